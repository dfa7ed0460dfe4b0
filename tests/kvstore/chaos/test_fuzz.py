"""Fuzzing: every gRPC request message, the entry/fragment parsers, crafted fragments on disk.

Contract under test: no crash, no hang (every call has a deadline), no unbounded
allocation (tracemalloc bounds), and a typed answer every time: a gRPC status
among the expected ones (never INTERNAL/UNKNOWN), or a ``KVStoreError`` from
the parsers. A parse that succeeds returns exactly the original bytes.
"""

from __future__ import annotations

import os
import random
import struct
import tracemalloc

import grpc
import pytest
import zstandard
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstore
from kvstore.embedded import codec
from kvstore.api import EntryKind, Layout
from kvstore.errors import CorruptData, IncompatibleFormat, KVStoreError
from kvstore.embedded.index import ekey
from kvstore.proto import kvstore_pb2 as pb

from tests.fragments import fragment_refs
from tests.kvstore.chaos.conftest import K

PARSE_ERRORS = (CorruptData, IncompatibleFormat)
ACCEPTABLE = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.RESOURCE_EXHAUSTED}
KEY_POOL = [K(i) for i in range(8)]


# ----------------------------------------------------------------------------- message strategies
def _scalar(f):
    return {
        FD.TYPE_BYTES: st.one_of(st.sampled_from(KEY_POOL), st.binary(max_size=40)),
        FD.TYPE_STRING: st.one_of(st.sampled_from(["", "block", "swa", "uint8", "float16", "bogus"]),
                                  st.text(max_size=12)),
        FD.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
        FD.TYPE_DOUBLE: st.floats(allow_nan=True, allow_infinity=True),
        FD.TYPE_BOOL: st.booleans(),
    }.get(f.type)


def message_strategy(desc, depth: int = 0):
    """Any message of this descriptor: every field unset, scalar, nested or repeated (max 6)."""
    cls = getattr(pb, desc.name)
    fields = {}
    for f in desc.fields:
        s = _scalar(f)
        if s is None:
            if f.type != FD.TYPE_MESSAGE or depth >= 2:
                continue
            s = message_strategy(f.message_type, depth + 1)
        repeated = f.is_repeated if hasattr(f, "is_repeated") else f.label == FD.LABEL_REPEATED
        fields[f.name] = st.lists(s, max_size=6) if repeated else s
    return st.fixed_dictionaries({}, optional=fields).map(lambda kw: cls(**kw))


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory):
    from kvstore.server import Daemon, load_server_config

    scfg, stcfg = load_server_config(None, env={}, port=0, gc_interval_s=0, fsync=False, max_batch_items=16,
                                     tenant_quota_bytes=200_000, orphan_grace_s=0, delete_grace_s=0,
                                     allow_direct_writes=True,
                                     data_dir=str(tmp_path_factory.mktemp("fuzzall") / "d"))
    d = Daemon(scfg, stcfg).start()
    ch = grpc.insecure_channel(d.address.split("://")[1])
    yield d, ch
    ch.close()
    d.stop(grace_s=1)


# Every RPC and its request type; test_the_fuzzed_table_covers_every_rpc keeps it complete.
ALL_METHODS = [
    ("Put", pb.PutRequest), ("PutMany", pb.PutManyRequest), ("Get", pb.KeyRequest),
    ("GetMany", pb.GetManyRequest), ("Delete", pb.KeyRequest), ("DeleteMany", pb.KeysRequest),
    ("Pin", pb.KeyRequest), ("PinMany", pb.KeysRequest), ("Unpin", pb.KeyRequest),
    ("UnpinMany", pb.KeysRequest), ("Lookup", pb.LookupRequest), ("LookupMany", pb.LookupManyRequest),
    ("Probe", pb.ProbeRequest), ("Stats", pb.StatsRequest), ("Gc", pb.GcRequest),
    ("Check", pb.CheckRequest), ("Repair", pb.RepairRequest), ("Describe", pb.DescribeRequest),
    ("Locate", pb.LocateRequest), ("Commit", pb.CommitRequest), ("Inspect", pb.InspectRequest)]


