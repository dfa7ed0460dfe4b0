"""Decode LB: place a request on the decode instance that keeps TBT lowest and fits in KV memory.

Role
    Called once per request after its prefill (``lb.sim`` or the
    entrypoint), with a snapshot of every decode instance. Pure; no I/O.

Rule, per healthy instance
    1. *Memory.* The request needs ``ceil((context + max_new_tokens) x
       kv_bytes_per_token)`` bytes for its whole life (:func:`request_kv_bytes`,
       whole bytes rounded up); the instance must have
       them below ``kv_capacity x memory_headroom`` (headroom keeps room for
       the running requests' growth).
    2. *Batch pressure.* TBT after admission is estimated with
       ``lb.cost_model.DecodeCostModel`` from the batch tokens and requests
       including the new one; with a TBT SLO, it must be <= the SLO.
    3. Among the instances passing 1 and 2, pick the lowest estimated TBT;
       ties go to the one with more free memory, then snapshot order.
    4. If none passes, ``Decision(None, reason)`` names how many failed each
       check and the closest instance.

Baselines in the same module: :class:`DecodeRoundRobin` and
:class:`DecodeLeastKV` (DeepSeek's V3 description: balance KV usage and
request count), both memory-checked so that they never overcommit.

Contract of a decode policy (every one here; ``lb.sim`` refuses one without both)
    ``choose(req, instances) -> Decision``: as above; may keep state (round robin's counter).
    ``kv_limit_bytes(capacity_bytes) -> float``: the most KV bytes
    (:func:`request_kv_bytes`) one request may need and still be placed, for memory, on an
    empty healthy instance of that capacity: ``choose`` refuses a request over it on an
    empty pool and never refuses one within it for memory. Pure (no state touched), so a
    caller can refuse a request no instance could ever take before spending its prefill
    (``lb.sim``'s arrival check) by the very rule placement uses.
"""

from __future__ import annotations

import math
from typing import Sequence

from lb.cost_model import CostModels, load_default
from lb.types import Decision, DecodeInstance, DecodeRequest, LBInputError, check_unique_ids

__all__ = ["KVStackDecodePolicy", "DecodeRoundRobin", "DecodeLeastKV", "request_kv_bytes"]


def request_kv_bytes(req: DecodeRequest, models: CostModels) -> int:
    """Whole bytes of KV ``req`` holds for its life: ``ceil((context + max_new_tokens) x kv_bytes_per_token)``.

    The one unit and rounding rule of decode KV (``lb.types.DecodeInstance``): every policy checks this
    figure, and whoever keeps an instance's ``kv_used_bytes`` (``lb.sim``, the entrypoint) adds this very
    integer, so the usage a policy reasoned about is the usage it sees next. Rounded up, never down: a
    floor would count less than was checked and let a full instance overcommit one byte per request.
    """
    return math.ceil((req.context_tokens + req.max_new_tokens) * models.transfer.kv_bytes_per_token)


def _live(instances: Sequence[DecodeInstance]) -> tuple[list[DecodeInstance], str | None]:
    if not instances:
        return [], "no decode instances in the snapshot"
    check_unique_ids(instances)
    live = [i for i in instances if i.healthy]
    return live, (None if live else f"all {len(instances)} decode instances are unhealthy")


class KVStackDecodePolicy:
    """Lowest post-admission TBT among instances with memory room; reject with a reason."""

    name = "kvstack"

    def __init__(self, models: CostModels | None = None, *, memory_headroom: float = 0.95) -> None:
        if not 0.0 < memory_headroom <= 1.0:
            raise LBInputError("KVStackDecodePolicy.memory_headroom must be in (0, 1]")
        self.models = models or load_default()
        self.headroom = memory_headroom

    def kv_limit_bytes(self, capacity_bytes: int) -> float:
        """The capacity less the headroom: rule 1 on an empty instance."""
        return capacity_bytes * self.headroom

    def tbt_after(self, inst: DecodeInstance, req: DecodeRequest) -> float:
        return self.models.decode.predict(inst.batch_tokens + req.context_tokens, inst.running_requests + 1)

    def choose(self, req: DecodeRequest, instances: Sequence[DecodeInstance]) -> Decision:
        live, why = _live(instances)
        if why:
            return Decision(None, why)
        need = request_kv_bytes(req, self.models)
        est = {i.id: self.tbt_after(i, req) for i in live}
        no_mem = [i for i in live if i.kv_used_bytes + need > i.kv_capacity_bytes * self.headroom]
        slo = None if req.tbt_slo_ms is None else req.tbt_slo_ms / 1e3
        slow = [i for i in live if slo is not None and est[i.id] > slo]
        bad = {i.id for i in no_mem} | {i.id for i in slow}
        ok = [i for i in live if i.id not in bad]
        if not ok:
            closest = min(live, key=lambda i: est[i.id])
            return Decision(
                None,
                f"no decode instance fits: {len(no_mem)} lack {need / 2**20:.1f} MiB of KV memory, "
                f"{len(slow)} would exceed the TBT SLO ({req.tbt_slo_ms} ms); lowest TBT would be "
                f"{est[closest.id] * 1e3:.1f} ms on {closest.id!r}",
                est,
            )
        pick = min(ok, key=lambda i: (est[i.id], i.kv_used_bytes - i.kv_capacity_bytes))
        return Decision(pick.id, f"lowest TBT {est[pick.id] * 1e3:.2f} ms with memory room", est)


class DecodeRoundRobin:
    """Next healthy instance with memory room, in snapshot order."""

    name = "round_robin"

    def __init__(self, models: CostModels | None = None) -> None:
        self.models = models or load_default()
        self._next = 0

    def kv_limit_bytes(self, capacity_bytes: int) -> float:
        """The whole capacity (no headroom)."""
        return float(capacity_bytes)

    def choose(self, req: DecodeRequest, instances: Sequence[DecodeInstance]) -> Decision:
        live, why = _live(instances)
        if why:
            return Decision(None, why)
        need = request_kv_bytes(req, self.models)
        for k in range(len(live)):
            inst = live[(self._next + k) % len(live)]
            if inst.kv_used_bytes + need <= inst.kv_capacity_bytes:
                self._next += k + 1
                return Decision(inst.id, "round robin")
        return Decision(None, f"no decode instance has {need / 2**20:.1f} MiB of KV memory free")


class DecodeLeastKV:
    """Lowest KV usage fraction, then fewest running requests (DeepSeek V3's description)."""

    name = "least_kv"

    def __init__(self, models: CostModels | None = None) -> None:
        self.models = models or load_default()

    def kv_limit_bytes(self, capacity_bytes: int) -> float:
        """The whole capacity (no headroom)."""
        return float(capacity_bytes)

    def choose(self, req: DecodeRequest, instances: Sequence[DecodeInstance]) -> Decision:
        live, why = _live(instances)
        if why:
            return Decision(None, why)
        need = request_kv_bytes(req, self.models)
        ok = [i for i in live if i.kv_used_bytes + need <= i.kv_capacity_bytes]
        if not ok:
            return Decision(None, f"no decode instance has {need / 2**20:.1f} MiB of KV memory free")
        est = {i.id: i.kv_used_bytes / i.kv_capacity_bytes for i in live}
        pick = min(ok, key=lambda i: (est[i.id], i.running_requests))
        return Decision(pick.id, f"least KV usage {est[pick.id]:.2f}", est)
