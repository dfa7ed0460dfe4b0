"""Mooncake Store peer for tools/bench_remote.py; runs inside Mooncake's own venv.

    /tmp/mcvenv/bin/python tools/mooncake_peer.py storage METADATA_URL MASTER SECONDS
    /tmp/mcvenv/bin/python tools/mooncake_peer.py bench METADATA_URL MASTER SIZES N BATCH

``storage`` mounts a 2 GiB segment and stays up (the storage process);
``bench`` mounts none (every byte goes over TCP to the storage process) and
prints one JSON line of MiB/s for put/get, single and batched, per size.
Only the standard library and ``mooncake`` are imported here, and ``mooncake``
only once the arguments are checked: ``--help`` works in any Python, and a
Python without it gets one line naming the venv to use (exit status 2, as for
a bad argument).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time


def _count(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return v


def _sizes(text: str) -> list[int]:
    return [_count(x) for x in text.split(",")]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mooncake_peer.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
    st = sub.add_parser("storage", help="mount a 2 GiB segment and stay up for SECONDS")
    be = sub.add_parser("bench", help="time put/get against the storage process; one JSON line")
    for p in (st, be):
        p.add_argument("meta", metavar="METADATA_URL", help="http://127.0.0.1:PORT/metadata")
        p.add_argument("master", metavar="MASTER", help="the master's 127.0.0.1:PORT")
    st.add_argument("seconds", metavar="SECONDS", type=_seconds, help="how long to stay up (> 0)")
    be.add_argument("sizes", metavar="SIZES", type=_sizes, help="comma list of value sizes in bytes (>= 1)")
    be.add_argument("n", metavar="N", type=_count, help="values per size and mode (>= 1)")
    be.add_argument("batch", metavar="BATCH", type=_count, help="values per batch (>= 1)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        ap.error(f"cannot import mooncake ({exc}); run this with the Mooncake venv's python "
                 f"(bash tools/install_peers.sh --mooncake creates .bench/mooncake-venv)")

    meta, master = args.meta, args.master
    s = MooncakeDistributedStore()
    if args.role == "storage":
        rc = s.setup("127.0.0.1:17811", meta, 2 << 30, 64 << 20, "tcp", "", master)
        print(json.dumps({"setup": rc}), flush=True)
        time.sleep(args.seconds)
        return 0
    sizes, n, batch = args.sizes, args.n, args.batch
    rc = s.setup("127.0.0.1:17812", meta, 0, 512 << 20, "tcp", "", master)
    out: dict = {"setup": rc}
    for size in sizes:
        v = os.urandom(size)
        r: dict = {}
        keys = [f"s{size}-{i}" for i in range(n)]
        t = time.perf_counter()
        for k in keys:
            assert s.put(k, v) == 0
        r["put"] = n * size / (time.perf_counter() - t) / 2**20
        t = time.perf_counter()
        for k in keys:
            assert s.get(k) == v
        r["get"] = n * size / (time.perf_counter() - t) / 2**20
        keys = [f"b{size}-{i}" for i in range(n)]
        t = time.perf_counter()
        for i in range(0, n, batch):
            assert all(x == 0 for x in s.put_batch(keys[i:i + batch], [v] * len(keys[i:i + batch])) or [0])
        r["put_batch"] = n * size / (time.perf_counter() - t) / 2**20
        t = time.perf_counter()
        for i in range(0, n, batch):
            got = s.get_batch(keys[i:i + batch])
            assert all(g == v for g in got)
        r["get_batch"] = n * size / (time.perf_counter() - t) / 2**20
        out[str(size)] = r
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # stdlib only
    from tools.cli_args import run_main

    run_main(main)
