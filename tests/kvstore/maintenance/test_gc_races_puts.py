"""GC's orphan sweep racing puts: no acknowledged put loses a file, whatever ``orphan_grace_s``
the sweeping process uses (``kvstore.maintenance.orphans``: the sweep decides in the index, the put checks
in its index transaction).

Each test puts for a bounded time while a sweep at grace 0 runs as often as it can, in this
process or in another one, then reads every acknowledged entry back: lost must be 0. Before
the sweep recorded its decisions in the index, each of these lost entries in every run (the
age rule alone protected a put only from sweeps whose grace was longer than the put took).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import kvstore
from kvstore import PutItem, StoreUnavailable, Unrecoverable

from tests.kvstore.conftest import value_for

RUN_S = 3.0  # putting time per test (bounded: every loop below also stops on its count)
MAX_PUTS = 20_000


def _put_for(store, seconds: float, seed: int) -> tuple[list[bytes], int]:
    """Single puts and batches (packs) for ``seconds``: the keys acknowledged, and how many
    puts raised ``StoreUnavailable`` (not acknowledged: a put whose files were swept before
    its index commit more often than it retries)."""
    acked: list[bytes] = []
    refused = 0
    deadline = time.monotonic() + seconds
    n = 0
    while time.monotonic() < deadline and n < MAX_PUTS:
        n += 1
        batch = [seed.to_bytes(2, "big") + os.urandom(14) for _ in range(1 if n % 3 else 4)]
        try:
            got = store.put_many([PutItem(k, value_for(k, 3000)) for k in batch])
        except StoreUnavailable:
            refused += 1
            continue
        acked += [k for k, ok in zip(batch, got) if ok]
    return acked, refused


def _lost(store, acked: list[bytes]) -> list[bytes]:
    """The acknowledged keys that do not read back as written."""
    lost = []
    for k in acked:
        try:
            if store.get(k) != value_for(k, 3000):
                lost.append(k)
        except (Unrecoverable, kvstore.NotFound):
            lost.append(k)
    return lost


def test_gc_at_grace_zero_in_process_loses_no_acknowledged_put(tmp_path):
    """Two writer threads and a GC thread at ``orphan_grace_s`` 0 on one store."""
    with kvstore.connect(str(tmp_path / "d"), fsync=False, orphan_grace_s=0, delete_grace_s=0) as s:
        stop = threading.Event()
        passes = [0]

        def sweeper() -> None:
            while not stop.is_set() and passes[0] < MAX_PUTS:
                s.gc()
                passes[0] += 1

        gc_thread = threading.Thread(target=sweeper, daemon=True)
        gc_thread.start()
        out: dict[int, tuple[list[bytes], int]] = {}
        writers = [threading.Thread(target=lambda i=i: out.__setitem__(i, _put_for(s, RUN_S, i)), daemon=True)
                   for i in range(2)]
        for w in writers:
            w.start()
        for w in writers:
            w.join(RUN_S + 60)
        stop.set()
        gc_thread.join(60)
        acked = [k for keys, _ in out.values() for k in keys]
        refused = sum(r for _, r in out.values())
        lost = _lost(s, acked)
        print(f"in-process: {len(acked)} acknowledged, {len(acked) - len(lost)} readable, {len(lost)} lost, "
              f"{refused} refused, {passes[0]} gc passes")
        assert passes[0] > 0 and len(acked) > 100
        assert lost == []
        s.gc()
        assert s.check() == []


_SWEEPER = textwrap.dedent("""
    import sys, time
    import kvstore
    s = kvstore.connect(sys.argv[1], fsync=False, orphan_grace_s=0)
    print("READY", flush=True)
    n, deadline = 0, time.monotonic() + float(sys.argv[2])
    while time.monotonic() < deadline and n < 100000:
        s.gc()
        n += 1
    s.close()
    print("PASSES", n, flush=True)
