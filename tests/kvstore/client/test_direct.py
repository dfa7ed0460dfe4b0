"""Direct reads (kvstore.client.direct_reads): the client reads the daemon's fragments itself, the daemon says where.

The behaviour suite (test_behaviour.py) runs every protocol call with direct reads on;
these tests pin what is particular to them: damaged fragments fall back to the daemon
(which alone counts degraded reads and marks entries lost), Locate is namespaced per
tenant and refreshes LRU as a get does, "auto" only turns on where it should, and a
daemon can refuse the whole thing.
"""

from __future__ import annotations

import hashlib
import os

import grpc
import numpy as np
import pytest

import kvstore
from kvstore import EntryKind, NotFound, PutItem, Unrecoverable
from kvstore.config import TargetSpec
from kvstore.client.direct_reads import DirectReads, auto_decision, client_url
from kvstore.errors import KVStoreError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.errors import PermissionDenied, Unauthenticated
from kvstore.embedded.targets import LocalTarget
from tests.fragments import FragmentRef, fragment_refs

from tests.kvstore.server.test_security import TOK_A, TOK_B, tokens_file  # noqa: F401 - a fixture


def K(i) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def frag_files(d, key: bytes, kind: str = "block") -> list[FragmentRef]:
    """Fragments of a live entry of daemon ``d``, fragment i at position i (anonymous tenant)."""
    return fragment_refs(d.store, key, kind)


def flip_last_byte(f: FragmentRef) -> None:
    b = bytearray(f.read_bytes())
    b[-1] ^= 0xFF
    f.write_bytes(bytes(b))


def counter(d, name: str) -> int:
    return d.store.counters[name]


def test_damaged_fragments_fall_back_to_the_daemon(make_daemon) -> None:
    d = make_daemon(segments=False)  # single puts as fragment files, a batch as a pack: both read paths
    s = kvstore.connect(d.address, direct_reads="on")
    vals = {n: os.urandom(200_000) for n in "ABCD"}
    assert s.put(K("A"), vals["A"]) and s.put(K("D"), vals["D"])  # fragment files
    assert s.put_many([PutItem(K(n), vals[n]) for n in "BC"]) == [True] * 2  # a pack
    assert frag_files(d, K("B"))[0].packed and not frag_files(d, K("A"))[0].packed
    assert s.get_many([K(n) for n in vals]) == list(vals.values())  # clean: all direct
    assert s.direct_stats()["counters"]["direct_reads"] == 4
    frag_files(d, K("A"))[1].remove()  # a missing data fragment
    flip_last_byte(frag_files(d, K("B"))[0])  # a corrupt one inside the pack (checksum fails)
    frag_files(d, K("D"))[2].remove()
    before = counter(d, "degraded_reads")

    assert s.get(K("A")) == vals["A"]  # get: direct read degraded -> the daemon's Get
    assert s.get_many([K("B"), K("C"), K("nope")]) == [vals["B"], vals["C"], None]  # get_many: B via GetStream
    out = np.zeros(200_000, np.uint8)
    (info,) = s.get_many_into([K("D")], [out])  # into caller buffers, then the daemon's copy
    assert info is not None and info.nbytes == 200_000 and out.tobytes() == vals["D"]

    assert counter(d, "degraded_reads") - before == 3  # the daemon saw (and counted) every damaged entry
    c = s.direct_stats()["counters"]
    assert c["fallbacks"] == 3 and c["degraded_reads"] == 3 and c["direct_reads"] == 5  # C was still direct
    assert counter(d, "unrecoverable") == 0 and d.store.lookup([K(n) for n in "ABCD"]).hit_blocks == 4
    problems = s.check(fix=True)  # the daemon's repair mends what the client only reported
    assert {p.kind.value for p in problems} == {"missing_fragment", "corrupt_fragment"}
    assert s.check() == []
    assert s.get_many([K(n) for n in "ABD"]) == [vals[n] for n in "ABD"]
    assert s.direct_stats()["counters"]["fallbacks"] == 3  # repaired: direct again
    s.close()


