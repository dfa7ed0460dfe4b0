"""Every fault ``kvstore.embedded.faults`` injects, and every retry/timeout limit of the store, reached.

Limits of the embedded store and where each is reached here:
  * ``fragment_read_retries`` (transient read error or checksum mismatch): recovered
    within the limit, exhausted past it (then the read goes degraded), and 0.
  * ``read_timeout_s``: a slow target is skipped while k others answer; when fewer
    than k answer in time the late reads are awaited (slow is not lost).
  * write fallback to spare targets: used while spares last; exhausted gives
    ``StoreUnavailable`` (EIO) or ``CapacityExceeded`` (ENOSPC) and stores nothing.
  * ``write_timeout_s``: a hung write fails its fragment within the timeout (a spare takes
    it; without one the put fails ``StoreUnavailable``), single puts and packs alike, and the
    hung target is not asked again while its write still runs.
  * fewer than k good fragments: ``Unrecoverable``, never wrong bytes; repair restores.
Every mutating test ends with ``check()`` clean.
"""

from __future__ import annotations

import errno
import time

import pytest

from kvstore import CapacityExceeded, PutItem, StoreUnavailable, Unrecoverable

from kvstore.embedded import faults

from kvstore.embedded import targets
from kvstore.embedded.index import ekey

from tests.kvstore.chaos.conftest import K, V, assert_clean


def frag_targets(store, key: bytes) -> list[str]:
    with store.index.env.begin() as txn:
        return list(store.index.get_meta(txn, ekey(1, key)).targets)


def targets_of_placement(store, key: bytes) -> list[str]:
    """The k+m targets rendezvous hashing picks for ``key`` (where a put tries first)."""
    from kvstore.embedded.placement import place

    return place(key, store.target_specs, store.config.ec_k + store.config.ec_m)


def _put_some(store, n=8, size=3000):
    for i in range(n):
        assert store.put(K(i), V(i, size))


def test_all_zero_plan_is_a_plain_directory(faulty_store):
    fs = faulty_store()
    _put_some(fs.store)
    assert [fs.store.get(K(i)) for i in range(8)] == [V(i) for i in range(8)]
    assert fs.store.counters["degraded_reads"] == 0 and fs.store.counters["read_retries"] == 0
    assert sum(sum(c.counts.values()) for c in fs.controls) == 0
    assert_clean(fs.store)


def test_transient_read_error_is_retried_within_the_limit(faulty_store):
    fs = faulty_store(fragment_read_retries=2)
    fs.store.put(K(1), V(1))
    first = fs.control_of(frag_targets(fs.store, K(1))[0])
    # Fail exactly the next two reads of that target, then calm: two retries suffice.
    first.set(read_error_p=1.0).schedule([(first.ops + 3, faults.FaultPlan())])
    assert fs.store.get(K(1)) == V(1)
    assert fs.store.counters["read_retries"] == 2
    assert fs.store.counters["degraded_reads"] == 0  # recovered on the same fragment
    assert first.counts["read_error"] == 2
    assert_clean(fs.store)


@pytest.mark.parametrize("retries", [0, 1, 3])
def test_read_retries_exhausted_then_degraded_read(faulty_store, retries):
    fs = faulty_store(fragment_read_retries=retries)
    fs.store.put(K(1), V(1))
    bad = fs.control_of(frag_targets(fs.store, K(1))[0]).set(read_error_p=1.0)
    assert fs.store.get(K(1)) == V(1)
    assert fs.store.counters["read_retries"] == retries
    assert bad.counts["read_error"] == retries + 1
    assert fs.store.counters["degraded_reads"] == 1
    fs.calm()
    assert_clean(fs.store)


def test_corrupt_reads_on_m_targets_never_return_wrong_bytes(faulty_store):
    fs = faulty_store(k=2, m=2, fragment_read_retries=0)
    _put_some(fs.store)
    for c in fs.controls[:2]:
        c.set(corrupt_read_p=1.0)
    for i in range(8):
        assert fs.store.get(K(i)) == V(i)
    assert sum(c.counts["corrupt_read"] for c in fs.controls) > 0
    assert fs.store.counters["degraded_reads"] > 0 and fs.store.counters["unrecoverable"] == 0
    fs.calm()
    assert_clean(fs.store)


