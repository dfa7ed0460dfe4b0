"""Dispatch races, in process with fake workers (the helpers of ``test_service``): a client that
leaves during the wait before a retry, and a worker registered again (or removed) between the
pick and the call (its old channel closed under the call)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from tests.entrypoint.test_service import FIRST_TOKEN, FakeWorker, _serve_fake, stack  # noqa: F401 - fixture

PROMPT = list(range(1, 50))


class FailsThenRunsLong(FakeWorker):
    """The first Prefill fails INTERNAL at once; later ones run 30 s unless cancelled."""

    def __init__(self, worker_id: str, role: str):
        super().__init__(worker_id, role)
        self.n = 0
        self.cancelled = threading.Event()

    def Prefill(self, request, context):
        self.n += 1
        self._record("Prefill", context)
        if self.n == 1:
            context.abort(grpc.StatusCode.INTERNAL, "engine step failed")
        t = time.monotonic()
        while time.monotonic() - t < 30:
            if not context.is_active():
                self.cancelled.set()
                break
            time.sleep(0.01)
        return pb.PrefillReply(first_token=FIRST_TOKEN, stats="{}")


def test_a_client_that_leaves_during_the_wait_before_a_retry_gets_no_retry(stack):  # noqa: F811
    """Before: the retry after the wait was sent anyway, and its cancel callback was never run
    (grpc runs no callback added after the call ended), so the worker computed for nothing and
    the request's slot and in-flight count were held until it answered."""
    svc, ch, fakes, _ = stack(retry_backoff_s=(0.6, 0.6))
    opened: list = []
    try:
        flaky = FailsThenRunsLong("flaky-p", "prefill")
        svc.registry.add(flaky.worker_id, "prefill", _serve_fake(flaky, opened))
        svc.registry.add(fakes["decode"][0].worker_id, "decode", fakes["decode"][1])
        call = pbg.EntrypointStub(ch).Generate(
            pb.GenerateRequest(token_ids=PROMPT, sampling=pb.Sampling(max_new_tokens=4)), timeout=60)
        next(iter(call))  # the lookup hop; the first Prefill then fails and the wait begins
        time.sleep(0.3)
        call.cancel()
        inst = svc.registry.instances("prefill")[0]
        deadline = time.monotonic() + 10  # well under the worker's 30 s
        while (svc._slots._value != svc.cfg.max_inflight or inst.inflight) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert svc._slots._value == svc.cfg.max_inflight and inst.inflight == {}
        assert flaky.n == 1 or flaky.cancelled.wait(5)  # no retry, or one the worker saw cancelled
    finally:
        for close in opened:
            close(None)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_registered_again_between_its_pick_and_its_call_is_failed_over(stack, role):  # noqa: F811
    """The pick's registration is replaced (its channel closed) before the call starts: grpc raises
    ValueError ("Channel closed!"), which escaped as UNKNOWN. Now the hop fails over to the new
    registration, which stays up."""
    svc, ch, fakes, _ = stack()
    for r in ("prefill", "decode"):
        svc.registry.add(fakes[r][0].worker_id, r, fakes[r][1])
    reg, ready, fired = svc.registry, svc.registry.ready, []

    def ready_then_reregister(r=None):
        live = ready(r)
        if r == role and not fired:  # right after the snapshot the pick is made from
            fired.append(1)
            reg.add(fakes[role][0].worker_id, role, fakes[role][1])
        return live

    reg.ready = ready_then_reregister
    events = list(pbg.EntrypointStub(ch).Generate(
        pb.GenerateRequest(token_ids=PROMPT, sampling=pb.Sampling(max_new_tokens=4)), timeout=30))
    assert fired and [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2, 3]
    assert all(i.healthy for i in reg.instances())
