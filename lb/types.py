"""Snapshot records and errors shared by every load balancer in ``lb/``.

Role
    The entrypoint (or the trace simulator, ``lb.sim``) builds these records
    from its view of the fleet and hands them to a policy; the policy returns
    a :class:`Decision`. Nothing here does I/O and no snapshot is mutated:
    every record is a frozen, slotted dataclass, so a policy may keep
    references to a snapshot without it changing under it. The one mutable
    class, :class:`QueueLoad`, belongs to whoever owns a queue (``lb.sim``):
    it keeps running sums per prefill instance and hands each snapshot an
    immutable :class:`QueueTotals`.

Who fills what
    * :class:`PrefillInstance` / :class:`DecodeInstance` / :class:`VEInstance`
      describe one engine each (load, memory, health, link bandwidths).
    * :class:`QueueTotals` (optional, on a :class:`PrefillInstance`) sums its
      waiting requests, so that ``least_loaded`` and ``dynamo`` need not walk
      a queue that grows with the load; :class:`QueueLoad` keeps them, O(1)
      per enqueue / start.
    * :class:`RouteRequest` describes one request, including what each
      prefill instance already holds of its prefix (``hits``: per instance
      id, a :class:`PrefixHits`). Cache state is per request *and* per
      instance, so it lives on the request, keyed by instance id.

Invariants (checked in ``__post_init__``; misuse raises :class:`LBInputError`)
    1. Counts, sizes and times are finite, non-negative real numbers; a
       capacity or bandwidth is positive. NaN is refused explicitly: every
       comparison with NaN is false, so a NaN load would otherwise pass a
       ``< 0`` check and then win every ``min`` it takes part in.
       Token, block and byte counts are integers (``RouteRequest``, ``DecodeInstance``).
    2. ``PrefixHits.total <= RouteRequest.num_blocks``: a prefix hit can not
       be longer than the prompt.
    3. Instance ids are unique within one snapshot (checked by the policies,
       see :func:`check_unique_ids`), because decisions name instances by id.

Failure kinds (STYLE.md habit 3)
    * an expected shortfall (no instance can meet the SLO) is a *value*:
      ``Decision(chosen=None, reason=...)``;
    * caller misuse raises :class:`LBInputError` (a ``ValueError``) with a
      message that says what to fix;
    * broken internal state raises :class:`LBInternalError` and says it is
      a bug.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Callable, Hashable, Iterable, Mapping, Sequence

__all__ = [
    "BLOCK_TOKENS", "LBError", "LBInputError", "LBInternalError", "UnknownPolicyError", "TierBandwidth",
    "PrefixHits", "QueuedPrefill", "QueueTotals", "QueueLoad", "PrefillInstance", "DecodeInstance",
    "VEInstance", "RouteRequest", "DecodeRequest", "VERequest", "Decision", "check_unique_ids",
]

#: Tokens per prefix block in the Mooncake trace format (and the default here).
BLOCK_TOKENS = 512


class LBError(Exception):
    """Base class of every error raised by ``lb/``."""


class LBInputError(LBError, ValueError):
    """Caller misuse: a snapshot or argument is invalid. The message says what to fix."""


class UnknownPolicyError(LBInputError, KeyError):
    """A policy name that is not in the registry; the message lists the known names."""

    def __str__(self) -> str:  # KeyError would repr() the message otherwise
        return str(self.args[0]) if self.args else ""


class LBInternalError(LBError, RuntimeError):
    """Broken internal state inside ``lb/``: this is a bug, please report it."""


def _finite(owner: str, name: str, value: object) -> float:
    """``value`` if it is a finite real number (not a bool), else :class:`LBInputError`."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise LBInputError(f"{owner}.{name} must be a finite number, got {value!r}")
    return value


def _nonneg(owner: str, **values: float) -> None:
    """Each value must be a finite real number >= 0 (NaN and inf are refused, not let through)."""
    for name, value in values.items():
        if _finite(owner, name, value) < 0:
            raise LBInputError(f"{owner}.{name} must be >= 0, got {value!r}")


def _positive(owner: str, **values: float) -> None:
    """Each value must be a finite real number > 0."""
    for name, value in values.items():
        if _finite(owner, name, value) <= 0:
            raise LBInputError(f"{owner}.{name} must be > 0, got {value!r}")


