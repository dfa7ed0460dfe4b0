"""Rebuilding the index from the fragments on the targets (``kvtool rebuild-index``).

Every fragment is self-describing (``kvstore.embedded.codec``): its header names its entry (kind,
key as stored, generation, slot, k, m, entry length) and the entry it decodes to carries its
tokens, layout, created and expiry times. So the index can be recomputed from the targets:

1. **Scan.** Walk every target (``Target.walk``, local or object store), keeping only names the
   store writes: fragment files (``fragment_path``) and pack files (``pack_path``), grouped by
   generation. A target that cannot be walked is reported, not fatal: erasure coding may
   decode its entries from the others.
2. **Decode, one generation at a time.** Read that generation's pack files whole and split
   them into fragments (``codec.split_pack``), plus its fragment files; keep each fragment
   whose checksum verifies and whose header agrees with where it was found; group by entry.
   An entry with at least k good fragments is decoded and its entry checksum verified, as a
   read does: only then does it count (one over ``max_value_bytes`` does not: raise the
   limit and run again). Nothing unverified is indexed, so a rebuilt store never returns a
   wrong byte; an entry that does not decode is counted and left to GC.
3. **Choose.** One record per entry key: of several generations (a re-put after a delete
   whose files were not purged yet, a compaction's old pack), the latest created wins; an
   entry whose expiry has passed is left out (GC sweeps its files as orphans). A slot whose
   fragment was found nowhere is recorded on a target placement ranks for the key, as a file
   of its own: ``verify`` reports it missing and ``repair`` rebuilds it there.
4. **Index** the records (``Index.insert_txn``: orderings, counters, pack records); a pack's
   bytes that no chosen record names are counted dead (``Index.pack_dead_txn``), so GC
   compacts it as it would have.

Two callers:

* ``rebuild_index(config)``: a data directory whose index is missing, emptied, truncated,
  garbled or another directory's (every open refuses it with ``CorruptData``). Builds a new
  index in ``<data_dir>/index.rebuild`` from every fragment (no age limit: no process can
  use the directory meanwhile, as every open refuses it), under the identity and erasure code
  the marker records, then moves the damaged index aside (``index.damaged-<UTC time>``, never
  deleted) and the new one into place. Until that rename the directory still refuses every
  open, so a GC elsewhere never sees an empty index and sweeps the fragments as orphans.
  Stop every process using the directory first.
* ``reindex_store(store)``: an open store (``EmbeddedStore.rebuild_index``; a daemon's
  ``Maintain`` op ``rebuild-index``): adds the entries found on the targets whose generation
  no record of the index names, and whose files are older than ``orphan_grace_s`` (younger
  ones may be a put in flight, which indexes them itself). A generation an index record
  names is never added to: its other entries lost a put race or were deleted. Use: an
  index restored from an older copy. GC in another process on the same directory must not
  run meanwhile (the daemon's own passes are serialised with it): its orphan sweep removes
  exactly the files this indexes.

What a rebuilt record does not have back: its pin (entries come back unpinned), its last
access (set to its creation, so LRU evicts rebuilt entries oldest first), and its lost
state (an entry that does not decode is not indexed). An entry deleted, evicted or expired
whose files GC had not removed yet (they wait ``delete_grace_s`` and the next gc) comes back
from a rebuild of a lost index, unless expired: its bytes are the ones put under its key,
so no read is wrong, but the delete is undone. A daemon's per-tenant quota usage
(``<data_dir>/server/quota``) is kept as it was, not recomputed.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvstore.embedded import codec
from kvstore.api import EntryKind
from kvstore.config import StoreConfig
from kvstore.embedded.durability import fsync_dir
from kvstore.errors import CorruptData, IncompatibleFormat, InvalidRequest
from kvstore.embedded.index import STANDALONE, Index, Meta, ekey, packed_bytes
from kvstore.embedded.placement import place
from kvstore.embedded.targets import Target, open_target, pack_path, parse_fragment_path, parse_pack_path

from kvstore.embedded.datadir import DataDir, with_recorded_targets
from kvstore.embedded.parts import StoreParts

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
INSERT_BATCH = 4096  # records per index write transaction
NEW_INDEX, DAMAGED_PREFIX = "index.rebuild", "index.damaged-"


def _no_progress(phase: str, done: int, total: int) -> None:
    pass


@dataclass(slots=True)
class _Generation:
    """What the scan found of one generation: its pack files (target -> size) and its fragment
    files (target, path, entry key, slot)."""

    packs: dict[str, int] = field(default_factory=dict)
    files: list[tuple[str, str, bytes, int]] = field(default_factory=list)


@dataclass(slots=True)
class _Counts:
    """The result's counters (``as_dict``)."""

    targets_down: list[str] = field(default_factory=list)
    generations: int = 0
    fragments_bad: int = 0  # a checksum or header that does not verify, or a file that cannot be read
    entries_undecodable: int = 0  # fewer than k good fragments, or the entry does not verify
    entries_expired: int = 0
    entries_superseded: int = 0  # an older generation of an entry key found with a newer one
    entries_degraded: int = 0  # indexed with fragments missing: `kvtool repair` rebuilds them
    already_indexed: int = 0  # generations a record names, and entry keys indexed meanwhile (``reindex_store``)
    skipped_young: int = 0  # generations whose files are younger than orphan_grace_s (``reindex_store``)
    indexed: Counter = field(default_factory=Counter)  # kind name -> records indexed

    def as_dict(self) -> dict:
        return {"entries": sum(self.indexed.values()), "by_kind": dict(self.indexed),
                "generations": self.generations, "fragments_bad": self.fragments_bad,
                "entries_undecodable": self.entries_undecodable, "entries_expired": self.entries_expired,
                "entries_superseded": self.entries_superseded, "entries_degraded": self.entries_degraded,
                "already_indexed": self.already_indexed, "skipped_young": self.skipped_young,
                "targets_down": list(self.targets_down)}


