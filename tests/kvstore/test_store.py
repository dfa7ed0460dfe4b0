"""Embedded store: the public surface, its semantics and its misuse errors."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

import kvstore
from kvstore import InvalidRequest, Layout, NotFound, PutItem
from kvstore.errors import IncompatibleFormat, StoreClosed

from .conftest import assert_clean, value_for
from tests.fragments import fragment_refs


def test_put_get_round_trip_and_dedup(store, keys):
    v = value_for(keys[0], 50_000)
    assert store.put(keys[0], v) is True
    assert store.get(keys[0]) == v
    files_before = sorted(p for t in store.targets.values() for p in __import__("pathlib").Path(t.root).rglob("*"))
    assert store.put(keys[0], v) is False  # no second copy
    files_after = sorted(p for t in store.targets.values() for p in __import__("pathlib").Path(t.root).rglob("*"))
    assert files_before == files_after
    assert store.stats()["entries"] == 1
    assert_clean(store)


def test_fragments_go_to_k_plus_m_distinct_targets(store, keys):
    store.put(keys[1], value_for(keys[1]))
    files = fragment_refs(store, keys[1])
    assert len(files) == 6
    assert not any(f.packed for f in files) and len({f.target for f in files}) == 6  # six distinct targets


def test_numpy_layout_is_kept(store, keys):
    arr = np.arange(2 * 16 * 8, dtype=np.float16).reshape(2, 16, 8)
    store.put(keys[2], arr, tokens=16)
    e = store.get_entry(keys[2])
    assert e.layout == Layout("float16", (2, 16, 8)) and e.tokens == 16
    np.testing.assert_array_equal(e.array(), arr)


def test_block_and_swa_entries_are_separate(store, keys):
    store.put(keys[3], b"block-kv")
    with pytest.raises(NotFound):
        store.get(keys[3], kind="swa")
    store.put(keys[3], b"window", kind="swa")
    assert store.get(keys[3], kind="swa") == b"window"
    assert store.get(keys[3]) == b"block-kv"


def test_lookup_longest_prefix_and_swa_boundary(store, keys):
    for k in keys[:10]:
        store.put(k, b"kv")
    store.put(keys[12], b"kv")  # after a gap: never part of the prefix
    store.put(keys[4], b"w", kind="swa")
    r = store.lookup(keys[:20])
    assert (r.hit_blocks, r.swa_at, r.swa_at_boundary) == (10, 5, False)
    store.put(keys[9], b"w", kind="swa")
    assert store.lookup(keys[:20]).swa_at_boundary
    assert store.lookup(keys[20:30]).hit_blocks == 0
    assert store.lookup([]).hit_blocks == 0
    assert [r.hit_blocks for r in store.lookup_many([keys[:3], keys[5:7], keys[10:]])] == [3, 2, 0]


@pytest.mark.parametrize("seed", range(4))
def test_lookup_swa_at_is_the_last_live_snapshot_below_the_hit(store, hasher, seed):
    """Against a plain model, over chains longer than the index's first search windows."""
    rng = np.random.default_rng(seed)
    n = 700
    keys = hasher.hash_blocks(list(range(16 * n)))
    hit = int(rng.integers(0, n))
    for k in keys[:hit]:
        store.put(k, b"kv")
    swa = sorted(int(x) for x in rng.choice(n, size=int(rng.integers(0, 4)), replace=False))
    for i in swa:
        store.put(keys[i], b"w", kind="swa")
    below = [i + 1 for i in swa if i < hit]
    r = store.lookup(keys[:n])
    assert (r.hit_blocks, r.swa_at) == (hit, below[-1] if below else None), (hit, swa)


def test_lookup_stops_at_an_expired_block_before_gc(store, keys, clock):
    """Both index paths: nothing expired yet (no per-record check) and something expired."""
    for i, k in enumerate(keys[:10]):
        store.put(k, b"kv", ttl_s=5 if i == 6 else None)
    store.put(keys[3], b"w", kind="swa", ttl_s=50)
    assert (store.lookup(keys[:10]).hit_blocks, store.lookup(keys[:10]).swa_at) == (10, 4)
    clock.advance(6)
    assert (store.lookup(keys[:10]).hit_blocks, store.lookup(keys[:10]).swa_at) == (6, 4)
    clock.advance(50)
    assert (store.lookup(keys[:10]).hit_blocks, store.lookup(keys[:10]).swa_at) == (6, None)


