"""Prefill / decode / VE policies: table-driven decision rules and hypothesis properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from lb.cost_model import CostModels, DecodeCostModel, PrefillCostModel, TransferModel
from lb.registry import BASELINES, DECODE_POLICIES, POLICIES, VE_POLICIES, get_policy
from lb.types import (
    DecodeInstance, DecodeRequest, LBInputError, PrefillInstance, PrefixHits, QueuedPrefill, RouteRequest,
    TierBandwidth, UnknownPolicyError, VEInstance, VERequest,
)

MODELS = CostModels(
    PrefillCostModel(const_s=0.0, per_token_s=1e-3, per_attn_pair_s=0.0),  # 1 ms per uncached token
    DecodeCostModel(const_s=1e-3, per_token_s=1e-7, per_request_s=1e-4),
    TransferModel(kv_bytes_per_token=1024.0),
)


def inst(i, queue=(), healthy=True, inflight=(), used=0):
    return PrefillInstance(i, tuple(QueuedPrefill(t) for t in queue), healthy=healthy,
                           inflight_blocks=frozenset(inflight), device_blocks_used=used)


def req(blocks=8, hits=None, slo=None, hashes=()):
    return RouteRequest(blocks * 512, blocks, hits or {}, tuple(hashes), ttft_slo_ms=slo)


# ---------------------------------------------------------------- registry
def test_registry_builds_every_policy():
    for name in POLICIES:
        assert hasattr(get_policy(name, MODELS), "choose")
    for name in DECODE_POLICIES:
        assert hasattr(get_policy(name, MODELS, kind="decode"), "choose")
    for name in VE_POLICIES:
        assert hasattr(get_policy(name, MODELS, kind="ve"), "choose")
    assert set(BASELINES) < set(POLICIES)


def test_unknown_policy_lists_names():
    with pytest.raises(UnknownPolicyError, match="known: .*kvstack.*mooncake"):
        get_policy("nope")
    with pytest.raises(ValueError, match="kind"):
        get_policy("kvstack", kind="nope")


def test_input_validation():
    with pytest.raises(LBInputError, match="covers 9 blocks"):
        RouteRequest(512 * 8, 8, {0: PrefixHits(9)})
    with pytest.raises(LBInputError, match="duplicate instance id"):
        get_policy("least_loaded").choose(req(), [inst(0), inst(0)])
    with pytest.raises(LBInputError):
        DecodeInstance(0, 0, 0)


@pytest.mark.parametrize("used,cap", [(1.5, 10**9), (0, 1e9)])
def test_decode_kv_bytes_are_whole_bytes(used, cap):
    """The unit of decode KV is the whole byte (lb.decode.request_kv_bytes rounds up): a fractional
    figure would drift from what the policy checked, so a snapshot refuses a non-integer."""
    with pytest.raises(LBInputError, match="kv_used_bytes must be an integer|kv_capacity_bytes must be an integer"):
        DecodeInstance(0, used, cap)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("make", [
    lambda: DecodeInstance(0, kv_used_bytes=NAN, kv_capacity_bytes=10**9),
    lambda: DecodeInstance(0, kv_used_bytes=0, kv_capacity_bytes=NAN),
    lambda: DecodeInstance(0, kv_used_bytes=0, kv_capacity_bytes=10**9, batch_tokens=NAN),
    lambda: DecodeInstance(0, kv_used_bytes=0, kv_capacity_bytes=10**9, running_requests=INF),
    lambda: VEInstance(0, queue_images=NAN),
    lambda: VEInstance(0, queue_images=-INF),
    lambda: QueuedPrefill(100, fetch_s=NAN),
    lambda: QueuedPrefill(NAN),
    lambda: QueuedPrefill(100, remaining_fraction=NAN),
    lambda: PrefixHits(NAN),
    lambda: TierBandwidth(host_bytes_per_s=NAN),
    lambda: TierBandwidth(store_latency_s=INF),
    lambda: RouteRequest(NAN, 1),
    lambda: RouteRequest(512, 1, ttft_slo_ms=NAN),
    lambda: DecodeRequest(100, 10, tbt_slo_ms=NAN),
    lambda: DecodeRequest(NAN, 10),
    lambda: VEInstance(0, queue_images="3"),
])
def test_non_finite_loads_are_refused(make):
    """NaN passes a bare ``< 0`` check and then wins every ``min``: refused at the snapshot."""
    with pytest.raises(LBInputError, match="finite|ms >= 0"):
        make()


def test_an_infinite_slo_means_no_slo():
    assert RouteRequest(512, 1, ttft_slo_ms=INF).ttft_slo_ms == INF
    assert DecodeRequest(100, 10, tbt_slo_ms=INF).tbt_slo_ms == INF


def test_a_nan_load_never_reaches_a_policy():
    with pytest.raises(LBInputError):
        get_policy("kvstack", MODELS, kind="decode").choose(
            DecodeRequest(1000, 10),
            [DecodeInstance(0, 10**8, 10**9), DecodeInstance(1, NAN, 10**9)])
    with pytest.raises(LBInputError):
        get_policy("kvstack", MODELS, kind="ve").choose(VERequest(("h",)), [VEInstance(0, 5), VEInstance(1, NAN)])
    with pytest.raises(LBInputError):
        get_policy("kvstack", MODELS).choose(req(), [inst(0, [100]), PrefillInstance(
            1, (QueuedPrefill(100, fetch_s=NAN),))])


@pytest.mark.parametrize("make", [
    lambda: get_policy("kvstack", MODELS, load_weight=NAN),
    lambda: get_policy("kvstack", MODELS, slack=INF),
    lambda: get_policy("dynamo", MODELS, overlap_weight=NAN),
    lambda: get_policy("kvstack", MODELS, kind="ve", seconds_per_image=NAN),
    lambda: PrefillCostModel(const_s=NAN),
    lambda: DecodeCostModel(per_token_s=NAN),
    lambda: TransferModel(kv_bytes_per_token=NAN),
    lambda: PrefillCostModel.fit([(100, 0, NAN), (200, 0, 1.0)]),
])
def test_non_finite_knobs_are_refused(make):
    with pytest.raises(LBInputError):
        make()


# ---------------------------------------------------------------- table-driven decisions
CASES = [
    # (policy, request, instances, expected choice)
    ("least_loaded", req(), [inst(0, [500]), inst(1, [100]), inst(2, [300])], 1),
    ("least_loaded", req(), [inst(0, [500]), inst(1, [100], healthy=False), inst(2, [300])], 2),
    # SGLang: good match wins despite load (balanced: max-min <= 64)
    ("sglang", req(8, {2: PrefixHits(4)}), [inst(0), inst(1, [1]), inst(2, [1, 1, 1])], 2),
    # SGLang: match ratio 1/8 <= 0.3 -> smallest cache (no block hashes: its tree is the device cache)
    ("sglang", req(8, {2: PrefixHits(1)}), [inst(0, used=50), inst(1, used=10), inst(2, used=90)], 1),
    # SGLang: imbalanced (100 vs 0 queued) -> shortest queue even with a perfect match elsewhere
    ("sglang", req(8, {0: PrefixHits(8)}), [inst(0, [1] * 100), inst(1), inst(2, [1] * 3)], 1),
    # Dynamo: 1 x uncached blocks + active blocks: inst0 8+0, inst1 2+1, inst2 8+0 -> 1
    ("dynamo", req(8, {1: PrefixHits(6)}), [inst(0), inst(1, [512]), inst(2)], 1),
    # Dynamo: a long queue outweighs the cache hit
    ("dynamo", req(8, {1: PrefixHits(6)}), [inst(0), inst(1, [512 * 20])], 0),
    # Mooncake: store hit (cheap fetch) beats recompute; both idle
    ("mooncake", req(8, {1: PrefixHits(0, 0, 8)}), [inst(0), inst(1)], 1),
    # Mooncake: queue of 10 s beats a 4 s saving
    ("mooncake", req(8, {1: PrefixHits(8)}), [inst(0), inst(1, [10_000])], 0),
    ("kvstack", req(8, {1: PrefixHits(0, 4)}), [inst(0), inst(1)], 1),
    # kvstack: blocks in flight on inst 1 count as device hits (Mooncake sees none)
    ("kvstack", req(8, {}, hashes=range(8)), [inst(0), inst(1, [100], inflight=range(8))], 1),
    ("mooncake", req(8, {}, hashes=range(8)), [inst(0), inst(1, [100], inflight=range(8))], 0),
    # SGLang with block hashes: its own tree, empty for a router that has routed nothing -> smallest tree
    ("sglang", req(8, {2: PrefixHits(8)}, hashes=range(8)), [inst(0, used=50), inst(1, used=10), inst(2)], 0),
]


@pytest.mark.parametrize("name,r,insts,want", CASES)
def test_decision_table(name, r, insts, want):
    d = get_policy(name, MODELS).choose(r, insts)
    assert d.chosen == want, d.reason
    assert d.reason


def test_round_robin_cycles_and_skips_unhealthy():
    p = get_policy("round_robin")
    insts = [inst(0), inst(1, healthy=False), inst(2)]
    assert [p.choose(req(), insts).chosen for _ in range(4)] == [0, 2, 0, 2]


@pytest.mark.parametrize("name", list(POLICIES))
def test_all_unhealthy_rejects_with_reason(name):
    d = get_policy(name, MODELS).choose(req(), [inst(0, healthy=False), inst(1, healthy=False)])
    assert d.rejected and "unhealthy" in d.reason
    assert get_policy(name, MODELS).choose(req(), []).rejected


@pytest.mark.parametrize("name", ["mooncake", "kvstack"])
def test_admission_rejects_when_slo_unreachable_by_load(name):
    # prefill needs 4 s; queues of 5 s and 6 s; SLO 4.5 s: reject, reason names the SLO and the best instance
    d = get_policy(name, MODELS).choose(req(8, slo=4500), [inst(0, [5000]), inst(1, [6000])])
    assert d.rejected
    assert "SLO 4500 ms" in d.reason and "instance 0" in d.reason
    assert set(d.estimates) == {0, 1}


def test_kvstack_serves_unavoidable_miss_when_queues_are_short():
    # 4 s of prefill, SLO 1 s: no instance can ever meet it; queues are empty -> serve (seeds the cache)
    d = get_policy("kvstack", MODELS).choose(req(8, slo=1000), [inst(0), inst(1, [10])])
    assert d.chosen == 0
    d = get_policy("kvstack", MODELS, serve_unavoidable=False).choose(req(8, slo=1000), [inst(0)])
    assert d.rejected
    assert get_policy("mooncake", MODELS).choose(req(8, slo=1000), [inst(0)]).rejected


# ---------------------------------------------------------------- properties
queue_st = st.lists(st.integers(0, 20_000), max_size=4)
hits_st = st.tuples(st.integers(0, 8), st.integers(0, 8), st.integers(0, 8))


def _hits(t, blocks=8):
    d, h, s = t
    d = min(d, blocks)
    h = min(h, blocks - d)
    return PrefixHits(d, h, min(s, blocks - d - h))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(queue_st, hits_st), min_size=1, max_size=6), st.integers(0, 5), st.data())
def test_strictly_better_instance_is_never_passed_over(others, k, data):
    """B dominated by A (longer queue, no more hits of any tier) is never chosen."""
    k = k % len(others)
    queues = [q for q, _ in others]
    hits = {i: _hits(h) for i, (_, h) in enumerate(others)}
    # B = copy of instance k with one more queued item; its hits are A's minus something
    b_id = len(others)
    queues.append(queues[k] + [data.draw(st.integers(1, 20_000))])
    a = hits[k]
    hits[b_id] = PrefixHits(data.draw(st.integers(0, a.device)), 0, 0)
    r = req(8, hits)
    insts = [inst(i, q) for i, q in enumerate(queues)]
    for name in ("mooncake", "kvstack", "least_loaded"):
        d = get_policy(name, MODELS).choose(r, insts)
        assert d.chosen != b_id, (name, d.reason)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(queue_st, hits_st), min_size=1, max_size=5), hits_st)
def test_overloaded_instance_stops_receiving_work(others, hot_hits):
    """An instance whose queue exceeds everyone else's total work gets nothing, even with a full hit."""
    hits = {i: _hits(h) for i, (_, h) in enumerate(others)}
    hot = len(others)
    hits[hot] = PrefixHits(8)
    insts = [inst(i, q) for i, (q, _) in enumerate(others)] + [inst(hot, [1] * 200 + [200_000])]
    r = req(8, hits)
    for name in ("mooncake", "kvstack", "least_loaded", "dynamo", "sglang"):
        assert get_policy(name, MODELS).choose(r, insts).chosen != hot, name


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(st.integers(1, 20_000), min_size=1, max_size=4), min_size=1, max_size=5),
       st.floats(1.0, 500.0))
