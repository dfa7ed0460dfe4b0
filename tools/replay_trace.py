"""Replay a Mooncake-format trace through lb/ prefill policies on simulated P/D instances.

Role
    The benchmark of ``lb/``: every policy in ``--policies`` is run on the
    same requests and the same simulated fleet (``lb.sim``), and the table
    puts them side by side with ratios vs the best baseline. Works on any
    Mooncake-format trace (JSON lines: ``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids`` of 512-token prefix blocks).

Exact commands
    Comparison at one load, with a store-capacity sweep (hit ratio vs the
    ideal and one LRU of the same capacity), JSON + PNG plots::

        .venv/bin/python tools/replay_trace.py \\
            --trace /work/shared/traces/mooncake_synthetic_trace.jsonl \\
            --speedup 0.5 --store-capacity-blocks 20000,2000,5000,10000,40000 --out results/replay

    Each policy's capacity (the highest speedup at which >= 90 % of *all*
    requests meet both the TTFT and the TBT SLO, a rejection counting as a
    miss), here with a cost model 30 % optimistic and noisy, then every policy
    at the best baseline's capacity (``tools/bench_lb.py`` runs this over
    several traces and conditions)::

        .venv/bin/python tools/replay_trace.py \\
            --trace /work/shared/traces/mooncake_synthetic_trace.jsonl \\
            --capacity --ttft-slo-ms 56500 --decode-instances 16 --bias 1.3 --noise 0.3 --out results/cap

    Find the offered load (speedup) at which the best baseline just meets
    the TTFT SLO at p90, then compare every policy at that load::

        .venv/bin/python tools/replay_trace.py \\
            --trace /work/shared/traces/mooncake_synthetic_trace.jsonl \\
            --find-load --ttft-slo-ms 20000 --out results/replay_findload

Metrics (per policy): prefix hit ratio = prefix-hit *full* blocks / all
blocks the trace lists (the partial last block of a prompt is never cached,
as in production, but is counted in the denominator; see ``lb/sim.py``),
over served requests, plus the ideal infinite-cache ratio and the ratio of one
LRU of the store's capacity (column ``lru_ref``, key ``lru_oracle`` in the JSON),
same definition, over all requests in arrival order. Both are references, not
bounds (neither an oracle): a queued request may reuse blocks of a later arrival
that finished first, and the policies also hit in device and host tiers the
single LRU does not have; see ``lb/sim.py``; TTFT p50/p90/p99 over *all* requests (one not
served, rejected or cut off, counts as an infinite TTFT: ``inf`` in the table, ``null`` in
``ttft_all_p*_s``; ``ttft_p*_s`` in ``results.json`` are over served requests), TBT p50/p90 (from the
first token, a wait for a decode slot included; requests
with ``output_length`` 0 have no TBT and are judged on TTFT alone; that wait's own
p50/p90/p99 are ``decode_wait_p*_s`` in ``results.json``), SLO
attainment (TTFT and TBT both met, rejections count as misses), TTFT
attainment, rejected requests (under the table, per run, how many no decode
instance could ever hold: refused as over ``max_model_len`` would be; every reason is
in ``reject_reasons`` in ``results.json``), and load imbalance (max / mean prefill busy
time across instances). A figure with no sample (nothing served) prints as
``n/a`` and is ``null`` in ``results.json``. The first value of
``--store-capacity-blocks`` is the one used for the main table; the others
only feed the sweep. Everything is bounded: ``--limit`` requests,
``--max-wall-s`` per simulation run, ``--find-load-iters`` bisection steps,
and, with ``--max-total-s``, the whole run: each simulation is cut at what is
left of it, and once it is spent no simulation starts (one line, exit 1).
Service times come from ``lb/data/cost_model.json`` (``--cost-model`` to
override; one warning says how many prompts are longer than any it was fitted
on); ``--noise`` adds log-normal noise and ``--bias`` a systematic factor (1.3: every prefill
30 % slower than modelled) to prefill service times, so policies' estimates are not exact.

``--capacity`` searches each policy's capacity from ``--speedup`` (doubling or
halving to bracket it, then a geometric bisection down to ``--capacity-tol``; at
most ``--capacity-iters`` loads each way); a run stops as soon as more than
``1 - --capacity-target`` of the requests have missed (the load failed, whatever
the rest does: ``stopped_early`` in ``results.json``). The capacity table gives
each policy's capacity and its ratio to the best baseline's (``none``: below the
target at every load tried); the main table then compares every policy at the
best baseline's capacity. ``results.json`` has ``capacity`` with every load
tried per policy (attainments and TTFT percentiles over all requests).
``--explain N`` prints, after the main table, each policy's decisions (routing, and
for ``kvstack`` the order in its instance's queue) for its first N requests that
missed the TTFT SLO.

A run cut by ``--max-wall-s`` covers only the requests that arrived before it
stopped: its row is marked ``*`` with a note of how far it got, attainments
still count every request (the rest as misses, so they are lower bounds), and
no ratio is printed between it and a complete run (``-``); the best baseline
is chosen among complete runs. ``--find-load`` takes a truncated run that
meets the target as a pass (a lower bound met it) and one that misses it as a
miss, saying so in one line per load (raise ``--max-wall-s`` to decide it).
When every load it tried met the target (it never found one that misses, so
it never bracketed the boundary), it says so in one line instead of "load
found", and ``results.json`` has ``find_load.bracketed: false`` (the speedup
is only a lower bound).

A trace may start with a UTF-8 byte-order mark (stripped from line 1 only).

Exit status (the contract of ``tools/cli_args.py``)
    0: the table was printed (and ``--out`` written). 2: a bad argument or bad
    input, refused in one line (naming the file and line) before any simulation
    runs: an option out of range, a trace that is missing, unreadable, not UTF-8
    JSON lines (gzip included: decompress it first), not Mooncake format (a
    missing field, a key twice in one object, nesting too deep, a value no trace
    can mean) or empty, a malformed
    ``--cost-model``, an ``--out`` that is not a directory, ``--policies``
    without a baseline to compare with, or both ``--capacity`` and ``--find-load``. 1: ``--max-total-s``
    was spent before the last
    simulation (one line says so), or ``--find-load`` searched and no
    load lets the best baseline meet the SLO (one line says so; raise
    ``--ttft-slo-ms`` or add ``--prefill-instances``, and raise ``--max-wall-s``
    when it says runs were cut by it); nothing is compared, and ``--out`` gets a
    ``results.json`` whose ``find_load`` has ``speedup: null``, the ``error`` and
    the loads tried; or ``--capacity`` found no baseline with a capacity (one line;
    ``results.json``'s ``capacity`` has ``best_baseline: null``, the ``error`` and
    every load tried).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from lb.cost_model import CostModels, load_default
from lb.registry import BASELINES, DECODE_POLICIES, POLICIES, get_policy
from lb.sim import (
    OVER_DECODE_KV, REFUSED_BY_EMPTY_DECODE, SimConfig, SimResult, TraceRequest, json_safe, parse_trace,
    prompts_beyond_fit, reference_hit_ratios, simulate,
)
from lb.types import LBInputError, TierBandwidth
from tools.cli_args import check_output_dir, csv_list, integer, number, one_line

log = logging.getLogger("replay_trace")


class NoFeasibleLoad(RuntimeError):
    """``--find-load``: no load at which the best baseline meets the SLO (a result, exit status 1);
    ``history`` holds every load tried, as ``results.json`` records it."""

    def __init__(self, message: str, history: list | None = None) -> None:
        super().__init__(message)
        self.history = history or []


class Progress:
    """Progress on stderr (no dependency); silent when ``quiet``. On a terminal, one bar redrawn in place
    with ``\r``; otherwise (a file, a pipe, a CI log) plain lines, one per tenth of a run and one at its
    end, so a log never holds carriage returns or thousands of redraws."""

    def __init__(self, quiet: bool = False) -> None:
        self.quiet = quiet
        self.label = ""
        self._tenth = -1  # the last tenth of the current run written as a plain line

    def __call__(self, done: int, total: int) -> None:
        if self.quiet:
            return
        isatty = getattr(sys.stderr, "isatty", None)
        if not (isatty and isatty()):
            tenth = 10 * done // max(total, 1)
            first = done <= 50  # lb.sim calls every 50 arrivals: a run's first call (after a cut one too)
            if done < total and tenth <= self._tenth and not first:
                return
            self._tenth = -1 if done >= total else tenth
            sys.stderr.write(f"{self.label}: {done}/{total} arrivals\n")
            sys.stderr.flush()
            return
        width = 30
        fill = int(width * done / max(total, 1))
        sys.stderr.write(f"\r{self.label:<40.40s} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}")
        if done >= total:
            sys.stderr.write("\n")
        Progress.open_bar = done < total
        sys.stderr.flush()

    open_bar = False  # a bar is on stderr without its newline (ended by main on Ctrl-C)


def _capacity(text: str) -> int | None:
    """A store capacity in blocks (an integer >= 0), or ``inf`` / ``none`` for unbounded."""
    return None if text.lower() in ("inf", "none") else integer(0)(text)


parse_capacities = csv_list(_capacity)  # --store-capacity-blocks (bench_lb checks its own with it)


def _policy_speedup(text: str) -> tuple[str, float]:
    """``POLICY=SPEEDUP`` (``--capacity-start``)."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected POLICY=SPEEDUP, got {text!r}")
    return name.strip(), number(0, 1e6, lo_open=True)(value)


