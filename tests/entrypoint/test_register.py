"""``Register`` checks that a prefill or decode worker hashes its KV keys as the entrypoint does
(namespace and block size, ``entrypoint.instances.check_kv_compat``), in process with fake workers
(the helpers of ``test_service``) and with a real worker's ``main``."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest

import kvstore
from engine_plugin.reference import model_preset
from entrypoint.instances import kv_namespace_pb
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from tests.entrypoint.test_service import kv_of, stack  # noqa: F401 - fixture

TINY = model_preset("tiny").namespace()


def _refused(stub, info: pb.WorkerInfo) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        stub.Register(info, timeout=10)
    return ei.value


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_with_another_namespace_or_block_size_or_none_is_refused(stack, role):
    """Before: ``WorkerInfo`` carried neither, so any worker was registered and routed requests
    whose prefix lookups and cost estimates assumed keys it never reads or writes."""
    svc, ch, fakes, _ = stack()
    stub = pbg.EntrypointStub(ch)
    address = fakes[role][1]
    other_model = replace(TINY, model_id=TINY.model_id + "-finetune")
    cases = {
        "block size": pb.WorkerInfo(worker_id="w", role=role, address=address, **kv_of(role, block_size=32)),
        "namespace": pb.WorkerInfo(worker_id="w", role=role, address=address, block_size=16,
                                   kv_namespace=kv_namespace_pb(other_model)),
        "rank": pb.WorkerInfo(worker_id="w", role=role, address=address, block_size=16,
                              kv_namespace=kv_namespace_pb(replace(TINY, rank=1))),
        "none": pb.WorkerInfo(worker_id="w", role=role, address=address),
    }
    for case, info in cases.items():
        err = _refused(stub, info)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, (case, err.details())
        assert TINY.label() in err.details() and "16-token blocks" in err.details(), (case, err.details())
        if case != "none":
            theirs = other_model if case == "namespace" else replace(TINY, rank=1) if case == "rank" else TINY
            assert theirs.label() in err.details(), (case, err.details())
        assert svc.registry.instances() == [], case  # nothing changed
    bad = pb.WorkerInfo(worker_id="w", role=role, address=address, block_size=16,
                        kv_namespace=pb.KVNamespace(kv_layout="x"))  # no model id: malformed
    assert _refused(stub, bad).code() == grpc.StatusCode.INVALID_ARGUMENT
    # The entrypoint's own namespace and block size: registered, and ListWorkers says what it declared.
    assert stub.Register(pb.WorkerInfo(worker_id="w", role=role, address=address, **kv_of(role)), timeout=10).ok
    svc.registry.poll_once()
    [listed] = stub.ListWorkers(pb.Empty(), timeout=10).workers
    assert listed.block_size == 16 and listed.kv_namespace == kv_namespace_pb(TINY)


def test_a_ve_worker_declares_no_kv_and_is_registered(stack):
    from tests.entrypoint.test_service import FakeWorker, _serve_fake

    svc, ch, _, _ = stack()
    opened: list = []
    try:
        address = _serve_fake(FakeWorker("ve-0", "ve"), opened)
        assert pbg.EntrypointStub(ch).Register(pb.WorkerInfo(worker_id="ve-0", role="ve", address=address),
                                               timeout=10).ok
        assert [i.worker_id for i in svc.registry.instances("ve")] == ["ve-0"]
    finally:
        for close in opened:
            close(None)


def test_a_real_worker_with_another_block_size_is_refused_and_exits_2_saying_why(stack, tmp_path, capsys):
    """The real worker declares its engine's namespace and block size (a matching one registers:
    every ``Cluster`` in ``test_e2e``); refused, it stops with one line and exit code 2 (a usage
    error), not 1 ("unreachable")."""
    from entrypoint.worker import main

    svc, _, _, entry = stack()
    rc = main(["--role", "prefill", "--id", "p-32", "--store", str(tmp_path / "wstore"), "--block-size", "32",
               "--num-blocks", "64", "--entrypoint", entry])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "refused the registration" in err and "32-token blocks" in err and "16-token blocks" in err
    assert svc.registry.instances() == []


def test_worker_register_maps_a_refusal_to_invalid_request(stack):
    from entrypoint.worker import _register

    svc, _, fakes, entry = stack()
    info = pb.WorkerInfo(worker_id="d", role="decode", address=fakes["decode"][1], **kv_of("decode", 32))
    with pytest.raises(kvstore.InvalidRequest, match="refused the registration.*32-token blocks"):
        _register(entry, info)
    assert svc.registry.instances() == []


# ----------------------------------------------------------------------------- roles


def _roles(svc) -> dict[str, tuple[str, str]]:
    return {i.worker_id: (i.role, i.address) for i in svc.registry.instances()}


def test_a_live_worker_id_keeps_its_role(stack):
    """Before: re-registering a prefill worker's id as ``ve`` replaced it, and the entrypoint sent
    that prefill engine ``Encode`` calls. Now a role change of a worker that is up is refused and
    changes nothing; after ``Deregister``, or once the worker is down, the id may take any role."""
    from tests.entrypoint.test_service import FakeWorker, _serve_fake

    svc, ch, fakes, _ = stack()
    stub = pbg.EntrypointStub(ch)
    opened: list = []
    try:
        ve_address = _serve_fake(FakeWorker("p0", "ve"), opened)  # a VE worker, as its Status says
        prefill = pb.WorkerInfo(worker_id="p0", role="prefill", address=fakes["prefill"][1], **kv_of("prefill"))
        assert stub.Register(prefill, timeout=10).ok
        for info in (pb.WorkerInfo(worker_id="p0", role="ve", address=ve_address),
                     pb.WorkerInfo(worker_id="p0", role="decode", address=fakes["decode"][1], **kv_of("decode"))):
            err = _refused(stub, info)
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
            assert "registered as a prefill worker" in err.details() and "deregister it first" in err.details()
            assert _roles(svc) == {"p0": ("prefill", fakes["prefill"][1])}
        assert stub.Register(prefill, timeout=10).ok  # the same role re-registers, as after a restart
        assert stub.Deregister(prefill, timeout=10).ok
        assert stub.Register(pb.WorkerInfo(worker_id="p0", role="ve", address=ve_address), timeout=10).ok
        assert _roles(svc) == {"p0": ("ve", ve_address)}
        svc.registry.mark_down("p0", "the test")  # crashed workers never deregister: a down id is free
        assert stub.Register(prefill, timeout=10).ok
        assert _roles(svc) == {"p0": ("prefill", fakes["prefill"][1])}
    finally:
        for close in opened:
            close(None)


def test_a_ve_worker_that_declares_kv_is_refused(stack):
    """Before: accepted, and ``ListWorkers`` showed a VE worker with a KV namespace it does not hold."""
    from tests.entrypoint.test_service import FakeWorker, _serve_fake

    svc, ch, _, _ = stack()
    stub = pbg.EntrypointStub(ch)
    opened: list = []
    try:
        address = _serve_fake(FakeWorker("ve-0", "ve"), opened)
        for kv in (kv_of("prefill"), dict(block_size=16), dict(kv_namespace=pb.KVNamespace(model_id="other"))):
            err = _refused(stub, pb.WorkerInfo(worker_id="ve-0", role="ve", address=address, **kv))
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "holds no KV" in err.details(), err.details()
        assert svc.registry.instances() == []
    finally:
        for close in opened:
            close(None)


def test_a_worker_that_answers_as_another_role_is_refused_or_marked_down(stack):
    """``Register`` with a role its ``Status`` contradicts is refused; a registered worker that starts
    answering as another role is down (no requests) until it answers as its own again."""
    svc, ch, fakes, _ = stack()
    stub = pbg.EntrypointStub(ch)
    err = _refused(stub, pb.WorkerInfo(worker_id="d1", role="decode", address=fakes["prefill"][1],
                                       **kv_of("decode")))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "its Status says prefill" in err.details()
    assert svc.registry.instances() == []
    fake, address = fakes["decode"]
    assert stub.Register(pb.WorkerInfo(worker_id="d0", role="decode", address=address, **kv_of("decode")),
                         timeout=10).ok
    assert [i.worker_id for i in svc.registry.ready("decode")] == ["d0"]
    fake.role = "prefill"
    svc.registry.poll_once()
    assert svc.registry.ready() == [] and not svc.registry.instances("decode")[0].healthy
    fake.role = "decode"
    svc.registry.poll_once()
    assert [i.worker_id for i in svc.registry.ready("decode")] == ["d0"]


def test_a_worker_restarted_under_its_id_with_another_role_joins_at_once(stack):  # noqa: F811
    """The prefill worker ``p0`` crashed (nothing answers at its address any more) and is started
    again as a VE worker under its id. Before, its Register was refused FAILED_PRECONDITION until
    the old registration had missed 3 heartbeats, and a real worker exits on that refusal. Now
    the entrypoint asks the old registration first, finds it gone, and takes the new one."""
    from tests.entrypoint.test_service import FakeWorker, _serve_fake

    svc, ch, fakes, _ = stack()
    stub = pbg.EntrypointStub(ch)
    opened: list = []
    try:
        crashed: list = []
        old_address = _serve_fake(FakeWorker("p0", "prefill"), crashed)
        assert stub.Register(pb.WorkerInfo(worker_id="p0", role="prefill", address=old_address,
                                           **kv_of("prefill")), timeout=10).ok
        for close in crashed:  # the crash
            close(None)
        ve_address = _serve_fake(FakeWorker("p0", "ve"), opened)
        assert stub.Register(pb.WorkerInfo(worker_id="p0", role="ve", address=ve_address), timeout=10).ok
        assert _roles(svc) == {"p0": ("ve", ve_address)}
    finally:
        for close in opened:
            close(None)
