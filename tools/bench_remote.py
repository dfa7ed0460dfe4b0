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
  ``direct_reads="on"`` (``kvstore.client.direct_reads``) and ``direct_writes="on"`` (``kvstore.client.direct_writes``):
  reads ask the daemon where the fragments are (``Locate``) and read and verify them from the
  daemon's target directories in this process, as on a shared DFS mount; puts encode and write
  the pack files in this process and ask the daemon to index them (``Commit``).
  Its client's counters go to the JSON under ``direct_stats`` and ``direct_write_stats``
  (fallbacks must be 0),
* ``redis``:    ``redis-server`` on 127.0.0.1 with the kvstore puts' durability (no persistence;
  AOF fsync always with ``--fsync true``), SET/GET, batches as SET pipelines and MGET
  (``bench_peers.RedisPeer``),
* ``mooncake``: Mooncake Store over TCP on loopback (master with its HTTP metadata server +
  one storage process with a 2 GiB segment, fresh each round; the bench client mounts no
  memory), from its own venv: ``$KVSTACK_MOONCAKE_VENV``, default ``.bench/mooncake-venv`` in
  the repository, as ``tools/install_peers.sh --mooncake`` creates it (``--mooncake-python``
  overrides). Its metadata server and transfer engine listen on 0.0.0.0 whatever their flags
  say, so all of it runs in a private network namespace holding only loopback (``unshare
  --net``, util-linux); where one cannot be made, Mooncake is skipped with the reason. Its
  client runs each step this process asks for over a pipe (``bench_peers.MooncakePeer``,
  ``mooncake_peer.py serve``) and times its own calls: the pipe is not counted against it.