@pytest.mark.parametrize("seed", range(3))
def test_probe_is_each_keys_own_lookup(store, keys, clock, seed):
    """``probe`` (what the daemon answers a sharded client's Probe with) against its model:
    ``lookup`` of each key alone, over live, expired, SWA-only and absent keys."""
    rng = np.random.default_rng(seed)
    ks = keys[:24]
    for k in ks:
        state = int(rng.integers(0, 6))
        if state in (1, 2, 3):
            store.put(k, b"kv", ttl_s=5 if state == 3 else None)
        if state in (2, 3, 4, 5):
            store.put(k, b"w", kind="swa", ttl_s=5 if state == 5 else None)
    clock.advance(6)  # the ttl'd ones expire
    block, swa = store.probe(ks + [keys[0]])
    want = [store.lookup([k]) for k in ks + [keys[0]]]
    assert list(block) == [r.hit_blocks for r in want]
    assert list(swa) == [int(r.swa_at == 1) for r in want]
    assert store.probe([]) == (b"", b"")
    # until_miss: the same answers, ending with the first key that has no live block.
    end = block.find(0) + 1 or len(block)
    assert store.probe(ks + [keys[0]], until_miss=True) == (block[:end], swa[:end])
    assert store.probe([], until_miss=True) == (b"", b"")


class CountingEnv:
    """The index's LMDB environment, counting the entry records its read cursors position on."""

    def __init__(self, env):
        self.env, self.reads = env, []

    def begin(self, **kw):
        counting = self

        class Txn:
            def __init__(self, txn):
                self.txn = txn

            def __enter__(self):
                self.txn.__enter__()
                return self

            def __exit__(self, *exc):
                return self.txn.__exit__(*exc)

            def cursor(self, **kw):
                cur = self.txn.cursor(**kw)

                class Cursor:
                    def __getattr__(self, name):
                        return getattr(cur, name)

                    def set_key(self, ek):
                        counting.reads.append(bytes(ek))
                        return cur.set_key(ek)

                return Cursor()

        return Txn(self.env.begin(**kw))


