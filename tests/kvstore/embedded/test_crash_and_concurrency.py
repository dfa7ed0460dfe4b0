"""Crash safety (SIGKILL at random instants) and concurrent threads and processes."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import kvstore
from kvstore import NotFound, PutItem
from kvstore.maintenance.problems import ProblemKind

from tests.kvstore.embedded._writer import value
from tests.kvstore.conftest import assert_clean
from tests.fragments import assert_pack_refs_match_records

ROOT = Path(__file__).resolve().parents[3]


def _spawn(data_dir, mode, seed):
    return subprocess.Popen([sys.executable, "-m", "tests.kvstore.embedded._writer", str(data_dir), mode, str(seed)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)


@pytest.mark.slow  # a crash soak: 20 writer processes killed at random instants
def test_sigkill_at_random_instants_loses_no_acknowledged_put(tmp_path):
    data_dir = tmp_path / "store"
    rnd = random.Random(7)
    acked: list[bytes] = []
    for trial in range(20):
        p = _spawn(data_dir, "put", trial)
        assert p.stdout.readline().strip() == "READY"
        deadline = time.monotonic() + rnd.uniform(0.05, 0.6)
        lines: list[str] = []

        def reader():
            for line in p.stdout:
                lines.append(line)

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        while time.monotonic() < deadline:
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
        t.join(timeout=10)
        # Only whole lines count: the kill may cut the last "ACK <hex>" line short.
        acked += [bytes.fromhex(line.split()[1]) for line in lines
                  if line.endswith("\n") and re.fullmatch(r"ACK [0-9a-f]{32}\n", line)]
    assert len(acked) > 20
    with kvstore.connect(str(data_dir), orphan_grace_s=0) as s:
        problems = s.check()
        assert {p.kind for p in problems} <= {ProblemKind.ORPHAN_FRAGMENT}, problems
        for k in acked:
            assert s.get(k) == value(k)
        s.check(fix=True)
        assert_clean(s)
        assert_pack_refs_match_records(s)


_HUNG_WRITE = """
import sys, threading, time
import kvstore
from kvstore.embedded.faults import FaultPlan, control, faulty_url
d = sys.argv[1]
names = [f"hung{i}" for i in range(6)]
s = kvstore.connect(d + "/data", targets=[faulty_url(n, f"{d}/t{i}") for i, n in enumerate(names)], fsync=False)
s.put(b"k" * 16, b"before")
for n in names:
    control(n).set(latency_s=60.0, latency_p=1.0)  # every target op now hangs for a minute
threading.Thread(target=s.put, args=(b"j" * 16, b"x" * 5000), daemon=True).start()
time.sleep(0.5)
print("leaving", flush=True)
"""


def test_a_write_hung_in_storage_does_not_hold_up_process_exit(tmp_path):
    """The store's fragment I/O runs on daemon threads (``kvstore.executors``): a process
    whose daemon thread is stuck in a put to a hung target exits when its main thread ends.
    Before, ``concurrent.futures`` joined the store's pool workers at exit: a minute here, a
    dead mount forever."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _HUNG_WRITE, str(tmp_path)], capture_output=True, text=True,
                       timeout=120, cwd=Path(__file__).resolve().parents[3])
    took = time.monotonic() - t0
    assert p.returncode == 0 and "leaving" in p.stdout, p.stderr[-2000:]
    assert took < 30, took  # the hung write would hold it 60 s
    from kvstore.embedded.faults import faulty_url  # in this process the plans are all zero: plain directories

    with kvstore.connect(str(tmp_path / "data"), targets=[faulty_url(f"hung{i}", f"{tmp_path}/t{i}")
                                                          for i in range(6)]) as st:
        assert st.get(b"k" * 16) == b"before"


