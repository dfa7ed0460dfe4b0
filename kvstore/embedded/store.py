"""The embedded store: LMDB index + erasure-coded fragments on fsspec targets.

``kvstore.connect(path)`` returns an ``EmbeddedStore``. Several processes may
open the same data directory at once (LMDB serialises writers across
processes); within a process the store is thread-safe.

Data directory::

    <data_dir>/kvstore.json     format version, creation time, erasure code, index identity (kvstore.embedded.datadir)
    <data_dir>/index/           LMDB environment (see kvstore.embedded.index), and its spare file
                                space.reserve (kvstore.embedded.diskroom: room for deletions on a full disk)
    <data_dir>/targets/t0..tN   the embedded default targets (k+m, one failure domain)

Write path (``put``), in this order, each step for the reason given:
  1. Validate key, kind, layout and size: nothing is written for a bad request.
  2. If a live entry exists, refresh its access time and return ``False``: a
     re-put stores no second copy.
  3. Encode (header + zstd-if-it-pays), erasure-code into k+m fragments, under
     the generation of the segment the put appends to (or a fresh 8-byte one, so
     that file names are unique, where it writes files).
  4. On local targets (``kvstore.embedded.segments``): append each target's
     fragments of the whole put to this process's open segment file there, one
     positioned write per target, then one flush (a ``syncfs`` per filesystem, or an
     ``fdatasync`` per file) shared with the puts running at the same time; a failed
     append seals the segment and the put appends once more to a new one, then goes
     fragment by fragment. Elsewhere (object
     stores, ``write_timeout_s``, ``segments`` off): write every fragment atomically
     (tmp + fsync + rename + dir fsync) to its rendezvous-chosen target; a failing
     target is replaced by the next best.
     With ``sync_mode`` "fs" the files are written without fsync and made durable
     together, one syncfs per filesystem, once all are in place (``FragmentWriter.sync_after``).
     A batch (``put_many``, ``pack_batches``) instead writes one pack file per
     target holding that target's fragments of every entry, each published the
     same atomic way, so a batch costs one fsync pair per target, not per fragment.
     Writes that wait (fsync, remote targets) run on threads, per fragment or, in a
     batch, per entry; page-cache writes run inline (``parallel_writes``). With
     ``write_timeout_s`` every write runs on its target's own threads, and one that
     hangs past it fails as a failing target does (``FragmentWriter.run_writes``).
  5. Only then commit the index record (LMDB, fsync). A crash before 5 leaves
     orphan fragments that GC sweeps after ``orphan_grace_s`` (in a segment: bytes no
     record names); never an index record without its fragments. A segment removed
     while appended to is never indexed into (``FragmentStore.check_segments_txn``: the put
     writes again, into a new one). If another writer committed the same key first, our
     fragments are removed (or stay in the pack or segment until it goes) and the put
     returns ``False``. Files an orphan sweep took meanwhile (any process, any
     ``orphan_grace_s``) are not indexed (``FragmentStore.check_unswept_txn``): the put writes
     them again under a new generation, up to ``SWEPT_RETRIES`` times. Files started over
     ``orphan_grace_s / 2`` before the transaction got the writer lock are not indexed
     either (``FragmentStore.check_in_time``: for sweeps that do not record their decisions);
     the put raises ``StoreUnavailable``, nothing stored. Before step 3, a put whose index
     filesystem has no room for its spare file is refused (``kvstore.embedded.diskroom``).
  6. Above the capacity high watermark, evict LRU entries down to the low one.
A direct-writing client of the daemon (``kvstore.client.direct_writes``) does 1-4 itself
(as a batch: packs) and hands 5-6 to ``commit_written``, which checks its records first.

Where each step lives, in the order a put runs them: ``put_many`` (here) does 1-2 and makes one
``PendingEntry`` record per entry to write (``kvstore.embedded.fragment_writes``), which each later
step fills in; ``FragmentWriter.write_entries`` (there) does 3-4: encode, place, write packs or
fragments; ``_index_new`` (here) does 5-6, with the checks of 5 from ``FragmentStore``
(``kvstore.embedded.fragments``); last ``FragmentWriter.discard_unindexed`` removes the files of
entries that were not indexed.

Read path (``get``, ``kvstore.embedded.fragment_reads``): read the k data fragments (in parallel for remote targets), verify each one's
checksum and header against the index; on any failure read parity fragments
until k are good; decode; verify the entry checksum; return. Local targets first
try a fast path (``kvstore.embedded.fastread``: ``read_fast`` / ``read_scatter``): one
``preadv`` per data fragment (a pack's or segment's through a descriptor kept open,
``kvstore.embedded.openfiles``; a fragment file of its own after an open), headers checked against the index, fragment 0 (which
holds the entry header; with any other holding part of a small entry's) verified whole,
and the rest trusted only through the entry checksum over the assembled payload; anything unexpected falls back to the path above. Fewer than k good
fragments: mark the entry lost and raise ``Unrecoverable``. ``get_many_into``
is the same path, except that the decode writes the payload into the caller's
buffer (one copy from the fragment bodies) and the checksum is verified there; a ``get``
of a large raw entry does the same into the ``bytes`` it returns (``fastread.fresh_bytes``).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import lmdb

from kvstore.api import (Entry, EntryInfo, EntryKind, Layout, LookupResult, PutItem, check_chain_ends, check_put_items,
                         writable_view)
from kvstore.config import StoreConfig, load_config
from kvstore.embedded import stats as store_stats
from kvstore.embedded.access import AccessTimes
from kvstore.embedded.calls import CLOSE_WAIT_S, frees_space, in_flight
from kvstore.embedded.datadir import DataDir, file_url_path
from kvstore.embedded.diskroom import IndexRoom
from kvstore.embedded.fragment_writes import PendingEntry, written_files
from kvstore.embedded.fragments import FilesSwept, FragmentStore, GenerationTaken, IndexFull, WrittenTooLongAgo
from kvstore.embedded.index import Meta, ekey, packed_bytes
from kvstore.embedded.packs import CommitResult, WrittenEntry
from kvstore.embedded.parts import Counters, StoreParts
from kvstore.embedded.segments import Segment
from kvstore.embedded.tuning import tune_malloc
from kvstore.errors import CapacityExceeded, InvalidRequest, NotFound, StoreClosed, StoreUnavailable, Unrecoverable
from kvstore.executors import DaemonExecutor, shutdown_all
from kvstore.keys import check_key, check_keys
from kvstore.maintenance import check as maintenance_check
from kvstore.maintenance import eviction
from kvstore.maintenance import gc as maintenance_gc
from kvstore.maintenance import reindex

log = logging.getLogger(__name__)

POOL_JOIN_S = 1.0  # close() waits this long for its I/O workers once no call is in flight
SWEPT_RETRIES = 2  # a put whose files an orphan sweep took before its index commit writes them again this often


class EmbeddedStore:
    """In-process implementation of ``kvstore.api.KVStore``. See the module docstring.

    Its parts, each built once at open: ``datadir`` (marker, index identity, erasure code:
    ``kvstore.embedded.datadir``), ``index`` (LMDB: ``kvstore.embedded.index``), ``fragments``
    (fragment and pack files: ``kvstore.embedded.fragments``), ``access`` (batched access
    times) and ``room`` (the index's spare space); ``parts`` hands them to maintenance and
    stats. ``config``, ``targets``, ``target_specs``, ``index_id``, ``file_clock`` and
    ``counters`` are the opened directory's, read-only. ``clock`` (TTLs, grace periods) may be
    replaced on an open store: the parts read it through ``_now_s``."""

    def __init__(self, config: StoreConfig, *, clock: Callable[[], float] = time.time):
        if config.tune_malloc:
            tune_malloc()
        # Files' ages (orphan grace, a written pack's age) are measured on the clock that stamps
        # their mtimes, this host's, never with clock_offset_s: on a skewed store clock a sweep
        # would take a put in flight for an old orphan.
        self.file_clock = clock
        if config.clock_offset_s:
            base, offset = clock, config.clock_offset_s
            clock = lambda: base() + offset  # noqa: E731 - a skewed node (TTLs, grace periods)
        self.clock = clock
        self.data_dir = Path(config.data_dir).resolve()
        self.config = config
        self._closed = False
        self._calls = threading.Condition()  # guards _closed, _in_flight and _shut (``in_flight``)
        self._in_flight = 0
        self._shut = False  # the index closed (``_finish_close``)
        self.room = IndexRoom(self.data_dir / "index", config.index_reserve_bytes)
        self.room.release_if_full()
        self.datadir = DataDir(self.data_dir)
        fresh = self.datadir.open(config)
        config = self.config = self.datadir.config
        self.index = self.datadir.index
        self.index_id = self.datadir.index_id  # this store's identity (a recreated directory has another)
        self.targets = self.datadir.targets
        self.target_specs = self.datadir.target_specs
        if not self.room.ensure():
            log.warning("no room for the index's spare file (%d bytes) on a full filesystem: puts are refused "
                        "until deletions or gc free space", config.index_reserve_bytes)
        # Two pools, so that no task ever waits on a task queued behind it in its own pool:
        # ``_pool`` runs single fragment reads/writes (leaf work); ``_batch_pool`` runs one
        # entry of a batch each, and those submit their fragment I/O to ``_pool``.
        # Daemon threads (``kvstore.executors``): a write stuck on a dead mount never holds up exit.
        self._pool = DaemonExecutor(config.read_workers, "kvstore-io")
        self._batch_pool = DaemonExecutor(config.read_workers, "kvstore-batch")
        self._counters = Counters()
        self.counters = self._counters.values
        self.access = AccessTimes(self.index, self.room, self._now_s, config.access_flush_s)
        self.fragments = FragmentStore(config, self.targets, self.target_specs, self.datadir.code, self.index,
                                       pool=self._pool, batch_pool=self._batch_pool, count=self._counters.add,
                                       clock=self._now_s, file_clock=self.file_clock, now_ns=self.now_ns,
                                       sync_mode=self.datadir.sync_mode)
        self.parts = StoreParts(config=config, data_dir=self.data_dir, index=self.index, targets=self.targets,
                                fragments=self.fragments, access=self.access, counters=self._counters,
                                room=self.room, pool=self._pool, clock=self._now_s, file_clock=self.file_clock,
                                evict_lock=threading.Lock())
        if not fresh:
            # Asked at once: a remote target that does not answer costs its timeouts once, not per target.
            states = dict(zip(self.targets, self._pool.map(lambda t: t.state(), self.targets.values())))
            down = [f"{n} ({why})" for n, (state, why) in states.items() if state != "up"]
            if down:
                log.warning("targets down at open: %s (reads of their fragments are degraded, or fail while more "
                            "than m are down)", "; ".join(down))

    # ------------------------------------------------------------------ set-up
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this store is closed; open a new one with kvstore.connect")

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self._clock = clock

    def _now_s(self) -> float:
        return self._clock()

    def now_ns(self) -> int:
        return int(self._clock() * 1e9)

    def put(self, key: bytes, value: Any, *, kind: str = "block", ttl_s: float | None = None,
            layout: Layout | None = None, tokens: int = 0) -> bool:
        return self.put_many([PutItem(key, value, kind, ttl_s, layout, tokens)])[0]

    @in_flight
    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        """Batched put: the fragments of all items written (on threads where writes wait),
        then one index commit."""
        self._check_open()
        items = check_put_items(items)
        if not items:
            return []
        now = self.now_ns()
        # 1-2: skip live keys (and duplicates inside the batch) before doing any work.
        result = [False] * len(items)
        todo: list[PutItem] = []  # what to write, key and kind checked and typed
        slots: list[int] = []  # their positions in ``items``
        seen: dict[bytes, None] = {}  # the put's entry keys, in its order
        writer = self.fragments.writer
        with self.index.env.begin() as txn:
            for i, it in enumerate(items):
                kind = EntryKind.parse(it.kind)  # key and kind checked once, here; typed from here on
                it = PutItem(check_key(it.key), it.value, kind, it.ttl_s, it.layout, it.tokens)
                ek = ekey(kind.code, it.key)
                if ek in seen:
                    writer.checked(it)  # refused as any item, though not written twice
                    continue
                seen[ek] = None  # what its eviction pass keeps (_index_new)
                m = self.index.get_meta(txn, ek)
                if m is not None and not m.expired(now):
                    writer.checked(it)  # refused all the same
                    self.access.touch(ek, now)
                    self._counters.add("puts_deduplicated")
                    continue
                todo.append(it)
                slots.append(i)
        if todo:
            self.room.check_put()  # the index's spare room is never spent on a put (kvstore.embedded.diskroom)
        for attempt in itertools.count():
            entries = [PendingEntry(it, i) for it, i in zip(todo, slots)]  # a retry writes under new generations
            try:
                self._write_and_index(entries, list(seen), now)
            except FilesSwept as exc:  # nothing indexed, its files removed: again
                if attempt == SWEPT_RETRIES:
                    raise
                log.info("put: %s; writing it again", exc)
                continue
            except CapacityExceeded as exc:  # per entry written: per item of the call
                exc.widen_created([e.slot for e in entries], result)
                raise
            for e in entries:
                result[e.slot] = e.created
            return result

    def _write_and_index(self, entries: list[PendingEntry], put_keys: list[bytes], now: int) -> None:
        """Steps 3-6 of ``put_many`` for ``entries``, setting each one's ``created``. Raises what
        the write raised (``FragmentWriter.write_entries``: nothing indexed); ``FilesSwept``
        (nothing indexed, the files written removed) when an orphan sweep took one of them
        before the index commit (``FragmentStore.check_unswept_txn``)."""
        writer = self.fragments.writer
        with self.index.env.begin() as txn:  # before the first file: see kvstore.maintenance.orphans
            since = self.index.sweep_decisions(txn)
        started = self.clock()  # the files written from here on are at most this old at commit
        # 3-4: encode, place, write; fragments durable first (``FragmentWriter.write_entries``).
        writer.write_entries(entries, packs=self.config.pack_batches, since=since)
        # 5-6: one index transaction for the batch; then capacity. Inside it, files an orphan
        # sweep took since ``since`` was read are not indexed (``FragmentStore.check_unswept_txn``), nor
        # segments removed while appended to (``FragmentStore.check_segments_txn``), nor files a write
        # took over half of orphan_grace_s to reach it with (``FragmentStore.check_in_time``: for
        # sweeps of versions that do not record their decisions in the index).
        try:
            created = self._index_new([e.record() for e in entries], now,
                                      written_at=(started, f"writing {len(entries)} entries"), put_keys=put_keys,
                                      unswept=(since, written_files(entries)),
                                      segments={e.segment for e in entries if e.segment is not None})
        except (WrittenTooLongAgo, FilesSwept, IndexFull) as exc:
            writer.seal_segments(entries, str(exc))  # the next try appends to a new one
            writer.discard_unindexed(entries)  # none indexed: every file goes
            raise
        except BaseException:
            writer.release_segments(entries, indexed_unknown=True)
            raise
        for e, c in zip(entries, created):
            e.created = c
        # A concurrent writer won where ``created`` is false: a loser's fragment files go, and its
        # share of a pack goes with the pack.
        writer.discard_unindexed(entries)

    def _index_new(self, records: Sequence[tuple[bytes, Meta]], now: int,
                   written_at: tuple[float, str] | None = None, fresh_gens: Sequence[bytes] = (),
                   put_keys: Sequence[bytes] | None = None,
                   unswept: tuple[int, Sequence[tuple[str, str]]] | None = None,
                   segments: Iterable[Segment] = ()) -> list[bool]:
        """Steps 5-6 for records whose fragments are durable: one transaction inserting each
        record whose key is free (absent or expired; a lost record of it goes to the
        graveyard), ``False`` where a live entry won the race (the caller removes or keeps the
        loser's files); then the counters, and eviction above the high watermark.
        ``written_at`` (clock time the files were started, what they are): first, inside the
        transaction, ``WrittenTooLongAgo`` (nothing indexed) when that was too long ago;
        ``fresh_gens``: ``GenerationTaken`` (nothing indexed) when a record already names one.
        ``put_keys``: every entry key of the put, in its order, those found already stored
        before any work included (default: the records'), which its eviction pass keeps.
        ``unswept`` (the sweep count read before the first file was written, and the files'
        ``(target, rel)``): ``FilesSwept`` (nothing indexed) when an orphan sweep took one of
        them (``FragmentStore.check_unswept_txn``), or one of the ``segments`` appended to was removed
        (``FragmentStore.check_segments_txn``). ``IndexFull`` (nothing indexed) when the
        index's filesystem has no room for the commit (``kvstore.embedded.diskroom``)."""
        created: list[bool] = []
        try:
            with self.index.env.begin(write=True) as txn:
                if written_at is not None:
                    self.fragments.check_in_time(*written_at)
                if unswept is not None:
                    self.fragments.check_unswept_txn(txn, *unswept)
                segments = list(segments)
                self.fragments.check_segments_txn(txn, segments)
                taken = [g for g in fresh_gens if self.index.pack_info(txn, g) is not None]
                if taken:
                    raise GenerationTaken(taken)
                for ek, meta in records:
                    old = self.index.get_meta(txn, ek)
                    if old is not None:
                        if not old.expired(now):
                            created.append(False)
                            continue
                        self.index.remove_txn(txn, ek, old, now)
                    lost = self.index.get_lost(txn, ek)
                    if lost is not None:
                        self.index.drop_lost_txn(txn, ek, lost, now, to_grave=True)
                    self.index.insert_txn(txn, ek, meta)
                    created.append(True)
                # A loser's share of a pack stays in it: dead from the start (index invariant 6).
                for (ek, meta), c in zip(records, created):
                    if not c and meta.offsets:
                        self.index.pack_dead_txn(txn, meta.gen, packed_bytes(meta))
                self.fragments.note_indexed(segments, {m.gen for (_, m), c in zip(records, created) if c})
                self.access.flush_txn(txn)
        except lmdb.Error as exc:  # nothing indexed: the caller removes the files
            if self.room.no_space(exc):
                raise IndexFull(str(self.room.full_error(exc, f"indexing {len(records)} entries"))) from exc
            raise
        n_new = sum(created)
        self._counters.add("puts", n_new)
        self._counters.add("bytes_in", sum(m.plain_len for (_, m), c in zip(records, created) if c))
        if n_new and self.config.capacity_bytes:
            try:
                eviction.evict_after_put(self.parts, [ek for ek, _ in records] if put_keys is None else put_keys)
            except CapacityExceeded as exc:  # after the commit: say what it indexed (``CapacityExceeded.created``)
                exc.created = created
                raise
        return created

    @in_flight
    def commit_written(self, entries: Sequence[WrittenEntry], *, shown: Sequence[bytes] = ()) -> CommitResult:
        """Index entries a client wrote into pack files itself (the daemon's ``Commit``;
        ``kvstore.client.direct_writes``): steps 5-6 of a put, after checking what the index will
        rely on. Per entry, ``created`` is ``False`` where a live entry of the key already
        exists (its bytes stay in the pack: the writer removes a pack none of whose entries
        was indexed) or where its pack was rejected.

        Checked first, all or nothing (``InvalidRequest``, nothing indexed), what only a
        wrong or malicious writer sends: the erasure code is this store's; the targets are
        k+m distinct known ones; sizes are consistent. Then per pack: it is new to the index
        (a generation names one batch; another writer may have claimed it first), and on
        every target it is present, holds its fragments end to end from its start and nothing
        else (no bytes kept alive that no record counts or quota charges), and was written less than half of
        ``orphan_grace_s`` ago (for sweeps of versions that do not record their decisions);
        and inside the index transaction, no orphan sweep has taken it (``FragmentStore.check_unswept_txn``:
        no hold on its path; and, if a sweep decided since the stats, still there). If any pack
        fails, or the index's write lock came too late for the oldest (``FragmentStore.check_in_time``), or a
        sweep took one (``FilesSwept``), every pack is ``rejected`` (generation
        -> why) and nothing indexed: a commit is all or nothing, as ``put_many``, and the
        writer puts the whole batch another way. The bytes themselves are not read: every
        read checks each fragment's checksum and header (key, generation, index) against the
        record, so a wrong byte is never returned. ``shown``: the keys as the caller sent them,
        one per entry, which the messages name (default: the stored keys).
        """
        self._check_open()
        if not entries:
            return CommitResult([], {})
        now = self.now_ns()
        found = self.fragments.check_written(entries, shown, now)
        rejected = dict(found.rejected)
        records = found.records
        keep = [j for j, e in enumerate(entries) if e.gen not in rejected]
        try:
            # The generations again, inside the index transaction: two commits naming one new
            # generation both pass the read above; only the first to take the lock indexes.
            made = self._index_new([records[j] for j in keep], now,
                                   written_at=(found.written_at, "committing written packs"),
                                   fresh_gens=sorted({entries[j].gen for j in keep}),
                                   unswept=(found.since, found.unswept))
        except (WrittenTooLongAgo, GenerationTaken, FilesSwept, IndexFull) as exc:  # all rejected, as above
            rejected.update({entries[j].gen: str(exc) for j in keep})
            keep, made = [], []
        except CapacityExceeded as exc:  # indexed, then evicted for room: per entry of the commit
            exc.widen_created(keep, [False] * len(entries))
            raise
        created = [False] * len(entries)
        for j, c in zip(keep, made):
            created[j] = c
            if not c:  # a re-put of a live key: refresh it, as put does
                self.access.touch(records[j][0], now)
                self._counters.add("puts_deduplicated")
        self._counters.add("rejected_packs", len(rejected))
        for why in rejected.values():
            log.warning("commit: %s; its entries are not indexed", why)
        return CommitResult(created, rejected)

    def _live_meta(self, ek: bytes, now: int) -> Meta | None:
        with self.index.env.begin() as txn:
            m = self.index.get_meta(txn, ek)
        if m is None or m.expired(now):
            return None
        return m

    @in_flight
    def get_entry(self, key: bytes, *, kind: str = "block") -> Entry:
        self._check_open()
        k = EntryKind.parse(kind)
        ek = ekey(k.code, check_key(key))
        now = self.now_ns()
        meta = self._live_meta(ek, now)
        self._counters.add("gets")
        if meta is None:
            self._counters.add("get_misses")
            with self.index.env.begin() as txn:
                lost = self.index.get_lost(txn, ek)
            if lost is not None and not lost.expired(now):  # a retry is told what the first read was
                raise Unrecoverable(f"{k.value} entry {ek[1:].hex()} is lost: fewer than k of its fragments "
                                    f"were good when it was read (targets {', '.join(lost.targets)}); kvtool "
                                    "verify names the failed ones, kvtool repair rebuilds it once they are back",
                                    key=ek[1:])
            raise NotFound(f"no {k.value} entry for key {ek[1:].hex()}")
        h, plain = self.fragments.reader.read_verified(ek, meta)
        self._counters.add("bytes_out", len(plain))
        self.access.touch(ek, now)
        return Entry(ek[1:], k, h.layout, h.tokens, plain)

    def get(self, key: bytes, *, kind: str = "block") -> bytes:
        return self.get_entry(key, kind=kind).data

    def get_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bytes | None]:
        """Batched get; a missing or unrecoverable entry is ``None`` in its slot, and so is one
        that cannot be read for now (``StoreUnavailable`` from ``get``: its targets could not be
        asked, or are not configured; logged): a batch is not failed for one entry."""
        entries = self.get_entries(keys, kind=kind)
        return [None if e is None else e.data for e in entries]

    @in_flight
    def get_entries(self, keys: Sequence[bytes], *, kind: str = "block") -> list[Entry | None]:
        self._check_open()
        k = EntryKind.parse(kind)
        eks = [ekey(k.code, key) for key in check_keys(keys)]
        now = self.now_ns()
        with self.index.env.begin() as txn:
            metas = [self.index.get_meta(txn, ek) for ek in eks]
        metas = [None if m is not None and m.expired(now) else m for m in metas]  # expired: absent
        self._counters.add("gets", len(eks))

        read = self.fragments.reader.read_verified

        def one(i: int) -> Entry | None:
            m = metas[i]
            if m is None:
                return None
            try:
                h, plain = read(eks[i], m)
            except (Unrecoverable, StoreUnavailable) as exc:  # lost, or unreadable for now: a miss
                log.error("get_many: %s", exc)
                return None
            return Entry(eks[i][1:], k, h.layout, h.tokens, plain)

        live = [m for m in metas if m is not None]
        if len(eks) == 1 or not any(self.fragments.reader.parallel(m) for m in live):
            # Local targets: a plain loop beats the thread hand-off (tools/bench_store.py).
            got = [one(i) for i in range(len(eks))]
        else:
            got = self._batched_remote(eks, metas, now, one)
        self._account_batch(eks, [None if e is None else len(e.data) for e in got], len(eks) - len(live), now)
        return got

    def _account_batch(self, eks: Sequence[bytes], sizes: Sequence[int | None], misses: int, now: int) -> None:
        """A batched get's counters and access times, once for the batch: ``sizes[i]`` the
        plain bytes returned for ``eks[i]`` (``None``: nothing returned), ``misses`` the keys
        without a live record (an entry that could not be read is not a miss, as in ``get``)."""
        hits = [ek for ek, n in zip(eks, sizes) if n is not None]
        self._counters.add("get_misses", misses)
        self._counters.add("bytes_out", sum(n for n in sizes if n is not None))
        self.access.touch_many(hits, now)

    def _batched_remote(self, eks: Sequence[bytes], metas: Sequence[Meta | None], now: int,
                        one: Callable[[int], Any]) -> list[Any]:
        """A batched get's entries read on threads (remote targets), the pack spans its live
        records share fetched first in one request each (``FragmentReader.prefetch``)."""
        reader = self.fragments.reader
        held = reader.prefetch([(ek, m) for ek, m in zip(eks, metas) if m is not None and not m.expired(now)])
        try:
            return list(self._batch_pool.map(one, range(len(eks))))
        finally:
            reader.release(held)

    @in_flight
    def locate(self, eks: Sequence[bytes]) -> list[Meta | None]:
        """The index half of a get, for readers that fetch the fragments themselves
        (``kvstore.client.direct_reads``, through the daemon's Locate): per ``kind + key`` the live index
        record (``None``: absent, expired or lost), each live one touched as a get does."""
        self._check_open()
        now = self.now_ns()
        with self.index.env.begin() as txn:
            metas = [self.index.get_meta(txn, ek) for ek in eks]
        out: list[Meta | None] = []
        for ek, m in zip(eks, metas):
            if m is None or m.expired(now):
                out.append(None)
                continue
            self.access.touch(ek, now)  # a located entry is about to be read: a use, as a get is
            out.append(m)
        return out

    @in_flight
    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *,
                      kind: str = "block") -> list[EntryInfo | None]:
        """Batched get straight into caller buffers (``kvstore.api``, "Reading into caller
        buffers"): fragments are read and verified as in ``get_many``, the payload pieces
        are copied from the fragment bodies into ``outs[i]`` (one copy; zstd entries are
        decompressed into it), and the entry checksum is verified over ``outs[i]``.

        Every buffer is checked against the index's plain size before any fragment is
        read, so a too-small one raises ``InvalidRequest`` with nothing written.
        """
        self._check_open()
        keys = check_keys(keys)
        if len(outs) != len(keys):
            raise InvalidRequest(f"get_many_into: {len(keys)} keys but {len(outs)} output buffers")
        k = EntryKind.parse(kind)
        eks = [ekey(k.code, key) for key in keys]
        views = [writable_view(o, f"outs[{i}]") for i, o in enumerate(outs)]
        now = self.now_ns()
        with self.index.env.begin() as txn:
            metas = [self.index.get_meta(txn, ek) for ek in eks]
        metas = [None if m is not None and m.expired(now) else m for m in metas]  # absent, as in get_many
        for i, m in enumerate(metas):
            if m is not None and m.plain_len > len(views[i]):
                raise InvalidRequest(
                    f"outs[{i}] holds {len(views[i])} bytes but the {k.value} entry {eks[i][1:].hex()} "
                    f"has {m.plain_len}; size the buffers from the entry layout"
                )
        self._counters.add("gets", len(eks))

        read = self.fragments.reader.read_verified

        def one(i: int) -> EntryInfo | None:
            m = metas[i]
            if m is None:  # absent or expired (above)
                return None
            try:
                h, _ = read(eks[i], m, views[i])
            except (Unrecoverable, StoreUnavailable) as exc:  # lost, or unreadable for now: a miss
                log.error("get_many_into: %s", exc)
                return None
            return EntryInfo(eks[i][1:], k, h.plain_len, h.layout, h.tokens)

        live = [m for m in metas if m is not None]
        if len(eks) == 1 or not any(self.fragments.reader.parallel(m) for m in live):
            got = [one(i) for i in range(len(eks))]  # local targets: as in get_entries
        else:
            got = self._batched_remote(eks, metas, now, one)
        self._account_batch(eks, [None if e is None else e.nbytes for e in got], len(eks) - len(live), now)
        return got

    # ------------------------------------------------------------------ access times (approximate LRU)
    @in_flight
    def flush_touches(self) -> None:
        """Write batched access times to the LRU ordering (one transaction)."""
        self.access.flush()

    # ------------------------------------------------------------------ delete, pin
    @in_flight
    @frees_space
    def delete(self, key: bytes, *, kind: str = "block") -> bool:
        self._check_open()
        ek = ekey(EntryKind.parse(kind).code, check_key(key))
        now = self.now_ns()
        with self.index.env.begin(write=True) as txn:
            m = self.index.get_meta(txn, ek)
            if m is not None:
                self.index.remove_txn(txn, ek, m, now)
                return True
            lost = self.index.get_lost(txn, ek)
            if lost is not None:
                self.index.drop_lost_txn(txn, ek, lost, now, to_grave=True)
                return True
        return False

    @in_flight
    def _set_pinned(self, key: bytes, kind: str, pinned: bool) -> bool:
        self._check_open()
        ek = ekey(EntryKind.parse(kind).code, check_key(key))
        with self.index.env.begin(write=True) as txn:
            m = self.index.get_meta(txn, ek)
            if m is None or m.expired(self.now_ns()):  # expired: absent, as for get
                return False
            if m.pinned != pinned:
                self.index.update_txn(txn, ek, m, replace(m, pinned=pinned))
        return True

    def pin(self, key: bytes, *, kind: str = "block") -> bool:
        """Exempt a live entry from capacity eviction (TTL still applies). False if absent."""
        return self._set_pinned(key, kind, True)

    def unpin(self, key: bytes, *, kind: str = "block") -> bool:
        return self._set_pinned(key, kind, False)

    # ------------------------------------------------------------------ lookup
    @in_flight
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        self._check_open()
        keys = check_keys(keys)
        hit, swa = self.index.lookup(keys, EntryKind.BLOCK.code, EntryKind.SWA.code, self.now_ns())
        return LookupResult(hit, swa)

    def lookup_many(self, chains: Sequence[Sequence[bytes]]) -> list[LookupResult]:
        self._check_open()
        return [self.lookup(c) for c in chains]

    @in_flight
    def probe(self, keys: Sequence[bytes], *, until_miss: bool = False,
              chain_ends: Sequence[int] | None = None) -> tuple[bytes, bytes]:
        """Per key, on its own (not a chain): 1 if a live block entry, and 1 if also a live SWA
        entry; as two byte strings (``RemoteStore.probe``'s answer, which serves it).
        ``until_miss``, ``chain_ends``: ``Index.probe``'s (each chain read to its first miss)."""
        self._check_open()
        keys = check_keys(keys)
        ends = check_chain_ends(chain_ends, len(keys), until_miss=until_miss)
        return self.index.probe(keys, EntryKind.BLOCK.code, EntryKind.SWA.code, self.now_ns(),
                                until_miss=until_miss, chain_ends=ends)

    # ------------------------------------------------------------------ capacity
    @in_flight
    def used_bytes(self) -> int:
        with self.index.env.begin() as txn:
            return self.index.counter(txn, "used_bytes")

    @in_flight
    @frees_space
    def evict_to(self, goal_bytes: int, *, dry_run: bool = False) -> int:
        """Evict until at most ``goal_bytes`` are used (``kvstore.maintenance.eviction.evict``: lost
        entries first, then least recently used; never pinned ones). Returns the count."""
        return eviction.evict(self.parts, goal_bytes, dry_run=dry_run)

    # ------------------------------------------------------------------ maintenance, stats
    @in_flight
    @frees_space
    def gc(self, *, dry_run: bool = False, orphans: bool = True, progress: Callable | None = None) -> dict:
        self._check_open()
        return maintenance_gc.run_gc(self.parts, dry_run=dry_run, sweep_orphans=orphans, progress=progress)

    @in_flight
    def check(self, fix: bool = False, *, progress: Callable | None = None) -> list:
        self._check_open()
        return maintenance_check.check(self.parts, fix=fix, progress=progress)

    @in_flight
    def repair(self, *, progress: Callable | None = None) -> dict:
        self._check_open()
        return maintenance_check.repair(self.parts, progress=progress)

    @in_flight
    def rebuild_index(self, *, progress: Callable | None = None) -> dict:
        """Index the entries found on the targets that the index does not know
        (``kvstore.maintenance.reindex.reindex_store``: an index restored from an older copy)."""
        self._check_open()
        return reindex.reindex_store(self.parts, progress=progress)

    @in_flight
    def stats(self) -> dict:
        self._check_open()
        return store_stats.stats(self.parts)

    def close(self, *, wait_s: float = CLOSE_WAIT_S) -> None:
        """Refuse new calls, wait up to ``wait_s`` for those in flight, write the batched
        access times, close the index. Past the wait, the last call still running closes it
        as it returns (``in_flight``). Idempotent."""
        with self._calls:
            if self._closed:
                return
            self._closed = True
            if not self._calls.wait_for(lambda: not self._in_flight, timeout=wait_s):
                log.warning("%d calls still running at close: the last one closes the index", self._in_flight)
                return
        self._finish_close(deferred=False)

    def _finish_close(self, *, deferred: bool) -> None:
        """Once, with no call in flight: write the batched access times, stop the pools (not
        waiting when a returning call closes: it may run on one of their threads), close the index."""
        with self._calls:
            if self._shut or self._in_flight:
                return
            self._shut = True
        try:
            self.access.flush_or_drop()
        finally:
            # A read abandoned at read_timeout_s may still hold a worker: not waited for past a bound.
            shutdown_all([self._batch_pool, self._pool, *self.fragments.pools.all()], wait=not deferred,
                         timeout_s=POOL_JOIN_S)
            self.fragments.close()
            self.index.close()

    def __enter__(self) -> "EmbeddedStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_embedded(url: str, **overrides: Any) -> EmbeddedStore:
    """``kvstore.connect`` opener for plain paths and ``file:`` URLs (``file:///abs``,
    ``file://localhost/abs``, ``file:/abs``; the path is taken as written, not
    percent-decoded, as the daemon's ``Describe`` writes target URLs)."""
    path = file_url_path(url)
    clock = overrides.pop("clock", None)
    config_file = overrides.pop("config_file", None)
    cfg = load_config(config_file, data_dir=path, **overrides)
    return EmbeddedStore(cfg, clock=clock or time.time)
