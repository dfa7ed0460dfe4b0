"""Fault scenarios through kvtool: targets vanish and come back, a fragment rots.

Every scenario ends with ``kvtool verify`` exiting 0 (the store is clean) once
the damage is repaired, as STYLE.md asks of tests that damage a store.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kvstore
from kvstore import index_view
from tests.kvstore.cli.conftest import Populated, populate, write_config


def _away(pop: Populated, name: str) -> tuple[Path, Path]:
    src = pop.path / "targets" / name
    dst = pop.path / "targets" / f"{name}.away"
    src.rename(dst)
    return src, dst


def _all_read_back(pop: Populated, **kw) -> None:
    with kvstore.connect(str(pop.path), **kw) as store:
        got = store.get_many(list(pop.blocks))
        assert got == list(pop.blocks.values())
        for key, data in pop.swa.items():
            assert store.get(key, kind="swa") == data


def _verify_json(run_tool, *argv) -> tuple[int, dict]:
    code, out, _ = run_tool("verify", *argv, "--json")
    return code, json.loads(out)


def _stats_json(run_tool, path) -> tuple[int, dict]:
    code, out, _ = run_tool("stats", path, "--json")
    return code, json.loads(out)


def test_inspect_and_stats_answer_1_while_a_target_is_down_or_entries_are_lost(store_dir, run_tool):
    """inspect's summary and stats exit as verify would: 1 with a target down or an entry lost
    (a store with every target gone and every entry lost answered 0, healthy; stats still
    did after inspect was fixed), 0 once healthy."""
    pop = store_dir
    assert run_tool("inspect", pop.path)[0] == 0 and run_tool("stats", pop.path)[0] == 0
    moved = [_away(pop, "t1")]
    code, out, _ = run_tool("inspect", pop.path, "--json")
    assert code == 1 and json.loads(out)["total"]["lost"] == 0  # degraded, a target down
    code, d = _stats_json(run_tool, pop.path)
    assert code == 1 and d["lost_entries"] == 0 and [t["name"] for t in d["targets"] if not t["up"]] == ["t1"]
    moved += [_away(pop, "t2"), _away(pop, "t4")]
    assert run_tool("verify", pop.path)[0] == 1  # marks the entries lost
    code, out, _ = run_tool("inspect", pop.path, "--json")
    assert code == 1 and json.loads(out)["total"]["lost"] == len(pop.blocks) + len(pop.swa)
    for src, dst in moved:
        dst.rename(src)
    code, out, _ = run_tool("inspect", pop.path, "--json")
    assert code == 1 and json.loads(out)["total"]["lost"] > 0  # every target up; still lost until a repair
    code, d = _stats_json(run_tool, pop.path)
    assert code == 1 and d["lost_entries"] > 0 and all(t["up"] for t in d["targets"])
    assert run_tool("repair", pop.path)[0] == 0 and run_tool("inspect", pop.path)[0] == 0
    assert run_tool("stats", pop.path)[0] == 0


def test_two_targets_down_reads_three_down_lost_then_repair(store_dir, run_tool):
    pop = store_dir
    moved = [_away(pop, "t1"), _away(pop, "t4")]
    _all_read_back(pop)  # k=4 of 6 fragments are enough
    code, d = _verify_json(run_tool, pop.path)
    assert code == 1 and not d["lost"] and d["counts"]["missing_fragment"] == 2 * (len(pop.blocks) + len(pop.swa))
    moved.append(_away(pop, "t2"))
    code, d = _verify_json(run_tool, pop.path)
    assert code == 1
    expected = {("block", k.hex()) for k in pop.blocks} | {("swa", k.hex()) for k in pop.swa}
    assert {(x["kind"], x["key"]) for x in d["lost"]} == expected  # every entry spans all six targets
    code, out, _ = run_tool("verify", pop.path, "--limit", "3")
    assert code == 1 and f"{len(expected)} lost_entry" in out and "more (--limit N" in out
    assert len(out.splitlines()) == 3 + 3  # 3 problems, "... more", the summary, the hint
    with kvstore.connect(str(pop.path)) as store:
        assert store.lookup(pop.chain).hit_blocks == 0  # lost entries stop matching
    code, out, _ = run_tool("repair", pop.path)
    assert code == 1 and "still lost" in out  # the targets are still away
    for src, dst in moved:
        dst.rename(src)
    code, out, _ = run_tool("repair", pop.path, "--json")
    d = json.loads(out)
    assert code == 0 and d["restored_entries"] == len(expected) and d["still_lost"] == 0 and d["unfixed"] == 0
    code, d = _verify_json(run_tool, pop.path)
    assert code == 0 and d["ok"] is True and d["problems"] == []
    _all_read_back(pop)
    with kvstore.connect(str(pop.path)) as store:
        assert store.lookup(pop.chain).hit_blocks == len(pop.chain)


def test_eight_targets_exactly_the_lost_entries_and_rebuild_on_spares(tmp_path, run_tool):
    root = tmp_path / "data"
    names = [f"t{i}" for i in range(8)]
    cfg = write_config(tmp_path / "kv.toml", targets=[f"file://{root}/targets/{n}#local#{n}" for n in names])
    pop = populate(root, 24, config_file=cfg)
    with kvstore.connect(str(root), config_file=cfg) as store:
        placement = {(r.kind.value, r.key.hex()): set(r.meta.targets) for r in index_view.iter_rows(store)}
    gone = {"t0", "t3", "t6"}
    expected = {e for e, ts in placement.items() if len(ts & gone) > 2}
    assert 0 < len(expected) < len(placement)  # some lost, some not: "exactly" means something
    moved = [_away(pop, n) for n in sorted(gone)]
    code, d = _verify_json(run_tool, root, "--config", cfg)
    assert code == 1 and {(x["kind"], x["key"]) for x in d["lost"]} == expected
    for src, dst in moved:
        dst.rename(src)
    assert run_tool("repair", root, "--config", cfg)[0] == 0
    assert _verify_json(run_tool, root, "--config", cfg)[0] == 0
    # Two targets gone for good: repair rebuilds their fragments onto the two healthy spares.
    for n in ("t1", "t5"):
        _away(pop, n)
    code, out, _ = run_tool("repair", root, "--config", cfg, "--json")
    # Exit 1, as verify's below: the targets are still down (before, repair said 0 and verify 1).
    assert code == 1 and json.loads(out)["rebuilt_fragments"] > 0 and json.loads(out)["targets_down"] == 2
    code, d = _verify_json(run_tool, root, "--config", cfg)
    assert code == 1 and set(d["counts"]) == {"target_down"}  # fully redundant; only the targets are reported
    code, out, _ = run_tool("inspect", root, "--config", cfg, "--json")
    assert json.loads(out)["total"]["degraded"] == 0
    _all_read_back(pop, config_file=cfg)


def test_corrupt_fragment_found_and_repaired(store_dir, run_tool):
    pop = store_dir
    key = pop.chain[5]
    code, out, _ = run_tool("inspect", pop.path, "--key", key.hex(), "--json")
    frag = json.loads(out)["targets"][2]
    path = pop.path / "targets" / frag["target"] / frag["file"]
    at = (frag["offset"] or 0) + 100  # in its own file, or in its batch's pack
    raw = bytearray(path.read_bytes())
    for i in range(at, at + 8):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))
    code, d = _verify_json(run_tool, pop.path)
    assert code == 1 and d["counts"] == {"corrupt_fragment": 1}
    assert d["problems"][0]["key"] == key.hex() and d["problems"][0]["target"] == frag["target"]
    code, out, _ = run_tool("repair", pop.path, "--json")
    assert code == 0 and json.loads(out)["rebuilt_fragments"] == 1
    if frag["offset"] is None:
        assert path.read_bytes() != bytes(raw)  # rewritten in place
    else:  # rebuilt as its own file; the pack keeps the damaged copy until the pack goes
        code, out, _ = run_tool("inspect", pop.path, "--key", key.hex(), "--json")
        assert json.loads(out)["targets"][2]["offset"] is None
    assert _verify_json(run_tool, pop.path)[0] == 0
    _all_read_back(pop)


def test_a_deleted_target_is_reported_down_once(store_dir, run_tool):
    """The consistency check notices a vanished target root, and so does the orphan sweep
    after it: one ``target_down`` problem, not two worded differently."""
    pop = store_dir
    src, dst = _away(pop, "t3")
    code, d = _verify_json(run_tool, pop.path)
    assert code == 1 and d["counts"]["target_down"] == 1
    assert [p["target"] for p in d["problems"] if p["kind"] == "target_down"] == ["t3"]
    assert d["counts"]["missing_fragment"] == len(pop.blocks) + len(pop.swa)  # its fragments still listed
    code, out, _ = run_tool("verify", pop.path)
    assert code == 1 and sum(line.startswith("target_down") for line in out.splitlines()) == 1
    code, out, _ = run_tool("repair", pop.path, "--json")
    assert code == 1  # nothing to rebuild onto: six targets, six fragments per entry
    dst.rename(src)
    assert run_tool("repair", pop.path)[0] == 0
    code, d = _verify_json(run_tool, pop.path)
    assert code == 0 and d["problems"] == []
    _all_read_back(pop)


def test_gc_with_a_target_down_says_it_was_not_swept(store_dir, run_tool):
    """gc cannot look for orphans on a target that is down: it says so and exits 1, as verify
    would (with most targets gone it said "orphans 0" and exited 0)."""
    pop = store_dir
    src, dst = _away(pop, "t3")
    code, out, _ = run_tool("gc", pop.path, "--json")
    assert code == 1 and json.loads(out)["targets_not_swept"] == 1
    code, out, _ = run_tool("gc", pop.path)
    assert code == 1 and "1 targets down, not swept for orphans" in out
    dst.rename(src)
    code, out, _ = run_tool("gc", pop.path, "--json")
    assert code == 0 and json.loads(out)["targets_not_swept"] == 0


def _rot(pop: Populated, run_tool, key: bytes, n: int) -> dict:
    """Flip bytes of fragment ``n`` of ``key``'s block; its ``inspect`` row."""
    frag = json.loads(run_tool("inspect", pop.path, "--key", key.hex(), "--json")[1])["targets"][n]
    path = pop.path / "targets" / frag["target"] / frag["file"]
    at = (frag["offset"] or 0) + 100
    raw = bytearray(path.read_bytes())
    raw[at:at + 8] = bytes(b ^ 0xFF for b in raw[at:at + 8])
    path.write_bytes(bytes(raw))
    return frag


