"""tools/bench_store.py --quick at its smallest settings: runs, compares, writes its JSON.

Only the shape of the results is checked (figures on a shared box are noise). The run takes
a few seconds; the full bench is not a test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_bench_store_quick_smallest(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    r = subprocess.run(
        [sys.executable, "tools/bench_store.py", "--quick", "--sizes", "128K", "--reps", "2", "--mib-per-rep", "1",
         "--batch", "8", "--lookup-sizes", "10k", "--no-ec", "--no-install", "--work-dir", str(tmp_path),
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    d = json.loads(out.read_text())
    systems = {row["system"] for row in d["io"]}
    assert {"kvstore", "kvstore_zstd", "raw_file", "ec_floor", "lmdb"} <= systems
    if shutil.which("redis-server"):
        assert "redis" in systems
    for row in d["io"]:
        assert row["mib_s"] > 0 and row["p50_ms"] <= row["p99_ms"] and len(row["rep_mib_s"]) == 2
    for x in d["ratios"]:  # paired rep by rep: the median lies within the per-rep ratios
        assert 0 < x["ratio_min"] <= x["ratio"] <= x["ratio_max"]
    assert {(g["op"], g["peer"]) for g in d["goals"]} >= {("get", "raw_file"), ("put", "raw_file")}
    assert d["lookup"][0]["hit_blocks"] == 1000 and d["lookup"][0]["entries"] == 10_000
    assert "ratio kvstore / peer" in r.stdout and "goals" in r.stdout
    assert not any(p.name.startswith("bench_store-") for p in tmp_path.iterdir())  # work dir cleaned


def test_bench_store_remote_runs_the_daemon_benchmark(tmp_path):
    """``bench_store.py --remote`` is the issue's command for the daemon's benchmark: it runs
    tools/bench_remote.py with the options that follow (here its smallest run, no peers)."""
    out = tmp_path / "remote.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    r = subprocess.run(
        [sys.executable, "tools/bench_store.py", "--remote", "--no-peers", "--n", "4", "--sizes", "131072",
         "--batch", "2", "--repeat", "1", "--chain", "50", "--lookup-reps", "5", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["chain"] == 50 and set(d["lookup_ms"]) == {"embedded", "remote", "sharded3"}
    for system in ("embedded", "remote", "remote_direct"):
        assert {"put", "get", "put_batch", "get_batch"} <= set(d["systems"][system]["131072"]), d["systems"][system]
    assert "lookup of a 50-block chain" in r.stdout


def test_the_ec_floor_peer_returns_what_was_put(tmp_path):
    """The design-floor peer splits each value into k shares (the last one padded) across
    k+m append-only files: every value, of any length, reads back exactly, single or batched."""
    from tools.bench_peers import ECFloorPeer

    peer = ECFloorPeer(str(tmp_path), k=4, m=2)
    vals = {os.urandom(16): os.urandom(n) for n in (0, 1, 3, 4, 5, 1001, 131072)}
    first = list(vals.items())
    peer.put(*first[0])
    peer.put_many(first[1:])
    try:
        assert {k: peer.get(k) for k in vals} == vals
        assert len({os.path.getsize(tmp_path / f"t{i}") for i in range(6)}) == 1  # one share per file per put
    finally:
        peer.close()


def test_a_peer_returning_wrong_bytes_for_a_later_batch_item_fails_the_run():
    """Every value of a batch read back is compared, not only the first one."""
    import pytest

    from tools.bench_peers import interleaved_rep

    class Garbling:
        def __init__(self):
            self.d = {}

        def put_many(self, items):
            self.d.update(items)

        def get_many(self, keys):
            return [self.d[k] if j == 0 else b"garbage" for j, k in enumerate(keys)]

    keys = [i.to_bytes(4, "big") for i in range(8)]
    vals = [os.urandom(64) for _ in range(3)]
    with pytest.raises(RuntimeError, match="wrong bytes"):
        interleaved_rep({"garbling": Garbling()}, "batch", keys, vals, batch=4)


def test_remote_ratios_come_from_unrounded_rounds():
    """The per-round ratios of bench_remote are taken before any rounding: two slow systems
    (0.04 and 0.06 MiB/s, which round to 0.0 and 0.1) still give their true ratio, 2/3."""
    from tools.bench_remote import _mibs, paired_ratio

    rounds = [{"a": {"1": {"get": _mibs(4 << 20, 100.0)}}, "b": {"1": {"get": _mibs(6 << 20, 100.0)}}}]
    assert paired_ratio(rounds, "a", "b", "1", "get") == pytest.approx(2 / 3)


def test_a_reps_systems_run_interleaved_step_by_step():
    """``interleaved_rep``: each step (a key, or a batch) is run by every system in turn, the
    order rotating from step to step, puts before gets; each system's time is its own steps'."""
    from tools.bench_peers import interleaved_rep

    calls: list[tuple[str, str, int]] = []

    class Logged:
        def __init__(self, name):
            self.name, self.d = name, {}

        def put_many(self, items):
            calls.append((self.name, "put", len(items)))
            self.d.update(items)

        def get_many(self, keys):
            calls.append((self.name, "get", len(keys)))
            return [self.d[k] for k in keys]

    keys = [i.to_bytes(4, "big") for i in range(12)]
    vals = [os.urandom(64) for _ in range(5)]
    res = interleaved_rep({"a": Logged("a"), "b": Logged("b"), "c": Logged("c")}, "batch", keys, vals, batch=4)
    order = [name for name, _, _ in calls]
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"] * 2
    assert [op for _, op, _ in calls] == ["put"] * 9 + ["get"] * 9 and {n for _, _, n in calls} == {4}
    for name in "abc":
        assert set(res[name]) == {"put", "get"} and len(res[name]["get"][1]) == 12 and res[name]["put"][0] > 0


def test_bench_remotes_systems_run_interleaved_step_by_step():
    """``bench_remote.bench_systems``: every step (one entry, or one batch) is run by each
    system (the kvstore clients, Redis, Mooncake) in turn, the order rotating per step; a
    wrong value read back fails the run."""
    from tools.bench_peers import Peer
    from tools.bench_remote import bench_systems

    calls: list[tuple[str, str]] = []

    class Logged(Peer):
        def __init__(self, name, garble=False):
            self.name, self.d, self.garble = name, {}, garble

        def put(self, k, v):
            calls.append((self.name, "put"))
            self.d[k] = v

        def get(self, k):
            calls.append((self.name, "get"))
            return b"garbage" if self.garble else self.d[k]

        def put_many(self, kv):
            calls.append((self.name, "put_many"))
            self.d.update(kv)

        def get_many(self, keys):
            calls.append((self.name, "get_many"))
            return [self.d[k] for k in keys]

    res = bench_systems({"a": Logged("a"), "b": Logged("b")}, 64, 4, 2, "t")
    assert [n for n, _ in calls] == ["a", "b", "b", "a"] * 6  # 4 single steps, put then get; 2 batch steps
    assert [op for _, op in calls] == ["put"] * 8 + ["get"] * 8 + ["put_many"] * 4 + ["get_many"] * 4
    assert set(res["a"]) == {"put", "get", "put_batch", "get_batch"} and all(x > 0 for x in res["b"].values())
    with pytest.raises(RuntimeError, match="wrong bytes"):
        bench_systems({"a": Logged("a"), "g": Logged("g", garble=True)}, 64, 2, 2, "t")
    calls.clear()  # --sequential: each mode's steps by one system, then by the next
    bench_systems({"b": Logged("b"), "a": Logged("a")}, 64, 4, 2, "t", interleave=False)
    assert calls == ([("b", "put")] * 4 + [("b", "get")] * 4 + [("a", "put")] * 4 + [("a", "get")] * 4
                     + [("b", "put_many"), ("b", "put_many"), ("b", "get_many"), ("b", "get_many")]
                     + [("a", "put_many"), ("a", "put_many"), ("a", "get_many"), ("a", "get_many")])


def test_each_goal_is_the_one_for_its_size_and_mode():
    """The store's goals as its benchmark judges them: a looser bar for small single gets than
    for large batches, and a batch put judged against raw files at 1.0x, not 0.5x."""
    from tools.bench_store import goal_of, goals

    K, M = 1024, 1024 * 1024
    assert [goal_of("get", "raw_file", mode, size) for mode, size in
            [("single", 128 * K), ("batch", 128 * K), ("single", M), ("batch", M), ("batch", 4 * M)]] == \
        [0.5, 0.6, 0.6, 0.7, 0.7]
    assert goal_of("get", "raw_file", "single", 64 * K) is None  # under every row: no goal claimed
    assert goal_of("get", "redis", "batch", 4 * M) == goal_of("get", "redis", "single", 128 * K) == 2.0
    assert (goal_of("put", "raw_file", "single", M), goal_of("put", "raw_file", "batch", M)) == (0.5, 1.0)
    assert goal_of("get", "lmdb", "single", M) is None
    rows = [{"op": "put", "peer": "raw_file", "size": M, "mode": "batch", "ratio": 0.74},
            {"op": "get", "peer": "raw_file", "size": M, "mode": "batch", "ratio": 0.55},
            {"op": "get", "peer": "lmdb", "size": M, "mode": "batch", "ratio": 9.0}]
    got = {(g["op"], g["mode"]): (g["goal"], g["met"]) for g in goals(rows)}
    assert got == {("put", "batch"): (1.0, False), ("get", "batch"): (0.7, False)}
