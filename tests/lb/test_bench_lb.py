"""tools/bench_lb.py and tools/replay_trace.py as functions: trace tiling, the load search's report,
the JSON written on a failed replay, the whole-run bound, trace reading from a pipe, progress lines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lb.sim import TraceRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))


@pytest.mark.parametrize("ids", [[(-5, -3), (-4,)], [(7,), (7, 7)], [(0,)], [(-1,), (-1,)], [(3, -2), ()]])
def test_tile_trace_copies_never_share_a_block_id(ids):
    import bench_lb

    reqs = [TraceRequest(float(i), 512 * max(1, len(h)), 1, h) for i, h in enumerate(ids)]
    tiled = bench_lb.tile_trace(reqs, 4)
    n = len(reqs)
    copies = [{h for r in tiled[k * n:(k + 1) * n] for h in r.hash_ids} for k in range(4)]
    assert copies[0] == {h for r in reqs for h in r.hash_ids}
    for a in range(4):
        for b in range(a + 1, 4):
            assert not copies[a] & copies[b], (ids, a, b, copies)
