"""The soak's reporting (tools/soak.py): the clients' progress files and the controller's
progress line, the latency summary, and ``failures``, the one definition of a failed run
(the soak's exit status and tests/tools/test_soak.py use it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from pathlib import Path


def progress_path(work: Path, client: int) -> Path:
    return work / f"progress-{client}.json"


def write_progress(path: Path, c: Counter) -> None:
    """A client's running counts for the controller's progress line (replaced atomically).
    ``refused``: ``StoreUnavailable`` (a daemon down, or a gc answered BUSY while another
    maintenance pass ran there) and ``CapacityExceeded`` (a target full)."""
    doc = {"ops": sum(v for k, v in c.items() if k.startswith("op_")),
           "refused": c["unavailable"] + c["capacity_refused"],
           "errors": c["unrecoverable"] + sum(v for k, v in c.items() if k.startswith("error_")),
           "wrong_bytes": c["wrong_bytes"]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    os.replace(tmp, path)


def failures(report: dict) -> list[str]:
    """Why a soak's report is a failure (empty: a clean run). The one definition, used for the
    exit status and by tests/tools/test_soak.py."""
    out = []
    if report["wrong_bytes"]:
        out.append(f"{report['wrong_bytes']} wrong bytes")
    if report["acked_lost"]:
        out.append(f"{report['acked_lost']} acknowledged keys lost")
    if report["deleted_but_found"]:
        out.append(f"{report['deleted_but_found']} deleted keys still found")
    # Orphan fragments are what a daemon killed mid-put leaves by design (GC sweeps them after
    # orphan_grace_s); anything else found after the final repair is a failure.
    found = {k: n for k, n in report["check_after_repair"].items() if k != "orphan_fragment"}
    if found:
        out.append(f"check after repair found {found}")
    missing = report["client_counts"].get("acked_missing_during_run", 0)
    if missing:
        out.append(f"{missing} acknowledged keys missing during the run")
    unreadable = report["client_counts"].get("acked_unreadable_during_run", 0)
    if unreadable:
        out.append(f"{unreadable} acknowledged keys unreadable (Unrecoverable) during the run")
    return out


def pct(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    xs = sorted(xs)
    at = lambda q: round(xs[min(len(xs) - 1, int(q * len(xs)))], 2)  # noqa: E731
    return {"n": len(xs), "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99)}


class Progress:
    """A line on stderr every ``every`` seconds: the clients' summed progress files."""

    def __init__(self, work: Path, clients: int, t_start: float, duration: float) -> None:
        self.work, self.clients, self.t_start, self.duration = work, clients, t_start, duration
        self.every = min(5.0, max(1.0, duration / 10))
        self.next = t_start + self.every

    def line(self, what: str) -> str:
        tot: Counter[str] = Counter()
        for c in range(self.clients):
            try:
                tot.update(json.loads(progress_path(self.work, c).read_text()))
            except (OSError, ValueError):
                pass  # not written yet
        return (f"soak: {time.time() - self.t_start:.0f} s of {self.duration:g} s{what}: {tot['ops']} ops, "
                f"{tot['refused']} refused (daemon down or target full), {tot['errors']} errors, "
                f"{tot['wrong_bytes']} wrong bytes")

    def __call__(self) -> None:
        if time.time() >= self.next:
            self.next = time.time() + self.every
            print(self.line(""), file=sys.stderr, flush=True)
