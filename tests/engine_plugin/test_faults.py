"""Faults at load time never change the answer: corrupt, lost, wrong-sized, down, slow.

Corruption is real (fragment files of a real embedded store are overwritten
on disk); outages and delays come from ``FaultyStore``, a thin wrapper that
delegates to a real store object and injects the fault. ``FaultyStore`` has
only the plain protocol (as the remote and sharded clients), so the plugin
reads through ``read_into``'s ``get_many`` fallback; ``FaultyNativeStore``
adds ``get_many_into`` (as the embedded store), with the same faults.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import replace

import numpy as np
import pytest

from engine_plugin.contract import Tier
from engine_plugin.reference import SamplingParams
from engine_plugin.tiers import Metrics, StoreGateway
from kvstore.api import EntryInfo, EntryKind, Layout, LookupResult
from kvstore.errors import StoreUnavailable

GREEDY = SamplingParams(max_new_tokens=5)


class FaultyStore:
    """Delegates to a real store; ``drop``/``truncate`` keys, ``down``, ``delay_s``, ``put_delay_s``;
    ``raise_in`` names methods (``lookup``, ``get``) that raise ``raise_exc`` instead (a broken
    store or client whose exception is neither a ``KVStoreError`` nor an ``OSError``)."""

    def __init__(self, inner):
        self.inner = inner
        self.drop: set[bytes] = set()
        self.truncate: set[bytes] = set()
        self.down = False
        self.delay_s = 0.0
        self.put_delay_s = 0.0
        self.raise_in: set[str] = set()
        self.raise_exc: Exception = ValueError("injected: the client could not parse the reply")

    def _gate(self, delay: float, what: str = "") -> None:
        if self.down:
            raise StoreUnavailable("injected outage")
        if what in self.raise_in:
            raise self.raise_exc
        if delay:
            time.sleep(delay)

    def lookup(self, keys):
        self._gate(self.delay_s, "lookup")
        return self.inner.lookup(keys)

    def get_many(self, keys, *, kind="block"):
        self._gate(self.delay_s, "get")
        out = self.inner.get_many(keys, kind=kind)
        return [None if k in self.drop else (v[:-4] if v is not None and k in self.truncate else v)
                for k, v in zip(keys, out)]

    def put_many(self, items):
        self._gate(self.put_delay_s)
        return self.inner.put_many(items)

    def __getattr__(self, name):
        if name == "get_many_into":  # the plain protocol only (FaultyNativeStore adds it)
            raise AttributeError(name)
        return getattr(self.inner, name)


class FaultyNativeStore(FaultyStore):
    """``FaultyStore`` with the native read into caller buffers, faults applied alike."""

    def get_many_into(self, keys, outs, *, kind="block"):
        self._gate(self.delay_s, "get")
        infos = self.inner.get_many_into(keys, outs, kind=kind)
        return [None if k in self.drop else
                (replace(i, nbytes=i.nbytes - 4) if i is not None and k in self.truncate else i)
                for k, i in zip(keys, infos)]


@pytest.fixture(params=[FaultyStore, FaultyNativeStore], ids=["get_many", "native"])
def faulty_cls(request):
    return request.param


# How the loading engine lands store payloads (engine_plugin.loader): straight into the pool
# (the cpu default), through staging buffers (accelerators), and direct with the snapshot
# read straight into the window too (unpromoted).
LOAD_PATHS = {"direct": {}, "staged": {"direct_reads": False}, "direct_unpromoted": {"promote_to_host": False}}


@pytest.fixture(params=sorted(LOAD_PATHS))
def load_path(request) -> dict:
    return LOAD_PATHS[request.param]


def _corrupt(store, key: bytes, kind: str | None = None) -> int:
    """Overwrite every fragment of ``key`` (of ``kind``, or any) with garbage of the same size,
    in its own file or inside its batch's pack (``tests.fragments``)."""
    from tests.fragments import fragment_refs

    n = 0
    for k in [kind] if kind else ["block", "swa"]:
        for f in fragment_refs(store, key, k):
            f.write_bytes(bytes(255 - b for b in f.read_bytes()))
            n += 1
    assert n, f"no fragments found for {key.hex()}"
    return n


