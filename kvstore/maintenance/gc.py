"""GC of an embedded store: expiry, eviction, the graveyard's purge, compaction, the orphan sweep.

Called through ``EmbeddedStore.gc`` (and so by ``kvtool gc`` and the daemon); works on the
store's parts (``kvstore.embedded.parts.StoreParts``) and its clocks. Every step works from the
index orderings (``ttl``, ``lru``, ``grave``) and never scans the whole index. The consistency
check and repair are ``kvstore.maintenance.check``'s; eviction ``kvstore.maintenance.eviction``'s.

GC steps, in order, with the reason for the order:
  1. Flush batched access times, so LRU decisions see recent reads.
  2. Expire entries whose TTL passed (``ttl`` ordering, oldest first).
  3. Evict LRU entries above the capacity high watermark, down to the low one.
     Pinned entries are never in the ``lru`` ordering, so they are never taken.
  4. Purge the graveyard: fragments of entries removed more than
     ``delete_grace_s`` ago (a reader that fetched the metadata before the
     removal has had that long to finish); a pack file goes with the last
     record stored in it (``kvstore.embedded.index`` invariant 6).
  5. Compact packs that are mostly dead (``kvstore.embedded.index`` invariant 6): their
     live entries are rewritten into a new pack, and the old one is purged with
     the last of its records one ``delete_grace_s`` later, as a delete is.
  6. Sweep orphans: fragment and pack files no index record names (a put that
     crashed before its index commit), older than ``orphan_grace_s``; the decision
     to delete is made in the index, so a put about to be acknowledged never loses
     a file to it, whatever the grace (``kvstore.maintenance.orphans``).

On a full filesystem, an index write of the pass that finds no room releases the
index's spare file and the pass runs again (``EmbeddedStore.gc``, ``kvstore.embedded.diskroom``).

A dry run (``run_gc(dry_run=True)``) changes nothing, not even the batched
access times, and reports what the real pass would do from the same state
(the plans are in ``kvstore.maintenance.gc_plan``): steps 2 and 3 walk their whole
orderings (not one batch), step 3 as the ``lru`` ordering will stand after
step 1 and without the entries step 2 removes; step 5 from the ``compact``
queue as step 4's purge leaves it (that purge adds dead bytes, which queues
packs the same real pass compacts). Its ``purged`` covers records already in
the graveyard; the entries it expires or evicts reach the graveyard only in
the real pass.

Failures within a pass: a file that cannot be deleted (step 4, step 6) is
logged and left for a later pass (step 6 also reports it: ``orphans_kept``,
an unfixed ``ORPHAN_FRAGMENT`` problem in ``check``), and so is a stale copy whose
path the sweep cannot take because the index map is full; a pack whose compaction
fails is logged and stays queued. None of these stops the rest of the pass.
In ``check``/``repair``, an index write that finds the map full (``lmdb.MapFullError``)
ends rebuilding, not the pass: what was not recorded stays unfixed, saying why, and
``repair`` then raises ``CapacityExceeded`` with its counts (``_check``, ``repair``).
Progress: ``run_gc``'s docstring lists its phases.
"""

from __future__ import annotations

import itertools
import logging
from typing import Sequence

from kvstore.embedded.index import STANDALONE, Meta
from kvstore.embedded.parts import StoreParts
from kvstore.embedded.segments import ALIGN
from kvstore.embedded.targets import fragment_path, pack_path
from kvstore.errors import CapacityExceeded, InternalError, KVStoreError, StoreClosed
from kvstore.maintenance.eviction import evict
from kvstore.maintenance.gc_plan import (DueGrave, count_expired, due_graves, expired_lost, grave_key, plan_compaction,
                                         plan_eviction, plan_expiry, plan_purge, removed_graves)
from kvstore.maintenance.orphans import sweep_orphans as sweep
from kvstore.maintenance.problems import ProblemKind, Progress, no_progress

log = logging.getLogger(__name__)

_PURGE_STEP = 256  # graveyard records between two progress reports of step 4
_COMPACT_LIMIT = 64  # packs step 5 compacts per pass (the rest wait in the queue)


def _remove_expired(parts: StoreParts, now: int, progress: Progress) -> tuple[int, int]:
    """Step 2: remove every entry whose TTL passed by ``now``, in write batches of 512, and
    every lost one (to the graveyard, as a delete); returns (entries, stored bytes). Reports
    ``expire`` progress after each batch, against a total counted first (a keys-only walk)."""
    total = count_expired(parts, now)
    progress("expire", 0, total)
    n = nbytes = 0
    with parts.index.env.begin(write=True) as txn:
        for ek, m in expired_lost(parts, txn, now):
            parts.index.drop_lost_txn(txn, ek, m, now, to_grave=True)
            n += 1
            nbytes += m.stored_bytes
    while True:
        with parts.index.env.begin(write=True) as txn:
            batch = list(parts.index.oldest(txn, "ttl", before_ns=now + 1, limit=512))
            for _t, ek in batch:
                m = parts.index.get_meta(txn, ek)
                if m is None:
                    continue
                parts.index.remove_txn(txn, ek, m, now)
                n += 1
                nbytes += m.stored_bytes
        if n or total:
            progress("expire", n, max(total, n))  # a put racing us may add a few
        if len(batch) < 512:  # each batch left the ordering: it ends within len(ttl) / 512 + 1 rounds
            return n, nbytes


