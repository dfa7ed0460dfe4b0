"""Byte ranges of remote pack objects fetched once for a batched get.

On an object store every fragment read is a request. A batch written by one put sits in one
pack object per target, its fragments side by side, so a batched get of it would otherwise
make k ranged GETs per entry where a few GETs per (target, pack) cover them. ``plan`` takes,
for the data fragments of a batch's records on targets that are not local directories, each
run of two or more of them in one pack whose gaps (other entries' parity fragments, say) are
at most ``GAP_MAX`` bytes: reading such a gap costs less than a request, while larger
fragments are read one by one, overlapping their decoding, as before. ``PackRanges`` holds
what was fetched for the duration of the batch, and ``copy_into`` serves a fragment read from
it.

Why serving from it is safe: a record's fragment bytes in a pack never change while the record
exists, and a generation is never reused (``kvstore.embedded.segments``, "Why appends are
safe"), so a range fetched moments before is what a read would have fetched. Every fragment
served is verified as any read one (``FragmentReader.read_fragment``); one that fails is read
again from its target, not from here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterable

from kvstore.embedded.index import STANDALONE, Meta
from kvstore.embedded.targets import LocalTarget, Target, pack_path

GAP_MAX = 64 * 1024  # bytes between two wanted fragments that one read takes along rather than split


@dataclass(frozen=True, slots=True)
class Span:
    """One GET's worth: bytes ``[start, end)`` of pack ``rel`` on target ``target``."""

    target: str
    rel: str
    start: int
    end: int


def plan(records: Iterable[tuple[bytes, Meta]], targets: dict[str, Target]) -> list[Span]:
    """The spans worth fetching whole for a batched get of ``records`` (module docstring)."""
    wanted: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for _ek, m in records:
        if not m.offsets:
            continue
        for i in range(m.k):
            name, off = m.targets[i], m.offsets[i]
            t = targets.get(name)
            if off == STANDALONE or t is None or type(t) is LocalTarget:
                continue
            wanted.setdefault((name, pack_path(m.gen)), []).append((off, off + m.frag_len))
    out = []
    for (name, rel), ranges in wanted.items():
        ranges.sort()
        run = [ranges[0]]
        for r in ranges[1:] + [(None, None)]:
            if r[0] is not None and r[0] - run[-1][1] <= GAP_MAX:
                run.append(r)
                continue
            if len(run) >= 2:
                out.append(Span(name, rel, run[0][0], max(b for _a, b in run)))
            run = [r]
    return out


class PackRanges:
    """The spans fetched for the batched gets in flight, by (target, pack); thread-safe. A span
    is added by the get that fetched it and removed by it when it ends (``remove``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str], list[tuple[int, bytes]]] = {}

    def add(self, span: Span, data: bytes) -> None:
        with self._lock:
            self._held.setdefault((span.target, span.rel), []).append((span.start, data))

    def remove(self, span: Span, data: bytes) -> None:
        with self._lock:
            held = self._held.get((span.target, span.rel), [])
            for j, (start, got) in enumerate(held):
                if start == span.start and got is data:
                    del held[j]
                    break
            if not held:
                self._held.pop((span.target, span.rel), None)

    def copy_into(self, target: str, rel: str, offset: int, buf: memoryview) -> bool:
        """Fill ``buf`` with bytes ``[offset, offset + len(buf))`` of the pack from a held span;
        False when no span holds them all."""
        if not self._held:
            return False
        with self._lock:
            for start, data in self._held.get((target, rel), ()):
                if start <= offset and offset + len(buf) <= start + len(data):
                    buf[:] = data[offset - start: offset - start + len(buf)]
                    return True
        return False
