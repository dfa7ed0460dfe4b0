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

ROOT = Path(__file__).resolve().parents[2]


def test_bench_store_quick_smallest(tmp_path):
    out = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    r = subprocess.run(
        [sys.executable, "tools/bench_store.py", "--quick", "--sizes", "128K", "--reps", "1", "--mib-per-rep", "1",
         "--batch", "8", "--lookup-sizes", "10k", "--no-ec", "--no-install", "--work-dir", str(tmp_path),
         "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    d = json.loads(out.read_text())
    systems = {row["system"] for row in d["io"]}
    assert {"kvstore", "kvstore_zstd", "raw_file", "lmdb"} <= systems
    if shutil.which("redis-server"):
        assert "redis" in systems
    for row in d["io"]:
        assert row["mib_s"] > 0 and row["p50_ms"] <= row["p99_ms"]
    assert {(g["op"], g["peer"]) for g in d["goals"]} >= {("get", "raw_file"), ("put", "raw_file")}
    assert d["lookup"][0]["hit_blocks"] == 1000 and d["lookup"][0]["entries"] == 10_000
    assert "ratio kvstore / peer" in r.stdout and "goals" in r.stdout
    assert not any(p.name.startswith("bench_store-") for p in tmp_path.iterdir())  # work dir cleaned
