"""Fragment paths held in the index (``kvstore.embedded.pathholds``): a hold whose process is gone,
or whose pid came back as another process, never blocks its path; a give-back that fails
neither stops GC nor holds the path for good."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import sys
from pathlib import Path

import lmdb

import kvstore
from kvstore.embedded.pathholds import path_key, start_time

from tests.kvstore.embedded.test_faults import _slot_orphan_setup


def _put_hold(s, target: str, rel: str, pid: int, start: int) -> None:
    """A hold record as a process ``pid`` started at ``start`` left it (not taken by ``s``)."""
    with s.index.env.begin(write=True) as txn:
        txn.put(path_key(target, rel), b"s" + struct.pack(">QQ", pid, start), db=s.index.db["info"])


def _hold(s, target: str, rel: str) -> bytes | None:
    with s.index.env.begin() as txn:
        raw = txn.get(path_key(target, rel), db=s.index.db["info"])
    return None if raw is None else bytes(raw)


def test_a_hold_left_under_this_processes_pid_holds_nothing(tmp_path):
    """A daemon in a container is pid 1 after every restart: a crash inside the sweep's delete
    left a hold with pid 1, which the restarted daemon took for its own live hold, and init
    (pid 1) looked alive to everyone else, so that orphan was never swept and repair never
    rebuilt that slot there. A hold under this process's pid that this store did not
    take is an earlier process's: taken over, and dropped when the index is next opened."""
    s, _ek, key, value, tgt, _cur, rel = _slot_orphan_setup(tmp_path)
    with s:
        _put_hold(s, tgt.name, rel, os.getpid(), start_time(os.getpid()))
        assert s.gc()["orphans"] == 1 and not (Path(tgt.root) / rel).exists()
        _put_hold(s, tgt.name, rel, os.getpid(), 0)
    with kvstore.connect(s.data_dir, fsync=False, orphan_grace_s=0) as s2:
        assert _hold(s2, tgt.name, rel) is None  # dropped at open
        _put_hold(s2, tgt.name, rel, os.getpid(), 0)
        with s2.index.env.begin(write=True) as txn:
            assert s2.index.take_path_txn(txn, tgt.name, rel, "repair")
            assert not s2.index.take_path_txn(txn, tgt.name, rel, "sweep")  # now ours: held
        s2.index.release_paths([(tgt.name, rel)])
        assert _hold(s2, tgt.name, rel) is None
        assert s2.get(key) == value and s2.check() == []


def test_a_hold_of_a_pid_now_another_process_holds_nothing(tmp_path):
    """The holder's pid runs, but as a process started at another time (the pid reused):
    the hold is the old process's, and it is gone. A hold whose process runs still holds."""
    s, _ek, key, value, tgt, _cur, rel = _slot_orphan_setup(tmp_path)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with s:
            start = start_time(other.pid)
            if not start:  # no /proc: the pid alone tells, which holds
                _put_hold(s, tgt.name, rel, other.pid, 0)
                assert s.gc()["orphans"] == 0
                return
            _put_hold(s, tgt.name, rel, other.pid, start)
            assert s.gc()["orphans"] == 0 and (Path(tgt.root) / rel).exists()  # it runs: held
            _put_hold(s, tgt.name, rel, other.pid, start + 1)
            assert s.gc()["orphans"] == 1 and not (Path(tgt.root) / rel).exists()
            assert _hold(s, tgt.name, rel) is None
            assert s.get(key) == value and s.check() == []
    finally:
        other.kill()
        other.wait()


class _FailingWrites:
    """An LMDB environment whose next write transaction, once armed, fails as a full map does."""

    def __init__(self, env):
        self.env, self.armed = env, False

    def begin(self, write=False, **kw):
        if write and self.armed:
            self.armed = False
            raise lmdb.MapFullError("mdb_txn_begin: MDB_MAP_FULL (injected)")
        return self.env.begin(write=write, **kw)

    def __getattr__(self, name):
        return getattr(self.env, name)


