"""Running queue totals (``lb.types.QueueLoad`` / ``QueueTotals``) and the decode finish heap (``lb.sim``).

The refactor they guard made ``least_loaded`` and ``dynamo`` O(instances) per decision and a decode
finish O(log batch). Its promise is *the same results as the scans it replaced*, bit for bit, so
the references below are the old scans, copied verbatim (they stay here, not in ``lb/``), and
every test compares against them: per event on random enqueue/start/finish sequences, per decision
on a replayed overloaded trace, and per finish on random decode batches.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings, strategies as st

from lb.cost_model import CostModels, DecodeCostModel, PrefillCostModel, TransferModel
from lb.registry import get_policy
from lb.sim import SimConfig, TraceRequest, simulate
from lb.types import (
    Decision, LBInputError, LBInternalError, PrefillInstance, QueuedPrefill, QueueLoad, QueueTotals, RouteRequest,
)

MODELS = CostModels(PrefillCostModel(1e-3, 1e-5, 0.0), DecodeCostModel(1e-3, 1e-8, 1e-4), TransferModel(1024.0))


# ----------------------------------------------------------------------------- the old scans (references)
def ref_pending_tokens(queue) -> int:
    """``PrefillInstance.pending_tokens`` before the running totals: a walk of the queue."""
    return int(sum(q.suffix_tokens * q.remaining_fraction for q in queue))


def ref_active_blocks(queue, bt: int) -> int:
    """Dynamo's "active blocks" before the running totals: a walk of the queue."""
    return sum((q.suffix_tokens + q.cached_tokens + bt - 1) // bt for q in queue)


def ref_least_loaded(req: RouteRequest, live: list) -> Decision:
    est = {i.id: float(ref_pending_tokens(i.queue)) for i in live}
    pick = min(live, key=lambda i: est[i.id])
    return Decision(pick.id, f"least pending tokens ({est[pick.id]:.0f})", est)


def ref_dynamo(req: RouteRequest, live: list, w: float = 1.0) -> Decision:
    bt = req.block_tokens
    cost = {}
    for i in live:
        uncached = req.num_blocks - req.hit_of(i.id).device
        active = sum((q.suffix_tokens + q.cached_tokens + bt - 1) // bt for q in i.queue)
        cost[i.id] = w * uncached + active
    pick = min(live, key=lambda i: cost[i.id])
    return Decision(pick.id, f"lowest Dynamo cost {cost[pick.id]:.1f}", cost)


REFERENCES = {"least_loaded": ref_least_loaded, "dynamo": ref_dynamo}


# ----------------------------------------------------------------------------- totals vs the walk, per event
def near_integer_fraction(suffix: int, k: int, ulps: int) -> float:
    """A remaining fraction whose ``suffix * fraction`` sits a few ulps below the integer ``k``:
    the case where the float walk may round up to ``k`` once larger integers are added."""
    f = min(k, suffix) / suffix
    for _ in range(ulps):
        f = math.nextafter(f, 0.0)
    return f


fraction_st = st.one_of(
    st.floats(0.0, 1.0),
    st.builds(near_integer_fraction, st.integers(1, 5000), st.integers(1, 5000), st.integers(1, 4)),
    st.sampled_from([0.0, 1.0, 0.5, 0.9999999999999999]),
)
entry_st = st.tuples(st.integers(0, 3000), st.integers(0, 3000), st.sampled_from([0, 1, 2**20, 2**40]))
events_st = st.lists(st.tuples(st.sampled_from(["enqueue", "enqueue", "start", "finish"]), entry_st, fraction_st),
                     max_size=60)


@settings(max_examples=300, deadline=None)
@given(events_st, st.sampled_from([1, 16, 512]))
def test_running_totals_equal_the_walk_after_every_event(events, bt):
    """Enqueue / start / finish in any order: the totals equal the sums over the waiting entries,
    and pending_tokens / queued_blocks equal the old walks (whatever the running head's fraction,
    including fractions that leave it a few ulps below an integer; the big tokens push the float
    walk into high binades, where it rounds)."""
    load = QueueLoad(bt)
    waiting: list[QueuedPrefill] = []
    running: QueuedPrefill | None = None
    for op, (suffix, cached, big), fraction in events:
        if op == "enqueue":
            q = QueuedPrefill(suffix + big, cached)
            load.enqueue(q)
            waiting.append(q)
        elif op == "start" and running is None and waiting:
            running = waiting.pop(0)
            load.dequeue(running)
        elif op == "finish" and running is not None:
            running = None
        head = () if running is None else (QueuedPrefill(running.suffix_tokens, running.cached_tokens, 0.0, fraction),)
        queue = head + tuple(waiting)
        t = load.totals()
        assert (t.requests, t.suffix_tokens, t.block_tokens) == (len(waiting), sum(q.suffix_tokens for q in waiting), bt)
        assert t.blocks == ref_active_blocks(waiting, bt)
        fast, walk = PrefillInstance(0, queue, totals=t), PrefillInstance(0, queue)
        want = ref_pending_tokens(queue)
        assert fast.pending_tokens == want and walk.pending_tokens == want
        for b in {bt, 7, 512}:  # totals kept for bt; any other block size walks
            assert fast.queued_blocks(b) == ref_active_blocks(queue, b) == walk.queued_blocks(b)


def test_an_integer_total_alone_would_round_differently_from_the_walk():
    """The head's 1 - 2**-53 plus 1 is 2.0 in floats (a tie, to even): the old walk says 2 pending
    tokens where floor(head) + integer total says 1; pending_tokens must keep the walk's 2."""
    head = QueuedPrefill(1, 0, 0.0, 0.9999999999999999)
    load = QueueLoad()
    load.enqueue(QueuedPrefill(1))
    inst = PrefillInstance(0, (head, QueuedPrefill(1)), totals=load.totals())
    assert ref_pending_tokens(inst.queue) == 2 == inst.pending_tokens
    # and the common case takes the O(1) path: the head is not within an ulp of an integer
    inst = PrefillInstance(0, (QueuedPrefill(100, 0, 0.0, 0.25), QueuedPrefill(1)), totals=load.totals())
    assert inst.pending_tokens == 26 == ref_pending_tokens(inst.queue)


def test_queue_load_refuses_misuse_and_says_a_broken_count_is_a_bug():
    load = QueueLoad(512)
    with pytest.raises(LBInputError, match="remaining_fraction 1.0"):
        load.enqueue(QueuedPrefill(10, 0, 0.0, 0.5))  # a running request is not a waiting one
    with pytest.raises(LBInputError, match="integer token counts"):
        load.enqueue(QueuedPrefill(10.5))
    with pytest.raises(LBInputError, match="block_tokens"):
        QueueLoad(0)
    with pytest.raises(LBInternalError, match="bug"):
        load.dequeue(QueuedPrefill(10))
    with pytest.raises(LBInputError, match="cover 2 waiting requests but the queue holds 1"):
        PrefillInstance(0, (QueuedPrefill(1),), totals=QueueTotals(2, 2, 2))
    load = QueueLoad(512)
    load.enqueue(QueuedPrefill(600, 10))
    assert load.totals() is load.totals()  # one record per state, shared by the snapshots
    assert load.totals() == QueueTotals(1, 600, 2, 512)


# ----------------------------------------------------------------------------- decisions on a replayed trace
class _Checked:
    """Runs the policy under test and the old scan on the same snapshots; records both."""

    def __init__(self, name: str) -> None:
        self.policy, self.ref, self.calls = get_policy(name, MODELS), REFERENCES[name], []

    def choose(self, req, instances):
        got = self.policy.choose(req, instances)
        want = self.ref(req, [i for i in instances if i.healthy])
        for i in instances:  # the sim's snapshot keeps the QueueTotals invariants
            t = i.totals
            waiting = [i.queue[k] for k in range(len(i.queue) - t.requests, len(i.queue))]
            assert (t.suffix_tokens, t.blocks) == (sum(q.suffix_tokens for q in waiting),
                                                   ref_active_blocks(waiting, t.block_tokens))
        self.calls.append((got, want, max(len(i.queue) for i in instances)))
        return got


def _overloaded_trace(n: int = 400, seed: int = 11) -> list[TraceRequest]:
    """``n`` requests 1 ms apart on prompts of 300-6000 tokens: far more work than 3 instances
    serve, so every queue grows with the trace; shared 2-block prefixes, partial last blocks."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        tokens = rng.randint(300, 6000)
        blocks = -(-tokens // 512)
        ids = [rng.randrange(5) * 100 + k for k in range(min(2, blocks))]
        ids += [10_000 + i * 20 + k for k in range(blocks - len(ids))]
        reqs.append(TraceRequest(float(i), tokens, rng.choice([0, 1, 4, 30]), tuple(ids)))
    return reqs


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_replayed_overloaded_trace_decides_as_the_old_scan(name):
    spy = _Checked(name)
    cfg = SimConfig(prefill_instances=3, decode_instances=2, device_capacity_blocks=20, host_capacity_blocks=40,
                    store_capacity_blocks=100, ttft_slo_ms=None)
    r = simulate(_overloaded_trace(), spy, cfg, name=name, models=MODELS)
    assert r.served == 400 and len(spy.calls) == 400
    assert max(depth for *_, depth in spy.calls) > 100  # overloaded: the queues did grow with the trace
    for got, want, _ in spy.calls:
        assert (got.chosen, got.reason, got.estimates) == (want.chosen, want.reason, want.estimates)


# ----------------------------------------------------------------------------- decode finishes: heap vs scan
class _ScanDecode:
    """The old ``_Decode`` bookkeeping: a dict scanned for the smallest target and for the due ones."""

    def __init__(self) -> None:
        self.active: dict = {}
        self.steps = 0.0

    def join(self, idx, target, ctx, kv, now):
        self.active[idx] = (target, ctx, kv, now)

    def next_target(self):
        return min(v[0] for v in self.active.values()) if self.active else None

    def finish_due(self):
        due = max(self.steps, min(v[0] for v in self.active.values())) + 1e-6
        self.steps = max(self.steps, due - 1e-6)
        out = []
        for idx, (target, ctx, kv, joined) in list(self.active.items()):
            if target <= due:
                del self.active[idx]
                out.append((idx, joined))
        return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["join", "join", "advance", "finish"]),
                          st.sampled_from([1.0, 2.0, 3.0, 1e-7, 0.5]), st.integers(1, 5)), max_size=80))
def test_decode_finish_heap_equals_the_scan(events):
    """Same requests finished, in the same order (join order), same steps, same smallest target,
    with ties and targets within 1e-6 of each other (output lengths 1e-7 apart)."""
    from lb.sim import _Decode

    d = _Decode(0, SimConfig(), MODELS)
    ref = _ScanDecode()
    now = 0.0
    for idx, (op, x, n) in enumerate(events):
        if op == "join":
            target = d.steps + n + (x if x < 1 else 0.0)
            kv, ctx = 100 * n, 10 * n
            d.join(idx, target, ctx, kv, now)
            ref.join(idx, target, ctx, kv, now)
        elif op == "advance":
            d.steps += x
            ref.steps = d.steps
        elif op == "finish" and ref.active:
            assert d.finish_due() == ref.finish_due()
            assert d.steps == ref.steps
        now += 1.0
        assert (d.targets[0][0] if d.targets else None) == ref.next_target()
        assert set(d.active) == set(ref.active) and len(d.targets) == len(d.active)
        assert d.kv_used == sum(v[2] for v in ref.active.values())
        assert d.batch_tokens == sum(v[1] for v in ref.active.values())
    assert sorted(e[2] for e in d.targets) == sorted(d.active)
