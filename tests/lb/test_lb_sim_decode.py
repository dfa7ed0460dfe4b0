"""lb.sim's decode side: requests no decode instance could ever hold are refused, never block the line."""

from __future__ import annotations

import pytest

from lb.cost_model import CostModels, DecodeCostModel, PrefillCostModel, TransferModel
from lb.registry import get_policy
from lb.sim import OVER_DECODE_KV, REFUSED_BY_EMPTY_DECODE, SimConfig, TraceRequest, simulate
from lb.decode import request_kv_bytes
from lb.types import Decision, DecodeRequest, LBInputError

KV_PER_TOKEN = 1024.0
MODELS = CostModels(PrefillCostModel(1e-3, 1e-5, 0.0), DecodeCostModel(1e-3, 1e-8, 1e-4),
                    TransferModel(KV_PER_TOKEN))
CAP_TOKENS = 10_000  # one decode instance holds 10,000 tokens of KV
CFG = SimConfig(prefill_instances=2, decode_instances=2, decode_kv_capacity_bytes=int(CAP_TOKENS * KV_PER_TOKEN),
                ttft_slo_ms=None)


def _small(t_ms: float, i: int) -> TraceRequest:
    return TraceRequest(t_ms, 1024, 50, (1000 + 2 * i, 1001 + 2 * i))


def test_a_request_over_the_decode_kv_capacity_is_refused_and_blocks_no_one():
    """Prompt + output over what an empty decode instance holds: refused at arrival (as max_model_len), with
    its reason, before any prefill; the requests behind it are all decoded. It used to wait in the decode
    queue forever, and every request behind it with it."""
    big = TraceRequest(0.0, 2 * CAP_TOKENS, 10, tuple(range(20)))
    reqs = [big] + [_small(1.0 + i, i) for i in range(6)]
    for decode in ("kvstack", "round_robin", "least_kv"):
        r = simulate(reqs, get_policy("round_robin", MODELS), CFG, models=MODELS,
                     decode_policy=get_policy(decode, MODELS, kind="decode"))
        assert (r.served, r.rejected, r.reject_reasons) == (6, 1, {OVER_DECODE_KV: 1}), decode
        assert len(r.tbt_s) == 6 and r.slo_attainment == 6 / 7, decode
        assert 0 not in r.cached_tokens  # refused before its prefill: it cost none
        assert r.to_dict()["reject_reasons"] == {OVER_DECODE_KV: 1}


def test_a_request_that_exactly_fills_an_empty_instance_is_served():
    """The bound is the capacity itself: a request that needs all of it fits an empty instance."""
    exact = TraceRequest(0.0, CAP_TOKENS - 10, 10, (1,))
    r = simulate([exact], get_policy("round_robin", MODELS), CFG, models=MODELS,
                 decode_policy=get_policy("round_robin", MODELS, kind="decode"))
    assert (r.served, r.rejected, len(r.tbt_s)) == (1, 0, 1)


class _RefusesOne:
    """kvstack, except that it refuses any request of ``context`` tokens (with room or not): a policy that
    refuses on an empty pool for a reason of its own, within its memory limit."""

    def __init__(self, context: int) -> None:
        self.inner, self.context = get_policy("kvstack", MODELS, kind="decode"), context

    def kv_limit_bytes(self, capacity_bytes: int) -> float:
        return self.inner.kv_limit_bytes(capacity_bytes)

    def choose(self, req, instances):
        if req.context_tokens == self.context:
            return Decision(None, "refused by the test")
        return self.inner.choose(req, instances)


