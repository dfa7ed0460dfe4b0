"""Loading from every tier gives the cold answer (greedy tokens identical, fp32 logits close).

Each test drives real engines through ``KVStoreConnector`` against a real
embedded store on tmp_path. Families of prompts share prefixes the way agent
turns do: turn k+1 = turn k's prompt + its output + a new message.
"""

from __future__ import annotations

import random

import pytest

from engine_plugin.contract import Tier
from engine_plugin.reference import SamplingParams

GREEDY = SamplingParams(max_new_tokens=6)


def _turns(rig, rng, n_turns=3, first=70, msg=(5, 40)):
    """Prompts of an agent conversation, each extending the last with the cold output."""
    prompts = [rig.tokens(rng, first)]
    for _ in range(n_turns - 1):
        prev = prompts[-1]
        prompts.append(prev + rig.cold(prev, GREEDY).output + rig.tokens(rng, rng.randint(*msg)))
    return prompts


@pytest.mark.parametrize("load_snapshots", [False, True], ids=["replay", "snapshot"])
def test_store_hits_equal_cold_over_random_families(rig, store, load_snapshots):
    """Each turn runs on a fresh engine (empty device and host tiers): every hit comes from the store."""
    rng = random.Random(10 + load_snapshots)
    replays = snaps = 0
    for fam in range(4):
        for k, prompt in enumerate(_turns(rig, rng, n_turns=3, first=rng.randint(40, 120))):
            eng = rig.engine(store, load_snapshots=load_snapshots)
            warm = eng.generate(prompt, GREEDY)
            eng.connector.flush()
            rig.same(rig.cold(prompt, GREEDY), warm)
            if k:
                assert warm.hit_tokens > 0, (fam, k)
                assert warm.plan.snapshot_tier in (None, Tier.STORE)
                replays += warm.plan.needs_replay
                snaps += warm.plan.snapshot_tier is Tier.STORE
                if warm.plan.needs_replay:
                    assert warm.replayed_tokens == min(warm.hit_tokens, rig.model.replay_span())
    assert (snaps > 0) == load_snapshots and replays > 0 if not load_snapshots else snaps > 0


def test_same_prefix_different_tails_in_one_batch(rig, store):
    rng = random.Random(20)
    base = rig.tokens(rng, 96)
    seed_eng = rig.engine(store)
    seed_eng.generate(base + [1], GREEDY)
    seed_eng.connector.flush()
    eng = rig.engine(store, load_snapshots=False, chunk=20)
    prompts = {f"r{i}": base + rig.tokens(rng, rng.randint(1, 30)) for i in range(4)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(max_new_tokens=5, temperature=0.7, seed=3))
    done = eng.run_until_done()
    for rid, p in prompts.items():
        rig.same(rig.cold(p, SamplingParams(max_new_tokens=5, temperature=0.7, seed=3)), done[rid])
        assert done[rid].hit_tokens > 0


def test_host_tier_hit(rig):
    """No store: device evictions land in the host tier, and a hit loads from there."""
    rng = random.Random(30)
    prefix = rig.tokens(rng, 100)
    eng = rig.engine(None, host_capacity_bytes=1 << 20)
    eng.generate(prefix, GREEDY)
    assert eng.pool.drop_cached() > 0
    prompt = prefix + rig.tokens(rng, 9)
    warm = eng.generate(prompt, GREEDY)
    m = eng.connector.metrics.snapshot()
    assert m["hit_tokens_host"] == warm.hit_tokens > 0 and m["device_evictions_to_host"] > 0
    assert warm.plan.snapshot_tier is Tier.HOST  # end-of-input snapshot of the first request
    rig.same(rig.cold(prompt, GREEDY), warm)


