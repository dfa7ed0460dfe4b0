"""The remote client's TLS rule and its learning of the daemon's ``max_batch_items``.

1. TLS is decided by the URL scheme (``kvstore.client.remote``'s module docstring): ``grpcs://``
   is TLS (``ca_file`` optional: the system roots without it), ``grpc://`` is plaintext,
   and TLS options with ``grpc://`` URLs only are refused before any channel is opened.
   In a shard list with a ``grpcs://`` URL they are for those shards.
2. A client left at its default ``max_batch_items`` talks to a daemon with a lower
   limit: the first over-limit batch is refused (nothing applied), the client learns the
   limit from the refusal and resends in pieces; later batches cost no refusal.

Everything listens on 127.0.0.1 (``make_daemon``); certificates from ``certs``.
"""

from __future__ import annotations

import hashlib
import time

import grpc
import pytest

import kvstore
from kvstore import InvalidRequest, PutItem
from kvstore.errors import StoreUnavailable
from kvstore.proto import kvstore_pb2 as pb
from kvstore.client.options import ClientOptions
from kvstore.client.remote import RemoteStore
from kvstore.errors import BatchTooLarge
from kvstore.wire import MD_BATCH_LIMIT, error_from_rpc, status_of

TLS_ENV = ("KVSTORE_CA_FILE", "KVSTORE_CERT_FILE", "KVSTORE_KEY_FILE")


def K(i) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


@pytest.fixture(autouse=True)
def _no_tls_env(monkeypatch) -> None:
    """The TLS options come from the environment too: start every test without them."""
    for name in TLS_ENV:
        monkeypatch.delenv(name, raising=False)


def _tls_daemon(make_daemon, certs, **over):
    return make_daemon(tls_cert=certs["server"], tls_key=certs["server_key"], **over)


def _calls(d, method: str, code: str) -> float:
    return d.metrics.registry.get_sample_value("kvstore_requests_total", {"method": method, "code": code}) or 0.0


# ---------------------------------------------------------------- 1. the scheme decides TLS
def test_grpc_url_with_a_client_certificate_only_is_refused_not_plaintext(make_daemon, certs, monkeypatch) -> None:
    d = make_daemon()  # a plaintext daemon the old client would have reached in plaintext
    opened: list[str] = []
    real_insecure, real_secure = grpc.insecure_channel, grpc.secure_channel
    monkeypatch.setattr(grpc, "insecure_channel", lambda *a, **kw: opened.append("plain") or real_insecure(*a, **kw))
    monkeypatch.setattr(grpc, "secure_channel", lambda *a, **kw: opened.append("tls") or real_secure(*a, **kw))
    with pytest.raises(InvalidRequest, match=r"use grpcs://127\.0\.0\.1:\d+ for TLS") as ei:
        kvstore.connect(d.address, cert_file=certs["client"], key_file=certs["client_key"])
    assert "cert_file, key_file" in str(ei.value) and "\n" not in str(ei.value)
    assert opened == []  # refused before any channel was opened
    with pytest.raises(InvalidRequest, match="use grpcs://"):
        RemoteStore(d.address, ClientOptions(cert_file=certs["client"], key_file=certs["client_key"]))
    assert opened == []


def test_grpc_url_with_ca_file_is_refused_from_options_or_environment(certs, monkeypatch) -> None:
    with pytest.raises(InvalidRequest, match="use grpcs://127.0.0.1:7070 for TLS"):
        kvstore.connect("grpc://127.0.0.1:7070", ca_file=certs["ca"])
    with pytest.raises(InvalidRequest, match="server_name"):
        kvstore.connect("grpc://127.0.0.1:7070", server_name="localhost")
    with pytest.raises(InvalidRequest, match="use grpcs://"):  # a list of grpc:// URLs only: the same
        kvstore.connect("grpc://127.0.0.1:7070,grpc://127.0.0.1:7071", ca_file=certs["ca"])
    monkeypatch.setenv("KVSTORE_CA_FILE", certs["ca"])
    with pytest.raises(InvalidRequest, match="KVSTORE_CA_FILE in the environment"):
        kvstore.connect("grpc://127.0.0.1:7070")
    with pytest.raises(InvalidRequest):  # not a connect option
        kvstore.connect("grpcs://127.0.0.1:7070", grpcs_in_set=True)


def test_the_scheme_not_ca_file_decides_tls(make_daemon, certs) -> None:
    d = _tls_daemon(make_daemon, certs, tls_client_ca=certs["ca"])
    mtls = dict(ca_file=certs["ca"], cert_file=certs["client"], key_file=certs["client_key"])
    with kvstore.connect(d.address, **mtls) as s:
        assert s.put(K(1), b"secret") and s.get(K(1)) == b"secret"
    with kvstore.connect(d.address, **mtls, server_name="localhost") as s:
        assert s.get(K(1)) == b"secret"
    # the old client dialled TLS here because ca_file was given; now the scheme says plaintext: refused
    with pytest.raises(InvalidRequest, match="use grpcs://"):
        kvstore.connect(d.address.replace("grpcs://", "grpc://"), **mtls)


