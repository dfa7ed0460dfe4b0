"""Fixtures for the chaos tests: embedded stores over ``faulty://`` targets (``kvstore.embedded.faults``).

Every store gets fresh control names (a per-test prefix), so no fault state leaks
between tests; fsync is off (the faults here are injected, not power cuts).
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Callable, Iterator

import pytest

import kvstore
from kvstore.embedded import faults
from kvstore.embedded.store import EmbeddedStore

_ids = itertools.count()


def K(i: int) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def V(i: int, size: int = 3000) -> bytes:
    """Value derived from the key index: any reader can verify it."""
    return hashlib.shake_128(b"v%d" % i).digest(size)


class FaultyStore:
    """An embedded store plus the fault controls of its targets (``controls[i]`` is target i)."""

    def __init__(self, store: EmbeddedStore, controls: list[faults.FaultControl]):
        self.store, self.controls = store, controls

    def calm(self) -> None:
        for c in self.controls:
            c.calm()

    def control_of(self, target_name: str) -> faults.FaultControl:
        return self.controls[[s.name for s in self.store.target_specs].index(target_name)]


@pytest.fixture
def faulty_store(tmp_path) -> Iterator[Callable[..., FaultyStore]]:
    """``faulty_store(n=5, k=2, m=2, **store_overrides)``."""
    opened: list[EmbeddedStore] = []

    def make(n: int = 5, k: int = 2, m: int = 2, **over) -> FaultyStore:
        tag = f"c{next(_ids)}x{abs(hash(str(tmp_path))) % 10**6}"
        controls = [faults.control(f"{tag}t{i}", faults.FaultPlan(seed=i)) for i in range(n)]
        urls = [faults.faulty_url(c.name, str(tmp_path / tag / f"t{i}")) for i, c in enumerate(controls)]
        over.setdefault("fsync", False)
        over.setdefault("orphan_grace_s", 0)
        over.setdefault("delete_grace_s", 0)
        s = kvstore.connect(str(tmp_path / tag / "data"), ec_k=k, ec_m=m, targets=",".join(urls), **over)
        opened.append(s)
        return FaultyStore(s, controls)

    yield make
    for s in opened:
        s.close()


def assert_clean(store) -> None:
    problems = store.check()
    assert problems == [], problems


# The daemon tests' certificate fixture (a CA, server and client certs as PEM files).
from tests.kvstore.daemons import certs  # noqa: E402,F401
