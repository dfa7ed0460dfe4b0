"""The device pool (``engine_plugin.reference.pool``): consistency when ``on_evict`` raises."""

from __future__ import annotations

import pytest
import torch

from engine_plugin.reference import SamplingParams
from engine_plugin.reference.pool import BlockPool


def _check(pool: BlockPool) -> None:
    """Invariants 1-2 of ``BlockPool``: every block in exactly one place, the hash maps agree."""
    free, lru = set(pool.free), set(pool.evictable)
    used = {b for b in range(pool.num_blocks) if pool.refcount[b] > 0}
    assert len(free) == len(pool.free) and not (free & lru) and not (free & used) and not (lru & used)
    assert free | lru | used == set(range(pool.num_blocks))
    assert {b: h for h, b in pool.by_hash.items()} == {
        b: h for b, h in enumerate(pool.block_hash) if h is not None}
    assert all(pool.block_hash[b] is not None for b in lru)
    assert all(pool.block_hash[b] is None for b in free)


def _cached_pool(n: int = 4) -> BlockPool:
    """A pool whose blocks are all cached and unused (evictable)."""
    pool = BlockPool(n, 2, 3, dtype=torch.float32, device="cpu")
    blocks = pool.allocate(n)
    for b in blocks:
        pool.register(b, bytes([b]))
    pool.release(blocks)
    return pool


def test_allocate_whose_on_evict_raises_leaves_the_pool_consistent():
    pool = _cached_pool()
    seen = []

    def evict(h, b):
        seen.append(b)
        if len(seen) == 2:
            raise RuntimeError("injected: host tier put failed")

    later = []
    pool.on_evict += [evict, lambda h, b: later.append(b)]
    with pytest.raises(RuntimeError, match="injected"):
        pool.allocate(3)
    _check(pool)  # before: the second block was out of the LRU yet still mapped, the first lost
    assert later == seen  # every callback ran, even for the block whose first callback raised
    assert sorted(pool.free) == sorted(seen) and pool.num_available() == 4
    assert pool.match_prefix([bytes([seen[0]])]) == []  # evicted blocks are unmapped
    got = pool.allocate(4)  # the pool works on: all four blocks can be had
    assert sorted(got) == [0, 1, 2, 3]
    _check(pool)


def test_drop_cached_whose_on_evict_raises_leaves_the_pool_consistent():
    pool = _cached_pool()

    def evict(h, b):
        raise RuntimeError("injected")

    pool.on_evict.append(evict)
    with pytest.raises(RuntimeError):
        pool.drop_cached()
    _check(pool)
    pool.on_evict.clear()
    assert pool.drop_cached() == 3 and len(pool.free) == 4
    _check(pool)


def test_an_admission_whose_eviction_raises_holds_no_blocks(rig):
    """The engine's prefix hit is released when ``allocate`` raises: the request stays waiting
    and holds nothing, so aborting it (what a worker does after a failed step) frees all."""
    eng = rig.engine(connector=False, num_blocks=6)
    prompt = list(range(1, 50))  # 4 blocks of 16: 3 cached, 3 free
    eng.generate(prompt, SamplingParams(max_new_tokens=1), request_id="a")
    eng.pool.on_evict.append(lambda h, b: (_ for _ in ()).throw(RuntimeError("injected")))
    # 6 blocks: a 2-block prefix hit, 3 free blocks, and the eviction of a's third block
    eng.add_request("b", prompt[:32] + [7] * 57, SamplingParams(max_new_tokens=1))
    with pytest.raises(RuntimeError, match="injected"):
        eng.step()
    assert not any(eng.pool.refcount)
    _check(eng.pool)
    assert eng.abort_request("b") and not any(eng.pool.refcount)