def test_corrupt_reads_beyond_m_are_unrecoverable_then_repaired(faulty_store):
    fs = faulty_store(k=2, m=1, n=3, fragment_read_retries=1)
    _put_some(fs.store, 4)
    for c in fs.controls[:2]:
        c.set(corrupt_read_p=1.0)
    for i in range(4):
        with pytest.raises(Unrecoverable):
            fs.store.get(K(i))  # never the wrong bytes
    assert fs.store.lookup([K(0)]).hit_blocks == 0  # marked lost: lookups stop offering it
    fs.calm()  # the bytes on disk were fine all along
    out = fs.store.repair()
    assert out["restored_entries"] == 4 and out["still_lost"] == 0
    assert [fs.store.get(K(i)) for i in range(4)] == [V(i) for i in range(4)]
    assert_clean(fs.store)


def test_read_timeout_skips_a_slow_target(faulty_store):
    fs = faulty_store(k=2, m=2, read_timeout_s=0.2)
    fs.store.put(K(1), V(1))
    slow = fs.control_of(frag_targets(fs.store, K(1))[0]).set(latency_s=1.5, latency_p=1.0)
    t0 = time.monotonic()
    assert fs.store.get(K(1)) == V(1)
    took = time.monotonic() - t0
    assert took < 1.0, took  # did not wait for the slow target
    assert fs.store.counters["read_timeouts"] == 1 and fs.store.counters["degraded_reads"] == 1
    assert slow.counts["latency"] == 1
    fs.calm()
    time.sleep(1.6)  # let the abandoned read finish before check()
    assert_clean(fs.store)


def test_a_frozen_target_cannot_take_every_read_thread(faulty_store):
    """Reads abandoned at ``read_timeout_s`` keep their worker while the target hangs. Once
    ``read_workers`` of them were stuck on one frozen target, every later read (healthy
    targets' too) queued behind them, "timed out" in the queue, and the get waited for the
    frozen ones: 43 s per get on a frozen S3 endpoint. Now a target with
    ``STALLED_READS_LIMIT`` reads still running past the timeout is not asked for more (parity
    instead), so every get finishes in about the timeout with the right bytes."""
    fs = faulty_store(n=4, k=2, m=2, read_timeout_s=0.2, read_workers=4)
    _put_some(fs.store, 12)
    frozen = fs.controls[0].set(latency_s=6.0, latency_p=1.0)
    for i in range(12):
        t0 = time.monotonic()
        assert fs.store.get(K(i)) == V(i)
        assert time.monotonic() - t0 < 2.0, i
    assert frozen.counts["latency"] <= targets.STALLED_READS_LIMIT + 1  # not asked again and again
    assert fs.store.counters["unrecoverable"] == 0 and fs.store.counters["degraded_reads"] > 0
    fs.calm()
    time.sleep(6.5)  # let the abandoned reads finish before check()
    assert_clean(fs.store)


def test_without_read_timeout_a_slow_target_stalls_the_get(faulty_store):
    fs = faulty_store(k=2, m=2, read_timeout_s=0)
    fs.store.put(K(1), V(1))
    fs.control_of(frag_targets(fs.store, K(1))[0]).set(latency_s=0.6, latency_p=1.0)
    t0 = time.monotonic()
    assert fs.store.get(K(1)) == V(1)
    assert time.monotonic() - t0 >= 0.6
    assert fs.store.counters["read_timeouts"] == 0


def test_read_timeout_waits_for_late_fragments_rather_than_losing_the_entry(faulty_store):
    fs = faulty_store(k=2, m=2, read_timeout_s=0.1)
    fs.store.put(K(1), V(1))
    names = frag_targets(fs.store, K(1))
    for n in names[:3]:  # only one fragment answers in time: k=2 needs a late one
        fs.control_of(n).set(latency_s=0.5, latency_p=1.0)
    t0 = time.monotonic()
    assert fs.store.get(K(1)) == V(1)
    assert time.monotonic() - t0 >= 0.4
    assert fs.store.counters["unrecoverable"] == 0 and fs.store.lookup([K(1)]).hit_blocks == 1
    fs.calm()
    time.sleep(0.6)
    assert_clean(fs.store)


