"""Misuse of the daemon and its client: each case is one typed error (``InvalidRequest``),
raised before anything is changed, and ``kvstore serve`` answers it with one line and exit 2.

Covers: client TLS options, listen/metrics ports that cannot be bound (the store is closed
again), non-finite or absurd numbers and malformed config files, CLI errors from the
environment (data dir, log level), batch kinds validated before a DeleteMany/PinMany
applies anything, client batches over ``max_batch_items`` sent in pieces, duplicate keys
charged once to a tenant quota, and malformed daemon URLs.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

import kvstore
from kvstore import CapacityExceeded, InvalidRequest, PutItem
from kvstore.embedded.index import ekey
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server import Daemon, ServerConfig, load_server_config
from kvstore.embedded.store import EmbeddedStore

from tests.kvstore.daemons import ROOT, health_ok, subprocess_env


def K(i) -> bytes:
    return f"misuse-key-{i}".encode().ljust(16, b"\0")[:16]


@pytest.fixture
def busy_port():
    """A 127.0.0.1 port held by a listening socket for the test's duration."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def serve_fails(tmp_path: Path, *args: str) -> str:
    """Run ``kvstore serve`` expecting a refused start: exit 2, one ``kvstore serve:`` line,
    no traceback. Returns that line."""
    cmd = [sys.executable, "-m", "kvstore.server.cli", "serve", *args]
    if "--data-dir" not in args:
        cmd += ["--data-dir", str(tmp_path / "data")]
    if "--port" not in args:
        cmd += ["--port", "0"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=subprocess_env())
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kvstore serve:")]
    assert len(lines) == 1, r.stderr[-3000:]
    assert r.stdout == ""  # never claimed to be serving
    return lines[0]


def _cfgs(tmp_path: Path, **over):
    over.setdefault("port", 0)
    over.setdefault("gc_interval_s", 0)
    over.setdefault("fsync", False)
    over.setdefault("data_dir", str(tmp_path / "data"))
    return load_server_config(None, env={}, **over)


# ---------------------------------------------------------------- 1. client TLS options
def test_client_cert_without_key_is_invalid_request_not_an_abort(certs) -> None:
    # In a child process: without the check, gRPC aborts the whole process (SIGABRT).
    code = (
        "import kvstore, sys\n"
        "for kw in ({'cert_file': sys.argv[2]}, {'key_file': sys.argv[3]}):\n"
        "    try:\n"
        "        kvstore.connect('grpcs://127.0.0.1:1', ca_file=sys.argv[1], **kw)\n"
        "    except kvstore.InvalidRequest as exc:\n"
        "        assert 'mutual TLS needs both cert_file and key_file' in str(exc), exc\n"
        "    else:\n"
        "        sys.exit('no error')\n"
        "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code, certs["ca"], certs["client"], certs["client_key"]],
                       capture_output=True, text=True, timeout=60, cwd=ROOT, env=subprocess_env())
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])


def test_client_tls_file_missing_or_not_pem_names_the_file(certs, tmp_path) -> None:
    with pytest.raises(InvalidRequest, match="/nonexistent.pem"):
        kvstore.connect("grpcs://127.0.0.1:1", ca_file="/nonexistent.pem")
    with pytest.raises(InvalidRequest, match="key_file '/nonexistent.key'"):
        kvstore.connect("grpcs://127.0.0.1:1", ca_file=certs["ca"], cert_file=certs["client"],
                        key_file="/nonexistent.key")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(InvalidRequest, match="not a PEM certificate"):
        kvstore.connect("grpcs://127.0.0.1:1", ca_file=str(junk))


# ---------------------------------------------------------------- 2. ports that cannot be bound
def test_port_in_use_closes_the_store_and_raises(tmp_path, busy_port) -> None:
    scfg, stcfg = _cfgs(tmp_path, port=busy_port)
    store = EmbeddedStore(stcfg)
    with pytest.raises(InvalidRequest, match=f"cannot listen on 127.0.0.1:{busy_port}"):
        Daemon(scfg, stcfg, store=store)
    assert store._closed
    scfg, stcfg = _cfgs(tmp_path, host="not a host!!")
    with pytest.raises(InvalidRequest, match="cannot listen"):
        Daemon(scfg, stcfg)
    d = Daemon(*_cfgs(tmp_path)).start()  # the data dir (its LMDB lock) was released each time
    d.stop(grace_s=0)


