"""The reference model alone: the replay span is the exact receptive field, and it is tight."""

from __future__ import annotations

import random

import pytest
import torch

from engine_plugin.reference import ReferenceModel, WindowState, model_preset
from engine_plugin.reference.model import REPLAY_SPANS
from kvstore.errors import InvalidRequest


class _FlatKV:
    def __init__(self, n: int, d: int):
        self.g = torch.zeros(n, d, dtype=torch.float64)

    def read(self, end):
        return self.g[:end]

    def write(self, start, g):
        self.g[start:start + g.shape[0]] = g


def _cold_window(model, toks, upto):
    kv = _FlatKV(len(toks), model.cfg.d_global)
    win = WindowState.empty(model.cfg, "cpu")
    kv.g = kv.g.to(win.buf.dtype)
    model.forward_chunk(torch.tensor(toks[:upto]), 0, win, kv)
    return win, kv


def _replayed_window(model, toks, kv, upto, span):
    start = max(0, upto - span)
    win = WindowState.empty(model.cfg, "cpu", end=start)
    win.valid = 0
    model.forward_chunk(torch.tensor(toks[start:upto]), start, win, kv, replay=True)
    return win


@pytest.mark.parametrize("overrides", [{}, {"window": 5, "n_swa_layers": 3, "n_cross_layers": 1},
                                       {"window": 12, "n_swa_layers": 1, "n_cross_layers": 3}])
def test_exact_span_rebuilds_windows_and_is_tight(overrides):
    # float64 so that "exact" means ~1e-15, far from the error of a span one token short
    model = ReferenceModel(model_preset("tiny", dtype="float64", **overrides))
    c = model.cfg
    R = model.replay_span()
    assert R == (c.n_swa_layers + c.n_cross_layers) * (c.window - 1)
    rng = random.Random(3)
    toks = [rng.randrange(c.vocab_size) for _ in range(3 * R)]
    H = 2 * R + 5
    cold, kv = _cold_window(model, toks, H)
    g_before = kv.g.clone()
    exact = _replayed_window(model, toks, kv, H, R)
    assert (exact.buf - cold.buf).abs().max() < 1e-11
    assert torch.equal(kv.g, g_before), "replay overwrote loaded global KV"
    short = _replayed_window(model, toks, kv, H, R - 1)  # one token less: the deepest row is wrong
    assert (short.buf - cold.buf).abs().max() > 1e-6  # measured ~1e-3..1e-1


def test_replay_policies_registry(model):
    assert model.replay_span("window") == model.cfg.window
    assert set(REPLAY_SPANS) >= {"exact", "window"}
    with pytest.raises(InvalidRequest):
        model.replay_span("nope")


def test_forward_chunk_misuse(model):
    kv = _FlatKV(8, model.cfg.d_global)
    win = WindowState.empty(model.cfg, "cpu")
    with pytest.raises(InvalidRequest):
        model.forward_chunk(torch.tensor([1, 2]), 3, win, kv)
    with pytest.raises(InvalidRequest):
        model.forward_chunk(torch.tensor([], dtype=torch.long), 0, win, kv)


def test_seeded_weights_and_safetensors_roundtrip(tmp_path, model):
    again = ReferenceModel(model_preset("tiny"))
    other = ReferenceModel(model_preset("tiny", seed=1))
    sd, sd2 = model.state_dict(), again.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert not torch.equal(sd["lm_head.weight"], other.state_dict()["lm_head.weight"])
    path = str(tmp_path / "w.safetensors")
    model.save_weights(path)
    other.load_weights(path)
    assert torch.equal(other.state_dict()["lm_head.weight"], sd["lm_head.weight"])


def test_config_validation():
    with pytest.raises(InvalidRequest):
        model_preset("tiny", window=0)
    with pytest.raises(InvalidRequest):
        model_preset("nope")


@pytest.mark.parametrize("overrides", [
    {"init_std": 0.1}, {"d_ff": 96}, {"rope_theta": 500.0}, {"d_latent": 16, "d_rope": 16},
], ids=["init_std", "d_ff", "rope_theta", "latent_rope_split"])
def test_every_field_that_changes_weights_or_kv_changes_the_namespace(rig, store, overrides):
    """Two models that differ only in a field left out of the readable id must not share keys:
    the second would load the first's KV (wrong output) from a shared store."""
    from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
    from engine_plugin.reference import Engine, EngineConfig, SamplingParams

    base = model_preset("tiny")
    other = model_preset("tiny", **overrides)
    assert other.d_global == base.d_global  # same KV width: only the namespace tells them apart
    assert other.namespace() != base.namespace() and other.model_id != base.model_id
    prompt = rig.tokens(random.Random(30), 70)
    sp = SamplingParams(max_new_tokens=2)
    filler = rig.engine(store)  # the base model fills the store
    filler.generate(prompt, sp)
    filler.connector.flush()
    assert store.lookup(filler.hasher.hash_blocks(prompt)).hit_blocks == 4
    model = ReferenceModel(other)
    conn = KVStoreConnector(model.kv_layout(), ConnectorConfig(block_size=16), store)
    rig.connectors.append(conn)
    eng = Engine(model, EngineConfig(block_size=16), connector=conn)
    assert store.lookup(eng.hasher.hash_blocks(prompt)).hit_blocks == 0
    warm = eng.generate(prompt, sp)
    assert warm.hit_tokens == 0 and conn.metrics.get("hit_tokens_store") == 0
    cold = Engine(model, EngineConfig(block_size=16)).generate(prompt, sp)
    assert warm.output == cold.output


