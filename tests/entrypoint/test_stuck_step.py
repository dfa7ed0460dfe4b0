"""The step watchdog (``entrypoint.engine_runner``, "Stuck steps"): an engine step that does not
return within ``step_timeout_s`` takes the worker down for good. Its requests, held or waiting,
end UNAVAILABLE naming the stuck step, ``Status`` answers UNAVAILABLE (so the heartbeat keeps it
down), a later submit fails at once, and should the step return, nothing more is published. The
entrypoint fails a stream over from such a worker to another decode worker.

Every stuck step here waits on an Event the test sets at its end (60 s at most)."""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time

import grpc
import pytest
import torch

from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
from engine_plugin.reference import Engine, EngineConfig, ReferenceModel, SamplingParams, model_preset
from entrypoint.engine_runner import DEFAULT_STEP_TIMEOUT_S, EngineRunner
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from entrypoint.worker import WorkerConfig
from kvstore.errors import InvalidRequest
from tests.entrypoint.test_service import FIRST_TOKEN, stack  # noqa: F401 - fixture
from tests.entrypoint.test_worker_shutdown import _serve_decode

torch.set_num_threads(1)

TIMEOUT_S = 0.3  # the watchdog's step_timeout_s in these tests


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(model_preset("tiny"))


class Hang:
    """Makes an engine's steps block once ``arm()`` was called, until ``release()`` (60 s at most)."""

    def __init__(self, eng: Engine) -> None:
        self.armed, self.stuck, self.released = threading.Event(), threading.Event(), threading.Event()
        self.steps_after = 0  # steps that returned after the release
        real_step = eng.step

        def step() -> None:
            if self.armed.is_set() and not self.released.is_set():
                self.stuck.set()
                self.released.wait(60)
                real_step()
                self.steps_after += 1
                return
            time.sleep(0.01)
            real_step()
        eng.step = step

    def arm(self) -> None:
        self.armed.set()

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def runners(model):
    """``make(step_timeout_s)`` -> (runner, its ``Hang``); each stuck step is released, each runner
    stopped and its connector closed at the end."""
    made: list = []

    def make(step_timeout_s: float = TIMEOUT_S) -> tuple[EngineRunner, Hang]:
        conn = KVStoreConnector(model.kv_layout(), ConnectorConfig(block_size=16))  # no store: tiers only
        eng = Engine(model, EngineConfig(block_size=16, num_blocks=64), connector=conn)
        hang = Hang(eng)
        r = EngineRunner(eng, conn, step_timeout_s=step_timeout_s)
        made.append((r, conn, hang))
        return r, hang

    yield make
    for r, conn, hang in made:
        hang.release()
        r.stop()
        conn.close()


def _next_event(h, timeout: float = 30.0) -> tuple:
    try:
        return h.events.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError("no event within the timeout") from None


def _last_event(h, timeout: float = 30.0) -> tuple:
    """The first event that is not a token."""
    ev = _next_event(h, timeout)
    while ev[0] == "token":
        ev = _next_event(h, timeout)
    return ev


def _submit(runner, rid, prompt, max_new=1000):
    return runner.submit(rid, prompt, SamplingParams(max_new_tokens=max_new), tenant_salt=b"", images=[])


def _stuck_down(ev: tuple) -> bool:
    return ev[:2] == ("error", grpc.StatusCode.UNAVAILABLE) and "this worker is down: engine step stuck" in ev[2]


