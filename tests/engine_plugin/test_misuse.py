"""Misuse of the engine, the connector and their configs is refused with ``InvalidRequest``
(or ``StoreClosed`` after ``close``) at the call that is wrong, and never leaves the engine
unable to serve the next request."""

from __future__ import annotations

import math
import random
import threading
from dataclasses import replace

import pytest
import torch

from engine_plugin.devices import get_backend
from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
from engine_plugin.reference import Engine, EngineConfig, SamplingParams, model_preset
from engine_plugin.reference.engine import Status
from engine_plugin.tiers import MAX_STORE_CALLS
from kvstore.errors import InvalidRequest, StoreClosed
from kvstore.keys import ImageSpan

GREEDY = SamplingParams(max_new_tokens=3)


# ----------------------------------------------------------------------------- the engine keeps serving


def test_a_request_too_big_for_the_pool_is_refused_alone(rig):
    eng = rig.engine(connector=False, num_blocks=8)
    with pytest.raises(InvalidRequest, match="needs 32 blocks.*the pool has 8"):
        eng.generate([1] * 500, SamplingParams(max_new_tokens=2))
    assert not eng.waiting and not eng.running  # nothing of it stayed queued
    prompt = rig.tokens(random.Random(20), 40)
    rig.same(rig.cold(prompt, GREEDY), eng.generate(prompt, GREEDY))  # the next request is served


def test_a_duplicate_request_id_is_refused_and_the_first_one_completes(rig):
    rng = random.Random(21)
    eng = rig.engine(connector=False, chunk=8)
    p1, p2 = rig.tokens(rng, 30), rig.tokens(rng, 20)
    eng.add_request("r", p1, GREEDY)
    with pytest.raises(InvalidRequest, match="already waiting or running"):
        eng.add_request("r", p2, GREEDY)  # while it waits
    eng.step()
    assert [r.request_id for r in eng.running] == ["r"]
    with pytest.raises(InvalidRequest, match="already waiting or running"):
        eng.add_request("r", p2, GREEDY)  # while it runs
    done = eng.run_until_done()
    rig.same(rig.cold(p1, GREEDY), done["r"])
    # Once it finished the id may be used again, and later requests are unaffected.
    rig.same(rig.cold(p2, GREEDY), eng.generate(p2, GREEDY, request_id="r"))


def test_abort_request_frees_its_blocks_and_the_others_go_on(rig):
    rng = random.Random(22)
    eng = rig.engine(connector=False, chunk=8)
    pa, pb = rig.tokens(rng, 50), rig.tokens(rng, 45)
    a = eng.add_request("a", pa, GREEDY)
    eng.add_request("b", pb, GREEDY)
    eng.step()
    assert eng.abort_request("a") and not eng.abort_request("a") and not eng.abort_request("nope")
    assert a.status is Status.ABORTED and not a.block_ids
    done = eng.run_until_done()
    assert "a" not in done
    rig.same(rig.cold(pb, GREEDY), done["b"])
    assert not any(eng.pool.refcount)  # a's blocks were given back


def test_abort_with_a_connector_after_a_step_that_raised(rig, store, monkeypatch):
    rng = random.Random(23)
    prompt = rig.tokens(rng, 70)
    seed = rig.engine(store)
    seed.generate(prompt, GREEDY)
    seed.connector.flush()
    eng = rig.engine(store)
    boom = RuntimeError("injected fault in the model")

    def fail(*a, **kw):
        raise boom

    with monkeypatch.context() as m:
        m.setattr(eng.model, "forward_chunk", fail)
        eng.add_request("x", prompt, GREEDY)
        with pytest.raises(RuntimeError, match="injected"):
            eng.step()
    assert "x" in eng.connector._jobs  # its store load was started, and never collected
    assert eng.abort_request("x")
    assert not eng.running and not any(eng.pool.refcount) and not eng.connector._jobs
    warm = eng.generate(prompt, GREEDY)  # the engine and its connector serve the next request
    rig.same(rig.cold(prompt, GREEDY), warm)


# ----------------------------------------------------------------------------- sampling


@pytest.mark.parametrize("temperature", [math.nan, -0.5, math.inf, -math.inf])
def test_non_finite_or_negative_temperature_is_refused(temperature):
    with pytest.raises(InvalidRequest, match="temperature"):
        SamplingParams(temperature=temperature)


