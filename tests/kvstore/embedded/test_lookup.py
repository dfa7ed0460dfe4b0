"""Longest-prefix lookup and per-key probe of the embedded store: answers against their
models, and reads counted (O(hit), not O(chain))."""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvstore
from kvstore import InvalidRequest


def test_lookup_longest_prefix_and_swa_boundary(store, keys):
    for k in keys[:10]:
        store.put(k, b"kv")
    store.put(keys[12], b"kv")  # after a gap: never part of the prefix
    store.put(keys[4], b"w", kind="swa")
    r = store.lookup(keys[:20])
    assert (r.hit_blocks, r.swa_at, r.swa_at_boundary) == (10, 5, False)
    store.put(keys[9], b"w", kind="swa")
    assert store.lookup(keys[:20]).swa_at_boundary
    assert store.lookup(keys[20:30]).hit_blocks == 0
    assert store.lookup([]).hit_blocks == 0
    assert [r.hit_blocks for r in store.lookup_many([keys[:3], keys[5:7], keys[10:]])] == [3, 2, 0]


@pytest.mark.parametrize("seed", range(4))
def test_lookup_swa_at_is_the_last_live_snapshot_below_the_hit(store, hasher, seed):
    """Against a plain model, over chains longer than the index's first search windows."""
    rng = np.random.default_rng(seed)
    n = 700
    keys = hasher.hash_blocks(list(range(16 * n)))
    hit = int(rng.integers(0, n))
    for k in keys[:hit]:
        store.put(k, b"kv")
    swa = sorted(int(x) for x in rng.choice(n, size=int(rng.integers(0, 4)), replace=False))
    for i in swa:
        store.put(keys[i], b"w", kind="swa")
    below = [i + 1 for i in swa if i < hit]
    r = store.lookup(keys[:n])
    assert (r.hit_blocks, r.swa_at) == (hit, below[-1] if below else None), (hit, swa)


def test_lookup_stops_at_an_expired_block_before_gc(store, keys, clock):
    """Both index paths: nothing expired yet (no per-record check) and something expired."""
    for i, k in enumerate(keys[:10]):
        store.put(k, b"kv", ttl_s=5 if i == 6 else None)
    store.put(keys[3], b"w", kind="swa", ttl_s=50)
    assert (store.lookup(keys[:10]).hit_blocks, store.lookup(keys[:10]).swa_at) == (10, 4)
    clock.advance(6)
    assert (store.lookup(keys[:10]).hit_blocks, store.lookup(keys[:10]).swa_at) == (6, 4)
    clock.advance(50)
    assert (store.lookup(keys[:10]).hit_blocks, store.lookup(keys[:10]).swa_at) == (6, None)


@pytest.mark.parametrize("seed", range(3))
def test_probe_is_each_keys_own_lookup(store, keys, clock, seed):
    """``probe`` (what the daemon answers a sharded client's Probe with) against its model:
    ``lookup`` of each key alone, over live, expired, SWA-only and absent keys."""
    rng = np.random.default_rng(seed)
    ks = keys[:24]
    for k in ks:
        state = int(rng.integers(0, 6))
        if state in (1, 2, 3):
            store.put(k, b"kv", ttl_s=5 if state == 3 else None)
        if state in (2, 3, 4, 5):
            store.put(k, b"w", kind="swa", ttl_s=5 if state == 5 else None)
    clock.advance(6)  # the ttl'd ones expire
    block, swa = store.probe(ks + [keys[0]])
    want = [store.lookup([k]) for k in ks + [keys[0]]]
    assert list(block) == [r.hit_blocks for r in want]
    assert list(swa) == [int(r.swa_at == 1) for r in want]
    assert store.probe([]) == (b"", b"")
    # until_miss: the same answers, ending with the first key that has no live block.
    end = block.find(0) + 1 or len(block)
    assert store.probe(ks + [keys[0]], until_miss=True) == (block[:end], swa[:end])
    assert store.probe([], until_miss=True) == (b"", b"")


class CountingEnv:
    """The index's LMDB environment, counting the entry records its read cursors position on."""

    def __init__(self, env):
        self.env, self.reads = env, []

    def begin(self, **kw):
        counting = self

        class Txn:
            def __init__(self, txn):
                self.txn = txn

            def __enter__(self):
                self.txn.__enter__()
                return self

            def __exit__(self, *exc):
                return self.txn.__exit__(*exc)

            def cursor(self, **kw):
                cur = self.txn.cursor(**kw)

                class Cursor:
                    def __getattr__(self, name):
                        return getattr(cur, name)

                    def set_key(self, ek):
                        counting.reads.append(bytes(ek))
                        return cur.set_key(ek)

                return Cursor()

        return Txn(self.env.begin(**kw))


