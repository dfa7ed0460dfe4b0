"""Three edges of request handling: a decode stream that ends with an error after its last
token (the request is complete), a VE cache shared by tenants who send one image at different
token lengths (what one is told never depends on the other), and a worker restarted at a dead
worker's address under a new id (the dead id stays down)."""

from __future__ import annotations

import json

import grpc
import pytest

from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from tests.entrypoint.test_service import FIRST_TOKEN, FakeWorker, _serve_fake, stack  # noqa: F401 - fixture


# ----------------------------------------------------------------------------- 1. error after the last token


class FailsAfterLastToken(FakeWorker):
    """Sends every token of the stream, then fails with ``code`` instead of its stats event, as a
    worker does when it dies (UNAVAILABLE) or its handler raises (UNKNOWN) while it flushes its
    saves after the last token."""

    def __init__(self, worker_id: str, role: str, code: grpc.StatusCode):
        super().__init__(worker_id, role)
        self.code = code

    def Decode(self, request, context):
        self._record("Decode", context)
        for i in range(len(request.generated), request.sampling.max_new_tokens):
            yield pb.DecodeEvent(token_id=i, index=i)
        context.abort(self.code, "flush after the last token failed")


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL])
def test_an_error_after_every_token_was_delivered_does_not_fail_the_request(stack, code):
    """Every token is delivered on the only (last allowed) attempt; the worker's stream then ends
    with an error instead of its stats. The request is complete (as for a stream that stalls after
    its last token), so the client gets its "done" and status OK, not an error."""
    svc, ch, fakes, _ = stack(max_attempts=1)
    opened: list = []
    try:
        w = FailsAfterLastToken("d-flush", "decode", code)
        svc.registry.add(w.worker_id, "decode", _serve_fake(w, opened))
        svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
        req = pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=4))
        events = []
        try:
            for ev in pbg.EntrypointStub(ch).Generate(req, timeout=30):
                events.append(ev)
            status = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            status = exc.code()
        assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2, 3]  # all delivered
        assert status == grpc.StatusCode.OK and events[-1].kind == "done", (status, events[-1].kind)
    finally:
        for close in opened:
            close(None)


def test_an_internal_after_every_token_does_not_strike_the_worker_that_served_it(stack):
    """max_attempts 3, avoid_after 1: the worker served every token, then its stream ended INTERNAL
    (its flush raised). Its worker is not struck (nor avoided) for a request it served, and no
    "failover" hop is sent with nothing left to resume."""
    svc, ch, fakes, _ = stack(max_attempts=3, avoid_after=1)
    opened: list = []
    try:
        w = FailsAfterLastToken("d-flush", "decode", grpc.StatusCode.INTERNAL)
        svc.registry.add(w.worker_id, "decode", _serve_fake(w, opened))
        svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
        req = pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=4))
        events = list(pbg.EntrypointStub(ch).Generate(req, timeout=30))
        assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2, 3]
        hops = [json.loads(e.detail)["hop"] for e in events if e.kind == "hop"]
        inst = svc.registry.instances("decode")[0]
        assert (inst.strikes, svc.strikes.avoided(inst), "failover" in hops) == (0, False, False)
    finally:
        for close in opened:
            close(None)


# ----------------------------------------------------------------------------- 2. VE cache across tenants


class _VEContext:
    """A servicer context carrying ``scope`` as the entrypoint sends it; ``abort`` raises."""

    def __init__(self, scope: str):
        self.scope = scope

    def invocation_metadata(self):
        from entrypoint.vision import SCOPE_METADATA
        return ((SCOPE_METADATA, self.scope),)

    def abort(self, code, details):
        raise RuntimeError(f"{code}: {details}")


def _ve_service():
    from engine_plugin.reference import model_preset
    from entrypoint.vision import VisionEncoder
    from entrypoint.worker import WorkerConfig, WorkerService

    cfg = model_preset("tiny")
    return WorkerService(WorkerConfig(role="ve", worker_id="ve0"), None, VisionEncoder(cfg.vocab_size, seed=cfg.seed))


