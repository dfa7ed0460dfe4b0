"""The daemon's life cycle: zero-flag start, config precedence, health, drain, background GC, metrics."""

from __future__ import annotations

import hashlib
import socket
import threading
import time
import urllib.request

import pytest

import kvstore
from kvstore.errors import InvalidRequest, StoreUnavailable
from kvstore.server import load_server_config

from tests.kvstore.daemons import health_ok, subprocess_env, wait_until
from tests.kvstore.server.test_security import slow_store


def K(i) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_zero_flags_serves_embedded_defaults_and_drains_on_sigterm(tmp_path) -> None:
    if not _port_free(7070):
        pytest.skip("port 7070 (the default) is in use on this machine")
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "kvstore.server.cli", "serve"], cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    try:
        line = p.stdout.readline()
        assert "grpc://127.0.0.1:7070" in line, (line, p.stderr.read() if p.poll() is not None else "")
        assert health_ok("grpc://127.0.0.1:7070")
        with kvstore.connect("grpc://127.0.0.1:7070") as s:
            assert s.put(K(1), b"zero") and s.get(K(1)) == b"zero"
        assert (tmp_path / "kvstack-data" / "kvstore.json").exists()
        p.send_signal(15)
        assert p.wait(30) == 0
        assert "kvstore stopped" in p.stdout.read()
    finally:
        if p.poll() is None:
            p.kill()
        p.stdout.close()
        p.stderr.close()


def test_port_zero_is_printed_and_flags_beat_env_beat_toml(spawn, tmp_path) -> None:
    cfg = tmp_path / "kv.toml"
    cfg.write_text('[store]\nec_k = 2\nec_m = 1\n[server]\ngc_interval_s = 5\nmax_batch_items = 10\n'
                   'drain_s = 3\n')
    env = {"KVSTORE_GC_INTERVAL_S": "7", "KVSTORE_MAX_BATCH_ITEMS": "20", "KVSTORE_EC_M": "2"}
    scfg, stcfg = load_server_config(cfg, env=env, gc_interval_s="9")
    assert (scfg.gc_interval_s, scfg.max_batch_items, scfg.drain_s) == (9.0, 20, 3.0)
    assert (stcfg.ec_k, stcfg.ec_m) == (2, 2)
    with pytest.raises(InvalidRequest):
        load_server_config(None, env={}, no_such_option=1)
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nbogus = 1\n")
    with pytest.raises(InvalidRequest, match="bogus"):
        load_server_config(bad, env={})
    d = spawn(tmp_path / "data", "--config", str(cfg), "--gc-interval-s", "0",
              env=subprocess_env(KVSTORE_EC_M="2"))
    assert d.port > 0
    with kvstore.connect(d.address) as s:
        assert s.stats()["erasure_code"].endswith("2+2")
        assert s.stats()["daemon"]["gc_interval_s"] == 0.0
    assert d.term() == 0


def test_health_and_drain_finishes_in_flight_calls(make_daemon, tmp_path) -> None:
    st = slow_store(tmp_path)
    d = make_daemon(store=st)
    assert health_ok(d.address)
    s = kvstore.connect(d.address, timeout_s=5)
    s.put(K(1), b"v")
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", s.get(K(1))))
    t.start()
    assert st.entered.wait(10)
    stopper = threading.Thread(target=d.stop, kwargs={"grace_s": 10})
    stopper.start()
    time.sleep(0.3)
    assert not health_ok(d.address, timeout=0.5)  # no longer serving new calls
    st.gate.set()
    t.join(10)
    stopper.join(20)
    assert out["v"] == b"v"  # the in-flight call finished
    with pytest.raises(StoreUnavailable):
        s.get(K(1))
    s.close()


def test_sigterm_exit_is_bounded_when_storage_hangs(spawn, tmp_path) -> None:
    """SIGTERM with a put stuck in storage (every target op now takes 60 s): the process
    exits within ``drain_s`` + ``STOP_EXTRA_S``, abandoning the call on its daemon thread.
    Before, ``Daemon.stop`` joined its worker pools without a bound, so exit waited for
    the storage (a hung mount: forever). The client is told UNAVAILABLE; the next daemon
    opens the data directory cleanly and serves what was acknowledged."""
    from kvstore.embedded.faults import FaultPlan, write_plan
    from kvstore.server.service import STOP_EXTRA_S

    data, faults = tmp_path / "data", tmp_path / "faults"
    faults.mkdir()
    names = [f"hang{i}" for i in range(6)]
    targets = ",".join(f"faulty://{n}{data}/targets/t{i}" for i, n in enumerate(names))
    env = subprocess_env(KVSTORE_FAULTS_DIR=str(faults))
    d = spawn(data, "--targets", targets, "--drain-s", "1", env=env)
    s = kvstore.connect(d.address, timeout_s=120)
    assert s.put(K(1), b"kept")
    for n in names:
        write_plan(str(faults), n, FaultPlan(latency_s=60.0, latency_p=1.0))
    time.sleep(1.5)  # the targets poll their plans
    out: dict = {}

    def put() -> None:
        try:
            out["r"] = s.put(K(2), b"x" * 800)
        except Exception as exc:  # noqa: BLE001 - the outcome is the test's subject
            out["r"] = exc

    t = threading.Thread(target=put, daemon=True)
    t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    assert d.term(timeout=60) == 0
    took = time.monotonic() - t0
    assert took < 1 + STOP_EXTRA_S + 5, took  # the storage would have held it 60 s
    t.join(10)
    assert isinstance(out.get("r"), StoreUnavailable), out
    for n in names:
        write_plan(str(faults), n, FaultPlan())
    d2 = spawn(data, "--targets", targets, env=env)
    with kvstore.connect(d2.address) as s2:
        assert s2.get(K(1)) == b"kept"
    s.close()


