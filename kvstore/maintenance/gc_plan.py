"""Read-only planning for a GC pass: what steps 2-5 of ``kvstore.maintenance.gc.run_gc`` would do.

Used by ``run_gc`` and by a dry-run eviction (``kvstore.maintenance.eviction.evict``). A dry run (``run_gc(dry_run=True)``) is built entirely from
these functions; the real pass uses ``expired_lost``, ``grave_key`` and ``due_graves``
too, so both read the same records. Every function here opens read transactions only and
changes nothing, not even the batched access times (``pending_touches`` copies them).

What each plan mirrors, in the order the real pass runs:
  2. ``plan_expiry``      -> ``maintenance._remove_expired``: the ``ttl`` ordering up to
                             ``now`` and the expired lost records.
  3. ``plan_eviction``    -> ``EmbeddedStore.evict_to``: unpinned lost records first, then
                             the ``lru`` ordering as step 1 will leave it, without step 2's
                             entries.
  4. ``plan_purge``       -> ``maintenance._purge_grave``: the bytes freed by purging the
                             graveyard records older than ``delete_grace_s`` (``due_graves``).
  5. ``plan_compaction``  -> ``maintenance._compact_packs``: the ``compact`` queue as step 4
                             will leave it (``kvstore.embedded.index`` invariant 6: purging a packed
                             record adds its pack bytes to the pack's dead bytes, which can
                             queue the pack; purging the last record of a pack removes the
                             pack, and its place in the queue), and the live entries each
                             queued pack holds once steps 2 and 3 have removed theirs.

Step 4 of the real pass also purges what steps 2 and 3 removed when they are due at once:
each removal is stamped with the time it ran (step 2: the pass's ``now``; step 3: the clock
when it evicts), and step 4 takes the records stamped at or before ``now - delete_grace_s``.
``removed_graves`` gives the plan those records, so with ``delete_grace_s = 0`` the dry run
counts the expired entries as purged too, as the real pass will.
"""

from __future__ import annotations

import heapq
from collections import Counter
from typing import Collection, Sequence

from kvstore.errors import CapacityExceeded
from kvstore.embedded.index import STANDALONE, Meta, packed_bytes
from kvstore.embedded.targets import fragment_path

from kvstore.embedded.parts import StoreParts

# One graveyard record due for purging: (deleted_ns, ek || gen, its Meta).
DueGrave = tuple[int, bytes, Meta]


def grave_key(t: int, rest: bytes) -> bytes:
    """The ``grave`` key of a record deleted at ``t`` ns, ``rest`` being ``ek || gen``."""
    return t.to_bytes(8, "big") + rest


def expired_lost(parts: StoreParts, txn, now: int) -> list[tuple[bytes, Meta]]:
    """The lost records whose TTL passed by ``now`` (lost records have no ``ttl`` ordering
    entry; they are few, so step 2 reads them all)."""
    return [(ek, m) for ek, m in parts.index.lost_records(txn) if m.expired(now)]


def count_expired(parts: StoreParts, now: int) -> int:
    """How many entries step 2 will remove at ``now`` (its progress total): one read
    transaction walking the ``ttl`` keys up to ``now`` (keys only, no record read)."""
    with parts.index.env.begin() as txn:
        return len(expired_lost(parts, txn, now)) + sum(1 for _ in parts.index.oldest(txn, "ttl", before_ns=now + 1))


def plan_expiry(parts: StoreParts, now: int) -> dict[bytes, int]:
    """Dry run of step 2: entry key -> stored bytes of every entry ``_remove_expired(now)``
    would remove. One read transaction over the ``ttl`` ordering up to ``now``; changes nothing.
    (Deleting nothing, it cannot page in batches as the real pass does: it walks once.)"""
    out: dict[bytes, int] = {}
    with parts.index.env.begin() as txn:
        out.update((ek, m.stored_bytes) for ek, m in expired_lost(parts, txn, now))
        for _t, ek in parts.index.oldest(txn, "ttl", before_ns=now + 1):
            m = parts.index.get_meta(txn, ek)
            if m is not None:
                out[bytes(ek)] = m.stored_bytes
    return out


