"""The deadline-ordered kvstack policy (pick_next, background service, calibration), the simulator's
wrong-cost-model knobs (bias, noise), its early stop and per-request trace, and the capacity search."""

from __future__ import annotations

import math

import pytest

from lb.cost_model import CostModels, DecodeCostModel, PrefillCostModel, TransferModel
from lb.prefill import yielding_queue_seconds
from lb.registry import get_policy
from lb.sim import SimConfig, TraceRequest, simulate
from lb.types import LBInputError, PrefillInstance, QueuedPrefill, RouteRequest

# 1 ms per prompt token, nothing else: a prefill of n uncached tokens takes n ms
MODELS = CostModels(PrefillCostModel(0.0, 1e-3, 0.0), DecodeCostModel(1e-3, 1e-8, 1e-4), TransferModel(1024.0))


def q(tokens: int, deadline: float | None = None, rest: float = 1.0) -> QueuedPrefill:
    return QueuedPrefill(tokens, 0, 0.0, rest, deadline_s=deadline)


def req(tokens: int, slo_ms: float | None, now: float | None = 0.0) -> RouteRequest:
    return RouteRequest(tokens, 0, ttft_slo_ms=slo_ms, now_s=now)


# ----------------------------------------------------------------------------- pick_next
def test_pick_next_takes_the_earliest_deadline_that_can_still_be_met():
    p = get_policy("kvstack", MODELS)
    # at t=10: the oldest (2 s of work, due at 11) can not make it; the third is due before the second
    k, why = p.pick_next([q(2000, 11.0), q(1000, 30.0), q(1000, 20.0)], 10.0)
    assert k == 2 and "earliest deadline" in why and "yield" in why
    assert p.pick_next([q(1000, 30.0), q(1000, 20.0)], 10.0)[0] == 1
    k, why = p.pick_next([q(500, 12.0), q(1000, None)], 10.0)
    assert k == 0 and "oldest" in why
    assert p.pick_next([q(5000, 11.0), q(1000, None)], 10.0)[0] == 1  # no deadline: always in time


def test_pick_next_runs_the_oldest_when_none_can_meet_its_slo():
    k, why = get_policy("kvstack", MODELS).pick_next([q(3000, 11.0), q(3000, 12.0)], 10.0)
    assert k == 0 and why.startswith("background:")
    with pytest.raises(LBInputError):
        get_policy("kvstack", MODELS).pick_next([], 0.0)


def test_requests_that_can_not_meet_their_slo_yield_in_the_queue_estimate():
    inst = PrefillInstance(0, (q(1000, rest=0.5), q(4000, 3.0), q(1000, 60.0)))
    on_time, backlog = yielding_queue_seconds(inst, MODELS, 0.0)
    assert on_time == pytest.approx(1.5) and backlog == pytest.approx(5.5)  # the 4 s one, due at 3 s, yields


# ----------------------------------------------------------------------------- choose: on time, background, reject
def test_kvstack_admits_what_mooncake_rejects_when_the_blocker_can_not_make_it_anyway():
    # instance 0: a 10 s request already late (due at 1 s) queued; a new 1 s request with a 3 s SLO is on
    # time there behind nothing that can still meet its SLO: FIFO (Mooncake) sees 10 s of queue and rejects
    insts = [PrefillInstance(0, (q(10_000, 1.0),))]
    d = get_policy("kvstack", MODELS).choose(req(1000, 3000), insts)
    assert d.chosen == 0 and d.reason.startswith("lowest ttft+work")
    assert get_policy("mooncake", MODELS).choose(req(1000, 3000), insts).rejected


def test_a_request_no_instance_can_serve_in_time_goes_to_the_background_or_is_rejected_with_why():
    short = [PrefillInstance(0), PrefillInstance(1, (q(500, 100.0),))]
    d = get_policy("kvstack", MODELS).choose(req(4000, 1000), short)  # 4 s of work, 1 s SLO: late anywhere
    assert d.chosen == 0 and d.reason.startswith("background: TTFT SLO 1000 ms not met by any of 2")
    assert "next turn" in d.reason
    long = [PrefillInstance(0, (q(3000, 100.0),))]  # its backlog (3 s) is over the SLO, its work (4 s) too
    d = get_policy("kvstack", MODELS).choose(req(4000, 1000), long)
    assert d.rejected and "TTFT SLO 1000 ms not met" in d.reason and "background backlog 3000 ms" in d.reason
    assert get_policy("kvstack", MODELS, serve_unavoidable=False).choose(req(4000, 1000), short).rejected
    d = get_policy("kvstack", MODELS).choose(req(200, 1000), long)  # late behind 3 s, but only 0.2 s of work
    assert d.chosen == 0 and d.reason.startswith("background:")


