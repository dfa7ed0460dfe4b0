"""tools/bench_store.py --s3 at its smallest settings: kvstore on 6 S3 targets against raw s3fs,
on a moto server on loopback; runs, compares, counts requests, writes its JSON.

moto and s3fs are test dependencies (pyproject's ``dev`` extra): a missing one fails the run
here, it is not skipped. Only the shape of the figures is checked (timings on a shared box
are noise); the request counts are the layout's, and are checked exactly where the layout
fixes them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSTORE_", "AWS_"))}
    return subprocess.run([sys.executable, "tools/bench_store.py", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)


def test_bench_store_s3_quick_smallest(tmp_path):
    out = tmp_path / "s3.json"
    r = _run(["--s3", "--quick", "--sizes", "4K", "--reps", "2", "--mib-per-rep", "0.0625", "--batch", "4",
              "--work-dir", str(tmp_path), "--out", str(out)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    d = json.loads(out.read_text())
    cells = {(row["system"], row["mode"], row["op"]) for row in d["io"]}
    assert cells == {(s, mode, op) for s in ("kvstore", "raw_s3") for mode in ("single", "batch")
                     for op in ("put", "get")}
    for row in d["io"]:
        assert row["size"] == 4096 and row["ops"] == 16 and row["mib_s"] > 0 and len(row["rep_mib_s"]) == 2
    assert {(x["mode"], x["op"]) for x in d["ratios"] if x["peer"] == "raw_s3"} == {
        (mode, op) for mode in ("single", "batch") for op in ("put", "get")}
    for x in d["ratios"]:  # positive numbers, the median within the per-rep ratios
        assert 0 < x["ratio_min"] <= x["ratio"] <= x["ratio_max"]
    reqs = {(x["system"], x["mode"], x["op"]): x for x in d["requests"]}
    assert set(reqs) == cells
    # the layout on S3: a single put is one object per fragment (k+m = 6), a batch one pack
    # object per target; a get reads at least k = 4 fragments (ranges of the objects)
    assert reqs[("kvstore", "single", "put")]["objects_written"] == 6
    assert reqs[("kvstore", "single", "put")]["requests"] == {"PUT": 6}  # no bucket listing per write
    batch_put = reqs[("kvstore", "batch", "put")]
    assert batch_put["objects_written"] == 6 and batch_put["entries"] == 4
    assert reqs[("kvstore", "single", "get")]["per_entry"] >= 4
    assert reqs[("raw_s3", "single", "put")]["requests"] == {"PUT": 1}
    assert reqs[("raw_s3", "single", "get")]["requests"] == {"GET": 1}
    assert reqs[("raw_s3", "batch", "put")]["requests"] == {"PUT": 4}
    assert "ratio kvstore / peer" in r.stdout and "S3 requests per op" in r.stdout
    assert not any(p.name.startswith("bench_store-") for p in tmp_path.iterdir())  # work dir cleaned


def test_bench_store_s3_refuses_options_of_the_local_run(tmp_path):
    r = _run(["--s3", "--systems", "kvstore,raw_file", "--out", str(tmp_path / "x.json")])
    assert r.returncode == 2 and "--s3 runs its own systems" in r.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for child processes")
def test_bench_store_s3_ctrl_c_stops_the_s3_server_and_removes_its_work_dir(tmp_path):
    from tests.tools.test_tools_interrupt import assert_interrupted, interrupt_when

    cmd = [sys.executable, "tools/bench_store.py", "--s3", "--sizes", "128K", "--reps", "1000", "--mib-per-rep", "1",
           "--batch", "4", "--work-dir", str(tmp_path), "--out", str(tmp_path / "s3.json")]
    code, err, kids = interrupt_when(cmd, "S3 (moto", tmp_path)
    assert kids, "the S3 server runs as a child process"
    assert_interrupted(code, err, kids, "bench_store.py")  # the server stopped with the run
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_bench_store_s3_a_server_that_does_not_start_is_one_error_line(tmp_path, monkeypatch, capsys):
    """Rule 3 of tools/cli_args.py: a run that fails once started says why in one line, status 1."""
    from tools import bench_store

    def no_server():
        raise RuntimeError("moto S3 server did not start within 30 s")

    monkeypatch.setattr(bench_store, "S3Server", no_server)
    with pytest.raises(SystemExit) as exc:
        bench_store.main(["--s3", "--quick", "--work-dir", str(tmp_path), "--out", str(tmp_path / "s3.json")])
    err = capsys.readouterr().err
    assert exc.value.code == 1 and "error: RuntimeError: moto S3 server did not start" in err and "Traceback" not in err
    assert list(tmp_path.iterdir()) == []  # the work dir removed, no results written
