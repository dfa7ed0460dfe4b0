"""A client's deadline and a client that goes away, at each hop (fake workers of ``test_service``):
a worker call that runs out of the client's time is DEADLINE_EXCEEDED to the client and takes no
worker down; a client that goes away cancels the worker call in flight."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

from entrypoint.dispatch import Abort
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from tests.entrypoint.test_service import FIRST_TOKEN, FakeWorker, _serve_fake, stack  # noqa: F401 - fixture


class SlowWorker(FakeWorker):
    """Prefill and Encode take ``delay_s`` (or until cancelled); Decode waits ``delay_s`` before each token."""

    def __init__(self, worker_id: str, role: str, delay_s: float):
        super().__init__(worker_id, role)
        self.delay_s = delay_s
        self.cancelled: list[float] = []  # after how long each cancelled Prefill saw its cancellation

    def Prefill(self, request, context):
        self._record("Prefill", context)
        self._wait(context)
        return pb.PrefillReply(first_token=FIRST_TOKEN, stats="{}")

    def _wait(self, context) -> None:
        t = time.monotonic()
        while time.monotonic() - t < self.delay_s:
            if not context.is_active():
                self.cancelled.append(time.monotonic() - t)
                break
            time.sleep(0.01)

    def Encode(self, request, context):
        self._record("Encode", context)
        self._wait(context)
        return pb.EncodeReply(token_ids=[5] * request.image.length)

    def Decode(self, request, context):
        self._record("Decode", context)
        for i in range(len(request.generated), request.sampling.max_new_tokens):
            time.sleep(self.delay_s)
            yield pb.DecodeEvent(token_id=i, index=i)


class ClientContext:
    """The servicer context of a client with ``deadline_s`` left that, as a real context may for a
    moment after its deadline, still reads as active (the race the entrypoint must not misread)."""

    def __init__(self, deadline_s: float):
        self.deadline = time.monotonic() + deadline_s
        self.callbacks: list = []

    def time_remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def is_active(self) -> bool:
        return True

    def add_callback(self, callback) -> bool:
        self.callbacks.append(callback)
        return True

    def invocation_metadata(self):
        return ()


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_short_client_deadline_is_the_clients_and_takes_no_worker_down(stack, role):
    """The client has 0.3 s; the ``role`` worker is slower. Before: the worker call (timeout: the
    client's remaining time) failed DEADLINE_EXCEEDED while the context still read as active, was
    taken for the worker's failure, and the healthy worker was marked down (the request then failed
    UNAVAILABLE, and so did the next ones until a heartbeat). Now: DEADLINE_EXCEEDED, worker up."""
    svc, _, fakes, _ = stack(max_attempts=3)
    opened: list = []
    try:
        slow = SlowWorker(f"slow-{role}", role, 1.0 if role == "prefill" else 0.1)
        svc.registry.add(slow.worker_id, role, _serve_fake(slow, opened))
        other = "decode" if role == "prefill" else "prefill"
        svc.registry.add(fakes[other][0].worker_id, other, fakes[other][1])
        req = pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=30))
        with pytest.raises(Abort) as ei:
            list(svc.pipeline.run(req, ClientContext(0.3)))
        assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, ei.value.message
        assert "client's deadline" in ei.value.message
        assert [i.worker_id for i in svc.registry.ready(role)] == [slow.worker_id]
        assert sum(1 for m, _ in slow.calls if m == role.capitalize()) == 1  # not retried
    finally:
        for close in opened:
            close(None)


@pytest.mark.parametrize("role", ["ve", "prefill"])
def test_a_client_that_goes_away_cancels_the_encode_or_prefill_in_flight(stack, role):
    """The client cancels while its Encode (or Prefill) runs, 30 s long. Before: these were blocking
    unary calls no one cancelled, so the worker computed on for 30 s and the entrypoint held the
    request's slot and the worker's in-flight count as long; now the worker sees the cancellation
    and both are taken back within a moment."""
    from kvstore.keys import image_hash

    svc, ch, fakes, _ = stack(max_inflight=4)
    opened: list = []
    try:
        slow = SlowWorker(f"slow-{role}", role, 30.0)
        svc.registry.add(slow.worker_id, role, _serve_fake(slow, opened))
        for other in ("prefill", "decode"):
            if other != role:
                svc.registry.add(fakes[other][0].worker_id, other, fakes[other][1])
        img = b"an image" * 10
        images = [pb.ImageSegment(image_hash=image_hash(img), image_data=img, start=2, length=4)]
        req = pb.GenerateRequest(token_ids=list(range(1, 17)), sampling=pb.Sampling(max_new_tokens=4),
                                 images=images if role == "ve" else [])
        call = pbg.EntrypointStub(ch).Generate(req, timeout=30)
        codes: list = []

        def drain() -> None:
            try:
                for _ in call:
                    pass
            except grpc.RpcError as exc:
                codes.append(exc.code())

        drainer = threading.Thread(target=drain)
        drainer.start()
        method = "Encode" if role == "ve" else "Prefill"
        for _ in range(200):  # until the worker call is in flight
            if any(m == method for m, _ in slow.calls):
                break
            time.sleep(0.01)
        time.sleep(0.2)
        call.cancel()
        drainer.join(timeout=5)
        assert codes == [grpc.StatusCode.CANCELLED]
        inst = svc.registry.instances(role)[0]
        for _ in range(1000):  # within 10 s (a loaded machine), not after the worker's 30 s
            if slow.cancelled and svc._slots._value == 4 and not inst.inflight and not inst.encodes:
                break
            time.sleep(0.01)
        assert slow.cancelled, "the worker call was not cancelled"
        assert (svc._slots._value, inst.inflight, inst.encodes) == (4, {}, 0)  # slot and counts taken back
        assert [i.worker_id for i in svc.registry.ready(role)] == [slow.worker_id]
    finally:
        for close in opened:
            close(None)



# ----------------------------------------------------------------------------- decode: inactivity, not length


class StallingDecode(FakeWorker):
    """Decode streams ``stall_at`` tokens, ``delay_s`` apart, then sends nothing for 30 s (or until cancelled)."""

    def __init__(self, worker_id: str, role: str, delay_s: float, stall_at: int = 10**9):
        super().__init__(worker_id, role)
        self.delay_s, self.stall_at = delay_s, stall_at
        self.cancelled = threading.Event()

    def Decode(self, request, context):
        self._record("Decode", context)
        for i in range(len(request.generated), request.sampling.max_new_tokens):
            if i >= self.stall_at:
                t = time.monotonic()
                while time.monotonic() - t < 30 and context.is_active():
                    time.sleep(0.01)
                self.cancelled.set()
                return
            time.sleep(self.delay_s)
            yield pb.DecodeEvent(token_id=i, index=i)


def _hops(events, name: str) -> list[dict]:
    return [d for d in (json.loads(e.detail) for e in events if e.kind == "hop") if d["hop"] == name]


def test_a_decode_stream_longer_than_worker_timeout_that_keeps_producing_is_served(stack):
    """worker_timeout_s 1 s; the stream takes about 3 s, a token every 0.1 s; the client sets no deadline
    (grpc's server context then reads ~9.2e18 s left, which no worker call can take as its timeout).
    Before: the Decode call's timeout was worker_timeout_s, so the stream was cut at 1 s, its (working)
    worker marked down, and with no other decode worker the request failed UNAVAILABLE."""
    svc, ch, fakes, _ = stack(worker_timeout_s=1.0)
    opened: list = []
    try:
        paced = StallingDecode("paced-d", "decode", 0.1)
        svc.registry.add(paced.worker_id, "decode", _serve_fake(paced, opened))
        svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
        req = pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=30))
        events = list(pbg.EntrypointStub(ch).Generate(req))  # no deadline: the stall watch bounds it
        assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN] + list(range(1, 30))
        assert _hops(events, "failover") == []
        assert sum(1 for m, _ in paced.calls if m == "Decode") == 1
        assert [i.worker_id for i in svc.registry.ready("decode")] == [paced.worker_id]
    finally:
        for close in opened:
            close(None)


def test_a_decode_stream_that_stalls_for_worker_timeout_fails_over_and_its_worker_is_down(stack):
    """The first decode worker sends 3 tokens then nothing: after worker_timeout_s (0.5 s) without an
    event its stream is cancelled, it is marked down, and the stream resumes on the other one; the
    client's own deadline (120 s) is far away."""
    svc, ch, fakes, _ = stack(worker_timeout_s=0.5, max_attempts=3)
    opened: list = []
    try:
        stuck = StallingDecode("stuck-d", "decode", 0.0, stall_at=3)
        good = StallingDecode("good-d", "decode", 0.0)
        for w in (stuck, good):
            svc.registry.add(w.worker_id, "decode", _serve_fake(w, opened))
        svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
        req = pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=8))
        t = time.monotonic()
        events = list(pbg.EntrypointStub(ch).Generate(req, timeout=120))
        assert time.monotonic() - t < 20  # not the stuck worker's 30 s
        assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN] + list(range(1, 8))
        first = _hops(events, "decode_start")[0]["worker"]
        assert first == stuck.worker_id  # ties go to the first registered
        fo = _hops(events, "failover")
        assert [f["worker"] for f in fo] == [stuck.worker_id] and "DEADLINE_EXCEEDED" in fo[0]["code"]
        assert [i.worker_id for i in svc.registry.ready("decode")] == [good.worker_id]
        assert stuck.cancelled.wait(10)  # the worker saw the cancel
    finally:
        for close in opened:
            close(None)