def _seed(rig, store, prompt, **kw):
    eng = rig.engine(store, **kw)
    eng.generate(prompt, GREEDY)
    eng.connector.flush()
    return eng


def test_corrupt_block_on_disk_falls_back_and_heals_the_store(rig, store, tmp_path, load_path):
    rng = random.Random(100)
    prompt = rig.tokens(rng, 120)
    a = _seed(rig, store, prompt, snapshot_end_of_input=False, snapshot_end_of_output=False)
    _corrupt(store, a.hasher.hash_blocks(prompt)[4])
    b = rig.engine(store, **load_path)
    warm = b.generate(prompt, GREEDY)
    rig.same(rig.cold(prompt, GREEDY), warm)
    m = b.connector.metrics.snapshot()
    assert b.rollbacks == 1 and m["load_errors"] == 1 and m["load_missing"] >= 1
    assert warm.plan.hit_tokens == 64 and warm.plan.needs_replay  # re-planned at the last good block
    b.connector.flush()
    c = rig.engine(store)  # b recomputed blocks 4.. and saved them again: the store is whole again
    again = c.generate(prompt, GREEDY)
    assert again.hit_tokens == 112 and again.plan.snapshot_tier is Tier.STORE and c.rollbacks == 0
    assert store.lookup(a.hasher.hash_blocks(prompt)).hit_blocks == 7
    rig.same(rig.cold(prompt, GREEDY), again)


def test_corrupt_snapshot_falls_back_to_replay(rig, store, tmp_path, load_path):
    rng = random.Random(101)
    prompt = rig.tokens(rng, 96 + 7)
    a = _seed(rig, store, prompt, snapshot_end_of_output=False)  # snapshot at 96
    keys = a.hasher.hash_blocks(prompt)
    _corrupt(store, keys[5], "swa")  # the SWA entry at 96; the blocks stay good
    b = rig.engine(store, **load_path)
    warm = b.generate(prompt, GREEDY)
    rig.same(rig.cold(prompt, GREEDY), warm)
    m = b.connector.metrics.snapshot()
    assert m["load_errors"] == 1 and m["snapshot_load_failed"] == 1 and b.rollbacks == 1
    assert warm.plan.hit_tokens == 96 and warm.plan.needs_replay  # same boundary, windows replayed


def test_lost_or_wrong_sized_entries_at_load_time(rig, store, faulty_cls, load_path):
    rng = random.Random(102)
    prompt = rig.tokens(rng, 150)
    a = _seed(rig, store, prompt)
    keys = a.hasher.hash_blocks(prompt)
    faulty = faulty_cls(store)
    faulty.drop = {keys[6]}  # lost between lookup and load
    b = rig.engine(faulty, **load_path)
    rig.same(rig.cold(prompt, GREEDY), b.generate(prompt, GREEDY))
    assert b.rollbacks == 1 and b.connector.metrics.get("load_missing") == 1
    faulty.drop, faulty.truncate = set(), {keys[2]}
    c = rig.engine(faulty, **load_path)
    warm = c.generate(prompt, GREEDY)
    rig.same(rig.cold(prompt, GREEDY), warm)
    assert c.connector.metrics.get("load_bad_size") == 1 and warm.plan.hit_tokens == 32
    faulty.truncate = {keys[-1]}  # the snapshot key: the SWA entry is fine, the block is short
    d = rig.engine(faulty, **load_path)
    rig.same(rig.cold(prompt, GREEDY), d.generate(prompt, GREEDY))
    assert store.check() == []


