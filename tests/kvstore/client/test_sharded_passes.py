"""A sharded set's gc and repair when a shard's pass ends in ``CapacityExceeded`` with its
counts (gc: everything left pinned; repair: the index map full): that shard answered, its
counts are summed with the others', and the error is raised once every shard is done.
Daemons listen on 127.0.0.1 only (``make_daemon``)."""

from __future__ import annotations

import pytest

import kvstore
from kvstore.errors import CapacityExceeded


def test_a_repair_that_found_a_shards_map_full_sums_its_counts_and_raises(make_daemon) -> None:
    """Repair raised on one shard with its counts (the index map full) was
    taken for a shard that did not answer: its counts dropped, the shard listed as down."""
    a, b = make_daemon("a"), make_daemon("b")
    with kvstore.connect(f"{a.address},{b.address}") as s:
        full_url = s.urls[0]
        counts = {"restored_entries": 2, "still_lost": 0, "unfixed": 3}

        def map_full(progress=None):
            raise CapacityExceeded("repair: the index map is full", result=dict(counts))

        s.shards[0].repair = map_full
        with pytest.raises(CapacityExceeded, match=f"shard {full_url}: repair: the index map is full") as ei:
            s.repair()
        out = ei.value.result
        assert out["unfixed"] == 3 and out["restored_entries"] == 2  # the full shard's counts, summed
        assert set(out["shards"]) == set(s.urls)
        assert all("error" not in d for d in out["shards"].values())  # both answered
        del s.shards[0].repair
        assert "error" not in s.repair()["shards"][full_url]
