"""Prefill LB: route a request to the prefill instance with the lowest estimated TTFT, and order each
instance's queue by deadline.

Role
    The entrypoint (or ``lb.sim``) calls :meth:`KVStackPrefillPolicy.choose`
    once per request with a fresh snapshot of every prefill instance. The
    policy is pure (no I/O); its only state is the calibration of its cost
    model (:meth:`~KVStackPrefillPolicy.observe`).

The contract of a prefill policy (every one in ``lb/``; ``lb.sim`` and the entrypoint keep it)
    ``choose(req, instances) -> Decision``: required. Two hooks are optional; an owner calls them
    when the policy has them and does without them otherwise:

    * ``pick_next(waiting, now_s) -> (index, reason)``: which waiting request an idle instance
      starts (``waiting``: its :class:`~lb.types.QueuedPrefill` estimates in arrival order, each
      with ``deadline_s``; at least one). Without it an instance runs FIFO. An owner that calls
      it shows the queue in arrival order and passes ``RouteRequest.now_s``.
    * ``observe(instance_id, modelled_s, actual_s)``: after each prefill, what the cost model
      said for the work it did (its actual hits) and how long it took.

Estimate, per healthy instance (all in seconds)::

    ttft = queue_s                          # work already queued there that runs before it
         + fetch_s(host blocks, store blocks)  # missing-from-device prefix, best tier per block
         + prefill_s(prompt, cached tokens)    # the uncached suffix, via the cost model

Cache affinity per tier falls out of the estimate: a device hit costs
nothing to load, a host hit costs PCIe time, a store hit costs storage
bandwidth, a miss costs compute.

What this policy adds over Mooncake's Algorithm 1 (``lb.baselines.Mooncake``)
    1. *Cache warming behind the queue.* Blocks that requests already queued
       on an instance will write to its device cache (``inflight_blocks``)
       count as device hits there: a request that shares a prefix with one
       still in flight is sent behind it instead of recomputing the prefix
       elsewhere (the shared store only learns blocks after their prefill).
       When the warm instance's queue costs more than recomputing the prefix
       elsewhere, the estimate itself sends it to a colder instance.
    2. *System cost, not only own TTFT.* Among instances that meet the SLO
       the score is ``ttft + load_weight * work_s``, where ``work_s`` is the
       time this request adds to that instance's queue (fetch + prefill):
       every later request routed there waits for it, so cheaper work (a
       warmer cache) is preferred when TTFTs are close.
    3. *Deadline order within an instance* (:meth:`~KVStackPrefillPolicy.pick_next`).
       An idle instance starts the waiting request with the earliest
       deadline among those that can still meet it; one that can not any
       more (it waited behind a slow prefill, or never could) yields to
       them and runs when none waits, oldest first. Under FIFO such a request
       runs anyway and makes every request behind it late too; here it costs
       only itself. ``queue_s`` counts accordingly only the requests that will
       run before a new one (:func:`yielding_queue_seconds`).
    4. *Admission: reject only what can not meet its SLO anywhere, and even
       then serve it in the background when it can.* If no instance's estimate
       meets ``ttft_slo_ms``, the request goes, with ``serve_unavoidable``, to
       the instance where its whole backlog plus its own work is least, as long
       as that backlog is at most ``unavoidable_max_queue x SLO`` (it will run
       within about one SLO) or its own work there at most
       ``unavoidable_max_work x SLO`` (it blocks a request that arrives while it
       runs for little): by 3. it runs after every request that can meet its
       SLO, and its prefix is then cached for the session's next turn (rejecting
       it would leave that turn cold, and the next, in a cascade). Otherwise
       ``Decision(None, reason)``; the reason names the SLO, the best instance
       with its estimate split into queue/fetch/prefill, and the backlog and
       work that were too long.
    5. *A calibrated cost model* (:meth:`~KVStackPrefillPolicy.observe`). Every
       estimate is scaled by the observed ratio of actual to modelled service
       time (an exponentially weighted mean of its log), so a cost model that
       is 30 % optimistic or pessimistic is corrected after a few dozen
       prefills instead of over-admitting (late requests) or over-rejecting.

Every decision is explainable: ``Decision.reason`` (routing) and ``pick_next``'s reason (order)
say which rule applied and with which estimates; ``lb.sim`` keeps both in the request's trace.

Not done, on purpose: dropping a request that can still meet its SLO so that several shorter ones
meet theirs (Moore-Hodgson), which would raise the count served in time further, but would turn
long prompts away while they could be served in time. Nor replication of hot prefixes into a
second instance's host tier: with the shared store a second instance already loads a hot prefix
at store bandwidth, which the estimate prices; and on conversation traffic what bounds the count
served in time is the order within a session (a turn's prompt holds the earlier turns', so it waits
for their prefill or recomputes it), which no placement of copies changes: ``tools/bench_lb.py``'s
session ceiling, which grants every request an idle instance and a free, unbounded cache, measures it.

Guarantees
    * Never chooses an unhealthy instance; with none healthy, rejects with
      a reason.
    * If instance A is at least as good as B on every input (queue, hits,
      bandwidth) A's estimate is <= B's (the estimate is monotone), so a
      strictly better instance is never passed over.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

from lb.cost_model import CostModels, load_default
from lb.types import (
    Decision,
    LBInputError,
    PrefillInstance,
    PrefixHits,
    QueuedPrefill,
    RouteRequest,
    check_unique_ids,
)

__all__ = ["TTFTEstimate", "queue_seconds", "entry_seconds", "yielding_queue_seconds", "estimate_ttft", "warm_hits",
           "KVStackPrefillPolicy"]

_MAX_LOG_SCALE = math.log(4.0)  # the calibration never trusts a ratio beyond 4x either way


@dataclass(frozen=True, slots=True)
class TTFTEstimate:
    """One instance's TTFT estimate for one request, split into its parts (seconds)."""

    instance_id: Hashable
    queue_s: float
    fetch_s: float
    prefill_s: float
    hits: PrefixHits

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.fetch_s + self.prefill_s

    @property
    def work_s(self) -> float:
        """Time this request itself occupies the instance."""
        return self.fetch_s + self.prefill_s

    def describe(self) -> str:
        return (
            f"instance {self.instance_id!r}: ttft {self.ttft_s * 1e3:.0f} ms = queue {self.queue_s * 1e3:.0f}"
            f" + fetch {self.fetch_s * 1e3:.0f} + prefill {self.prefill_s * 1e3:.0f}"
            f" (hit blocks device/host/store {self.hits.device}/{self.hits.host}/{self.hits.store})"
        )


