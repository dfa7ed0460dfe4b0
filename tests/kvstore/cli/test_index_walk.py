"""``index_view.iter_rows``: the index walk behind ``inspect``'s summary and the Parquet
export (a data directory's, and a daemon's ``ExportIndex``) reads in short read transactions,
so a slow consumer never holds one open (LMDB could not reuse pages freed meanwhile)."""

from __future__ import annotations

import os

import pytest

import kvstore
from kvstore import index_view
from kvstore.embedded.index import ekey


def _active_readers(store) -> int:
    """Read transactions open now in LMDB's reader table (an idle slot shows txnid ``-``)."""
    lines = store.index.env.readers().splitlines()[1:]
    return sum(1 for line in lines if line.split() and line.split()[-1] != "-")


def test_the_walk_yields_every_record_once_across_transactions(tmp_path):
    s = kvstore.connect(str(tmp_path / "s"), fsync=False)
    try:
        keys = [os.urandom(16) for _ in range(11)]
        for k in keys:
            s.put(k, b"v" * 100)
        lost = keys[0]
        s.put(lost, b"x", kind="swa")
        with s.index.env.begin(write=True) as txn:  # one lost record: the second sub-database too
            ek = ekey(kvstore.EntryKind.SWA.code, lost)
            s.index.mark_lost_txn(txn, ek, s.index.get_meta(txn, ek))
        for per_txn in (1, 3, 11, 12, 1000):
            rows = list(index_view.iter_rows(s, rows_per_txn=per_txn))
            assert sorted((r.key, r.kind.value, r.state.value) for r in rows) == sorted(
                [(k, "block", "live") for k in keys] + [(lost, "swa", "lost")]), per_txn
    finally:
        s.close()


def test_no_read_transaction_is_held_while_the_consumer_waits(tmp_path):
    s = kvstore.connect(str(tmp_path / "s"), fsync=False)
    try:
        for _ in range(7):
            s.put(os.urandom(16), b"v" * 100)
        walk = index_view.iter_rows(s, rows_per_txn=3)
        seen = [next(walk)]
        assert _active_readers(s) == 0  # paused inside the first lot of 3: its transaction is closed
        added = [os.urandom(16) for _ in range(3)]
        for k in added:  # writes meanwhile never break the walk
            s.put(k, b"w" * 100)
        seen.extend(walk)
        assert _active_readers(s) == 0
        assert len({r.key for r in seen}) == len(seen) >= 7
        batches = index_view.iter_batches(s, batch_rows=2)
        next(batches)
        assert _active_readers(s) == 0
        assert sum(b.num_rows for b in batches) + 2 == 10
    finally:
        s.close()


def test_a_walk_of_no_rows_per_transaction_is_refused(tmp_path):
    s = kvstore.connect(str(tmp_path / "s"), fsync=False)
    try:
        s.put(os.urandom(16), b"v")
        with pytest.raises(ValueError, match="rows_per_txn"):
            next(index_view.iter_rows(s, rows_per_txn=0))
    finally:
        s.close()
