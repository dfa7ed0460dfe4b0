"""Dispatch to prefill and decode workers, in process with fake workers (the helpers of
``test_service``): a request every engine fails on (INTERNAL) fails after max_attempts and takes
no worker down, one that only shared its failed step is served on a retry, and a retry goes to
another worker of the role than the one that failed it, after a short wait (so the requests of
one failed step do not share the next); concurrent requests spread over the workers of a role
(each pick is counted in flight before the next one reads the loads); a failed call marks down
only the registration it was made on."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

import kvstore
from entrypoint.config import EntrypointConfig
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from tests.entrypoint.test_service import FIRST_TOKEN, FakeWorker, _serve_fake, stack  # noqa: F401 - fixture

POISON = 666  # a prompt token every fake engine below fails on


class PoisonWorker(FakeWorker):
    """Fails (``code``) every Prefill and Decode whose prompt holds ``POISON``, as a worker does
    when its engine step raises on that request (and then serves the next one); serves others."""

    def __init__(self, worker_id: str, role: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL):
        super().__init__(worker_id, role)
        self.code = code

    def Prefill(self, request, context):
        if POISON in request.token_ids:
            self._record("Prefill", context)
            context.abort(self.code, "engine step failed: poisoned")
        return super().Prefill(request, context)

    def Decode(self, request, context):
        if POISON in request.token_ids:
            self._record("Decode", context)
            context.abort(self.code, "engine step failed: poisoned")
        yield from super().Decode(request, context)


def _calls(fakes, method: str) -> int:
    return sum(1 for f in fakes for m, _ in f.calls if m == method)


@pytest.mark.parametrize("code", [grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN])
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_poison_request_fails_after_max_attempts_and_every_worker_stays_up(stack, role, code):
    """Before: INTERNAL (and UNKNOWN) counted as the worker's failure: the poison request marked
    each worker it reached down in turn (3 of 3), failed UNAVAILABLE, and the next request found
    no worker up. Now it is tried max_attempts times, then fails with the worker's status and
    message, and no worker is marked down."""
    svc, ch, fakes, _ = stack(max_attempts=3)
    opened: list = []
    try:
        poisoned = [PoisonWorker(f"{role}-{i}", role, code) for i in range(3)]
        for p in poisoned:
            svc.registry.add(p.worker_id, role, _serve_fake(p, opened))
        other = "decode" if role == "prefill" else "prefill"
        svc.registry.add(fakes[other][0].worker_id, other, fakes[other][1])
        stub = pbg.EntrypointStub(ch)
        method = role.capitalize()
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(pb.GenerateRequest(token_ids=[1, 2, POISON, 4], sampling=pb.Sampling(max_new_tokens=3)),
                               timeout=30))
        assert ei.value.code() == code, ei.value.details()
        assert "poisoned" in ei.value.details() and f"{role}-" in ei.value.details()
        assert _calls(poisoned, method) == 3  # max_attempts, and no more
        assert sorted(i.worker_id for i in svc.registry.ready(role)) == [p.worker_id for p in poisoned]
        events = list(stub.Generate(pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=3)),
                                    timeout=30))
        assert [e.token_id for e in events if e.kind == "token"][1:] == [1, 2]  # the next request is served
        assert not any('"failover"' in e.detail for e in events if e.kind == "hop")
    finally:
        for close in opened:
            close(None)


class FailsOnce(FakeWorker):
    """Fails its first Prefill and its first Decode with INTERNAL, as a worker does for every
    request batched in an engine step that raised on another one; then serves."""

    def __init__(self, worker_id: str, role: str):
        super().__init__(worker_id, role)
        self.failed: set[str] = set()

    def _first(self, method: str, context) -> None:
        if method not in self.failed:
            self.failed.add(method)
            self._record(method, context)
            context.abort(grpc.StatusCode.INTERNAL, "engine step failed (another request in the batch)")

    def Prefill(self, request, context):
        self._first("Prefill", context)
        return super().Prefill(request, context)

    def Decode(self, request, context):
        self._first("Decode", context)
        yield from super().Decode(request, context)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_request_failed_with_its_batch_is_retried_and_served(stack, role):
    """A request dropped with a failed engine step (INTERNAL) that was not its own fault is
    served on a retry, with the worker still up (the helper's first version failed it)."""
    svc, ch, fakes, _ = stack(max_attempts=3)
    opened: list = []
    try:
        flaky = FailsOnce(f"{role}-flaky", role)
        svc.registry.add(flaky.worker_id, role, _serve_fake(flaky, opened))  # the only one of its role
        other = "decode" if role == "prefill" else "prefill"
        svc.registry.add(fakes[other][0].worker_id, other, fakes[other][1])
        events = list(pbg.EntrypointStub(ch).Generate(
            pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=3)), timeout=30))
        assert [e.token_id for e in events if e.kind == "token"][1:] == [1, 2]
        assert _calls([flaky], role.capitalize()) == 2  # failed once, served on the retry
        assert [i.worker_id for i in svc.registry.ready(role)] == [flaky.worker_id]
    finally:
        for close in opened:
            close(None)


