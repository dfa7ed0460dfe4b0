"""Lost targets and damaged fragments: detected, reconstructed, never returned wrong.
Every test ends with the store's own ``check()`` clean (or listing exactly what is lost)."""

from __future__ import annotations

import itertools
import os
import shutil

import pytest

import kvstore
from kvstore import PutItem, Unrecoverable
from kvstore.maintenance.problems import ProblemKind

from tests.kvstore.conftest import assert_clean, value_for
from tests.fragments import fragment_refs

N = 40


@pytest.fixture(params=["segment", "pack", "files"])
def full(data_dir, clock, keys, request):
    """N entries from one batch: appended to the store's segment files (the default), in the
    batch's pack files (stores without segments), or one file per fragment."""
    with kvstore.connect(str(data_dir), fsync=False, clock=clock, orphan_grace_s=0, delete_grace_s=0,
                         segments=request.param == "segment", pack_batches=request.param == "pack") as s:
        s.put_many([PutItem(k, value_for(k, 6000)) for k in keys[:N]])
        assert all(f.packed == (request.param != "files") for f in fragment_refs(s, keys[0]))
        yield s


def _roots(store):
    return {name: t.root for name, t in store.targets.items()}


@pytest.mark.parametrize("down", list(itertools.combinations(range(6), 2))[::3])
def test_any_m_targets_gone_everything_reads_back(full, keys, down):
    roots = _roots(full)
    for i in down:
        os.rename(roots[f"t{i}"], roots[f"t{i}"] + ".away")
    assert full.get_many(keys[:N]) == [value_for(k, 6000) for k in keys[:N]]
    assert full.counters["degraded_reads"] > 0
    assert full.lookup(keys[:N]).hit_blocks == N


def test_m_plus_one_gone_only_the_overexposed_are_lost_then_repair(data_dir, keys, clock):
    # 9 disks for 4+2 fragments, so that losing 3 disks loses some entries, not all.
    targets = ",".join(f"file://{data_dir}/disks/d{i}#local#d{i}" for i in range(9))
    full = kvstore.connect(str(data_dir), targets=targets, fsync=False, clock=clock, orphan_grace_s=0)
    full.put_many([PutItem(k, value_for(k, 6000)) for k in keys[:N]])
    roots = _roots(full)
    gone = ["d0", "d1", "d2"]
    for n in gone:
        os.rename(roots[n], roots[n] + ".away")
    expected_lost = {k for k in keys[:N]
                     if sum(f.target in gone for f in fragment_refs(full, k)) > 2}
    assert expected_lost and len(expected_lost) < N
    for k in keys[:N]:
        if k in expected_lost:
            with pytest.raises(Unrecoverable) as ei:
                full.get(k)
            assert ei.value.key == k and set(ei.value.failed_targets) <= set(gone)
        else:
            assert full.get(k) == value_for(k, 6000)
    for k in expected_lost:  # a second read is told the same, not NotFound
        with pytest.raises(Unrecoverable, match="is lost") as ei:
            full.get(k)
        assert ei.value.key == k
    # Lost entries are no longer matched by lookup.
    first_lost = min(keys.index(k) for k in expected_lost)
    assert full.lookup(keys[:N]).hit_blocks == first_lost
    lost_reported = {p.key for p in full.check() if p.kind is ProblemKind.LOST_ENTRY}
    assert lost_reported == {k.hex() for k in expected_lost}
    for n in gone:
        os.rename(roots[n] + ".away", roots[n])
    summary = full.repair()
    assert summary["restored_entries"] == len(expected_lost) and summary["still_lost"] == 0
    assert full.get_many(keys[:N]) == [value_for(k, 6000) for k in keys[:N]]
    assert full.lookup(keys[:N]).hit_blocks == N
    assert_clean(full)
    full.close()