def test_admission_control_rejects_with_reason(queues, slo_ms):
    """Every queue is longer than the SLO: both SLO-aware policies reject and say why."""
    insts = [inst(i, [q + int(slo_ms) + 1 for q in qs]) for i, qs in enumerate(queues)]
    for name in ("mooncake", "kvstack"):
        d = get_policy(name, MODELS).choose(req(8, slo=slo_ms), insts)
        assert d.rejected and "SLO" in d.reason and "queue" in d.reason


# ---------------------------------------------------------------- decode LB
def dinst(i, used_gib=0.0, batch_tokens=0, running=0, cap_gib=1.0, healthy=True):
    return DecodeInstance(i, int(used_gib * 2**30), int(cap_gib * 2**30), batch_tokens, running, healthy)


def test_decode_picks_lowest_tbt_with_memory_room():
    p = get_policy("kvstack", MODELS, kind="decode")
    r = DecodeRequest(1000, 100)
    d = p.choose(r, [dinst(0, batch_tokens=900_000, running=10), dinst(1, batch_tokens=1000, running=2),
                     dinst(2, used_gib=0.9999, running=0)])
    assert d.chosen == 1


def test_decode_rejects_when_nothing_fits():
    p = get_policy("kvstack", MODELS, kind="decode")
    d = p.choose(DecodeRequest(1_000_000, 10), [dinst(0), dinst(1)])
    assert d.rejected and "lack" in d.reason
    d = p.choose(DecodeRequest(1000, 10, tbt_slo_ms=1.0), [dinst(0, batch_tokens=10**6, running=50)])
    assert d.rejected and "TBT SLO" in d.reason
    for name in ("round_robin", "least_kv"):
        assert get_policy(name, MODELS, kind="decode").choose(DecodeRequest(10**7, 10), [dinst(0)]).rejected


