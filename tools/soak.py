"""Chaos soak: sharded ``kvstore serve`` daemons over ``faulty://`` targets, many clients, faults.

Claim under test: never wrong bytes, and nothing acknowledged lost while at most
m targets of a shard are faulty. Exact commands::

    # the full run (a benchmark: two minutes of chaos)
    .venv/bin/python tools/soak.py --duration 120 --shards 3 --clients 4 --out soak-full.json
    # the short run that tests/tools/test_soak.py does (15 s of chaos), also with --direct-writes,
    # and with --plain-targets (plain directories: the store's segments under SIGKILLs and damage)
    .venv/bin/python tools/soak.py --duration 15 --shards 2 --clients 2 --out /tmp/soak.json

Loopback only; every daemon binds 127.0.0.1 on a port picked at first start and
reused on restart. Bounded by ``--duration`` and ``--max-ops`` per client.

Set-up: ``--shards`` daemons, each over ``--targets`` faulty targets with EC
``k+m`` (at least one spare target); the fault plans live in files under
``<workdir>/faults`` that the daemons poll (``kvstore.embedded.faults``).

Clients (``--clients`` processes, ``ShardedStore``): a mixed workload of puts,
TTL puts, gets of their own keys and of other clients' keys, lookups of chains,
deletes, and GC. A value is derived from its key (``value_for``), so every
read is checked by whoever reads; each client keeps the ledger of its
acknowledged puts and deletes (``<workdir>/ledger-N.json``). With ``--direct-writes`` the
clients write the pack files of their puts into the faulty targets themselves and the
daemons only commit them (``kvstore.client.direct_writes``): the clients meet the same faults,
and a failed pack goes through the daemon (``client_counts``: ``direct_*``).

Chaos (one controller, seeded): SIGKILL + restart of a daemon (sometimes with
a skewed clock, ``--clock-offset-s``), a target vanishing and coming back, a
target filling up (ENOSPC by capacity), latency, transient read errors, bits
flipped in fragment files on disk, short writes. Invariant of the schedule:
per shard, targets under a fault or holding unrepaired damage are at most m
(``max_faulty_targets`` in the report proves it); damage is cleared by a
``Repair`` of that shard before its budget is freed (asked again while the daemon
answers BUSY because a client's gc pass runs there: ``repair_shard``).

Final pass: all faults cleared, every shard repaired, then every acknowledged,
undeleted, non-TTL key is read back: ``acked_lost`` (must be 0) and
``wrong_bytes`` (must be 0, counted during the run too); also ``deleted_but_found``,
``acked_missing_during_run`` and ``acked_unreadable_during_run`` (client counts: an
acknowledged key a get found absent, or could not decode) must be 0 and ``check_after_repair`` hold
nothing but orphan fragments (a killed daemon's in-flight puts; GC sweeps them)
(``failures``). Output: JSON to ``--out``; exit 1 if any of them is not.

Work directory: ``--workdir`` is yours and stays. Without it the soak makes a
temporary one (daemon data, fault plans, ledgers: tens to hundreds of MiB) and
removes it after a clean run; after a failed run (or with ``--keep``) it stays for
the post-mortem, and the report's ``workdir`` names it (stderr names it too).

Progress: a line on stderr every few seconds (elapsed, operations, calls refused while a
daemon was down or a target full or, for a client's gc, while another gc, check or repair
pass ran on that daemon: BUSY, one pass at a time; unexpected errors, wrong bytes), from
small per-client progress files the clients rewrite every second.

Exit status (the contract of ``tools/cli_args.py``): 0 when nothing was lost and no byte
was wrong; 1 when something was, or when the run itself failed (a daemon that does not
start, a client that dies): one line says why and names the kept work directory; 2 for a
bad argument (``--k``/``--m`` follow ``kvstore.config.StoreConfig``: k >= 1, m >= 0,
k+m <= 32, m = 0 only with k = 1), refused before anything is started or created.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import kvstore
from kvstore import PutItem
from kvstore.embedded import faults
from kvstore.config import StoreConfig
from kvstore.errors import (CapacityExceeded, InvalidRequest, KVStoreError, NotFound, ServerBusy,
                            StoreUnavailable, Unrecoverable)
from tools.cli_args import (check_output_dir, check_output_file, integer, number, one_line,
                            sigint_deferred, sigint_ignored_in_children)
from tools.soak_report import Progress, failures, pct, progress_path, write_progress

ROOT = Path(__file__).resolve().parents[1]
REPAIR_BUSY_WAIT_S = 30.0  # how long the controller's Repair waits out another pass on its daemon
OPS = {"put": 22, "put_many": 8, "put_ttl": 8, "get": 30, "get_other": 8, "lookup": 12, "delete": 5, "get_many": 6,
       "gc": 1}


def key_for(seed: int, client: int, i: int) -> bytes:
    return hashlib.blake2b(f"{seed}:{client}:{i}".encode(), digest_size=16).digest()


def value_for(key: bytes) -> bytes:
    return hashlib.shake_128(key).digest(256 + key[0] * 8)


# ----------------------------------------------------------------------------- client process
def run_client(a: argparse.Namespace) -> int:
    rng = random.Random(a.seed * 1000 + a.client)
    s = kvstore.connect(a.urls, timeout_s=10, direct_writes="on" if a.direct_writes else "off")
    live: list[int] = []  # acknowledged, not deleted, no TTL (insertion order)
    live_set: set[int] = set()
    ttl: dict[int, tuple[float, float]] = {}
    deleted: set[int] = set()
    uncertain: set[int] = set()
    c: Counter[str] = Counter()
    samples: list[tuple[float, str, float]] = []
    errors: list[str] = []  # the first few unexpected errors, for the report
    nxt = 0
    ops, weights = list(OPS), list(OPS.values())
    end = time.time() + a.duration
    progress = progress_path(Path(a.ledger).parent, a.client)
    next_progress = 0.0

    def check_value(k: bytes, v: bytes | None) -> None:
        if v is not None and v != value_for(k):
            c["wrong_bytes"] += 1

    for _ in range(a.max_ops):
        now = time.time()
        if now >= end:
            break
        if now >= next_progress:
            write_progress(progress, c)
            next_progress = now + 1.0
        op = rng.choices(ops, weights)[0]
        if op in ("get", "delete", "lookup", "get_many") and not live:
            op = "put"
        t0 = time.time()
        try:
            if op in ("put", "put_ttl"):
                i, nxt = nxt, nxt + 1
                k = key_for(a.seed, a.client, i)
                life = rng.uniform(2.0, 8.0) if op == "put_ttl" else None
                try:
                    s.put(k, value_for(k), ttl_s=life)
                except (StoreUnavailable, CapacityExceeded):
                    uncertain.add(i)  # may or may not have been committed: not acknowledged
                    raise
                if life is None:
                    live.append(i)
                    live_set.add(i)
                else:
                    ttl[i] = (time.time(), life)
                c["acked_puts"] += 1
            elif op == "put_many":  # a batch: pack files on each shard it reaches
                idx = list(range(nxt, nxt + rng.randint(2, 4)))
                nxt += len(idx)
                try:
                    s.put_many([PutItem(key_for(a.seed, a.client, i), value_for(key_for(a.seed, a.client, i)))
                                for i in idx])
                except (StoreUnavailable, CapacityExceeded):
                    uncertain.update(idx)
                    raise
                live.extend(idx)
                live_set.update(idx)
                c["acked_puts"] += len(idx)
            elif op == "get":
                i = rng.choice(live) if live_set and (not ttl or rng.random() < 0.8) else rng.choice(list(ttl))
                k = key_for(a.seed, a.client, i)
                try:
                    check_value(k, s.get(k))
                    c["reads_ok"] += 1
                except Unrecoverable:  # at most m targets faulty or damaged: an acknowledged key reads back
                    c["unrecoverable"] += 1
                    if i in live_set:
                        c["acked_unreadable_during_run"] += 1
                except NotFound:
                    if i in live_set:
                        c["acked_missing_during_run"] += 1
                    elif time.time() < ttl[i][0] + ttl[i][1] - a.max_skew - 1.0:
                        c["ttl_missing_early"] += 1
                    else:
                        c["ttl_expired"] += 1
            elif op == "get_other":
                other = rng.randrange(a.clients)
                k = key_for(a.seed, other, rng.randrange(max(nxt, 1)))
                try:
                    check_value(k, s.get(k))
                    c["reads_ok"] += 1
                except NotFound:
                    pass
            elif op == "get_many":
                idx = rng.sample(live, min(len(live), 16))
                keys = [key_for(a.seed, a.client, i) for i in idx]
                for k, v in zip(keys, s.get_many(keys)):
                    check_value(k, v)
                    c["acked_missing_during_run" if v is None else "reads_ok"] += 1
            elif op == "lookup":
                start = rng.randrange(len(live))
                chain = [key_for(a.seed, a.client, i) for i in live[start:start + 8]]
                if s.lookup(chain).hit_blocks != len(chain):
                    c["lookup_short"] += 1
            elif op == "delete":
                i = live.pop(rng.randrange(len(live)))
                live_set.discard(i)
                try:
                    s.delete(key_for(a.seed, a.client, i))
                    deleted.add(i)
                except StoreUnavailable:
                    uncertain.add(i)
                    raise
            elif op == "gc":
                s.gc()
            c[f"op_{op}"] += 1
            samples.append((t0, op, (time.time() - t0) * 1000))
        except Unrecoverable:
            c["unrecoverable"] += 1
        except CapacityExceeded:
            c["capacity_refused"] += 1
        except StoreUnavailable:
            c["unavailable"] += 1
        except KVStoreError as exc:
            c[f"error_{type(exc).__name__}"] += 1
            if len(errors) < 5:
                errors.append(f"{op}: {type(exc).__name__}: {exc}"[:300])
    if a.direct_writes:  # per shard: this client's pack writes, commits and fallbacks to PutStream
        for st in s.direct_write_stats().values():
            c.update({f"direct_{k}": v for k, v in st["counters"].items()})
    s.close()
    doc = {"client": a.client, "counts": dict(c), "live": live, "ttl": list(ttl), "deleted": sorted(deleted),
           "uncertain": sorted(uncertain), "samples": samples, "errors": errors}
    Path(a.ledger).write_text(json.dumps(doc))
    return 0


# ----------------------------------------------------------------------------- daemons
class Shard:
    def __init__(self, idx: int, work: Path, a: argparse.Namespace, env: dict):
        self.idx, self.a, self.env = idx, a, env
        self.names = [f"s{idx}t{j}" for j in range(a.targets)]
        self.dirs = [work / f"s{idx}" / f"t{j}" for j in range(a.targets)]
        self.data = work / f"s{idx}" / "data"
        self.log_path = work / f"daemon-{idx}.log"
        self.log = open(self.log_path, "ab")
        self.port = 0
        self.proc: subprocess.Popen | None = None
        self.offset = 0.0
        self.harvested: Counter[str] = Counter()

    def start(self, offset: float = 0.0) -> None:
        self.offset = offset
        if self.a.plain_targets:  # plain directories: the store appends to segments there
            urls = ",".join(f"file://{d}#{n}#{n}" for n, d in zip(self.names, self.dirs))
        else:
            urls = ",".join(faults.faulty_url(n, str(d)) for n, d in zip(self.names, self.dirs))
        cmd = [sys.executable, "-m", "kvstore.server.cli", "serve", "--port", str(self.port), "--data-dir",
               str(self.data), "--targets", urls, "--ec-k", str(self.a.k), "--ec-m", str(self.a.m),
               "--fsync", "false", "--gc-interval-s", "3", "--orphan-grace-s", "60", "--delete-grace-s", "2",
               "--read-timeout-s", "0.5", "--fragment-read-retries", "1", "--clock-offset-s", str(offset),
               "--log-level", "WARNING", "--allow-direct-writes", str(self.a.direct_writes).lower()]
        for attempt in range(20):
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=ROOT,
                                         env=self.env)
            m = re.search(r"grpc://\S+", self.proc.stdout.readline())
            if m:
                self.url = m.group(0)
                self.port = int(self.url.rsplit(":", 1)[1])
                return
            self.proc.wait()
            time.sleep(0.25)  # the old port may linger for a moment after a SIGKILL
        raise RuntimeError(f"shard {self.idx} did not start; see {self.log_path}")

    def harvest(self) -> None:
        """Add this incarnation's store counters (they live in memory: read before a kill)."""
        try:
            with kvstore.connect(self.url, timeout_s=10) as r:
                self.harvested.update(r.stats()["counters"])
        except KVStoreError:
            pass

    def kill(self) -> None:
        self.harvest()
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.harvest()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


