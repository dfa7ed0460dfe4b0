"""Cost models: the fit recovers known coefficients, predictions are monotone, the committed fit loads."""

from __future__ import annotations

import numpy as np
import pytest

from lb.cost_model import DEFAULT_PATH, CostModels, DecodeCostModel, PrefillCostModel, TransferModel, load_default
from lb.types import LBInputError, TierBandwidth


def test_prefill_fit_recovers_coefficients():
    true = PrefillCostModel(0.003, 2e-4, 5e-9)
    rng = np.random.default_rng(0)
    samples = []
    for p in (256, 1024, 4096, 16384):
        for frac in (0.0, 0.5, 0.9):
            c = int(p * frac)
            samples.append((p, c, true.predict(p, c) * (1 + rng.normal(0, 1e-3))))
    fit = PrefillCostModel.fit(samples)
    assert fit.r2 > 0.999
    for p, c, _ in samples:
        assert fit.predict(p, c) == pytest.approx(true.predict(p, c), rel=0.02)
    np.testing.assert_allclose(fit.predict_many(np.array([1000, 500]), np.array([0, 500])),
                               [fit.predict(1000, 0), 0.0])


def test_fit_rejects_bad_samples():
    with pytest.raises(LBInputError, match="cached_tokens <= prompt_tokens"):
        PrefillCostModel.fit([(10, 20, 1.0)] * 3)
    with pytest.raises(LBInputError, match="at least 3 samples"):
        PrefillCostModel.fit([(10, 0, 1.0)])
    with pytest.raises(LBInputError):
        DecodeCostModel.fit([(1, 2)])


def test_predictions_monotone_and_transfer():
    m = PrefillCostModel(0.001, 1e-4, 1e-9)
    assert m.predict(1000, 0) > m.predict(1000, 500) > m.predict(1000, 999) > m.predict(1000, 1000) == 0.0
    t = TransferModel(kv_bytes_per_token=1000.0, block_tokens=100)
    bw = TierBandwidth(host_bytes_per_s=1e6, store_bytes_per_s=1e5, host_latency_s=0.0, store_latency_s=0.5)
    assert t.host_s(10, bw) == pytest.approx(1.0) and t.store_s(1, bw) == pytest.approx(1.5)
    assert t.fetch_s(10, 1, bw) == pytest.approx(1.5) and t.fetch_s(0, 0, bw) == 0.0


def test_json_round_trip_and_committed_file():
    m = CostModels(PrefillCostModel(r2=0.5), DecodeCostModel(r2=0.5), meta={"x": 1})
    assert CostModels.from_json(m.to_json()) == m
    with pytest.raises(LBInputError, match="refit"):
        CostModels.from_json('{"format": 2}')
    for not_an_object in ("[1]", "3", '"x"', "null"):
        with pytest.raises(LBInputError, match="malformed cost model JSON"):
            CostModels.from_json(not_an_object)
    assert DEFAULT_PATH.exists(), "run tools/fit_cost_model.py"
    d = load_default()
    assert d.prefill.r2 > 0.9 and d.decode.r2 > 0.9
    assert "fit_cost_model.py" in d.meta["command"] and d.meta["prefill_samples"]


@pytest.mark.parametrize("part,field,value,match", [
    ("prefill", "const_s", -1.0, "finite numbers >= 0"),
    ("decode", "per_token_s", float("nan"), "finite numbers >= 0"),
    ("prefill", "per_token_s", float("inf"), "finite numbers >= 0"),
    ("prefill", "const_s", True, "finite numbers >= 0"),
    ("prefill", "per_token_s", 1e303, "non-finite time"),
    ("prefill", "r2", "x", "r2 must be a number"),
    ("decode", "r2", 5.0, "r2 must be a number"),
    ("transfer", "kv_bytes_per_token", 0, "kv_bytes_per_token > 0"),
    ("transfer", "block_tokens", 512.5, "integer block_tokens"),
])
def test_absurd_cost_models_are_refused_in_one_line(part, field, value, match):
    import json

    d = json.loads(CostModels().to_json())
    d[part][field] = value
    with pytest.raises(LBInputError, match=match):
        CostModels.from_json(json.dumps(d))


@pytest.mark.parametrize("part,zero", [("prefill", {"per_token_s": 0, "per_attn_pair_s": 0}),
                                       ("decode", {"const_s": 0, "per_token_s": 0, "per_request_s": 0})])
def test_a_cost_model_with_free_work_is_refused(part, zero, tmp_path):
    """All-zero work coefficients: every prefill (or decode step) takes no time, an infinite throughput;
    the replay tool says so in one line."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    d = json.loads(CostModels().to_json())
    d[part].update(zero)
    with pytest.raises(LBInputError, match="infinite throughput"):
        CostModels.from_json(json.dumps(d))
    (tmp_path / "m.json").write_text(json.dumps(d))
    (tmp_path / "t.jsonl").write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n')
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, str(root / "tools" / "replay_trace.py"), "--trace", str(tmp_path / "t.jsonl"),
                        "--cost-model", str(tmp_path / "m.json"), "--quiet"], capture_output=True, text=True,
                       timeout=120, cwd=root)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert line.startswith("replay_trace.py: error: --cost-model") and "infinite throughput" in line, line
