"""Remote (gRPC daemon) store throughput vs the embedded store, Redis and Mooncake Store, in one run.

Command (from the repository root; ``bash tools/install_peers.sh --mooncake`` first for
redis-server and the Mooncake venv)::

    .venv/bin/python tools/bench_remote.py --out results/bench_remote.json
    .venv/bin/python tools/bench_remote.py --fsync true --n 64     # durable puts (fsync) for kvstore

``run_remote(args)`` (arguments from ``add_arguments``) is the whole comparison, for
other scripts to call. Measured, per entry size (128 KiB and 1 MiB): put and get
throughput, single calls and batches of ``--batch``, for

* ``embedded``: ``kvstore.connect(dir)`` in this process (4+2 erasure code, zstd off: random bytes),
* ``remote``:   one ``kvstore serve`` daemon on 127.0.0.1, same store config, over gRPC,
* ``remote_direct``: the same daemon (``allow_direct_writes``), client opened with
  ``direct_reads="on"`` (``kvstore.direct``) and ``direct_writes="on"`` (``kvstore.direct_writes``):
  reads ask the daemon where the fragments are (``Locate``) and read and verify them from the
  daemon's target directories in this process, as on a shared DFS mount; puts encode and write
  the pack files in this process and ask the daemon to index them (``Commit``).
  Its client's counters go to the JSON under ``direct_stats`` and ``direct_write_stats``
  (fallbacks must be 0),
* ``redis``:    ``redis-server`` on 127.0.0.1 (no persistence), SET/GET, MSET/MGET pipelines,
* ``mooncake``: Mooncake Store over TCP on loopback (master with its HTTP metadata server +
  one storage process with a 2 GiB segment; the bench client mounts no memory), from its own
  venv: ``$KVSTACK_MOONCAKE_VENV``, default ``.bench/mooncake-venv`` in the repository, as
  ``tools/install_peers.sh --mooncake`` creates it (``--mooncake-python`` overrides). Its
  metadata server and transfer engine listen on 0.0.0.0 whatever their flags say, so all of it
  runs in a private network namespace holding only loopback (``unshare --net``, util-linux);
  where one cannot be made, Mooncake is skipped with the reason.

and the p50/p90/p99 of ``lookup`` on a chain of ``--chain`` blocks (default 1,000; all hit, an SWA
snapshot at every boundary, so the answer is ``hit_blocks = swa_at = --chain``): embedded, over
gRPC, and sharded over 3 daemons. Peers that cannot run are reported with the reason, never silently dropped.
kvstore writes use ``fsync=false`` by default (page-cache durability, like Redis without AOF
and Mooncake's memory pool); ``--fsync true`` measures durable puts. Prints a table with ratios
(``remote`` and ``remote_direct`` / each peer); ``--out`` writes the JSON. Issue #3's goals for
batched gets: ``remote_direct`` >= 1.0x ``mooncake`` and >= 2x ``redis``. Every throughput is
the median of ``--repeat`` rounds (each round: ``--n`` entries per size and mode, all systems;
the three kvstore clients interleaved op by op, ``bench_kvstores``, so each meets the page
cache and the disk in the same state: run one after the other, the last one met the
writeback of the others' puts);
each ratio is the median of the per-round ratios; the per-round values are kept in the JSON
under ``rounds``. Loopback on a shared 2-core machine is noisy: compare ratios from one run,
not absolute figures across runs.

Profile of the remote batch path (16 x 1 MiB, fsync off), before the streaming RPCs:
GetMany was ~65 ms per batch against 4.7 ms embedded. Server: building the 16 MiB
GetManyReply (upb copies each value into its arena) ~20 ms, serializing it (second copy)
~14 ms; gRPC moving one 16 MiB message ~28 ms against ~10 ms for sixteen 1 MiB messages on
a bare echo server (same options; max_frame_size / lookahead / BDP options changed nothing
measurable). Client PutMany: ~35 ms building and serializing before the first byte is sent.
Now: GetStream/PutStream (one message per value, small values packed to ~1 MiB), values
hand-encoded with one copy (kvstore.server.wire), the server reading window k+1 while it
sends window k. What is left for put is the store's own put_many (erasure coding and
fragment writes): remote put_batch is within ~1.1-1.5x of embedded.

Progress goes to stderr, one line per round and per lookup measurement. Exit status (the
contract of ``tools/cli_args.py``): 0 when the table was printed; 2 for a bad argument,
refused in one line before any daemon starts; 1 when a daemon did not start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # noqa: E402 - run as a script

from tools.bench_peers import Peer  # noqa: E402
from tools.bench_store import interleaved_rep  # noqa: E402
from tools.cli_args import check_output_file, choice_bool, csv_list, integer, one_line  # noqa: E402
from tools.daemon_util import stop_process  # noqa: E402

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent


def mooncake_python() -> str:
    """The Mooncake venv's python, found as tools/install_peers.sh --mooncake places it."""
    venv = os.environ.get("KVSTACK_MOONCAKE_VENV") or str(ROOT / ".bench" / "mooncake-venv")
    return str(Path(venv) / "bin" / "python")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _key(tag: str, i: int) -> bytes:
    return hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest()