def test_grpcs_without_ca_file_against_a_private_ca_fails_typed_and_bounded(make_daemon, certs) -> None:
    d = _tls_daemon(make_daemon, certs)
    with kvstore.connect(d.address, timeout_s=3) as s:  # the system roots do not know the test CA
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="ca_file") as ei:
            s.get(K(1))
        assert time.monotonic() - t0 < 10
    assert "\n" not in str(ei.value)
    with kvstore.connect(d.address, ca_file=certs["ca"]) as s:  # the right CA: the same daemon works
        assert s.put(K(2), b"v") and s.get(K(2)) == b"v"


def test_a_connection_the_daemon_closes_says_what_to_check(make_daemon, certs) -> None:
    """Plaintext to a TLS daemon, or TLS without a client certificate to a daemon requiring
    one: gRPC says only "Socket closed"; the error now says what to check (before: nothing)."""
    d = _tls_daemon(make_daemon, certs, tls_client_ca=certs["ca"])
    for url, opts in ((d.address.replace("grpcs://", "grpc://"), {}), (d.address, {"ca_file": certs["ca"]})):
        with kvstore.connect(url, timeout_s=3, **opts) as s:
            with pytest.raises(StoreUnavailable) as ei:
                s.get(K(1))
        msg = str(ei.value)
        assert "\n" not in msg and ("grpcs://" in msg or "ca_file" in msg), msg
        assert "cert_file" in msg or "ca_file" in msg, msg


@pytest.mark.parametrize("source", ["option", "environment"])
def test_a_sharded_set_mixing_grpcs_and_grpc(make_daemon, certs, monkeypatch, source) -> None:
    # both daemons at a low max_batch_items: each shard's client learns it (about 20 keys per shard)
    tls = _tls_daemon(make_daemon, certs, name="tls", max_batch_items=8)
    plain = make_daemon(name="plain", max_batch_items=8)
    url = f"{tls.address},{plain.address}"
    opts = {"ca_file": certs["ca"]}
    if source == "environment":
        monkeypatch.setenv("KVSTORE_CA_FILE", certs["ca"])
        opts = {}
    keys = [K(f"m{i}") for i in range(40)]
    with kvstore.connect(url, **opts) as s, kvstore.connect(url, **opts) as again:
        assert [sh.url for sh in s.shards] == [tls.address, plain.address]
        assert s.put_many([PutItem(k, k * 2) for k in keys]) == [True] * 40
        assert again.get_many(keys + [K("absent")]) == [k * 2 for k in keys] + [None]
        assert s.get(keys[0]) == keys[0] * 2
        assert s.lookup(keys) == kvstore.LookupResult(40, None)
        assert s.lookup_many([keys[:10], keys[:3] + [K("absent")], []]) == [
            kvstore.LookupResult(10, None), kvstore.LookupResult(3, None), kvstore.LookupResult(0, None)]
        assert [sh._rpc.batch_items for sh in s.shards] == [8, 8]
        per = s.stats()["shards"]
        assert per[tls.address]["entries"] > 0 and per[plain.address]["entries"] > 0  # both shards used
        assert per[tls.address]["entries"] + per[plain.address]["entries"] == 40
    # A ShardedStore built directly (not through connect) takes the same rule for a mixed list.
    from kvstore.client.options import ClientOptions
    from kvstore.client.sharded import ShardedStore

    with ShardedStore([tls.address, plain.address], ClientOptions(ca_file=certs["ca"])) as direct:
        assert direct.get_many(keys[:5]) == [k * 2 for k in keys[:5]]


# ---------------------------------------------------------------- 2. the daemon's max_batch_items
def _model(tmp_path):
    return kvstore.connect(str(tmp_path / "model"), fsync=False)


def _exercise(s, model, n: int = 50) -> None:
    """Every batched call of ``n`` items against the embedded store's answers."""
    keys = [K(f"b{i}") for i in range(n)]
    items = [PutItem(k, b"v%d" % i) for i, k in enumerate(keys)]
    for st in (s, model):
        assert st.put_many(items) == [True] * n
    absent = [K("absent")]
    assert s.get_many(keys + absent) == model.get_many(keys + absent) == [b"v%d" % i for i in range(n)] + [None]
    outs = [bytearray(8) for _ in keys]
    infos = s.get_many_into(keys, outs)
    assert [bytes(o[:i.nbytes]) for o, i in zip(outs, infos)] == [b"v%d" % i for i in range(n)]
    chains = [keys[i:i + 3] for i in range(0, 30, 3)] + [keys, keys[5:7] + absent, [], keys[40:]]
    assert s.lookup_many(chains) == model.lookup_many(chains)
    assert s.lookup(keys + absent) == model.lookup(keys + absent)
    assert s.probe(keys + absent) == (b"\1" * n + b"\0", b"\0" * (n + 1))
    assert s.pin_many(keys) == [True] * n and s.unpin_many(keys) == [True] * n
    assert s.delete_many(keys + absent) == [True] * n + [False]
    assert s.get_many(keys) == [None] * n