def _scan(targets: dict[str, Target], counts: _Counts, progress: Progress,
          newer_than: float | None, known: set[bytes]) -> dict[bytes, _Generation]:
    """Step 1: every target's fragment and pack files, by generation. A generation in ``known``
    is left out (``already_indexed``); so, with ``newer_than`` (a file time), is one with any
    file modified after it (``skipped_young``)."""
    gens: dict[bytes, _Generation] = {}
    young: set[bytes] = set()
    skipped_known: set[bytes] = set()
    names = list(targets)
    progress("scan", 0, len(names))
    for n, name in enumerate(names, 1):
        try:
            for rel, size, mtime in targets[name].walk():
                gen = parse_pack_path(rel)
                frag = None if gen is not None else parse_fragment_path(rel)
                if frag is not None:
                    gen = frag[2]
                if gen is None:
                    continue  # not a name the store writes (a .tmp. file, an operator's file)
                if gen in known:
                    skipped_known.add(gen)
                    continue
                if newer_than is not None and mtime > newer_than:
                    young.add(gen)
                g = gens.setdefault(gen, _Generation())
                if frag is None:
                    g.packs[name] = size
                else:
                    g.files.append((name, rel, ekey(frag[0], frag[1]), frag[3]))
        except OSError as exc:  # TargetUnavailable, TargetUnreachable, a listing that failed
            log.warning("rebuild-index: target %s not scanned: %s", name, exc)
            counts.targets_down.append(name)
        progress("scan", n, len(names))
    counts.skipped_young, counts.already_indexed = len(young), len(skipped_known)
    for gen in young:
        del gens[gen]
    return gens


# A fragment found: (target, offset in its pack or None for a file of its own, header, bytes)
_Found = tuple[str, "int | None", codec.FragmentHeader, memoryview]


