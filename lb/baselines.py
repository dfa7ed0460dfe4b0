"""Baseline prefill routers, written from their public descriptions (see FACTS.md).

Role
    The peers that ``lb.prefill.KVStackPrefillPolicy`` is compared against in
    ``tools/replay_trace.py`` and the tests. Each class has the same
    interface as every prefill policy: ``choose(req, instances) -> Decision``,
    registered by name in ``lb.registry``. They read only what their public
    description says they read:

    ============== ===========================================================
    round_robin    next healthy instance in snapshot order, ignoring everything else
    least_loaded   fewest pending prefill tokens (queued + rest of running)
    sglang         SGLang router: if loads are imbalanced ((max - min) > 64
                   and max > 1.5 x min, load = queued requests) -> shortest
                   queue; else if the best device-cache match ratio > 0.3 ->
                   the best match; else the instance with the smallest tree
                   (least routed to it), ties by load. The match is against its
                   own approximate tree of what it routed where (sgl-router
                   inserts a request's prefix for its worker when it routes
                   it, and prunes the tree by size), not the instance's cache
    dynamo         Dynamo KV router: cost = w x (uncached prefill blocks of
                   this request, device cache only) + (active blocks already
                   on the instance); lowest wins
    mooncake       Mooncake Algorithm 1: TTFT = transfer of the missing
                   prefix + queueing + prefill of the rest; lowest wins;
                   reject when the TTFT SLO can not be met
    ============== ===========================================================

    Cost per decision: ``least_loaded`` and ``dynamo`` read
    ``PrefillInstance.pending_tokens`` / ``queued_blocks``, O(1) per instance
    when the snapshot carries ``QueueTotals`` (``lb.sim`` does), a walk of
    the queue otherwise; the same numbers either way (see ``lb.types``).
    ``mooncake`` (like ``kvstack``) still walks every queue in
    ``queue_seconds``: a float sum of model predictions, whose value depends
    on its order, so no running total can reproduce it bit for bit.

    Deviations, on purpose: "active blocks" for Dynamo are the KV blocks of
    the requests queued on the prefill instance (our snapshot has no decode
    side on a prefill instance); SGLang's tree is one of block hashes (the
    simulator's unit), and a request without block hashes is matched against
    the device cache, the smallest tree then being ``device_blocks_used``. Only
    ``mooncake`` does admission control; the others reject only when no
    instance is healthy.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from numbers import Real
from typing import Sequence

from lb.cost_model import CostModels, load_default
from lb.prefill import estimate_ttft, healthy_or_reason
from lb.types import Decision, LBInputError, PrefillInstance, RouteRequest

__all__ = ["RoundRobin", "LeastLoaded", "SGLangCacheAware", "DynamoCost", "Mooncake"]


def _knob(owner: str, name: str, value, hi: float = math.inf) -> float:
    """``value`` if it is a finite real number (not a bool) in ``[0, hi]``, else LBInputError: a NaN
    threshold compares false with everything and would silently switch its rule off."""
    if isinstance(value, bool) or not isinstance(value, Real) or not (math.isfinite(value) and 0 <= value <= hi):
        bound = f"in [0, {hi:g}]" if math.isfinite(hi) else ">= 0"
        raise LBInputError(f"{owner}.{name} must be a finite number {bound}, got {value!r}")
    return value


class RoundRobin:
    """Cycle over healthy instances in snapshot order (the only state is a counter).

    Snapshot order, not id order: ids are any hashable (not always sortable), and every other
    policy breaks ties in snapshot order too; a caller that wants id order passes the snapshot
    sorted (``lb.sim`` lists instances by id)."""

    name = "round_robin"

    def __init__(self, models: CostModels | None = None) -> None:
        self._next = 0

    def choose(self, req: RouteRequest, instances: Sequence[PrefillInstance]) -> Decision:
        live, why = healthy_or_reason(instances)
        if why:
            return Decision(None, why)
        pick = live[self._next % len(live)]
        self._next += 1
        return Decision(pick.id, "round robin")


class LeastLoaded:
    """Fewest pending prefill tokens; ties by snapshot order."""

    name = "least_loaded"

    def __init__(self, models: CostModels | None = None) -> None:
        pass

    def choose(self, req: RouteRequest, instances: Sequence[PrefillInstance]) -> Decision:
        live, why = healthy_or_reason(instances)
        if why:
            return Decision(None, why)
        est = {i.id: float(i.pending_tokens) for i in live}  # O(1) each with QueueTotals
        pick = min(live, key=lambda i: est[i.id])
        return Decision(pick.id, f"least pending tokens ({est[pick.id]:.0f})", est)


class SGLangCacheAware:
    """SGLang router's cache-aware policy with its imbalance fallback."""

    name = "sglang"

    def __init__(
        self,
        models: CostModels | None = None,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_blocks: int = 1 << 20,
    ) -> None:
        self.cache_threshold = _knob("SGLangCacheAware", "cache_threshold", cache_threshold, 1.0)
        self.balance_abs_threshold = _knob("SGLangCacheAware", "balance_abs_threshold", balance_abs_threshold)
        self.balance_rel_threshold = _knob("SGLangCacheAware", "balance_rel_threshold", balance_rel_threshold)
        self.max_tree_blocks = int(_knob("SGLangCacheAware", "max_tree_blocks", max_tree_blocks))
        # Its approximate tree: per instance, the prefix blocks of the requests routed there, least
        # recently routed first, pruned to max_tree_blocks (block hashes are chained: a block's hash
        # names its whole prefix, so a set of them is the tree). State of the router, as sgl-router's.
        self._tree: dict[object, OrderedDict] = {}

    def _match(self, req: RouteRequest, inst: PrefillInstance) -> int:
        """Blocks of ``req``'s prefix in ``inst``'s tree; without block hashes, its device hit."""
        if not req.block_hashes:
            return req.hit_of(inst.id).device
        tree = self._tree.get(inst.id, ())
        n = 0
        for bh in req.block_hashes:
            if bh not in tree:
                break
            n += 1
        return n

    def _insert(self, req: RouteRequest, inst_id: object) -> None:
        tree = self._tree.setdefault(inst_id, OrderedDict())
        for bh in req.block_hashes:
            tree[bh] = None
            tree.move_to_end(bh)
        while len(tree) > self.max_tree_blocks:
            tree.popitem(last=False)

    def choose(self, req: RouteRequest, instances: Sequence[PrefillInstance]) -> Decision:
        live, why = healthy_or_reason(instances)
        if why:
            return Decision(None, why)
        loads = {i.id: i.queued_requests for i in live}
        lo, hi = min(loads.values()), max(loads.values())
        if hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo:
            pick = min(live, key=lambda i: loads[i.id])
            d = Decision(pick.id, f"imbalanced (max {hi}, min {lo}): shortest queue", dict(loads))
        else:
            denom = max(1, req.prompt_tokens)
            ratio = {i.id: req.cached_tokens(self._match(req, i)) / denom for i in live}
            best = max(live, key=lambda i: (ratio[i.id], -loads[i.id]))
            if ratio[best.id] > self.cache_threshold:
                d = Decision(best.id, f"cache match {ratio[best.id]:.2f} > {self.cache_threshold}",
                             {k: -v for k, v in ratio.items()})
            else:
                size = {i.id: len(self._tree.get(i.id, ())) if req.block_hashes else i.device_blocks_used
                        for i in live}
                pick = min(live, key=lambda i: (size[i.id], loads[i.id]))
                d = Decision(pick.id, "no good match: smallest tree", {k: -v for k, v in ratio.items()})
        self._insert(req, d.chosen)
        return d


