"""tools/bench_lb.py and tools/replay_trace.py as functions: trace tiling, the load search's report,
the JSON written on a failed replay, the whole-run bound, trace reading from a pipe, progress lines."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lb.sim import TraceRequest


@pytest.mark.parametrize("ids", [[(-5, -3), (-4,)], [(7,), (7, 7)], [(0,)], [(-1,), (-1,)], [(3, -2), ()]])
def test_tile_trace_copies_never_share_a_block_id(ids):
    from tools import bench_lb

    reqs = [TraceRequest(float(i), 512 * max(1, len(h)), 1, h) for i, h in enumerate(ids)]
    tiled = bench_lb.tile_trace(reqs, 4)
    n = len(reqs)
    copies = [{h for r in tiled[k * n:(k + 1) * n] for h in r.hash_ids} for k in range(4)]
    assert copies[0] == {h for r in reqs for h in r.hash_ids}
    for a in range(4):
        for b in range(a + 1, 4):
            assert not copies[a] & copies[b], (ids, a, b, copies)


def test_find_load_says_when_it_never_bracketed_the_load(tmp_path, capsys):
    """Every load tried meets the SLO: the search stops at its step bound without a failing load; the
    line and the JSON say the speedup is only a lower bound, not "load found"."""
    import json

    from tools import replay_trace

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 1e6, "input_length": 512, "output_length": 1,
                                         "hash_ids": [i]}) + "\n" for i in range(3)))
    rc = replay_trace.main(["--trace", str(trace), "--policies", "round_robin", "--prefill-instances", "2",
                            "--find-load", "--find-load-iters", "2", "--ttft-slo-ms", "1e9", "--quiet",
                            "--store-capacity-blocks", "10", "--out", str(tmp_path / "o")])
    out = capsys.readouterr().out
    assert rc == 0
    assert "load found" not in out and "NOT bracketed" in out and "lower bound" in out, out
    fl = json.loads((tmp_path / "o" / "results.json").read_text())["find_load"]
    assert fl["bracketed"] is False and fl["speedup_is"] == "lower_bound" and len(fl["history"]) == 2


def _tiny_trace(path: Path, n: int = 3) -> Path:
    import json

    path.write_text("".join(json.dumps({"timestamp": i * 1e6, "input_length": 512, "output_length": 1,
                                        "hash_ids": [i]}) + "\n" for i in range(n)))
    return path


def test_bench_lb_writes_its_json_when_the_replay_fails(tmp_path, capsys):
    """No load meets a 1 us SLO: exit status 1 (the replay's one line), and --out still holds what ran
    (the SLO) with the failure recorded: the part, its status and the loads the capacity search tried."""
    import json

    from tools import bench_lb

    out = tmp_path / "b.json"
    rc = bench_lb.main(["--trace", str(_tiny_trace(tmp_path / "t.jsonl")), "--out", str(out), "--skip-eplb",
                        "--ttft-slo-ms", "0.001", "--prefill-instances", "1", "--store-capacity-blocks", "10",
                        "--shapes", ""])
    assert rc == 1
    assert "no baseline meets the TTFT SLO" in capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["ttft_slo"]["ttft_slo_ms"] == 0.001 and not data["capacity"]["summary"]
    failed = data["failed"]
    assert failed["part"] == "capacity:trace:exact" and failed["exit_status"] == 1
    cap = failed["replay"]["capacity"]
    assert cap["best_baseline"] is None and "no baseline meets" in cap["error"]
    assert all(c["speedup"] is None and c["history"] for c in cap["by_policy"].values())


def test_whole_run_time_bound_stops_every_load_loop(tmp_path, monkeypatch, capsys):
    """--max-total-s: a spent budget starts no simulation (find_load, the sweep, the simulator-cost part);
    bench_lb then exits 1 in one line with --out written and the part named."""
    import json
    import time

    from tools import bench_lb
    from tools import replay_trace
    from lb.sim import SimConfig

    reqs = [TraceRequest(float(i), 512, 1, (i,)) for i in range(3)]
    cfg = SimConfig(prefill_instances=1, decode_instances=1, ttft_slo_ms=None)
    with pytest.raises(replay_trace.TimeBudgetSpent):
        replay_trace.find_load(reqs, ["round_robin"], cfg, None, replay_trace.Progress(True), 0.9, 8,
                               deadline=time.monotonic() - 1)
    assert replay_trace._run_cfg(cfg, time.monotonic() + 2).max_wall_s <= 2  # a run is cut at what is left
    assert bench_lb.run_sim_cost(reqs, ["round_robin"], cfg, 2, deadline=time.monotonic() - 1) == {}
    assert bench_lb.sim_cost_cut({}, ["round_robin"], 2)
    rows = bench_lb.run_sim_cost(reqs, ["round_robin"], cfg, 2, deadline=time.monotonic() + 600)
    assert not bench_lb.sim_cost_cut(rows, ["round_robin"], 2) and len(rows["round_robin"]["wall_s"]) == 2
    trace = _tiny_trace(tmp_path / "t.jsonl")
    assert replay_trace.main(["--trace", str(trace), "--policies", "round_robin", "--quiet",
                              "--max-total-s", "600"]) == 0
    out = tmp_path / "b.json"
    argv = ["--trace", str(trace), "--out", str(out), "--skip-eplb", "--skip-replay", "--sim-cost",
            "--sim-tile", "1", "--sim-repeats", "1", "--sim-policies", "round_robin", "--ttft-slo-ms", "1000"]

    def spent(cfg, deadline):
        raise replay_trace.TimeBudgetSpent("spent")

    monkeypatch.setattr(replay_trace, "_run_cfg", spent)
    assert bench_lb.main(argv + ["--max-total-s", "5"]) == 1
    assert "--max-total-s 5 s was spent before sim_cost" in capsys.readouterr().err
    assert json.loads(out.read_text())["failed"]["part"] == "sim_cost"


def test_read_trace_reads_a_pipe(tmp_path):
    """A non-seekable trace (a FIFO, as /dev/stdin from a pipe) is read; gzip is still told apart."""
    import gzip
    import os
    import threading

    from tools import replay_trace
    from lb.types import LBInputError

    fifo = tmp_path / "fifo"
    for payload in (_tiny_trace(tmp_path / "t.jsonl").read_bytes(), gzip.compress(b"{}\n")):
        os.mkfifo(fifo)
        writer = threading.Thread(target=fifo.write_bytes, args=(payload,))
        writer.start()
        try:
            if payload[:2] == b"\x1f\x8b":
                with pytest.raises(LBInputError, match="gzip-compressed"):
                    replay_trace.read_trace(fifo)
            else:
                assert [r.hash_ids for r in replay_trace.read_trace(fifo)] == [(0,), (1,), (2,)]
        finally:
            writer.join(timeout=10)
            fifo.unlink()


def test_a_trace_with_no_block_prints_hit_ratios_as_na(tmp_path, capsys):
    """Every hash_ids empty: no block to hit, so the hit ratio and both references are n/a (null in
    the JSON), in the main table and the sweep, not 0.000."""
    import json

    from tools import replay_trace
    from lb.registry import get_policy
    from lb.sim import SimConfig, reference_hit_ratios, simulate

    reqs = [TraceRequest(i * 1e6, 100, 1, ()) for i in range(3)]
    r = simulate(reqs, get_policy("round_robin"), SimConfig(prefill_instances=1, decode_instances=1))
    assert r.served == 3 and r.to_dict()["hit_ratio"] is None
    refs = replay_trace.json_safe(reference_hit_ratios(reqs, 10))
    assert refs == {"ideal": None, "lru_oracle": None}
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i * 1e6, "input_length": 100, "output_length": 1,
                                         "hash_ids": []}) + "\n" for i in range(3)))
    assert replay_trace.main(["--trace", str(trace), "--policies", "round_robin", "--quiet",
                              "--store-capacity-blocks", "10,inf", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.split()[:1] == ["round_rob"])
    assert row.split()[1:4] == ["n/a", "n/a", "n/a"], row
    sweep = [ln.split() for ln in out.splitlines() if ln.split()[:1] in (["10"], ["inf"])]
    assert sweep == [["10", "n/a", "n/a", "n/a"], ["inf", "n/a", "n/a", "n/a"]], out
    res = json.loads((tmp_path / "o" / "results.json").read_text())
    assert res["sweep"]["10"]["refs"] == {"ideal": None, "lru_oracle": None}


def test_the_single_lru_column_is_labelled_a_reference_not_an_oracle(tmp_path, capsys):
    """The arrival-order LRU of the store's capacity bounds nothing (queueing, per-instance tiers): it
    is printed as lru_ref, never as an oracle, in the main table and the sweep."""
    from tools import replay_trace

    trace = _tiny_trace(tmp_path / "t.jsonl")
    assert replay_trace.main(["--trace", str(trace), "--policies", "round_robin", "--quiet",
                              "--store-capacity-blocks", "10,inf"]) == 0
    out = capsys.readouterr().out
    assert "orc" not in out.lower()
    headers = [ln.split() for ln in out.splitlines() if "lru_ref" in ln]
    assert [h[:4] for h in headers] == [["policy", "hit", "ideal", "lru_ref"], ["capacity", "ideal", "lru_ref",
                                                                               "round_rob"]], out


def test_progress_off_a_terminal_is_plain_periodic_lines(monkeypatch):
    """stderr not a tty (a file, a pipe): no carriage return, one line per tenth of a run and one at its
    end; on a tty the bar is redrawn in place."""
    import io

    from tools import replay_trace

    class Tty(io.StringIO):
        def isatty(self):
            return True

    for stream, tty in ((io.StringIO(), False), (Tty(), True)):
        monkeypatch.setattr(sys, "stderr", stream)
        p = replay_trace.Progress()
        for run in ("a", "b"):
            p.label = run
            for done in range(50, 1001, 50):
                p(done, 1000)
        text = stream.getvalue()
        if tty:
            assert text.count("\r") == 40 and text.count("\n") == 2
        else:
            lines = text.splitlines()
            assert "\r" not in text and len(lines) == 22, lines  # 0/10 .. 9/10 and the end, per run
            assert lines[0] == "a: 50/1000 arrivals" and lines[10] == "a: 1000/1000 arrivals", lines
            assert lines[11] == "b: 50/1000 arrivals", lines


def test_the_derived_slo_scales_with_the_work_an_ideal_cache_leaves_not_with_the_context():
    """A conversation's second turn re-sends the first one's 4 blocks: with an ideal cache it prefills only
    its new block, so the p90 the SLO derives from is the cold first turn's, not the long second's."""
    from tools import bench_lb

    from lb.cost_model import load_default

    m = load_default()
    reqs = [TraceRequest(0.0, 2048, 1, (1, 2, 3, 4)), TraceRequest(1.0, 2560, 1, (1, 2, 3, 4, 5))]
    assert bench_lb.ideal_prefill_s(reqs, m) == [m.prefill.predict(2048, 0), m.prefill.predict(2560, 2048)]
    slo, meta = bench_lb.derive_ttft_slo_ms(reqs, 3.0)
    assert meta["p90_ideal_cache_prefill_s"] < m.prefill.predict(2048, 0) + 1e-9 and slo < 3e3 * m.prefill.predict(
        2560, 0)


def _two_turns(gap_ms: float, same_session: bool) -> list:
    """Prompts of 8 and 9 full blocks, the second extending the first (one session), or of 8 and 8
    distinct blocks (two sessions)."""
    first = TraceRequest(0.0, 8 * 512, 1, tuple(range(8)))
    second = (TraceRequest(gap_ms, 9 * 512, 1, tuple(range(9))) if same_session
              else TraceRequest(gap_ms, 8 * 512, 1, tuple(range(100, 108))))
    return [first, second]


def test_session_ceiling_a_turn_waits_for_its_prefix_or_recomputes_it():
    """A turn that arrives while the previous turn of its session is still in prefill can not end
    before that prefill ends plus its own rest, nor recompute the prefix faster: with an SLO between
    the cold prefill of 8 and of 9 blocks, the second turn at once misses; a request that shares no
    prefix does not wait, and a second turn long after the first reuses its prefix."""
    from lb.cost_model import load_default
    from tools import bench_lb

    models = load_default()
    slo_ms = (models.prefill.predict(8 * 512, 0) + models.prefill.predict(9 * 512, 0)) / 2 * 1e3
    assert bench_lb.session_ceiling(_two_turns(0.0, True), models, 1.0, 1.0, slo_ms) == 0.5
    assert bench_lb.session_ceiling(_two_turns(0.0, False), models, 1.0, 1.0, slo_ms) == 1.0
    later = _two_turns(1e9, True)
    assert bench_lb.session_ceiling(later, models, 1.0, 1.0, slo_ms) == 1.0
    # the speedup compresses the gap: the same turns, a long gap at trace time, become back to back
    assert bench_lb.session_ceiling(later, models, 1e12, 1.0, slo_ms) == 0.5
    # a service twice as slow as the model: the first turn misses, the second still fits its rest
    assert bench_lb.session_ceiling(later, models, 1.0, 2.0, slo_ms) == 0.5


@pytest.mark.parametrize("shape", ["agent", "chat"])
def test_no_policy_beats_the_session_ceiling(shape):
    """On a generated conversation trace under the exact cost model, every policy's TTFT attainment is at
    most the session ceiling (the bound grants an idle instance per request and a free, unbounded cache);
    at a load so low that no prefill overlaps a later request, the ceiling is the ideal-cache one."""
    from lb.cost_model import load_default
    from lb.registry import POLICIES, get_policy
    from lb.sim import SimConfig, simulate
    from tools import bench_lb, gen_trace

    models = load_default()
    recs = gen_trace.generate(gen_trace.SHAPES[shape], 12, seed=4)
    reqs = [TraceRequest(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"])) for r in recs]
    slo_ms = bench_lb.derive_ttft_slo_ms(reqs, 1.0)[0]
    for speedup in (2.0, 8.0):
        ceiling = bench_lb.session_ceiling(reqs, models, speedup, 1.0, slo_ms)
        cfg = SimConfig(prefill_instances=4, decode_instances=4, speedup=speedup, ttft_slo_ms=slo_ms)
        for name in POLICIES:
            res = simulate(reqs, get_policy(name, models), cfg, name=name, models=models)
            assert res.ttft_attainment <= ceiling + 1e-12, (name, speedup, res.ttft_attainment, ceiling)
    ideal = sum(t * 1e3 <= slo_ms for t in bench_lb.ideal_prefill_s(reqs, models)) / len(reqs)
    assert bench_lb.session_ceiling(reqs, models, 1e-9, 1.0, slo_ms) == ideal