def test_device_tier_hit_with_host_snapshot(rig, store):
    rng = random.Random(40)
    prefix = rig.tokens(rng, 64)  # end-of-input snapshot at 64 == the next hit boundary
    eng = rig.engine(store)
    eng.generate(prefix, GREEDY)
    prompt = prefix + rig.tokens(rng, 20)
    warm = eng.generate(prompt, GREEDY)
    assert warm.hit_tokens == 64 and eng.connector.metrics.get("hit_tokens_device") == 64
    assert warm.plan.snapshot_tier is Tier.HOST and warm.replayed_tokens == 0
    rig.same(rig.cold(prompt, GREEDY), warm)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_eviction_and_reload_cycles(rig, store, policy):
    """A small device pool and host tier force evictions at both levels; every answer stays cold-equal."""
    rng = random.Random(50)
    fams = [_turns(rig, rng, n_turns=2, first=rng.randint(50, 90)) for _ in range(3)]
    eng = rig.engine(store, num_blocks=14, host_capacity_bytes=6 * 16 * 32 * 4, save_policy=policy)
    for _ in range(2):
        for fam in fams:
            for p in fam:
                rig.same(rig.cold(p, GREEDY), eng.generate(p, GREEDY))
    eng.pool.drop_cached()  # device -> host
    eng.connector.persist_host_tier()  # host -> store (write-back keeps DRAM-only entries until now)
    eng.connector.flush()
    m = eng.connector.metrics.snapshot()
    assert eng.pool.evictions > 0 and m["host_evictions_block"] > 0
    assert m.get("hit_tokens_host", 0) + m.get("hit_tokens_store", 0) > 0
    # a fresh engine reads back what the policy put in the store
    fresh = rig.engine(store)
    p = fams[0][1]
    warm = fresh.generate(p, GREEDY)
    rig.same(rig.cold(p, GREEDY), warm)
    assert warm.hit_tokens > 0


def test_interval_snapshots_let_a_hit_stop_early(rig, store):
    """With a snapshot two blocks before the boundary, prefilling 32 tokens beats replaying 28+."""
    rng = random.Random(60)
    long = rig.tokens(rng, 160)
    a = rig.engine(store, snapshot_interval_blocks=2, snapshot_end_of_input=False,
                   snapshot_end_of_output=False)
    a.generate(long, GREEDY)
    a.connector.flush()
    prompt = long[:115] + rig.tokens(rng, 10)  # 7 full blocks shared; snapshots at 32, 64, 96
    b = rig.engine(store, replay_policy="exact")
    warm = b.generate(prompt, GREEDY)
    assert warm.plan.snapshot_tier is Tier.STORE and warm.hit_tokens == 96 and warm.replayed_tokens == 0
    rig.same(rig.cold(prompt, GREEDY), warm)


def test_short_hit_is_not_adopted_unless_asked(rig, store):
    rng = random.Random(70)
    prefix = rig.tokens(rng, 20)  # one block (16 tokens) <= span (28): V4.1 does not adopt it
    seed = rig.engine(store, snapshot_end_of_input=False, snapshot_end_of_output=False)
    seed.generate(prefix, GREEDY)
    seed.connector.flush()
    prompt = prefix + rig.tokens(rng, 5)
    e1 = rig.engine(store, snapshot_end_of_input=False, snapshot_end_of_output=False)
    r1 = e1.generate(prompt, GREEDY)
    assert r1.hit_tokens == 0 and e1.connector.metrics.get("hits_not_adopted") == 1
    e2 = rig.engine(store, adopt_short_hits=True)
    r2 = e2.generate(prompt, GREEDY)
    assert r2.hit_tokens == 16 and r2.replayed_tokens == 16  # replay from 0: exact by construction
    for r in (r1, r2):
        rig.same(rig.cold(prompt, GREEDY), r)


def test_prefill_decode_handoff_through_the_store(rig, store):
    """Prefill on engine A, decode on engine B == one engine doing both."""
    rng = random.Random(80)
    prompt = rig.tokens(rng, 123)
    sp = SamplingParams(max_new_tokens=10, temperature=0.9, seed=11)
    pe = rig.engine(store)
    first = pe.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0.9, seed=11))
    pe.connector.flush()
    assert first.transfer_params_out["kvstack"]["computed_tokens"] == 123
    de = rig.engine(store)
    de.add_request("d", prompt, sp, kv_transfer_params=first.transfer_params_out)
    out = de.run_until_done()["d"]
    assert out.hit_tokens == 112 and out.plan.snapshot_tier is Tier.STORE
    assert out.output[0] == first.output[0]
    rig.same(rig.cold(prompt, sp), out)


def test_get_finished_reports_saved_requests(rig, store):
    eng = rig.engine(store)
    eng.generate(rig.tokens(random.Random(90), 40), GREEDY, request_id="x")
    eng.connector.flush()
    eng.collect_finished()
    assert "x" in eng.kv_sent


