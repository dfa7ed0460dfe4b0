"""The entrypoint service in process, with fake workers (no engine, no subprocess): the worker
secret on the membership calls and on every call to a worker (the worker's check of it, here
on a fake servicer; on real workers in ``test_e2e``), and the ``max_model_len`` bound checked
before any prefill."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

import kvstore
from engine_plugin.reference import model_preset
from entrypoint import auth
from entrypoint.config import EntrypointConfig
from entrypoint.instances import Registry, kv_namespace_pb
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from entrypoint.rpc import make_server
from entrypoint.server import EntrypointService, serve

SECRET = "s3cret-for-the-tests-0123456789"
FIRST_TOKEN = 7


def kv_of(role: str, block_size: int = 16) -> dict:
    """The ``WorkerInfo`` fields a ``role`` worker of the tiny model declares in ``Register``."""
    if role == "ve":
        return {}
    return dict(kv_namespace=kv_namespace_pb(model_preset("tiny").namespace()), block_size=block_size)


class FakeWorker(pbg.WorkerServicer):
    """Answers Status for ``role``; Prefill replies FIRST_TOKEN; Decode streams 1, 2, 3, ...;
    Encode gives ``length`` tokens 5. Records each call: (method, its metadata as a dict)."""

    def __init__(self, worker_id: str, role: str):
        self.worker_id, self.role = worker_id, role
        self.prefills: list[int] = []  # prompt lengths of the Prefill calls
        self.calls: list[tuple[str, dict]] = []

    def _record(self, method: str, context) -> None:
        self.calls.append((method, dict(context.invocation_metadata() or ())))

    def Status(self, request, context):
        self._record("Status", context)
        return pb.WorkerStatus(worker_id=self.worker_id, role=self.role, kv_capacity_bytes=1 << 30)

    def Prefill(self, request, context):
        self._record("Prefill", context)
        self.prefills.append(len(request.token_ids))
        return pb.PrefillReply(first_token=FIRST_TOKEN, stats="{}")

    def Decode(self, request, context):
        self._record("Decode", context)
        for i in range(len(request.generated), request.sampling.max_new_tokens):
            yield pb.DecodeEvent(token_id=i, index=i)

    def Encode(self, request, context):
        self._record("Encode", context)
        return pb.EncodeReply(token_ids=[5] * request.image.length)


def _serve_fake(fake: FakeWorker, opened: list, secret: str = "") -> str:
    """Serve ``fake`` on loopback as a worker does (requiring ``secret`` when given); its address."""
    kw = {"interceptors": auth.server_interceptors(secret)} if secret else {}  # none: a worker without one
    server, port = make_server(ThreadPoolExecutor(4), [(fake, pb.DESCRIPTOR.services_by_name["Worker"])],
                               "127.0.0.1", 0, **kw)
    server.start()
    opened.append(server.stop)
    return f"127.0.0.1:{port}"


@contextlib.contextmanager
def _serving(cfg: EntrypointConfig, store_dir, **serve_kw):
    """``entrypoint.server.serve`` in a thread (``serve_kw``: more of its arguments); yields its address."""
    stop, ready = threading.Event(), []
    t = threading.Thread(target=serve, args=(cfg, str(store_dir)),
                         kwargs=dict(host="127.0.0.1", heartbeat_s=0.05, stop=stop, ready=ready.append, **serve_kw),
                         daemon=True)
    t.start()
    try:
        for _ in range(200):
            if ready:
                break
            stop.wait(0.05)
        yield ready[0]
    finally:
        stop.set()
        t.join(timeout=30)


@pytest.fixture
def stack(tmp_path):
    """``start(**EntrypointConfig fields)`` -> (service, channel, {role: (fake, address)}, address)."""
    opened: list = []

    def start(**cfg_kw):
        fakes = {}
        for role in ("prefill", "decode"):
            fake = FakeWorker(f"fake-{role}", role)
            fakes[role] = (fake, _serve_fake(fake, opened))
        cfg = EntrypointConfig(namespace=model_preset("tiny").namespace(), **cfg_kw)
        store = kvstore.connect(str(tmp_path / "store"))
        registry = Registry(worker_secret=cfg.worker_secret)  # as entrypoint.server.serve makes it
        svc = EntrypointService(cfg, store, registry)
        server, port = make_server(ThreadPoolExecutor(8), [(svc, pb.DESCRIPTOR.services_by_name["Entrypoint"])],
                                   "127.0.0.1", 0)
        server.start()
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        opened.extend([server.stop, lambda _: ch.close(), lambda _: registry.stop(), lambda _: store.close()])
        return svc, ch, fakes, f"127.0.0.1:{port}"

    yield start
    for close in opened:
        close(None)


def _addresses(svc) -> dict[str, str]:
    return {i.worker_id: i.address for i in svc.registry.instances()}


# ----------------------------------------------------------------------------- worker secret


def test_membership_calls_need_the_worker_secret_and_a_refusal_changes_nothing(stack):
    svc, ch, fakes, _ = stack(worker_secret=SECRET)
    stub = pbg.EntrypointStub(ch)
    real = pb.WorkerInfo(worker_id="decode-0", role="decode", address=fakes["decode"][1], **kv_of("decode"))
    evil = pb.WorkerInfo(worker_id="decode-0", role="decode", address="127.0.0.1:9")
    good, bad = auth.metadata(SECRET), auth.metadata("not-the-secret-but-long-enough")
    for md in ((), bad, (("authorization", SECRET),)):  # no secret, a wrong one, not as a bearer token
        with pytest.raises(grpc.RpcError) as ei:
            stub.Register(real, timeout=10, metadata=md)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED and "worker secret" in ei.value.details()
    assert _addresses(svc) == {}  # before: registered by anyone
    assert stub.Register(real, timeout=10, metadata=good).ok
    # Another process cannot re-point the worker id at itself, nor remove it.
    with pytest.raises(grpc.RpcError) as ei:
        stub.Register(evil, timeout=10, metadata=bad)
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as ei:
        stub.Deregister(real, timeout=10)
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _addresses(svc) == {"decode-0": fakes["decode"][1]}
    assert [w.worker_id for w in stub.ListWorkers(pb.Empty(), timeout=10).workers] == ["decode-0"]  # open
    # The legitimate worker, restarted elsewhere after a failover, re-registers under its id.
    opened: list = []
    try:
        elsewhere = _serve_fake(FakeWorker("decode-0", "decode"), opened)  # a decode worker: Status says so
        moved = pb.WorkerInfo(worker_id="decode-0", role="decode", address=elsewhere, **kv_of("decode"))
        assert stub.Register(moved, timeout=10, metadata=good).ok
        assert _addresses(svc) == {"decode-0": elsewhere}
        assert stub.Deregister(moved, timeout=10, metadata=good).ok and _addresses(svc) == {}
    finally:
        for close in opened:
            close(None)


def test_worker_register_sends_its_secret_and_says_what_to_fix_when_refused(stack):
    from entrypoint.worker import _register

    svc, _, fakes, entry = stack(worker_secret=SECRET)
    info = pb.WorkerInfo(worker_id="prefill-0", role="prefill", address=fakes["prefill"][1], **kv_of("prefill"))
    for given in ("", "not-the-secret-but-long-enough"):
        with pytest.raises(kvstore.InvalidRequest, match="refused the registration.*KVSTACK_WORKER_SECRET"):
            _register(entry, info, given)
    assert _addresses(svc) == {}
    _register(entry, info, SECRET)
    assert _addresses(svc) == {"prefill-0": fakes["prefill"][1]}


def test_without_a_secret_loopback_serves_with_one_warning_and_other_hosts_refuse(tmp_path, caplog):
    cfg = EntrypointConfig(namespace=model_preset("tiny").namespace())
    with pytest.raises(kvstore.InvalidRequest, match="beyond loopback.*KVSTACK_WORKER_SECRET"):
        serve(cfg, str(tmp_path / "refused"), host="0.0.0.0")
    assert not (tmp_path / "refused").exists()  # refused before the store was opened
    caplog.set_level(logging.WARNING, logger="entrypoint")
    with _serving(cfg, tmp_path / "store") as address, grpc.insecure_channel(address) as ch:
        stub = pbg.EntrypointStub(ch)
        for i in range(2):
            assert stub.Register(pb.WorkerInfo(worker_id=f"w{i}", role="ve", address="127.0.0.1:9"),
                                 timeout=10).ok
    warnings = [r for r in caplog.records if "no worker secret" in r.getMessage()]
    assert len(warnings) == 1


def test_the_entrypoint_sends_the_secret_on_every_call_to_a_worker(tmp_path):
    """Every call the entrypoint makes to a worker (the heartbeat, each hop) carries the secret,
    after the call's own metadata (the VE scope). Before: none did, so workers could not ask."""
    from entrypoint.vision import SCOPE_METADATA, tenant_scope
    from kvstore.keys import image_hash

    opened: list = []
    fakes = {role: FakeWorker(f"fake-{role}", role) for role in ("ve", "prefill", "decode")}
    cfg = EntrypointConfig(namespace=model_preset("tiny").namespace(), worker_secret=SECRET)
    try:
        with _serving(cfg, tmp_path / "store") as address, grpc.insecure_channel(address) as ch:
            stub = pbg.EntrypointStub(ch)
            for role, fake in fakes.items():
                info = pb.WorkerInfo(worker_id=fake.worker_id, role=role, address=_serve_fake(fake, opened),
                                     **kv_of(role))
                assert stub.Register(info, timeout=10, metadata=auth.metadata(SECRET)).ok
            img = b"picture" * 20
            req = pb.GenerateRequest(token_ids=list(range(1, 41)), sampling=pb.Sampling(max_new_tokens=4),
                                     images=[pb.ImageSegment(image_hash=image_hash(img), image_data=img,
                                                             start=2, length=8)])
            events = list(stub.Generate(req, timeout=30))
            assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2, 3]
            seen, deadline = len(fakes["ve"].calls), time.monotonic() + 10
            while not any(m == "Status" for m, _ in fakes["ve"].calls[seen:]):  # the heartbeat thread's too
                assert time.monotonic() < deadline, "no heartbeat within 10 s"
                time.sleep(0.05)
    finally:
        for close in opened:
            close(None)
    bearer = f"Bearer {SECRET}"
    for role, fake in fakes.items():
        methods = {m for m, _ in fake.calls}
        assert methods >= {"Status", {"ve": "Encode", "prefill": "Prefill", "decode": "Decode"}[role]}
        assert all(md.get("authorization") == bearer for _, md in fake.calls), (role, fake.calls)
    encode_md = next(md for m, md in fakes["ve"].calls if m == "Encode")
    assert encode_md[SCOPE_METADATA] == tenant_scope("default", b"")  # the call's own metadata, kept