def _fragments(targets: dict[str, Target], gen: bytes, g: _Generation, counts: _Counts) -> dict[bytes, list[_Found]]:
    """Step 2's reading: every verified fragment of generation ``gen``, by entry key."""
    out: dict[bytes, list[_Found]] = {}
    for name, _size in sorted(g.packs.items()):
        try:
            raw = memoryview(targets[name].read(pack_path(gen)))
        except OSError as exc:
            log.warning("rebuild-index: pack %s on %s unreadable: %s", gen.hex(), name, exc)
            counts.fragments_bad += 1
            continue
        for off, piece in codec.split_pack(raw):
            try:
                fh, _ = codec.parse_fragment(piece, max_body=len(piece))
            except (CorruptData, IncompatibleFormat):
                counts.fragments_bad += 1
                continue
            if fh.gen != gen:  # a fragment of another batch inside this pack: not where its record would say
                counts.fragments_bad += 1
                continue
            out.setdefault(ekey(fh.kind_code, fh.key), []).append((name, off, fh, piece))
    for name, rel, ek, slot in g.files:
        try:
            raw = memoryview(targets[name].read(rel))
            fh, _ = codec.parse_fragment(raw, max_body=len(raw))
        except (OSError, CorruptData, IncompatibleFormat) as exc:
            log.warning("rebuild-index: fragment %s on %s unusable: %s", rel, name, exc)
            counts.fragments_bad += 1
            continue
        if (fh.gen, fh.index, ekey(fh.kind_code, fh.key)) != (gen, slot, ek):  # not the fragment its name says
            counts.fragments_bad += 1
            continue
        out.setdefault(ek, []).append((name, None, fh, raw))
    return out


def _decode(ek: bytes, found: list[_Found], ec_type: str, specs: list, max_plain: int,
            counts: _Counts) -> Meta | None:
    """Step 2's decoding: the record of entry ``ek`` from its fragments of one generation, or
    ``None`` when fewer than k agree and verify, or the entry does not verify."""
    # The fragments of one entry agree on its shape; a stray one that does not is not counted.
    shape = Counter((fh.k, fh.m, fh.entry_len, fh.body_len) for _, _, fh, _ in found).most_common(1)[0][0]
    k, m, entry_len, body_len = shape
    slots: dict[int, _Found] = {}
    for f in found:
        fh = f[2]
        if (fh.k, fh.m, fh.entry_len, fh.body_len) != shape or fh.index >= k + m:
            counts.fragments_bad += 1
        elif fh.index not in slots or (slots[fh.index][1] is not None and f[1] is None):
            slots[fh.index] = f  # a file of its own (repair's copy) over the pack's, as the record would have it
    bodies = {i: f[3][codec.FRAG_HEADER_LEN:] for i, f in sorted(slots.items())}
    try:
        if len(bodies) < k:
            raise CorruptData(f"{len(bodies)} good fragments, needs {k}")
        code = codec.erasure_code(k, m, ec_type)
        pieces = code.data_pieces(bodies)
        try:
            if pieces is None:
                raise CorruptData("not all data fragments at hand")
            h, _ = codec.decode_entry_pieces(pieces, max_plain=max_plain)
        except CorruptData:
            h, _ = codec.decode_entry(code.decode(bodies)[:entry_len], max_plain=max_plain)
        if h.key != ek[1:] or h.kind.code != ek[0]:
            raise CorruptData("the decoded entry names another key")
    except (CorruptData, IncompatibleFormat, InvalidRequest) as exc:
        log.warning("rebuild-index: %s entry %s (generation %s) not indexed: %s",
                    EntryKind.from_code(ek[0]).value, ek[1:].hex(), found[0][2].gen.hex(), exc)
        counts.entries_undecodable += 1
        return None
    targets: list[str | None] = [slots[i][0] if i in slots else None for i in range(k + m)]
    packed = any(f[1] is not None for f in slots.values())
    offsets = [slots[i][1] if i in slots and slots[i][1] is not None else STANDALONE for i in range(k + m)]
    if None in targets:  # on the target placement ranks first among those holding none of its others, as a
        # file of its own: repair rebuilds it there (a lost disk replaced by an empty one: that disk)
        counts.entries_degraded += 1
        spare = [t for t in place(ek[1:], specs, len(specs)) if t not in targets]
        targets = [t if t is not None else spare.pop(0) if spare else "" for t in targets]
        if "" in targets:
            counts.entries_undecodable += 1  # more slots than configured targets: nowhere to name
            return None
    return Meta(k=k, m=m, tokens=h.tokens, plain_len=h.plain_len, entry_len=entry_len,
                frag_len=codec.FRAG_HEADER_LEN + body_len, created_ns=h.created_ns, access_ns=h.created_ns,
                expires_ns=h.expires_ns, gen=found[0][2].gen, targets=tuple(targets),
                offsets=tuple(offsets) if packed else ())