def entry_seconds(q: QueuedPrefill, models: CostModels) -> float:
    """Model seconds that ``q`` still occupies its instance: fetch + prefill when it waits, the rest of
    its prefill when it runs (``remaining_fraction < 1``)."""
    pre = models.prefill.predict(q.cached_tokens + q.suffix_tokens, q.cached_tokens)
    return q.fetch_s + pre if q.remaining_fraction >= 1.0 else pre * q.remaining_fraction


def queue_seconds(inst: PrefillInstance, models: CostModels, scale: float = 1.0) -> float:
    """Estimated time until ``inst`` can start a newly queued request, FIFO (model seconds x ``scale``)."""
    total = 0.0
    for q in inst.queue:
        total += entry_seconds(q, models)
    return total * scale if scale != 1.0 else total


def warm_hits(req: RouteRequest, inst: PrefillInstance) -> PrefixHits:
    """The request's hits on ``inst`` once the requests queued ahead of it have run.

    Blocks in ``inst.inflight_blocks`` become device hits; the tail of the
    prefix keeps its tiers. Needs ``req.block_hashes``; without them it
    returns the plain hits.
    """
    base = req.hit_of(inst.id)
    if not req.block_hashes or not inst.inflight_blocks:
        return base
    n = 0
    inflight = inst.inflight_blocks
    for i, bh in enumerate(req.block_hashes):
        if i < base.device or bh in inflight:
            n += 1
        else:
            break
    if n <= base.device:
        return base
    extra = n - base.device
    host = max(0, base.host - extra)
    extra -= base.host - host
    store = max(0, base.store - extra)
    return PrefixHits(n, host, store)


def yielding_queue_seconds(inst: PrefillInstance, models: CostModels, now_s: float,
                           scale: float = 1.0) -> tuple[float, float]:
    """``(on_time_s, backlog_s)`` of ``inst`` under :meth:`KVStackPrefillPolicy.pick_next`'s order.

    ``backlog_s`` is everything queued (the running request's rest included, as in
    :func:`queue_seconds`); ``on_time_s`` is only what a newly queued request (the latest deadline)
    waits for: the running request's rest, then the waiting requests in deadline order, each
    counted only if it can still start in time (``now_s + wait + its work <= its deadline``); the
    others yield to it, as ``pick_next`` runs them only when nothing that can still meet its SLO
    waits. A request without a deadline never yields. Model seconds x ``scale``.
    """
    wait = backlog = 0.0
    waiting = []
    for q in inst.queue:
        w = entry_seconds(q, models) * scale
        backlog += w
        if q.remaining_fraction < 1.0:
            wait += w  # the running request: everyone waits for its rest
        else:
            waiting.append((math.inf if q.deadline_s is None else q.deadline_s, w))
    waiting.sort(key=lambda e: e[0])  # stable: arrival order among equal deadlines
    for deadline, w in waiting:
        if now_s + wait + w <= deadline:
            wait += w
    return wait, backlog


