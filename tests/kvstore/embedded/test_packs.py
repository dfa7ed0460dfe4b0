"""Pack files: a batched put publishes one file per target holding that target's fragments
of every entry (``kvstore.embedded.targets``, ``kvstore.embedded.index`` invariant 6). What must hold: the
entries read back from their packs; a pack outlives every record stored in it and no
longer; a pack no record names is swept as an orphan; a pack that cannot be written
leaves nothing behind and the batch is written fragment by fragment instead; repair
rebuilds a packed fragment as its own file. These are the packs of a store without segments
(object-store targets, a write timeout, ``segments=false``), which direct writers and compaction
also write; a store's segments, which are packs that grow, are in ``test_segments.py``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import kvstore
from kvstore import PutItem
from kvstore.embedded.index import STANDALONE, ekey, packed_bytes
from kvstore.maintenance.problems import ProblemKind
from kvstore.embedded.targets import LocalTarget, pack_path, parse_pack_path

from tests.kvstore.conftest import assert_clean, value_for
from tests.fragments import fragment_refs


def _packs(store) -> list[Path]:
    return sorted(p for t in store.targets.values() for p in Path(t.root).rglob("*.pack"))


def _pack_refs(store) -> dict[bytes, int]:
    with store.index.env.begin() as txn:
        return {bytes(g): int.from_bytes(v[:8], "big") for g, v in store.index.iter_db(txn, "packs")}


@pytest.fixture
def packed(data_dir, clock):
    with kvstore.connect(str(data_dir), segments=False, fsync=False, clock=clock, orphan_grace_s=60, delete_grace_s=30) as s:
        yield s


def test_a_batch_is_one_pack_file_per_target_and_reads_back(packed, keys):
    vals = [value_for(k, 3000 + 500 * i) for i, k in enumerate(keys[:12])]  # unequal sizes
    assert packed.put_many([PutItem(k, v) for k, v in zip(keys[:12], vals)]) == [True] * 12
    packs = _packs(packed)
    assert len(packs) == 6 and len({p.name for p in packs}) == 1
    gen = parse_pack_path(str(packs[0].relative_to(packs[0].parents[2])))
    assert _pack_refs(packed) == {gen: 12}
    # Every fragment sits inside the pack, none overlapping another on its target.
    spans: dict[str, list[tuple[int, int]]] = {}
    for k in keys[:12]:
        for f in fragment_refs(packed, k):
            assert f.packed and f.path.name == packs[0].name
            spans.setdefault(f.target, []).append((f.offset, f.offset + f.length))
    for t, ss in spans.items():
        ss.sort()
        assert all(a[1] <= b[0] for a, b in zip(ss, ss[1:])), t
        assert ss[-1][1] == os.path.getsize(Path(packed.targets[t].root) / pack_path(gen))
    assert packed.get_many(keys[:12]) == vals
    assert [packed.get(k) for k in keys[:12]] == vals
    outs = [bytearray(len(v)) for v in vals]
    assert all(packed.get_many_into(keys[:12], outs)) and [bytes(o) for o in outs] == vals
    assert_clean(packed)


def test_a_pack_outlives_every_entry_in_it_and_no_longer(data_dir, keys, clock):
    packed = kvstore.connect(str(data_dir), segments=False, fsync=False, clock=clock, delete_grace_s=30,
                             pack_compact_ratio=1.0)  # no compaction: a pack lives as long as its entries
    packed.put_many([PutItem(k, value_for(k)) for k in keys[:4]])
    (gen,) = _pack_refs(packed)
    for k in keys[:3]:
        packed.delete(k)
    clock.advance(31)
    assert packed.gc(dry_run=True)["reclaimed_bytes"] == 0  # the pack stays: nothing to free yet
    assert packed.gc()["purged"] == 3
    assert len(_packs(packed)) == 6 and _pack_refs(packed) == {gen: 1}  # keys[3] still lives there
    assert packed.get(keys[3]) == value_for(keys[3])
    assert_clean(packed)
    packed.delete(keys[3])
    assert packed.gc()["purged"] == 0  # within the delete grace: a reader may still hold the record
    assert len(_packs(packed)) == 6
    clock.advance(31)
    would = packed.gc(dry_run=True)  # counts the pack the real pass frees, and frees nothing
    assert would["purged"] == 1 and would["reclaimed_bytes"] > 0 and len(_packs(packed)) == 6
    done = packed.gc()
    assert done["purged"] == 1 and done["reclaimed_bytes"] == would["reclaimed_bytes"]
    assert _packs(packed) == [] and _pack_refs(packed) == {}
    assert packed.stats()["pack_dead_bytes"] == 0
    assert_clean(packed)
    packed.close()


def test_dead_bytes_are_counted_and_a_mostly_dead_pack_is_compacted(packed, keys, clock):
    vals = {k: value_for(k, 20_000) for k in keys[:8]}
    packed.put_many([PutItem(k, v) for k, v in vals.items()])
    packed.pin(keys[6])
    (old,) = _pack_refs(packed)
    with packed.index.env.begin() as txn:
        dead = sum(packed.index.get_meta(txn, ekey(1, k)).stored_bytes for k in keys[:3])
        before = {k: packed.index.get_meta(txn, ekey(1, k)) for k in keys[5:8]}
    for k in keys[:3]:
        packed.delete(k)
    clock.advance(31)
    out = packed.gc()  # 3 of 8 dead: under the ratio, nothing moves
    assert out["purged"] == 3 and out["compacted_packs"] == 0
    assert packed.stats()["pack_dead_bytes"] == dead
    packed.delete(keys[3])
    clock.advance(31)
    out = packed.gc()  # 4 of 8 dead: the 4 live entries move to a new pack
    assert out["compacted_packs"] == 1 and out["moved_entries"] == 4
    refs = _pack_refs(packed)
    assert refs[old] == 4 and len(refs) == 2  # the old records wait out the grace in the graveyard
    assert packed.get_many(list(vals)[4:]) == list(vals.values())[4:]
    with packed.index.env.begin() as txn:
        for k, m in before.items():  # times, TTL and pin kept
            now = packed.index.get_meta(txn, ekey(1, k))
            assert now.gen != old and (now.access_ns, now.created_ns, now.expires_ns, now.pinned) == (
                m.access_ns, m.created_ns, m.expires_ns, m.pinned)
    assert_clean(packed)
    clock.advance(31)
    packed.gc()
    assert old not in _pack_refs(packed) and len(_packs(packed)) == 6
    assert packed.stats()["pack_dead_bytes"] == 0 and packed.stats()["entries"] == 4
    assert packed.get_many(list(vals)[4:]) == list(vals.values())[4:]
    assert_clean(packed)


def test_capacity_eviction_frees_packs(data_dir, keys, clock):
    with kvstore.connect(str(data_dir), segments=False, fsync=False, clock=clock, delete_grace_s=0, compression="none",
                         capacity_bytes=400_000) as s:
        for b in range(6):  # six batches of 4 x 20 kB (about 30 kB stored each): over capacity
            clock.advance(1)
            s.put_many([PutItem(k, os.urandom(20_000)) for k in keys[b * 4 : b * 4 + 4]])
        s.gc()
        s.gc()  # also purges what the first one compacted away
        assert s.used_bytes() <= 400_000
        st = s.stats()
        assert sum(_pack_refs(s).values()) == st["entries"] + st["graveyard_entries"] and st["entries"] < 24
        assert len(_packs(s)) == 6 * len(_pack_refs(s))  # a pack with no record is gone
        # What stays on disk: the live entries, plus dead pack bytes under the compaction ratio.
        with s.index.env.begin() as txn:
            for gen in _pack_refs(s):
                refs, nbytes, dead = s.index.pack_info(txn, gen)
                assert dead < 0.5 * nbytes or txn.get(gen, db=s.index.db["compact"]) is not None
        assert_clean(s)


def test_an_unindexed_pack_is_an_orphan_after_its_grace(packed, keys, clock):
    packed.put_many([PutItem(k, value_for(k)) for k in keys[:3]])
    stray = os.urandom(8)
    packed.targets["t2"].write(pack_path(stray), [b"half a ", b"batch"], fsync=False)  # a crashed batch
    path = Path(packed.targets["t2"].root) / pack_path(stray)
    clock.t = os.path.getmtime(path) + 10
    assert packed.gc()["orphans"] == 0  # may be a batch in flight
    clock.t = os.path.getmtime(path) + 61
    problems = packed.check()
    assert [(p.kind, p.target, p.detail) for p in problems] == [(ProblemKind.ORPHAN_FRAGMENT, "t2", pack_path(stray))]
    out = packed.gc()
    assert out["orphans"] == 1 and out["reclaimed_bytes"] == 12
    assert not path.exists() and len(_packs(packed)) == 6
    assert packed.get_many(keys[:3]) == [value_for(k) for k in keys[:3]]
    assert_clean(packed)


def test_a_failing_pack_write_falls_back_to_fragment_files(packed, keys, monkeypatch):
    real = LocalTarget.write

    def write(self, rel, data, *, fsync):
        if self.name == "t4" and rel.startswith("p/"):
            raise OSError(5, "injected I/O error")
        return real(self, rel, data, fsync=fsync)

    monkeypatch.setattr(LocalTarget, "write", write)
    assert packed.put_many([PutItem(k, value_for(k)) for k in keys[:5]]) == [True] * 5
    assert _packs(packed) == [] and _pack_refs(packed) == {}  # the other targets' packs removed
    assert not any(f.packed for k in keys[:5] for f in fragment_refs(packed, k))
    assert packed.get_many(keys[:5]) == [value_for(k) for k in keys[:5]]
    assert_clean(packed)


def test_a_batch_that_loses_every_race_leaves_no_pack(packed, keys, monkeypatch):
    real = packed.fragments.writer.write_pack

    def racing(encs, gen):
        out = real(encs, gen)
        for e in encs:  # another writer commits the same keys first
            packed.put(e.key, b"theirs")
        return out

    monkeypatch.setattr(packed.fragments.writer, "write_pack", racing)
    assert packed.put_many([PutItem(k, value_for(k)) for k in keys[:3]]) == [False] * 3
    assert _packs(packed) == [] and _pack_refs(packed) == {}
    assert packed.get_many(keys[:3]) == [b"theirs"] * 3
    assert_clean(packed)


def test_a_race_losers_share_of_a_pack_is_dead_from_the_start(packed, keys, monkeypatch, clock):
    real = packed.fragments.writer.write_pack

    def racing(encs, gen):
        out = real(encs, gen)
        for e in encs[:3]:  # another writer commits three of the keys first
            packed.put(e.key, b"theirs")
        return out

    monkeypatch.setattr(packed.fragments.writer, "write_pack", racing)
    vals = {k: os.urandom(20_000) for k in keys[:5]}  # one size: every share of the pack is as long
    assert packed.put_many([PutItem(k, v) for k, v in vals.items()]) == [False] * 3 + [True] * 2
    monkeypatch.undo()
    (gen,) = _pack_refs(packed)
    with packed.index.env.begin() as txn:
        refs, nbytes, dead = packed.index.pack_info(txn, gen)
        flen = packed.index.get_meta(txn, ekey(1, keys[3])).frag_len
    assert refs == 2 and dead == 3 * 6 * flen and nbytes == 5 * 6 * flen  # the 3 losers' shares
    assert packed.stats()["pack_dead_bytes"] == dead
    packed.delete(keys[3])  # 4 of 5 shares dead: over the ratio, GC moves the last entry out
    clock.advance(31)
    out = packed.gc()
    assert out["compacted_packs"] == 1 and out["moved_entries"] == 1
    assert packed.get(keys[4]) == vals[keys[4]] and packed.get_many(keys[:3]) == [b"theirs"] * 3
    clock.advance(31)
    packed.gc()
    assert gen not in _pack_refs(packed) and packed.stats()["pack_dead_bytes"] == 0
    assert_clean(packed)


def test_repair_rebuilds_a_packed_fragment_as_its_own_file(packed, keys, clock):
    packed.put_many([PutItem(k, value_for(k)) for k in keys[:4]])
    bad = fragment_refs(packed, keys[2])[3]
    bad.write_bytes(b"\xff" * 64)
    assert packed.repair()["rebuilt_fragments"] == 1
    refs = fragment_refs(packed, keys[2])
    assert not refs[3].packed and refs[3].path.exists() and all(f.packed for f in refs[:3] + refs[4:])
    with packed.index.env.begin() as txn:
        assert packed.index.get_meta(txn, ekey(1, keys[2])).offsets[3] == STANDALONE
    assert packed.stats()["pack_dead_bytes"] == bad.length  # the damaged copy stays in the pack
    assert packed.get(keys[2]) == value_for(keys[2])
    assert_clean(packed)
    # Deleted, the entry takes its own file with it, and the pack goes with the last entry.
    for k in keys[:4]:
        packed.delete(k)
    clock.advance(31)
    assert packed.gc()["purged"] == 4
    assert not refs[3].path.exists() and _packs(packed) == []
    assert_clean(packed)


def test_a_restored_lost_entry_counts_its_repaired_pack_share_as_dead(packed, keys):
    """A packed entry is marked lost (3 of its 6 fragments bad), two come back, and repair
    restores it, rebuilding the third as its own file: that fragment's copy in the pack is
    dead bytes, as for a live entry's repair (invariant 6)."""
    packed.put_many([PutItem(k, value_for(k)) for k in keys[:4]])
    refs = fragment_refs(packed, keys[2])
    saved = [f.read_bytes() for f in refs[:3]]
    for f in refs[:3]:
        f.write_bytes(b"\xff" * 64)
    with pytest.raises(kvstore.Unrecoverable):
        packed.get(keys[2])
    assert packed.stats()["lost_entries"] == 1
    for f, data in zip(refs[:2], saved[:2]):  # two targets come back; fragment 2 stays bad
        f.write_bytes(data)
    out = packed.repair()
    assert (out["restored_entries"], out["rebuilt_fragments"]) == (1, 1)
    assert not fragment_refs(packed, keys[2])[2].packed
    assert packed.stats()["pack_dead_bytes"] == refs[2].length
    assert packed.get(keys[2]) == value_for(keys[2])
    assert_clean(packed)