def test_write_errors_fall_back_to_a_spare_target(faulty_store):
    fs = faulty_store(n=5, k=2, m=2)
    bad = fs.controls[0].set(write_error_p=1.0)
    _put_some(fs.store, 12)
    assert bad.counts["write_error"] > 0
    for i in range(12):
        assert bad.name not in "".join(frag_targets(fs.store, K(i)))
        assert fs.store.get(K(i)) == V(i)
    fs.calm()
    assert_clean(fs.store)


@pytest.mark.parametrize("fault,err", [("write_error_p", StoreUnavailable), ("enospc_p", CapacityExceeded)])
def test_spares_exhausted_put_fails_typed_and_stores_nothing(faulty_store, fault, err):
    fs = faulty_store(n=4, k=2, m=2)  # no spare target
    fs.store.put(K(0), V(0))
    fs.controls[1].set(**{fault: 1.0})
    with pytest.raises(err):
        fs.store.put(K(1), V(1))
    assert fs.store.lookup([K(1)]).hit_blocks == 0
    assert fs.store.get(K(0)) == V(0)  # reads keep working
    fs.calm()
    assert_clean(fs.store)  # the failed put's placed fragments were removed, no orphans
    assert fs.store.put(K(1), V(1)) and fs.store.get(K(1)) == V(1)  # space is back


def test_short_writes_are_caught_on_read_and_repaired(faulty_store):
    fs = faulty_store(k=2, m=2)
    liar = fs.controls[2].set(short_write_p=1.0)
    _put_some(fs.store, 10)  # acknowledged: the disk lied
    fs.calm()
    assert liar.counts["short_write"] > 0
    for i in range(10):
        assert fs.store.get(K(i)) == V(i)
    problems = fs.store.check()
    assert problems and {p.kind.value for p in problems} == {"corrupt_fragment"}
    assert fs.store.repair()["rebuilt_fragments"] == liar.counts["short_write"]
    assert_clean(fs.store)


def test_target_vanishes_and_comes_back(faulty_store):
    fs = faulty_store(n=5, k=2, m=2)
    _put_some(fs.store, 10)
    gone = fs.controls[0].down()
    assert not fs.store.targets[fs.store.target_specs[0].name].is_up()
    for i in range(10):
        assert fs.store.get(K(i)) == V(i)
    for i in range(10, 20):  # new puts avoid it
        assert fs.store.put(K(i), V(i))
        assert gone.name not in "".join(frag_targets(fs.store, K(i)))
    assert any(p.kind.value == "target_down" for p in fs.store.check())
    gone.up()
    assert [fs.store.get(K(i)) for i in range(20)] == [V(i) for i in range(20)]
    assert_clean(fs.store)


def test_capacity_of_a_target_gives_enospc(faulty_store):
    fs = faulty_store(n=4, k=2, m=2)
    fs.controls[0].set(capacity_bytes=20_000)
    stored = []
    with pytest.raises(CapacityExceeded) as info:
        for i in range(100):
            fs.store.put(K(i), V(i))
            stored.append(i)
    assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
    assert 0 < len(stored) < 100
    assert [fs.store.get(K(i)) for i in stored] == [V(i) for i in stored]
    assert_clean(fs.store)
    fs.controls[0].set(capacity_bytes=0)
    assert fs.store.put(K(500), V(500))


def test_same_seed_same_faults(tmp_path):
    def run(name):
        c = faults.control(name, faults.FaultPlan(read_error_p=0.3, seed=7))
        out = []
        for _ in range(200):
            out.append(c.draw("read_error", c.plan.read_error_p))
        return out

    assert run("seed-a") == run("seed-b")


def test_plan_file_reaches_other_processes(tmp_path):
    c = faults.FaultControl("fileplan", state_dir=str(tmp_path))
    faults.write_plan(str(tmp_path), "fileplan", faults.FaultPlan(down=True))
    with pytest.raises(FileNotFoundError):
        c.step("read")
    assert c.plan.down
    time.sleep(0.06)
    faults.write_plan(str(tmp_path), "fileplan", faults.FaultPlan())
    time.sleep(0.06)
    c.step("read")
    time.sleep(0.55)
    c.step("read")
    assert faults.read_counts(str(tmp_path), "fileplan") == {"down": 1}


