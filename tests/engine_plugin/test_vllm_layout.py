"""The vLLM binding's pure parts: its options, how vLLM's KV groups are stored, its namespace."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from engine_plugin.vllm_layout import (ConnectorOptions, GroupKind, GroupPlan, first_window_block,
                                       namespace_id)
from kvstore.errors import InvalidRequest
from kvstore.keys import BlockHasher, Namespace


@dataclass
class FullAttentionSpec:
    block_size: int = 32


@dataclass
class SlidingWindowSpec:
    block_size: int = 32
    sliding_window: int = 64


@dataclass
class MambaSpec:
    block_size: int = 32


def _config(*specs_and_layers):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=list(ls))
                                            for s, ls in specs_and_layers])


def test_options_need_a_store_and_refuse_unknown_or_bad_keys():
    o = ConnectorOptions.parse({"store_url": "grpc://127.0.0.1:7070", "ttl_s": 60, "save_queue_depth": 8})
    assert (o.store_url, o.ttl_s, o.save_queue_depth, o.direct_reads) == ("grpc://127.0.0.1:7070", 60.0, 8, "off")
    for bad, word in [({}, "store_url"), ({"store_url": ""}, "store_url"),
                      ({"store_url": "d", "stor_url": "x"}, "stor_url"),
                      ({"store_url": "d", "ttl_s": 0}, "ttl_s"), ({"store_url": "d", "ttl_s": True}, "ttl_s"),
                      ({"store_url": "d", "save_queue_depth": 1.5}, "save_queue_depth"),
                      ({"store_url": "d", "lookup_timeout_s": float("nan")}, "lookup_timeout_s"),
                      ({"store_url": "d", "direct_reads": "yes"}, "direct_reads"),
                      ({"store_url": "d", "snapshot_end_of_output": "no"}, "snapshot_end_of_output")]:
        with pytest.raises(InvalidRequest, match=word):
            ConnectorOptions.parse(bad)


def test_groups_sorted_into_full_and_window_and_others_refused():
    plan = GroupPlan.from_kv_cache_config(_config((FullAttentionSpec(), ["l.1", "l.3"]),
                                                  (SlidingWindowSpec(), ["l.2", "l.0"])), 32)
    assert [g.kind for g in plan.groups] == [GroupKind.FULL, GroupKind.WINDOW]
    assert plan.window[0].layer_names == ("l.0", "l.2") and plan.window[0].window == 64
    with pytest.raises(InvalidRequest, match="MambaSpec"):
        GroupPlan.from_kv_cache_config(_config((MambaSpec(), ["m"])), 32)
    with pytest.raises(InvalidRequest, match="block size"):
        GroupPlan.from_kv_cache_config(_config((FullAttentionSpec(block_size=16), ["l"])), 32)


@pytest.mark.parametrize("boundary,window,block,first", [
    (896, 64, 32, 26),  # the token at 896 reads [833, 896]: blocks 26 (832..863) and 27
    (64, 64, 32, 0),
    (65, 64, 32, 0),
    (96, 64, 32, 1),
    (128, 128, 128, 0),
    (4096, 4096, 128, 0),
    (4097, 4096, 128, 0),
    (4224, 4096, 128, 1),
])
def test_first_window_block_is_the_first_block_the_next_token_reads(boundary, window, block, first):
    assert first_window_block(boundary, window, block) == first
    # what vLLM's SlidingWindowManager skips after `boundary` computed tokens: max(0, H - W + 1)
    assert first == max(0, boundary - window + 1) // block


def test_namespace_changes_with_everything_that_changes_kv_bytes():
    plan = GroupPlan.from_kv_cache_config(_config((FullAttentionSpec(), ["a", "b"])), 32)
    base = dict(model="m", weights="w", cache_dtype="bfloat16", block_size=32, device="cpu", attn_layout="NHD",
                tp_rank=0, tp_size=1, plan=plan)
    ref = namespace_id(**base)
    other_plan = GroupPlan.from_kv_cache_config(_config((FullAttentionSpec(), ["a"]), (SlidingWindowSpec(), ["b"])), 32)
    for k, v in [("model", "m2"), ("weights", "w2"), ("cache_dtype", "fp8"), ("block_size", 16), ("device", "cuda"),
                 ("attn_layout", "HND"), ("tp_rank", 1), ("tp_size", 2), ("plan", other_plan)]:
        assert namespace_id(**dict(base, **{k: v})) != ref, k
    assert namespace_id(**base) == ref


def test_keys_from_engine_hashes_are_namespaced_and_keep_prefixes():
    hashes = [bytes([i]) * 32 for i in range(6)]
    a = BlockHasher(Namespace("m", "vllm-x"), 32)
    keys = a.keys_for_engine_hashes(hashes)
    assert len(set(keys)) == 6 and all(len(k) == 16 for k in keys)
    assert a.keys_for_engine_hashes(hashes[:3]) == keys[:3]
    assert BlockHasher(Namespace("m", "vllm-y"), 32).keys_for_engine_hashes(hashes)[0] != keys[0]
    assert BlockHasher(Namespace("m", "vllm-x"), 64).keys_for_engine_hashes(hashes)[0] != keys[0]
    # never equal to a key the project's own token hashing gives
    assert not set(keys) & set(a.hash_blocks(list(range(6 * 32))))