def test_a_stuck_step_takes_the_worker_down_for_good_and_ends_every_request(runners, caplog):
    """A long request is streaming when its engine's next step hangs; another one is submitted
    meanwhile (it waits in the inbox). Before: both waited for ever, and Status answered OK. Now,
    once the step has run for step_timeout_s, both end UNAVAILABLE naming the stuck step, the
    worker's Status is UNAVAILABLE, a new submit fails at once, one error is logged; when the step
    returns at last, nothing more is published and the runner thread ends."""
    runner, hang = runners()
    opened: list = []
    try:
        stub = pbg.WorkerStub(grpc.insecure_channel(_serve_decode(runner, "dec-stuck", opened)))
        assert stub.Status(pb.StatusRequest(), timeout=10).worker_id == "dec-stuck"
        streaming = _submit(runner, "streaming", list(range(1, 21)))
        assert _next_event(streaming)[0] == "token"
        hang.arm()
        assert hang.stuck.wait(30), "the engine never stepped again"
        waiting = _submit(runner, "waiting", [1, 2, 3], max_new=3)
        for h in (streaming, waiting):
            ev = _last_event(h)
            assert _stuck_down(ev), ev
        assert runner.broken.startswith("engine step stuck for ") and f"step_timeout_s={TIMEOUT_S:g}" in runner.broken
        with pytest.raises(grpc.RpcError) as ei:
            stub.Status(pb.StatusRequest(), timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "engine step stuck" in ei.value.details()
        late = _submit(runner, "late", [1, 2, 3], max_new=3)
        ev = late.events.get_nowait()  # at once: submit failed it itself
        assert _stuck_down(ev), ev
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "engine step stuck" in errors[0].getMessage(), errors
        hang.release()
        runner._thread.join(timeout=30)
        assert not runner._thread.is_alive() and hang.steps_after == 1
        for h in (streaming, waiting, late):
            assert h.events.empty()  # the step that returned made a token: not published
        assert not runner._live and runner._inbox.empty()
    finally:
        for close in opened:
            close(None)


def test_steps_that_each_return_in_time_never_trip_the_watchdog(runners):
    """A stream of 40 tokens takes many times step_timeout_s in all, but each step is short: the
    watchdog times each step, not the request, and the worker stays up."""
    runner, _ = runners()
    h = _submit(runner, "long", list(range(1, 21)), max_new=40)
    tokens = 0
    while (ev := _next_event(h))[0] == "token":
        tokens += 1
    assert ev[0] == "done" and tokens == 40 and runner.broken is None


def test_a_step_timeout_of_zero_starts_no_watchdog(runners):
    runner, _ = runners(0)
    assert runner._watchdog is None and WorkerConfig(role="decode").step_timeout_s == DEFAULT_STEP_TIMEOUT_S


@pytest.mark.parametrize("value", [-1, math.nan, math.inf, "5", True])
def test_a_bad_step_timeout_is_refused_in_one_line(model, value):
    with pytest.raises(InvalidRequest, match=r"WorkerConfig.step_timeout_s must be a finite number of seconds >= 0"):
        WorkerConfig(role="decode", step_timeout_s=value)
    with pytest.raises(InvalidRequest, match=r"step_timeout_s must be a finite number of seconds >= 0"):
        EngineRunner(None, None, step_timeout_s=value)


def test_the_entrypoint_serves_a_stream_from_another_decode_worker_when_one_is_stuck(stack, runners):
    """Two real decode workers; every step of the one the stream starts on hangs. Its watchdog takes
    it down after step_timeout_s: the entrypoint fails the stream over to the other, and the client
    gets every token once, in order, the same as the other serves alone. The heartbeat then keeps
    the stuck worker down (before: its Status answered OK, and it was brought back up)."""
    svc, ch, fakes, _ = stack(max_attempts=3)
    (stuck, hang), (good, _) = runners(), runners()
    hang.arm()
    opened: list = []
    try:
        svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
        svc.registry.add("dec-a", "decode", _serve_decode(stuck, "dec-a", opened))  # ties go to the first
        svc.registry.add("dec-b", "decode", _serve_decode(good, "dec-b", opened))
        stub = pbg.EntrypointStub(ch)
        req = pb.GenerateRequest(token_ids=list(range(1, 21)), sampling=pb.Sampling(max_new_tokens=10))
        events = list(stub.Generate(req, timeout=120))
        hops = [json.loads(e.detail) for e in events if e.kind == "hop"]
        assert [h["worker"] for h in hops if h["hop"] == "decode_start"] == ["dec-a", "dec-b"], hops
        fo = [h for h in hops if h["hop"] == "failover"]
        assert len(fo) == 1 and fo[0]["worker"] == "dec-a" and "UNAVAILABLE" in fo[0]["code"], fo
        tokens = [e for e in events if e.kind == "token"]
        assert [e.index for e in tokens] == list(range(10)) and events[-1].kind == "done"
        svc.registry.poll_once()  # a heartbeat: the stuck worker answers UNAVAILABLE, so it stays down
        assert [i.worker_id for i in svc.registry.ready("decode")] == ["dec-b"]
        assert "engine step stuck" in stuck.broken
        again = [e.token_id for e in stub.Generate(req, timeout=120) if e.kind == "token"]  # dec-b alone
        assert [e.token_id for e in tokens] == again and again[0] == FIRST_TOKEN
    finally:
        hang.release()
        for close in opened:
            close(None)
