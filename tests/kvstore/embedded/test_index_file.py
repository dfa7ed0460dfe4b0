"""A truncated index file is refused before LMDB maps it (``kvstore.embedded.index_file``): every entry
point says ``CorruptData``, names the file and ``kvtool rebuild-index``, and the CLIs exit 2.
Mapping it killed each of them with SIGBUS (exit 135, no message). Each entry point runs in a
subprocess, so a signal fails the test instead of killing pytest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore
from kvstore.errors import CorruptData

ROOT = Path(__file__).resolve().parents[3]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture(scope="module")
def truncated(tmp_path_factory) -> Path:
    """200 single puts, closed, then ``data.mdb`` cut to half its size (page-aligned)."""
    d = tmp_path_factory.mktemp("trunc") / "data"
    with kvstore.connect(str(d), fsync=False) as s:
        for i in range(200):
            s.put(i.to_bytes(16, "big"), os.urandom(1000))
    f = d / "index" / "data.mdb"
    size = f.stat().st_size
    assert size >= 4 * 4096
    os.truncate(f, size // 2 // 4096 * 4096)
    return d


ENTRY_POINTS = {
    "connect": lambda d: [sys.executable, "-c", f"import kvstore; kvstore.connect({str(d)!r})"],
    "serve": lambda d: [sys.executable, "-m", "kvstore.server.cli", "serve", "--data-dir", str(d), "--port", "0",
                        "--host", "127.0.0.1"],
    "kvtool verify": lambda d: [sys.executable, "-m", "kvstore.cli.kvtool", "verify", str(d)],
}


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_a_truncated_index_is_refused_by_every_entry_point(truncated, name):
    p = subprocess.run(ENTRY_POINTS[name](truncated), capture_output=True, text=True, env=_env(), timeout=120)
    assert p.returncode == (1 if name == "connect" else 2), (p.returncode, p.stderr[-2000:])
    err = " ".join(p.stderr.split())
    assert "truncated" in err and str(truncated / "index" / "data.mdb") in err, err[-2000:]
    assert f"kvtool rebuild-index {truncated}" in err, err[-2000:]
    if name == "connect":
        assert "CorruptData" in err


def test_a_file_shorter_than_its_second_meta_page_is_refused(tmp_path):
    d = tmp_path / "data"
    with kvstore.connect(str(d), fsync=False) as s:
        s.put(b"k" * 16, b"v" * 100)
    os.truncate(d / "index" / "data.mdb", 4096)
    with pytest.raises(CorruptData, match="truncated"):
        kvstore.connect(str(d))
