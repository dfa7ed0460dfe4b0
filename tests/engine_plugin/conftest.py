"""Fixtures for the engine plugin tests: the tiny reference model, a real embedded
store on tmp_path, engines wired to a ``KVStoreConnector``, and cold references."""

from __future__ import annotations

import random

import pytest
import torch

import kvstore
from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
from engine_plugin.reference import Engine, EngineConfig, ReferenceModel, SamplingParams, model_preset

BLOCK = 16

# Tiny tensors: one intra-op thread is as fast and does not fight the other test runs for the
# two shared cores (oversubscribed torch threads made these tests ~10x slower under load).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model() -> ReferenceModel:
    return ReferenceModel(model_preset("tiny"))


@pytest.fixture
def store(tmp_path, rig):
    s = kvstore.connect(str(tmp_path / "store"))
    yield s
    rig.close()  # connectors first: their saver threads may still be writing to the store
    s.close()


class Rig:
    """Builds engines and connectors; closes the connectors at teardown."""

    def __init__(self, model: ReferenceModel):
        self.model = model
        self.connectors: list[KVStoreConnector] = []
        self._cold: dict[tuple, object] = {}

    def engine(self, store=None, *, num_blocks: int = 256, chunk: int = 32, connector: bool = True,
               **conn_kw) -> Engine:
        conn = None
        if connector:
            conn = KVStoreConnector(self.model.kv_layout(), ConnectorConfig(block_size=BLOCK, **conn_kw), store)
            self.connectors.append(conn)
        return Engine(self.model, EngineConfig(block_size=BLOCK, num_blocks=num_blocks, chunk_size=chunk),
                      connector=conn)

    def cold(self, prompt: list[int], sp: SamplingParams):
        """Full recompute in one engine without any cache (memoised)."""
        k = (tuple(prompt), sp)
        if k not in self._cold:
            self._cold[k] = self.engine(connector=False, chunk=1024).generate(prompt, sp)
        return self._cold[k]

    def close(self) -> None:
        for c in self.connectors:
            c.close()
        self.connectors.clear()

    @staticmethod
    def same(cold, warm, atol: float = 1e-4) -> None:
        assert_same(cold, warm, atol)

    @staticmethod
    def tokens(rng: random.Random, n: int) -> list[int]:
        return rand_tokens(rng, n)


@pytest.fixture
def rig(model):
    r = Rig(model)
    yield r
    r.close()


def assert_same(cold, warm, atol: float = 1e-4) -> None:
    assert warm.output == cold.output, (cold.output, warm.output)
    for a, b in zip(cold.logits, warm.logits):
        torch.testing.assert_close(b, a, atol=atol, rtol=1e-4)


def rand_tokens(rng: random.Random, n: int, vocab: int = 128) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]
