"""EPLB: replicate hot MoE experts and place the replicas so every GPU gets an equal share of load.

Role
    Called offline/periodically by whoever re-shards experts (the engine's
    EP runtime) with the expert loads measured per layer; pure numpy, no I/O.
    Same contract and shapes as DeepSeek's public ``eplb.rebalance_experts``:

    * ``weight``  ``[layers, num_logical_experts]`` load per logical expert
      (numpy array, torch tensor or nested lists; converted with np.asarray);
    * returns ``phy2log`` ``[layers, num_replicas]`` (the logical expert in
      each physical slot; slot ``p`` lives on GPU ``p // (num_replicas //
      num_gpus)``), ``log2phy`` ``[layers, num_logical_experts,
      max_replicas]`` (the slots of each expert's replicas, padded with
      -1), ``logcnt`` ``[layers, num_logical_experts]`` (replica counts).
      All returned as ``np.int64`` numpy arrays.

Algorithm
    1. Run DeepSeek's greedy plan (``lb.eplb_greedy``): hierarchical when
       ``num_groups % num_nodes == 0`` (groups -> nodes, replicate within
       nodes, replicas -> GPUs), global otherwise.
    2. Improve each layer by local search on the most loaded GPU ``g``:
       a. *swap* a slot on ``g`` with a lighter slot on another GPU;
       b. *re-split*: turn one replica of a cooler expert ``x`` (with >= 2
          replicas) into one more replica of an expert ``y`` on ``g``; all
          replicas of ``x`` and ``y`` change load (``w / count``);
       c. *donate*: turn a slot on ``g`` holding an expert with >= 2 replicas
          into a replica of another expert (the slot stays on ``g``).
       The best move is applied only if every GPU it touches ends strictly
       below the current maximum, so the sorted load vector strictly
       decreases and the search terminates. In hierarchical mode moves stay
       inside a node (an expert's replicas never leave its group's node, as
       in the greedy plan). Slots per GPU never change.
       Step 2 runs from several starts: the greedy plan; the greedy's replica
       counts re-packed heaviest-first so that no GPU holds two replicas of
       one expert (the greedy packer may stack them, making one heavy item);
       and, with several groups per node, the greedy pipeline run on a
       group -> node packing improved by group swaps between nodes.
    3. Keep, per layer, whichever plan (greedy or improved) has the lower
       maximum GPU load: ours is never worse than the greedy by construction.

Dead GPUs / nodes
    ``dead_gpus`` (GPU indices) and ``dead_nodes`` (node indices: all their
    GPUs; each a list, tuple, set, range, numpy array or torch tensor of
    integers in range, else :class:`lb.types.LBInputError`) are planned around: the problem is solved over the live GPUs
    only (hierarchical over the live nodes when the dead GPUs are whole
    nodes and the groups still divide evenly, global otherwise), and the
    dead GPUs' slots hold **-1** in ``phy2log`` (no expert; ``log2phy``
    never points at them; ``logcnt`` counts live replicas). Every logical
    expert keeps >= 1 replica on a live GPU; too few live slots raises
    :class:`lb.types.LBInputError` saying how many are needed.

Worked example (DeepSeek's README input; greedy's phy2log is identical to
DeepSeek's published output)::

    >>> import numpy as np
    >>> from lb.eplb import rebalance_experts, balancedness
    >>> from lb.eplb_greedy import rebalance_experts_greedy
    >>> w = np.array([[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    ...               [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]])
    >>> g, _, _ = rebalance_experts_greedy(w, 16, 4, 2, 8)
    >>> g[0].tolist()
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1]
    >>> p, l2p, cnt = rebalance_experts(w, 16, 4, 2, 8)
    >>> p.shape, l2p.shape, cnt.shape
    ((2, 16), (2, 12, 2), (2, 12))
    >>> balancedness(w, p, 8) >= balancedness(w, g, 8)
    True
    >>> p, _, _ = rebalance_experts(w, 16, 4, 2, 8, dead_gpus={3})
    >>> p[0, 6:8].tolist()                  # GPU 3's two slots are empty
    [-1, -1]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from numbers import Integral

import numpy as np

from lb.eplb_greedy import as_count, balanced_packing, build_log2phy, check_eplb_args, rebalance_hierarchical
from lb.types import LBInputError, LBInternalError

__all__ = ["rebalance_experts", "balancedness", "gpu_loads", "phy_ranks", "EPLBStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EPLBStats:
    """What the local search did on one call (for benchmarks and logs)."""

    layers_improved: int
    moves: int
    greedy_balancedness: float
    balancedness: float


def phy_ranks(phy2log: np.ndarray) -> np.ndarray:
    """For each slot, which replica (0, 1, ...) of its logical expert it is, in slot order; -1 slots get 0."""
    layers, s = phy2log.shape
    rank = np.zeros((layers, s), dtype=np.int64)
    for li in range(layers):
        order = np.argsort(phy2log[li], kind="stable")
        keys = phy2log[li, order]
        start = np.r_[0, np.flatnonzero(np.diff(keys)) + 1]
        first = np.repeat(start, np.diff(np.r_[start, s]))
        rank[li, order] = np.arange(s) - first
    return np.where(phy2log >= 0, rank, 0)


def gpu_loads(weight, phy2log: np.ndarray, num_gpus: int) -> np.ndarray:
    """``[layers, num_gpus]`` load per GPU (each replica carries ``w / replicas``); dead GPUs: NaN."""
    w = np.asarray(weight, dtype=np.float64)
    phy2log = np.asarray(phy2log)
    layers, s = phy2log.shape
    per_gpu = s // num_gpus
    valid = phy2log >= 0
    idx = np.where(valid, phy2log, 0)
    cnt = np.zeros_like(w)
    rows = np.repeat(np.arange(layers), s).reshape(layers, s)
    np.add.at(cnt, (rows[valid], idx[valid]), 1)
    slot = np.where(valid, np.take_along_axis(w, idx, -1) / np.maximum(np.take_along_axis(cnt, idx, -1), 1), 0.0)
    loads = slot.reshape(layers, num_gpus, per_gpu).sum(-1)
    alive = valid.reshape(layers, num_gpus, per_gpu).any(-1)
    return np.where(alive, loads, np.nan)


def balancedness(weight, phy2log: np.ndarray, num_gpus: int, *, per_layer: bool = False):
    """mean GPU load / max GPU load over live GPUs (1.0 = perfect); averaged over layers unless per_layer."""
    loads = gpu_loads(weight, phy2log, num_gpus)
    mx = np.nanmax(loads, axis=-1)
    b = np.where(mx > 0, np.nanmean(loads, axis=-1) / np.where(mx > 0, mx, 1.0), 1.0)
    return b if per_layer else float(b.mean())


class _Layer:
    """Mutable search state for one layer (private; ``_improve_layer`` drives it).

    Invariants: ``nslot[e, g]`` = slots of expert e on GPU g; ``cnt[e]`` =
    nslot[e].sum() >= 1; ``loads[g]`` = sum of w[e]/cnt[e] over g's slots.
    """

    def __init__(self, w: np.ndarray, phy2log: np.ndarray, num_gpus: int, domain: np.ndarray) -> None:
        self.w = w
        self.p = phy2log.copy()
        self.G = num_gpus
        self.k = len(phy2log) // num_gpus
        self.gpu_of = np.arange(len(phy2log)) // self.k
        self.domain = domain  # [G] domain (node) id of each GPU; moves stay in a domain
        n = len(w)
        self.nslot = np.zeros((n, num_gpus), dtype=np.int64)
        np.add.at(self.nslot, (self.p, self.gpu_of), 1)
        self.cnt = self.nslot.sum(1)
        self.expert_domain = np.full(n, -1)
        self.expert_domain[self.p] = domain[self.gpu_of]
        self.recompute()

    def recompute(self) -> None:
        per = self.w / self.cnt
        self.loads = (self.nslot * per[:, None]).sum(0)

    def best_swap(self, g: int) -> tuple[float, tuple | None]:
        per = self.w / self.cnt
        a_slots = np.flatnonzero(self.gpu_of == g)
        b_mask = (self.gpu_of != g) & (self.domain[self.gpu_of] == self.domain[g])
        b_slots = np.flatnonzero(b_mask)
        if len(b_slots) == 0:
            return np.inf, None
        sa = per[self.p[a_slots]][:, None]
        sb = per[self.p[b_slots]][None, :]
        gb = self.gpu_of[b_slots][None, :]
        val = np.maximum(self.loads[g] - sa + sb, self.loads[gb] + sa - sb)
        val = np.where(self.p[a_slots][:, None] == self.p[b_slots][None, :], np.inf, val)
        i, j = np.unravel_index(int(np.argmin(val)), val.shape)
        return float(val[i, j]), ("swap", int(a_slots[i]), int(b_slots[j]))

    def best_resplit(self, g: int) -> tuple[float, tuple | None]:
        w, cnt, N = self.w, self.cnt, self.nslot
        per = w / cnt
        # donors: experts with >= 2 replicas; their remaining replicas each carry w/(c-1)
        donor = cnt >= 2
        dx = np.where(donor, w / np.maximum(cnt - 1, 1) - per, 0.0)  # change per remaining x slot
        best = (np.inf, None)
        for y in np.unique(self.p[self.gpu_of == g]):
            dy = w[y] / (cnt[y] + 1) - per[y]
            base = self.loads + N[y] * dy  # y's slots get lighter
            ok = donor.copy()
            ok[y] = False
            ok &= self.expert_domain == self.expert_domain[y]
            xs = np.flatnonzero(ok)
            if len(xs) == 0:
                continue
            M = base[None, :] + N[xs] * dx[xs][:, None]  # [X, G] loads after x loses a replica (before the slot flips)
            add = w[y] / (cnt[y] + 1) - w[xs] / (cnt[xs] - 1)  # the donor slot flips from x to y
            top = np.argmax(M, axis=1)
            m1 = M[np.arange(len(xs)), top]
            M2 = M.copy()
            M2[np.arange(len(xs)), top] = -np.inf
            m2 = M2.max(axis=1)
            excl = np.where(np.arange(self.G)[None, :] == top[:, None], m2[:, None], m1[:, None])
            val = np.maximum(excl, M + add[:, None])
            val = np.where(N[xs] > 0, val, np.inf)
            i, gg = np.unravel_index(int(np.argmin(val)), val.shape)
            if val[i, gg] < best[0]:
                best = (float(val[i, gg]), ("resplit", int(y), int(xs[i]), int(gg)))
        return best

    def best_donate(self, g: int) -> tuple[float, tuple | None]:
        """A slot on ``g`` holding expert x (>= 2 replicas) becomes a replica of another expert y."""
        w, cnt, N = self.w, self.cnt, self.nslot
        per = w / cnt
        best = (np.inf, None)
        for x in np.unique(self.p[self.gpu_of == g]):
            if cnt[x] < 2:
                continue
            base = self.loads + N[x] * (w[x] / (cnt[x] - 1) - per[x])
            ok = self.expert_domain == self.expert_domain[x]
            ok[x] = False
            ys = np.flatnonzero(ok)
            if len(ys) == 0:
                continue
            M = base[None, :] + N[ys] * (w[ys] / (cnt[ys] + 1) - per[ys])[:, None]  # [Y, G]
            M[:, g] += w[ys] / (cnt[ys] + 1) - w[x] / (cnt[x] - 1)  # g's x slot becomes a y slot
            val = M.max(axis=1)
            i = int(np.argmin(val))
            if val[i] < best[0]:
                best = (float(val[i]), ("resplit", int(ys[i]), int(x), int(g)))
        return best

    def apply(self, move: tuple) -> None:
        if move[0] == "swap":
            _, a, b = move
            ea, eb = self.p[a], self.p[b]
            ga, gb = self.gpu_of[a], self.gpu_of[b]
            self.p[a], self.p[b] = eb, ea
            self.nslot[ea, ga] -= 1
            self.nslot[eb, gb] -= 1
            self.nslot[ea, gb] += 1
            self.nslot[eb, ga] += 1
        else:
            _, y, x, gg = move
            slots = np.flatnonzero((self.p == x) & (self.gpu_of == gg))
            s = int(slots[0])
            self.p[s] = y
            self.nslot[x, gg] -= 1
            self.nslot[y, gg] += 1
            self.cnt[x] -= 1
            self.cnt[y] += 1
        self.recompute()


def _improve_layer(w: np.ndarray, phy2log: np.ndarray, num_gpus: int, domain: np.ndarray,
                   max_moves: int) -> tuple[np.ndarray, int]:
    if w.sum() <= 0:
        return phy2log, 0
    st = _Layer(w, phy2log, num_gpus, domain)
    moves = 0
    while moves < max_moves:
        g = int(np.argmax(st.loads))
        cur = st.loads[g]
        eps = 1e-12 * max(cur, 1e-300)
        v1, m1 = st.best_swap(g)
        v2, m2 = st.best_resplit(g)
        v3, m3 = st.best_donate(g)
        val, mv = min(((v1, m1), (v2, m2), (v3, m3)), key=lambda c: c[0])
        if mv is None or not val < cur - eps:
            break
        st.apply(mv)
        moves += 1
    return st.p, moves


def _repack_distinct(w: np.ndarray, phy2log: np.ndarray, num_gpus: int, domain: np.ndarray) -> np.ndarray:
    """Re-pack one layer's slots heaviest first onto the least-loaded GPU of the same domain that has
    room and does not yet hold that expert (two replicas of one expert on one GPU are one heavy item)."""
    k = len(phy2log) // num_gpus
    cnt = np.bincount(phy2log, minlength=len(w))
    per = w / np.maximum(cnt, 1)
    out = np.empty_like(phy2log)
    gpu_of = np.arange(len(phy2log)) // k
    for dom in np.unique(domain):
        gpus = np.flatnonzero(domain == dom)
        items = phy2log[np.isin(gpu_of, gpus)]
        items = items[np.argsort(-per[items], kind="stable")]
        loads = np.zeros(len(gpus))
        fill = np.zeros(len(gpus), dtype=np.int64)
        held: list[set] = [set() for _ in gpus]
        for e in items:
            room = fill < k
            fresh = room & np.array([e not in h for h in held])
            cand = np.flatnonzero(fresh if fresh.any() else room)  # a mask, not an inf sentinel
            j = int(cand[np.argmin(loads[cand])])
            out[gpus[j] * k + fill[j]] = e
            loads[j] += per[e]
            fill[j] += 1
            held[j].add(int(e))
    return out


def _improved_group_packing(group_w: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy group -> node packing, then swap groups between the heaviest node and others while the
    pair's larger load drops below the current maximum (equal groups per node kept)."""
    pack, _ = balanced_packing(group_w, num_nodes)
    layers, n = group_w.shape
    for li in range(layers):
        for _ in range(4 * n):
            loads = np.bincount(pack[li], weights=group_w[li], minlength=num_nodes)
            m = int(np.argmax(loads))
            a = np.flatnonzero(pack[li] == m)
            b = np.flatnonzero(pack[li] != m)
            if len(b) == 0:
                break
            wa, wb = group_w[li, a][:, None], group_w[li, b][None, :]
            val = np.maximum(loads[m] - wa + wb, loads[pack[li, b]][None, :] + wa - wb)
            i, j = np.unravel_index(int(np.argmin(val)), val.shape)
            if not val[i, j] < loads[m] * (1 - 1e-12):
                break
            pack[li, a[i]], pack[li, b[j]] = pack[li, b[j]], m
    rank = np.zeros_like(pack)
    for li in range(layers):
        for nd in range(num_nodes):
            idx = np.flatnonzero(pack[li] == nd)
            rank[li, idx] = np.arange(len(idx))
    return pack, rank