def test_an_unavailable_worker_is_still_marked_down_and_failed_over(stack):
    """The other side of the line: a worker that answers UNAVAILABLE (down, or unreachable) is
    marked down and the hop goes to another worker."""
    svc, ch, fakes, _ = stack(max_attempts=3)
    opened: list = []
    try:
        down = PoisonWorker("prefill-down", "prefill", grpc.StatusCode.UNAVAILABLE)
        svc.registry.add(down.worker_id, "prefill", _serve_fake(down, opened))  # first in snapshot order
        for role in ("prefill", "decode"):
            svc.registry.add(fakes[role][0].worker_id, role, fakes[role][1])
        req = pb.GenerateRequest(token_ids=[1, 2, POISON, 4], sampling=pb.Sampling(max_new_tokens=2))
        for _ in range(2):  # the first may or may not be routed to the down one
            list(pbg.EntrypointStub(ch).Generate(req, timeout=30))
            if _calls([down], "Prefill"):
                break
        assert _calls([down], "Prefill") == 1
        assert "prefill-down" not in {i.worker_id for i in svc.registry.ready("prefill")}
    finally:
        for close in opened:
            close(None)


def test_a_prefill_with_no_worker_left_says_why_the_last_one_failed(stack):
    """The only prefill worker answers UNAVAILABLE: it is marked down, and the next attempt finds no
    prefill worker up. Before: the error said only "no prefill worker is up" (the decode hop's says
    why its last attempt failed); now it names the worker, its status and its message too."""
    svc, ch, fakes, _ = stack(max_attempts=3)
    opened: list = []
    try:
        down = PoisonWorker("prefill-down", "prefill", grpc.StatusCode.UNAVAILABLE)
        svc.registry.add(down.worker_id, "prefill", _serve_fake(down, opened))
        svc.registry.add(fakes["decode"][0].worker_id, "decode", fakes["decode"][1])
        req = pb.GenerateRequest(token_ids=[1, 2, POISON, 4], sampling=pb.Sampling(max_new_tokens=2))
        with pytest.raises(grpc.RpcError) as ei:
            list(pbg.EntrypointStub(ch).Generate(req, timeout=30))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        details = ei.value.details()
        assert details.startswith("no prefill worker is up (after 1 failed attempts; last: prefill worker "
                                  "prefill-down: StatusCode.UNAVAILABLE: engine step failed: poisoned)"), details
        assert _calls([down], "Prefill") == 1
    finally:
        for close in opened:
            close(None)


# ----------------------------------------------------------------------------- concurrent picks


class SlowWorker(FakeWorker):
    """A fake whose Prefill takes ``delay_s`` and whose Decode waits ``delay_s`` before each token."""

    def __init__(self, worker_id: str, role: str, delay_s: float):
        super().__init__(worker_id, role)
        self.delay_s = delay_s

    def Prefill(self, request, context):
        time.sleep(self.delay_s)
        return super().Prefill(request, context)

    def Decode(self, request, context):
        for ev in super().Decode(request, context):
            time.sleep(self.delay_s)
            yield ev


