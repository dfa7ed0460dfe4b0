"""kvstore.tuning: the allocator tuning is applied once per process, only on request, and
never over the operator's own glibc malloc settings. Each case runs in a fresh interpreter
(the tuning is process-wide)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

SCRIPT = """
import sys, kvstore, kvstore.tuning as t
s = kvstore.connect(sys.argv[1], fsync=False, tune_malloc=sys.argv[2] == "on")
s.put(b"k" * 16, b"x" * (3 << 20))
assert s.get(b"k" * 16) == b"x" * (3 << 20)
print(t._state, t.tune_malloc())
"""


def _run(tmp_path, knob: str, **env: str) -> list[str]:
    e = {k: v for k, v in os.environ.items() if "MALLOC" not in k and k != "GLIBC_TUNABLES"}
    e.update(env)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "s"), knob], env=e, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.split()


glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning applies to glibc only")


@glibc
def test_a_store_applies_it_once(tmp_path):
    assert _run(tmp_path, "on") == ["applied", "applied"]


def test_off_leaves_the_allocator_alone(tmp_path):
    assert _run(tmp_path, "off")[0] == "None"  # the store did not touch it; the explicit call then decides


@glibc
@pytest.mark.parametrize("env", [{"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"},
                                 {"MALLOC_TRIM_THRESHOLD_": "1048576"}])
def test_the_operators_settings_win(tmp_path, env):
    assert _run(tmp_path, "on", **env) == ["environment", "environment"]