def test_repair_rebuilds_onto_a_healthy_target_when_one_never_returns(data_dir, keys, clock):
    targets = ",".join(f"file://{data_dir}/disks/d{i}#rack{i % 3}" for i in range(8))
    with kvstore.connect(str(data_dir), targets=targets, fsync=False, clock=clock, orphan_grace_s=0) as s:
        s.put_many([PutItem(k, value_for(k)) for k in keys[:20]])
        shutil.rmtree(data_dir / "disks" / "d3")
        res = s.repair()
        assert res["rebuilt_fragments"] > 0 and res["unfixed"] == 0
        problems = [p for p in s.check() if p.kind is not ProblemKind.TARGET_DOWN]
        assert problems == []
        assert s.get_many(keys[:20]) == [value_for(k) for k in keys[:20]]


def _flip(path, at=-10):
    b = bytearray(path.read_bytes())
    b[at] ^= 0xFF
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "header"])
def test_damaged_fragment_is_detected_and_reconstructed(full, keys, damage):
    k = keys[5]
    f = fragment_refs(full, k)[1]
    {"flip": lambda: _flip(f),
     "truncate": lambda: f.write_bytes(f.read_bytes()[:-100]),
     "empty": lambda: f.write_bytes(b""),
     "header": lambda: _flip(f, 20)}[damage]()
    assert full.get(k) == value_for(k, 6000)
    assert full.counters["degraded_reads"] == 1
    problems = full.check()
    assert [(p.kind, p.key) for p in problems] == [(ProblemKind.CORRUPT_FRAGMENT, k.hex())]
    full.check(fix=True)
    assert_clean(full)


def test_swapped_fragments_between_entries_are_caught(full, keys):
    a, b = fragment_refs(full, keys[1]), fragment_refs(full, keys[2])
    for i in (0, 3):
        da, db = a[i].read_bytes(), b[i].read_bytes()
        a[i].write_bytes(db)
        b[i].write_bytes(da)
    assert full.get(keys[1]) == value_for(keys[1], 6000)
    assert full.get(keys[2]) == value_for(keys[2], 6000)
    kinds = {(p.kind, p.key) for p in full.check()}
    assert kinds == {(ProblemKind.CORRUPT_FRAGMENT, keys[1].hex()), (ProblemKind.CORRUPT_FRAGMENT, keys[2].hex())}
    full.check(fix=True)
    assert_clean(full)


def test_every_fragment_damaged_beyond_m_is_unrecoverable_never_wrong(full, keys):
    k = keys[7]
    for f in fragment_refs(full, k)[:3]:
        _flip(f)
    with pytest.raises(Unrecoverable):
        full.get(k)
    assert full.get_many([k, keys[8]]) == [None, value_for(keys[8], 6000)]


def test_targets_left_out_of_the_config_are_not_a_loss(tmp_path, keys):
    """Reopened with some of its targets missing from the configuration, a store reads what
    it can, answers ``StoreUnavailable`` for the rest and marks nothing lost: with the full
    target list back, every entry reads, every lookup hits and ``check`` is clean."""
    from kvstore.errors import StoreUnavailable

    urls = [f"file://{tmp_path / f'disk{i}'}#d{i}#disk{i}" for i in range(9)]
    vals = {k: value_for(k, 3000) for k in keys[:30]}
    with kvstore.connect(str(tmp_path / "s"), fsync=False, targets=",".join(urls)) as s:
        s.put_many([PutItem(k, v) for k, v in vals.items()])
    unavailable = 0
    with kvstore.connect(str(tmp_path / "s"), fsync=False, targets=",".join(urls[:6])) as s:
        for k, v in vals.items():
            try:
                assert s.get(k) == v
            except StoreUnavailable as exc:
                assert "not opened with" in str(exc)
                unavailable += 1
        assert s.stats()["lost_entries"] == 0
    assert unavailable  # some entry had more than m fragments on the 3 targets left out
    with kvstore.connect(str(tmp_path / "s"), fsync=False, targets=",".join(urls)) as s:
        assert s.get_many(list(vals)) == list(vals.values())
        assert s.lookup(list(vals)).hit_blocks == 30
        assert_clean(s)


