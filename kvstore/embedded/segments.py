"""Segments: the pack files a store's puts append to, one open file per target, so that an entry
costs positioned writes into files already open instead of k+m files created, synced and renamed.

Contract. ``Segments`` hands each put the process's *active* segment (``acquire``): a generation,
and per target the file ``pack_path(gen)`` held open. ``append`` writes a put's fragments at the
end of each target's file, fragments back to back exactly as a pack holds them
(``codec.split_pack`` reads both), and returns each entry's (targets, offsets); ``make_durable``
returns once those bytes, and the files' names, are on disk. The put then indexes its records
(``kvstore.embedded.store``), which name the segment's generation and the offsets: to every
reader a segment is a pack (``kvstore.embedded.index`` invariant 6: its record count, bytes, dead
bytes, compaction, removal with its last record). ``release`` ends the put's use, saying whether
a record of it was indexed.

Why appends are safe (what holds a published record to its bytes):

1. *Nothing half-written is named.* A record is committed only after ``make_durable`` returned
   for its bytes, so after any crash the index names only bytes that were durable. Bytes past
   them (an append in flight at a crash, torn) are never named; ``kvtool rebuild-index`` reads
   frames back to back and skips a damaged stretch (``codec.split_pack``), and the fragment
   checksums reject any torn frame.
2. *Appends to one file are ordered.* Each target file's appends run one at a time under its
   lock, so every byte before an acknowledged append was written before it and is made durable
   with it (``syncfs`` and ``fdatasync`` flush everything written before they start); a failed
   append seals the segment (below), so no later append lands past a hole.
3. *Bytes never move.* A generation is never reused and a segment is never rewritten:
   compaction writes a new pack; deletion unlinks the file. So a reader holding a record, or an
   open descriptor, reads the bytes that record was indexed with. And a segment takes each key
   once (``acquire``: a key put again goes to a new segment), so a key and a generation name
   one record, as they do for a pack (compaction and the pack's member records rely on it).
4. *A file removed while still appended to is never indexed into.* GC removes a pack's files
   when its last record goes; an orphan sweep removes a pack file no record names once older
   than ``orphan_grace_s``. Either can take the active segment of a process (its records all
   deleted, or none indexed yet and idle past the grace); the process's descriptor then writes
   into an unlinked file. The put's index transaction catches both
   (``kvstore.embedded.fragments.FragmentStore.check_segments_txn``): a segment that already
   holds indexed records must still have its pack record, and one that holds none is checked as
   any new file is, against the sweep count read before its first append (``Segment.since``).
   A segment counts as holding records from inside the transaction that commits its first
   (``mark_indexed``), not from that put's ``release``, so a put racing it cannot miss it.
   Either failing raises ``FilesSwept``: nothing is indexed, the segment is sealed, and the put
   writes again into a new one.

Sealing. A segment past ``segment_bytes``, one whose append or sync failed, or one found taken
as in 4 is sealed: no new put gets it; its descriptors close when its last put releases it
(or at once when none uses it);
and a sealed segment in which no record was ever indexed is removed then (what it holds no
record names). Closing the store seals the active one.

Durability (``sync_mode``): "fs" makes a put's appends durable with one ``syncfs`` per
filesystem, "file" with one ``fdatasync`` per file it touched (and a new file's directory
synced when it is created); "" (fsync off) does nothing. Both are group commits: a put whose
bytes were already covered by a sync that started after they were written returns without
syncing, so concurrent puts share one flush (``_Flusher``).

What is not done here: remote targets (object stores cannot append) and stores with a
``write_timeout_s`` (a hung append cannot be given up on while it holds its file's lock) keep
the pack-per-batch and file-per-fragment writes of ``kvstore.embedded.fragment_writes``
(``usable``). Space of dead entries inside a segment comes back by compaction, as a pack's.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

from kvstore.embedded.durability import RootSyncs
from kvstore.embedded.targets import LocalTarget, Target, pack_path

log = logging.getLogger("kvstore.embedded.store")

_IOV_MAX = 512  # well under the kernel's 1024 per pwritev
# Every fragment starts on a filesystem block: a dead entry's fragments are then whole blocks (and
# the hole before the next one) whose space GC gives back at once (``Target.punch``), while the
# file lives on. Costs the unused tail of each fragment's last block, as a file per fragment does.
ALIGN = 4096


class _Flusher:
    """Group commit of one durable flush (a filesystem's ``syncfs``, a file's ``fdatasync``).
    A write it must cover takes a number as it starts (``begin``) and a ticket once it has
    finished (``written``); ``flush(ticket, began)`` returns once a flush that started after
    that ticket was given has finished, running one only if none did. A flush that fails
    fails every write that had *started* when it failed, also for the callers that wait on
    it: the kernel reports a writeback error once, and the failed writeback may have taken
    the pages of a write that finished while it ran but was counted after it started, so
    flushing again would "succeed" over lost pages."""

    __slots__ = ("_count_lock", "_lock", "_started", "_written", "_flushed", "_failed", "_flush")

    def __init__(self, flush: Callable[[], None]):
        self._count_lock = threading.Lock()
        self._lock = threading.Lock()
        self._started = 0
        self._written = 0
        self._flushed = 0
        self._failed: tuple[int, OSError] | None = None  # writes started when a flush failed, its error
        self._flush = flush

    def begin(self) -> int:
        """The number of a write about to start (before its first byte is written)."""
        with self._count_lock:
            self._started += 1
            return self._started

    def written(self) -> int:
        """The ticket of a write that has finished."""
        with self._count_lock:
            self._written += 1
            return self._written

    def flush(self, upto: int, began: int) -> bool:
        """Make the writes up to ticket ``upto``, the first of which began as number ``began``,
        durable; whether this call ran the flush."""
        with self._lock:
            if self._failed is not None and began <= self._failed[0]:
                raise OSError(self._failed[1].errno, f"a flush covering this write failed: {self._failed[1]}")
            if self._flushed >= upto:
                return False
            with self._count_lock:
                covers = self._written  # every write counted so far has finished before this point
            try:
                self._flush()
            except OSError as exc:
                with self._count_lock:  # any write started by now may have lost its pages to it
                    self._failed = (self._started, exc)
                raise
            self._flushed = covers
            return True


class _File:
    """One target's file of a segment: its descriptor, the end its appends reached (under
    ``lock``: appends run one at a time), and its ``fdatasync`` group commit."""

    __slots__ = ("fd", "end", "lock", "sync")

    def __init__(self, fd: int):
        self.fd = fd
        self.end = 0
        self.lock = threading.Lock()
        self.sync = _Flusher(lambda: os.fdatasync(fd))


@dataclass(frozen=True, slots=True)
class Appended:
    """What one ``Segments.append`` did: per target, the offset of each fragment of its share;
    per flush that makes it durable (a filesystem's or a file's), the number its first write
    began as and the ticket of its last (``_Flusher``)."""

    offsets: dict[str, list[int]]
    flushes: dict[_Flusher, tuple[int, int]]
    files: dict[str, _File]

    @staticmethod
    def merged(parts: Sequence["Appended"]) -> "Appended":
        """The flushes of several appends as one (``offsets`` are per append: not merged)."""
        flushes: dict[_Flusher, tuple[int, int]] = {}
        files: dict[str, _File] = {}
        for p in parts:
            files.update(p.files)
            for fl, (began, ticket) in p.flushes.items():
                had = flushes.get(fl)
                flushes[fl] = (began, ticket) if had is None else (min(began, had[0]), max(ticket, had[1]))
        return Appended({}, flushes, files)


@dataclass(eq=False)
class Segment:
    """One segment (module docstring): ``gen`` names its file on each target; ``since`` is the
    index's sweep count read before its first append (``kvstore.maintenance.orphans``);
    ``indexed``: a record in it was indexed, or may have been (set inside the index
    transaction, before its commit: its pack record must exist from then on); ``users``: puts
    between ``acquire`` and ``release``; ``sealed``: no new put gets it; ``keys``: the entry
    keys puts appended to it (each at most once: "Why appends are safe", 3)."""

    gen: bytes
    since: int
    files: dict[str, _File] = field(default_factory=dict)
    indexed: bool = False
    sealed: bool = False
    users: int = 0
    appended: int = 0  # fragment bytes appended, over all its files
    keys: set[bytes] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def size(self) -> int:
        """The end of its longest file."""
        with self.lock:
            return max((f.end for f in self.files.values()), default=0)

    def written_on(self) -> list[str]:
        """The targets this segment has a file on."""
        with self.lock:
            return list(self.files)


class Segments:
    """The active segment of one store's process and its sealed ones still in use (module
    docstring), over ``targets``. ``sync_mode()`` says how writes are made durable ("fs",
    "file" or ""); ``count(name, n)`` counts into the store's stats; ``on_retired(gen, nbytes)``
    is told, when a segment in which records were indexed is retired, how many fragment bytes
    were appended to it in all (those no record names are then counted dead by the index);
    ``on_unindexed(gen, names)`` removes the files on targets ``names`` of a retired segment in
    which this process indexed nothing, unless a record names them by then (without it, they
    are deleted). ``roots``: the store's ``syncfs`` descriptors (default: its own, closed at
    ``close``)."""

    def __init__(self, targets: dict[str, Target], *, segment_bytes: int, sync_mode: Callable[[], str],
                 count: Callable[..., None], on_retired: Callable[[bytes, int], None] | None = None,
                 on_unindexed: Callable[[bytes, list[str]], None] | None = None, roots: RootSyncs | None = None):
        self.targets = targets
        self._roots = roots or RootSyncs(targets)
        self._own_roots = roots is None
        self._on_retired = on_retired
        self._on_unindexed = on_unindexed
        self.segment_bytes = segment_bytes
        self._sync_mode = sync_mode
        self._count = count
        self._lock = threading.Lock()
        self._active: Segment | None = None
        self._fs: dict[int, _Flusher] = {}  # st_dev -> its syncfs group commit
        self._closed = False

    @staticmethod
    def usable(targets: dict[str, Target], write_timeout_s: float) -> bool:
        """Whether puts to ``targets`` can append to segments: every target a local directory,
        and no write timeout (module docstring, "What is not done here")."""
        return not write_timeout_s and bool(targets) and all(type(t) is LocalTarget for t in targets.values())

    # ------------------------------------------------------------------ a put's use
    def acquire(self, since: int, keys: Sequence[bytes] = ()) -> Segment:
        """The active segment for one put of the entries ``keys``: a new one, recording
        ``since``, when there is none, or the last one was sealed, has reached
        ``segment_bytes`` or already holds one of ``keys`` (a key deleted and put again: a
        record names its segment's generation, and no two records of one key may name the same
        one). ``release`` it after the put's index commit, whatever happened."""
        old = None
        with self._lock:
            if self._closed:
                raise OSError(errno.EBADF, "the store's segments are closed")
            seg = self._active
            if seg is None or seg.sealed or seg.size() >= self.segment_bytes or not seg.keys.isdisjoint(keys):
                if seg is not None and not seg.sealed:
                    self._seal_locked(seg)
                    old = seg if seg.users == 0 else None  # else its last put retires it
                seg = self._active = Segment(os.urandom(8), since)
                self._count("segments_started")
            seg.keys.update(keys)
            seg.users += 1
        if old is not None:
            self._retire(old)
        return seg

    def release(self, seg: Segment, *, indexed: bool) -> None:
        """A put's use of ``seg`` ended; ``indexed``: at least one of its records in ``seg`` was
        indexed. A segment past ``segment_bytes`` is sealed then, and retired by its last put."""
        with self._lock:
            seg.indexed = seg.indexed or indexed
            seg.users -= 1
            if not seg.sealed and seg.size() >= self.segment_bytes:
                self._seal_locked(seg)
            done = seg.sealed and seg.users == 0
        if done:
            self._retire(seg)

    def mark_indexed(self, seg: Segment) -> None:
        """A record in ``seg`` is about to be committed: called inside the index transaction,
        so that from its commit on every other put's transaction requires ``seg``'s pack record
        (``FragmentStore.check_segments_txn``); a transaction that then fails leaves ``seg``
        taken as indexed, which only keeps its files for the orphan sweep."""
        with self._lock:
            seg.indexed = True

    def seal(self, seg: Segment, why: str) -> None:
        """No new put gets ``seg`` (module docstring, "Sealing")."""
        with self._lock:
            if seg.sealed:
                return
            log.info("segment %s sealed: %s", seg.gen.hex(), why)
            self._seal_locked(seg)
            done = seg.users == 0
        if done:
            self._retire(seg)

    def _seal_locked(self, seg: Segment) -> None:
        seg.sealed = True
        if self._active is seg:
            self._active = None

    def _retire(self, seg: Segment) -> None:
        """Close a sealed segment nobody uses; remove its files if no record was ever indexed in it,
        else tell ``on_retired`` what was appended to it."""
        if seg.indexed and self._on_retired is not None:
            try:
                self._on_retired(seg.gen, seg.appended)
            except Exception as exc:  # accounting only: the bytes stay until the segment goes
                log.warning("segment %s: its unindexed bytes were not counted dead: %s", seg.gen.hex(), exc)
        with seg.lock:
            files = list(seg.files.items())
            seg.files.clear()
            seg.keys.clear()
        for _name, f in files:
            try:
                os.close(f.fd)
            except OSError:
                pass
        if seg.indexed or not files:
            return
        if self._on_unindexed is not None:
            self._on_unindexed(seg.gen, [name for name, _ in files])
            return
        for name, _ in files:
            try:
                self.targets[name].delete(pack_path(seg.gen))
            except OSError:
                pass  # an orphan GC will sweep

    def close(self) -> None:
        """Seal the active segment; descriptors close as their puts release them. Called once
        no put is in flight."""
        with self._lock:
            self._closed = True
            seg = self._active
        if seg is not None:
            self.seal(seg, "the store is closing")
        if self._own_roots:
            self._roots.close()

    # ------------------------------------------------------------------ writing
    def _file(self, seg: Segment, name: str) -> _File:
        with seg.lock:
            f = seg.files.get(name)
            if f is None:
                target = self.targets[name]
                fd = target.create_for_append(pack_path(seg.gen), fsync=self._sync_mode() == "file")
                f = seg.files[name] = _File(fd)
            return f

    def append(self, seg: Segment, shares: dict[str, list[list[bytes]]]) -> Appended:
        """Append each target's share (its fragments, each a list of byte strings) to its file of
        ``seg``, each fragment starting at a multiple of ``ALIGN`` (the gap a hole); the offset
        of every fragment, and what ``make_durable`` must flush. An ``OSError`` (naming the
        target) leaves ``seg`` sealed: nothing appended by this call is named by any record."""
        mode = self._sync_mode()
        out = Appended({}, {}, {})
        name = ""
        try:
            for name, frames in shares.items():
                f = out.files[name] = self._file(seg, name)
                offsets = out.offsets[name] = []
                fl = f.sync if mode == "file" else self._fs_flusher(name) if mode == "fs" else None
                with f.lock:
                    began = 0 if fl is None else fl.begin()
                    end = f.end
                    for frame in frames:
                        off = -(-end // ALIGN) * ALIGN
                        _pwrite_all(f.fd, frame, off)
                        offsets.append(off)
                        end = off + sum(len(p) for p in frame)
                    f.end = end
                if fl is not None:  # a ticket once the writes have finished; numbers only grow
                    out.flushes[fl] = (began, fl.written())
                with seg.lock:
                    seg.appended += sum(len(p) for frame in frames for p in frame)
        except OSError as exc:
            self.seal(seg, f"an append failed on target {name}: {exc}")
            raise OSError(exc.errno, f"appending to segment {seg.gen.hex()} on target {name}: "
                                     f"{exc.strerror or exc}") from exc
        return out

    def make_durable(self, seg: Segment, appended: Appended) -> None:
        """Return once ``appended`` is durable (module docstring, "Durability"), its files still
        linked (one removed behind the store's back, its target's directory deleted say, would
        take the bytes with it); an ``OSError`` seals ``seg`` (those bytes may not be on disk)."""
        try:
            for flusher, (began, ticket) in appended.flushes.items():
                if flusher.flush(ticket, began):
                    self._count("segment_syncs")
            for name, f in appended.files.items():
                if os.fstat(f.fd).st_nlink == 0:
                    raise OSError(errno.ENOENT, f"the segment file on target {name} was removed while "
                                                "appended to")
        except OSError as exc:
            self.seal(seg, f"making its appends durable failed: {exc}")
            raise

    def _fs_flusher(self, name: str) -> _Flusher:
        """The syncfs group commit of target ``name``'s filesystem, its descriptor held from
        now on (``RootSyncs``: called before the first append there)."""
        dev = self._roots.hold(name)
        fl = self._fs.get(dev)
        if fl is None:
            with self._lock:
                fl = self._fs.get(dev)
                if fl is None:
                    fl = self._fs[dev] = _Flusher(lambda: self._roots.sync(name))
        return fl


def _pwrite_all(fd: int, parts: Sequence[memoryview | bytes], offset: int) -> None:
    """Write ``parts`` back to back at ``offset`` fully (``pwritev`` until done)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        n = os.pwritev(fd, views[:_IOV_MAX], offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]