@pytest.mark.parametrize("n", [1, 6], ids=["put", "put_many"])
def test_a_put_slower_than_half_the_orphan_grace_is_refused_not_lost(tmp_path, monkeypatch, n):
    """A write whose fragments took longer than ``orphan_grace_s / 2`` is not indexed: its
    first files may already be swept by a GC (here one runs while the write is still
    going, 100 s into it with a 60 s grace). Before, the put was acknowledged and its
    entries were Unrecoverable at once. Now it raises ``StoreUnavailable``, stores nothing
    and leaves nothing behind; a put within the time is indexed as before."""
    from kvstore.errors import StoreUnavailable

    from tests.kvstore.conftest import FakeClock

    clock = FakeClock(time.time())
    s = kvstore.connect(str(tmp_path / "d"), fsync=False, clock=clock, orphan_grace_s=60, delete_grace_s=0)
    slow = {"on": True}
    for name in ("write_pack", "write_fragments", "append_entries"):
        def wrapped(*a, _orig=getattr(s.fragments.writer, name), **kw):
            got = _orig(*a, **kw)
            if slow["on"]:
                clock.advance(100)
                sweeper = threading.Thread(target=s.gc)  # another thread's GC sweeps "orphans"
                sweeper.start()
                sweeper.join(30)
            return got
        monkeypatch.setattr(s.fragments.writer, name, wrapped)
    try:
        items = [PutItem(k, value(k)) for k in (os.urandom(16) for _ in range(n))]
        with pytest.raises(StoreUnavailable, match="orphan_grace_s"):
            s.put_many(items)
        assert s.get_many([it.key for it in items]) == [None] * n
        assert s.stats()["entries"] == 0
        slow["on"] = False
        clock.advance(100)
        s.gc()
        assert s.check() == []  # nothing left behind
        assert s.put_many(items) == [True] * n  # in time: indexed and readable
        assert s.get_many([it.key for it in items]) == [it.value for it in items]
    finally:
        s.close()


def test_threads_put_get_gc_one_store(data_dir, clock):
    s = kvstore.connect(str(data_dir), fsync=False, capacity_bytes=400_000, high_watermark=0.9,
                        low_watermark=0.6, delete_grace_s=60, access_flush_s=0.01)
    errors: list[str] = []
    stop = time.monotonic() + 3

    def worker(seed):
        rng = random.Random(seed)
        mine = []
        n = 0
        while time.monotonic() < stop and n < 400:
            n += 1
            if not mine or rng.random() < 0.4:
                new = [rng.randbytes(16) for _ in range(rng.choice([1, 1, 2, 3]))]  # batches: packs
                s.put_many([PutItem(k, value(k)) for k in new])
                mine.extend(new)
            else:
                k = rng.choice(mine)
                try:
                    if s.get(k) != value(k):
                        errors.append("wrong bytes")
                except NotFound:
                    pass
                except Exception as exc:  # noqa: BLE001 - any other failure is the bug we look for
                    errors.append(repr(exc))

    def collector():
        while time.monotonic() < stop:
            s.gc()
            time.sleep(0.05)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)] + [threading.Thread(target=collector)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert s.used_bytes() <= 400_000
    s.gc()
    assert [p for p in s.check() if p.kind is not ProblemKind.ORPHAN_FRAGMENT] == []
    assert_pack_refs_match_records(s)
    s.close()


def test_processes_share_one_data_directory(data_dir):
    kvstore.connect(str(data_dir), fsync=False).close()
    procs = [_spawn(data_dir, "mixed", seed) for seed in range(3)]
    with kvstore.connect(str(data_dir), fsync=False, capacity_bytes=600_000, delete_grace_s=5) as s:
        t_end = time.monotonic() + 60
        while any(p.poll() is None for p in procs) and time.monotonic() < t_end:
            s.gc(orphans=False)
            time.sleep(0.05)
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs)
        assert all(o.strip().endswith("BAD 0") for o in outs), outs
        assert [p for p in s.check() if p.kind is not ProblemKind.ORPHAN_FRAGMENT] == []
        assert_pack_refs_match_records(s)