def test_serve_on_a_busy_port_says_one_line(tmp_path, busy_port) -> None:
    """``kvstore serve`` on a port in use: one line and exit 2, without gRPC's C-core log line
    ("add_port.cc ... Failed to add port") printed before it."""
    cmd = [sys.executable, "-m", "kvstore.server.cli", "serve", "--port", str(busy_port),
           "--data-dir", str(tmp_path / "d"), "--log-level", "WARNING"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=subprocess_env())
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{busy_port}" in lines[0], r.stderr


def test_port_taken_reads_bracketed_ipv6(busy_port) -> None:
    """``[::1]`` (how gRPC and daemon URLs write IPv6) is checked like ``::1``; before, the
    brackets made the lookup fail and a busy port was taken for a free one."""
    from kvstore.netaddr import port_taken

    assert port_taken("127.0.0.1", busy_port) and not port_taken("127.0.0.1", 0)
    try:
        s6 = socket.socket(socket.AF_INET6)
        s6.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with s6:
        s6.listen()
        port = s6.getsockname()[1]
        assert port_taken("[::1]", port) and port_taken("::1", port)


def test_tls_key_not_matching_the_certificate_is_invalid_request(tmp_path, certs) -> None:
    scfg, stcfg = _cfgs(tmp_path, tls_cert=certs["server"], tls_key=certs["client_key"])
    with pytest.raises(InvalidRequest, match="TLS key does not match"):
        Daemon(scfg, stcfg)


def test_metrics_port_in_use_stops_what_was_started(tmp_path, busy_port) -> None:
    scfg, stcfg = _cfgs(tmp_path, metrics_port=busy_port)
    d = Daemon(scfg, stcfg)
    with pytest.raises(InvalidRequest, match=f"cannot serve metrics on 127.0.0.1:{busy_port}"):
        d.start()
    assert d.store._closed and not health_ok(d.address, timeout=0.5)
    d.stop()  # idempotent after the failed start


def test_serve_refuses_busy_ports_and_bad_hosts_with_one_line(tmp_path, busy_port) -> None:
    assert "cannot listen" in serve_fails(tmp_path, "--port", str(busy_port))
    assert "cannot serve metrics" in serve_fails(tmp_path, "--metrics-port", str(busy_port))
    assert "cannot listen" in serve_fails(tmp_path, "--host", "not a host!!")


