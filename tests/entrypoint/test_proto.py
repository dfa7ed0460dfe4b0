"""The committed serving stubs equal what tools/gen_proto.py generates from serving.proto."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_committed_serving_stubs_are_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for p in mod.generate(tmp_path, "entrypoint"):
        committed = ROOT / "entrypoint" / "proto" / p.name
        assert committed.read_text() == p.read_text(), (
            f"{committed} is stale: run `python tools/gen_proto.py --package entrypoint` and commit the result")
