"""The vLLM binding's worker hooks driven by hand in vLLM's order, and its namespace: what it
saves after a failed load, and what tells engines with different weights apart."""

from __future__ import annotations

import concurrent.futures as cf
import time
from types import SimpleNamespace

import pytest
import torch

import kvstore
from engine_plugin.saver import SaveQueue
from engine_plugin.tiers import Metrics, StoreGateway
from kvstore.keys import BlockHasher, Namespace

pytestmark = pytest.mark.vllm  # imports vLLM: the second stage of tools/run_tests.sh

B = 16


def _vllm_worker(store, tmp_path, num_blocks=8):
    """A worker-role KvstackConnector wired by hand (no vLLM engine): one full-attention
    group with one layer, the embedded store, sync loads (what load_mode=auto picks for an
    embedded store and one full group)."""
    import engine_plugin.vllm as vk
    from engine_plugin.vllm_layout import ConnectorOptions, GroupInfo, GroupKind, GroupPlan

    c = object.__new__(vk.KvstackConnector)
    c.opts = ConnectorOptions.parse({"store_url": str(tmp_path / "unused")})
    c.B = B
    c.plan = GroupPlan(B, (GroupInfo(0, GroupKind.FULL, ("l0",)),))
    c.metrics = Metrics()
    c._hasher = BlockHasher(Namespace("review-model"), B)
    c.store = store
    c.gateway = StoreGateway(store, c.metrics, timeout_s=5.0, put_timeout_s=5.0)
    c.saves = SaveQueue(c.gateway, c.metrics, depth=8, enqueue_timeout_s=0.0)
    c._loader = cf.ThreadPoolExecutor(1)
    c._reads = cf.ThreadPoolExecutor(1)
    c._layers, c._jobs, c._invalid = {}, {}, set()
    c._finishing_copied, c._last_finished = set(), set()
    c._reported, c._last_log, c._written = {}, time.monotonic(), None
    c._kv_cache_config = SimpleNamespace(num_blocks=num_blocks)
    c.register_kv_caches({"l0": torch.randn(num_blocks, 2, B, 8)})
    return vk, c


def test_blocks_computed_over_a_failed_synchronous_load_are_not_saved(tmp_path):
    """vLLM calls, in one step: start_load_kv -> forward -> wait_for_save ->
    get_transfer_results -> get_block_ids_with_load_errors (kv_connector_model_runner_mixin).
    Request r hits blocks 0..1 in the store (the scheduler's lookup); before the worker reads
    them block 1 is gone (evicted, expired, lost). The load stops at block 1, so the forward
    computes block 2 over whatever pool block 6 held. wait_for_save, which runs before vLLM
    learns of the failure, must not put block 2 under its key: a put of a live key is refused,
    so vLLM's recompute could never replace it, and every later hit would load wrong KV."""
    store = kvstore.connect(str(tmp_path / "store"))
    vk, c = _vllm_worker(store, tmp_path)
    try:
        h = [bytes([i]) * 32 for i in range(3)]  # vLLM's chained block hashes of r
        key = lambda i: c._hasher.keys_for_engine_hashes([h[i]])[0]  # noqa: E731
        lay = c._entry_layout(1)
        # block 0 is stored; block 1 is not (lost between lookup and load)
        store.put_many([kvstore.PutItem(key(0), torch.zeros(c._full_nbytes, dtype=torch.uint8).numpy(),
                                        kind="block", layout=lay, tokens=B)])
        meta = vk.KvstackMetadata(
            loads=[vk.LoadJob("r", (vk.BlockLoad(h[0], (5,)), vk.BlockLoad(h[1], (6,))), None, sync=True)],
            block_saves=[vk.BlockSave("r", h[2], (7,))])  # block 2: computed by this step's forward
        c.bind_connector_metadata(meta)
        c.start_load_kv(None)
        c.wait_for_layer_load("l0")
        # (forward runs here over blocks 5, 6 (not loaded) and writes block 7)
        c.wait_for_save()
        res = c.get_transfer_results(set())
        invalid = c.get_block_ids_with_load_errors()
        c.clear_connector_metadata()
        assert invalid == {6}, (res, invalid)  # the failure is reported: vLLM recomputes from block 1
        assert c.saves.flush(10)
        # ...but block 2, computed over the bad block 1, must not have reached the store
        assert store.lookup([key(0), key(1)]).hit_blocks == 1
        assert store.get_many([key(2)])[0] is None, \
            "block 2 computed over a failed load was saved under its real key"
    finally:
        c.saves.close()
        c._loader.shutdown(wait=True)
        c._reads.shutdown(wait=True)
        c.gateway.close()
        store.close()


def _vllm_namespace(**model_kw):
    import engine_plugin.vllm as vk
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from engine_plugin.vllm_layout import ConnectorOptions, GroupInfo, GroupKind, GroupPlan

    c = object.__new__(vk.KvstackConnector)
    c._role = KVConnectorRole.SCHEDULER
    c.opts = ConnectorOptions.parse({"store_url": "/unused"})
    c.B = B
    c.plan = GroupPlan(B, (GroupInfo(0, GroupKind.FULL, ("l0",)),))
    mc = dict(model="org/model", dtype=torch.bfloat16, revision=None, quantization=None, hf_overrides={})
    mc.update(model_kw)
    vc = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1),
                         cache_config=SimpleNamespace(cache_dtype="auto"),
                         model_config=SimpleNamespace(**mc))
    return vk.KvstackConnector._namespace(c, vc)


def test_engines_with_other_weights_under_one_model_name_share_no_keys():
    """vLLM's block hashes hold only tokens (and salt, LoRA, multimodal inputs), so the
    namespace alone keeps apart engines whose KV differs: LLM(model="org/model",
    revision="v1") and revision="v2", the same checkpoint with quantization="fp8", another
    model dtype, or other config overrides (rope scaling), all with the same cache dtype and
    layout (which the load's layout check cannot tell apart)."""
    base = _vllm_namespace()
    assert _vllm_namespace() == base  # stable
    assert _vllm_namespace(revision="v2") != base
    assert _vllm_namespace(quantization="fp8") != base
    assert _vllm_namespace(dtype=torch.float16) != base
    assert _vllm_namespace(hf_overrides={"rope_scaling": {"type": "yarn", "factor": 4.0}}) != base
