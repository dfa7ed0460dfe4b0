"""kvtool subcommands in-process (``main(argv)``) and once through a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import kvstore
from tests.kvstore.cli.conftest import populate, write_config

ROOT = Path(__file__).resolve().parents[3]


def test_inspect_summary_json(store_dir, run_tool):
    code, out, _ = run_tool("inspect", store_dir.path, "--json")
    assert code == 0
    d = json.loads(out)
    assert d["by_kind"]["block"]["entries"] == len(store_dir.blocks)
    assert d["by_kind"]["swa"]["entries"] == len(store_dir.swa)
    assert d["total"]["lost"] == 0 and d["total"]["degraded"] == 0
    assert d["by_kind"]["block"]["plain_bytes"] == sum(len(v) for v in store_dir.blocks.values())
    assert d["total"]["oldest_created"] <= d["total"]["newest_created"]
    # the erasure code spelled as stats spells it (it said "4+2" against stats' "<ec_type> 4+2")
    assert d["erasure_code"] == json.loads(run_tool("stats", store_dir.path, "--json")[1])["erasure_code"]
    code, out, _ = run_tool("inspect", store_dir.path)
    assert code == 0 and "block" in out and "swa" in out


def test_inspect_key_and_chain(store_dir, run_tool):
    key = next(iter(store_dir.swa))
    code, out, _ = run_tool("inspect", store_dir.path, "--key", key.hex(), "--kind", "swa", "--json")
    d = json.loads(out)
    assert code == 0 and d["state"] == "live" and d["kind"] == "swa" and len(d["targets"]) == 6
    code, out, _ = run_tool("inspect", store_dir.path, "--key", "00" * 16, "--json")
    assert code == 1 and json.loads(out)["state"] == "absent"
    chain = store_dir.chain[:6] + [b"\x00" * 16]
    code, out, _ = run_tool("inspect", store_dir.path, "--chain", ",".join(k.hex() for k in chain), "--json")
    d = json.loads(out)
    assert code == 0 and d["hit_blocks"] == 6 and d["swa_at"] == 4
    assert [p["block"] for p in d["positions"]] == ["live"] * 6 + ["absent"]
    assert [p["swa"] for p in d["positions"]][:6] == ["absent", "absent", "absent", "live", "absent", "absent"]


def test_inspect_chain_from_a_file(store_dir, run_tool, tmp_path):
    """``--chain @FILE``: a chain too long for one argument, one key per line or comma separated."""
    chain = store_dir.chain[:6] + [b"\x00" * 16]
    listed = tmp_path / "chain.txt"
    listed.write_text("\n".join(k.hex() for k in chain[:3]) + "\n" + ", ".join(k.hex() for k in chain[3:]) + "\n")
    code, out, _ = run_tool("inspect", store_dir.path, "--chain", f"@{listed}", "--json")
    d = json.loads(out)
    assert code == 0 and d["hit_blocks"] == 6 and d["swa_at"] == 4 and len(d["positions"]) == 7
    code, out, err = run_tool("inspect", store_dir.path, "--chain", f"@{tmp_path / 'missing.txt'}")
    assert code == 2 and out == "" and "cannot read the chain from" in err and "Traceback" not in err


def test_parquet_round_trip(store_dir, run_tool, tmp_path):
    out_file = tmp_path / "index.parquet"
    code, out, _ = run_tool("inspect", store_dir.path, "--parquet", out_file)
    assert code == 0
    t = pq.read_table(out_file).to_pylist()
    assert len(t) == len(store_dir.blocks) + len(store_dir.swa)
    assert {r["key"] for r in t if r["kind"] == "block"} == {k.hex() for k in store_dir.blocks}
    assert {r["key"] for r in t if r["kind"] == "swa"} == {k.hex() for k in store_dir.swa}
    for r in t:
        assert r["state"] == "live" and r["expires"] is None and not r["pinned"]
        assert len(r["targets"]) == 6 and r["stored_bytes"] == 6 * r["fragment_bytes"]
        assert r["created"] <= r["last_access"]
    assert {r["plain_bytes"] for r in t if r["kind"] == "block"} == {2 * 16 * 64 * 2}


def test_stats_and_delete_swa(store_dir, run_tool):
    code, out, _ = run_tool("stats", store_dir.path, "--json")
    assert code == 0 and json.loads(out)["entries"] == len(store_dir.blocks) + len(store_dir.swa)
    key = next(iter(store_dir.swa))
    code, out, _ = run_tool("delete", store_dir.path, "--key", key.hex(), "--kind", "swa")
    assert code == 0 and "deleted swa" in out
    code, _, _ = run_tool("delete", store_dir.path, "--key", key.hex(), "--kind", "swa")
    assert code == 1  # already gone
    with kvstore.connect(str(store_dir.path)) as store:
        assert store.get(key) == store_dir.blocks[key]  # the block under the same key stays
        res = store.lookup(store_dir.chain[:4])
        assert res.hit_blocks == 4 and res.swa_at is None


def test_gc_ttl_and_orphans(tmp_path, run_tool):
    cfg = write_config(tmp_path / "kv.toml", delete_grace_s=0.0, orphan_grace_s=0.0)
    pop = populate(tmp_path / "data", 4, config_file=cfg)
    with kvstore.connect(str(pop.path), config_file=cfg) as store:
        store.put(b"\x07" * 16, b"x" * 5000, ttl_s=0.05)
    orphan = pop.path / "targets" / "t0" / "1" / "ab" / f"{'ab' * 16}.{'00' * 8}.0"
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes(b"junk" * 100)
    time.sleep(0.1)
    code, out, err = run_tool("gc", pop.path, "--config", cfg, "--dry-run", "--json")
    d = json.loads(out)
    assert code == 0 and d["dry_run"] and d["expired"] == 1 and d["orphans"] == 1
    assert orphan.exists()
    code, out, err = run_tool("gc", pop.path, "--config", cfg, "--json")
    d = json.loads(out)
    assert code == 0 and d["expired"] == 1 and d["orphans"] == 1 and d["purged"] == 1
    assert d["reclaimed_bytes"] > 400 and not orphan.exists()
    assert "orphans" in err  # progress lines on stderr (not a TTY here)
    code, out, _ = run_tool("gc", pop.path, "--config", cfg)
    assert code == 0 and "reclaimed 0 B" in out
    assert run_tool("verify", pop.path, "--config", cfg)[0] == 0


def test_usage_errors_exit_2(store_dir, run_tool, tmp_path):
    missing = tmp_path / "nope"
    for cmd in ("inspect", "verify", "stats", "gc", "repair"):
        code, out, err = run_tool(cmd, missing)
        assert code == 2 and "does not exist" in err and "Traceback" not in err
    assert not missing.exists()  # never creates a store
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_tool("verify", empty)
    assert code == 2 and "not a kvstore data directory" in err and not any(empty.iterdir())
    assert run_tool("inspect", store_dir.path, "--key", "xyz")[0] == 2
    # A store whose marker was lost is still one: kvtool opens it (rewriting the marker from
    # the index, as the store and daemon do); before, it was refused as "not a data directory".
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(store_dir.path, copy)
    (copy / "kvstore.json").unlink()
    code, out, err = run_tool("stats", copy, "--json")
    assert code == 0 and json.loads(out)["entries"] > 0 and "rewrites it from the index" in err, err
    assert (copy / "kvstore.json").is_file() and run_tool("verify", copy)[0] == 0
    assert run_tool("delete", store_dir.path, "--key", "abcd", "--kind", "swa")[0] == 2
    assert run_tool("delete", store_dir.path)[0] == 2  # --key is required
    assert run_tool("frobnicate", store_dir.path)[0] == 2
    assert run_tool("stats", store_dir.path, "--config", tmp_path / "no.toml")[0] == 2
    assert run_tool("stats", "--data-dir", store_dir.path, tmp_path / "other")[0] == 2
    code, _, err = run_tool("stats", "nosuch://x")
    assert code == 2 and "scheme" in err


def test_store_location_forms(store_dir, run_tool, monkeypatch, tmp_path):
    for argv in (("stats", store_dir.path), (store_dir.path, "stats"), ("--data-dir", store_dir.path, "stats"),
                 ("stats", "--data-dir", store_dir.path), ("stats", f"file://{store_dir.path}")):
        code, out, _ = run_tool(*argv, "--json")
        assert code == 0 and json.loads(out)["data_dir"] == str(store_dir.path), argv
    monkeypatch.setenv("KVSTORE_DATA_DIR", str(store_dir.path))
    code, out, _ = run_tool("stats", "--json")
    assert code == 0 and json.loads(out)["data_dir"] == str(store_dir.path)
    monkeypatch.delenv("KVSTORE_DATA_DIR")
    cfg = write_config(tmp_path / "kv.toml", data_dir=str(store_dir.path))
    code, out, _ = run_tool("--config", cfg, "stats", "--json")
    assert code == 0 and json.loads(out)["data_dir"] == str(store_dir.path)


def test_subprocess_module_and_console_script(store_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    r = subprocess.run([sys.executable, "-m", "kvstore.cli.kvtool", "verify", str(store_dir.path), "--json"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True
    script = Path(sys.executable).with_name("kvtool")
    if script.exists():
        r = subprocess.run([str(script), "verify", str(store_dir.path / "missing")],
                           capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def test_logging_quieted_and_restored(store_dir, run_tool):
    import logging

    lg = logging.getLogger("kvstore")
    before = (lg.level, lg.propagate, list(lg.handlers))
    assert run_tool("stats", store_dir.path)[0] == 0
    assert run_tool("-v", "stats", store_dir.path)[0] == 0
    assert (lg.level, lg.propagate, list(lg.handlers)) == before


def _limited_file_size(limit: int):
    def setup() -> None:  # in the child: `ulimit -f`, so a write past `limit` bytes fails "File too large"
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return setup


def test_parquet_write_failure_keeps_the_earlier_file(store_dir, tmp_path):
    """A failure mid-write ("File too large" under ``ulimit -f``) leaves an earlier export as it
    was and no temporary behind; the error is one line, exit 2."""
    pytest.importorskip("resource")
    out_file = tmp_path / "index.parquet"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    argv = [sys.executable, "-m", "kvstore.cli.kvtool", "inspect", str(store_dir.path), "--parquet", str(out_file)]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    good = out_file.read_bytes()
    assert len(good) > 2048
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
                       preexec_fn=_limited_file_size(2048))
    assert out_file.read_bytes() == good  # not truncated, not half-written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "index.parquet"]  # the temporary is gone
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert str(out_file) in r.stderr and "left unchanged" in r.stderr
    assert pq.read_table(out_file).num_rows == len(store_dir.blocks) + len(store_dir.swa)


def test_parquet_failure_in_process_creates_nothing(store_dir, run_tool, tmp_path, monkeypatch):
    out_file = tmp_path / "out" / "index.parquet"
    out_file.parent.mkdir()
    real_write = pq.ParquetWriter.write_table

    def write_then_fail(self, *a, **kw):
        real_write(self, *a, **kw)  # some bytes reach the file first, as in a real mid-write failure
        raise OSError(27, "File too large")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", write_then_fail)
    code, out, err = run_tool("inspect", store_dir.path, "--parquet", out_file)
    assert code == 2 and out == "" and "File too large" in err and err.count("\n") == 1
    assert not any(out_file.parent.iterdir())  # neither FILE nor a temporary
    monkeypatch.undo()
    code, out, _ = run_tool("inspect", store_dir.path, "--parquet", out_file)
    assert code == 0 and [p.name for p in out_file.parent.iterdir()] == ["index.parquet"]


def test_parquet_empty_or_directory_path_is_a_usage_error(store_dir, run_tool, tmp_path):
    for bad in ("", "  "):
        code, out, err = run_tool("inspect", store_dir.path, "--parquet", bad)
        assert code == 2 and out == "" and "--parquet" in err and "Traceback" not in err
    code, out, err = run_tool("inspect", store_dir.path, "--parquet", tmp_path)
    assert code == 2 and out == "" and "is a directory" in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == [store_dir.path]


def test_negative_or_non_numeric_limit_is_a_usage_error(store_dir, run_tool):
    for bad in ("-1", "-50", "ten", "1.5"):
        code, out, err = run_tool("verify", store_dir.path, "--limit", bad)
        assert code == 2 and out == "" and "--limit" in err and "... and" not in err, bad
    code, out, _ = run_tool("verify", store_dir.path, "--limit", "0")
    assert code == 0 and "no problems" in out and "... and" not in out


def test_config_with_a_daemon_url_is_one_clear_usage_error(store_dir, run_tool, tmp_path):
    cfg = write_config(tmp_path / "kv.toml", capacity_bytes=100000)
    for argv in (("--config", cfg, "stats", "grpc://127.0.0.1:1"), ("stats", "grpc://127.0.0.1:1", "--config", cfg),
                 ("--config", cfg, "--data-dir", "grpcs://example.invalid:443", "verify")):
        code, out, err = run_tool(*argv)
        assert code == 2 and out == "" and err.count("\n") == 1, argv
        assert "--config applies only to a data directory" in err and "config_file" not in err, err
    assert run_tool("--config", cfg, "stats", store_dir.path)[0] == 0  # a data directory takes it


def test_gc_dry_run_reports_the_whole_capacity_eviction(tmp_path, run_tool):
    """More than one eviction batch (256) over capacity: the dry run reports the count and
    bytes the real gc then evicts, and changes nothing."""
    pop = populate(tmp_path / "data", 300)  # 300 blocks + 75 SWA snapshots
    cfg = write_config(tmp_path / "kv.toml", capacity_bytes=20000)
    code, out, _ = run_tool("--config", cfg, "gc", "--dry-run", pop.path, "--json")
    dry = json.loads(out)
    assert code == 0 and dry["dry_run"] and dry["evicted"] > 256
    code, out, _ = run_tool("--config", cfg, "gc", "--dry-run", pop.path)
    assert code == 0 and f"evicted {dry['evicted']} (" in out  # with its size
    code, out, _ = run_tool("stats", pop.path, "--json")
    assert json.loads(out)["entries"] == 375  # the dry run removed nothing
    code, out, _ = run_tool("--config", cfg, "gc", pop.path, "--json")
    real = json.loads(out)
    assert code == 0 and (real["evicted"], real["evicted_bytes"]) == (dry["evicted"], dry["evicted_bytes"])
    assert real["used_bytes"] <= 20000 * 0.85


def test_gc_that_cannot_reach_capacity_prints_the_pass_and_exits_1(tmp_path, run_tool):
    """Everything left pinned: gc still purges and sweeps, prints that pass's counts (text and
    --json) and exits 1 with the reason in one stderr line. Before: nothing on stdout."""
    path = tmp_path / "data"
    with kvstore.connect(str(path), fsync=False) as s:
        for i in range(5):
            key = bytes([i + 1]) * 16
            s.put(key, os.urandom(20_000))
            assert s.pin(key)
        s.put(b"\xee" * 16, os.urandom(2_000))
        assert s.delete(b"\xee" * 16)
    cfg = write_config(tmp_path / "cap.toml", capacity_bytes=50_000, delete_grace_s=0)
    code, out, err = run_tool("gc", path, "--config", cfg, "--dry-run", "--json")
    d = json.loads(out)
    assert code == 1 and d["dry_run"] is True and d["purged"] == 1 and d["used_bytes"] > 50_000, err
    code, out, err = run_tool("gc", path, "--config", cfg, "--json")
    d = json.loads(out)
    assert code == 1 and d["dry_run"] is False and d["purged"] == 1 and d["evicted"] == 0, err
    # the deleted entry's space: its blocks punched out of the segment that holds the pinned ones
    assert d["reclaimed_bytes"] + d["punched_bytes"] > 0 and d["used_bytes"] > 50_000
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvtool: error: gc: ") and "everything left is pinned" in last
    assert err.count("kvtool: error:") == 1 and "Traceback" not in err
    code, out, err = run_tool("gc", path, "--config", cfg)  # text: the counts, then the reason
    assert code == 1 and out.startswith("gc: expired 0, evicted 0, purged 0 deleted") and "pinned" in err
