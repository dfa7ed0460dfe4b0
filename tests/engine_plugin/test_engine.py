"""The reference engine without a store: chunking, batching, sampling, device prefix cache."""

from __future__ import annotations

import random
import threading

import pytest

from engine_plugin.reference import SamplingParams
from engine_plugin.reference.engine import SendState
from kvstore.errors import InvalidRequest


@pytest.mark.parametrize("chunk", [1, 7, 16, 50])
def test_chunk_size_does_not_change_the_answer(rig, chunk):
    prompt = rig.tokens(random.Random(1), 70)
    sp = SamplingParams(max_new_tokens=6)
    rig.same(rig.cold(prompt, sp), rig.engine(connector=False, chunk=chunk).generate(prompt, sp))


def test_batched_requests_equal_single_runs(rig):
    rng = random.Random(2)
    eng = rig.engine(connector=False, chunk=24)
    prompts = [rig.tokens(rng, n) for n in (5, 40, 77, 33)]
    sps = [SamplingParams(max_new_tokens=5 + i, temperature=0.8 * (i % 2), seed=i) for i in range(4)]
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        eng.add_request(f"r{i}", p, sp)
    done = eng.run_until_done()
    assert eng.steps < sum(len(p) // 24 + 1 + sp.max_new_tokens for p, sp in zip(prompts, sps))  # ran together
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        rig.same(rig.cold(p, sp), done[f"r{i}"])


def test_seeded_sampling_is_reproducible(rig):
    prompt = rig.tokens(random.Random(3), 30)
    a = rig.engine(connector=False).generate(prompt, SamplingParams(max_new_tokens=12, temperature=1.0, seed=7))
    b = rig.engine(connector=False).generate(prompt, SamplingParams(max_new_tokens=12, temperature=1.0, seed=7))
    c = rig.engine(connector=False).generate(prompt, SamplingParams(max_new_tokens=12, temperature=1.0, seed=8))
    assert a.output == b.output and a.output != c.output


def test_device_prefix_hit_replays_and_matches_cold(rig):
    rng = random.Random(4)
    prefix = rig.tokens(rng, 90)
    eng = rig.engine(connector=False)
    eng.generate(prefix, SamplingParams(max_new_tokens=2))
    prompt = prefix + rig.tokens(rng, 11)
    warm = eng.generate(prompt, SamplingParams(max_new_tokens=8))
    assert warm.hit_tokens == 80 and warm.replayed_tokens == rig.model.replay_span()
    rig.same(rig.cold(prompt, SamplingParams(max_new_tokens=8)), warm)


def test_small_pool_evicts_and_stays_correct(rig):
    rng = random.Random(5)
    eng = rig.engine(connector=False, num_blocks=12)
    prompts = [rig.tokens(rng, 100) for _ in range(4)]
    for p in prompts + prompts[:2]:
        rig.same(rig.cold(p, SamplingParams(max_new_tokens=4)), eng.generate(p, SamplingParams(max_new_tokens=4)))
    assert eng.pool.evictions > 0


def test_misuse_raises(rig):
    eng = rig.engine(connector=False, num_blocks=4)
    with pytest.raises(InvalidRequest):
        eng.add_request("a", [], SamplingParams())
    with pytest.raises(InvalidRequest):
        eng.add_request("b", [1, 999], SamplingParams())
    with pytest.raises(InvalidRequest, match="needs 8 blocks"):  # can never fit in 4 blocks
        eng.add_request("c", list(range(100)), SamplingParams())
    assert not eng.has_work()  # refused before it was queued


def test_finished_requests_are_pruned_once_taken_and_reach_the_connector_once(rig):
    """A long-running owner takes each finished request (``take_finished``), so the engine holds
    O(1) finished records; ``connector.get_finished`` is handed only the requests finished since
    its last call (before: every request ever finished, on every step, and never pruned)."""
    eng = rig.engine()
    handed: list[set[str]] = []
    real = eng.connector.get_finished

    def get_finished(ids):
        handed.append(set(ids))
        return real(ids)

    eng.connector.get_finished = get_finished
    rng = random.Random(9)
    for i in range(12):
        eng.add_request(f"r{i}", rig.tokens(rng, 20), SamplingParams(max_new_tokens=2))
        while f"r{i}" not in eng.finished:
            eng.step()
        assert eng.take_finished(f"r{i}").request_id == f"r{i}"
        assert not eng.finished and eng.take_finished(f"r{i}") is None
    seen = [rid for ids in handed for rid in ids]
    assert sorted(seen) == sorted(f"r{i}" for i in range(12))  # each handed over once
    assert max(len(ids) for ids in handed) == 1


class HeldPuts:
    """Delegates to a real store; while ``hold`` is clear, every put waits for it."""

    def __init__(self, inner):
        self.inner, self.hold = inner, threading.Event()

    def put_many(self, items):
        self.hold.wait(60)
        return self.inner.put_many(items)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_handoff_signal_is_held_only_while_the_request_or_its_saves_are(rig, store):
    """A worker takes each request as soon as it finished, often before its saves ended: the
    engine keeps its P/D handoff signal only until the connector reports them, then sets it
    on the record taken (``send_state``) and holds nothing more of it. Before, ``kv_sent``
    and ``kv_send_failed`` gained one id per request for the worker's life."""
    st = HeldPuts(store)
    eng = rig.engine(st)
    rng = random.Random(10)
    for i in range(6):
        st.hold.clear()
        eng.add_request(f"r{i}", rig.tokens(rng, 40), SamplingParams(max_new_tokens=2))
        while f"r{i}" not in eng.finished:
            eng.step()
        req = eng.take_finished(f"r{i}")  # its block saves are still held in put_many
        eng.collect_finished()
        assert req.send_state is SendState.PENDING
        st.hold.set()
        assert eng.connector.flush(timeout=60)
        eng.collect_finished()
        assert req.send_state is SendState.SENT
        assert not eng.kv_sent and not eng.kv_send_failed and not eng._sending
    assert store.lookup(req.block_hashes[:2]).hit_blocks == 2


def test_kv_sent_names_the_finished_requests_still_held(rig, store):
    """``kv_sent`` is a view over ``finished``: a request taken leaves it."""
    eng = rig.engine(store)
    out = eng.generate(rig.tokens(random.Random(11), 40), SamplingParams(max_new_tokens=2), request_id="x")
    assert eng.connector.flush(timeout=60)
    eng.collect_finished()
    assert eng.kv_sent == {"x"} and out.send_state is SendState.SENT
    eng.take_finished("x")
    assert not eng.kv_sent