def test_another_tenants_image_at_another_length_changes_nothing_a_tenant_is_told():
    """Tenant A sends image X at length 4; tenant B then sends the same bytes at length 8. A's
    Encode of X by hash alone at length 4 is still served, and at length 8 (which A never sent) is
    still refused: what A is told does not depend on B's images (``entrypoint.vision``, "Trust")."""
    from entrypoint.vision import tenant_scope
    from kvstore.keys import image_hash

    svc = _ve_service()
    a, b = _VEContext(tenant_scope("a", b"salt-a")), _VEContext(tenant_scope("b", b"salt-b"))
    x = b"the shared picture " * 30
    h = image_hash(x)

    def enc(ctx, length, data=x):
        return svc.Encode(pb.EncodeRequest(request_id="r", image=pb.ImageSegment(
            image_hash=h, image_data=data, start=0, length=length)), ctx)

    assert enc(a, 4).cache_hit is False
    assert enc(a, 4, data=b"").cache_hit is True  # A's own entry, by hash alone: served
    # Without B: A asking length 8 by hash alone is refused (A never sent X for 8 tokens).
    with pytest.raises(RuntimeError, match="INVALID_ARGUMENT"):
        enc(a, 8, data=b"")
    enc(b, 8)  # tenant B sends the same image, 8 tokens
    told = {}
    for name, length in (("a 4 by hash", 4), ("a 8 by hash", 8)):
        try:
            told[name] = enc(a, length, data=b"").cache_hit
        except RuntimeError as exc:
            told[name] = "refused" if "INVALID_ARGUMENT" in str(exc) else str(exc)
    assert told == {"a 4 by hash": True, "a 8 by hash": "refused"}, told


# ----------------------------------------------------------------------------- 3. a dead id back in rotation


def _serve_at(fake: FakeWorker, port: int):
    from concurrent.futures import ThreadPoolExecutor

    from entrypoint.rpc import make_server

    server, bound = make_server(ThreadPoolExecutor(4), [(fake, pb.DESCRIPTOR.services_by_name["Worker"])],
                                "127.0.0.1", port)
    server.start()
    return server, f"127.0.0.1:{bound}", bound


def test_a_crashed_workers_id_stays_down_when_another_worker_answers_at_its_address(stack):
    """Decode worker "d-old" (default ids are random per start) dies without deregistering; it is
    restarted at the same --port under a new id "d-new" and registers. The heartbeat of d-old's
    address, where d-new now answers, keeps d-old down: one engine is never in rotation twice
    (the Decode LB would give it about twice its free KV between two heartbeats)."""
    svc, _, _, _ = stack()
    old = FakeWorker("d-old", "decode")
    server, addr, port = _serve_at(old, 0)
    svc.registry.add("d-old", "decode", addr)
    server.stop(None).wait()  # the process dies; it never deregisters
    svc.registry.poll_once(), svc.registry.poll_once(), svc.registry.poll_once()
    assert [i.worker_id for i in svc.registry.ready("decode")] == []
    new = FakeWorker("d-new", "decode")  # restarted at the same port, with a new id
    server2, addr2, _ = _serve_at(new, port)
    try:
        assert addr2 == addr
        import time
        deadline = time.monotonic() + 20  # the channel to the port reconnects after its backoff
        polled = grpc.StatusCode.UNAVAILABLE
        while polled == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline:
            polled = svc.registry._poll(svc.registry.instances("decode")[0])  # d-old's address: d-new answers
            time.sleep(0.2)
        assert polled is not None  # answered, as another worker: not up
        svc.registry.add("d-new", "decode", addr2)
        svc.registry.poll_once()
        ready = sorted(i.worker_id for i in svc.registry.ready("decode"))
        assert ready == ["d-new"], ready
    finally:
        server2.stop(None)
