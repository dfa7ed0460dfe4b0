"""The orphan sweep of an embedded store (GC step 6, ``check``'s last step: ``kvstore.maintenance.gc``, ``kvstore.maintenance.check``).

An orphan is a fragment or pack file no index record needs, older than ``orphan_grace_s``
(plus the target's mtime resolution), so that a put still writing its files is seldom
made to write them again (what keeps an indexed file safe is the decision below, not the age):
* a fragment file of an (entry key, generation) no live, lost or graveyard record has
  (a put that crashed before its index commit, a purge that could not delete it);
* a pack file no record is stored in;
* a ``.tmp.`` file (a write that never got renamed into place);
* a fragment file of a known generation in a slot or on a target no record holds it on
  (``_slot_orphan``: the copy a repair replaced while its target was away), re-checked just
  before it is deleted (``_still_an_orphan``: the record's own copy of the slot must read
  back and verify, so a name that now means another directory never costs a fragment).
Anything else under a target (not named as ours) is left alone.

Why no acknowledged put ever loses a file to the sweep, whatever ``orphan_grace_s`` any
process on the directory uses and whatever its clock says: the decision to delete an
unindexed fragment or pack file is made in the index, serialised with every index commit.
  1. A sweep lists a target, then decides on the files no record named when it read the
     records (up to ``_DECIDE_BATCH`` in one write transaction, ``_take_unindexed``): it
     counts a decision (``info`` ``sweep_decisions``), looks at the records again, and takes
     the path of each file still unindexed (``Index.take_path_txn``). It deletes those files
     after that transaction, then counts once more and gives their paths back.
  2. A writer reads ``sweep_decisions`` before it writes its first file, and in the write
     transaction that indexes its files (``FragmentStore.check_unswept_txn``) refuses to index
     any whose path a hold record sits on, and, when the count has moved, any it cannot
     stat any more: ``FilesSwept``, nothing indexed, the put writes again under a new
     generation.
  3. LMDB runs one write transaction at a time. A decision that commits before the
     writer's index transaction moved the count (the writer's files are new names, so the
     sweep listed them after the writer's first read): the writer sees the hold until the
     file is deleted, and the missing file after. A decision after it reads the record (1)
     and leaves the file alone. A direct writer's files (``EmbeddedStore.commit_written``) are
     older than the count it compares with, read before it stats them: a decision before
     that read either shows as a hold, or its delete is done and counted after it, before
     the hold goes (1), so the count has moved and the file is looked at again.
The age rule (older than ``orphan_grace_s``) only keeps the sweep from deciding on files a
put is still writing, which would make that put write again; a ``.tmp.`` file is never
indexed, so it is deleted without a decision, once older than the grace and at least
``TMP_MIN_AGE_S`` (a write whose ``.tmp.`` file goes fails, and that fragment goes to a
spare target, or the put fails). The writer's own time check
(``FragmentStore.check_in_time``: files indexed within ``orphan_grace_s / 2`` of their
writing) stays for sweeps of versions without the decision step.

A slot orphan's name is re-created by repair alone: it rebuilds a slot onto a spare at
the path a stale copy there has. So the sweep's last look at the records and repair's
decision to write there each take the path in the index (``Index.take_path_txn``, one short
write transaction): the sweep only when no record of the generation claims the file and no
live process holds the path, repair only when none holds it; each keeps it until its
delete, or its record, is done. Whichever takes it first, the other sees it: a sweep that
took it first is never followed by a rebuild there until its delete is over, and a repair
that took it first is recorded (the sweep then sees the record) or gave up (its file is an
orphan) before the sweep looks. The stat and the delete, and repair's write, run outside
any write transaction (inside one, on S3, every put would wait on a round trip).

A take that fails because the index map is full (``lmdb.MapFullError``; the index never
grows its map, ``lmdb_map_size`` is fixed at open) keeps those orphans (a slot orphan, or a
batch of unindexed files) for a later pass: each is counted as kept (an unfixed
``ORPHAN_FRAGMENT`` problem, ``run_gc``'s ``orphans_kept``), logged once per sweep, and the
sweep goes on. A full map is when GC is
needed most, and the rest of the sweep needs no index write, so the error never ends the pass.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Collection, Sequence

import lmdb

from kvstore.maintenance.gc_plan import DueGrave, purged_files
from kvstore.embedded.index import STANDALONE, Meta
from kvstore.maintenance.problems import Problem, ProblemKind, Progress
from kvstore.embedded.targets import parse_fragment_path, parse_pack_path

from kvstore.embedded.parts import StoreParts

log = logging.getLogger(__name__)


Claims = set[tuple[int, str, bool]]  # per record slot: (slot, target, in a file of its own)


def known_generations(parts: StoreParts) -> tuple[dict[tuple[bytes, bytes], Claims], set[bytes]]:
    """What the records claim: per (entry key, gen) of every live, lost and graveyard record,
    each slot's (slot, target, standalone); and the gens of the packs records name. A
    fragment file of a known generation is an orphan only by ``_slot_orphan``."""
    known: dict[tuple[bytes, bytes], Claims] = {}

    def add(ek: bytes, m: Meta) -> None:
        known.setdefault((ek, m.gen), set()).update(
            (i, t, not m.offsets or m.offsets[i] == STANDALONE) for i, t in enumerate(m.targets))

    with parts.index.env.begin() as txn:
        for db in ("entries", "lost"):
            for ek, raw in parts.index.iter_db(txn, db):
                add(bytes(ek), parts.index.unpack(txn, raw))
        for k, raw in parts.index.iter_db(txn, "grave"):
            add(bytes(k[8:25]), parts.index.unpack(txn, raw))
        packs = {bytes(gen) for gen, _ in parts.index.iter_db(txn, "packs")}
    return known, packs


def _slot_orphan(claims: Claims, slot: int, name: str, configured: Collection[str]) -> bool:
    """Is the fragment file of ``slot`` on target ``name``, of a generation records know, an
    orphan? Yes when no record holds that slot in a file on ``name`` and every target the
    records name for the slot is configured: the copy a repair replaced while its target was
    away, found when it comes back (else such copies would stay as long as their entry lives).
    A slot recorded on a target that is not configured keeps the file: that target may be
    this one under another name (a mount moved, its old name not given; deleting by the slot
    rule alone would remove every fragment on renamed targets)."""
    mine = [(t, alone) for i, t, alone in claims if i == slot]
    return bool(mine) and (name, True) not in mine and all(t in configured for t, _ in mine)


def _claims_slot_here(metas: Sequence[Meta], name: str, slot: int) -> bool:
    """Does one of ``metas`` hold ``slot`` in a file of its own on target ``name``?"""
    return any(m.targets[slot] == name and (not m.offsets or m.offsets[slot] == STANDALONE) for m in metas)


def _live_metas(parts: StoreParts, txn: "lmdb.Transaction", ek: bytes, gen: bytes) -> list[Meta]:
    """The live and lost records of ``ek`` with generation ``gen``."""
    return [m for m in (parts.index.get_meta(txn, ek), parts.index.get_lost(txn, ek)) if m is not None and m.gen == gen]


def _still_an_orphan(parts: StoreParts, tgt, rel: str, ek: bytes, gen: bytes, slot: int) -> bool:
    """Before deleting a slot orphan: a live or lost record of its generation holds the
    slot elsewhere, the copy there reads back and verifies, and no record names this file.
    A repair may have rebuilt that very slot onto this target since the records were read
    (same path, a new file), then recorded it. And a configured name may no longer mean the
    directory it meant (mounts swapped or rotated, a name given to another directory): then
    the recorded copy is not where the record says, so this one is kept (swapped names would
    have one gc delete a fragment of every entry, a rotation all of them). The last look,
    and the age, are ``_delete_slot_orphan``'s."""
    with parts.index.env.begin() as txn:
        metas = _live_metas(parts, txn, ek, gen)
    if not metas:
        return False  # only the graveyard has it: its purge takes its files, the rest are orphans after
    if _claims_slot_here(metas, tgt.name, slot):
        return False
    try:
        parts.fragments.reader.read_fragment(metas[0], ek, slot)  # the recorded copy: present and verified, or keep this one
    except Exception as exc:  # noqa: BLE001 - missing, corrupt, unreachable: all mean "keep"
        log.info("orphan sweep: kept %s on %s: the copy its record names does not read back (%s)",
                 rel, tgt.name, exc)
        return False
    return True


