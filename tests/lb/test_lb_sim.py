"""Trace replay: exact hit ratios on known traces, the LRU oracle vs a plain LRU, the replay tool end to end."""

from __future__ import annotations

import json
import sys
from collections import OrderedDict
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from lb.cost_model import CostModels, DecodeCostModel, PrefillCostModel, TransferModel
from lb.registry import POLICIES, get_policy
from lb.sim import LRU, SimConfig, TraceRequest, parse_trace, prefix_hits_lru, reference_hit_ratios, simulate
from lb.types import LBInputError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

MODELS = CostModels(PrefillCostModel(1e-3, 1e-5, 0.0), DecodeCostModel(1e-3, 1e-8, 1e-4), TransferModel(1024.0))


def plain_lru_prefix_hits(reqs, capacity):
    """An independent LRU (OrderedDict) for the oracle: prefix hits, then touch/insert every block."""
    cache: OrderedDict = OrderedDict()
    hits = 0
    for r in sorted(reqs, key=lambda r: r.timestamp_ms):
        n = 0
        while n < len(r.hash_ids) and r.hash_ids[n] in cache:
            n += 1
        hits += n
        for h in r.hash_ids:
            cache[h] = True
            cache.move_to_end(h)
            if capacity is not None:
                while len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


def spaced(blocks_lists, gap_ms=1e7):
    """Requests far apart in time: each finishes before the next arrives."""
    return [TraceRequest(i * gap_ms, 512 * len(b), 4, tuple(b)) for i, b in enumerate(blocks_lists)]


def test_known_answer_hit_ratios():
    reqs = spaced([[1, 2, 3], [1, 2, 4], [1, 5], [9, 2]])
    # prefix hits: 0 + 2 + 1 + 0 (block 2 of the last request does not count: block 9 missed) = 3 of 10
    assert reference_hit_ratios(reqs, None) == {"ideal": 0.3, "lru_oracle": 0.3}
    # capacity 2: after A {2,3}; B misses block 1 -> 0, then {2,4}... -> no hits at all
    assert prefix_hits_lru(reqs, 2) == 0
    cfg = SimConfig(prefill_instances=1, decode_instances=1, device_capacity_blocks=0, host_capacity_blocks=0,
                    store_capacity_blocks=None, ttft_slo_ms=None)
    for name in POLICIES:
        r = simulate(reqs, get_policy(name, MODELS), cfg, name=name, models=MODELS)
        assert r.served == 4 and r.hit_ratio == pytest.approx(0.3), name
        assert r.hit_tiers["store"] == pytest.approx(0.3)
    # the same hits come from the device cache when it is big enough, none from the store
    cfg2 = SimConfig(prefill_instances=1, decode_instances=1, device_capacity_blocks=100, host_capacity_blocks=0,
                     store_capacity_blocks=0, ttft_slo_ms=None)
    r = simulate(reqs, get_policy("kvstack", MODELS), cfg2, models=MODELS)
    assert r.hit_tiers == {"device": pytest.approx(0.3), "host": 0.0, "store": 0.0}
    # device evictions spill to host: device of 1 block, host of 100
    cfg3 = SimConfig(prefill_instances=1, decode_instances=1, device_capacity_blocks=1, host_capacity_blocks=100,
                     store_capacity_blocks=0, ttft_slo_ms=None)
    r = simulate(reqs, get_policy("kvstack", MODELS), cfg3, models=MODELS)
    assert r.hit_ratio == pytest.approx(0.3) and r.hit_tiers["host"] > 0


trace_st = st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=6), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(trace_st, st.one_of(st.none(), st.integers(0, 15)))
def test_lru_oracle_matches_plain_lru(blocks, cap):
    reqs = spaced(blocks)
    assert prefix_hits_lru(reqs, cap) == plain_lru_prefix_hits(reqs, cap)


@settings(max_examples=30, deadline=None)
@given(trace_st, st.integers(0, 15))
def test_sequential_sim_equals_oracle(blocks, cap):
    """With no device/host tier and requests one at a time, the simulated store IS the LRU oracle."""
    reqs = spaced(blocks)
    total = sum(len(b) for b in blocks)
    cfg = SimConfig(prefill_instances=2, decode_instances=1, device_capacity_blocks=0, host_capacity_blocks=0,
                    store_capacity_blocks=cap, ttft_slo_ms=None)
    r = simulate(reqs, get_policy("least_loaded", MODELS), cfg, models=MODELS)
    assert r.hit_ratio * total == pytest.approx(plain_lru_prefix_hits(reqs, cap))


def test_lru_basics():
    c = LRU(2)
    assert c.insert(1) == [] and c.insert(2) == []
    c.touch(1)
    assert c.insert(3) == [2] and 1 in c and 2 not in c
    assert LRU(0).insert(5) == [5] and len(LRU(None)) == 0
    with pytest.raises(LBInputError):
        LRU(-1)


def test_parse_trace_errors_name_the_line():
    good = json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]})
    assert len(parse_trace([good, "", good], limit=1)) == 1
    with pytest.raises(LBInputError, match="line 2"):
        parse_trace([good, '{"timestamp": 1}'])


def test_busy_trace_ttft_and_load():
    """Concurrent arrivals: everyone is served, TTFT >= service time, work spread over instances."""
    reqs = [TraceRequest(i * 10.0, 4096, 8, tuple(range(i * 100, i * 100 + 8))) for i in range(40)]
    cfg = SimConfig(prefill_instances=4, decode_instances=2, ttft_slo_ms=None)
    for name in POLICIES:
        r = simulate(reqs, get_policy(name, MODELS), cfg, name=name, models=MODELS)
        assert r.served == 40 and r.rejected == 0
        assert min(r.ttft_s) >= MODELS.prefill.predict(4096, 0) - 1e-9
        assert len(r.tbt_s) == 40 and min(r.tbt_s) > 0
        assert r.imbalance < 1.5, (name, r.busy_s)