@pytest.mark.parametrize("hit", [0, 3, 40])
def test_lookup_reads_its_hit_not_its_chain(store, hasher, monkeypatch, hit):
    """Lookup costs O(hit length). A 1,000-block chain that hits ``hit`` blocks
    (one SWA snapshot inside) positions on at most hit + 1 block records, and on the SWA records
    from the hit back to the snapshot."""
    keys = hasher.hash_blocks(list(range(16 * 1000)))
    for k in keys[:hit] + keys[hit + 1:hit + 30]:  # stored blocks past the first gap do not count
        store.put(k, b"kv")
    if hit:
        store.put(keys[hit // 2], b"w", kind="swa")
    counting = CountingEnv(store.index.env)
    monkeypatch.setattr(store.index, "env", counting)
    r = store.lookup(keys)
    assert (r.hit_blocks, r.swa_at) == (hit, hit // 2 + 1 if hit else None)
    code = bytes((kvstore.EntryKind.BLOCK.code,))
    swa = bytes((kvstore.EntryKind.SWA.code,))
    block = [ek for ek in counting.reads if ek[:1] == code]
    assert block == [code + k for k in keys[:hit + 1]]
    # SWA keys are read backwards from the hit and stop at the snapshot: none past it.
    assert [ek for ek in counting.reads if ek[:1] != code] == [swa + k for k in keys[hit // 2:hit][::-1]]
    # A sharded client's probe of its share of the chain, until its first miss: the same reads.
    counting.reads.clear()
    flags, swas = store.probe(keys, until_miss=True)
    assert flags == b"\1" * hit + b"\0" and len(swas) == hit + 1
    assert [ek for ek in counting.reads if ek[:1] == code] == [code + k for k in keys[:hit + 1]]
    assert len(counting.reads) == 2 * hit + 1  # and one SWA read per live block


@pytest.mark.parametrize("seed", range(3))
def test_probe_of_several_chains_reads_each_to_its_first_miss(store, monkeypatch, seed):
    """``probe(chain_ends=...)`` (a sharded ``lookup_many``'s shares): per chain, the answers
    ``until_miss`` gives for it alone, zero-filled to the chain's length; a chain is read up to
    its first miss and no further, whatever is stored after the gap."""
    rng = np.random.default_rng(seed)
    chains = [[os.urandom(16) for _ in range(int(rng.integers(0, 40)))] for _ in range(6)]
    for c in chains:
        hit = int(rng.integers(0, len(c) + 1))
        for i, k in enumerate(c):
            if i < hit or (i > hit and rng.random() < 0.5):
                store.put(k, b"kv")
            if rng.random() < 0.2:
                store.put(k, b"w", kind="swa")
    flat = [k for c in chains for k in c]
    ends = np.cumsum([len(c) for c in chains]).tolist()
    counting = CountingEnv(store.index.env)
    monkeypatch.setattr(store.index, "env", counting)
    block, swa = store.probe(flat, chain_ends=ends)
    code = bytes((kvstore.EntryKind.BLOCK.code,))
    reads = [ek[1:] for ek in counting.reads if ek[:1] == code]
    want_b, want_s, want_reads = b"", b"", []
    for c in chains:
        b, w = store.probe(c, until_miss=True)
        hit = b.find(0) if 0 in b else len(b)
        want_b += b.ljust(len(c), b"\0")
        want_s += w.ljust(len(c), b"\0")
        want_reads += c[:hit + 1]
    assert (block, swa) == (want_b, want_s)
    assert reads == want_reads  # each chain to its first miss, that miss included
    assert store.probe([], chain_ends=[]) == (b"", b"")
    assert store.probe(chains[0], chain_ends=[0, 0, len(chains[0])])[0] == want_b[:len(chains[0])]
    for bad in ([3, 2, len(flat)], [len(flat) - 1], [-1, len(flat)], [len(flat) + 1], ["x"]):
        with pytest.raises(InvalidRequest, match="chain_ends"):
            store.probe(flat, chain_ends=bad)
    with pytest.raises(InvalidRequest, match="not both"):
        store.probe(flat, until_miss=True, chain_ends=[len(flat)])


def test_lookup_has_no_side_effects(store, keys):
    store.put(keys[0], b"x")
    before = store.counters.copy()
    store.lookup(keys[:5])
    assert store.counters == before