def test_model_id_is_stable_and_ignores_only_the_name():
    a = model_preset("tiny")
    assert a.model_id == model_preset("tiny").model_id  # deterministic: no process-level seed
    assert model_preset("tiny", rope_theta=10000).model_id == a.model_id  # 10000 == 10000.0
    assert model_preset("tiny", name="other").namespace() != a.namespace()  # the readable prefix
    assert model_preset("tiny", seed=1).model_id != a.model_id


def _store_engine(model, store, rig):
    from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
    from engine_plugin.reference import Engine, EngineConfig

    conn = KVStoreConnector(model.kv_layout(), ConnectorConfig(block_size=16), store)
    rig.connectors.append(conn)
    return Engine(model, EngineConfig(block_size=16), connector=conn)


def test_loaded_weights_change_the_namespace(rig, store, tmp_path):
    """A fine-tune has its base model's config: without its weights in the identity it
    loads the base model's KV from a shared store and answers with other tokens."""
    from engine_plugin.reference import Engine, EngineConfig, SamplingParams

    base = ReferenceModel(model_preset("tiny"))
    ReferenceModel(model_preset("tiny", seed=5)).save_weights(str(tmp_path / "ft.safetensors"))
    ft = ReferenceModel(model_preset("tiny"))
    ft.load_weights(str(tmp_path / "ft.safetensors"))
    assert ft.model_id != base.model_id and ft.namespace() != base.namespace()
    prompt = rig.tokens(random.Random(0), 100)
    sp = SamplingParams(max_new_tokens=8)
    filler = _store_engine(base, store, rig)
    filler.generate(prompt, sp)
    filler.connector.flush()
    assert store.lookup(filler.hasher.hash_blocks(prompt)).hit_blocks == 6
    eng = _store_engine(ft, store, rig)
    warm = eng.generate(prompt, sp)
    assert warm.hit_tokens == 0 and eng.connector.metrics.get("hit_tokens_store") == 0
    cold = Engine(ft, EngineConfig(block_size=16)).generate(prompt, sp)
    assert warm.output == cold.output


def test_models_with_the_same_loaded_weights_share_kv(rig, store, tmp_path):
    """The weights digest is of the tensors, not the file: two files of one model share KV."""
    from engine_plugin.reference import Engine, EngineConfig, SamplingParams

    src = ReferenceModel(model_preset("tiny", seed=5))
    src.save_weights(str(tmp_path / "a.safetensors"))
    src.save_weights(str(tmp_path / "b.safetensors"))
    a, b = ReferenceModel(model_preset("tiny")), ReferenceModel(model_preset("tiny"))
    a.load_weights(str(tmp_path / "a.safetensors"))
    b.load_weights(str(tmp_path / "b.safetensors"))
    assert a.namespace() == b.namespace() != model_preset("tiny").namespace()
    prompt = rig.tokens(random.Random(1), 100)
    sp = SamplingParams(max_new_tokens=8)
    filler = _store_engine(a, store, rig)
    filler.generate(prompt, sp)
    filler.connector.flush()
    eng = _store_engine(b, store, rig)
    warm = eng.generate(prompt, sp)
    assert eng.connector.metrics.get("hit_tokens_store") > 0
    assert warm.output == Engine(b, EngineConfig(block_size=16)).generate(prompt, sp).output


def test_an_engine_built_before_load_weights_refuses_to_run(tmp_path):
    """Its namespace and pool belong to the old weights: refused, never silently reused."""
    from engine_plugin.reference import Engine, EngineConfig, SamplingParams

    ReferenceModel(model_preset("tiny", seed=5)).save_weights(str(tmp_path / "ft.safetensors"))
    m = ReferenceModel(model_preset("tiny"))
    eng = Engine(m, EngineConfig(block_size=16))
    eng.add_request("queued", [1, 2, 3], SamplingParams(max_new_tokens=2))
    m.load_weights(str(tmp_path / "ft.safetensors"))
    with pytest.raises(InvalidRequest, match="weights changed"):
        eng.step()
    with pytest.raises(InvalidRequest, match="weights changed"):
        eng.add_request("r", [1, 2, 3], SamplingParams(max_new_tokens=2))
    assert Engine(m, EngineConfig(block_size=16)).namespace == m.namespace()
