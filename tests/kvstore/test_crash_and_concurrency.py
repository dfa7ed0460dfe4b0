"""Crash safety (SIGKILL at random instants) and concurrent threads and processes."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import kvstore
from kvstore import NotFound, PutItem
from kvstore.maintenance import ProblemKind

from ._writer import value
from .conftest import assert_clean
from tests.fragments import assert_pack_refs_match_records

ROOT = Path(__file__).resolve().parents[2]


def _spawn(data_dir, mode, seed):
    return subprocess.Popen([sys.executable, "-m", "tests.kvstore._writer", str(data_dir), mode, str(seed)],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)


def test_sigkill_at_random_instants_loses_no_acknowledged_put(tmp_path):
    data_dir = tmp_path / "store"
    rnd = random.Random(7)
    acked: list[bytes] = []
    for trial in range(20):
        p = _spawn(data_dir, "put", trial)
        assert p.stdout.readline().strip() == "READY"
        deadline = time.monotonic() + rnd.uniform(0.05, 0.6)
        lines: list[str] = []

        def reader():
            for line in p.stdout:
                lines.append(line)

        t = threading.Thread(target=reader, daemon=True)
        t.start()
        while time.monotonic() < deadline:
            time.sleep(0.01)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
        t.join(timeout=10)
        # Only whole lines count: the kill may cut the last "ACK <hex>" line short.
        acked += [bytes.fromhex(line.split()[1]) for line in lines
                  if line.endswith("\n") and re.fullmatch(r"ACK [0-9a-f]{32}\n", line)]
    assert len(acked) > 20
    with kvstore.connect(str(data_dir), orphan_grace_s=0) as s:
        problems = s.check()
        assert {p.kind for p in problems} <= {ProblemKind.ORPHAN_FRAGMENT}, problems
        for k in acked:
            assert s.get(k) == value(k)
        s.check(fix=True)
        assert_clean(s)
        assert_pack_refs_match_records(s)


def test_threads_put_get_gc_one_store(data_dir, clock):
    s = kvstore.connect(str(data_dir), fsync=False, capacity_bytes=400_000, high_watermark=0.9,
                        low_watermark=0.6, delete_grace_s=60, access_flush_s=0.01)
    errors: list[str] = []
    stop = time.monotonic() + 3

    def worker(seed):
        rng = random.Random(seed)
        mine = []
        n = 0
        while time.monotonic() < stop and n < 400:
            n += 1
            if not mine or rng.random() < 0.4:
                new = [rng.randbytes(16) for _ in range(rng.choice([1, 1, 2, 3]))]  # batches: packs
                s.put_many([PutItem(k, value(k)) for k in new])
                mine.extend(new)
            else:
                k = rng.choice(mine)
                try:
                    if s.get(k) != value(k):
                        errors.append("wrong bytes")
                except NotFound:
                    pass
                except Exception as exc:  # noqa: BLE001 - any other failure is the bug we look for
                    errors.append(repr(exc))

    def collector():
        while time.monotonic() < stop:
            s.gc()
            time.sleep(0.05)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)] + [threading.Thread(target=collector)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert s.used_bytes() <= 400_000
    s.gc()
    assert [p for p in s.check() if p.kind is not ProblemKind.ORPHAN_FRAGMENT] == []
    assert_pack_refs_match_records(s)
    s.close()


def test_processes_share_one_data_directory(data_dir):
    kvstore.connect(str(data_dir), fsync=False).close()
    procs = [_spawn(data_dir, "mixed", seed) for seed in range(3)]
    with kvstore.connect(str(data_dir), fsync=False, capacity_bytes=600_000, delete_grace_s=5) as s:
        t_end = time.monotonic() + 60
        while any(p.poll() is None for p in procs) and time.monotonic() < t_end:
            s.gc(orphans=False)
            time.sleep(0.05)
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs)
        assert all(o.strip().endswith("BAD 0") for o in outs), outs
        assert [p for p in s.check() if p.kind is not ProblemKind.ORPHAN_FRAGMENT] == []
        assert_pack_refs_match_records(s)
