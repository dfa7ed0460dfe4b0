"""Maintenance of an embedded store: GC, consistency check, repair (stats: ``kvstore.embedded.stats``).

Called through ``EmbeddedStore.gc / check / repair`` and by ``kvtool``. Rebuilding one record's
fragments, and recording it, is ``kvstore.maintenance.rebuild``'s.
Every pass here works from the index orderings (``ttl``, ``lru``, ``grave``)
and never scans the whole index, except ``check``/``repair`` (and stats), whose
job is to look at everything (they report progress through a callback).

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

import enum
import itertools
import logging
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Sequence

import lmdb

from kvstore.api import EntryKind
from kvstore.config import ENV_PREFIX
from kvstore.errors import CapacityExceeded, CorruptData, InternalError, KVStoreError, StoreClosed
from kvstore.embedded.fragments import WrittenTooLongAgo
from kvstore.maintenance.gc_plan import (DueGrave, count_expired, due_graves, expired_lost, grave_key, plan_compaction,
                             plan_eviction, plan_expiry, plan_purge, removed_graves)
from kvstore.embedded.index import STANDALONE, Meta
from kvstore.maintenance.rebuild import _rebuild, _record_repair, _unrecorded_detail
from kvstore.embedded.targets import TargetUnavailable, TargetUnreachable, fragment_path

if TYPE_CHECKING:
    from kvstore.embedded.store import EmbeddedStore

log = logging.getLogger(__name__)
Progress = Callable[[str, int, int], None]  # (phase, done, total)


class ProblemKind(enum.Enum):
    MISSING_FRAGMENT = "missing_fragment"
    CORRUPT_FRAGMENT = "corrupt_fragment"
    LOST_ENTRY = "lost_entry"  # fewer than k good fragments
    ORPHAN_FRAGMENT = "orphan_fragment"  # a file no index record names
    TARGET_DOWN = "target_down"


@dataclass(frozen=True, slots=True)
class Problem:
    kind: ProblemKind
    key: str = ""  # entry key hex ("" for target-level problems)
    entry_kind: str = ""
    target: str = ""
    detail: str = ""
    fixed: bool = False

    def as_dict(self) -> dict:
        return {"kind": self.kind.value, "key": self.key, "entry_kind": self.entry_kind,
                "target": self.target, "detail": self.detail, "fixed": self.fixed}


def _noop(phase: str, done: int, total: int) -> None:
    pass


# --------------------------------------------------------------------------- GC
UNFIXED_DETAIL_MAX = 20  # repair: fragments left as they were, listed with why (the rest counted)
_PURGE_STEP = 256  # graveyard records between two progress reports of step 4
_COMPACT_LIMIT = 64  # packs step 5 compacts per pass (the rest wait in the queue)
# why check/repair left a fragment or entry as it was when an index write found the map full
MAP_FULL_WHY = "the index map is full, so nothing was recorded (raise lmdb_map_size, or free entries)"


def evict_after_put(store: "EmbeddedStore", put: Sequence[bytes]) -> int:
    """After a put (``EmbeddedStore._index_new``): above the high watermark, evict down to the
    low one; the put's entries (``put``, in its order) stay while they fit under the capacity
    (``evict``). One pass at a time per process (``store._evict_lock``); a put that finds one
    running skips its own. Returns the count."""
    cap = store.config.capacity_bytes
    if not cap or store.used_bytes() <= cap * store.config.high_watermark:
        return 0
    if not store._evict_lock.acquire(blocking=False):
        return 0  # another thread of this process is evicting
    try:
        return evict(store, int(cap * store.config.low_watermark), keep=put, keep_within=cap)
    finally:
        store._evict_lock.release()


def evict(store: "EmbeddedStore", goal_bytes: int, *, dry_run: bool = False,
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
    evicted by its own pass (QA: with pinned entries just under the low watermark, every put
    was). When they do not fit, they go from the put's last entry back (a chain keeps its
    prefix) until the rest fit, and the pass raises ``CapacityExceeded`` saying how many it
    evicted. This covers the triggering put only: another thread's or process's put may see
    its entries evicted as plain LRU (``evict_after_put`` runs one pass at a
    time per process and skips, rather than waits, while one runs)."""
    if dry_run:
        return plan_eviction(store, store.used_bytes(), goal_bytes, ())[0]
    store.flush_touches()
    evicted = 0
    now = store.now_ns()
    try:
        with store.index.env.begin(write=True) as txn:
            used = store.index.counter(txn, "used_bytes")
            for ek, m in sorted(store.index.lost_records(txn), key=lambda r: r[1].access_ns):
                if used <= goal_bytes:
                    break
                if not m.pinned:
                    store.index.drop_lost_txn(txn, ek, m, now, to_grave=True)
                    used -= m.stored_bytes
                    evicted += 1
        own = list(dict.fromkeys(keep))  # the put's entries, in its order
        protected, dropped = frozenset(own), 0
        while True:
            with store.index.env.begin(write=True) as txn:
                used = store.index.counter(txn, "used_bytes")
                if used <= goal_bytes:
                    break
                batch = [(t, ek) for t, ek in store.index.oldest(txn, "lru", limit=256 + len(own))
                         if ek not in protected]
                if not batch and own:  # only pinned entries and the put's own are left
                    for ek in reversed(own):  # those that do not fit go, the put's last first
                        m = store.index.get_meta(txn, ek)
                        if used <= keep_within:
                            break
                        if m is not None and not m.pinned:
                            store.index.remove_txn(txn, ek, m, now)
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
                    m = store.index.get_meta(txn, ek)
                    if m is None:
                        continue
                    store.index.remove_txn(txn, ek, m, now)
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
        store._count("evicted", evicted)
        if evicted:
            log.info("evicted %d entries to get under %d bytes", evicted, goal_bytes)
    return evicted


