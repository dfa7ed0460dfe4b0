"""CUDA correctness of the plugin path (run by tools/gpu_check.sh; skipped without CUDA)."""

from __future__ import annotations

import random

import pytest
import torch

from engine_plugin.contract import Tier
from engine_plugin.devices import get_backend
from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
from engine_plugin.reference import Engine, EngineConfig, ReferenceModel, SamplingParams, model_preset

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def cuda_model():
    return ReferenceModel(model_preset("tiny"), device="cuda")


def _engine(model, store, **kw):
    conn = KVStoreConnector(model.kv_layout(), ConnectorConfig(block_size=16, device="cuda", **kw), store)
    return Engine(model, EngineConfig(block_size=16, chunk_size=32), connector=conn)


@pytest.mark.parametrize("load_snapshots", [False, True])
def test_cuda_store_hit_equals_cpu_cold(rig, store, cuda_model, load_snapshots):
    rng = random.Random(200)
    prefix = rig.tokens(rng, 150)
    a = _engine(cuda_model, store)
    a.generate(prefix, GREEDY)
    a.connector.flush()
    prompt = prefix + rig.tokens(rng, 20)
    b = _engine(cuda_model, store, load_snapshots=load_snapshots)
    warm = b.generate(prompt, GREEDY)
    assert warm.hit_tokens == 144 and (warm.plan.snapshot_tier is Tier.STORE) == load_snapshots
    cold_gpu = Engine(cuda_model, EngineConfig(block_size=16, chunk_size=1024)).generate(prompt, GREEDY)
    assert warm.output == cold_gpu.output
    for x, y in zip(cold_gpu.logits, warm.logits):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    cpu_cold = rig.cold(prompt, GREEDY)  # different kernels: close, same greedy tokens
    assert warm.output == cpu_cold.output
    for e in (a, b):
        e.connector.close()


def test_cuda_staging_buffers_are_pinned_and_reused(store, cuda_model):
    be = get_backend("cuda")
    buf = be.empty_host(1024)
    assert buf.is_pinned()
    rng = random.Random(201)
    prompt = [rng.randrange(128) for _ in range(300)]
    a = _engine(cuda_model, store)
    a.generate(prompt, GREEDY)
    a.connector.flush()
    b = _engine(cuda_model, store, load_batch_blocks=4, staging_buffers=8, promote_to_host=False)
    b.generate(prompt + [1], GREEDY)
    assert b.connector.buffers.reuses > 0 and b.connector.buffers.allocations <= 8 + 1  # + a snapshot
    for e in (a, b):
        e.connector.close()