def test_store_down_runs_cold_with_a_reason_and_counters(rig, store, caplog):
    rng = random.Random(103)
    prompt = rig.tokens(rng, 100)
    _seed(rig, store, prompt)
    faulty = FaultyStore(store)
    faulty.down = True
    eng = rig.engine(faulty, store_backoff_s=60)
    r1 = eng.generate(prompt, GREEDY)
    r2 = eng.generate(prompt + [3], GREEDY)
    eng.connector.flush()
    for p, r in ((prompt, r1), (prompt + [3], r2)):
        rig.same(rig.cold(p, GREEDY), r)
    m = eng.connector.metrics.snapshot()
    assert r1.hit_tokens == 0 and m["store_errors"] == 1 and m["store_skipped"] >= 1
    assert m.get("saves_done", 0) == 0 and m["saves_failed"] >= 1
    assert "StoreUnavailable" in caplog.text and "injected outage" in eng.connector.gateway.last_error


def test_slow_store_times_out_instead_of_hanging(rig, store, faulty_cls):
    rng = random.Random(104)
    prompt = rig.tokens(rng, 100)
    _seed(rig, store, prompt)
    faulty = faulty_cls(store)
    faulty.delay_s = 1.5
    eng = rig.engine(faulty, store_timeout_s=0.1, store_backoff_s=60)
    t0 = time.monotonic()
    r = eng.generate(prompt, GREEDY)
    assert time.monotonic() - t0 < 1.4  # did not wait out the 1.5 s delay
    rig.same(rig.cold(prompt, GREEDY), r)
    assert r.hit_tokens == 0 and eng.connector.metrics.get("store_timeouts") == 1


def test_slow_puts_drop_saves_instead_of_stalling(rig, store):
    rng = random.Random(105)
    faulty = FaultyStore(store)
    faulty.put_delay_s = 0.3
    eng = rig.engine(faulty, save_queue_depth=1, save_enqueue_timeout_s=0.01, store_timeout_s=5)
    prompts = [rig.tokens(rng, 64) for _ in range(4)]
    for p in prompts:
        rig.same(rig.cold(p, GREEDY), eng.generate(p, GREEDY))
    eng.connector.flush()
    m = eng.connector.metrics.snapshot()
    assert m["saves_dropped"] > 0 and m["saves_done"] > 0
    # the engine never waited on the slow store longer than the enqueue timeout (+ scheduling slack)
    assert m["save_enqueue_wait_max_s"] < 0.01 + 0.2


def test_host_tier_hit_survives_a_dead_store(rig, store):
    rng = random.Random(106)
    prefix = rig.tokens(rng, 80)
    faulty = FaultyStore(store)
    eng = rig.engine(faulty)
    eng.generate(prefix, GREEDY)
    eng.connector.flush()
    eng.pool.drop_cached()
    faulty.down = True
    prompt = prefix + [1, 2, 3]
    warm = eng.generate(prompt, GREEDY)
    assert warm.hit_tokens == 80 and warm.plan.snapshot_tier is Tier.HOST
    rig.same(rig.cold(prompt, GREEDY), warm)


def test_an_entry_of_another_layout_is_not_loaded(rig, store, load_path):
    """An entry of the right byte count but saved as another dtype/shape (here int32 [16, 32]
    where the connector moves float32 [16, 32]) is not this KV: refused like a wrong size."""
    rng = random.Random(107)
    prompt = rig.tokens(rng, 120)
    a = _seed(rig, store, prompt, snapshot_end_of_input=False, snapshot_end_of_output=False)
    keys = a.hasher.hash_blocks(prompt)
    assert store.delete(keys[3], kind="block")
    store.put(keys[3], np.full((16, 32), 7, dtype=np.int32), kind="block", tokens=16)  # 2048 bytes too
    b = rig.engine(store, **load_path)
    warm = b.generate(prompt, GREEDY)
    rig.same(rig.cold(prompt, GREEDY), warm)
    m = b.connector.metrics.snapshot()
    assert m["load_bad_size"] == 1 and m["load_errors"] == 1 and b.rollbacks == 1
    assert warm.plan.hit_tokens == 48  # re-planned at the last good block


