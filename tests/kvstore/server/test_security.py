"""TLS, mutual TLS, bearer tokens with tenant namespacing, size and concurrency limits."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
from pathlib import Path

import grpc
import pytest

import kvstore
from kvstore import NotFound, PutItem
from kvstore.errors import InvalidRequest, StoreUnavailable
from kvstore.proto import kvstore_pb2 as pb
from kvstore.errors import PermissionDenied, RequestTooLarge, ServerBusy, Unauthenticated
from kvstore.embedded.store import EmbeddedStore

TOK_A, TOK_A2, TOK_B, TOK_OPS = "token-aaaaaaaa", "token-a2a2a2a2", "token-bbbbbbbb", "token-opsopsops"


def K(i) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


@pytest.fixture
def tokens_file(tmp_path):
    p = tmp_path / "tokens.toml"
    p.write_text(f'admin_tenants = ["ops"]\n[tokens]\n"{TOK_A}" = "tenant-a"\n"{TOK_A2}" = "tenant-a"\n'
                 f'"{TOK_B}" = "tenant-b"\n"{TOK_OPS}" = "ops"\n')
    return str(p)


def test_tls_round_trip_and_plaintext_refused(make_daemon, certs) -> None:
    d = make_daemon(tls_cert=certs["server"], tls_key=certs["server_key"])
    assert d.address.startswith("grpcs://")
    with kvstore.connect(d.address, ca_file=certs["ca"]) as s:
        assert s.put(K(1), b"secret") and s.get(K(1)) == b"secret"
    with kvstore.connect(d.address.replace("grpcs://", "grpc://"), timeout_s=3) as s:
        with pytest.raises(StoreUnavailable):
            s.get(K(1))
    with kvstore.connect(d.address, ca_file=certs["other_ca"], timeout_s=3) as s:  # untrusted server cert
        with pytest.raises(StoreUnavailable):
            s.get(K(1))


def test_mutual_tls_requires_a_client_certificate(make_daemon, certs) -> None:
    d = make_daemon(tls_cert=certs["server"], tls_key=certs["server_key"], tls_client_ca=certs["ca"])
    with kvstore.connect(d.address, ca_file=certs["ca"], cert_file=certs["client"],
                         key_file=certs["client_key"]) as s:
        assert s.put(K(2), b"m") and s.get(K(2)) == b"m"
    with kvstore.connect(d.address, ca_file=certs["ca"], timeout_s=3) as s:
        with pytest.raises(StoreUnavailable):
            s.get(K(2))


def test_no_or_wrong_token_is_unauthenticated(make_daemon, tokens_file) -> None:
    d = make_daemon(tokens_file=tokens_file)
    for opts in ({}, {"token": "wrong-token-123"}):
        with kvstore.connect(d.address, **opts) as s:
            with pytest.raises(Unauthenticated):
                s.put(K(1), b"x")
            with pytest.raises(Unauthenticated):
                s.lookup([K(1)])
    # the raw status is UNAUTHENTICATED
    with grpc.insecure_channel(d.address.split("://")[1]) as ch:
        call = ch.unary_unary("/kvstore.v1.KVStore/Lookup")
        with pytest.raises(grpc.RpcError) as ei:
            call(pb.LookupRequest(keys=[K(1)]).SerializeToString(), timeout=5)
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_tenants_are_isolated(make_daemon, tokens_file) -> None:
    d = make_daemon(tokens_file=tokens_file)
    a = kvstore.connect(d.address, token=TOK_A)
    a2 = kvstore.connect(d.address, token=TOK_A2)
    b = kvstore.connect(d.address, token=TOK_B)
    prompt = [K(f"prompt{i}") for i in range(6)]
    assert a.put_many([PutItem(k, b"A-kv-%d" % i) for i, k in enumerate(prompt)]) == [True] * 6
    a.put(prompt[5], b"A-swa", kind="swa")
    # the same tenant through another token sees everything
    assert a2.lookup(prompt) == kvstore.LookupResult(6, 6)
    # tenant B's lookup of A's exact prompt misses; reads, deletes and pins find nothing
    assert b.lookup(prompt) == kvstore.LookupResult(0, None)
    assert b.lookup_many([prompt]) == [kvstore.LookupResult(0, None)]
    with pytest.raises(NotFound):
        b.get(prompt[0])
    assert b.get_many(prompt) == [None] * 6
    assert b.delete(prompt[0]) is False and b.pin(prompt[0]) is False
    # no presence signal: B's put of the same key is a *new* entry, and does not touch A's
    assert b.put(prompt[0], b"B-kv") is True
    assert a.get(prompt[0]) == b"A-kv-0" and b.get(prompt[0]) == b"B-kv"
    assert a.lookup(prompt).hit_blocks == 6
    # admin-only maintenance
    with pytest.raises(PermissionDenied):
        a.stats()
    with pytest.raises(PermissionDenied):
        b.gc()
    with kvstore.connect(d.address, token=TOK_OPS) as ops:
        assert ops.stats()["entries"] == 8
        assert ops.check() == []
    for s in (a, a2, b):
        s.close()


def test_kvtool_deletes_what_inspect_names(make_daemon, tokens_file) -> None:
    """``delete_index_keys`` (kvtool delete) names keys as Inspect does: an admin's are index
    keys, so it can delete the entry ``inspect``/``verify`` showed it (before, Delete mapped them
    into the admin's own namespace: "no block entry"); another tenant's are its own keys, so
    the flag gives it no reach into anyone else's entries."""
    d = make_daemon(tokens_file=tokens_file)
    a, b, ops = (kvstore.connect(d.address, token=t) for t in (TOK_A, TOK_B, TOK_OPS))
    a.put_many([PutItem(K(i), b"A%d" % i) for i in range(3)])
    tenant = d.tokens.tenants_by_token[TOK_A.encode()]
    stored = [tenant.store_key(K(i)) for i in range(3)]  # stored[i] is K(i)'s index key
    with d.store.index.env.begin() as txn:
        assert sorted(bytes(k[1:]) for k, _ in d.store.index.iter_db(txn, "entries")) == sorted(stored)
    assert K(0) not in stored
    assert [v["state"] for v in ops.inspect_entries(stored)] == ["live"] * 3
    assert b.delete_index_keys(stored + [K(0)]) == [False] * 4  # B reaches neither A's index keys nor A's keys
    assert ops.delete(stored[0]) is False  # the plain API: the admin's own namespace, as its puts
    assert ops.delete_index_keys([stored[0]]) == [True]
    assert a.delete_index_keys([K(1), K(1)]) == [True, False]  # a tenant: its own keys
    assert sum(v is not None for v in a.get_many([K(i) for i in range(3)])) == 1
    with pytest.raises(kvstore.InvalidRequest, match="kvstore-index-keys"):  # only on Delete/DeleteMany
        ops._rpc.call("Get", pb.KeyRequest(key=stored[2]), md=(("kvstore-index-keys", "1"),))
    with pytest.raises(kvstore.InvalidRequest, match="kvstore-index-keys"):
        ops._rpc.call("Delete", pb.KeyRequest(key=stored[2]), md=(("kvstore-index-keys", "yes"),))
    for s in (a, b, ops):
        s.close()


def test_unrecoverable_names_the_callers_key(make_daemon, tokens_file, tmp_path) -> None:
    """A tenant's keys are stored hashed into its namespace; an ``Unrecoverable`` for one
    names the key the client asked for (in ``.key`` and the message), never the stored one.
    It names the failed targets to an admin only (target names may spell bucket and mount
    paths; Inspect hides placement from other tenants the same way)."""
    import shutil

    import kvstore.errors

    st = kvstore.connect(str(tmp_path / "lose"), fsync=False)
    d = make_daemon(store=st, tokens_file=tokens_file)
    with kvstore.connect(d.address, token=TOK_A) as a, kvstore.connect(d.address, token=TOK_OPS) as ops:
        a.put(K("doomed"), b"v" * 5000)
        ops.put(K("doomed"), b"o" * 5000)
        for t in ("t0", "t1", "t2"):  # m + 1 = 3 of the 4+2 fragments gone
            shutil.rmtree(st.targets[t].root)
        with pytest.raises(kvstore.errors.Unrecoverable) as ei:
            a.get(K("doomed"))
        with pytest.raises(kvstore.errors.Unrecoverable) as admin_ei:
            ops.get(K("doomed"))
        with pytest.raises(kvstore.NotFound) as nf:  # NotFound as well names the caller's key
            a.get(K("absent"))
    assert K("absent").hex() in str(nf.value)
    assert ei.value.key == K("doomed") and K("doomed").hex() in str(ei.value)
    assert ei.value.failed_targets == () and not any(t in str(ei.value) for t in ("t0", "t1", "t2"))
    assert set(admin_ei.value.failed_targets) == {"t0", "t1", "t2"} and "t0" in str(admin_ei.value)
    stored = [bytes(k[1:]) for k, _ in st.index.iter_db(st.index.env.begin(), "lost")]
    assert len(stored) == 2 and K("doomed") not in stored and not any(k.hex() in str(ei.value) for k in stored)


def test_a_tenants_write_errors_say_nothing_of_the_store_as_a_whole(make_daemon, tokens_file, tmp_path) -> None:
    """A put refused for capacity or failing targets: a tenant that is not an admin learns
    neither the bytes the store holds (every tenant's), that the rest is pinned, nor target
    names and paths (both came back word for word); an admin gets the store's own message.
    Describe shows a tenant no data directory (where tenant.secret lives by default)."""
    import kvstore.errors

    d = make_daemon(tokens_file=tokens_file, capacity_bytes=100_000, high_watermark=1.0, low_watermark=0.5,
                    delete_grace_s=0)
    with kvstore.connect(d.address, token=TOK_A) as a, kvstore.connect(d.address, token=TOK_OPS) as ops:
        i = 0
        while d.store.used_bytes() < 80_000:  # tenant A pins far over the goal (50 kB), under capacity
            assert a.put(K(("pinned", i)), os.urandom(9_000)) and a.pin(K(("pinned", i)))
            i += 1
        errs = {}
        with kvstore.connect(d.address, token=TOK_B) as b:
            for who, s in (("b", b), ("ops", ops)):
                with pytest.raises(kvstore.errors.CapacityExceeded) as ei:
                    for i in range(10):
                        s.put(K((who, i)), os.urandom(9_000))
                errs[who] = str(ei.value)
        assert "everything left is pinned" in errs["ops"] and "bytes" in errs["ops"], errs
        assert "pinned" not in errs["b"] and not re.search(r"\d{4}", errs["b"]) and "store is full" in errs["b"]
        assert a._rpc.call("Describe", pb.DescribeRequest()).data_dir == ""
        assert ops._rpc.call("Describe", pb.DescribeRequest()).data_dir == str(d.store.data_dir)
    for t in ("t0", "t1", "t2"):  # more targets failing than a put can replace
        root = d.store.targets[t].root
        shutil.rmtree(root)
        Path(root).write_bytes(b"not a directory")
    with kvstore.connect(d.address, token=TOK_B) as b, kvstore.connect(d.address, token=TOK_OPS) as ops:
        with pytest.raises(kvstore.errors.StoreUnavailable) as tenant_err:
            b.put(K("after"), b"x" * 1000)
        with pytest.raises(kvstore.errors.StoreUnavailable) as admin_err:
            ops.put(K("after"), b"x" * 1000)
    assert "t0" in str(admin_err.value) and str(d.store.data_dir) in str(admin_err.value)
    assert not re.search(r"\bt[0-5]\b|/", str(tenant_err.value)) and "retry later" in str(tenant_err.value)


def test_a_token_with_a_trailing_newline_works_and_a_control_character_is_refused(make_daemon, tokens_file,
                                                                                  monkeypatch) -> None:
    d = make_daemon(tokens_file=tokens_file)
    monkeypatch.setenv("KVSTORE_TOKEN", TOK_OPS + "\n")  # as `export KVSTORE_TOKEN="$(cat file)"` may leave it
    with kvstore.connect(d.address) as s:
        assert "daemon" in s.stats()  # before: INTERNAL "Invalid metadata"
    for bad in ("tok\x01en", "tok en", "tokén"):
        with pytest.raises(InvalidRequest, match="printable ASCII") as ei:
            kvstore.connect(d.address, token=bad)
        assert bad not in str(ei.value)  # a secret is never echoed


def test_tenant_keys_are_stable_across_restart(make_daemon, tokens_file, tmp_path) -> None:
    d = make_daemon(tokens_file=tokens_file, data_dir=str(tmp_path / "stable"))
    with kvstore.connect(d.address, token=TOK_A) as a:
        a.put(K("s"), b"kept")
    d.stop()
    d2 = make_daemon(tokens_file=tokens_file, data_dir=str(tmp_path / "stable"))
    with kvstore.connect(d2.address, token=TOK_A) as a:
        assert a.get(K("s")) == b"kept"


def test_oversized_message_is_resource_exhausted(make_daemon) -> None:
    d = make_daemon(max_message_bytes=1024 * 1024)
    with kvstore.connect(d.address) as s:
        assert s.put(K(1), b"x" * 1000)
        with pytest.raises(RequestTooLarge, match="max_message_bytes"):
            s.put(K(2), b"x" * (2 * 1024 * 1024))
        assert s.get_many([K(2)]) == [None]
    with kvstore.connect(d.address, max_message_bytes=256 * 1024) as s:  # the client's own limit
        with pytest.raises(RequestTooLarge):
            s.put(K(3), b"y" * (512 * 1024))
    with grpc.insecure_channel(d.address.split("://")[1]) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            ch.unary_unary("/kvstore.v1.KVStore/Put")(
                pb.PutRequest(key=K(4), value=b"z" * (2 * 1024 * 1024)).SerializeToString(), timeout=10)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


class _SlowStore(EmbeddedStore):
    """An embedded store whose ``get`` waits for a gate: a call that stays in flight."""

    gate: threading.Event
    entered: threading.Event

    def get_entry(self, key, *, kind="block"):
        self.entered.set()
        self.gate.wait(10)
        return super().get_entry(key, kind=kind)


def slow_store(tmp_path) -> _SlowStore:
    from kvstore.config import load_config

    st = _SlowStore(load_config(None, env={}, data_dir=str(tmp_path / "slow"), fsync=False))
    st.gate, st.entered = threading.Event(), threading.Event()
    return st


def test_get_many_fits_a_message_limit_below_a_stream_chunk(make_daemon) -> None:
    """A daemon's ``max_message_bytes`` may be below ``GET_STREAM_CHUNK_BYTES`` (1 MiB): a
    batch of values that each fit goes out in chunks within the limit. Before, two 40 KB
    values were packed into one 80 KB chunk and the batch failed with RequestTooLarge while
    each ``get`` worked."""
    d = make_daemon(max_message_bytes=64 * 1024)
    vals = [bytes([i]) * 40_000 for i in range(5)]
    with kvstore.connect(d.address, max_message_bytes=64 * 1024) as s:
        for i, v in enumerate(vals):
            assert s.put(K(100 + i), v)
        assert s.get_many([K(100 + i) for i in range(5)] + [K(99)]) == vals + [None]


def test_concurrency_limit_is_resource_exhausted(make_daemon, tmp_path) -> None:
    st = slow_store(tmp_path)
    d = make_daemon(store=st, max_concurrent_requests=1)
    s = kvstore.connect(d.address)
    s.put(K(1), b"v")
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("v", s.get(K(1))))
    t.start()
    assert st.entered.wait(10)
    with pytest.raises(ServerBusy, match="max_concurrent_requests"):
        s.lookup([K(1)])
    with grpc.insecure_channel(d.address.split("://")[1]) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            ch.unary_unary("/kvstore.v1.KVStore/Lookup")(pb.LookupRequest(keys=[K(1)]).SerializeToString(), timeout=5)
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    st.gate.set()
    t.join(10)
    assert result["v"] == b"v"
    assert s.lookup([K(1)]).hit_blocks == 1  # admitted again once the slot is free
    s.close()


