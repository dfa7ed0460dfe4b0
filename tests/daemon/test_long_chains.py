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
