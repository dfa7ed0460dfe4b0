"""End to end on loopback: the entrypoint, real worker processes running the reference
engine with the plugin, the kvstore daemon. Tokens are compared with a cold run of the
same request on a single in-process engine without any cache."""

from __future__ import annotations

import json
import os
import signal

import grpc
import pytest

from engine_plugin.reference import model_preset
from entrypoint.instances import kv_namespace_pb
from entrypoint.proto import serving_pb2 as pb
from entrypoint.vision import VisionEncoder
from entrypoint.walkthrough.launcher import Cluster
from kvstore.keys import image_hash

# The whole serving stack in processes: the test command's second stage (marker e2e).
pytestmark = pytest.mark.e2e

MODEL = "tiny"


def cold_tokens(prompt, max_new):
    from engine_plugin.reference import Engine, EngineConfig, ReferenceModel, SamplingParams, model_preset

    eng = Engine(ReferenceModel(model_preset(MODEL)), EngineConfig(block_size=16, num_blocks=256))
    return eng.generate(prompt, SamplingParams(max_new_tokens=max_new)).output


def splice(prompt, img_bytes, start, length):
    from engine_plugin.reference import model_preset

    cfg = model_preset(MODEL)
    toks = VisionEncoder(cfg.vocab_size, seed=cfg.seed).encode(img_bytes, length)
    out = list(prompt)
    out[start:start + length] = toks
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"), ve=1, prefill=1, decode=2, model=MODEL, store="daemon",
                entrypoint_args=("--tenant", "a=salt-a", "--tenant", "b=salt-b"))
    with c:
        yield c


def _prompt(seed, n):
    import random

    r = random.Random(seed)
    return [r.randrange(1, 128) for _ in range(n)]


def test_generate_matches_cold_and_second_turn_hits_the_store(cluster):
    cl = cluster.client()
    prompt = _prompt(1, 150)
    img = os.urandom(3000)
    seg = pb.ImageSegment(image_hash=image_hash(img), image_data=img, start=40, length=20)
    toks, hops, summary = cl.generate(prompt, max_new_tokens=12, images=[seg])
    full = splice(prompt, img, 40, 20)
    assert toks == cold_tokens(full, 12)
    assert [h["hop"] for h in hops][:3] == ["ve", "lookup", "prefill"]
    # Turn 2 re-sends turn 1 plus more: most of its prefix comes from the store.
    prompt2 = prompt + toks + _prompt(2, 40)
    toks2, hops2, _ = cl.generate(prompt2, max_new_tokens=8, images=[seg])
    assert toks2 == cold_tokens(splice(prompt2, img, 40, 20), 8)
    ve, lookup, prefill = hops2[0], hops2[1], hops2[2]
    assert ve["cache_hit"] is True
    assert lookup["hit_blocks"] >= 9
    assert prefill["hit_tokens"] >= 9 * 16 and prefill["prefilled_tokens"] < len(prompt2) - 100


def test_sigkill_decode_worker_mid_stream_same_tokens(cluster):
    cl = cluster.client()
    prompt = _prompt(3, 120)
    expected = cold_tokens(prompt, 200)
    victim: list[str] = []
    serving: list[str] = []

    def on_event(ev):
        if ev.kind == "hop":
            d = json.loads(ev.detail)
            if d["hop"] == "decode_start":
                serving.append(d["worker"])
        if ev.kind == "token" and ev.index == 10 and not victim:
            victim.append(serving[-1])
            cluster.kill(serving[-1], signal.SIGKILL)  # the worker serving this stream dies mid-stream

    toks, hops, summary = cl.generate(prompt, max_new_tokens=200, on_event=on_event)
    assert toks == expected
    assert [h for h in hops if h["hop"] == "failover"] and len(summary["failovers"]) == 1
    assert serving[-1] != victim[0]
    # A restart brings the capacity back for the other tests.
    cluster.start_worker("decode", victim[0])