@pytest.mark.parametrize("body, match", [
    ('admin_tenants = "ops"\n', "admin_tenants must be a list"),  # would make tenants o, p and s admins
    ("admin_tenants = [1]\n", "admin_tenants must be a list"),
    ('admin_tenant = ["ops"]\n', "unknown key"),  # a typo: silently no admins
    # tokens a client could never send in a gRPC header: before, loaded and never authenticating
    ('[tokens]\n" padded-token-1 " = "p"\n', "printable ASCII"),
    ('[tokens]\n"t\u00f6ken-\u00fcnicode" = "u"\n', "printable ASCII"),
])
def test_a_malformed_tokens_file_is_refused(tmp_path, body, match) -> None:
    from kvstore.errors import InvalidRequest
    from kvstore.auth import TokenTable

    p = tmp_path / "tokens.toml"
    p.write_text(body if "[tokens]" in body else body + f'[tokens]\n"{TOK_A}" = "o"\n"{TOK_OPS}" = "ops"\n')
    with pytest.raises(InvalidRequest, match=match):
        TokenTable.load(str(p), b"s" * 32)
    p.write_text(f'admin_tenants = ["ops"]\n[tokens]\n"{TOK_A}" = "o"\n"{TOK_OPS}" = "ops"\n')
    table = TokenTable.load(str(p), b"s" * 32)
    assert {t.name: t.admin for t in table.tenants_by_token.values()} == {"o": False, "ops": True}


