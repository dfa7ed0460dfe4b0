"""Mooncake Store peer for tools/bench_remote.py; runs inside Mooncake's own venv.

From the repository root (``tools.bench_peers`` starts it with the root on ``PYTHONPATH``,
since the Mooncake venv does not have this project installed)::

    PYTHONPATH=. /tmp/mcvenv/bin/python tools/mooncake_peer.py storage METADATA_URL MASTER SECONDS
    PYTHONPATH=. /tmp/mcvenv/bin/python tools/mooncake_peer.py serve METADATA_URL MASTER

``storage`` mounts a 2 GiB segment and stays up (the storage process);
``serve`` mounts none (every byte goes over TCP to the storage process) and runs the put and
get steps another process asks for, so that
``tools/bench_peers.MooncakePeer`` can interleave Mooncake with other systems step by step.
It prints ``{"setup": RC}``, then answers each JSON line read from stdin with one on
stdout, until stdin closes:

  ``{"op": "value", "id": I, "path": P}``   value ``I`` is the bytes of file ``P``
  ``{"op": "put" | "put_batch", "keys": [...], "vals": [I, ...]}``  -> ``{"s": SECONDS}``
  ``{"op": "get" | "get_batch", "keys": [...]}``  -> ``{"s": SECONDS, "got": [I or -1, ...]}``

``s`` is the time of the Mooncake call alone (the pipe is not counted); ``got`` names the
value each key read back as (-1: none of them, or nothing), compared after the timing; a
failed call answers ``{"error": TEXT}``. ``put`` and ``get`` take one key.
Only the standard library and ``mooncake`` are imported here, and ``mooncake``
only once the arguments are checked: ``--help`` works in any Python, and a
Python without it gets one line naming the venv to use (exit status 2, as for
a bad argument).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number of seconds > 0, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mooncake_peer.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="role", required=True)
    st = sub.add_parser("storage", help="mount a 2 GiB segment and stay up for SECONDS")
    sv = sub.add_parser("serve", help="run the put/get steps asked on stdin, one JSON line each")
    for p in (st, sv):
        p.add_argument("meta", metavar="METADATA_URL", help="http://127.0.0.1:PORT/metadata")
        p.add_argument("master", metavar="MASTER", help="the master's 127.0.0.1:PORT")
    st.add_argument("seconds", metavar="SECONDS", type=_seconds, help="how long to stay up (> 0)")
    return ap


def _step(s, cmd: dict, vals: dict[int, bytes], ids: dict[bytes, int]) -> dict:
    """One command of ``serve`` (module docstring) on the Mooncake client ``s``."""
    op, keys = cmd["op"], cmd.get("keys", [])
    if op == "value":
        with open(cmd["path"], "rb") as f:
            vals[cmd["id"]] = v = f.read()
        ids.setdefault(v, cmd["id"])
        return {}
    if op in ("put", "put_batch"):
        vs = [vals[i] for i in cmd["vals"]]
        t = time.perf_counter()
        rcs = [s.put(keys[0], vs[0])] if op == "put" else s.put_batch(keys, vs)
        dt = time.perf_counter() - t
        if any(rc != 0 for rc in rcs or [0]):
            return {"error": f"{op} of {len(keys)} keys returned {list(rcs)}"}
        return {"s": dt}
    if op in ("get", "get_batch"):
        t = time.perf_counter()
        got = [s.get(keys[0])] if op == "get" else s.get_batch(keys)
        dt = time.perf_counter() - t
        return {"s": dt, "got": [ids.get(bytes(g), -1) if g else -1 for g in got]}
    return {"error": f"unknown op {op!r}"}


def serve(s, inp, out) -> int:
    """``serve``'s loop: one answer per command line, until ``inp`` closes."""
    vals: dict[int, bytes] = {}
    ids: dict[bytes, int] = {}
    for line in inp:
        try:
            reply = _step(s, json.loads(line), vals, ids)
        except Exception as exc:  # noqa: BLE001 - any failure is this step's answer, not a dead pipe
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


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
    rc = s.setup("127.0.0.1:17812", meta, 0, 512 << 20, "tcp", "", master)
    print(json.dumps({"setup": rc}), flush=True)
    return serve(s, sys.stdin, sys.stdout) if rc == 0 else 1


if __name__ == "__main__":
    from tools.cli_args import run_main  # standard library only: runs in the Mooncake venv too

    run_main(main)