@pytest.mark.parametrize("write", ["take_path_txn", "update_txn"])
def test_repair_with_the_index_map_full_is_one_error_line_and_indexes_nothing(store_dir, run_tool, monkeypatch,
                                                                              write):
    """An index write of repair (taking a rebuilt fragment's new path, recording the rebuild)
    that found the LMDB map full raised ``lmdb.MapFullError`` out of kvtool as a traceback.
    Now the pass runs to its end without rebuilding more, kvtool prints its counts and one line
    saying the map is full and how to raise it, exit 1; the index is as it was, no path hold is
    left, and a repair once the map has room mends everything."""
    import lmdb

    from kvstore.embedded.index import Index
    from kvstore.embedded.pathholds import PREFIX

    pop = store_dir
    frags = [_rot(pop, run_tool, pop.chain[i], 2) for i in (2, 7)]
    assert all(f["offset"] is not None for f in frags)  # packed: rebuilt as a file of its own, a new place
    calls = []

    def full(self, *args, **kw):
        calls.append(args)
        raise lmdb.MapFullError("mdb_put: MDB_MAP_FULL: Environment mapsize limit reached (injected)")

    monkeypatch.setattr(Index, write, full)
    code, out, err = run_tool("repair", pop.path, "--json")
    assert code == 1 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.startswith("kvtool: error:")]
    assert len(lines) == 1 and "index map is full" in lines[0] and "lmdb_map_size" in lines[0], err
    d = json.loads(out)
    assert d["rebuilt_fragments"] == 0 and d["unfixed"] == 2
    assert any("index map is full" in x for x in d["unfixed_detail"])
    assert any("repair stopped" in x for x in d["unfixed_detail"])  # the second entry: not rebuilt
    assert len(calls) == 1  # no index write tried after the map was found full
    monkeypatch.undo()
    code, d = _verify_json(run_tool, pop.path)
    assert code == 1 and d["counts"] == {"corrupt_fragment": 2}  # nothing recorded
    with kvstore.connect(str(pop.path)) as store:
        with store.index.env.begin() as txn:
            cur = txn.cursor(db=store.index.db["info"])
            assert not (cur.set_range(PREFIX) and bytes(cur.key()).startswith(PREFIX))  # every hold given back
    code, out, _ = run_tool("repair", pop.path, "--json")
    assert code == 0 and json.loads(out)["rebuilt_fragments"] == 2
    assert _verify_json(run_tool, pop.path)[0] == 0
    _all_read_back(pop)
