"""Room for the index on a full filesystem: deletions and GC commit when nothing else can.

Called by the embedded store (``kvstore.embedded.store``): ``release_if_full`` before its index opens,
``ensure`` once it is open and before every put (``check_put``), ``release`` when an index
write of a deletion finds no room (``run_freeing``, for ``kvstore.embedded.calls.frees_space``), ``no_space`` to tell
such a failure from others.

Problem: every index change is an LMDB write transaction, and a commit needs free pages; when
the file has none left it grows, and on a full filesystem that fails (``lmdb.DiskError``, or
``EIO`` from a short page write). Deleting an entry, expiring one, GC's first step (writing
the batched access times) are such changes: without this module the store's own tools for
freeing space stopped working exactly when the disk filled up.

Mechanism:
  1. A spare file, ``<data_dir>/index/space.reserve``, of ``index_reserve_bytes``, allocated
     on the index's filesystem (``posix_fallocate``: real blocks, not a hole) when the store
     opens and whenever it is missing and there is room (``ensure``). A store opening on a
     filesystem with almost nothing free releases it first (``release_if_full``): the open
     itself may need to write.
  2. A deletion (``delete``, ``gc``, ``evict_to``) whose index write fails for want of space
     deletes the spare file and runs once more (``frees_space``): the index grows into the
     space it held, and the deletion's files are then freed by the same pass (GC) or the next.
  3. A put never spends that space: before writing anything it makes sure the spare file is
     there (``check_put``: one ``stat``), re-making it if it was released, but only while the
     filesystem has twice its size free (so a put racing a deletion that has just released
     it does not take the room back before the deletion commits); when it cannot, the put is
     refused with ``CapacityExceeded`` naming ENOSPC, and so is an index commit of a put that
     finds no room (its files removed).
  4. Recovery needs nobody: once deletions and GC have freed space, the next put re-makes
     the spare file and goes on.

Every process on one data directory shares the one spare file (its name is fixed); two
making it at once each write a temporary file and rename it into place, so it is whole.
What this does not cover: a filesystem where allocated blocks do not hold space (compressed
or copy-on-write ones may free less than the file's size, or nothing, when it is deleted),
and a full filesystem under the targets but not the index (a put then fails at its fragment
writes, ``CapacityExceeded`` ENOSPC, and deletions need no room to commit).
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

import lmdb

from kvstore.errors import CapacityExceeded

log = logging.getLogger(__name__)
T = TypeVar("T")

RESERVE_NAME = "space.reserve"
# An LMDB error other than DiskError is taken for a full filesystem (a short page write reads
# EIO) only while the index's filesystem has less than this free, or less than the reserve.
_NEARLY_FULL_BYTES = 1 << 20


class IndexRoom:
    """The spare file of one data directory's index (see the module docstring)."""

    def __init__(self, index_dir: Path, nbytes: int):
        self.path = Path(index_dir) / RESERVE_NAME
        self.nbytes = nbytes  # 0: no spare file (nothing is reserved, no put is refused for it)
        self._lock = threading.Lock()

    def free_bytes(self) -> int:
        """Bytes an unprivileged writer may still allocate on the index's filesystem."""
        st = os.statvfs(self.path.parent)
        return st.f_bavail * st.f_frsize

    def no_space(self, exc: BaseException) -> bool:
        """Does ``exc`` (from an LMDB write) mean the index's filesystem has no room?"""
        if isinstance(exc, lmdb.DiskError):
            return True
        if not isinstance(exc, lmdb.Error) or isinstance(exc, lmdb.MapFullError):
            return False
        if "Input/output error" not in str(exc) and "No space left" not in str(exc):
            return False
        try:
            return self.free_bytes() < max(_NEARLY_FULL_BYTES, self.nbytes)
        except OSError:
            return False

    def ensure(self) -> bool:
        """The spare file in place, made now if it is missing: False when there is no room for
        it, else True (also with no reserve configured). Made only while the filesystem has
        twice its size free: a deletion that has just released it needs that room to commit,
        and a put racing it must not take it back first."""
        if not self.nbytes or self._present():
            return True
        with self._lock:
            if self._present():
                return True
            try:
                if self.free_bytes() < 2 * self.nbytes:
                    return False
            except OSError:
                pass  # cannot tell: try to make it
            tmp = self.path.with_name(f".{RESERVE_NAME}.{os.getpid()}.{secrets.token_hex(4)}")
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.posix_fallocate(fd, 0, self.nbytes)
                finally:
                    os.close(fd)
                os.replace(tmp, self.path)
            except OSError as exc:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    return False
                log.warning("cannot make the index's spare file %s (%s): this process keeps none, so deletions "
                            "may not commit on a full filesystem", self.path, exc)
                self.nbytes = 0  # not for want of space: puts are not refused for it, nor is it tried again
                return True
            log.info("index spare file %s in place (%d bytes)", self.path, self.nbytes)
            return True

    def _present(self) -> bool:
        try:
            return os.stat(self.path).st_size >= self.nbytes
        except FileNotFoundError:
            return False

    def release(self) -> int:
        """Delete the spare file, so that an index write can grow into its space: the bytes it
        held (0: there was none to release)."""
        with self._lock:
            try:
                size = os.stat(self.path).st_size
                os.unlink(self.path)
            except FileNotFoundError:
                return 0
        log.warning("the filesystem of the index %s is full: released its %d spare bytes so that deletions "
                    "commit; puts are refused until there is room to reserve them again", self.path.parent, size)
        return size

    def run_freeing(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` for a deletion (step 2): when an index write of it finds no room,
        the spare file is released and ``fn`` runs once more (a second failure is raised). A
        transaction that failed changed nothing, and what committed before it stays done, so
        running it again is safe."""
        try:
            return fn(*args, **kwargs)
        except lmdb.Error as exc:
            if not self.no_space(exc) or not self.release():
                raise
        return fn(*args, **kwargs)

    def release_if_full(self) -> None:
        """Before the index opens (its open may write: dropping stale holds, a new target's id):
        release the spare file when the filesystem has almost nothing free, so that the open,
        and the ``kvtool gc`` or ``delete`` it is for, can commit."""
        try:
            full = self.nbytes and self.path.exists() and self.free_bytes() < _NEARLY_FULL_BYTES
        except OSError:
            return
        if full:
            self.release()

    def check_put(self) -> None:
        """Before a put writes anything: ``CapacityExceeded`` (ENOSPC) when the spare file is
        missing and there is no room to make it again."""
        if not self.ensure():
            raise CapacityExceeded(
                f"no space left on the filesystem of the index ({os.strerror(errno.ENOSPC)}, ENOSPC): "
                f"{self.free_bytes()} bytes free, {self.nbytes} must stay reserved so that deletions can "
                "commit. Free space: `kvtool gc` (and `kvtool delete`), or lower capacity_bytes; puts go on "
                "by themselves once there is room")

    def full_error(self, exc: BaseException, what: str) -> CapacityExceeded:
        """The typed error for an index write that found no room (``no_space``), to raise ``from exc``."""
        return CapacityExceeded(f"{what}: no space left on the filesystem of the index (ENOSPC: {exc}); free "
                                "space with `kvtool gc` or `kvtool delete`, which keep room to commit")