def test_a_flipped_version_field_is_a_damaged_fragment_not_a_failed_get(faulty_store):
    """Found by the soak: one bit in one fragment's version field failed the whole get
    with IncompatibleFormat; it is now a degraded read and repair rewrites the fragment."""
    import struct
    from pathlib import Path

    from kvstore.embedded.targets import fragment_path

    fs = faulty_store(k=2, m=2)
    fs.store.put(K(1), V(1))
    with fs.store.index.env.begin() as txn:
        m = fs.store.index.get_meta(txn, ekey(1, K(1)))
    p = Path(fs.store.targets[m.targets[0]].root) / fragment_path(1, K(1), m.gen, 0)
    raw = bytearray(p.read_bytes())
    struct.pack_into("<H", raw, 4, 3)
    p.write_bytes(bytes(raw))
    assert fs.store.get(K(1)) == V(1)
    assert fs.store.counters["degraded_reads"] == 1
    assert [x.kind.value for x in fs.store.check()] == ["corrupt_fragment"]
    assert fs.store.repair()["rebuilt_fragments"] == 1
    assert_clean(fs.store)


def _lost(store) -> int:
    return store.stats()["lost_entries"]


def test_targets_that_cannot_be_asked_never_lose_entries(faulty_store, monkeypatch):
    """A target that refuses to be asked (access denied: a wrong credential, an endpoint that
    refuses) says nothing about its fragments. Beyond m of them a get is ``StoreUnavailable``,
    not ``Unrecoverable``; ``check`` reports them down and marks nothing lost (before, one
    verify with a bad credential took every entry out of service); within m, reads are
    degraded and repair leaves their fragments where they are; once they answer, all is clean."""
    monkeypatch.setattr(targets, "UNREACHABLE_COOLDOWN_S", 0.0)  # ask every time (the breaker: below)
    fs = faulty_store(n=5, k=2, m=2)
    _put_some(fs.store, 12)
    with fs.store.index.env.begin() as txn:  # m + 1 of K(0)'s own targets: at least K(0) is unreadable
        down = list(fs.store.index.get_meta(txn, ekey(1, K(0))).targets[:3])
    for name in down:
        fs.control_of(name).set(unreachable=True)
    names = set(down)
    failed = 0
    for i in range(12):
        try:
            assert fs.store.get(K(i)) == V(i)
        except StoreUnavailable as exc:
            failed += 1
            assert "could not be reached" in str(exc) and "nothing is marked lost" in str(exc)
    assert failed > 0  # 3 of 5 targets unasked: some entries have fewer than k fragments elsewhere
    assert _lost(fs.store) == 0
    problems = fs.store.check()
    assert {p.kind.value for p in problems} == {"target_down"}, problems
    assert {p.target for p in problems} == names
    assert all("access denied" in p.detail and "not checked" in p.detail for p in problems), problems
    assert _lost(fs.store) == 0 and fs.store.lookup([K(0)]).hit_blocks == 1
    for name in down:
        fs.control_of(name).set(unreachable=False)
    fs.control_of(down[0]).set(unreachable=True)  # within m: degraded reads, nothing rebuilt elsewhere
    assert [fs.store.get(K(i)) for i in range(12)] == [V(i) for i in range(12)]
    before = fs.store.stats()["counters"]["fragment_rewrites"]
    assert {p.kind.value for p in fs.store.check(fix=True)} == {"target_down"}
    assert fs.store.stats()["counters"]["fragment_rewrites"] == before
    fs.calm()
    assert [fs.store.get(K(i)) for i in range(12)] == [V(i) for i in range(12)]
    assert_clean(fs.store)


