"""``kvstack walkthrough`` without running the stack: usage errors are one line and exit 2
before anything starts, and every run gets a directory of its own."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from entrypoint.walkthrough.conversation import build

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow  # one subprocess per case: the second stage of the test command
@pytest.mark.parametrize("args, needle", [
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--block-size", "-16"], "--block-size must be >= 1"),
    (["--model", "nope"], "unknown model preset 'nope'"),
    (["--out", "/dev/null/x"], "cannot create a run directory"),
    (["--num-blocks", "-1"], "--num-blocks must be >= 0"),
    (["--context-tokens", "5"], "--context-tokens must be >= 100"),
    (["--block-size", "x"], "--block-size"),
])
def test_usage_errors_are_one_line_and_start_nothing(tmp_path, args, needle):
    out = tmp_path / "out"
    argv = ["--out", str(out), *args] if "--out" not in args else args
    res = subprocess.run([sys.executable, "-m", "entrypoint.walkthrough.cli", "walkthrough", *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    err = res.stderr.strip()
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and len(err.splitlines()) == 1, res.stderr
    assert err.startswith("kvstack") and needle in err, err
    assert "starting" not in res.stdout  # refused before the stack was started
    assert not out.exists() or not any(out.iterdir())


def test_a_too_small_pool_is_refused_before_anything_starts(tmp_path, capsys, monkeypatch):
    """--num-blocks x --block-size that can not hold turn 3 (prompt + new tokens, within the decode
    policy's share) is one line naming the least --num-blocks that does; that least is accepted."""
    from entrypoint.walkthrough import cli

    started = []
    monkeypatch.setattr(cli, "walkthrough", lambda args: started.append(args.num_blocks) or 0)
    base = ["walkthrough", "--context-tokens", "700", "--max-new-tokens", "24", "--out", str(tmp_path / "out")]
    assert cli.main([*base, "--num-blocks", "1"]) == 2 and started == []
    assert "use --num-blocks >= " in capsys.readouterr().err
    sizes = cli.request_sizes(argparse.Namespace(context_tokens=700, max_new_tokens=24, model="tiny", block_size=16))
    assert sizes.longest == sizes.turn3 + 24 and sizes.turn3 > sizes.turn2 > sizes.turn1
    least = cli.min_num_blocks(sizes, 16)
    assert cli.DECODE_ADMITS_PCT * least * 16 > 100 * sizes.longest >= cli.DECODE_ADMITS_PCT * (least - 1) * 16
    for too_few in (1, least - 1):
        assert cli.main([*base, "--num-blocks", str(too_few)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"use --num-blocks >= {least}" in err, err
        assert f"{sizes.turn3} prompt + 24 new tokens" in err, err
    assert started == [] and not (tmp_path / "out").exists()
    assert cli.main([*base, "--num-blocks", str(least)]) == 0 and started == [least]
    assert cli.main([*base, "--num-blocks", "0"]) == 0 and started[-1] >= least  # the default fits


def test_the_default_pool_fits_small_blocks(monkeypatch):
    """--num-blocks 0 sizes the pool from the requests: also a small context with tiny blocks."""
    from entrypoint.walkthrough import cli

    started = []
    monkeypatch.setattr(cli, "walkthrough", lambda args: started.append(args) or 0)
    assert cli.main(["walkthrough", "--context-tokens", "100", "--block-size", "1"]) == 0
    conv = build(100, 128)
    n = started[0].max_new_tokens  # turn 3: turn 1, its reply, turn 2's messages, its reply, the new message
    longest = len(conv.turn1) + n + len(conv.turn2_added) + n + len(conv.turn3_added) + n
    assert started[0].num_blocks * 0.95 > longest
    assert cli.request_sizes(started[0]).longest == longest


def test_a_block_size_over_the_shared_prefix_is_refused(tmp_path, capsys, monkeypatch):
    """A block larger than turn 2's prompt (all turn 3 shares with it) is never cached: refused with
    one line naming the largest block size that works, which is accepted."""
    from entrypoint.walkthrough import cli

    started = []
    monkeypatch.setattr(cli, "walkthrough", lambda args: started.append(args.block_size) or 0)
    conv = build(700, 128)
    turn2 = len(conv.turn1) + 24 + len(conv.turn2_added)  # turn 1, its 24-token reply, turn 2's messages
    base = ["walkthrough", "--context-tokens", "700", "--max-new-tokens", "24", "--out", str(tmp_path / "out")]
    for too_big in (turn2 + 1, 100_000):
        assert cli.main([*base, "--block-size", str(too_big)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"use --block-size <= {turn2}" in err, err
    assert started == [] and not (tmp_path / "out").exists()
    assert cli.main([*base, "--block-size", str(turn2)]) == 0 and started == [turn2]


def test_run_directories_are_unique_within_one_second(tmp_path):
    from entrypoint.walkthrough.cli import make_run_dir

    now = time.localtime()
    got: list[Path] = []
    lock = threading.Lock()

    def claim():
        d = make_run_dir(tmp_path, now)
        with lock:
            got.append(d)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    stamp = time.strftime("run-%Y%m%d-%H%M%S", now)
    assert len(got) == 8 and len(set(got)) == 8
    assert {d.name for d in got} == {stamp} | {f"{stamp}-{i}" for i in range(2, 9)}
    assert all(d.is_dir() and d.parent == tmp_path for d in got)


def test_run_directory_errors_are_typed(tmp_path):
    from entrypoint.walkthrough.cli import make_run_dir

    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        make_run_dir(tmp_path / "file" / "out")


def test_a_long_request_prints_a_heartbeat(capsys):
    """A request that shows no event for a while (the full-size example's CPU prefill takes
    minutes) prints a line at each heartbeat instead of going silent; none after it ends."""
    from entrypoint.walkthrough import cli

    class Event:
        def __init__(self, kind, **kw):
            self.kind, self.t_ms, self.index, self.token_id, self.detail = kind, 0.0, 0, 0, ""
            self.__dict__.update(kw)

    class SlowClient:
        def generate(self, prompt, *, on_event, **_):
            time.sleep(0.75)  # no event: a long prefill
            on_event(Event("token", index=0, token_id=7))
            return [7], [], {"total_ms": 750.0, "ttft_ms": 750.0}

    res = cli._run(SlowClient(), "cold", [1, 2, 3], [], 1, heartbeat_s=0.2)
    assert res.tokens == [7]
    out = capsys.readouterr().out
    beats = out.count("... working")
    assert 2 <= beats <= 4, out
    assert out.rstrip().splitlines()[-1].strip().endswith("TTFT 750.0 ms")  # nothing after the end


# A stand-in for the stack whose stop is slow (a child that takes its time to exit): it waits for a
# line on stdin, which the test sends only after its signals. Started by main() as the real one is.
SLOW_STOP = """
import sys, threading
from entrypoint.walkthrough import cli
from kvstore.errors import StoreUnavailable

class SlowStop:
    def __init__(self, *args, **kwargs):
        self.stopped = threading.Event()

    def start(self):
        print("STUB started", flush=True)
        self.stopped.wait()
        raise StoreUnavailable("the stub was stopped")

    def stop(self):
        print("STUB stopping", flush=True)
        sys.stdin.readline()
        self.stopped.set()
        print("STUB stopped", flush=True)

cli.Cluster = SlowStop
sys.exit(cli.main(["walkthrough", "--out", sys.argv[1]]))
"""


def _read_until(p: subprocess.Popen, needle: str, seen: list[str]) -> None:
    for line in p.stdout:
        seen.append(line)
        if needle in line:
            return
    raise AssertionError(f"no {needle!r} in {''.join(seen)}")


# SIGTERM first (slow) takes the same deferred stop as SIGINT first
@pytest.mark.parametrize("first", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_signals_during_stop_are_deferred(tmp_path, first):
    """A second Ctrl-C (or a SIGTERM) while the stack is stopping does not cut the stop short:
    the stop finishes, then one line and exit 130, no traceback."""
    p = subprocess.Popen([sys.executable, "-c", SLOW_STOP, str(tmp_path / "out")], cwd=ROOT, text=True,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: list[str] = []
    try:
        _read_until(p, "STUB started", seen)
        p.send_signal(first)
        _read_until(p, "STUB stopping", seen)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGINT):
            p.send_signal(sig)
        time.sleep(0.3)  # handled while the stop is still waiting
        rest, _ = p.communicate("go\n", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    text = "".join(seen) + rest
    assert p.returncode == 130, text
    assert "Traceback" not in text and "STUB stopped" in text, text
    assert text.count("interrupted: stopping everything") == 1, text


def test_max_new_tokens_leaves_tokens_to_re_stream(tmp_path, capsys, monkeypatch):
    """--max-new-tokens below 8 is refused (one line, nothing started): with 3 the failover variant
    killed the decode worker at the last token, and nothing was left to re-stream."""
    from entrypoint.walkthrough import cli

    started = []
    monkeypatch.setattr(cli, "walkthrough", lambda args: started.append(args.max_new_tokens) or 0)
    for n in ("3", "7"):
        assert cli.main(["walkthrough", "--max-new-tokens", n, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--max-new-tokens must be >= 8" in err and f"got {n}" in err, err
    assert started == [] and not (tmp_path / "out").exists()
    assert cli.main(["walkthrough", "--max-new-tokens", "8", "--out", str(tmp_path / "out")]) == 0
    assert started == [8]


class _Ev:
    def __init__(self, kind, index=0, detail=""):
        self.kind, self.index, self.detail, self.token_id, self.t_ms = kind, index, detail, 7, 0.0


def _stream(n: int, worker: str = "decode-1"):
    """The events of a request as the entrypoint sends them: token 0 from the prefill, then the decode."""
    yield _Ev("token", 0)
    yield _Ev("hop", detail=json.dumps({"hop": "decode_start", "worker": worker, "resume_at": 1}))
    for i in range(1, n):
        yield _Ev("token", i)


def test_the_failover_killer_fires_after_the_first_token(capsys):
    """The killer SIGKILLs the decode worker picked to stream the rest once, right after token 0 (the
    prefill's), so that even at the least --max-new-tokens all but one token are left to re-stream."""
    from entrypoint.walkthrough import cli

    killed: list[tuple[str, int]] = []
    got = [0]
    killer = cli.FailoverKiller(lambda worker: killed.append((worker, got[0])))
    for ev in _stream(cli.MIN_NEW_TOKENS):
        killer(ev)
        got[0] += ev.kind == "token"
    assert killed == [("decode-1", 1)] and killer.killed == ["decode-1"] and killer.tokens == 1
    assert cli.MIN_NEW_TOKENS - killer.tokens >= 7  # tokens still to come when the kill came
    assert "SIGKILL decode-1" in capsys.readouterr().out


def test_restreamed_counts_the_tokens_after_the_failover():
    from entrypoint.walkthrough.report import VariantResult

    fo = {"hop": "failover", "worker": "decode-1", "code": "UNAVAILABLE", "resumed_at": 2, "ms": 5.0, "t_ms": 9.0}
    assert VariantResult("failover", list(range(8)), [fo], {}).figures()["restreamed"] == 6
    assert VariantResult("hit", list(range(8)), [], {}).figures()["restreamed"] == 0