def _remove_expired(store: "EmbeddedStore", now: int, progress: Progress) -> tuple[int, int]:
    """Step 2: remove every entry whose TTL passed by ``now``, in write batches of 512, and
    every lost one (to the graveyard, as a delete); returns (entries, stored bytes). Reports
    ``expire`` progress after each batch, against a total counted first (a keys-only walk)."""
    total = count_expired(store, now)
    progress("expire", 0, total)
    n = nbytes = 0
    with store.index.env.begin(write=True) as txn:
        for ek, m in expired_lost(store, txn, now):
            store.index.drop_lost_txn(txn, ek, m, now, to_grave=True)
            n += 1
            nbytes += m.stored_bytes
    while True:
        with store.index.env.begin(write=True) as txn:
            batch = list(store.index.oldest(txn, "ttl", before_ns=now + 1, limit=512))
            for _t, ek in batch:
                m = store.index.get_meta(txn, ek)
                if m is None:
                    continue
                store.index.remove_txn(txn, ek, m, now)
                n += 1
                nbytes += m.stored_bytes
        if n or total:
            progress("expire", n, max(total, n))  # a put racing us may add a few
        if len(batch) < 512:  # each batch left the ordering: it ends within len(ttl) / 512 + 1 rounds
            return n, nbytes


def _purge_grave(store: "EmbeddedStore", due: Sequence[DueGrave], dry_run: bool,
                 progress: Progress) -> tuple[int, int]:
    """Step 4: purge ``due``, the graveyard records removed at least ``delete_grace_s`` ago
    (``gc_plan.due_graves``); (records, bytes freed). Reports ``purge`` progress every
    ``_PURGE_STEP`` records."""
    total = len(due)
    progress("purge", 0, total)
    if dry_run:  # what the real pass would free: own files, and each pack all of whose records are due
        nbytes = plan_purge(store, due)
        progress("purge", total, total)
        return total, nbytes
    nbytes = purged = 0
    for done, (t, rest, m) in enumerate(due, 1):
        ek = rest[:17]
        removed = 0  # its own files; pack bytes go with the pack
        for i, name in enumerate(m.targets):
            tgt = store.targets.get(name)
            if tgt is None or (m.offsets and m.offsets[i] != STANDALONE):
                continue
            removed += m.frag_len * _delete(tgt, fragment_path(ek[0], ek[1:], m.gen, i))
        with store.index.env.begin(write=True) as txn:
            mine, pack_freed = store.index.purge_grave_txn(txn, grave_key(t, rest), m)
        if mine:  # counted by the one pass that dropped it (QA: two at once both counted everything)
            purged += 1
            nbytes += removed
        if pack_freed is not None:  # every target the batch may have used; what it removed
            nbytes += store._discard_pack(m.gen, list(store.targets))
        if done % _PURGE_STEP == 0 or done == total:
            progress("purge", done, total)
    return purged, nbytes