def test_valid_sampling_params_are_accepted():
    assert SamplingParams(temperature=0).temperature == 0
    assert SamplingParams(temperature=0.7, seed=3, output_offset=2).seed == 3
    with pytest.raises(InvalidRequest):
        SamplingParams(seed=-1)


# ----------------------------------------------------------------------------- prompts


@pytest.mark.parametrize("prompt, match", [
    ("hello", "list of int token ids, got str"),
    (torch.tensor([1, 2, 3]), "list of int token ids, got Tensor"),
    ([1.5, 2.7], "token ids must be ints"),
    ([1, 2.0], "token ids must be ints"),
    ([True, 2], "token ids must be ints"),
    ([], "at least one token"),
    ([1, 128], r"\[0, 128\)"),
    ([-1, 2], r"\[0, 128\)"),
])
def test_bad_prompts_are_refused_with_a_clear_message(rig, prompt, match):
    eng = rig.engine(connector=False)
    with pytest.raises(InvalidRequest, match=match):
        eng.add_request("p", prompt, GREEDY)
    assert not eng.has_work()


def test_a_tuple_prompt_is_a_prompt(rig):
    prompt = rig.tokens(random.Random(24), 20)
    rig.same(rig.cold(prompt, GREEDY), rig.engine(connector=False).generate(tuple(prompt), GREEDY))


# ----------------------------------------------------------------------------- configs


def test_connector_and_engine_block_sizes_must_agree(rig):
    conn = KVStoreConnector(rig.model.kv_layout(), ConnectorConfig(block_size=32))
    rig.connectors.append(conn)
    with pytest.raises(InvalidRequest, match="block_size is 32 but the engine's is 16"):
        Engine(rig.model, EngineConfig(block_size=16), connector=conn)


@pytest.mark.parametrize("change, match", [
    ({"d_global": 40}, "d_global 40"),
    ({"dtype": "float16"}, "dtype 'float16'"),
    ({"snapshot_shape": (4, 2, 7, 4, 8)}, "snapshot_shape"),
])
def test_a_layout_that_does_not_fit_the_model_is_refused_at_construction(rig, change, match):
    conn = KVStoreConnector(replace(rig.model.kv_layout(), **change), ConnectorConfig(block_size=16))
    rig.connectors.append(conn)
    with pytest.raises(InvalidRequest, match=match):
        Engine(rig.model, EngineConfig(block_size=16), connector=conn)


@pytest.mark.parametrize("kw", [
    {"block_size": 0}, {"block_size": -16}, {"host_capacity_bytes": -1}, {"save_queue_depth": 0},
    {"store_timeout_s": 0}, {"store_timeout_s": math.nan}, {"store_backoff_s": -1}, {"ttl_s": 0},
    {"snapshot_interval_blocks": -1}, {"load_batch_blocks": 0},
    {"store_max_calls": 5}, {"store_max_calls": 2}, {"store_max_calls": 0},
    {"store_max_calls": 4.0}, {"store_max_calls": True},
])
def test_connector_config_refuses_bad_values(kw):
    with pytest.raises(InvalidRequest, match=next(iter(kw))):
        ConnectorConfig(**kw)


def test_store_max_calls_reaches_the_store_gateway(rig):
    """``ConnectorConfig.store_max_calls`` bounds the gateway's store call threads (it was only
    settable by building a ``StoreGateway`` by hand: the connector always used 16)."""
    conn = KVStoreConnector(rig.model.kv_layout(), ConnectorConfig(block_size=16, store_max_calls=7))
    rig.connectors.append(conn)
    assert conn.gateway.max_calls == 7
    assert ConnectorConfig().store_max_calls == MAX_STORE_CALLS


@pytest.mark.parametrize("kw", [{"d_global": 0}, {"dtype": "nope"}, {"snapshot_shape": "abc"},
                                {"replay_spans": (("exact", -1),)}])
def test_kv_layout_refuses_bad_values(rig, kw):
    with pytest.raises(InvalidRequest):
        replace(rig.model.kv_layout(), **kw)


@pytest.mark.parametrize("spec", ["cpu:abc", "cpu:-1", "cpu:", "gpu", "cuda:1.5"])
def test_get_backend_refuses_bad_device_strings(spec):
    with pytest.raises(InvalidRequest):
        get_backend(spec)