@pytest.mark.parametrize("method", [m.name for m in pb.DESCRIPTOR.services_by_name["Worker"].methods])
def test_a_worker_with_a_secret_refuses_every_call_without_it_before_parsing_it(method):
    """The worker's side (``auth.server_interceptors``, as ``entrypoint.worker.serve`` serves):
    no secret, a wrong one, one not sent as a bearer token, and even unparsable bytes are
    UNAUTHENTICATED and reach no handler; the secret gets the call served."""
    opened: list = []
    fake = FakeWorker("w", "ve")
    m = pb.DESCRIPTOR.services_by_name["Worker"].methods_by_name[method]
    try:
        with grpc.insecure_channel(_serve_fake(fake, opened, SECRET)) as ch:
            path = f"/{m.containing_service.full_name}/{m.name}"
            call = (ch.unary_stream if m.server_streaming else ch.unary_unary)(
                path, request_serializer=None, response_deserializer=None)  # raw bytes both ways
            good = pb.DecodeRequest(sampling=pb.Sampling(max_new_tokens=2)) if method == "Decode" else \
                pb.EncodeRequest(image=pb.ImageSegment(length=2)) if method == "Encode" else None
            raw = good.SerializeToString() if good is not None else b""

            def invoke(data: bytes, md) -> list:
                res = call(data, timeout=10, metadata=md)
                return list(res) if m.server_streaming else [res]

            for data, md in ((raw, ()), (raw, auth.metadata("not-the-secret-but-long-enough")),
                             (raw, (("authorization", SECRET),)), (b"\xff", ())):
                with pytest.raises(grpc.RpcError) as ei:
                    invoke(data, md)
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, (data, md, ei.value.details())
                assert method in ei.value.details() and "worker secret" in ei.value.details()
            assert fake.calls == []  # refused before the handler
            assert invoke(raw, auth.metadata(SECRET)) and [c for c, _ in fake.calls] == [method]
    finally:
        for close in opened:
            close(None)