def test_single_puts_and_unpacked_batches_write_fragment_files(data_dir, keys):
    with kvstore.connect(str(data_dir), segments=False, fsync=False, pack_batches=False) as s:
        s.put_many([PutItem(k, value_for(k)) for k in keys[:3]])
        s.put(keys[3], value_for(keys[3]))
        assert _packs(s) == []
        assert not any(f.packed for k in keys[:4] for f in fragment_refs(s, k))
    with kvstore.connect(str(data_dir), segments=False, fsync=False) as s:  # the same directory, packing on
        s.put(keys[4], value_for(keys[4]))
        assert not any(f.packed for f in fragment_refs(s, keys[4]))
        s.put_many([PutItem(k, value_for(k)) for k in keys[5:7]])
        assert all(f.packed for f in fragment_refs(s, keys[5]))
        assert s.get_many(keys[:7]) == [value_for(k) for k in keys[:7]]
        assert_clean(s)


def test_a_large_batch_is_cut_into_packs_of_about_pack_bytes(data_dir, keys):
    with kvstore.connect(str(data_dir), segments=False, fsync=False, pack_bytes=10_000) as s:
        assert s.put_many([PutItem(k, value_for(k, 5000)) for k in keys[:9]]) == [True] * 9
        assert sorted(_pack_refs(s).values()) == [1, 2, 2, 2, 2]  # 2 x 5000 reach pack_bytes
        assert len(_packs(s)) == 5 * 6
        assert s.get_many(keys[:9]) == [value_for(k, 5000) for k in keys[:9]]
        assert_clean(s)