def estimate_ttft(
    req: RouteRequest, inst: PrefillInstance, models: CostModels, *, hits: PrefixHits | None = None,
    scale: float = 1.0, queue_s: float | None = None,
) -> TTFTEstimate:
    """Queue + fetch (host/store blocks) + prefill of the suffix, for one instance.

    ``req.block_tokens`` must equal ``models.transfer.block_tokens`` (:class:`LBInputError` otherwise):
    hits count the request's blocks, a fetch is sized in the transfer model's, so a mismatch would
    cost every hit at the wrong number of bytes (the entrypoint and ``lb.sim`` give both one size).
    ``scale`` multiplies every part: the observed ratio of actual to modelled service time (1: the model).
    ``queue_s`` replaces the FIFO wait (:func:`queue_seconds`) when the caller computed another one.
    """
    if req.block_tokens != models.transfer.block_tokens:
        raise LBInputError(f"RouteRequest.block_tokens {req.block_tokens} differs from the cost model's "
                           f"transfer.block_tokens {models.transfer.block_tokens}: fetches would be sized for "
                           f"another block; give both the same block size")
    h = req.hit_of(inst.id) if hits is None else hits
    cached = req.cached_tokens(h.total)
    fetch = models.transfer.fetch_s(h.host, h.store, inst.bandwidth)
    return TTFTEstimate(
        inst.id,
        queue_seconds(inst, models, scale) if queue_s is None else queue_s,
        fetch * scale,
        models.prefill.predict(req.prompt_tokens, cached) * scale,
        h,
    )


def healthy_or_reason(instances: Sequence[PrefillInstance]) -> tuple[list, str | None]:
    """The healthy instances, or a rejection reason when there are none."""
    if not instances:
        return [], "no prefill instances in the snapshot"
    check_unique_ids(instances)
    live = [i for i in instances if i.healthy]
    if not live:
        return [], f"all {len(instances)} prefill instances are unhealthy"
    return live, None


