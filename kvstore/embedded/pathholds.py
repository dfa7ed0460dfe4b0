"""Fragment paths taken in the index while their I/O runs outside any write transaction.

Called through ``kvstore.embedded.index.Index`` (``take_path_txn``, ``release_paths``) by the orphan
sweep (``kvstore.maintenance.orphans``: deleting a stale copy of a slot) and by repair
(``kvstore.maintenance.rebuild._rebuild``: writing a rebuilt fragment in a new place). Whichever
takes a path first, the other sees it and leaves the file alone.

A hold is one record of the index's ``info`` database::

    b"path\\0" || target || b"\\0" || rel  ->  who (1 byte: b"s" sweep, b"r" repair)
                                              || pid (u64 BE)
                                              || start (u64 BE: the process's start time,
                                                 /proc/<pid>/stat field 22; 0 unknown)
                                              || serial (u64 BE: which take of this process)

(A hold written before start times were recorded is 9 bytes: its start is unknown; one
before serials, 17. A record too short to name a pid is damaged and holds nothing.)

Who holds what, and why a crash never blocks a path for good:
  1. This process holds a path only while its ``PathHolds`` has it in ``held`` (taken and
     not given back) with the serial the record carries. A record with this process's pid
     that is not in ``held`` under its serial holds nothing (a take whose transaction did not
     commit left the record as it was, and must not block that path for the life of the
     process): it is an earlier process's with the same pid (a daemon in a container is
     pid 1 after every restart, and a hold left by a crash inside the sweep's delete must not
     pass for the restarted daemon's own, or that orphan is never swept and that slot never
     rebuilt there) or a give-back that failed. Records like that are dropped when
     the index opens (``drop_stale_txn``) and taken over by ``take_txn``.
  2. Another process's hold holds while its pid runs and, where /proc tells start times,
     that process started when the hold says: a pid reused by a new process (the
     restarted container's pid 1) holds nothing of the old one's.
  3. Unsure (a pid not ours to signal, no /proc) counts as held: a path is never taken
     from a live holder.
  4. A give-back that fails (the index map full, say) is logged, never raised: the hold
     left behind holds nothing for this process (1), is retried at its next give-back,
     and for other processes holds until then or until this process ends (2).
  5. Closing the index gives back what this process still has there (``close``): no later
     give-back could, and a process that closes its store and runs on would otherwise block
     those paths for other processes until it ended. All of them in one write
     transaction first; when that fails, each in a transaction of its own, up to
     ``CLOSE_TRIES`` attempts in all per path, so one path whose give-back keeps failing
     keeps only itself (retrying one transaction for all of them, one failing path would
     keep every other). What still fails is logged as one error naming those paths and
     counting those kept and given back, never raised.

Assumption: every process that opens one data directory runs on one host and in one pid
namespace, as for LMDB's own reader table, which is checked by pid the same way. A holder
in another pid namespace (a daemon in a container, ``kvtool`` on the host, one volume
shared) has a pid that means nothing here: it may look gone while it runs (its path then
taken from under it: a sweep may delete a fragment repair has just rebuilt there) or alive
when it is gone (until that pid ends). Do not run maintenance on one directory from two
pid namespaces at once.
"""

from __future__ import annotations

import logging
import itertools
import os
import struct
from typing import Iterable

import lmdb

log = logging.getLogger(__name__)

PREFIX = b"path\0"
_HOLD = struct.Struct(">cQQQ")  # who, pid, start time (0 unknown), serial
_PID = struct.Struct(">Q")
_serials = itertools.count(1)
CLOSE_TRIES = 3  # give-backs attempted at close (rule 5); a full map seldom frees itself sooner
_CLOSE_NAMED = 10  # paths named in the error when a give-back at close fails (the rest counted)


def path_key(target: str, rel: str) -> bytes:
    return PREFIX + target.encode() + b"\0" + rel.encode()


def _shown(key: bytes) -> str:
    """A hold's key as ``target:rel``, for a log line."""
    return key[len(PREFIX):].decode(errors="replace").replace("\0", ":", 1)


def start_time(pid: int) -> int:
    """When process ``pid`` started (clock ticks after boot: /proc/<pid>/stat field 22), or 0
    when that cannot be told (no /proc, the process gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])  # fields from 3 on follow the ")" of comm
    except (OSError, ValueError, IndexError):
        return 0


def holder(raw: bytes) -> tuple[int, int]:
    """(pid, start time) of a hold record; start 0 when unknown (a 9-byte hold of old); pid 0
    for a record too short to name one (damaged: it holds nothing)."""
    if len(raw) < 9:
        return 0, 0
    return _PID.unpack_from(raw, 1)[0], (_PID.unpack_from(raw, 9)[0] if len(raw) >= 17 else 0)


def serial(raw: bytes) -> int | None:
    """Which take of its process wrote a hold record (``None``: a record of old, without one)."""
    return _PID.unpack_from(raw, 17)[0] if len(raw) >= _HOLD.size else None


def runs(pid: int, start: int) -> bool:
    """Does the process that wrote a hold (``pid``, its ``start`` time) still run? Unsure (a
    pid not ours to signal, a start time unknown) counts as yes."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # runs, as another user's process
    now = start_time(pid) if start else 0
    return not (now and now != start)  # another start: the pid was reused, the holder is gone