def test_a_second_stop_returns_when_the_first_has_ended(make_daemon, tmp_path) -> None:
    """Two callers stopping one daemon (a signal handler and its owner): the second returns
    only once the first has drained and closed the store. Before, it returned at once, and an
    in-process restart on the data directory failed with CorruptData ("restore it from a
    copy") while the first stop still held the index; that case now says StoreUnavailable."""
    st = slow_store(tmp_path)
    d = make_daemon(store=st)
    s = kvstore.connect(d.address, timeout_s=10)
    s.put(K(1), b"v")
    threading.Thread(target=lambda: _quiet(s.get, K(1)), daemon=True).start()
    assert st.entered.wait(10)
    first = threading.Thread(target=d.stop, kwargs={"grace_s": 0.5})
    first.start()
    time.sleep(0.2)
    d.stop(grace_s=0.5)
    assert not first.is_alive()  # the second call waited for the first
    st.gate.set()
    first.join(10)
    s.close()
    from kvstore.embedded.index import Index

    held = Index(str(tmp_path / "held"), map_size=1 << 20, sync=False)
    with pytest.raises(kvstore.StoreUnavailable, match="still open in this process"):
        Index(str(tmp_path / "held"), map_size=1 << 20, sync=False)
    held.close()


def _quiet(fn, *a):
    try:
        fn(*a)
    except kvstore.KVStoreError:
        pass  # the call cut off by the stop: its error is not this test's subject


def test_background_gc_runs_without_stalling_requests(make_daemon) -> None:
    d = make_daemon(gc_interval_s=0.1, delete_grace_s=0)
    s = kvstore.connect(d.address)
    for i in range(30):
        s.put(K(i), b"x" * 5000, ttl_s=0.2)
    s.put(K("keep"), b"kept")
    worst = 0.0
    end = time.monotonic() + 1.2
    while time.monotonic() < end:
        t0 = time.perf_counter()
        assert s.get(K("keep")) == b"kept"
        worst = max(worst, time.perf_counter() - t0)
    assert wait_until(lambda: d.metrics.gc_runs._value.get() >= 3, timeout=5)
    assert wait_until(lambda: d.store.stats()["entries"] == 1, timeout=5)  # expired entries reclaimed
    assert worst < 0.5, f"a get took {worst:.3f}s while GC ran"
    assert d.store.check() == []
    s.close()


def test_prometheus_metrics(make_daemon) -> None:
    d = make_daemon(metrics_port=0)
    assert d.metrics.port
    s = kvstore.connect(d.address)
    s.put(K(1), b"a" * 100)
    s.get(K(1))
    s.get_many([K(1), K(2)])
    s.lookup([K(1), K(2)])
    s.lookup([K(3)])
    with pytest.raises(kvstore.NotFound):
        s.get(K(9))
    s.gc()
    # a sharded client's lookup asks each shard a Probe (here: this daemon twice, as a set of one)
    s.probe([K(1), K(2)], until_miss=True)
    s.probe([K(3)])
    body = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics.port}/metrics", timeout=5).read().decode()
    for needle in ('kvstore_requests_total{code="OK",method="Put"} 1.0',
                   'kvstore_hits_total{kind="block",op="probe"} 1.0',
                   'kvstore_misses_total{kind="block",op="probe"} 1.0',
                   'kvstore_requests_total{code="NOT_FOUND",method="Get"} 1.0',
                   'kvstore_hits_total{kind="block",op="get"} 2.0',
                   'kvstore_misses_total{kind="block",op="get"} 2.0',
                   'kvstore_hits_total{kind="block",op="lookup"} 1.0',
                   'kvstore_misses_total{kind="block",op="lookup"} 1.0',
                   "kvstore_bytes_in_total 100.0", "kvstore_bytes_out_total 200.0",
                   "kvstore_gc_runs_total 1.0", "kvstore_gc_reclaimed_bytes_total",
                   'kvstore_request_seconds_bucket{le="0.005",method="Get"}',
                   "kvstore_degraded_reads_total 0.0", "kvstore_lost_entries 0.0", "kvstore_used_bytes",
                   "kvstore_rejected_packs_total 0.0"):
        assert needle in body, needle
    s.close()


def test_a_get_of_a_lost_entry_counts_a_miss(make_daemon, tmp_path) -> None:
    """A Get that returns no value because the entry is lost counts a miss, as GetMany counts
    the same read, never neither a hit nor a miss."""
    import shutil

    st = kvstore.connect(str(tmp_path / "lose"), fsync=False)
    d = make_daemon(store=st, metrics_port=0)
    with kvstore.connect(d.address) as s:
        s.put(K(1), b"v" * 5000, kind="swa")
        for t in ("t0", "t1", "t2"):  # m + 1 of the 4+2 fragments gone
            shutil.rmtree(st.targets[t].root)
        with pytest.raises(kvstore.Unrecoverable):
            s.get(K(1), kind="swa")
    body = urllib.request.urlopen(f"http://127.0.0.1:{d.metrics.port}/metrics", timeout=5).read().decode()
    assert 'kvstore_misses_total{kind="swa",op="get"} 1.0' in body
