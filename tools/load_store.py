"""Mixed put/get/lookup load on kvstore daemons over loopback, every read verified byte for byte.

Commands (from the repository root)::

    .venv/bin/python tools/load_store.py --procs 4 --seconds 20 --out results/load_1daemon.json
    .venv/bin/python tools/load_store.py --procs 4 --seconds 20 --daemons 3 --out results/load_3daemons.json
    .venv/bin/python tools/load_store.py --url grpc://127.0.0.1:7070 --procs 4 --seconds 20
    .venv/bin/python tools/load_store.py --procs 4 --seconds 20 --direct-reads on --out results/load_direct.json
    .venv/bin/python tools/load_store.py --procs 4 --seconds 20 --put-batch 4 --direct-writes on --direct-reads on

Without ``--url`` it starts ``--daemons`` fresh ``kvstore serve`` processes on
127.0.0.1 (port 0, temporary data directories; several daemons are reached as
one sharded store) and stops them afterwards. ``--procs`` client processes
(multiprocessing, spawn) each run a bounded loop (``--seconds`` and
``--max-ops``) of puts (``--put``; ``--put-batch N`` puts N consecutive keys in one
``put_many``), gets (``--get``) and chain lookups (the rest).

``--direct-reads on|auto`` opens every client with that option (``kvstore.client.direct_reads``): reads
go to the daemons' target files, puts and lookups over gRPC; the report adds the clients'
summed direct-read counters (``direct``: reads served directly, fallbacks to the daemon).
``--direct-writes on|auto`` likewise for puts (``kvstore.client.direct_writes``: clients write the
pack files, the daemons index them; the daemons it starts get ``--allow-direct-writes true``);
the report adds ``direct_w`` (entries written directly, commits, fallbacks).

Verification: key ``j`` is ``BLAKE2b-128(seed:j)`` and its value is
``SHAKE-128(key)`` of a length derived from the key, so any process can check
any value it reads. A get that returns other bytes counts as ``wrong_bytes``;
a lookup that claims ``h`` blocks is checked by reading block ``h-1`` back.
After the run, one process reads back every key anyone acknowledged.

Reports throughput (ops/s, MiB/s, over ``wall_s``: the measured span from the
first client's first operation to the last client's last one, never the
requested ``--seconds``), p50/p90/p99 latency per operation, misses, errors and
wrong bytes; ``--out`` writes the JSON. While it runs, a progress line goes to
stderr every few seconds.

Exit status (the contract of ``tools/cli_args.py``): 0 when every read was
right; 1 when ``wrong_bytes``, ``errors`` or ``final_missing`` is non-zero, or
when a client process died (the run is stopped at once, the daemons and their
``kvload-*`` temporary directory removed, and its error printed in one line);
2 for a bad argument or an unreachable ``--url``, refused before anything starts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import queue
import random
import sys
import tempfile
import time
from pathlib import Path

from tools.cli_args import (check_output_file, choice_bool, integer, number, one_line,
                            sigint_deferred, sigint_ignored_in_children)

MAX_VALUE_BYTES = 40 * 2**20  # values are 0.5x..1.5x --value-bytes; the store's default limit is 64 MiB
PROGRESS_EVERY_S = 5.0


class ClientFailed(RuntimeError):
    """A client process died or reported an exception: the run is stopped."""


def key_of(seed: int, j: int) -> bytes:
    return hashlib.blake2b(f"{seed}:{j}".encode(), digest_size=16).digest()


def value_of(key: bytes, value_bytes: int) -> bytes:
    n = value_bytes // 2 + (int.from_bytes(key[:4], "little") % max(1, value_bytes))  # 0.5x .. 1.5x
    return hashlib.shake_128(key).digest(n)


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def worker(wid: int, args: dict, out: "mp.Queue", ops_done) -> None:
    """One client process: its report, or ``{"wid", "error"}`` if it failed, goes to ``out``."""
    try:
        res = client_loop(wid, args, ops_done)
    except Exception as exc:  # reported to the parent, which stops the whole run
        out.put({"wid": wid, "error": one_line(exc)[:500]})
        return
    out.put(res)


def client_loop(wid: int, args: dict, ops_done) -> dict:
    import kvstore
    from kvstore import PutItem
    from kvstore.errors import KVStoreError, NotFound

    rng = random.Random(args["seed"] * 1000 + wid)
    store = kvstore.connect(args["url"], direct_reads=args["direct_reads"], direct_writes=args["direct_writes"])
    lat: dict[str, list[float]] = {"put": [], "get": [], "lookup": []}
    res = {"wid": wid, "ops": 0, "bytes_in": 0, "bytes_out": 0, "misses": 0, "errors": 0, "wrong_bytes": 0,
           "error_samples": [], "acked": []}
    L, space, vb, seed = args["chain_len"], args["key_space"], args["value_bytes"], args["seed"]
    # the load window, on the system-wide monotonic clock: the parent spans all clients' windows
    res["t_start"] = time.monotonic()
    end = res["t_start"] + args["seconds"]
    while time.monotonic() < end and res["ops"] < args["max_ops"]:
        r = rng.random()
        j = rng.randrange(space)
        k = key_of(seed, j)
        t0 = time.perf_counter()
        try:
            if r < args["put"]:
                if args["put_batch"] > 1:  # consecutive keys in one put_many (pack files)
                    js = [(j + i) % space for i in range(args["put_batch"])]
                    vs = [value_of(key_of(seed, x), vb) for x in js]
                    store.put_many([PutItem(key_of(seed, x), v) for x, v in zip(js, vs)])
                else:
                    js, vs = [j], [value_of(k, vb)]
                    store.put(k, vs[0])
                res["bytes_in"] += sum(map(len, vs))
                res["acked"].extend(js)
                op = "put"
            elif r < args["put"] + args["get"]:
                op = "get"
                try:
                    got = store.get(k)
                    res["bytes_out"] += len(got)
                    if got != value_of(k, vb):
                        res["wrong_bytes"] += 1
                except NotFound:
                    res["misses"] += 1
            else:
                op = "lookup"
                c = (j // L) * L
                chain = [key_of(seed, c + i) for i in range(L)]
                hit = store.lookup(chain).hit_blocks
                if hit:  # the lookup's claim must hold: block hit-1 is readable and right
                    if store.get(chain[hit - 1]) != value_of(chain[hit - 1], vb):
                        res["wrong_bytes"] += 1
                else:
                    res["misses"] += 1
            lat[op].append(time.perf_counter() - t0)
            res["ops"] += 1
            ops_done[wid] = res["ops"]
        except (KVStoreError, OSError) as exc:
            res["errors"] += 1
            if len(res["error_samples"]) < 5:
                res["error_samples"].append(f"{type(exc).__name__}: {exc}"[:300])
    res["t_end"] = time.monotonic()
    # one client: {"counters": ...}; a sharded one: {url: {"counters": ...}}
    for name, st in (("direct", store.direct_stats()), ("direct_w", store.direct_write_stats())):
        res[name] = st["counters"] if "counters" in st else _summed(x["counters"] for x in st.values())
    store.close()
    res["lat"] = lat
    return res


def _summed(dicts) -> dict:
    out: dict = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


def verify_all(url: str, seed: int, value_bytes: int, acked: set[int], direct_reads: str = "off") -> tuple[int, int]:
    import kvstore

    wrong = missing = 0
    with kvstore.connect(url, direct_reads=direct_reads) as s:
        ids = sorted(acked)
        for i in range(0, len(ids), 64):
            part = ids[i:i + 64]
            for j, v in zip(part, s.get_many([key_of(seed, j) for j in part])):
                if v is None:
                    missing += 1
                elif v != value_of(key_of(seed, j), value_bytes):
                    wrong += 1
    return wrong, missing


def collect(procs: list, q: "mp.Queue", ops_done, seconds: float) -> list[dict]:
    """Every client's report, in client order; a progress line on stderr every few seconds.

    Raises ``ClientFailed`` as soon as one client reports an exception or dies without a
    report (the caller stops the others), or when they outlast ``seconds`` + 120 s."""
    results: dict[int, dict] = {}
    t0 = time.monotonic()
    deadline, next_note = t0 + seconds + 120, t0 + PROGRESS_EVERY_S
    exited_at: dict[int, float] = {}

    def take(r: dict) -> None:
        if "error" in r:
            raise ClientFailed(f"client process {r['wid']} failed: {r['error']}")
        results[r["wid"]] = r

    while len(results) < len(procs):
        try:
            take(q.get(timeout=0.25))
            continue
        except queue.Empty:
            pass
        now = time.monotonic()
        for w, p in enumerate(procs):
            if w in results or p.exitcode is None:
                continue
            # a clean exit has flushed its report into the queue first: give the pipe a moment
            if p.exitcode != 0 or now - exited_at.setdefault(w, now) > 5.0:
                try:  # its own error report, if it managed to send one
                    while True:
                        take(q.get(timeout=0.5))
                except queue.Empty:
                    pass
                if w not in results:
                    raise ClientFailed(f"client process {w} died without a report (exit code {p.exitcode})")
        if now > deadline:
            raise ClientFailed(f"client processes did not finish within --seconds + 120 s ({seconds + 120:g} s)")
        if now >= next_note:
            next_note = now + PROGRESS_EVERY_S
            print(f"load_store: {now - t0:.0f} s of {seconds:g} s, {sum(ops_done)} ops, "
                  f"{len(results)}/{len(procs)} clients done", file=sys.stderr, flush=True)
    return [results[w] for w in range(len(procs))]


def run(args: argparse.Namespace) -> dict:
    from tools.daemon_util import start_daemon, stop_daemon

    daemons = []
    tmp = None
    url = args.url
    ctx = mp.get_context("spawn")
    procs: list = []
    q: mp.Queue = ctx.Queue()
    try:
        if not url:
            tmp = tempfile.TemporaryDirectory(prefix="kvload-")
            opts = ["--fsync", str(args.fsync).lower(),
                    "--allow-direct-writes", str(args.direct_writes != "off").lower()]
            for i in range(args.daemons):
                daemons.append(start_daemon(Path(tmp.name) / f"d{i}", opts))
            url = ",".join(d.url for d in daemons)
        params = {"url": url, "seconds": args.seconds, "max_ops": args.max_ops, "seed": args.seed,
                  "value_bytes": args.value_bytes, "key_space": args.key_space, "chain_len": args.chain_len,
                  "put": args.put, "put_batch": args.put_batch, "get": args.get, "direct_reads": args.direct_reads,
                  "direct_writes": args.direct_writes}
        ops_done = ctx.RawArray("q", args.procs)  # per client, for the progress line only
        procs = [ctx.Process(target=worker, args=(w, params, q, ops_done)) for w in range(args.procs)]
        with sigint_ignored_in_children():  # Ctrl-C: this process stops them (finally below), quietly
            for p in procs:
                p.start()
        results = collect(procs, q, ops_done, args.seconds)
        for p in procs:
            p.join(30)
        # the measured load window: first client's start to last client's end (not --seconds)
        wall = max(r["t_end"] for r in results) - min(r["t_start"] for r in results)
        acked = {j for r in results for j in r["acked"]}
        final_wrong, final_missing = verify_all(url, args.seed, args.value_bytes, acked, args.direct_reads)
    finally:
        with sigint_deferred():  # a Ctrl-C now waits until everything below is stopped
            for p in procs:  # still running only when the run stopped early: stop them first
                if p.is_alive():
                    p.terminate()
                    p.join(5)
                    if p.is_alive():
                        p.kill()
                        p.join(5)
            q.close()
            q.cancel_join_thread()
            for d in daemons:
                stop_daemon(d)
            if tmp is not None:
                tmp.cleanup()
    lat = {op: [x for r in results for x in r["lat"][op]] for op in ("put", "get", "lookup")}
    ops = sum(r["ops"] for r in results)

    def per_s(x: float, scale: float = 1.0, nd: int = 1) -> float | None:
        return round(x / scale / wall, nd) if wall > 0 else None

    return {
        "url": url if args.url else f"{args.daemons} fresh daemon(s)", "daemons": args.daemons if not args.url else None,
        "procs": args.procs, "seconds": args.seconds, "wall_s": round(wall, 3), "value_bytes": args.value_bytes,
        "put_batch": args.put_batch,
        "ops": ops, "ops_per_s": per_s(ops),
        "mib_in_per_s": per_s(sum(r["bytes_in"] for r in results), 2**20, 2),
        "mib_out_per_s": per_s(sum(r["bytes_out"] for r in results), 2**20, 2),
        "latency_ms": {op: {"n": len(v), **{f"p{int(q * 100)}": round(pct(v, q) * 1e3, 3) if v else None
                                             for q in (0.5, 0.9, 0.99)}} for op, v in lat.items()},
        "misses": sum(r["misses"] for r in results), "errors": sum(r["errors"] for r in results),
        "error_samples": [e for r in results for e in r["error_samples"]][:10],
        "wrong_bytes": sum(r["wrong_bytes"] for r in results) + final_wrong,
        "acknowledged_keys": len(acked), "final_missing": final_missing,
        "direct_reads": args.direct_reads, "direct": _summed(r["direct"] for r in results),
        "direct_writes": args.direct_writes, "direct_w": _summed(r["direct_w"] for r in results),
    }


def check_url(url: str) -> str | None:
    """Why ``--url`` can not be used (None: every daemon in it answers)."""
    import kvstore
    from kvstore.errors import KVStoreError
    from kvstore.client.options import split_urls

    try:
        split_urls(url)
        with kvstore.connect(url, timeout_s=10) as s:
            s.stats()
    except KVStoreError as exc:
        return f"--url {url}: {one_line(exc)}"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="mixed load on kvstore daemons, every read verified")
    ap.add_argument("--url", default="", help="existing daemon(s): grpc://h:p[,grpc://h:p...]")
    ap.add_argument("--daemons", type=integer(1, 64), default=1, help="daemons to start when --url is not given")
    ap.add_argument("--procs", type=integer(1, 256), default=4, help="client processes")
    ap.add_argument("--seconds", type=number(0, 86400, lo_open=True), default=10.0,
                    help="load duration per client (the report divides by the measured wall_s)")
    ap.add_argument("--max-ops", type=integer(1), default=200_000, help="per process")
    ap.add_argument("--value-bytes", type=integer(1, MAX_VALUE_BYTES), default=64 * 1024,
                    help="mean value size (each value is 0.5x..1.5x of it)")
    ap.add_argument("--key-space", type=integer(1), default=2000)
    ap.add_argument("--chain-len", type=integer(1), default=16)
    ap.add_argument("--put", type=number(0, 1), default=0.3, help="share of puts")
    ap.add_argument("--put-batch", type=integer(1, 1024), default=1,
                    help="keys per put op (> 1: one put_many, as an engine saves)")
    ap.add_argument("--get", type=number(0, 1), default=0.5, help="share of gets (the rest: lookups)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fsync", type=choice_bool, default=True, help="daemons it starts fsync (true/false)")
    ap.add_argument("--direct-reads", default="off", choices=["off", "on", "auto"],
                    help="clients read the daemons' target files directly (kvstore.client.direct_reads)")
    ap.add_argument("--direct-writes", default="off", choices=["off", "on", "auto"],
                    help="clients write pack files into the daemons' targets (kvstore.client.direct_writes)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if args.put + args.get > 1:
        ap.error(f"--put + --get must be <= 1 (the rest are lookups), got {args.put} + {args.get}")
    if args.out and (msg := check_output_file(args.out)):
        ap.error(msg)
    if args.url and (msg := check_url(args.url)):
        ap.error(msg)
    try:
        rep = run(args)
    except (RuntimeError, OSError) as exc:  # a client that died (ClientFailed), a daemon that did not start
        ap.exit(1, f"{ap.prog}: error: {exc if isinstance(exc, ClientFailed) else one_line(exc)}\n")
    text = json.dumps(rep, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 1 if rep["wrong_bytes"] or rep["errors"] or rep["final_missing"] else 0


if __name__ == "__main__":
    from tools.cli_args import run_main

    run_main(main)
