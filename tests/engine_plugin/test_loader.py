"""The loader's store -> staging path: reads land in the pool's buffers, verified there.

Checks what the read-into path adds to the loader's guarantees: a read abandoned
at its timeout keeps its staging buffers out of the pool until it finished (it may
still write into them), promoted blocks are the staging buffers themselves (no
second copy, and the pool's accounting stays right), and stores without
``get_many_into`` load the same bytes through the ``get_many`` fallback.
"""

from __future__ import annotations

import random
import threading

import torch

from engine_plugin.connector import BlockLoad, LoadSpec, Tier
from engine_plugin.reference import SamplingParams

GREEDY = SamplingParams(max_new_tokens=3)


class GatedStore:
    """Delegates to a real store; ``get_many_into`` waits for ``gate`` and then scribbles
    over its buffers before reading into them (a late writer, as a slow store is)."""

    def __init__(self, inner):
        self.inner = inner
        self.gate = threading.Event()
        self.done = threading.Event()

    def get_many_into(self, keys, outs, *, kind="block"):
        self.gate.wait(10)
        for o in outs:
            o[:] = 0x5A
        try:
            return self.inner.get_many_into(keys, outs, kind=kind)
        finally:
            self.done.set()

    def __getattr__(self, name):
        return getattr(self.inner, name)


class GetManyOnly:
    """The plain protocol only, as the remote and sharded clients have it today."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "get_many_into":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _seeded(rig, store, n_tokens: int, seed: int):
    prompt = rig.tokens(random.Random(seed), n_tokens)
    a = rig.engine(store)
    a.generate(prompt, GREEDY)
    a.connector.flush()
    return prompt, a.hasher.hash_blocks(prompt)


def _spec(keys) -> LoadSpec:
    return LoadSpec("r", tuple(BlockLoad(i, i, k, Tier.STORE) for i, k in enumerate(keys)), 0)


def test_abandoned_read_keeps_its_buffers_until_it_ends(rig, store):
    prompt, keys = _seeded(rig, store, 64, 1)
    gated = GatedStore(store)
    eng = rig.engine(gated, store_timeout_s=0.1, load_batch_blocks=4, staging_buffers=4,
                     promote_to_host=False)
    c = eng.connector
    good, _ = c.loader.load_blocks(_spec(keys[:4]), eng.pool.kv)
    assert good == 0 and c.metrics.get("store_timeouts") == 1
    # All four buffers still belong to the abandoned read: none can be handed out.
    assert c.buffers.acquire(c.block_nbytes, timeout=0.05) is None
    gated.gate.set()
    assert gated.done.wait(5)
    got = [c.buffers.acquire(c.block_nbytes, timeout=2) for _ in range(4)]
    assert all(b is not None for b in got) and c.buffers.allocations == 4


def test_promoted_blocks_are_the_staging_buffers_themselves(rig, store):
    prompt, keys = _seeded(rig, store, 96, 2)
    eng = rig.engine(store, load_batch_blocks=2, staging_buffers=2)
    c = eng.connector
    good, ev = c.loader.load_blocks(_spec(keys), eng.pool.kv)
    c.backend.sync_event(ev["global"])
    assert good == len(keys)
    for i, k in enumerate(keys):
        held = c.host.get("block", k)
        assert torch.equal(held, eng.pool.kv[i])
        assert held.numpy().tobytes() == store.get(k)
    # Each promoted buffer left the pool's accounting, so the pool (2 per size) kept going.
    assert c.buffers.allocations == len(keys) and c.buffers.reuses == 0


def test_plain_protocol_store_loads_the_same(rig, store):
    prompt, keys = _seeded(rig, store, 100, 3)
    b = rig.engine(GetManyOnly(store))
    warm = b.generate(prompt + [9], GREEDY)
    assert warm.hit_tokens == 96 and b.rollbacks == 0
    rig.same(rig.cold(prompt + [9], GREEDY), warm)