def test_decode_least_kv_baseline():
    d = get_policy("least_kv", MODELS, kind="decode").choose(DecodeRequest(10, 10), [dinst(0, 0.5), dinst(1, 0.1)])
    assert d.chosen == 1


# ---------------------------------------------------------------- VE LB
def test_ve_affinity_vs_queue():
    p = get_policy("kvstack", kind="ve", seconds_per_image=1.0)
    r = VERequest(("a", "b", "c"))
    warm = VEInstance(0, queue_images=2, cached_images=frozenset("abc"))
    cold = VEInstance(1, queue_images=0)
    assert p.choose(r, [warm, cold]).chosen == 0  # 2 queued < 3 encodes
    busy = VEInstance(0, queue_images=5, cached_images=frozenset("abc"))
    assert p.choose(r, [busy, cold]).chosen == 1  # 5 queued > 3 encodes
    assert get_policy("least_queue", kind="ve").choose(r, [warm, cold]).chosen == 1
    capped = get_policy("kvstack", kind="ve", max_queue_images=1)
    d = capped.choose(r, [VEInstance(0, 3), VEInstance(1, 2)])
    assert d.rejected and ">= 1 images queued" in d.reason


@pytest.mark.parametrize("bad", [float("nan"), "4", True, 2.0, 0, -1])
def test_ve_max_queue_images_must_be_a_positive_int(bad):
    """NaN was accepted and then rejected every request; a string raised a bare TypeError."""
    with pytest.raises(LBInputError, match="max_queue_images must be None or an integer > 0"):
        get_policy("kvstack", kind="ve", max_queue_images=bad)
    with pytest.raises(LBInputError, match="seconds_per_image must be a finite number > 0"):
        get_policy("kvstack", kind="ve", seconds_per_image=str(bad))


