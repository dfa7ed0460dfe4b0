"""TTFT and load throughput of prefix hits in a real vLLM: kvstack against vLLM's own hits and
its shipped storage connector, same engine build, same prompts, one run.

    python tools/bench_vllm.py --out results/bench_vllm.json            # the full run (minutes)
    python tools/bench_vllm.py --tokens 4096 --prompts 3 --out /tmp/b.json   # a quick look

Systems, each engine a fresh process (``tools.vllm_run``), greedy, one output token per
prompt (TTFT = the wall time of a one-token ``generate``, prompts one at a time, after one
short warm-up prompt that is not counted):

=================  =====================================================================
cold               no connector, empty prefix cache: every token prefilled
vllm-prefix-cache  the same engine, the same prompts again: vLLM's in-engine prefix cache
                   (nothing is loaded; the upper bound a store can approach)
kvstack-embedded   a fresh engine loading what another engine saved, embedded store
kvstack-daemon     the same through ``kvstore serve`` on loopback (gRPC)
kvstack-direct     the daemon again, the client reading the fragments itself from the
                   daemon's targets (``direct_reads``: one ``Locate`` call per batch)
example-connector  vLLM's ``ExampleConnector`` (safetensors files per prompt), the storage
                   peer a vLLM user has today; on vLLM's CPU backend it mis-reads the
                   KV layout, and a run whose tokens differ from cold is reported as such
=================  =====================================================================

Every engine that hits then runs the same prompts again without resetting vLLM's prefix
cache: its own in-engine hit, in the same process, is the bound its hit is compared with
(``x own hit``). Load throughput: ``hit KV bytes / (TTFT hit - TTFT own in-engine hit)``,
per prompt: the time a hit costs beyond an in-engine hit is the time spent bringing the KV
in; the same formula for every system. kvstack also reports its loader's own figure (bytes
/ loader seconds).
Hybrid: a Gemma3-style model (sliding and full layers alternating) saves its prompts with
kvstack; persisted bytes per prompt token against storing every layer's KV per block.

The goals (README, benchmarks): kvstack hit TTFT <= 0.15x cold and within 1.5x of vLLM's
in-engine hit; load throughput >= 2x the example connector's; hybrid persisted bytes per
token <= 1.1x the full-attention share of store-everything; 0 wrong tokens anywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from tools.daemon_util import start_daemon, stop_daemon
from tools.vllm_models import ModelSpec, build_model, prompt_ids
from tools.vllm_run import connector_config, engine_env, read_stats


def _engine(workdir: Path, name: str, spec: dict, limit_s: float) -> dict:
    d = workdir / name
    d.mkdir(parents=True, exist_ok=True)
    (d / "spec.json").write_text(json.dumps(spec))
    env = engine_env(inproc=False)
    t0 = time.perf_counter()
    with open(d / "log.txt", "w") as log:
        rc = subprocess.call([sys.executable, "-m", "tools.vllm_run", str(d / "spec.json"), str(d / "out.json")],
                             cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=limit_s)
    print(f"  {name}: exit {rc} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    if rc != 0:
        tail = (d / "log.txt").read_text()[-1500:]
        return {"error": f"exit {rc}: ...{tail.strip().splitlines()[-1] if tail.strip() else ''}"}
    return json.loads((d / "out.json").read_text())


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summary(name: str, out: dict, want: list[dict], kv_bytes_per_token: float) -> dict:
    """A system's row from its engine's output: round 0 its hits (or cold), round 1 the same
    prompts again in the same engine (its own in-engine hit); the warm-up prompt left out."""
    if "rounds" not in out:
        return {"system": name, "error": out.get("error", "did not run")}
    rnd, own = out["rounds"][0][1:], out["rounds"][1][1:]
    ttft, bound = [o["seconds"] for o in rnd], [o["seconds"] for o in own]
    hit = [o["num_cached_tokens"] for o in rnd]
    wrong = sum(o["tokens"] != w["tokens"] for o, w in zip(rnd, want))
    extra = [t - b for t, b in zip(ttft, bound)]
    positive = all(e > 0 for e in extra)  # else the hit costs nothing measurable over the bound
    gbps = [h * kv_bytes_per_token / e / 1e9 for h, e in zip(hit, extra) if h > 0] if positive else []
    return {"system": name, "ttft_s": ttft, "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": _pct(ttft, 0.9),
            "own_hit_p50_s": statistics.median(bound), "x_own_hit": statistics.median(t / b for t, b in zip(ttft, bound)),
            "hit_tokens_mean": statistics.mean(hit), "wrong_outputs": wrong, "prompts": len(rnd),
            "load_gbps_p50": statistics.median(gbps) if gbps else None,
            "load_extra_s_p50": statistics.median(extra)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384, help="prompt length (default 16384)")
    ap.add_argument("--prompts", type=int, default=5, help="distinct prompts per system (default 5)")
    ap.add_argument("--block-size", type=int, default=128, help="vLLM block size (default 128, vLLM's on CPU)")
    ap.add_argument("--hidden", type=int, default=256, help="plain model width (default 256)")
    ap.add_argument("--layers", type=int, default=4, help="plain model layers (default 4)")
    ap.add_argument("--hybrid-tokens", type=int, default=4096, help="hybrid model prompt length")
    ap.add_argument("--engine-limit-s", type=float, default=900.0, help="bound on one engine process")
    ap.add_argument("--work", help="work folder (default: a temporary one)")
    ap.add_argument("--out", help="write the results JSON here")
    args = ap.parse_args(argv)
    # refused before anything starts: each would fail minutes later inside an engine
    if args.prompts < 1:
        ap.error(f"--prompts must be at least 1, got {args.prompts}")
    if args.block_size < 32 or args.block_size % 32:
        ap.error(f"--block-size must be a multiple of 32 (vLLM's CPU attention), got {args.block_size}")
    if args.tokens <= 2 * args.block_size:
        ap.error(f"--tokens must exceed two blocks ({2 * args.block_size}) so that a hit can be measured, "
                 f"got {args.tokens}")
    if args.hybrid_tokens < 256:
        ap.error(f"--hybrid-tokens must be at least 256 (several sliding windows), got {args.hybrid_tokens}")
    if args.hidden < 16 or args.layers < 1:
        ap.error(f"--hidden must be at least 16 and --layers at least 1, got {args.hidden} and {args.layers}")
    if not args.engine_limit_s > 0:
        ap.error(f"--engine-limit-s must be a positive number of seconds, got {args.engine_limit_s}")
    if args.out and Path(args.out).is_dir():
        ap.error(f"--out {args.out} is a directory; give a file path")

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    mspec = ModelSpec(kind="plain", hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2, head_dim=64,
                      intermediate=3 * args.hidden, max_positions=args.tokens + 1024)
    model = build_model(work / "model-plain", mspec)
    kv_bytes_per_token = 2 * mspec.layers * mspec.kv_heads * mspec.head_dim * 2  # K and V, bf16
    warmup = {"ids": prompt_ids(2 * args.block_size + 7, 99)}
    prompts = [warmup] + [{"ids": prompt_ids(args.tokens, 100 + i)} for i in range(args.prompts)]
    base = {"model": str(model), "block_size": args.block_size, "max_model_len": args.tokens + 64,
            "prompts": prompts, "max_tokens": 1, "one_by_one": True, "logprobs": 1, "rounds": 2,
            "reset_between_rounds": False}
    limit = args.engine_limit_s
    print(f"bench_vllm: {args.prompts} prompts of {args.tokens} tokens, work folder {work}", file=sys.stderr)

    cold = _engine(work, "cold", base, limit)
    if "rounds" not in cold:
        raise SystemExit(f"bench_vllm: the cold engine failed: {cold['error']}")
    want = cold["rounds"][0][1:]
    own = {"rounds": [cold["rounds"][1], cold["rounds"][1]]}
    rows = [_summary("cold", cold, want, kv_bytes_per_token), _summary("vllm-prefix-cache", own, want, kv_bytes_per_token)]
    rows[0].update(x_own_hit=None, load_gbps_p50=None)

    def kvstack(name: str, url: str, save: bool = True, **opts) -> None:
        st = work / f"stats-{name}"
        saved = _engine(work, f"{name}-save", dict(base, rounds=1, kv_transfer_config=connector_config(
            url, stats_file=str(st) + "-s", **opts)), limit) if save else {}
        hit = _engine(work, f"{name}-hit", dict(base, kv_transfer_config=connector_config(
            url, stats_file=str(st) + "-h", **opts)), limit)
        row = _summary(name, hit, want, kv_bytes_per_token)
        w = read_stats(str(st) + "-h", "worker")
        if w.get("load_seconds"):
            row["loader_gbps"] = w["bytes_loaded"] / w["load_seconds"] / 1e9
        row["errors"] = [r["error"] for r in (saved, hit) if "error" in r]
        rows.append(row)

    kvstack("kvstack-embedded", str(work / "kv-embedded"))
    daemon = start_daemon(work / "kv-daemon")
    try:
        kvstack("kvstack-daemon", daemon.url)
        kvstack("kvstack-direct", daemon.url, save=False, direct_reads="on")  # what kvstack-daemon saved
    finally:
        stop_daemon(daemon)

    ex = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"shared_storage_path": str(work / "example")}}
    _engine(work, "example-save", dict(base, rounds=1, kv_transfer_config=ex), limit)
    rows.append(_summary("example-connector", _engine(work, "example-hit", dict(base, kv_transfer_config=ex), limit),
                         want, kv_bytes_per_token))

    # Hybrid: persisted bytes per token against storing every layer's KV for every block.
    hspec = ModelSpec(kind="hybrid", max_positions=args.hybrid_tokens + 1024)
    hmodel = build_model(work / "model-hybrid", hspec)
    hdir = work / "kv-hybrid"
    hprompts = [{"ids": prompt_ids(args.hybrid_tokens, 200 + i)} for i in range(2)]
    hout = _engine(work, "hybrid-save", {"model": str(hmodel), "block_size": 32, "max_model_len": args.hybrid_tokens + 64,
                                         "prompts": hprompts, "max_tokens": 16, "kv_transfer_config": connector_config(str(hdir))},
                   limit)
    import kvstore
    from kvstore.index_view import iter_rows

    store = kvstore.connect(hdir)
    try:
        stored = {"block": 0, "swa": 0}
        for r in iter_rows(store):
            stored[r.kind.value] = stored.get(r.kind.value, 0) + r.meta.plain_len
    finally:
        store.close()
    tokens_saved = sum(len(p["ids"]) + 16 for p in hprompts)
    per_token_all = 2 * hspec.layers * hspec.kv_heads * hspec.head_dim * 2
    full_share = (hspec.layers // 2) / hspec.layers
    persisted = (stored["block"] + stored["swa"]) / tokens_saved
    hybrid = {"persisted_bytes_per_token": persisted, "store_everything_bytes_per_token": per_token_all,
              "ratio_to_store_everything": persisted / per_token_all, "full_attention_share": full_share,
              "ratio_to_full_share": persisted / per_token_all / full_share, "block_bytes": stored["block"],
              "swa_bytes": stored["swa"], "errors": [hout["error"]] if "error" in hout else []}

    by = {r["system"]: r for r in rows}
    c50, b50 = by["cold"]["ttft_p50_s"], by["vllm-prefix-cache"]["ttft_p50_s"]
    ex_ok = "ttft_p50_s" in by["example-connector"] and not by["example-connector"]["wrong_outputs"]
    ex_gbps = by["example-connector"].get("load_gbps_p50") if ex_ok else None

    def fmt(v, nd=2):
        return "n/a" if v is None else f"{v:.{nd}f}"

    print(f"\n{'system':18} {'TTFT p50':>8} {'p90':>7} {'x cold':>7} {'x vLLM':>7} {'x own':>6} {'hit tok':>8} "
          f"{'+load s':>8} {'GB/s':>6} {'wrong':>5}")
    for r in rows:
        if "ttft_p50_s" not in r:
            print(f"{r['system']:18} error: {r.get('error')}")
            continue
        print(f"{r['system']:18} {r['ttft_p50_s']:8.3f} {r['ttft_p90_s']:7.3f} {r['ttft_p50_s'] / c50:7.3f} "
              f"{r['ttft_p50_s'] / b50:7.2f} {fmt(r.get('x_own_hit'))!s:>6} {r['hit_tokens_mean']:8.0f} "
              f"{fmt(r.get('load_extra_s_p50'), 3)!s:>8} {fmt(r.get('load_gbps_p50'))!s:>6} {r['wrong_outputs']:5d}")
    print("x vLLM: against vLLM's in-engine hit in the cold engine; x own: against the same engine's own "
          "in-engine hit of the same prompts; +load s: TTFT minus that (the cost of bringing the KV in)")
    for name in ("kvstack-embedded", "kvstack-daemon", "kvstack-direct"):
        r = by[name]
        if "ttft_p50_s" in r:
            ratio = r["load_gbps_p50"] / ex_gbps if ex_gbps and r.get("load_gbps_p50") else None
            print(f"{name}: loader {r.get('loader_gbps', 0):.2f} GB/s; load throughput vs example connector: "
                  f"{'n/a (no positive load time to compare)' if ratio is None else f'{ratio:.2f}x'}")
    print(f"hybrid: {hybrid['persisted_bytes_per_token']:.0f} B/token persisted, store-everything "
          f"{per_token_all} B/token: {hybrid['ratio_to_store_everything']:.3f}x "
          f"(full-attention share {full_share:.2f}: {hybrid['ratio_to_full_share']:.3f}x of it)")
    result = {"args": vars(args), "kv_bytes_per_token": kv_bytes_per_token, "systems": rows, "hybrid": hybrid,
              "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