def test_an_unreachable_target_is_classified_from_a_backend_error():
    """The errors of the client libraries under fsspec (botocore's EndpointConnectionError is
    not an OSError) and an object store's access-denied or 5xx answers are "could not ask";
    a missing object is an answer; a local I/O error stays what it is."""
    import errno as e

    from kvstore.embedded.targets import _is_unreachable

    class EndpointConnectionError(Exception):  # the shape of botocore's, by module
        __module__ = "botocore.exceptions"

    assert _is_unreachable(EndpointConnectionError("Could not connect to the endpoint URL"))
    assert _is_unreachable(PermissionError(e.EACCES, "AccessDenied"))
    assert _is_unreachable(ConnectionRefusedError(e.ECONNREFUSED, "refused"))
    assert _is_unreachable(TimeoutError("read timed out"))
    assert _is_unreachable(OSError(e.EREMOTEIO, "InternalError"))
    assert not _is_unreachable(FileNotFoundError(e.ENOENT, "NoSuchKey"))
    assert not _is_unreachable(OSError(e.EIO, "read error"))
    assert not _is_unreachable(ValueError("a bug is not an outage"))


def test_a_target_that_could_not_be_asked_is_not_asked_again_for_a_while(faulty_store, monkeypatch):
    """The circuit breaker (``kvstore.embedded.targets.UNREACHABLE_COOLDOWN_S``): after one "could not
    ask", operations on that target fail at once without reaching it, so an outage costs its
    timeouts once per interval; after the interval it is asked again."""
    clock = [1000.0]
    monkeypatch.setattr(targets.time, "monotonic", lambda: clock[0])
    fs = faulty_store(n=5, k=2, m=2)
    _put_some(fs.store, 4)
    c = fs.controls[0]
    t = fs.store.targets[fs.store.target_specs[0].name]
    c.set(unreachable=True)
    assert t.state()[0] == "unreachable"
    assert c.counts["unreachable"] == 1
    for _ in range(5):
        assert t.state()[0] == "unreachable"
        with pytest.raises(targets.TargetUnreachable, match="not asked"):
            t.read("anything")
    assert c.counts["unreachable"] == 1  # not asked again
    c.set(unreachable=False)
    clock[0] += targets.UNREACHABLE_COOLDOWN_S - 0.01
    with pytest.raises(targets.TargetUnreachable, match="not asked"):
        t.read("anything")
    clock[0] += 0.01
    ops = c.ops
    with pytest.raises(FileNotFoundError):  # asked again: an answer
        t.read("anything")
    assert c.ops == ops + 1 and t.state()[0] == "up"
    assert [fs.store.get(K(i)) for i in range(4)] == [V(i) for i in range(4)]


def test_the_breaker_waits_longer_after_a_probe_that_took_long(monkeypatch):
    """A call that took 40 s to fail (an endpoint that accepts and never answers) keeps the
    target from being asked for twice that, not for the 5 s a quick refusal gets (with a
    fixed 5 s nearly every get paid the 40 s again)."""
    import math
    from types import SimpleNamespace

    clock = [1000.0]
    monkeypatch.setattr(targets.time, "monotonic", lambda: clock[0])
    asked = []

    class Hung:
        name, spec = "t9", SimpleNamespace(shown_url="t9")
        _unreachable_at, _unreachable_why, _unreachable_for = -math.inf, "", 0.0

        @targets._asking
        def read(self):
            asked.append(clock[0])
            clock[0] += 40.0  # the client's timeouts and retries
            raise ConnectionError("no answer")

    t = Hung()
    with pytest.raises(targets.TargetUnreachable, match="could not be reached"):
        t.read()
    clock[0] += 79.0
    with pytest.raises(targets.TargetUnreachable, match="not asked"):
        t.read()
    clock[0] += 1.0
    with pytest.raises(targets.TargetUnreachable, match="could not be reached"):
        t.read()  # 80 s later: asked again
    assert len(asked) == 2