def test_a_bad_item_late_in_a_batch_leaves_nothing_behind(data_dir, keys):
    with kvstore.connect(str(data_dir), segments=False, fsync=False, pack_bytes=10_000, max_value_bytes=8000) as s:
        items = [PutItem(k, value_for(k, 5000)) for k in keys[:8]] + [PutItem(keys[8], b"x" * 9000)]
        with pytest.raises(kvstore.InvalidRequest, match="max_value_bytes"):
            s.put_many(items)  # four packs were already on their way when the last item failed
        assert _packs(s) == [] and s.stats()["entries"] == 0
        assert_clean(s)


def _compactable(s, keys, vals) -> None:
    """A pack of 8 entries, 5 of them deleted and purged: queued for compaction."""
    s.put_many([PutItem(k, v) for k, v in vals.items()])
    for k in keys[:5]:
        s.delete(k)


def test_a_compaction_that_waited_past_half_the_grace_is_postponed_not_lost(data_dir, keys, monkeypatch):
    """Compaction wrote the new pack, then indexed it with no check of its age, so a wait for
    the index's writer lock past the orphan grace, while another process swept, moved live
    entries into a pack already removed: every one Unrecoverable. Now the age is checked
    inside the transaction: the compaction is postponed and the entries stay where they were."""
    import time

    from kvstore.maintenance.orphans import sweep_orphans

    from tests.kvstore.conftest import FakeClock

    clock = FakeClock(time.time())
    vals = {k: value_for(k, 20_000) for k in keys[:8]}
    with kvstore.connect(str(data_dir), segments=False, fsync=False, clock=clock, orphan_grace_s=60, delete_grace_s=0) as s:
        _compactable(s, keys, vals)
        swept = []

        def slow_write_pack(encs, gen, _orig=s.fragments.writer.write_pack):
            got = _orig(encs, gen)
            clock.advance(100)  # the wait for the writer lock, while another process sweeps
            swept.append(sweep_orphans(s.parts, s.file_clock(), False, 60, lambda *a: None)[0])
            return got

        monkeypatch.setattr(s.fragments.writer, "write_pack", slow_write_pack)
        out = s.gc()  # postponed: the pack stays queued
        assert out["compacted_packs"] == 0 and out["moved_entries"] == 0 and swept == [6]  # postponed: not done
        assert s.get_many(keys[5:8]) == [vals[k] for k in keys[5:8]]  # still in their old pack
        monkeypatch.undo()
        out = s.gc()  # in time: moved
        assert out["moved_entries"] == 3
        assert s.get_many(keys[5:8]) == [vals[k] for k in keys[5:8]]
        assert_clean(s)


