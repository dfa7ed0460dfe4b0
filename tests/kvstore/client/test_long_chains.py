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

    from kvstore.client.sharded import ShardedStore

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
                def spy(ks, until_miss, ends, *, _probe=type(shard).probe_checked.__get__(shard)):
                    nonlocal asked, answered
                    block, swa = _probe(ks, until_miss, ends)
                    asked, answered = asked + len(ks), answered + len(block)
                    return block, swa
                shard.probe_checked = spy  # what ShardedStore calls on each shard
            assert sh.lookup(keys) == want, (trial, hit)
            assert asked == 300 and answered <= asked, (trial, hit, answered)
            if hit < 250:  # the shard holding the first miss owns some of the 50+ keys after it
                assert answered < asked, (trial, hit, answered)
            assert [r.hit_blocks for r in sh.lookup_many([keys, keys[:hit // 2]])] == [want.hit_blocks, hit // 2]


def test_probe_of_several_chains_over_the_batch_limit(make_daemon):
    """``chain_ends`` through the daemon, with the keys split in pieces of 100: each piece
    carries the ends within it, and the answer is every chain's own, zero-filled."""
    d = make_daemon(max_batch_items=100)
    chains = [[os.urandom(16) for _ in range(n)] for n in (130, 0, 45, 90, 7)]
    hits = [110, 0, 45, 3, 0]
    with kvstore.connect(d.address, max_batch_items=100) as s:
        for c, hit in zip(chains, hits):
            s.put_many([PutItem(k, b"kv") for k in c[:hit] + c[hit + 1:]])  # blocks after the gap too
        s.put(chains[0][50], b"w", kind="swa")
        flat = [k for c in chains for k in c]
        ends = [130, 130, 175, 265, 272]
        block, swa = s.probe(flat, chain_ends=ends)
        want = b"".join(b"\1" * h + b"\0" * (len(c) - h) for c, h in zip(chains, hits))
        assert block == want and swa == b"\0" * 50 + b"\1" + b"\0" * 221
        assert [r.hit_blocks for r in s.lookup_many(chains)] == hits
        # many empty chains: a piece of 2 keys carried every end (5,001) and was refused as a
        # batch over the limit; now only its distinct ends go
        many = [chains[0][:1]] + [[]] * 250 + [chains[2][:1]]
        want = [1] + [0] * 250 + [1]
        assert [r.hit_blocks for r in s.lookup_many(many)] == want
        from kvstore.client.sharded import ShardedStore

        with ShardedStore([d.address]) as sh:  # the daemon allows 100 items a call
            assert [r.hit_blocks for r in sh.lookup_many(many)] == want


def test_sharded_lookup_many_reads_each_chain_to_its_first_miss(make_daemon, tmp_path):
    """A sharded ``lookup_many`` of many new prompts (chains that miss early) reads each chain
    on each shard up to that shard's first miss in it, not the whole chain: before, every key
    of every chain was read. Answers checked against the embedded store as the model."""
    import random

    from kvstore.client.sharded import ShardedStore
    from tests.kvstore.embedded.test_lookup import CountingEnv

    stores = [kvstore.connect(str(tmp_path / f"s{i}"), fsync=False) for i in range(3)]
    daemons = [make_daemon(store=st) for st in stores]
    rng = random.Random(7)
    chains = [[os.urandom(16) for _ in range(200)] for _ in range(8)]
    hits = [0, 0, 1, 5, 0, 200, 17, 0]
    with ShardedStore([d.address for d in daemons]) as sh, kvstore.connect(str(tmp_path / "model"), fsync=False) as model:
        want_reads = 0  # per shard and chain: its keys up to and including its first miss
        for c, hit in zip(chains, hits):
            stored = c[:hit] + [k for k in c[hit + 1:] if rng.random() < 0.7]
            for shard in range(3):
                mine = [k in stored for k in c if sh.owner(k) == shard]
                want_reads += mine.index(False) + 1 if False in mine else len(mine)
            for s in (sh, model):
                s.put_many([PutItem(k, b"kv") for k in stored])
                s.put(c[hit // 2], b"w", kind="swa")
        counters = [CountingEnv(st.index.env) for st in stores]
        for st, c in zip(stores, counters):
            st.index.env = c
        try:
            assert sh.lookup_many(chains) == model.lookup_many(chains)
        finally:
            for st, c in zip(stores, counters):
                st.index.env = c.env
        block_reads = sum(1 for c in counters for ek in c.reads if ek[:1] == bytes((kvstore.EntryKind.BLOCK.code,)))
        assert block_reads == want_reads < 600, block_reads  # every key of every chain: 1,600


def test_sharded_batch_placement_is_owner_per_key():
    """``ShardedStore._group`` (one score matrix for a batch) must place every key exactly where
    ``owner`` (the per-key rendezvous rule) does; no daemon needed, channels connect lazily."""
    from kvstore.client.sharded import ShardedStore

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
    from kvstore.client.sharded import ShardedStore

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
    from kvstore.client.options import shard_name

    # an IPv6 zone is an interface name: its case is kept, its %25 spelling is the same zone
    assert shard_name("grpc://[FE80::1%25eth0]:5") == shard_name("grpc://[fe80::1%eth0]:5") == "grpc://[fe80::1%eth0]:5"
    assert shard_name("grpc://[fe80::1%ETH0]:5") != shard_name("grpc://[fe80::1%eth0]:5")


def test_probe_answers_are_checked():
    """An answer for every key (``until_miss`` not applied): accepted. An answer cut short
    without ending on a miss, or with unequal strings, is a bug: raised. With ``chain_ends``
    every key is answered: a short answer is raised."""
    import pytest

    from kvstore.errors import InternalError
    from kvstore.proto import kvstore_pb2 as pb

    s = kvstore.connect("grpc://127.0.0.1:1")  # channels connect lazily; _rpc.call is replaced below
    try:
        keys = [os.urandom(16) for _ in range(3)]
        for block, swa, ok in [(b"\1\0\1", b"\0\0\0", True), (b"\1\0", b"\0\0", True), (b"\1", b"\1", False),
                               (b"\1\1\1", b"\1", False), (b"\1\1\1\1", b"\0\0\0\0", False)]:
            s._rpc.call = lambda method, req, *a, **k: pb.ProbeReply(block=block, swa=swa)
            if ok:
                assert s.probe(keys, until_miss=True) == (block, swa)
            else:
                with pytest.raises(InternalError):
                    s.probe(keys, until_miss=True)
            if len(block) == 3 == len(swa):
                assert s.probe(keys, chain_ends=[2, 3]) == (block, swa)
            else:
                with pytest.raises(InternalError):
                    s.probe(keys, chain_ends=[2, 3])
    finally:
        s.close()