def _optional_slo(owner: str, **values: float | None) -> None:
    """An SLO is ``None`` or ``inf`` (no SLO) or a number of milliseconds >= 0; NaN is refused
    (``ttft > nan`` is always false, so a NaN SLO would silently mean "no SLO")."""
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, Real) or math.isnan(value) or value < 0:
            raise LBInputError(f"{owner}.{name} must be None or a number of ms >= 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class TierBandwidth:
    """Link from each cache tier into an instance's device memory.

    ``host_*``: pinned host DRAM -> device; ``store_*``: the shared KV store
    (SSD / distributed FS) -> device. Bandwidth in bytes per second, latency
    in seconds per transfer (one per tier per request, not per block).
    """

    host_bytes_per_s: float = 10.0e9
    store_bytes_per_s: float = 1.18 * 2**30
    host_latency_s: float = 50e-6
    store_latency_s: float = 1e-3

    def __post_init__(self) -> None:
        _positive("TierBandwidth", host_bytes_per_s=self.host_bytes_per_s,
                  store_bytes_per_s=self.store_bytes_per_s)
        _nonneg("TierBandwidth", host_latency_s=self.host_latency_s,
                store_latency_s=self.store_latency_s)


@dataclass(frozen=True, slots=True)
class PrefixHits:
    """What one instance can reuse of one request's prefix, by best tier.

    The *usable* prefix is the longest run of blocks from block 0 that is
    present in at least one tier; each block of it is counted once, in the
    fastest tier that holds it (device < host < store). So
    ``device + host + store`` is the usable prefix length in blocks.
    """

    device: int = 0
    host: int = 0
    store: int = 0

    def __post_init__(self) -> None:
        _nonneg("PrefixHits", device=self.device, host=self.host, store=self.store)

    @property
    def total(self) -> int:
        return self.device + self.host + self.store

    @classmethod
    def from_tiers(
        cls,
        block_hashes: Iterable[Hashable],
        device: Callable[[Hashable], bool],
        host: Callable[[Hashable], bool] = lambda _h: False,
        store: Callable[[Hashable], bool] = lambda _h: False,
    ) -> "PrefixHits":
        """Walk the prefix; stop at the first block held by no tier.

        ``device``/``host``/``store`` are membership tests (e.g. ``set.__contains__``);
        they must be side-effect free (no LRU touch): this is a lookup only.
        """
        d = h = s = 0
        for bh in block_hashes:
            if device(bh):
                d += 1
            elif host(bh):
                h += 1
            elif store(bh):
                s += 1
            else:
                break
        return cls(d, h, s)


@dataclass(frozen=True, slots=True)
class QueuedPrefill:
    """One request waiting in (or running on) a prefill instance.

    ``suffix_tokens`` will be computed on top of ``cached_tokens`` of context;
    ``fetch_s`` is its estimated load time of cached KV from host/store.
    ``remaining_fraction`` < 1 marks the running request (part already done).
    ``deadline_s`` (optional) is when its TTFT SLO runs out, on the clock of
    :attr:`RouteRequest.now_s`: a policy that schedules within an instance
    (``pick_next``, see ``lb.prefill``) orders the waiting requests by it.
    """

    suffix_tokens: int
    cached_tokens: int = 0
    fetch_s: float = 0.0
    remaining_fraction: float = 1.0
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        _nonneg("QueuedPrefill", suffix_tokens=self.suffix_tokens,
                cached_tokens=self.cached_tokens, fetch_s=self.fetch_s)
        if self.deadline_s is not None:
            _finite("QueuedPrefill", "deadline_s", self.deadline_s)
        if not 0.0 <= _finite("QueuedPrefill", "remaining_fraction", self.remaining_fraction) <= 1.0:
            raise LBInputError("QueuedPrefill.remaining_fraction must be in [0, 1]")


def _ceil_blocks(q: QueuedPrefill, block_tokens: int) -> int:
    """KV blocks of ``q``'s whole context (cached + suffix), the last one possibly partial."""
    return (q.suffix_tokens + q.cached_tokens + block_tokens - 1) // block_tokens


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _integers(owner: str, low: int, **values: object) -> None:
    """Each value must be an integer (``int`` or numpy's, not a bool) >= ``low``: a count of blocks or tokens."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, Integral) or value < low:
            raise LBInputError(f"{owner}.{name} must be an integer >= {low}, got {value!r}")


def _image_hash_ok(h: object) -> bool:
    """An image hash: a non-empty ``str`` or ``bytes``, or an ``int`` (not a bool)."""
    return (isinstance(h, (str, bytes)) and len(h) > 0) or _is_int(h)


def _sequence(owner: str, name: str, value: object, what: str) -> tuple:
    """``value`` (a tuple or list) as a tuple; anything else (a ``str``: its characters) is refused."""
    if not isinstance(value, (tuple, list)):
        raise LBInputError(f"{owner}.{name} must be a tuple or list of {what}, got {type(value).__name__} "
                           f"{value!r}; wrap a single one: (h,)")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class QueueTotals:
    """Sums over the *waiting* entries of one :class:`PrefillInstance` queue, taken at snapshot time.

    A snapshot that carries them lets ``least_loaded`` and ``dynamo`` decide in O(1) per
    instance instead of walking a queue that grows with the overload (the walk made an
    overloaded replay quadratic). Built by :meth:`QueueLoad.totals`; immutable, so a snapshot
    keeps showing the sums of the moment it was taken.

    Invariants, for the instance ``inst`` that carries them (the waiting entries are the *last*
    ``requests`` of ``inst.queue``: the running request, if any, comes first and is walked)::

        waiting       = inst.queue[len(inst.queue) - requests:]
        suffix_tokens = sum(q.suffix_tokens for q in waiting)                      # exact int
        blocks        = sum(ceil((q.suffix_tokens + q.cached_tokens) / block_tokens)
                            for q in waiting)                                      # exact int
        every q in waiting: remaining_fraction == 1.0, integer token counts

    Integers, not floats, on purpose: a float running sum would depend on the order of its
    additions and subtractions, so a total kept across events could differ in its last bit
    from the walk the policies used to do, and flip a tie; integer sums are exact in any order.
    """

    requests: int = 0
    suffix_tokens: int = 0
    blocks: int = 0
    block_tokens: int = BLOCK_TOKENS


@dataclass(slots=True)
class QueueLoad:
    """The running :class:`QueueTotals` of one prefill instance's waiting requests.

    Kept by whoever owns the instance's queue (``lb.sim``'s ``_Prefill``), which calls, per
    request ``q`` (its :class:`QueuedPrefill` as shown in the snapshot's queue):

    1. :meth:`enqueue` when ``q`` joins the queue (it is waiting from now on);
    2. :meth:`dequeue` when ``q`` stops being a waiting entry: in the simulator when it
       *starts* (it becomes the running head of the queue, shown with its remaining
       fraction and walked, so it must leave the sums); an owner whose snapshot shows
       running requests in full, as waiting entries, calls it when they *finish* instead.

    A finish in the simulator changes nothing here: the request left the sums when it
    started. The fields satisfy the :class:`QueueTotals` invariants over the requests
    enqueued and not yet dequeued; each update is O(1). A dequeue that would drive a sum
    below zero means the owner dequeued something it never enqueued: a bug, raised as
    :class:`LBInternalError`.
    """

    block_tokens: int = BLOCK_TOKENS
    requests: int = 0
    suffix_tokens: int = 0
    blocks: int = 0
    _snap: QueueTotals | None = field(default=None, init=False, repr=False, compare=False)  # last totals()

    def __post_init__(self) -> None:
        if not _is_int(self.block_tokens) or self.block_tokens < 1:
            raise LBInputError(f"QueueLoad.block_tokens must be an integer >= 1, got {self.block_tokens!r}")

    def enqueue(self, q: QueuedPrefill) -> None:
        """``q`` joined the queue: add it to the sums."""
        if not (_is_int(q.suffix_tokens) and _is_int(q.cached_tokens)) or q.remaining_fraction != 1.0:
            raise LBInputError(f"QueueLoad.enqueue: a waiting request has integer token counts and "
                               f"remaining_fraction 1.0, got {q!r}")
        self.requests += 1
        self.suffix_tokens += q.suffix_tokens
        self.blocks += _ceil_blocks(q, self.block_tokens)
        self._snap = None

    def dequeue(self, q: QueuedPrefill) -> None:
        """``q`` (enqueued earlier) is no longer a waiting entry: take it out of the sums."""
        self.requests -= 1
        self.suffix_tokens -= q.suffix_tokens
        self.blocks -= _ceil_blocks(q, self.block_tokens)
        self._snap = None
        if self.requests < 0 or self.suffix_tokens < 0 or self.blocks < 0:
            raise LBInternalError(f"QueueLoad went negative ({self!r}) after dequeuing {q!r}: a request was "
                                  "dequeued that was never enqueued; this is a bug, please report it")

    def totals(self) -> QueueTotals:
        """The sums now, as an immutable record for a snapshot (O(1); shared until the next update)."""
        if self._snap is None:
            self._snap = QueueTotals(self.requests, self.suffix_tokens, self.blocks, self.block_tokens)
        return self._snap


#: Sums of integers in floats stay exact below 2**53; the fast pending_tokens keeps below this, see there.
_EXACT_INT = 2**52


def _walk_tokens(entries: Iterable[QueuedPrefill]) -> float:
    """``sum(q.suffix_tokens * q.remaining_fraction)`` as one float addition after another, in order.

    Written out rather than ``sum()`` because CPython 3.12's ``sum`` compensates float
    rounding: the bit-exact argument of :attr:`PrefillInstance.pending_tokens` needs plain
    sequential additions (which is what ``sum`` does on 3.11, the walk the policies used to do).
    """
    total = 0
    for q in entries:
        total += q.suffix_tokens * q.remaining_fraction
    return total


@dataclass(frozen=True, slots=True)
class PrefillInstance:
    """Snapshot of one prefill engine.

    ``queue`` holds the running request first (if any) then the waiting
    ones, FIFO. ``inflight_blocks`` are block hashes that queued/running
    requests will have written to this instance's device cache by the time
    a newly queued request starts: a policy that knows it can count them as
    device hits (the cache "warms" behind the queue).

    ``totals`` (optional) are the sums over the waiting entries of ``queue``
    (the :class:`QueueTotals` invariants say exactly which): with them,
    :attr:`pending_tokens` and :meth:`queued_blocks` are O(1) (they walk only
    the entries before the waiting ones, the running request); without them
    (a snapshot built from a plain tuple), they walk the queue. Both ways give
    the same numbers, bit for bit.
    """

    id: Hashable
    queue: tuple[QueuedPrefill, ...] = ()
    bandwidth: TierBandwidth = field(default_factory=TierBandwidth)
    healthy: bool = True
    inflight_blocks: frozenset = frozenset()
    device_blocks_used: int = 0
    totals: QueueTotals | None = None

    def __post_init__(self) -> None:
        if self.totals is not None and not 0 <= self.totals.requests <= len(self.queue):
            raise LBInputError(f"PrefillInstance {self.id!r}: totals cover {self.totals.requests} waiting "
                               f"requests but the queue holds {len(self.queue)}; build them with QueueLoad")

    def _head(self) -> list[QueuedPrefill]:
        """The entries before the waiting ones that ``totals`` sum (the running request): O(their number)."""
        return [self.queue[i] for i in range(len(self.queue) - self.totals.requests)]

    @property
    def pending_tokens(self) -> int:
        """Tokens still to compute on this instance (queued + rest of running).

        Defined as the walk ``int(total)`` where ``total`` adds ``q.suffix_tokens *
        q.remaining_fraction`` over the queue in order, one float addition at a time
        (:func:`_walk_tokens`). With ``totals`` the result is the same without the walk:
        the head's partial sum ``x`` is walked, then the waiting entries add the exact
        integer ``S = totals.suffix_tokens``. Adding an integer to ``x`` rounds only when
        the sum enters a higher binade, by at most half an ulp of it, so over the whole
        walk the sum drifts above ``x + S`` by less than one ulp of the result (a geometric
        sum) and never falls below an integer it has reached. Hence ``int(walk) ==
        floor(x) + S`` unless the fractional part of ``x`` lies within that drift of 1; in
        that (rare) case, and for sums near ``2**53``, it walks the queue.
        """
        t = self.totals
        if t is not None:
            x = _walk_tokens(self._head())
            if not t.requests:
                return int(x)
            m = math.floor(x)
            f = x - m  # exact (Sterbenz: m <= x < 2m when m >= 1; f == x when m == 0)
            bound = m + t.suffix_tokens + 2  # the walk stays below it, so its ulp is < bound * 2**-52
            if bound < _EXACT_INT and (1.0 - f) * _EXACT_INT > bound:
                return m + t.suffix_tokens
        return int(_walk_tokens(self.queue))

    def queued_blocks(self, block_tokens: int) -> int:
        """KV blocks of every request in the queue, running one included:
        ``sum(ceil((q.suffix_tokens + q.cached_tokens) / block_tokens) for q in queue)``.

        O(1) with ``totals`` kept for the same ``block_tokens``; a walk otherwise.
        """
        t = self.totals
        if t is not None and t.block_tokens == block_tokens:
            return sum(_ceil_blocks(q, block_tokens) for q in self._head()) + t.blocks
        return sum(_ceil_blocks(q, block_tokens) for q in self.queue)

    @property
    def queued_requests(self) -> int:
        return len(self.queue)


@dataclass(frozen=True, slots=True)
class DecodeInstance:
    """Snapshot of one decode engine: KV memory and batch pressure.

    ``kv_used_bytes`` and ``kv_capacity_bytes`` are whole bytes (integers); a request's share is
    ``lb.decode.request_kv_bytes`` (rounded up), the figure every decode policy checks, and whoever
    keeps ``kv_used_bytes`` adds exactly it, so usage never drifts from what a policy checked.
    """

    id: Hashable
    kv_used_bytes: int
    kv_capacity_bytes: int
    batch_tokens: int = 0
    running_requests: int = 0
    healthy: bool = True

    def __post_init__(self) -> None:
        _nonneg(f"DecodeInstance {self.id!r}", kv_used_bytes=self.kv_used_bytes,
                batch_tokens=self.batch_tokens, running_requests=self.running_requests)
        _positive(f"DecodeInstance {self.id!r}", kv_capacity_bytes=self.kv_capacity_bytes)
        _integers(f"DecodeInstance {self.id!r}", 0, kv_used_bytes=self.kv_used_bytes,  # whole bytes: see above
                  kv_capacity_bytes=self.kv_capacity_bytes)


@dataclass(frozen=True, slots=True)
class VEInstance:
    """Snapshot of one vision-encoder engine.

    ``queue_images`` images are waiting to be encoded; ``cached_images`` are
    image hashes whose encoder output this instance still caches: a frozenset
    (a set, tuple or list is copied into one) of hashes as :class:`VERequest`
    takes them; a ``str`` container is refused (``in`` would test substrings).
    """

    id: Hashable
    queue_images: int = 0
    cached_images: frozenset = frozenset()
    healthy: bool = True

    def __post_init__(self) -> None:
        owner = f"VEInstance {self.id!r}"
        _nonneg(owner, queue_images=self.queue_images)
        cached = self.cached_images
        if not isinstance(cached, (frozenset, set, tuple, list)):
            raise LBInputError(f"{owner}.cached_images must be a frozenset of image hashes, got "
                               f"{type(cached).__name__} {cached!r}")
        for h in cached:
            if not _image_hash_ok(h):
                raise LBInputError(f"{owner}.cached_images holds {h!r}; an image hash is a non-empty str or "
                                   f"bytes, or an int (as in VERequest.image_hashes)")
        if not isinstance(cached, frozenset):
            object.__setattr__(self, "cached_images", frozenset(cached))


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request to route to a prefill instance.

    ``hits[instance_id]`` is what that instance can reuse (missing key = no
    hit). ``block_hashes`` (optional) lets policies compare the prefix with
    ``PrefillInstance.inflight_blocks``. SLOs are in milliseconds; ``None``
    means no SLO (admission control then never rejects). ``now_s``
    (optional) is the owner's clock at the decision, the clock of
    :attr:`QueuedPrefill.deadline_s`; ``None``: deadlines are not known.

    Checked: token and block counts are integers, ``num_blocks <=
    ceil(prompt_tokens / block_tokens)``; ``block_hashes`` is a tuple (a list
    is copied) of hashables, empty (unknown) or one per block. A cost-based
    policy also needs ``block_tokens == TransferModel.block_tokens``.
    """

    prompt_tokens: int
    num_blocks: int
    hits: Mapping[Hashable, PrefixHits] = field(default_factory=dict)
    block_hashes: tuple = ()
    image_hashes: tuple = ()
    ttft_slo_ms: float | None = None
    tbt_slo_ms: float | None = None
    block_tokens: int = BLOCK_TOKENS
    now_s: float | None = None

    def __post_init__(self) -> None:
        _nonneg("RouteRequest", prompt_tokens=self.prompt_tokens, num_blocks=self.num_blocks)
        if self.now_s is not None:
            _finite("RouteRequest", "now_s", self.now_s)
        _positive("RouteRequest", block_tokens=self.block_tokens)
        _integers("RouteRequest", 0, prompt_tokens=self.prompt_tokens, num_blocks=self.num_blocks)
        _integers("RouteRequest", 1, block_tokens=self.block_tokens)
        most = -(-self.prompt_tokens // self.block_tokens)
        if self.num_blocks > most:
            raise LBInputError(f"RouteRequest.num_blocks is {self.num_blocks} but {self.prompt_tokens} prompt tokens "
                               f"fill at most {most} blocks of {self.block_tokens}; pass the count of blocks, "
                               f"not of tokens")
        hashes = _sequence("RouteRequest", "block_hashes", self.block_hashes, "block hashes")
        if hashes and len(hashes) != self.num_blocks:
            raise LBInputError(f"RouteRequest.block_hashes lists {len(hashes)} hashes for {self.num_blocks} blocks; "
                               f"give one per block (the prefix, in order) or none")
        for i, h in enumerate(hashes):
            try:
                hash(h)
            except TypeError as exc:
                raise LBInputError(f"RouteRequest.block_hashes[{i}] is not hashable: {h!r}") from exc
        object.__setattr__(self, "block_hashes", hashes)
        _optional_slo("RouteRequest", ttft_slo_ms=self.ttft_slo_ms, tbt_slo_ms=self.tbt_slo_ms)
        for iid, h in self.hits.items():
            if h.total > self.num_blocks:
                raise LBInputError(
                    f"RouteRequest.hits[{iid!r}] covers {h.total} blocks but the request "
                    f"has only {self.num_blocks}; recompute the hits for this prompt"
                )

    def hit_of(self, instance_id: Hashable) -> PrefixHits:
        return self.hits.get(instance_id, _NO_HIT)

    def cached_tokens(self, blocks: int) -> int:
        """Prompt tokens that ``blocks`` cached prefix blocks let the engine skip.

        At most ``prompt_tokens - 1``: the last prompt token is always computed
        (its logits give the first output token), as in vLLM's scheduler.
        """
        return max(0, min(self.prompt_tokens - 1, blocks * self.block_tokens))


_NO_HIT = PrefixHits()


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """One request to place on a decode instance (after its prefill)."""

    context_tokens: int
    max_new_tokens: int
    tbt_slo_ms: float | None = None

    def __post_init__(self) -> None:
        _nonneg("DecodeRequest", context_tokens=self.context_tokens,
                max_new_tokens=self.max_new_tokens)
        _optional_slo("DecodeRequest", tbt_slo_ms=self.tbt_slo_ms)


@dataclass(frozen=True, slots=True)
class VERequest:
    """Images of one request to encode (hashes of the image bytes).

    ``image_hashes`` is a tuple (a list is copied into one) of hashes, each a
    non-empty ``str`` or ``bytes`` or an ``int``; repeats are allowed (the
    policies count an image once). A ``str`` or ``bytes`` as the container is
    refused: ``VERequest("abc")`` would otherwise be the three images 'a',
    'b', 'c'.
    """

    image_hashes: tuple

    def __post_init__(self) -> None:
        hashes = _sequence("VERequest", "image_hashes", self.image_hashes, "image hashes")
        for i, h in enumerate(hashes):
            if not _image_hash_ok(h):
                raise LBInputError(f"VERequest.image_hashes[{i}] must be a non-empty str or bytes, or an int; "
                                   f"got {h!r}")
        object.__setattr__(self, "image_hashes", hashes)


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer of a policy.

    ``chosen`` is an instance id, or ``None`` when the request is rejected
    (admission control); ``reason`` is always a human-readable sentence.
    ``estimates`` maps instance id -> the policy's score for it (seconds of
    estimated TTFT/TBT for cost-based policies, a policy-specific score for
    the others; lower is better).
    """

    chosen: Hashable | None
    reason: str
    estimates: Mapping[Hashable, float] = field(default_factory=dict)

    @property
    def rejected(self) -> bool:
        return self.chosen is None


def check_unique_ids(instances: Sequence) -> None:
    """Raise :class:`LBInputError` if two instances share an id."""
    seen = set()
    for inst in instances:
        if inst.id in seen:
            raise LBInputError(f"duplicate instance id {inst.id!r} in the snapshot; ids must be unique")
        seen.add(inst.id)
