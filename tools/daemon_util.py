"""Start and stop ``kvstore serve`` subprocesses on loopback, for tools/load_store.py and tools/bench_remote.py.

Each daemon gets ``--port 0`` (a free port, read back from its first stdout
line) and its own data directory; ``stop`` sends SIGTERM (a graceful drain)
and kills after a bound.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tools.cli_args import sigint_deferred


@dataclass(frozen=True, slots=True)
class DaemonProc:
    proc: subprocess.Popen
    url: str


def start_daemon(data_dir: Path, extra: Sequence[str] = ()) -> DaemonProc:
    cmd = [sys.executable, "-m", "kvstore.server.cli", "serve", "--port", "0", "--data-dir", str(data_dir),
           "--gc-interval-s", "0", "--log-level", "WARNING", *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = p.stdout.readline()
    except BaseException:  # interrupted (Ctrl-C) or failed: the daemon must not outlive us
        p.kill()
        p.wait()
        raise
    m = re.search(r"(grpcs?://\S+)", line)
    if not m:
        p.kill()
        raise RuntimeError(f"daemon did not start (exit {p.wait()}): {line!r}")
    return DaemonProc(p, m.group(1))


def stop_process(p: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL if ``p`` has not exited within ``timeout``: its exit status. A
    Ctrl-C meanwhile waits until it is stopped (``sigint_deferred``)."""
    with sigint_deferred():
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                return p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                return p.wait(10)
        return p.returncode


def stop_daemon(d: DaemonProc, timeout: float = 30.0) -> int:
    return stop_process(d.proc, timeout)


def stop_all(daemons: Sequence[DaemonProc], timeout: float = 30.0) -> None:
    """``stop_daemon`` each one; if stopping one fails, the rest are killed. A Ctrl-C meanwhile
    waits until all are stopped (``sigint_deferred``)."""
    with sigint_deferred():
        for i, d in enumerate(daemons):
            try:
                stop_daemon(d, timeout)
            except BaseException:
                for rest in daemons[i:]:
                    if rest.proc.poll() is None:
                        rest.proc.kill()
                        rest.proc.wait()
                raise