def test_a_snapshot_of_another_layout_is_not_loaded(rig, store, load_path):
    rng = random.Random(108)
    prompt = rig.tokens(rng, 96 + 7)
    a = _seed(rig, store, prompt, snapshot_end_of_output=False)  # snapshot at 96
    key = a.hasher.hash_blocks(prompt)[5]
    nbytes = len(store.get(key, kind="swa"))
    assert store.delete(key, kind="swa")
    store.put(key, np.zeros(nbytes // 4, dtype=np.int32), kind="swa")  # same size, flat int32
    b = rig.engine(store, **load_path)
    warm = b.generate(prompt, GREEDY)
    rig.same(rig.cold(prompt, GREEDY), warm)
    m = b.connector.metrics.snapshot()
    assert m["load_bad_size"] == 1 and m["snapshot_load_failed"] == 1 and b.rollbacks == 1
    assert warm.plan.hit_tokens == 96 and warm.plan.needs_replay  # same boundary, windows replayed


class _InfoStore:
    """A ``ReadsInto`` store answering every key with a fixed ``EntryInfo`` header."""

    def __init__(self, layout):
        self.layout = layout

    def get_many_into(self, keys, outs, *, kind="block"):
        return [EntryInfo(k, EntryKind.parse(kind), 2048, self.layout) for k in keys]

    def get_many(self, keys, *, kind="block"):
        raise AssertionError("not used")


@pytest.mark.parametrize("inline", [True, False])
@pytest.mark.parametrize("stored, ok", [
    (Layout("float32", (16, 32)), True),
    (None, True),  # the remote client's gRPC fallback reports no layout: only the size is checked
    (Layout("int32", (16, 32)), False),
    (Layout("float32", (32, 16)), False),
    (Layout("uint8", (2048,)), False),
])
def test_gateway_checks_the_entry_layout_where_the_store_reports_it(stored, ok, inline):
    m = Metrics()
    gw = StoreGateway(_InfoStore(stored), m)
    try:
        res = gw.read_into([b"k" * 16], [bytearray(2048)], kind="block", nbytes=2048,
                           layout=Layout("float32", (16, 32)), inline=inline)
    finally:
        gw.close()
    assert res.ok == [ok] and m.get("load_bad_size") == (0 if ok else 1)


@pytest.mark.parametrize("where", ["get", "lookup"])
def test_a_store_raising_an_unexpected_exception_means_recompute(rig, store, faulty_cls, load_path, where,
                                                                 caplog):
    """A broken store (or client) that raises e.g. ``ValueError`` is a failed load, logged with
    the exception and counted: the engine recomputes instead of raising."""
    rng = random.Random(109)
    prompt = rig.tokens(rng, 100)
    _seed(rig, store, prompt)
    faulty = faulty_cls(store)
    faulty.raise_in = {where}
    eng = rig.engine(faulty, store_backoff_s=60, **load_path)
    with caplog.at_level(logging.WARNING, logger="engine_plugin.tiers"):
        warm = eng.generate(prompt, GREEDY)
    rig.same(rig.cold(prompt, GREEDY), warm)
    m = eng.connector.metrics.snapshot()
    assert m["store_errors"] == 1
    if where == "get":  # the hit was planned, its load failed: rolled back and recomputed
        assert eng.rollbacks == 1 and m["load_errors"] == 1 and warm.plan.hit_tokens == 0
    else:  # no lookup, no hit
        assert warm.hit_tokens == 0 and eng.rollbacks == 0
    assert "ValueError: injected" in eng.connector.gateway.last_error
    assert "injected: the client could not parse the reply" in caplog.text and "Traceback" in caplog.text
    assert eng.generate(prompt + [1], GREEDY).output  # the breaker is open: the store is skipped


def test_a_bug_in_the_plugin_around_a_store_call_is_not_swallowed(rig, store, monkeypatch, caplog):
    """Only the store call is guarded: an exception in the plugin's own code is not a store
    error. It is logged with its traceback and counted (``load_exceptions``), and the request
    recomputes: the load hooks never raise (``engine_plugin.contract``)."""
    rng = random.Random(110)
    prompt = rig.tokens(rng, 100)
    _seed(rig, store, prompt)

    def broken(*a, **kw):
        raise ZeroDivisionError("a bug in the plugin")

    monkeypatch.setattr("engine_plugin.tiers.writable_view", broken)  # used after get_many returned
    eng = rig.engine(FaultyStore(store), direct_reads=False)
    with caplog.at_level(logging.ERROR, logger="engine_plugin.kv_connector"):
        rig.same(rig.cold(prompt, GREEDY), eng.generate(prompt, GREEDY))
    assert "ZeroDivisionError: a bug in the plugin" in caplog.text and "Traceback" in caplog.text
    assert eng.connector.metrics.get("store_errors") == 0
    assert eng.connector.metrics.get("load_exceptions") >= 1 and eng.rollbacks >= 1


class BadLookupStore(FaultyStore):
    """``FaultyStore`` whose ``lookup`` answers ``answer(n_keys)`` instead of the truth."""

    def __init__(self, inner, answer):
        super().__init__(inner)
        self.answer = answer

    def lookup(self, keys):
        return self.answer(len(keys))


BAD_LOOKUPS = {
    "more_than_asked": lambda n: LookupResult(n + 5, None),
    "negative": lambda n: LookupResult(-3, None),
    "float": lambda n: LookupResult(2.0, None),
    "bool": lambda n: LookupResult(True, None),
    "swa_past_hit": lambda n: LookupResult(1, 3),
    "swa_negative": lambda n: LookupResult(2, -1),
    "swa_float": lambda n: LookupResult(2, 2.0),
}


@pytest.mark.parametrize("answer", sorted(BAD_LOOKUPS))
def test_out_of_range_lookup_answer_is_a_store_error_and_runs_cold(rig, store, answer):
    """The contract: a store fault is 0 hits, never an exception in the admit step."""
    rng = random.Random(140)
    prompt = rig.tokens(rng, 96)  # whole blocks: "more than asked" would cover the last token
    _seed(rig, store, prompt)
    eng = rig.engine(BadLookupStore(store, BAD_LOOKUPS[answer]))
    warm = eng.generate(prompt, GREEDY)
    rig.same(rig.cold(prompt, GREEDY), warm)
    assert warm.hit_tokens == 0 and eng.connector.metrics.get("store_errors") == 1
    assert "lookup" in eng.connector.gateway.last_error


def test_flush_waits_for_earlier_saves_not_for_an_empty_queue():
    """``SaveQueue.flush`` under steady save traffic from other requests: it returns once the
    jobs submitted before it were attempted (before, it waited for an empty queue, which a
    busy engine never has), and the job it waited for is then in the store."""
    import threading
    import time as _time

    from engine_plugin.saver import SaveQueue
    from engine_plugin.tiers import Metrics
    from kvstore.api import PutItem

    saved: list[bytes] = []

    class SlowGateway:
        def put_many(self, items):
            _time.sleep(0.01)
            saved.extend(it.key for it in items)
            return True

    q = SaveQueue(SlowGateway(), Metrics(), depth=4, enqueue_timeout_s=5.0)
    stop = threading.Event()

    def traffic():
        i = 0
        while not stop.is_set():
            q.submit([PutItem(b"o" + i.to_bytes(15, "big"), b"x")], [f"other{i}"])
            i += 1

    bg = threading.Thread(target=traffic, daemon=True)
    bg.start()
    try:
        _time.sleep(0.05)  # the queue is full of other requests' saves, and stays so
        mine = b"m" * 16
        assert q.submit([PutItem(mine, b"v")], ["mine"])
        t0 = _time.monotonic()
        assert q.flush(timeout=10.0) is True
        assert _time.monotonic() - t0 < 5.0
        assert mine in saved
    finally:
        stop.set()
        bg.join(timeout=10)
        q.close()


_EXIT_SCRIPT = r"""
import sys, time
import kvstore
from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
from engine_plugin.reference import Engine, EngineConfig, ReferenceModel, SamplingParams, model_preset

import engine_plugin.saver
DELAY = {"slow": 0.2, "too_slow": 2.0, "hung": 3600.0}[sys.argv[2]]
engine_plugin.saver.EXIT_FLUSH_S = 3.0

class SlowPuts:  # a store whose puts take a while: saves are still queued when the script ends
    def __init__(self, store):
        self._s = store
    def __getattr__(self, name):
        return getattr(self._s, name)
    def put_many(self, items):
        time.sleep(DELAY)
        return self._s.put_many(items)

store = kvstore.connect(sys.argv[1], fsync=False)
model = ReferenceModel(model_preset("tiny"))
conn = KVStoreConnector(model.kv_layout(), ConnectorConfig(block_size=16), SlowPuts(store))
engine = Engine(model, EngineConfig(block_size=16), connector=conn)
engine.generate(list(range(1, 100)), SamplingParams(max_new_tokens=4))
# Saves still queued at the end (as after a last request's blocks were staged): put straight
# on the connector's save queue, one item per job.
for i in range(5):
    conn.saves.submit([kvstore.PutItem(bytes([i]) * 16, b"late save %d" % i)], [])
print("queued", conn.saves._submitted - conn.saves._completed, flush=True)
# no conn.close(), no store.close(): the script just ends, as the README's snippet did
"""


def test_saves_queued_when_the_process_ends_are_not_lost(tmp_path):
    """A script that ends without closing its connector (the README's snippet did) still
    gets every queued save attempted: before, the saver's store calls were refused once
    concurrent.futures shut down at exit ("cannot schedule new futures after interpreter
    shutdown", a traceback) and those entries were silently missing."""
    import subprocess
    import sys

    import kvstore

    data = tmp_path / "store"
    p = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(data), "slow"], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    queued = int(p.stdout.split("queued", 1)[1].split()[0])
    assert queued >= 4  # the test exercises the exit path: saves were still waiting
    assert "Traceback" not in p.stderr and "cannot schedule" not in p.stderr, p.stderr[-3000:]
    assert "exit: writing" in p.stderr and "dropped" not in p.stderr, p.stderr[-3000:]
    with kvstore.connect(str(data)) as s:
        assert s.get_many([bytes([i]) * 16 for i in range(5)]) == [b"late save %d" % i for i in range(5)]


@pytest.mark.parametrize("mode", ["too_slow", "hung"])
def test_exit_waits_for_queued_saves_only_so_long(tmp_path, mode):
    """Saves that cannot be written in time (a store too slow, or one whose put never
    returns) hold exit up for ``EXIT_FLUSH_S`` (3 s here) at most, then are dropped with one
    line, no traceback. Before, a hung put held exit forever (concurrent.futures joins its
    worker threads at exit) and a slow one ended in "cannot schedule new futures" tracebacks."""
    import subprocess
    import sys

    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, str(tmp_path / "store"), mode], capture_output=True,
                       text=True, timeout=120)
    took = time.monotonic() - t0
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "cannot schedule" not in p.stderr, p.stderr[-3000:]
    assert "exit: writing" in p.stderr and "dropped (not written within 3 s)" in p.stderr, p.stderr[-3000:]
    assert took < 100, took  # bounded (the generate before it takes seconds; a hang would take hours)


def test_a_closed_gateway_answers_shortfalls_and_resolves_every_future():
    """After ``close`` a call is a shortfall, not an exception (it raised RuntimeError, and a
    caller waiting on a job cancelled by close got CancelledError); a job submitted while
    close runs is cancelled, never left unresolved behind the stop markers."""
    import threading as th

    from kvstore.executors import DaemonExecutor

    class Slow:
        def lookup(self, keys):
            time.sleep(0.5)
            return LookupResult(0, None)

    gw = StoreGateway(Slow(), Metrics(), timeout_s=5)
    got: list = []
    threads = [th.Thread(target=lambda: got.append(gw.lookup([b"k" * 16]))) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    gw.close()
    for t in threads:
        t.join(10)
    assert len(got) == 6  # nobody raised
    assert gw.lookup([b"k" * 16]) is None  # the shortfall answer: no store
    ex = DaemonExecutor(2, "t")
    futs = []
    stop = th.Thread(target=ex.shutdown, kwargs={"wait": False})
    for i in range(200):
        futs.append(ex.submit(time.sleep, 0))
        if i == 100:
            stop.start()
    stop.join(10)
    for f in futs:
        f.result(timeout=5) if not f.cancelled() else None  # each one resolved: done or cancelled