# ----------------------------------------------------------------------------- chaos
WINDOW_FAULTS = {  # kind -> plan for one target during its window (a registry, not a chain of ifs)
    "target_down": lambda r, d: faults.FaultPlan(down=True),
    "target_full": lambda r, d: faults.FaultPlan(capacity_bytes=faults._du(str(d)) + r.randrange(0, 30_000)),
    "latency": lambda r, d: faults.FaultPlan(latency_s=r.uniform(0.05, 0.8), latency_p=0.5, seed=r.randrange(99)),
    "read_errors": lambda r, d: faults.FaultPlan(read_error_p=0.3, seed=r.randrange(99)),
    "short_writes": lambda r, d: faults.FaultPlan(short_write_p=0.5, seed=r.randrange(99)),  # leaves damage
    "corrupt_reads": lambda r, d: faults.FaultPlan(corrupt_read_p=0.3, seed=r.randrange(99)),
}
DAMAGING = {"short_writes", "corrupt_files"}


def corrupt_files(r: random.Random, d: Path, n: int) -> int:
    files = [p for p in d.rglob("*") if p.is_file() and not p.name.startswith(".")]
    hit = 0
    for p in r.sample(files, min(n, len(files))):
        try:  # in place: a segment the daemon still appends to must keep every other byte
            with open(p, "r+b") as fh:
                i = r.randrange(os.fstat(fh.fileno()).st_size * 8)
                fh.seek(i // 8)
                b = fh.read(1)[0] ^ (1 << (i % 8))
                fh.seek(i // 8)
                fh.write(bytes((b,)))
            hit += 1
        except (OSError, ValueError, IndexError):
            pass
    return hit


def repair_shard(url: str, busy_wait_s: float = REPAIR_BUSY_WAIT_S) -> dict:
    """One shard's ``Repair`` for the controller. A daemon runs one gc, check or repair pass at a
    time and answers another BUSY (``ServerBusy``): a client's ``gc`` may be running there, so
    a refused Repair is asked again every 0.2 s for up to ``busy_wait_s`` (asked once, the final
    repair would fail now and then, its shard's damage would stay, and the run would fail)."""
    deadline = time.monotonic() + busy_wait_s
    with kvstore.connect(url, timeout_s=60) as rs:
        while True:
            try:
                return rs.repair()
            except ServerBusy:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.2)


def chaos(shards: list[Shard], fdir: Path, a: argparse.Namespace, end: float, tick=lambda: None,
          stop=lambda: False) -> dict:
    """The fault schedule until ``end`` or until ``stop()`` is true (checked once per step, as
    ``tick()``, the progress line, is called)."""
    r = random.Random(a.seed)
    active: list[tuple[float, int, int, str]] = []  # (until, shard, target, kind)
    damaged: dict[int, set[int]] = defaultdict(set)
    cooling: dict[tuple[int, int], float] = {}
    timeline: list[tuple[float, float, str]] = []
    injected: Counter[str] = Counter()
    repairs: Counter[str] = Counter()
    max_faulty = 0

    def busy(s: int, now: float) -> set[int]:
        return ({t for _, sh, t, _ in active if sh == s} | damaged[s]
                | {t for (sh, t), until in cooling.items() if sh == s and until > now})

    def repair(s: int) -> None:
        try:
            out = repair_shard(shards[s].url)
            repairs["runs"] += 1
            for k, v in out.items():
                if isinstance(v, (int, float)):  # the counts; not unfixed_detail (a list of lines)
                    repairs[k] += v
            damaged[s].clear()
        except KVStoreError:
            repairs["failed_runs"] += 1

    while time.time() < end and not stop():
        tick()
        now = time.time()
        for f in [f for f in active if f[0] <= now]:
            active.remove(f)
            faults.write_plan(str(fdir), shards[f[1]].names[f[2]], faults.FaultPlan())
            cooling[(f[1], f[2])] = now + 0.3  # the daemon polls every 50 ms; keep it counted a while
            if f[3] in DAMAGING:
                damaged[f[1]].add(f[2])
        s = r.randrange(len(shards))
        choice = r.random()
        if choice < 0.3:
            pass  # calm steps: the latency figures need a calm baseline from the same run
        elif choice < 0.4:
            t0 = time.time()
            skew = r.choice([0.0, 0.0, r.uniform(-20, 20)])
            shards[s].kill()
            injected["daemon_sigkill"] += 1
            time.sleep(r.uniform(0.2, 1.0))
            shards[s].start(offset=skew)
            injected["clock_skew" if skew else "daemon_restart"] += 1
            timeline.append((t0, time.time(), "daemon_sigkill"))
        elif choice < 0.5 and damaged[s] and not any(f[1] == s for f in active):
            repair(s)
        else:
            free = [t for t in range(a.targets) if t not in busy(s, now)]
            if free and len(busy(s, now)) < a.m:
                t = r.choice(free)
                if a.plain_targets or r.random() < 0.15:  # window faults need faulty:// targets
                    injected["corrupt_files"] += corrupt_files(r, shards[s].dirs[t], r.randint(1, 5))
                    damaged[s].add(t)
                else:
                    kind = r.choice(list(WINDOW_FAULTS))
                    faults.write_plan(str(fdir), shards[s].names[t], WINDOW_FAULTS[kind](r, shards[s].dirs[t]))
                    length = r.uniform(1.0, 3.0)
                    active.append((now + length, s, t, kind))
                    timeline.append((now, now + length + 0.3, kind))
                    injected[kind] += 1
        for sh in range(len(shards)):
            max_faulty = max(max_faulty, len(busy(sh, time.time())))
        time.sleep(r.uniform(0.2, 0.6))
    for f in active:
        faults.write_plan(str(fdir), shards[f[1]].names[f[2]], faults.FaultPlan())
    time.sleep(0.3)
    for s in range(len(shards)):
        repair(s)
    return {"injected": dict(injected), "repairs": dict(repairs), "timeline": timeline,
            "max_faulty_targets": max_faulty}


# ----------------------------------------------------------------------------- report
def verify(urls: str, seed: int, ledgers: list[dict]) -> Counter:
    out: Counter[str] = Counter()
    with kvstore.connect(urls, timeout_s=30) as s:
        for led in ledgers:
            cl = led["client"]
            for group, expect in ((led["live"], "live"), (led["deleted"], "deleted"), (led["uncertain"], "any")):
                for b in range(0, len(group), 256):
                    keys = [key_for(seed, cl, i) for i in group[b:b + 256]]
                    for k, v in zip(keys, s.get_many(keys)):
                        if v is not None and v != value_for(k):
                            out["wrong_bytes"] += 1
                        elif expect == "live":
                            out["acked_checked"] += 1
                            out["acked_lost"] += v is None
                        elif expect == "deleted" and v is not None:
                            out["deleted_but_found"] += 1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=number(0, 7 * 86400, lo_open=True), default=60.0, help="seconds of chaos")
    ap.add_argument("--shards", type=integer(1, 32), default=3)
    ap.add_argument("--clients", type=integer(1, 256), default=4)
    ap.add_argument("--targets", type=integer(2, 64), default=5, help="faulty targets per shard (>= k + m + 1)")
    ap.add_argument("--k", type=int, default=2, help="erasure code data fragments (k >= 1, k + m <= 32)")
    ap.add_argument("--m", type=int, default=2, help="erasure code parity fragments (m >= 0; 0 only with k = 1)")
    ap.add_argument("--max-ops", type=integer(1), default=1_000_000, help="per client")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default="", help="kept afterwards (default: a temporary one, removed after a clean run)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary work directory after a clean run too")
    ap.add_argument("--out", default="results/soak.json")
    ap.add_argument("--plain-targets", action="store_true",
                    help="targets as plain local directories, where the store appends to segments, instead of "
                         "faulty:// ones; the window faults (a target down or full, latency, read errors, short "
                         "writes, corrupt reads) need faulty:// targets and are left out: daemon SIGKILLs, restarts, "
                         "clock skew and damaged files stay")
    ap.add_argument("--direct-writes", action="store_true",
                    help="clients write pack files into the faulty targets themselves (kvstore.client.direct_writes)")
    ap.add_argument("--client", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--urls", default="", help=argparse.SUPPRESS)
    ap.add_argument("--ledger", default="", help=argparse.SUPPRESS)
    ap.add_argument("--max-skew", type=float, default=20.0, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.client >= 0:  # one client process, started by the controller below
        try:
            return run_client(a)
        except Exception as exc:  # the controller sees the status and names the work directory
            print(f"{ap.prog} client {a.client}: error: {one_line(exc)}", file=sys.stderr)
            return 1
    try:  # the store's own rule for an erasure code, checked before any daemon is started
        StoreConfig(ec_k=a.k, ec_m=a.m)
    except InvalidRequest as exc:
        ap.error(f"--k {a.k} --m {a.m}: {exc}")
    if a.targets < a.k + a.m + 1:
        ap.error(f"--targets must be at least k + m + 1 = {a.k + a.m + 1} (a spare to fall back to), got {a.targets}")
    for msg in (check_output_file(a.out), a.workdir and check_output_dir(a.workdir, "--workdir")):
        if msg:
            ap.error(msg)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="kvsoak-"))
    shards: list[Shard] = []
    clients: list[subprocess.Popen] = []
    try:
        return run(a, argv, work, shards, clients)
    except (RuntimeError, OSError, ValueError, KVStoreError, subprocess.TimeoutExpired) as exc:
        print(f"{ap.prog}: error: {one_line(exc)}; work directory kept for the post-mortem: {work}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{ap.prog}: error: interrupted; work directory kept for the post-mortem: {work}", file=sys.stderr)
        return 130
    finally:  # whatever happened: nothing this run started is left running (a Ctrl-C waits for it)
        with sigint_deferred():
            for p in clients:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
            for sh in shards:
                if sh.proc is not None and sh.proc.poll() is None:
                    sh.proc.kill()
                    sh.proc.wait(10)


