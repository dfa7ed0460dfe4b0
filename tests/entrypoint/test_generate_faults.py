"""``Generate`` against misbehaving requests and workers, in process with fake workers (the
helpers of ``test_service``): request values the LBs refuse are INVALID_ARGUMENT before any
hop, a decode stream that ends early without an error is a failed attempt (bounded), the
routing estimate reuses at most what the engine can, VE load spreads over the VE workers, and
what a tenant is told about the VE cache never depends on other tenants."""

from __future__ import annotations

import json
import math
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from lb.types import LBInputError
from tests.entrypoint.test_service import FIRST_TOKEN, FakeWorker, _serve_fake, stack  # noqa: F401 - fixture


def _register_fakes(svc, fakes) -> None:
    for role, (fake, address) in fakes.items():
        svc.registry.add(fake.worker_id, role, address)


# ----------------------------------------------------------------------------- request values


@pytest.mark.parametrize("field, value", [("ttft_slo_ms", -1.0), ("ttft_slo_ms", math.nan),
                                          ("tbt_slo_ms", -1.0), ("tbt_slo_ms", math.nan)])
def test_a_negative_or_nan_slo_is_invalid_argument_before_any_hop(stack, field, value):
    """Before: UNKNOWN ("Exception iterating responses: RouteRequest.ttft_slo_ms must be ..."),
    and for ``tbt_slo_ms`` only after the prefill ran and the first token was streamed."""
    svc, ch, fakes, _ = stack()
    _register_fakes(svc, fakes)
    req = pb.GenerateRequest(token_ids=list(range(1, 41)), sampling=pb.Sampling(max_new_tokens=4),
                             **{field: value})
    events = []
    with pytest.raises(grpc.RpcError) as ei:
        for ev in pbg.EntrypointStub(ch).Generate(req, timeout=30):
            events.append(ev)
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value.details()
    assert field in ei.value.details()
    assert events == [] and fakes["prefill"][0].prefills == []


def test_inf_and_zero_slos_mean_none_and_are_served(stack):
    svc, ch, fakes, _ = stack()
    _register_fakes(svc, fakes)
    req = pb.GenerateRequest(token_ids=list(range(1, 41)), sampling=pb.Sampling(max_new_tokens=3),
                             ttft_slo_ms=math.inf, tbt_slo_ms=0.0)
    events = list(pbg.EntrypointStub(ch).Generate(req, timeout=30))
    assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2]


def test_an_lb_input_error_escaping_a_hop_is_invalid_argument_not_unknown(stack, monkeypatch):
    svc, ch, fakes, _ = stack()
    _register_fakes(svc, fakes)

    def refuse(req, instances):
        raise LBInputError("DecodeRequest.tbt_slo_ms must be None or a number of ms >= 0, got -1")

    monkeypatch.setattr(svc.dispatch.lbs.decode, "choose", refuse)
    req = pb.GenerateRequest(token_ids=list(range(1, 41)), sampling=pb.Sampling(max_new_tokens=4))
    with pytest.raises(grpc.RpcError) as ei:
        list(pbg.EntrypointStub(ch).Generate(req, timeout=30))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tbt_slo_ms" in ei.value.details()


# ----------------------------------------------------------------------------- decode streams


class EmptyDecode(FakeWorker):
    """A decode worker whose stream ends at once, with no token and no error."""

    def Decode(self, request, context):
        self._record("Decode", context)
        return iter(())


def _decode_calls(*fakes) -> int:
    return sum(1 for f in fakes for m, _ in f.calls if m == "Decode")


def test_a_decode_stream_that_ends_with_no_token_is_a_bounded_failed_attempt(stack):
    """Before: the decode loop re-dispatched at once, forever (thousands of Decode calls until
    the client's deadline; without one, for ever, holding a slot)."""
    svc, ch, fakes, _ = stack(max_attempts=3)
    svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
    opened: list = []
    try:
        empties = [EmptyDecode(f"empty-{i}", "decode") for i in range(3)]
        for e in empties:
            svc.registry.add(e.worker_id, "decode", _serve_fake(e, opened))
        req = pb.GenerateRequest(token_ids=list(range(1, 41)), sampling=pb.Sampling(max_new_tokens=4))
        events = []
        with pytest.raises(grpc.RpcError) as ei:
            for ev in pbg.EntrypointStub(ch).Generate(req, timeout=10):
                events.append(ev)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value.details()
        assert "empty-" in ei.value.details() and "without a token" in ei.value.details()
        assert _decode_calls(*empties) == 3  # max_attempts, one per worker
        assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN]
        assert sum(1 for e in events if e.kind == "hop" and '"failover"' in e.detail) == 3
        # One worker only: down after its attempt, so the error says why none is left.
        svc.registry.remove("empty-1"), svc.registry.remove("empty-2")
        svc.registry.poll_once()  # empty-0 answers its heartbeat: up again
        with pytest.raises(grpc.RpcError) as ei:
            list(pbg.EntrypointStub(ch).Generate(req, timeout=10))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "empty-0" in ei.value.details()
        assert _decode_calls(*empties) == 4
    finally:
        for close in opened:
            close(None)


