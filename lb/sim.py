"""Discrete-event simulation of P/D instances with tiered prefix caches, driven by lb/ policies.

Role
    ``tools/replay_trace.py`` (and the tests) parse a Mooncake-format trace
    with :func:`parse_trace` (``lb.trace``: parsing and the reference ratios), build a :class:`SimConfig`, and call
    :func:`simulate` once per policy. The same ``lb`` policy objects as in
    production receive snapshots (``PrefillInstance``, ``RouteRequest``,
    ``DecodeInstance``) built from the simulated state. Pure Python + the
    cost model: no I/O (the caller reads files and draws the progress bar
    through the ``progress`` callback).

Cacheable blocks
    Only *full* blocks are ever cached or hit, as in production
    (``kvstore/keys.py`` hashes every full block; a partial last block is
    recomputed): of a request's ``hash_ids`` only the first
    ``input_length // block_tokens`` are looked up, inserted and counted as
    in flight (:func:`cacheable_blocks`). A prompt of 1000 tokens with ids
    ``[1, 2]`` can cache and reuse block 1 (512 tokens), never block 2.

Model (one heap of timed events; ties: completions before arrivals)
    1. *Arrival* at ``timestamp_ms / 1000 / speedup``: hits per instance are
       looked up (device LRU, host LRU of that instance; the shared store
       LRU), the prefill policy chooses; a rejection is final (counted as an
       SLO miss). The request joins that instance's queue: FIFO, unless the policy
       orders queues itself (``pick_next``, the contract in ``lb.prefill``): then
       each idle instance asks it which waiting request to start, showing each with
       the hits it would have now and its deadline (arrival + TTFT SLO), and the
       snapshot's estimate of a queued request counts the blocks of the requests
       ahead of it as cached (``lb.prefill.warm_hits``), as that policy does. Before that, a
       request that needs more KV memory (``lb.decode.request_kv_bytes``: prompt +
       output tokens) than the decode policy admits on an empty decode instance
       (its ``kv_limit_bytes``: ``kvstack`` keeps 5 % headroom, the baselines none; the
       very limit its placement applies, see ``lb.decode``) is refused, its reason
       :data:`OVER_DECODE_KV`, as the entrypoint refuses one over ``max_model_len``:
       no decode could ever take it, and it costs no prefill. The rule is the same for
       a request with ``output_length`` 0 (its prompt alone over it), which needs no
       decode: the entrypoint's bound counts the prompt too.
    2. *Prefill start*: hits are looked up again (the cache may have warmed
       meanwhile); the usable prefix is the longest run of cacheable blocks
       present in some tier, each loaded from its fastest tier; cached tokens
       = ``min(input_length - 1, hit blocks x block_tokens)`` (the last token
       is always computed); service time = ``TransferModel.fetch_s`` +
       ``PrefillCostModel.predict``, times ``service_bias`` (a cost model that is
       systematically wrong: 1.3 = every prefill 30 % slower than modelled) and an
       optional log-normal noise (``service_noise``); the policies are not told
       (one with ``observe`` hears the modelled and the actual time at prefill end). Hit
       blocks are touched in their tiers.
    3. *Prefill end*: the request's cacheable blocks enter the device LRU
       (evicted blocks spill to the host LRU) and the shared store LRU (saved
       after prefill). TTFT = end - arrival. A request with ``output_length``
       0 is then done (no decode, no TBT sample, not judged on the TBT SLO);
       any other is placed by the decode policy with its TBT SLO (as the entrypoint); one
       that does not fit waits, FIFO among the waiting, for a decode to finish (work-conserving:
       a request whose prefill ends while others wait is placed at once if a batch takes it,
       and only joins the line if none does; at each decode finish the line is offered the
       freed room in order and *every* waiting request a batch now takes is placed, so one that
       does not fit never holds up a smaller one behind it; its TBT counts that wait). The
       price: a large request may be overtaken by smaller ones for as long as they keep coming
       (the line drains once arrivals stop). With every batch empty, a
       request over the SLO alone is placed without it; one
       that the decode policy refuses even then, SLO or not, is refused, its reason
       :data:`REFUSED_BY_EMPTY_DECODE`, and leaves the line: no finish can ever free more,
       so it would wait forever). Step 1 already refused every request over the policy's
       memory limit, so this takes a policy that refuses for another reason. A request
       refused after its prefill is rejected, not served: it leaves no TTFT sample (its
       prefill still counts in busy time and hit ratios).
    4. *Decode*: a fluid model per decode instance; steps advance at rate
       ``1 / DecodeCostModel.predict(batch tokens, batch requests)``, the
       batch changes on joins/leaves; TBT = (decode end - prefill end) / output tokens:
       the time spent waiting for a decode slot counts, as the client sees it (the first
       token comes with the prefill, ``entrypoint/generate.py``; the next only once the
       request decodes), so a policy that queues at decode is not flattered by a TBT of
       its decode batch alone. TTFT ends at prefill end for the same reason.

Early stop and trace
    With ``stop_after_misses`` a run stops once more requests than that are known
    to miss (rejected, still not prefilled at its TTFT deadline, TBT over its SLO at
    decode end): its ``stopped_early`` attainment is a lower bound and already below
    ``1 - stop_after_misses / requests``, which is all a capacity search needs to
    know (``tools/replay_trace.py --capacity``). With ``keep_trace`` each request
    keeps its decisions' reasons in order (``route: ...``, ``start: ...`` from
    ``pick_next``, ``prefill done: TTFT ...``) in ``SimResult.trace``.

Hit ratios (blocks, prefix semantics: a block counts only if every block
before it in the request also hit)
    ``hit blocks / all blocks``: the numerator counts prefix-hit *full*
    blocks; the denominator counts every block the trace lists
    (``len(hash_ids)``, the partial last block included), so a request of
    ``k`` full blocks and one partial block reaches at most ``k / (k + 1)``.
    The policies' ratio is over the blocks of the requests served, taken at
    prefill start; the two references use the same definition over all
    requests in arrival order: *ideal* (infinite cache) and *LRU*
    (``lru_oracle``, printed ``lru_ref``: one independent LRU of the store's
    capacity, touched at arrival; no oracle). See :func:`reference_hit_ratios`.
    Neither bounds a policy: a request that waits in a queue may reuse the
    blocks of a request that arrived after it but finished its prefill first,
    which the arrival-order references never count (a policy above "ideal"
    means queueing, not a bug), and a policy also hits in device and host
    tiers the single LRU lacks (so it may beat "LRU"), or misses what another
    instance holds (so it may trail it).

Cost per event
    A snapshot of an instance is O(1): its ``queue`` and ``inflight_blocks``
    are immutable views (:class:`QueueView`, :class:`InflightView`) over
    the instance's append-only job log, not copies of its queue, and its
    ``totals`` (``lb.types.QueueTotals``) come from the running sums each
    instance keeps (a ``QueueLoad``: + at enqueue, - at prefill start), so
    ``pending_tokens`` and ``queued_blocks`` (``least_loaded``, ``dynamo``)
    are O(1) too. Policies that walk the queue (``queue_seconds``:
    ``mooncake``, ``kvstack``) still pay for its length. A decode finish is
    O(log batch): each decode instance keeps a heap of its requests' target
    steps (:class:`_Decode`), plus one decode-policy call per request waiting in
    the decode line (the work-conserving drain offers the freed room to each).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from lb.cost_model import CostModels, load_default
from lb.trace import (  # the trace half (lb/trace.py), re-exported (``__all__``)
    LRU, TraceRequest, cacheable_blocks, json_safe, parse_trace, prefix_hits_lru, prompts_beyond_fit,
    reference_hit_ratios,
)
from lb.sim_views import FinishedInflightView, InflightView, QueueView
from lb.types import (
    BLOCK_TOKENS, DecodeInstance, DecodeRequest, LBInputError, LBInternalError, PrefillInstance, PrefixHits,
    QueuedPrefill, QueueLoad, RouteRequest, TierBandwidth,
)

__all__ = ["TraceRequest", "cacheable_blocks", "parse_trace", "LRU", "SimConfig", "SimResult", "simulate",
           "reference_hit_ratios", "prefix_hits_lru", "json_safe", "prompts_beyond_fit", "OVER_DECODE_KV",
           "REFUSED_BY_EMPTY_DECODE"]

# Reject reasons (``SimResult.reject_reasons`` keys) of requests no decode instance could ever take
OVER_DECODE_KV = ("needs more KV memory than the decode policy admits on an empty decode instance "
                  "(over max_model_len)")
REFUSED_BY_EMPTY_DECODE = "the decode policy refuses it with every decode instance empty"


@dataclass(frozen=True, slots=True)
class SimConfig:
    """Everything a run depends on (one per run; the policy is passed separately)."""

    prefill_instances: int = 8
    decode_instances: int = 4
    device_capacity_blocks: int = 2000
    host_capacity_blocks: int = 8000
    store_capacity_blocks: int | None = 20000
    bandwidth: TierBandwidth = field(default_factory=TierBandwidth)
    decode_kv_capacity_bytes: int = 40 * 2**30
    speedup: float = 1.0
    ttft_slo_ms: float | None = 30_000.0
    tbt_slo_ms: float | None = 100.0
    admission: bool = True
    service_noise: float = 0.0
    service_bias: float = 1.0
    seed: int = 0
    block_tokens: int = BLOCK_TOKENS
    max_wall_s: float = 600.0
    stop_after_misses: int | None = None
    keep_trace: bool = False

    def __post_init__(self) -> None:
        if self.prefill_instances < 1 or self.decode_instances < 1:
            raise LBInputError("need at least one prefill and one decode instance")
        if self.speedup <= 0:
            raise LBInputError("speedup must be > 0 (1 = trace time, 2 = twice the offered load)")
        if self.service_noise < 0:
            raise LBInputError("service_noise (sigma of log-normal noise) must be >= 0")
        if not (math.isfinite(self.service_bias) and self.service_bias > 0):
            raise LBInputError("service_bias (actual / modelled prefill time) must be a finite number > 0")
        if self.stop_after_misses is not None and self.stop_after_misses < 0:
            raise LBInputError("stop_after_misses must be None or an integer >= 0")


# SimResult.pct's sample names -> fields (a registry: a new sample is one line here)
_SAMPLES = {"ttft": "ttft_s", "tbt": "tbt_s", "decode_wait": "decode_wait_s"}


@dataclass(frozen=True, slots=True)
class SimResult:
    """Per-run metrics; ``to_dict`` is the JSON form written by the replay tool.

    ``requests`` is every request of the trace; ``arrived`` those whose arrival was
    handled (``requests`` unless ``truncated``: the run stopped at ``max_wall_s``).
    Attainments are over all ``requests``: a rejected request, one that never
    arrived and one still in flight at a truncation count as misses, so a truncated
    run's attainment is a lower bound of the complete run's (the run is deterministic
    up to the point where it stopped). ``reject_reasons`` counts rejections by reason: the
    prefill policy's (its first clause), :data:`OVER_DECODE_KV` and :data:`REFUSED_BY_EMPTY_DECODE`
    (requests no decode instance could ever take); ``rejected`` is their sum. ``cached_tokens``
    maps the index in ``reqs`` of every request whose prefill started to the prompt tokens it reused. Percentiles of an
    empty sample (nothing served, no TBT sample) and hit ratios over no block (nothing served,
    or only requests with empty ``hash_ids``) are NaN here and ``None`` in
    ``to_dict``, whose every non-finite figure is ``None``. ``decode_wait_s`` (one per TBT sample)
    is the part of each TBT spent waiting for a decode slot; ``to_dict`` gives its p50/p90/p99 in s.
    """

    policy: str
    requests: int
    served: int
    rejected: int
    hit_ratio: float
    hit_tiers: dict
    ttft_s: tuple
    tbt_s: tuple
    slo_attainment: float
    ttft_attainment: float
    busy_s: tuple
    sim_end_s: float
    wall_s: float
    truncated: bool
    reject_reasons: dict
    arrived: int = 0
    cached_tokens: dict = field(default_factory=dict)
    decode_wait_s: tuple = ()  # per TBT sample, same order: the wait for a decode slot, included in it
    stopped_early: bool = False  # cut once more than cfg.stop_after_misses requests had missed an SLO
    trace: dict = field(default_factory=dict)  # cfg.keep_trace: request index -> its decisions' reasons, in order

    def pct(self, what: str, q: float) -> float:
        """Percentile ``q`` of a sample by name: ``ttft``, ``tbt`` or ``decode_wait`` (NaN when empty)."""
        v = getattr(self, _SAMPLES[what])
        return float(np.percentile(v, q)) if v else math.nan

    def ttft_all(self, q: float) -> float:
        """Percentile ``q`` (nearest rank) of the TTFT over *all* requests, each one not served (rejected,
        never arrived, still in flight at a cut) counted as an infinite TTFT: ``inf`` once more than
        ``100 - q`` percent were not served."""
        if not self.requests:
            return math.nan
        k = max(1, math.ceil(q / 100.0 * self.requests))  # the k-th smallest of all requests' TTFTs
        if k > len(self.ttft_s):
            return math.inf
        return float(np.partition(np.asarray(self.ttft_s), k - 1)[k - 1])

    @property
    def imbalance(self) -> float:
        """max / mean prefill busy time across instances (1.0 = perfectly even)."""
        m = float(np.mean(self.busy_s)) if self.busy_s else 0.0
        return max(self.busy_s) / m if m > 0 else 1.0

    def to_dict(self) -> dict:
        """The JSON form: plain numbers, non-finite ones (an empty percentile) as ``None``."""
        return json_safe({
            "policy": self.policy, "requests": self.requests, "arrived": self.arrived, "served": self.served,
            "rejected": self.rejected, "hit_ratio": self.hit_ratio, "hit_tiers": self.hit_tiers,
            "ttft_p50_s": self.pct("ttft", 50), "ttft_p90_s": self.pct("ttft", 90), "ttft_p99_s": self.pct("ttft", 99),
            "tbt_p50_ms": self.pct("tbt", 50) * 1e3, "tbt_p90_ms": self.pct("tbt", 90) * 1e3,
            "tbt_p99_ms": self.pct("tbt", 99) * 1e3, "decode_wait_p50_s": self.pct("decode_wait", 50),
            "decode_wait_p90_s": self.pct("decode_wait", 90), "decode_wait_p99_s": self.pct("decode_wait", 99),
            "slo_attainment": self.slo_attainment, "ttft_attainment": self.ttft_attainment,
            "imbalance": self.imbalance, "busy_s": list(self.busy_s), "sim_end_s": self.sim_end_s,
            "wall_s": self.wall_s, "truncated": self.truncated, "stopped_early": self.stopped_early,
            "ttft_all_p50_s": self.ttft_all(50), "ttft_all_p90_s": self.ttft_all(90),
            "ttft_all_p99_s": self.ttft_all(99), "reject_reasons": self.reject_reasons,
        })


@dataclass(slots=True)
class _Job:
    idx: int
    req: TraceRequest
    arrival: float
    est: QueuedPrefill  # the routing-time estimate shown to later snapshots
    pos: int = 0  # its position in its instance's job log
    start: float = 0.0
    end: float = 0.0
    actual: QueuedPrefill | None = None
    model_s: float = 0.0  # the cost model's time for what it ran (its actual hits): the policy's feedback


class _Prefill:
    """Simulated prefill instance: an append-only job log (FIFO queue), device + host LRU.

    Invariants (the O(1) snapshots rely on them)
        1. ``jobs``, ``ests``, ``blocks``, ``cum`` and every list in ``where`` are
           append-only: an entry, once written, never changes, so a view bounded by two
           positions taken at snapshot time shows the same content forever.
        2. ``jobs[:done]`` finished their prefill; ``jobs[done]`` is ``running`` when
           ``started > done`` (one at a time: ``started - done`` is 0 or 1);
           ``jobs[started:]`` wait, FIFO.
        3. In flight (queued or running) is ``jobs[done:]``: block ``b`` is in flight iff
           ``where[b]`` holds a position in ``[done, len(jobs))``.
        4. ``load`` sums the estimates of the waiting jobs, ``ests[started:]`` (the
           ``QueueTotals`` invariants): :meth:`enqueue` adds a job, :meth:`start` takes the
           next one out as it becomes the running head; a finish changes nothing there.

    *Scheduled* instances (``scheduled``: the policy has ``pick_next``) start any waiting
    job, not only the oldest, so 2. and 3. hold in this form instead: ``wait`` lists the
    positions of the waiting jobs in arrival order; ``fin[p]`` is 0 until job ``p``
    finishes, then the finish count at that moment (set once); ``lo`` is the lowest
    position not finished, so in flight is every ``p >= lo`` with ``fin[p] == 0``, and
    ``inflight_blocks`` counts their cacheable blocks. ``load`` sums ``ests`` over ``wait``.
    """

    def __init__(self, iid: int, cfg: SimConfig, scheduled: bool = False) -> None:
        self.id = iid
        self.device = LRU(cfg.device_capacity_blocks)
        self.host = LRU(cfg.host_capacity_blocks)
        self.jobs: list[_Job] = []
        self.ests: list[QueuedPrefill] = []  # ests[i] = jobs[i].est
        self.blocks: list[tuple] = []  # blocks[i] = the cacheable blocks of jobs[i]
        self.cum: list[int] = [0]  # cum[i] = sum of len(blocks[:i])
        self.where: dict = {}  # block -> ascending positions of the jobs that hold it
        self.started = 0
        self.done = 0
        self.running: _Job | None = None
        self.busy = 0.0
        self.load = QueueLoad(cfg.block_tokens)
        self.scheduled = scheduled
        self.wait: list[int] = []  # scheduled only: positions of the waiting jobs, in arrival order
        self.fin: list[int] = []  # scheduled only: fin[p] = finish count when job p finished, 0 before
        self.finished = 0
        self.lo = 0
        self.inflight_blocks = 0

    def enqueue(self, job: _Job, blocks: tuple) -> None:
        """Append ``job`` (cacheable ``blocks``) to the queue; its blocks are in flight from now."""
        pos = job.pos = len(self.jobs)
        if self.scheduled:
            self.wait.append(pos)
            self.fin.append(0)
            self.inflight_blocks += len(blocks)
        self.jobs.append(job)
        self.ests.append(job.est)
        self.blocks.append(blocks)
        self.cum.append(self.cum[-1] + len(blocks))
        for b in blocks:
            pos_list = self.where.get(b)
            if pos_list is None:
                self.where[b] = [pos]
            elif pos_list[-1] != pos:  # a block repeated within one request: one position
                pos_list.append(pos)
        self.load.enqueue(job.est)

    def start(self, k: int = 0) -> _Job:
        """The next waiting job (FIFO; scheduled: the ``k``-th waiting one) becomes the running one
        (the caller checked that none runs)."""
        job = self.jobs[self.wait.pop(k) if self.scheduled else self.started]
        self.started += 1
        self.load.dequeue(job.est)  # shown from now on as the queue head, not in the waiting sums
        self.running = job
        return job

    def finish(self, job: _Job) -> None:
        """The running ``job`` finished its prefill: its blocks leave the in-flight set."""
        self.running = None
        self.done += 1
        if self.scheduled:
            self.finished += 1
            self.fin[job.pos] = self.finished
            self.inflight_blocks -= len(self.blocks[job.pos])
            while self.lo < len(self.fin) and self.fin[self.lo]:
                self.lo += 1

    def waiting(self) -> bool:
        return self.started < len(self.jobs)

    def waiting_ests(self) -> tuple:
        """Scheduled only: the waiting jobs' estimates, in arrival order (what ``pick_next`` is shown)."""
        return tuple(self.ests[p] for p in self.wait)

    def queue_view(self, head: QueuedPrefill | None) -> Sequence[QueuedPrefill]:
        if self.scheduled:
            rest = self.waiting_ests()
            return rest if head is None else (head, *rest)
        return QueueView(head, self.ests, self.started, len(self.ests))

    def inflight_view(self) -> InflightView | FinishedInflightView:
        if self.scheduled:
            return FinishedInflightView(self.where, self.blocks, self.fin, self.lo, len(self.jobs), self.finished,
                                        self.inflight_blocks > 0)
        return InflightView(self.where, self.blocks, self.cum, self.done, len(self.jobs))