def _plan(w: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int,
          max_moves: int) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Greedy plan and improved plan (both phy2log) for the live problem; returns (greedy, ours, improved, moves)."""
    hier = num_groups % num_nodes == 0
    if not hier:
        num_groups, num_nodes = 1, 1
    greedy, _, _ = rebalance_hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus)
    domain = np.arange(num_gpus) // (num_gpus // num_nodes)
    ours = greedy.copy()
    improved = moves = 0
    g_loads = gpu_loads(w, greedy, num_gpus)
    regrouped = None
    if num_groups // num_nodes > 1:  # groups can move between nodes: also start from a better node packing
        regrouped, _, _ = rebalance_hierarchical(w, num_replicas, num_groups, num_nodes, num_gpus,
                                                 group_packing=_improved_group_packing)
    for li in range(w.shape[0]):
        best_max, best_p, best_m = np.nanmax(g_loads[li]), None, 0
        # starts: the greedy plan; the same replica counts re-packed without duplicates per GPU;
        # and (hierarchical, several groups per node) the plan from an improved group -> node packing
        starts = [greedy[li], _repack_distinct(w[li], greedy[li], num_gpus, domain)]
        if regrouped is not None:
            starts += [regrouped[li], _repack_distinct(w[li], regrouped[li], num_gpus, domain)]
        for start in starts:
            p, m = _improve_layer(w[li], start, num_gpus, domain, max_moves)
            new_max = np.nanmax(gpu_loads(w[li:li + 1], p[None, :], num_gpus))
            if new_max < best_max:  # keep whichever is better (ties: greedy)
                best_max, best_p, best_m = new_max, p, m
        if best_p is not None:
            ours[li] = best_p
            improved += 1
            moves += best_m
    return greedy, ours, improved, moves


def _indices(name: str, xs, hi: int) -> list[int]:
    """``xs`` (None, a list/tuple/set/range, a numpy array or a torch tensor of indices) as Python ints
    in ``[0, hi)``; anything else (a float, NaN, a bool mask, a string) is LBInputError."""
    if xs is None:
        return []
    if isinstance(xs, (str, bytes)):
        raise LBInputError(f"{name} must be a collection of integer indices, got {xs!r}")
    try:
        items = np.asarray(xs if hasattr(xs, "__array__") else list(xs)).ravel().tolist()
    except (TypeError, ValueError) as exc:
        raise LBInputError(f"{name} must be a collection of integer indices, got {xs!r}") from exc
    for i in items:
        if isinstance(i, bool) or not isinstance(i, Integral) or not 0 <= i < hi:
            raise LBInputError(f"{name}: index {i!r} is not an integer in [0, {hi})")
    return [int(i) for i in items]


def _dead_set(num_gpus: int, num_nodes: int, dead_gpus, dead_nodes) -> set[int]:
    per_node = num_gpus // num_nodes
    dead = set(_indices("dead_gpus", dead_gpus, num_gpus))
    for nd in _indices("dead_nodes", dead_nodes, num_nodes):
        dead.update(range(nd * per_node, (nd + 1) * per_node))
    return dead


def rebalance_experts(
    weight,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    *,
    dead_gpus=None,
    dead_nodes=None,
    max_moves_per_layer: int | None = None,
    return_stats: bool = False,
):
    """Plan expert replicas; see the module docstring for shapes, algorithm and the dead-GPU convention.

    Returns ``(phy2log, log2phy, logcnt)`` (plus an :class:`EPLBStats` when
    ``return_stats``). ``max_moves_per_layer`` bounds the local search
    (default ``4 * num_replicas``).
    """
    w = np.asarray(weight, dtype=np.float64)
    num_replicas, num_groups, num_nodes, num_gpus = check_eplb_args(w, num_replicas, num_groups, num_nodes, num_gpus)
    layers, n_log = w.shape
    per_gpu = num_replicas // num_gpus
    per_node = num_gpus // num_nodes
    dead = _dead_set(num_gpus, num_nodes, dead_gpus, dead_nodes)
    live = [g for g in range(num_gpus) if g not in dead]
    live_slots = len(live) * per_gpu
    if live_slots < n_log:
        raise LBInputError(
            f"{len(live)} live GPUs x {per_gpu} slots = {live_slots} slots < {n_log} logical experts; "
            f"every expert needs a replica: bring back at least {-(-(n_log - live_slots) // per_gpu)} GPU(s) "
            f"or raise num_replicas"
        )
    max_moves = (4 * num_replicas if max_moves_per_layer is None
                 else as_count("max_moves_per_layer", max_moves_per_layer, minimum=0))

    dead_nodes_whole = {g // per_node for g in dead}
    whole = all(set(range(nd * per_node, (nd + 1) * per_node)) <= dead for nd in dead_nodes_whole)
    live_nodes = num_nodes - (len(dead_nodes_whole) if whole else 0)
    if dead and not (whole and num_groups % live_nodes == 0):
        sub_groups, sub_nodes = 1, 1  # partial nodes: plan globally over the live GPUs
    else:
        sub_groups, sub_nodes = num_groups, live_nodes
    if not dead:
        sub_groups, sub_nodes = num_groups, num_nodes
    greedy, ours, improved, moves = _plan(w, live_slots, sub_groups, sub_nodes, len(live), max_moves)

    phy2log = np.full((layers, num_replicas), -1, dtype=np.int64)
    live_slot_idx = (np.asarray(live)[:, None] * per_gpu + np.arange(per_gpu)[None, :]).reshape(-1)
    phy2log[:, live_slot_idx] = ours
    logcnt = np.zeros((layers, n_log), dtype=np.int64)
    rows = np.repeat(np.arange(layers), live_slots)
    np.add.at(logcnt, (rows, ours.reshape(-1)), 1)
    if (logcnt < 1).any():
        raise LBInternalError("EPLB bug: a logical expert lost its last replica; please report this")
    log2phy = build_log2phy(phy2log, phy_ranks(phy2log), logcnt)
    if not return_stats:
        return phy2log, log2phy, logcnt
    stats = EPLBStats(
        improved, moves,
        balancedness(w, greedy, len(live)), balancedness(w, ours, len(live)),
    )
    return phy2log, log2phy, logcnt, stats