def test_the_fuzzed_table_covers_every_rpc(fuzz_daemon):
    d, _ = fuzz_daemon
    assert {n: m.request for n, m in d.methods.items()} == dict(ALL_METHODS)


@pytest.mark.parametrize("name,req_cls", ALL_METHODS, ids=[m[0] for m in ALL_METHODS])
def test_fuzz_every_request_message(fuzz_daemon, name, req_cls):
    d, ch = fuzz_daemon
    call = ch.unary_unary(f"/kvstore.v1.KVStore/{name}")
    n = 6 if name in ("Check", "Repair", "Gc", "Stats", "Inspect") else 25  # these read the whole index

    acceptable = ACCEPTABLE
    view = b""
    if name == "Commit":  # refused before its entries without the writer_view Describe gives (missing: an
        # older client, PERMISSION_DENIED; another: a stale one, ABORTED); half the messages carry it
        acceptable = ACCEPTABLE | {grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ABORTED}
        view = pb.DescribeReply.FromString(ch.unary_unary("/kvstore.v1.KVStore/Describe")(b"", timeout=10)).writer_view

    @settings(max_examples=n, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(msg=message_strategy(req_cls.DESCRIPTOR), tail=st.binary(max_size=8), viewed=st.booleans())
    def run(msg, tail, viewed):
        if view and viewed:
            msg.view = view
        raw = msg.SerializeToString()
        for payload in (raw, raw + tail, raw[: len(raw) // 2]):
            try:
                call(payload, timeout=10)
            except grpc.RpcError as err:
                assert err.code() in acceptable, (name, err.code(), err.details())

    run()


def test_fuzzed_daemon_is_consistent_and_serving(fuzz_daemon):
    d, _ = fuzz_daemon
    assert d.store.check() == []
    with kvstore.connect(d.address) as s:
        assert s.put(K(100), b"still fine") in (True, False) and s.get(K(100)) == b"still fine"


# ----------------------------------------------------------------------------- parsers
def _entry(payload: bytes, compression="zstd", kind=EntryKind.BLOCK) -> bytes:
    return codec.encode_entry(K(1), kind, payload, Layout.for_bytes(len(payload)), 5,
                              compression=compression, zstd_level=3, min_ratio=1.0)


MUTATIONS = ["truncate", "extend", "flip", "version", "kind", "codec", "lengths", "ndim", "magic"]


def _mutate(buf: bytes, how: str, r: random.Random) -> bytes:
    b = bytearray(buf)
    if how == "truncate":
        return bytes(b[: r.randrange(len(b))])
    if how == "extend":
        return bytes(b + r.randbytes(r.randint(1, 64)))
    if how == "flip":
        for _ in range(r.randint(1, 4)):
            i = r.randrange(len(b) * 8)
            b[i // 8] ^= 1 << (i % 8)
        return bytes(b)
    if how == "version":
        struct.pack_into("<H", b, 4, r.choice([0, 2, 7, 0xFFFF]))
    elif how == "kind":
        b[6] = r.choice([0, 3, 9, 255])
    elif how == "codec":
        b[7] = r.choice([2, 3, 255])
    elif how == "lengths":
        struct.pack_into("<QQ", b, 8, r.choice([2**63, 2**64 - 1, 10**12]), r.choice([0, 2**64 - 1]))
    elif how == "ndim" and len(b) > 61:
        b[61] = r.choice([9, 200, 255])
    elif how == "magic":
        b[0:4] = b"KVE9"
    return bytes(b)


@settings(max_examples=150, deadline=None)
@given(payload=st.binary(max_size=3000), compression=st.sampled_from(["zstd", "none"]),
       how=st.sampled_from(MUTATIONS), seed=st.integers(0, 2**32))
def test_entry_parser_typed_errors_or_exact_bytes(payload, compression, how, seed):
    buf = _entry(payload, compression)
    bad = _mutate(buf, how, random.Random(seed))
    try:
        h, plain = codec.decode_entry(bad, max_plain=1 << 20)
    except PARSE_ERRORS:
        return
    assert plain == payload  # a flip outside the checked payload may parse; the bytes never differ
    try:
        h2, plain2 = codec.decode_entry_pieces([memoryview(bad)], max_plain=1 << 20)
    except PARSE_ERRORS:
        return
    assert plain2 == payload


def _frag(body: bytes, index=0) -> bytes:
    return codec.frame_fragment(codec.FragmentHeader(index, 4, 2, 1, K(3), b"g" * 8, 1234, len(body)), body)


@settings(max_examples=150, deadline=None)
@given(body=st.binary(max_size=2000), how=st.sampled_from(MUTATIONS), seed=st.integers(0, 2**32))
def test_fragment_parser_rejects_every_change(body, how, seed):
    good = _frag(body)
    bad = _mutate(good, how, random.Random(seed))
    try:
        h, got = codec.parse_fragment(bad, max_body=4096)
    except PARSE_ERRORS:
        return
    assert bad == good and bytes(got) == body  # the checksum covers header and body


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=400))
def test_parsers_on_random_bytes(raw):
    for fn, kw in ((codec.decode_entry, {"max_plain": 1 << 20}), (codec.decode_entry_header, {"max_plain": 1 << 20}),
                   (codec.parse_fragment, {"max_body": 1 << 20})):
        try:
            fn(raw, **kw)
        except PARSE_ERRORS:
            pass


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    except PARSE_ERRORS:
        pass
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def test_no_unbounded_allocation_on_hostile_sizes():
    buf = bytearray(_entry(b"x" * 200, "none"))
    struct.pack_into("<QQ", buf, 8, 2**62, 2**62)  # claims 4 EiB
    assert _peak(lambda: codec.decode_entry(bytes(buf), max_plain=1 << 20)) < 1 << 20
    frag = bytearray(_frag(b"y" * 100))
    struct.pack_into("<Q", frag, 44, 2**62)  # body length claim
    assert _peak(lambda: codec.parse_fragment(bytes(frag), max_body=1 << 20)) < 1 << 20
    # a zstd bomb: 64 MiB of zeros in a few KiB, under a header that claims 1 MiB
    bomb = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))
    head = bytearray(_entry(b"z" * 100, "none"))[:62]
    struct.pack_into("<BQQ", head, 7, codec.CODEC_ZSTD, 1 << 20, len(bomb))
    peak = _peak(lambda: codec.decode_entry(bytes(head) + bomb, max_plain=1 << 20))
    assert peak < 8 << 20, peak