def test_a_give_back_that_fails_neither_stops_gc_nor_holds_the_path(tmp_path, monkeypatch, caplog):
    """The sweep gives its path back in a write transaction of its own after the delete: when
    that failed (the index map full, say), the LMDB error ended GC, and the hold left behind
    looked like this live process's for as long as it ran. Now it is logged; the hold holds
    nothing for this process and is retried at its next give-back."""
    from kvstore.embedded.targets import LocalTarget

    s, _ek, key, value, tgt, _cur, rel = _slot_orphan_setup(tmp_path)
    with s:
        real_env, wrapped = s.index.env, _FailingWrites(s.index.env)
        real_delete = LocalTarget.delete

        def delete(self, path):
            wrapped.armed = self is tgt and path == rel  # the give-back that follows fails
            return real_delete(self, path)

        monkeypatch.setattr(LocalTarget, "delete", delete)
        monkeypatch.setattr(s.index, "env", wrapped)
        with caplog.at_level(logging.WARNING):
            assert s.gc()["orphans"] == 1
        monkeypatch.undo()
        assert s.index.env is real_env
        assert "could not give back 1 fragment path" in caplog.text
        assert _hold(s, tgt.name, rel) is not None  # left behind
        with s.index.env.begin(write=True) as txn:
            assert s.index.take_path_txn(txn, tgt.name, rel, "repair")  # holds nothing for us
        s.index.release_paths([(tgt.name, rel)])
        assert _hold(s, tgt.name, rel) is None
        # a failed give-back is retried by the next one
        with s.index.env.begin(write=True) as txn:
            assert s.index.take_path_txn(txn, tgt.name, rel, "repair")
        monkeypatch.setattr(s.index, "env", wrapped)
        wrapped.armed = True
        s.index.release_paths([(tgt.name, rel)])
        monkeypatch.undo()
        assert _hold(s, tgt.name, rel) is not None
        s.index.release_paths([])
        assert _hold(s, tgt.name, rel) is None
        assert s.get(key) == value and s.check() == []


def test_a_take_over_that_does_not_commit_holds_nothing(tmp_path):
    """A take-over of this process's own leftover hold (a failed give-back) inside a write
    transaction that does not commit left the old record, which ``held`` then claimed: the
    path was blocked for this process and, since the pid runs, for every other one."""
    s, _ek, key, value, tgt, _cur, rel = _slot_orphan_setup(tmp_path)
    with s:
        _put_hold(s, tgt.name, rel, os.getpid(), start_time(os.getpid()))  # a leftover of ours
        try:
            with s.index.env.begin(write=True) as txn:
                assert s.index.take_path_txn(txn, tgt.name, rel, "repair")
                raise RuntimeError("the commit fails")
        except RuntimeError:
            pass
        assert _hold(s, tgt.name, rel) is not None  # the old record, as it was
        with s.index.env.begin(write=True) as txn:
            assert s.index.take_path_txn(txn, tgt.name, rel, "sweep")  # not held: taken
        s.index.release_paths([(tgt.name, rel)])
        assert _hold(s, tgt.name, rel) is None
        assert s.gc()["orphans"] == 1 and s.get(key) == value and s.check() == []


def test_a_damaged_hold_record_does_not_stop_the_store_opening(tmp_path):
    """A hold record too short to name its pid made every open fail with struct.error (the
    stale holds are dropped at open): now it holds nothing and is dropped."""
    s, _ek, key, value, tgt, _cur, rel = _slot_orphan_setup(tmp_path)
    with s:
        with s.index.env.begin(write=True) as txn:
            txn.put(path_key(tgt.name, rel), b"s\x00\x01", db=s.index.db["info"])
    with kvstore.connect(s.data_dir, fsync=False, orphan_grace_s=0) as s2:
        assert _hold(s2, tgt.name, rel) is None
        assert s2.gc()["orphans"] == 1 and s2.get(key) == value and s2.check() == []