def test_close_racing_calls_on_other_threads_gives_store_closed_never_an_lmdb_error(tmp_path, keys):
    """Threads reading, looking up and putting while the main thread closes the store: each
    call returns its result or raises ``StoreClosed``; none sees the closed index."""
    import threading

    from kvstore.errors import StoreClosed

    for cycle in range(8):
        s = kvstore.connect(str(tmp_path / f"s{cycle}"), fsync=False)
        s.put_many([PutItem(k, os.urandom(2000)) for k in keys[:8]])
        errors: list[BaseException] = []
        go = threading.Event()

        def work(i: int) -> None:
            go.wait()
            for j in range(200):
                try:
                    (s.get_many(keys[:8]), s.lookup(keys), s.put(keys[8 + (i * 200 + j) % 50], b"v"),
                     s.flush_touches(), s.used_bytes())
                except StoreClosed:
                    return
                except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        go.set()
        s.close()
        for t in threads:
            t.join(30)
        assert not errors, errors
        with pytest.raises(StoreClosed):
            s.used_bytes()


def test_a_call_outliving_closes_wait_finishes_and_nested_calls_are_not_refused(tmp_path, keys, monkeypatch):
    """A GC still running when close() stops waiting finishes on an open index (the last call
    out closes it), and its own nested calls (stats, used bytes) are part of it, not refused;
    a put racing close with capacity set returns its result."""
    import kvstore.embedded.store as store_mod
    from kvstore.errors import StoreClosed

    monkeypatch.setattr(store_mod, "CLOSE_WAIT_S", 0.2)
    s = kvstore.connect(str(tmp_path / "s"), fsync=False, capacity_bytes=10**9)
    s.put_many([PutItem(k, os.urandom(2000)) for k in keys[:20]])
    started, out = threading.Event(), {}

    def slow(phase: str, done: int, total: int) -> None:
        started.set()
        time.sleep(0.6)  # past close()'s wait

    def run() -> None:
        try:
            out["gc"] = s.gc(progress=slow)
        except BaseException as exc:  # noqa: BLE001 - checked below
            out["gc"] = exc

    t = threading.Thread(target=run)
    t.start()
    started.wait(10)
    s.close()  # returns after 0.2 s with the GC still running
    t.join(30)
    assert isinstance(out["gc"], dict), out["gc"]
    with pytest.raises(StoreClosed):
        s.used_bytes()
    assert s._shut  # the GC, returning last, closed the index


class _SlowWriterLock:
    """``store.index.env`` whose next write transaction begins only after ``on_wait()``: a
    long wait for LMDB's writer lock (another process's big batch, a stopped process), during
    which another process's GC sweeps orphans."""

    def __init__(self, env, on_wait):
        self._env, self._on_wait = env, on_wait

    def begin(self, write=False, **kw):
        if write and self._on_wait is not None:
            wait, self._on_wait = self._on_wait, None
            wait()
        return self._env.begin(write=write, **kw)

    def __getattr__(self, name):
        return getattr(self._env, name)


def _sweep(store) -> int:
    from kvstore.maintenance.orphans import sweep_orphans

    return sweep_orphans(store.parts, store.file_clock(), False, store.config.orphan_grace_s, lambda *a: None)[0]


@pytest.mark.parametrize("n", [1, 6], ids=["put", "put_many"])
def test_a_put_that_waited_long_for_the_index_lock_is_refused_not_lost(tmp_path, monkeypatch, n):
    """The age of a put's files was checked before its index transaction waited for LMDB's
    writer lock, so a put that waited past the orphan grace while another process swept was
    acknowledged with its files gone: every entry Unrecoverable. The age is now checked
    inside the transaction: the put raises ``StoreUnavailable`` and stores nothing."""
    from kvstore.errors import StoreUnavailable

    from tests.kvstore.conftest import FakeClock

    clock = FakeClock(time.time())
    s = kvstore.connect(str(tmp_path / "d"), fsync=False, clock=clock, orphan_grace_s=60, delete_grace_s=0)
    swept = []

    def wait() -> None:
        clock.advance(100)
        swept.append(_sweep(s))

    monkeypatch.setattr(s.index, "env", _SlowWriterLock(s.index.env, wait))
    try:
        items = [PutItem(k, value(k)) for k in (os.urandom(16) for _ in range(n))]
        with pytest.raises(StoreUnavailable, match="orphan_grace_s"):
            s.put_many(items)
        assert swept and swept[0] > 0  # the sweep did take the put's files
        assert s.get_many([it.key for it in items]) == [None] * n and s.stats()["entries"] == 0
        assert s.check() == []  # nothing indexed without its files, nothing left behind
        assert s.put_many(items) == [True] * n  # no wait: indexed and readable
        assert s.get_many([it.key for it in items]) == [it.value for it in items]
    finally:
        s.close()


