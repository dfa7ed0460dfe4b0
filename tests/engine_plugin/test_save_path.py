"""The save path under load: more blocks in a step than staging buffers, and failed saves.

``KVStoreConnector._save_blocks`` copies a step's blocks out in chunks bounded by the
staging pool; ``SaveQueue`` reports per request whether its KV reached the store.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from tests.engine_plugin.test_devices import outstanding

from engine_plugin.contract import BlockSave, WindowSnapshot
from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
from engine_plugin.reference import Engine, EngineConfig, SamplingParams
from engine_plugin.reference.engine import SendState
from engine_plugin.saver import SaveQueue
from engine_plugin.tiers import Metrics, StoreGateway
from kvstore.api import PutItem
from tests.kvstore.daemons import wait_until
from kvstore.errors import StoreUnavailable

BLOCK = 16  # the block size of the fixtures (conftest.BLOCK)

ONE = SamplingParams(max_new_tokens=1)
GREEDY = SamplingParams(max_new_tokens=4)


def _big_step_engine(rig, store, n_blocks: int, **conn_kw) -> Engine:
    """An engine whose prefill of ``n_blocks`` blocks runs in one step."""
    conn = KVStoreConnector(rig.model.kv_layout(), ConnectorConfig(block_size=BLOCK, **conn_kw), store)
    rig.connectors.append(conn)
    tokens = (n_blocks + 4) * BLOCK
    return Engine(rig.model, EngineConfig(block_size=BLOCK, num_blocks=n_blocks + 8, chunk_size=tokens,
                                          max_batched_tokens=tokens), connector=conn)


def test_a_step_saving_more_blocks_than_staging_buffers_saves_them_all(rig, store):
    """40 blocks in one step through 4 staging buffers: none dropped, the store holds all 40
    (one buffer per block held for the whole step would make 36 wait out the enqueue timeout
    one by one and be dropped, leaving a gap that ends every later hit)."""
    n = 40
    eng = _big_step_engine(rig, store, n, staging_buffers=4, load_batch_blocks=4)
    out = eng.generate(rig.tokens(random.Random(300), n * BLOCK + 5), ONE, request_id="r")
    assert eng.connector.flush(timeout=60)
    m = eng.connector.metrics.snapshot()
    assert m.get("saves_dropped", 0) == 0, m
    assert store.lookup(out.block_hashes[:n]).hit_blocks == n
    assert eng.connector.buffers.allocations <= 4


def test_block_saves_with_every_staging_buffer_held_elsewhere_are_dropped_not_stalled(rig, store):
    """Buffers held by someone else (staged loads) are waited for once per step, not per block."""
    n = 40
    eng = _big_step_engine(rig, store, n, staging_buffers=4, load_batch_blocks=4, save_enqueue_timeout_s=0.05)
    conn = eng.connector
    held = conn.buffers.acquire_many(conn.block_nbytes, 4, timeout=0)
    assert len(held) == 4
    eng.generate(rig.tokens(random.Random(301), n * BLOCK + 5), ONE, request_id="r")
    for b in held:
        conn.buffers.release(b)
    assert conn.flush(timeout=60)
    assert conn.metrics.get("saves_dropped") == n
    eng.collect_finished()  # its blocks never reached the store: not reported as sent
    assert "r" in eng.kv_send_failed and "r" not in eng.kv_sent


class FailingPuts:
    """Delegates to a real store; while ``down``, every put fails."""

    def __init__(self, inner):
        self.inner, self.down = inner, False

    def put_many(self, items):
        if self.down:
            raise StoreUnavailable("injected: puts fail")
        return self.inner.put_many(items)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_request_whose_saves_failed_is_not_reported_as_sent(rig, store):
    """``kv_sent`` (the P/D handoff signal) holds only requests whose KV reached the store; one
    whose saves failed is reported as ended (``get_finished``: the engine frees what it holds)
    and as failed (``get_failed_sends``), never reported sent with nothing stored."""
    rng = random.Random(302)
    st = FailingPuts(store)
    eng = rig.engine(st, store_backoff_s=0)
    eng.generate(rig.tokens(rng, 100), GREEDY, request_id="ok")
    assert eng.connector.flush(timeout=60)
    st.down = True
    bad = eng.generate(rig.tokens(rng, 100), GREEDY, request_id="bad")
    assert eng.connector.flush(timeout=60)
    eng.collect_finished()
    assert eng.kv_sent == {"ok"} and eng.kv_send_failed == {"bad"}
    assert store.lookup(bad.block_hashes).hit_blocks == 0
    m = eng.connector.metrics.snapshot()
    assert m["saves_failed"] > 0 and m["requests_save_incomplete"] == 1
    eng.collect_finished()  # each request is reported once
    assert eng.kv_sent == {"ok"} and eng.kv_send_failed == {"bad"}
    assert eng.connector.metrics.get("requests_save_incomplete") == 1


def test_a_save_queue_full_marks_its_requests_failed_and_an_abort_forgets_them():
    class Stuck:  # the saver's first put waits until released: the queue fills behind it
        def __init__(self):
            self.go = threading.Event()

        def put_many(self, items):
            self.go.wait(60)
            return [True] * len(items)

    st = Stuck()
    gw = StoreGateway(st, Metrics(), put_timeout_s=120)
    q = SaveQueue(gw, Metrics(), depth=1, enqueue_timeout_s=0.01)
    item = PutItem(b"k" * 16, b"v")
    try:
        assert q.submit([item], ["a"])  # taken by the saver, which hangs in put_many
        assert wait_until(lambda: q._q.qsize() == 0, timeout=30.0, step=0.01)
        assert q.submit([item], ["b"])  # queued behind it
        assert not q.submit([item], ["c"])  # queue full: dropped
        assert not q.submit([item], ["x"])
        q.forget("x")  # aborted: never reported, no mark kept
        for rid in "abc":
            q.mark_finished(rid)
        st.go.set()
        assert q.flush(timeout=60)
        done, failed = q.take_sent()
        assert done == {"a", "b", "c"} and failed == {"c"}
        assert not q._failed and not q._inflight
    finally:
        st.go.set()
        q.close()
        gw.close()



def test_a_save_chunk_that_raises_gives_its_buffers_back(rig, store, monkeypatch):
    """An exception in a save chunk (here its third copy out of the pool) fails the step; the
    chunk's staging buffers go back once the copies already started ended, so the pool that
    later steps save and load through keeps its size (they used to leak, chunk by chunk)."""
    eng = rig.engine(store, staging_buffers=4, load_batch_blocks=4)
    c = eng.connector
    copies, synced = [], []

    def copy_async(dst, src, stream):
        copies.append(1)
        if len(copies) % 3 == 0:
            raise RuntimeError("injected: a copy out of the pool failed")

    monkeypatch.setattr(c.backend, "copy_async", copy_async)
    monkeypatch.setattr(c.backend, "synchronize", lambda: synced.append(1))
    saves = [BlockSave("r", i, i, bytes([i]) * 16) for i in range(6)]
    for n in range(1, 4):  # more failures than the pool has buffers to lose
        with pytest.raises(RuntimeError, match="injected"):
            c._save_blocks(saves, eng.pool.kv)
        assert outstanding(c.buffers) == 0 and len(synced) == n  # back once no copy can write into them


def test_a_host_insert_that_raises_does_not_stop_the_others_nor_runs_again(rig):
    """``wait_for_save`` inserts the step's snapshots into the host tier: one whose ``host.put``
    raises (a write-back ``on_evict``) leaves the others inserted, the error is raised once all
    ran, and no insert runs twice (before: the rest were skipped, then all put again next step)."""
    conn = KVStoreConnector(rig.model.kv_layout(), ConnectorConfig(block_size=BLOCK))
    rig.connectors.append(conn)
    keys = [bytes([i]) * 16 for i in range(3)]
    win = torch.zeros(conn.snap_shape, dtype=conn.dtype)
    conn.save_kv_layer("swa", [WindowSnapshot("r", (i + 1) * BLOCK, k, win) for i, k in enumerate(keys)], None)
    real, calls = conn.host.put, []

    def put(kind, key, t):
        calls.append(key)
        if key == keys[1]:
            raise RuntimeError("injected: on_evict failed")
        return real(kind, key, t)

    conn.host.put = put
    with pytest.raises(RuntimeError, match="injected"):
        conn.wait_for_save()
    assert calls == keys
    assert ("swa", keys[0]) in conn.host and ("swa", keys[2]) in conn.host
    conn.wait_for_save()  # the next step: nothing of the last one is inserted again
    assert calls == keys


@pytest.mark.parametrize("with_store, policy", [(False, "write_through"), (True, "write_back")])
def test_a_request_whose_blocks_are_not_sent_is_not_reported_as_sent(rig, store, with_store, policy):
    """Without a store, or under write-back (a block reaches the store only when the host tier
    evicts it), nothing of a request is sent on its behalf: ``kv_sent`` (the P/D handoff signal)
    must not name it, whether it had saves of its own (snapshots) or none. It used to."""
    rng = random.Random(303)
    eng = rig.engine(store if with_store else None, save_policy=policy)
    eng.generate(rig.tokens(rng, 100), GREEDY, request_id="snap")  # an end-of-input snapshot save
    eng.connector.flush(timeout=60)
    eng.generate(rig.tokens(rng, 100), GREEDY, request_id="plain")
    eng.generate(rig.tokens(rng, 5), GREEDY, request_id="short")  # not one block: no save of its own
    assert eng.connector.flush(timeout=60)
    eng.collect_finished()
    assert not eng.kv_sent and eng.kv_send_failed == {"snap", "plain", "short"}
    assert not eng.connector.metrics.get("requests_save_incomplete")  # none failed: none was sent


class _HeldPuts:
    """A store whose ``put_many`` waits until ``go`` is set (bounded); ``entered`` once one waits."""

    def __init__(self, inner=None):
        self.inner, self.go, self.entered = inner, threading.Event(), threading.Event()
        self.fail_first = False

    def put_many(self, items):
        self.entered.set()
        self.go.wait(60)
        if self.fail_first:
            self.fail_first = False
            raise StoreUnavailable("injected: this put failed")
        return self.inner.put_many(items) if self.inner is not None else [True] * len(items)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_an_aborted_requests_saves_are_counted_apart_from_a_new_request_under_its_id():
    """``forget`` ends an id's incarnation: a request re-added under that id (a retry alone, a
    reused client id) is reported once *its own* saves ended, whatever the aborted one's do, and
    an aborted save that fails marks it nothing. Before, the counts were shared: the new request
    was never reported (its engine record stayed PENDING, held in ``_sending`` for ever)."""
    st = _HeldPuts()
    gw = StoreGateway(st, Metrics(), put_timeout_s=120, backoff_s=0.0)  # no breaker: one failure alone
    q = SaveQueue(gw, Metrics(), depth=8, enqueue_timeout_s=5.0)
    item = PutItem(b"k" * 16, b"v")
    try:
        st.fail_first = True  # the aborted requests' save fails
        assert q.submit([item], ["r", "s"])
        assert st.entered.wait(30)  # held in put_many
        q.forget("r")
        q.forget("s")
        assert q.submit([item], ["r"])  # the new "r" saves; the new "s" has no save of its own
        q.mark_finished("r")
        q.mark_finished("s")
        assert q.take_sent() == ({"s"}, set())  # not held up by the aborted one's save
        st.go.set()
        assert q.flush(timeout=60)
        assert q.take_sent() == ({"r"}, set())  # its own save reached the store
        assert q.take_sent() == (set(), set())  # reported once
        assert not q._inflight and not q._tag and not q._ended and not q._failed
    finally:
        st.go.set()
        q.close()
        gw.close()


def test_a_request_aborted_mid_save_then_re_added_under_its_id_leaves_pending(rig, store):
    """The engine side of the test above (the reported repro): abort a request while its block saves are
    in flight, re-add it under the same id (``EngineRunner`` retries a request alone so) and run
    it to the end: once the saves ended, its ``send_state`` is set and the engine keeps nothing
    of it (before: PENDING for ever, its record and logits held in ``Engine._sending``)."""
    st = _HeldPuts(store)
    eng = rig.engine(st)
    prompt = rig.tokens(random.Random(3), 64)
    eng.add_request("r", prompt, SamplingParams(max_new_tokens=50))
    for _ in range(8):  # prefill chunks, until a block save waits in put_many
        if st.entered.is_set():
            break
        eng.step()
    assert st.entered.wait(30), "no save in flight"
    assert eng.abort_request("r")
    eng.add_request("r", prompt, SamplingParams(max_new_tokens=2))
    for _ in range(1000):
        if "r" in eng.finished:
            break
        eng.step()
    req = eng.take_finished("r")
    assert req is not None
    st.go.set()
    assert eng.connector.flush(timeout=60)
    eng.collect_finished()
    assert req.send_state is SendState.SENT
    assert not eng._sending and not eng.connector.saves._ended


class _HeldOutcomes:
    """A store whose ``put_many`` waits until ``go`` is set (bounded), then takes the next of
    ``outcomes`` (True: every item stored; False: the put raises), True once they run out."""

    def __init__(self, *outcomes: bool):
        self.outcomes, self.go, self.entered = list(outcomes), threading.Event(), threading.Event()

    def put_many(self, items):
        self.entered.set()
        self.go.wait(60)
        if self.outcomes and not self.outcomes.pop(0):
            raise StoreUnavailable("injected: this put failed")
        return [True] * len(items)


def test_a_finished_request_re_added_under_its_id_is_reported_apart_from_its_saves_in_flight():
    """A request finishes with a save in flight, and a new one is added under its id without an
    abort between (a reused client id): each incarnation is reported once its *own* saves ended,
    with its *own* outcome, oldest first. Before, the new one's saves joined the old one's count:
    the old one was reported failed for the new one's failed save, and the new one then sent."""
    st = _HeldOutcomes(True, False)  # the old request's save reaches the store; the new one's fails
    gw = StoreGateway(st, Metrics(), put_timeout_s=120, backoff_s=0.0)
    q = SaveQueue(gw, Metrics(), depth=8, enqueue_timeout_s=5.0)
    item = PutItem(b"k" * 16, b"v")
    try:
        assert q.submit([item], ["r"])
        assert st.entered.wait(30)  # held in put_many
        q.mark_finished("r")
        assert q.take_sent() == (set(), set())
        assert q.submit([item], ["r"])  # the new "r" (no abort between) saves too
        st.go.set()
        assert q.flush(timeout=60)
        assert q.take_sent() == ({"r"}, set())  # the old one: its own save reached the store
        assert q.take_sent() == (set(), set())  # the new one still runs: nothing to report
        q.mark_finished("r")
        assert q.take_sent() == ({"r"}, {"r"})  # the new one: its own save failed
        assert q.take_sent() == (set(), set())
        assert not q._inflight and not q._tag and not q._ended and not q._ending and not q._failed
    finally:
        st.go.set()
        q.close()
        gw.close()