def _delete_slot_orphan(parts: StoreParts, tgt, rel: str, ek: bytes, gen: bytes, slot: int,
                        grace_s: float) -> bool | None:
    """Delete a slot orphan ``_still_an_orphan`` passed: ``None`` (kept) when a record of its
    generation now names this file or none is live or lost any more, a repair holds its path,
    or the file is gone or young (rewritten since the listing); else what ``tgt.delete`` says
    (``OSError`` raised). The last look at the records takes the path in one short write
    transaction; the stat and the delete run after it, the path held until they are done, so
    no repair rebuilds the slot here meanwhile (see the module docstring)."""
    with parts.index.env.begin(write=True) as txn:
        metas = _live_metas(parts, txn, ek, gen)
        if not metas or _claims_slot_here(metas, tgt.name, slot):
            return None
        if not parts.index.take_path_txn(txn, tgt.name, rel, "sweep"):
            return None  # a repair is writing it (or another sweep deleting it)
    try:
        try:
            _size, mtime = tgt.stat(rel)
        except OSError:
            return None  # gone already, or cannot tell: leave it
        if not mtime or parts.file_clock() - mtime < grace_s + tgt.mtime_resolution_s:
            return None
        return tgt.delete(rel)
    finally:
        parts.index.release_paths([(tgt.name, rel)])  # never raises an LMDB error: the sweep goes on