def test_a_request_the_decode_policy_refuses_on_an_empty_pool_leaves_the_line():
    """Within the policy's memory limit but refused even so: no finish can ever change that, so once every
    decode instance is empty it is refused (not served: no TTFT sample) and the line moves on."""
    refused = TraceRequest(5.0, 777, 100, (1,))
    early = [TraceRequest(0.0, 1024, 2000, (1000 + i,)) for i in range(2)]  # decoding still: it waits for them
    late = [_small(6.0 + i, 10 + i) for i in range(4)]
    for admission in (True, False):
        cfg = SimConfig(prefill_instances=2, decode_instances=2, ttft_slo_ms=None, admission=admission,
                        decode_kv_capacity_bytes=CFG.decode_kv_capacity_bytes)
        r = simulate(early + [refused] + late, get_policy("round_robin", MODELS), cfg, models=MODELS,
                     decode_policy=_RefusesOne(777))
        assert (r.served, r.rejected, r.reject_reasons) == (6, 1, {REFUSED_BY_EMPTY_DECODE: 1}), admission
        assert len(r.ttft_s) == 6 and len(r.tbt_s) == 6 and 2 in r.cached_tokens, admission  # it was prefilled


def test_replay_table_says_how_many_could_never_be_decoded():
    from tools import replay_trace

    big = TraceRequest(0.0, 2 * CAP_TOKENS, 10, tuple(range(20)))
    r = simulate([big, _small(1.0, 0)], get_policy("round_robin", MODELS), CFG, name="round_robin", models=MODELS)
    table = replay_trace.format_table({"round_robin": r}, {"ideal": 0.0, "lru_oracle": 0.0})
    assert "round_robin: 1 of 1 rejected could never be decoded" in table


def test_the_wait_for_a_decode_slot_counts_in_tbt_and_its_slo():
    """Two requests whose KV fits a decode instance only one at a time: the second gets its first token
    with its prefill, then waits the first's whole decode before its next. Its TBT counts that wait
    (from prefill end), so it misses a TBT SLO the decode pace alone meets; counted from the join,
    it would look as if it had never waited."""
    reqs = [TraceRequest(0.0, 6000, 100, (1,)), TraceRequest(0.0, 6000, 100, (2,))]
    cfg = SimConfig(prefill_instances=2, decode_instances=1, decode_kv_capacity_bytes=CFG.decode_kv_capacity_bytes,
                    ttft_slo_ms=None, tbt_slo_ms=2.0)
    r = simulate(reqs, get_policy("round_robin", MODELS), cfg, models=MODELS,
                 decode_policy=get_policy("round_robin", MODELS, kind="decode"))
    pace = MODELS.decode.predict(6000, 1)  # one request in the batch at a time
    assert pace < 2e-3
    assert (r.served, r.rejected, len(r.tbt_s)) == (2, 0, 2)
    assert r.tbt_s[0] == pytest.approx(pace) and r.tbt_s[1] == pytest.approx(2 * pace)
    assert r.decode_wait_s[0] == 0.0 and r.decode_wait_s[1] == pytest.approx(100 * pace)
    assert r.ttft_s[0] == pytest.approx(r.ttft_s[1])  # the first token came with the prefill: no wait there
    assert r.slo_attainment == 0.5 and r.ttft_attainment == 1.0