def _slow_lb(lb, monkeypatch, delay_s: float = 0.03) -> None:
    """Make ``lb.choose`` take ``delay_s``: the window between reading the loads and counting the pick."""
    choose = lb.choose

    def slow(*args):
        time.sleep(delay_s)
        return choose(*args)

    monkeypatch.setattr(lb, "choose", slow)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_concurrent_requests_spread_over_the_workers_of_a_role(stack, monkeypatch, role):
    """12 requests at once, 3 workers of ``role``, distinct prompts (no prefix affinity). Before,
    for prefill: the queues were read under the lock and the pick was counted after it, so the
    requests whose picks overlapped all saw empty queues and went to the first worker (8 of 12 or
    more); for decode: the entrypoint counted no stream it had open, so every request picked between
    two heartbeats saw the same figures and went to the same worker (12 of 12)."""
    svc, ch, fakes, _ = stack(max_inflight=32)
    opened: list = []
    try:
        slow = [SlowWorker(f"{role}-{i}", role, 0.3 if role == "prefill" else 0.1) for i in range(3)]
        for w in slow:
            svc.registry.add(w.worker_id, role, _serve_fake(w, opened))
        other = "decode" if role == "prefill" else "prefill"
        svc.registry.add(fakes[other][0].worker_id, other, fakes[other][1])
        _slow_lb(svc.dispatch.lbs.prefill if role == "prefill" else svc.dispatch.lbs.decode, monkeypatch)
        stub = pbg.EntrypointStub(ch)

        def one(i: int) -> str:
            req = pb.GenerateRequest(token_ids=[1000 + i] * 40, sampling=pb.Sampling(max_new_tokens=4))
            events = list(stub.Generate(req, timeout=60))
            return next(json.loads(e.detail)["worker"] for e in events
                        if e.kind == "hop" and json.loads(e.detail)["hop"] == role)

        with ThreadPoolExecutor(12) as pool:
            picked = Counter(pool.map(one, range(12)))
        assert sum(picked.values()) == 12 and len(picked) == 3 and min(picked.values()) >= 2, picked
        assert all(not i.inflight and not i.decodes for i in svc.registry.instances())  # counts taken back
    finally:
        for close in opened:
            close(None)


# ----------------------------------------------------------------------------- re-registration


class PacedDecode(FakeWorker):
    """Decode streams 1, 2, 3, ... with ``delay_s`` before each token."""

    def __init__(self, worker_id: str, role: str, delay_s: float):
        super().__init__(worker_id, role)
        self.delay_s = delay_s

    def Decode(self, request, context):
        self._record("Decode", context)
        for i in range(len(request.generated), request.sampling.max_new_tokens):
            time.sleep(self.delay_s)
            yield pb.DecodeEvent(token_id=i, index=i)


def test_a_worker_registered_again_mid_stream_is_not_marked_down_by_the_old_registration(stack):
    """The decode worker registers again (same id, same address) while a stream is open on it:
    ``add`` closes the old channel, the stream fails CANCELLED, and dispatch marks the failed
    worker down. Before, ``mark_down`` went by id and took down the new registration, so the
    request found no decode worker up; now only the failed registration is, and the stream
    resumes on the new one."""
    svc, ch, fakes, _ = stack(max_attempts=3)
    opened: list = []
    try:
        svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
        paced = PacedDecode("decode-0", "decode", 0.05)
        address = _serve_fake(paced, opened)
        svc.registry.add(paced.worker_id, "decode", address)
        result: dict = {}

        def run() -> None:
            req = pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=12))
            try:
                result["events"] = list(pbg.EntrypointStub(ch).Generate(req, timeout=30))
            except grpc.RpcError as exc:
                result["error"] = (exc.code(), exc.details())

        t = threading.Thread(target=run)
        t.start()
        time.sleep(0.25)  # a few tokens in
        svc.registry.add(paced.worker_id, "decode", address)  # e.g. its Register retried
        t.join(timeout=30)
        assert "error" not in result, result.get("error")
        assert [e.token_id for e in result["events"] if e.kind == "token"] == [FIRST_TOKEN] + list(range(1, 12))
        assert [i.worker_id for i in svc.registry.ready("decode")] == [paced.worker_id]
    finally:
        for close in opened:
            close(None)