def test_without_a_clock_the_policy_falls_back_to_the_fifo_queue():
    insts = [PrefillInstance(0, (q(10_000, 1.0),))]
    d = get_policy("kvstack", MODELS).choose(req(1000, 3000, now=None), insts)
    assert d.rejected  # deadlines can not be judged: the 10 s ahead count in full


# ----------------------------------------------------------------------------- calibration
def test_observed_service_times_calibrate_every_estimate():
    p = get_policy("kvstack", MODELS)
    before = p.choose(req(1000, None), [PrefillInstance(0)]).estimates[0]
    for _ in range(200):
        p.observe(0, 1.0, 1.3)
    assert p.scale == pytest.approx(1.3, rel=1e-3)
    d = p.choose(req(1000, None), [PrefillInstance(0)])
    assert d.estimates[0] == pytest.approx(1.3 * before, rel=1e-3) and "cost model x1.30" in d.reason
    for bad in ((0.0, 1.0), (1.0, -1.0), (math.nan, 1.0), (1.0, math.inf)):
        p.observe(0, *bad)
    assert p.scale == pytest.approx(1.3, rel=1e-3)  # nothing measured: nothing learnt
    for _ in range(500):
        p.observe(0, 1.0, 100.0)
    assert p.scale == pytest.approx(4.0)  # never beyond 4x
    with pytest.raises(LBInputError):
        get_policy("kvstack", MODELS, calibration_rate=1.5)


# ----------------------------------------------------------------------------- the simulator
def _spaced(n: int, gap_ms: float = 1000.0, tokens: int = 1000) -> list[TraceRequest]:
    return [TraceRequest(i * gap_ms, tokens, 0, ()) for i in range(n)]


def test_bias_scales_every_prefill_and_the_policies_do_not_know():
    cfg = SimConfig(prefill_instances=1, decode_instances=1, ttft_slo_ms=None)
    exact = simulate(_spaced(3, 10_000), get_policy("mooncake", MODELS), cfg, models=MODELS)
    slow = simulate(_spaced(3, 10_000), get_policy("mooncake", MODELS), SimConfig(
        prefill_instances=1, decode_instances=1, ttft_slo_ms=None, service_bias=1.3), models=MODELS)
    assert exact.ttft_s == pytest.approx((1.0,) * 3) and slow.ttft_s == pytest.approx((1.3,) * 3)
    with pytest.raises(LBInputError):
        SimConfig(service_bias=0.0)


def test_kvstack_learns_the_bias_that_mooncake_ignores():
    # 1 s prefills (as modelled) every 1.2 s on one instance, SLO 3 s, actual times 1.3x the model: Mooncake
    # admits by its model and its FIFO queue runs late; kvstack learns the 1.3 and lets the late ones yield
    cfg = SimConfig(prefill_instances=1, decode_instances=1, ttft_slo_ms=3000.0, service_bias=1.3)
    reqs = _spaced(60, 1200.0)
    moon = simulate(reqs, get_policy("mooncake", MODELS), cfg, models=MODELS)
    ours = simulate(reqs, get_policy("kvstack", MODELS), cfg, models=MODELS)
    assert ours.slo_attainment > moon.slo_attainment + 0.2


def test_a_run_stops_once_more_misses_than_allowed_are_known():
    cfg = SimConfig(prefill_instances=1, decode_instances=1, ttft_slo_ms=500.0, admission=False,
                    stop_after_misses=3)
    r = simulate(_spaced(50, 100.0), get_policy("round_robin", MODELS), cfg, models=MODELS)
    assert r.stopped_early and r.arrived < 50 and r.to_dict()["stopped_early"] is True
    assert r.slo_attainment < 0.9
    full = simulate(_spaced(50, 100.0), get_policy("round_robin", MODELS),
                    SimConfig(prefill_instances=1, decode_instances=1, ttft_slo_ms=500.0, admission=False),
                    models=MODELS)
    assert not full.stopped_early and full.arrived == 50


def test_each_request_keeps_the_reasons_of_its_decisions():
    cfg = SimConfig(prefill_instances=2, decode_instances=1, ttft_slo_ms=1500.0, keep_trace=True)
    r = simulate(_spaced(6, 100.0) + [TraceRequest(700.0, 9000, 0, ())], get_policy("kvstack", MODELS), cfg,
                 models=MODELS)
    assert set(r.trace) == set(range(7))
    first = r.trace[0]
    assert first[0].startswith("route: lowest ttft+work") and first[1].startswith("start: ")
    assert first[2].startswith("prefill done: TTFT 1.000 s")
    assert r.trace[6][0].startswith(("route: background: TTFT SLO 1500 ms", "route: TTFT SLO 1500 ms"))
    off = simulate(_spaced(2), get_policy("kvstack", MODELS), SimConfig(prefill_instances=1, decode_instances=1),
                   models=MODELS)
    assert off.trace == {}