def test_the_decode_slot_wait_is_written_with_the_other_latencies(tmp_path, capsys):
    """``decode_wait_s`` (the wait included in TBT) reaches ``to_dict``, so the replay's ``results.json``
    (which ``tools/bench_lb.py`` embeds) carries its p50/p90/p99 next to TTFT's and TBT's; null with no
    sample. It was computed but written nowhere."""
    import json

    from tools import replay_trace

    reqs = [TraceRequest(0.0, 6000, 100, (1,)), TraceRequest(0.0, 6000, 100, (2,))]
    cfg = SimConfig(prefill_instances=2, decode_instances=1, decode_kv_capacity_bytes=CFG.decode_kv_capacity_bytes,
                    ttft_slo_ms=None)
    r = simulate(reqs, get_policy("round_robin", MODELS), cfg, models=MODELS,
                 decode_policy=get_policy("round_robin", MODELS, kind="decode"))
    d = r.to_dict()
    wait = 100 * MODELS.decode.predict(6000, 1)  # the second waits the first's whole decode
    assert d["decode_wait_p50_s"] == pytest.approx(wait / 2)
    assert d["decode_wait_p90_s"] == pytest.approx(0.9 * wait) and d["decode_wait_p99_s"] == pytest.approx(0.99 * wait)
    assert r.pct("decode_wait", 99) == d["decode_wait_p99_s"]
    none = simulate([TraceRequest(0.0, 100, 0, (1,))], get_policy("round_robin", MODELS), cfg, models=MODELS).to_dict()
    assert none["decode_wait_p50_s"] is None and none["decode_wait_p99_s"] is None  # no TBT sample
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [i]})
                             + "\n" for i in range(3)))
    assert replay_trace.main(["--trace", str(trace), "--policies", "round_robin", "--quiet",
                              "--store-capacity-blocks", "10", "--out", str(tmp_path / "o")]) == 0
    res = json.loads((tmp_path / "o" / "results.json").read_text())["sweep"]["10"]["results"]["round_robin"]
    assert {"decode_wait_p50_s", "decode_wait_p90_s", "decode_wait_p99_s"} <= res.keys()
    assert res["decode_wait_p50_s"] >= 0.0


def test_a_waiting_request_that_fits_is_placed_even_when_the_head_of_the_line_does_not():
    """The decode line is FIFO among the waiting and work-conserving: at a decode finish every waiting request
    a batch now takes is placed, in line order, not only a prefix of the line. Here B (7000 tokens of KV)
    waits ahead of C (2500); A2's finish frees 4000 of 10,000: B still does not fit, C does and is placed
    then. It used to wait behind B until A1's long decode ended (3 s instead of 0.2 s)."""
    a1, a2 = TraceRequest(0.0, 1000, 3000, (1,)), TraceRequest(0.0, 3800, 200, (2,))  # 4000 tokens each
    b, c = TraceRequest(40.0, 6900, 100, (3,)), TraceRequest(90.0, 2400, 100, (4,))  # ready in this order
    cfg = SimConfig(prefill_instances=4, decode_instances=1, decode_kv_capacity_bytes=CFG.decode_kv_capacity_bytes,
                    ttft_slo_ms=None, tbt_slo_ms=None)
    for decode in ("kvstack", "round_robin", "least_kv"):
        r = simulate([a1, a2, b, c], get_policy("round_robin", MODELS), cfg, models=MODELS,
                     decode_policy=get_policy(decode, MODELS, kind="decode"))
        assert (r.served, r.rejected, len(r.tbt_s)) == (4, 0, 4), decode
        a2_end = 0.039 + 200 * MODELS.decode.predict(4000 + 3800, 2)  # A2's prefill ends at ~39 ms
        waits = sorted(r.decode_wait_s)  # A1, A2: none; C: until A2's finish; B: until A1's
        assert waits[:2] == [0.0, 0.0] and waits[2] < a2_end and waits[3] > 3.0, (decode, waits)
        assert waits[2] == pytest.approx(a2_end - (0.09 + MODELS.prefill.predict(2400, 0)), rel=0.05), decode


def test_a_request_with_no_output_over_the_decode_kv_capacity_is_refused_like_any_other():
    """The over-capacity rule is uniform: a prompt alone over what an empty decode instance holds is refused at
    arrival, its reason OVER_DECODE_KV, whatever its output length (the entrypoint refuses prompt +
    max_new_tokens over max_model_len alike), with 0 output tokens too."""
    for out in (0, 10):
        big = TraceRequest(0.0, 2 * CAP_TOKENS, out, tuple(range(20)))
        r = simulate([big, _small(1.0, 0)], get_policy("round_robin", MODELS), CFG, models=MODELS)
        assert (r.served, r.rejected, r.reject_reasons) == (1, 1, {OVER_DECODE_KV: 1}), out
        assert 0 not in r.cached_tokens and r.slo_attainment == 0.5, out  # no prefill spent on it


@pytest.mark.parametrize("decode,limit_tokens",
                         [("kvstack", 9500), ("round_robin", CAP_TOKENS), ("least_kv", CAP_TOKENS)])
