"""The daemon's one maintenance slot: unary Gc/Check/Repair, ``Maintain`` and background GC
never run two passes at once (``kvstore.server.admin_rpc.AdminRPC._take_pass_slot``)."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

import kvstore
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.wire import ServerBusy


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
        unary = threading.Thread(target=lambda: s._stub.Check(pb.CheckRequest(), timeout=30))
        unary.start()
        assert started.wait(10)
        time.sleep(0.5)  # background rounds come due meanwhile
        busy_from = time.monotonic()
        with pytest.raises(ServerBusy, match="still running"):
            s.check(progress=lambda *a: None)  # Maintain
        for call in (lambda: s._stub.Gc(pb.GcRequest(dry_run=True), timeout=10),
                     lambda: s._stub.Repair(pb.RepairRequest(), timeout=10)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED and "still running" in e.value.details()
        skipped = [t for t in gcs if t >= busy_from]
        release.set()
        unary.join(10)
        assert not skipped, "background gc ran beside an admin's pass"
        assert json.loads(s._stub.Gc(pb.GcRequest(dry_run=True), timeout=10).json)["dry_run"] is True
        deadline = time.monotonic() + 10
        while not [t for t in gcs if t > busy_from] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [t for t in gcs if t > busy_from], "background gc never ran again"