def test_one_tenants_stalled_streams_cannot_take_every_handler_thread(make_daemon, tokens_file) -> None:
    """A stream holds its handler thread while it receives (or sends), and admission runs on a
    handler thread. With the old defaults (32 threads, 32 slots per tenant) one tenant's 32
    stalled PutStreams held every thread: every other tenant's call queued until its deadline,
    and even that tenant's 33rd was never refused. Admission now always has threads left
    (max_concurrent_requests < workers, checked): the others are served, the 33rd refused."""
    import time

    d = make_daemon(tokens_file=tokens_file, stream_receive_s=30.0)  # the default limits
    cfg = d.cfg
    assert cfg.max_concurrent_per_tenant < cfg.max_concurrent_requests < cfg.workers
    ch = grpc.insecure_channel(d.address.split("://")[1])
    stalled = threading.Event()

    def nothing():
        stalled.wait(30)
        return
        yield  # noqa: unreachable - a generator that sends nothing

    call = ch.stream_unary("/kvstore.v1.KVStore/PutStream")
    md = [("authorization", f"Bearer {TOK_A}")]
    futs = [call.future(nothing(), metadata=md, timeout=60) for _ in range(cfg.max_concurrent_per_tenant)]
    try:
        with kvstore.connect(d.address, token=TOK_A, timeout_s=10) as a:
            deadline = time.monotonic() + 20
            with pytest.raises(ServerBusy, match="max_concurrent_per_tenant"):
                while time.monotonic() < deadline:  # admitted until every stream holds its slot
                    a.lookup([K("a")])
                    time.sleep(0.05)
        t0 = time.monotonic()
        with kvstore.connect(d.address, token=TOK_B, timeout_s=10) as b:
            assert b.put(K("b"), b"served") and b.get(K("b")) == b"served"
        assert time.monotonic() - t0 < 10
    finally:
        stalled.set()
        for f in futs:
            try:
                f.result(timeout=30)
            except grpc.RpcError:
                pass
        ch.close()