def test_repair_rebuilds_what_it_can_when_a_fragment_has_nowhere_to_go(tmp_path):
    """Two fragments gone and one healthy spare: repair rewrites one (5 of 6) and records it;
    before, one fragment with no target made it rewrite none, and the file it had written on
    the spare stayed unreferenced (orphaned until the entry died)."""
    base = tmp_path / "pr"
    targets = ",".join(f"file://{base}/t{i}#d{i}" for i in range(7))  # 4+2 over 7: one spare
    key, value = b"k" * 16, os.urandom(20000)
    with kvstore.connect(str(base / "data"), targets=targets, fsync=False) as s:
        s.put(key, value)
        with s.index.env.begin() as txn:
            m = s.index.get_meta(txn, b"\x01" + key)
    for t in m.targets[:2]:
        shutil.rmtree(t[len("file://"):] if t.startswith("file://") else base / t)
    with kvstore.connect(str(base / "data"), targets=targets, fsync=False) as s:
        res = s.repair()
        assert (res["rebuilt_fragments"], res["unfixed"]) == (1, 1)
        # and says which one and why (before: only the count; the reason was in the log)
        (line,) = res["unfixed_detail"]
        assert line.startswith(f"block {key.hex()} on ") and "not rebuilt: no target took it" in line
        assert "root is missing" in line
        with s.index.env.begin() as txn:
            now = s.index.get_meta(txn, b"\x01" + key)
        assert len(set(now.targets)) == 6 and set(now.targets) - set(m.targets)  # the spare is recorded
        assert s.get(key) == value
        problems = s.check()
        assert [p.kind for p in problems if p.kind is not ProblemKind.TARGET_DOWN] == [ProblemKind.MISSING_FRAGMENT]


def test_the_copies_a_repair_replaced_are_swept_when_their_target_comes_back(tmp_path):
    """A target away, repair rebuilds its fragments onto the spares; the target comes back
    holding the old copies. The record names the spare for that slot, so the old copy is an
    orphan: swept by GC (they were kept, invisible to verify, gc and stats, for as long
    as their entry lived, since the sweep asked only whether an entry's generation was known)."""
    base = tmp_path / "rt"
    targets = ",".join(f"file://{base}/t{i}#d{i}" for i in range(8))  # 4+2 over 8: two spares
    vals = {bytes([i]) * 16: os.urandom(3000 + i) for i in range(40)}
    # Single puts as one file per fragment (a store without segments): the slots this concerns.
    with kvstore.connect(str(base / "data"), targets=targets, fsync=False, orphan_grace_s=0, segments=False) as s:
        for k, v in vals.items():
            s.put(k, v)  # one file per fragment
        (base / "t3").rename(base / "t3.away")
        res = s.repair()
        assert res["rebuilt_fragments"] > 0 and res["unfixed"] == 0
        (base / "t3.away").rename(base / "t3")
        stale = [f for f in (base / "t3").rglob("*") if f.is_file() and not f.name.startswith(".")]
        assert len(stale) == res["rebuilt_fragments"]
        problems = s.check()  # verify sees the stale copies (before: nothing)
        assert {p.kind for p in problems} == {ProblemKind.ORPHAN_FRAGMENT} and len(problems) == len(stale)
        assert s.gc()["orphans"] == len(stale)
        assert not [f for f in (base / "t3").rglob("*") if f.is_file() and not f.name.startswith(".")]
        assert all(s.get(k) == v for k, v in vals.items()) and s.check() == []