def test_two_finished_incarnations_of_an_id_are_reported_in_the_order_they_finished():
    """The new request under the id finishes while the old one's save is still in flight (it has
    no save of its own, or a dropped one): it waits behind the old one, so the engine, which pairs
    each report of an id with its oldest record, gives each record its own outcome, one per call."""
    st = _HeldOutcomes(True)
    gw = StoreGateway(st, Metrics(), put_timeout_s=120, backoff_s=0.0)
    q = SaveQueue(gw, Metrics(), depth=8, enqueue_timeout_s=5.0)
    try:
        assert q.submit([PutItem(b"k" * 16, b"v")], ["r"])
        assert st.entered.wait(30)
        q.mark_finished("r")
        q.mark_failed(["r"])  # the new "r": a save dropped before submit
        q.mark_finished("r")
        assert q.take_sent() == (set(), set())  # the new one waits behind the old one's save
        st.go.set()
        assert q.flush(timeout=60)
        assert q.take_sent() == ({"r"}, set())  # the old one, not marked by the new one's drop
        assert q.take_sent() == ({"r"}, {"r"})  # then the new one
        assert q.take_sent() == (set(), set()) and not q._ended
    finally:
        st.go.set()
        q.close()
        gw.close()


def test_a_request_re_added_under_its_id_while_its_saves_run_does_not_take_over_its_signal(rig, store):
    """The engine side (no abort between): the first request finishes, is taken while its saves
    are held, and a new request under its id runs to the end. Each record gets its own
    ``send_state`` once its own saves ended, and the engine then holds nothing of either. Before,
    the new record took over ``Engine._sending`` and the connector's count: the first stayed
    PENDING for ever."""
    st = _HeldPuts(store)
    eng = rig.engine(st)
    rng = random.Random(12)
    eng.add_request("r", rig.tokens(rng, 40), SamplingParams(max_new_tokens=2))
    while "r" not in eng.finished:
        eng.step()
    first = eng.take_finished("r")
    assert st.entered.wait(30), "no save in flight"
    eng.add_request("r", rig.tokens(rng, 40), SamplingParams(max_new_tokens=2))
    while "r" not in eng.finished:
        eng.step()
    second = eng.take_finished("r")
    eng.collect_finished()
    assert first.send_state is SendState.PENDING and second.send_state is SendState.PENDING
    st.go.set()
    assert eng.connector.flush(timeout=60)
    eng.collect_finished()
    assert first.send_state is SendState.SENT and second.send_state is SendState.PENDING
    assert eng.has_pending_sends()
    eng.collect_finished()
    assert second.send_state is SendState.SENT
    assert not eng._sending and not eng.has_pending_sends() and not eng.connector.saves._ended
    assert store.lookup(second.block_hashes[:2]).hit_blocks == 2