def _mibs(nbytes: int, seconds: float) -> float:
    """Throughput in MiB/s, unrounded: the per-round ratios are taken from these (``_medians``
    rounds only the printed medians)."""
    return nbytes / seconds / MiB


class _Client(Peer):
    """A kvstore client behind ``bench_store``'s ``Peer`` interface, with keys of its own
    (``tag`` hashed in), so that two clients of one daemon never put the same key."""

    batch_api = True

    def __init__(self, store: Any, tag: str):
        self.store, self.tag = store, tag.encode()

    def _k(self, key: bytes) -> bytes:
        return hashlib.blake2b(self.tag + key, digest_size=16).digest()

    def put(self, key, val):
        self.store.put(self._k(key), val)

    def get(self, key):
        return self.store.get(self._k(key))

    def put_many(self, kv):
        from kvstore import PutItem

        self.store.put_many([PutItem(self._k(k), v) for k, v in kv])

    def get_many(self, keys):
        return self.store.get_many([self._k(k) for k in keys])


def bench_kvstores(stores: dict[str, Any], size: int, n: int, batch: int, tag: str) -> dict[str, dict]:
    """put, get, put_batch, get_batch of ``n`` entries of ``size`` bytes on each store,
    interleaved step by step as ``bench_store``'s systems are (``interleaved_rep``: each entry,
    or batch of ``batch``, run by every store in turn), so that the page cache's writeback and
    the disk's state land on every store alike, where stores run one after the other met
    different ones. Per store: op -> MiB/s, from the time it spent in its own steps."""
    peers = {name: _Client(store, f"{tag}{name}") for name, store in stores.items()}
    vals = [os.urandom(size)]
    out: dict[str, dict] = {name: {} for name in stores}
    for mode, suffix in (("single", ""), ("batch", "_batch")):
        keys = [_key(f"{tag}{size}{mode}", i) for i in range(n)]
        for name, by_op in interleaved_rep(peers, mode, keys, vals, batch).items():
            for op, (secs, _lat) in by_op.items():
                out[name][op + suffix] = _mibs(n * size, secs)
    return out


def bench_redis(size: int, n: int, batch: int, port: int) -> dict:
    import redis

    c = redis.Redis(host="127.0.0.1", port=port)
    v = os.urandom(size)
    keys = [_key(f"r{size}s", i) for i in range(n)]
    t = time.perf_counter()
    for k in keys:
        c.set(k, v)
    r = {"put": _mibs(n * size, time.perf_counter() - t)}
    t = time.perf_counter()
    for k in keys:
        assert c.get(k) == v
    r["get"] = _mibs(n * size, time.perf_counter() - t)
    keys = [_key(f"r{size}b", i) for i in range(n)]
    t = time.perf_counter()
    for i in range(0, n, batch):
        c.mset({k: v for k in keys[i:i + batch]})
    r["put_batch"] = _mibs(n * size, time.perf_counter() - t)
    t = time.perf_counter()
    for i in range(0, n, batch):
        assert all(x == v for x in c.mget(keys[i:i + batch]))
    r["get_batch"] = _mibs(n * size, time.perf_counter() - t)
    c.close()
    return r


