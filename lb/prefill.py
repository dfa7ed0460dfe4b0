"""Prefill LB: route a request to the prefill instance with the lowest estimated TTFT.

Role
    The entrypoint (or ``lb.sim``) calls :meth:`KVStackPrefillPolicy.choose`
    once per request with a fresh snapshot of every prefill instance. The
    policy is pure: the only state it keeps is none (the snapshot carries the
    queue); it never performs I/O.

Estimate, per healthy instance (all in seconds)::

    ttft = queue_s                          # work already queued there
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
    2. *System cost, not only own TTFT.* Among instances that meet the SLO
       the score is ``ttft + load_weight * work_s``, where ``work_s`` is the
       time this request adds to that instance's queue (fetch + prefill):
       every later request routed there waits for it, so cheaper work (a
       warmer cache) is preferred when TTFTs are close. Routing a prefix to
       the instance that already holds it keeps it warm for the next turn.
    3. *Admission control.* If no instance's estimate meets ``ttft_slo_ms``
       the decision is ``Decision(None, reason)``, the reason naming the best
       instance and its estimate split into queue/fetch/prefill. Exception
       (``serve_unavoidable``): when the miss is intrinsic (even an idle
       instance would exceed the SLO: a long cold prompt) and the best
       instance's queue is short (``<= unavoidable_max_queue x SLO``), the
       request is served anyway: rejecting it would also keep its prefix out
       of every cache, so each later turn of the same session would be cold
       and rejected in turn (a cascade seen on the Mooncake trace).

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
    RouteRequest,
    check_unique_ids,
)

__all__ = ["TTFTEstimate", "queue_seconds", "estimate_ttft", "warm_hits", "KVStackPrefillPolicy"]


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


def queue_seconds(inst: PrefillInstance, models: CostModels) -> float:
    """Estimated time until ``inst`` can start a newly queued request."""
    total = 0.0
    for q in inst.queue:
        pre = models.prefill.predict(q.cached_tokens + q.suffix_tokens, q.cached_tokens)
        if q.remaining_fraction >= 1.0:
            total += q.fetch_s + pre
        else:
            total += pre * q.remaining_fraction
    return total


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


def estimate_ttft(
    req: RouteRequest, inst: PrefillInstance, models: CostModels, *, hits: PrefixHits | None = None
) -> TTFTEstimate:
    """Queue + fetch (host/store blocks) + prefill of the suffix, for one instance.

    ``req.block_tokens`` must equal ``models.transfer.block_tokens`` (:class:`LBInputError` otherwise):
    hits count the request's blocks, a fetch is sized in the transfer model's, so a mismatch would
    cost every hit at the wrong number of bytes (the entrypoint and ``lb.sim`` give both one size).
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
        queue_seconds(inst, models),
        fetch,
        models.prefill.predict(req.prompt_tokens, cached),
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
    """Lowest estimated TTFT, with cache warming, a system-cost tie-break and admission control.

    ``load_weight`` (>= 0) scales the work term of the score (0 = pure
    own-TTFT, like Mooncake, but with warming); ``slack`` (>= 0, fraction)
    lets an instance whose TTFT is within ``(1 + slack)`` of the best win on
    the score. Both are documented knobs, not magic: see the module docstring.
    """

    name = "kvstack"

    def __init__(
        self,
        models: CostModels | None = None,
        *,
        load_weight: float = 1.0,
        slack: float = 0.25,
        serve_unavoidable: bool = True,
        unavoidable_max_queue: float = 0.25,
    ) -> None:
        if not all(math.isfinite(v) and v >= 0 for v in (load_weight, slack, unavoidable_max_queue)):
            raise LBInputError("KVStackPrefillPolicy: load_weight, slack and unavoidable_max_queue must be "
                               "finite numbers >= 0")
        self.models = models or load_default()
        self.load_weight = load_weight
        self.slack = slack
        self.serve_unavoidable = serve_unavoidable
        self.unavoidable_max_queue = unavoidable_max_queue

    def choose(self, req: RouteRequest, instances: Sequence[PrefillInstance]) -> Decision:
        live, why = healthy_or_reason(instances)
        if why:
            return Decision(None, why)
        ests = [estimate_ttft(req, i, self.models, hits=warm_hits(req, i)) for i in live]
        best_ttft = min(e.ttft_s for e in ests)
        estimates = {e.instance_id: e.ttft_s for e in ests}
        slo_s = None if req.ttft_slo_ms is None else req.ttft_slo_ms / 1e3
        bound = best_ttft * (1.0 + self.slack)
        if slo_s is not None and best_ttft > slo_s:
            best = min(ests, key=lambda e: e.ttft_s)
            unavoidable = min(e.work_s for e in ests) > slo_s
            if not (unavoidable and self.serve_unavoidable and best.queue_s <= self.unavoidable_max_queue * slo_s):
                return Decision(
                    None,
                    f"TTFT SLO {req.ttft_slo_ms:.0f} ms not met by any of {len(live)} healthy instances; "
                    f"best is {best.describe()}",
                    estimates,
                )
            # the miss is intrinsic (even an idle instance can not meet the SLO): serve it anyway while
            # queues are short, because its KV seeds the caches for the session's next turns
        elif slo_s is not None:
            bound = min(bound, slo_s)
        # every estimate within the bound competes on ttft + load_weight * work (ties: ttft, then order)
        pool = [e for e in ests if e.ttft_s <= bound] or [min(ests, key=lambda e: e.ttft_s)]
        pick = min(pool, key=lambda e: (e.ttft_s + self.load_weight * e.work_s, e.ttft_s))
        return Decision(pick.instance_id, f"lowest ttft+work score; {pick.describe()}", estimates)