def _collect(targets: dict[str, Target], gens: dict[bytes, _Generation], specs: list, ec_type: str,
             max_plain: int, now_ns: int, counts: _Counts, progress: Progress) -> dict[bytes, Meta]:
    """Steps 2 and 3: one record per entry key."""
    chosen: dict[bytes, Meta] = {}
    order = sorted(gens)
    progress("decode", 0, len(order))
    for n, gen in enumerate(order, 1):
        counts.generations += 1
        for ek, found in _fragments(targets, gen, gens[gen], counts).items():
            m = _decode(ek, found, ec_type, specs, max_plain, counts)
            if m is None:
                continue
            if m.expired(now_ns):
                counts.entries_expired += 1
                continue
            old = chosen.get(ek)
            if old is not None:
                counts.entries_superseded += 1
                if (old.created_ns, old.gen) > (m.created_ns, m.gen):
                    continue
            chosen[ek] = m
        progress("decode", n, len(order))
    return chosen


def _index(index: Index, chosen: dict[bytes, Meta], gens: dict[bytes, _Generation], counts: _Counts,
           progress: Progress, *, merge: bool) -> None:
    """Step 4: the records into ``index``, ``INSERT_BATCH`` per transaction. With ``merge`` (an
    index in use) a key it holds (live or lost, put meanwhile) is left as it is."""
    items = sorted(chosen.items())
    progress("index", 0, len(items))
    claimed: Counter = Counter()  # pack generation -> bytes of it the indexed records name
    for start in range(0, len(items), INSERT_BATCH):
        with index.env.begin(write=True) as txn:
            for ek, m in items[start:start + INSERT_BATCH]:
                # (its generation was no record's at the scan, and its files were too old for a writer to index)
                if merge and (index.get_meta(txn, ek) is not None or index.get_lost(txn, ek) is not None):
                    counts.already_indexed += 1
                    continue
                index.insert_txn(txn, ek, m)
                counts.indexed[EntryKind.from_code(ek[0]).value] += 1
                if m.offsets:
                    claimed[m.gen] += packed_bytes(m)
        progress("index", min(start + INSERT_BATCH, len(items)), len(items))
    with index.env.begin(write=True) as txn:  # the rest of each pack is dead bytes (index invariant 6)
        for gen, nbytes in claimed.items():
            dead = sum(gens[gen].packs.values()) - nbytes
            if dead > 0:
                index.pack_dead_txn(txn, gen, dead)


def _known_generations(index: Index) -> set[bytes]:
    """Every generation a record of ``index`` names (live, lost, deleted), and every pack's."""
    out: set[bytes] = set()
    with index.env.begin() as txn:
        for db in ("entries", "lost"):
            for _ek, raw in index.iter_db(txn, db):
                out.add(index.unpack(txn, raw).gen)
        for _k, raw in index.iter_db(txn, "grave"):
            out.add(index.unpack(txn, raw).gen)
        out.update(bytes(g) for g, _ in index.iter_db(txn, "packs"))
    return out


