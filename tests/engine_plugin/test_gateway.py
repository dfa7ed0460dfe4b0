"""``StoreGateway`` and the loader against stores that answer garbage or hang.

A malformed answer is a failed store call (the engine recomputes), never an exception
out of a hook; an exception the loader lets escape anyway becomes a ``LoadError``.
"""

from __future__ import annotations

import logging
import random
import threading

import numpy as np
import pytest

from engine_plugin.connector_config import MIN_STORE_CALLS
from engine_plugin.loader import Loader
from engine_plugin.reference import SamplingParams
from engine_plugin.tiers import Metrics, StoreGateway
from kvstore.api import EntryInfo, EntryKind, LookupResult, PutItem
from tests.kvstore.daemons import wait_until

GREEDY = SamplingParams(max_new_tokens=4)
KEYS = [b"a" * 16, b"b" * 16]


class Garbling:
    """Delegates to a real store; while ``on``, every slot of a batched read is ``slot``.
    Only the plain protocol unless ``native`` (then ``get_many_into`` too)."""

    def __init__(self, inner, slot, native: bool):
        self.inner, self.slot, self.native, self.on = inner, slot, native, False

    def get_many(self, keys, *, kind="block"):
        out = self.inner.get_many(keys, kind=kind)
        return [self.slot] * len(out) if self.on else out

    def __getattr__(self, name):
        if name == "get_many_into" and not self.native:
            raise AttributeError(name)
        if name == "get_many_into":
            def into(keys, outs, *, kind="block"):
                infos = self.inner.get_many_into(keys, outs, kind=kind)
                return [self.slot] * len(infos) if self.on else infos
            return into
        return getattr(self.inner, name)


MALFORMED = {  # (slot, native)
    "plain-int": (12345, False),
    "plain-str": ("not bytes", False),
    "native-tuple": (("not", "an", "EntryInfo"), True),
    "native-bad-nbytes": (EntryInfo(b"k" * 16, EntryKind.BLOCK, "64"), True),
    "native-bad-layout": (EntryInfo(b"k" * 16, EntryKind.BLOCK, 64, layout="f32"), True),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_read_slot_is_a_failed_call_not_an_exception(case):
    slot, native = MALFORMED[case]

    class Store:
        def get_many(self, keys, *, kind="block"):
            return [slot] * len(keys)

    if native:
        Store.get_many_into = lambda self, keys, outs, *, kind="block": [slot] * len(keys)
    m = Metrics()
    gw = StoreGateway(Store(), m, timeout_s=5)
    outs = [np.zeros(64, dtype=np.uint8) for _ in KEYS]
    assert gw.read_into(KEYS, outs, kind="block", nbytes=64).ok == [False, False]
    if not native:
        assert gw.get_many(KEYS, kind="block", nbytes=64) == [None, None]  # breaker open: skipped
    assert m.get("store_errors") == 1 and not gw.available
    gw.close()


@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "staged"])
def test_an_engine_over_a_store_answering_malformed_slots_recomputes(rig, store, case, direct):
    """The hit was planned, the read came back garbled: recompute, same answer; the next
    request runs (the failed job used to stay and make every later step raise)."""
    slot, native = MALFORMED[case]
    rng = random.Random(400)
    prompt = rig.tokens(rng, 100)
    seed = rig.engine(store)
    seed.generate(prompt, GREEDY)
    seed.connector.flush()
    bad = Garbling(store, slot, native)
    eng = rig.engine(bad, store_backoff_s=60, direct_reads=direct)
    bad.on = True
    warm = eng.generate(prompt, GREEDY)
    rig.same(rig.cold(prompt, GREEDY), warm)
    m = eng.connector.metrics.snapshot()
    assert m["store_errors"] >= 1 and m["load_errors"] == 1 and eng.rollbacks == 1
    other = rig.tokens(rng, 40)
    rig.same(rig.cold(other, GREEDY), eng.generate(other, GREEDY))


@pytest.mark.parametrize("which", ["load_blocks", "load_snapshot"])
def test_an_exception_escaping_the_loader_is_a_load_error(rig, store, monkeypatch, caplog, which):
    """Whatever the loader thread raises, ``wait_for_layer_load`` and ``get_load_errors`` do
    not: the request recomputes (logged with the traceback), later steps run."""
    rng = random.Random(401)
    prompt = rig.tokens(rng, 100)
    seed = rig.engine(store)
    seed.generate(prompt, GREEDY)
    seed.connector.flush()

    def broken(*a, **kw):
        raise RuntimeError("injected: a loader bug")

    monkeypatch.setattr(Loader, which, broken)
    eng = rig.engine(store)
    with caplog.at_level(logging.ERROR, logger="engine_plugin.kv_connector"):
        warm = eng.generate(prompt, GREEDY)
    rig.same(rig.cold(prompt, GREEDY), warm)
    m = eng.connector.metrics.snapshot()
    assert m["load_exceptions"] == 1 and m["load_errors"] == 1 and eng.rollbacks == 1
    assert "injected: a loader bug" in caplog.text and "Traceback" in caplog.text
    other = rig.tokens(rng, 40)
    rig.same(rig.cold(other, GREEDY), eng.generate(other, GREEDY))


class Sticky:
    """The first ``hang`` calls of each kind never return until ``release`` is set; later calls
    answer at once. ``calls`` counts the calls that reached the store."""

    def __init__(self, hang: int):
        self.hang, self.calls = hang, 0
        self.lock, self.release = threading.Lock(), threading.Event()

    def _gate(self) -> None:
        with self.lock:
            self.calls += 1
            stuck = self.calls <= self.hang
        if stuck:
            self.release.wait(60)

    def lookup(self, keys):
        self._gate()
        return LookupResult(len(keys), None)

    def get_many(self, keys, *, kind="block"):
        self._gate()
        return [None] * len(keys)

    def put_many(self, items):
        self._gate()
        return [True] * len(items)