def test_the_arrival_check_and_placement_use_the_same_kv_limit(decode, limit_tokens):
    """A request is refused at arrival (OVER_DECODE_KV, no prefill) iff the decode policy would refuse it on an
    empty instance for memory: kvstack keeps 5 % headroom (9500 of 10,000 tokens here), the baselines none.
    One at the limit is served; one token over it is refused before its prefill. The arrival check used the
    raw capacity, so kvstack's 9501..10,000 passed it, cost a prefill, then were refused on an empty pool."""
    pol = get_policy(decode, MODELS, kind="decode")
    assert pol.kv_limit_bytes(CFG.decode_kv_capacity_bytes) == pytest.approx(limit_tokens * KV_PER_TOKEN)
    for tokens, served in ((limit_tokens, True), (limit_tokens + 1, False)):
        req = TraceRequest(0.0, tokens - 100, 100, (1,))
        r = simulate([req], get_policy("round_robin", MODELS), CFG, models=MODELS,
                     decode_policy=get_policy(decode, MODELS, kind="decode"))
        if served:
            assert (r.served, r.rejected, len(r.tbt_s)) == (1, 0, 1), (decode, tokens)
        else:
            assert (r.served, r.reject_reasons) == (0, {OVER_DECODE_KV: 1}), (decode, tokens)
            assert r.cached_tokens == {}, (decode, tokens)  # refused before its prefill


def test_a_decode_policy_without_a_kv_limit_is_refused_with_a_hint():
    class NoLimit:
        def choose(self, req, instances):
            return get_policy("round_robin", MODELS, kind="decode").choose(req, instances)

    with pytest.raises(LBInputError, match="kv_limit_bytes"):
        simulate([_small(0.0, 0)], get_policy("round_robin", MODELS), CFG, models=MODELS, decode_policy=NoLimit())


class _Recording:
    """A decode policy that records, at each call, the snapshot's KV in use next to the requests running there."""

    def __init__(self, models) -> None:
        self.inner, self.models, self.seen = get_policy("round_robin", models, kind="decode"), models, []

    def kv_limit_bytes(self, capacity_bytes: int) -> float:
        return self.inner.kv_limit_bytes(capacity_bytes)

    def choose(self, req, instances):
        inst = instances[0]
        self.seen.append((inst.kv_used_bytes, inst.running_requests, request_kv_bytes(req, self.models)))
        return self.inner.choose(req, instances)


def test_decode_kv_usage_is_the_figure_the_policy_checked():
    """At 1.5 bytes per token a request of 1101 tokens needs 1651.5 bytes, 1652 in whole bytes (rounded up). The
    simulator adds exactly that to an instance's usage, so the next snapshot shows what the policy reasoned
    about; three such requests (4956 bytes) do not fit 4954 bytes at once, the third waits. The simulator used
    to add int(1651.5) = 1651 per request: usage drifted below the checked figure and the third fit (an
    overcommit of the policy's own 4954.5 bytes)."""
    models = CostModels(MODELS.prefill, MODELS.decode, TransferModel(1.5))
    assert request_kv_bytes(DecodeRequest(101, 1000), models) == 1652
    cfg = SimConfig(prefill_instances=3, decode_instances=1, decode_kv_capacity_bytes=4954, ttft_slo_ms=None,
                    tbt_slo_ms=None)
    pol = _Recording(models)
    reqs = [TraceRequest(float(i), 101, 1000, (10 + i,)) for i in range(3)]
    r = simulate(reqs, get_policy("round_robin", models), cfg, models=models, decode_policy=pol)
    assert (r.served, r.rejected, len(r.tbt_s)) == (3, 0, 3)
    assert all(used == running * need for used, running, need in pol.seen), pol.seen
    assert max(running for _, running, _ in pol.seen) == 2  # the third waited for a finish
    assert sorted(r.decode_wait_s)[2] > 0.0
