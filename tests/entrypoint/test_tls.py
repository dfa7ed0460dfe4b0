"""TLS on the entrypoint's hops (``entrypoint.tls``). Before, the entrypoint and the workers spoke
plaintext only, so the client tokens and the worker secret crossed the network in clear.

1. The entrypoint's port (clients and workers' ``Register``): ``grpcs://`` in READY, a client
   with the CA is served, a plaintext or untrusting one is not, mutual TLS refuses a caller
   without a certificate, and a worker told the wrong scheme or CA says what to check.
2. The worker hop: the entrypoint dials ``grpcs://`` workers with ``--worker-ca``, and then
   refuses plaintext ones and workers whose certificate it cannot verify.
3. The command lines refuse mixes that cannot work, in one line, exit code 2.
4. A real stack (``Cluster(tls=...)``: every hop TLS, and every hop mutual TLS) serves a request
   end to end with the reference engine.

Everything listens on 127.0.0.1; certificates from the daemon tests' ``certs`` fixture.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from engine_plugin.reference import model_preset
from entrypoint.__main__ import main as entrypoint_main
from entrypoint.client import Client
from entrypoint.config import EntrypointConfig
from entrypoint.instances import Registry
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from entrypoint.rpc import make_server
from entrypoint.tls import ChannelTLS, ServerTLS, open_channel
from entrypoint.walkthrough.launcher import Cluster, ClusterTLS
from entrypoint.worker import ENTRYPOINT_TLS_NONE, _register
from entrypoint.worker import main as worker_main
from kvstore.errors import InvalidRequest, StoreUnavailable
from tests.entrypoint.test_service import SECRET, FakeWorker, _serving, kv_of

PROMPT = list(range(1, 40))


def _cfg(**kw) -> EntrypointConfig:
    return EntrypointConfig(namespace=model_preset("tiny").namespace(), **kw)


def _list_workers(address: str, tls: ChannelTLS | None = None, **kw) -> list:
    with open_channel(address, tls) as ch:
        return list(pbg.EntrypointStub(ch).ListWorkers(pb.Empty(), timeout=10, **kw).workers)


def _refused(address: str, tls: ChannelTLS | None = None) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as ei:
        _list_workers(address, tls)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE, ei.value
    return ei.value


# ----------------------------------------------------------------------------- 1. the entrypoint's port
def test_a_tls_entrypoint_serves_callers_with_the_ca_only(certs, tmp_path):
    with _serving(_cfg(), tmp_path / "store", tls=ServerTLS(certs["server"], certs["server_key"])) as address:
        assert address.startswith("grpcs://127.0.0.1:")  # READY says TLS
        assert _list_workers(address, ChannelTLS(certs["ca"])) == []
        plain = address.removeprefix("grpcs://")
        _refused(plain)  # a plaintext client: the TLS port answers nothing
        _refused(address, ChannelTLS(certs["other_ca"]))  # a client that trusts another CA
        with pytest.raises(InvalidRequest, match=f"ca_file given for the plaintext address '{plain}': use "
                                                 f"grpcs://{plain} for TLS"):
            Client(plain, ca_file=certs["ca"])  # never silently plaintext
        # A worker told the wrong scheme, or not given the CA, says what to check (one line, exit 1).
        info = pb.WorkerInfo(worker_id="p", role="prefill", address="127.0.0.1:1", **kv_of("prefill"))
        with pytest.raises(StoreUnavailable, match="closed the connection: if it serves TLS, use grpcs://"):
            _register(plain, info)
        with pytest.raises(StoreUnavailable, match="TLS handshake failed: .* signed by --entrypoint-ca"):
            _register(address, info)  # the system roots do not hold the test CA


def test_mutual_tls_refuses_a_caller_without_a_certificate(certs, tmp_path):
    tls = ServerTLS(certs["server"], certs["server_key"], certs["ca"])
    with _serving(_cfg(), tmp_path / "store", tls=tls) as address:
        _refused(address, ChannelTLS(certs["ca"]))
        client = Client(address, ca_file=certs["ca"])
        try:
            with pytest.raises(grpc.RpcError) as ei:
                client.generate(PROMPT, max_new_tokens=2, timeout=10)
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            client.close()
        assert _list_workers(address, ChannelTLS(certs["ca"], certs["client"], certs["client_key"])) == []
        info = pb.WorkerInfo(worker_id="p", role="prefill", address="127.0.0.1:1", **kv_of("prefill"))
        with pytest.raises(StoreUnavailable, match="give --entrypoint-cert and --entrypoint-key"):
            _register(address, info, tls=ChannelTLS(certs["ca"], names=ENTRYPOINT_TLS_NONE.names))


# ----------------------------------------------------------------------------- 2. the worker hop
@pytest.fixture
def fake_workers(certs):
    """``serve(tls)`` -> the address of a fake prefill worker served with ``tls`` (a ``ServerTLS``)."""
    servers = []

    def serve(tls: ServerTLS) -> str:
        server, port = make_server(ThreadPoolExecutor(4), [(FakeWorker("w", "prefill"),
                                                            pb.DESCRIPTOR.services_by_name["Worker"])],
                                   "127.0.0.1", 0, credentials=tls.credentials())
        server.start()
        servers.append(server)
        return f"grpcs://127.0.0.1:{port}" if tls.enabled else f"127.0.0.1:{port}"

    yield serve
    for s in servers:
        s.stop(None)


def test_the_entrypoint_dials_tls_workers_and_refuses_ones_it_cannot_trust(certs, fake_workers):
    tls_worker = fake_workers(ServerTLS(certs["server"], certs["server_key"]))
    plain_worker = fake_workers(ServerTLS())
    registry = Registry(worker_tls=ChannelTLS(certs["ca"]))
    try:
        assert registry.add("w", "prefill", tls_worker, **kv_of("prefill")).status.worker_id == "w"
        with pytest.raises(InvalidRequest, match="plaintext address .* over TLS only .* --tls-cert"):
            registry.add("w2", "prefill", plain_worker, **kv_of("prefill"))
    finally:
        registry.stop()
    for worker_tls in (ChannelTLS(certs["other_ca"]), None):  # another CA; none: the system roots
        registry = Registry(worker_tls=worker_tls)
        try:
            with pytest.raises(InvalidRequest, match="did not answer the entrypoint's Status over TLS"):
                registry.add("w", "prefill", tls_worker, **kv_of("prefill"))
            assert registry.instances() == []
        finally:
            registry.stop()


def test_a_worker_with_mutual_tls_needs_the_entrypoints_certificate(certs, fake_workers):
    worker = fake_workers(ServerTLS(certs["server"], certs["server_key"], certs["ca"]))
    for worker_tls, joins in ((ChannelTLS(certs["ca"]), False),
                              (ChannelTLS(certs["ca"], certs["client"], certs["client_key"]), True)):
        registry = Registry(worker_tls=worker_tls)
        try:
            if joins:
                registry.add("w", "prefill", worker, **kv_of("prefill"))
            else:
                with pytest.raises(InvalidRequest, match="--worker-cert and --worker-key"):
                    registry.add("w", "prefill", worker, **kv_of("prefill"))
        finally:
            registry.stop()


# ----------------------------------------------------------------------------- 3. the command lines
def _args(certs, tmp_path, args: list[str]) -> list[str]:
    files = dict(certs, missing=str(tmp_path / "missing.pem"))
    return [a.format(**files) for a in args]


def test_a_worker_client_certificate_alone_also_makes_tls_to_workers_required(certs, fake_workers, capsys):
    """--worker-cert/--worker-key without --worker-ca: the workers are verified with the system roots,
    and a plaintext worker is refused too. Before, the help and the refusal named --worker-ca alone."""
    names = ("--worker-ca", "--worker-cert", "--worker-key")
    registry = Registry(worker_tls=ChannelTLS("", certs["client"], certs["client_key"], names=names))
    try:
        with pytest.raises(InvalidRequest, match=r"over TLS only \(--worker-cert, --worker-key\)"):
            registry.add("w", "prefill", fake_workers(ServerTLS()), **kv_of("prefill"))
    finally:
        registry.stop()
    assert entrypoint_main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "it too makes the worker calls TLS only" in text


@pytest.mark.parametrize("args, needle", [
    (["--tls-client-ca", "{ca}"], "mutual TLS (--tls-client-ca) needs --tls-cert and --tls-key as well"),
    (["--tls-cert", "{server}"], "TLS needs both --tls-cert and --tls-key"),
    (["--tls-cert", "{missing}", "--tls-key", "{server_key}"], "cannot read --tls-cert '"),
    (["--tls-cert", "{server_key}", "--tls-key", "{server_key}"], "--tls-cert '"),  # ... is not a PEM certificate
    (["--tls-cert", "{server}", "--tls-key", "{client_key}"], "the TLS key does not match the certificate"),
    (["--worker-cert", "{client}"], "mutual TLS needs both --worker-cert and --worker-key"),
    (["--worker-ca", "{server_key}"], "--worker-ca '"),  # ... is not a PEM certificate
    (["--worker-ca", "{missing}"], "cannot read --worker-ca '"),
])
def test_entrypoint_tls_misuse_is_one_line(certs, tmp_path, capsys, args, needle):
    assert entrypoint_main([*_args(certs, tmp_path, args), "--store", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("python -m entrypoint: error: "), err
    assert not (tmp_path / "store").exists()  # found before anything was opened


@pytest.mark.parametrize("args, needle", [
    (["--tls-client-ca", "{ca}"], "mutual TLS (--tls-client-ca) needs --tls-cert and --tls-key as well"),
    (["--tls-key", "{server_key}"], "TLS needs both --tls-cert and --tls-key"),
    (["--tls-cert", "{server}", "--tls-key", "{client_key}"], "the TLS key does not match the certificate"),
    (["--entrypoint-ca", "{ca}"], "give --entrypoint too"),
    (["--entrypoint", "127.0.0.1:1", "--entrypoint-ca", "{ca}"], "use grpcs://127.0.0.1:1 for a TLS entrypoint"),
    (["--entrypoint", "grpcs://127.0.0.1:1", "--entrypoint-cert", "{client}"],
     "mutual TLS needs both --entrypoint-cert and --entrypoint-key"),
    (["--entrypoint", "grpcs://127.0.0.1:1", "--entrypoint-ca", "{missing}"], "cannot read --entrypoint-ca '"),
    (["--entrypoint", "https://127.0.0.1:1"], "expected HOST:PORT, grpc://HOST:PORT or grpcs://HOST:PORT"),
])
def test_worker_tls_misuse_is_one_line(certs, tmp_path, capsys, args, needle):
    assert worker_main(["--role", "ve", *_args(certs, tmp_path, args), "--store", str(tmp_path / "store")]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.splitlines()) == 1 and err.startswith("python -m entrypoint.worker: error: "), err
    assert not (tmp_path / "store").exists()


# ----------------------------------------------------------------------------- 4. a real stack
@pytest.mark.e2e  # a whole stack in processes
@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_a_tls_stack_serves_a_request_end_to_end(certs, tmp_path, mutual):
    client_files = dict(client_cert=certs["client"], client_key=certs["client_key"]) if mutual else {}
    tls = ClusterTLS(certs["ca"], certs["server"], certs["server_key"], **client_files)
    with Cluster(tmp_path, ve=0, prefill=1, decode=1, store="dir", worker_secret=SECRET, tls=tls) as c:
        assert c.entrypoint_address.startswith("grpcs://127.0.0.1:")
        workers = _list_workers(c.entrypoint_address, c.client_tls(), metadata=c.worker_metadata())
        assert sorted(w.address.split(":")[0] for w in workers) == ["grpcs", "grpcs"]  # the worker hop is TLS
        client = c.client()
        try:
            tokens, hops, summary = client.generate(PROMPT, max_new_tokens=3)
        finally:
            client.close()
        assert len(tokens) == 3, summary
        assert {"prefill", "decode"} <= {h["hop"] for h in hops}
        _refused(c.entrypoint_address.removeprefix("grpcs://"))  # plaintext: refused
        if mutual:
            _refused(c.entrypoint_address, ChannelTLS(certs["ca"]))  # no client certificate: refused


@pytest.mark.parametrize("server", ["entrypoint", "worker"])
def test_listening_beyond_loopback_without_tls_warns_that_secrets_travel_in_clear(server, caplog):
    from entrypoint.tls import warn_plaintext

    with caplog.at_level("WARNING", logger="entrypoint.tls"):
        warn_plaintext(server, "127.0.0.1", False)
        warn_plaintext(server, "10.0.0.5", True)
    assert not caplog.records  # loopback, or TLS on: nothing to say
    with caplog.at_level("WARNING", logger="entrypoint.tls"):
        warn_plaintext(server, "10.0.0.5", False)
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert f"the {server} listens on 10.0.0.5" in caplog.text and "clear text" in caplog.text


def test_help_shows_no_empty_defaults(capsys):
    """``--help`` gave every option without a default "(default: )"; an option with one still shows it."""
    from entrypoint.worker import main as worker_main

    for main in (entrypoint_main, worker_main):
        assert main(["--help"]) == 0
        out = capsys.readouterr().out
        assert "(default: )" not in out and "(default: None)" not in out and "(default: 127.0.0.1)" in out