@pytest.mark.parametrize("hit", [0, 3, 40])
def test_lookup_reads_its_hit_not_its_chain(store, hasher, monkeypatch, hit):
    """Issue #2: lookup costs O(hit length). A 1,000-block chain that hits ``hit`` blocks
    (one SWA snapshot inside) positions on at most hit + 1 block records, and on the SWA records
    from the hit back to the snapshot."""
    keys = hasher.hash_blocks(list(range(16 * 1000)))
    for k in keys[:hit] + keys[hit + 1:hit + 30]:  # stored blocks past the first gap do not count
        store.put(k, b"kv")
    if hit:
        store.put(keys[hit // 2], b"w", kind="swa")
    counting = CountingEnv(store.index.env)
    monkeypatch.setattr(store.index, "env", counting)
    r = store.lookup(keys)
    assert (r.hit_blocks, r.swa_at) == (hit, hit // 2 + 1 if hit else None)
    code = bytes((kvstore.EntryKind.BLOCK.code,))
    swa = bytes((kvstore.EntryKind.SWA.code,))
    block = [ek for ek in counting.reads if ek[:1] == code]
    assert block == [code + k for k in keys[:hit + 1]]
    # SWA keys are read backwards from the hit and stop at the snapshot: none past it.
    assert [ek for ek in counting.reads if ek[:1] != code] == [swa + k for k in keys[hit // 2:hit][::-1]]
    # A sharded client's probe of its share of the chain, until its first miss: the same reads.
    counting.reads.clear()
    flags, swas = store.probe(keys, until_miss=True)
    assert flags == b"\1" * hit + b"\0" and len(swas) == hit + 1
    assert [ek for ek in counting.reads if ek[:1] == code] == [code + k for k in keys[:hit + 1]]
    assert len(counting.reads) == 2 * hit + 1  # and one SWA read per live block


@pytest.mark.parametrize("seed", range(3))
def test_probe_of_several_chains_reads_each_to_its_first_miss(store, monkeypatch, seed):
    """``probe(chain_ends=...)`` (a sharded ``lookup_many``'s shares): per chain, the answers
    ``until_miss`` gives for it alone, zero-filled to the chain's length; a chain is read up to
    its first miss and no further, whatever is stored after the gap."""
    rng = np.random.default_rng(seed)
    chains = [[os.urandom(16) for _ in range(int(rng.integers(0, 40)))] for _ in range(6)]
    for c in chains:
        hit = int(rng.integers(0, len(c) + 1))
        for i, k in enumerate(c):
            if i < hit or (i > hit and rng.random() < 0.5):
                store.put(k, b"kv")
            if rng.random() < 0.2:
                store.put(k, b"w", kind="swa")
    flat = [k for c in chains for k in c]
    ends = np.cumsum([len(c) for c in chains]).tolist()
    counting = CountingEnv(store.index.env)
    monkeypatch.setattr(store.index, "env", counting)
    block, swa = store.probe(flat, chain_ends=ends)
    code = bytes((kvstore.EntryKind.BLOCK.code,))
    reads = [ek[1:] for ek in counting.reads if ek[:1] == code]
    want_b, want_s, want_reads = b"", b"", []
    for c in chains:
        b, w = store.probe(c, until_miss=True)
        hit = b.find(0) if 0 in b else len(b)
        want_b += b.ljust(len(c), b"\0")
        want_s += w.ljust(len(c), b"\0")
        want_reads += c[:hit + 1]
    assert (block, swa) == (want_b, want_s)
    assert reads == want_reads  # each chain to its first miss, that miss included
    assert store.probe([], chain_ends=[]) == (b"", b"")
    assert store.probe(chains[0], chain_ends=[0, 0, len(chains[0])])[0] == want_b[:len(chains[0])]
    for bad in ([3, 2, len(flat)], [len(flat) - 1], [-1, len(flat)], [len(flat) + 1], ["x"]):
        with pytest.raises(InvalidRequest, match="chain_ends"):
            store.probe(flat, chain_ends=bad)
    with pytest.raises(InvalidRequest, match="not both"):
        store.probe(flat, until_miss=True, chain_ends=[len(flat)])


def test_lookup_has_no_side_effects(store, keys):
    store.put(keys[0], b"x")
    before = store.counters.copy()
    store.lookup(keys[:5])
    assert store.counters == before


def test_batched_put_and_get(store, keys):
    items = [PutItem(k, value_for(k, 3000)) for k in keys[:8]]
    assert store.put_many(items) == [True] * 8
    assert store.put_many(items[:2] + [PutItem(keys[8], b"new")]) == [False, False, True]
    got = store.get_many(keys[:10])
    assert got[:8] == [value_for(k, 3000) for k in keys[:8]]
    assert got[8] == b"new" and got[9] is None


def test_delete_and_pin(store, keys):
    store.put(keys[0], b"x")
    assert store.pin(keys[0]) and not store.pin(keys[1])
    assert store.unpin(keys[0])
    assert store.delete(keys[0]) is True
    assert store.delete(keys[0]) is False
    with pytest.raises(NotFound):
        store.get(keys[0])
    assert store.lookup(keys[:1]).hit_blocks == 0
    store.gc()
    assert_clean(store)


@pytest.mark.parametrize("call, match", [
    (lambda s, k: s.put(b"short", b"x"), "16 bytes"),
    (lambda s, k: s.put(k, "a string"), "bytes-like"),
    (lambda s, k: s.put(k, b"x", kind="weird"), "unknown entry kind"),
    (lambda s, k: s.put(k, b"x" * 10, layout=Layout("float13", (10,))), "unknown layout dtype"),
    (lambda s, k: s.put(k, b"x" * 10, layout=Layout("float16", (10,))), "describes 20 bytes"),
    (lambda s, k: s.put(k, b"x", ttl_s=-1), "ttl_s must be in"),
    (lambda s, k: s.put(k, b"x", ttl_s=float("nan")), "ttl_s must be in"),
    (lambda s, k: s.put(k, b"x", ttl_s=1e300), "ttl_s must be in"),
    (lambda s, k: s.put(k, b"x", tokens=-3), "tokens"),
    (lambda s, k: s.get(b""), "16 bytes"),
])
def test_misuse_is_a_typed_error_and_writes_nothing(store, keys, call, match):
    with pytest.raises(InvalidRequest, match=match):
        call(store, keys[0])
    assert store.stats()["entries"] == 0
    assert not [p for t in store.targets.values() for p in __import__("pathlib").Path(t.root).rglob("*.*")]


def test_payload_over_maximum(data_dir, keys):
    with kvstore.connect(str(data_dir), max_value_bytes=1000, fsync=False) as s:
        with pytest.raises(InvalidRequest, match="max_value_bytes"):
            s.put(keys[0], b"x" * 1001)
        assert s.stats()["entries"] == 0


def test_incompatible_format_version(data_dir, keys):
    kvstore.connect(str(data_dir), fsync=False).close()
    (data_dir / "kvstore.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(IncompatibleFormat, match="format version 99"):
        kvstore.connect(str(data_dir))


def test_the_directory_records_its_erasure_code(data_dir, keys):
    from kvstore.config import DEFAULT_EC_TYPE

    with kvstore.connect(str(data_dir), fsync=False) as s:
        assert s.config.ec_type == DEFAULT_EC_TYPE
        s.put(keys[0], value_for(keys[0]))
    assert json.loads((data_dir / "kvstore.json").read_text())["ec_type"] == DEFAULT_EC_TYPE
    with pytest.raises(IncompatibleFormat, match="written with ec_type 'isa_l_rs_cauchy'.*leave ec_type unset"):
        kvstore.connect(str(data_dir), ec_type="isa_l_rs_vand")
    with kvstore.connect(str(data_dir), fsync=False, ec_type=DEFAULT_EC_TYPE) as s:
        assert s.get(keys[0]) == value_for(keys[0])


@pytest.mark.parametrize("ec_type", ["isa_l_rs_vand", "isa_l_rs_cauchy"])
def test_a_directory_is_decoded_with_its_own_code(data_dir, keys, ec_type):
    """Parity written by one code is rebuilt with that code whatever the default is, also for
    a marker from before the code was recorded (then it was ISA-L Vandermonde)."""
    with kvstore.connect(str(data_dir), fsync=False, ec_type=ec_type) as s:
        s.put_many([PutItem(k, value_for(k, 20_000)) for k in keys[:6]])
        lost = [fragment_refs(s, k)[:2] for k in keys[:6]]  # two data fragments each: parity must decode
    if ec_type == "isa_l_rs_vand":  # a marker written before ec_type was recorded
        doc = json.loads((data_dir / "kvstore.json").read_text())
        del doc["ec_type"]
        (data_dir / "kvstore.json").write_text(json.dumps(doc))
    for refs in lost:
        for f in refs:
            f.remove()
    with kvstore.connect(str(data_dir), fsync=False) as s:
        assert s.config.ec_type == ec_type
        assert s.get_many(keys[:6]) == [value_for(k, 20_000) for k in keys[:6]]
        assert s.stats()["counters"]["degraded_reads"] == 6


def test_an_unknown_erasure_code_creates_nothing(data_dir):
    with pytest.raises(InvalidRequest, match="unknown ec_type 'rs_magic'"):
        kvstore.connect(str(data_dir), ec_type="rs_magic")
    assert not data_dir.exists()


def test_the_directory_records_its_k_and_m(data_dir, keys):
    """An 8+3 directory opened with no code given is read as 8+3 (all 11 targets), never
    with the 4+2 default (which would miss 5 targets and mark every entry lost); a code
    given that differs from the recorded one is refused."""
    vals = {k: value_for(k, 5000) for k in keys[:10]}
    with kvstore.connect(str(data_dir), fsync=False, ec_k=8, ec_m=3) as s:
        s.put_many([PutItem(k, v) for k, v in vals.items()])
    doc = json.loads((data_dir / "kvstore.json").read_text())
    assert (doc["ec_k"], doc["ec_m"]) == (8, 3)
    with kvstore.connect(str(data_dir), fsync=False) as s:
        assert (s.config.ec_k, s.config.ec_m, len(s.targets)) == (8, 3, 11)
        assert s.get_many(list(vals)) == list(vals.values())
        assert s.check() == [] and s.lookup(list(vals)).hit_blocks == 10
    with pytest.raises(IncompatibleFormat, match="written with ec_k 8.*leave ec_k unset"):
        kvstore.connect(str(data_dir), ec_k=4, ec_m=2)
    with pytest.raises(IncompatibleFormat, match="written with ec_m 3"):
        kvstore.connect(str(data_dir), ec_m=2)


def test_a_marker_from_before_k_and_m_were_recorded_takes_them_from_the_records(data_dir, tmp_path, keys):
    """A marker without ec_k/ec_m (written before they were recorded): the directory's
    records say what they were written with, and the marker is filled in from them; an
    empty old directory takes the configured code (or the default)."""
    def strip(d):  # as a directory written before: no ec_k/ec_m in the marker, no code in the index
        doc = json.loads((d / "kvstore.json").read_text())
        del doc["ec_k"], doc["ec_m"]
        (d / "kvstore.json").write_text(json.dumps(doc))
        from kvstore.index import Index

        idx = Index(str(d / "index"), map_size=2**24, sync=False)
        with idx.env.begin(write=True) as txn:
            assert txn.delete(b"code", db=idx.db["info"])
        idx.close()

    with kvstore.connect(str(data_dir), fsync=False, ec_k=3, ec_m=1) as s:
        s.put(keys[0], b"v")
    strip(data_dir)
    with kvstore.connect(str(data_dir), fsync=False) as s:  # no code given: the records' 3+1
        assert (s.config.ec_k, s.config.ec_m) == (3, 1) and s.get(keys[0]) == b"v"
    assert (json.loads((data_dir / "kvstore.json").read_text())["ec_k"]) == 3  # filled in at open
    empty = tmp_path / "empty"
    kvstore.connect(str(empty), fsync=False, ec_k=2, ec_m=1).close()
    strip(empty)
    with kvstore.connect(str(empty), fsync=False, ec_k=5, ec_m=1) as s:
        assert (s.config.ec_k, s.config.ec_m) == (5, 1)


def test_a_lost_marker_is_rewritten_from_the_index(data_dir, keys):
    """kvstore.json gone (deleted, or a crash between creating the index and writing it):
    the next open takes the code from the records and the identity from the index."""
    with kvstore.connect(str(data_dir), fsync=False, ec_k=8, ec_m=3) as s:
        s.put_many([PutItem(k, value_for(k, 5000)) for k in keys[:4]])
    doc = json.loads((data_dir / "kvstore.json").read_text())
    (data_dir / "kvstore.json").unlink()
    with kvstore.connect(str(data_dir), fsync=False) as s:
        assert (s.config.ec_k, s.config.ec_m) == (8, 3)
        assert s.get_many(keys[:4]) == [value_for(k, 5000) for k in keys[:4]]
    again = json.loads((data_dir / "kvstore.json").read_text())
    assert {k: again[k] for k in ("ec_type", "ec_k", "ec_m", "index_id")} == {
        k: doc[k] for k in ("ec_type", "ec_k", "ec_m", "index_id")}


def test_the_index_holds_the_code_so_a_lost_marker_or_a_creation_race_cannot_change_it(data_dir, keys):
    """The code is settled in the index with its identity: a directory created with a
    non-default ec_type and code keeps them when its marker is lost, and a creator that lost
    the race to another (its marker not written yet) adopts the winner's code when it gave
    none, and is refused when it asked for another."""
    with kvstore.connect(str(data_dir), fsync=False, ec_type="isa_l_rs_vand", ec_k=3, ec_m=2,
                         pack_batches=False) as s:
        s.put_many([PutItem(k, value_for(k, 50_000)) for k in keys[:3]])
        lose = [fragment_refs(s, k)[:2] for k in keys[:3]]
    (data_dir / "kvstore.json").unlink()  # the winner crashed before writing it, or it was deleted
    with pytest.raises(IncompatibleFormat, match="written with ec_k 3"):
        kvstore.connect(str(data_dir), fsync=False, ec_k=4, ec_m=2)
    for refs in lose:
        for f in refs:
            f.remove()
    with kvstore.connect(str(data_dir), fsync=False) as s:
        assert (s.config.ec_type, s.config.ec_k, s.config.ec_m) == ("isa_l_rs_vand", 3, 2)
        assert s.get_many(keys[:3]) == [value_for(k, 50_000) for k in keys[:3]]  # parity decoded right
    doc = json.loads((data_dir / "kvstore.json").read_text())
    assert (doc["ec_type"], doc["ec_k"], doc["ec_m"]) == ("isa_l_rs_vand", 3, 2)


def test_an_older_marker_over_a_missing_index_is_refused_when_targets_hold_files(data_dir, keys):
    """A marker from before index_id was recorded: a missing index is still refused while any
    target holds a file (GC would sweep them all as orphans)."""
    import shutil

    with kvstore.connect(str(data_dir), fsync=False) as s:
        s.put_many([PutItem(k, value_for(k, 3000)) for k in keys[:4]])
    doc = json.loads((data_dir / "kvstore.json").read_text())
    (data_dir / "kvstore.json").write_text(json.dumps({k: doc[k] for k in ("format_version", "created", "ec_type")}))
    shutil.rmtree(data_dir / "index")
    with pytest.raises(kvstore.CorruptData, match="missing or empty"):
        kvstore.connect(str(data_dir), fsync=False, orphan_grace_s=0)
    assert not (data_dir / "index").exists()


@pytest.mark.parametrize("damage", ["removed", "emptied", "another"])
def test_a_lost_or_replaced_index_is_refused_and_no_fragment_is_touched(data_dir, tmp_path, keys, damage):
    """Issue #2 (nothing lost): a data directory whose index is gone, truncated to nothing or
    swapped for another directory's is refused at open, with nothing created or deleted; it
    is never taken for an empty store whose fragments GC would sweep as orphans."""
    import shutil

    with kvstore.connect(str(data_dir), fsync=False, orphan_grace_s=0) as s:
        s.put_many([PutItem(k, value_for(k, 3000)) for k in keys[:8]])
    before = sorted(p for p in (data_dir / "targets").rglob("*") if p.is_file())
    index = data_dir / "index"
    if damage == "removed":
        shutil.rmtree(index)
    elif damage == "emptied":
        (index / "data.mdb").write_bytes(b"")
    else:
        other = tmp_path / "other"
        kvstore.connect(str(other), fsync=False).close()
        shutil.rmtree(index)
        shutil.copytree(other / "index", index)
    with pytest.raises(kvstore.CorruptData, match="index.*(missing or empty|not the one).*orphan"):
        kvstore.connect(str(data_dir), fsync=False, orphan_grace_s=0)
    assert sorted(p for p in (data_dir / "targets").rglob("*") if p.is_file()) == before
    assert index.exists() == (damage != "removed")  # refused before anything was created


def test_a_damaged_index_file_is_a_typed_error(data_dir, keys):
    with kvstore.connect(str(data_dir), fsync=False) as s:
        s.put(keys[0], b"v")
    with open(data_dir / "index" / "data.mdb", "r+b") as fh:
        fh.truncate(4096)
    with pytest.raises(kvstore.CorruptData, match="index.*cannot be opened"):
        kvstore.connect(str(data_dir), fsync=False)


def test_an_index_it_may_not_write_is_not_called_damaged(data_dir, keys, monkeypatch):
    """LMDB refusing for permissions (a read-only mount, another user's files) is said as
    such; before, the message called the index damaged and advised starting a fresh store."""
    import lmdb

    with kvstore.connect(str(data_dir), fsync=False) as s:
        s.put(keys[0], b"v")

    def refuse(path, **kw):
        raise lmdb.ReadonlyError(f"{path}: Read-only file system")

    monkeypatch.setattr(lmdb, "open", refuse)
    with pytest.raises(kvstore.InvalidRequest, match="write access") as ei:
        kvstore.connect(str(data_dir), fsync=False)
    assert "fresh" not in str(ei.value)


def test_refuses_a_foreign_directory(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(InvalidRequest, match="refusing"):
        kvstore.connect(str(tmp_path))


def test_reopen_keeps_everything(data_dir, keys):
    with kvstore.connect(f"file://{data_dir}", fsync=False) as s:
        s.put_many([PutItem(k, value_for(k)) for k in keys[:5]])
    with kvstore.connect(str(data_dir), fsync=False) as s:
        assert s.get_many(keys[:5]) == [value_for(k) for k in keys[:5]]
        assert s.lookup(keys).hit_blocks == 5


def test_closed_store_says_so(data_dir, keys):
    s = kvstore.connect(str(data_dir), fsync=False)
    s.close()
    with pytest.raises(StoreClosed):
        s.get(keys[0])


def test_config_precedence(tmp_path, monkeypatch):
    toml = tmp_path / "c.toml"
    toml.write_text("[store]\nec_k = 3\nec_m = 1\nzstd_level = 5\n")
    monkeypatch.setenv("KVSTORE_EC_M", "2")
    cfg = kvstore.load_config(toml, zstd_level=7)
    assert (cfg.ec_k, cfg.ec_m, cfg.zstd_level) == (3, 2, 7)
    with pytest.raises(InvalidRequest, match="unknown config field"):
        (tmp_path / "bad.toml").write_text("eck = 3\n")
        kvstore.load_config(tmp_path / "bad.toml")
    with pytest.raises(InvalidRequest, match="out of range"):
        kvstore.StoreConfig(ec_k=0)


def test_unknown_scheme():
    with pytest.raises(InvalidRequest, match="no store for URL scheme"):
        kvstore.connect("ftp://x")


@pytest.mark.parametrize("mode, fsync, single, batch, pack", [
    ("never", True, {"MainThread"}, {"MainThread"}, {"MainThread"}),
    ("always", False, {"kvstore-io"}, {"kvstore-io"}, {"kvstore-io"}),
    ("auto", False, {"MainThread"}, {"MainThread"}, {"MainThread"}),  # page-cache writes: inline
    # fsync per file waits: per fragment, or per entry of an unpacked batch, or per pack file
    ("auto", True, {"kvstore-io"}, {"kvstore-batch"}, {"kvstore-io"}),
    # one syncfs after the writes (sync_mode "fs"): the writes themselves do not wait
    ("auto", "fs", {"MainThread"}, {"MainThread"}, {"MainThread"}),
])
def test_writes_run_on_threads_only_where_they_wait(data_dir, keys, monkeypatch, mode, fsync, single, batch, pack):
    from kvstore.targets import _SYNCFS

    if fsync == "fs" and _SYNCFS is None:
        pytest.skip("syncfs is Linux-only")
    sync_mode = "fs" if fsync == "fs" else "file"
    fsync = bool(fsync)
    from kvstore.targets import LocalTarget

    seen: list[str] = []
    real = LocalTarget.write

    def write(self, rel, data, *, fsync):
        seen.append(threading.current_thread().name.rsplit("_", 1)[0])
        return real(self, rel, data, fsync=fsync)

    monkeypatch.setattr(LocalTarget, "write", write)
    with kvstore.connect(str(data_dir), fsync=fsync, parallel_writes=mode, pack_batches=False,
                         sync_mode=sync_mode) as s:
        assert s.put(keys[0], b"one")
        assert set(seen) == single and len(seen) == 6
        seen.clear()
        assert s.put_many([PutItem(k, value_for(k, 5000)) for k in keys[1:5]]) == [True] * 4
        assert set(seen) == batch and len(seen) == 24
        assert s.get(keys[0]) == b"one"
        assert s.get_many(keys[1:5]) == [value_for(k, 5000) for k in keys[1:5]]
        assert s.check() == []
    seen.clear()
    with kvstore.connect(str(data_dir), fsync=fsync, parallel_writes=mode, sync_mode=sync_mode) as s:  # packs
        assert s.put_many([PutItem(k, value_for(k, 5000)) for k in keys[5:9]]) == [True] * 4
        assert set(seen) == pack and len(seen) == 6  # one pack file per target
        assert s.get_many(keys[1:9]) == [value_for(k, 5000) for k in keys[1:9]]
        assert s.check() == []


def test_parallel_writes_is_checked(data_dir):
    with pytest.raises(InvalidRequest, match="parallel_writes must be auto, always or never"):
        kvstore.connect(str(data_dir), parallel_writes="sometimes")


def test_a_target_id_assigned_elsewhere_is_read_from_the_index(store, keys):
    """Target ids are cached per process; an id another process assigned after this one
    loaded the table (here: forgotten) is read from the index, not a KeyError."""
    v = value_for(keys[0], 20_000)
    store.put(keys[0], v)
    known = dict(store.index._tname)
    store.index._tname.clear()
    assert store.get(keys[0]) == v
    assert store.index._tname == known


def test_an_entry_larger_than_the_capacity_is_refused_not_stored_and_evicted(data_dir, keys):
    """With capacity_bytes below one entry's stored size, the put raises CapacityExceeded
    (nothing written) instead of returning True for an entry the next eviction removes."""
    with kvstore.connect(str(data_dir), fsync=False, capacity_bytes=50_000, compression="none",
                         orphan_grace_s=0) as s:
        assert s.put(keys[0], b"x" * 10_000)  # fits: ~15 kB stored with 4+2
        with pytest.raises(kvstore.CapacityExceeded, match="cannot fit under the low watermark"):
            s.put(keys[1], b"x" * 60_000)
        with pytest.raises(kvstore.CapacityExceeded):
            s.put_many([PutItem(keys[2], b"y" * 100), PutItem(keys[3], b"z" * 60_000)])
        assert [s.lookup([k]).hit_blocks for k in keys[:4]] == [1, 0, 0, 0]
        assert s.check() == []  # the refused batch left no fragment behind


@pytest.mark.parametrize("bad", [
    dict(value="not bytes"), dict(value=b"x" * 1001), dict(ttl_s=float("nan")), dict(ttl_s="10"), dict(tokens=-1),
    dict(layout=kvstore.Layout("float32", (7,))),
])
def test_a_bad_put_of_a_live_key_is_refused_too(data_dir, keys, bad):
    """Step 1 of the write path (validate) comes before step 2 (a live key stores nothing):
    the same request is refused whether or not the key is stored already."""
    with kvstore.connect(str(data_dir), fsync=False, max_value_bytes=1000) as s:
        assert s.put(keys[0], b"x" * 10)
        args = {"value": b"x" * 10, **bad}
        with pytest.raises(InvalidRequest):
            s.put(keys[0], args.pop("value"), **args)
        with pytest.raises(InvalidRequest):  # and a duplicate inside one batch
            s.put_many([PutItem(keys[1], b"ok"), PutItem(keys[1], **{"value": b"x" * 10, **bad})])
        assert s.lookup([keys[1]]).hit_blocks == 0


def test_misused_arguments_are_typed_errors(store, keys):
    with pytest.raises(InvalidRequest, match="sequence of 16-byte keys"):
        store.lookup(None)
    with pytest.raises(InvalidRequest, match="wrap a single key"):
        store.lookup(keys[0])
    with pytest.raises(InvalidRequest, match="PutItem"):
        store.put_many([(keys[0], b"v")])
    assert kvstore.Layout("uint8", [4]).shape == (4,)
    with pytest.raises(InvalidRequest, match="tuple of ints"):
        kvstore.Layout("uint8", (1.5,))


def test_an_expired_entry_is_absent_to_pin_and_get_many_into(store, keys, clock):
    """Before GC removes it, an expired entry is absent everywhere: ``pin``/``unpin`` say
    False, and ``get_many_into`` answers ``None`` for it whatever its buffer's size (it
    raised InvalidRequest over a buffer sized for the entry that no longer exists)."""
    store.put(keys[0], b"x" * 100, ttl_s=1)
    store.put(keys[1], b"y" * 10)
    clock.advance(2)
    assert store.pin(keys[0]) is False and store.unpin(keys[0]) is False
    assert store.get_many([keys[0], keys[1]]) == [None, b"y" * 10]
    outs = [bytearray(10), bytearray(10)]
    got = store.get_many_into([keys[0], keys[1]], outs)
    assert got[0] is None and got[1] is not None and bytes(outs[1]) == b"y" * 10
    assert store.pin(keys[1]) is True