class KVStackPrefillPolicy:
    """Lowest estimated TTFT under its own deadline order, with cache warming, a system-cost tie-break,
    background service instead of rejection, and a cost model calibrated by what it observes.

    ``load_weight`` (>= 0) scales the work term of the score (0 = pure own-TTFT, like Mooncake, but
    with warming); ``slack`` (>= 0, fraction) lets an instance whose TTFT is within ``(1 + slack)`` of
    the best win on the score; ``serve_unavoidable`` (rule 4) sends a request that can not meet its
    SLO anywhere to the background when its backlog is at most ``unavoidable_max_queue`` x the SLO or
    its work at most ``unavoidable_max_work`` x the SLO, and rejects it otherwise; ``calibration_rate`` (in [0, 1]; 0 = trust the model) is the weight
    of each observation in :attr:`scale`. Documented knobs, not magic: see the module docstring.
    """

    name = "kvstack"

    def __init__(
        self,
        models: CostModels | None = None,
        *,
        load_weight: float = 1.0,
        slack: float = 0.25,
        serve_unavoidable: bool = True,
        unavoidable_max_queue: float = 1.0,
        unavoidable_max_work: float = 0.25,
        calibration_rate: float = 0.05,
    ) -> None:
        if not all(math.isfinite(v) and v >= 0 for v in (load_weight, slack, unavoidable_max_queue,
                                                          unavoidable_max_work)):
            raise LBInputError("KVStackPrefillPolicy: load_weight, slack, unavoidable_max_queue and "
                               "unavoidable_max_work must be finite numbers >= 0")
        if not (math.isfinite(calibration_rate) and 0 <= calibration_rate <= 1):
            raise LBInputError(f"KVStackPrefillPolicy.calibration_rate must be in [0, 1], got {calibration_rate!r}")
        self.models = models or load_default()
        self.load_weight = load_weight
        self.slack = slack
        self.serve_unavoidable = serve_unavoidable
        self.unavoidable_max_queue = unavoidable_max_queue
        self.unavoidable_max_work = unavoidable_max_work
        self.calibration_rate = calibration_rate
        self._log_scale = 0.0  # EWMA of log(actual / modelled service time), see observe()

    @property
    def scale(self) -> float:
        """Observed actual / modelled service time (1.0 until :meth:`observe` says otherwise)."""
        return math.exp(self._log_scale)

    def observe(self, instance_id: Hashable, modelled_s: float, actual_s: float) -> None:
        """Feedback after a prefill ran: the cost model said ``modelled_s`` for what it did (its actual
        hits), it took ``actual_s``. Every later estimate is scaled by an exponentially weighted mean of
        the ratio, in log space (2x too slow and 2x too fast weigh the same), kept within 4x either way:
        one sample moves its log by ``calibration_rate`` of the difference. A time that is not a finite
        number > 0 carries no information and is ignored."""
        if not (math.isfinite(modelled_s) and math.isfinite(actual_s) and modelled_s > 0 and actual_s > 0):
            return
        a = self.calibration_rate
        ls = (1.0 - a) * self._log_scale + a * math.log(actual_s / modelled_s)
        self._log_scale = min(_MAX_LOG_SCALE, max(-_MAX_LOG_SCALE, ls))

    def pick_next(self, waiting: Sequence[QueuedPrefill], now_s: float) -> tuple[int, str]:
        """Which waiting request an idle instance starts: ``(index into waiting, reason)``.

        The earliest deadline among those that can still meet it if started now (no deadline: always
        can); when none can, the oldest (index 0): it is late whatever happens, and running it in
        arrival order keeps a session's turns in order. ``waiting`` is in arrival order; the caller
        passes at least one request.
        """
        if not waiting:
            raise LBInputError("pick_next needs at least one waiting request")
        scale = self.scale
        best, best_key = None, None
        for i, q in enumerate(waiting):
            w = entry_seconds(q, self.models) * scale
            if q.deadline_s is None or now_s + w <= q.deadline_s:
                key = math.inf if q.deadline_s is None else q.deadline_s
                if best_key is None or key < best_key:
                    best, best_key = i, key
        if best is None:
            return 0, f"background: none of {len(waiting)} waiting can still meet its TTFT SLO; oldest first"
        if best == 0:
            return 0, "oldest waiting request, and it can still meet its TTFT SLO"
        return best, (f"earliest deadline that can still be met; {best} older request(s) can not and yield to it")

    def _queues(self, req: RouteRequest, inst: PrefillInstance, scale: float) -> tuple[float, float]:
        """(wait of an on-time request, whole backlog) on ``inst``: deadline order when the clock is known."""
        if req.now_s is None:
            q = queue_seconds(inst, self.models, scale)
            return q, q
        return yielding_queue_seconds(inst, self.models, req.now_s, scale)

    def choose(self, req: RouteRequest, instances: Sequence[PrefillInstance]) -> Decision:
        live, why = healthy_or_reason(instances)
        if why:
            return Decision(None, why)
        scale = self.scale
        queues = {i.id: self._queues(req, i, scale) for i in live}
        ests = [estimate_ttft(req, i, self.models, hits=warm_hits(req, i), scale=scale, queue_s=queues[i.id][0])
                for i in live]
        best = min(ests, key=lambda e: e.ttft_s)
        estimates = {e.instance_id: e.ttft_s for e in ests}
        cal = "" if abs(self._log_scale) < 0.01 else f" (cost model x{scale:.2f}, as observed)"
        slo_s = None if req.ttft_slo_ms is None else req.ttft_slo_ms / 1e3
        if slo_s is not None and best.ttft_s > slo_s:
            # no instance can meet the SLO: in the background where the whole backlog is least, or rejected
            bg = min(ests, key=lambda e: (queues[e.instance_id][1] + e.work_s, e.ttft_s))
            backlog = queues[bg.instance_id][1]
            miss = (f"TTFT SLO {req.ttft_slo_ms:.0f} ms not met by any of {len(live)} healthy instances; "
                    f"best is {best.describe()}{cal}")
            limit, small = self.unavoidable_max_queue * slo_s, self.unavoidable_max_work * slo_s
            if not self.serve_unavoidable or (backlog > limit and bg.work_s > small):
                tail = (f"; background backlog {backlog * 1e3:.0f} ms on instance {bg.instance_id!r} is over "
                        f"{limit * 1e3:.0f} ms and its work there {bg.work_s * 1e3:.0f} ms over "
                        f"{small * 1e3:.0f} ms" if self.serve_unavoidable else "")
                return Decision(None, miss + tail, estimates)
            return Decision(bg.instance_id,
                            f"background: {miss}; queued on instance {bg.instance_id!r} (backlog "
                            f"{backlog * 1e3:.0f} ms) behind every request that can meet its SLO, so that its "
                            f"prefix is cached for the session's next turn", estimates)
        bound = best.ttft_s * (1.0 + self.slack)
        if slo_s is not None:
            bound = min(bound, slo_s)
        # every estimate within the bound competes on ttft + load_weight * work (ties: ttft, then order)
        pool = [e for e in ests if e.ttft_s <= bound]
        pick = min(pool, key=lambda e: (e.ttft_s + self.load_weight * e.work_s, e.ttft_s))
        return Decision(pick.instance_id, f"lowest ttft+work score; {pick.describe()}{cal}", estimates)