def run_redis(sizes: list[int], n: int, batch: int) -> dict:
    exe = shutil.which("redis-server")
    if not exe:
        return {"skipped": "redis-server not installed (bash tools/install_peers.sh)"}
    try:
        import redis
    except ImportError:
        return {"skipped": "redis-py not installed (pip install -e '.[bench]')"}
    port = _free_port()
    p = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                          "--protected-mode", "yes"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 10
        while True:
            try:
                redis.Redis(host="127.0.0.1", port=port).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > end:
                    return {"skipped": "redis-server did not start"}
                time.sleep(0.05)
        return {str(s): bench_redis(s, n, batch, port) for s in sizes}
    finally:
        stop_process(p)


def run_mooncake(sizes: list[int], n: int, batch: int, python: str) -> dict:
    if not python or not Path(python).exists():
        return {"skipped": f"no Mooncake venv at {python!r} (bash tools/install_peers.sh --mooncake)"}
    bindir = Path(python).parent
    master = bindir / "mooncake_master"
    if not master.exists():
        return {"skipped": f"{master} missing"}
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    meta, addr = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
    peer = str(Path(__file__).resolve().parent / "mooncake_peer.py")
    procs = []
    try:
        procs.append(subprocess.Popen([str(master), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
                                       "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}",
                                       "--http_metadata_server_host=127.0.0.1",
                                       # its metrics server listens on 0.0.0.0:9003 unless told
                                       "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.5)
        st = subprocess.Popen([python, peer, "storage", meta, addr, "600"], stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True)
        procs.append(st)
        line = st.stdout.readline()
        if '"setup": 0' not in line:
            return {"skipped": f"Mooncake storage process failed to set up: {line.strip() or st.poll()}"}
        out = subprocess.run([python, peer, "bench", meta, addr, ",".join(map(str, sizes)), str(n), str(batch)],
                             capture_output=True, text=True, timeout=300)
        last = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode or not last:
            return {"skipped": f"Mooncake bench failed (exit {out.returncode}): {out.stderr.strip()[-500:]}"}
        res = json.loads(last[-1])
        res.pop("setup", None)
        return {k: {op: float(x) for op, x in v.items()} for k, v in res.items()}
    finally:
        for p in reversed(procs):
            stop_process(p)


# Run inside the namespace: loopback up, then ``run_mooncake`` (argv: repo root, sizes, n, batch, python).
# The transfer engine wants a LAN address, which the namespace lacks: it is told loopback's.
_IN_NETNS = ("import json, os, subprocess, sys; subprocess.run(['ip', 'link', 'set', 'lo', 'up'], check=True); "
             "os.environ['MC_TCP_BIND_ADDRESS'] = '127.0.0.1'; "
             "sys.path.insert(0, sys.argv[1]); from tools.bench_remote import run_mooncake; "
             "print(json.dumps(run_mooncake(json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), "
             "sys.argv[5])), flush=True)")


def run_mooncake_isolated(sizes: list[int], n: int, batch: int, python: str) -> dict:
    """``run_mooncake`` in a private network namespace with only loopback: Mooncake's servers
    listen on 0.0.0.0 (the master's HTTP metadata server ignores its host flag; the transfer
    engine's ports have none), and nothing of a benchmark may listen beyond loopback."""
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        return {"skipped": f"no {' or '.join(missing)} here to isolate Mooncake's 0.0.0.0 listeners on loopback"}
    out = subprocess.run(["unshare", "--net", "--map-root-user", "--", sys.executable, "-c", _IN_NETNS, str(ROOT),
                          json.dumps(sizes), str(n), str(batch), python], capture_output=True, text=True, timeout=900)
    last = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode or not last:
        why = " ".join(out.stderr.strip().splitlines()[-2:])[-300:]
        return {"skipped": f"Mooncake in a loopback-only network namespace failed (exit {out.returncode}): {why}"}
    return json.loads(last[-1])


def lookup_latency(store: Any, chain_len: int, reps: int, tag: str) -> dict:
    from kvstore import PutItem

    chain = [_key(f"{tag}chain", i) for i in range(chain_len)]
    for i in range(0, chain_len, 250):  # a block and an SWA snapshot at every boundary, as bench_store's chain
        store.put_many([PutItem(k, b"%d" % j, kind=kind) for j, k in enumerate(chain[i:i + 250])
                        for kind in ("block", "swa")])
    got = store.lookup(chain)
    assert (got.hit_blocks, got.swa_at) == (chain_len, chain_len), got
    # The throughput rounds leave GiBs in the page cache (fsync off); their writeback would run
    # on these two cores during the loop below. Lookup latency is measured without it.
    os.sync()
    lat = []
    for _ in range(reps):
        t = time.perf_counter()
        store.lookup(chain)
        lat.append(time.perf_counter() - t)
    lat.sort()
    return {f"p{q}": round(lat[min(len(lat) - 1, int(q / 100 * len(lat)))] * 1e3, 3) for q in (50, 90, 99)}


def _log(msg: str) -> None:
    print(f"bench_remote: {msg}", file=sys.stderr, flush=True)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", type=csv_list(integer(1, 64 * MiB)), default=[131072, 1048576],
                    help="entry sizes in bytes, comma separated (at most 64 MiB, the store's max_value_bytes)")
    ap.add_argument("--n", type=integer(1, 1 << 20), default=256,
                    help="entries per size and mode (256: 16 batches of 16 per figure; 64 gave only 4)")
    ap.add_argument("--batch", type=integer(1, 4096), default=16)
    ap.add_argument("--fsync", type=choice_bool, default=False, help="kvstore puts durable (fsync) or page cache only")
    ap.add_argument("--chain", type=integer(1, 1 << 20), default=1000)
    ap.add_argument("--lookup-reps", type=integer(1, 1 << 20), default=200)
    ap.add_argument("--mooncake-python", default=mooncake_python(),
                    help="python of the Mooncake venv (default: $KVSTACK_MOONCAKE_VENV or .bench/mooncake-venv)")
    ap.add_argument("--repeat", type=integer(1, 1000), default=3,
                    help="rounds; each throughput is the median over them")
    ap.add_argument("--no-peers", action="store_true", help="skip Redis and Mooncake")
    ap.add_argument("--out", default="")


def run_remote(args: argparse.Namespace) -> dict:
    """The whole comparison; returns the JSON-able report."""
    import kvstore
    from tools.daemon_util import start_daemon, stop_all

    sizes = [int(s) for s in args.sizes.split(",")] if isinstance(args.sizes, str) else list(args.sizes)
    fs = args.fsync if isinstance(args.fsync, bool) else str(args.fsync).lower() in ("1", "true", "yes")
    rep: dict[str, Any] = {"sizes": sizes, "n": args.n, "batch": args.batch, "chain": args.chain, "fsync": fs,
                           "repeat": args.repeat, "unit": "MiB/s", "systems": {}, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        opts = ["--fsync", str(fs).lower(), "--compression", "none", "--allow-direct-writes", "true"]
        emb = None
        daemons = []  # filled one by one, so that a failure (or Ctrl-C) starting one stops those before
        try:
            emb = kvstore.connect(str(Path(tmp) / "emb"), fsync=fs, compression="none")
            for i in range(4):
                daemons.append(start_daemon(Path(tmp) / f"d{i}", opts))
            rs = kvstore.connect(daemons[0].url)
            rd = kvstore.connect(daemons[0].url, direct_reads="on", direct_writes="on")
            # Each round runs every system; the three kvstore clients interleaved step by step
            # (bench_kvstores), the peers (other processes) after them.
            for rnd in range(args.repeat):
                _log(f"round {rnd + 1} of {args.repeat}: sizes {sizes}, {args.n} entries each")
                one: dict[str, Any] = {name: {} for name in ("embedded", "remote", "remote_direct")}
                for s in sizes:
                    got = bench_kvstores({"embedded": emb, "remote": rs, "remote_direct": rd}, s, args.n,
                                         args.batch, f"{rnd}.")
                    for name, ops in got.items():
                        one[name][str(s)] = ops
                if not args.no_peers:
                    one["redis"] = run_redis(sizes, args.n, args.batch)
                    one["mooncake"] = run_mooncake_isolated(sizes, args.n, args.batch, args.mooncake_python)
                rep["rounds"].append(one)
            _log(f"lookup latency of a {args.chain}-block chain, {args.lookup_reps} reps")
            lk = {"embedded": lookup_latency(emb, args.chain, args.lookup_reps, "e"),
                  "remote": lookup_latency(rs, args.chain, args.lookup_reps, "r")}
            rs.close()
            rep["direct_stats"] = rd.direct_stats()
            rep["direct_write_stats"] = rd.direct_write_stats()
            rd.close()
            with kvstore.connect(",".join(d.url for d in daemons[1:])) as sh:
                lk["sharded3"] = lookup_latency(sh, args.chain, args.lookup_reps, "s")
        finally:
            try:
                if emb is not None:
                    emb.close()
            finally:
                stop_all(daemons)
    rep["systems"] = _medians(rep["rounds"])
    rep["lookup_ms"] = lk
    return rep


def _medians(rounds: list[dict]) -> dict:
    """Per system, size and op: the median over rounds (a system skipped in any round: skipped)."""
    out: dict[str, Any] = {}
    for name in rounds[0]:
        per = [r[name] for r in rounds]
        skipped = next((p["skipped"] for p in per if "skipped" in p), None)
        if skipped:
            out[name] = {"skipped": skipped}
            continue
        out[name] = {size: {op: round(statistics.median(p[size][op] for p in per), 1) for op in ops}
                     for size, ops in per[0].items()}
    return out


def paired_ratio(rounds: list[dict], a: str, b: str, size: str, op: str) -> float | None:
    """``a`` / ``b`` throughput: the median of the per-round ratios (both ran in that round)."""
    got = [r[a][size][op] / r[b][size][op] for r in rounds
           if r[a].get(size, {}).get(op) and r[b].get(size, {}).get(op)]
    return statistics.median(got) if got else None


# (subject, peer) pairs of the ratio table, subject / peer.
RATIOS = [("remote", "embedded"), ("remote", "redis"), ("remote", "mooncake"), ("remote_direct", "embedded"),
          ("remote_direct", "remote"), ("remote_direct", "redis"), ("remote_direct", "mooncake")]
SHORT = {"remote_direct": "direct", "embedded": "emb", "mooncake": "mooncake"}


def table(rep: dict) -> str:
    systems = rep["systems"]
    names = list(systems)
    pairs = [(a, b) for a, b in RATIOS if a in systems and b in systems]
    rows = [f"MiB/s, median of {rep['repeat']} rounds", f"{'op':<10}{'size':>9} " + "".join(f"{n:>14}" for n in names),
            ]
    ratio_rows = ["ratios (median of the per-round ratios)", f"{'op':<10}{'size':>9} " + "".join(
        f"{SHORT.get(a, a) + '/' + SHORT.get(b, b):>16}" for a, b in pairs)]
    for s in rep["sizes"]:
        for op in ("put", "get", "put_batch", "get_batch"):
            vals = {n: systems[n].get(str(s), {}).get(op) if "skipped" not in systems[n] else None for n in names}
            head = f"{op:<10}{s // 1024:>7}Ki "
            rows.append(head + "".join(f"{(v if v is not None else '-'):>14}" for v in vals.values()))
            ratio = {(a, b): paired_ratio(rep["rounds"], a, b, str(s), op) for a, b in pairs}
            ratio_rows.append(head + "".join(
                f"{(f'{x:.2f}x' if x is not None else '-'):>16}" for x in ratio.values()))
    rows += ratio_rows
    for n, v in systems.items():
        if "skipped" in v:
            rows.append(f"{n}: skipped: {v['skipped']}")
    lk = rep["lookup_ms"]
    rows.append(f"lookup of a {rep['chain']:,}-block chain (ms): " + ", ".join(
        f"{k} p50 {v['p50']} p99 {v['p99']}" for k, v in lk.items()))
    if "direct_stats" in rep:
        c = rep["direct_stats"].get("counters", {})
        rows.append(f"remote_direct client: active={rep['direct_stats'].get('active')} direct_reads="
                    f"{c.get('direct_reads', 0)} fallbacks={c.get('fallbacks', 0)}")
    if "direct_write_stats" in rep:
        c = rep["direct_write_stats"].get("counters", {})
        rows.append(f"remote_direct client: direct writes active={rep['direct_write_stats'].get('active')} "
                    f"entries={c.get('direct_writes', 0)} commits={c.get('commits', 0)} "
                    f"fallbacks={c.get('fallbacks', 0)}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_store.py --remote / bench_remote.py",
                                 description="remote kvstore vs embedded, Redis and Mooncake")
    add_arguments(ap)
    args = ap.parse_args(argv)
    if args.out and (msg := check_output_file(args.out)):
        ap.error(msg)
    try:
        rep = run_remote(args)
    except RuntimeError as exc:  # tools.daemon_util: a daemon that did not start
        ap.exit(1, f"{ap.prog}: error: {one_line(exc)}\n")
    print(table(rep))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rep, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    from tools.cli_args import run_main

    run_main(main)
