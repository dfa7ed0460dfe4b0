"""The KV of the decode streams this entrypoint picked between two heartbeats is counted against
their instance until a heartbeat does (``entrypoint.dispatch.Dispatch.decode_snapshot``), in
process with fake workers (the helpers of ``test_service``; no heartbeat thread runs there, so
the last ``Status`` is the one ``add`` or ``poll_once`` asked)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from tests.entrypoint.test_service import FIRST_TOKEN, FakeWorker, _serve_fake, stack  # noqa: F401 - fixture

MIB = 1 << 20
PROMPT = list(range(1, 41))  # 40 tokens; with max_new_tokens 8 a decode needs 41 + 7 = 48 tokens of KV


class MemDecode(FakeWorker):
    """A decode worker with ``capacity`` bytes of KV whose Status reports the KV of its open streams
    (their context, ``bpt`` bytes a token); its streams send a token each ``delay_s``."""

    def __init__(self, worker_id: str, capacity: int, bpt: int, delay_s: float):
        super().__init__(worker_id, "decode")
        self.capacity, self.bpt, self.delay_s = capacity, bpt, delay_s
        self.used = 0
        self.first_token = threading.Event()

    def Status(self, request, context):
        self._record("Status", context)
        return pb.WorkerStatus(worker_id=self.worker_id, role="decode", kv_capacity_bytes=self.capacity,
                               kv_used_bytes=self.used, running=1 if self.used else 0)

    def Decode(self, request, context):
        self._record("Decode", context)
        kv = (len(request.token_ids) + len(request.generated)) * self.bpt
        self.used += kv
        try:
            for i in range(len(request.generated), request.sampling.max_new_tokens):
                time.sleep(self.delay_s)
                yield pb.DecodeEvent(token_id=i, index=i)
                self.first_token.set()
        finally:
            self.used -= kv


def test_decodes_picked_between_two_heartbeats_cannot_overcommit_an_instance_s_kv(stack):
    """One decode instance with KV for one request (100 MiB, 95 under the LB's headroom; a request
    needs 48 MiB). A first stream is open there; its heartbeat has not come. Before: the second
    request saw the last heartbeat's 0 bytes used and was placed there too (96 MiB of a 95 MiB
    budget); now the first one's 48 MiB are counted and the second is refused by admission control.
    Once a heartbeat asked after the first stream started counts it, only that heartbeat's figure is."""
    svc, ch, fakes, _ = stack(kv_bytes_per_token=float(MIB))
    opened: list = []
    try:
        mem = MemDecode("mem-d", 100 * MIB, MIB, 0.5)
        svc.registry.add(mem.worker_id, "decode", _serve_fake(mem, opened))
        svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
        stub = pbg.EntrypointStub(ch)
        req = pb.GenerateRequest(token_ids=PROMPT, sampling=pb.Sampling(max_new_tokens=8))
        first: dict = {}
        t = threading.Thread(target=lambda: first.setdefault("events", list(stub.Generate(req, timeout=60))))
        t.start()
        assert mem.first_token.wait(30)
        inst = svc.registry.instances("decode")[0]
        with svc._lock:
            assert svc.dispatch.decode_snapshot(inst).kv_used_bytes == 48 * MIB  # reserved: not reported yet
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(pb.GenerateRequest(token_ids=PROMPT[::-1], sampling=pb.Sampling(max_new_tokens=8)),
                               timeout=60))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV memory" in ei.value.details()
        svc.registry.poll_once()  # asked after the first stream started: it counts its KV (41 MiB so far)
        with svc._lock:
            assert svc.dispatch.decode_snapshot(inst).kv_used_bytes == 41 * MIB
        t.join(timeout=60)
        assert [e.token_id for e in first["events"] if e.kind == "token"] == [FIRST_TOKEN] + list(range(1, 8))
        assert inst.decodes == {}
    finally:
        for close in opened:
            close(None)


@pytest.mark.parametrize("max_new, served", [(17, True), (18, False), (1, True)])
def test_a_request_no_decode_worker_could_hold_even_empty_is_refused_before_its_prefill(stack, max_new, served):
    """A decode pool of 60 MiB takes 57 MiB under kvstack's 5 % headroom; at 1 MiB a token, 40 prompt
    tokens + 17 new (57 tokens of KV: 41 + 16) fit, + 18 (58) do not. Before, such a request was prefilled,
    then refused at the decode hop; now it is refused first, and no prefill worker is called. A request
    with max_new_tokens 1 has no decode hop: nothing to check."""
    svc, ch, fakes, _ = stack(kv_bytes_per_token=float(MIB))
    opened: list = []
    try:
        mem = MemDecode("mem-d", 60 * MIB, MIB, 0.0)
        svc.registry.add(mem.worker_id, "decode", _serve_fake(mem, opened))
        prefill = fakes["prefill"][0]
        svc.registry.add(prefill.worker_id, "prefill", fakes["prefill"][1])
        req = pb.GenerateRequest(token_ids=PROMPT, sampling=pb.Sampling(max_new_tokens=max_new))
        stub = pbg.EntrypointStub(ch)
        if served:
            events = list(stub.Generate(req, timeout=60))
            assert len([e for e in events if e.kind == "token"]) == max_new
            return
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(req, timeout=60))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value.details()
        assert "58 tokens" in ei.value.details() and "57.0 MiB" in ei.value.details()
        assert prefill.prefills == []
    finally:
        for close in opened:
            close(None)