def test_staging_buffers_are_reused_across_batches(rig, store):
    rng = random.Random(95)
    prompt = rig.tokens(rng, 300)
    a = rig.engine(store)
    a.generate(prompt, GREEDY)
    a.connector.flush()
    b = rig.engine(store, load_batch_blocks=4, staging_buffers=4, promote_to_host=False,
                   direct_reads=False)  # the staged path (as on an accelerator)
    warm = b.generate(prompt + [7], GREEDY)
    assert warm.hit_tokens == 288
    assert b.connector.buffers.reuses > 0 and b.connector.buffers.allocations <= 4 + 1  # + a snapshot
    rig.same(rig.cold(prompt + [7], GREEDY), warm)


@pytest.mark.parametrize("promote", [True, False])
def test_direct_reads_give_the_cold_answer(rig, store, promote):
    """On the cpu backend the store reads straight into the pool blocks (and, unpromoted,
    the snapshot straight into the window): the same answer, no host-tier copy of blocks."""
    rng = random.Random(97)
    prompt = rig.tokens(rng, 300)
    a = rig.engine(store)
    a.generate(prompt, GREEDY)
    a.connector.flush()
    b = rig.engine(store, load_batch_blocks=4, staging_buffers=4, promote_to_host=promote)
    assert b.connector.direct_reads
    warm = b.generate(prompt + [7], GREEDY)
    assert warm.hit_tokens == 288 and warm.plan.snapshot_tier is Tier.STORE and b.rollbacks == 0
    # loaded blocks are not promoted (the pool is host memory already); a promoted snapshot
    # is (its staging buffer becomes the host entry)
    assert not any(kind == "block" for (kind, _), _ in b.connector.host.items())
    assert (("swa", a.hasher.hash_blocks(prompt)[17]) in b.connector.host) == promote
    rig.same(rig.cold(prompt + [7], GREEDY), warm)


def test_window_only_span_runs_and_reports(rig, store):
    """The production-style span (the window alone) is approximate: it runs; agreement is a
    measured figure (tools/bench_engine.py), not asserted here."""
    rng = random.Random(96)
    prompt = rig.tokens(rng, 100)
    a = rig.engine(store, replay_policy="window")  # its KV is in the window policy's namespace
    a.generate(prompt, GREEDY)
    a.connector.flush()
    b = rig.engine(store, replay_policy="window", load_snapshots=False)
    warm = b.generate(prompt + [5, 6], GREEDY)
    assert warm.hit_tokens == 96 and warm.replayed_tokens == rig.model.cfg.window
    assert len(warm.output) == GREEDY.max_new_tokens


def test_kv_computed_after_an_approximate_replay_never_reaches_an_exact_engine(tmp_path):
    """An engine replaying only the window (``replay_policy="window"``, approximate) saved the
    blocks and snapshots it computed after such a replay under the exact namespace, and an
    exact engine loaded them: its tokens differed from a cold run. Its KV now lives in a
    namespace of its own; engines of one policy still share."""
    import kvstore
    from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
    from engine_plugin.reference import Engine, EngineConfig, ReferenceModel, model_preset

    model = ReferenceModel(model_preset("tiny"))
    store = kvstore.connect(str(tmp_path / "kv"), fsync=False)

    def run(policy, prompt, n):
        c = KVStoreConnector(model.kv_layout(), ConnectorConfig(replay_policy=policy, load_snapshots=False), store)
        eng = Engine(model, EngineConfig(), connector=c)
        out = eng.generate(prompt, SamplingParams(max_new_tokens=n)).output
        c.flush()
        hits = c.metrics.snapshot().get("hit_tokens_store", 0)
        c.close()
        return out, hits, eng.namespace

    rng = random.Random(0)
    p1 = [rng.randrange(128) for _ in range(97)]
    p2 = p1 + [rng.randrange(128) for _ in range(80)]
    p3 = p2 + [rng.randrange(128) for _ in range(5)]
    run("exact", p1, 1)
    _, window_hits, window_ns = run("window", p2, 1)  # approximate past p1's blocks
    got, exact_hits, exact_ns = run("exact", p3, 8)
    cold = Engine(model, EngineConfig()).generate(p3, SamplingParams(max_new_tokens=8)).output
    assert got == cold and window_ns != exact_ns and exact_hits > 0  # p1's exact blocks still shared
    assert run("window", p3, 8)[1] > window_hits  # window engines share what they computed
    store.close()