_DECIDE_BATCH = 256  # unindexed files decided on in one write transaction (module docstring, step 1)
# A ``.tmp.`` file younger than this is a write in progress whatever the grace: deleting it can
# only fail that write (a crashed write's file waits this much longer at most).
TMP_MIN_AGE_S = 60.0


@dataclass(frozen=True, slots=True)
class _Unindexed:
    """A file of a generation no record named when the sweep read the records: a fragment
    file (``ek`` its entry key) or a pack file (``ek`` ``None``), and its problem as reported."""

    rel: str
    size: int
    ek: bytes | None
    gen: bytes
    problem: Problem


def _take_unindexed(parts: StoreParts, name: str, files: Sequence[_Unindexed]) -> list[_Unindexed]:
    """Step 1 of the module docstring for ``files`` on target ``name``: in one write
    transaction, count a decision and take the path of each that no record names now (a
    put may have indexed it since the listing); those taken, for the caller to delete and
    give back. A record indexed and deleted again since the listing sits in the graveyard
    only, which is not looked at here: its files go now rather than ``delete_grace_s`` after
    its delete (no live entry loses anything)."""
    taken = []
    with parts.index.env.begin(write=True) as txn:
        parts.index.add_counter(txn, "sweep_decisions", 1)
        for f in files:
            named = (parts.index.pack_info(txn, f.gen) is not None if f.ek is None
                     else bool(_live_metas(parts, txn, f.ek, f.gen)))
            if not named and parts.index.take_path_txn(txn, name, f.rel, "sweep"):
                taken.append(f)
    return taken


def _delete_unindexed(parts: StoreParts, tgt, files: Sequence[_Unindexed],
                      map_full: list[lmdb.MapFullError]) -> list[tuple[Problem, int]]:
    """Decide on ``files`` (``_take_unindexed``), delete those taken, give their paths back:
    (problem, bytes freed) per file deleted (fixed) or kept because it could not be (unfixed,
    0 bytes: a delete that failed, or the index map full, appended to ``map_full``)."""
    try:
        taken = _take_unindexed(parts, tgt.name, files)
    except lmdb.MapFullError as exc:
        map_full.append(exc)
        return [(replace(f.problem, detail=f"{f.rel} (kept: the index map is full, its path cannot be taken: "
                                           f"{exc})", fixed=False), 0) for f in files]
    out = []
    try:
        for f in taken:
            try:
                removed = tgt.delete(f.rel)
            except OSError as exc:
                log.warning("orphan sweep: cannot delete %s on %s: %s", f.rel, tgt.name, exc)
                out.append((replace(f.problem, detail=f"{f.rel} (cannot delete: {exc})", fixed=False), 0))
                continue
            if removed:  # else gone since the listing (another pass swept it): not freed here
                out.append((f.problem, f.size))
    finally:
        if taken:
            try:  # counted again once the files are gone, before their holds go (module docstring, step 1)
                with parts.index.env.begin(write=True) as txn:
                    parts.index.add_counter(txn, "sweep_decisions", 1)
            except lmdb.Error as exc:  # the give-back below then fails too, or the holds stay: either way safe
                log.warning("orphan sweep: could not count its deletes in the index (%s)", exc)
            parts.index.release_paths([(tgt.name, f.rel) for f in taken])  # never raises an LMDB error
    return out


