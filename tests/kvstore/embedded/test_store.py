"""Embedded store: the public surface, its semantics and its misuse errors."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

import kvstore
from kvstore import InvalidRequest, Layout, NotFound, PutItem
from kvstore.embedded.datadir import DATA_FORMAT_VERSION
from kvstore.errors import IncompatibleFormat, StoreClosed

from tests.kvstore.conftest import assert_clean, value_for
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
    assert all(f.packed for f in files) and len({f.target for f in files}) == 6  # six distinct targets' segments


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


@pytest.mark.parametrize("version", ['"1"', "1.0", "true", "null"])
def test_format_version_of_another_type_is_refused(data_dir, version):
    kvstore.connect(str(data_dir), fsync=False).close()
    marker = data_dir / "kvstore.json"
    doc = json.loads(marker.read_text())
    assert doc["format_version"] == DATA_FORMAT_VERSION
    marker.write_text(json.dumps({**doc, "format_version": "V"}).replace('"V"', version))
    with pytest.raises(IncompatibleFormat, match="format_version is"):
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
        from kvstore.embedded.index import Index

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
    """Nothing lost: a data directory whose index is gone, truncated to nothing or
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
    from kvstore.embedded.durability import _SYNCFS

    if fsync == "fs" and _SYNCFS is None:
        pytest.skip("syncfs is Linux-only")
    sync_mode = "fs" if fsync == "fs" else "file"
    fsync = bool(fsync)
    from kvstore.embedded.targets import LocalTarget

    seen: list[str] = []
    real = LocalTarget.write

    def write(self, rel, data, *, fsync):
        seen.append(threading.current_thread().name.rsplit("_", 1)[0])
        return real(self, rel, data, fsync=fsync)

    monkeypatch.setattr(LocalTarget, "write", write)
    # Files and packs: the writes of a store without segments (segments append, see test_segments.py).
    with kvstore.connect(str(data_dir), fsync=fsync, parallel_writes=mode, pack_batches=False,
                         sync_mode=sync_mode, segments=False) as s:
        assert s.put(keys[0], b"one")
        assert set(seen) == single and len(seen) == 6
        seen.clear()
        assert s.put_many([PutItem(k, value_for(k, 5000)) for k in keys[1:5]]) == [True] * 4
        assert set(seen) == batch and len(seen) == 24
        assert s.get(keys[0]) == b"one"
        assert s.get_many(keys[1:5]) == [value_for(k, 5000) for k in keys[1:5]]
        assert s.check() == []
    seen.clear()
    with kvstore.connect(str(data_dir), fsync=fsync, parallel_writes=mode, sync_mode=sync_mode,
                         segments=False) as s:  # packs
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


def test_a_single_puts_large_fragments_are_written_on_threads(data_dir, keys, monkeypatch):
    """With one syncfs after the writes (nothing waits for the device per file), a single put
    still writes on threads once its fragments reach ``PARALLEL_WRITE_MIN_BYTES`` (the kernel
    then waits for the device to take dirty pages); smaller ones, and batches, stay inline."""
    from kvstore.embedded.durability import _SYNCFS
    from kvstore.embedded.fragment_writes import PARALLEL_WRITE_MIN_BYTES
    from kvstore.embedded.targets import LocalTarget

    if _SYNCFS is None:
        pytest.skip("syncfs is Linux-only")
    seen: list[str] = []
    real = LocalTarget.write

    def write(self, rel, data, *, fsync):
        seen.append(threading.current_thread().name)
        return real(self, rel, data, fsync=fsync)

    monkeypatch.setattr(LocalTarget, "write", write)
    big = os.urandom(4 * PARALLEL_WRITE_MIN_BYTES)  # 4+2: fragments just over the bound
    small = big[: 4 * PARALLEL_WRITE_MIN_BYTES - 4096]  # just under it
    with kvstore.connect(str(data_dir), fsync=True, sync_mode="fs", compression="none", segments=False) as s:
        assert s.put(keys[0], big)
        assert len(seen) == 6 and "MainThread" not in seen
        seen.clear()
        assert s.put(keys[1], small)
        assert seen == ["MainThread"] * 6
        seen.clear()
        assert s.put_many([PutItem(k, big) for k in keys[2:4]]) == [True, True]
        assert set(seen) == {"MainThread"}
        assert s.get(keys[0]) == big and s.get(keys[1]) == small and s.get(keys[3]) == big