def test_a_slot_rebuilt_onto_a_target_after_the_sweep_listed_it_is_not_deleted(tmp_path, monkeypatch):
    """The sweep lists a target, then a repair rebuilds a slot onto it at the very path a stale
    copy had (the target it replaced failed) and records it: the sweep checks the record and
    the file's age again before deleting, so the fragment the record now names stays."""
    from dataclasses import replace as dc_replace

    from kvstore.embedded.index import STANDALONE

    base = tmp_path / "s1"
    targets = ",".join(f"file://{base}/t{i}#d{i}" for i in range(8))
    key, value = b"q" * 16, os.urandom(5000)
    # Single puts as one file per fragment (a store without segments): the slots this concerns.
    with kvstore.connect(str(base / "data"), targets=targets, fsync=False, orphan_grace_s=0, segments=False) as s:
        s.put(key, value)
        ek = b"\x01" + key
        with s.index.env.begin() as txn:
            m = s.index.get_meta(txn, ek)
        home = m.targets[0]
        tgt = s.targets[home]
        os.rename(tgt.root, tgt.root + ".away")
        assert s.repair()["rebuilt_fragments"] == 1
        os.rename(tgt.root + ".away", tgt.root)  # back, with its stale copy of slot 0
        real_walk = type(tgt).walk

        def walk(self):
            listing = list(real_walk(self))
            if self is tgt:  # listed; now a repair rebuilds slot 0 here again and records it
                with s.index.env.begin(write=True) as txn:
                    cur = s.index.get_meta(txn, ek)
                    offsets = tuple(STANDALONE for _ in cur.targets) if cur.offsets else cur.offsets
                    s.index.update_txn(txn, ek, cur, dc_replace(cur, targets=(home, *cur.targets[1:]),
                                                               offsets=offsets))
            return iter(listing)

        monkeypatch.setattr(type(tgt), "walk", walk)
        s.gc()
        monkeypatch.undo()
        assert s.get(key) == value  # slot 0 is where the record says
        # what is an orphan now is the copy on the spare the first repair used
        (p,) = s.check()
        assert p.kind is ProblemKind.ORPHAN_FRAGMENT and p.target != home
        assert s.gc()["orphans"] == 1 and s.check() == [] and s.get(key) == value


def _write_txn(s) -> bool:
    """Open and commit an empty index write transaction (it waits for LMDB's writer lock)."""
    with s.index.env.begin(write=True):
        return True


def _slot_orphan_setup(tmp_path, **kw):
    """A store whose slot 0 was rebuilt on a spare while its home target was away, the home
    back with its stale copy: (store, entry key, key, value, home target, its record, path)."""
    from kvstore.embedded.targets import fragment_path

    base = tmp_path / "s2"
    targets = ",".join(f"file://{base}/t{i}#d{i}" for i in range(8))
    key, value = b"r" * 16, os.urandom(5000)
    # Single puts as one file per fragment (a store without segments): the slots this concerns.
    s = kvstore.connect(str(base / "data"), targets=targets, fsync=False, orphan_grace_s=0, segments=False, **kw)
    s.put(key, value)
    ek = b"\x01" + key
    with s.index.env.begin() as txn:
        home = s.index.get_meta(txn, ek).targets[0]
    tgt = s.targets[home]
    os.rename(tgt.root, tgt.root + ".away")
    assert s.repair()["rebuilt_fragments"] == 1
    os.rename(tgt.root + ".away", tgt.root)  # back, with its stale copy of slot 0
    with s.index.env.begin() as txn:
        cur = s.index.get_meta(txn, ek)
    return s, ek, key, value, tgt, cur, fragment_path(ek[0], key, cur.gen, 0)


