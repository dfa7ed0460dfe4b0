"""The walkthrough at a tiny scale: every variant completes with the cold run's tokens,
nothing is left running, the report renders in headless Chromium; Ctrl-C midway leaves
no process and no listening port behind."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Every test here runs the whole walkthrough (model, store daemon, workers, entrypoint): the
# second stage of the test command (tools/run_tests.sh), with the vLLM tests. Its parts run in
# the default suite too: tests/entrypoint/test_e2e.py (generate equals the cold run, the second
# turn hits the store, decode failover), the engine's replay tests, and test_cli.py.
pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[3]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _cmd(out: Path) -> list[str]:
    return [sys.executable, "-m", "entrypoint.walkthrough.cli", "walkthrough", "--context-tokens", "700",
            "--max-new-tokens", "24", "--out", str(out)]


def _our_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention ``marker`` (our run directory)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd:
            found.append(cmd)
    return found


def _addresses(text: str) -> list[tuple[str, int]]:
    return [(h, int(p)) for h, p in re.findall(r"(127\.0\.0\.1):(\d+)", text)]


def _listening(addr: tuple[str, int]) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(addr) == 0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("walk")
    t0 = time.monotonic()
    res = subprocess.run(_cmd(out), cwd=ROOT, capture_output=True, text=True, timeout=240)
    return out, res, time.monotonic() - t0


def test_all_variants_match_the_cold_run(run):
    out, res, secs = run
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    results = json.loads(next(out.glob("run-*/results.json")).read_text())
    assert set(results) == {"turn 3, cold (no cache for this tenant)", "turn 3, cache hit", "turn 3, SWA miss",
                            "turn 3, engine failover"}
    assert all(v["matches_cold"] for v in results.values())
    hit, miss, fail = (results[f"turn 3, {k}"]["figures"] for k in ("cache hit", "SWA miss", "engine failover"))
    cold = results["turn 3, cold (no cache for this tenant)"]["figures"]
    assert cold["loaded"] == 0 and cold["prefilled"] == cold["prompt_tokens"]
    assert hit["loaded"] > 0.8 * hit["prompt_tokens"] and hit["replayed"] == 0 and hit["snapshot_hit"]
    assert miss["replayed"] > 0 and miss["loaded_by_tier"]["store"] > 0
    assert fail["failovers"] == 1 and 0 < fail["restreamed"] <= 23  # killed after token 0 of 24 arrived
    assert "report: " in res.stdout


def test_nothing_left_running(run):
    out, res, _ = run
    assert _our_processes(str(out)) == []
    assert not [a for a in _addresses(res.stdout) if _listening(a)]


def test_report_renders_in_headless_chromium(run, tmp_path):
    if CHROMIUM is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing: tools/install_peers.sh installs it")
        pytest.skip("chromium not installed (bash tools/install_peers.sh)")
    out, res, _ = run
    report = next(out.glob("run-*/report.html"))
    shot = tmp_path / "report.png"
    # Flags for a sandboxed, offline CI: no sandbox (root), no GPU, no background networking.
    proc = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
         "--window-size=1100,2400", f"--screenshot={shot}", report.as_uri()],
        capture_output=True, text=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000, proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line]
    assert console == [], console
    shutil.copy(shot, report.with_suffix(".png"))  # kept beside the report for a person to look at


def test_sigint_midway_leaves_nothing_behind(tmp_path):
    p = subprocess.Popen(_cmd(tmp_path), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    deadline = time.monotonic() + 120
    for line in p.stdout:
        seen.append(line)
        if "== turn 1" in line or time.monotonic() > deadline:
            break
    p.send_signal(signal.SIGINT)
    rest, _ = p.communicate(timeout=60)
    text = "".join(seen) + rest
    assert p.returncode == 130, text[-2000:]
    assert _our_processes(str(tmp_path)) == []
    assert not [a for a in _addresses(text) if _listening(a)]