def test_a_default_client_learns_a_lower_daemon_limit(make_daemon, tmp_path) -> None:
    d = make_daemon(max_batch_items=8)
    with kvstore.connect(d.address) as s, _model(tmp_path) as model:
        assert s.options.max_batch_items == 4096  # the client's default, left alone
        _exercise(s, model)
        assert s.check() == [] and s.stats()["entries"] == 0
        refused = _calls(d, "PutStream", "INVALID_ARGUMENT")
        assert refused == 1  # learned on the first put_many
        assert s.put_many([PutItem(K(f"again{i}"), b"x") for i in range(50)]) == [True] * 50
        assert _calls(d, "PutStream", "INVALID_ARGUMENT") == refused  # steady state: no refused call
        assert _calls(d, "PutStream", "OK") == 2 * 7  # 50 items in pieces of 8, twice


@pytest.mark.parametrize("first", ["put_many", "get_many", "get_many_into", "delete_many", "pin_many",
                                   "lookup_many", "lookup", "probe"])
def test_every_batch_call_learns_the_limit_on_its_own(make_daemon, first) -> None:
    """Whichever batch call meets the daemon's refusal first learns the limit and succeeds."""
    d = make_daemon(max_batch_items=8)
    keys = [K(f"f{i}") for i in range(50)]
    with kvstore.connect(d.address, max_batch_items=8) as seed:
        seed.put_many([PutItem(k, b"v") for k in keys[:30]])
    with kvstore.connect(d.address) as s:
        got = {
            "put_many": lambda: s.put_many([PutItem(k, b"v") for k in keys]) == [False] * 30 + [True] * 20,
            "get_many": lambda: s.get_many(keys) == [b"v"] * 30 + [None] * 20,
            "get_many_into": lambda: [i is not None for i in s.get_many_into(keys, [bytearray(4) for _ in keys])]
            == [True] * 30 + [False] * 20,
            "delete_many": lambda: s.delete_many(keys) == [True] * 30 + [False] * 20,
            "pin_many": lambda: s.pin_many(keys) == [True] * 30 + [False] * 20,
            "lookup_many": lambda: s.lookup_many([keys[:5], keys[:40], keys[10:14]]) == [
                kvstore.LookupResult(5, None), kvstore.LookupResult(30, None), kvstore.LookupResult(4, None)],
            "lookup": lambda: s.lookup(keys) == kvstore.LookupResult(30, None),
            "probe": lambda: s.probe(keys) == (b"\1" * 30 + b"\0" * 20, b"\0" * 50),
        }[first]()
        assert got
        assert s._rpc.batch_items == 8


def test_direct_reads_and_writes_learn_the_limit_too(make_daemon, tmp_path) -> None:
    """A refused Commit indexed nothing (its packs are removed) and a refused Locate read nothing."""
    d = make_daemon(max_batch_items=8, allow_direct_writes=True)
    with kvstore.connect(d.address, direct_reads="on", direct_writes="on") as s, _model(tmp_path) as model:
        _exercise(s, model)
        assert s.direct_write_stats()["active"] and s.direct_stats()["active"]
        assert _calls(d, "Commit", "INVALID_ARGUMENT") == 1
        assert s.check() == [] and s.stats()["entries"] == 0


def test_the_clients_option_stays_an_upper_bound(make_daemon) -> None:
    d = make_daemon(max_batch_items=8)
    keys = [K(f"u{i}") for i in range(50)]
    with kvstore.connect(d.address, max_batch_items=3) as s:  # lower than the daemon's: used as is
        assert s.put_many([PutItem(k, b"v") for k in keys]) == [True] * 50
        assert _calls(d, "PutStream", "OK") == 17 and _calls(d, "PutStream", "INVALID_ARGUMENT") == 0
    with kvstore.connect(d.address, max_batch_items=20) as s:  # higher: the daemon's limit wins
        assert s.get_many(keys) == [b"v"] * 50
        assert s._rpc.batch_items == 8
    with kvstore.connect(d.address, max_batch_items=8) as s:  # equal: never refused
        assert s.delete_many(keys) == [True] * 50
        assert _calls(d, "DeleteMany", "INVALID_ARGUMENT") == 0