class _Cancellable:
    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()


def test_the_stall_watch_does_not_count_while_paused_and_fires_once_resumed_and_idle():
    """``StallWatch`` (idle 0.3 s) paused for 1.5 s does not cancel; once resumed, 0.3 s without an
    event does (within a wide 10 s bound)."""
    from entrypoint.dispatch import StallWatch

    call = _Cancellable()
    with StallWatch(call, 0.3) as watch:
        watch.pause()
        assert not call.cancelled.wait(1.5)
        assert not watch.stalled
        watch.progress()
        assert call.cancelled.wait(10)
        assert watch.stalled


def test_a_slow_client_reader_is_not_a_stalled_decode_worker(stack):
    """worker_timeout_s 1 s; the decode worker sends its tokens at once, but the client takes 3 s to
    read one of them (a slow reader, or grpc's flow control holding the write). Before: the stall
    watch counted the time the generator sat at its ``yield`` as the worker's, cancelled the stream
    and marked the healthy worker down (with no other decode worker: UNAVAILABLE). Now: served, no
    failover, the worker up."""
    svc, _, fakes, _ = stack(worker_timeout_s=1.0, max_attempts=3)
    for role in ("prefill", "decode"):
        svc.registry.add(fakes[role][0].worker_id, role, fakes[role][1])
    req = pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=6))
    events = []
    for ev in svc.pipeline.run(req, ClientContext(120)):
        events.append(ev)
        if ev.kind == "token" and ev.index == 2:
            time.sleep(3.0)
    assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN] + list(range(1, 6))
    assert _hops(events, "failover") == []
    assert [i.worker_id for i in svc.registry.ready("decode")] == [fakes["decode"][0].worker_id]