def test_a_slot_rebuilt_onto_a_target_between_the_sweeps_last_look_and_its_delete_is_not_lost(tmp_path, monkeypatch):
    """The sweep's last look at a stale copy (the record, then the file's age) and its delete
    were two steps: a repair that rebuilt that slot at the very path in between (the target it
    had replaced failed) and recorded it had its new file deleted, leaving a record that names
    a missing fragment. Then the look and the delete shared one index write transaction, which
    held every put back for a target round trip. Now the sweep's last look takes the path and
    holds it through the stat and the delete, outside the transaction: a repair takes the path
    before it writes there, so it does not, and a put meanwhile is not held back."""
    import threading
    from pathlib import Path

    s, ek, key, value, tgt, cur, rel = _slot_orphan_setup(tmp_path)
    with s:
        home = tgt.name
        frame = s.targets[cur.targets[0]].read(rel)  # the good copy, on the spare the first repair used
        real_stat, put_done = type(tgt).stat, []

        def stat(self, path):
            got = real_stat(self, path)
            if self is tgt and path == rel and not hasattr(stat, "took"):  # the sweep's last look
                with s.index.env.begin(write=True) as txn:  # a repair about to rebuild slot 0 here
                    stat.took = s.index.take_path_txn(txn, home, rel, "repair")
                if stat.took:
                    tgt.write(rel, frame, fsync=False)
                put = threading.Thread(target=lambda: put_done.append(_write_txn(s)))  # as a put's commit
                put.start()
                put.join(10)  # at once: the sweep holds no write transaction while it asks the target
            return got

        monkeypatch.setattr(type(tgt), "stat", stat)
        s.gc()
        monkeypatch.undo()
        assert stat.took is False and put_done == [True]
        assert not (Path(tgt.root) / rel).exists()  # the stale copy swept
        assert s.repair()["rebuilt_fragments"] == 0
        assert s.get(key) == value and s.counters.get("degraded_reads", 0) == 0
        assert s.check() == []


def test_repair_and_the_sweep_ask_no_target_inside_an_index_write_transaction(tmp_path, monkeypatch):
    """Repair's check that a file it rebuilt in a new place is still there, and the sweep's
    last stat and delete of a slot orphan, ran inside an index write transaction: on S3 a
    round trip that every put's commit waited on. Now no target is asked while one is held."""
    import threading

    from kvstore.embedded.targets import LocalTarget

    s, _ek, key, value, tgt, _cur, rel = _slot_orphan_setup(tmp_path)
    probes: list[tuple[str, bool]] = []
    waiting: list[threading.Thread] = []
    real = {op: getattr(LocalTarget, op) for op in ("stat", "delete", "write")}

    def probing(op):
        def call(self, *a, **kw):
            done: list[bool] = []
            t = threading.Thread(target=lambda: done.append(_write_txn(s)))
            t.start()
            t.join(2)  # a put's commit: at once unless this thread holds the writer lock
            probes.append((op, bool(done)))
            waiting.append(t)  # joined at the end: it may wait for this very thread's transaction
            return real[op](self, *a, **kw)
        return call

    with s:
        for op in real:
            monkeypatch.setattr(LocalTarget, op, probing(op))
        os.rename(s.targets[_cur.targets[0]].root, s.targets[_cur.targets[0]].root + ".away")  # the spare gone
        s.repair()  # slot 0 rebuilt elsewhere: a new place, checked before it is recorded
        os.rename(s.targets[_cur.targets[0]].root + ".away", s.targets[_cur.targets[0]].root)
        s.gc()  # the stale copies swept: a slot orphan's last stat and its delete
        monkeypatch.undo()
        for t in waiting:
            t.join()
        assert {op for op, _ in probes} >= {"stat", "delete", "write"}
        assert all(ok for _, ok in probes), [op for op, ok in probes if not ok]
        assert s.get(key) == value and s.check() == []


