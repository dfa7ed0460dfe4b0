"""``kvtool inspect --parquet FILE`` against daemon URLs: the daemon's ``ExportIndex`` streams its
index rows and kvtool writes the file, the same file as the export on the data directory.

Admin tenants only (exit 2 in one line otherwise, nothing written); a sharded set's file holds
every shard's rows (targets ``URL/target``), and a shard that does not answer is named, exit 1,
the others' rows written. Fixtures and helpers come from ``test_kvtool``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow.parquet as pq

import kvstore
from kvstore import PutItem

from tests.kvstore.cli.test_kvtool import TOK_A, TOK_OPS, K, dead_url, one_line, run_tool, tokens_file  # noqa: F401 (fixtures)


def _fill(url: str, n: int, **connect) -> None:
    """``n`` blocks (some pinned, one with a TTL) and a few SWA snapshots, in small batches."""
    with kvstore.connect(url, **connect) as s:
        for start in range(0, n, 50):
            assert all(s.put_many([PutItem(K(i), b"v%d" % i * 20, tokens=i % 7)
                                   for i in range(start, min(n, start + 50))]))
        for i in range(0, n, 9):
            s.put(K(i), b"snapshot" * 30, kind="swa")
        s.pin(K(1))
        s.put(K("ttl"), b"short-lived" * 10, ttl_s=3600)


def _files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_parquet_through_a_daemon_is_the_data_directory_export(make_daemon, run_tool, tmp_path) -> None:
    """Before: ``--parquet needs an embedded store (a data directory), not a daemon URL``, exit 2.
    A small max_message_bytes makes the daemon split its batches into many chunks."""
    d = make_daemon(max_message_bytes=64 * 1024)
    _fill(d.address, 400, max_message_bytes=64 * 1024)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    remote = out_dir / "remote.parquet"
    before = dict(d.store.counters)
    code, out, err = run_tool("inspect", d.address, "--parquet", remote, "--json")
    n = d.store.stats()["entries"]
    assert (code, json.loads(out)) == (0, {"parquet": str(remote), "rows": n}), err
    assert _files(out_dir) == ["remote.parquet"]  # no temporary left behind
    assert dict(d.store.counters) == before and not d.store.access.pending()  # read-only: nothing refreshed or counted
    reg = d.metrics.registry
    assert reg.get_sample_value("kvstore_requests_total", {"method": "ExportIndex", "code": "OK"}) == 1
    code, text, _ = run_tool("inspect", d.address, "--parquet", remote)
    assert code == 0 and text == f"wrote {n} index rows to {remote}\n"
    data_dir = str(d.store.data_dir)
    d.stop()
    local = out_dir / "local.parquet"
    assert run_tool("inspect", data_dir, "--parquet", local)[0] == 0
    got, want = pq.read_table(remote), pq.read_table(local)
    assert got.num_rows == n > 400 and got.schema == want.schema
    assert got.equals(want)  # row for row, access times included


def test_parquet_through_a_daemon_needs_an_admin(make_daemon, run_tool, tokens_file, tmp_path, monkeypatch) -> None:
    d = make_daemon(tokens_file=tokens_file)
    _fill(d.address, 20, token=TOK_A)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    dest = out_dir / "index.parquet"
    dest.write_bytes(b"earlier")
    monkeypatch.setenv("KVSTORE_TOKEN", TOK_A)
    code, out, err = run_tool("inspect", d.address, "--parquet", dest)
    assert code == 2 and out == ""
    assert one_line(err).startswith("kvtool: error: inspect needs an admin tenant's token: set KVSTORE_TOKEN")
    assert "PERMISSION_DENIED" in err or "ExportIndex" in err
    assert _files(out_dir) == ["index.parquet"] and dest.read_bytes() == b"earlier"  # left as it was
    monkeypatch.setenv("KVSTORE_TOKEN", TOK_OPS)
    code, out, err = run_tool("inspect", d.address, "--parquet", dest)
    assert code == 0 and pq.read_table(dest).num_rows == d.store.stats()["entries"], err


def test_parquet_through_a_sharded_set_with_a_shard_down(make_daemon, run_tool, tmp_path) -> None:
    a, b = make_daemon("a"), make_daemon("b")
    _fill(f"{a.address},{b.address}", 60)
    held = {}
    for shard in (a, b):
        assert shard.store.stats()["entries"] > 0  # both shards hold some
        local = tmp_path / f"{shard.port}.parquet"
        assert run_tool("inspect", shard.address, "--parquet", local)[0] == 0
        held[shard.address] = pq.read_table(local).to_pylist()
    dest = tmp_path / "set.parquet"
    code, out, err = run_tool("inspect", f"{a.address},{b.address}", "--parquet", dest, "--json")
    rows = pq.read_table(dest).to_pylist()
    assert code == 0 and json.loads(out)["rows"] == len(rows) == sum(len(r) for r in held.values()), err

    def named(url: str, shard_rows: list[dict]) -> list[dict]:  # targets as a set names them
        return [dict(r, targets=[f"{url}/{t}" for t in r["targets"]]) for r in shard_rows]

    assert rows == named(a.address, held[a.address]) + named(b.address, held[b.address])
    # A shard down: named in one line, exit 1, the others' rows still written.
    down = dead_url()
    code, out, err = run_tool("inspect", f"{a.address},{down},{b.address}", "--parquet", dest, "--json",
                              "--timeout", "20")
    d = json.loads(out)
    assert code == 1 and set(d["unanswered"]) == {down} and d["rows"] == len(rows), err
    assert one_line(err).startswith(f"kvtool: error: inspect: shard {down} did not answer")
    assert "from the other 2 of 3 shards" in err
    assert pq.read_table(dest).to_pylist() == rows
    # No shard answering: the store's error (exit 2), the earlier file left as it was.
    code, out, err = run_tool("inspect", f"{down},{dead_url()}", "--parquet", dest, "--timeout", "20")
    assert code == 2 and out == "" and "unreachable" in one_line(err)
    assert pq.read_table(dest).to_pylist() == rows and _files(tmp_path).count("set.parquet") == 1
    assert not [p for p in _files(tmp_path) if p.endswith(".tmp")]


def test_a_write_failure_through_a_daemon_leaves_nothing(make_daemon, run_tool, tmp_path, monkeypatch) -> None:
    """The file is written on kvtool's side as on a data directory: a write failing part-way is
    one line, exit 2, no FILE and no temporary; the daemon's stream is ended, not left open."""
    d = make_daemon(max_message_bytes=64 * 1024)
    _fill(d.address, 300, max_message_bytes=64 * 1024)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    dest = out_dir / "index.parquet"
    real_write = pq.ParquetWriter.write_table

    def write_then_fail(self, *a, **kw):
        real_write(self, *a, **kw)
        raise OSError(27, "File too large")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", write_then_fail)
    code, out, err = run_tool("inspect", d.address, "--parquet", dest)
    assert code == 2 and out == "" and "File too large" in one_line(err) and str(dest) in err
    assert _files(out_dir) == []
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while d.limiter.in_flight and time.monotonic() < deadline:  # the cancel reaches the daemon shortly
        time.sleep(0.05)
    assert d.limiter.in_flight == 0  # the call ended with kvtool's failure (its slot given back)
    code, out, err = run_tool("inspect", d.address, "--parquet", dest)
    assert code == 0 and pq.read_table(dest).num_rows == d.store.stats()["entries"], err