@pytest.mark.parametrize("over", [{"workers": 8, "max_concurrent_requests": 8}, {"workers": 1},
                                  {"workers": 64, "max_concurrent_requests": 64}])
def test_admission_limits_must_leave_handler_threads_free(over) -> None:
    from kvstore.server.config import ServerConfig

    with pytest.raises(InvalidRequest, match="max_concurrent_requests must be below workers"):
        ServerConfig(**over)


@pytest.mark.parametrize("over, want", [({}, (48, 64)), ({"workers": 32}, (24, 32)),
                                        ({"max_concurrent_requests": 64}, (64, 85)),
                                        ({"workers": 10, "max_concurrent_requests": 9}, (9, 10))])
def test_one_admission_limit_set_derives_the_other(over, want) -> None:
    """A config that set only one of the two (the old defaults were 64 and 32, both fine alone)
    still starts: the other is derived so that threads stay free for refusals."""
    from kvstore.server.config import ServerConfig

    cfg = ServerConfig(**over)
    assert (cfg.max_concurrent_requests, cfg.workers) == want


def test_a_tokens_file_that_is_not_utf8_is_one_line_not_a_traceback(tmp_path) -> None:
    """tomllib raises UnicodeDecodeError (no TOMLDecodeError) for bytes that are not UTF-8;
    before, it escaped ``read_tokens_file`` and ``kvstore serve`` died with a traceback, exit 1."""
    from kvstore.auth import TokenTable

    from tests.kvstore.server.test_misuse import serve_fails

    p = tmp_path / "tokens.toml"
    p.write_bytes(f'[tokens]\n"{TOK_A}" = "tenant-\xe9"\n'.encode("latin-1"))
    with pytest.raises(InvalidRequest, match=f"cannot read tokens file {re.escape(str(p))}.*utf-8"):
        TokenTable.load(str(p), b"s" * 32)
    assert str(p) in serve_fails(tmp_path, "--tokens-file", str(p))