# ---------------------------------------------------------------- 3. non-finite and absurd numbers
@pytest.mark.parametrize("field", ["drain_s", "gc_interval_s"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan", "1e300", "1e10", "-1"])
def test_non_finite_or_huge_durations_are_refused(field, value) -> None:
    with pytest.raises(InvalidRequest, match=field):
        load_server_config(None, env={}, **{field: value})
    with pytest.raises(InvalidRequest, match=field):
        ServerConfig(**{field: float(value)})


def test_absurd_sizes_are_refused_at_config_time() -> None:
    with pytest.raises(InvalidRequest, match="max_message_bytes"):
        load_server_config(None, env={}, max_message_bytes=2**40)  # a C int inside gRPC
    with pytest.raises(InvalidRequest, match="tenant_quota_bytes"):
        load_server_config(None, env={}, tenant_quota_bytes=2**70)  # a u64 in the quota ledger


def test_serve_refuses_infinite_drain_with_one_line(tmp_path) -> None:
    assert "drain_s" in serve_fails(tmp_path, "--drain-s", "inf")
    assert "gc_interval_s" in serve_fails(tmp_path, "--gc-interval-s", "nan")


# ---------------------------------------------------------------- 4. config files
@pytest.mark.parametrize("text, match", [
    ("[server]\nport = 7070\n[store]\nec_k = 2\nec_m = 1\n[severr]\nport = 1\n", "severr"),
    ("stray = 1\n[server]\nport = 7070\n[store]\n", "stray"),
    ("[store]\nec_k = 2\nec_m = 1\n[severr]\n", "severr"),
    ("[server]\nport = 7070.9\n[store]\n", "integer"),
    ("[server]\nport = true\n", "integer"),
    ("[server]\ndrain_s = true\n", "number"),
    ("[server]\nallow_direct_reads = 1\n", "true or false"),
    ("[server]\nhost = 5\n", "string"),
    ("[server]\ngc_interval_s = inf\n", "gc_interval_s"),
    ("server = 5\n", "table"),
])
def test_config_file_mistakes_are_refused(tmp_path, text, match) -> None:
    cfg = tmp_path / "kv.toml"
    cfg.write_text(text)
    with pytest.raises(InvalidRequest, match=match):
        load_server_config(cfg, env={})


def test_config_file_good_forms_still_load(tmp_path) -> None:
    cfg = tmp_path / "kv.toml"
    cfg.write_text("[server]\nport = 7071.0\ndrain_s = 3\n[store]\nec_k = 2\nec_m = 1\n")
    scfg, stcfg = load_server_config(cfg, env={})
    assert (scfg.port, scfg.drain_s, stcfg.ec_k) == (7071, 3.0, 2)
    assert isinstance(scfg.port, int)
    with pytest.raises(InvalidRequest, match="integer"):
        ServerConfig(port=7070.9)


def test_serve_refuses_unknown_table_with_one_line(tmp_path) -> None:
    cfg = tmp_path / "kv.toml"
    cfg.write_text("[server]\ngc_interval_s = 0\n[store]\n[severr]\nport = 1\n")
    assert "severr" in serve_fails(tmp_path, "--config", str(cfg))


# ---------------------------------------------------------------- 5. CLI errors from the environment
def test_serve_bad_data_dir_or_log_level_is_one_line(tmp_path) -> None:
    f = tmp_path / "a-file"
    f.write_text("x")
    serve_fails(tmp_path, "--data-dir", str(f))
    serve_fails(tmp_path, "--data-dir", "/proc/nonexistent-kvstore/x")
    assert "--log-level" in serve_fails(tmp_path, "--log-level", "bogus")


# ---------------------------------------------------------------- 6. batch kinds validated first
def _meta(d: Daemon, key: bytes):
    with d.store.index.env.begin() as txn:
        return d.store.index.get_meta(txn, ekey(1, key))


@pytest.mark.parametrize("method", ["DeleteMany", "PinMany", "UnpinMany"])
def test_keys_batch_with_a_bad_kind_applies_nothing(make_daemon, method) -> None:
    d = make_daemon()
    with kvstore.connect(d.address) as s:
        assert s.put(K(1), b"v")
        if method == "UnpinMany":
            assert s.pin(K(1))
    before = _meta(d, K(1))
    with grpc.insecure_channel(d.address.split("://")[1]) as ch:
        call = ch.unary_unary(f"/kvstore.v1.KVStore/{method}", request_serializer=pb.KeysRequest.SerializeToString,
                              response_deserializer=pb.BoolsReply.FromString)
        req = pb.KeysRequest(keys=[pb.KeyRequest(key=K(1), kind="block"), pb.KeyRequest(key=K(2), kind="bogus")])
        with pytest.raises(grpc.RpcError) as ei:
            call(req, timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bogus" in ei.value.details()
    after = _meta(d, K(1))
    assert after is not None and after.pinned == before.pinned


# ---------------------------------------------------------------- 7. client batches in pieces
def _exercise_batches(s, n: int) -> None:
    keys = [K(f"b{i}") for i in range(n)]
    vals = [os.urandom(16 + i % 7) for i in range(n)]
    assert s.put_many([PutItem(k, v) for k, v in zip(keys, vals)]) == [True] * n
    assert s.put_many([PutItem(k, v) for k, v in zip(keys[:3], vals)]) == [False] * 3
    assert s.get_many(keys + [K("absent")]) == vals + [None]
    outs = [bytearray(32) for _ in keys]
    infos = s.get_many_into(keys, outs)
    assert [bytes(o[:i.nbytes]) for o, i in zip(outs, infos)] == vals
    assert s.pin_many(keys) == [True] * n
    assert s.unpin_many(keys) == [True] * n
    assert s.delete_many(keys + [K("absent")]) == [True] * n + [False]
    assert s.get_many(keys) == [None] * n


def test_batches_over_max_batch_items_go_in_pieces(make_daemon) -> None:
    d = make_daemon(max_batch_items=8)
    with kvstore.connect(d.address, max_batch_items=8) as s:
        _exercise_batches(s, 21)
        bad = [PutItem(K(f"v{i}"), b"v") for i in range(20)] + [PutItem(K("v20"), b"v", kind="bogus")]
        with pytest.raises(InvalidRequest, match="bogus"):
            s.put_many(bad)  # validated whole before the first piece is sent
        assert s.stats()["entries"] == 0
        with pytest.raises(InvalidRequest):
            s.delete_many([K(1)] * 10 + [b"short"])
        assert s.check() == []


def test_5000_items_with_the_default_limits(make_daemon) -> None:
    d = make_daemon()
    with kvstore.connect(d.address) as s:
        keys = [K(f"d{i}") for i in range(5000)]
        assert s.put_many([PutItem(k, k) for k in keys]) == [True] * 5000
        assert s.get_many(keys) == keys
        assert s.delete_many(keys) == [True] * 5000


def test_sharded_and_direct_batches_over_max_batch_items(make_daemon) -> None:
    ds = [make_daemon(max_batch_items=8) for _ in range(2)]
    with kvstore.connect(",".join(d.address for d in ds), max_batch_items=8) as s:
        _exercise_batches(s, 40)
    d = make_daemon(max_batch_items=8, allow_direct_writes=True)
    with kvstore.connect(d.address, max_batch_items=8, direct_reads="on", direct_writes="on") as s:
        _exercise_batches(s, 21)
        assert s.check() == []


# ---------------------------------------------------------------- 8. tenant quota and duplicates
def test_quota_charges_a_key_repeated_in_one_batch_once(make_daemon) -> None:
    d = make_daemon(tenant_quota_bytes=100_000)
    with kvstore.connect(d.address) as s:
        assert s.put(K("big"), os.urandom(60_000))
        v = os.urandom(30_000)
        assert s.put_many([PutItem(K("dup"), v), PutItem(K("dup"), v)]) == [True, False]
        assert s.get(K("dup")) == v
        with pytest.raises(CapacityExceeded):  # the quota still holds: 90,000 used
            s.put(K("more"), os.urandom(20_000))


@pytest.mark.parametrize("direct", [False, True], ids=["put", "direct-write"])
def test_a_put_indexed_before_its_eviction_found_no_room_is_charged_for_what_it_kept(make_daemon, direct) -> None:
    """The eviction after a put's index commit may find only pinned entries and the put's own,
    evict the put's last ones and raise ``CapacityExceeded``: the entries it indexed are
    charged to the tenant as any put's (``created`` says which), not let go with the error."""
    import hashlib

    def key(i) -> bytes:
        return hashlib.blake2b(repr(i).encode(), digest_size=16).digest()

    d = make_daemon(tenant_quota_bytes=1_000_000, capacity_bytes=100_000, high_watermark=1.0, low_watermark=0.5,
                    delete_grace_s=0, allow_direct_writes=True)
    with kvstore.connect(d.address) as plain:
        i = 0
        while d.store.used_bytes() < 74_000:  # pinned: room for one of the two entries below, not both
            assert plain.put(key(("pinned", i)), os.urandom(3_000)) and plain.pin(key(("pinned", i)))
            i += 1
    before = d.quota.used("")
    with kvstore.connect(d.address, direct_writes="on" if direct else "off") as s:
        with pytest.raises(CapacityExceeded) as ei:
            s.put_many([PutItem(key("a"), os.urandom(9_000)), PutItem(key("b"), os.urandom(9_000))])
    assert ei.value.created == [True, True]
    # Both were indexed (the second evicted again at once); a direct write is charged its entry bytes
    # (a header more than the payload: the daemon does not take a writer's word for less).
    assert 18_000 <= d.quota.used("") - before < 19_000


def test_created_of_a_batch_sent_in_pieces_counts_the_earlier_pieces() -> None:
    """A remote batch goes as consecutive pieces: a ``CapacityExceeded`` raised after the index
    commit of the third of five items says, per item of the whole batch, what was indexed."""
    from kvstore.client.puts import _created_of_all

    exc = CapacityExceeded("no room", created=[True])
    _created_of_all(exc, [True, False], 5)
    assert exc.created == [True, False, True, False, False]
    nothing = CapacityExceeded("over quota")
    _created_of_all(nothing, [True], 3)
    assert nothing.created is None


# ---------------------------------------------------------------- 9. daemon URLs
@pytest.mark.parametrize("url", [
    "grpc://127.0.0.1:99999", "grpc://127.0.0.1:0", "grpc://:7070", "grpc://127.0.0.1:", "grpc://127.0.0.1:x",
    "grpc://::1:7070", "grpc://a b:7070", "grpc://h:1/path",
    "grpc://127.0.0.1:7070,grpc://127.0.0.1:7071,", "grpc://127.0.0.1:7070,,grpc://127.0.0.1:7071",
    "grpc://127.0.0.1:7070,grpc://:7071",
])
def test_malformed_daemon_urls_are_refused_at_connect(url) -> None:
    with pytest.raises(InvalidRequest, match=r"grpc://HOST:PORT\[,grpc://HOST:PORT\.\.\.\]"):
        kvstore.connect(url)


def test_leading_comma_is_refused_too() -> None:
    with pytest.raises(InvalidRequest):
        kvstore.connect(",grpc://127.0.0.1:7070")
    from kvstore.client.connect import open_grpc

    with pytest.raises(InvalidRequest, match="stray comma"):
        open_grpc(",grpc://127.0.0.1:7070")


def test_good_daemon_urls_still_connect() -> None:
    for url in ("grpc://127.0.0.1:7070", "grpc://[::1]:7070", "grpc://localhost:7070/"):
        kvstore.connect(url).close()
    s = kvstore.connect("grpc://127.0.0.1:7070, grpc://127.0.0.1:7071")
    assert len(s.shards) == 2
    s.close()


def test_lookup_many_over_max_batch_items_in_all_chains_goes_in_pieces(make_daemon, tmp_path) -> None:
    """The daemon limits the chains and the keys in all chains of one LookupMany: the client
    sends whole chains in pieces within both, a longer chain alone, results in order."""
    d = make_daemon(max_batch_items=10)
    keys = [K(f"l{i}") for i in range(40)]
    chains = [keys[i:i + 3] for i in range(0, 30, 3)] + [keys[:25], keys[5:7], [], keys[30:40], keys[:1]]
    with kvstore.connect(d.address, max_batch_items=10) as s, \
            kvstore.connect(str(tmp_path / "model"), fsync=False) as model:
        for st in (s, model):
            st.put_many([PutItem(k, b"v") for k in keys[:20]])
        assert s.lookup_many(chains) == model.lookup_many(chains)


def test_a_trailing_slash_names_the_same_shard(make_daemon) -> None:
    ds = [make_daemon() for _ in range(2)]
    plain, slashed = ",".join(d.address for d in ds), ",".join(d.address + "/" for d in ds)
    with kvstore.connect(plain) as a, kvstore.connect(slashed) as b:
        a.put_many([PutItem(K(f"s{i}"), b"v") for i in range(30)])
        assert b.get_many([K(f"s{i}") for i in range(30)]) == [b"v"] * 30
    with pytest.raises(InvalidRequest):
        kvstore.connect(f"{ds[0].address},{ds[0].address}/")  # one daemon listed twice
