"""DeepSeek's greedy EPLB, in numpy, written from its public description (the baseline).

Role
    ``lb.eplb.rebalance_experts`` starts from this plan and improves it; the
    tests and ``tools/bench_lb.py`` compare the two. Same contract as
    DeepSeek's ``eplb.rebalance_experts`` (shapes below). Pure; no I/O.

Algorithm (public description)
    * replicate: give every logical expert one replica, then repeatedly add
      a replica to the expert with the largest ``load / replicas``;
    * balanced packing: sort items heaviest first; put each into the pack
      with the least load that still has room (every pack gets the same
      number of items);
    * hierarchical (when ``num_groups % num_nodes == 0``): pack expert
      groups onto nodes, replicate experts within each node, pack the
      node's physical experts onto its GPUs; otherwise the same with one
      group and one node (global).

Shapes
    weight ``[layers, num_logical_experts]``; returns phy2log
    ``[layers, num_replicas]``, phyrank ``[layers, num_replicas]`` (which
    replica of its logical expert each slot is), logcnt
    ``[layers, num_logical_experts]``. Slot ``p`` lives on GPU
    ``p // (num_replicas // num_gpus)``.
"""

from __future__ import annotations

import operator

import numpy as np

from lb.types import LBInputError

__all__ = ["balanced_packing", "replicate_experts", "rebalance_hierarchical", "rebalance_experts_greedy",
           "check_eplb_args", "as_count"]


def as_count(name: str, v, *, minimum: int = 1) -> int:
    """``v`` as a Python int if it is an integer (``int``, a numpy integer, a 0-d integer tensor:
    anything with ``__index__``, not a bool) >= ``minimum``; else LBInputError. ``16.0`` is refused:
    numpy would fail on it deep inside, and NaN or inf would raise ValueError / OverflowError."""
    try:
        if isinstance(v, (bool, np.bool_)):
            raise TypeError("a bool is not a count")
        iv = operator.index(v)
    except TypeError as exc:
        raise LBInputError(f"{name} must be an integer >= {minimum}, got {v!r}") from exc
    if iv < minimum:
        raise LBInputError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return iv


def check_eplb_args(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
                    num_gpus: int) -> tuple[int, int, int, int]:
    """Raise LBInputError with what to fix if the EPLB arguments are inconsistent; returns the four
    counts as Python ints.

    Besides each load being finite and >= 0, each layer's *sum* must be finite: the packers add loads
    up, and a sum that overflows to inf would make every pack look equally (infinitely) full."""
    if weight.ndim != 2:
        raise LBInputError(f"weight must be [layers, num_logical_experts], got shape {weight.shape}")
    if not np.isfinite(weight).all() or (weight < 0).any():
        raise LBInputError("weight must be finite and >= 0 (expert loads)")
    layers, n_log = weight.shape
    if layers < 1 or n_log < 1:
        raise LBInputError(f"weight must have at least one layer and one logical expert, got shape {weight.shape}")
    with np.errstate(over="ignore"):
        total = weight.sum(axis=-1)
    if not np.isfinite(total).all():
        li = int(np.flatnonzero(~np.isfinite(total))[0])
        raise LBInputError(f"layer {li}'s expert loads sum to more than a float64 holds; rescale the weights")
    num_replicas, num_groups, num_nodes, num_gpus = (
        as_count(name, v) for name, v in (("num_replicas", num_replicas), ("num_groups", num_groups),
                                          ("num_nodes", num_nodes), ("num_gpus", num_gpus)))
    if num_replicas < n_log:
        raise LBInputError(f"num_replicas ({num_replicas}) must be >= num_logical_experts ({n_log})")
    if num_replicas % num_gpus:
        raise LBInputError(f"num_replicas ({num_replicas}) must be a multiple of num_gpus ({num_gpus})")
    if num_gpus % num_nodes:
        raise LBInputError(f"num_gpus ({num_gpus}) must be a multiple of num_nodes ({num_nodes})")
    if n_log % num_groups:
        raise LBInputError(f"num_logical_experts ({n_log}) must be a multiple of num_groups ({num_groups})")
    return num_replicas, num_groups, num_nodes, num_gpus


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack ``[layers, n]`` items into ``num_packs`` packs of ``n // num_packs`` items each.

    Returns (pack_index, rank_in_pack), both ``[layers, n]``.
    """
    layers, n = weight.shape
    per_pack = n // num_packs
    if per_pack * num_packs != n:
        raise LBInputError(f"{n} items do not split evenly into {num_packs} packs")
    if per_pack == 1:
        return np.tile(np.arange(n), (layers, 1)), np.zeros((layers, n), dtype=np.int64)
    pack_index = np.empty((layers, n), dtype=np.int64)
    rank = np.empty((layers, n), dtype=np.int64)
    for li in range(layers):
        loads = np.zeros(num_packs)
        counts = np.zeros(num_packs, dtype=np.int64)
        for item in np.argsort(-weight[li], kind="stable"):
            open_ = np.flatnonzero(counts < per_pack)  # a mask, not an inf sentinel: loads may be huge
            p = int(open_[np.argmin(loads[open_])])
            pack_index[li, item] = p
            rank[li, item] = counts[p]
            loads[p] += weight[li, item]
            counts[p] += 1
    return pack_index, rank


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Replicate ``[layers, n_log]`` experts into ``num_phy`` slots, max load/replicas first.

    Returns phy2log ``[layers, num_phy]``, phyrank ``[layers, num_phy]``, logcnt ``[layers, n_log]``.
    """
    layers, n_log = weight.shape
    phy2log = np.tile(np.arange(num_phy) % max(n_log, 1), (layers, 1))
    phy2log[:, :n_log] = np.arange(n_log)
    phyrank = np.zeros((layers, num_phy), dtype=np.int64)
    logcnt = np.ones((layers, n_log), dtype=np.int64)
    rows = np.arange(layers)
    for p in range(n_log, num_phy):
        e = np.argmax(weight / logcnt, axis=-1)
        phy2log[:, p] = e
        phyrank[:, p] = logcnt[rows, e]
        logcnt[rows, e] += 1
    return phy2log, phyrank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    rows = np.arange(perm.shape[0])[:, None]
    inv[rows, perm] = np.arange(perm.shape[1])[None, :]
    return inv


