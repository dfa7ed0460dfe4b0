"""Open read descriptors of pack files, kept between reads: one positioned read per fragment
instead of an open, a read and a close.

``OpenFiles`` belongs to one ``kvstore.embedded.fragment_reads.FragmentReader`` (so to one
embedded store, or one direct reader of a client), which creates it and closes it in its own
``close``. The local read fast paths (``kvstore.embedded.fastread``) and the reader's get path
take descriptors of *pack* files from it (``kvstore.embedded.targets.pack_path``); a
fragment in a file of its own is opened, read and closed as before. Order of a read::

    held = files.hold([path, ...])      # one lock round for all k paths; misses are opened
    try:
        os.preadv(held[i].fd, ...)      # no lock held while reading
    finally:
        files.release(held)             # one lock round; closes what was evicted meanwhile

Why a descriptor may be kept, each for its reason:
  1. The bytes of a pack at an offset never change while an index record names them: packs
     (segments included) are appended to, never rewritten in place, and a generation (so a
     pack's name) is never reused; compaction writes a new pack under a new generation. So a
     descriptor opened once reads what a fresh open would, for every record that names that
     pack. (GC punches out the blocks of purged entries, which no record names any more: a
     stale reader then reads zeros through any descriptor, and its checks reject them.)
  2. Every byte read through a kept descriptor is still verified by the caller (checksums,
     fragment header against the record), exactly as one read through a fresh open.
  3. A pack unlinked by GC stays readable through a kept descriptor: a reader that took the
     record before the deletion gets the entry's own verified bytes, as it would have within
     ``delete_grace_s``. The price: the deleted pack's blocks stay allocated until its
     descriptor closes. That is bounded: at most ``capacity`` descriptors per ``OpenFiles``
     (each pins at most one pack); ``forget(path)`` closes one at once (the deleter's
     hook); and every ``SWEEP_EVERY`` opens, or ``SWEEP_S`` seconds of reads, the kept
     descriptors whose file has no name left (``st_nlink == 0``) are closed. A reader that
     reads nothing more keeps what it holds until it is closed.
  4. A path that no longer names the same file (a target root moved away, a pack deleted by
     hand) is not noticed by a kept descriptor: reads through it return the old, verified
     bytes (a deleted one until the sweep of 3). Readers that must see the file system as it
     is now (``check``, the orphan sweep) do not use this cache (``FragmentReader.read_fragment``
     without ``kept``). A disk that fails answers reads with errors: the descriptor is
     dropped (``discard``) and the next read opens the path again, or reads parity. And a
     filesystem with kept descriptors on it is busy: unmounting a target under a running
     store needs the store closed first (or a lazy unmount).

Concurrency: thread-safe. The LRU order and reference counts change under one lock, never
held across I/O (an open of a missing or slow file blocks only its caller). An evicted,
forgotten or discarded descriptor is closed by whoever drops its last reference, so a
``preadv`` in flight on another thread never sees its descriptor closed (or, worse,
reused for another file) under it. ``close`` closes every idle descriptor; held ones close
as their readers release them, and later ``hold`` calls get descriptors that are closed on
release (nothing is kept after ``close``).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from typing import Sequence

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 256  # descriptors kept per reader: one per (target, pack) recently read
SWEEP_EVERY = 64  # opens between two looks for kept descriptors of unlinked files (invariant 3)
SWEEP_S = 5.0  # and at most this long between two, while reads go on


class Held:
    """One kept descriptor and its use count (``fd`` stays open while anyone holds it)."""

    __slots__ = ("fd", "path", "refs", "dropped")

    def __init__(self, fd: int, path: str):
        self.fd = fd
        self.path = path
        self.refs = 0
        self.dropped = False  # out of the cache: closed as soon as refs is 0

    def drop(self) -> int | None:
        """Out of the cache (under the owner's lock): the descriptor to close now, if idle."""
        self.dropped = True
        return self._closable()

    def unhold(self) -> int | None:
        """One holder fewer (under the owner's lock): the descriptor to close now, if the last."""
        self.refs -= 1
        return self._closable() if self.dropped else None

    def _closable(self) -> int | None:
        if self.refs or self.fd < 0:
            return None
        fd, self.fd = self.fd, -1  # closed exactly once, by whoever saw it idle first
        return fd


def _close_fds(fds: Sequence[int | None]) -> None:
    for fd in fds:
        if fd is None:
            continue
        try:
            os.close(fd)
        except OSError as exc:  # EIO on closing a read-only descriptor: nothing to do about it
            log.warning("closing a kept pack descriptor: %s", exc)


def _close_all(kept: "OrderedDict[str, Held]") -> None:
    """Drop every kept descriptor, closing the idle ones (at ``close``, or when the owner is
    collected unclosed)."""
    fds = [h.drop() for h in kept.values()]
    kept.clear()
    _close_fds(fds)


class OpenFiles:
    """A bounded LRU of read-only descriptors by absolute path (module docstring)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY):
        if capacity < 1:
            raise ValueError(f"OpenFiles capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._kept: OrderedDict[str, Held] = OrderedDict()
        self._closed = False
        self._opens = 0
        self._next_sweep = time.monotonic() + SWEEP_S
        # An owner dropped without ``close`` (a store never closed) still gives its descriptors back.
        self._finalizer = weakref.finalize(self, _close_all, self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    def hold(self, paths: Sequence[str]) -> list[Held]:
        """A descriptor for each path (opened read-only where not kept yet), each held until
        ``release``. Raises what ``os.open`` raises (``FileNotFoundError`` for a missing file),
        after releasing what it held."""
        kept = self._kept
        now = time.monotonic()
        with self._lock:
            out = [kept.get(p) for p in paths]
            missing = []
            for j, h in enumerate(out):
                if h is None:
                    missing.append(j)
                else:
                    kept.move_to_end(h.path)
                    h.refs += 1
            sweep = now >= self._next_sweep
            if sweep:
                self._next_sweep = now + SWEEP_S
        if sweep:
            self._sweep_unlinked()
        for j in missing:
            try:
                out[j] = self._open(paths[j])
            except OSError:
                self.release([h for h in out if h is not None])
                raise
        return out

    def release(self, held: Sequence[Held]) -> None:
        """Give back what ``hold`` gave; descriptors dropped meanwhile close now."""
        with self._lock:
            fds = [h.unhold() for h in held]
        _close_fds(fds)

    def discard(self, h: Held) -> None:
        """Stop keeping ``h`` (a read through it failed: the next read opens the path again);
        it closes once no read holds it."""
        with self._lock:
            fd = None
            if self._kept.get(h.path) is h:
                del self._kept[h.path]
                fd = h.drop()
        _close_fds([fd])

    def forget(self, path: str) -> None:
        """The file at ``path`` was deleted: close its kept descriptor (once no read holds it),
        so that its blocks are freed now (invariant 3)."""
        with self._lock:
            h = self._kept.pop(path, None)
            fd = None if h is None else h.drop()
        _close_fds([fd])

    def close(self) -> None:
        """Close every kept descriptor (held ones as they are released); keep none from now on."""
        with self._lock:
            self._closed = True
            _close_all(self._kept)

    # ------------------------------------------------------------------ internals
    def _open(self, path: str) -> Held:
        """Open ``path`` (no lock held: a slow open blocks only its caller) and keep it, unless
        another thread kept it meanwhile (then use that one) or ``close`` has run."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno not in (errno.EMFILE, errno.ENFILE):
                raise
            self._shed()  # out of descriptors: give back the idle kept ones, then try once more
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        h = Held(fd, path)
        h.refs = 1
        done: list[int | None] = []
        with self._lock:
            other = self._kept.get(path)
            if other is not None:  # another thread opened it first: use that one
                other.refs += 1
                self._kept.move_to_end(path)
                done.append(fd)  # ours, never shared
                h = other
            elif self._closed:
                h.dropped = True  # nothing is kept after close: closed on release
            else:
                self._kept[path] = h
                while len(self._kept) > self.capacity:
                    done.append(self._kept.popitem(last=False)[1].drop())
            self._opens += 1
            sweep = not self._opens % SWEEP_EVERY
        _close_fds(done)
        if sweep:
            self._sweep_unlinked()
        return h

    def _shed(self) -> None:
        """Close every idle kept descriptor (the process ran out of descriptors)."""
        with self._lock:
            idle = [p for p, h in self._kept.items() if not h.refs]
            fds = [self._kept.pop(p).drop() for p in idle]
        _close_fds(fds)
        log.warning("out of file descriptors: closed %d kept pack descriptors", len(fds))

    def _sweep_unlinked(self) -> None:
        """Forget kept descriptors whose file has no name left (invariant 3)."""
        with self._lock:
            items = list(self._kept.values())
            for h in items:
                h.refs += 1  # held across the fstat, so that nothing closes it meanwhile
        gone = []
        for h in items:
            try:
                if os.fstat(h.fd).st_nlink == 0:
                    gone.append(h)
            except OSError:
                gone.append(h)
        self.release(items)
        for h in gone:
            self.discard(h)
