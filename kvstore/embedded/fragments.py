"""The fragment store of the embedded store: its one part for fragment and pack files, and what
ties them to the index.

``FragmentStore`` owns a ``FragmentReader`` (``kvstore.embedded.fragment_reads``: read, verify,
decode) and a ``FragmentWriter`` (``kvstore.embedded.fragment_writes``: encode, place, publish,
remove), built over the targets, the erasure code and the config it is given, and holds the
index handle and clocks for what joins files to records: the checks made inside the index
transaction that publishes files (``check_in_time``, ``check_unswept_txn``), marking an
unreadable entry lost (``mark_lost``), compaction of a pack that is mostly dead (``rewrite``)
and the checks of packs a direct writer wrote before they are indexed (``check_written``).

The embedded store (``kvstore.embedded.store``) drives it for puts, gets and commits;
maintenance (``kvstore.maintenance``) reaches it through ``kvstore.embedded.parts.StoreParts``.
Where packs sit in the write path is in ``kvstore.embedded.store``'s docstring; their names in
``kvstore.embedded.targets``; their bookkeeping (record counts, dead bytes, the compaction
queue) in ``kvstore.embedded.index`` invariant 6; when GC compacts them in ``kvstore.maintenance.gc``.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import lmdb

from kvstore.api import EntryKind, as_payload
from kvstore.config import StoreConfig, TargetSpec
from kvstore.embedded import codec
from kvstore.embedded.fragment_reads import FragmentReader
from kvstore.embedded.fragment_writes import FragmentWriter, expiry_ns
from kvstore.embedded.index import STANDALONE, Index, Meta, packed_bytes
from kvstore.embedded.packs import WrittenEntry
from kvstore.embedded.segments import Segment, Segments
from kvstore.embedded.targets import Target, TargetPools, pack_path
from kvstore.errors import CapacityExceeded, CorruptData, InvalidRequest, StoreUnavailable, Unrecoverable

log = logging.getLogger("kvstore.embedded.store")


class WrittenTooLongAgo(StoreUnavailable):
    """Files about to be indexed were written over ``orphan_grace_s / 2`` ago: an orphan sweep
    (GC, ``check(fix=True)``, in this process or another) may be removing them, so they are
    not indexed (``FragmentStore.check_in_time``). Raised inside the index transaction, which
    it aborts; the writer removes its files and the put stores nothing."""


class IndexFull(CapacityExceeded):
    """The index commit of new records found no room on the index's filesystem (ENOSPC;
    ``kvstore.embedded.diskroom``): nothing was indexed, and the writer removes its files."""


class FilesSwept(StoreUnavailable):
    """Files about to be indexed were taken by an orphan sweep (``kvstore.maintenance.orphans``: a hold
    record sits on the path of one, or, the sweep count having moved since the writer read it,
    one is gone or cannot be asked): ``FragmentStore.check_unswept_txn``. Raised inside the index
    transaction, which it aborts; the writer removes its files and stores nothing (a put
    writes them again, under a new generation)."""


class GenerationTaken(StoreUnavailable):
    """Pack generations about to be indexed (``gens``) already hold indexed entries: another
    commit claimed them between this one's checks and its index transaction (``EmbeddedStore.commit_written``).
    Raised inside that transaction, which it aborts: nothing of the commit is indexed."""

    def __init__(self, gens: Sequence[bytes]):
        super().__init__(f"pack generations {', '.join(g.hex() for g in gens)} already hold indexed entries")
        self.gens = tuple(gens)


@dataclass(frozen=True, slots=True)
class WrittenCheck:
    """What ``FragmentStore.check_written`` found: per entry its index record (``(ek, meta)``);
    the packs rejected (generation -> why; one rejects them all); the sweep count read before
    the packs were looked at; when the oldest pack was written (on ``clock``); and the
    ``(target, rel)`` of every pack to index, for ``FragmentStore.check_unswept_txn``."""

    records: list[tuple[bytes, Meta]]
    rejected: dict[bytes, str]
    since: int
    written_at: float
    unswept: list[tuple[str, str]]


class FragmentStore:
    """The fragment and pack files of one store, and their ties to its index (module docstring)."""

    def __init__(self, config: StoreConfig, targets: dict[str, Target], target_specs: Sequence[TargetSpec],
                 code: Any, index: Index, *, pool: Executor, batch_pool: Executor, count: Callable[..., None],
                 clock: Callable[[], float], file_clock: Callable[[], float], now_ns: Callable[[], int],
                 sync_mode: str | None = None):
        self.config = config
        self.targets = targets
        self.target_specs = target_specs
        self.code = code
        self.index = index
        self.clock = clock
        self.file_clock = file_clock
        self.now_ns = now_ns
        self._count = count
        self.pools = TargetPools(config.read_workers)
        self.reader = FragmentReader(config, targets, self.pools, pool, count=count, mark_lost=self.mark_lost)
        self.writer = FragmentWriter(config, targets, target_specs, code, self.pools, pool, batch_pool,
                                     count=count, now_ns=now_ns, sync_mode=sync_mode,
                                     on_pack_deleted=self.reader.forget_pack)
        if config.segments and Segments.usable(targets, config.write_timeout_s):
            self.writer.segments = Segments(targets, segment_bytes=config.segment_bytes,
                                            sync_mode=self.writer.sync_mode, count=count,
                                            on_retired=self._segment_retired,
                                            on_unindexed=self._segment_unindexed, roots=self.writer.roots)

    def _segment_retired(self, gen: bytes, appended: int) -> None:
        """Count the bytes of a retired segment that no record names (appends whose put failed or
        lost every race) as its dead bytes (``kvstore.embedded.index`` invariant 6), so that
        compaction sees them."""
        with self.index.env.begin(write=True) as txn:
            info = self.index.pack_info(txn, gen)
            if info is not None and appended > info[1]:
                self.index.pack_dead_txn(txn, gen, appended - info[1])

    def _segment_unindexed(self, gen: bytes, names: Sequence[str]) -> None:
        """A retired segment in which this process indexed no record: its files go, decided in
        the index as the orphan sweep decides (``kvstore.maintenance.orphans``, step 1: a
        decision counted, each path held while its file is deleted), unless a record names the
        segment by then (``rebuild-index`` indexes unnamed packs). Best effort: what is left is
        an orphan the sweep removes."""
        rel = pack_path(gen)
        try:
            with self.index.env.begin(write=True) as txn:
                if self.index.pack_info(txn, gen) is not None:
                    return
                self.index.add_counter(txn, "sweep_decisions", 1)
                taken = [name for name in names if self.index.take_path_txn(txn, name, rel, "sweep")]
        except lmdb.Error as exc:
            log.warning("segment %s: its files are left to the orphan sweep (%s)", gen.hex(), exc)
            return
        try:
            for name in taken:
                try:
                    self.targets[name].delete(rel)
                except OSError as exc:
                    log.info("segment %s on %s: not removed (%s); the orphan sweep will", gen.hex(), name, exc)
        finally:
            if taken:
                try:  # counted again once the files are gone, before their holds go (as the sweep does)
                    with self.index.env.begin(write=True) as txn:
                        self.index.add_counter(txn, "sweep_decisions", 1)
                except lmdb.Error as exc:
                    log.warning("segment %s: its removal was not counted in the index (%s)", gen.hex(), exc)
                self.index.release_paths([(name, rel) for name in taken])

    def close(self) -> None:
        """Seal the active segment (``kvstore.embedded.segments``), close the writer's held
        filesystem descriptors and the reader's kept ones; called once no call is in flight,
        before the index closes."""
        if self.writer.segments is not None:
            self.writer.segments.close()
        self.writer.close()
        self.reader.close()

    # ------------------------------------------------------------------ publishing
    def check_in_time(self, written_at: float, what: str) -> None:
        """``WrittenTooLongAgo`` when files written from ``written_at`` (``clock``) on are over
        ``orphan_grace_s / 2`` old now. Called inside the write transaction that would index
        them, so after any wait for LMDB's writer lock: a sweep takes its time before reading
        which records exist, so files indexed within half the grace are never swept
        (``kvstore.maintenance.orphans``). A grace of 0 protects no write: nothing to check."""
        grace = self.config.orphan_grace_s
        took = self.clock() - written_at
        if grace and took > grace / 2:
            raise WrittenTooLongAgo(f"{what} took {took:.0f} s to reach the index, over orphan_grace_s/2 = "
                                    f"{grace / 2:.0f} s, so GC may be sweeping their files: nothing was stored; "
                                    "retry (in smaller batches), or raise orphan_grace_s")

    def check_unswept_txn(self, txn: Any, since: int, paths: Sequence[tuple[str, str]]) -> None:
        """``FilesSwept`` unless every file of ``paths`` (``(target, rel)``, all written after
        ``since`` was read from ``Index.sweep_decisions``) is safe from the orphan sweep. Called
        inside the write transaction that would index them, so no sweep decides meanwhile: a
        hold record on a path means a sweep is deleting it (whoever holds it, live or not); and
        a sweep count other than ``since`` means a sweep decided since, so each file must still
        be there (one stat per file, only then). See ``kvstore.maintenance.orphans`` for why that suffices."""
        for name, rel in paths:
            if self.index.path_recorded_txn(txn, name, rel):
                raise FilesSwept(f"{rel} on target {name} is being deleted by an orphan sweep (a GC with an "
                                 "orphan_grace_s shorter than this write took): nothing was stored")
        if self.index.sweep_decisions(txn) == since:
            return
        for name, rel in paths:
            try:
                self.targets[name].stat(rel)
            except OSError as exc:
                raise FilesSwept(f"{rel} on target {name} is gone since it was written ({exc}): an orphan sweep "
                                 "took it; nothing was stored") from exc

    def check_segments_txn(self, txn: Any, segments: Sequence[Segment]) -> None:
        """``FilesSwept`` unless every segment a put appended to (``kvstore.embedded.segments``,
        "Why appends are safe", 4) is still there to be indexed into: one that holds indexed
        records must still have its pack record (GC removes the files with the last one); one
        that holds none is checked as a new file is (``check_unswept_txn``), from the sweep count
        read before its first append. Called inside the write transaction that would index them."""
        for seg in segments:
            if seg.indexed:
                if self.index.pack_info(txn, seg.gen) is None:
                    raise FilesSwept(f"segment {seg.gen.hex()} was removed with its last record while this "
                                     "process still appended to it: nothing was stored")
            else:
                self.check_unswept_txn(txn, seg.since, [(name, pack_path(seg.gen)) for name in seg.written_on()])

    def note_indexed(self, segments: Sequence[Segment], gens: set[bytes]) -> None:
        """Inside the index transaction, before its commit: the ``segments`` among those a put
        appended to whose generation is in ``gens`` get a record (``Segments.mark_indexed``)."""
        for seg in segments:
            if seg.gen in gens:
                self.writer.segments.mark_indexed(seg)

    def mark_lost(self, ek: bytes, meta: Meta) -> None:
        """Move a record whose fragments are gone to ``lost`` (lookup stops offering it).
        Never for a record naming targets this store was not opened with: that is a
        configuration to correct, and marking would hide intact entries until a repair."""
        unknown = sorted(set(meta.targets) - set(self.targets))
        if unknown:
            log.error("entry %s names targets %s that this store was not opened with: not marked lost",
                      ek[1:].hex(), ", ".join(unknown))
            return
        self._count("unrecoverable")
        with self.index.env.begin(write=True) as txn:
            cur = self.index.get_meta(txn, ek)
            if cur is not None and cur.gen == meta.gen:
                self.index.mark_lost_txn(txn, ek, cur)
        log.error("entry %s marked lost", ek[1:].hex())

    # ------------------------------------------------------------------ packs
    def check_written(self, entries: Sequence[WrittenEntry], shown: Sequence[bytes], now: int) -> WrittenCheck:
        """The checks ``EmbeddedStore.commit_written`` makes before its index transaction (its
        docstring): ``InvalidRequest`` for what only a wrong or malicious writer sends (nothing
        indexed); then each pack's, a failing one rejecting every pack of the commit."""
        cfg = self.config
        n = cfg.ec_k + cfg.ec_m
        placed: dict[tuple[bytes, str], list[tuple[int, int]]] = {}  # (gen, target) -> (offset, length)
        records = []
        for j, e in enumerate(entries):
            what = f"written entry {(shown[j] if j < len(shown) else e.ek[1:]).hex()}"
            if (e.k, e.m) != (cfg.ec_k, cfg.ec_m):
                raise InvalidRequest(f"{what}: erasure code {e.k}+{e.m}; this store uses {cfg.ec_k}+{cfg.ec_m}")
            if len(e.targets) != n or len(set(e.targets)) != n or any(t not in self.targets for t in e.targets):
                raise InvalidRequest(f"{what}: needs {n} distinct targets of this store, got {list(e.targets)}")
            if len(e.offsets) != n or STANDALONE in e.offsets or len(e.gen) != 8:
                raise InvalidRequest(f"{what}: needs an 8-byte generation and {n} pack offsets")
            # The bytes are not read, so the sizes a quota charges must follow from what is checked:
            # the fragments (their packs' lengths are) hold at most padding beyond the entry, and
            # the entry at most a header beyond its payload (compressed: less): no writer declares
            # plain_len=0 for a megabyte of fragments and is charged nothing.
            share = e.frag_len - codec.FRAG_HEADER_LEN - (self.code.data_lead or 0)
            if not (0 <= e.plain_len <= cfg.max_value_bytes and 0 < e.entry_len <= e.k * share
                    and e.k * share - e.entry_len <= e.k * codec.MAX_SHARE_PADDING
                    and e.entry_len <= e.plain_len + codec.ENTRY_HEADER_MAX
                    and codec.FRAG_HEADER_LEN < e.frag_len and 0 <= e.tokens < 2**32):
                raise InvalidRequest(f"{what}: inconsistent sizes (plain {e.plain_len}, entry {e.entry_len}, "
                                     f"fragment {e.frag_len}) or tokens {e.tokens}")
            records.append((e.ek, Meta(e.k, e.m, e.tokens, e.plain_len, e.entry_len, e.frag_len, now, now,
                                       expiry_ns(e.ttl_s, cfg.default_ttl_s, now), e.gen, e.targets,
                                       offsets=e.offsets)))
            for name, off in zip(e.targets, e.offsets):
                placed.setdefault((e.gen, name), []).append((off, e.frag_len))
        rejected: dict[bytes, str] = {}
        need: dict[tuple[bytes, str], int] = {}  # (gen, target) -> the pack's length, its fragments end to end
        for (gen, name), frags in placed.items():
            at = 0
            for off, flen in sorted(frags):
                if off != at:  # a gap no record would count (or charge), or two records on one range
                    rejected[gen] = (f"pack {gen.hex()} on target {name}: its entries' fragments do not lie end "
                                     f"to end from its start (one at {off}, expected at {at})")
                    break
                at = off + flen
            need[(gen, name)] = at
        with self.index.env.begin() as txn:
            since = self.index.sweep_decisions(txn)  # before the stats below (``check_unswept_txn``)
            for g in {g for g, _ in need}:
                if self.index.pack_info(txn, g) is not None:  # another commit (another writer's?) took it
                    rejected[g] = (f"pack generation {g.hex()} already holds indexed entries; each batch is "
                                   "written under a fresh random generation")
        file_now, now_s = self.file_clock(), self.clock()
        oldest = file_now - cfg.orphan_grace_s / 2
        written_at = now_s  # of the oldest pack indexed, on ``clock`` (``check_in_time``)
        for (gen, name), size in need.items():
            if gen in rejected:
                continue
            try:
                got, mtime = self.targets[name].stat(pack_path(gen))
            except OSError as exc:  # FileNotFoundError included
                rejected[gen] = f"pack {gen.hex()} cannot be checked on target {name}: {exc}"
                continue
            if got != size:  # a writer's pack holds its entries' fragments and nothing else: no bytes unaccounted
                rejected[gen] = f"pack {gen.hex()} on target {name} has {got} bytes; its entries make {size}"
            elif mtime < oldest:
                rejected[gen] = (f"pack {gen.hex()} on target {name} was written more than orphan_grace_s/2 = "
                                 f"{cfg.orphan_grace_s / 2:.0f} s ago; GC may be sweeping it as an orphan")
            else:
                written_at = min(written_at, now_s - (file_now - mtime))
        if rejected:  # all or nothing, as put_many: the writer puts the whole batch another way
            why = next(iter(rejected.values()))
            for e in entries:
                rejected.setdefault(e.gen, f"another pack of this commit was rejected ({why})")
        return WrittenCheck(records, rejected, since, written_at,
                            sorted((name, pack_path(g)) for g, name in need if g not in rejected))

    def rewrite(self, members: Sequence[tuple[bytes, Meta]]) -> int:
        """Compaction (``kvstore.maintenance.gc``): read these live entries of one pack, write
        them into a new pack, and swap each record whose generation did not change meanwhile;
        the old records go to the graveyard (readers holding them finish within the grace)
        and the old pack goes with the last of them. Times, TTL and pin are kept (the new
        entry headers carry the record's created and expiry times, as a put's do). An entry
        that fails to read stays where it is (if lost, the read marked it; if its targets could
        not be asked, ``StoreUnavailable``, it is moved by a later pass); so does one that cannot
        be encoded again (logged). Entries are moved, not put: a put's admission limits
        (``max_value_bytes``, capacity), which may have been lowered since they were stored, do
        not apply (``FragmentWriter.encode_entry``; times are the old record's). Returns the count moved.
        ``StoreUnavailable`` (nothing moved; the pack stays queued) when the new pack cannot be
        written, or was written too long ago to be indexed safely (``check_in_time``), or an orphan
        sweep took it before it was indexed (``FilesSwept``, ``check_unswept_txn``)."""
        gen = os.urandom(8)
        with self.index.env.begin() as txn:  # before the new pack is written (``check_unswept_txn``)
            since = self.index.sweep_decisions(txn)
        encs = []
        for ek, m in members:
            try:
                h, plain = self.reader.read_verified(ek, m)
            except (Unrecoverable, StoreUnavailable) as exc:
                log.error("compaction: %s", exc)
                continue
            try:
                kind = EntryKind.from_code(ek[0])
                payload, lay = as_payload(bytes(plain), h.layout)
                encs.append((ek, m, self.writer.encode_entry(ek[1:], kind, payload, lay, h.tokens, gen,
                                                                 m.created_ns, m.expires_ns)))
            except (InvalidRequest, CorruptData) as exc:  # a record this version cannot write back
                log.warning("compaction: entry %s stays in pack %s: %s", ek[1:].hex(), m.gen.hex(), exc)
        if not encs:
            return 0
        started = self.clock()
        try:
            locs = self.writer.write_pack([e for _, _, e in encs], gen)
        except OSError as exc:  # the pack stays queued (``kvstore.maintenance.gc``): a later pass retries
            raise StoreUnavailable(f"compaction of {len(encs)} entries postponed: {exc}") from exc
        moved = 0
        now = self.now_ns()
        try:
            with self.index.env.begin(write=True) as txn:
                self.check_in_time(started, f"compacting {len(encs)} entries")
                self.check_unswept_txn(txn, since, sorted({(n, pack_path(gen)) for names, _ in locs for n in names}))
                dead = []
                for (ek, old, enc), (names, offs) in zip(encs, locs):
                    new = replace(enc.meta_base, targets=names, offsets=offs)
                    cur = self.index.get_meta(txn, ek)
                    if cur is None or cur.gen != old.gen:
                        dead.append(new)  # deleted, evicted or re-put meanwhile: our copy is dead on arrival
                        continue
                    self.index.remove_txn(txn, ek, cur, now)
                    self.index.insert_txn(txn, ek, replace(new, created_ns=cur.created_ns, access_ns=cur.access_ns,
                                                           expires_ns=cur.expires_ns, pinned=cur.pinned))
                    moved += 1
                for m in dead:  # counted once the pack has records (index invariant 6), as _index_new does
                    self.index.pack_dead_txn(txn, gen, packed_bytes(m))
        finally:  # nothing indexed (every copy dead on arrival, or too late: WrittenTooLongAgo; or
            # swept: FilesSwept; the old pack stays queued): the new pack goes
            if not moved:
                self.writer.discard_pack(gen, sorted({n for names, _ in locs for n in names}))
        self._count("compacted_entries", moved)
        return moved
