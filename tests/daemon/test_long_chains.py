"""Chains longer than the daemon's batch limit: the clients look them up piece by piece."""

from __future__ import annotations

import os

import kvstore
from kvstore import PutItem


def test_long_chain_lookup_over_the_batch_limit(make_daemon):
    d = make_daemon(max_batch_items=100)
    keys = [os.urandom(16) for _ in range(350)]
    with kvstore.connect(d.address, max_batch_items=100) as s:
        for off in range(0, 250, 50):
            s.put_many([PutItem(k, b"kv") for k in keys[off:off + 50]])
        s.put(keys[119], b"w", kind="swa")
        s.put(keys[239], b"w", kind="swa")
        r = s.lookup(keys)
        assert (r.hit_blocks, r.swa_at) == (250, 240)
        assert s.lookup(keys[:200]).hit_blocks == 200  # ends exactly on a piece boundary
        assert [x.hit_blocks for x in s.lookup_many([keys, keys[:30]])] == [250, 30]
        block, swa = s.probe(keys)
        assert block.count(1) == 250 and swa.count(1) == 2
        # until_miss: pieces up to the one holding the first miss, whose answer ends there.
        assert s.probe(keys, until_miss=True) == (block[:251], swa[:251])
        assert s.probe(keys[:200], until_miss=True) == (block[:200], swa[:200])  # no miss at all


def test_sharded_lookup_stops_each_shard_at_its_first_miss(make_daemon, tmp_path):
    """A sharded lookup of one chain asks each shard only up to its own first miss; the walk
    still finds the chain's prefix and SWA boundary, against the embedded store as the model."""
    import random

    from kvstore.sharded import ShardedStore

    daemons = [make_daemon() for _ in range(3)]
    rng = random.Random(5)
    with ShardedStore([d.address for d in daemons]) as sh, kvstore.connect(str(tmp_path / "model"), fsync=False) as model:
        for trial, hit in enumerate([0, 1, 57, 150, 299, 300]):
            keys = [os.urandom(16) for _ in range(300)]
            stored = keys[:hit] + [k for k in keys[hit + 1:] if rng.random() < 0.7]  # holes after the gap
            swa = [keys[i] for i in rng.sample(range(300), 5)]
            for s in (sh, model):
                s.put_many([PutItem(k, b"kv") for k in stored])
                s.put_many([PutItem(k, b"w", "swa") for k in swa])
            want = model.lookup(keys)
            asked = answered = 0
            for shard in sh.shards:
                def spy(ks, *, until_miss=False, _probe=type(shard).probe.__get__(shard)):
                    nonlocal asked, answered
                    block, swa = _probe(ks, until_miss=until_miss)
                    asked, answered = asked + len(ks), answered + len(block)
                    return block, swa
                shard.probe = spy
            assert sh.lookup(keys) == want, (trial, hit)
            assert asked == 300 and answered <= asked, (trial, hit, answered)
            if hit < 250:  # the shard holding the first miss owns some of the 50+ keys after it
                assert answered < asked, (trial, hit, answered)
            assert [r.hit_blocks for r in sh.lookup_many([keys, keys[:hit // 2]])] == [want.hit_blocks, hit // 2]


def test_sharded_batch_placement_is_owner_per_key():
    """``ShardedStore._group`` (one score matrix for a batch) must place every key exactly where
    ``owner`` (the per-key rendezvous rule) does; no daemon needed, channels connect lazily."""
    from kvstore.sharded import ShardedStore

    s = ShardedStore([f"grpc://127.0.0.1:{p}" for p in (1, 2, 3, 4)])
    try:
        keys = [os.urandom(16) for _ in range(2000)]
        groups = s._group(keys)
        assert sorted(i for pos in groups.values() for i in pos) == list(range(len(keys)))
        assert all(s.owner(keys[i]) == shard for shard, pos in groups.items() for i in pos)
        assert len(groups) == 4 and s._group([]) == {}
    finally:
        s.close()


def test_shard_placement_does_not_depend_on_how_an_address_is_spelled():
    """Clients naming the same daemons with a different host case, port zeros, IPv6 form or a
    trailing slash place every key on the same daemon; before, placement hashed the URL as
    written, so such a client missed (and duplicated) every other client's keys. The usual
    spelling keeps its placement (names hash as before), and two spellings of one daemon
    in one list are refused."""
    import pytest
    import xxhash

    from kvstore.errors import InvalidRequest
    from kvstore.sharded import ShardedStore

    plain = ["grpc://kv-a.example:5001", "grpc://127.0.0.1:5002", "grpc://[::1]:5003"]
    other = ["grpc://KV-A.example.:05001/", "grpc://127.0.0.1:5002/", "grpc://[0:0:0:0:0:0:0:1]:5003"]
    keys = [os.urandom(16) for _ in range(500)]
    a, b = ShardedStore(plain), ShardedStore(other)
    try:
        assert [a.owner(k) for k in keys] == [b.owner(k) for k in keys]
        assert len({a.owner(k) for k in keys}) == 3
        for k in keys[:50]:  # the usual spelling is its own name: placement unchanged
            scores = [xxhash.xxh3_64_intdigest(k + u.encode()) for u in plain]
            assert a.owner(k) == scores.index(max(scores))
    finally:
        a.close()
        b.close()
    with pytest.raises(InvalidRequest, match="distinct"):
        ShardedStore(["grpc://h:1", "grpc://H:0001"])
    from kvstore.client_options import shard_name

    # an IPv6 zone is an interface name: its case is kept, its %25 spelling is the same zone
    assert shard_name("grpc://[FE80::1%25eth0]:5") == shard_name("grpc://[fe80::1%eth0]:5") == "grpc://[fe80::1%eth0]:5"
    assert shard_name("grpc://[fe80::1%ETH0]:5") != shard_name("grpc://[fe80::1%eth0]:5")


def test_probe_answers_are_checked():
    """A daemon that ignores ``until_miss`` (an older one) answers every key: accepted. An
    answer cut short without ending on a miss, or with unequal strings, is a bug: raised."""
    import pytest

    from kvstore.errors import InternalError
    from kvstore.proto import kvstore_pb2 as pb

    s = kvstore.connect("grpc://127.0.0.1:1")  # channels connect lazily; _call is replaced below
    try:
        keys = [os.urandom(16) for _ in range(3)]
        for block, swa, ok in [(b"\1\0\1", b"\0\0\0", True), (b"\1\0", b"\0\0", True), (b"\1", b"\1", False),
                               (b"\1\1\1", b"\1", False), (b"\1\1\1\1", b"\0\0\0\0", False)]:
            s._call = lambda method, req, *a, **k: pb.ProbeReply(block=block, swa=swa)
            if ok:
                assert s.probe(keys, until_miss=True) == (block, swa)
            else:
                with pytest.raises(InternalError):
                    s.probe(keys, until_miss=True)
    finally:
        s.close()