def test_ttft_over_all_requests_counts_the_unserved_as_infinite():
    cfg = SimConfig(prefill_instances=1, decode_instances=1, ttft_slo_ms=1500.0)
    r = simulate(_spaced(10, 100.0), get_policy("mooncake", MODELS), cfg, models=MODELS)
    assert r.served == 2 and r.rejected == 8
    assert r.ttft_all(20) == max(r.ttft_s) <= 1.5 and r.ttft_all(10) == min(r.ttft_s)
    assert r.ttft_all(21) == r.ttft_all(50) == math.inf and r.pct("ttft", 50) <= 1.5  # served only: not inf


# ----------------------------------------------------------------------------- capacity search
def test_capacity_is_the_highest_load_where_nine_in_ten_meet_the_slos():
    from tools import replay_trace

    # 1 s prefills arriving every second on one instance, SLO 3 s: fine up to speedup 1, then the queue grows
    reqs = _spaced(40)
    cfg = SimConfig(prefill_instances=1, decode_instances=1, ttft_slo_ms=3000.0, admission=False)
    cap = replay_trace.search_capacity(reqs, "round_robin", cfg, MODELS, replay_trace.Progress(True), rel_tol=0.02)
    assert cap.bracketed and 1.0 <= cap.speedup < 1.2
    passed = [h for h in cap.history if h["slo_attainment"] >= 0.9]
    failed = [h for h in cap.history if h["slo_attainment"] < 0.9]
    assert max(h["speedup"] for h in passed) == cap.speedup and min(h["speedup"] for h in failed) > cap.speedup
    assert min(h["speedup"] for h in failed) <= cap.speedup * 1.02 + 1e-9
    assert all(h["stopped_early"] for h in failed if h["speedup"] >= 2)  # overloaded runs end at 5 misses
    assert all(h["ttft_all_p90_s"] is not None for h in passed)
    none = replay_trace.search_capacity(reqs, "round_robin", SimConfig(prefill_instances=1, decode_instances=1,
                                                                       ttft_slo_ms=500.0),
                                        MODELS, replay_trace.Progress(True), iters=4)
    assert none.speedup is None and not none.bracketed and len(none.history) == 4


def test_replay_capacity_mode_prints_capacities_with_ratios_and_compares_at_the_best_baselines(tmp_path, capsys):
    import json

    from tools import replay_trace

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 1000, "input_length": 1000, "output_length": 0,
                                         "hash_ids": [i, i + 1000]}) + "\n" for i in range(30)))
    out = tmp_path / "o"
    assert replay_trace.main(["--trace", str(trace), "--policies", "round_robin,mooncake,kvstack", "--capacity",
                              "--prefill-instances", "1", "--ttft-slo-ms", "3000", "--quiet", "--bias", "1.3",
                              "--out", str(out), "--capacity-iters", "6", "--capacity-start", "kvstack=4"]) == 0
    text = capsys.readouterr().out
    assert "== capacity:" in text and "vs best" in text and "bias 1.3" in text
    res = json.loads((out / "results.json").read_text())
    cap = res["capacity"]
    assert cap["best_baseline"] in ("round_robin", "mooncake")
    assert res["config"]["speedup"] == cap["compared_at_speedup"] == cap["by_policy"][cap["best_baseline"]]["speedup"]
    assert cap["ratio_vs_best"][cap["best_baseline"]] == 1.0
    assert cap["by_policy"]["kvstack"]["history"][0]["speedup"] == 4.0  # --capacity-start
    assert cap["by_policy"]["mooncake"]["history"][0]["speedup"] == 0.5  # --speedup's default


def test_replay_explain_prints_why_requests_missed(tmp_path, capsys):
    import json

    from tools import replay_trace

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 100, "input_length": 8000, "output_length": 0,
                                         "hash_ids": list(range(100 * i, 100 * i + 16))}) + "\n" for i in range(10)))
    assert replay_trace.main(["--trace", str(trace), "--policies", "mooncake,kvstack", "--prefill-instances", "1",
                              "--ttft-slo-ms", "1500", "--speedup", "1", "--explain", "1", "--quiet"]) == 0
    text = capsys.readouterr().out
    for name in ("mooncake", "kvstack"):
        assert f"-- {name}: requests that missed the TTFT SLO, and why --" in text
    assert "route: TTFT SLO 1500 ms not met" in text
