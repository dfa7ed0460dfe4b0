"""Cost models: the fit recovers known coefficients, predictions are monotone, the committed fit loads."""

from __future__ import annotations

import numpy as np
import pytest

from lb.cost_model import (
    DEFAULT_PATH, MIN_TIMING_S, CostModels, DecodeCostModel, PrefillCostModel, TransferModel, load_default,
)
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


def _grid_samples(true: PrefillCostModel) -> list[tuple[int, int, float]]:
    return [(p, c, true.predict(p, c)) for p in (512, 2048, 8192, 32768) for c in (0, p // 2, p * 7 // 8)]


def test_fit_refuses_a_zero_time_sample_and_names_it():
    """A 0 s row had relative weight 1e12 and made the fit predict ~0 s for every prefill."""
    true = PrefillCostModel(0.02, 1e-4, 5e-10)
    samples = _grid_samples(true)
    with pytest.raises(LBInputError, match=r"sample 12 \(64.0, 0.0, 0.0\) takes 0 s"):
        PrefillCostModel.fit(samples + [(64, 0, 0.0)])
    with pytest.raises(LBInputError, match="sample 1 .* takes 0 s"):
        DecodeCostModel.fit([(100, 1, 0.01), (200, 2, 0.0), (300, 3, 0.03), (400, 4, 0.04)])
    for bad in [(64, 0, -1.0), (64, 0, float("nan")), (float("inf"), 0, 1.0), (-1, 0, 1.0)]:
        with pytest.raises(LBInputError, match="sample 12 .* finite numbers >= 0"):
            PrefillCostModel.fit(samples + [bad])
    with pytest.raises(LBInputError, match=r"sample 12 .* cached_tokens <= prompt_tokens"):
        PrefillCostModel.fit(samples + [(10, 20, 1.0)])


@pytest.mark.parametrize("t", [1e-9, 5e-7, MIN_TIMING_S * (1 - 1e-9)])
def test_fit_refuses_a_timing_below_the_resolution_and_names_it(t):
    """A positive but sub-microsecond time (clock noise, a unit slip) weighs ~1/t**2 in the relative fit:
    one such row pulled the whole fit towards it and was caught, if at all, by the R^2 or throughput
    checks with a message about the model, not the row. Refused at the row, like a 0 s one."""
    samples = _grid_samples(PrefillCostModel(0.02, 1e-4, 5e-10))
    with pytest.raises(LBInputError, match=r"sample 12 \(64.0, 0.0, .*\) takes .* s \(1 such rows\), below the "
                                           r"timing resolution 1e-06 s"):
        PrefillCostModel.fit(samples + [(64, 0, t)])
    dec = [(t_, b, DecodeCostModel(1e-3, 1e-8, 1e-4).predict(t_, b)) for t_ in (1000, 10000) for b in (1, 8)]
    with pytest.raises(LBInputError, match="sample 4 .* below the timing resolution"):
        DecodeCostModel.fit(dec + [(10, 1, t)])


def test_a_timing_at_the_resolution_is_fitted():
    """The bound is inclusive: a 1 us row of a model that predicts it is a sample like any other."""
    true = DecodeCostModel(MIN_TIMING_S / 2, 0.0, MIN_TIMING_S / 2)
    fit = DecodeCostModel.fit([(0, b, true.predict(0, b)) for b in (1, 2, 4, 8)])
    assert fit.predict(0, 1) == pytest.approx(MIN_TIMING_S) and fit.r2 == pytest.approx(1.0)


@pytest.mark.parametrize("y", [0.5, 0.1])
def test_a_fit_of_equal_times_is_refused_r2_is_undefined(y):
    """All times equal: SS_tot is 0 (0.5: an exact mean) or an ulp-sized residue (0.1: the mean of equal
    floats is off by an ulp), so R^2 = 1 - SSE / SS_tot is 0 / 0. SS_tot fell back to 1.0, which reported
    R^2 ~ 1 for any model (0.5) or a huge negative R^2 (0.1); now refused, saying why."""
    from lb.cost_model import nonneg_lstsq

    with pytest.raises(LBInputError, match=r"all 4 samples have the same y .* R\^2 is undefined"):
        nonneg_lstsq(np.c_[np.ones(4), np.arange(4.0)], np.full(4, y))
    with pytest.raises(LBInputError, match=r"R\^2 is undefined"):
        DecodeCostModel.fit([(1000 * k, k, y) for k in (1, 2, 3, 4)])
    with pytest.raises(LBInputError, match=r"R\^2 is undefined"):
        PrefillCostModel.fit([(1000 * k, 0, y) for k in (1, 2, 3, 4)])


def test_fit_drops_rows_the_model_predicts_zero_for(caplog):
    """A fully cached prefill (suffix 0) or a decode step of no request is predicted 0 s: such rows
    only distorted the fit (a 5 ms fully-cached row moved const_s by 5 ms); now dropped and counted."""
    true = PrefillCostModel(0.02, 1e-4, 5e-10)
    clean = PrefillCostModel.fit(_grid_samples(true))
    with caplog.at_level("WARNING", logger="lb.cost_model"):
        fit = PrefillCostModel.fit(_grid_samples(true) + [(4096, 4096, 0.005)] * 3)
    assert fit == clean and fit.const_s == pytest.approx(0.02, rel=1e-6)
    (rec,) = [r for r in caplog.records if r.name == "lb.cost_model"]
    assert "dropped 3 of 15" in rec.getMessage() and "prompt_tokens == cached_tokens" in rec.getMessage()
    dtrue = DecodeCostModel(1e-3, 1e-8, 1e-4)
    dec = [(t, b, dtrue.predict(t, b)) for t in (1000, 10000, 100000) for b in (1, 8, 64)]
    assert DecodeCostModel.fit(dec + [(0, 0, 0.5)]) == DecodeCostModel.fit(dec)
    with pytest.raises(LBInputError, match="at least 3 samples"):
        PrefillCostModel.fit([(100, 100, 1.0)] * 5 + [(100, 0, 1.0)])


def test_fit_with_negative_r2_is_refused():
    """Samples that do not follow the model (here: time falls as work grows) are refused, not fitted."""
    samples = [(p, 0, 1.0 / p) for p in (100, 1000, 10000, 100000)]
    with pytest.raises(LBInputError, match=r"R\^2 = .* < 0"):
        PrefillCostModel.fit(samples)
    with pytest.raises(LBInputError, match=r"r2 must be a number in \[0, 1\]"):
        PrefillCostModel(r2=-0.38)


@pytest.mark.parametrize("model", [
    lambda: PrefillCostModel(0.0, 2.2e-23, 0.0),  # what the 0 s sample used to produce
    lambda: PrefillCostModel(1.0, 0.0, 1e-30),
    lambda: DecodeCostModel(0.0, 0.0, 1e-23),
    lambda: DecodeCostModel(1e-4, 0.0, 0.0),  # a step of 10M requests in 0.1 ms
])
def test_near_zero_work_is_an_infinite_throughput(model):
    with pytest.raises(LBInputError, match="infinite throughput"):
        model()


def _kkt_gap(x: np.ndarray, y: np.ndarray, coef: np.ndarray) -> float:
    """How far ``coef`` is from the NNLS optimum of the relative problem (0 at the optimum): the KKT
    conditions, independent of how the solver works, scaled per column."""
    wt = 1.0 / y
    xw, yw = x * wt[:, None], y * wt
    xs = xw / np.linalg.norm(xw, axis=0)
    cs = coef * np.linalg.norm(xw, axis=0)
    g = xs.T @ (xs @ cs - yw) / max(np.linalg.norm(yw), 1e-300)
    return float(max(0.0, -g.min(), np.abs(g[cs > 1e-12 * cs.max(initial=1.0)]).max(initial=0.0)))


def test_nonneg_lstsq_is_an_exact_nnls():
    """The old active set dropped every negative coefficient at once and never re-added one: 277 of 3000
    such problems were suboptimal (weighted SSE up to 2.9x). Checked by the KKT conditions and by
    brute force over every support."""
    import itertools

    from lb.cost_model import nonneg_lstsq

    rng = np.random.default_rng(3)
    for _ in range(600):
        n, k = int(rng.integers(4, 9)), int(rng.integers(1, 5))
        x = np.c_[np.ones(n), rng.uniform(0, 100, (n, k - 1))]
        y = rng.uniform(0.01, 1, n)
        coef, _ = nonneg_lstsq(x, y)
        assert (coef >= 0).all()
        assert _kkt_gap(x, y, coef) < 1e-7, (x.tolist(), y.tolist(), coef)
        wt = 1.0 / y
        xw, yw = x * wt[:, None], y * wt
        sse = ((xw @ coef - yw) ** 2).sum()
        for r in range(1, k + 1):
            for cols in itertools.combinations(range(k), r):
                cand = np.zeros(k)
                cand[list(cols)] = np.clip(np.linalg.lstsq(xw[:, list(cols)], yw, rcond=None)[0], 0, None)
                assert sse <= ((xw @ cand - yw) ** 2).sum() * (1 + 1e-9) + 1e-15
    with pytest.raises(LBInputError, match="every y > 0"):
        nonneg_lstsq(np.ones((3, 1)), np.array([1.0, 0.0, 1.0]))


def test_fit_cost_model_reports_timings_it_cannot_fit_in_one_line(monkeypatch, tmp_path, capsys):
    """A timing the fit refuses (here every one 0 s) ends ``tools/fit_cost_model.py`` with exit
    code 1 and one line naming the cause, and writes nothing; before, a traceback."""
    pytest.importorskip("torch")
    from tools import fit_cost_model as tool

    class Target:  # no model to time: the timings come from the patched timed_min
        kv_bytes_per_token = 2
        def __init__(self, *_): pass  # noqa: E301,E704
        def prepare_prefill(self, *_): pass  # noqa: E301,E704
        def prepare_decode(self, *_): pass  # noqa: E301,E704
        def meta(self): return {}  # noqa: E301,E704

    monkeypatch.setattr(tool, "ToyStack", Target)
    monkeypatch.setattr(tool, "timed_min", lambda points, *_: [0.0] * len(points))
    out = tmp_path / "model.json"
    assert tool.main(["--target", "toy", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("fit_cost_model: cannot fit these timings") and "0 s" in err[-1], err[-1]
    assert "Traceback" not in "\n".join(err) and not out.exists()
