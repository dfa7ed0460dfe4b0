"""The event discipline of the transfer path, checked without a GPU.

``LazyBackend`` defers every ``copy_async`` until someone waits on its event
(or a later event of the same stream), which is the worst case an
asynchronous device allows: data that is read before its event was waited
on is stale. If the connector or the engine ever skipped a wait, these
loads would compute with zeros and the answers would differ from cold.
"""

from __future__ import annotations

import random

import pytest

from engine_plugin import devices
from engine_plugin.contract import Tier
from engine_plugin.devices import DeviceBackend
from engine_plugin.reference import SamplingParams

GREEDY = SamplingParams(max_new_tokens=5)


class _Stream:
    def __init__(self):
        self.pending: list = []  # (seq, closure)


class LazyBackend(DeviceBackend):
    name = "lazy"
    host_resident = False  # its copies are asynchronous: the staged path, with its events
    seq = 0

    def new_stream(self):
        return _Stream()

    def copy_async(self, dst, src, stream):
        if stream is None:
            dst.copy_(src)
            return None
        src = src.clone()  # the source may be a staging buffer reused only after the event
        LazyBackend.seq += 1
        stream.pending.append((LazyBackend.seq, lambda: dst.copy_(src)))
        return (stream, LazyBackend.seq)

    def _run(self, event):
        if event is None:
            return
        stream, upto = event
        while stream.pending and stream.pending[0][0] <= upto:  # stream order: earlier copies first
            stream.pending.pop(0)[1]()

    def wait_event(self, event):
        self._run(event)

    def sync_event(self, event):
        self._run(event)


@pytest.fixture
def lazy(monkeypatch):
    monkeypatch.setitem(devices.BACKENDS, "lazy", LazyBackend)
    return "lazy"


@pytest.mark.parametrize("load_snapshots", [False, True])
def test_deferred_copies_still_give_the_cold_answer(rig, store, lazy, load_snapshots):
    rng = random.Random(300)
    prefix = rig.tokens(rng, 130)
    a = rig.engine(store, device=lazy)
    a.generate(prefix, GREEDY)
    a.connector.flush()
    prompt = prefix + rig.tokens(rng, 17)
    b = rig.engine(store, device=lazy, load_snapshots=load_snapshots, load_batch_blocks=2, staging_buffers=2)
    warm = b.generate(prompt, GREEDY)
    assert warm.hit_tokens == 128
    assert (warm.plan.snapshot_tier is Tier.STORE) == load_snapshots
    rig.same(rig.cold(prompt, GREEDY), warm)


def test_deferred_copies_through_host_tier_and_evictions(rig, store, lazy):
    rng = random.Random(301)
    prompts = [rig.tokens(rng, 90) for _ in range(3)]
    eng = rig.engine(store, device=lazy, num_blocks=16)
    for _ in range(2):
        for p in prompts:
            q = p + [9, 9]
            rig.same(rig.cold(q, GREEDY), eng.generate(q, GREEDY))
    m = eng.connector.metrics.snapshot()
    assert m["device_evictions_to_host"] > 0 and m.get("hit_tokens_host", 0) > 0