def test_after_an_empty_stream_the_request_resumes_on_another_decode_worker(stack):
    svc, ch, fakes, _ = stack()
    opened: list = []
    try:
        empty = EmptyDecode("empty-0", "decode")
        svc.registry.add(empty.worker_id, "decode", _serve_fake(empty, opened))  # first in snapshot order
        _register_fakes(svc, fakes)
        req = pb.GenerateRequest(token_ids=list(range(1, 41)), sampling=pb.Sampling(max_new_tokens=4))
        events = list(pbg.EntrypointStub(ch).Generate(req, timeout=10))
        assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2, 3]
        assert _decode_calls(empty) <= 1 and _decode_calls(fakes["decode"][0]) == 1
    finally:
        for close in opened:
            close(None)


# ----------------------------------------------------------------------------- routing estimate


class RecordingPrefill(FakeWorker):
    """A prefill fake that records the entrypoint's in-flight estimate of each Prefill it gets."""

    def __init__(self, worker_id: str, svc):
        super().__init__(worker_id, "prefill")
        self.svc = svc
        self.inflight: list = []

    def Prefill(self, request, context):
        inst = next(i for i in self.svc.registry.instances("prefill") if i.worker_id == self.worker_id)
        self.inflight.append(list(inst.inflight.values()))
        return super().Prefill(request, context)


def test_the_routing_estimate_reuses_at_most_len_minus_one_over_block_size_blocks(stack, monkeypatch):
    """A 33-token prompt's 2 blocks are cached (device and store); its 32-token prefix is exactly
    2 blocks, of which the engine reuses (32 - 1) // 16 = 1 (it must compute the last token).
    Before: the lookup hop said 2 of 2 and the route counted 32 cached tokens, a suffix of 0."""
    from kvstore.keys import BlockHasher

    svc, ch, fakes, _ = stack()
    opened: list = []
    try:
        prefill = RecordingPrefill("rec-prefill", svc)
        svc.registry.add(prefill.worker_id, "prefill", _serve_fake(prefill, opened))
        svc.registry.add(fakes["decode"][0].worker_id, "decode", fakes["decode"][1])
        routes = []
        choose = svc.dispatch.lbs.prefill.choose
        monkeypatch.setattr(svc.dispatch.lbs.prefill, "choose",
                            lambda route, snaps: routes.append(route) or choose(route, snaps))
        stub = pbg.EntrypointStub(ch)
        long = list(range(1, 34))
        list(stub.Generate(pb.GenerateRequest(token_ids=long, sampling=pb.Sampling(max_new_tokens=2)), timeout=30))
        keys = BlockHasher(svc.cfg.namespace, svc.cfg.block_size, b"").hash_blocks(long)
        assert len(keys) == 2
        for k in keys:  # the store holds both blocks too
            svc.store.put(k, b"kv" * 8)
        events = list(stub.Generate(pb.GenerateRequest(token_ids=long[:32], sampling=pb.Sampling(max_new_tokens=2)),
                                    timeout=30))
        lookup = next(json.loads(e.detail) for e in events if e.kind == "hop" and '"lookup"' in e.detail)
        assert (lookup["blocks"], lookup["hit_blocks"]) == (2, 1)
        assert routes[-1].hit_of(prefill.worker_id).total == 1
        assert prefill.inflight[-1] == [(16, 16)]  # (suffix tokens, cached tokens), as the engine computes
        # A prompt one token longer than 2 blocks reuses both.
        list(stub.Generate(pb.GenerateRequest(token_ids=long, sampling=pb.Sampling(max_new_tokens=2)), timeout=30))
        assert routes[-1].hit_of(prefill.worker_id).total == 2 and prefill.inflight[-1] == [(1, 32)]
    finally:
        for close in opened:
            close(None)


# ----------------------------------------------------------------------------- VE load