@pytest.mark.parametrize("bad,match", [("abc", "tuple or list"), (b"ab", "tuple or list"), ({"a"}, "tuple or list"),
                                       (("a", ""), r"image_hashes\[1\]"), ((None,), r"image_hashes\[0\]"),
                                       ((b"",), r"image_hashes\[0\]"), ((True,), r"image_hashes\[0\]")])
def test_ve_request_is_validated(bad, match):
    """Malformed image lists are refused: VERequest("abc") is not read as the three images 'a', 'b', 'c'."""
    with pytest.raises(LBInputError, match=match):
        VERequest(bad)
    assert VERequest(["a", b"b", 3]).image_hashes == ("a", b"b", 3)


def test_ve_repeated_image_is_encoded_once():
    """Three copies of one uncached image cost one encode, not three."""
    p = get_policy("kvstack", kind="ve", seconds_per_image=1.0)
    d = p.choose(VERequest(("x", "x", "x")), [VEInstance(0, queue_images=2), VEInstance(1, queue_images=0)])
    assert d.chosen == 1 and d.estimates == {0: 3.0, 1: 1.0} and "0/1 images cached" in d.reason


@pytest.mark.parametrize("knob,bad", [("balance_abs_threshold", float("nan")), ("balance_rel_threshold", float("nan")),
                                      ("balance_abs_threshold", -1), ("balance_rel_threshold", float("inf")),
                                      ("balance_abs_threshold", "64"), ("balance_rel_threshold", True),
                                      ("cache_threshold", "0.3"), ("cache_threshold", 1.5)])