def test_a_worker_whose_secret_the_entrypoint_lacks_is_refused_at_registration(stack):
    """It would refuse every call from this entrypoint: its Register fails and says why (before:
    registered, then never up, silently)."""
    from entrypoint.worker import _register

    svc, _, _, entry = stack()  # an entrypoint without a secret
    opened: list = []
    try:
        info = pb.WorkerInfo(worker_id="ve-0", role="ve", address=_serve_fake(FakeWorker("ve-0", "ve"), opened,
                                                                             SECRET))
        with pytest.raises(kvstore.InvalidRequest, match="refused the registration.*UNAUTHENTICATED.*same"):
            _register(entry, info, SECRET)
        assert _addresses(svc) == {}
        # A healthy worker registered under that id stays when such a one registers over it
        # (before, it was dropped first, so the refused one left the id with no worker at all).
        good = _serve_fake(FakeWorker("ve-0", "ve"), opened)
        _register(entry, pb.WorkerInfo(worker_id="ve-0", role="ve", address=good), "")
        with pytest.raises(kvstore.InvalidRequest, match="UNAUTHENTICATED"):
            _register(entry, info, SECRET)
        assert _addresses(svc) == {"ve-0": good}
    finally:
        for close in opened:
            close(None)


@pytest.mark.parametrize("value, needle", [
    ("short", "KVSTACK_WORKER_SECRET must be 16"),
    ("with a space in the secret", "printable ASCII"),
])
def test_bad_secrets_are_refused_naming_their_source(value, needle):
    with pytest.raises(kvstore.InvalidRequest, match=needle):
        auth.load_worker_secret("", {"KVSTACK_WORKER_SECRET": value})


