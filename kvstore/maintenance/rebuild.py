"""Rebuilding the bad fragments of one record, and recording what was rebuilt (``repair``).

Called by ``kvstore.maintenance.check`` (``fix=True``), which keeps the rest of a repair pass:
scanning, deciding what to rebuild, reporting. Split out of it to keep each module short;
its log lines go under ``kvstore.maintenance.check``, where an operator looks for repair's.

Contracts (each function's docstring has the details):
  * ``rebuild`` writes files only: a fragment in a new place only once its path is held in the
    index (``kvstore.embedded.pathholds``), and every path it takes is in ``taken`` for the caller to
    give back, whatever happens after (an LMDB error included).
  * ``record_repair`` is the one index write of a rebuild, in one transaction: either the record
    names every rebuilt file, or (an error, the record moved) it is left as it was, and the new
    files are orphans the GC sweep removes after ``orphan_grace_s``.
  * An LMDB error (``lmdb.MapFullError`` when the index map is full) from either is raised to
    the caller, with nothing indexed (``check`` turns it into unfixed problems).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kvstore.embedded import codec
from kvstore.embedded.index import STANDALONE, Meta
from kvstore.embedded.placement import by_spread, place
from kvstore.embedded.targets import fragment_path

from kvstore.embedded.parts import StoreParts
from kvstore.maintenance.problems import Problem

log = logging.getLogger("kvstore.maintenance.check")  # repair's log lines, wherever its code lives


def rebuild(parts: StoreParts, ek: bytes, m: Meta, good: dict[int, bytes],
             bad: dict[int, Problem], why: dict[int, str],
             taken: list[tuple[str, str]]) -> tuple[Meta, set[int]] | None:
    """Rewrite the bad fragments (same target if it is up, else a healthy spare): (new Meta, the
    fragments rewritten), or None when the entry cannot be rebuilt (it does not decode). A
    fragment no target takes stays as it was, the others are rewritten all the same (as much
    redundancy as the healthy targets allow; every file written is in the returned Meta).
    A rebuilt fragment is always its own file: a packed one is marked ``STANDALONE``.
    ``why`` gets, per fragment left as it was, the reason (what ``repair`` tells its caller).
    A file in a new place (a target, or a file of its own, the record did not have for the
    slot) is written only once its path is taken (``Index.take_path_txn``): an orphan sweep
    may be deleting a stale copy there (``kvstore.maintenance.orphans``). ``taken`` gets each path taken,
    for the caller to give back once the record is written or given up."""
    code = codec.erasure_code(m.k, m.m, parts.config.ec_type)
    try:
        rebuilt = code.reconstruct(good, sorted(bad))
        # Verify before writing anything: the whole entry must decode and check out.
        full = dict(good)
        full.update(rebuilt)
        parts.fragments.reader.decode(m, ek, {i: full[i] for i in sorted(full)[: m.k + m.m]}, [])
    except Exception as exc:  # noqa: BLE001 - any failure here means "cannot rebuild now"
        log.error("cannot rebuild %s: %s", ek[1:].hex(), exc)
        why.update({i: f"the entry does not decode from its good fragments: {exc}" for i in bad})
        return None
    targets = list(m.targets)
    offsets = list(m.offsets)
    done: set[int] = set()
    for i, body in rebuilt.items():
        frame = codec.frame_fragment(codec.FragmentHeader(i, m.k, m.m, ek[0], ek[1:], m.gen, m.entry_len, len(body)), body)
        # its own target first, unless no longer configured (replaced by a new one): then a spare
        spares = [n for n in place(ek[1:], parts.target_specs, len(parts.target_specs)) if n not in targets]
        siblings = [t for j, t in enumerate(targets) if j != i]
        candidates = [targets[i]] * (targets[i] in parts.targets) + by_spread(spares, siblings, parts.target_specs)
        rel = fragment_path(ek[0], ek[1:], m.gen, i)
        for name in candidates:
            if (name, True) != (m.targets[i], not m.offsets or m.offsets[i] == STANDALONE):  # a new place
                with parts.index.env.begin(write=True) as txn:
                    mine = parts.index.take_path_txn(txn, name, rel, "repair")
                if not mine:
                    why[i] = f"target {name}: an orphan sweep is deleting a stale copy at its path"
                    continue
                taken.append((name, rel))
            try:
                parts.targets[name].write(rel, frame, fsync=parts.config.fsync)
                targets[i] = name
                if offsets:
                    offsets[i] = STANDALONE
                done.add(i)
                why.pop(i, None)  # an earlier candidate's failure no longer matters
                break
            except OSError as exc:
                log.warning("repair of %s fragment %d: target %s failed: %s", ek[1:].hex(), i, name, exc)
                why[i] = f"target {name}: {exc}"
        else:
            log.warning("repair of %s fragment %d: no healthy target took it; left as it was", ek[1:].hex(), i)
            why[i] = f"no target took it (last: {why[i]})" if i in why else "no other target to put it on"
    parts.counters.add("fragment_rewrites", len(done))
    return replace(m, targets=tuple(targets), offsets=tuple(offsets)), done


def record_repair(parts: StoreParts, ek: bytes, m: Meta, fixed_meta: Meta, where: str,
                   written_at: float) -> bool:
    """Index what ``rebuild`` wrote for record ``m`` of ``where`` ("entries" or "lost"): False
    when the record moved or went meanwhile (its new files are orphans). ``WrittenTooLongAgo``
    (nothing indexed) when those files were written over half the orphan grace ago, as for a
    put (``FragmentStore.check_in_time``): a sweep may be deleting them. A file in a new place
    is safe from the sweep while ``rebuild`` holds its path, so nothing here asks a target
    (inside this transaction, a target round trip would hold up every put)."""
    with parts.index.env.begin(write=True) as txn:
        parts.fragments.check_in_time(written_at, f"the repair of {ek[1:].hex()}")
        if where == "entries":
            cur = parts.index.get_meta(txn, ek)
            if cur is None or (cur.gen, cur.targets, cur.offsets) != (m.gen, m.targets, m.offsets):
                return False
            parts.index.update_txn(txn, ek, cur, replace(fixed_meta, access_ns=cur.access_ns, pinned=cur.pinned))
            return True
        cur = parts.index.get_lost(txn, ek)
        if cur is None or cur.gen != m.gen or parts.index.get_meta(txn, ek) is not None:
            return False
        parts.index.drop_lost_txn(txn, ek, fixed_meta, parts.now_ns(), to_grave=False)
        return True


def unrecorded_detail(m: Meta, fixed_meta: Meta, i: int, why: str) -> str:
    """What ``check`` says of fragment ``i`` of record ``m``, rewritten by ``rebuild`` (as in
    ``fixed_meta``) but not recorded for ``why``: rebuilt in place (its own target, a file of its
    own: the good file is at the path the record names) or on another target (a file no record
    names, for the orphan sweep); never "not rebuilt", since a good file was written."""
    name = fixed_meta.targets[i]
    if name == m.targets[i] and (not m.offsets or m.offsets[i] == STANDALONE):
        return f"rebuilt but not recorded (in place: the good file is at its recorded path on {name}): {why}"
    return f"rebuilt but not recorded (its new file on {name} is named by no record; GC sweeps it): {why}"