@pytest.mark.parametrize("overrides, match", [
    ({"nope": 1}, "unknown ModelConfig field"),
    ({"dtype": "nope"}, "dtype 'nope'"),
    ({"d_model": 0}, "d_model"),
    ({"init_std": math.nan}, "init_std"),
    ({"rope_theta": -1.0}, "rope_theta"),
    ({"window": 2.5}, "window"),
])
def test_model_preset_refuses_bad_overrides(overrides, match):
    with pytest.raises(InvalidRequest, match=match):
        model_preset("tiny", **overrides)


@pytest.mark.parametrize("kw", [{"block_size": 0}, {"num_blocks": -1}, {"chunk_size": 1.5},
                                {"max_running": 0}])
def test_engine_config_refuses_bad_values(kw):
    with pytest.raises(InvalidRequest, match=next(iter(kw))):
        EngineConfig(**kw)


# ----------------------------------------------------------------------------- close


def test_close_is_idempotent_and_use_after_close_is_typed(rig, store):
    rng = random.Random(25)
    eng = rig.engine(store)
    eng.generate(rig.tokens(rng, 40), GREEDY)
    conn = eng.connector
    closer = threading.Thread(target=lambda: [conn.close() for _ in range(3)], daemon=True)
    closer.start()
    closer.join(timeout=20)
    assert not closer.is_alive(), "close() hung on a repeated call"
    with pytest.raises(StoreClosed, match="closed"):
        conn.flush()
    with pytest.raises(StoreClosed, match="closed"):
        eng.generate(rig.tokens(rng, 40), GREEDY)
    with pytest.raises(StoreClosed, match="closed"):
        conn.persist_host_tier()
    assert not eng.running and not any(eng.pool.refcount)  # the refused admission gave its blocks back
    conn.close()  # and once more: still nothing


# ----------------------------------------------------------------------------- sampling seeds and images


@pytest.mark.parametrize("seed", [2**45, 2**63 - 1, 2**64 - 1])
def test_any_wire_seed_samples_and_fails_no_other_request(rig, seed):
    """The wire's seed is a uint64; seeds over about 1.8e13 overflowed torch's seed in the
    sampler, failing the whole step: the request beside it too (and, through the entrypoint,
    the prefill workers were marked down). Now every seed folds into torch's range."""
    eng = rig.engine(connector=False)
    ok = eng.add_request("ok", [1, 2, 3], GREEDY)
    big = eng.add_request("big", [1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.5, seed=seed))
    eng.run_until_done()
    assert ok.status is Status.FINISHED and big.status is Status.FINISHED and len(big.output) == 4
    sampling = SamplingParams(max_new_tokens=4, temperature=0.5, seed=seed)
    again = rig.engine(connector=False).generate([1, 2, 3], sampling)
    assert again.output == big.output  # still a function of (seed, output index)


@pytest.mark.parametrize("other", [5 + 2**32, 5 + 2**63, 6])
def test_every_seed_has_a_noise_stream_of_its_own(rig, other):
    """The sampler seeded torch's CPU generator, which keeps only the low 32 bits of a seed, with
    ``seed * 1_000_003 + index``: wire seeds 2**32 apart sampled the same tokens (and seed 6's
    stream was seed 5's, shifted by a million tokens). The noise now comes from the whole
    (seed, index) pair, so none of these agree with seed 5."""
    def sample(seed):
        sampling = SamplingParams(max_new_tokens=24, temperature=1.0, seed=seed)
        return rig.engine(connector=False).generate([1, 2, 3], sampling).output
    assert sample(5) == sample(5)  # still a function of (seed, output index) alone
    assert sample(5) != sample(other)


@pytest.mark.parametrize("images, match", [
    ([(b"img", 0, 4)], "list of ImageSpan"),
    ("not spans", "list of ImageSpan"),
    ([ImageSpan(b"h", 36, 8)], r"\[36, 44\) lies outside the 40-token prompt"),
    ([ImageSpan(b"h", 0, 8), ImageSpan(b"g", 4, 8)], "overlap"),
])
def test_bad_image_spans_are_refused_and_never_block_the_queue(rig, images, match):
    """Spans that were not ImageSpans got in and made every later step raise, so no request
    queued behind ran; spans outside the prompt were taken silently."""
    eng = rig.engine(connector=False)
    with pytest.raises(InvalidRequest, match=match):
        eng.add_request("bad", list(range(40)), GREEDY, images=images)
    ok = eng.add_request("ok", [1, 2, 3, 4], GREEDY)
    eng.run_until_done()
    assert ok.status is Status.FINISHED