class _Decode:
    """Fluid decode instance: ``steps`` advance at ``1 / tbt(batch)``.

    Invariants (a finish is O(log batch) because of them)
        1. ``targets`` is a heap holding exactly one ``(target step, join number, idx)``
           per request in ``active``: :meth:`join` pushes it, :meth:`finish_due` pops it,
           nothing else touches either. So ``targets[0][0]`` is the smallest target
           (what a scan of ``active`` found) and the requests due at a finish are a
           prefix of the heap order.
        2. Join numbers increase with each join, so sorting popped entries by them gives
           ``active``'s insertion order: finished requests are reported in the order the
           scan of ``active`` used to report them (``SimResult.tbt_s`` is that order).
    """

    def __init__(self, iid: int, cfg: SimConfig, models: CostModels) -> None:
        self.id, self.cap, self.models = iid, cfg.decode_kv_capacity_bytes, models
        self.active: dict[int, tuple[float, int, int, float]] = {}  # idx -> (target step, ctx, kv bytes, ready t)
        self.targets: list[tuple[float, int, int]] = []  # heap of (target step, join number, idx)
        self.joins = 0
        self.steps, self.t, self.version = 0.0, 0.0, 0
        self.kv_used, self.batch_tokens = 0, 0

    def join(self, idx: int, target: float, ctx: int, kv: int, ready: float) -> None:
        """Request ``idx`` joins the batch (the caller advanced ``steps`` to now); ``ready`` is when its
        prefill ended (it waited for a decode slot since then), returned by :meth:`finish_due`."""
        self.active[idx] = (target, ctx, kv, ready)
        heapq.heappush(self.targets, (target, self.joins, idx))
        self.joins += 1
        self.kv_used += kv
        self.batch_tokens += ctx

    def finish_due(self) -> list[tuple[int, float]]:
        """Finish the requests due now: the smallest target unconditionally (so float error in
        ``steps`` can never re-schedule it forever) and any within 1e-6 steps of it, or of
        ``steps``. Returns ``(idx, ready time)`` of each, in join order."""
        due = max(self.steps, self.targets[0][0]) + 1e-6
        self.steps = max(self.steps, due - 1e-6)
        popped = []
        while self.targets and self.targets[0][0] <= due:
            popped.append(heapq.heappop(self.targets))
        popped.sort(key=lambda e: e[1])
        out = []
        for _, _, idx in popped:
            _, ctx, kv, ready = self.active.pop(idx)
            self.kv_used -= kv
            self.batch_tokens -= ctx
            out.append((idx, ready))
        return out

    def tbt(self) -> float:
        return max(self.models.decode.predict(self.batch_tokens, len(self.active)), 1e-6)

    def advance(self, now: float) -> None:
        if self.active:
            self.steps += (now - self.t) / self.tbt()
        self.t = now

    def next_finish(self) -> float | None:
        if not self.targets:
            return None
        remaining = self.targets[0][0] - self.steps
        return self.t + max(0.0, remaining) * self.tbt()