def test_unrecoverable_entry_is_marked_lost_only_by_the_daemon(make_daemon) -> None:
    d = make_daemon()
    s = kvstore.connect(d.address, direct_reads="on")
    v = os.urandom(50_000)
    s.put(K("lost"), v)
    for f in frag_files(d, K("lost"))[:3]:  # m + 1 = 3 of 4+2 gone: fewer than k remain
        f.remove()
    direct = s._direct
    r = direct.reader()
    (loc,) = direct.locate([K("lost")], EntryKind.BLOCK, r)
    assert r.read(loc) is None  # the direct read gives up ...
    assert r.counters["unrecoverable"] == 1
    assert d.store.lookup([K("lost")]).hit_blocks == 1  # ... and marks nothing: still live in the index
    assert counter(d, "unrecoverable") == 0
    with pytest.raises(Unrecoverable):  # the fallback Get: the daemon's read path decides, typed over the wire
        s.get(K("lost"))
    assert counter(d, "unrecoverable") == 1
    assert s.lookup([K("lost")]).hit_blocks == 0  # marked lost by the daemon
    assert s.get_many([K("lost")]) == [None]  # Locate no longer finds it: no read at all
    with pytest.raises(Unrecoverable, match="is lost"):  # a retry is told what the first get was
        s.get(K("lost"))
    assert s.delete(K("lost"))
    assert s.check() == []
    s.close()


def test_tenant_cannot_locate_another_tenants_key(make_daemon, tokens_file) -> None:  # noqa: F811
    d = make_daemon(tokens_file=tokens_file)
    a = kvstore.connect(d.address, token=TOK_A, direct_reads="on")
    b = kvstore.connect(d.address, token=TOK_B, direct_reads="on")
    assert a.put(K(1), b"A's entry")
    assert a.get(K(1)) == b"A's entry" and a.direct_stats()["counters"]["direct_reads"] == 1
    req = pb.LocateRequest(keys=[K(1)], kind="block")
    (mine,) = a._rpc.call("Locate", req).locations
    assert mine.found and mine.stored_key != K(1)  # stored under A's namespaced key
    (theirs,) = b._rpc.call("Locate", req).locations
    assert not theirs.found and not theirs.stored_key  # B's translation of the same key finds nothing
    with pytest.raises(NotFound):
        b.get(K(1))
    assert b.get_many([K(1)]) == [None]
    assert b.direct_stats()["counters"].get("direct_reads", 0) == 0
    with kvstore.connect(d.address, direct_reads="on") as anon:  # no token: no Describe, no Locate
        with pytest.raises(Unauthenticated):
            anon.get(K(1))
        with pytest.raises(Unauthenticated):
            anon._rpc.call("Locate", req)
    for s in (a, b):
        s.close()


def test_locate_refreshes_lru_as_a_get_does(make_daemon) -> None:
    for read_first in (True, False):
        d = make_daemon()
        s = kvstore.connect(d.address, direct_reads="on")
        s.put(K("old"), os.urandom(10_000))
        s.put(K("new"), os.urandom(10_000))
        if read_first:
            assert s.get(K("old"))  # via Locate + a direct read: no Get reaches the daemon
            assert s.direct_stats()["counters"]["direct_reads"] == 1
            assert d.metrics.requests.labels("Get", "OK")._value.get() == 0
        assert d.store.evict_to(d.store.used_bytes() - 1) == 1  # the first LRU victim
        gone = "new" if read_first else "old"
        assert s.get_many([K("old"), K("new")]).count(None) == 1
        assert s.lookup([K(gone)]).hit_blocks == 0
        assert d.metrics.hits.labels("locate", "block")._value.get() >= (2 if read_first else 1)
        assert d.metrics.misses.labels("locate", "block")._value.get() == 1
        s.close()


def test_auto_turns_on_only_for_this_daemons_files_and_never_with_tokens(make_daemon, tokens_file) -> None:  # noqa: F811
    d = make_daemon()
    with kvstore.connect(d.address, direct_reads="auto") as s:
        s.put(K(1), b"x")
        assert s.get(K(1)) == b"x"
        st = s.direct_stats()
        assert st["active"] and st["counters"]["direct_reads"] == 1, st
    dt = make_daemon(tokens_file=tokens_file)
    with kvstore.connect(dt.address, token=TOK_A, direct_reads="auto") as s:
        s.put(K(1), b"y")
        assert s.get(K(1)) == b"y"
        st = s.direct_stats()
        assert not st["active"] and "tokens" in st["reason"], st
    with kvstore.connect(dt.address, token=TOK_A, direct_reads="on") as s:  # explicit: the operator's call
        assert s.get(K(1)) == b"y" and s.direct_stats()["active"]
    # the decision itself, on what Describe reports
    desc = pb.DescribeReply()
    desc.ParseFromString(kvstore.connect(d.address)._rpc.call("Describe", pb.DescribeRequest()).SerializeToString())
    assert desc.direct_reads and not desc.auth and len(desc.targets) == 6
    assert all(t.url.startswith("file:///") for t in desc.targets)
    assert auto_decision(desc) == ""
    other = pb.DescribeReply()
    other.CopyFrom(desc)
    other.format_marker = b'{"format_version": 1, "created": 1.0}'  # same path, another store
    assert "not the daemon's" in auto_decision(other)
    other.CopyFrom(desc)
    other.targets[0].url = "s3://bucket/kv"
    assert "not a local path" in auto_decision(other)
    other.CopyFrom(desc)
    other.targets[0].url = "file:///nonexistent/kvstack/t0"
    assert "not a directory" in auto_decision(other)