def rebalance_hierarchical(
    weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int, group_packing=None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Groups -> nodes, replicate within nodes, physical experts -> GPUs. Returns (phy2log, phyrank, logcnt).

    ``group_packing(group_weight [layers, groups], num_nodes) -> (pack_index, rank_in_pack)``
    replaces step 1's packer (``lb.eplb`` passes an improved one); default: :func:`balanced_packing`.
    """
    layers, n_log = weight.shape
    group_size = n_log // num_groups
    groups_per_node = num_groups // num_nodes
    phy_per_gpu = num_phy // num_gpus
    log_per_node = n_log // num_nodes
    # 1. groups onto nodes
    group_w = weight.reshape(layers, num_groups, group_size).sum(-1)
    gpack, grank = (group_packing or balanced_packing)(group_w, num_nodes)
    # log2mlog: logical expert -> "node-major" logical index (node, slot in node)
    log2mlog = ((gpack * groups_per_node + grank) * group_size)[:, :, None] + np.arange(group_size)
    log2mlog = log2mlog.reshape(layers, n_log)
    mlog2log = _inverse(log2mlog)
    # 2. replicate within each node
    w_mlog = np.take_along_axis(weight, mlog2log, -1).reshape(layers * num_nodes, log_per_node)
    phy2mlog, phyrank, mlogcnt = replicate_experts(w_mlog, num_phy // num_nodes)
    # 3. physical experts onto the node's GPUs
    w_phy = np.take_along_axis(w_mlog / mlogcnt, phy2mlog, -1)
    pack, rank = balanced_packing(w_phy, num_gpus // num_nodes)
    phy2pphy = pack * phy_per_gpu + rank
    pphy2phy = _inverse(phy2pphy)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, -1)
    pphy2mlog = (pphy2mlog.reshape(layers, num_nodes, -1) + (np.arange(num_nodes) * log_per_node)[None, :, None])
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog.reshape(layers, -1), -1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, -1).reshape(layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(layers, -1), log2mlog, -1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts_greedy(
    weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """DeepSeek's contract: returns (phy2log, log2phy, logcnt); see ``lb.eplb`` for shapes."""
    w = np.asarray(weight, dtype=np.float64)
    num_replicas, num_groups, num_nodes, num_gpus = check_eplb_args(w, num_replicas, num_groups, num_nodes, num_gpus)
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = rebalance_hierarchical(w, num_replicas, 1, 1, num_gpus)
    return phy2log, build_log2phy(phy2log, phyrank, logcnt), logcnt


def build_log2phy(phy2log: np.ndarray, phyrank: np.ndarray, logcnt: np.ndarray) -> np.ndarray:
    """``[layers, n_log, max(logcnt)]`` physical slot of each replica, padded with -1."""
    layers, n_log = logcnt.shape
    maxcnt = int(logcnt.max()) if logcnt.size else 1
    log2phy = np.full((layers, n_log * maxcnt), -1, dtype=np.int64)
    rows = np.repeat(np.arange(layers), phy2log.shape[1]).reshape(phy2log.shape)
    valid = phy2log >= 0
    slots = np.tile(np.arange(phy2log.shape[1]), (layers, 1))
    log2phy[rows[valid], (phy2log * maxcnt + phyrank)[valid]] = slots[valid]
    return log2phy.reshape(layers, n_log, maxcnt)