def test_crafted_fragments_with_valid_frames_never_crash_or_lie(tmp_path):
    """Bodies replaced under a recomputed frame checksum reach the erasure decoder itself."""
    r = random.Random(11)
    s = kvstore.connect(str(tmp_path / "s"), fsync=False, ec_k=4, ec_m=2)
    outcomes = {"exact": 0, "typed_error": 0}
    for _ in range(25):
        key, val = r.randbytes(16), r.randbytes(r.randint(100, 6000))
        s.put(key, val)
        with s.index.env.begin() as txn:
            m = s.index.get_meta(txn, ekey(1, key))
        refs = fragment_refs(s, key)  # inside the store's segment, or a file of its own
        for i in r.sample(range(6), r.randint(1, 6)):
            body = bytearray(refs[i].read_bytes()[codec.FRAG_HEADER_LEN:])
            mode = r.randrange(3)
            if mode == 0:
                body = bytearray(r.randbytes(len(body)))
            else:
                body[r.randrange(min(80, len(body)) if mode == 1 else len(body))] ^= 0xFF
            h = codec.FragmentHeader(i, m.k, m.m, 1, key, m.gen, m.entry_len, len(body))
            refs[i].write_bytes(codec.frame_fragment(h, bytes(body)))
        try:
            assert s.get(key) == val
            outcomes["exact"] += 1
        except KVStoreError:
            outcomes["typed_error"] += 1
    s.close()
    assert sum(outcomes.values()) == 25
