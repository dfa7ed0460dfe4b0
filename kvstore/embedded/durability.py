"""How the store makes written files durable: ``fsync_dir`` (a new name in a directory),
``syncfs`` (one call for every dirty file of a filesystem) and ``sync_plan``, which resolves
``StoreConfig.sync_mode`` for a store's targets ("file": fsync each file and its directory;
"fs": write without fsync, then one syncfs per filesystem before the index commits). The
write path that uses them is ``kvstore.embedded.fragment_writes`` (``FragmentWriter.sync_after``) and
``kvstore.embedded.targets`` (``LocalTarget.write``).
"""

from __future__ import annotations

import errno
import os
import re
import sys
import threading
from typing import Any, Mapping, Protocol, Sequence

from kvstore.errors import InternalError, InvalidRequest


class SyncedTarget(Protocol):
    """What ``sync_plan`` reads of a target (``kvstore.embedded.targets.Target`` has it): its name,
    whether it is a local directory, that directory, and its spec (for the URL scheme)."""

    name: str
    local: bool
    root: str
    spec: Any

# Filesystems whose syncfs(2) writes back every dirty page and inode and commits the journal,
# and (Linux >= 5.8) reports writeback errors: one call makes all of a put's files durable.
# Not network or FUSE filesystems: there syncfs may not reach the servers.
SYNCFS_FSTYPES = frozenset({"ext4", "xfs", "btrfs"})
SYNCFS_MIN_KERNEL = (5, 8)


def _libc_syncfs():
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    return fn


_SYNCFS = _libc_syncfs() if sys.platform.startswith("linux") else None


def syncfs(path: str) -> None:
    """Make every written file and directory entry of ``path``'s filesystem durable."""
    if _SYNCFS is None:
        raise OSError(errno.ENOSYS, "syncfs is not available here", path)
    fd = os.open(path, os.O_RDONLY)
    try:
        syncfs_fd(fd, path)
    finally:
        os.close(fd)


def syncfs_fd(fd: int, path: str) -> None:
    """``syncfs`` through a descriptor the caller holds open (``path`` names it in errors): it
    also reports writeback errors of that filesystem since the descriptor was opened."""
    import ctypes

    if _SYNCFS is None:
        raise OSError(errno.ENOSYS, "syncfs is not available here", path)
    if _SYNCFS(fd) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)


class RootSyncs:
    """``syncfs`` of the filesystems ``targets``' roots sit on, through one descriptor per
    filesystem, opened at the first ``hold`` of a target there (before the first file written
    there) and held until ``close``: syncfs reports the writeback errors that happened since the
    descriptor it is called on was opened, so one opened after the files were written would miss
    those of their pages written back meanwhile. One per store, shared by its writes and its
    segments' flushes. Thread-safe."""

    def __init__(self, targets: Mapping[str, SyncedTarget]):
        self.targets = targets
        self._devs: dict[str, int] = {}  # target name -> st_dev of its root
        self._fds: dict[int, int] = {}  # st_dev -> the descriptor held
        self._lock = threading.Lock()

    def dev(self, name: str) -> int:
        """The filesystem (``st_dev``) target ``name``'s root is on."""
        dev = self._devs.get(name)
        if dev is None:
            dev = self._devs[name] = os.stat(self.targets[name].root).st_dev
        return dev

    def hold(self, name: str) -> int:
        """Before writing to target ``name``: its filesystem's descriptor held; its ``dev``."""
        dev = self.dev(name)
        if dev not in self._fds:
            with self._lock:
                if dev not in self._fds:
                    self._fds[dev] = os.open(self.targets[name].root, os.O_RDONLY | os.O_CLOEXEC)
        return dev

    def sync(self, name: str) -> None:
        """``syncfs`` of target ``name``'s filesystem through the descriptor ``hold`` opened
        (``OSError`` if it fails)."""
        fd = self._fds.get(self.dev(name))
        if fd is None:
            raise InternalError(f"syncfs of target {name} with no descriptor held (a kvstore bug: hold it "
                                "before writing)")
        syncfs_fd(fd, self.targets[name].root)

    def close(self) -> None:
        """Close the descriptors held; called once no write is in flight."""
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def fs_type(path: str) -> str:
    """The type of the filesystem ``path`` is on (``/proc/self/mountinfo``), "" if unknown."""
    real = os.path.realpath(path)
    best, kind = "", ""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                left, _, right = line.partition(" - ")
                mnt = left.split(" ")[4].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, right.split(" ", 1)[0]
    except OSError:
        return ""
    return kind


def sync_plan(mode: str, targets: Sequence[SyncedTarget]) -> tuple[str, str]:
    """Resolve ``StoreConfig.sync_mode`` for these targets: ("file" or "fs", why)."""
    if mode == "file":
        return "file", "sync_mode = file"
    if mode == "fs":
        if _SYNCFS is None or not all(t.local for t in targets):
            raise InvalidRequest("sync_mode = fs needs Linux and local targets only; use auto or file")
        return "fs", "sync_mode = fs"
    if _SYNCFS is None:
        return "file", "no syncfs on this platform"
    release = tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2])
    if release < SYNCFS_MIN_KERNEL:
        return "file", f"kernel {os.uname().release} < 5.8 (syncfs does not report write errors)"
    for t in targets:
        kind = fs_type(t.root) if t.local else ""
        if kind not in SYNCFS_FSTYPES:
            return "file", f"target {t.name} is on {kind or t.spec.url.split('://', 1)[0]}, not {sorted(SYNCFS_FSTYPES)}"
    return "fs", "every target on a local " + "/".join(sorted({fs_type(t.root) for t in targets}))


def fsync_dir(d: str) -> None:
    """Make the entries of directory ``d`` (a new or renamed name in it) durable."""
    dfd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