def test_the_refusal_carries_the_limit_and_is_retried_once(make_daemon) -> None:
    d = make_daemon(max_batch_items=8)
    with kvstore.connect(d.address) as s:  # the raw refusal: typed, with the daemon's limit
        with pytest.raises(BatchTooLarge, match="max_batch_items=8") as ei:
            s._rpc.call("GetMany", pb.GetManyRequest(keys=[K(i) for i in range(9)]))
        assert ei.value.limit == 8 and isinstance(ei.value, InvalidRequest)
    status, md = status_of(BatchTooLarge("too many", limit=8))
    assert status is grpc.StatusCode.INVALID_ARGUMENT and (MD_BATCH_LIMIT, "8") in md

    class Refused(grpc.RpcError):
        def __init__(self, limit: str):
            self.md = (("kvstore-error-code", "INVALID_REQUEST"), (MD_BATCH_LIMIT, limit))

        def trailing_metadata(self):
            return self.md

        def details(self) -> str:
            return "over max_batch_items"

        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

    for bad in ("", "0", "-3", "x", "99999999999"):  # no usable limit: a plain InvalidRequest
        e = error_from_rpc(Refused(bad))
        assert type(e) is InvalidRequest
    assert error_from_rpc(Refused("8")).limit == 8

    s = RemoteStore("grpc://127.0.0.1:7070")  # no daemon needed: sends are simulated
    sent: list[int] = []

    def daemon_at(limit: int):
        def send(p: slice) -> int:
            sent.append(p.stop - p.start)
            if p.stop - p.start > limit:
                raise BatchTooLarge("refused", limit=limit)
            return p.stop - p.start
        return send

    assert [n for _, n in s._rpc.each_piece(50, daemon_at(8))] == [8] * 6 + [2]
    assert sent[0] == 50 and s._rpc.batch_items == 8
    with pytest.raises(BatchTooLarge):  # a second refusal in the same call is raised, not retried again
        def shrinking(p: slice) -> int:
            raise BatchTooLarge("refused", limit=max(1, (p.stop - p.start) // 2))
        list(s._rpc.each_piece(50, shrinking))
    with pytest.raises(BatchTooLarge):  # a refusal naming no lower limit is raised at once
        list(s._rpc.each_piece(5, lambda p: (_ for _ in ()).throw(BatchTooLarge("refused", limit=8))))
    s.close()


class _Unavailable(grpc.RpcError):
    """A failed call as gRPC reports it without kvstore metadata (the daemon never answered)."""

    def __init__(self, details: str):
        self._details = details

    def trailing_metadata(self):
        return ()

    def details(self) -> str:
        return self._details

    def code(self):
        return grpc.StatusCode.UNAVAILABLE


def test_the_closed_connection_hint_is_for_connect_failures_only() -> None:
    """A daemon killed under a running call ("Stream removed (Socket closed)") got the TLS hint of a
    connection closed at once ("if it serves TLS use grpcs://") on a plaintext setup that had
    worked until then. The hint stays for a connection refused at connect (TLS on one side)."""
    at_connect = ("failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:7070: "
                  "Socket closed")
    assert "closed the connection" in str(error_from_rpc(_Unavailable(at_connect), "Get"))
    mid_call = str(error_from_rpc(_Unavailable("Stream removed (Socket closed)"), "PutStream"))
    assert "unreachable" in mid_call and "grpcs://" not in mid_call and "closed the connection" not in mid_call


def test_a_client_key_that_is_not_the_certificates_is_refused_at_connect(certs) -> None:
    """Accepted at connect before, it failed every call with gRPC's "Failed to create security
    handshaker." and no hint."""
    url = "grpcs://127.0.0.1:7070"  # nothing is dialled: refused before the channel opens
    with pytest.raises(InvalidRequest, match="key does not match the certificate.*key_file"):
        kvstore.connect(url, ca_file=certs["ca"], cert_file=certs["client"], key_file=certs["server_key"])


def test_an_error_the_daemon_sends_names_the_daemon(make_daemon, tmp_path) -> None:
    """Unauthenticated, ServerBusy and PermissionDenied said nothing of which daemon sent them: in a
    sharded set one cannot tell which shard refused."""
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tokens]\n"good-token-1" = "t"\n')
    d = make_daemon(tokens_file=str(tokens))
    with kvstore.connect(d.address, token="wrong-token-1") as s:
        with pytest.raises(kvstore.errors.KVStoreError, match=f"on {d.address}") as ei:
            s.get(K(1))
        assert type(ei.value).__name__ == "Unauthenticated"
    with kvstore.connect(d.address, token="good-token-1") as s:
        with pytest.raises(kvstore.errors.KVStoreError, match=f"on {d.address}") as ei:
            s.stats()  # admin only
        assert type(ei.value).__name__ == "PermissionDenied"