def test_a_slot_path_a_repair_holds_is_not_swept(tmp_path, monkeypatch):
    """The other order: a repair took the path (it is writing its rebuilt fragment there, to
    record it) before the sweep's last look; the sweep keeps the file. Its delete is held back
    until the repair gives the path back, and is then taken only if no record claims the file."""
    from dataclasses import replace as dc_replace
    from pathlib import Path

    from kvstore.maintenance import rebuild as maintenance

    s, ek, key, value, tgt, cur, rel = _slot_orphan_setup(tmp_path)
    with s:
        frame = s.targets[cur.targets[0]].read(rel)
        with s.index.env.begin(write=True) as txn:
            assert s.index.take_path_txn(txn, tgt.name, rel, "repair")
        tgt.write(rel, frame, fsync=False)
        assert s.gc()["orphans"] == 0 and (Path(tgt.root) / rel).exists()
        assert maintenance.record_repair(s.parts, ek, cur, dc_replace(cur, targets=(tgt.name, *cur.targets[1:])),
                                          "entries", s.clock())
        with s.index.env.begin(write=True) as txn:
            s.index.release_path_txn(txn, tgt.name, rel)
        assert s.gc()["orphans"] == 1  # the copy on the spare, no longer recorded
        assert (Path(tgt.root) / rel).exists() and s.get(key) == value
        assert s.counters.get("degraded_reads", 0) == 0 and s.check() == []


def test_gc_keeps_the_fragments_of_targets_renamed_under_it(tmp_path):
    """Three targets' directories moved and the store opened with the new URLs (their old
    names not given): their files name slots the records put on targets no longer
    configured, which may be these under new names, so they are kept (the slot rule
    alone made gc delete all of them, and every entry was lost once the names were back)."""
    base = tmp_path / "mv"
    old = [f"file://{base}/a{i}" for i in range(6)]
    vals = {bytes([i]) * 16: os.urandom(2000 + i) for i in range(10)}
    with kvstore.connect(str(base / "data"), targets=",".join(old), fsync=False, orphan_grace_s=0) as s:
        for k, v in vals.items():
            s.put(k, v)
    for i in range(3):
        (base / f"a{i}").rename(base / f"b{i}")
    moved = [f"file://{base}/b{i}" for i in range(3)] + old[3:]
    with kvstore.connect(str(base / "data"), targets=",".join(moved), fsync=False, orphan_grace_s=0) as s:
        assert s.gc()["orphans"] == 0
    for i in range(3):
        (base / f"b{i}").rename(base / f"a{i}")
    with kvstore.connect(str(base / "data"), targets=",".join(old), fsync=False) as s:
        assert all(s.get(k) == v for k, v in vals.items()) and s.check() == []


@pytest.mark.parametrize("order", [[1, 0, 2, 3, 4, 5], [1, 2, 0, 3, 4, 5]], ids=["swapped", "rotated"])
@pytest.mark.parametrize("how", ["files", "pack"])
def test_gc_keeps_every_fragment_when_target_names_now_mean_other_directories(tmp_path, order, how):
    """The mounts of named targets swapped (or rotated) after a restart: every fragment sits
    on a target its record does not name for its slot, and every name is configured. A stray
    copy is deleted only once the copy its record names reads back, so nothing is lost and
    fixing the mounts restores everything (one gc deleted a fragment of every entry when
    swapped, and every entry when rotated)."""
    from kvstore.config import TargetSpec

    dirs = [str(tmp_path / f"disk{i}") for i in range(6)]
    for d in dirs:
        os.makedirs(d)

    def specs(o):
        return [TargetSpec(url=dirs[j], name=f"t{i}") for i, j in enumerate(o)]

    kw = dict(fsync=False, orphan_grace_s=0, delete_grace_s=0)
    vals = {bytes([i]) * 16: os.urandom(3000 + i) for i in range(12)}
    with kvstore.connect(str(tmp_path / "data"), targets=specs(range(6)), **kw) as s:
        if how == "pack":
            s.put_many([PutItem(k, v) for k, v in vals.items()])
        else:
            for k, v in vals.items():
                s.put(k, v)
    with kvstore.connect(str(tmp_path / "data"), targets=specs(order), **kw) as s:
        assert s.gc()["orphans"] == 0
    with kvstore.connect(str(tmp_path / "data"), targets=specs(range(6)), **kw) as s:
        assert all(s.get(k) == v for k, v in vals.items()) and s.check() == []


