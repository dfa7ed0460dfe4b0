"""Store throughput and latency against its peers, on the same bytes in the same run.

Exact command (the reported figures are produced with it)::

    bash tools/install_peers.sh          # redis-server (Debian) + redis-py/hiredis/lmdb, idempotent
    .venv/bin/python tools/bench_store.py --out results/bench_store.json
    .venv/bin/python tools/bench_store.py --quick     # a short run: smaller figures, same shape
    .venv/bin/python tools/bench_store.py --remote --out results/bench_remote.json  # the daemon (below)
    .venv/bin/python tools/bench_store.py --s3 --out results/bench_store_s3.json    # S3 targets (below)
    .venv/bin/python tools/bench_store.py --s3 --quick

``--remote`` runs the daemon's benchmark instead (``tools/bench_remote.py``: remote and
direct-read clients over gRPC against the embedded store, Redis and the Mooncake store in
the same run); the options after it are that benchmark's (``--remote --help`` lists them).

What is measured (figures, not a test; the machine is noisy, read the ratios):

1. put / get of KV-like payloads (fp16 random-normal, 128 KiB, 1 MiB, 4 MiB), single ops and
   batches (``put_many``/``get_many``), for: kvstore EC 4+2 with zstd off; kvstore with zstd on
   (``min_compress_ratio=1.0`` so the compressed path is really taken; the payload's zstd-3
   ratio is printed: fp16 noise compresses only a little); raw files (tmp write + fsync + rename
   + dir fsync vs plain read: the limit for one copy at the same durability); ``ec_floor`` (the
   least I/O of any store keeping k+m fragments behind a durable index: appends to open files,
   one syncfs, one durable LMDB commit; k preads back; nothing encoded or verified: the limit
   for the segment layout kvstore writes on local targets, ``tools.bench_peers.ECFloorPeer``;
   each goal against raw_file prints ec_floor / raw_file beside it, the most that layout
   reaches here); ``file_floor`` (the same bound for one file per fragment, each written under a
   temporary name and renamed, the layout of stores whose targets cannot append:
   ``FileFloorPeer``); LMDB (py-lmdb,
   ``sync=True``, one transaction per put or per batch); Redis (``redis-server`` started here on
   loopback with ``appendonly yes, appendfsync always``, RDB off, AOF rewrite off; redis-py +
   hiredis; a batch put is a pipeline of SETs, a batch get one MGET). Every rep writes fresh
   keys into a fresh directory, then reads them back (page cache warm for every system
   alike). Each rep runs every system together, interleaved step by step: one op (or batch)
   of each system in turn, the order rotating from step to step, so every system meets the
   same disk. (Run one after the other, ``--sequential``, the systems meet different ones: a
   cloud disk that writes fast until a burst allowance runs out and slowly after makes a
   system's put figure depend on how much the systems before it had written, so a ratio
   depends on the order of the systems.) Throughput: median over reps, from
   the time each system spent in its own steps; latency: p50/p90/p99 per op (a batch's time
   divided by its size).
2. Ratios kvstore(zstd off) / peer, each the median of the per-rep ratios (the two systems ran
   in the same rep; the JSON has the lowest and highest too), and the goals (``GOALS``): get
   >= 0.5x raw read at 128 KiB single, >= 0.6x at 128 KiB batch and 1 MiB single, >= 0.7x at
   1 MiB batch (larger sizes: as 1 MiB); get >= 2x Redis GET at every size and mode; put >=
   0.5x raw write single and >= 1.0x batch, at the same durability.
3. Longest-prefix ``lookup`` of a 1,000-block chain (all hit, with SWA snapshots), p50/p90/p99 in
   process, at 10k / 100k / 1M index entries. The index is filled by inserting records with
   fake fragment metadata straight through ``kvstore.embedded.index.Index`` (lookup reads only the index).
4. Erasure coding alone: pyeclib ISA-L (``isa_l_rs_cauchy``, the default, and ``isa_l_rs_vand``)
   4+2 and 8+4 encode, and decode with 0, 1 and 2 data fragments lost.
5. ``--s3``: the store on S3 targets, where nothing can be appended to (an object is written
   whole). A moto S3 server is started as a child process on loopback (``S3Server``: it
   counts every request it answers, by bucket and kind), and in one interleaved run, as
   above (sizes 128K,1M by default; 3 reps of 8 MiB; quick: 1 rep of 2 MiB): kvstore with 6
   S3 targets (one bucket each, EC 4+2; its index in a local directory) against raw s3fs
   (``S3RawPeer``: one object per entry, ``pipe_file``/``cat_file``, a batch one concurrent
   ``fs.pipe``/``fs.cat``). Before each rep every bucket and object is dropped. Printed:
   throughput, latency, the ratios kvstore / raw_s3, and the S3 requests of one op of each
   system, counted alone after the timed reps (objects written per single put and per
   batch, ranged GETs per get, and any listing or HEAD the op made). ``--systems`` and
   ``--lookup-sizes`` do not apply (refused); lookup and erasure coding are not run.

The peers live in ``tools/bench_peers.py``. A missing peer (no redis-server even after
``tools/install_peers.sh``) is reported and skipped.

Exit status (the contract of ``tools/cli_args.py``): 0 when the tables were printed and the
JSON written; 2 for a bad argument, refused in one line before anything runs, including a
``--systems`` list with nothing to compare (it needs ``kvstore`` and at least one peer) and a
run whose only peer (redis) turned out to be missing; ``--s3`` without moto, s3fs or boto3
installed is refused the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

import kvstore
from kvstore.embedded import codec
from kvstore.config import DEFAULT_EC_TYPE, LEGACY_EC_TYPE
from kvstore.embedded.index import Meta, ekey
from kvstore.errors import KVStoreError
from tools.bench_peers import (ECFloorPeer, FileFloorPeer, LMDBPeer, Peer, RawFilePeer, RedisPeer, RedisServer,
                               S3RawPeer, S3Server, interleaved_rep)
from tools.cli_args import check_existing_dir, check_output_file, csv_list, integer, number, one_line

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20
# The store's goals, kvstore / peer: (op, peer, mode) -> ((smallest size, minimum ratio), ...),
# the row of the largest size not over the entry's. A size under every row has no goal.
GOALS: dict[tuple[str, str, str], tuple[tuple[int, float], ...]] = {
    ("get", "raw_file", "single"): ((128 * 1024, 0.5), (MiB, 0.6)),
    ("get", "raw_file", "batch"): ((128 * 1024, 0.6), (MiB, 0.7)),
    ("get", "redis", "single"): ((0, 2.0),),
    ("get", "redis", "batch"): ((0, 2.0),),
    ("put", "raw_file", "single"): ((0, 0.5),),
    ("put", "raw_file", "batch"): ((0, 1.0),),
}


def goal_of(op: str, peer: str, mode: str, size: int) -> float | None:
    """The minimum ratio kvstore / ``peer`` for ``op`` in ``mode`` at ``size`` (``GOALS``)."""
    need = None
    for least, ratio in GOALS.get((op, peer, mode), ()):
        if size >= least:
            need = ratio
    return need


@dataclass(frozen=True, slots=True)
class Row:
    system: str
    size: int
    mode: str  # single | batch
    op: str  # put | get
    mib_s: float  # median over reps
    p50_ms: float
    p90_ms: float
    p99_ms: float
    ops: int  # ops per rep
    reps: int
    rep_mib_s: list[float] = field(default_factory=list)  # per rep, in rep order (for paired ratios)


def pct(samples: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q)) if samples else float("nan")


# ----------------------------------------------------------------------------------- the store
class KVStorePeer(Peer):
    batch_api = True

    def __init__(self, d: str, compression: str, **overrides):
        self.s = kvstore.connect(d, ec_k=4, ec_m=2, compression=compression, min_compress_ratio=1.0, **overrides)

    def put(self, key, val):
        self.s.put(key, val)

    def get(self, key):
        return self.s.get(key)

    def put_many(self, kv):
        self.s.put_many([kvstore.PutItem(k, v) for k, v in kv])

    def get_many(self, keys):
        return self.s.get_many(keys)

    def close(self):
        self.s.close()


# name -> factory(directory). The first is the store under test; the rest are its peers.
SYSTEMS: dict[str, Callable[[str], Peer]] = {
    "kvstore": lambda d: KVStorePeer(d, "none"),
    "kvstore_zstd": lambda d: KVStorePeer(d, "zstd"),
    "raw_file": RawFilePeer,
    "ec_floor": ECFloorPeer,
    "file_floor": FileFloorPeer,
    "lmdb": LMDBPeer,
    "redis": RedisPeer,
}


# ----------------------------------------------------------------------------------- put / get
def payloads(size: int, n: int, seed: int) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(size // 2, dtype=np.float32).astype(np.float16).tobytes() for _ in range(n)]


def bench_io(systems: list[str], sizes: list[int], reps: int, mib_per_rep: float, batch: int,
             work: str, log: Callable[[str], None], interleave: bool = True,
             factories: dict[str, Callable[[str], Peer]] = SYSTEMS,
             setup: Callable[[], None] | None = None) -> list[Row]:
    """Every system once per rep, on fresh keys in fresh directories. ``interleave``: the
    systems of a rep run together, step by step (``interleaved_rep``); else one after the
    other, in an order that rotates from rep to rep, so that a burst of load on this shared
    machine lands on all systems of a rep alike only when it outlasts the rep (``ratios``
    pairs the systems rep by rep either way). ``factories``: name -> peer on a directory;
    ``setup``: called before each group's peers are opened (a fresh S3 server state)."""
    rows = []
    for size in sizes:
        n = max(batch, int(mib_per_rep * MiB // size) // batch * batch)
        vals = payloads(size, 8, seed=size)
        for mode in ("single", "batch"):
            tput = {(name, op): [] for name in systems for op in ("put", "get")}
            lats: dict[tuple[str, str], list[float]] = {key: [] for key in tput}
            for rep in range(reps):
                first = rep % len(systems)
                order = systems[first:] + systems[:first]
                groups = [order] if interleave else [[name] for name in order]
                for group in groups:
                    dirs = {name: tempfile.mkdtemp(prefix=f"{name}-", dir=work) for name in group}
                    keys = [os.urandom(16) for _ in range(n)]
                    peers: dict[str, Peer] = {}
                    try:
                        if setup is not None:
                            setup()
                        for name in group:
                            peers[name] = factories[name](dirs[name])
                        res = interleaved_rep(peers, mode, keys, vals, min(batch, n))
                    finally:
                        for peer in peers.values():
                            peer.close()
                        for d in dirs.values():
                            shutil.rmtree(d, ignore_errors=True)
                    for name, by_op in res.items():
                        for op, (secs, lat) in by_op.items():
                            tput[(name, op)].append(n * size / MiB / secs)
                            lats[(name, op)].extend(lat)
            for name in systems:
                for op in ("put", "get"):
                    lat, per_rep = lats[(name, op)], tput[(name, op)]
                    r = Row(name, size, mode, op, statistics.median(per_rep), pct(lat, 50) * 1e3,
                            pct(lat, 90) * 1e3, pct(lat, 99) * 1e3, n, reps, per_rep)
                    rows.append(r)
                    log(f"  {name:<13} {size // 1024:>5} KiB {mode:<6} {op}: {r.mib_s:8.1f} MiB/s  "
                        f"p50 {r.p50_ms:.2f} ms")
    return rows


def ratios(rows: list[Row], of: str = "kvstore", peers: Sequence[str] = tuple(SYSTEMS)) -> list[dict]:
    """``of`` / peer throughput: the median of the per-rep ratios (both ran in the same rep,
    minutes apart at most), with the lowest and highest of them."""
    by = {(r.system, r.size, r.mode, r.op): r for r in rows}
    out = []
    for (system, size, mode, op), r in by.items():
        if system != of:
            continue
        for peer in peers:
            p = by.get((peer, size, mode, op))
            if peer == of or p is None:
                continue
            paired = [a / b for a, b in zip(r.rep_mib_s, p.rep_mib_s) if b > 0]
            if paired:
                out.append({"size": size, "mode": mode, "op": op, "peer": peer, "ratio": statistics.median(paired),
                            "ratio_min": min(paired), "ratio_max": max(paired)})
    return out


def goals(ratio_rows: list[dict], floor_rows: Sequence[dict] = ()) -> list[dict]:
    """The goals' rows; a goal against raw_file also gets ``floor``, ec_floor / raw_file in the
    same reps (``floor_rows``: ``ratios(rows, "ec_floor")``): the most the segment layout
    reaches against one plain copy here, whatever kvstore does."""
    floors = {(x["size"], x["mode"], x["op"]): x["ratio"] for x in floor_rows if x["peer"] == "raw_file"}
    out = []
    for x in sorted(ratio_rows, key=lambda x: (x["op"], x["peer"], x["size"], x["mode"] != "single")):
        need = goal_of(x["op"], x["peer"], x["mode"], x["size"])
        if need is not None:
            floor = floors.get((x["size"], x["mode"], x["op"])) if x["peer"] == "raw_file" else None
            out.append({**x, "goal": need, "met": x["ratio"] >= need, "floor": floor})
    return out


# ----------------------------------------------------------------------------------- lookup
def bench_lookup(sizes: list[int], work: str, iters: int, log: Callable[[str], None]) -> list[dict]:
    from kvstore.embedded.index import Index

    d = tempfile.mkdtemp(prefix="lookup-", dir=work)
    kvstore.connect(d).close()  # create the data directory and index
    targets = tuple(f"t{i}" for i in range(6))
    chain = [os.urandom(16) for _ in range(1000)]
    out, have = [], 0
    try:
        for target in sorted(sizes):
            t0 = time.perf_counter()
            idx = Index(os.path.join(d, "index"), map_size=16 * 2**30, sync=False)
            now = time.time_ns()
            meta = Meta(4, 2, 256, 229376, 229500, 57500, now, now, 0, b"\0" * 8, targets)
            while have < target:
                with idx.env.begin(write=True) as txn:
                    for _ in range(min(50_000, target - have)):
                        if have < len(chain):
                            key, kind = chain[have], 1
                        elif have < len(chain) + len(chain) // 8:
                            key, kind = chain[(have - len(chain)) * 8 + 7], 2  # SWA every 8th block
                        else:
                            key, kind = os.urandom(16), 1
                        idx.insert_txn(txn, ekey(kind, key), meta)
                        have += 1
            idx.env.sync(True)
            idx.close()
            fill_s = time.perf_counter() - t0
            with kvstore.connect(d) as store:
                assert store.lookup(chain).hit_blocks == 1000
                lat = []
                for _ in range(iters):
                    t = time.perf_counter()
                    res = store.lookup(chain)
                    lat.append(time.perf_counter() - t)
            row = {"entries": target, "chain": 1000, "hit_blocks": res.hit_blocks, "swa_at": res.swa_at,
                   "p50_ms": pct(lat, 50) * 1e3, "p90_ms": pct(lat, 90) * 1e3, "p99_ms": pct(lat, 99) * 1e3,
                   "iters": iters, "fill_s": fill_s}
            out.append(row)
            log(f"  lookup 1000-block chain at {target:>8} entries: p50 {row['p50_ms']:.2f} ms "
                f"(filled in {fill_s:.1f} s)")
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------------- erasure coding
def bench_ec(sizes: list[int], iters: int, log: Callable[[str], None]) -> list[dict]:
    out = []
    for (k, m), ec_type in itertools.product(((4, 2), (8, 4)), (DEFAULT_EC_TYPE, LEGACY_EC_TYPE)):
        code = codec.erasure_code(k, m, ec_type)
        for size in sizes:
            data = payloads(size, 1, seed=7)[0]
            frags = code.encode(data)
            cases: dict[str, Callable[[], object]] = {"encode": lambda: code.encode(data)}
            for lost in (0, 1, 2):
                have = {i: f for i, f in enumerate(frags) if i >= lost}  # lose data fragments first
                have = dict(list(have.items())[:k])
                cases[f"decode_{lost}_lost"] = lambda have=have: code.decode(have)
            assert code.decode(dict(list(enumerate(frags))[2:2 + k]))[:size] == data
            for name, fn in cases.items():
                fn()
                lat = []
                for _ in range(iters):
                    t = time.perf_counter()
                    fn()
                    lat.append(time.perf_counter() - t)
                row = {"ec": f"{k}+{m}", "ec_type": ec_type, "size": size, "op": name,
                       "mib_s": size / MiB / statistics.median(lat), "p50_ms": pct(lat, 50) * 1e3}
                out.append(row)
                log(f"  EC {ec_type} {k}+{m} {size // 1024:>5} KiB {name:<14} {row['mib_s']:8.0f} MiB/s")
    return out


# ----------------------------------------------------------------------------------- S3 targets
S3_BUCKETS = tuple(f"kvs-t{i}" for i in range(6))  # kvstore's 6 targets (EC 4+2), one bucket and domain each
S3_RAW_BUCKET = "raw"
S3_PEERS = ("raw_s3",)
# The server is moto on loopback: these only satisfy the clients' signing; the endpoint is the server's.
_S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@contextlib.contextmanager
def s3_environment(endpoint: str) -> Iterator[None]:
    """The AWS environment the store's s3fs targets read (credentials, ``AWS_ENDPOINT_URL``
    pointing at ``endpoint``) inside the block; the previous values back after."""
    env = {**_S3_ENV, "AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def s3_systems(server: S3Server) -> tuple[dict[str, Callable[[str], Peer]], Callable[[], None]]:
    """The S3 run's systems on ``server`` (name -> peer on a local directory: kvstore keeps its
    index there, its fragments in ``S3_BUCKETS``) and the setup before each rep: every bucket
    and object dropped, the buckets made again, fsspec's cached filesystems (and their
    listing caches) forgotten."""
    import s3fs

    targets = ",".join(f"s3://{b}/kv#{b}" for b in S3_BUCKETS)
    factories: dict[str, Callable[[str], Peer]] = {
        "kvstore": lambda d: KVStorePeer(d, "none", targets=targets),
        "raw_s3": lambda d: S3RawPeer(server, S3_RAW_BUCKET),
    }

    def setup() -> None:
        server.reset()
        for b in S3_BUCKETS:
            server.create_bucket(b)
        s3fs.S3FileSystem.clear_instance_cache()

    return factories, setup


def s3_requests(server: S3Server, factories: dict[str, Callable[[str], Peer]], setup: Callable[[], None],
                sizes: list[int], batch: int, work: str) -> list[dict]:
    """What one op costs in S3 requests, per system, size and mode: one put (or one batch of
    ``batch`` entries), then one get (or ``get_many``) of it, each system alone on a fresh
    server, untimed; the requests the server received during each call, by kind (PUT: an
    object written; GET range: a ranged read; LIST: a bucket-level GET; HEAD ...)."""
    out = []
    for size in sizes:
        val = payloads(size, 1, seed=size)[0]
        for mode in ("single", "batch"):
            n = 1 if mode == "single" else batch
            for name, factory in factories.items():
                d = tempfile.mkdtemp(prefix=f"{name}-", dir=work)
                keys = [os.urandom(16) for _ in range(n)]
                setup()
                peer = factory(d)
                try:
                    server.zero_counts()
                    peer.put(keys[0], val) if mode == "single" else peer.put_many([(k, val) for k in keys])
                    put = server.counts()
                    server.zero_counts()
                    got = [peer.get(keys[0])] if mode == "single" else peer.get_many(keys)
                    get = server.counts()
                finally:
                    peer.close()
                    shutil.rmtree(d, ignore_errors=True)
                if got != [val] * n:
                    raise RuntimeError(f"{name} returned wrong bytes")
                for op, c in (("put", put), ("get", get)):
                    out.append({"system": name, "size": size, "mode": mode, "op": op, "entries": n,
                                "requests": dict(sorted(c.items())), "objects_written": c.get("PUT", 0),
                                "per_entry": sum(c.values()) / n})
    return out


def s3_table(rows: list[Row], ratio_rows: list[dict], reqs: list[dict]) -> str:
    lines = [_io_lines(rows), "", _ratio_lines(ratio_rows, S3_PEERS),
             "\nS3 requests per op (each system alone, one op; a batch's are for all its entries)"]
    for x in reqs:
        what = ", ".join(f"{k} {v}" for k, v in x["requests"].items()) or "none"
        lines.append(f"  {x['system']:<8} {x['size'] // 1024:>5} KiB {x['mode']:<6} {x['op']:<3} "
                     f"x{x['entries']:<4} {what:<40} ({x['per_entry']:.2f} per entry)")
    return "\n".join(lines)


def run_s3(a: argparse.Namespace, ap: argparse.ArgumentParser, argv: Sequence[str] | None,
           log: Callable[[str], None]) -> int:
    """``--s3``: kvstore on 6 S3 targets against raw s3fs, on a moto server on loopback."""
    import importlib.util

    missing = [m for m in ("moto", "s3fs", "boto3") if importlib.util.find_spec(m) is None]
    if missing:
        ap.error(f"--s3 needs {', '.join(missing)} (pip install -e '.[s3,dev]')")
    q = a.quick
    sizes = a.sizes or [128 * 1024, MiB]
    reps = a.reps if a.reps is not None else (1 if q else 3)
    mib_per_rep = a.mib_per_rep if a.mib_per_rep is not None else (2 if q else 8)
    t_start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="bench_store-", dir=a.work_dir)
    server = None
    try:  # from here on, whatever happens (Ctrl-C included): the S3 server stopped, work dir removed
        server = S3Server()
        with s3_environment(server.endpoint):
            factories, setup = s3_systems(server)
            systems = list(factories)
            log(f"S3 (moto {server.version} at {server.endpoint}): systems {systems}; sizes {sizes}; reps {reps}; "
                f"{mib_per_rep} MiB per rep; batch {a.batch}")
            rows = bench_io(systems, sizes, reps, mib_per_rep, a.batch, work, log, interleave=not a.sequential,
                            factories=factories, setup=setup)
            reqs = s3_requests(server, factories, setup, sizes, a.batch, work)
    except (RuntimeError, OSError, KVStoreError) as exc:  # the server did not start or failed; wrong bytes
        ap.exit(1, f"{ap.prog}: error: {one_line(exc)}\n")
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(work, ignore_errors=True)
    rr = ratios(rows, peers=S3_PEERS)
    print(s3_table(rows, rr, reqs))
    elapsed = time.perf_counter() - t_start
    print(f"elapsed {elapsed:.0f} s")
    meta = {
        "command": " ".join([Path(sys.executable).name, "tools/bench_store.py", *(argv or sys.argv[1:])]),
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "payload": "fp16 random-normal", "ec": f"{DEFAULT_EC_TYPE} 4+2", "s3_server": f"moto {server.version}, "
        "a child process on loopback", "kvstore_targets": [f"s3://{b}/kv" for b in S3_BUCKETS],
        "kvstore_fsync": "default (true): objects are whole once PUT returns; the local index commit is synced",
        "raw_s3": "s3fs, one object per entry: pipe_file / cat_file; batches fs.pipe / fs.cat (concurrent)",
        "reps": reps, "mib_per_rep": mib_per_rep, "interleaved": not a.sequential, "batch": a.batch,
        "elapsed_s": elapsed,
    }
    out = Path(a.out or "results/bench_store_s3.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "io": [asdict(r) for r in rows], "ratios": rr, "requests": reqs},
                              indent=1))
    print(f"wrote {out}")
    return 0


# ----------------------------------------------------------------------------------- report
def _io_lines(rows: list[Row]) -> str:
    lines = [f"{'system':<13} {'size':>8} {'mode':<6} {'op':<3} {'MiB/s':>9} {'p50 ms':>8} {'p90 ms':>8} "
             f"{'p99 ms':>8}"]
    for r in rows:
        lines.append(f"{r.system:<13} {r.size // 1024:>4} KiB {r.mode:<6} {r.op:<3} {r.mib_s:>9.1f} "
                     f"{r.p50_ms:>8.2f} {r.p90_ms:>8.2f} {r.p99_ms:>8.2f}")
    return "\n".join(lines)


def _ratio_lines(ratio_rows: list[dict], systems: Sequence[str] = tuple(SYSTEMS)) -> str:
    lines = ["ratio kvstore / peer (throughput; median of the per-rep ratios)"]
    peers = [p for p in systems if p != "kvstore" and any(x["peer"] == p for x in ratio_rows)]
    lines.append(f"{'size':>8} {'mode':<6} {'op':<3} " + " ".join(f"{p:>12}" for p in peers))
    keyed = {(x["size"], x["mode"], x["op"], x["peer"]): x["ratio"] for x in ratio_rows}
    for size, mode, op in sorted({(x["size"], x["mode"], x["op"]) for x in ratio_rows}):
        cells = [f"{keyed[(size, mode, op, p)]:>11.2f}x" if (size, mode, op, p) in keyed else f"{'-':>12}"
                 for p in peers]
        lines.append(f"{size // 1024:>4} KiB {mode:<6} {op:<3} " + " ".join(cells))
    return "\n".join(lines)


def table(rows: list[Row], ratio_rows: list[dict], goal_rows: list[dict], lookups: list[dict],
          ec: list[dict]) -> str:
    lines = [_io_lines(rows), "", _ratio_lines(ratio_rows)]
    lines.append("\ngoals (kvstore / peer)")
    for g in goal_rows:
        lines.append(f"  {g['op']} >= {g['goal']}x {g['peer']:<8} {g['size'] // 1024:>5} KiB {g['mode']:<6} "
                     f"{g['ratio']:6.2f}x  (reps {g['ratio_min']:.2f}-{g['ratio_max']:.2f}x)  "
                     f"{'MET' if g['met'] else 'MISSED'}"
                     + (f"  (ec_floor / raw_file {g['floor']:.2f}x)" if g.get("floor") is not None else ""))
    if lookups:
        lines.append("\nlookup of a 1,000-block chain (all hit), in process; index filled with fake metas")
        for x in lookups:
            lines.append(f"  {x['entries']:>9} entries: p50 {x['p50_ms']:.3f} ms  p90 {x['p90_ms']:.3f} ms  "
                         f"p99 {x['p99_ms']:.3f} ms  (hit {x['hit_blocks']}, swa_at {x['swa_at']})")
    if ec:
        lines.append("\nerasure coding, pyeclib (MiB/s of payload)")
        for x in ec:
            lines.append(f"  {x['ec_type']:<16} {x['ec']:<5} {x['size'] // 1024:>5} KiB {x['op']:<14} "
                         f"{x['mib_s']:>9.0f}")
    return "\n".join(lines)


def parse_size(text: str) -> int:
    units = {"K": 1024, "M": MiB, "k": 1000}
    t = text.strip()
    return int(float(t[:-1]) * units[t[-1]]) if t[-1] in units else int(t)


MAX_PAYLOAD = 64 * MiB  # the store's default max_value_bytes
MIN_LOOKUP_ENTRIES = 1000 + 1000 // 8  # the 1,000-block chain and its SWA snapshots must fit


def _size_in(lo: int, hi: int | None, what: str) -> Callable[[str], int]:
    """``type=`` for one size such as 128K, 1M, 10k or 4096, in ``[lo, hi]``."""

    def conv(text: str) -> int:
        try:
            v = parse_size(text)
        except (ValueError, IndexError, OverflowError):
            raise argparse.ArgumentTypeError(f"expected a size such as 4096, 128K, 1M or 10k, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{what} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
        if what == "payload size" and v % 2:
            raise argparse.ArgumentTypeError(f"a payload size is a whole number of fp16 values (even), got {v}")
        return v

    return conv


def _systems(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {','.join(SYSTEMS)}")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"a system is named twice in {text!r}")
    if "kvstore" not in names or len(names) < 2:
        peers = ",".join(n for n in SYSTEMS if n != "kvstore")
        raise argparse.ArgumentTypeError(f"got {names}: the bench compares kvstore with its peers, so it needs "
                                         f"kvstore and at least one of {peers}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--remote" in args:
        from tools import bench_remote

        args.remove("--remote")
        return bench_remote.main(args)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--remote", action="store_true",
                    help="run the daemon's benchmark (tools/bench_remote.py) instead; see --remote --help")
    ap.add_argument("--s3", action="store_true",
                    help="kvstore on 6 S3 targets against raw s3fs, on a moto S3 server on loopback (docstring)")
    ap.add_argument("--quick", action="store_true", help="a short run: fewer bytes, reps, sizes")
    ap.add_argument("--sizes", type=csv_list(_size_in(2, MAX_PAYLOAD, "payload size")), default=None,
                    help="payload sizes (default 128K,1M,4M)")
    ap.add_argument("--reps", type=integer(1, 1000), default=None, help="repetitions (default 5; quick 1)")
    ap.add_argument("--mib-per-rep", type=number(0, 1 << 20, lo_open=True), default=None,
                    help="MiB written per rep (default 32; quick 4)")
    ap.add_argument("--batch", type=integer(1, 4096), default=16, help="items per put_many/get_many")
    ap.add_argument("--systems", type=_systems, default=None,
                    help=f"kvstore and at least one peer, from {','.join(SYSTEMS)}")
    ap.add_argument("--lookup-sizes", type=csv_list(_size_in(MIN_LOOKUP_ENTRIES, None, "lookup index size")),
                    default=None, help="index sizes (default 10k,100k,1000k; quick 10k,100k)")
    ap.add_argument("--no-lookup", action="store_true")
    ap.add_argument("--no-ec", action="store_true")
    ap.add_argument("--sequential", action="store_true",
                    help="run a rep's systems one after the other, not interleaved step by step")
    ap.add_argument("--work-dir", default=None, help="where the stores live (default: a temp dir)")
    ap.add_argument("--no-install", action="store_true", help="do not run tools/install_peers.sh if redis is missing")
    ap.add_argument("--out", default=None, help="results file (default results/bench_store.json; "
                                                "with --s3 results/bench_store_s3.json)")
    a = ap.parse_args(args)
    if a.s3 and (a.systems is not None or a.lookup_sizes is not None):
        ap.error("--s3 runs its own systems (kvstore, raw_s3) and no lookup: drop --systems and --lookup-sizes")
    if a.work_dir is not None and (msg := check_existing_dir(a.work_dir, "--work-dir")):
        ap.error(msg)
    if msg := check_output_file(a.out or ("results/bench_store_s3.json" if a.s3 else "results/bench_store.json")):
        ap.error(msg)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if a.s3:
        return run_s3(a, ap, argv, log)
    q = a.quick
    sizes = a.sizes or [128 * 1024, MiB, 4 * MiB]
    reps = a.reps if a.reps is not None else (1 if q else 5)
    mib_per_rep = a.mib_per_rep if a.mib_per_rep is not None else (4 if q else 32)
    lookup_sizes = a.lookup_sizes or ([10_000, 100_000] if q else [10_000, 100_000, 1_000_000])
    systems = list(a.systems or SYSTEMS)
    t_start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="bench_store-", dir=a.work_dir)
    notes: list[str] = []
    server = None
    try:  # from here on, whatever happens (Ctrl-C included): redis-server stopped, work dir removed
        if "redis" in systems:
            if shutil.which("redis-server") is None and not a.no_install:
                log("redis-server missing: running tools/install_peers.sh")
                subprocess.run(["bash", str(ROOT / "tools" / "install_peers.sh")], check=False)
            try:
                server = RedisPeer.server = RedisServer(work)
            except (RuntimeError, ImportError) as exc:
                notes.append(f"redis peer skipped: {exc}")
                systems.remove("redis")
                log(notes[-1])
                if len(systems) < 2:  # nothing left to compare kvstore with
                    ap.error(f"{notes[-1]}; no peer is left to compare kvstore with (add one to --systems)")
        sample = payloads(1 * MiB, 1, seed=1)[0]
        import zstandard

        zratio = len(sample) / len(zstandard.ZstdCompressor(level=3).compress(sample))
        from kvstore.embedded.tuning import tune_malloc

        malloc = tune_malloc()  # before any system runs: kvstore, raw files and LMDB share this process's allocator
        log(f"payload: fp16 random-normal, zstd-3 ratio {zratio:.3f}; systems {systems}; sizes {sizes}; "
            f"reps {reps}; {mib_per_rep} MiB per rep; malloc tuning {malloc}")
        rows = bench_io(systems, sizes, reps, mib_per_rep, a.batch, work, log, interleave=not a.sequential)
        lookups = [] if a.no_lookup else bench_lookup(lookup_sizes, work, 50 if q else 200, log)
        ec = [] if a.no_ec else bench_ec([MiB] if q else [MiB, 4 * MiB], 10 if q else 40, log)
    finally:
        if server is not None:
            server.close()
        shutil.rmtree(work, ignore_errors=True)
    rr = ratios(rows)
    gr = goals(rr, ratios(rows, "ec_floor"))
    print(table(rows, rr, gr, lookups, ec))
    for n in notes:
        print(f"note: {n}")
    elapsed = time.perf_counter() - t_start
    print(f"elapsed {elapsed:.0f} s")
    meta = {
        "command": " ".join([Path(sys.executable).name, "tools/bench_store.py", *(argv or sys.argv[1:])]),
        "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
        "payload": "fp16 random-normal", "zstd3_ratio": zratio, "ec": f"{DEFAULT_EC_TYPE} 4+2", "fsync": True,
        "redis": getattr(server, "version", None), "redis_persistence": "appendonly yes, appendfsync always",
        "lmdb": "sync=True, one txn per put or batch", "raw_file": "tmp write + fsync + rename + dir fsync",
        "reps": reps, "mib_per_rep": mib_per_rep, "interleaved": not a.sequential, "batch": a.batch,
        "elapsed_s": elapsed, "notes": notes,
        "malloc_tuning": malloc,
        "lookup_index": "filled with fake metas through kvstore.embedded.index.Index (lookup reads only the index)",
    }
    out = Path(a.out or "results/bench_store.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "io": [asdict(r) for r in rows], "ratios": rr, "goals": gr,
                               "lookup": lookups, "ec": ec}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    from tools.cli_args import run_main

    run_main(main)