@pytest.mark.parametrize("req, code", [
    (pb.GenerateRequest(token_ids=[]), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(token_ids=[1, 2, 3], images=[pb.ImageSegment(image_hash=b"h", start=2, length=5)]),
     grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(token_ids=[1, 2, 3], tenant="nobody"), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(token_ids=[1, 2, 3], sampling=pb.Sampling(temperature=float("nan"))),
     grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(token_ids=[1, 2, 3], sampling=pb.Sampling(temperature=-1.0)),
     grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(token_ids=[1, 2, 3], sampling=pb.Sampling(temperature=float("inf"))),
     grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(token_ids=[1] * 40, images=[
        pb.ImageSegment(image_hash=image_hash(b"img1" * 50), image_data=b"img2" * 50, start=2, length=8)]),
     grpc.StatusCode.INVALID_ARGUMENT),
    (pb.GenerateRequest(token_ids=[1] * 40, images=[
        pb.ImageSegment(image_hash=image_hash(b"x" * 50), image_data=b"x" * 50, start=2, length=8),
        pb.ImageSegment(image_hash=image_hash(b"y" * 50), image_data=b"y" * 50, start=9, length=8)]),
     grpc.StatusCode.INVALID_ARGUMENT),
], ids=["empty", "image_outside", "unknown_tenant", "temperature_nan", "temperature_negative",
        "temperature_inf", "image_hash_mismatch", "image_spans_overlap"])
def test_bad_requests_get_clear_errors(cluster, req, code):
    with pytest.raises(grpc.RpcError) as ei:
        list(cluster.client().stub.Generate(req, timeout=30))
    assert ei.value.code() == code and ei.value.details()


def test_an_image_hash_cannot_poison_or_read_another_tenants_image(cluster):
    """Before: B's img2 bytes under H(img1) were encoded and cached as img1 for every tenant,
    and B could get A's image tokens by sending A's hash with no bytes."""
    cl = cluster.client()
    prompt = _prompt(11, 60)
    img1, img2 = os.urandom(2000), os.urandom(2000)
    real = pb.ImageSegment(image_hash=image_hash(img1), image_data=img1, start=5, length=10)
    forged = pb.ImageSegment(image_hash=image_hash(img1), image_data=img2, start=5, length=10)
    with pytest.raises(grpc.RpcError) as ei:
        cl.generate(prompt, max_new_tokens=2, images=[forged], tenant="b")
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not match" in ei.value.details()
    toks, hops, _ = cl.generate(prompt, max_new_tokens=4, images=[real], tenant="a")
    assert toks == cold_tokens(splice(prompt, img1, 5, 10), 4)
    hash_only = pb.ImageSegment(image_hash=image_hash(img1), start=5, length=10)
    with pytest.raises(grpc.RpcError) as ei:
        cl.generate(prompt, max_new_tokens=2, images=[hash_only], tenant="b")
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    toks_again, hops, _ = cl.generate(prompt, max_new_tokens=4, images=[hash_only], tenant="a")
    assert toks_again == toks and hops[0]["cache_hit"] is True


def test_a_prompt_too_big_for_the_prefill_pool_fails_alone(cluster):
    """The prefill worker's pool (1024 blocks of 16) can never hold this prompt: that request
    is refused, and the worker keeps serving (before: it failed every later request while
    its heartbeat still said it was up). One new token: no decode hop, so the entrypoint's own
    check that a decode worker could hold it (``Dispatch.check_decode_fits``) does not refuse
    it first, and the prefill worker's refusal is what is tested."""
    cl = cluster.client()
    with pytest.raises(grpc.RpcError) as ei:
        cl.generate(_prompt(8, 1024 * 16 + 1), max_new_tokens=1, timeout=120)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "blocks" in ei.value.details()
    with pytest.raises(grpc.RpcError) as ei:  # with a decode hop: no decode pool could hold it, refused first
        cl.generate(_prompt(8, 1024 * 16 + 1), max_new_tokens=2, timeout=120)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "even when empty" in ei.value.details()
    prompt = _prompt(9, 60)
    for _ in range(2):
        toks, _, _ = cl.generate(prompt, max_new_tokens=4)
        assert toks == cold_tokens(prompt, 4)


def test_deadline_and_cancellation_leave_the_service_healthy(cluster):
    cl = cluster.client()
    prompt = _prompt(5, 100)
    with pytest.raises(grpc.RpcError) as ei:
        list(cl.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=pb.Sampling(max_new_tokens=400)),
                              timeout=0.3))
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stream = cl.stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=pb.Sampling(max_new_tokens=400)),
                              timeout=60)
    for ev in stream:
        if ev.kind == "token":
            stream.cancel()  # the client goes away after the first token
            break
    with pytest.raises(grpc.RpcError) as ei:
        next(stream)
    assert ei.value.code() == grpc.StatusCode.CANCELLED
    # Neither the deadline nor the cancel counts as a worker failure: all are still up and serving.
    workers = cl.stub.ListWorkers(pb.Empty(), timeout=10).workers
    assert len(workers) == 4
    toks, _, _ = cl.generate(prompt, max_new_tokens=6)
    assert toks == cold_tokens(prompt, 6)