# ----------------------------------------------------------------------------- FAILED_HERE retries


class AlwaysFails(FakeWorker):
    """Fails every Prefill and Decode with UNKNOWN, as a worker whose handler raises on every call
    does; its Status still answers, so it stays up."""

    def Prefill(self, request, context):
        self._record("Prefill", context)
        context.abort(grpc.StatusCode.UNKNOWN, "handler raised")

    def Decode(self, request, context):
        self._record("Decode", context)
        context.abort(grpc.StatusCode.UNKNOWN, "handler raised")
        yield  # a stream handler


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_retry_after_failed_here_goes_to_another_worker_of_the_role(stack, role):
    """A ``role`` worker that answers UNKNOWN on every call, registered first, and a healthy peer.
    Before: the retry went back to the same worker (its in-flight count was released, so it looked
    idle, and ties go to the first registered): 15 calls to it, 0 to the peer, and every one of the
    5 requests failed. Now each request tries it at most once and is served by the peer."""
    svc, ch, fakes, _ = stack(max_attempts=3)
    opened: list = []
    try:
        bad = AlwaysFails(f"{role}-bad", role)
        svc.registry.add(bad.worker_id, role, _serve_fake(bad, opened))
        for r in ("prefill", "decode"):
            svc.registry.add(fakes[r][0].worker_id, r, fakes[r][1])
        stub = pbg.EntrypointStub(ch)
        method = role.capitalize()
        for _ in range(5):
            events = list(stub.Generate(pb.GenerateRequest(token_ids=[1, 2, 3, 4],
                                                           sampling=pb.Sampling(max_new_tokens=3)), timeout=30))
            assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2]
        assert _calls([bad], method) <= 5 and _calls([fakes[role][0]], method) == 5
        assert {i.worker_id for i in svc.registry.ready(role)} == {bad.worker_id, fakes[role][0].worker_id}
    finally:
        for close in opened:
            close(None)


class TimedFailsOnce(FailsOnce):
    """``FailsOnce`` that notes when each Prefill and Decode call arrived."""

    def __init__(self, worker_id: str, role: str):
        super().__init__(worker_id, role)
        self.arrived: list[float] = []

    def _record(self, method: str, context) -> None:
        super()._record(method, context)
        if method != "Status":
            self.arrived.append(time.monotonic())


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_retry_after_failed_here_waits_a_little_first(stack, role):
    """Before: the retry after INTERNAL was immediate (a few ms after the failure), so the requests
    of one failed engine step, all retried at once, shared an engine step again. Now it waits at
    least the low end of ``retry_backoff_s`` (20 ms)."""
    svc, ch, fakes, _ = stack(max_attempts=3)
    opened: list = []
    try:
        flaky = TimedFailsOnce(f"{role}-flaky", role)
        svc.registry.add(flaky.worker_id, role, _serve_fake(flaky, opened))
        other = "decode" if role == "prefill" else "prefill"
        svc.registry.add(fakes[other][0].worker_id, other, fakes[other][1])
        events = list(pbg.EntrypointStub(ch).Generate(
            pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=3)), timeout=30))
        assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2]
        assert len(flaky.arrived) == 2 and flaky.arrived[1] - flaky.arrived[0] >= 0.02, flaky.arrived
    finally:
        for close in opened:
            close(None)


