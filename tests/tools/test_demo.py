"""tools/demo.py runs end to end (both invocation forms) and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import kvstore

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}


def test_demo_script_keeps_store(tmp_path):
    data = tmp_path / "demo-data"
    r = subprocess.run([sys.executable, "tools/demo.py", "--data-dir", str(data)], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "hit_blocks=10 swa_at=10" in r.stdout and "all bit-identical" in r.stdout
    assert "tenant-b: hit_blocks=0" in r.stdout and r.stdout.rstrip().endswith(f"kvtool inspect {data}")
    with kvstore.connect(str(data)) as store:
        s = store.stats()
        assert s["by_kind"]["block"]["entries"] == 10 and s["by_kind"]["swa"]["entries"] == 1
        assert store.check() == []


def test_demo_module_on_temporary_dir():
    r = subprocess.run([sys.executable, "-m", "tools.demo"], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "OK: demo finished" in r.stdout
