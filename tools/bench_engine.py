"""Benchmark the engine plugin on the reference engine: TTFT cold vs hit per tier, replay share,
load throughput, persisted bytes per token, and the window-only span's greedy agreement.

Exact command (the reported figures were produced with it; writes JSON to --out)::

    .venv/bin/python tools/bench_engine.py --sizes 4096,16384,32768 --block-size 256 --reps 3 \
        --agree-n 40 --out results/bench_engine.json
    # 16-token blocks (the test block size; small 8 KiB store entries):
    .venv/bin/python tools/bench_engine.py --sizes 4096,16384,32768 --reps 2 --out bench_engine_b16.json
    # quicker:
    .venv/bin/python tools/bench_engine.py --sizes 1024,2048 --reps 2 --agree-n 10 --out /tmp/b.json
    # add the daemon as a store tier:
    .venv/bin/python tools/bench_engine.py --store-url grpc://127.0.0.1:7070 --out results/bench_engine.json
    # the load-throughput goal (>= 0.8x the store's faster batched get), embedded store:
    .venv/bin/python tools/bench_engine.py --sizes 4096,16384,32768 --block-size 256 --reps 3 \
        --load-reps 15 --agree-n 0 --out results/bench_engine_load.json
    # the same with the daemon as a store tier too:
    .venv/bin/kvstore serve --data-dir /tmp/d --port 0 &   # prints kvstore serving grpc://HOST:PORT
    .venv/bin/python tools/bench_engine.py --sizes 4096,16384,32768 --block-size 256 --reps 3 \
        --load-reps 9 --agree-n 0 --store-url grpc://HOST:PORT --out bench_engine_into.json

What is compared, all in one run, on the same prompts:

* TTFT of turn N+1 (= an N-token prefix + ``--suffix`` new tokens, 1 output token): cold (no
  cache) vs a hit from each tier (device pool, host DRAM, embedded store, daemon store), each
  with the SWA snapshot at the boundary ("snap") and with bounded replay instead ("replay");
  p50/p90/p99 over ``--reps`` and the ratio cold/hit.
* The replay's share of TTFT (replay wall time / TTFT, replay rows).
* Plugin load throughput (``Loader.load_blocks`` into the engine's pool) vs the store's own batched
  gets on the same entries, in the same process and run, interleaved ``--load-reps`` times (GB/s,
  medians and best-of-N). Store paths: ``get_many`` and, where the store has it, ``get_many_into``
  into preallocated buffers (its best API). Plugin paths: the default (on ``--device cpu`` the
  store reads straight into the pool blocks, ``direct_reads``; on accelerators it lands in pinned
  staging buffers and is copied to the device), the staged path on the same backend
  (``direct_reads=False``: one more host copy) and the default over a ``get_many``-only view of
  the store (remote/sharded clients). The goal, ``plugin_over_store >= 0.8``, is the plugin's
  median against the median of the *faster* store path (``store_ref``).
* Persisted bytes per token: measured (global KV blocks + SWA snapshots, logical bytes) vs
  persisting the SWA KV of every token with every block, and vs a window snapshot per block.
* Window-only replay span (``replay_policy="window"``): how often greedy continuations agree
  with cold (reported, not asserted); the exact span is reported alongside as a control.

Arguments are checked before any work, in two steps: the plain numbers first (at once, before
torch is imported: ``--help`` needs no torch either), then what needs torch and the engine
(``--preset``, ``--agree-preset``, ``--device``: refused when torch can not allocate there, e.g.
``cuda`` on a CPU-only build; the engine and connector configs; ``--store-url``). Exit status
(the contract of ``tools/cli_args.py``): 0 when the results were printed and written, 2 for a
bad argument (one line, before any model is built).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from tools.cli_args import check_output_file, csv_list, integer, one_line

B = 16  # block size of the agreement runs (tiny model)


def _import_engine() -> None:
    """torch, the engine and the store (seconds to import): imported once the plain arguments are checked,
    so that ``--help`` and a bad number answer at once. Binds the module names used below."""
    global torch, kvstore, BlockLoad, LoadSpec, Tier, Engine, EngineConfig, ReferenceModel, SamplingParams
    global model_preset, MODEL_PRESETS, ConnectorConfig, KVStoreConnector, ReadsInto, ONE
    import torch

    import kvstore
    from engine_plugin.contract import BlockLoad, LoadSpec, Tier
    from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
    from engine_plugin.reference import (MODEL_PRESETS, Engine, EngineConfig, ReferenceModel, SamplingParams,
                                         model_preset)
    from kvstore.api import ReadsInto

    ONE = SamplingParams(max_new_tokens=1)


class _GetManyOnly:
    """A store seen through the plain protocol only (no ``get_many_into``): the load peer."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        if name == "get_many_into":
            raise AttributeError(name)
        return getattr(self.inner, name)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def summary(xs: list[float]) -> dict:
    return {"p50": pct(xs, 50), "p90": pct(xs, 90), "p99": pct(xs, 99), "n": len(xs)}


