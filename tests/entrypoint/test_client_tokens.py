"""Client tokens (``entrypoint.client_tokens``): with a tokens file, a Generate acts for its token's
tenant only. Before, the request's ``tenant`` field was trusted as sent, so any client could
name another tenant and read which prompts it had cached (the lookup hop's cached tokens)."""

from __future__ import annotations

import json

import grpc
import pytest

import kvstore
from engine_plugin.reference import model_preset
from entrypoint import auth
from entrypoint.__main__ import main as entrypoint_main
from entrypoint.client import Client
from entrypoint.client_tokens import ClientAuth
from entrypoint.config import EntrypointConfig
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from entrypoint.server import serve
from entrypoint.walkthrough.launcher import Cluster
from kvstore.keys import BlockHasher
from tests.entrypoint.test_service import FIRST_TOKEN, SECRET, stack  # noqa: F401 - the fixture

ACME, GLOBEX = "acme-token-0123456789", "globex-token-0123456789"
TENANTS = {"default": b"", "acme": b"salt-a", "globex": b"salt-g"}
TOKENS = {ACME: "acme", GLOBEX: "globex"}
PROMPT = list(range(1, 50))  # 3 full blocks of 16, and one token more


def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _generate(stub, md, tenant: str = "") -> list:
    req = pb.GenerateRequest(token_ids=PROMPT, tenant=tenant, sampling=pb.Sampling(max_new_tokens=2))
    return list(stub.Generate(req, timeout=30, metadata=md))


def _hit_blocks(events) -> int:
    (lookup,) = [json.loads(e.detail) for e in events if e.kind == "hop" and json.loads(e.detail)["hop"] == "lookup"]
    return lookup["hit_blocks"]


def _seed_acme_prompt(svc) -> None:
    """Acme's prompt cached in the store under acme's salt, as acme's own prefill leaves it."""
    cfg = svc.cfg
    hasher = BlockHasher(cfg.namespace, cfg.block_size, TENANTS["acme"])
    for h in hasher.hash_blocks(PROMPT):
        svc.store.put(h, b"kv" * 8)


def test_a_token_acts_for_its_own_tenant_and_cannot_name_another(stack):  # noqa: F811
    svc, ch, fakes, entry = stack(tenants=TENANTS, client_tokens=TOKENS)
    for role, (fake, address) in fakes.items():
        svc.registry.add(fake.worker_id, role, address)
    _seed_acme_prompt(svc)
    stub = pbg.EntrypointStub(ch)
    mine = _generate(stub, _bearer(ACME))  # the field left empty: the token's tenant
    assert _hit_blocks(mine) == 3 and [e.token_id for e in mine if e.kind == "token"][0] == FIRST_TOKEN
    assert _hit_blocks(_generate(stub, _bearer(ACME), "acme")) == 3
    assert _hit_blocks(_generate(stub, _bearer(GLOBEX))) == 0  # globex's own salt: a miss
    for asked in ("acme", "no-such-tenant"):  # one answer either way: a token cannot probe tenant names
        with pytest.raises(grpc.RpcError) as ei:
            _generate(stub, _bearer(GLOBEX), asked)
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert ei.value.details() == "this token acts for its own tenant only; send tenant 'globex' or leave it empty"
    prefills = len(fakes["prefill"][0].prefills)
    for md in ((), _bearer("not-a-token-at-all"), (("authorization", ACME),)):
        with pytest.raises(grpc.RpcError) as ei:
            _generate(stub, md, "acme")
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED and "bearer token" in ei.value.details()
        with pytest.raises(grpc.RpcError) as ei:
            stub.ListWorkers(pb.Empty(), timeout=10, metadata=md)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(fakes["prefill"][0].prefills) == prefills  # the refused calls reached no worker
    assert len(stub.ListWorkers(pb.Empty(), timeout=10, metadata=_bearer(ACME)).workers) == 2
    client = Client(entry, token=GLOBEX)  # the library's client sends its token
    try:
        assert client.generate(PROMPT, max_new_tokens=2)[0][0] == FIRST_TOKEN
    finally:
        client.close()


def test_without_tokens_the_field_is_trusted_and_list_workers_stays_open(stack):  # noqa: F811
    svc, ch, fakes, _ = stack(tenants=TENANTS, worker_secret=SECRET)
    for role, (fake, address) in fakes.items():
        svc.registry.add(fake.worker_id, role, address)
    _seed_acme_prompt(svc)
    stub = pbg.EntrypointStub(ch)
    assert _hit_blocks(_generate(stub, (), "acme")) == 3
    assert len(stub.ListWorkers(pb.Empty(), timeout=10).workers) == 2


