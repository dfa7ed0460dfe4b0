"""Shared fixtures for the embedded store tests: a fresh data directory per test,
an injectable clock, and value and check helpers (fragments on disk: ``tests.fragments``)."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvstore
from kvstore.keys import BlockHasher, Namespace
from tests.kvstore.daemons import certs, make_daemon, spawn  # noqa: F401 - fixtures for every test below


class FakeClock:
    """A clock the test moves by hand (TTL, grace periods)."""

    def __init__(self, t: float = 1_800_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def hasher() -> BlockHasher:
    return BlockHasher(Namespace("test-model", "global", "bfloat16", 0), block_size=16, tenant_salt=b"t")


@pytest.fixture
def keys(hasher):
    return hasher.hash_blocks(list(range(16 * 64)))


@pytest.fixture
def data_dir(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(data_dir, clock):
    s = kvstore.connect(str(data_dir), fsync=False, clock=clock, orphan_grace_s=0, delete_grace_s=0)
    yield s
    s.close()


def value_for(key: bytes, size: int = 4000) -> bytes:
    """Deterministic, mildly compressible bytes derived from the key."""
    import numpy as np

    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 16, size, dtype=np.uint8).tobytes()


def assert_clean(store) -> None:
    problems = store.check()
    assert problems == [], problems
