"""``kvtool rebuild-index grpc://...``: the daemon's ``Maintain`` op ``rebuild-index`` adds the
entries its targets hold that its index does not know, under the tenant keys they were stored
with (so each tenant reads its own back, and no other tenant sees them); admins only."""

from __future__ import annotations

import hashlib
import os
import shutil

import numpy as np

import kvstore
from kvstore import PutItem

from tests.kvstore.cli.test_kvtool import TOK_A, TOK_B, TOK_OPS, run_tool, tokens_file  # noqa: F401 - fixtures


def K(i) -> bytes:
    return hashlib.blake2b(f"rebuild-{i}".encode(), digest_size=16).digest()


def test_rebuild_index_through_the_daemon_keeps_tenant_keys(make_daemon, run_tool, tokens_file, tmp_path,  # noqa: F811
                                                           monkeypatch) -> None:
    data = tmp_path / "data"
    rng = np.random.default_rng(0)
    first = {K(i): rng.standard_normal((2, 8)).astype(np.float16) for i in range(6)}
    later = {K(100 + i): rng.standard_normal((3, 8)).astype(np.float32) for i in range(10)}
    d = make_daemon(data_dir=str(data), tokens_file=tokens_file)
    with kvstore.connect(d.address, token=TOK_A) as a:
        assert all(a.put_many([PutItem(k, v, tokens=8) for k, v in first.items()]))
    d.stop(grace_s=1)
    shutil.copytree(data / "index", tmp_path / "index-copy")
    d = make_daemon(data_dir=str(data), tokens_file=tokens_file)
    with kvstore.connect(d.address, token=TOK_A) as a:
        assert all(a.put_many([PutItem(k, v, tokens=16, ttl_s=3600) for k, v in list(later.items())[:6]]))
        for k, v in list(later.items())[6:]:
            assert a.put(k, v, kind="swa", tokens=24)
    d.stop(grace_s=1)
    shutil.rmtree(data / "index")  # an index restored from a copy made before the later puts
    shutil.copytree(tmp_path / "index-copy", data / "index")
    old = os.path.getmtime(data / "kvstore.json") - 3600
    for root, _, files in os.walk(data / "targets"):
        for name in files:
            os.utime(os.path.join(root, name), (old, old))  # written an hour ago: no put in flight

    d = make_daemon(data_dir=str(data), tokens_file=tokens_file)
    kinds = ["block"] * 6 + ["swa"] * 4
    with kvstore.connect(d.address, token=TOK_A) as a:
        assert [a.get_many([k], kind=kind)[0] for k, kind in zip(later, kinds)] == [None] * len(later)
    monkeypatch.setenv("KVSTORE_TOKEN", TOK_A)
    code, out, err = run_tool("rebuild-index", d.address)
    assert code == 2 and "rebuild-index needs an admin tenant's token" in err, (out, err)
    monkeypatch.setenv("KVSTORE_TOKEN", TOK_OPS)
    code, out, err = run_tool("rebuild-index", d.address)
    assert code == 0 and "10 entries (6 block, 4 swa) added" in out, (out, err)
    assert "decode:" in err  # the daemon's progress, drawn by kvtool
    with kvstore.connect(d.address, token=TOK_A) as a:
        for (k, v), kind in zip(later.items(), kinds):
            e = a.get_entry(k, kind=kind)
            assert bytes(e.data) == v.tobytes() and e.layout.shape == v.shape and e.tokens == (16 if kind == "block"
                                                                                                else 24)
        assert all(a.get(k) == v.tobytes() for k, v in first.items())
    with kvstore.connect(d.address, token=TOK_B) as b:  # another tenant's namespace: none of them
        assert b.get_many(list(later)) == [None] * len(later)
    code, out, err = run_tool("verify", d.address)
    assert code == 0, (out, err)


def test_rebuild_index_on_a_sharded_set_sums_the_shards(make_daemon, run_tool) -> None:  # noqa: F811
    a, b = make_daemon("a"), make_daemon("b")
    with kvstore.connect(f"{a.address},{b.address}") as s:
        assert all(s.put_many([PutItem(K(i), os.urandom(500)) for i in range(20)]))
    code, out, err = run_tool("rebuild-index", f"{a.address},{b.address}", "--json")
    assert code == 0, (out, err)
    assert '"entries": 0' in out and '"already_indexed": ' in out and f'"{a.address}"' in out, out