def test_daemon_can_refuse_direct_reads(make_daemon) -> None:
    d = make_daemon(allow_direct_reads=False)
    with kvstore.connect(d.address, direct_reads="on") as s:
        s.put(K(1), b"v")
        assert s.get(K(1)) == b"v" and s.get_many([K(1), K(2)]) == [b"v", None]  # over gRPC
        st = s.direct_stats()
        assert not st["active"] and "allow_direct_reads" in st["reason"]
        desc = s._rpc.call("Describe", pb.DescribeRequest())
        assert not desc.direct_reads and not desc.targets and not desc.data_dir
        with pytest.raises(PermissionDenied):
            s._rpc.call("Locate", pb.LocateRequest(keys=[K(1)]))
    with grpc.insecure_channel(d.address.split("://")[1]) as ch:
        with pytest.raises(grpc.RpcError) as ei:
            ch.unary_unary("/kvstore.v1.KVStore/Locate")(pb.LocateRequest(keys=[K(1)]).SerializeToString(), timeout=5)
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_locate_validates_like_get(make_daemon) -> None:
    d = make_daemon(max_batch_items=4)
    with kvstore.connect(d.address, direct_reads="on") as s:
        with pytest.raises(kvstore.InvalidRequest):
            s._rpc.call("Locate", pb.LocateRequest(keys=[b"short"]))
        with pytest.raises(kvstore.InvalidRequest):
            s._rpc.call("Locate", pb.LocateRequest(keys=[K(1)], kind="bogus"))
        with pytest.raises(kvstore.InvalidRequest, match="max_batch_items"):
            s._rpc.call("Locate", pb.LocateRequest(keys=[K(i) for i in range(5)]))
        assert s.get_many([K(i) for i in range(5)]) == [None] * 5  # the client learns the limit and splits
        with pytest.raises(kvstore.InvalidRequest):
            s.get(b"short")


def test_sharded_store_reads_directly_from_each_shard(make_daemon) -> None:
    ds = [make_daemon() for _ in range(3)]
    with kvstore.connect(",".join(d.address for d in ds), direct_reads="on") as s:
        keys = [K(f"sh{i}") for i in range(30)]
        vals = [os.urandom(3000 + i) for i in range(30)]
        assert s.put_many([PutItem(k, v) for k, v in zip(keys, vals)]) == [True] * 30
        assert s.get_many(keys) == vals
        outs = [bytearray(4000) for _ in keys]
        infos = s.get_many_into(keys, outs)
        assert all(bytes(o[: i.nbytes]) == v for o, i, v in zip(outs, infos, vals))
        per = s.direct_stats()
        assert all(st["active"] and st["counters"]["direct_reads"] > 0 for st in per.values()), per
        assert sum(st["counters"]["direct_reads"] for st in per.values()) == 60
        assert s.check() == []


def test_client_url_and_modes(tmp_path, monkeypatch) -> None:
    spec = TargetSpec("s3://AKIA:secret@bucket/kv", "az1", "s3a")
    assert client_url(spec, None) == "s3://bucket/kv"
    assert client_url(TargetSpec("s3://bucket/kv"), None) == "s3://bucket/kv"
    (tmp_path / "t").mkdir()
    monkeypatch.chdir(tmp_path)
    local = TargetSpec("t", "d", "t0")
    assert client_url(local, LocalTarget(local)) == f"file://{tmp_path / 't'}"
    with pytest.raises(kvstore.InvalidRequest, match="direct_reads"):
        kvstore.connect("grpc://127.0.0.1:1", direct_reads="sometimes")
    assert kvstore.connect("grpc://127.0.0.1:1", direct_reads=True).direct_stats()["mode"] == "on"


def test_older_daemon_without_describe_reads_over_grpc() -> None:
    def call(method, req):
        raise KVStoreError("UNIMPLEMENTED: Method not found!")

    dr = DirectReads("on", call, "grpc://old")
    assert dr.reader() is None and "Describe failed" in dr.stats()["reason"]
    assert dr.get_many([K(1)], EntryKind.BLOCK, lambda keys, kind: [b"x"]) is None  # the caller's gRPC path