def _purge_grave(parts: StoreParts, due: Sequence[DueGrave], dry_run: bool,
                 progress: Progress) -> tuple[int, int, int]:
    """Step 4: purge ``due``, the graveyard records removed at least ``delete_grace_s`` ago
    (``gc_plan.due_graves``); (records, bytes of the files removed, bytes punched out of packs
    and segments that stay: ``_punch_share``; 0 in a dry run). Reports ``purge`` progress every
    ``_PURGE_STEP`` records."""
    total = len(due)
    progress("purge", 0, total)
    if dry_run:  # what the real pass would free: own files, and each pack all of whose records are due
        nbytes = plan_purge(parts, due)
        progress("purge", total, total)
        return total, nbytes, 0
    nbytes = purged = punched = 0
    for done, (t, rest, m) in enumerate(due, 1):
        ek = rest[:17]
        removed = 0  # its own files; pack bytes go with the pack
        for i, name in enumerate(m.targets):
            tgt = parts.targets.get(name)
            if tgt is None or (m.offsets and m.offsets[i] != STANDALONE):
                continue
            removed += m.frag_len * _delete(tgt, fragment_path(ek[0], ek[1:], m.gen, i))
        with parts.index.env.begin(write=True) as txn:
            mine, pack_freed = parts.index.purge_grave_txn(txn, grave_key(t, rest), m)
        if mine:  # counted by the one pass that dropped it (two passes at once: each record counted once)
            purged += 1
            nbytes += removed
        if pack_freed is not None:  # every target the batch may have used; what it removed
            nbytes += parts.fragments.writer.discard_pack(m.gen, list(parts.targets))
        elif mine and m.offsets:  # its share of a pack that lives on: the space back now, where the filesystem can
            punched += _punch_share(parts, m)
        if done % _PURGE_STEP == 0 or done == total:
            progress("purge", done, total)
    return purged, nbytes, punched