""")


@pytest.mark.slow  # a soak of puts against another process's GC: the second stage of the test command
def test_gc_from_another_process_at_grace_zero_loses_no_acknowledged_put(tmp_path):
    """This process puts with the default grace (300 s); another one opens the same directory
    with ``orphan_grace_s`` 0 (as ``KVSTORE_ORPHAN_GRACE_S=0 kvtool gc DIR`` does) and runs GC
    passes back to back: the grace is not recorded anywhere, so only the index can tell it
    which files a put is about to acknowledge."""
    data = str(tmp_path / "d")
    with kvstore.connect(data, fsync=False) as s:
        s.put(b"\0" * 16, b"first")  # the directory exists before the sweeper opens it
        child = subprocess.Popen([sys.executable, "-c", _SWEEPER, data, str(RUN_S + 1)], stdout=subprocess.PIPE,
                                 text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])})
        try:
            assert child.stdout.readline().strip() == "READY"
            acked, refused = _put_for(s, RUN_S, 7)
            out, _ = child.communicate(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        passes = int(out.split()[-1])
        lost = _lost(s, acked)
        print(f"two processes: {len(acked)} acknowledged, {len(acked) - len(lost)} readable, {len(lost)} lost, "
              f"{refused} refused, {passes} gc passes in the other process")
        assert child.returncode == 0 and passes > 0 and len(acked) > 100
        assert lost == []
        s.gc()
        assert s.check() == []


def test_direct_commits_racing_gc_from_another_process_lose_nothing(tmp_path, monkeypatch):
    """A daemon (default grace) indexes batches a direct-writing client wrote into its targets
    (``EmbeddedStore.commit_written``) while another process sweeps at grace 0. The client's packs are
    older than anything the commit reads, so its check in the index transaction must also see
    sweeps decided before it started (their holds, or their counted deletes). The commit is
    made to wait 20 ms before it looks at the packs (a slow network), which is when a sweep
    would take them."""
    from kvstore.server.config import load_server_config
    from kvstore.server.service import Daemon

    data = tmp_path / "d"
    scfg, stcfg = load_server_config(None, env={}, port=0, gc_interval_s=0, data_dir=str(data), fsync=False,
                                     allow_direct_writes=True)
    daemon = Daemon(scfg, stcfg).start()
    real = daemon.store.commit_written

    def slow_commit(*a, **kw):
        time.sleep(0.02)
        return real(*a, **kw)

    monkeypatch.setattr(daemon.store, "commit_written", slow_commit)
    client = kvstore.connect(daemon.address, direct_writes="on")
    try:
        assert client.put_many([PutItem(b"\0" * 16, b"first" * 100), PutItem(b"\1" * 16, b"second" * 100)])
        child = subprocess.Popen([sys.executable, "-c", _SWEEPER, str(data), str(RUN_S + 1)],
                                 stdout=subprocess.PIPE, text=True,
                                 env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[3])})
        try:
            assert child.stdout.readline().strip() == "READY"
            acked: list[bytes] = []
            refused = 0
            deadline = time.monotonic() + RUN_S
            while time.monotonic() < deadline and len(acked) < MAX_PUTS:
                batch = [os.urandom(16) for _ in range(4)]
                try:
                    got = client.put_many([PutItem(k, value_for(k, 3000)) for k in batch])
                except StoreUnavailable:  # swept more often than the daemon's put retries: not acknowledged
                    refused += 1
                    continue
                acked += [k for k, ok in zip(batch, got) if ok]
            out, _ = child.communicate(timeout=120)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        counters = client.direct_write_stats()["counters"]
        lost = _lost(client, acked)
        print(f"direct commits: {len(acked)} acknowledged, {len(acked) - len(lost)} readable, {len(lost)} lost, "
              f"{refused} refused, {counters.get('direct_writes', 0)} written directly, "
              f"{counters.get('rejected_packs', 0)} packs rejected, {out.split()[-1]} gc passes in the other process")
        assert child.returncode == 0 and counters.get("direct_writes", 0) > 0
        assert lost == []
    finally:
        client.close()
        daemon.stop(grace_s=1)