def simulate(
    reqs: Sequence[TraceRequest],
    policy,
    cfg: SimConfig,
    *,
    name: str = "?",
    models: CostModels | None = None,
    decode_policy=None,
    progress: Callable[[int, int], None] | None = None,
) -> SimResult:
    """Replay ``reqs`` through ``policy`` (a prefill policy object) under ``cfg``; see the module docstring.

    ``models.transfer.block_tokens`` must equal ``cfg.block_tokens`` (``LBInputError`` otherwise):
    hits are counted in ``cfg``'s blocks and fetched at the transfer model's bytes per block.
    Deterministic for a given ``cfg.seed``. Stops early, with ``truncated`` set, once
    ``cfg.max_wall_s`` of wall time has passed (checked before each event). ``progress``
    is called with (arrivals handled, requests) every 50 arrivals and at the last one.
    """
    from lb.decode import KVStackDecodePolicy, request_kv_bytes
    from lb.prefill import warm_hits

    models = models or load_default()
    if models.transfer.block_tokens != cfg.block_tokens:  # hits count cfg's blocks; a fetch sizes transfer's
        raise LBInputError(f"SimConfig.block_tokens {cfg.block_tokens} differs from the cost model's "
                           f"transfer.block_tokens {models.transfer.block_tokens}: fetches would be sized for "
                           f"another block; give both the same block size")
    decode_policy = decode_policy or KVStackDecodePolicy(models)
    if not callable(getattr(decode_policy, "kv_limit_bytes", None)):
        raise LBInputError(f"decode policy {decode_policy!r} has no kv_limit_bytes(capacity_bytes): the arrival "
                           f"check needs its memory limit (see the contract in lb/decode.py)")
    kv_limit = decode_policy.kv_limit_bytes(cfg.decode_kv_capacity_bytes)  # the limit its placement applies
    rng = random.Random(cfg.seed)
    bt = cfg.block_tokens
    pick_next = getattr(policy, "pick_next", None)  # optional: the policy orders each instance's queue
    pick_next = pick_next if callable(pick_next) else None
    pre = [_Prefill(i, cfg, pick_next is not None) for i in range(cfg.prefill_instances)]
    dec = [_Decode(i, cfg, models) for i in range(cfg.decode_instances)]
    store = LRU(cfg.store_capacity_blocks)
    full = [cacheable_blocks(r, bt) for r in reqs]  # only full blocks are ever cached (module doc)
    order = sorted(range(len(reqs)), key=lambda i: reqs[i].timestamp_ms)
    t0 = reqs[order[0]].timestamp_ms if reqs else 0.0
    heap: list = []
    seq = 0

    def push(t: float, kind: int, payload) -> None:
        nonlocal seq
        heapq.heappush(heap, (t, kind, seq, payload))
        seq += 1

    # kinds: 0 prefill end, 1 decode finish, 2 arrival (completions first on ties), 3 a TTFT deadline
    # (only with stop_after_misses: a request not prefilled by then is counted as a miss at once)
    for i in order:
        push((reqs[i].timestamp_ms - t0) / 1000.0 / cfg.speedup, 2, i)

    ttft: dict[int, float] = {}
    tbt: dict[int, float] = {}
    ready_at: dict[int, float] = {}  # prefill end of each request that goes on to decode
    dwait: dict[int, float] = {}  # its wait for a decode slot (prefill end to join)
    cached_tok: dict[int, int] = {}
    reasons: Counter = Counter()
    hit_blocks = Counter()
    served_blocks = 0
    decode_line: deque = deque()  # prefilled requests waiting for a decode slot, in order
    observe = getattr(policy, "observe", None)  # optional feedback hook (lb.prefill: the contract)
    trace: dict[int, list[str]] | None = {} if cfg.keep_trace else None
    wall0 = time.monotonic()
    truncated = False
    stopped = False
    done_arrivals = 0
    ttft_slo = math.inf if cfg.ttft_slo_ms is None else cfg.ttft_slo_ms / 1e3
    tbt_slo = math.inf if cfg.tbt_slo_ms is None else cfg.tbt_slo_ms / 1e3
    misses = 0  # requests known to miss an SLO so far (rejected, TTFT over, TBT over): stop_after_misses
    watch_deadlines = cfg.stop_after_misses is not None and math.isfinite(ttft_slo)
    late: set[int] = set()  # requests counted as misses at their deadline, still in a queue then

    def hits_on(p: _Prefill, idx: int) -> PrefixHits:
        return PrefixHits.from_tiers(full[idx], p.device.__contains__, p.host.__contains__, store.__contains__)

    def snapshot(p: _Prefill, now: float) -> PrefillInstance:
        # O(1): views over the instance's append-only log (see _Prefill), not a copy of its queue
        head = None
        if p.running is not None:
            a = p.running.actual
            dur = max(p.running.end - p.running.start, 1e-12)
            head = QueuedPrefill(a.suffix_tokens, a.cached_tokens, 0.0, min(1.0, max(0.0, (p.running.end - now) / dur)))
        return PrefillInstance(p.id, p.queue_view(head), cfg.bandwidth, True, p.inflight_view(), len(p.device),
                               p.load.totals())

    def fresh_est(p: _Prefill, job: _Job) -> QueuedPrefill:
        """``job``'s estimate with the hits it would have on ``p`` if it started now."""
        h = hits_on(p, job.idx)
        cached = max(0, min(job.req.input_length - 1, h.total * bt))
        return QueuedPrefill(job.req.input_length - cached, cached, models.transfer.fetch_s(h.host, h.store, cfg.bandwidth),
                             deadline_s=job.est.deadline_s)

    def start_next(p: _Prefill, now: float) -> None:
        nonlocal served_blocks
        if p.running is not None or not p.waiting():
            return
        if p.scheduled:
            # the instance knows its own cache when it picks: each waiting request's work as it stands now
            waiting = tuple(fresh_est(p, p.jobs[pos]) for pos in p.wait)
            k, why = pick_next(waiting, now)
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(waiting):
                raise LBInputError(f"{name}.pick_next returned {k!r} for {len(waiting)} waiting requests: it must "
                                   f"return the index of one of them")
            job = p.start(k)
            if trace is not None:
                trace[job.idx].append(f"start: {why}")
        else:
            job = p.start()
        r = job.req
        h = hits_on(p, job.idx)
        for b in full[job.idx][: h.total]:  # touch each hit block in the tier it is loaded from
            (p.device if b in p.device else p.host if b in p.host else store).touch(b)
        cached = max(0, min(r.input_length - 1, h.total * bt))  # the last token is always computed
        fetch = models.transfer.fetch_s(h.host, h.store, cfg.bandwidth)
        dur = job.model_s = fetch + models.prefill.predict(r.input_length, cached)
        dur *= cfg.service_bias
        if cfg.service_noise > 0:
            dur *= math.exp(rng.gauss(0.0, cfg.service_noise))
        job.actual = QueuedPrefill(r.input_length - cached, cached, fetch)
        cached_tok[job.idx] = cached
        job.start, job.end = now, now + dur
        p.busy += dur
        hit_blocks["device"] += h.device
        hit_blocks["host"] += h.host
        hit_blocks["store"] += h.store
        served_blocks += len(r.hash_ids)
        push(job.end, 0, p.id)

    def place_decode(idx: int, now: float) -> bool | None:
        """Place ``idx`` on a decode instance: True placed, False it waits, None it never can (refused)."""
        nonlocal misses
        r = reqs[idx]
        snaps = [DecodeInstance(d.id, d.kv_used, d.cap, d.batch_tokens, len(d.active)) for d in dec]
        slo = cfg.tbt_slo_ms if cfg.admission else None  # the request's own SLO, as the entrypoint passes it
        dd = decode_policy.choose(DecodeRequest(r.input_length, r.output_length, slo), snaps)
        if dd.chosen is None and slo is not None and not any(d.active for d in dec):
            # no finish can ever bring its TBT under the SLO: placed without it (an SLO miss)
            dd = decode_policy.choose(DecodeRequest(r.input_length, r.output_length, None), snaps)
        if dd.chosen is None:
            if any(d.active for d in dec):
                return False  # a finish may free room: wait for it
            # every instance is empty and the policy still refuses (without the SLO, when there is one):
            # nothing can ever change that, so waiting would block the line forever
            if ttft.pop(idx) <= ttft_slo:  # rejected, not served: a miss now (not already one for its TTFT)
                misses += 1
            reasons[REFUSED_BY_EMPTY_DECODE] += 1
            return None
        d = dec[dd.chosen]
        d.advance(now)
        kv = request_kv_bytes(DecodeRequest(r.input_length, r.output_length), models)  # what the policy checked
        d.join(idx, d.steps + r.output_length, r.input_length, kv, ready_at[idx])
        dwait[idx] = now - ready_at[idx]
        d.version += 1
        nf = d.next_finish()
        push(nf, 1, (d.id, d.version))
        return True

    now = 0.0  # simulated time of the last event handled (none yet: a wall bound may trip first)
    while heap:
        if time.monotonic() - wall0 > cfg.max_wall_s:
            truncated = True
            break
        if cfg.stop_after_misses is not None and misses > cfg.stop_after_misses:
            stopped = True
            break
        now, kind, _, payload = heapq.heappop(heap)
        if kind == 2:
            idx = payload
            r = reqs[idx]
            done_arrivals += 1
            if progress is not None and (done_arrivals % 50 == 0 or done_arrivals == len(reqs)):
                progress(done_arrivals, len(reqs))
            # whatever its output length: the entrypoint's max_model_len bound is prompt + max_new_tokens
            if request_kv_bytes(DecodeRequest(r.input_length, r.output_length), models) > kv_limit:
                reasons[OVER_DECODE_KV] += 1  # no decode instance could ever hold it: refused before its prefill
                misses += 1
                continue
            hits = {p.id: hits_on(p, idx) for p in pre}
            slo_ms = cfg.ttft_slo_ms if cfg.admission else None
            rr = RouteRequest(  # as production builds it: full blocks only (entrypoint/generate.py)
                r.input_length, len(full[idx]), hits, full[idx], (),
                slo_ms, cfg.tbt_slo_ms if cfg.admission else None, bt, now,
            )
            snaps = [snapshot(p, now) for p in pre]
            dcs = policy.choose(rr, snaps)
            if trace is not None:
                trace[idx] = [f"route: {dcs.reason}"]
            if dcs.chosen is None:
                reasons[dcs.reason.split(";")[0][:80]] += 1
                misses += 1
                continue
            p = pre[dcs.chosen]
            # a scheduled instance orders its queue by these estimates, so they count what the requests ahead
            # will have written by then (lb.prefill.warm_hits), as its policy did; FIFO ones show plain hits
            h = warm_hits(rr, snaps[p.id]) if p.scheduled else hits[p.id]
            cached = max(0, min(r.input_length - 1, h.total * bt))  # the last token is always computed
            fetch = models.transfer.fetch_s(h.host, h.store, cfg.bandwidth)
            est = QueuedPrefill(r.input_length - cached, cached, fetch,  # deadline: for a pick_next policy
                                deadline_s=None if slo_ms is None else now + slo_ms / 1e3)
            p.enqueue(_Job(idx, r, now, est), full[idx])
            if watch_deadlines:  # a request still waiting at its deadline is a miss already: count it then
                push(now + ttft_slo, 3, idx)
            start_next(p, now)
        elif kind == 0:
            p = pre[payload]
            job = p.running
            if job is None or p.started != p.done + 1:
                raise LBInternalError("sim bug: prefill end event for an idle instance; please report this")
            p.finish(job)  # its blocks leave the in-flight set: they are cached now
            for b in full[job.idx]:
                for ev in p.device.insert(b):
                    p.host.insert(ev)
                store.insert(b)
            ttft[job.idx] = now - job.arrival
            if observe is not None and job.model_s > 0:
                observe(p.id, job.model_s, job.end - job.start)
            misses += ttft[job.idx] > ttft_slo and job.idx not in late
            if trace is not None:
                trace[job.idx].append(f"prefill done: TTFT {ttft[job.idx]:.3f} s")
            # output_length 0: nothing to decode, the request is done (no TBT sample)
            ready_at[job.idx] = now
            if job.req.output_length > 0 and place_decode(job.idx, now) is False:
                decode_line.append(job.idx)
            start_next(p, now)
        elif kind == 3:
            if payload not in ttft:  # its prefill has not ended by its deadline
                late.add(payload)
                misses += 1
        else:
            did, version = payload
            d = dec[did]
            if version != d.version:
                continue  # stale: the batch changed since this finish time was computed
            d.advance(now)
            # this event was scheduled for the smallest target: finish_due ends it (and any within
            # rounding) unconditionally, so float error in `steps` can never re-schedule it forever
            for idx, ready in d.finish_due():
                # from prefill end (the first token), the decode-slot wait included; >= 1: 0 is never decoded
                tbt[idx] = (now - ready) / reqs[idx].output_length
                misses += tbt[idx] > tbt_slo and ttft[idx] <= ttft_slo  # a TTFT miss was counted already
            d.version += 1
            nf = d.next_finish()
            if nf is not None:
                push(nf, 1, (d.id, d.version))
            # work-conserving: every waiting request a batch now takes is placed, in line order; one that
            # does not fit holds no one behind it (placed, or refused for good: either way it leaves the line)
            decode_line = deque(i for i in decode_line if place_decode(i, now) is False)

    n = len(reqs)
    ok_ttft = sum(1 for i, v in ttft.items() if v <= ttft_slo)
    # a request with no output token has no TBT to judge: its TTFT alone decides
    ok_both = sum(1 for i, v in ttft.items()
                  if v <= ttft_slo and (reqs[i].output_length == 0 or tbt.get(i, math.inf) <= tbt_slo))
    hb = sum(hit_blocks.values())
    return SimResult(
        policy=name, requests=n, served=len(ttft), rejected=sum(reasons.values()),
        hit_ratio=hb / served_blocks if served_blocks else math.nan,  # no block listed: no ratio (n/a)
        hit_tiers={k: v / served_blocks if served_blocks else math.nan for k, v in hit_blocks.items()},
        ttft_s=tuple(ttft.values()), tbt_s=tuple(tbt.values()),
        slo_attainment=ok_both / n if n else 1.0, ttft_attainment=ok_ttft / n if n else 1.0,
        busy_s=tuple(p.busy for p in pre), sim_end_s=now,
        wall_s=time.monotonic() - wall0, truncated=truncated, reject_reasons=dict(reasons),
        arrived=done_arrivals, cached_tokens=cached_tok, decode_wait_s=tuple(dwait[i] for i in tbt),
        stopped_early=stopped, trace={} if trace is None else {i: tuple(v) for i, v in trace.items()},
    )