def _punch_share(parts: StoreParts, m: Meta) -> int:
    """Free the space of a purged record's fragments inside its pack or segment (``Target.punch``):
    the bytes no record names any more (one range names one record: a gen is never reused and
    compaction writes new packs), read by nobody once ``delete_grace_s`` has passed; a segment's
    fragment with the rest of its last block (``Meta.aligned``). The pack's dead bytes stay
    counted for compaction, which still rewrites a mostly dead pack. Returns the bytes of the
    ranges given back (``punched_bytes``: space freed inside files that stay, which
    ``reclaimed_bytes``, the bytes of files removed, does not count)."""
    punched = 0
    for i, name in enumerate(m.targets):
        tgt = parts.targets.get(name)
        if tgt is not None and m.offsets[i] != STANDALONE:
            try:
                span = -(-m.frag_len // ALIGN) * ALIGN if m.aligned else m.frag_len
                punched += span * tgt.punch(pack_path(m.gen), m.offsets[i], span)
            except OSError as exc:
                log.warning("cannot free %d bytes of %s on %s: %s", m.frag_len, pack_path(m.gen), name, exc)
    return punched


def _delete(tgt, rel: str) -> bool:
    """Delete ``rel`` on ``tgt``: True when this call removed it. False when it could not
    (logged; the bytes are not counted as reclaimed until the orphan sweep removes the file,
    so they are never counted twice) or when it was not there (a lost fragment, or one another
    pass removed: nothing freed here)."""
    try:
        return tgt.delete(rel)
    except OSError as exc:  # a down target keeps the file; the orphan sweep gets it later
        log.warning("cannot delete %s on %s: %s", rel, tgt.name, exc)
        return False


def _compact_packs(parts: StoreParts, progress: Progress, limit: int = _COMPACT_LIMIT) -> tuple[int, int]:
    """Step 5 for up to ``limit`` queued packs: (packs, entries moved out). Reports
    ``compact`` progress per pack. A pack whose rewrite fails with a store error (not a
    bug, not a closed store) is logged and stays queued for a later pass: one bad pack
    never stops the rest of the pass."""
    with parts.index.env.begin() as txn:
        queued = [bytes(g) for g, _ in itertools.islice(parts.index.iter_db(txn, "compact"), limit)]
    progress("compact", 0, len(queued))
    moved = compacted = 0
    for done, gen in enumerate(queued, 1):
        with parts.index.env.begin() as txn:
            live = [(ek, m) for ek in parts.index.pack_members(txn, gen)
                    if (m := parts.index.get_meta(txn, ek)) is not None and m.gen == gen]
        try:
            moved += parts.fragments.rewrite(live)
        except (StoreClosed, InternalError):
            raise
        except KVStoreError as exc:
            log.warning("compaction of pack %s failed (%s: %s); it stays queued for a later gc",
                        gen.hex(), type(exc).__name__, exc)
        else:
            with parts.index.env.begin(write=True) as txn:
                # queued again if it gets deader still; counted by the pass that dequeues it (two
                # passes at once: each pack counted once)
                compacted += bool(txn.delete(gen, db=parts.index.db["compact"]))
        progress("compact", done, len(queued))
    return compacted, moved


def run_gc(parts: StoreParts, *, dry_run: bool = False, sweep_orphans: bool = True,
           progress: Progress | None = None) -> dict:
    """One GC pass (steps 1-6 above); returns its counts. ``evicted_bytes`` is the stored size
    of the evicted entries (in a real pass, measured from the used-bytes counter, so a put
    running alongside shifts it). ``orphans_kept`` counts orphans the sweep could not delete
    (logged; ``check`` lists them); ``targets_not_swept`` the targets the sweep could not list
    (down: their orphans wait for a later pass). A dry run reports the counts and bytes of the real pass from
    the same state and changes nothing. Raises ``CapacityExceeded`` when step 3 cannot get
    under the low watermark because everything left is pinned (a dry run raises it too),
    after steps 4-6 have run: deleted entries and orphans are reclaimed all the same, and the
    error's ``result`` holds the counts this function would have returned.

    ``progress(phase, done, total)`` is called at least at the start and end of each step:
    ``expire`` (entries), ``evict`` (bytes to free: ``evict`` reports nothing in
    between), ``purge`` (graveyard records), ``compact`` (packs) and ``orphans`` (targets);
    a total of 0 means nothing to do."""
    progress = progress or no_progress
    now = parts.now_ns()
    if dry_run:
        plan = plan_expiry(parts, now)
        expired, expired_bytes = len(plan), sum(plan.values())
        progress("expire", expired, expired)
    else:
        parts.access.flush()
        plan = {}
        expired, expired_bytes = _remove_expired(parts, now, progress)
    evicted = evicted_bytes = 0
    evicted_keys: set[bytes] = set()
    used = parts.used_bytes() - (expired_bytes if dry_run else 0)
    cap = parts.config.capacity_bytes
    full: CapacityExceeded | None = None  # raised once steps 4-6 have reclaimed what they can
    if cap and used > cap * parts.config.high_watermark:
        goal = int(cap * parts.config.low_watermark)
        progress("evict", 0, used - goal)
        try:
            if dry_run:
                evicted, evicted_bytes, evicted_keys = plan_eviction(parts, used, goal, plan)
            else:
                evicted = parts.room.run_freeing(evict, parts, goal)  # as ``EmbeddedStore.evict_to``
                evicted_bytes = max(0, used - parts.used_bytes())
        except CapacityExceeded as exc:
            full = exc
            if not dry_run:
                evicted_bytes = max(0, used - parts.used_bytes())
        progress("evict", min(evicted_bytes, used - goal), used - goal)
    else:
        progress("evict", 0, 0)
    due = due_graves(parts, now)
    if dry_run:  # what steps 2-3 will remove and step 4 then purges at once (gc_plan docstring)
        due += removed_graves(parts, plan, now, now) + removed_graves(parts, evicted_keys, parts.now_ns(), now)
    purged, purged_bytes, punched_bytes = _purge_grave(parts, due, dry_run, progress)
    if dry_run:  # from the state step 4 leaves: its purge queues packs, or takes them out
        compacted, moved = plan_compaction(parts, due, set(plan) | evicted_keys, _COMPACT_LIMIT)
        progress("compact", compacted, compacted)
    else:
        compacted, moved = _compact_packs(parts, progress)
    orphans = orphan_bytes = kept = unswept = 0
    if sweep_orphans:
        orphans, orphan_bytes, found = sweep(parts, parts.file_clock(), dry_run,
                                                      parts.config.orphan_grace_s, progress,
                                                      purging=due if dry_run else ())
        kept = sum(1 for p in found if p.kind is ProblemKind.ORPHAN_FRAGMENT and not p.fixed and not dry_run)
        unswept = sum(1 for p in found if p.kind is ProblemKind.TARGET_DOWN)  # not listed: not swept
    out = {
        "dry_run": dry_run, "expired": expired, "evicted": evicted, "evicted_bytes": evicted_bytes,
        "purged": purged, "compacted_packs": compacted, "moved_entries": moved,
        "orphans": orphans, "orphans_kept": kept, "targets_not_swept": unswept,
        "reclaimed_bytes": purged_bytes + orphan_bytes, "punched_bytes": punched_bytes,
        "used_bytes": parts.used_bytes(),
    }
    log.info("gc: %s", out)
    if full is not None:
        raise CapacityExceeded(f"{full} (the rest of the gc pass ran: expired {expired}, purged {purged}, "
                               f"orphans {orphans}, {out['reclaimed_bytes']} bytes reclaimed)", result=out) from full
    return out