def test_admission_rejections_are_counted():
    reqs = [TraceRequest(0.0, 4096, 8, tuple(range(i * 10, i * 10 + 8))) for i in range(20)]
    cfg = SimConfig(prefill_instances=1, decode_instances=1, ttft_slo_ms=100.0)
    r = simulate(reqs, get_policy("mooncake", MODELS), cfg, models=MODELS)
    assert r.rejected > 0 and r.served + r.rejected == 20 and r.reject_reasons
    assert r.ttft_attainment <= r.served / 20


def test_replay_tool_end_to_end(tmp_path, capsys):
    import replay_trace

    trace = tmp_path / "t.jsonl"
    lines = [json.dumps({"timestamp": i * 200, "input_length": 2048 + 512 * (i % 3), "output_length": 5,
                         "hash_ids": list(range(i % 4, i % 4 + 4 + i % 3))}) for i in range(60)]
    trace.write_text("\n".join(lines))
    out = tmp_path / "out"
    rc = replay_trace.main(["--trace", str(trace), "--policies", "least_loaded,mooncake,kvstack",
                            "--decode-policy", "least_kv",
                            "--prefill-instances", "2", "--store-capacity-blocks", "4,inf", "--limit", "50",
                            "--find-load", "--find-load-iters", "3", "--ttft-slo-ms", "2000", "--out", str(out),
                            "--quiet"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["requests"] == 50 and set(res["sweep"]) == {"4", "inf"}
    assert res["find_load"]["speedup"] > 0
    for n in ("least_loaded", "mooncake", "kvstack"):
        assert 0 <= res["sweep"]["inf"]["results"][n]["hit_ratio"] <= res["sweep"]["inf"]["refs"]["ideal"] + 1e-9
    text = capsys.readouterr().out
    assert "kvstack" in text and "p90/best" in text
    pytest.importorskip("matplotlib")
    assert (out / "ttft_cdf.png").exists() and (out / "hit_ratio_vs_store_capacity.png").exists()


@pytest.mark.parametrize("field,value", [
    ("timestamp", float("nan")), ("timestamp", float("inf")), ("timestamp", -1), ("timestamp", True),
    ("timestamp", "0"), ("hash_ids", "abc"), ("hash_ids", [1.0, 2]), ("hash_ids", [1.5]), ("hash_ids", [[1, 2], [3]]),
    ("hash_ids", [True]), ("hash_ids", [None]), ("hash_ids", [""]), ("input_length", True), ("input_length", 1000.7),
    ("input_length", 1000.0), ("input_length", 10**18), ("input_length", -5), ("input_length", 0),
    ("output_length", -1), ("output_length", 2.5), ("output_length", None),
])
def test_parse_trace_refuses_values_no_trace_can_mean(field, value):
    """Non-finite, non-integer (bools too) and out-of-range values: LBInputError naming the line."""
    good = {"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]}
    bad = json.dumps({**good, field: value})  # json writes nan/inf as NaN/Infinity, which json.loads reads
    with pytest.raises(LBInputError, match=f"line 3 .*{field}"):
        parse_trace([json.dumps(good), "", bad])


def test_parse_trace_warns_once_when_hash_ids_and_input_length_disagree(caplog):
    """ceil(input_length / block) == len(hash_ids) is consistent (the last block may be partial);
    anything else is kept, and counted in one warning."""
    def line(n: int, blocks: int) -> str:
        return json.dumps({"timestamp": 0, "input_length": n, "output_length": 1, "hash_ids": list(range(blocks))})

    with caplog.at_level("WARNING", logger="lb.sim"):
        reqs = parse_trace([line(1024, 2), line(1025, 3), line(1, 1), line(1024, 3), line(5000, 2), line(10, 0)])
    assert len(reqs) == 6
    warnings = [r for r in caplog.records if r.name == "lb.sim"]
    assert len(warnings) == 1 and "3 of 6" in warnings[0].getMessage() and "line 4" in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level("WARNING", logger="lb.sim"):
        assert len(parse_trace([line(32, 2)], block_tokens=16)) == 1
    assert not caplog.records
    with pytest.raises(LBInputError, match="block_tokens"):
        parse_trace([line(32, 2)], block_tokens=0)


def test_parse_trace_takes_any_integer_or_string_block_hashes():
    """Hash ids are opaque and only compared: signed 64-bit (and larger) integers and hex
    strings are ids as well as Mooncake's 0, 1, 2, ... (a converted trace may use any)."""
    ids = [-1, 2**64, "9f86d081884c7d65", 7]
    got = parse_trace([json.dumps({"timestamp": 0, "input_length": 2048, "output_length": 1, "hash_ids": ids})])
    assert list(got[0].hash_ids) == ids


def test_a_wall_bound_that_trips_before_the_first_event_gives_an_empty_truncated_result():
    """max_wall_s of 0: the loop stops before handling any event (it raised UnboundLocalError)."""
    reqs = parse_trace([json.dumps({"timestamp": i, "input_length": 512, "output_length": 1, "hash_ids": [i]})
                        for i in range(5)])
    cfg = SimConfig(prefill_instances=1, decode_instances=1, max_wall_s=0.0)
    res = simulate(reqs, get_policy("round_robin"), cfg)
    assert res.truncated and res.served == 0 and res.sim_end_s == 0.0