def test_with_tokens_list_workers_also_takes_the_worker_secret(stack):  # noqa: F811
    svc, ch, fakes, _ = stack(tenants=TENANTS, client_tokens=TOKENS, worker_secret=SECRET)
    svc.registry.add(fakes["decode"][0].worker_id, "decode", fakes["decode"][1])
    stub = pbg.EntrypointStub(ch)
    assert len(stub.ListWorkers(pb.Empty(), timeout=10, metadata=auth.metadata(SECRET)).workers) == 1
    with pytest.raises(grpc.RpcError) as ei:  # the worker secret is no client token
        _generate(stub, auth.metadata(SECRET), "acme")
    assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_token_for_an_unconfigured_tenant_is_refused_at_start():
    with pytest.raises(kvstore.InvalidRequest, match=r"tenant\(s\) \['initech'\] that are not configured"):
        EntrypointConfig(namespace=model_preset("tiny").namespace(), tenants=TENANTS,
                         client_tokens={**TOKENS, "initech-token-0123": "initech"})


def test_several_tenants_beyond_loopback_need_client_tokens(tmp_path):
    cfg = EntrypointConfig(namespace=model_preset("tiny").namespace(), tenants=TENANTS, worker_secret=SECRET)
    with pytest.raises(kvstore.InvalidRequest, match="beyond loopback.*--client-tokens"):
        serve(cfg, str(tmp_path / "refused"), host="0.0.0.0")
    assert not (tmp_path / "refused").exists()  # refused before the store was opened


def test_tokens_never_show_in_a_repr():
    cfg = EntrypointConfig(namespace=model_preset("tiny").namespace(), tenants=TENANTS, client_tokens=TOKENS)
    for text in (repr(cfg), repr(ClientAuth(TOKENS))):
        assert ACME not in text and GLOBEX not in text


def test_the_command_line_reads_the_tokens_file_and_refuses_a_bad_one(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[tokens]\n"short" = "acme"\n')
    assert entrypoint_main(["--client-tokens", str(bad), "--tenant", "acme=salt-a", "--store",
                            str(tmp_path / "s")]) == 2
    assert ">= 8 characters" in capsys.readouterr().err
    unknown = tmp_path / "unknown.toml"
    unknown.write_text(f'[tokens]\n"{ACME}" = "acme"\n')
    assert entrypoint_main(["--client-tokens", str(unknown), "--store", str(tmp_path / "s")]) == 2
    assert "['acme'] that are not configured" in capsys.readouterr().err
    latin1 = tmp_path / "latin1.toml"  # not UTF-8: before, a UnicodeDecodeError traceback, exit 1
    latin1.write_bytes(f'[tokens]\n"{ACME}" = "acm\xe9"\n'.encode("latin-1"))
    assert entrypoint_main(["--client-tokens", str(latin1), "--tenant", "acme=salt-a", "--store",
                            str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert f"cannot read tokens file {latin1}" in err and "Traceback" not in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("secret", [SECRET, ""])  # ListWorkers with the worker secret; without one, a client token
def test_cluster_waits_for_workers_on_an_entrypoint_with_client_tokens(stack, tmp_path, secret):  # noqa: F811
    """Before, ``Cluster.wait_for_workers`` called ``ListWorkers`` with no metadata, which an
    entrypoint with client tokens refuses: a ``Cluster`` could not run one."""
    svc, _, fakes, entry = stack(tenants=TENANTS, client_tokens=TOKENS, worker_secret=secret)
    svc.registry.add(fakes["decode"][0].worker_id, "decode", fakes["decode"][1])
    # with the secret it needs no tokens: as a Cluster that was handed an entrypoint it did not start
    c = Cluster(tmp_path / "cluster", worker_secret=secret, **({} if secret else {"client_tokens": TOKENS}))
    c.entrypoint_address = entry  # this in-process entrypoint instead of a started one
    c.wait_for_workers(1, timeout_s=10)


@pytest.mark.e2e  # a whole stack in processes
def test_a_real_cluster_runs_an_entrypoint_with_client_tokens(tmp_path):
    """``Cluster(client_tokens=...)`` starts the entrypoint with ``--client-tokens`` (a 0600 file
    in its work directory); ``client(token)`` sends the token, ``client()`` none."""
    c = Cluster(tmp_path, ve=0, prefill=1, decode=1, store="dir", client_tokens=TOKENS,
                entrypoint_args=("--tenant", "acme=salt-a", "--tenant", "globex=salt-g"))
    with c:  # start() returns once both workers are listed
        assert (tmp_path / "client-tokens.toml").stat().st_mode & 0o777 == 0o600
        acme = c.client(ACME)
        anonymous = c.client()
        try:
            tokens, _, summary = acme.generate(PROMPT, max_new_tokens=2, tenant="acme")
            assert len(tokens) == 2, summary
            with pytest.raises(grpc.RpcError) as ei:
                anonymous.generate(PROMPT, max_new_tokens=2)
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            acme.close()
            anonymous.close()
