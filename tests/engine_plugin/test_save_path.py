"""The save path under load: more blocks in a step than staging buffers, and failed saves.

``KVStoreConnector._save_blocks`` copies a step's blocks out in chunks bounded by the
staging pool; ``SaveQueue`` reports per request whether its KV reached the store.
"""

from __future__ import annotations

import random

from engine_plugin.reference import Engine, EngineConfig, SamplingParams
from engine_plugin.store_connector import ConnectorConfig, KVStoreConnector

BLOCK = 16  # the block size of the fixtures (conftest.BLOCK)

ONE = SamplingParams(max_new_tokens=1)


def _big_step_engine(rig, store, n_blocks: int, **conn_kw) -> Engine:
    """An engine whose prefill of ``n_blocks`` blocks runs in one step."""
    conn = KVStoreConnector(rig.model.kv_layout(), ConnectorConfig(block_size=BLOCK, **conn_kw), store)
    rig.connectors.append(conn)
    tokens = (n_blocks + 4) * BLOCK
    return Engine(rig.model, EngineConfig(block_size=BLOCK, num_blocks=n_blocks + 8, chunk_size=tokens,
                                          max_batched_tokens=tokens), connector=conn)


def test_a_step_saving_more_blocks_than_staging_buffers_saves_them_all(rig, store):
    """40 blocks in one step through 4 staging buffers: none dropped, the store holds all 40
    (it used to take one buffer per block for the whole step, so 36 waited out the enqueue
    timeout one by one and were dropped, leaving a gap that ended every later hit)."""
    n = 40
    eng = _big_step_engine(rig, store, n, staging_buffers=4, load_batch_blocks=4)
    out = eng.generate(rig.tokens(random.Random(300), n * BLOCK + 5), ONE, request_id="r")
    assert eng.connector.flush(timeout=60)
    m = eng.connector.metrics.snapshot()
    assert m.get("saves_dropped", 0) == 0, m
    assert store.lookup(out.block_hashes[:n]).hit_blocks == n
    assert eng.connector.buffers.allocations <= 4


def test_block_saves_with_every_staging_buffer_held_elsewhere_are_dropped_not_stalled(rig, store):
    """Buffers held by someone else (staged loads) are waited for once per step, not per block."""
    n = 40
    eng = _big_step_engine(rig, store, n, staging_buffers=4, load_batch_blocks=4, save_enqueue_timeout_s=0.05)
    conn = eng.connector
    held = conn.buffers.acquire_many(conn.block_nbytes, 4, timeout=0)
    assert len(held) == 4
    eng.generate(rig.tokens(random.Random(301), n * BLOCK + 5), ONE, request_id="r")
    for b in held:
        conn.buffers.release(b)
    assert conn.flush(timeout=60)
    assert conn.metrics.get("saves_dropped") == n