def _raw_hold(index_dir: str, target: str, rel: str) -> bytes | None:
    """The hold record at a path, read from a closed index's files (no ``Index``: its open drops leftovers)."""
    env = lmdb.open(index_dir, max_dbs=16, readonly=True, lock=False)
    try:
        with env.begin() as txn:
            raw = txn.get(path_key(target, rel), db=env.open_db(b"info", txn=txn, create=False))
        return None if raw is None else bytes(raw)
    finally:
        env.close()


class _WritesFail(_FailingWrites):
    """Every write transaction fails as a full map does, and is counted."""

    def __init__(self, env):
        super().__init__(env)
        self.tries = 0

    def begin(self, write=False, **kw):
        if write:
            self.tries += 1
            raise lmdb.MapFullError("mdb_txn_begin: MDB_MAP_FULL (injected)")
        return self.env.begin(write=write, **kw)


def test_close_gives_back_the_holds_whose_give_back_failed(tmp_path, monkeypatch, caplog):
    """A failed give-back is retried at the next one, but close did not retry it: a process
    that closed its index and ran on blocked that path for every other process (its pid and
    start time live) until it ended. Close gives back what is left; what it still cannot
    is logged as an error naming the path, never raised, and retried a bounded number of times."""
    from kvstore.embedded.index import Index
    from kvstore.embedded.pathholds import CLOSE_TRIES

    where = str(tmp_path / "index")
    index = Index(where, map_size=1 << 20, sync=False)
    with index.env.begin(write=True) as txn:
        assert index.take_path_txn(txn, "t0", "ab/frag.1", "sweep")
        assert index.take_path_txn(txn, "t1", "ab/frag.1", "repair")  # still taken at close: given back too
    wrapped = _FailingWrites(index.env)
    monkeypatch.setattr(index, "env", wrapped)
    wrapped.armed = True
    index.release_paths([("t0", "ab/frag.1")])  # fails: left behind
    monkeypatch.undo()
    index.close()
    assert _raw_hold(where, "t0", "ab/frag.1") is None and _raw_hold(where, "t1", "ab/frag.1") is None

    index = Index(where, map_size=1 << 20, sync=False)
    with index.env.begin(write=True) as txn:
        assert index.take_path_txn(txn, "t0", "ab/frag.2", "repair")
    failing = _WritesFail(index.env)
    monkeypatch.setattr(index, "env", failing)
    with caplog.at_level(logging.WARNING, logger="kvstore.embedded.pathholds"):
        index.release_paths([("t0", "ab/frag.2")])
        caplog.clear()
        index.close()  # every give-back fails: logged, not raised
    assert failing.tries == 1 + CLOSE_TRIES
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "t0:ab/frag.2" in errors[0].getMessage()
    assert "MDB_MAP_FULL" in errors[0].getMessage() and str(os.getpid()) in errors[0].getMessage()
    index.close()  # nothing left to give back: no second attempt, no second error
    assert failing.tries == 1 + CLOSE_TRIES
    assert _raw_hold(where, "t0", "ab/frag.2") is not None  # stays, as logged