def test_entries_removed_while_compaction_copies_them_are_dead_in_the_new_pack(data_dir, keys, clock, monkeypatch):
    """An entry deleted (evicted, re-put) between compaction's read and its commit is left out
    of the new pack's records, but its bytes are in the file: they are counted dead there
    (index invariant 6), so the new pack is compacted in turn. Before, they were counted
    nowhere and the pack could never reach the ratio."""
    vals = {k: value_for(k, 20_000) for k in keys[:8]}
    with kvstore.connect(str(data_dir), segments=False, fsync=False, clock=clock, delete_grace_s=0) as s:
        _compactable(s, keys, vals)

        def racing_write_pack(encs, gen, _orig=s.fragments.writer.write_pack):
            got = _orig(encs, gen)
            s.delete(keys[5])  # as another process would, between the copy and the commit
            s.delete(keys[6])
            return got

        monkeypatch.setattr(s.fragments.writer, "write_pack", racing_write_pack)
        out = s.gc()
        assert out["moved_entries"] == 1
        monkeypatch.undo()
        with s.index.env.begin() as txn:
            live = s.index.get_meta(txn, ekey(1, keys[7]))  # the one entry moved, into the new pack
            refs, nbytes, dead = s.index.pack_info(txn, live.gen)
        assert refs == 1 and dead > live.stored_bytes and nbytes == dead + packed_bytes(live)  # the two left out
        out = s.gc()  # 2 of 3 dead: compacted again
        assert out["compacted_packs"] == 1 and out["moved_entries"] == 1
        assert s.get(keys[7]) == vals[keys[7]]
        assert_clean(s)