and the p50/p90/p99 of ``lookup`` on a chain of ``--chain`` blocks (default 1,000; all hit, an SWA
snapshot at every boundary, so the answer is ``hit_blocks = swa_at = --chain``): embedded, over
gRPC, and sharded over 3 daemons. Peers that cannot run are reported with the reason, never silently dropped.
kvstore writes use ``fsync=false`` by default (page-cache durability, like Redis without AOF
and Mooncake's memory pool); ``--fsync true`` measures durable puts. Prints a table with ratios
(``remote`` and ``remote_direct`` / each peer); ``--out`` writes the JSON. The goals for
batched gets: ``remote_direct`` >= 1.0x ``mooncake`` and >= 2x ``redis``. Every throughput is
the median of ``--repeat`` rounds (each round: ``--n`` entries per size and mode, all five
systems interleaved op by op, ``bench_systems``, so each meets the page cache, the disk and
this machine's other load in the same state: run one after the other, the last kvstore client
met the writeback of the others' puts, and Redis and Mooncake, run after all three, met it too);
each ratio is the median of the per-round ratios; the per-round values are kept in the JSON
under ``rounds``. Loopback on a shared 2-core machine is noisy: compare ratios from one run,
not absolute figures across runs. Interleaving has a cost of its own, and not the same for
every system: each step finds the caches and the other processes' threads as the four other
systems left them, so a system measured alone can do better than interleaved.
``--sequential`` runs each system's steps together (the order rotating per round): quote both.

The remote batch path the figures measure: GetStream/PutStream, one message per value (small
values packed into messages of about 1 MiB), values hand-encoded with one copy
(``kvstore.wire``), the server reading window k+1 while it sends window k. One message per
batch would cost a copy of every value into the reply message, a second one to serialize it,
and gRPC moves one large message slower than the same bytes as several smaller ones; a
client would build and serialize a whole batch before sending its first byte. What is left
for put is the store's own ``put_many`` (erasure coding and fragment writes).

Progress goes to stderr, one line per round and per lookup measurement. Exit status (the
contract of ``tools/cli_args.py``): 0 when the table was printed; 2 for a bad argument,
refused in one line before any daemon starts; 1 when a daemon did not start.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tools.bench_peers import Peer, PeerUnavailable, RedisPeer, RedisServer, interleaved_rep, start_mooncake
from tools.cli_args import check_output_file, choice_bool, csv_list, integer, one_line

MiB = 2**20
ROOT = Path(__file__).resolve().parent.parent


def mooncake_python() -> str:
    """The Mooncake venv's python, found as tools/install_peers.sh --mooncake places it."""
    venv = os.environ.get("KVSTACK_MOONCAKE_VENV") or str(ROOT / ".bench" / "mooncake-venv")
    return str(Path(venv) / "bin" / "python")


def _key(tag: str, i: int) -> bytes:
    return hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest()


def _mibs(nbytes: int, seconds: float) -> float:
    """Throughput in MiB/s, unrounded: the per-round ratios are taken from these (``_medians``
    rounds only the printed medians)."""
    return nbytes / seconds / MiB


class _Client(Peer):
    """A kvstore client behind the ``Peer`` interface of ``tools.bench_peers``, with keys of its own
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


def bench_systems(systems: dict[str, Peer], size: int, n: int, batch: int, tag: str,
                  interleave: bool = True) -> dict[str, dict]:
    """put, get, put_batch, get_batch of ``n`` entries of ``size`` bytes on each system,
    interleaved step by step (``interleaved_rep``: each entry, or batch of ``batch``, run by
    every system in turn), so that the page cache's writeback,
    the disk's state and the other tenants of this machine land on every system alike, where
    systems run one after the other met different ones. ``interleave=False``: one system after
    the other, in the order given. Per system: op -> MiB/s, from the time it spent in its own
    steps (a peer in another process times itself: ``Peer.last_s``)."""
    vals = [os.urandom(size)]
    out: dict[str, dict] = {name: {} for name in systems}
    groups = [systems] if interleave else [{name: peer} for name, peer in systems.items()]
    for mode, suffix in (("single", ""), ("batch", "_batch")):
        keys = [_key(f"{tag}{size}{mode}", i) for i in range(n)]
        for group in groups:
            for name, by_op in interleaved_rep(group, mode, keys, vals, batch).items():
                for op, (secs, _lat) in by_op.items():
                    out[name][op + suffix] = _mibs(n * size, secs)
    return out


def start_peers(work: str, redis: Any, mooncake_python: str) -> tuple[dict[str, Peer], dict[str, str]]:
    """This round's Redis and Mooncake peers, and the reason for each that cannot run."""
    peers: dict[str, Peer] = {}
    skipped: dict[str, str] = {}
    if isinstance(redis, str):
        skipped["redis"] = redis
    else:
        peers["redis"] = RedisPeer(server=redis)
    try:
        peers["mooncake"] = start_mooncake(mooncake_python, work)
    except PeerUnavailable as exc:
        skipped["mooncake"] = str(exc)
    return peers, skipped


def start_redis(work: str, fsync: bool) -> Any:
    """A ``RedisServer`` with the kvstore puts' durability (AOF fsync always, or none), or why not."""
    if importlib.util.find_spec("redis") is None:
        return "redis-py not installed (pip install -e '.[bench]')"
    try:
        return RedisServer(work, aof=fsync)
    except RuntimeError as exc:
        return str(exc)


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
    ap.add_argument("--sequential", action="store_true",
                    help="run the systems one after the other in each round (the order rotating from round "
                         "to round), not interleaved step by step")
    ap.add_argument("--out", default="")


def run_remote(args: argparse.Namespace) -> dict:
    """The whole comparison; returns the JSON-able report."""
    import kvstore
    from tools.daemon_util import start_daemon, stop_all

    sizes = [int(s) for s in args.sizes.split(",")] if isinstance(args.sizes, str) else list(args.sizes)
    fs = args.fsync if isinstance(args.fsync, bool) else str(args.fsync).lower() in ("1", "true", "yes")
    rep: dict[str, Any] = {"sizes": sizes, "n": args.n, "batch": args.batch, "chain": args.chain, "fsync": fs,
                           "repeat": args.repeat, "interleaved": not args.sequential, "unit": "MiB/s", "systems": {}, "rounds": []}
    with tempfile.TemporaryDirectory(prefix="kvbench-") as tmp:
        opts = ["--fsync", str(fs).lower(), "--compression", "none", "--allow-direct-writes", "true"]
        emb = redis = None
        daemons = []  # filled one by one, so that a failure (or Ctrl-C) starting one stops those before
        try:
            emb = kvstore.connect(str(Path(tmp) / "emb"), fsync=fs, compression="none")
            for i in range(4):
                daemons.append(start_daemon(Path(tmp) / f"d{i}", opts))
            rs = kvstore.connect(daemons[0].url)
            rd = kvstore.connect(daemons[0].url, direct_reads="on", direct_writes="on")
            redis = start_redis(tmp, fs) if not args.no_peers else None
            # Each round runs every system, all interleaved step by step (bench_systems).
            for rnd in range(args.repeat):
                _log(f"round {rnd + 1} of {args.repeat}: sizes {sizes}, {args.n} entries each")
                systems: dict[str, Peer] = {name: _Client(st, f"{rnd}.{name}") for name, st in
                                            (("embedded", emb), ("remote", rs), ("remote_direct", rd))}
                peers, skipped = start_peers(tmp, redis, args.mooncake_python) if not args.no_peers else ({}, {})
                one: dict[str, Any] = {name: {} for name in [*systems, *peers]}
                one.update((name, {"skipped": why}) for name, why in skipped.items())
                every = {**systems, **peers}
                order = list(every)[rnd % len(every):] + list(every)[:rnd % len(every)]  # --sequential
                try:
                    for s in sizes:
                        for name, ops in bench_systems({name: every[name] for name in order}, s, args.n, args.batch,
                                                       f"{rnd}.", interleave=not args.sequential).items():
                            one[name][str(s)] = ops
                finally:
                    for p in peers.values():
                        p.close()
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
                if isinstance(redis, RedisServer):
                    redis.close()
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
    how = "interleaved step by step" if rep.get("interleaved", True) else "one after the other"
    rows = [f"MiB/s, median of {rep['repeat']} rounds, systems {how}", f"{'op':<10}{'size':>9} " + "".join(f"{n:>14}" for n in names),
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
