"""The consistency check and repair of an embedded store (python-diskcache's ``check(fix=...)``).

Called through ``EmbeddedStore.check`` and ``EmbeddedStore.repair`` (and so by ``kvtool verify``
and ``kvtool repair``); works on the store's parts (``kvstore.embedded.parts.StoreParts``) and
its clocks. Unlike GC (``kvstore.maintenance.gc``) its job is to look at everything: every
fragment of every live and lost record is read and verified, then the targets are swept for
orphans (``kvstore.maintenance.orphans``); progress goes through a callback. Rebuilding one
record's fragments, and recording it, is ``kvstore.maintenance.rebuild``'s.

An index write that finds the map full (``lmdb.MapFullError``) ends rebuilding, not the pass:
what was not recorded stays unfixed, saying why, and ``repair`` then raises
``CapacityExceeded`` with its counts (``_check``, ``repair``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import lmdb

from kvstore.api import EntryKind
from kvstore.config import ENV_PREFIX
from kvstore.embedded.fragment_reads import says_nothing_of_fragment
from kvstore.embedded.fragments import WrittenTooLongAgo
from kvstore.embedded.index import Meta
from kvstore.embedded.parts import StoreParts
from kvstore.embedded.targets import TargetUnavailable, TargetUnreachable
from kvstore.errors import CapacityExceeded, CorruptData
from kvstore.maintenance.orphans import sweep_orphans
from kvstore.maintenance.problems import Problem, ProblemKind, Progress, no_progress
from kvstore.maintenance.rebuild import rebuild, record_repair, unrecorded_detail

log = logging.getLogger(__name__)

UNFIXED_DETAIL_MAX = 20  # repair: fragments left as they were, listed with why (the rest counted)
# why check/repair left a fragment or entry as it was when an index write found the map full
MAP_FULL_WHY = "the index map is full, so nothing was recorded (raise lmdb_map_size, or free entries)"


def _scan_entry(parts: StoreParts, ek: bytes, m: Meta,
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
            good[i] = parts.fragments.reader.read_fragment(m, ek, i)
        except TargetUnreachable as exc:  # not asked: nothing known of this fragment (``check``)
            bad[i] = Problem(ProblemKind.TARGET_DOWN, ek[1:].hex(), kind, name, f"fragment {i}: {exc}")
        except (OSError, TargetUnavailable) as exc:
            # This process out of descriptors or memory says nothing of the fragment either.
            what = ProblemKind.TARGET_DOWN if says_nothing_of_fragment(exc) else ProblemKind.MISSING_FRAGMENT
            bad[i] = Problem(what, ek[1:].hex(), kind, name, f"fragment {i}: {exc}")
        except CorruptData as exc:
            bad[i] = Problem(ProblemKind.CORRUPT_FRAGMENT, ek[1:].hex(), kind, name, f"fragment {i}: {exc}")
    return good, bad


def _still_current(parts: StoreParts, ek: bytes, m: Meta, where: str) -> bool:
    """True when ``ek``'s record in ``where`` ("entries" or "lost") is still ``m``'s (same
    generation and fragment places): ``check`` scans a snapshot of the records, and a GC,
    delete, compaction or repair running alongside may have moved or removed one since."""
    with parts.index.env.begin() as txn:
        cur = parts.index.get_meta(txn, ek) if where == "entries" else parts.index.get_lost(txn, ek)
    return cur is not None and (cur.gen, cur.targets, cur.offsets) == (m.gen, m.targets, m.offsets)


def _iter_records(parts: StoreParts, db: str) -> list[tuple[bytes, Meta]]:
    with parts.index.env.begin() as txn:
        return [(bytes(ek), parts.index.unpack(txn, raw)) for ek, raw in parts.index.iter_db(txn, db)]


def check(parts: StoreParts, fix: bool = False, progress: Progress | None = None) -> list[Problem]:
    """``_check``'s problems (its docstring)."""
    return _check(parts, fix, progress)[0]