@pytest.mark.parametrize("change", ["compact", "delete"])
def test_check_reports_nothing_of_a_record_gc_moved_or_removed_during_the_scan(tmp_path, change):
    """``check`` scans a snapshot of the records; an entry compacted into a new pack (or deleted
    and purged) by a GC running alongside was reported ``lost_entry`` (and a repair counted it
    still lost) though it read fine. The scan's progress callback stands in for that GC."""
    keys = [bytes([i]) * 16 for i in range(4)]
    with kvstore.connect(str(tmp_path / "s"), delete_grace_s=0, fsync=False) as s:
        s.put_many([PutItem(k, bytes([i]) * 5000) for i, k in enumerate(keys)])
        for k in keys[1:]:
            s.delete(k)  # the pack is mostly dead: queued for compaction
        ran = []

        def progress(phase, n, total):
            if phase == "verify" and n == 0 and not ran:
                ran.append(1)
                if change == "delete":
                    s.delete(keys[0])
                s.gc()
                s.gc()  # compacts (or purges) keys[0] and removes the old pack

        assert [p for p in s.check(progress=progress) if p.kind is not ProblemKind.ORPHAN_FRAGMENT] == []
        assert ran and s.stats()["lost_entries"] == 0
        if change == "compact":
            assert s.get(keys[0]) == bytes([0]) * 5000


def test_a_record_whose_plain_size_disagrees_with_the_entry_is_never_decoded(tmp_path):
    """A direct writer commits the record (its plain_len) without the daemon reading the bytes;
    a forged small plain_len over a zstd bomb was charged ~1 KiB and decoded to 32 MiB on every
    get. The read path now takes the record's plain size as the limit and requires the
    entry to match it: never decoded, Unrecoverable, marked lost."""
    from dataclasses import replace

    from kvstore.embedded.index import ekey

    key = b"z" * 16
    with kvstore.connect(str(tmp_path / "s"), fsync=False, compression="zstd") as s:
        s.put(key, bytes(4 << 20))
        ek = ekey(1, key)
        with s.index.env.begin(write=True) as txn:
            m = s.index.get_meta(txn, ek)
            assert m.entry_len < 4096  # compressed
            s.index.update_txn(txn, ek, m, replace(m, plain_len=m.entry_len))
        for read in (lambda: s.get(key), lambda: s.get_many([key])[0]):
            try:
                got = read()
            except Unrecoverable:
                got = None
            assert got is None
        assert s.stats()["lost_entries"] == 1


def test_a_repair_that_took_over_half_the_orphan_grace_records_nothing(tmp_path, monkeypatch):
    """A rebuilt fragment's file is new to the index until the repair records it; a sweep
    (another process) may delete it once it is older than the orphan grace. A repair whose
    writes took over half the grace records nothing, as a put would not (before, it recorded
    a fragment the sweep could be removing) and says why; the next repair rebuilds it."""
    import time

    from tests.kvstore.conftest import FakeClock

    base = tmp_path / "rt"
    targets = ",".join(f"file://{base}/t{i}#d{i}" for i in range(7))  # 4+2 over 7: one spare
    clock = FakeClock(time.time())
    vals = {bytes([i]) * 16: os.urandom(3000 + i) for i in range(6)}
    with kvstore.connect(str(base / "data"), targets=targets, fsync=False, clock=clock, orphan_grace_s=60) as s:
        for k, v in vals.items():
            s.put(k, v)
        (base / "t3").rename(base / "t3.away")
        slow = []

        def slow_write(self, rel, data, **kw):
            got = orig(self, rel, data, **kw)
            clock.advance(40)  # over orphan_grace_s / 2 before the index hears of it
            slow.append(rel)
            return got

        orig = type(next(iter(s.targets.values()))).write
        monkeypatch.setattr(type(next(iter(s.targets.values()))), "write", slow_write)
        res = s.repair()
        assert slow and res["rebuilt_fragments"] == 0 and res["unfixed"] > 0
        assert all("rebuilt but not recorded" in d and "orphan_grace_s/2" in d for d in res["unfixed_detail"])
        monkeypatch.undo()
        res = s.repair()  # in time: recorded
        assert res["rebuilt_fragments"] > 0 and res["unfixed"] == 0
        assert all(s.get(k) == v for k, v in vals.items())
        assert {p.kind for p in s.check()} == {ProblemKind.TARGET_DOWN}  # t3, still away