def pending_touches(parts: StoreParts) -> dict[bytes, int]:
    """A copy of the access times the store batches in memory (step 1 writes them). Read
    under the store's own lock, not flushed: a dry run writes nothing, yet must order the
    LRU walk as the real pass will."""
    return parts.access.pending()


def plan_eviction(parts: StoreParts, used: int, goal: int,
                  gone: Collection[bytes]) -> tuple[int, int, set[bytes]]:
    """Dry run of step 3: (entries, stored bytes, their entry keys) that
    ``EmbeddedStore.evict_to(goal)`` would evict when ``used`` bytes are stored and the
    entries in ``gone`` were removed first (step 2).

    Mirrors ``evict_to`` without deleting: takes the unpinned lost entries first, then walks
    the ``lru`` ordering oldest first, as it will
    stand once step 1 has written the pending access times (an entry read since the last flush
    moves to its new time), skipping pinned entries (they are not in the ordering) and ``gone``,
    until ``used`` would be at most ``goal``. Raises ``CapacityExceeded``, as the real pass
    would, when the ordering runs out first. One read transaction; bounded by the ordering.
    """
    pending = pending_touches(parts)
    n = nbytes = 0
    taken: set[bytes] = set()
    with parts.index.env.begin() as txn:
        for _a, ek, m in sorted((m.access_ns, ek, m) for ek, m in parts.index.lost_records(txn)
                                if not m.pinned and ek not in gone):  # lost entries go first
            if used - nbytes <= goal:
                return n, nbytes, taken
            n += 1
            nbytes += m.stored_bytes
            taken.add(ek)
        moved: list[tuple[int, bytes]] = []  # (new access time, ek): where step 1 will put them
        for ek, ts in pending.items():
            m = parts.index.get_meta(txn, ek)
            if m is not None and not m.pinned and ts > m.access_ns:  # Index.touch_txn's rule
                moved.append((ts, bytes(ek)))
        moved.sort()
        moved_keys = {ek for _, ek in moved}
        stored = ((t, bytes(ek)) for t, ek in parts.index.oldest(txn, "lru"))
        # Both streams are sorted by (time, ek), the ``lru`` ordering's own key order.
        order = heapq.merge((x for x in stored if x[1] not in moved_keys), moved)
        for _t, ek in order:
            if used - nbytes <= goal:
                return n, nbytes, taken
            if ek in gone:
                continue
            m = parts.index.get_meta(txn, ek)
            if m is None:
                continue
            n += 1
            nbytes += m.stored_bytes
            taken.add(ek)
    if used - nbytes <= goal:
        return n, nbytes, taken
    raise CapacityExceeded(
        f"gc would fail: after evicting {n} entries the store would hold {used - nbytes} bytes, over the "
        f"goal {goal}, and everything left is pinned; unpin entries or raise capacity_bytes")


def due_graves(parts: StoreParts, now: int) -> list[DueGrave]:
    """The graveyard records step 4 purges at ``now``: removed at least ``delete_grace_s``
    ago, oldest first. One read transaction."""
    cutoff = now - int(parts.config.delete_grace_s * 1e9)
    with parts.index.env.begin() as txn:
        return [(t, bytes(rest), parts.index.unpack(txn, txn.get(grave_key(t, rest), db=parts.index.db["grave"])))
                for t, rest in parts.index.oldest(txn, "grave", before_ns=cutoff + 1)]


