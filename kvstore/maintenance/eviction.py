"""Capacity eviction of an embedded store: lost entries first, then least recently used, never
pinned ones, down to a goal.

Called by ``EmbeddedStore.evict_to`` (and GC step 3, ``kvstore.maintenance.gc``), and after a
put's index commit above the high watermark (``evict_after_put``). Works on the store's parts
(``kvstore.embedded.parts.StoreParts``): its index, its batched access times (written first,
so LRU decisions see recent reads) and its counters. A dry run plans instead
(``kvstore.maintenance.gc_plan.plan_eviction``).
"""

from __future__ import annotations

import logging
from typing import Sequence

from kvstore.embedded.parts import StoreParts
from kvstore.errors import CapacityExceeded
from kvstore.maintenance.gc_plan import plan_eviction

log = logging.getLogger(__name__)


def evict_after_put(parts: StoreParts, put: Sequence[bytes]) -> int:
    """After a put (``EmbeddedStore._index_new``): above the high watermark, evict down to the
    low one; the put's entries (``put``, in its order) stay while they fit under the capacity
    (``evict``). One pass at a time per process (``parts.evict_lock``); a put that finds one
    running skips its own. Returns the count."""
    cap = parts.config.capacity_bytes
    if not cap or parts.used_bytes() <= cap * parts.config.high_watermark:
        return 0
    if not parts.evict_lock.acquire(blocking=False):
        return 0  # another thread of this process is evicting
    try:
        return evict(parts, int(cap * parts.config.low_watermark), keep=put, keep_within=cap)
    finally:
        parts.evict_lock.release()


def evict(parts: StoreParts, goal_bytes: int, *, dry_run: bool = False,
          keep: Sequence[bytes] = (), keep_within: int = 0) -> int:
    """Evict until at most ``goal_bytes`` are used: first unpinned lost entries (no read
    can use them until a repair; oldest access first), then least-recently-used unpinned
    entries; returns the count. ``CapacityExceeded`` when only pinned entries are left
    (what was evicted before is counted all the same). ``dry_run``: the count it would
    evict (``gc_plan.plan_eviction``), nothing changed.

    ``keep`` (entry keys, in the order of the put that triggered this pass: all of its
    entries, new or already stored) are taken last, and only while more than ``keep_within``
    bytes (the capacity) would stay used with them: otherwise the pass stops above
    ``goal_bytes``, and a put that fits under the capacity is never acknowledged and then
    evicted by its own pass (with pinned entries just under the low watermark, every put
    would be). When they do not fit, they go from the put's last entry back (a chain keeps its
    prefix) until the rest fit, and the pass raises ``CapacityExceeded`` saying how many it
    evicted. This covers the triggering put only: another thread's or process's put may see
    its entries evicted as plain LRU (``evict_after_put`` runs one pass at a
    time per process and skips, rather than waits, while one runs)."""
    if dry_run:
        return plan_eviction(parts, parts.used_bytes(), goal_bytes, ())[0]
    parts.access.flush()
    evicted = 0
    now = parts.now_ns()
    try:
        with parts.index.env.begin(write=True) as txn:
            used = parts.index.counter(txn, "used_bytes")
            for ek, m in sorted(parts.index.lost_records(txn), key=lambda r: r[1].access_ns):
                if used <= goal_bytes:
                    break
                if not m.pinned:
                    parts.index.drop_lost_txn(txn, ek, m, now, to_grave=True)
                    used -= m.stored_bytes
                    evicted += 1
        own = list(dict.fromkeys(keep))  # the put's entries, in its order
        protected, dropped = frozenset(own), 0
        while True:
            with parts.index.env.begin(write=True) as txn:
                used = parts.index.counter(txn, "used_bytes")
                if used <= goal_bytes:
                    break
                batch = [(t, ek) for t, ek in parts.index.oldest(txn, "lru", limit=256 + len(own))
                         if ek not in protected]
                if not batch and own:  # only pinned entries and the put's own are left
                    for ek in reversed(own):  # those that do not fit go, the put's last first
                        m = parts.index.get_meta(txn, ek)
                        if used <= keep_within:
                            break
                        if m is not None and not m.pinned:
                            parts.index.remove_txn(txn, ek, m, now)
                            used -= m.stored_bytes
                            evicted += 1
                            dropped += 1
                    if used <= keep_within:
                        break
                    batch = []  # the put's own all gone, the pinned ones alone are over the capacity
                if not batch:
                    raise CapacityExceeded(
                        f"store holds {used} bytes over the goal {goal_bytes} and everything left "
                        "is pinned; unpin entries or raise capacity_bytes"
                    )
                for _t, ek in batch:
                    m = parts.index.get_meta(txn, ek)
                    if m is None:
                        continue
                    parts.index.remove_txn(txn, ek, m, now)
                    used -= m.stored_bytes
                    evicted += 1
                    if used <= goal_bytes:
                        break
        if dropped:
            raise CapacityExceeded(
                f"{dropped} of the {len(own)} entries just put did not fit under capacity_bytes ({keep_within} "
                f"bytes) and were evicted again, the put's last ones (the first {len(own) - dropped} were kept): "
                "everything left is pinned; unpin entries or raise capacity_bytes")
    finally:
        parts.counters.add("evicted", evicted)
        if evicted:
            log.info("evicted %d entries to get under %d bytes", evicted, goal_bytes)
    return evicted