def test_a_sweeper_whose_clock_is_ahead_does_not_take_a_put_in_flight_for_an_orphan(tmp_path, monkeypatch):
    """The orphan sweep measured files' ages on the store's clock, which includes
    ``clock_offset_s``, against mtimes stamped by this host's clock: a process whose clock ran
    ahead by more than the grace removed the files of every put in flight elsewhere, and those
    puts were acknowledged, then Unrecoverable. Ages are measured on ``file_clock``."""
    d = str(tmp_path / "d")
    writer = kvstore.connect(d, fsync=False, orphan_grace_s=60)
    sweep = ("import kvstore, sys; s = kvstore.connect(sys.argv[1], fsync=False, orphan_grace_s=60, "
             "clock_offset_s=3600); print(s.gc()['orphans']); s.close()")
    swept = []
    for name in ("write_fragments", "write_pack", "append_entries"):
        def wrapped(*a, _orig=getattr(writer.fragments.writer, name), **kw):
            got = _orig(*a, **kw)
            # Another process's GC while the put is in flight: its files are not indexed yet.
            out = subprocess.run([sys.executable, "-c", sweep, d], cwd=ROOT, capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode == 0, out.stderr
            swept.append(int(out.stdout.split()[-1]))
            return got
        monkeypatch.setattr(writer.fragments.writer, name, wrapped)
    try:
        k1, k2, k3 = (os.urandom(16) for _ in range(3))
        assert writer.put(k1, value(k1)) is True
        assert writer.put_many([PutItem(k2, value(k2)), PutItem(k3, value(k3))]) == [True, True]
        assert swept == [0, 0]
        assert writer.get_many([k1, k2, k3]) == [value(k1), value(k2), value(k3)]
        assert writer.check() == []
    finally:
        writer.close()


_CRASH_AT = """
import hashlib, os, sys
import kvstore
from kvstore.embedded.store import EmbeddedStore

data_dir, point, segments, key = sys.argv[1], sys.argv[2], sys.argv[3] == "1", bytes.fromhex(sys.argv[4])
val = hashlib.shake_256(key).digest(200_000)
real = EmbeddedStore._index_new

def crash(self, *args, **kwargs):
    if point == "before_index":  # every fragment written and made durable, nothing indexed
        os._exit(0)
    real(self, *args, **kwargs)
    os._exit(0)  # indexed, the put not yet returned

EmbeddedStore._index_new = crash
s = kvstore.connect(data_dir, fsync=True, segments=segments, compression="none")
s.put(key, val)
"""


@pytest.mark.parametrize("segments", [True, False], ids=["segment", "files"])
@pytest.mark.parametrize("point", ["before_index", "after_index"])
def test_a_process_that_dies_at_a_put_step_leaves_the_entry_whole_or_absent(tmp_path, point, segments):
    """A writer process that exits at once just before its put's index commit (its fragments
    durable) or just after it (the put not yet returned): on reopen the entry reads back whole
    (after) or is absent (before), and a check finds nothing but orphan fragments. Deterministic
    crash points for what the SIGKILL soak hits by chance: fragments are durable before the
    record that names them is committed, never after."""
    import hashlib

    key = os.urandom(16)
    val = hashlib.shake_256(key).digest(200_000)
    r = subprocess.run([sys.executable, "-c", _CRASH_AT, str(tmp_path / "d"), point, "1" if segments else "0",
                        key.hex()], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    with kvstore.connect(str(tmp_path / "d"), segments=segments, compression="none") as s:
        if point == "after_index":
            assert s.get(key) == val
        else:
            with pytest.raises(NotFound):
                s.get(key)
        assert {p.kind for p in s.check()} <= {ProblemKind.ORPHAN_FRAGMENT}
        assert s.put(key, val) is (point == "before_index") and s.get(key) == val