def removed_graves(parts: StoreParts, removed: Collection[bytes], stamp: int, now: int) -> list[DueGrave]:
    """The graveyard records steps 2-3 will add for the entry keys ``removed``, stamped
    ``stamp``, when step 4 at ``now`` will purge them too (``stamp <= now - delete_grace_s``;
    module docstring); otherwise none. One read transaction."""
    if not removed or stamp > now - int(parts.config.delete_grace_s * 1e9):
        return []
    out = []
    with parts.index.env.begin() as txn:
        for ek in removed:
            m = parts.index.get_meta(txn, ek) or parts.index.get_lost(txn, ek)
            if m is not None:
                out.append((stamp, bytes(ek) + m.gen, m))
    return out


def purged_files(due: Sequence[DueGrave]) -> tuple[set[tuple[bytes, bytes]], set[tuple[str, str]]]:
    """For a dry run's orphan sweep, what step 4's purge of ``due`` changes: the (entry key,
    generation) pairs it forgets (their other files, e.g. a stale copy on a target that came
    back, are orphans after it) and the (target, file) pairs it deletes itself (counted as
    purged, not as orphans). Pack files are the purge's to count (``plan_purge``)."""
    forget, files = set(), set()
    for _t, rest, m in due:
        ek = bytes(rest[:17])
        forget.add((ek, m.gen))
        for i, name in enumerate(m.targets):
            if not m.offsets or m.offsets[i] == STANDALONE:
                files.add((name, fragment_path(ek[0], ek[1:], m.gen, i)))
    return forget, files


def _pack_effects(due: Sequence[DueGrave]) -> tuple[Counter, Counter]:
    """Per pack generation: (records the purge drops from it, pack bytes it makes dead)."""
    refs: Counter = Counter()
    dead: Counter = Counter()
    for _t, _rest, m in due:
        if m.offsets:
            refs[m.gen] += 1
            dead[m.gen] += packed_bytes(m)
    return refs, dead


def plan_purge(parts: StoreParts, due: Sequence[DueGrave]) -> int:
    """Dry run of step 4: the bytes purging ``due`` frees (each record's own fragment files,
    and each pack all of whose records are due)."""
    nbytes = sum(m.stored_bytes - packed_bytes(m) for _, _, m in due)
    refs, _dead = _pack_effects(due)
    with parts.index.env.begin() as txn:
        for gen, n in refs.items():
            info = parts.index.pack_info(txn, gen)
            if info is not None and info[0] == n:
                nbytes += info[1]
    return nbytes


def plan_compaction(parts: StoreParts, due: Sequence[DueGrave], gone: Collection[bytes],
                    limit: int) -> tuple[int, int]:
    """Dry run of step 5 after step 4 purged ``due`` and steps 2-3 removed the entries in
    ``gone``: (packs, entries moved out), as ``_compact_packs(limit)`` would report them.

    The queue after the purge, by ``Index._pack_update``'s rule: a pack leaves it when its
    last record is purged; a pack joins it when the purge adds dead bytes and they reach
    ``compact_ratio`` of its bytes (dead bytes only grow during a purge, so the rule checked
    once on the final counts is the rule checked after each record). The real pass takes the
    first ``limit`` queued generations in key order; each moves its live records still in
    that pack."""
    refs_drop, dead_add = _pack_effects(due)
    with parts.index.env.begin() as txn:
        queued = {bytes(g) for g, _ in parts.index.iter_db(txn, "compact")}
        for gen, n in refs_drop.items():
            info = parts.index.pack_info(txn, gen)
            if info is None:
                continue
            refs, nbytes, dead = info
            if refs <= n:
                queued.discard(gen)  # the pack goes with its last record
            elif dead_add[gen] and dead + dead_add[gen] >= parts.index.compact_ratio * nbytes:
                queued.add(gen)
        chosen = sorted(queued)[:limit]  # LMDB orders keys bytewise, as ``sorted`` orders bytes
        moved = 0
        for gen in chosen:
            for ek in parts.index.pack_members(txn, gen):
                if ek in gone:
                    continue
                m = parts.index.get_meta(txn, ek)
                moved += m is not None and m.gen == gen
    return len(chosen), moved