def test_unreachable_targets_make_batch_slots_misses_and_gc_finishes(faulty_store, monkeypatch):
    """More than m targets unreachable: get_many gives None in the slots it cannot read (not a
    failed batch), and GC finishes (compaction postpones the entries it cannot read) instead
    of failing on every run until the targets answer. A walk whose listing fails midway is
    classified too."""
    from kvstore import PutItem

    monkeypatch.setattr(targets, "UNREACHABLE_COOLDOWN_S", 0.0)
    fs = faulty_store(n=3, k=2, m=1)
    s = fs.store
    assert s.put_many([PutItem(K(i), V(i)) for i in range(20)]) == [True] * 20  # one pack
    for i in range(15):
        assert s.delete(K(i))
    for c in fs.controls[:2]:
        c.set(unreachable=True)
    got = s.get_many([K(i) for i in range(15, 20)])
    assert got == [None] * 5
    out = s.gc()  # the pack is mostly dead: compaction reads its live entries, and cannot
    assert out["moved_entries"] == 0 and s.stats()["lost_entries"] == 0
    fs.calm()
    assert s.get_many([K(i) for i in range(15, 20)]) == [V(i) for i in range(15, 20)]
    t = s.targets[s.target_specs[0].name]
    fs.controls[0].schedule([(fs.controls[0].ops + 1, faults.FaultPlan(unreachable=True))])
    with pytest.raises(targets.TargetUnreachable):
        list(t.walk())


@pytest.mark.slow  # a burst against a frozen target (test_a_frozen_target_cannot_take_every_read_thread covers the pool)
def test_a_burst_of_gets_with_a_frozen_target_all_succeed_in_about_the_timeout(faulty_store):
    """Concurrent gets while one target hangs: before its first read timed out, a burst sent it
    enough reads to fill the shared I/O pool, reads of healthy targets queued behind them timed
    out in the queue and were counted against those targets, which were then skipped: gets of
    fully readable entries failed. Reads now run on their target's own pool and one
    still queued at the timeout is cancelled, so only the frozen target's reads are held."""
    from concurrent.futures import ThreadPoolExecutor

    fs = faulty_store(n=4, k=2, m=2, read_timeout_s=0.2, read_workers=4)
    _put_some(fs.store, 24)
    frozen = fs.controls[0].set(latency_s=6.0, latency_p=1.0)

    def get(i):
        t0 = time.monotonic()
        return fs.store.get(K(i)) == V(i), time.monotonic() - t0

    with ThreadPoolExecutor(16) as ex:
        res = list(ex.map(get, range(24)))
    assert all(ok for ok, _ in res) and max(took for _, took in res) < 3.0, res
    assert fs.store.counters["unrecoverable"] == 0
    assert frozen.counts["latency"] <= 4  # its pool's threads at most: the rest cancelled or not sent
    fs.calm()
    time.sleep(6.5)
    assert_clean(fs.store)


def test_busy_but_healthy_targets_never_make_an_entry_lost(faulty_store):
    """Reads queued behind their target's others at read_timeout_s are cancelled; they were then
    counted as failed, so under load alone (every target healthy, 60 ms a read, one thread per
    target) most entries were marked lost with every fragment intact. A cancelled read is
    read after all when fewer than k arrive otherwise."""
    from concurrent.futures import ThreadPoolExecutor

    fs = faulty_store(n=4, k=2, m=2, read_timeout_s=0.1, read_workers=1, parallel_reads="always")
    _put_some(fs.store, 32)
    for c in fs.controls:
        c.set(latency_s=0.06, latency_p=1.0)
    with ThreadPoolExecutor(16) as ex:
        got = list(ex.map(lambda i: fs.store.get(K(i)) == V(i), range(32)))
    assert all(got) and fs.store.counters["unrecoverable"] == 0
    fs.calm()
    assert_clean(fs.store)


def test_close_waits_once_for_stuck_reads_not_once_per_target(faulty_store):
    """close() joined each target's read pool for POOL_JOIN_S in turn: 5 s with five frozen
    targets. The pools share one bound."""
    from concurrent.futures import ThreadPoolExecutor

    from kvstore.embedded.store import POOL_JOIN_S

    fs = faulty_store(n=8, k=2, m=5, read_timeout_s=0.1, parallel_reads="always")
    _put_some(fs.store, 20)
    for c in fs.controls[:5]:
        c.set(latency_s=8.0, latency_p=1.0)
    with ThreadPoolExecutor(16) as ex:
        assert list(ex.map(lambda i: fs.store.get(K(i)) == V(i), range(20))) == [True] * 20
    t0 = time.monotonic()
    fs.store.close()
    assert time.monotonic() - t0 < POOL_JOIN_S + 1.5


