"""tools/load_store.py and the sharded client's placement, kept short (bounded by time and count)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore
from kvstore import PutItem
from tests.kvstore.daemons import make_daemon  # noqa: F401 - the fixture of the sharded-client test

ROOT = Path(__file__).resolve().parents[2]


# ("3", "off"), batched puts through the daemons, is slow: the remote client's tests cover that path
@pytest.mark.parametrize("put_batch,direct", [("1", "off"), pytest.param("3", "off", marks=pytest.mark.slow),
                                              ("3", "on")])
def test_load_tool_against_three_daemons_verifies_every_read(tmp_path, put_batch, direct) -> None:
    out = tmp_path / "load.json"
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "load_store.py"), "--procs", "2", "--seconds", "2",
                        "--daemons", "3", "--value-bytes", "4096", "--key-space", "300", "--fsync", "false",
                        "--put-batch", put_batch, "--direct-reads", direct, "--direct-writes", direct,
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["ops"] > 0 and rep["wrong_bytes"] == 0 and rep["errors"] == 0 and rep["final_missing"] == 0
    assert rep["latency_ms"]["get"]["p50"] is not None
    if direct == "on":  # the clients wrote packs themselves, and nothing fell back to the daemons
        assert rep["direct_w"]["direct_writes"] > 0 and rep["direct_w"]["fallbacks"] == 0, rep["direct_w"]


def test_sharded_store_spreads_keys_and_chains_cross_shards(make_daemon) -> None:
    ds = [make_daemon() for _ in range(3)]
    s = kvstore.connect(",".join(d.address for d in ds))
    keys = [hashlib.blake2b(b"%d" % i, digest_size=16).digest() for i in range(300)]
    s.put_many([PutItem(k, b"v") for k in keys])
    per = [d.store.stats()["entries"] for d in ds]
    assert sum(per) == 300 and min(per) > 60, per  # rendezvous hashing: roughly even
    owners = {s.owner(k) for k in keys[:20]}
    assert len(owners) == 3  # one chain really spans the three daemons
    assert s.lookup(keys).hit_blocks == 300
    victim = keys[150]
    assert s.delete(victim)
    assert s.lookup(keys).hit_blocks == 150
    st = s.stats()
    assert st["entries"] == 299 and set(st["shards"]) == {d.address for d in ds}
    s.close()