class PathHolds:
    """The holds of one process on one index (LMDB refuses a second ``Index`` on one
    directory in a process, so ``held`` is all this process holds there)."""

    def __init__(self, info_db) -> None:
        self.db = info_db
        self.held: dict[bytes, int] = {}  # key taken and not given back -> the serial of that take
        self.unreleased: set[bytes] = set()  # keys given back whose record may still be there

    def _mine(self, key: bytes, raw: bytes) -> bool:
        """Is ``raw`` (the record at ``key``) a hold this process took and still holds?"""
        return holder(raw)[0] == os.getpid() and self.held.get(key, -1) == serial(raw)

    def _holds(self, key: bytes, raw: bytes) -> bool:
        pid, start = holder(raw)
        if pid == 0:
            return False  # damaged
        if pid == os.getpid():
            return self._mine(key, raw)
        return runs(pid, start)

    def drop_stale_txn(self, txn: lmdb.Transaction) -> int:
        """Delete every hold that holds nothing (see the module docstring); how many."""
        cur = txn.cursor(db=self.db)
        stale = []
        if cur.set_range(PREFIX):
            for key, raw in cur:
                if not key.startswith(PREFIX):
                    break
                if not self._holds(key, raw):
                    stale.append(key)
        for key in stale:
            txn.delete(key, db=self.db)
        return len(stale)

    def take_txn(self, txn: lmdb.Transaction, target: str, rel: str, who: str) -> bool:
        key = path_key(target, rel)
        raw = txn.get(key, db=self.db)
        if raw is not None and self._holds(key, raw):
            return False
        pid, n = os.getpid(), next(_serials)
        txn.put(key, _HOLD.pack(who[:1].encode(), pid, start_time(pid), n), db=self.db)
        self.held[key] = n  # a take that does not commit leaves the record as it was: not this serial
        return True

    def recorded_txn(self, txn: lmdb.Transaction, target: str, rel: str) -> bool:
        """Is there a hold record at this path, whoever wrote it and whether or not that
        process still runs? (A put about to index the file takes any record for a sweep
        deleting it: ``kvstore.maintenance.orphans``; judging the holder alive by pid could be wrong.)"""
        return txn.get(path_key(target, rel), db=self.db) is not None

    def release_txn(self, txn: lmdb.Transaction, target: str, rel: str) -> None:
        key = path_key(target, rel)
        self.held.pop(key, None)
        raw = txn.get(key, db=self.db)
        if raw is not None and holder(raw)[0] == os.getpid():
            txn.delete(key, db=self.db)  # only ours: one taken over from a holder that looked gone stays

    def release(self, env: lmdb.Environment, paths: Iterable[tuple[str, str]]) -> None:
        """Give ``paths`` back in one write transaction of its own, with any an earlier call
        could not; never raises an LMDB error (rule 4 of the module docstring)."""
        keys = {path_key(t, r) for t, r in paths}
        for key in keys:
            self.held.pop(key, None)
        self.unreleased |= keys
        attempt = len(self.unreleased)
        exc = self._give_back(env)
        if exc is not None:
            log.warning("could not give back %d fragment path(s) held in the index (%s): they hold nothing "
                        "for this process, are retried at its next give-back and dropped when the index "
                        "is next opened; other processes wait for them until then", attempt, exc)

    def close(self, env: lmdb.Environment) -> None:
        """Before ``env`` closes: give back every path this process still has in it, those
        whose give-back failed and any still taken (rule 5 of the module docstring): all in one
        write transaction, then, for what that left, each path in a transaction of its own, up to
        ``CLOSE_TRIES`` attempts per path in all. Never raises an LMDB error: what stays is
        logged. Leaves nothing to give back, so a second call does nothing."""
        self.unreleased |= set(self.held)
        self.held.clear()
        if not self.unreleased:
            return
        before = len(self.unreleased)
        exc = self._give_back(env)  # the common case: one transaction for all
        for _ in range(CLOSE_TRIES - 1):
            if not self.unreleased:
                return
            failed: set[bytes] = set()
            for key in sorted(self.unreleased):  # one path's failure keeps only that path
                err = self._give_back(env, {key})
                if err is not None:
                    exc = err
                    failed.add(key)
            self.unreleased = failed
        if not self.unreleased:
            return
        left = sorted(self.unreleased)
        named = ", ".join(_shown(k) for k in left[:_CLOSE_NAMED])
        more = f" and {len(left) - _CLOSE_NAMED} more" if len(left) > _CLOSE_NAMED else ""
        log.error("closing the index: kept %d fragment path hold(s) whose give-back failed %d times (last: %s), "
                  "gave back the other %d: %s%s. Other processes see them held (GC does not sweep them, repair "
                  "does not rebuild there) until this process (pid %d) ends or opens this index again",
                  len(left), CLOSE_TRIES, exc, before - len(left), named, more, os.getpid())
        self.unreleased.clear()  # the environment closes: nothing here can give them back any more

    def _give_back(self, env: lmdb.Environment, keys: set[bytes] | None = None) -> lmdb.Error | None:
        """Delete the records of ``keys`` (default: all of ``unreleased``) that are still this
        process's leftovers, in one write transaction; ``None`` when it committed (those keys
        then out of ``unreleased``), else the LMDB error (``unreleased`` as it was)."""
        attempt = set(self.unreleased if keys is None else keys)
        try:
            with env.begin(write=True) as txn:
                for key in attempt:
                    raw = txn.get(key, db=self.db)
                    # taken again meanwhile (by this process: in held; by another: not our pid) stays
                    if raw is not None and holder(raw)[0] == os.getpid() and not self._mine(key, raw):
                        txn.delete(key, db=self.db)
        except lmdb.Error as exc:
            return exc
        self.unreleased -= attempt
        return None