class OwnDeadlineWorker(FakeWorker):
    """Its first Prefill (or Decode) fails DEADLINE_EXCEEDED at once: a deadline of its own, not the
    client's (the client has far more time left)."""

    def _own_deadline_once(self, method: str, context) -> None:
        first = not any(m == method for m, _ in self.calls)
        self._record(method, context)
        if first:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "an internal deadline of the worker passed")

    def Prefill(self, request, context):
        self._own_deadline_once("Prefill", context)
        return pb.PrefillReply(first_token=FIRST_TOKEN, stats="{}")

    def Decode(self, request, context):
        self._own_deadline_once("Decode", context)
        yield from super().Decode(request, context)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_workers_own_deadline_exceeded_is_not_taken_for_the_clients(stack, role):
    """The client has 60 s (less than worker_timeout_s, so the worker call's timeout is the client's
    time); the ``role`` worker fails its first call DEADLINE_EXCEEDED at once. Before: that was taken
    for the client's deadline passing, and the request failed DEADLINE_EXCEEDED ("the client's
    deadline passed") with 60 s left. Now it is the worker's failure: the hop fails over, served."""
    svc, ch, fakes, _ = stack(max_attempts=3)
    opened: list = []
    try:
        own = OwnDeadlineWorker(f"own-{role}", role)
        svc.registry.add(own.worker_id, role, _serve_fake(own, opened))
        svc.registry.add(fakes[role][0].worker_id, role, fakes[role][1])
        other = "decode" if role == "prefill" else "prefill"
        svc.registry.add(fakes[other][0].worker_id, other, fakes[other][1])
        req = pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=4))
        events = list(svc.pipeline.run(req, ClientContext(60)))
        assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2, 3]
    finally:
        for close in opened:
            close(None)
