"""Taking a data directory of an older format version to this one (``kvtool migrate``).

A data directory's format version is its marker's ``format_version``
(``kvstore.embedded.datadir.DATA_FORMAT_VERSION`` says what each version means). A version in
``MIGRATES_FROM`` differs from this one only in what code may do to the files, not in the
files: version 2's fragment frames, pack files and index records are valid version 3 ones, but
code of version 2 assumes a published pack never grows. So the migration rewrites the marker
and nothing else, and it must not run while a process of the old version uses the directory
(every open of this version refuses the old marker, and every open of the old version refuses
the new one, so the two never share a directory).

``migrate(data_dir)``, the steps in order:

1. **Read the marker**, whatever its version (``DataDir.read_marker(any_version=True)``; a
   marker that cannot be read as one is ``IncompatibleFormat``). Already this version: nothing
   to do. A version not in ``MIGRATES_FROM`` (version 1, or one newer than this code): refused,
   with ``format_refusal``'s words.
2. **Open the index read-only** (LMDB, with its lock file) and **take its lock exclusively**
   (``_exclusive``, without waiting): every process that has the index open (a store, a daemon,
   kvtool) holds LMDB's shared ``fcntl`` lock on the first byte of ``index/lock.mdb`` for as
   long as it is open, whether or not it is reading, so a refused exclusive lock proves a user,
   named by its pid where the system says (``StoreUnavailable``: stop it, run again). Held until
   step 4 is done, so a process that opens the index meanwhile waits for it.
3. **Check the index** is this directory's: its identity (``info`` ``identity``) is the one the
   marker records (``index_id``; the check a store makes at open) and its format is one this
   code reads. A missing or damaged index is refused (``CorruptData``): rebuild it with the
   release that wrote the directory, then migrate.
4. **Rewrite the marker** (``write_marker_file``: temporary file, fsync, rename, directory
   fsync), every field kept but ``format_version``. ``dry_run`` stops before this step.

Idempotent: a crash before step 4's rename leaves the old marker (run again), after it the new
one (run again: nothing to do).

Not detected in step 2, so the operator stops them first (``kvtool migrate``'s help says so): a
process on another host whose filesystem does not carry ``fcntl`` locks between hosts; a process
that read the old marker and has not opened the index yet (one starting during the migration);
clients that read or write fragments directly without opening the index (they work through a
daemon, which is detected).
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import lmdb

from kvstore.embedded.datadir import (DATA_FORMAT_VERSION, FORMAT_FILE, MIGRATES_FROM, DataDir, format_refusal,
                                      write_marker_file)
from kvstore.embedded.index import INDEX_FORMAT, Index
from kvstore.embedded.index_file import check_index_file
from kvstore.errors import CorruptData, IncompatibleFormat, InvalidRequest, StoreUnavailable

# LMDB's lock file in the index directory, and the byte every process that has the index open
# holds a shared fcntl lock on (LMDB's "excl" lock: taken exclusively only by a first opener
# while it resets the reader table, shared afterwards until the environment is closed).
LOCK_FILE = "lock.mdb"
_OPEN_LOCK_BYTE = 0


@dataclass(frozen=True, slots=True)
class MigrateResult:
    """What ``migrate`` found and did: ``migrated`` when the marker was rewritten now (never
    with ``dry_run``); ``from_version`` is the version the marker recorded."""

    data_dir: str
    from_version: int
    to_version: int
    migrated: bool
    dry_run: bool

    @property
    def needed(self) -> bool:
        """Was (or, with ``dry_run``, would) the marker be rewritten?"""
        return self.from_version != self.to_version

    def as_dict(self) -> dict:
        return {**asdict(self), "needed": self.needed}


def migrate(data_dir: str | Path, *, dry_run: bool = False) -> MigrateResult:
    """Take the data directory ``data_dir`` to ``DATA_FORMAT_VERSION`` (module docstring).
    Raises ``InvalidRequest`` for a path that is not a data directory, ``IncompatibleFormat``
    for a version it does not migrate, ``StoreUnavailable`` while a process has the index open,
    ``CorruptData`` for a missing, damaged or foreign index."""
    data_dir = Path(data_dir).resolve()
    marker = DataDir(data_dir).read_marker(any_version=True)
    if marker is None:
        raise InvalidRequest(f"{data_dir} is not a kvstore data directory (no {FORMAT_FILE}); nothing to migrate")
    version = marker["format_version"]
    if version == DATA_FORMAT_VERSION:
        return MigrateResult(str(data_dir), version, DATA_FORMAT_VERSION, migrated=False, dry_run=dry_run)
    if version not in MIGRATES_FROM:
        raise IncompatibleFormat(f"{format_refusal(data_dir, version)}; `kvtool migrate` takes only version "
                                 f"{', '.join(map(str, sorted(MIGRATES_FROM)))} to {DATA_FORMAT_VERSION}")
    index_dir = data_dir / "index"
    remedy = (f"rebuild it with `kvtool rebuild-index {data_dir}` of the kvstack release that wrote the directory "
              f"(format version {version}), or restore it from a copy; then run `kvtool migrate` again")
    data_file = index_dir / "data.mdb"
    if not data_file.is_file() or data_file.stat().st_size == 0:
        raise CorruptData(f"the index of data directory {data_dir} is missing or empty ({data_file}); {remedy}")
    check_index_file(str(index_dir), remedy)  # a truncated file is refused before LMDB maps it (a SIGBUS)
    try:
        env = lmdb.open(str(index_dir), readonly=True, max_dbs=len(Index.DBS) + 1, readahead=False)
    except lmdb.Error as exc:
        if "already open in this process" in str(exc):  # a store of this very process holds it
            raise StoreUnavailable(f"the index at {index_dir} is open in this process: close the store that "
                                   "holds it, then migrate") from exc
        if any(m in str(exc) for m in ("Permission denied", "Read-only file system")):
            raise InvalidRequest(f"the index at {index_dir} cannot be opened ({exc}): kvtool migrate needs write "
                                 "access to the data directory (its lock file and its marker)") from exc
        raise CorruptData(f"the index at {index_dir} cannot be opened ({exc}); {remedy}") from exc
    try:
        # The exclusive lock is taken after LMDB opened the environment: that open creates the lock
        # file if it is missing, and takes the shared lock for this process, which ours replaces.
        # Closing any descriptor of the lock file drops every lock this process holds on it, so the
        # marker is written before either is closed.
        lock_fd = _exclusive(index_dir / LOCK_FILE, data_dir)
        try:
            _check_index(env, index_dir, marker, data_dir, remedy)
            if not dry_run:
                write_marker_file(data_dir, {**marker, "format_version": DATA_FORMAT_VERSION})
        finally:
            os.close(lock_fd)
    finally:
        env.close()
    return MigrateResult(str(data_dir), version, DATA_FORMAT_VERSION, migrated=not dry_run, dry_run=dry_run)


def _check_index(env: lmdb.Environment, index_dir: Path, marker: dict, data_dir: Path, remedy: str) -> None:
    """``CorruptData`` unless the index at ``index_dir`` is the one ``marker`` names (its
    identity) in a format this code reads (``IncompatibleFormat`` otherwise). A marker that
    names no index (written before identities were recorded) accepts any; the store records
    the identity at its next open."""
    try:
        info = env.open_db(b"info", create=False)
        with env.begin() as txn:
            ident = txn.get(b"identity", db=info)
            fmt = txn.get(b"format", db=info)
    except lmdb.Error as exc:  # no "info" database: not a kvstore index
        raise CorruptData(f"the index at {index_dir} is not a kvstore index or is damaged ({exc}); {remedy}") from exc
    if fmt is not None and struct.unpack(">Q", fmt)[0] != INDEX_FORMAT:
        raise IncompatibleFormat(f"the index at {index_dir} has format {struct.unpack('>Q', fmt)[0]}; this kvstore "
                                 f"reads {INDEX_FORMAT}; open the directory with a matching kvstack release")
    recorded = marker.get("index_id")
    if recorded and (ident is None or bytes(ident).hex() != recorded):
        raise CorruptData(
            f"the index at {index_dir} is not the one data directory {data_dir} was created with (it was "
            f"recreated or copied from another directory); {remedy}")


def _exclusive(lock_path: Path, data_dir: Path) -> int:
    """A descriptor of ``lock_path`` holding the exclusive lock on its open-lock byte; closing
    it gives the lock back. ``StoreUnavailable`` naming the holder when another process has the
    index open; ``InvalidRequest`` when the filesystem cannot lock (the migration cannot tell
    who uses the directory, so it does not guess)."""
    try:
        fd = os.open(lock_path, os.O_RDWR)
    except OSError as exc:
        raise InvalidRequest(f"cannot open {lock_path} to see whether a process uses {data_dir}: "
                             f"{exc.strerror or exc}; kvtool migrate needs write access to the directory") from exc
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, _OPEN_LOCK_BYTE, os.SEEK_SET)
    except OSError as exc:
        holder = _lock_holder(fd) if exc.errno in (errno.EAGAIN, errno.EACCES) else None
        os.close(fd)
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            who = f"process {holder}" if holder else "another process"
            raise StoreUnavailable(
                f"{who} has the index of {data_dir} open: stop every process using the directory (daemons, "
                "engines with an embedded store, kvtool), then run `kvtool migrate` again") from exc
        raise InvalidRequest(f"cannot lock {lock_path} ({exc.strerror or exc}), so whether a process uses {data_dir} "
                             "cannot be told; run kvtool migrate on a filesystem with fcntl locks") from exc
    return fd


# struct flock on Linux (x86-64 and arm64): l_type, l_whence (short), l_start, l_len (off_t), l_pid.
_FLOCK = struct.Struct("hhqqi")
_FLOCK_SIZE = 32  # with the kernel's trailing padding


def _lock_holder(fd: int) -> int | None:
    """The pid of a process holding a lock that conflicts with the exclusive one (``F_GETLK``),
    or ``None`` where the system does not say (other platforms, or it was just released)."""
    if not sys.platform.startswith("linux"):
        return None
    query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, _OPEN_LOCK_BYTE, 1, 0)
    try:
        raw = fcntl.fcntl(fd, fcntl.F_GETLK, query.ljust(_FLOCK_SIZE, b"\0"))
    except OSError:
        return None
    kind, _whence, _start, _len, pid = _FLOCK.unpack(raw[:_FLOCK.size])
    return pid if kind != fcntl.F_UNLCK and pid > 0 else None
