"""A GC pass as a whole (``kvstore.maintenance.gc.run_gc``, ``kvstore.maintenance.gc_plan``): one file or
pack that resists never stops the rest of the pass; the pass reports progress in every
step; its dry run counts the compaction the real pass does from the same state; and
compaction moves stored entries whatever today's put limits are. Time is the injected
clock."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest

import kvstore
from kvstore import PutItem
from kvstore.errors import CapacityExceeded, InvalidRequest
from kvstore.embedded.index import ekey
from kvstore.maintenance.problems import ProblemKind
from kvstore.embedded.targets import fragment_path, pack_path

from tests.kvstore.conftest import assert_clean, value_for
from tests.fragments import assert_pack_refs_match_records


def _stray_fragment(store, target: str) -> Path:
    """An orphan fragment file (no index record names it) on ``target``."""
    rel = fragment_path(1, os.urandom(16), os.urandom(8), 0)
    store.targets[target].write(rel, [b"orphan bytes"], fsync=False)
    return Path(store.targets[target].root) / rel


def _stray_pack(store, target: str) -> Path:
    rel = pack_path(os.urandom(8))
    store.targets[target].write(rel, [b"x" * 100], fsync=False)
    return Path(store.targets[target].root) / rel


def _gen(store, key: bytes) -> bytes:
    with store.index.env.begin() as txn:
        return store.index.get_meta(txn, ekey(1, key)).gen


# --------------------------------------------------------------------------- A: an undeletable orphan
def test_an_undeletable_orphan_is_reported_and_the_sweep_goes_on(store, keys, monkeypatch, caplog):
    store.put(keys[0], b"live")
    first, last = list(store.targets)[0], list(store.targets)[-1]
    stuck, swept = _stray_fragment(store, first), _stray_fragment(store, last)
    tgt = store.targets[first]
    delete = tgt.delete

    def read_only(rel: str) -> bool:
        if rel.endswith(stuck.name):
            raise PermissionError(1, "Operation not permitted", rel)
        return delete(rel)

    monkeypatch.setattr(tgt, "delete", read_only)
    with caplog.at_level(logging.WARNING, logger="kvstore.maintenance.gc"):
        out = store.gc()
    assert out["orphans"] == 1 and out["orphans_kept"] == 1 and out["reclaimed_bytes"] == len(b"orphan bytes")
    assert stuck.exists() and not swept.exists()
    assert any(stuck.name in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)

    swept = _stray_fragment(store, last)
    problems = store.check(fix=True)  # repair's path: completes, the stuck file reported unfixed
    orphans = {(p.target, p.fixed) for p in problems if p.kind is ProblemKind.ORPHAN_FRAGMENT}
    assert orphans == {(first, False), (last, True)} and not swept.exists()
    assert store.repair()["orphans_kept"] == 1
    monkeypatch.undo()
    assert store.gc()["orphans"] == 1 and not stuck.exists()
    assert store.get(keys[0]) == b"live"
    assert_clean(store)


# --------------------------------------------------------------------------- B: progress in every step
def test_gc_reports_progress_in_every_step(store, keys, clock, monkeypatch):
    monkeypatch.setattr("kvstore.maintenance.gc._PURGE_STEP", 2, raising=False)  # per-batch reports of 2
    store.put_many([PutItem(k, value_for(k, 2000)) for k in keys[:8]])  # one pack
    for k in keys[:6]:
        store.delete(k)
    for k in keys[8:11]:
        store.put(k, b"short-lived", ttl_s=10)
    clock.advance(11)
    calls: list[tuple[str, int, int]] = []
    out = store.gc(progress=lambda *a: calls.append(a))
    assert (out["expired"], out["purged"], out["compacted_packs"], out["moved_entries"]) == (3, 9, 1, 2)
    by_phase: dict[str, list[tuple[int, int]]] = {}
    for phase, done, total in calls:
        by_phase.setdefault(phase, []).append((done, total))
    assert list(by_phase) == ["expire", "evict", "purge", "compact", "orphans"]  # in step order
    assert by_phase["expire"][0] == (0, 3) and by_phase["expire"][-1] == (3, 3)
    assert by_phase["evict"] == [(0, 0)]  # no capacity set: nothing to do
    assert by_phase["purge"] == [(0, 9), (2, 9), (4, 9), (6, 9), (8, 9), (9, 9)]  # per batch
    assert by_phase["compact"] == [(0, 1), (1, 1)]  # per pack
    dry: list[tuple[str, int, int]] = []
    store.gc(dry_run=True, progress=lambda *a: dry.append(a))
    assert list(dict.fromkeys(p for p, _, _ in dry)) == ["expire", "evict", "purge", "compact", "orphans"]
    assert_clean(store)


def test_gc_reports_eviction_progress_in_bytes(data_dir, keys, clock):
    opts = dict(fsync=False, clock=clock, compression="none", delete_grace_s=0, orphan_grace_s=0,
                access_flush_s=0, high_watermark=0.9, low_watermark=0.5)
    with kvstore.connect(str(data_dir), **opts) as s:
        for k in keys[:6]:
            s.put(k, value_for(k, 5000))
            clock.advance(1)
        used = s.used_bytes()
    with kvstore.connect(str(data_dir), capacity_bytes=used, **opts) as s:
        calls: list[tuple[str, int, int]] = []
        out = s.gc(progress=lambda *a: calls.append(a))
        evict = [(d, t) for p, d, t in calls if p == "evict"]
        need = used - int(used * 0.5)
        assert out["evicted"] == 3 and evict[0] == (0, need) and evict[-1] == (need, need)
        assert_clean(s)


# --------------------------------------------------------------------------- C: dry-run compaction
def test_dry_run_counts_the_compaction_its_own_purge_queues(store, keys):
    store.put_many([PutItem(k, value_for(k, 3000)) for k in keys[:6]])  # one pack
    for k in keys[:4]:
        store.delete(k)  # 4 of 6 dead once purged: over compact_ratio
    with store.index.env.begin() as txn:
        assert not list(store.index.iter_db(txn, "compact"))  # nothing queued before the pass
    dry = store.gc(dry_run=True)
    real = store.gc()
    counts = ("purged", "compacted_packs", "moved_entries")
    assert [real[c] for c in counts] == [4, 1, 2]
    assert [dry[c] for c in counts] == [real[c] for c in counts]
    assert store.get_many(keys[4:6]) == [value_for(k, 3000) for k in keys[4:6]]
    assert_pack_refs_match_records(store)
    assert_clean(store)


def test_dry_run_compaction_leaves_out_entries_expired_first_and_packs_purged_whole(data_dir, keys, clock):
    with kvstore.connect(str(data_dir), fsync=False, clock=clock, delete_grace_s=10, orphan_grace_s=0) as s:
        s.put_many([PutItem(k, value_for(k, 3000), ttl_s=20 if i == 7 else None)
                    for i, k in enumerate(keys[:8])])  # pack A; keys[7] expires at +20 s
        s.put_many([PutItem(k, value_for(k, 3000)) for k in keys[8:11]])  # pack B
        for k in keys[:5] + keys[8:11]:
            s.delete(k)  # A: 5 of 8 dead once purged; B: every record purged, so no compaction
        clock.advance(21)
        dry = s.gc(dry_run=True)
        real = s.gc()
        counts = ("expired", "purged", "compacted_packs", "moved_entries")
        assert [real[c] for c in counts] == [1, 8, 1, 2]  # keys[5:7] move; keys[7] expired first
        assert [dry[c] for c in counts] == [real[c] for c in counts]
        assert s.get_many(keys[5:7]) == [value_for(k, 3000) for k in keys[5:7]]
        assert_clean(s)


@pytest.mark.parametrize("real_clock", [False, True])
def test_dry_run_with_no_delete_grace_counts_the_entries_it_expires_as_purged(data_dir, keys, clock, real_clock):
    """With ``delete_grace_s = 0`` the real pass purges, in the same pass, the entries its
    step 2 expires (stamped with the pass's ``now``); the dry run left them out ("purged 14,
    would reclaim 31936" against "purged 24, reclaimed 191416")."""
    import time

    opts = dict(fsync=False, delete_grace_s=0, orphan_grace_s=0, **({} if real_clock else {"clock": clock}))
    with kvstore.connect(str(data_dir), **opts) as s:
        s.put_many([PutItem(k, value_for(k, 3000), ttl_s=0.5 if i < 4 else None)
                    for i, k in enumerate(keys[:8])])  # one pack; keys[:4] expire
        s.put(keys[8], value_for(keys[8], 3000), ttl_s=0.5)  # its own files
        s.delete(keys[7])
        clock.advance(1)
        if real_clock:
            time.sleep(0.6)
        dry = s.gc(dry_run=True)
        real = s.gc()
        counts = ("expired", "purged", "compacted_packs", "moved_entries", "reclaimed_bytes")
        assert (real["expired"], real["purged"]) == (5, 6)
        assert [dry[c] for c in counts] == [real[c] for c in counts]
        assert_clean(s)


def test_dry_run_counts_the_stale_copies_its_purge_leaves_as_orphans(data_dir, clock, keys):
    """A fragment's stale copy (a target that came back after repair rebuilt it elsewhere) is
    named by its entry's key and generation: not an orphan while the entry's record exists, an
    orphan once the pass purges it. The dry run swept with the records still there and counted
    neither it nor its bytes ("orphans 0; would reclaim 14232" against "orphans 1;
    reclaimed 15418"); the files the purge deletes itself are not counted twice."""
    # A store without segments, whose single puts write a file per fragment: the copies this concerns.
    store = kvstore.connect(str(data_dir), fsync=False, clock=clock, orphan_grace_s=0, delete_grace_s=0,
                            segments=False)
    store.put(keys[0], value_for(keys[0], 3000))  # its own fragment files
    store.put_many([PutItem(k, value_for(k, 3000)) for k in keys[1:4]])  # a pack
    gen = _gen(store, keys[0])
    with store.index.env.begin() as txn:
        names = store.index.get_meta(txn, ekey(1, keys[0])).targets
    spare = next(t for t in store.targets if t != names[0])
    rel = fragment_path(1, keys[0], gen, 0)
    stale = Path(store.targets[spare].root) / rel
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes((Path(store.targets[names[0]].root) / rel).read_bytes())
    store.delete(keys[0])
    store.delete(keys[1])
    dry = store.gc(dry_run=True)
    real = store.gc()
    assert real["orphans"] == 1 and not stale.exists()
    counts = ("purged", "orphans", "reclaimed_bytes")
    assert [dry[c] for c in counts] == [real[c] for c in counts]
    assert_clean(store)
    store.close()


# --------------------------------------------------------------------------- D: compaction and put limits
def test_compaction_moves_entries_over_a_lowered_max_value_bytes(data_dir, keys, clock):
    vals = {k: os.urandom(20_000) for k in keys[:8]}
    opts = dict(fsync=False, clock=clock, compression="none", delete_grace_s=0, orphan_grace_s=0)
    with kvstore.connect(str(data_dir), **opts) as s:
        s.put_many([PutItem(k, v) for k, v in vals.items()])  # one pack
    with kvstore.connect(str(data_dir), max_value_bytes=10_000, **opts) as s:
        with pytest.raises(InvalidRequest):
            s.put(keys[9], os.urandom(20_000))  # new puts obey the new limit
        old = _gen(s, keys[7])
        for k in keys[:6]:
            s.delete(k)
        stray = _stray_pack(s, list(s.targets)[0])
        out = s.gc()  # not InvalidRequest: moving a stored entry is not a put
        assert out["compacted_packs"] == 1 and out["moved_entries"] == 2 and out["orphans"] == 1
        assert not stray.exists() and _gen(s, keys[7]) != old
        assert s.get_many(keys[6:8]) == [vals[k] for k in keys[6:8]]
        assert_pack_refs_match_records(s)
        assert_clean(s)


def test_an_entry_that_cannot_be_moved_stays_and_the_pass_goes_on(store, keys, monkeypatch, caplog):
    store.put_many([PutItem(k, value_for(k, 3000)) for k in keys[:6]])
    for k in keys[:4]:
        store.delete(k)  # 4 of 6 dead: over compact_ratio
    old = _gen(store, keys[4])
    encode = store.fragments.writer.encode_entry

    def refuse_one(key, *a):
        if key == keys[4]:
            raise InvalidRequest("cannot be written back")
        return encode(key, *a)

    monkeypatch.setattr(store.fragments.writer, "encode_entry", refuse_one)
    stray = _stray_pack(store, list(store.targets)[-1])
    with caplog.at_level(logging.WARNING, logger="kvstore.embedded.store"):
        out = store.gc()
    assert out["compacted_packs"] == 1 and out["moved_entries"] == 1 and out["orphans"] == 1
    assert _gen(store, keys[4]) == old and _gen(store, keys[5]) != old and not stray.exists()
    assert any(keys[4].hex() in r.getMessage() for r in caplog.records)
    assert store.get_many(keys[4:6]) == [value_for(k, 3000) for k in keys[4:6]]
    assert_clean(store)


def test_a_pack_whose_compaction_fails_stays_queued_and_the_pass_goes_on(store, keys, monkeypatch):
    store.put_many([PutItem(k, value_for(k, 3000)) for k in keys[:6]])
    for k in keys[:4]:
        store.delete(k)  # 4 of 6 dead: over compact_ratio
    old = _gen(store, keys[4])

    def full(members):
        raise CapacityExceeded("no room for the new pack")

    monkeypatch.setattr(store.fragments, "rewrite", full)
    stray = _stray_pack(store, list(store.targets)[0])
    out = store.gc()
    # compacted 0: the pack stays queued (before, a failed compaction counted as one done)
    assert out["purged"] == 4 and out["compacted_packs"] == 0 and out["moved_entries"] == 0
    assert out["orphans"] == 1 and not stray.exists()
    with store.index.env.begin() as txn:
        assert txn.get(old, db=store.index.db["compact"]) is not None  # retried by a later pass
    monkeypatch.undo()
    assert store.gc()["moved_entries"] == 2 and _gen(store, keys[4]) != old
    assert_clean(store)


# --------------------------------------------------------------------------- edge cases of the above
def test_close_does_not_wait_for_a_read_abandoned_at_its_timeout(tmp_path):
    """A fragment read abandoned at ``read_timeout_s`` (a dead mount) keeps its worker; close
    no longer joins that worker without a bound (it took as long as the hang: 30 s here)."""
    import threading
    import time

    import kvstore

    s = kvstore.connect(str(tmp_path / "s"), fsync=False, read_timeout_s=0.5)
    s.put(b"a" * 16, os.urandom(5000))
    stuck = threading.Event()
    t = next(iter(s.targets.values()))
    for meth in ("read", "read_into"):
        orig = getattr(t, meth)
        setattr(t, meth, lambda *a, _o=orig, **k: (stuck.wait(30), _o(*a, **k))[1])
    try:
        assert len(s.get(b"a" * 16)) == 5000  # degraded: the other fragments suffice
        t0 = time.monotonic()
        s.close()
        assert time.monotonic() - t0 < 10  # POOL_JOIN_S per pool, not the hang
    finally:
        stuck.set()


def test_evict_to_dry_run_counts_what_the_real_call_evicts(data_dir, clock):
    """With lost entries, ``evict_to(dry_run=True)`` counted their bytes twice (7 where the
    real call took 4); it is now ``gc_plan.plan_eviction``. And entries evicted before the
    call ends in ``CapacityExceeded`` are counted (the counter stayed 0)."""
    import kvstore
    from kvstore import CapacityExceeded, Unrecoverable
    from tests.fragments import fragment_refs

    keys = [b"k%015d" % i for i in range(20)]
    with kvstore.connect(str(data_dir), fsync=False, clock=clock, compression="none") as s:
        for i, k in enumerate(keys):
            s.put(k, bytes([i]) * 1000)
        for k in (keys[3], keys[7], keys[11]):
            for r in fragment_refs(s, k)[:3]:
                r.remove()
            with pytest.raises(Unrecoverable):
                s.get(k)
        used = s.used_bytes()
        goal = used - 4 * (used // 20)
        assert s.evict_to(goal, dry_run=True) == s.evict_to(goal) == 4
        for r in fragment_refs(s, keys[19])[:3]:  # one more lost, unpinned; every live entry pinned
            r.remove()
        with pytest.raises(Unrecoverable):
            s.get(keys[19])
        for k in keys:
            s.pin(k)
        before = s.counters["evicted"]
        with pytest.raises(CapacityExceeded):
            s.evict_to(0)
        assert s.counters["evicted"] == before + 1


# --------------------------------------------------------------------------- targets (S3/fsspec)
@pytest.mark.parametrize("second", ["file://{a}", "{a}/", "{a}/../a"])
def test_two_targets_at_one_place_are_refused(tmp_path, second):
    """Distinct target names at one place (a trailing slash, ``file://``, ``..``) were accepted,
    and each batch wrote its pack there twice: one fragment of every entry corrupt at once."""
    import kvstore
    from kvstore.errors import InvalidRequest

    a = str(tmp_path / "a")
    targets = [a, second.format(a=a)] + [str(tmp_path / f"t{i}") for i in range(4)]
    with pytest.raises(InvalidRequest, match="same place"):
        kvstore.connect(str(tmp_path / "d"), targets=targets, fsync=False)


def test_repair_after_a_target_was_replaced_by_a_new_one(tmp_path):
    """Records name a target no longer configured (replaced by a new one beside the rest):
    repair rebuilds those fragments onto a configured target. Before: KeyError, and a traceback
    from kvtool."""
    import kvstore
    from kvstore import PutItem

    old = [str(tmp_path / f"t{i}") for i in range(6)]
    vals = {os.urandom(16): os.urandom(3000) for _ in range(5)}
    with kvstore.connect(str(tmp_path / "d"), targets=old, fsync=False) as s:
        s.put_many([PutItem(k, v) for k, v in vals.items()])
    new = old[:5] + [str(tmp_path / "t6")]
    os.makedirs(new[5])  # a new disk, mounted (a missing root reads as a target down)
    with kvstore.connect(str(tmp_path / "d"), targets=new, fsync=False, orphan_grace_s=0) as s:
        assert s.get_many(list(vals)) == list(vals.values())  # degraded: one fragment each unreachable
        out = s.repair()
        assert out["rebuilt_fragments"] == 5 and out["still_lost"] == 0 and out["unfixed"] == 0
        assert [p for p in s.check() if p.kind.value != "orphan_fragment"] == []
        assert s.get_many(list(vals)) == list(vals.values())


def test_repair_with_lost_entries_on_targets_down_says_still_lost_and_kvtool_exits_1(tmp_path):
    """Lost entries whose targets cannot be asked are not examined by repair, yet stay lost:
    ``still_lost`` counts the lost records left in the index, so kvtool repair exits 1 (before:
    exit 0 and "still lost 0"). Targets that could not be asked are named (``targets_down``)."""
    import argparse

    import kvstore
    from kvstore import Unrecoverable
    from kvstore.cli.commands import ExitCode, run_repair
    from kvstore.embedded.faults import control, faulty_url
    from tests.fragments import fragment_refs

    names = [f"rdown{i}" for i in range(6)]
    with kvstore.connect(str(tmp_path / "d"), targets=[faulty_url(n, str(tmp_path / n)) for n in names],
                         fsync=False) as s:
        s.put(b"k" * 16, b"v" * 3000)
        for r in fragment_refs(s, b"k" * 16)[:3]:
            r.remove()
        with pytest.raises(Unrecoverable):
            s.get(b"k" * 16)
        for n in names:  # every target unreachable (an endpoint that refuses): nothing can be asked
            control(n).set(unreachable=True)
        try:
            out = s.repair()
            assert out["still_lost"] == 1, out
            assert out["targets_down"] >= 1
            got = run_repair(type("S", (), {"repair": lambda self, progress=None: out})(), argparse.Namespace(),
                             lambda *a: None)
            assert got.code == ExitCode.PROBLEMS and "still lost 1" in got.text and "targets down (missing or unreachable)" in got.text
        finally:
            for n in names:
                control(n).calm()


def test_a_graveyard_record_purged_by_two_passes_at_once_is_counted_once(tmp_path):
    """Two GC passes that read the same due graveyard records (two kvtool gc at once): the
    one whose transaction drops a record counts it and its bytes; the other counts nothing
    (each reported every record purged, twice what existed)."""
    from kvstore.maintenance.gc_plan import due_graves
    from kvstore.maintenance.gc import _purge_grave

    with kvstore.connect(str(tmp_path / "d"), fsync=False, delete_grace_s=0) as s:
        keys = [bytes([i]) * 16 for i in range(5)]
        for k in keys:
            s.put(k, os.urandom(5000))
        for k in keys:
            assert s.delete(k)
        due = due_graves(s.parts, s.now_ns())
        assert len(due) == len(keys)
        first = _purge_grave(s.parts, due, False, lambda *a: None)
        second = _purge_grave(s.parts, due, False, lambda *a: None)  # the other pass, on what it read before
        assert first[0] == len(keys) and first[1] >= len(keys) * 5000 and second == (0, 0, 0)


def _no_fds_for_pack_reads(monkeypatch, roots):
    real_open = os.open

    def no_fds(path, flags, *a, **kw):
        p = str(path)
        if p.startswith(roots) and p.endswith(".pack") and not flags & (os.O_WRONLY | os.O_RDWR):
            raise OSError(errno.EMFILE, "Too many open files", p)
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", no_fds)
    return real_open


def test_check_out_of_descriptors_does_not_mark_a_healthy_entry_lost(tmp_path, monkeypatch):
    """``check`` (kvtool verify) run by a process that is out of descriptors (EMFILE) learns
    nothing about the fragments, as a get does; it must not move a healthy entry to ``lost``
    (hidden from lookups, evicted first by the next gc)."""
    s = kvstore.connect(str(tmp_path / "s"), fsync=False, compression="none")
    try:
        key, val = os.urandom(16), os.urandom(20_000)
        assert s.put(key, val)
        roots = tuple(t.root for t in s.targets.values())
        real_open = _no_fds_for_pack_reads(monkeypatch, roots)
        s.check()
        monkeypatch.setattr(os, "open", real_open)
        with s.index.env.begin() as txn:
            assert s.index.get_lost(txn, ekey(1, key)) is None, "check marked a healthy entry lost on EMFILE"
        assert s.get(key) == val
    finally:
        s.close()