def test_the_secret_file_wins_over_the_environment_and_is_never_in_a_repr(tmp_path):
    f = tmp_path / "secret"
    f.write_text(SECRET + "\n")
    assert auth.load_worker_secret(str(f), {"KVSTACK_WORKER_SECRET": "from-the-environment-123"}) == SECRET
    assert auth.load_worker_secret("", {"KVSTACK_WORKER_SECRET": "from-the-environment-123"}) \
        == "from-the-environment-123"
    assert auth.load_worker_secret("", {}) == ""
    with pytest.raises(kvstore.InvalidRequest, match="cannot read --worker-secret-file"):
        auth.load_worker_secret(str(tmp_path / "missing"), {})
    cfg = EntrypointConfig(namespace=model_preset("tiny").namespace(), worker_secret=SECRET)
    assert SECRET not in repr(cfg)


# ----------------------------------------------------------------------------- max_model_len


def test_a_request_over_max_model_len_is_refused_before_any_prefill(stack):
    svc, ch, fakes, _ = stack(max_model_len=64)
    for role, (fake, address) in fakes.items():
        svc.registry.add(fake.worker_id, role, address)
    stub = pbg.EntrypointStub(ch)
    prompt = list(range(1, 61))
    for max_new, needle in ((5, "prompt (60 tokens) + max_new_tokens (5) = 65 exceeds max_model_len 64"),
                            (0, "max_new_tokens (16) = 76")):  # 0: the default, 16
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=pb.Sampling(max_new_tokens=max_new)),
                               timeout=30))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in ei.value.details()
        assert "at most 4 new tokens" in ei.value.details()
    assert fakes["prefill"][0].prefills == []  # before: prefilled, then RESOURCE_EXHAUSTED at decode
    events = list(stub.Generate(pb.GenerateRequest(token_ids=prompt, sampling=pb.Sampling(max_new_tokens=4)),
                                timeout=30))
    assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2, 3]
    assert fakes["prefill"][0].prefills == [60]


@pytest.mark.parametrize("value", [-1, True, 1.5])
def test_max_model_len_must_be_an_int_of_at_least_zero(value):
    with pytest.raises(kvstore.InvalidRequest, match="max_model_len"):
        EntrypointConfig(namespace=model_preset("tiny").namespace(), max_model_len=value)


def test_the_lbs_fetch_blocks_of_the_served_block_size(tmp_path):
    """The prefill LB counts hits in block_size-token blocks, so its transfer model sizes a fetched block
    the same, with or without a configured kv_bytes_per_token (before: 512-token blocks without one)."""
    for kv in (0.0, 4096.0):
        cfg = EntrypointConfig(namespace=model_preset("tiny").namespace(), block_size=16, kv_bytes_per_token=kv)
        store = kvstore.connect(str(tmp_path / f"store{kv}"))
        registry = Registry(worker_secret=cfg.worker_secret)
        try:
            transfer = EntrypointService(cfg, store, registry).dispatch.lbs.prefill.models.transfer
            assert transfer.block_tokens == 16 and transfer.kv_bytes_per_token > 0
            assert kv == 0.0 or transfer.kv_bytes_per_token == kv
        finally:
            registry.stop()
            store.close()