class DynamoCost:
    """Dynamo KV router: ``w * uncached blocks + active blocks``, lowest wins."""

    name = "dynamo"

    def __init__(self, models: CostModels | None = None, *, overlap_weight: float = 1.0) -> None:
        _knob("DynamoCost", "overlap_weight", overlap_weight)
        self.w = overlap_weight

    def choose(self, req: RouteRequest, instances: Sequence[PrefillInstance]) -> Decision:
        live, why = healthy_or_reason(instances)
        if why:
            return Decision(None, why)
        bt = req.block_tokens
        cost = {}
        for i in live:
            uncached = req.num_blocks - req.hit_of(i.id).device
            active = i.queued_blocks(bt)  # O(1) when the snapshot carries QueueTotals
            cost[i.id] = self.w * uncached + active
        pick = min(live, key=lambda i: cost[i.id])
        return Decision(pick.id, f"lowest Dynamo cost {cost[pick.id]:.1f}", cost)


class Mooncake:
    """Mooncake Algorithm 1: lowest TTFT = transfer + queue + prefill; reject if over the SLO."""

    name = "mooncake"

    def __init__(self, models: CostModels | None = None) -> None:
        self.models = models or load_default()

    def choose(self, req: RouteRequest, instances: Sequence[PrefillInstance]) -> Decision:
        live, why = healthy_or_reason(instances)
        if why:
            return Decision(None, why)
        ests = [estimate_ttft(req, i, self.models) for i in live]
        best = min(ests, key=lambda e: e.ttft_s)
        estimates = {e.instance_id: e.ttft_s for e in ests}
        if req.ttft_slo_ms is not None and best.ttft_s * 1e3 > req.ttft_slo_ms:
            return Decision(None, f"TTFT SLO {req.ttft_slo_ms:.0f} ms not met; best is {best.describe()}", estimates)
        return Decision(best.instance_id, f"lowest TTFT; {best.describe()}", estimates)
