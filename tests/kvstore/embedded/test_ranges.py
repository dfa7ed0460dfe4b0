"""Batched gets on object-store targets (``kvstore.embedded.ranges``): the data fragments of a
batch that share a pack object are fetched with one read per (target, pack), every fragment
still verified, a damaged one read again and rebuilt from parity; nothing held after the get."""

from __future__ import annotations

import os
from dataclasses import replace

import kvstore
from kvstore import PutItem
from kvstore.embedded import ranges as R
from kvstore.embedded import targets as T
from kvstore.embedded.index import ekey


def _memory_store(tmp_path, tag):
    # memory:// buckets are process-wide: a fresh name per test
    targets = ",".join(f"memory://{tag}{i}/kv#d{i}" for i in range(6))
    return kvstore.connect(str(tmp_path / "d"), targets=targets, fsync=False, compression="none")


def _count_reads(monkeypatch):
    calls = []
    orig = T.Target.read_into

    def read_into(self, rel, buf, offset=0):
        calls.append((self.name, rel, offset, len(buf)))
        return orig(self, rel, buf, offset)

    monkeypatch.setattr(T.Target, "read_into", read_into)
    return calls


def test_a_batched_get_reads_each_shared_pack_once_per_target(tmp_path, monkeypatch):
    s = _memory_store(tmp_path, "rg-a")
    vals = {os.urandom(16): os.urandom(20_000) for _ in range(12)}
    assert s.put_many([PutItem(k, v) for k, v in vals.items()]) == [True] * 12
    with s.index.env.begin() as txn:
        recs = [(ekey(1, k), s.index.get_meta(txn, ekey(1, k))) for k in vals]
    spans = R.plan(recs, s.targets)
    alone = sum(1 for _ek, m in recs for i in range(m.k)
                if not any(sp.target == m.targets[i] and sp.start <= m.offsets[i] < sp.end for sp in spans))
    calls = _count_reads(monkeypatch)
    assert s.get_many(list(vals)) == list(vals.values())
    # one read per span, one per data fragment no span holds: far fewer than one per fragment
    assert len(spans) >= 1 and len(calls) == len(spans) + alone < 12 * 4
    assert not s.fragments.reader.ranges._held  # released with the get
    calls.clear()
    k0 = next(iter(vals))
    assert s.get(k0) == vals[k0] and len(calls) == 4  # a single get: its k fragments
    s.close()


def test_a_damaged_fragment_in_a_fetched_span_is_read_again_then_rebuilt(tmp_path, monkeypatch):
    s = _memory_store(tmp_path, "rg-b")
    vals = {os.urandom(16): os.urandom(20_000) for _ in range(8)}
    s.put_many([PutItem(k, v) for k, v in vals.items()])
    bad = next(iter(vals))
    with s.index.env.begin() as txn:
        m = s.index.get_meta(txn, ekey(1, bad))
    t = s.targets[m.targets[0]]
    rel = T.pack_path(m.gen)
    blob = bytearray(t.read(rel))
    blob[m.offsets[0] + 100] ^= 0xFF  # inside fragment 0's body
    t.fs.pipe_file(t._p(rel), bytes(blob))
    assert s.get_many(list(vals)) == list(vals.values())
    assert s.counters["degraded_reads"] >= 1
    s.close()


def test_plan_fetches_only_spans_that_are_mostly_wanted(tmp_path):
    s = _memory_store(tmp_path, "rg-c")
    keys = [os.urandom(16) for _ in range(8)]
    s.put_many([PutItem(k, os.urandom(20_000)) for k in keys])
    with s.index.env.begin() as txn:
        recs = [(ekey(1, k), s.index.get_meta(txn, ekey(1, k))) for k in keys]
    spans = R.plan(recs, s.targets)
    assert 1 <= len(spans)
    for sp in spans:  # runs of wanted fragments, no gap between them over GAP_MAX
        inside = sorted((m.offsets[i], m.offsets[i] + m.frag_len) for _ek, m in recs for i in range(m.k)
                        if m.targets[i] == sp.target and sp.start <= m.offsets[i] < sp.end)
        assert len(inside) >= 2 and inside[0][0] == sp.start and inside[-1][1] == sp.end
        assert all(b[0] - a[1] <= R.GAP_MAX for a, b in zip(inside, inside[1:]))
    assert R.plan(recs[:1], s.targets) == []  # one fragment per pack: nothing to share
    big = [(ek, replace(m, frag_len=R.GAP_MAX * 2)) for ek, m in recs]  # far apart, as if large
    assert R.plan([(ek, replace(m, offsets=tuple(o * 100 for o in m.offsets))) for ek, m in big],
                  s.targets) == []  # fragments far apart: read one by one
    s.close()


def test_local_targets_plan_nothing(tmp_path):
    with kvstore.connect(str(tmp_path / "d"), fsync=False) as s:
        keys = [os.urandom(16) for _ in range(4)]
        s.put_many([PutItem(k, b"x" * 5000) for k in keys])
        with s.index.env.begin() as txn:
            recs = [(ekey(1, k), s.index.get_meta(txn, ekey(1, k))) for k in keys]
        assert R.plan(recs, s.targets) == []  # read through kept descriptors instead


def test_a_batched_get_whose_prefetch_fails_holds_no_span(tmp_path, monkeypatch):
    """A fetch failing with something other than an ``OSError`` (no memory for a large span)
    ends the batched get before anyone could release what was fetched: the spans already
    held are released there, not kept for the process's life."""
    import pytest

    targets = ",".join(f"memory://rv-pf{i}/kv#d{i}" for i in range(6))
    s = kvstore.connect(str(tmp_path / "d"), targets=targets, fsync=False, compression="none")
    try:
        vals = {os.urandom(16): os.urandom(20_000) for _ in range(12)}
        assert s.put_many([PutItem(k, v) for k, v in vals.items()]) == [True] * 12
        with s.index.env.begin() as txn:
            recs = [(ekey(1, k), s.index.get_meta(txn, ekey(1, k))) for k in vals]
        spans = R.plan(recs, s.targets)
        assert len(spans) >= 2
        last = spans[-1]  # collected last: every other span is held before it fails
        orig = T.Target.read_into

        def read_into(self, rel, buf, offset=0):
            if (self.name, rel, offset, len(buf)) == (last.target, last.rel, last.start, last.end - last.start):
                raise MemoryError("no room for the span")
            return orig(self, rel, buf, offset)

        monkeypatch.setattr(T.Target, "read_into", read_into)
        with pytest.raises(MemoryError):
            s.get_many(list(vals))
        assert not s.fragments.reader.ranges._held
        monkeypatch.setattr(T.Target, "read_into", orig)
        assert s.get_many(list(vals)) == list(vals.values())
    finally:
        s.close()
