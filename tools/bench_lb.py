"""Benchmark lb/: EPLB (ours vs DeepSeek's greedy) and each prefill policy's capacity on several traces.

Exact command (what produced the figures in ``docs/benchmarks.md``; most of the time goes to the
shared trace's 4,000 requests; ``--skip-eplb`` skips part 1)::

    .venv/bin/python tools/bench_lb.py \\
        --trace /work/shared/traces/mooncake_synthetic_trace.jsonl --out results/bench_lb.json

Bigger runs: ``--sessions-scale 4`` (generated traces four times longer), ``--shapes chat,agent,longdoc,mixed``,
``--store-capacity-blocks 20000,2000,5000,10000,40000,inf`` (the hit-ratio sweep on the shared trace).
(``results/`` is git-ignored; the figures are quoted in ``docs/benchmarks.md``.)

Simulator cost alone (part 3, opt-in)::

    .venv/bin/python tools/bench_lb.py --skip-eplb --skip-replay --sim-cost \
        --trace /work/shared/traces/mooncake_synthetic_trace.jsonl --sim-tile 3 --sim-repeats 3 \
        --out results/bench_lb_simcost.json

Parts (each compares peers in the same run and reports ratios)
    1. EPLB: a seeded corpus of expert loads (uniform, Zipf-like Pareto,
       log-normal, one hot expert) on DeepSeek-V3-like shapes: 58 layers x
       256 experts on 64 GPUs / 8 nodes with 320 replicas (5 per GPU;
       288 does not divide over 64 GPUs), hierarchical (8 groups) and
       global (groups not divisible by nodes); 288 replicas on 32 GPUs /
       4 nodes; and the 64-GPU case with one dead node. For each: mean
       balancedness (mean/max GPU load) of both, the ratio, the share of
       layers strictly improved, the worst per-layer difference (must be
       >= 0) and the run time of both.
    2. Capacity (``tools/replay_trace.py --capacity``) on ``--trace`` and on the
       conversation traces ``tools/gen_trace.py`` generates for ``--shapes``
       (seeded by ``--seed``; written to ``<out stem>_replay/traces/``), each
       under every cost-model condition of ``--conditions``: ``exact`` (service
       times are the cost model's), ``slow`` (actual prefill 1.3x the model's,
       log-normal noise sigma 0.3) and ``fast`` (0.7x, the same noise). Per
       policy, the capacity: the highest speedup at which >= 90 % of *all*
       requests meet both the TTFT and the TBT SLO (a rejection is a miss;
       the Mooncake paper's effective request capacity), found by doubling and
       geometric bisection to ``--capacity-tol``; then every policy at the best
       baseline's capacity (SLO attainment, TTFT p50/p90/p99 over all requests
       with the unserved as infinite, hit ratios). One summary table per run:
       the best baseline (Mooncake's Alg. 1 is always one), its capacity,
       Mooncake's, ours, the ratio, our attainment and both hit ratios at the
       best baseline's capacity, and the three goals (capacity >= 1.25x the best
       baseline's, attainment >= 0.95 there, hit ratio within 1 % of Mooncake's). Each
       row also gives the *session ceiling* (:func:`session_ceiling`) at the best baseline's
       capacity and at 1.25x it: the TTFT attainment no router can exceed under the cost model
       (noise aside), since a turn's prompt holds its session's earlier turns; where it is below
       a goal's threshold, that goal is out of reach on that trace and load.
       A baseline with no capacity (below 90 % at every load tried, as Mooncake's
       Alg. 1 on the shared trace, whose rejections of long cold turns cascade
       into the sessions' next turns) is printed ``none``. Every run's JSON and
       PNGs go under ``<out stem>_replay/<trace>_<condition>/``.

       Caveat of every speedup-scaled replay, the shared trace's included: the
       speedup compresses a session's gaps between turns too, so at high speedups a
       turn arrives before the previous one's answer would have. The traces carry no
       session ids, so the replay can not hold a turn back; the capacities of the
       generated traces, whose sessions chain quickly, are the most affected.
    3. Simulator cost (only with ``--sim-cost``): the trace tiled
       ``--sim-tile`` times (copy k shifted by k trace spans, its block ids
       made its own, so every copy has the first copy's statistics: 25 tiles
       of the shared trace make about 100k requests) is replayed at
       ``--sim-speedup`` (default 1, already overloaded on 16 instances: the
       shared trace's cold prefill work exceeds its span, so queues grow with
       the trace) through each of
       ``--sim-policies``, ``--sim-repeats`` times. Reports the wall time of
       each run, their p50/p90 and, per policy, one digest of every
       decision (chosen instance, reason, estimates) and of every metric
       (each TTFT, TBT and cached-token count included): two builds of
       ``lb/`` that give the same digest made the same run, decision by
       decision. A run is still bounded by ``--max-wall-s`` (``truncated``).

TTFT SLO
    Unless ``--ttft-slo-ms`` is given, it is derived per trace from the
    committed cost model so that it follows a refit: ``--ttft-slo-x`` (default
    3) times the p90 of the predicted prefill of each request with an *ideal*
    cache (its longest prefix seen in any earlier request reused:
    :func:`ideal_prefill_s`), the work that no router can avoid. A conversation
    re-sends its whole context every turn, so an SLO taken from the cold
    prefill of the median prompt measures the context, not the work: on the
    agent and longdoc shapes almost every request would meet it at any load.
    It is rounded *up* to a whole
    100 ms, so it is never below 100 ms: a trace of short prompts (a
    predicted prefill of a few ms) gets a 100 ms SLO, not 0. The value
    used is printed and recorded in the JSON (``ttft_slo`` for ``--trace``, each
    summary row's ``ttft_slo_ms``). The TBT SLO is 100 ms; the fleet is
    ``--prefill-instances`` (16) and ``--decode-instances`` (16: with 4, the
    chat shape is decode-bound and no prefill policy can matter).

Time bounds
    The whole run is bounded by ``--max-total-s`` (default 1 h): each replay
    gets what is left of it (``replay_trace.py --max-total-s``), every
    simulation is cut at it, and once it is spent nothing more starts (one
    line, ``--out`` written with ``failed``, exit status 1). Every loop is
    bounded in count too (at most 10 loads to bracket a capacity and 10 to
    bisect it, per policy; the sweep's capacities; ``--sim-repeats``). A
    capacity search stops a run as soon as more than 10 % of the requests
    have missed, so an overloaded load costs little.

Truncated runs
    Each replay run is bounded by ``--max-wall-s`` (passed to
    ``replay_trace.py``). A run cut by it is marked ``*`` in the replay's
    table, gets no ratios against complete runs, and one line after the
    table counts such runs.
    Figures with no sample are ``null`` in the JSON (never a bare NaN).

Exit status (the contract of ``tools/cli_args.py``)
    0: the parts asked for ran and ``--out`` was written. 2: a bad argument or input,
    refused in one line before any part runs: nothing to run (``--skip-eplb``
    and ``--skip-replay`` without ``--sim-cost``), a trace that is missing, unreadable, malformed or
    holds no requests (when the replay runs), an SLO that is not a positive
    number, an unknown shape or condition, an output path that can not be written. 1:
    ``--max-total-s`` was spent, or a capacity search found no baseline with a
    capacity (``replay_trace.py`` says so in one line). Whenever a replay exits non-zero,
    ``--out`` is still written with what ran so far and ``failed``: the part
    (``capacity:TRACE:CONDITION``), its exit status and, where the replay wrote
    one, its ``results.json`` (the loads each capacity search tried).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np

from lb.eplb import balancedness, rebalance_experts
from lb.eplb_greedy import rebalance_experts_greedy
from lb.cost_model import load_default
from lb.registry import POLICIES, get_policy
from lb.sim import SimConfig, TraceRequest, json_safe, simulate
from lb.types import BLOCK_TOKENS, LBInputError
from tools import gen_trace, replay_trace
from tools.cli_args import check_output_dir, check_output_file, integer, number

log = logging.getLogger("bench_lb")


def load_corpus(layers: int, experts: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    one_hot = rng.uniform(1, 2, (layers, experts))
    one_hot[np.arange(layers), rng.integers(0, experts, layers)] = 20 * experts / 8
    return {
        "uniform": rng.uniform(90, 110, (layers, experts)),
        "zipf": rng.pareto(1.2, (layers, experts)) * 100 + 1,
        "lognormal": rng.lognormal(0, 1.5, (layers, experts)),
        "one_hot": one_hot,
    }


def eplb_case(name: str, w: np.ndarray, reps: int, groups: int, nodes: int, gpus: int, dead=None) -> dict:
    t0 = time.perf_counter()
    if dead:
        # the greedy has no dead-GPU notion: give it the same live problem (live GPUs only, global)
        live = gpus - len(dead)
        g, _, _ = rebalance_experts_greedy(w, reps // gpus * live, 1, 1, live)
        greedy_b = balancedness(w, g, live, per_layer=True)
    else:
        g, _, _ = rebalance_experts_greedy(w, reps, groups, nodes, gpus)
        greedy_b = balancedness(w, g, gpus, per_layer=True)
    t_greedy = time.perf_counter() - t0
    t0 = time.perf_counter()
    p, _, _ = rebalance_experts(w, reps, groups, nodes, gpus, dead_gpus=dead)
    t_ours = time.perf_counter() - t0
    ours_b = balancedness(w, p, gpus, per_layer=True)
    row = {
        "case": name, "layers": w.shape[0], "experts": w.shape[1], "replicas": reps, "groups": groups,
        "nodes": nodes, "gpus": gpus, "dead_gpus": sorted(dead) if dead else [],
        "mode": "global-live" if dead else ("hierarchical" if groups % nodes == 0 else "global"),
        "greedy_balancedness": float(greedy_b.mean()), "ours_balancedness": float(ours_b.mean()),
        "ratio": float(ours_b.mean() / greedy_b.mean()),
        "layers_strictly_better": float((ours_b > greedy_b + 1e-12).mean()),
        "worst_layer_delta": float((ours_b - greedy_b).min()),
        "greedy_s": t_greedy, "ours_s": t_ours,
    }
    log.info("%-34s %-12s greedy %.4f ours %.4f x%.3f better %3.0f%% %.2fs vs %.2fs", name, row["mode"],
             row["greedy_balancedness"], row["ours_balancedness"], row["ratio"],
             100 * row["layers_strictly_better"], t_greedy, t_ours)
    return row


def run_eplb(seed: int) -> list[dict]:
    rows = []
    corpus = load_corpus(58, 256, seed)
    for kind, w in corpus.items():
        rows.append(eplb_case(f"{kind} 58x256 64gpu hier", w, 320, 8, 8, 64))
        rows.append(eplb_case(f"{kind} 58x256 64gpu global", w, 320, 4, 8, 64))
        rows.append(eplb_case(f"{kind} 58x256 32gpu hier r288", w, 288, 8, 4, 32))
        rows.append(eplb_case(f"{kind} 58x256 64gpu 1 dead node", w, 320, 8, 8, 64, dead=set(range(56, 64))))
    return rows


def derive_ttft_slo_ms(reqs: list[TraceRequest], multiple: float) -> tuple[float, dict]:
    """``multiple`` x the p90 of the committed cost model's prefill of each request with an ideal cache
    (its prefix reused from any earlier request, :func:`ideal_prefill_s`), in ms, rounded up to a whole
    100 ms (so never below 100 ms, even for a trace of very short prompts)."""
    models = load_default()
    p90_s = float(np.percentile(ideal_prefill_s(reqs, models), 90))
    # up to a whole 100 ms, at least 100 ms: rounding to the nearest would give 0 ms for short
    # prompts, an SLO every request misses
    slo_ms = float(max(100, 100 * math.ceil(multiple * p90_s * 1e3 / 100)))
    return slo_ms, {"ttft_slo_ms": slo_ms, "source": "derived", "multiple": multiple,
                    "p90_ideal_cache_prefill_s": p90_s,
                    "median_input_tokens": float(np.median([r.input_length for r in reqs])),
                    "cost_model": models.meta.get("command", "defaults"),
                    "cost_model_target": models.meta.get("target"), "preset": models.meta.get("preset")}


def ideal_prefill_s(reqs: list[TraceRequest], models) -> list[float]:
    """Each request's predicted prefill when its longest prefix of full blocks seen in any earlier request
    (arrival order) is cached: the work a perfect router with an infinite cache leaves."""
    from lb.trace import cacheable_blocks

    seen: set = set()
    out = []
    for r in sorted(reqs, key=lambda r: r.timestamp_ms):
        full = cacheable_blocks(r)
        n = next((i for i, h in enumerate(full) if h not in seen), len(full))
        out.append(models.prefill.predict(r.input_length, min(r.input_length - 1, n * BLOCK_TOKENS)))
        seen.update(full)
    return out


def session_ceiling(reqs: list[TraceRequest], models, speedup: float, bias: float, slo_ms: float) -> float:
    """Share of ``reqs`` whose TTFT can meet ``slo_ms`` at ``speedup`` however they are routed, under the
    cost model (prefill times ``bias`` x the model's, no noise).

    The bound gives every request an idle prefill instance of its own (no queue) and a cache that never
    evicts and costs nothing to load from. What remains is that a prefix is reusable only once a
    prefill that computes it has ended: a request ends, at the earliest, at the minimum over ``L`` (its
    first ``L`` full blocks, ``L = 0`` included) of ``max(arrival, earliest end of a request holding
    block L) + prefill(prompt, L blocks cached)``. Block ids are chained (an id names its whole prefix),
    so holding block ``L`` means holding the first ``L``. A conversation's turn holds its earlier
    turns' prompt: it waits for their prefill or recomputes it, which costs at least as long (the
    model's prefill of ``a + b`` new tokens is no cheaper than of ``a`` and then ``b``), so when the
    speedup brings a session's turns faster than their prefills, its later turns miss whatever the
    routing. In arrival order; a later arrival never supplies a prefix sooner than its own sources do.
    O(blocks) per request.
    """
    from lb.trace import cacheable_blocks

    earliest: dict = {}  # block -> the earliest end of a request holding it
    ok = 0
    for r in sorted(reqs, key=lambda r: r.timestamp_ms):
        full = cacheable_blocks(r)
        arrival = r.timestamp_ms / 1000.0 / speedup

        def prefill(blocks: int) -> float:
            return models.prefill.predict(r.input_length, min(r.input_length - 1, blocks * BLOCK_TOKENS)) * bias

        end = arrival + prefill(0)
        for n, h in enumerate(full, 1):
            if (ready := earliest.get(h)) is None:
                break
            end = min(end, max(arrival, ready) + prefill(n))
        for h in full:
            if earliest.get(h, math.inf) > end:
                earliest[h] = end
        ok += end - arrival <= slo_ms / 1e3
    return ok / len(reqs) if reqs else 1.0


def tile_trace(reqs: list[TraceRequest], copies: int) -> list[TraceRequest]:
    """``copies`` back-to-back copies of ``reqs``: copy k is shifted by k spans (span = the trace's
    duration + its mean gap) and has its own block ids (integer ids offset by k x (max id - min id + 1),
    so copy k's ids lie in ``[min + k w, max + k w]`` with ``w`` >= 1, disjoint from every other copy's,
    negative ids and a single repeated id included; other ids paired with k), so no copy reuses another's
    cache and each has the trace's load."""
    if copies <= 1 or not reqs:
        return list(reqs)
    ts = [r.timestamp_ms for r in reqs]
    lo, hi = min(ts), max(ts)
    span = (hi - lo) + (hi - lo) / max(1, len(reqs) - 1)
    ints = all(isinstance(h, int) for r in reqs for h in r.hash_ids)
    ids = [h for r in reqs for h in r.hash_ids]
    stride = (max(ids) - min(ids) + 1 if ids else 1) if ints else 0  # the id range's width: never 0 or < 0
    out = list(reqs)
    for k in range(1, copies):
        for r in reqs:
            ids = tuple(h + k * stride for h in r.hash_ids) if ints else tuple((k, h) for h in r.hash_ids)
            out.append(TraceRequest(r.timestamp_ms + k * span, r.input_length, r.output_length, ids))
    return out


class _Recorder:
    """A prefill policy that hashes every decision of the one it wraps (chosen, reason, estimates,
    floats by their exact repr) into ``digest``: equal digests mean equal decisions, in order."""

    def __init__(self, policy) -> None:
        self.policy, self.digest, self.decisions = policy, hashlib.sha256(), 0

    def choose(self, req, instances):
        d = self.policy.choose(req, instances)
        self.digest.update(repr((d.chosen, d.reason, sorted(d.estimates.items(), key=repr))).encode())
        self.decisions += 1
        return d


def run_sim_cost(reqs: list[TraceRequest], names: list[str], cfg: SimConfig, repeats: int,
                 deadline: float | None = None) -> dict:
    """Wall time of ``simulate`` per policy (``repeats`` runs, sequential) and a digest of its outputs.

    Each run is cut at what is left before ``deadline`` (``time.monotonic()``); once nothing is, no
    run starts: the rows of the runs done are returned (a policy with no run has no row, a row may hold
    fewer than ``repeats`` runs: :func:`sim_cost_cut` tells)."""
    out: dict = {}
    spent = False
    for name in names:
        walls, digests, last = [], set(), None
        for _ in range(repeats):
            try:
                run_cfg = replay_trace._run_cfg(cfg, deadline)
            except replay_trace.TimeBudgetSpent:
                spent = True
                break
            rec = _Recorder(get_policy(name))
            t0 = time.perf_counter()
            res = simulate(reqs, rec, run_cfg, name=name)
            walls.append(time.perf_counter() - t0)
            metrics = res.to_dict()
            metrics.pop("wall_s")
            rec.digest.update(repr((sorted(metrics.items()), res.ttft_s, res.tbt_s,
                                    sorted(res.cached_tokens.items()))).encode())
            digests.add(rec.digest.hexdigest()[:16])
            last = (res, rec.decisions)
        if last is None:
            break
        res, decisions = last
        row = {"policy": name, "requests": len(reqs), "arrived": res.arrived, "decisions": decisions,
               "served": res.served, "rejected": res.rejected, "truncated": res.truncated,
               "wall_s": walls, "wall_p50_s": float(np.percentile(walls, 50)),
               "wall_p90_s": float(np.percentile(walls, 90)), "wall_p99_s": float(np.percentile(walls, 99)),
               "digest": sorted(digests)[0] if len(digests) == 1 else sorted(digests)}
        log.info("%-13s %6d requests (%d arrived%s) wall p50 %.1f s (runs: %s) digest %s", name, len(reqs),
                 res.arrived, ", TRUNCATED" if res.truncated else "", row["wall_p50_s"],
                 " ".join(f"{w:.1f}" for w in walls), row["digest"])
        out[name] = row
        if spent:
            break
    best = min((r["wall_p50_s"] for r in out.values()), default=math.nan)
    for row in out.values():
        row["wall_p50_vs_fastest"] = row["wall_p50_s"] / best if best > 0 else math.nan
    return out


def sim_cost_cut(rows: dict, names: list[str], repeats: int) -> bool:
    """Whether ``run_sim_cost`` stopped at its deadline: fewer runs than asked, its only reason."""
    return len(rows) < len(names) or any(len(r["wall_s"]) < repeats for r in rows.values())


def truncated_runs(results: dict) -> list[str]:
    """``capacity:policy`` of every run in a replay's ``results.json`` cut by ``--max-wall-s``."""
    return [f"{cap}:{name}" for cap, v in results.get("sweep", {}).items()
            for name, r in v.get("results", {}).items() if r.get("truncated")]


def note_truncated(results: dict, what: str, max_wall_s: float) -> None:
    """One line when some of a replay's runs were cut by ``--max-wall-s`` (never silent)."""
    cut = truncated_runs(results)
    if cut:
        print(f"note: {len(cut)} {what} runs were cut by --max-wall-s {max_wall_s:g} s ({', '.join(cut)}): "
              f"their figures cover only part of the trace (marked * above); raise --max-wall-s")


def replay(argv: list[str]) -> int:
    """``replay_trace.main(argv)``'s exit status (it has printed its one line if it is not 0)."""
    try:
        return replay_trace.main(argv)
    except SystemExit as exc:  # argparse's exit: every argument was checked here first, so a bug
        return exc.code if isinstance(exc.code, int) else 2


#: Cost-model conditions of the capacity part: (log-normal sigma, bias = actual / modelled prefill time).
CONDITIONS: dict[str, tuple[float, float]] = {"exact": (0.0, 1.0), "slow": (0.3, 1.3), "fast": (0.3, 0.7)}

#: Sessions per generated shape at --sessions-scale 1 (about 1,000 to 1,500 requests each; the default 0.5
#: halves them).
SHAPE_SESSIONS = {"chat": 300, "agent": 100, "longdoc": 250, "mixed": 300}

#: The policy the goals are about.
OURS = "kvstack"


def capacity_row(trace: str, cond: str, slo_ms: float, res: dict, ceiling: float | None = None,
                 session_ceilings: tuple[float, float] | None = None) -> dict:
    """One summary row from a ``replay_trace.py --capacity`` results.json: the capacities, the ratio of
    ours to the best baseline's, and at the best baseline's capacity our SLO attainment and both hit ratios;
    ``ceiling``: the share of requests whose ideal-cache prefill alone, at the condition's bias, meets the
    TTFT SLO (no policy's attainment can exceed it, noise aside); ``session_ceilings``: :func:`session_ceiling` at the
    best baseline's capacity and at 1.25x it."""
    cap = res["capacity"]
    best = cap["best_baseline"]
    by = {n: c["speedup"] for n, c in cap["by_policy"].items()}
    lower = sorted(n for n, c in cap["by_policy"].items() if c["speedup"] is not None and not c["bracketed"])
    at = res["sweep"][res["main_store_capacity"]]["results"]
    ours, moon = at.get(OURS, {}), at.get("mooncake", {})
    ratio = (by.get(OURS) or 0.0) / by[best] if best and by.get(best) else None
    hit_ok = None
    if ours.get("hit_ratio") is not None and moon.get("hit_ratio") is not None:
        hit_ok = ours["hit_ratio"] >= moon["hit_ratio"] - 0.01
    return {"trace": trace, "condition": cond, "ttft_slo_ms": slo_ms, "best_baseline": best,
            "best_capacity": by.get(best), "capacity": by, "ours_capacity": by.get(OURS), "ratio": ratio,
            "lower_bounds": lower, "attainment_ceiling": ceiling,
            "session_ceiling_at_best": session_ceilings[0] if session_ceilings else None,
            "session_ceiling_at_1.25x": session_ceilings[1] if session_ceilings else None,
            "ours_attainment_at_best": ours.get("slo_attainment"), "ours_hit": ours.get("hit_ratio"),
            "mooncake_hit": moon.get("hit_ratio"), "mooncake_capacity": by.get("mooncake"),
            "goals": {"capacity_1.25x": ratio is not None and ratio >= 1.25,
                      "attainment_0.95": (ours.get("slo_attainment") or 0.0) >= 0.95, "hit_within_1pct": hit_ok}}


def row_best(res: dict) -> float | None:
    """The best baseline's capacity in a ``replay_trace.py --capacity`` results.json (None: none has one)."""
    cap = res["capacity"]
    best = cap["best_baseline"]
    return cap["by_policy"][best]["speedup"] if best else None


def print_capacity_summary(rows: list[dict]) -> None:
    print(f"\n== capacity (speedup at which >= 90% of all requests meet both SLOs), {OURS} vs the best baseline ==")
    print(f"{'trace':9s} {'cond':6s} {'SLO s':>6s} {'best base':>10s} {'its cap':>8s} {'mooncake':>8s} {OURS:>8s} "
          f"{'ratio':>6s} {'att@best':>8s} {'ceiling':>7s} {'sess@b':>6s} {'@1.25x':>6s} {'hit':>6s} {'hit mc':>6s}"
          "  goals")
    for r in rows:
        g = r["goals"]
        flags = " ".join(f"{k}:{'ok' if v else ('n/a' if v is None else 'MISS')}" for k, v in g.items())
        lb = {n: ">=" if n in r["lower_bounds"] else "" for n in (r["best_baseline"], "mooncake", OURS)}
        print(f"{r['trace'][:9]:9s} {r['condition']:6s} {r['ttft_slo_ms'] / 1e3:6.1f} {str(r['best_baseline'])[:10]:>10s} "
              f"{lb[r['best_baseline']] + _fmt(r['best_capacity']):>8s} {lb['mooncake'] + _fmt(r['mooncake_capacity']):>8s} "
              f"{lb[OURS] + _fmt(r['ours_capacity']):>8s} {lb[OURS] + _fmt(r['ratio'], '.2f'):>6s} "
              f"{_fmt(r['ours_attainment_at_best'], '.3f'):>8s} {_fmt(r.get('attainment_ceiling'), '.3f'):>7s} "
              f"{_fmt(r.get('session_ceiling_at_best'), '.4f'):>6s} "
              f"{_fmt(r.get('session_ceiling_at_1.25x'), '.4f'):>6s} "
              f"{_fmt(r['ours_hit'], '.3f'):>6s} {_fmt(r['mooncake_hit'], '.3f'):>6s}  {flags}")
    print("(ceiling: the share of requests whose prefill with an ideal cache and no queue meets the TTFT SLO at the "
          "condition's times without noise; sess@b / @1.25x: the same when a prefix is reusable only once a prefill "
          "that computes it has ended (a turn waits for its session's earlier turns or recomputes them), at the best "
          "baseline's capacity and at 1.25x it: no router beats it without noise; "
          "capacity 'none': below 90% at every load tried; '>=': every load tried met the target, a lower bound; "
          "conditions: exact = the cost model's own times, slow/fast = actual prefill 1.3x/0.7x the model's with "
          "log-normal noise sigma 0.3)")


def _fmt(v, spec: str = ".4g") -> str:
    return "none" if v is None else format(v, spec)


def search_starts(capacity: dict[str, float | None]) -> dict[str, float]:
    """Where each policy's capacity search starts under the later conditions of a trace: the lowest
    capacity any policy had under the first (``{}``: none had one, the default start). One start
    for all: attainment is not monotone in the load (noise, cache luck), so a search started higher
    can land on a passing island above a failed load, and a policy started from its own, higher
    capacity would be favoured."""
    found = [v for v in capacity.values() if v]
    return dict.fromkeys(capacity, min(found)) if found else {}


def run_capacity(args: argparse.Namespace, reqs: list[TraceRequest], out: dict, traces: dict, rdir: Path,
                 deadline: float) -> int:
    """Part 2: per trace and cost-model condition, ``replay_trace.py --capacity`` (every policy's capacity,
    then every policy at the best baseline's capacity); the shared trace's exact run also sweeps the store
    capacity. Returns the exit status (non-zero: ``--out`` was written with the failure)."""
    out["capacity"] = {"runs": {}, "summary": []}
    for tname, path in traces.items():
        treqs = reqs if tname == "trace" else replay_trace.read_trace(path)
        slo_ms = args.ttft_slo_ms if args.fixed_slo else derive_ttft_slo_ms(treqs, args.ttft_slo_x)[0]
        ideal = ideal_prefill_s(treqs, load_default())
        starts: dict = {}  # where every policy's search starts under the later conditions (search_starts)
        for cond in args.condition_list:
            noise, bias = CONDITIONS[cond]
            ceiling = float(np.mean([t * bias * 1e3 <= slo_ms for t in ideal]))
            part = f"capacity:{tname}:{cond}"
            d = rdir / f"{tname}_{cond}"
            if (left := deadline - time.monotonic()) < 1:
                return spent_budget(out, args, part)
            print(f"\n-- {part}: {len(treqs)} requests from {path}, TTFT SLO {slo_ms:.0f} ms --")
            caps = args.store_capacity_blocks if (tname == "trace" and cond == args.condition_list[0]) else \
                args.store_capacity_blocks.split(",")[0]
            rc = replay([
                "--trace", str(path), "--capacity", "--speedup", "1", "--ttft-slo-ms", repr(slo_ms),
                *(["--capacity-start", ",".join(f"{n}={v!r}" for n, v in starts.items())] if starts else []),
                "--prefill-instances", str(args.prefill_instances), "--decode-instances", str(args.decode_instances),
                "--noise", repr(noise), "--bias", repr(bias), "--capacity-tol", repr(args.capacity_tol),
                "--capacity-iters", "10",
                "--store-capacity-blocks", caps, "--out", str(d), "--quiet", "--seed", str(args.seed),
                "--max-wall-s", repr(args.max_wall_s), "--max-total-s", repr(left),
            ])
            if rc:
                return failed_replay(out, args.out, part, rc, d)
            res = json.loads((d / "results.json").read_text())
            out["capacity"]["runs"][f"{tname}:{cond}"] = res
            sess = None
            if best_cap := row_best(res):
                sess = tuple(session_ceiling(treqs, load_default(), x * best_cap, bias, slo_ms) for x in (1.0, 1.25))
            row = capacity_row(tname, cond, slo_ms, res, ceiling, sess)
            out["capacity"]["summary"].append(row)
            note_truncated(res, part, args.max_wall_s)
            if cond == args.condition_list[0]:
                starts = search_starts(row["capacity"])
    print_capacity_summary(out["capacity"]["summary"])
    return 0


def write_out(path: Path, out: dict) -> None:
    """``--out``: strict JSON (a figure with no sample, NaN, is null, never a bare NaN)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(out), indent=2, default=str, allow_nan=False))
    print(f"wrote {path}")


def failed_replay(out: dict, path: Path, part: str, rc: int, rdir: Path) -> int:
    """A replay exited ``rc`` (it said why in one line): ``--out`` gets what ran, with the failure."""
    out["failed"] = {"part": part, "exit_status": rc, "replay_dir": str(rdir)}
    try:
        out["failed"]["replay"] = json.loads((rdir / "results.json").read_text())
    except (OSError, ValueError):
        pass  # the replay wrote nothing (refused before running, or interrupted)
    write_out(path, out)
    return rc


def spent_budget(out: dict, args: argparse.Namespace, part: str) -> int:
    """``--max-total-s`` was spent before ``part`` (or some of its runs): one line, ``--out`` with what
    ran and the failure, exit status 1."""
    msg = f"--max-total-s {args.max_total_s:g} s was spent before {part} finished; raise --max-total-s"
    print(f"bench_lb.py: error: {msg}", file=sys.stderr)
    out["failed"] = {"part": part, "exit_status": 1, "error": msg}
    write_out(args.out, out)
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_lb.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="results JSON path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ttft-slo-ms", type=number(0, 1e12, lo_open=True), default=None,
                    help="TTFT SLO; default: --ttft-slo-x times the p90 ideal-cache prefill (see above)")
    ap.add_argument("--ttft-slo-x", type=number(0, 1e6, lo_open=True), default=3.0,
                    help="multiple of the p90 of each request's predicted prefill with an ideal cache: the "
                         "default SLO of each trace")
    ap.add_argument("--prefill-instances", type=integer(1, 4096), default=16)
    ap.add_argument("--decode-instances", type=integer(1, 4096), default=16)
    ap.add_argument("--shapes", default="chat,agent,longdoc",
                    help=f"generated conversation traces to run beside --trace (tools/gen_trace.py; comma list "
                         f"of {', '.join(gen_trace.SHAPES)}; empty: none)")
    ap.add_argument("--sessions-scale", type=number(0.01, 100), default=0.5,
                    help="multiplies each shape's default number of sessions (bigger runs: 4)")
    ap.add_argument("--conditions", default=",".join(CONDITIONS),
                    help=f"cost-model conditions, each a full capacity search: {', '.join(CONDITIONS)}")
    ap.add_argument("--capacity-tol", type=number(0.001, 1), default=0.05,
                    help="capacity search: bisect until the bracket's hi/lo <= 1 + this")
    ap.add_argument("--store-capacity-blocks", default="20000",
                    help="store capacity in blocks; a comma list also sweeps the hit ratio over them on --trace "
                         "(exact condition) at the best baseline's capacity ('inf' = unbounded)")
    ap.add_argument("--max-wall-s", type=number(1), default=300.0,
                    help="wall-clock bound per replay simulation run (>= 1), passed to replay_trace.py")
    ap.add_argument("--max-total-s", type=number(1), default=3600.0,
                    help="wall-clock bound on the whole run (>= 1): every replay and simulation is cut at what "
                         "is left of it, and none starts once it is spent")
    ap.add_argument("--skip-eplb", action="store_true")
    ap.add_argument("--skip-replay", action="store_true")
    ap.add_argument("--sim-cost", action="store_true", help="also run part 3, the simulator's own cost")
    ap.add_argument("--sim-tile", type=integer(1, 1000), default=25,
                    help="part 3: copies of the trace, back to back (25 x 3993 = ~100k requests)")
    ap.add_argument("--sim-speedup", type=number(0, 1e6, lo_open=True), default=1.0,
                    help="part 3: offered load (1 = trace time: overloaded on 16 instances)")
    ap.add_argument("--sim-policies", default="least_loaded,dynamo", help="part 3: comma list of prefill policies")
    ap.add_argument("--sim-repeats", type=integer(1, 100), default=3, help="part 3: runs per policy (median)")
    args = ap.parse_args(argv)
    deadline = time.monotonic() + args.max_total_s
    # Every input is checked here, before the EPLB part runs for minutes: nothing is derived
    # from a trace that does not hold requests, and the replay never meets an argument it refuses.
    if args.skip_eplb and args.skip_replay and not args.sim_cost:
        ap.error("--skip-eplb and --skip-replay leave nothing to run (add --sim-cost?)")
    sim_policies = [n for n in args.sim_policies.split(",") if n]
    unknown = [n for n in sim_policies if n not in POLICIES]
    if args.sim_cost and (unknown or not sim_policies):
        ap.error(f"argument --sim-policies: unknown policy {', '.join(unknown) or '(none given)'}; "
                 f"known: {', '.join(POLICIES)}")
    try:
        replay_trace.parse_capacities(args.store_capacity_blocks)
    except argparse.ArgumentTypeError as exc:
        ap.error(f"argument --store-capacity-blocks: {exc}")
    replay_dirs = [args.out.with_name(args.out.stem + "_replay")]
    shapes = [n for n in args.shapes.split(",") if n]
    if unknown := [n for n in shapes if n not in gen_trace.SHAPES]:
        ap.error(f"argument --shapes: unknown shape {', '.join(unknown)}; known: {', '.join(gen_trace.SHAPES)}")
    conditions = [n for n in args.conditions.split(",") if n]
    unknown = [n for n in conditions if n not in CONDITIONS]
    if unknown or (not conditions and not args.skip_replay):
        ap.error(f"argument --conditions: unknown condition {', '.join(unknown) or '(none given)'}; "
                 f"known: {', '.join(CONDITIONS)}")
    args.condition_list = conditions
    for msg in [check_output_file(args.out)] + ([] if args.skip_replay else
                                                [check_output_dir(d, "replay directory") for d in replay_dirs]):
        if msg:
            ap.error(msg)
    try:
        reqs = replay_trace.read_trace(args.trace)
    except LBInputError as exc:
        ap.error(str(exc))
    if not reqs and (not args.skip_replay or args.sim_cost):
        ap.error(f"trace {args.trace} holds no requests")
    traces = {"trace": args.trace}
    if not args.skip_replay and shapes:  # generated here, seeded: the same files for the same arguments
        tdir = replay_dirs[0] / "traces"
        for shape in shapes:
            sessions = max(1, round(SHAPE_SESSIONS.get(shape, 200) * args.sessions_scale))
            path = tdir / f"{shape}.jsonl"
            gen_trace.write_jsonl(gen_trace.generate(gen_trace.SHAPES[shape], sessions, args.seed), path)
            traces[shape] = path
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out: dict = {"command": "python tools/bench_lb.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    args.fixed_slo = args.ttft_slo_ms is not None
    if not args.skip_replay or args.sim_cost:
        if args.ttft_slo_ms is None:
            try:
                args.ttft_slo_ms, out["ttft_slo"] = derive_ttft_slo_ms(reqs, args.ttft_slo_x)
            except LBInputError as exc:
                ap.error(f"cannot derive the TTFT SLO from the committed cost model: {exc}")
        else:
            out["ttft_slo"] = {"ttft_slo_ms": args.ttft_slo_ms, "source": "--ttft-slo-ms"}
    if not args.skip_eplb:
        rows = run_eplb(args.seed)
        out["eplb"] = rows
        print("\n== EPLB: balancedness (mean/max GPU load), ours vs DeepSeek greedy ==")
        print(f"{'case':36s} {'mode':12s} {'greedy':>7s} {'ours':>7s} {'ratio':>6s} {'better':>7s} "
              f"{'min d':>8s} {'t_greedy':>8s} {'t_ours':>7s}")
        for r in rows:
            print(f"{r['case']:36s} {r['mode']:12s} {r['greedy_balancedness']:7.4f} {r['ours_balancedness']:7.4f} "
                  f"{r['ratio']:6.3f} {100 * r['layers_strictly_better']:6.0f}% {r['worst_layer_delta']:8.1e} "
                  f"{r['greedy_s']:7.2f}s {r['ours_s']:6.2f}s")
    if not args.skip_replay:
        rc = run_capacity(args, reqs, out, traces, replay_dirs[0], deadline)
        if rc:
            return rc
    if args.sim_cost:
        tiled = tile_trace(reqs, args.sim_tile)
        cfg = SimConfig(prefill_instances=args.prefill_instances, speedup=args.sim_speedup,
                        ttft_slo_ms=args.ttft_slo_ms, max_wall_s=args.max_wall_s, seed=args.seed)
        print(f"\n== simulator cost: {len(tiled)} requests ({args.sim_tile} x the trace), speedup "
              f"{args.sim_speedup:g}, {args.prefill_instances} prefill instances, {args.sim_repeats} runs each ==")
        rows = run_sim_cost(tiled, sim_policies, cfg, args.sim_repeats, deadline)
        out["sim_cost"] = {"tile": args.sim_tile, "speedup": args.sim_speedup, "requests": len(tiled),
                           "prefill_instances": args.prefill_instances, "max_wall_s": args.max_wall_s,
                           "results": rows}
        print(f"{'policy':13s} {'requests':>8s} {'arrived':>8s} {'p50 s':>8s} {'p90 s':>8s} {'x fastest':>9s}  digest")
        for r in rows.values():
            print(f"{r['policy']:13s} {r['requests']:8d} {r['arrived']:8d}{'*' if r['truncated'] else ' '}"
                  f"{r['wall_p50_s']:7.1f} {r['wall_p90_s']:8.1f} {r['wall_p50_vs_fastest']:9.2f}  {r['digest']}")
        if any(r["truncated"] for r in rows.values()):
            print(f"note: runs marked * were cut by --max-wall-s {args.max_wall_s:g} s (or --max-total-s)")
        if sim_cost_cut(rows, sim_policies, args.sim_repeats):
            return spent_budget(out, args, "sim_cost")
    write_out(args.out, out)
    return 0


if __name__ == "__main__":
    from tools.cli_args import run_main

    run_main(main)
