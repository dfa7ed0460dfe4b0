"""The daemon's one maintenance slot: unary Gc/Check/Repair, ``Maintain`` and background GC
never run two passes at once (``kvstore.server.admin_rpc.PassSlot``)."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

import kvstore
from kvstore.proto import kvstore_pb2 as pb
from kvstore.errors import DeadlineExceeded, ServerBusy


def test_one_pass_at_a_time_whether_unary_streamed_or_background(make_daemon) -> None:
    """The unary Gc/Check/Repair take the daemon's one pass slot as ``Maintain`` does (before,
    they ran beside it and beside each other: a client's retries after timeouts stacked up
    unary passes), and background GC skips its rounds while an admin's pass runs."""
    d = make_daemon(gc_interval_s=0.2)
    release = threading.Event()
    started = threading.Event()
    gcs: list[float] = []

    def slow_check(fix=False, progress=None):
        started.set()
        release.wait(30)
        return []

    real_gc = d.store.gc
    d.store.check = slow_check

    def counted_gc(**kw):
        if threading.current_thread().name == "kvstore-gc":  # background rounds only
            gcs.append(time.monotonic())
        return real_gc(**kw)

    d.store.gc = counted_gc
    with kvstore.connect(d.address) as s:
        unary = threading.Thread(target=lambda: s._rpc.stub.Check(pb.CheckRequest(), timeout=30))
        unary.start()
        assert started.wait(10)
        time.sleep(0.5)  # background rounds come due meanwhile
        busy_from = time.monotonic()
        with pytest.raises(ServerBusy, match="still running"):
            s.check(progress=lambda *a: None)  # Maintain
        for call in (lambda: s._rpc.stub.Gc(pb.GcRequest(dry_run=True), timeout=10),
                     lambda: s._rpc.stub.Repair(pb.RepairRequest(), timeout=10)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "still running" in e.value.details()
        skipped = [t for t in gcs if t >= busy_from]
        release.set()
        unary.join(10)
        assert not skipped, "background gc ran beside an admin's pass"
        assert json.loads(s._rpc.stub.Gc(pb.GcRequest(dry_run=True), timeout=10).json)["dry_run"] is True
        deadline = time.monotonic() + 10
        while not [t for t in gcs if t > busy_from] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [t for t in gcs if t > busy_from], "background gc never ran again"


def test_a_background_round_never_makes_an_admin_call_busy(make_daemon) -> None:
    """Background GC looked at the slot by taking it and giving it back: an admin's Gc arriving
    in between was refused BUSY though no pass was running. The look is now a flag read: the
    slot below stalls whoever takes it from the background thread, and the admin call still runs."""
    d = make_daemon(gc_interval_s=0.05)
    probing, admin_done = threading.Event(), threading.Event()
    rounds: list[float] = []
    real_gc = d.store.gc

    def counted_gc(**kw):
        if threading.current_thread().name == "kvstore-gc":
            rounds.append(time.monotonic())
        return real_gc(**kw)

    class StallingSlot:
        """The daemon's semaphore; a background-thread holder keeps it until the admin call is done."""

        def __init__(self, sem: threading.Semaphore) -> None:
            self.sem = sem

        def acquire(self, blocking: bool = True) -> bool:
            got = self.sem.acquire(blocking)
            if got and threading.current_thread().name == "kvstore-gc":
                probing.set()
                admin_done.wait(10)
            return got

        def release(self) -> None:
            self.sem.release()

    d.store.gc = counted_gc
    d.passes.semaphore = StallingSlot(d.passes.semaphore)
    deadline = time.monotonic() + 10
    while not (probing.is_set() or rounds) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert probing.is_set() or rounds, "no background round came due"
    with kvstore.connect(d.address) as s:
        try:
            assert json.loads(s._rpc.stub.Gc(pb.GcRequest(dry_run=True), timeout=10).json)["dry_run"] is True
        finally:
            admin_done.set()
    assert not probing.is_set(), "background gc took the admin pass slot"


def test_the_soaks_final_repair_waits_out_a_pass_that_holds_the_slot(make_daemon, tmp_path) -> None:
    """tools/soak.py repairs every shard at the end; a client's gc still running on a daemon made
    that Repair answer BUSY, the repair was counted as failed and its damage stayed, so the run
    failed (check_after_repair: corrupt_fragment) now and then. The controller now asks again
    while the daemon is busy with another pass."""
    import argparse

    from tools import soak

    d = make_daemon()
    assert d.passes.semaphore.acquire(blocking=False)  # another pass (a client's gc) runs
    releaser = threading.Timer(1.0, d.passes.semaphore.release)
    releaser.start()
    try:
        shard = argparse.Namespace(url=d.address, names=["t0"])
        out = soak.chaos([shard], tmp_path, argparse.Namespace(seed=1), end=time.time())  # only the final repair
    finally:
        releaser.join()
    assert out["repairs"].get("runs") == 1 and not out["repairs"].get("failed_runs"), out["repairs"]


def test_a_pass_whose_client_gave_up_stops_on_the_daemon(make_daemon) -> None:
    """A verify whose client timed out (or was interrupted) stops on the daemon at its next
    progress step (kvtool's retries after timeouts stacked up passes on the daemon)."""
    d = make_daemon()
    steps: list[int] = []
    stopped, second_asked = threading.Event(), threading.Event()

    def slow_check(fix=False, progress=None):  # 60 s of work in 1 s steps, unless stopped
        try:
            for n in range(60):
                progress("verify", n, 60)
                steps.append(n)
                # The first step lasts until the second call below was answered, so that call
                # surely meets this pass running (before, on a loaded machine the pass could
                # stop first and the second call start a slow pass of its own: a timeout).
                if n == 0:
                    second_asked.wait(10)
                else:
                    time.sleep(1.0)
        except Exception:
            stopped.set()
            raise
        return []

    d.store.check = slow_check
    with kvstore.connect(d.address, maintenance_timeout_s=1.0) as s:
        with pytest.raises(DeadlineExceeded):
            s.check(progress=lambda *a: None)
        # Until it has stopped, another pass is refused, not started beside it (retries
        # stacked up passes past the admission limit, whose slot the call gave back at once).
        try:
            with pytest.raises(ServerBusy, match="still running"):
                s.check(progress=lambda *a: None)
        finally:
            second_asked.set()
        assert stopped.wait(10), f"the pass went on after its client left ({len(steps)} steps)"
        assert len(steps) < 10
        d.store.check = lambda fix=False, progress=None: []
        for _ in range(50):  # its thread gives the slot back as it ends
            try:
                assert s.check(progress=lambda *a: None) == []
                break
            except ServerBusy:
                time.sleep(0.1)
        else:
            raise AssertionError("the slot of a stopped pass was never given back")