def test_sglang_thresholds_are_checked(knob, bad):
    """A NaN balance threshold silently switched the imbalance fallback off."""
    with pytest.raises(LBInputError, match=f"SGLangCacheAware.{knob} must be a finite number"):
        get_policy("sglang", MODELS, **{knob: bad})
    with pytest.raises(LBInputError, match="DynamoCost.overlap_weight must be a finite number >= 0"):
        get_policy("dynamo", MODELS, overlap_weight=str(bad))
    p = get_policy("sglang", MODELS, balance_abs_threshold=0, balance_rel_threshold=0.0)
    assert p.choose(req(), [inst(0, queue=[512]), inst(1)]).chosen == 1  # imbalanced: the shorter queue


@pytest.mark.parametrize("bad,match", [
    ("abc", "frozenset of image hashes"), (b"ab", "frozenset of image hashes"), (None, "frozenset of image hashes"),
    (frozenset({""}), "holds ''"), (frozenset({None}), "holds None"), ({True}, "holds True"), ((3.5,), "holds 3.5"),
])
def test_ve_instance_cached_images_are_validated(bad, match):
    """cached_images was unchecked: a str cache made ``h in cached`` a substring test (the image 'a' a hit on an
    instance caching 'abc'), and a hash of another kind could never match a request's."""
    with pytest.raises(LBInputError, match=match):
        VEInstance(0, cached_images=bad)
    assert VEInstance(0, cached_images=["a", b"b", 3]).cached_images == frozenset({"a", b"b", 3})
    assert isinstance(VEInstance(0, cached_images={"a"}).cached_images, frozenset)


@pytest.mark.parametrize("kw,match", [
    ({"num_blocks": 1.5}, "num_blocks must be an integer"),
    ({"num_blocks": 2**40}, "fill at most 8 blocks of 512"),
    ({"prompt_tokens": 4096.5}, "prompt_tokens must be an integer"),
    ({"block_tokens": 512.5}, "block_tokens must be an integer"),
    ({"block_tokens": True}, "block_tokens must be a finite number"),
    ({"block_hashes": "abcdefgh"}, "block_hashes must be a tuple or list"),
    ({"block_hashes": range(8)}, "block_hashes must be a tuple or list"),
    ({"block_hashes": (1, 2, 3)}, "lists 3 hashes for 8 blocks"),
    ({"block_hashes": tuple(range(7)) + ([1],)}, r"block_hashes\[7\] is not hashable"),
])
def test_route_request_counts_and_block_hashes_are_validated(kw, match):
    """num_blocks took any number (a count of tokens passed as blocks went through), block_tokens any
    positive float, and block_hashes any object of any length: warm_hits walked it as the prefix."""
    args = {"prompt_tokens": 4096, "num_blocks": 8, **kw}
    with pytest.raises(LBInputError, match=match):
        RouteRequest(**args)
    assert RouteRequest(4096, 8, block_hashes=list(range(8))).block_hashes == tuple(range(8))
    assert RouteRequest(4097, 9).num_blocks == 9  # a partial last block counts


@pytest.mark.parametrize("name", ["kvstack", "mooncake"])
def test_cost_based_policies_refuse_a_request_in_other_blocks_than_their_model(name):
    """A request counted in 256-token blocks under a model that sizes a fetched block at 512 tokens: every
    host/store hit was costed at twice its bytes. Refused, as lb.sim refuses the same mismatch."""
    r = RouteRequest(4096, 16, {0: PrefixHits(0, 8)}, block_tokens=256)
    with pytest.raises(LBInputError, match="block_tokens 256 differs from the cost model's transfer.block_tokens 512"):
        get_policy(name, MODELS).choose(r, [inst(0), inst(1)])
    assert get_policy(name, MODELS).choose(req(), [inst(0), inst(1)]).chosen is not None


def test_round_robin_cycles_in_snapshot_order_not_id_order():
    """As its docstring says (the module table said "id order"): healthy ids 2, 0, 3 are picked in that order."""
    p = get_policy("round_robin", MODELS)
    snap = [inst(2), inst(0), inst(1, healthy=False), inst(3)]
    assert [p.choose(req(), snap).chosen for _ in range(4)] == [2, 0, 3, 2]