def _delete(tgt, rel: str) -> bool:
    """Delete ``rel`` on ``tgt``: True when this call removed it. False when it could not
    (logged; the bytes are not counted as reclaimed until the orphan sweep removes the file:
    QA found them counted twice) or when it was not there (a lost fragment, or one another
    pass removed: nothing freed here)."""
    try:
        return tgt.delete(rel)
    except OSError as exc:  # a down target keeps the file; the orphan sweep gets it later
        log.warning("cannot delete %s on %s: %s", rel, tgt.name, exc)
        return False


def _compact_packs(store: "EmbeddedStore", progress: Progress, limit: int = _COMPACT_LIMIT) -> tuple[int, int]:
    """Step 5 for up to ``limit`` queued packs: (packs, entries moved out). Reports
    ``compact`` progress per pack. A pack whose rewrite fails with a store error (not a
    bug, not a closed store) is logged and stays queued for a later pass: one bad pack
    never stops the rest of the pass."""
    with store.index.env.begin() as txn:
        queued = [bytes(g) for g, _ in itertools.islice(store.index.iter_db(txn, "compact"), limit)]
    progress("compact", 0, len(queued))
    moved = compacted = 0
    for done, gen in enumerate(queued, 1):
        with store.index.env.begin() as txn:
            live = [(ek, m) for ek in store.index.pack_members(txn, gen)
                    if (m := store.index.get_meta(txn, ek)) is not None and m.gen == gen]
        try:
            moved += store._rewrite(live)
        except (StoreClosed, InternalError):
            raise
        except KVStoreError as exc:
            log.warning("compaction of pack %s failed (%s: %s); it stays queued for a later gc",
                        gen.hex(), type(exc).__name__, exc)
        else:
            with store.index.env.begin(write=True) as txn:
                # queued again if it gets deader still; counted by the pass that dequeues it (QA: two
                # passes at once both counted every pack)
                compacted += bool(txn.delete(gen, db=store.index.db["compact"]))
        progress("compact", done, len(queued))
    return compacted, moved


