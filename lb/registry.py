"""Registry of load-balancing policies by name (no if/elif chains on names).

Role
    ``tools/replay_trace.py``, the entrypoint and the tests look policies up
    here. ``POLICIES`` maps a prefill policy name to a factory
    ``factory(models: CostModels | None = None, **params) -> policy``;
    ``DECODE_POLICIES`` and ``VE_POLICIES`` do the same for the other LBs.
    :func:`get_policy` builds one, and raises
    :class:`lb.types.UnknownPolicyError` (a ``ValueError``) listing the
    known names when the name is not registered. Every call returns a new
    object (round robin keeps a counter), so callers never share state.
"""

from __future__ import annotations

from typing import Any, Callable

from lb.baselines import DynamoCost, LeastLoaded, Mooncake, RoundRobin, SGLangCacheAware
from lb.cost_model import CostModels
from lb.decode import DecodeLeastKV, DecodeRoundRobin, KVStackDecodePolicy
from lb.prefill import KVStackPrefillPolicy
from lb.types import LBInputError, UnknownPolicyError
from lb.ve import KVStackVEPolicy, VELeastQueue

__all__ = ["POLICIES", "DECODE_POLICIES", "VE_POLICIES", "KINDS", "BASELINES", "get_policy", "register"]

Factory = Callable[..., Any]

#: Prefill LB policies (the ones the trace replay compares).
POLICIES: dict[str, Factory] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "sglang": SGLangCacheAware,
    "dynamo": DynamoCost,
    "mooncake": Mooncake,
    "kvstack": KVStackPrefillPolicy,
}

#: Names in POLICIES that are baselines (everything but ours).
BASELINES: tuple[str, ...] = ("round_robin", "least_loaded", "sglang", "dynamo", "mooncake")

DECODE_POLICIES: dict[str, Factory] = {
    "kvstack": KVStackDecodePolicy,
    "round_robin": DecodeRoundRobin,
    "least_kv": DecodeLeastKV,
}

VE_POLICIES: dict[str, Factory] = {
    "kvstack": KVStackVEPolicy,
    "least_queue": VELeastQueue,
}

KINDS: dict[str, dict[str, Factory]] = {"prefill": POLICIES, "decode": DECODE_POLICIES, "ve": VE_POLICIES}


def register(name: str, factory: Factory, *, kind: str = "prefill") -> None:
    """Add a policy; re-registering a name is misuse (pick another name)."""
    table = KINDS.get(kind)
    if table is None:
        raise LBInputError(f"unknown policy kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}")
    if name in table:
        raise LBInputError(f"{kind} policy {name!r} is already registered")
    table[name] = factory


def get_policy(name: str, models: CostModels | None = None, *, kind: str = "prefill", **params: Any) -> Any:
    """Build the policy registered as ``name`` for ``kind`` ('prefill', 'decode' or 've')."""
    table = KINDS.get(kind)
    if table is None:
        raise LBInputError(f"unknown policy kind {kind!r}; known kinds: {', '.join(sorted(KINDS))}")
    try:
        factory = table[name]
    except KeyError:
        raise UnknownPolicyError(
            f"unknown {kind} policy {name!r}; known: {', '.join(sorted(table))}"
        ) from None
    return factory(models, **params)