class StepBatcher(FakeWorker):
    """Prefills form engine steps: a step closes with 2 requests, or ``window_s`` after its first
    (the very first step waits for 2); a step holding ``POISON`` fails all its requests with
    INTERNAL, as ``entrypoint.worker`` does."""

    def __init__(self, worker_id: str, role: str, window_s: float = 0.05):
        super().__init__(worker_id, role)
        self.window_s, self.cond, self.steps = window_s, threading.Condition(), []

    def Prefill(self, request, context):
        self._record("Prefill", context)
        with self.cond:
            now = time.monotonic()
            step = self.steps[-1] if self.steps else None
            if step is None or len(step["prompts"]) >= 2 or (len(self.steps) > 1 and now > step["t"] + self.window_s):
                step = {"t": now, "prompts": []}
                self.steps.append(step)
            step["prompts"].append(list(request.token_ids))
            self.cond.notify_all()
            first = len(self.steps) == 1
            self.cond.wait_for(lambda: len(step["prompts"]) >= 2, timeout=5 if first else self.window_s)
        if any(POISON in p for p in step["prompts"]):
            context.abort(grpc.StatusCode.INTERNAL, "engine step failed: poisoned")
        return pb.PrefillReply(first_token=FIRST_TOKEN, stats="{}")


def test_the_batch_mate_of_a_poison_request_is_served_on_its_retry(stack, monkeypatch):
    """One prefill worker; a poison request and a good one share an engine step, which fails both.
    Before: both were retried at once, shared the next step too, and the good one failed as well
    (max_attempts 2). Now their retries wait different times (the draws are fixed here, 20 and
    120 ms) and land in different steps: the good one is served."""
    draws = iter([0.02, 0.12, 0.02, 0.12])
    monkeypatch.setattr("random.uniform", lambda low, high: next(draws))
    svc, ch, fakes, _ = stack(max_attempts=2)
    opened: list = []
    try:
        batcher = StepBatcher("prefill-batching", "prefill")
        svc.registry.add(batcher.worker_id, "prefill", _serve_fake(batcher, opened))
        svc.registry.add(fakes["decode"][0].worker_id, "decode", fakes["decode"][1])
        stub = pbg.EntrypointStub(ch)

        def one(prompt: list[int]) -> str:
            try:
                list(stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=pb.Sampling(max_new_tokens=2)),
                                   timeout=30))
                return "OK"
            except grpc.RpcError as exc:
                return exc.code().name

        with ThreadPoolExecutor(2) as pool:
            poison, mate = pool.map(one, ([1, 2, POISON, 4], [1, 2, 3, 4]))
        assert (poison, mate) == ("INTERNAL", "OK"), batcher.steps
    finally:
        for close in opened:
            close(None)


def test_the_wait_before_a_retry_is_bounded_by_the_clients_remaining_time(stack):
    """With a 5 s backoff and a client that has 0.5 s, the request ends at the client's deadline,
    not 5 s later."""
    svc, ch, fakes, _ = stack(max_attempts=3, retry_backoff_s=(5.0, 5.0))
    opened: list = []
    try:
        flaky = FailsOnce("prefill-flaky", "prefill")
        svc.registry.add(flaky.worker_id, "prefill", _serve_fake(flaky, opened))
        svc.registry.add(fakes["decode"][0].worker_id, "decode", fakes["decode"][1])
        t = time.monotonic()
        with pytest.raises(grpc.RpcError) as ei:
            list(pbg.EntrypointStub(ch).Generate(
                pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=3)), timeout=0.5))
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        while svc._slots._value != svc.cfg.max_inflight and time.monotonic() - t < 4.0:
            time.sleep(0.01)  # the service's own side of the request ends once the client's time is up
        assert svc._slots._value == svc.cfg.max_inflight and time.monotonic() - t < 4.5  # not after the 5 s wait
        assert [i.worker_id for i in svc.registry.ready("prefill")] == [flaky.worker_id]
    finally:
        for close in opened:
            close(None)


@pytest.mark.parametrize("value", [(0.1, 0.05), (-0.01, 0.1), (0.0, float("inf")), (0.1,), [0.02, 0.1], (True, 1.0)])
def test_retry_backoff_s_must_be_a_low_high_pair_of_seconds(value):
    from engine_plugin.reference import model_preset

    with pytest.raises(kvstore.InvalidRequest, match="retry_backoff_s"):
        EntrypointConfig(namespace=model_preset("tiny").namespace(), retry_backoff_s=value)