def run(a: argparse.Namespace, argv: list[str] | None, work: Path, shards: list, clients: list) -> int:
    """The soak once every argument was checked; fills ``shards`` and ``clients`` as it starts them."""
    fdir = work / "faults"
    fdir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env[faults.ENV_DIR] = str(fdir)
    shards.extend(Shard(i, work, a, env) for i in range(a.shards))
    for sh in shards:
        sh.start()
    urls = ",".join(sh.url for sh in shards)
    t_start = time.time()
    end = t_start + a.duration
    with sigint_ignored_in_children():  # Ctrl-C: the controller stops them (main's finally), quietly
        clients.extend(subprocess.Popen([sys.executable, __file__, "--client", str(c), "--clients", str(a.clients),
                                         "--urls", urls, "--ledger", str(work / f"ledger-{c}.json"), "--seed", str(a.seed),
                                         "--duration", str(a.duration), "--max-ops", str(a.max_ops),
                                         *(["--direct-writes"] if a.direct_writes else [])], cwd=ROOT, env=env)
                       for c in range(a.clients))
    print(f"soak: {a.shards} shard(s) of {a.targets} faulty targets (EC {a.k}+{a.m}), {a.clients} client(s), "
          f"{a.duration:g} s; work directory {work}", file=sys.stderr, flush=True)
    progress = Progress(work, a.clients, t_start, a.duration)

    def failed_client() -> int | None:
        return next((c for c, p in enumerate(clients) if p.poll()), None)

    # chaos stops early once a client died (or all are done): no point faulting daemons nobody uses
    ch = chaos(shards, fdir, a, end, progress,
               stop=lambda: failed_client() is not None or all(p.poll() is not None for p in clients))
    c = failed_client()
    if c is not None:
        raise RuntimeError(f"client {c} exited with status {clients[c].returncode} after "
                           f"{time.time() - t_start:.0f} s of {a.duration:g} s")
    for c, p in enumerate(clients):
        if p.wait(timeout=a.duration + 120):
            raise RuntimeError(f"client {c} exited with status {p.returncode}")
    print(progress.line(", chaos over") + "; verifying every acknowledged key", file=sys.stderr, flush=True)
    ledgers = [json.loads((work / f"ledger-{c}.json").read_text()) for c in range(a.clients)]
    final = verify(urls, a.seed, ledgers)
    with kvstore.connect(urls, timeout_s=60) as s:
        problems = [p.kind.value for p in s.check()]
    for sh in shards:
        sh.stop()
    counts: Counter[str] = Counter()
    for led in ledgers:
        counts.update(led["counts"])
    daemon_faults: Counter[str] = Counter()
    for sh in shards:
        for n in sh.names:
            daemon_faults.update(faults.read_counts(str(fdir), n))
    windows = ch.pop("timeline")
    lat: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for led in ledgers:
        for t, op, ms in led["samples"]:
            phase = "faults" if any(w0 <= t <= w1 for w0, w1, _ in windows) else "calm"
            lat[phase][op].append(ms)
            lat[phase]["all"].append(ms)
    harvested: Counter[str] = Counter()
    for sh in shards:
        harvested.update(sh.harvested)
    ops_done = sum(v for k, v in counts.items() if k.startswith("op_"))
    report = {
        "command": " ".join([Path(sys.executable).name, "tools/soak.py", *(argv or sys.argv[1:])]),
        "config": {"shards": a.shards, "clients": a.clients, "targets_per_shard": a.targets, "ec": f"{a.k}+{a.m}",
                   "duration_s": a.duration, "seed": a.seed, "direct_writes": a.direct_writes},
        "elapsed_s": round(time.time() - t_start, 1),
        "operations": ops_done, "ops_by_kind": {k[3:]: v for k, v in counts.items() if k.startswith("op_")},
        "faults_scheduled": ch["injected"], "faults_injected_in_daemons": dict(daemon_faults),
        "max_faulty_targets_per_shard": ch["max_faulty_targets"], "m": a.m,
        "degraded_reads": harvested["degraded_reads"], "read_retries": harvested["read_retries"],
        "read_timeouts": harvested["read_timeouts"], "unrecoverable_in_daemons": harvested["unrecoverable"],
        "repairs": ch["repairs"],
        "wrong_bytes": counts["wrong_bytes"] + final["wrong_bytes"],
        "acked_lost": final["acked_lost"], "acked_checked_at_end": final["acked_checked"],
        "deleted_but_found": final["deleted_but_found"],
        "client_counts": {k: v for k, v in counts.items() if not k.startswith("op_")},
        "client_counts_note": ("unavailable: calls to a shard while its daemon was killed (not acknowledged), "
                               "and gc calls it answered BUSY (ServerBusy) while another gc, check or repair "
                               "pass ran there (one pass at a time per daemon)"),
        "client_error_samples": [e for led in ledgers for e in led.get("errors", [])][:10],
        "check_after_repair": dict(Counter(problems)),
        "latency": {ph: {op: pct(v) for op, v in sorted(d.items())} for ph, d in lat.items()},
        "workdir": str(work),
    }
    failed = failures(report)
    report["workdir_kept"] = bool(a.workdir or a.keep or failed)
    if not report["workdir_kept"]:
        shutil.rmtree(work, ignore_errors=True)
    elif failed:
        print(f"soak.py: error: {', '.join(failed)}; work directory kept for the post-mortem: {work}",
              file=sys.stderr)
    else:
        print(f"soak: work directory kept: {work}", file=sys.stderr)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("operations", "faults_scheduled", "degraded_reads", "repairs",
                                             "wrong_bytes", "acked_lost", "max_faulty_targets_per_shard")}))
    return 1 if failed else 0


if __name__ == "__main__":
    from tools.cli_args import run_main

    run_main(main)