@pytest.mark.parametrize("md", [(), (("authorization", "Bearer not-the-stack-secret-0123456789"),)],
                         ids=["no_secret", "wrong_secret"])
def test_workers_refuse_direct_calls_without_the_secret_and_do_nothing(cluster, md):
    """Before: any local process could call a worker directly, with any tenant's salt or VE scope,
    past the entrypoint's tenant handling and limits. Now each method is UNAUTHENTICATED and does
    no work; the same requests through the entrypoint are served."""
    import kvstore
    from engine_plugin.reference import model_preset
    from entrypoint.proto import serving_pb2_grpc as pbg
    from entrypoint.vision import scoped_image_key, tenant_scope
    from kvstore.keys import BlockHasher

    def refused(call):
        with pytest.raises(grpc.RpcError) as ei:
            call()
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, (ei.value.code(), ei.value.details())

    salt = b"salt-a"  # tenant a's: a direct caller claims to be tenant a
    prompt = _prompt(20 + len(md), 64)
    sampling = pb.Sampling(max_new_tokens=4)
    img = os.urandom(1500)
    keys = BlockHasher(model_preset(MODEL).namespace(), 16, salt).hash_blocks(prompt, [])
    channels = {name: grpc.insecure_channel(cluster.procs[name].address) for name in ("ve-0", "prefill-0", "decode-0")}
    store = kvstore.connect(cluster.store_url)
    try:
        ve, prefill, decode = (pbg.WorkerStub(ch) for ch in channels.values())
        refused(lambda: ve.Status(pb.StatusRequest(), timeout=10, metadata=md))
        refused(lambda: ve.Encode(pb.EncodeRequest(image=pb.ImageSegment(
            image_hash=image_hash(img), image_data=img, length=10)), timeout=10, metadata=md))
        refused(lambda: prefill.Prefill(pb.PrefillRequest(request_id="direct", token_ids=prompt, tenant_salt=salt,
                                                          sampling=sampling), timeout=60, metadata=md))
        streamed = []
        refused(lambda: streamed.extend(decode.Decode(pb.DecodeRequest(
            request_id="direct", token_ids=prompt, generated=[1], tenant_salt=salt, sampling=sampling),
            timeout=60, metadata=md)))
        assert streamed == []  # not one token
        # Nothing was done: no image tokens cached, no KV written to the store under tenant a's salt.
        cached = ve.Status(pb.StatusRequest(), timeout=10, metadata=cluster.worker_metadata()).cached_images
        assert not {scoped_image_key(sc.encode(), image_hash(img))  # under no scope (cached_images are scoped)
                    for sc in ("", tenant_scope("a", salt), tenant_scope("default", b""))} & set(cached)
        assert store.lookup(keys).hit_blocks == 0
        # The entrypoint's own calls carry the secret: the same prompt, as tenant a, is served.
        toks, _, _ = cluster.client().generate(prompt, max_new_tokens=4, tenant="a")
        assert toks == cold_tokens(prompt, 4)
        assert store.lookup(keys).hit_blocks == len(keys)  # (the check above would have seen a write)
    finally:
        store.close()
        for ch in channels.values():
            ch.close()


def _live_workers(cl) -> dict[str, str]:
    return {w.worker_id: w.address for w in cl.stub.ListWorkers(pb.Empty(), timeout=10).workers}


def test_workers_join_and_leave_at_run_time(cluster):
    cl = cluster.client()
    md = cluster.worker_metadata()
    info = next(w for w in cl.stub.ListWorkers(pb.Empty(), timeout=10).workers if w.role == "decode")
    # Without the stack's worker secret, no process can remove a worker or re-point it at itself.
    forged = pb.WorkerInfo(worker_id=info.worker_id, role="decode", address="127.0.0.1:9")
    for call, msg in ((cl.stub.Deregister, info), (cl.stub.Register, forged)):
        with pytest.raises(grpc.RpcError) as ei:
            call(msg, timeout=10)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _live_workers(cl)[info.worker_id] == info.address
    assert cl.stub.Deregister(info, timeout=10, metadata=md).ok
    assert info.worker_id not in {w.worker_id for w in cl.stub.ListWorkers(pb.Empty(), timeout=10).workers}
    prompt = _prompt(6, 70)
    toks, hops, _ = cl.generate(prompt, max_new_tokens=6)  # served by the decode worker that is left
    assert toks == cold_tokens(prompt, 6)
    assert all(h["worker"] != info.worker_id for h in hops if h["hop"] == "decode_start")
    assert cl.stub.Register(info, timeout=10, metadata=md).ok
    assert info.worker_id in {w.worker_id for w in cl.stub.ListWorkers(pb.Empty(), timeout=10).workers}


