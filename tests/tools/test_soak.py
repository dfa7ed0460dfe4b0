"""The short chaos soak (``tools/soak.py``): figures with nothing lost and no wrong bytes.

Runs the tool as a subprocess exactly as documented (2 shards x 5 faulty targets,
EC 2+2, 2 clients, ~15 s of chaos) and checks its JSON report; once with the daemons
writing every put, once with the clients writing their packs (``--direct-writes``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.soak_report import failures

pytestmark = pytest.mark.slow  # a soak: seconds of chaos per run (test_tools_cli runs a short one by default)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("direct, plain", [(False, False), (True, False), (False, True)],
                         ids=["daemon-writes", "direct-writes", "plain-targets"])
def test_short_soak_loses_nothing_and_never_lies(tmp_path, direct, plain):
    """The direct-writes run also lets the soak make its own temporary work directory (under
    this test's, through TMPDIR), which a clean run removes; the others name one, which stays.
    The plain-targets run is the store's segment layout under SIGKILLs and damaged files."""
    out = tmp_path / "soak.json"
    workdir = [] if direct else ["--workdir", str(tmp_path / "w")]
    r = subprocess.run([sys.executable, "tools/soak.py", "--duration", "15", "--shards", "2", "--clients", "2",
                        "--seed", "3", *workdir, "--out", str(out), *(["--direct-writes"] if direct else []),
                        *(["--plain-targets"] if plain else [])],
                       cwd=ROOT, capture_output=True, text=True, timeout=150, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.exists(), r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert r.returncode == 0, (rep, r.stderr[-3000:])
    assert failures(rep) == []  # the tool's own definition of a failed run (its exit status)
    assert rep["wrong_bytes"] == 0
    assert rep["acked_lost"] == 0 and rep["deleted_but_found"] == 0
    assert rep["max_faulty_targets_per_shard"] <= rep["m"]
    assert rep["operations"] > 300 and rep["acked_checked_at_end"] > 50
    assert len(rep["faults_scheduled"]) >= 3  # several kinds of chaos actually happened
    assert rep["repairs"].get("runs", 0) >= 2  # one per shard at the end, at least
    assert rep["check_after_repair"] == {}
    assert rep["client_counts"].get("acked_missing_during_run", 0) == 0
    assert {"calm", "faults"} >= set(rep["latency"])
    assert rep["client_error_samples"] == []  # no error but the typed unavailable/refused ones
    if direct:  # the clients wrote packs themselves; faulty ones were rejected or failed and went via the daemon
        assert rep["client_counts"]["direct_direct_writes"] > 100, rep["client_counts"]
    work = Path(rep["workdir"])
    assert work.parent == tmp_path and rep["workdir_kept"] == (not direct) and work.exists() == (not direct)
