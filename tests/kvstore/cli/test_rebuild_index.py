"""``kvtool rebuild-index`` (``kvstore.maintenance.reindex``): a lost or damaged index rebuilt from the
fragments on the targets, every entry back as it was (key, kind, bytes, layout, tokens, times);
and, on an index that opens, the entries it does not know added."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import kvstore
from kvstore.api import EntryKind
from kvstore.embedded.datadir import DATA_FORMAT_VERSION
from kvstore.embedded.index import ekey
from kvstore.keys import BlockHasher, Namespace

N_TARGETS = 6


def _open(path: Path, targets: str | None = None) -> kvstore.KVStore:
    kw = {"targets": targets} if targets else {}
    return kvstore.connect(str(path), fsync=False, ec_k=4, ec_m=2, **kw)


def _fill(path: Path, targets: str, n_blocks: int = 24, seed: int = 0) -> dict[tuple[str, bytes], dict]:
    """Block entries in batches (pack files), SWA entries one by one (fragment files), some
    with a TTL; returns per (kind, key) what a read and the index say of it."""
    rng = np.random.default_rng(seed)
    chain = BlockHasher(Namespace(f"m{seed}", "global", "float16"), block_size=16).hash_blocks(
        list(range(16 * n_blocks)))
    with _open(path, targets) as s:
        items = [kvstore.PutItem(k, rng.standard_normal((2, 16, 8)).astype(np.float16), tokens=16,
                                 ttl_s=3600 if i % 3 == 0 else None) for i, k in enumerate(chain)]
        for start in range(0, len(items), 8):
            assert all(s.put_many(items[start:start + 8]))
        for i, k in enumerate(chain[3::4]):
            assert s.put(k, rng.standard_normal((4, 16, 4)).astype(np.float32), kind="swa", tokens=16 * (4 * i + 4),
                         ttl_s=60 if i % 2 else None)
        return _snapshot(s, [("block", k) for k in chain] + [("swa", k) for k in chain[3::4]])


def _snapshot(s, names) -> dict[tuple[str, bytes], dict]:
    out = {}
    with s.index.env.begin() as txn:
        metas = {n: s.index.get_meta(txn, ekey(EntryKind.parse(n[0]).code, n[1])) for n in names}
    for kind, key in names:
        e = s.get_entry(key, kind=kind)
        m = metas[(kind, key)]
        out[(kind, key)] = {"data": bytes(e.data), "layout": e.layout, "tokens": e.tokens,
                            "created_ns": m.created_ns, "expires_ns": m.expires_ns, "plain_len": m.plain_len}
    return out


@pytest.fixture
def six(tmp_path: Path) -> tuple[Path, str]:
    roots = [tmp_path / f"disk{i}" for i in range(N_TARGETS)]
    targets = ",".join(f"{r}#d{i % 3}#t{i}" for i, r in enumerate(roots))
    return tmp_path / "data", targets


def test_rebuild_after_the_index_and_a_target_are_lost(six, run_tool):
    """Block (packed) and SWA (own files) entries over 6 targets, 4+2; the index deleted and
    one target's disk replaced by an empty one: every entry comes back identical (bytes,
    layout, tokens, created and expiry times), degraded; repair restores the lost target's
    fragments and verify is clean. Before: every open refused the directory, and nothing
    could bring the entries back."""
    data, targets = six
    before = _fill(data, targets)
    shutil.rmtree(data / "index")
    lost = Path(targets.split(",")[2].split("#")[0])
    shutil.rmtree(lost)
    lost.mkdir()
    with pytest.raises(kvstore.CorruptData, match="kvtool rebuild-index"):
        _open(data)

    code, out, err = run_tool("rebuild-index", data)
    assert code == 1, (out, err)  # degraded entries: repair is needed
    assert f"{len(before)} entries ({sum(k == 'block' for k, _ in before)} block, " in out, out
    assert "not decodable 0, bad fragments 0" in out and "run `kvtool repair`" in out, out
    assert "decode:" in err  # progress on stderr
    assert not (data / "index.rebuild").exists()

    with _open(data) as s:
        assert _snapshot(s, list(before)) == before
        chain = [k for kind, k in before if kind == "block"]
        hit = s.lookup(chain)
        assert hit.hit_blocks == len(chain) and hit.swa_at == len(chain)
        assert s.stats()["entries"] == len(before)
    code, out, err = run_tool("repair", data)
    assert code == 0, (out, err)
    code, out, err = run_tool("verify", data)
    assert code == 0 and "no problems" in out, (out, err)


def test_a_truncated_index_is_moved_aside_and_rebuilt(six, run_tool):
    """A truncated index, and one fragment in a pack damaged: the damaged fragment is counted
    and left out (its entry indexed degraded, decoded from the others), the pack's other
    fragments are found past it; the old index is kept aside."""
    data, targets = six
    before = _fill(data, targets, n_blocks=8)
    f = data / "index" / "data.mdb"
    os.truncate(f, f.stat().st_size // 2 // 4096 * 4096)
    pack = next(Path(targets.split(",")[0].split("#")[0]).rglob("*.pack"))
    raw = bytearray(pack.read_bytes())
    raw[100] ^= 0xFF  # inside the first fragment's body
    pack.write_bytes(bytes(raw))
    code, out, err = run_tool("verify", data)
    assert code == 2 and "kvtool rebuild-index" in err
    code, out, err = run_tool("rebuild-index", data)
    assert code == 1 and "degraded 1 " in out and "bad fragments 1," in out, (out, err)
    aside = [p for p in data.iterdir() if p.name.startswith("index.damaged-")]
    assert len(aside) == 1 and str(aside[0]) in out
    assert (aside[0] / "data.mdb").is_file()  # kept, never deleted
    with _open(data) as s:
        assert _snapshot(s, list(before)) == before
    assert run_tool("repair", data)[0] == 0
    code, out, err = run_tool("verify", data)
    assert code == 0, (out, err)


def test_an_index_restored_from_an_older_copy_gets_the_newer_entries(six, run_tool):
    """On an index that opens, rebuild-index adds the entries it does not know (files older
    than orphan_grace_s), and leaves those it knows as they are (a pin survives)."""
    data, targets = six
    first = _fill(data, targets, n_blocks=8, seed=1)
    copy = data.parent / "index-copy"
    shutil.copytree(data / "index", copy)
    second = _fill(data, targets, n_blocks=8, seed=2)  # another namespace: other keys
    shutil.rmtree(data / "index")
    shutil.copytree(copy, data / "index")
    old = os.path.getmtime(data / "kvstore.json") - 3600
    for d, _, files in os.walk(data.parent):
        if "disk" in d:
            for name in files:
                os.utime(os.path.join(d, name), (old, old))  # written an hour ago: no put in flight
    pinned = next(k for kind, k in first if kind == "block")
    with _open(data) as s:
        assert s.pin(pinned)
        assert all(s.get_many([k], kind=kind) == [None] for kind, k in second)
    code, out, err = run_tool("rebuild-index", data)
    assert code == 0 and f"{len(second)} entries" in out, (out, err)
    with _open(data) as s:
        assert _snapshot(s, list(first)) == first and _snapshot(s, list(second)) == second
        assert s.stats()["entries"] == len(first) + len(second)
        with s.index.env.begin() as txn:
            assert s.index.get_meta(txn, ekey(EntryKind.BLOCK.code, pinned)).pinned
    code, out, err = run_tool("rebuild-index", data)  # again: nothing left to add
    assert code == 0 and "0 entries (none) added" in out, (out, err)
    code, out, err = run_tool("verify", data)
    assert code == 0, (out, err)


def test_an_older_data_directory_is_refused_not_misread(six, run_tool):
    data, targets = six
    _fill(data, targets, n_blocks=4)
    marker = data / "kvstore.json"
    doc = json.loads(marker.read_text())
    assert doc["format_version"] == DATA_FORMAT_VERSION
    marker.write_text(json.dumps({**doc, "format_version": 1}))
    code, out, err = run_tool("rebuild-index", data)
    assert code == 2 and "format version 1" in err, (out, err)
    assert "kvtool migrate" not in err  # version 1 is not migrated: no remedy but a matching release