@pytest.mark.parametrize("service, method", [
    (s, m.name) for s in ("Entrypoint", "Worker") for m in pb.DESCRIPTOR.services_by_name[s].methods])
@pytest.mark.parametrize("raw", [b"\xff", b"\x0a\x05ab"], ids=["bad_tag", "truncated"])
def test_undecodable_request_bytes_are_invalid_argument_on_every_method(cluster, service, method, raw):
    """Before: gRPC's own INTERNAL "Exception deserializing request!" (read as a server bug, and as
    a retryable worker failure by the entrypoint's failover)."""
    m = pb.DESCRIPTOR.services_by_name[service].methods_by_name[method]
    if service == "Entrypoint":
        address = cluster.entrypoint_address
    else:
        address = cluster.procs["ve-0"].address
    with grpc.insecure_channel(address) as ch:
        path = f"/{m.containing_service.full_name}/{m.name}"
        call = (ch.unary_stream if m.server_streaming else ch.unary_unary)(
            path, request_serializer=None, response_deserializer=None)  # raw bytes both ways
        with pytest.raises(grpc.RpcError) as ei:
            res = call(raw, timeout=10, metadata=cluster.worker_metadata())
            list(res) if m.server_streaming else res
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (ei.value.code(), ei.value.details())
    assert f"malformed {method} request" in ei.value.details()
    assert m.input_type.full_name in ei.value.details()


def test_backpressure_answers_resource_exhausted(tmp_path):
    with Cluster(tmp_path, ve=0, prefill=1, decode=1, model=MODEL, store="embedded",
                 entrypoint_args=("--max-inflight", "1")) as c:
        stub = c.client().stub
        first = stub.Generate(pb.GenerateRequest(token_ids=_prompt(7, 200), sampling=pb.Sampling(max_new_tokens=300)),
                              timeout=120)
        next(first)  # the first request holds the only slot while it streams
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(pb.GenerateRequest(token_ids=[1, 2, 3]), timeout=30))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in ei.value.details()
        assert sum(1 for ev in first if ev.kind == "token") > 0


def test_a_non_retryable_decode_error_reaches_the_client_without_failover(tmp_path):
    """Before: any decode error marked the worker down and failed over (here: to nothing,
    UNAVAILABLE); a FAILED_PRECONDITION is the request's fault and goes back as it is."""
    import time
    from concurrent import futures

    from entrypoint.proto import serving_pb2_grpc as pbg

    calls = []

    class RefusingDecode(pbg.WorkerServicer):
        def Status(self, request, context):
            return pb.WorkerStatus(worker_id="fake-decode", role="decode", kv_capacity_bytes=1 << 30)

        def Decode(self, request, context):
            calls.append(request.request_id)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "injected: this request cannot be decoded")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pbg.add_WorkerServicer_to_server(RefusingDecode(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Cluster(tmp_path, ve=0, prefill=1, decode=0, model=MODEL, store="embedded") as c:
            cl = c.client()
            info = pb.WorkerInfo(worker_id="fake-decode", role="decode", address=f"127.0.0.1:{port}",
                                 kv_namespace=kv_namespace_pb(model_preset(MODEL).namespace()), block_size=16)
            assert cl.stub.Register(info, timeout=10, metadata=c.worker_metadata()).ok
            deadline = time.monotonic() + 30
            while "fake-decode" not in {w.worker_id for w in cl.stub.ListWorkers(pb.Empty(), timeout=10).workers}:
                assert time.monotonic() < deadline, "the fake decode worker never became ready"
                time.sleep(0.1)
            with pytest.raises(grpc.RpcError) as ei:
                cl.generate(_prompt(12, 40), max_new_tokens=4, timeout=60)
            assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "injected" in ei.value.details()
            assert len(calls) == 1
            assert "fake-decode" in {w.worker_id for w in cl.stub.ListWorkers(pb.Empty(), timeout=10).workers}
    finally:
        server.stop(grace=0).wait()
