"""The loader's two store paths: staged (store -> staging buffer -> pool) and direct (store -> pool).

Checks what the read-into paths add to the loader's guarantees. Staged: a read
abandoned at its timeout keeps its staging buffers out of the pool until it
finished (it may still write into them), promoted blocks are the staging buffers
themselves (no second copy, and the pool's accounting stays right). Direct (the cpu
backend's default): payloads land in the pool blocks with no staging buffer, a bad
entry in the middle of a batch stops the good count there and the engine's answer
is still the cold one, an overrun native read is waited for (it would otherwise
write into blocks the engine recomputes) and trips the breaker, and a slow
``get_many``-only store never writes after its timeout. Stores without ``get_many_into`` load the same bytes.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
from tests.engine_plugin.test_devices import outstanding

from engine_plugin.contract import BlockLoad, LoadSpec, Tier
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
                     promote_to_host=False, direct_reads=False)
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
    eng = rig.engine(store, load_batch_blocks=2, staging_buffers=2, direct_reads=False)
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


class SlowGetMany(GetManyOnly):
    """The plain protocol, with every ``get_many`` taking ``delay_s``."""

    def __init__(self, inner, delay_s: float):
        super().__init__(inner)
        self.delay_s = delay_s
        self.done = threading.Event()

    def get_many(self, keys, *, kind="block"):
        time.sleep(self.delay_s)
        try:
            return self.inner.get_many(keys, kind=kind)
        finally:
            self.done.set()


def test_direct_read_lands_in_the_pool_without_staging(rig, store):
    prompt, keys = _seeded(rig, store, 96, 4)
    eng = rig.engine(store, load_batch_blocks=4, staging_buffers=4)
    c = eng.connector
    assert c.direct_reads
    spec = LoadSpec("r", tuple(BlockLoad(i, 10 + 2 * i, k, Tier.STORE) for i, k in enumerate(keys)), 0)
    good, ev = c.loader.load_blocks(spec, eng.pool.kv)
    c.backend.sync_event(ev["global"])
    assert good == len(keys)
    for i, k in enumerate(keys):  # non-adjacent destination blocks, each written whole
        assert eng.pool.kv[10 + 2 * i].numpy().tobytes() == store.get(k)
    assert c.buffers.allocations == 0 and len(c.host) == 0  # no staging, no promotion
    assert c.metrics.get("bytes_loaded") == len(keys) * c.block_nbytes


def test_direct_read_with_a_corrupt_entry_mid_batch_gives_the_cold_answer(rig, store, tmp_path):
    from tests.engine_plugin.test_faults import _corrupt

    prompt, keys = _seeded(rig, store, 150, 5)
    _corrupt(store, keys[3], "block")
    eng = rig.engine(store, load_batch_blocks=8)  # blocks 0..7 in one read: 3 is mid-batch
    assert eng.connector.direct_reads
    eng.pool.kv.fill_(float("nan"))  # stale block contents: a block used without being written shows
    warm = eng.generate(prompt + [5], GREEDY)
    m = eng.connector.metrics.snapshot()
    assert eng.rollbacks == 1 and m["load_errors"] == 1 and m["load_missing"] == 1
    assert warm.plan.hit_tokens == 48  # re-planned at the bad block; 4.. (read fine) not adopted
    rig.same(rig.cold(prompt + [5], GREEDY), warm)


def test_overrun_direct_read_is_waited_for(rig, store):
    prompt, keys = _seeded(rig, store, 64, 6)
    gated = GatedStore(store)
    eng = rig.engine(gated, store_timeout_s=0.05, load_batch_blocks=4)
    c = eng.connector
    threading.Timer(0.3, gated.gate.set).start()
    t0 = time.monotonic()
    good, _ = c.loader.load_blocks(_spec(keys[:4]), eng.pool.kv)
    # it returned only once the store stopped writing into the pool blocks ...
    assert gated.done.is_set() and time.monotonic() - t0 >= 0.25
    # ... counted as a timeout (the breaker is open), its verified entries kept
    assert c.metrics.get("store_timeouts") == 1 and c.metrics.get("direct_read_overruns") == 1
    assert not c.gateway.available and good == 4
    for i, k in enumerate(keys[:4]):
        assert eng.pool.kv[i].numpy().tobytes() == store.get(k)


def test_slow_plain_store_never_writes_after_its_timeout(rig, store):
    prompt, keys = _seeded(rig, store, 64, 7)
    slow = SlowGetMany(store, delay_s=0.8)  # far above the 0.05 s timeout: a loaded CI runner has room
    eng = rig.engine(slow, store_timeout_s=0.05, load_batch_blocks=4)
    c = eng.connector
    eng.pool.kv.fill_(7.0)
    t0 = time.monotonic()
    good, _ = c.loader.load_blocks(_spec(keys[:4]), eng.pool.kv)
    assert good == 0 and time.monotonic() - t0 < 0.7  # bounded: not waited for
    assert c.metrics.get("direct_read_overruns") == 0
    assert slow.done.wait(5)
    time.sleep(0.05)  # the gateway thread has returned the bytes; nobody copies them anywhere
    assert bool((eng.pool.kv == 7.0).all())


def _flaky_copies(monkeypatch, c, every: int) -> list:
    """Every ``every``-th ``copy_async`` raises; returns the list ``synchronize`` calls append to."""
    real, calls, synced = c.backend.copy_async, [], []

    def copy_async(dst, src, stream):
        calls.append(1)
        if len(calls) % every == 0:
            raise RuntimeError("injected: a copy into the engine failed")
        return real(dst, src, stream)

    monkeypatch.setattr(c.backend, "copy_async", copy_async)
    monkeypatch.setattr(c.backend, "synchronize", lambda: synced.append(1))
    return synced


@pytest.mark.parametrize("what", ["blocks", "snapshot"])
def test_an_exception_past_staging_gives_the_buffers_back(rig, store, monkeypatch, what):
    """A load that raises after its staging read (here a copy into the engine) makes the request
    recompute (``load_exceptions``); its staging buffers go back to the pool, which saves share,
    after a device sync (a copy may still read them). They used to leak at every such load until
    the pool was empty and every save was dropped."""
    prompt, keys = _seeded(rig, store, 96, 8)
    swa = next(k for (kind, k), _ in rig.connectors[-1].host.items() if kind == "swa")
    eng = rig.engine(store, load_batch_blocks=4, staging_buffers=4, promote_to_host=False, direct_reads=False)
    c = eng.connector
    synced = _flaky_copies(monkeypatch, c, every=2)
    win = torch.zeros(c.snap_shape, dtype=c.dtype)
    for _ in range(3):  # more failures than the pool has buffers to lose
        with pytest.raises(RuntimeError, match="injected"):
            if what == "blocks":
                c.loader.load_blocks(_spec(keys), eng.pool.kv)
            else:
                c.loader.load_snapshot(LoadSpec("r", (), 0, swa, Tier.STORE), win)
        assert outstanding(c.buffers) == 0
    assert len(synced) == 3


def test_a_promotion_whose_eviction_raises_keeps_that_buffer_out_of_the_pool(rig, store):
    """``HostCache.put`` runs its eviction callback (which queues a store write) after the entry
    went in: when that raises, the host tier holds the staging buffer, so the pool must never
    hand it out again (two owners of one buffer); the batch's other buffers go back."""
    prompt, keys = _seeded(rig, store, 96, 9)
    eng = rig.engine(store, load_batch_blocks=4, staging_buffers=4, direct_reads=False)
    c = eng.connector
    c.host.capacity = c.block_nbytes  # one block: the first promotion evicts the entry below
    assert c.host.put("block", b"\0" * 16, torch.zeros(c.block_nbytes, dtype=torch.uint8))

    def on_evict(kind, key, t):
        raise RuntimeError("injected: the eviction's store write failed")

    c.host.on_evict = on_evict
    with pytest.raises(RuntimeError, match="injected"):
        c.loader.load_blocks(_spec(keys[:4]), eng.pool.kv)
    held = c.host.get("block", keys[0])
    assert held is not None and held.numpy().tobytes() == store.get(keys[0])
    assert outstanding(c.buffers) == 0  # detached (the tier's now), or back in the pool
    free = c.buffers.acquire_many(c.block_nbytes, 4, timeout=0)
    assert len(free) == 4 and held.data_ptr() not in {b.data_ptr() for b in free}