@pytest.mark.parametrize("why", ["late", "moved"])
def test_a_fragment_rebuilt_in_place_but_not_recorded_is_not_called_not_rebuilt(tmp_path, monkeypatch, why):
    """A missing fragment rebuilt on its own target (the good file written at its recorded
    path) whose record was then not updated: written too long ago to be indexed, or the entry
    changed meanwhile. Before, repair reported it "not rebuilt" ("not rebuilt: rebuilt but not
    recorded", or "not rebuilt: the entry changed"), though the good file was on disk. Now it
    says it was rebuilt in place and not recorded, and why."""
    import time

    from kvstore.maintenance import check as maintenance

    from tests.kvstore.conftest import FakeClock

    base = tmp_path / "ip"
    targets = ",".join(f"file://{base}/t{i}#d{i}" for i in range(6))  # 4+2 over 6: rebuilt in place
    clock = FakeClock(time.time())
    key, value = b"q" * 16, os.urandom(5000)
    # Single puts as one file per fragment (a store without segments): the slots this concerns.
    with kvstore.connect(str(base / "data"), targets=targets, fsync=False, clock=clock, orphan_grace_s=60, segments=False) as s:
        s.put(key, value)
        ref = fragment_refs(s, key)[2]
        good = ref.read_bytes()
        ref.remove()
        if why == "late":
            orig = type(s.targets[ref.target]).write

            def slow_write(self, rel, data, **kw):
                got = orig(self, rel, data, **kw)
                clock.advance(40)  # over orphan_grace_s / 2 before the index hears of it
                return got

            monkeypatch.setattr(type(s.targets[ref.target]), "write", slow_write)
        else:
            monkeypatch.setattr(maintenance, "record_repair", lambda *a, **kw: False)
        res = s.repair()
        assert (res["rebuilt_fragments"], res["unfixed"]) == (0, 1), res
        (line,) = res["unfixed_detail"]
        assert "not rebuilt" not in line, line
        assert f"rebuilt but not recorded (in place: the good file is at its recorded path on {ref.target})" in line
        assert ("orphan_grace_s/2" if why == "late" else "the entry changed while it was rebuilt") in line
        assert ref.read_bytes() == good  # the good file is there indeed
        monkeypatch.undo()
        assert s.get(key) == value
        assert_clean(s)


@pytest.mark.parametrize("reads", [{}, {"parallel_reads": "always"}, {"read_timeout_s": 5.0}],
                         ids=["fast-path", "parallel", "timeout"])
def test_unrecoverable_names_the_key_and_every_failed_target(data_dir, reads):
    """Short of k good fragments, the error names the key and every target whose fragment
    failed (missing and corrupt alike), not just the first ones tried: the read goes on
    through the parity fragments before it gives up, whichever read mode."""
    key, value = b"u" * 16, os.urandom(20000)
    with kvstore.connect(str(data_dir), fsync=False, **reads) as s:
        s.put(key, value)
        refs = fragment_refs(s, key)
        refs[0].remove()
        for i in (3, 5):  # corrupt: a bit flipped in the body
            raw = bytearray(refs[i].read_bytes())
            raw[-3] ^= 0xFF
            refs[i].write_bytes(bytes(raw))
        with pytest.raises(Unrecoverable) as ei:
            s.get(key)
    want = {refs[i].target for i in (0, 3, 5)}
    assert ei.value.key == key and key.hex() in str(ei.value)
    assert set(ei.value.failed_targets) == want and all(t in str(ei.value) for t in want)