class Bench:
    def __init__(self, args):
        self.args = args
        self.model = ReferenceModel(model_preset(args.preset), device=args.device)
        self.vocab = self.model.cfg.vocab_size

    def ecfg(self, n_tokens: int) -> EngineConfig:
        B = self.args.block_size
        return EngineConfig(block_size=B, num_blocks=2 * (n_tokens // B) + 64, chunk_size=self.args.chunk,
                            max_batched_tokens=self.args.chunk, device=self.args.device, sync_timing=True)

    def engine(self, store, n_tokens: int, **kw) -> Engine:
        conn = None
        if store is not False:
            conn = KVStoreConnector(self.model.kv_layout(), ConnectorConfig(
                block_size=self.args.block_size, device=self.args.device, host_capacity_bytes=4 << 30,
                **kw), store)
        return Engine(self.model, self.ecfg(n_tokens), connector=conn)

    @staticmethod
    def ttft(eng: Engine, rid: str, prompt: list[int]):
        t0 = time.perf_counter()
        eng.add_request(rid, prompt, ONE)
        while rid not in eng.finished:
            eng.step()
        return time.perf_counter() - t0, eng.finished[rid]

    def size(self, N: int, stores: dict) -> dict:
        a, rng = self.args, random.Random(N)
        prefix = [rng.randrange(self.vocab) for _ in range(N)]

        def turn() -> list[int]:  # a fresh new message each time: no timed run hits another's tail
            return prefix + [rng.randrange(self.vocab) for _ in range(a.suffix)]

        out: dict = {"tokens": N, "suffix": a.suffix, "rows": {}}
        cold = []
        for sname, store in stores.items():
            # The previous turn ran once per store, cold, with the plugin saving: it is both the
            # cold TTFT sample and the seed (an interval snapshot lands exactly at N).
            seed = self.engine(store, N + a.suffix, snapshot_interval_blocks=N // a.block_size)
            t, req = self.ttft(seed, "seed", turn())
            assert req.hit_tokens == 0, "the store was not empty: the cold sample would be a hit"
            cold.append(t)
            seed.connector.flush()
            m = seed.connector.metrics.snapshot()
            out.setdefault("persisted_bytes_per_token", m.get("bytes_saved", 0) / (N + a.suffix))
            seed.connector.close()
        cold += [self.ttft(self.engine(False, N + a.suffix), "c", turn())[0] for _ in range(a.cold_reps - 1)]
        out["rows"]["cold"] = summary(cold)
        for mode in ("snap", "replay"):
            kw = {"load_snapshots": mode == "snap"}
            tiers = [("device", "embedded"), ("host", "embedded")] + [("store", s) for s in stores]
            for tier, sname in tiers:
                times, shares, hits = [], [], []
                for i in range(a.reps):
                    eng = self.engine(stores[sname], N + a.suffix, **kw)
                    if tier in ("device", "host"):
                        eng.generate(prefix, ONE)  # warm the device pool (it loads from the store)
                        eng.connector.flush()
                        if tier == "host":
                            eng.pool.drop_cached()
                    t, req = self.ttft(eng, f"t{i}", turn())
                    times.append(t)
                    shares.append(req.replay_s / t)
                    hits.append(req.hit_tokens)
                    eng.connector.close()
                name = f"{tier}:{sname}:{mode}" if tier == "store" else f"{tier}:{mode}"
                out["rows"][name] = summary(times) | {"replay_share": statistics.median(shares),
                                                      "hit_tokens": min(hits)}
        out["load"] = {s: self.load_throughput(prefix, st) for s, st in stores.items()}
        return out

    def load_throughput(self, prefix: list[int], store) -> dict:
        """Plugin load paths vs the store's own batched gets on the same entries, interleaved.

        Store paths: ``get_many`` (bytes objects) and, where the store has it, ``get_many_into``
        into preallocated numpy buffers (its best batched API: no allocation, one copy). Plugin
        paths (``Loader.load_blocks`` into the engine's pool, no promotion): the default (direct
        into the pool on a host-resident backend, else staged), staged (``direct_reads=False``;
        only timed when the default is direct) and the default over a ``get_many``-only view of
        the store. The goal figure ``plugin_over_store`` is the plugin's median against the
        *faster* store path's median (``store_ref``); best-of-N ratios are kept alongside.
        """
        cfg = ConnectorConfig(block_size=self.args.block_size, device=self.args.device, promote_to_host=False,
                              load_batch_blocks=256, staging_buffers=512)
        conn = KVStoreConnector(self.model.kv_layout(), cfg, store)
        direct = getattr(conn, "direct_reads", False)
        peers = {"plugin": conn, "plugin_get_many_path": KVStoreConnector(self.model.kv_layout(), cfg,
                                                                          _GetManyOnly(store))}
        if direct:
            peers["plugin_staged"] = KVStoreConnector(self.model.kv_layout(), replace(cfg, direct_reads=False),
                                                      store)
        eng = Engine(self.model, self.ecfg(len(prefix)), connector=conn)
        keys = eng.hasher.hash_blocks(prefix)
        spec = LoadSpec("bench", tuple(BlockLoad(i, i, k, Tier.STORE) for i, k in enumerate(keys)), 0)
        nbytes = len(keys) * conn.block_nbytes
        outs = [np.empty(conn.block_nbytes, np.uint8) for _ in keys]  # get_many_into's buffers, reused

        def get_many() -> None:
            assert all(g is not None for g in store.get_many(keys, kind="block"))

        def get_many_into() -> None:
            assert all(i is not None for i in store.get_many_into(keys, outs, kind="block"))

        def loader(c) -> None:
            good, ev = c.loader.load_blocks(spec, eng.pool.kv)
            c.backend.sync_event(ev["global"])
            assert good == len(keys)

        paths = {"store_get_many": get_many}
        if isinstance(store, ReadsInto):
            paths["store_get_many_into"] = get_many_into
        paths |= {name: (lambda c=c: loader(c)) for name, c in peers.items()}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for fn in paths.values():  # warm-up: every path then reads warm caches, buffers allocated
            fn()
        for _ in range(self.args.load_reps or self.args.reps):
            for name, fn in paths.items():  # interleaved: a noisy neighbour hits every path alike
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        for c in peers.values():
            c.close()
        med = {n: statistics.median(ts) for n, ts in times.items()}
        best = {n: min(ts) for n, ts in times.items()}
        stores = [n for n in times if n.startswith("store_")]
        ref = min(stores, key=med.__getitem__)  # the faster store path: the honest reference
        ref_best = min(best[n] for n in stores)
        out = {"bytes": nbytes, "reps": len(times["plugin"]), "native_into": isinstance(store, ReadsInto),
               "direct_reads": direct, "store_ref": ref,
               "paths": {n: {"median_GBps": nbytes / med[n] / 1e9, "best_GBps": nbytes / best[n] / 1e9,
                             "p90_s": pct(times[n], 90)} for n in times},
               "plugin_over_store": med[ref] / med["plugin"],
               "plugin_over_store_best": ref_best / best["plugin"],
               "plugin_over_store_get_many": med["store_get_many"] / med["plugin"]}
        for n in peers:
            if n != "plugin":
                out[f"{n}_over_store"] = med[ref] / med[n]
        return out

    def agreement(self) -> dict:
        a = self.args
        model = ReferenceModel(model_preset(a.agree_preset), device=a.device)
        R, W = model.replay_span("exact"), model.replay_span("window")
        rng = random.Random(7)
        res = {"preset": a.agree_preset, "exact_span": R, "window_span": W, "n": a.agree_n}
        tmp = Path(tempfile.mkdtemp(prefix="bench-agree-"))
        store = None
        sp = SamplingParams(max_new_tokens=a.agree_tokens)
        stats = {"exact": [], "window": []}
        try:
            store = kvstore.connect(str(tmp / "store"))
            for i in range(a.agree_n):
                n = rng.randint(2 * R, 4 * R) // B * B
                prompt = [rng.randrange(model.cfg.vocab_size) for _ in range(n + rng.randint(1, 30))]
                cold = Engine(model, EngineConfig(block_size=B, chunk_size=4096,
                                                  num_blocks=len(prompt) // B + 16)).generate(prompt, sp)
                for pol in stats:
                    # Seeded by a cold prefill under the policy's own namespace (an approximate
                    # policy's KV is kept apart from exact KV: Engine, namespace_tag).
                    seed = KVStoreConnector(model.kv_layout(), ConnectorConfig(block_size=B, replay_policy=pol), store)
                    Engine(model, EngineConfig(block_size=B, num_blocks=len(prompt) // B + 16),
                           connector=seed).generate(prompt[:n], ONE)
                    seed.close()
                    c = KVStoreConnector(model.kv_layout(), ConnectorConfig(block_size=B, replay_policy=pol,
                                                                    load_snapshots=False), store)
                    warm = Engine(model, EngineConfig(block_size=B, num_blocks=len(prompt) // B + 16),
                                  connector=c).generate(prompt, sp)
                    c.close()
                    k = next((j for j, (x, y) in enumerate(zip(cold.output, warm.output)) if x != y),
                             len(cold.output))
                    stats[pol].append(k)
        finally:
            if store is not None:
                store.close()
            shutil.rmtree(tmp, ignore_errors=True)
        for pol, ks in stats.items():
            res[pol] = {"full_agreement": sum(k == a.agree_tokens for k in ks) / len(ks),
                        "first_token_agreement": sum(k > 0 for k in ks) / len(ks),
                        "mean_agreeing_prefix": statistics.mean(ks)}
        return res


def persisted_model(cfg, B: int) -> dict:
    isz = torch.empty((), dtype=getattr(torch, cfg.dtype)).element_size()
    glob = cfg.d_global * isz
    swa_tok = cfg.n_layers * 2 * cfg.n_heads * cfg.head_dim * isz
    snap = cfg.n_layers * 2 * (cfg.window - 1) * cfg.n_heads * cfg.head_dim * isz
    return {"global_only": glob, "swa_kv_with_every_block": glob + swa_tok,
            "window_snapshot_every_block": glob + snap / B}


def check_with_engine(a) -> str | None:
    """What only torch and the engine can tell (None: all good); called before any model is built."""
    for opt, name in (("--preset", a.preset), ("--agree-preset", a.agree_preset if a.agree_n > 0 else a.preset)):
        if name not in MODEL_PRESETS:
            return f"{opt} {name!r} is not a model preset; known: {', '.join(sorted(MODEL_PRESETS))}"
    try:
        torch.empty(1, device=a.device)
    except (RuntimeError, AssertionError, ValueError) as exc:  # e.g. cuda on a CPU-only torch build
        return f"--device {a.device}: torch can not allocate there ({one_line(exc)})"
    n_max = max(a.sizes) + a.suffix
    try:
        EngineConfig(block_size=a.block_size, num_blocks=2 * (n_max // a.block_size) + 64, chunk_size=a.chunk,
                     max_batched_tokens=a.chunk, device=a.device, sync_timing=True)
        ConnectorConfig(block_size=a.block_size, device=a.device, host_capacity_bytes=4 << 30,
                        snapshot_interval_blocks=min(a.sizes) // a.block_size)
    except (kvstore.InvalidRequest, ValueError, TypeError) as exc:
        return f"the engine refuses these arguments: {one_line(exc)}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=csv_list(integer(1, 1 << 22)), default=[4096, 16384, 32768],
                    help="cached prefix lengths in tokens, each a multiple of --block-size")
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=integer(1, 10_000), default=3)
    ap.add_argument("--load-reps", type=integer(0, 10_000), default=0, help="load throughput reps (default: --reps)")
    ap.add_argument("--cold-reps", type=integer(1, 10_000), default=1)
    ap.add_argument("--suffix", type=integer(1, 1 << 20), default=64)
    ap.add_argument("--chunk", type=integer(1, 1 << 22), default=2048)
    ap.add_argument("--block-size", type=integer(1, 1 << 16), default=16, help="tokens per block (= store entry)")
    ap.add_argument("--threads", type=integer(1, 1024), default=2)
    ap.add_argument("--store-url", default=None, help="also measure a daemon store, e.g. grpc://host:port")
    ap.add_argument("--data-dir", default=None, help="embedded store directory (default: a temp dir)")
    ap.add_argument("--agree-preset", default="tiny")
    ap.add_argument("--agree-n", type=integer(0, 100_000), default=40)
    ap.add_argument("--agree-tokens", type=integer(1, 4096), default=16)
    ap.add_argument("--out", default="results/bench_engine.json")
    a = ap.parse_args(argv)
    bad = [n for n in a.sizes if n % a.block_size]
    if bad:
        ap.error(f"--sizes {bad}: each size must be a multiple of --block-size {a.block_size} "
                 f"(the cached prefix is whole blocks)")
    if a.data_dir and Path(a.data_dir).exists() and not Path(a.data_dir).is_dir():
        ap.error(f"--data-dir {a.data_dir} exists and is not a directory")
    if msg := check_output_file(a.out):
        ap.error(msg)
    if a.store_url:
        from kvstore.errors import InvalidRequest
        from kvstore.client.options import split_urls

        try:
            split_urls(a.store_url)  # a daemon URL, never a path to open an embedded store at
        except InvalidRequest as exc:
            ap.error(f"--store-url: {exc}")
    _import_engine()
    if msg := check_with_engine(a):
        ap.error(msg)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(a.threads)
    tmp = Path(a.data_dir or tempfile.mkdtemp(prefix="bench-engine-"))
    stores: dict = {}
    try:  # from here on, whatever happens (Ctrl-C included): stores closed, temporary directory removed
        try:
            stores["embedded"] = kvstore.connect(str(tmp / "store"))
            if a.store_url:
                stores["daemon"] = kvstore.connect(a.store_url)
                stores["daemon"].stats()  # reachable, before any model is built
        except kvstore.KVStoreError as exc:
            ap.error(f"{'--store-url' if 'embedded' in stores else '--data-dir'}: {one_line(exc)}")
        bench = Bench(a)
        results = {"args": vars(a), "model": bench.model.cfg.model_id, "sizes": [],
                   "persisted_model_bytes_per_token": persisted_model(bench.model.cfg, a.block_size)}
        for N in a.sizes:
            print(f"bench_engine: {N} cached tokens ...", file=sys.stderr, flush=True)
            results["sizes"].append(bench.size(N, stores))
            print_size(results["sizes"][-1])
        if a.agree_n > 0:
            print(f"bench_engine: greedy agreement, {a.agree_n} prompts ...", file=sys.stderr, flush=True)
            results["window_span_agreement"] = bench.agreement()
    finally:
        for s in stores.values():
            s.close()
        if not a.data_dir:
            shutil.rmtree(tmp, ignore_errors=True)
    print_tail(results)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {a.out}")
    return 0


def print_size(r: dict) -> None:
    cold = r["rows"]["cold"]["p50"]
    print(f"\n== {r['tokens']} cached tokens + {r['suffix']} new: TTFT (s) ==")
    print(f"{'path':28} {'p50':>8} {'p90':>8} {'p99':>8} {'cold/hit':>9} {'replay%':>8} {'hit':>7}")
    for name, row in r["rows"].items():
        print(f"{name:28} {row['p50']:8.3f} {row['p90']:8.3f} {row['p99']:8.3f} {cold / row['p50']:9.1f}"
              f" {100 * row.get('replay_share', 0):7.1f}% {row.get('hit_tokens', 0):7d}")
    for s, ld in r["load"].items():
        p = ld["paths"]
        print(f"load {s} ({ld['bytes'] / 1e6:.1f} MB x {ld['reps']}, GB/s median / best):")
        for name, row in p.items():
            print(f"  {name:24} {row['median_GBps']:6.2f} / {row['best_GBps']:6.2f}")
        extra = "".join(f", {n[:-len('_over_store')]} {v:.2f}" for n, v in ld.items()
                        if n.endswith("_over_store") and n != "plugin_over_store")
        print(f"  plugin / {ld['store_ref']} (the faster store path), medians: {ld['plugin_over_store']:.2f}"
              f" (best-of {ld['plugin_over_store_best']:.2f}; vs store_get_many {ld['plugin_over_store_get_many']:.2f})"
              f"{extra}; direct_reads={ld['direct_reads']}")


def print_tail(res: dict) -> None:
    pm = res["persisted_model_bytes_per_token"]
    meas = [s["persisted_bytes_per_token"] for s in res["sizes"]]
    print("\n== persisted bytes per token ==")
    if meas:
        print(f"measured (blocks + snapshots, bounded replay): {meas[-1]:.1f}  ({meas[-1] / pm['global_only']:.2f}x "
              f"global-only, {meas[-1] / pm['swa_kv_with_every_block']:.2f}x persisting SWA KV with every block)")
    for k, v in pm.items():
        print(f"{k:30} {v:10.1f}  ({v / pm['global_only']:.1f}x global-only)")
    ag = res.get("window_span_agreement")
    if ag:
        print(f"\n== greedy agreement with cold, {ag['n']} prompts ({ag['preset']}) ==")
        for pol in ("exact", "window"):
            span = ag[f"{pol}_span"]
            print(f"span {pol:6} ({span:4d} tokens): full {ag[pol]['full_agreement']:.2f}, first token "
                  f"{ag[pol]['first_token_agreement']:.2f}, mean agreeing prefix {ag[pol]['mean_agreeing_prefix']:.1f}")


if __name__ == "__main__":
    from tools.cli_args import run_main

    run_main(main)