def read_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    """The requests of a Mooncake JSON-lines trace; any problem with the file is one ``LBInputError``
    that names the file (and the line, for a problem on one line). A UTF-8 byte-order mark at the
    start of line 1 is skipped; anywhere else it is refused with its line. The file is read once,
    front to back, so a pipe works (``--trace /dev/stdin``)."""

    def lines(fh):
        for n, raw in enumerate(fh, 1):
            try:
                yield raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise LBInputError(f"trace {path} line {n} is not UTF-8 text ({exc.reason}); "
                                   f"a trace is JSON lines") from None

    try:
        with open(path, "rb") as fh:  # buffered: peek, never seek (a pipe or /dev/stdin can not)
            if fh.peek(2)[:2] == b"\x1f\x8b":
                raise LBInputError(f"trace {path} is gzip-compressed: decompress it first (gunzip -k {path})")
            return parse_trace(lines(fh), limit, source=f"trace {path}")
    except IsADirectoryError:
        raise LBInputError(f"trace {path} is a directory, not a JSON-lines file") from None
    except FileNotFoundError:
        raise LBInputError(f"trace {path}: no such file") from None
    except OSError as exc:
        raise LBInputError(f"trace {path}: cannot read it ({exc.strerror or exc})") from None


def load_cost_model(path: Path) -> CostModels:
    """``--cost-model``: a JSON file from tools/fit_cost_model.py; any problem is one ``LBInputError``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LBInputError(f"--cost-model {path}: cannot read it ({one_line(exc)})") from None
    try:
        if not isinstance(json.loads(text), dict):
            raise LBInputError("not a JSON object")
        return CostModels.from_json(text)
    except (LBInputError, json.JSONDecodeError, TypeError, ValueError) as exc:
        raise LBInputError(f"--cost-model {path} is not a cost model ({exc}); refit with tools/fit_cost_model.py") \
            from None


def run_policies(reqs, names, cfg, models, progress: Progress, decode: str = "kvstack",
                 deadline: float | None = None) -> dict[str, SimResult]:
    """One simulation per policy in ``names``; each is cut at what is left before ``deadline``."""
    res = {}
    for name in names:
        progress.label = f"{name} x{cfg.speedup:.3g} store={cfg.store_capacity_blocks}"
        run_cfg = _run_cfg(cfg, deadline)
        res[name] = simulate(reqs, get_policy(name, models), run_cfg, name=name, models=models,
                             progress=progress, decode_policy=get_policy(decode, models, kind="decode"))
        r = res[name]
        if r.truncated:
            log.warning("%s stopped at --max-wall-s %g s%s after %d of %d arrivals: its figures cover only that "
                        "part of the trace", progress.label, run_cfg.max_wall_s,
                        " (what was left of --max-total-s)" if run_cfg.max_wall_s < cfg.max_wall_s else "",
                        r.arrived, r.requests)
    return res


def best_baseline(results: dict[str, SimResult]) -> str | None:
    """The baseline with the best SLO attainment (both SLOs, over all requests; then lowest TTFT p90 over
    all requests), among complete runs when there is one (a run cut by ``--max-wall-s`` is not a fair
    reference); None without baselines."""
    base = [n for n in results if n in BASELINES]
    if not base:
        return None
    pool = [n for n in base if not results[n].truncated] or base

    def key(n: str) -> tuple:
        p90 = results[n].ttft_all(90)
        return results[n].slo_attainment, -p90 if math.isfinite(p90) else -math.inf

    return max(pool, key=key)


class TimeBudgetSpent(RuntimeError):
    """``--max-total-s`` is spent: no further simulation starts (exit status 1, one line)."""


def _run_cfg(cfg: SimConfig, deadline: float | None) -> SimConfig:
    """``cfg`` for one simulation under the whole-run ``deadline`` (``time.monotonic()``; None: none):
    cut at what is left of it; raises :class:`TimeBudgetSpent` when nothing is."""
    if deadline is None:
        return cfg
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeBudgetSpent("--max-total-s is spent: no further simulation starts; raise --max-total-s")
    return replace(cfg, max_wall_s=min(cfg.max_wall_s, left))


class LoadSearch(NamedTuple):
    """What ``find_load`` found: ``speedup``, every load tried (``history``), and ``bracketed``: False
    when every load tried met the target (none missed it), so ``speedup`` is only a lower bound on the
    load the best baseline can take, not the boundary the search looks for."""

    speedup: float
    history: list
    bracketed: bool


def find_load(reqs, baselines, cfg, models, progress, target: float, iters: int,
              decode: str = "kvstack", deadline: float | None = None) -> LoadSearch:
    """Largest speedup at which the best baseline's TTFT attainment is >= target (bisection, bounded).

    Doubling from ``cfg.speedup`` brackets the boundary (one load that meets the target, one that
    does not) in at most ``iters`` loads, then bisects it in at most ``iters`` more; every run
    is bounded by ``deadline`` (:func:`run_policies`). No load meeting it raises
    :class:`NoFeasibleLoad`; no load missing it returns ``bracketed=False`` (a lower bound).

    A run cut by ``--max-wall-s`` counts every request that never arrived as a miss, so its
    attainment is a lower bound: >= target is a pass; below it is taken as a miss, which may be
    the time bound and not the SLO, and one warning line per such load says so.
    """
    history = []
    unsure = []  # speedups judged a miss while some baseline run was truncated

    def ok(s: float) -> bool:
        res = run_policies(reqs, baselines, replace(cfg, speedup=s), models, progress, decode, deadline)
        best = max(r.ttft_attainment for r in res.values())
        cut = {n: r for n, r in res.items() if r.truncated}
        history.append({"speedup": s, "best_baseline_ttft_attainment": best,
                        "by_policy": {n: r.ttft_attainment for n, r in res.items()},
                        "truncated": sorted(cut)})
        log.info("speedup %.4g: best baseline TTFT attainment %.3f", s, best)
        if best < target and cut:
            unsure.append(s)
            log.warning("--find-load: speedup %.4g counted as missing the SLO, but %s stopped at --max-wall-s "
                        "%g s (%s): its attainment is only a lower bound; raise --max-wall-s to decide this load",
                        s, ", ".join(cut), cfg.max_wall_s,
                        ", ".join(f"{r.arrived} of {r.requests} arrivals" for r in cut.values()))
        return best >= target

    lo, hi = None, None
    s = cfg.speedup
    for _ in range(iters):  # bracket
        if ok(s):
            lo = s
            s *= 2
        else:
            hi = s
            s /= 2
        if lo is not None and hi is not None:
            break
    if lo is None:
        cut = (f"; {len(unsure)} of these loads had runs cut by --max-wall-s {cfg.max_wall_s:g} s, "
               f"so the time bound, not the SLO, may be why: raise --max-wall-s") if unsure else ""
        raise NoFeasibleLoad(f"--find-load: no baseline meets the TTFT SLO at {target:.0%} even at speedup "
                             f"{s * 2:.3g}; raise --ttft-slo-ms or add --prefill-instances{cut}", history)
    if hi is None:
        return LoadSearch(lo, history, False)
    for _ in range(iters):
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
        if hi / lo < 1.02:
            break
    return LoadSearch(lo, history, True)


class Capacity(NamedTuple):
    """What :func:`search_capacity` found for one policy: ``speedup``, the highest load tried at which
    at least ``target`` of all requests met both SLOs (``None``: no load tried did, down to the search's
    floor); ``bracketed``: a load above it missed (False: every load tried up to the step bound met the
    target, so ``speedup`` is only a lower bound); ``history``: every load tried, in order."""

    speedup: float | None
    bracketed: bool
    history: list


def load_row(r: SimResult) -> dict:
    """One load's figures for ``history``: attainments and TTFT percentiles over *all* requests (one not
    served counts as an infinite TTFT, ``None`` in JSON), the hit ratio, and whether the run was cut."""
    return {"slo_attainment": r.slo_attainment, "ttft_attainment": r.ttft_attainment,
            "ttft_all_p50_s": r.ttft_all(50), "ttft_all_p90_s": r.ttft_all(90), "ttft_all_p99_s": r.ttft_all(99),
            "hit_ratio": r.hit_ratio, "rejected": r.rejected, "served": r.served,
            "stopped_early": r.stopped_early, "truncated": r.truncated}


def search_capacity(reqs, name: str, cfg: SimConfig, models, progress, *, target: float = 0.9, iters: int = 8,
                    rel_tol: float = 0.05, min_speedup: float = 1e-3, decode: str = "kvstack",
                    deadline: float | None = None) -> Capacity:
    """Effective request capacity of policy ``name``: the highest speedup at which >= ``target`` of *all*
    requests meet both the TTFT and the TBT SLO (a rejection is a miss), as in the Mooncake paper.

    From ``cfg.speedup``, doubling or halving brackets it (at most ``iters`` loads; below ``min_speedup``
    the policy has no capacity, ``speedup=None``), then a geometric bisection narrows the bracket to a
    ratio of ``1 + rel_tol`` (at most ``iters`` more loads): at most ``2 x iters`` simulations. Each run
    stops as soon as more than ``(1 - target) x requests`` have missed (``stop_after_misses``): the load
    has failed whatever the rest does, so an overloaded run costs little. A run cut by ``--max-wall-s``
    counts as a pass only if its lower-bound attainment meets the target. Attainment is not always
    monotone in the load (noise, cache luck); the bisection keeps the bracket it has, it does not scan, so
    the result depends on the start: compare policies searched from one start (``tools/bench_lb.py``
    gives every policy the same).
    """
    stop = int(math.floor((1.0 - target) * len(reqs) + 1e-9))
    history: list = []

    def ok(s: float) -> bool:
        res = run_policies(reqs, [name], replace(cfg, speedup=s, stop_after_misses=stop), models, progress,
                           decode, deadline)[name]
        history.append({"speedup": s, **load_row(res)})
        return res.slo_attainment >= target

    lo = hi = None
    s = cfg.speedup
    for _ in range(iters):
        if ok(s):
            lo, s = s, s * 2
        else:
            hi, s = s, s / 2
        if (lo is not None and hi is not None) or (lo is None and s < min_speedup):
            break
    if lo is None or hi is None:
        return Capacity(lo, False, history)
    for _ in range(iters):
        if hi / lo <= 1.0 + rel_tol:
            break
        mid = math.sqrt(lo * hi)
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return Capacity(lo, True, history)


def capacity_table(caps: dict[str, Capacity]) -> tuple[str, str | None]:
    """The capacities side by side with the ratio to the best baseline's (the baseline of the highest
    capacity; ``None`` when no baseline has one); returns (table, best baseline)."""
    base = {n: c.speedup for n, c in caps.items() if n in BASELINES and c.speedup is not None}
    best = max(base, key=base.get) if base else None
    lines = [f"{'policy':>12s} {'capacity':>9s} {'vs best':>8s} {'runs':>5s}  note"]
    for n, c in caps.items():
        ratio = (_ratio(c.speedup, base[best]) if best and c.speedup is not None else
                 ("0" if best else "-"))
        note = ("none: below the target at every load tried" if c.speedup is None else
                "" if c.bracketed else "lower bound: no load tried missed the target")
        lines.append(f"{n[:12]:>12s} {_num(c.speedup if c.speedup is not None else math.nan, '.4g'):>9s} "
                     f"{ratio:>8s} {len(c.history):>5d}  {note}")
    lines.append(f"(capacity = the highest speedup at which >= the target of all requests meet both SLOs; "
                 f"ratios vs best baseline = {best or 'none: no baseline has a capacity'})")
    return "\n".join(lines), best


def _num(v: float, spec: str) -> str:
    """``v`` formatted, or ``n/a`` for a figure with no sample (NaN, inf)."""
    return format(v, spec) if math.isfinite(v) else "n/a"


def _opt(v: float | None, spec: str) -> str:
    """``_num`` of a figure read back from ``to_dict`` (where no sample is ``None``)."""
    return _num(math.nan if v is None else v, spec)


def _inf(v: float) -> str:
    """A TTFT percentile over all requests: ``inf`` when too few were served to reach it."""
    return "inf" if v == math.inf else _num(v, ".2f")


def _ratio(a: float, b: float) -> str:
    return _num(a / b, ".3f") if math.isfinite(a) and math.isfinite(b) and b else "-"


def explain_misses(results: dict[str, SimResult], cfg: SimConfig, n: int) -> str:
    """Per policy, the trace (every decision's reason, in order) of its first ``n`` requests that were
    rejected or missed the TTFT SLO (runs made with ``keep_trace``)."""
    slo = math.inf if cfg.ttft_slo_ms is None else cfg.ttft_slo_ms / 1e3
    lines = []
    for name, r in results.items():
        shown = 0
        for idx, steps in sorted(r.trace.items()):
            done = [st for st in steps if st.startswith("prefill done: TTFT ")]
            if done and float(done[0].split()[3]) <= slo:
                continue
            if shown == 0:
                lines.append(f"\n-- {name}: requests that missed the TTFT SLO, and why --")
            lines.append(f"request {idx}: " + " | ".join(steps))
            shown += 1
            if shown >= n:
                break
    return "\n".join(lines)


def format_table(results: dict[str, SimResult], refs: dict) -> str:
    """The main table; a run cut by ``--max-wall-s`` is marked ``*`` and gets no ratios (``-``):
    it covered a different extent of the trace than a complete run."""
    best = best_baseline(results)
    b = results.get(best) if best else None
    cols = ["policy", "hit", "ideal", "lru_ref", "ttft50", "ttft90", "ttft99", "tbt50ms", "tbt90ms",
            "slo_att", "ttft_att", "rej", "imbal", "p90/best", "att/best"]
    lines = [" ".join(f"{c:>9s}" for c in cols)]
    for name, r in results.items():
        p90 = r.ttft_all(90)
        same_extent = b is not None and not r.truncated and not b.truncated
        row = [name[:8] + "*" if r.truncated else name[:9], _num(r.hit_ratio, ".3f"), _num(refs["ideal"], ".3f"),
               _num(refs["lru_oracle"], ".3f"), _inf(r.ttft_all(50)), _inf(p90), _inf(r.ttft_all(99)), _num(r.pct("tbt", 50) * 1e3, ".1f"), _num(r.pct("tbt", 90) * 1e3, ".1f"),
               f"{r.slo_attainment:.3f}", f"{r.ttft_attainment:.3f}", f"{r.rejected}", f"{r.imbalance:.2f}",
               _ratio(p90, b.ttft_all(90)) if same_extent else "-",
               _ratio(r.slo_attainment, b.slo_attainment) if same_extent else "-"]
        lines.append(" ".join(f"{c:>9s}" for c in row))
    if b is not None and b.truncated:
        lines.append("(TTFT in s over all requests; no ratios: every baseline run was cut by --max-wall-s)")
    else:
        lines.append(f"(TTFT in s over all requests, one not served counting as inf; ratios vs best baseline = "
                     f"{best}; lower p90/best is better, att/best compares slo_att)")
    for name, r in results.items():
        never = sum(r.reject_reasons.get(k, 0) for k in (OVER_DECODE_KV, REFUSED_BY_EMPTY_DECODE))
        if never:
            lines.append(f"{name}: {never} of {r.rejected} rejected could never be decoded (more KV memory than the "
                         f"decode policy admits on an empty decode instance, or refused by it on an empty pool)")
    for name, r in results.items():
        if r.truncated:
            lines.append(f"* {name}: cut by --max-wall-s after {r.arrived} of {r.requests} arrivals; its figures cover "
                         f"only that part (attainments count the rest as misses); no ratios against complete runs")
    return "\n".join(lines)


def write_plots(out: Path, sweep: dict, main: dict[str, SimResult]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no PNG plots (pip install 'kvstack[bench]'); JSON was written")
        return []
    import numpy as np

    files = []
    caps = sorted(sweep, key=lambda c: math.inf if c == "inf" else int(c))
    if caps:
        xs = [float("inf") if c == "inf" else int(c) for c in caps]
        finite = [x for x in xs if math.isfinite(x)]
        xplot = [x if math.isfinite(x) else (max(finite) * 2 if finite else 1) for x in xs]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        names = list(next(iter(sweep.values()))["results"])
        for n in names:
            hits = [sweep[c]["results"][n]["hit_ratio"] for c in caps]  # None: no block listed (n/a)
            ax.plot(xplot, [math.nan if h is None else h for h in hits], marker="o", label=n)
        ax.plot(xplot, [sweep[c]["refs"]["lru_oracle"] for c in caps], "k--",
                label="one LRU of that capacity (a reference, not a bound)")
        ax.plot(xplot, [sweep[c]["refs"]["ideal"] for c in caps], "k:", label="ideal (infinite)")
        files.append(_save_log_x(plt, fig, ax, out / "hit_ratio_vs_store_capacity.png",
                                 "shared store capacity (blocks; rightmost point = unbounded)",
                                 "prefix hit ratio (blocks)"))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for n, r in main.items():
        v = np.sort(np.asarray(r.ttft_s))
        if len(v):
            ax.plot(v, np.arange(1, len(v) + 1) / r.requests, label=n)
    files.append(_save_log_x(plt, fig, ax, out / "ttft_cdf.png", "TTFT (s)",
                             "fraction of all requests (rejected never reach 1)"))
    return files


def _save_log_x(plt, fig, ax, path: Path, xlabel: str, ylabel: str) -> str:
    """Finish a log-x plot (labels, legend, grid), write it as PNG, return its file name."""
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path.name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="replay_trace.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma list from: {', '.join(POLICIES)} (at least one baseline: {', '.join(BASELINES)})")
    ap.add_argument("--decode-policy", default="kvstack", choices=sorted(DECODE_POLICIES),
                    help="decode LB used for every run (the table compares prefill policies)")
    ap.add_argument("--prefill-instances", type=integer(1, 4096), default=16)
    ap.add_argument("--decode-instances", type=integer(1, 4096), default=4)
    ap.add_argument("--device-capacity-blocks", type=integer(0), default=2000)
    ap.add_argument("--host-capacity-blocks", type=integer(0), default=8000)
    ap.add_argument("--store-capacity-blocks", type=parse_capacities, default=[20000],
                    help="comma list (first = main run; all = sweep); 'inf' = unbounded")
    ap.add_argument("--speedup", type=number(0, 1e6, lo_open=True), default=0.5,
                    help="time scaling: 2 = twice the trace's offered load")
    ap.add_argument("--limit", type=integer(1), default=None, help="replay only the first N requests")
    ap.add_argument("--ttft-slo-ms", type=number(0, 1e12, lo_open=True), default=20000.0)
    ap.add_argument("--tbt-slo-ms", type=number(0, 1e12, lo_open=True), default=100.0)
    ap.add_argument("--no-admission", action="store_true", help="do not pass SLOs to policies (no rejections)")
    ap.add_argument("--noise", type=number(0, 3), default=0.0, help="log-normal sigma on prefill service times")
    ap.add_argument("--bias", type=number(0.1, 10), default=1.0,
                    help="actual / modelled prefill service time, the same for every prefill (1.3: the cost "
                         "model is 30%% optimistic; 0.7: 30%% pessimistic)")
    ap.add_argument("--store-gbps", type=number(0, 1e6, lo_open=True), default=1.18 * 2**30 / 1e9,
                    help="store -> device GB/s")
    ap.add_argument("--host-gbps", type=number(0, 1e6, lo_open=True), default=10.0, help="host -> device GB/s")
    ap.add_argument("--cost-model", type=Path, default=None, help="cost model JSON (default lb/data/cost_model.json)")
    ap.add_argument("--find-load", action="store_true", help="search the load where the best baseline just meets the SLO")
    ap.add_argument("--find-load-target", type=number(0, 1, lo_open=True), default=0.9,
                    help="required TTFT attainment (0.9 = p90)")
    ap.add_argument("--find-load-iters", type=integer(1, 64), default=8)
    ap.add_argument("--capacity", action="store_true",
                    help="search each policy's capacity (the highest speedup at which >= --capacity-target of all "
                         "requests meet both SLOs; from --speedup), then compare every policy at the best "
                         "baseline's capacity")
    ap.add_argument("--capacity-target", type=number(0, 1, lo_open=True), default=0.9)
    ap.add_argument("--capacity-tol", type=number(0.001, 1), default=0.05,
                    help="stop bisecting once the bracket's hi/lo <= 1 + this")
    ap.add_argument("--capacity-iters", type=integer(1, 64), default=8,
                    help="at most this many loads to bracket, and as many to bisect, per policy")
    ap.add_argument("--capacity-start", type=csv_list(_policy_speedup), default=[],
                    help="POLICY=SPEEDUP,...: where that policy's search starts (default --speedup), e.g. its "
                         "capacity under another condition")
    ap.add_argument("--max-wall-s", type=number(1), default=300.0, help="wall-clock bound per simulation run (>= 1)")
    ap.add_argument("--max-total-s", type=number(1), default=None,
                    help="wall-clock bound on the whole run (>= 1; default: none): runs are cut at it")
    ap.add_argument("--explain", type=integer(0, 1000), default=0,
                    help="after the main table, each policy's decisions for its first N requests that missed an SLO")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="directory for results.json and PNG plots")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")

    # Everything is checked before the first simulation: a bad input costs nothing.
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        ap.error(f"unknown policies {unknown}; known: {', '.join(POLICIES)}")
    if not names:
        ap.error(f"--policies lists no policy; choose from: {', '.join(POLICIES)}")
    if not any(n in BASELINES for n in names):
        ap.error(f"--policies {','.join(names)} has no baseline to compare with; add one of: {', '.join(BASELINES)}")
    if len(set(names)) != len(names):
        ap.error(f"--policies names a policy twice: {','.join(names)}")
    if args.capacity and args.find_load:
        ap.error("--capacity and --find-load are two ways to choose the load: give one")
    if stray := [n for n, _ in args.capacity_start if n not in names]:
        ap.error(f"argument --capacity-start: {', '.join(stray)} is not in --policies")
    if args.out is not None and (msg := check_output_dir(args.out)):
        ap.error(msg)
    try:
        models: CostModels = load_cost_model(args.cost_model) if args.cost_model else load_default()
        reqs = read_trace(args.trace, args.limit)
    except LBInputError as exc:
        ap.error(str(exc))
    if not reqs:
        ap.error(f"trace {args.trace} holds no requests")
    beyond = prompts_beyond_fit(reqs, models)
    if beyond and beyond[0]:
        log.warning("%d of %d requests have prompts longer than the largest the prefill cost model was fitted on "
                    "(%d tokens): their service times are extrapolated", beyond[0], len(reqs), beyond[1])
    caps = args.store_capacity_blocks
    try:
        cfg = SimConfig(
            prefill_instances=args.prefill_instances, decode_instances=args.decode_instances,
            device_capacity_blocks=args.device_capacity_blocks, host_capacity_blocks=args.host_capacity_blocks,
            store_capacity_blocks=caps[0],
            bandwidth=TierBandwidth(host_bytes_per_s=args.host_gbps * 1e9, store_bytes_per_s=args.store_gbps * 1e9),
            speedup=args.speedup, ttft_slo_ms=args.ttft_slo_ms, tbt_slo_ms=args.tbt_slo_ms,
            admission=not args.no_admission, service_noise=args.noise, service_bias=args.bias, seed=args.seed,
            max_wall_s=args.max_wall_s,
        )
    except LBInputError as exc:
        ap.error(str(exc))
    try:
        return _run(args, names, models, reqs, caps, cfg, argv)
    except (NoFeasibleLoad, TimeBudgetSpent) as exc:
        print(f"{ap.prog}: error: {exc}", file=sys.stderr)
        return 1
    except LBInputError as exc:  # misuse found only once running: still one line
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    except KeyboardInterrupt:  # the interrupted line (cli_args.run_main) starts on a line of its own
        if Progress.open_bar:
            sys.stderr.write("\n")
            Progress.open_bar = False
        raise


def _run(args: argparse.Namespace, names: list[str], models: CostModels, reqs: list[TraceRequest],
         caps: list[int | None], cfg: SimConfig, argv: list[str] | None) -> int:
    """The simulations, the table and ``--out``, once every input was checked."""
    progress = Progress(args.quiet)
    t0 = time.monotonic()
    deadline = None if args.max_total_s is None else t0 + args.max_total_s
    out: dict = {"trace": str(args.trace), "requests": len(reqs), "argv": sys.argv[1:] if argv is None else argv,
                 "cost_model": models.meta.get("command", "defaults")}
    if args.find_load:
        baselines = [n for n in names if n in BASELINES]  # at least one: checked in main()
        try:
            s, hist, bracketed = find_load(reqs, baselines, cfg, models, progress, args.find_load_target,
                                           args.find_load_iters, args.decode_policy, deadline)
        except NoFeasibleLoad as exc:  # a result too: results.json records the loads tried, then exit 1
            out["find_load"] = {"speedup": None, "target_ttft_attainment": args.find_load_target,
                                "ttft_slo_ms": args.ttft_slo_ms, "bracketed": False, "error": str(exc),
                                "history": exc.history}
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "results.json").write_text(json.dumps(json_safe(out), indent=2, default=str,
                                                                  allow_nan=False))
            raise
        cfg = replace(cfg, speedup=s)
        out["find_load"] = {"speedup": s, "target_ttft_attainment": args.find_load_target,
                            "ttft_slo_ms": args.ttft_slo_ms, "bracketed": bracketed,
                            "speedup_is": "boundary" if bracketed else "lower_bound", "history": hist}
        if bracketed:
            print(f"load found: speedup {s:.4g} (best baseline TTFT attainment >= {args.find_load_target})")
        else:
            print(f"load NOT bracketed: every load tried ({len(hist)}, up to speedup {s:.4g}) met the SLO, none "
                  f"missed it, so {s:.4g} is only a lower bound; raise --find-load-iters or --speedup")
    if args.capacity:
        c0 = replace(cfg, store_capacity_blocks=caps[0])
        starts = dict(args.capacity_start)
        found = {n: search_capacity(reqs, n, replace(c0, speedup=starts.get(n, c0.speedup)), models, progress,
                                    target=args.capacity_target,
                                    iters=args.capacity_iters, rel_tol=args.capacity_tol, decode=args.decode_policy,
                                    deadline=deadline) for n in names}
        table, best = capacity_table(found)
        at = found[best].speedup if best else cfg.speedup
        print(f"\n== capacity: {len(reqs)} requests, {cfg.prefill_instances} prefill / {cfg.decode_instances} "
              f"decode, TTFT SLO {cfg.ttft_slo_ms} ms, TBT SLO {cfg.tbt_slo_ms} ms, noise {cfg.service_noise:g}, "
              f"bias {cfg.service_bias:g}, target {args.capacity_target:g} of all requests ==")
        print(table)
        out["capacity"] = {"target": args.capacity_target, "best_baseline": best, "compared_at_speedup": at,
                           "by_policy": {n: c._asdict() for n, c in found.items()},
                           "ratio_vs_best": {n: (c.speedup or 0.0) / found[best].speedup if best else None
                                             for n, c in found.items()}}
        if best is None:  # a result too: results.json records the loads tried, then exit 1
            lowest = min(h["speedup"] for c in found.values() for h in c.history)
            msg = (f"--capacity: no baseline meets the TTFT SLO and the TBT SLO for {args.capacity_target:.0%} of "
                   f"the requests even at speedup {lowest:.3g}; raise --ttft-slo-ms or add --prefill-instances")
            out["capacity"]["error"] = msg
            if args.out:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "results.json").write_text(json.dumps(json_safe(out), indent=2, default=str,
                                                                  allow_nan=False))
            raise NoFeasibleLoad(msg)
        cfg = replace(cfg, speedup=at)
    sweep = {}
    main_results: dict[str, SimResult] = {}
    cfg = replace(cfg, keep_trace=bool(args.explain))
    for i, cap in enumerate(caps):
        c = replace(cfg, store_capacity_blocks=cap)
        refs = reference_hit_ratios(reqs, cap, block_tokens=c.block_tokens)
        res = run_policies(reqs, names, c, models, progress, args.decode_policy, deadline)
        key = "inf" if cap is None else str(cap)
        sweep[key] = {"refs": refs, "results": {n: r.to_dict() for n, r in res.items()}}
        if i == 0:
            main_results = res
            print(f"\n== {len(reqs)} requests, speedup {c.speedup:.4g}, {c.prefill_instances} prefill / "
                  f"{c.decode_instances} decode instances, store {key} blocks, TTFT SLO {c.ttft_slo_ms} ms ==")
            print(format_table(res, refs))
            if args.explain:
                print(explain_misses(res, c, args.explain))
    if len(caps) > 1:
        print("\n== hit ratio vs store capacity ==")
        print(f"{'capacity':>9s} {'ideal':>7s} {'lru_ref':>7s} " + " ".join(f"{n[:9]:>9s}" for n in names))
        for key, v in sweep.items():
            print(f"{key:>9s} {_opt(v['refs']['ideal'], '.3f'):>7s} {_opt(v['refs']['lru_oracle'], '.3f'):>7s} "
                  + " ".join(f"{_opt(v['results'][n]['hit_ratio'], '.3f'):>8s}"
                             f"{'*' if v['results'][n]['truncated'] else ' '}"
                             for n in names))
        if any(r["truncated"] for v in sweep.values() for r in v["results"].values()):
            print("(* cut by --max-wall-s: that hit ratio covers only the requests served before it stopped)")
    out["config"] = {k: (v if not isinstance(v, TierBandwidth) else repr(v)) for k, v in
                     ((f, getattr(cfg, f)) for f in cfg.__dataclass_fields__)}
    out["sweep"] = sweep
    out["main_store_capacity"] = "inf" if caps[0] is None else str(caps[0])
    out["best_baseline"] = best_baseline(main_results)
    out["wall_s"] = time.monotonic() - t0
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        # strict JSON: a figure with no sample (NaN) is null, never a bare NaN
        (args.out / "results.json").write_text(json.dumps(json_safe(out), indent=2, default=str, allow_nan=False))
        plots = write_plots(args.out, sweep, main_results)
        print(f"wrote {args.out / 'results.json'}" + (f" and {', '.join(plots)}" if plots else ""))
    return 0


if __name__ == "__main__":
    from tools.cli_args import run_main

    run_main(main)
