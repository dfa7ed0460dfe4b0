"""The committed stubs equal what tools/gen_proto.py generates from kvstore.proto."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


def test_committed_stubs_are_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "tools" / "gen_proto.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for p in mod.generate(tmp_path):
        committed = ROOT / "kvstore" / "proto" / p.name
        assert committed.read_text() == p.read_text(), (
            f"{committed} is stale: run `python tools/gen_proto.py` and commit the result")


def test_stubs_import_as_a_package() -> None:
    from kvstore.proto import kvstore_pb2, kvstore_pb2_grpc

    assert kvstore_pb2.DESCRIPTOR.services_by_name["KVStore"].methods_by_name["PutMany"]
    assert hasattr(kvstore_pb2_grpc, "KVStoreStub")
