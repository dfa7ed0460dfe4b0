"""A worker's shutdown (``entrypoint.engine_runner``, "Stopping"): every request its runner holds
ends UNAVAILABLE ("shutting down") at once, and so does each one submitted later; the Decode RPC
waiting on one ends with that status, and the entrypoint marks the worker down and resumes the
stream on another decode worker after the tokens already sent."""

from __future__ import annotations

import json
import queue
import time
from concurrent import futures

import grpc
import pytest
import torch

from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
from engine_plugin.reference import Engine, EngineConfig, ReferenceModel, SamplingParams, model_preset
from entrypoint.engine_runner import EngineRunner
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from entrypoint.rpc import make_server
from entrypoint.worker import WorkerConfig, WorkerService
from tests.entrypoint.test_service import FIRST_TOKEN, stack  # noqa: F401 - fixture

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(model_preset("tiny"))


@pytest.fixture
def runners(model):
    """``make()`` -> a new runner whose engine steps take about 20 ms (so a long request is still in
    the engine when the test stops it); every one made is stopped and closed at the end."""
    made: list = []

    def make() -> EngineRunner:
        conn = KVStoreConnector(model.kv_layout(), ConnectorConfig(block_size=16))  # no store: tiers only
        eng = Engine(model, EngineConfig(block_size=16, num_blocks=64), connector=conn)
        real_step = eng.step

        def slow_step():
            time.sleep(0.02)
            real_step()
        eng.step = slow_step
        r = EngineRunner(eng, conn)
        made.append((r, conn))
        return r

    yield make
    for r, conn in made:
        r.stop()
        conn.close()


def _serve_decode(runner: EngineRunner, worker_id: str, opened: list) -> str:
    """A decode ``WorkerService`` over ``runner``, served on loopback; its address."""
    svc = WorkerService(WorkerConfig(role="decode", worker_id=worker_id), runner, None)
    server, port = make_server(futures.ThreadPoolExecutor(max_workers=4),
                               [(svc, pb.DESCRIPTOR.services_by_name["Worker"])], "127.0.0.1", 0)
    server.start()
    opened.append(server.stop)
    return f"127.0.0.1:{port}"


def _next_event(h, timeout: float = 30.0) -> tuple:
    try:
        return h.events.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError("no event within the timeout") from None


def test_stopping_the_runner_ends_every_request_it_holds_unavailable(runners):
    """A long request is in the engine (its first token sent) when the runner stops. Before: it got
    no final event at all (its RPC waited until grpc cut it), and a request submitted after the stop
    waited for ever in the inbox. Now both end UNAVAILABLE, saying the worker is shutting down."""
    runner = runners()
    h = runner.submit("long", list(range(1, 21)), SamplingParams(max_new_tokens=1000), tenant_salt=b"", images=[])
    assert _next_event(h)[0] == "token"
    runner.stop()
    ev = _next_event(h, timeout=10)
    while ev[0] == "token":
        ev = _next_event(h, timeout=10)
    assert ev[:2] == ("error", grpc.StatusCode.UNAVAILABLE) and "shutting down" in ev[2], ev
    assert not runner._live and runner.broken and "shutting down" in runner.broken
    late = runner.submit("late", [1, 2, 3], SamplingParams(max_new_tokens=3), tenant_salt=b"", images=[])
    ev = _next_event(late, timeout=10)
    assert ev[:2] == ("error", grpc.StatusCode.UNAVAILABLE) and "shutting down" in ev[2], ev
    runner.stop()  # again: nothing more to do
    assert h.events.empty() and late.events.empty()


def test_a_decode_in_flight_when_the_worker_stops_ends_unavailable_not_silently(runners):
    """A Decode stream has sent 3 tokens when its worker's runner stops. Before: the stream sent
    nothing more and never ended (here: until its 20 s deadline); now it ends UNAVAILABLE at once."""
    runner, opened = runners(), []
    try:
        ch = grpc.insecure_channel(_serve_decode(runner, "d", opened))
        req = pb.DecodeRequest(request_id="long", token_ids=list(range(1, 21)),
                               sampling=pb.Sampling(max_new_tokens=1000))
        call = pbg.WorkerStub(ch).Decode(req, timeout=20)
        assert [next(call).index for _ in range(3)] == [0, 1, 2]
        runner.stop()
        with pytest.raises(grpc.RpcError) as ei:
            for _ in call:
                pass
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in ei.value.details()
        ch.close()
    finally:
        for close in opened:
            close(None)


def test_the_entrypoint_resumes_a_stream_whose_decode_worker_shuts_down_on_another(stack, runners):
    """Two real decode workers; the one the stream starts on stops after the client has 4 tokens. The
    entrypoint marks it down and resumes the stream on the other after the tokens sent: the client
    gets every token once, in order, the same tokens as a request served by the other alone."""
    svc, ch, fakes, _ = stack(max_attempts=3)
    first, second, opened = runners(), runners(), []
    try:
        svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
        svc.registry.add("dec-a", "decode", _serve_decode(first, "dec-a", opened))  # ties go to the first
        svc.registry.add("dec-b", "decode", _serve_decode(second, "dec-b", opened))
        stub = pbg.EntrypointStub(ch)
        req = pb.GenerateRequest(token_ids=list(range(1, 21)), sampling=pb.Sampling(max_new_tokens=40))
        events = []
        for ev in stub.Generate(req, timeout=120):
            events.append(ev)
            if ev.kind == "token" and ev.index == 3:
                first.stop()
        hops = [json.loads(e.detail) for e in events if e.kind == "hop"]
        assert [h["worker"] for h in hops if h["hop"] == "decode_start"] == ["dec-a", "dec-b"], hops
        fo = [h for h in hops if h["hop"] == "failover"]
        assert len(fo) == 1 and fo[0]["worker"] == "dec-a" and "UNAVAILABLE" in fo[0]["code"], fo
        tokens = [e for e in events if e.kind == "token"]
        assert [e.index for e in tokens] == list(range(40)) and events[-1].kind == "done"
        assert [i.worker_id for i in svc.registry.ready("decode")] == ["dec-b"]
        again = [e.token_id for e in stub.Generate(req, timeout=120) if e.kind == "token"]  # dec-b alone
        assert [e.token_id for e in tokens] == again and again[0] == FIRST_TOKEN
    finally:
        for close in opened:
            close(None)
