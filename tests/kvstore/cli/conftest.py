"""Fixtures for the kvtool tests: small stores built through the public API.

Every store is closed before kvtool opens it, as an operator would run the
tool beside (or after) the serving process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import kvstore
from kvstore.cli.kvtool import main
from kvstore.keys import BlockHasher, Namespace


@dataclass(frozen=True, slots=True)
class Populated:
    path: Path
    blocks: dict[bytes, bytes]  # key -> payload bytes
    swa: dict[bytes, bytes]
    chain: list[bytes]


def populate(path: Path, n_blocks: int = 12, *, config_file: str | None = None, seed: int = 0) -> Populated:
    rng = np.random.default_rng(seed)
    hasher = BlockHasher(Namespace("test-model", "global", "float16"), block_size=16)
    chain = hasher.hash_blocks(list(range(16 * n_blocks)))
    blocks: dict[bytes, bytes] = {}
    swa: dict[bytes, bytes] = {}
    kw = {"config_file": config_file} if config_file else {}
    with kvstore.connect(str(path), **kw) as store:
        items = []
        for key in chain:
            arr = rng.standard_normal((2, 16, 64)).astype(np.float16)
            blocks[key] = arr.tobytes()
            items.append(kvstore.PutItem(key, arr, tokens=16))
        for key in chain[3::4]:
            arr = rng.standard_normal((4, 16, 8)).astype(np.float16)
            swa[key] = arr.tobytes()
            items.append(kvstore.PutItem(key, arr, kind="swa", tokens=16))
        assert all(store.put_many(items))
    return Populated(path, blocks, swa, list(chain))


@pytest.fixture
def store_dir(tmp_path: Path) -> Populated:
    return populate(tmp_path / "data")


def write_config(path: Path, **fields: object) -> str:
    """A TOML ``[store]`` table; strings and lists of strings are quoted."""
    def val(v: object) -> str:
        if isinstance(v, str):
            return f'"{v}"'
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(val(x) for x in v) + "]"
        if isinstance(v, bool):
            return "true" if v else "false"
        return str(v)

    path.write_text("[store]\n" + "".join(f"{k} = {val(v)}\n" for k, v in fields.items()))
    return str(path)


@pytest.fixture
def run_tool(capsys):
    """Run kvtool in-process: returns (exit code, stdout, stderr)."""
    def run(*argv: str) -> tuple[int, str, str]:
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture(autouse=True)
def _no_store_env(monkeypatch):
    # A developer's KVSTORE_* settings must not leak into these tests.
    for k in list(os.environ):
        if k.startswith("KVSTORE_"):
            monkeypatch.delenv(k)