def run_gc(store: "EmbeddedStore", *, dry_run: bool = False, sweep_orphans: bool = True,
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
    ``expire`` (entries), ``evict`` (bytes to free: ``store.evict_to`` reports nothing in
    between), ``purge`` (graveyard records), ``compact`` (packs) and ``orphans`` (targets);
    a total of 0 means nothing to do."""
    progress = progress or _noop
    now = store.now_ns()
    if dry_run:
        plan = plan_expiry(store, now)
        expired, expired_bytes = len(plan), sum(plan.values())
        progress("expire", expired, expired)
    else:
        store.flush_touches()
        plan = {}
        expired, expired_bytes = _remove_expired(store, now, progress)
    evicted = evicted_bytes = 0
    evicted_keys: set[bytes] = set()
    used = store.used_bytes() - (expired_bytes if dry_run else 0)
    cap = store.config.capacity_bytes
    full: CapacityExceeded | None = None  # raised once steps 4-6 have reclaimed what they can
    if cap and used > cap * store.config.high_watermark:
        goal = int(cap * store.config.low_watermark)
        progress("evict", 0, used - goal)
        try:
            if dry_run:
                evicted, evicted_bytes, evicted_keys = plan_eviction(store, used, goal, plan)
            else:
                evicted = store.evict_to(goal)
                evicted_bytes = max(0, used - store.used_bytes())
        except CapacityExceeded as exc:
            full = exc
            if not dry_run:
                evicted_bytes = max(0, used - store.used_bytes())
        progress("evict", min(evicted_bytes, used - goal), used - goal)
    else:
        progress("evict", 0, 0)
    due = due_graves(store, now)
    if dry_run:  # what steps 2-3 will remove and step 4 then purges at once (gc_plan docstring)
        due += removed_graves(store, plan, now, now) + removed_graves(store, evicted_keys, store.now_ns(), now)
    purged, purged_bytes = _purge_grave(store, due, dry_run, progress)
    if dry_run:  # from the state step 4 leaves: its purge queues packs, or takes them out
        compacted, moved = plan_compaction(store, due, set(plan) | evicted_keys, _COMPACT_LIMIT)
        progress("compact", compacted, compacted)
    else:
        compacted, moved = _compact_packs(store, progress)
    orphans = orphan_bytes = kept = unswept = 0
    if sweep_orphans:
        from kvstore.maintenance.orphans import sweep_orphans as sweep  # imports this module's Problem

        orphans, orphan_bytes, found = sweep(store, store.file_clock(), dry_run,
                                                      store.config.orphan_grace_s, progress,
                                                      purging=due if dry_run else ())
        kept = sum(1 for p in found if p.kind is ProblemKind.ORPHAN_FRAGMENT and not p.fixed and not dry_run)
        unswept = sum(1 for p in found if p.kind is ProblemKind.TARGET_DOWN)  # not listed: not swept
    out = {
        "dry_run": dry_run, "expired": expired, "evicted": evicted, "evicted_bytes": evicted_bytes,
        "purged": purged, "compacted_packs": compacted, "moved_entries": moved,
        "orphans": orphans, "orphans_kept": kept, "targets_not_swept": unswept,
        "reclaimed_bytes": purged_bytes + orphan_bytes,
        "used_bytes": store.used_bytes(),
    }
    log.info("gc: %s", out)
    if full is not None:
        raise CapacityExceeded(f"{full} (the rest of the gc pass ran: expired {expired}, purged {purged}, "
                               f"orphans {orphans}, {out['reclaimed_bytes']} bytes reclaimed)", result=out) from full
    return out


# --------------------------------------------------------------------------- check / verify / repair
def _scan_entry(store: "EmbeddedStore", ek: bytes, m: Meta,
                unreachable: frozenset[str] = frozenset()) -> tuple[dict[int, bytes], dict[int, Problem]]:
    """Read and verify every fragment of a record: the good bodies, and a problem per bad one
    (``TARGET_DOWN`` for a fragment on a target that could not be asked, or is in
    ``unreachable``: known unreachable, so not asked again at the cost of its timeouts)."""
    good: dict[int, bytes] = {}
    bad: dict[int, Problem] = {}
    kind = EntryKind.from_code(ek[0]).value
    for i, name in enumerate(m.targets):
        if name in unreachable:
            bad[i] = Problem(ProblemKind.TARGET_DOWN, ek[1:].hex(), kind, name, f"fragment {i}: target unreachable")
            continue
        try:
            good[i] = store._read_fragment(m, ek, i)
        except TargetUnreachable as exc:  # not asked: nothing known of this fragment (``check``)
            bad[i] = Problem(ProblemKind.TARGET_DOWN, ek[1:].hex(), kind, name, f"fragment {i}: {exc}")
        except FileNotFoundError as exc:
            bad[i] = Problem(ProblemKind.MISSING_FRAGMENT, ek[1:].hex(), kind, name, f"fragment {i}: {exc}")
        except (OSError, TargetUnavailable) as exc:
            bad[i] = Problem(ProblemKind.MISSING_FRAGMENT, ek[1:].hex(), kind, name, f"fragment {i}: {exc}")
        except CorruptData as exc:
            bad[i] = Problem(ProblemKind.CORRUPT_FRAGMENT, ek[1:].hex(), kind, name, f"fragment {i}: {exc}")
    return good, bad


def _still_current(store: "EmbeddedStore", ek: bytes, m: Meta, where: str) -> bool:
    """True when ``ek``'s record in ``where`` ("entries" or "lost") is still ``m``'s (same
    generation and fragment places): ``check`` scans a snapshot of the records, and a GC,
    delete, compaction or repair running alongside may have moved or removed one since."""
    with store.index.env.begin() as txn:
        cur = store.index.get_meta(txn, ek) if where == "entries" else store.index.get_lost(txn, ek)
    return cur is not None and (cur.gen, cur.targets, cur.offsets) == (m.gen, m.targets, m.offsets)


def _iter_records(store: "EmbeddedStore", db: str) -> list[tuple[bytes, Meta]]:
    with store.index.env.begin() as txn:
        return [(bytes(ek), store.index.unpack(txn, raw)) for ek, raw in store.index.iter_db(txn, db)]


def check(store: "EmbeddedStore", fix: bool = False, progress: Progress | None = None) -> list[Problem]:
    """``_check``'s problems (its docstring)."""
    return _check(store, fix, progress)[0]


def _check(store: "EmbeddedStore", fix: bool = False,
           progress: Progress | None = None) -> tuple[list[Problem], lmdb.MapFullError | None]:
    """Compare the index with the fragments on every target (python-diskcache's ``check``).

    Reads and verifies every fragment of every live and lost entry, then lists
    orphan files. An entry with fewer than k good fragments is marked lost even
    without ``fix`` (as a read would), so lookups stop offering it. With ``fix=True``: rebuilds missing and corrupt fragments,
    restores lost entries that became readable again, and removes orphans
    older than ``orphan_grace_s``. Returns the problems found (``fixed`` says
    which were mended); a down target is one ``TARGET_DOWN`` problem, whichever
    step noticed it.

    The index map full (``lmdb.MapFullError`` from an index write: marking lost, taking a path,
    recording a rebuild) stops nothing but rebuilding: that entry's problems stay unfixed and
    say why (its record as it was; a file written in a new place is an orphan GC sweeps), and so
    do those of every entry after it (checked, not rebuilt: the map does not grow). Returns the
    problems and the first such error (``None``: the map never was full), logged once.
    """
    progress = progress or _noop
    map_full: lmdb.MapFullError | None = None  # the first index write the full map refused
    problems: list[Problem] = []
    states = dict(zip(store.targets, store._pool.map(lambda t: t.state(), store.targets.values())))  # at once
    down = [name for name, (state, _) in states.items() if state != "up"]
    for name in down:
        problems.append(Problem(ProblemKind.TARGET_DOWN, target=name, detail=states[name][1]))
    # Targets that could not be asked (``TargetUnreachable``: a wrong credential, an endpoint
    # that does not answer) say nothing about their fragments: an entry short of k good ones
    # because of them is not marked lost, and their fragments are not rebuilt elsewhere. One
    # TARGET_DOWN problem per such target says how many entries it left unchecked.
    unchecked: dict[str, int] = {}
    unreachable = frozenset(name for name, (state, _) in states.items() if state == "unreachable")
    records = [(ek, m, "entries") for ek, m in _iter_records(store, "entries")]
    records += [(ek, m, "lost") for ek, m in _iter_records(store, "lost")]
    total = len(records)
    for n, (ek, m, where) in enumerate(records):
        if n % 64 == 0:
            progress("verify", n, total)
        good, bad = _scan_entry(store, ek, m, unreachable)
        kind = EntryKind.from_code(ek[0]).value
        unasked = {i: p for i, p in bad.items() if p.kind is ProblemKind.TARGET_DOWN}
        if unasked:
            for p in unasked.values():
                unchecked[p.target] = unchecked.get(p.target, 0) + 1
            bad = {i: p for i, p in bad.items() if i not in unasked}
            if len(good) < m.k <= len(good) + len(unasked):
                continue  # readable, for all we know: not lost, and nothing to rebuild from
        if (bad or len(good) < m.k or where == "lost") and not _still_current(store, ek, m, where):
            continue  # moved or removed while the scan ran: what it found is of a record gone
        if len(good) < m.k:
            # A scrub knows what a read would learn: mark it lost so lookups stop offering it
            # (``repair`` restores it if its targets come back).
            unmarked = ""
            if where == "entries":
                try:
                    store._mark_lost(ek, m)
                except lmdb.MapFullError as exc:  # reported all the same; a lookup marks it when it reads it
                    map_full, unmarked = map_full or exc, f"; not marked lost: {MAP_FULL_WHY}"
            problems.append(Problem(ProblemKind.LOST_ENTRY, ek[1:].hex(), kind, ",".join(
                p.target for p in bad.values()), f"{len(good)} of {m.k} needed fragments are good{unmarked}"))
            continue
        if not bad and where == "entries":
            continue
        why: dict[int, str] = {}
        fixing = fix and map_full is None  # once the index map is full, nothing more is rebuilt
        if fix and not fixing:
            why.update({i: f"repair stopped: {MAP_FULL_WHY}" for i in bad})
        written_at = store.clock()  # of the files _rebuild writes (``_check_in_time``)
        taken: list[tuple[str, str]] = []  # paths _rebuild took: held until recorded or given up
        unrecorded = ""  # why the fragments rewritten were not recorded (written, so not "not rebuilt")
        try:
            try:
                rebuilt = _rebuild(store, ek, m, good, bad, why, taken) if (fixing and bad) else (
                    (m, set()) if fixing else None)
            except lmdb.MapFullError as exc:  # a path take: nothing indexed; files in new places are orphans
                map_full, rebuilt = exc, None
                why.update({i: MAP_FULL_WHY for i in bad})
            fixed_meta, fixed = rebuilt if rebuilt is not None else (None, set())
            if fixed_meta is not None and where == "entries" and not fixed:
                fixed_meta = None  # nothing rewritten: the record stands as it is
            if fixing and fixed_meta is not None:
                try:
                    if not _record_repair(store, ek, m, fixed_meta, where, written_at):
                        unrecorded = "the entry changed while it was rebuilt"
                except WrittenTooLongAgo as exc:  # a sweep may be deleting them: not recorded
                    unrecorded = str(exc)
                except lmdb.MapFullError as exc:  # its one transaction aborted: the record as it was
                    map_full, unrecorded = exc, MAP_FULL_WHY
        finally:
            if taken:
                store.index.release_paths(taken)  # never raises an LMDB error: the check goes on
        for i, p in bad.items():
            if unrecorded and i in fixed:
                detail = f"{p.detail}; {_unrecorded_detail(m, fixed_meta, i, unrecorded)}"
            else:
                detail = f"{p.detail}; not rebuilt: {why[i]}" if i in why else p.detail
            problems.append(replace(p, fixed=not unrecorded and fixed_meta is not None and i in fixed, detail=detail))
        if unrecorded:
            fixed_meta = None
        if where == "lost":
            # Readable again (targets came back; any bad fragments listed above): with fix it is
            # live again, its bad fragments rebuilt first.
            problems.append(Problem(ProblemKind.LOST_ENTRY, ek[1:].hex(), kind, "",
                                    "marked lost but readable again" + (f"; not restored: {MAP_FULL_WHY}"
                                                                        if fix and not fixing else ""),
                                    fixed=fixing and fixed_meta is not None))
    progress("verify", total, total)
    for name, n in unchecked.items():
        detail = f"could not be reached; {n} entries with fragments on it were not checked"
        if name in down:
            problems = [replace(p, detail=f"{p.detail}; {n} entries with fragments on it were not checked")
                        if p.kind is ProblemKind.TARGET_DOWN and p.target == name and not p.key else p
                        for p in problems]
        else:
            problems.append(Problem(ProblemKind.TARGET_DOWN, target=name, detail=detail))
            down.append(name)
    # A target reported down above is not swept: its failed listing would report it down twice.
    from kvstore.maintenance.orphans import sweep_orphans

    _, _, orphans = sweep_orphans(store, store.file_clock(), not fix, store.config.orphan_grace_s, progress,
                                   skip=down)
    problems.extend(orphans)
    if map_full is not None:
        log.error("%s: the index map is full (%s); %s", "repair" if fix else "check", map_full, MAP_FULL_WHY)
    return problems, map_full


def repair(store: "EmbeddedStore", progress: Progress | None = None) -> dict:
    """``check(fix=True)`` summarised: what was rebuilt, restored, and what stays lost
    (``orphans_kept``: orphans that could not be deleted; ``targets_down``: targets that
    could not be asked; ``still_lost``: the lost records left in the index, examined or not;
    ``unfixed_detail``: the first ``UNFIXED_DETAIL_MAX`` fragments left as they were, each with
    why, as ``check`` lists them: QA found "unfixed 1" with the reason only in the log).
    Raises ``CapacityExceeded`` (its ``result`` the counts above) when the index map was full
    (``_check``): the pass ran to its end, rebuilding nothing after that (QA: a raw
    ``lmdb.MapFullError`` ended it, and kvtool printed a traceback)."""
    problems, map_full = _check(store, fix=True, progress=progress)
    out = {"rebuilt_fragments": 0, "restored_entries": 0, "still_lost": 0, "orphans_removed": 0, "unfixed": 0,
           "orphans_kept": 0,
           # targets that could not be asked: what they hold was neither checked nor repaired
           "targets_down": len({p.target for p in problems if p.kind is ProblemKind.TARGET_DOWN}),
           "unfixed_detail": []}
    for p in problems:
        if p.kind in (ProblemKind.MISSING_FRAGMENT, ProblemKind.CORRUPT_FRAGMENT):
            out["rebuilt_fragments" if p.fixed else "unfixed"] += 1
            if not p.fixed and len(out["unfixed_detail"]) < UNFIXED_DETAIL_MAX:
                out["unfixed_detail"].append(f"{p.entry_kind} {p.key} on {p.target}: {p.detail}")
        elif p.kind is ProblemKind.LOST_ENTRY:
            out["restored_entries" if p.fixed else "still_lost"] += 1
        elif p.kind is ProblemKind.ORPHAN_FRAGMENT:  # kept: could not be deleted (logged)
            out["orphans_removed" if p.fixed else "orphans_kept"] += 1
    with store.index.env.begin() as txn:  # also those not examined (their targets could not be asked)
        out["still_lost"] = max(out["still_lost"], txn.stat(store.index.db["lost"])["entries"])
    if map_full is not None:
        raise CapacityExceeded(
            f"the index map is full ({map_full}): repair stopped rebuilding; nothing half-recorded, the rest of "
            f"the pass ran. Raise lmdb_map_size (now {store.config.lmdb_map_size} bytes) in the store config "
            f"([store] lmdb_map_size, or {ENV_PREFIX}LMDB_MAP_SIZE), or free entries, and run repair again",
            result=out) from map_full
    return out