def test_a_full_index_map_keeps_the_orphan_whose_path_it_cannot_take_and_the_sweep_goes_on(tmp_path, monkeypatch,
                                                                                           caplog):
    """Taking a stale copy's path is a write transaction: with the index map full it raised
    ``MapFullError`` and ended the GC pass, when a full map is when GC is needed most.
    The index never grows its map, so that copy is kept (counted in ``orphans_kept``, listed
    by ``check``) and the sweep goes on to the orphans that need no index write."""
    from kvstore.embedded.pathholds import PathHolds

    s, _ek, key, value, tgt, _cur, rel = _slot_orphan_setup(tmp_path)
    with s:
        other = next(t for n, t in s.targets.items() if n != tgt.name)
        crashed = Path(other.root) / "ab" / ".tmp.crashed-put"  # a put that died: its delete takes no path
        crashed.parent.mkdir(parents=True, exist_ok=True)
        crashed.write_bytes(b"x" * 100)
        old = crashed.stat().st_mtime - 3600  # long past the grace
        os.utime(crashed, (old, old))

        def take_txn(self, txn, target, rel, who):
            raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL (injected)")

        monkeypatch.setattr(PathHolds, "take_txn", take_txn)
        with caplog.at_level(logging.WARNING, logger="kvstore.maintenance.orphans"):
            out = s.gc()
        assert out["orphans"] == 1 and out["orphans_kept"] == 1 and not crashed.exists()
        assert (Path(tgt.root) / rel).exists() and "index map is full" in caplog.text
        kept = [p for p in s.check() if not p.fixed]
        assert [(p.target, p.detail.split(" ")[0]) for p in kept] == [(tgt.name, rel)]
        monkeypatch.undo()  # room again: the next pass sweeps it
        out = s.gc()
        assert out["orphans"] == 1 and out["orphans_kept"] == 0 and not (Path(tgt.root) / rel).exists()
        assert s.get(key) == value and s.check() == []


class _DeleteFailsOn:
    """A write transaction whose delete of one key fails as a full map does; the rest passes through."""

    def __init__(self, txn, bad: bytes):
        self.txn, self.bad = txn, bad

    def __enter__(self):
        self.txn.__enter__()
        return self

    def __exit__(self, *exc):
        return self.txn.__exit__(*exc)

    def delete(self, key, *args, **kw):
        if bytes(key) == self.bad:
            raise lmdb.MapFullError("mdb_del: MDB_MAP_FULL (injected)")
        return self.txn.delete(key, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.txn, name)


class _OneKeyFails:
    """An LMDB environment whose write transactions cannot delete ``bad`` (counted)."""

    def __init__(self, env, bad: bytes):
        self.env, self.bad, self.tries = env, bad, 0

    def begin(self, write=False, **kw):
        txn = self.env.begin(write=write, **kw)
        if write:
            self.tries += 1
            return _DeleteFailsOn(txn, self.bad)
        return txn

    def __getattr__(self, name):
        return getattr(self.env, name)


def test_close_gives_back_every_hold_but_the_one_whose_give_back_keeps_failing(tmp_path, monkeypatch, caplog):
    """Close gave back every hold left in one write transaction, retried as a whole: one path
    whose give-back kept failing kept every other one too, and other processes saw them all
    held until this process ended. Now what the one transaction leaves is given back path
    by path: only the failing one is kept, and the error counts it and names it."""
    from kvstore.embedded.index import Index
    from kvstore.embedded.pathholds import CLOSE_TRIES

    where = str(tmp_path / "index")
    index = Index(where, map_size=1 << 20, sync=False)
    paths = [("t0", "ab/frag.0"), ("t1", "ab/frag.1"), ("t2", "ab/frag.2")]
    with index.env.begin(write=True) as txn:
        for t, rel in paths:
            assert index.take_path_txn(txn, t, rel, "repair")
    failing = _OneKeyFails(index.env, path_key("t1", "ab/frag.1"))
    monkeypatch.setattr(index, "env", failing)
    with caplog.at_level(logging.WARNING, logger="kvstore.embedded.pathholds"):
        index.close()
    assert _raw_hold(where, "t0", "ab/frag.0") is None and _raw_hold(where, "t2", "ab/frag.2") is None
    assert _raw_hold(where, "t1", "ab/frag.1") is not None  # the failing one stays, as logged
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    text = errors[0].getMessage()
    assert "kept 1 " in text and "gave back the other 2" in text and "t1:ab/frag.1" in text
    assert "t0:ab/frag.0" not in text and "t2:ab/frag.2" not in text
    # all at once, then each of the three on its own, then the failing one until its tries are spent
    assert failing.tries == 1 + 3 + (CLOSE_TRIES - 2)