def _run(index: Index, targets: dict[str, Target], specs: list, config: StoreConfig, now_ns: int,
         progress: Progress, *, newer_than: float | None, known: set[bytes] = frozenset()) -> _Counts:
    counts = _Counts()
    started = time.monotonic()
    gens = _scan(targets, counts, progress, newer_than, known)
    chosen = _collect(targets, gens, specs, config.ec_type, config.max_value_bytes, now_ns, counts, progress)
    _index(index, chosen, gens, counts, progress, merge=newer_than is not None)
    log.info("rebuild-index: %d entries indexed in %.1f s", sum(counts.indexed.values()), time.monotonic() - started)
    return counts


def reindex_store(parts: StoreParts, progress: Progress | None = None) -> dict:
    """Add to an open store's index the entries found on its targets that it does not know
    (module docstring, second caller). Returns the counts (``_Counts.as_dict``)."""
    progress = progress or _no_progress
    started = time.monotonic()
    newer_than = parts.file_clock() - parts.config.orphan_grace_s
    counts = _run(parts.index, parts.targets, list(parts.target_specs), parts.config, parts.now_ns(), progress,
                  newer_than=newer_than, known=_known_generations(parts.index))
    return {**counts.as_dict(), "rebuilt": False, "seconds": round(time.monotonic() - started, 3)}


def rebuild_index(config: StoreConfig, progress: Progress | None = None) -> dict:
    """Build a new index for the data directory ``config.data_dir`` from the fragments on its
    targets, and put it in place of the one there, which is moved aside (module docstring,
    first caller). ``config`` as for ``kvstore.connect``: the targets and erasure code the
    marker records are used where it names none. Returns the counts, ``rebuilt`` True and
    ``moved_aside`` (the damaged index's new path, or ``None`` when there was none)."""
    progress = progress or _no_progress
    started = time.monotonic()
    data_dir = Path(config.data_dir).resolve()
    opener = DataDir(data_dir)
    marker = opener.read_marker()  # IncompatibleFormat for another format version: never misread
    if marker is None:
        raise InvalidRequest(f"{data_dir} has no kvstore.json: rebuild-index needs it (it records the erasure code "
                             "and the targets)")
    config = opener.resolve_code(with_recorded_targets(config, marker), marker)
    specs = list(config.resolved_targets())
    targets = {s.name: open_target(s) for s in specs}
    new_dir = data_dir / NEW_INDEX
    shutil.rmtree(new_dir, ignore_errors=True)  # an earlier run's, stopped before its rename
    index = Index(str(new_dir), map_size=config.lmdb_map_size, sync=config.fsync, max_readers=config.max_readers,
                  compact_ratio=config.pack_compact_ratio)
    try:
        ident = bytes.fromhex(marker["index_id"]) if marker.get("index_id") else os.urandom(16)
        index.settle(ident, lambda txn: {n: getattr(config, n) for n in ("ec_type", "ec_k", "ec_m")})
        counts = _run(index, targets, specs, config, time.time_ns(), progress, newer_than=None)
    finally:
        index.close()
    old = data_dir / "index"
    aside = None
    if old.exists():
        stamp = time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())
        aside, n = data_dir / f"{DAMAGED_PREFIX}{stamp}", 1
        while aside.exists():  # another rebuild within the same second
            aside, n = data_dir / f"{DAMAGED_PREFIX}{stamp}.{n}", n + 1
        os.rename(old, aside)
    os.rename(new_dir, old)
    fsync_dir(str(data_dir))
    log.info("rebuild-index: a new index for %s from its fragments%s", data_dir,
                f"; the damaged one is at {aside}" if aside else "")
    return {**counts.as_dict(), "rebuilt": True, "moved_aside": str(aside) if aside else None,
            "seconds": round(time.monotonic() - started, 3)}