def _check(parts: StoreParts, fix: bool = False,
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
    progress = progress or no_progress
    map_full: lmdb.MapFullError | None = None  # the first index write the full map refused
    problems: list[Problem] = []
    states = dict(zip(parts.targets, parts.pool.map(lambda t: t.state(), parts.targets.values())))  # at once
    down = [name for name, (state, _) in states.items() if state != "up"]
    for name in down:
        problems.append(Problem(ProblemKind.TARGET_DOWN, target=name, detail=states[name][1]))
    # Targets that could not be asked (``TargetUnreachable``: a wrong credential, an endpoint
    # that does not answer) say nothing about their fragments: an entry short of k good ones
    # because of them is not marked lost, and their fragments are not rebuilt elsewhere. One
    # TARGET_DOWN problem per such target says how many entries it left unchecked.
    unchecked: dict[str, int] = {}
    unreachable = frozenset(name for name, (state, _) in states.items() if state == "unreachable")
    records = [(ek, m, "entries") for ek, m in _iter_records(parts, "entries")]
    records += [(ek, m, "lost") for ek, m in _iter_records(parts, "lost")]
    total = len(records)
    for n, (ek, m, where) in enumerate(records):
        if n % 64 == 0:
            progress("verify", n, total)
        good, bad = _scan_entry(parts, ek, m, unreachable)
        kind = EntryKind.from_code(ek[0]).value
        unasked = {i: p for i, p in bad.items() if p.kind is ProblemKind.TARGET_DOWN}
        if unasked:
            for p in unasked.values():
                unchecked[p.target] = unchecked.get(p.target, 0) + 1
            bad = {i: p for i, p in bad.items() if i not in unasked}
            if len(good) < m.k <= len(good) + len(unasked):
                continue  # readable, for all we know: not lost, and nothing to rebuild from
        if (bad or len(good) < m.k or where == "lost") and not _still_current(parts, ek, m, where):
            continue  # moved or removed while the scan ran: what it found is of a record gone
        if len(good) < m.k:
            # A scrub knows what a read would learn: mark it lost so lookups stop offering it
            # (``repair`` restores it if its targets come back).
            unmarked = ""
            if where == "entries":
                try:
                    parts.fragments.mark_lost(ek, m)
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
        written_at = parts.clock()  # of the files rebuild writes (``FragmentStore.check_in_time``)
        taken: list[tuple[str, str]] = []  # paths rebuild took: held until recorded or given up
        unrecorded = ""  # why the fragments rewritten were not recorded (written, so not "not rebuilt")
        try:
            try:
                rebuilt = rebuild(parts, ek, m, good, bad, why, taken) if (fixing and bad) else (
                    (m, set()) if fixing else None)
            except lmdb.MapFullError as exc:  # a path take: nothing indexed; files in new places are orphans
                map_full, rebuilt = exc, None
                why.update({i: MAP_FULL_WHY for i in bad})
            fixed_meta, fixed = rebuilt if rebuilt is not None else (None, set())
            if fixed_meta is not None and where == "entries" and not fixed:
                fixed_meta = None  # nothing rewritten: the record stands as it is
            if fixing and fixed_meta is not None:
                try:
                    if not record_repair(parts, ek, m, fixed_meta, where, written_at):
                        unrecorded = "the entry changed while it was rebuilt"
                except WrittenTooLongAgo as exc:  # a sweep may be deleting them: not recorded
                    unrecorded = str(exc)
                except lmdb.MapFullError as exc:  # its one transaction aborted: the record as it was
                    map_full, unrecorded = exc, MAP_FULL_WHY
        finally:
            if taken:
                parts.index.release_paths(taken)  # never raises an LMDB error: the check goes on
        for i, p in bad.items():
            if unrecorded and i in fixed:
                detail = f"{p.detail}; {unrecorded_detail(m, fixed_meta, i, unrecorded)}"
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
        detail = (f"could not be reached (or this process could not open its files); {n} entries with "
                  "fragments on it were not checked")
        if name in down:
            problems = [replace(p, detail=f"{p.detail}; {n} entries with fragments on it were not checked")
                        if p.kind is ProblemKind.TARGET_DOWN and p.target == name and not p.key else p
                        for p in problems]
        else:
            problems.append(Problem(ProblemKind.TARGET_DOWN, target=name, detail=detail))
            down.append(name)
    # A target reported down above is not swept: its failed listing would report it down twice.
    _, _, orphans = sweep_orphans(parts, parts.file_clock(), not fix, parts.config.orphan_grace_s, progress,
                                   skip=down)
    problems.extend(orphans)
    if map_full is not None:
        log.error("%s: the index map is full (%s); %s", "repair" if fix else "check", map_full, MAP_FULL_WHY)
    return problems, map_full


def repair(parts: StoreParts, progress: Progress | None = None) -> dict:
    """``check(fix=True)`` summarised: what was rebuilt, restored, and what stays lost
    (``orphans_kept``: orphans that could not be deleted; ``targets_down``: targets that
    could not be asked; ``still_lost``: the lost records left in the index, examined or not;
    ``unfixed_detail``: the first ``UNFIXED_DETAIL_MAX`` fragments left as they were, each with
    why, as ``check`` lists them, so the reason is in the answer, not only in the log).
    Raises ``CapacityExceeded`` (its ``result`` the counts above) when the index map was full
    (``_check``): the pass ran to its end, rebuilding nothing after that; never a raw
    ``lmdb.MapFullError``."""
    problems, map_full = _check(parts, fix=True, progress=progress)
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
    with parts.index.env.begin() as txn:  # also those not examined (their targets could not be asked)
        out["still_lost"] = max(out["still_lost"], txn.stat(parts.index.db["lost"])["entries"])
    if map_full is not None:
        raise CapacityExceeded(
            f"the index map is full ({map_full}): repair stopped rebuilding; nothing half-recorded, the rest of "
            f"the pass ran. Raise lmdb_map_size (now {parts.config.lmdb_map_size} bytes) in the store config "
            f"([store] lmdb_map_size, or {ENV_PREFIX}LMDB_MAP_SIZE), or free entries, and run repair again",
            result=out) from map_full
    return out
