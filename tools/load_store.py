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

``--direct-reads on|auto`` opens every client with that option (``kvstore.direct``): reads
go to the daemons' target files, puts and lookups over gRPC; the report adds the clients'
summed direct-read counters (``direct``: reads served directly, fallbacks to the daemon).
``--direct-writes on|auto`` likewise for puts (``kvstore.direct_writes``: clients write the
pack files, the daemons index them; the daemons it starts get ``--allow-direct-writes true``);
the report adds ``direct_w`` (entries written directly, commits, fallbacks).

Verification: key ``j`` is ``BLAKE2b-128(seed:j)`` and its value is
``SHAKE-128(key)`` of a length derived from the key, so any process can check
any value it reads. A get that returns other bytes counts as ``wrong_bytes``;
a lookup that claims ``h`` blocks is checked by reading block ``h-1`` back.
After the run, one process reads back every key anyone acknowledged. Exit
status 1 when ``wrong_bytes`` or ``errors`` is non-zero.

Reports throughput (ops/s, MiB/s), p50/p90/p99 latency per operation, misses,
errors and wrong bytes; ``--out`` writes the JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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


def worker(wid: int, args: dict, out: "mp.Queue") -> None:
    import kvstore
    from kvstore import PutItem
    from kvstore.errors import KVStoreError, NotFound

    rng = random.Random(args["seed"] * 1000 + wid)
    store = kvstore.connect(args["url"], direct_reads=args["direct_reads"], direct_writes=args["direct_writes"])
    lat: dict[str, list[float]] = {"put": [], "get": [], "lookup": []}
    res = {"ops": 0, "bytes_in": 0, "bytes_out": 0, "misses": 0, "errors": 0, "wrong_bytes": 0,
           "error_samples": [], "acked": []}
    L, space, vb, seed = args["chain_len"], args["key_space"], args["value_bytes"], args["seed"]
    end = time.monotonic() + args["seconds"]
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
        except (KVStoreError, OSError) as exc:
            res["errors"] += 1
            if len(res["error_samples"]) < 5:
                res["error_samples"].append(f"{type(exc).__name__}: {exc}"[:300])
    # one client: {"counters": ...}; a sharded one: {url: {"counters": ...}}
    for name, st in (("direct", store.direct_stats()), ("direct_w", store.direct_write_stats())):
        res[name] = st["counters"] if "counters" in st else _summed(x["counters"] for x in st.values())
    store.close()
    res["lat"] = lat
    out.put(res)


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


def run(args: argparse.Namespace) -> dict:
    from tools.daemon_util import start_daemon, stop_daemon

    daemons = []
    tmp = None
    url = args.url
    if not url:
        tmp = tempfile.TemporaryDirectory(prefix="kvload-")
        opts = ["--fsync", str(args.fsync), "--allow-direct-writes", str(args.direct_writes != "off").lower()]
        daemons = [start_daemon(Path(tmp.name) / f"d{i}", opts) for i in range(args.daemons)]
        url = ",".join(d.url for d in daemons)
    try:
        ctx = mp.get_context("spawn")
        q: mp.Queue = ctx.Queue()
        params = {"url": url, "seconds": args.seconds, "max_ops": args.max_ops, "seed": args.seed,
                  "value_bytes": args.value_bytes, "key_space": args.key_space, "chain_len": args.chain_len,
                  "put": args.put, "put_batch": args.put_batch, "get": args.get, "direct_reads": args.direct_reads,
                  "direct_writes": args.direct_writes}
        procs = [ctx.Process(target=worker, args=(w, params, q)) for w in range(args.procs)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        results = [q.get(timeout=args.seconds + 120) for _ in procs]
        for p in procs:
            p.join(30)
        wall = time.monotonic() - t0
        acked = {j for r in results for j in r["acked"]}
        final_wrong, final_missing = verify_all(url, args.seed, args.value_bytes, acked, args.direct_reads)
    finally:
        for d in daemons:
            stop_daemon(d)
        if tmp is not None:
            tmp.cleanup()
    lat = {op: [x for r in results for x in r["lat"][op]] for op in ("put", "get", "lookup")}
    ops = sum(r["ops"] for r in results)
    return {
        "url": url if args.url else f"{args.daemons} fresh daemon(s)", "daemons": args.daemons if not args.url else None,
        "procs": args.procs, "seconds": args.seconds, "wall_s": round(wall, 2), "value_bytes": args.value_bytes,
        "put_batch": args.put_batch,
        "ops": ops, "ops_per_s": round(ops / args.seconds, 1),
        "mib_in_per_s": round(sum(r["bytes_in"] for r in results) / args.seconds / 2**20, 2),
        "mib_out_per_s": round(sum(r["bytes_out"] for r in results) / args.seconds / 2**20, 2),
        "latency_ms": {op: {"n": len(v), **{f"p{int(q * 100)}": round(pct(v, q) * 1e3, 3) if v else None
                                             for q in (0.5, 0.9, 0.99)}} for op, v in lat.items()},
        "misses": sum(r["misses"] for r in results), "errors": sum(r["errors"] for r in results),
        "error_samples": [e for r in results for e in r["error_samples"]][:10],
        "wrong_bytes": sum(r["wrong_bytes"] for r in results) + final_wrong,
        "acknowledged_keys": len(acked), "final_missing": final_missing,
        "direct_reads": args.direct_reads, "direct": _summed(r["direct"] for r in results),
        "direct_writes": args.direct_writes, "direct_w": _summed(r["direct_w"] for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="mixed load on kvstore daemons, every read verified")
    ap.add_argument("--url", default="", help="existing daemon(s): grpc://h:p[,grpc://h:p...]")
    ap.add_argument("--daemons", type=int, default=1, help="daemons to start when --url is not given")
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--max-ops", type=int, default=200_000, help="per process")
    ap.add_argument("--value-bytes", type=int, default=64 * 1024)
    ap.add_argument("--key-space", type=int, default=2000)
    ap.add_argument("--chain-len", type=int, default=16)
    ap.add_argument("--put", type=float, default=0.3)
    ap.add_argument("--put-batch", type=int, default=1, help="keys per put op (> 1: one put_many, as an engine saves)")
    ap.add_argument("--get", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fsync", default="true")
    ap.add_argument("--direct-reads", default="off", choices=["off", "on", "auto"],
                    help="clients read the daemons' target files directly (kvstore.direct)")
    ap.add_argument("--direct-writes", default="off", choices=["off", "on", "auto"],
                    help="clients write pack files into the daemons' targets (kvstore.direct_writes)")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rep = run(args)
    text = json.dumps(rep, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 1 if rep["wrong_bytes"] or rep["errors"] or rep["final_missing"] else 0


if __name__ == "__main__":
    sys.exit(main())