def test_an_object_delete_whose_bucket_vanished_before_rm_is_no_answer():
    """``ObjectTarget.delete``: ``rm_file`` raising ``FileNotFoundError`` after ``info`` found the
    object is "removed since" only while the root is still there; s3fs raises the same for a
    bucket deleted in between (NoSuchBucket), which must not read as "was not there"."""
    from kvstore.config import TargetSpec

    t = targets.open_target(TargetSpec("memory://qa-gone-bucket/root", "d", "m"))
    assert type(t).__name__ == "ObjectTarget"
    t.create_root()
    t.write("a/f1", b"x" * 10, fsync=False)
    t.write("a/f2", b"y" * 10, fsync=False)
    real = t.fs

    class RacedFS:  # s3fs as it answers once the object, or the whole bucket, went after info()
        def __init__(self, bucket_gone: bool) -> None:
            self.bucket_gone, self.removed = bucket_gone, False

        def __getattr__(self, name):
            return getattr(real, name)

        def rm_file(self, path):
            real.rm_file(path)
            self.removed = True
            raise FileNotFoundError(errno.ENOENT, "The specified bucket does not exist", path)

        def ls(self, path, **kw):
            if self.bucket_gone and self.removed:
                raise FileNotFoundError(errno.ENOENT, "NoSuchBucket", path)
            return real.ls(path, **kw)

    t.spec = TargetSpec("s3://qa-gone-bucket/root", "d", "m")  # a missing bucket is then a missing root
    t.fs = RacedFS(bucket_gone=False)
    assert t.delete("a/f1") is False  # an answer: removed since it was asked for
    t.fs = RacedFS(bucket_gone=True)
    with pytest.raises(targets.TargetUnavailable, match="root missing"):
        t.delete("a/f2")


def _wait_writes_ended(fs, bound_s: float = 10.0) -> None:
    """Until no write abandoned at ``write_timeout_s`` still runs (bounded), so check() sees
    the files the late writes published."""
    deadline = time.monotonic() + bound_s
    while any(t.writes_stalled() for t in fs.store.targets.values()) and time.monotonic() < deadline:
        time.sleep(0.05)


def test_write_timeout_moves_a_hung_fragment_to_a_spare(faulty_store):
    """A target whose writes hang (a stalled mount or object store): before, a put waited for
    it as long as it hung. Now the fragment fails at ``write_timeout_s``, a spare takes it,
    and the next put does not ask the hung target while its write still runs."""
    fs = faulty_store(n=5, k=2, m=2, write_timeout_s=0.1)
    hung_name = fs.store.target_specs[0].name
    hung = fs.controls[0].set(latency_s=1.0, latency_p=1.0)
    keys = [i for i in range(64) if hung_name in targets_of_placement(fs.store, K(i))][:2]
    for i in keys:
        t0 = time.monotonic()
        assert fs.store.put(K(i), V(i))
        assert time.monotonic() - t0 < 0.8, i  # one step of the hung target takes 1.0 s
        assert hung_name not in frag_targets(fs.store, K(i))
        assert fs.store.get(K(i)) == V(i)
    assert fs.store.counters["write_timeouts"] == 1  # the second put did not ask it
    assert hung.counts["latency"] == 1
    fs.calm()
    _wait_writes_ended(fs)
    fs.store.gc()  # the late write's file is named by no record there: an orphan
    assert_clean(fs.store)


def test_write_timeout_without_a_spare_fails_the_put_typed(faulty_store):
    """No spare target left: the put fails ``StoreUnavailable`` within the timeout and
    stores nothing; a batch (packs first, then fragment by fragment) likewise."""
    fs = faulty_store(n=4, k=2, m=2, write_timeout_s=0.1)
    fs.store.put(K(0), V(0))
    fs.controls[1].set(latency_s=1.0, latency_p=1.0)
    for items in ([K(1)], [K(2), K(3), K(4)]):
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="write_timeout_s"):
            fs.store.put_many([PutItem(k, V(1)) for k in items])
        assert time.monotonic() - t0 < 0.8
        assert fs.store.lookup(items).hit_blocks == 0
    assert fs.store.get(K(0)) == V(0)  # reads keep working
    fs.calm()
    _wait_writes_ended(fs)
    fs.store.gc()
    assert_clean(fs.store)
    assert fs.store.put(K(1), V(1)) and fs.store.get(K(1)) == V(1)
