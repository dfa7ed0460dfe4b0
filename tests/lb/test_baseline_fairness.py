"""The comparison of prefill routers is fair: the SGLang baseline's prefix tree takes a request
when it routes it (as sgl-router does), and every policy's capacity is searched from one start."""

from lb.baselines import SGLangCacheAware
from lb.cost_model import load_default
from lb.sim import SimConfig, TraceRequest, simulate
from tools import bench_lb


def test_sglang_baseline_matches_prefixes_it_routed_before_their_prefill_ends():
    """SGLang's cache-aware router inserts each request's prefix into its approximate tree for the chosen
    worker at routing time (sgl-router's ``policies/cache_aware.rs`` inserts right after the choice), so a
    second turn arriving while the first is still queued or prefilling matches that worker (ratio > 0.3)
    and goes there, reusing the shared prefix, not to the idle instance with the smallest cache."""
    m = load_default()
    a = TraceRequest(0.0, 16 * 512, 10, tuple(range(16)))  # ~4.6 s cold prefill under the committed model
    b = TraceRequest(100.0, 17 * 512, 10, tuple(range(17)))  # same 16 blocks + 1, arrives while A runs
    cfg = SimConfig(prefill_instances=2, decode_instances=1, ttft_slo_ms=None, keep_trace=True)
    res = simulate([a, b], SGLangCacheAware(m), cfg, name="sglang", models=m)
    assert res.cached_tokens[1] == 16 * 512, (res.trace[1], res.cached_tokens)


def test_every_policy_searches_its_capacity_from_one_start():
    """Attainment is not monotone in the load, so a capacity search's result depends on where it
    starts (on a longdoc trace under "slow", kvstack's from 13.45 landed on a passing island at
    4.76, from 1.0 on 2.18): the later conditions search every policy from one start, the lowest
    capacity any policy had under the first, never each from its own."""
    assert bench_lb.search_starts({"kvstack": 13.45, "least_loaded": 3.83, "mooncake": None}) == \
        {"kvstack": 3.83, "least_loaded": 3.83, "mooncake": 3.83}
    assert bench_lb.search_starts({"kvstack": None, "round_robin": None}) == {}
