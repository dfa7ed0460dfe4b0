"""Immutable O(1) views over a simulated prefill instance's append-only job log (``lb.sim``).

Role
    ``lb.sim._Prefill`` builds a :class:`QueueView` (its ``PrefillInstance.queue``) and an
    :class:`InflightView` (its ``inflight_blocks``) for every snapshot it hands a policy.
    Both only read lists that the instance only ever appends to, so a view bounded by two
    positions taken at snapshot time shows the same content forever (``lb.sim._Prefill``
    invariant 1); they never copy the queue. An instance whose policy schedules its queue
    (``pick_next``) finishes jobs out of arrival order: its in-flight blocks are a
    :class:`FinishedInflightView` (the queue, no longer a slice of the log, is a tuple).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence, Set as AbstractSet
from itertools import chain

from lb.types import QueuedPrefill

__all__ = ["QueueView", "InflightView", "FinishedInflightView"]


class QueueView(Sequence):
    """``PrefillInstance.queue`` of a snapshot, built in O(1): the running request (``head``,
    if any) then ``items[lo:hi]``, the waiting requests' estimates, FIFO.

    Immutable although it shares ``items`` with the simulator: ``items`` is append-only
    (``lb.sim._Prefill`` invariant 1), so the slice ``[lo, hi)`` fixed at snapshot time never
    changes. Compares and hashes like the equivalent tuple.
    """

    __slots__ = ("_head", "_items", "_lo", "_hi")

    def __init__(self, head: QueuedPrefill | None, items: list, lo: int, hi: int) -> None:
        self._head, self._items, self._lo, self._hi = head, items, lo, hi

    def __len__(self) -> int:
        return (self._head is not None) + self._hi - self._lo

    def __iter__(self):
        rest = self._items[self._lo:self._hi]
        return iter(rest) if self._head is None else chain((self._head,), rest)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("queue index out of range")
        if self._head is not None:
            if i == 0:
                return self._head
            i -= 1
        return self._items[self._lo + i]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, QueueView)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


class _LazySet(AbstractSet):
    """A set view whose members (:meth:`_members`) are built once, on the first ``len``, iteration or
    hash; membership and truth are the subclass's own, without building the set."""

    __slots__ = ("_set",)

    def _members(self):
        raise NotImplementedError

    def _frozen(self) -> frozenset:
        if self._set is None:
            self._set = frozenset(self._members())
        return self._set

    def __len__(self) -> int:
        return len(self._frozen())

    def __iter__(self):
        return iter(self._frozen())

    def __hash__(self) -> int:
        return hash(self._frozen())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({set(self._frozen())!r})"


class InflightView(_LazySet):
    """``PrefillInstance.inflight_blocks`` of a snapshot, built in O(1): the cacheable blocks
    of the jobs at positions ``[lo, hi)`` of an instance's log (queued or running).

    ``b in view`` is a binary search in ``where[b]`` (ascending positions of the jobs holding
    ``b``); ``bool(view)`` is one subtraction of running block counts (``cum``). Iteration
    and ``len`` build the set once (O(blocks in flight)). Immutable for the same reason as
    :class:`QueueView`: every list it reads is append-only.
    """

    __slots__ = ("_where", "_blocks", "_cum", "_lo", "_hi")

    def __init__(self, where: dict, blocks: list, cum: list, lo: int, hi: int) -> None:
        self._where, self._blocks, self._cum, self._lo, self._hi = where, blocks, cum, lo, hi
        self._set: frozenset | None = None

    def __contains__(self, b: object) -> bool:
        pos = self._where.get(b)
        if not pos:
            return False
        i = bisect_left(pos, self._lo)
        return i < len(pos) and pos[i] < self._hi

    def __bool__(self) -> bool:
        return self._cum[self._hi] - self._cum[self._lo] > 0

    def _members(self):
        return chain.from_iterable(self._blocks[self._lo:self._hi])


class FinishedInflightView(_LazySet):
    """``PrefillInstance.inflight_blocks`` of a snapshot of an instance that may finish its jobs out of
    arrival order (a policy with ``pick_next`` schedules them): the cacheable blocks of the jobs at
    positions ``[lo, hi)`` that had not finished when the snapshot was taken.

    ``fin[p]`` is 0 while job ``p`` is in flight, then the instance's finish count after it finished
    (set once, never changed again); the snapshot keeps the finish count ``seen`` of its moment, so a
    job that finishes later (``fin[p] > seen``) still shows as in flight here: immutable, as
    :class:`InflightView`, although ``fin`` is written after the snapshot. ``b in view`` walks the
    positions holding ``b`` from ``lo`` (few: a block is shared by the turns of one prefix);
    ``bool(view)`` is fixed at snapshot time; iteration and ``len`` build the set once.
    """

    __slots__ = ("_where", "_blocks", "_fin", "_lo", "_hi", "_seen", "_any")

    def __init__(self, where: dict, blocks: list, fin: list, lo: int, hi: int, seen: int, any_: bool) -> None:
        self._where, self._blocks, self._fin, self._lo, self._hi = where, blocks, fin, lo, hi
        self._seen, self._any = seen, any_
        self._set: frozenset | None = None

    def _live(self, p: int) -> bool:
        f = self._fin[p]
        return f == 0 or f > self._seen

    def __contains__(self, b: object) -> bool:
        pos = self._where.get(b)
        if not pos:
            return False
        for i in range(bisect_left(pos, self._lo), len(pos)):
            p = pos[i]
            if p >= self._hi:
                return False
            if self._live(p):
                return True
        return False

    def __bool__(self) -> bool:
        return self._any

    def _members(self):
        return chain.from_iterable(self._blocks[p] for p in range(self._lo, self._hi) if self._live(p))