def _ve_services(n: int, opened: list, delay_s: float = 0.0) -> list:
    """``n`` real VE ``WorkerService``s served on loopback; each encode takes ``delay_s`` longer and
    records the service's own ``Status().running`` while it runs (in ``svc.running_seen``)."""
    from engine_plugin.reference import model_preset
    from entrypoint.rpc import make_server
    from entrypoint.vision import VisionEncoder
    from entrypoint.worker import WorkerConfig, WorkerService

    cfg = model_preset("tiny")
    out = []
    for i in range(n):
        svc = WorkerService(WorkerConfig(role="ve", worker_id=f"ve{i}"), None,
                            VisionEncoder(cfg.vocab_size, seed=cfg.seed))
        svc.running_seen = []
        real = svc.encoder.encode

        def encode(data, length, _svc=svc, _real=real):
            _svc.running_seen.append(_svc.Status(pb.StatusRequest(), None).running)
            time.sleep(delay_s)
            return _real(data, length)

        svc.encoder.encode = encode
        server, port = make_server(ThreadPoolExecutor(16), [(svc, pb.DESCRIPTOR.services_by_name["Worker"])],
                                   "127.0.0.1", 0)
        server.start()
        opened.append(server.stop)
        svc.address = f"127.0.0.1:{port}"
        out.append(svc)
    return out


def test_concurrent_uncached_images_spread_over_the_ve_workers(stack):
    """Before: a VE worker's Status said running=0, waiting=0 and the entrypoint kept no count of
    its Encode calls in flight, so every uncached image went to the first VE worker (24 of 24)."""
    from kvstore.keys import image_hash

    svc, ch, fakes, _ = stack()
    _register_fakes(svc, fakes)
    opened: list = []
    try:
        ves = _ve_services(3, opened, delay_s=0.2)
        for v in ves:
            svc.registry.add(v.cfg.worker_id, "ve", v.address)
        stub = pbg.EntrypointStub(ch)

        def one(i: int) -> str:
            img = f"image number {i} ".encode() * 20
            req = pb.GenerateRequest(token_ids=list(range(1, 41)), sampling=pb.Sampling(max_new_tokens=2),
                                     images=[pb.ImageSegment(image_hash=image_hash(img), image_data=img,
                                                             start=2, length=8)])
            events = list(stub.Generate(req, timeout=60))
            return next(json.loads(e.detail)["worker"] for e in events if e.kind == "hop" and '"ve"' in e.detail)

        with ThreadPoolExecutor(12) as pool:
            picked = list(pool.map(one, range(24)))
        per_worker = {v.cfg.worker_id: len(v.running_seen) for v in ves}
        assert sum(per_worker.values()) == 24 and Counter(per_worker) == Counter(picked)
        assert all(n >= 4 for n in per_worker.values()), per_worker  # about 8 each; before: {ve0: 24}
        assert max(n for v in ves for n in v.running_seen) >= 2  # Status reports the encodes in flight
        assert all(v.Status(pb.StatusRequest(), None).running == 0 for v in ves)  # ...and only those
        assert all(i.encodes == 0 for i in svc.registry.instances("ve"))  # every count taken back
    finally:
        for close in opened:
            close(None)


# ----------------------------------------------------------------------------- VE cache across tenants


def test_what_a_tenant_is_told_about_the_ve_cache_does_not_depend_on_other_tenants(stack):
    """Tenants A and B send the same image bytes. Before: B's ``ve`` hop said cache_hit: true (and
    went to the worker holding A's entry), so B learned that another tenant had sent this image."""
    from kvstore.keys import image_hash

    svc, ch, fakes, _ = stack(tenants={"default": b"", "a": b"salt-a", "b": b"salt-b"})
    _register_fakes(svc, fakes)
    opened: list = []
    try:
        ves = _ve_services(2, opened)
        for v in ves:
            svc.registry.add(v.cfg.worker_id, "ve", v.address)
        stub = pbg.EntrypointStub(ch)

        def ve_hop(tenant: str, img: bytes) -> dict:
            req = pb.GenerateRequest(token_ids=list(range(1, 41)), sampling=pb.Sampling(max_new_tokens=2),
                                     tenant=tenant, images=[pb.ImageSegment(image_hash=image_hash(img),
                                                                            image_data=img, start=2, length=8)])
            events = list(stub.Generate(req, timeout=30))
            return next(json.loads(e.detail) for e in events if e.kind == "hop" and '"ve"' in e.detail)

        def encodes() -> int:
            return sum(len(v.running_seen) for v in ves)

        shared, fresh = b"the shared picture " * 30, b"a picture only B has " * 30
        svc.registry.mark_down("ve0", "test: A's image goes to ve1")
        a = ve_hop("a", shared)
        svc.registry.poll_once()  # ve0 up again
        assert a["worker"] == "ve1" and a["cache_hit"] is False
        again = ve_hop("a", shared)
        assert again["cache_hit"] is True and again["worker"] == "ve1"  # A's own entry: a hit, by affinity
        n = encodes()
        b = ve_hop("b", shared)
        assert b["cache_hit"] is False  # before: True
        assert encodes() == n + 1  # encoded for B (a miss's time), not served from A's entry
        assert b["worker"] == ve_hop("b", fresh)["worker"]  # chosen as for an image nobody sent
        assert ve_hop("b", shared)["cache_hit"] is True  # B's own entry from now on
    finally:
        for close in opened:
            close(None)