def sweep_orphans(parts: StoreParts, now_s: float, dry_run: bool, grace_s: float,
                   progress: Progress, skip: Collection[str] = (),
                   purging: Sequence[DueGrave] = ()) -> tuple[int, int, list[Problem]]:
    """Step 6: (files, bytes, problems) of orphans on every target but those in ``skip``
    (targets the caller already reported down). A target that cannot be listed is one
    ``TARGET_DOWN`` problem. An orphan that cannot be deleted (a read-only file or target)
    is logged and reported as an unfixed ``ORPHAN_FRAGMENT`` problem, is not counted in the
    files and bytes, and the sweep goes on with the next file and target; so is a slot orphan
    whose path cannot be taken because the index map is full (the module docstring).

    ``now_s`` is ``parts.file_clock()`` (the clock of the files' mtimes), taken before the
    records are read: a writer indexes its files only within ``orphan_grace_s / 2`` of
    starting them, checked once it holds the index's write lock (``FragmentStore.check_in_time``),
    so no file a writer is about to index is ever old enough here. A file of unknown age
    (no mtime) is kept.

    ``purging`` (a dry run): the graveyard records the real pass purges before it sweeps, so
    the files they leave behind count as orphans and the files they delete do not."""
    known, packs = known_generations(parts)
    forget, deleted = purged_files(purging)
    for gone in forget:
        known.pop(gone, None)
    n = nbytes = unknown_age = 0
    map_full: list[lmdb.MapFullError] = []  # orphans whose path the full index map could not take
    problems: list[Problem] = []
    names = list(parts.targets)
    for ti, name in enumerate(names):
        tgt = parts.targets[name]
        progress("orphans", ti, len(names))
        if name in skip:
            continue
        try:
            files = list(tgt.walk())
        except OSError as exc:
            problems.append(Problem(ProblemKind.TARGET_DOWN, target=name, detail=str(exc)))
            continue
        unindexed: list[_Unindexed] = []  # decided on in batches (module docstring, step 1)

        def decide() -> None:
            nonlocal n, nbytes
            for problem, freed in _delete_unindexed(parts, tgt, unindexed, map_full):
                problems.append(problem)
                n += problem.fixed
                nbytes += freed
            unindexed.clear()

        for rel, size, mtime in files:
            if (name, rel) in deleted:
                continue
            base = rel.rsplit("/", 1)[-1]
            parsed = parse_fragment_path(rel)
            pack = parse_pack_path(rel) if parsed is None else None
            recheck = False
            if parsed is not None:
                kind_code, key, gen, slot = parsed
                ek = bytes((kind_code,)) + key
                claims = known.get((ek, gen))
                if claims is not None and not _slot_orphan(claims, slot, name, parts.targets):
                    continue
                recheck = claims is not None
            elif pack is not None:
                if pack in packs:
                    continue
            elif not base.startswith(".tmp."):
                continue  # not ours: leave foreign files alone
            wait_s = grace_s if parsed is not None or pack is not None else max(grace_s, TMP_MIN_AGE_S)
            if not mtime or now_s - mtime < wait_s + tgt.mtime_resolution_s:
                unknown_age += not mtime
                continue  # may belong to a put still in flight (of unknown age: never taken for an orphan)
            if recheck and not dry_run and not _still_an_orphan(parts, tgt, rel, ek, gen, slot):
                continue
            orphan = Problem(ProblemKind.ORPHAN_FRAGMENT, key=parsed[1].hex() if parsed else "",
                             target=name, detail=rel, fixed=not dry_run)
            if not dry_run and not recheck and (parsed is not None or pack is not None):
                unindexed.append(_Unindexed(rel, size, ek if parsed else None, gen if parsed else pack, orphan))
                if len(unindexed) >= _DECIDE_BATCH:
                    decide()
                continue
            if not dry_run:
                try:
                    if recheck:  # the last look takes the path; the delete holds it
                        removed = _delete_slot_orphan(parts, tgt, rel, ek, gen, slot, grace_s)
                        if removed is None:
                            continue  # claimed, rewritten or gone since: kept
                    else:  # a .tmp. file: never indexed
                        removed = tgt.delete(rel)
                except OSError as exc:
                    log.warning("orphan sweep: cannot delete %s on %s: %s", rel, name, exc)
                    problems.append(replace(orphan, detail=f"{rel} (cannot delete: {exc})", fixed=False))
                    continue
                except lmdb.MapFullError as exc:  # the take's write transaction: kept, the sweep goes on
                    map_full.append(exc)
                    problems.append(replace(orphan, detail=f"{rel} (kept: the index map is full, its path "
                                                           f"cannot be taken: {exc})", fixed=False))
                    continue
                if not removed:
                    continue  # gone since the listing (another pass swept it): not freed here
            problems.append(orphan)
            n += 1
            nbytes += size
        if unindexed:
            decide()
    progress("orphans", len(names), len(names))
    if map_full:
        log.warning("orphan sweep: kept orphans (%d takes refused): the index map is full (%s), so their "
                    "paths could not be taken for the delete; they are swept by a later pass once the index has room "
                    "(raise lmdb_map_size, or free entries)", len(map_full), map_full[0])
    if unknown_age:
        log.warning("orphan sweep: %d unindexed files have no modification time on their target, so their "
                    "age is unknown and they were kept", unknown_age)
    return n, nbytes, problems