def test_calls_hung_past_their_timeout_do_not_wedge_the_gateway():
    """6 calls hang for good (a dead connection each); the store answers new ones. Each later
    call reaches the store and answers (queued behind the 4 shared workers the hung calls hold,
    it would time out and trip the breaker, and the store would never be reached again)."""
    clock = [0.0]
    st, m = Sticky(hang=6), Metrics()
    gw = StoreGateway(st, m, timeout_s=0.5, backoff_s=1.0, clock=lambda: clock[0])
    try:
        for _ in range(6):
            clock[0] += 2.0  # past the backoff: the breaker lets the next call through
            assert gw.lookup(KEYS) is None
        assert m.get("store_timeouts") == 6 and gw.running_calls == 6
        for _ in range(5):
            clock[0] += 2.0
            assert gw.lookup(KEYS) == LookupResult(2, None)
            assert gw.put_many([]) is True  # puts do not queue behind the hung lookups either
        assert st.calls == 16 and m.get("store_busy") == 0
    finally:
        st.release.set()
        gw.close()


def test_with_max_calls_hung_a_call_fails_at_once_and_recovers_when_they_end():
    clock = [0.0]
    st, m = Sticky(hang=3), Metrics()
    gw = StoreGateway(st, m, timeout_s=0.5, backoff_s=1.0, clock=lambda: clock[0], max_calls=3)
    try:
        for _ in range(3):
            clock[0] += 2.0
            assert gw.lookup(KEYS) is None
        clock[0] += 2.0
        outs = [np.zeros(64, dtype=np.uint8) for _ in KEYS]
        res = gw.read_into(KEYS, outs, kind="block", nbytes=64)  # plain store: get_many path
        assert res.ok == [False, False] and res.pending is None  # staging buffers free at once
        assert st.calls == 3 and m.get("store_busy") == 1 and not gw.available  # never sent
        clock[0] += 2.0
        assert gw.lookup(KEYS) is None and st.calls == 3 and m.get("store_busy") == 2
        st.release.set()
        assert wait_until(lambda: gw.running_calls == 0, timeout=30.0, step=0.01)
        clock[0] += 2.0
        assert gw.lookup(KEYS) == LookupResult(2, None) and st.calls == 4
    finally:
        st.release.set()
        gw.close()


def test_at_the_fewest_max_calls_one_abandoned_call_per_path_leaves_room_for_each():
    """``ConnectorConfig``'s floor on ``store_max_calls``: with a lookup, a load and a put each
    abandoned (timed out, still running), the three paths still reach the store, none refused as
    ``store_busy`` (at the old floor, 3, the first of them failed and tripped the breaker)."""
    clock = [0.0]
    st, m = Sticky(hang=3), Metrics()
    gw = StoreGateway(st, m, timeout_s=0.5, put_timeout_s=0.5, backoff_s=1.0, clock=lambda: clock[0],
                      max_calls=MIN_STORE_CALLS)
    outs = [np.zeros(64, dtype=np.uint8) for _ in KEYS]
    try:
        clock[0] += 2.0
        assert gw.lookup(KEYS) is None  # abandoned after timeout_s, still running
        clock[0] += 2.0
        assert gw.read_into(KEYS, outs, kind="block", nbytes=64).ok == [False, False]
        clock[0] += 2.0
        assert not gw.put_many([PutItem(KEYS[0], b"v")])
        assert gw.running_calls == 3
        clock[0] += 2.0  # past the breaker the timeouts opened
        assert gw.lookup(KEYS) == LookupResult(2, None)
        gw.read_into(KEYS, outs, kind="block", nbytes=64)
        assert gw.put_many([PutItem(KEYS[0], b"v")])
        assert st.calls == 6 and not m.get("store_busy") and gw.available
    finally:
        st.release.set()
        gw.close()


def test_a_save_the_store_refuses_for_room_does_not_cut_off_its_reads(tmp_path):
    """A put_many the store refused with CapacityExceeded (its entries do not fit beside
    the pinned ones) tripped the breaker like an outage, so for backoff_s the engine skipped
    every lookup and load, the pinned entries' too. Now it is a failed save, counted
    ``store_refused``, and the store stays in use; an outage still trips the breaker."""
    import kvstore
    from kvstore.errors import StoreUnavailable

    one = b"p" * 10_000
    with kvstore.connect(str(tmp_path / "probe"), fsync=False, compression="none") as s:
        s.put(KEYS[0], one)
        size = s.used_bytes()
    store = kvstore.connect(str(tmp_path / "d"), fsync=False, compression="none", capacity_bytes=int(size * 1.5))
    store.put(KEYS[0], one)
    assert store.pin(KEYS[0])
    m = Metrics()
    gw = StoreGateway(store, m, timeout_s=5, backoff_s=60)
    assert not gw.put_many([PutItem(b"c" * 16, one)])  # does not fit beside the pinned entry: refused
    assert m.get("store_refused") == 1 and m.get("store_errors") == 0 and gw.available
    assert gw.lookup(KEYS[:1]) == LookupResult(1, None)  # reads go on
    assert "CapacityExceeded" in gw.last_error

    def down(items):
        raise StoreUnavailable("the daemon is down")

    store.put_many = down
    assert not gw.put_many([PutItem(b"d" * 16, one)])
    assert m.get("store_errors") == 1 and not gw.available  # an outage still opens the breaker
    gw.close()
    store.close()
