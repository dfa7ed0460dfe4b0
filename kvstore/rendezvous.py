"""Rendezvous (highest-random-weight) hashing: the one scoring rule of the project.

Every candidate (a target of an entry's fragments, a daemon of a sharded store) gets the
score ``xxh3_64(key || name)``; the best scores win. Adding or removing a candidate moves
only the keys that scored it among their best, and every process computes the same answer
with no shared state. ``kvstore.embedded.placement`` ranks targets with it (and adds failure
domains); ``kvstore.client.sharded`` picks one daemon per key.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash


def score(key: bytes, name: bytes) -> int:
    """The score of ``name`` for ``key``."""
    return xxhash.xxh3_64_intdigest(key + name)


def best(key: bytes, names: Sequence[bytes]) -> int:
    """Index of the best-scoring name for ``key`` (the first of equal scores)."""
    top, top_i = -1, 0
    for i, n in enumerate(names):
        s = score(key, n)
        if s > top:
            top, top_i = s, i
    return top_i


def best_many(keys: Sequence[bytes], names: Sequence[bytes]) -> list[int]:
    """``best`` for every key at once: one score matrix and one argmax (the first of equal
    scores, as ``best``)."""
    if not keys:
        return []
    scores = np.array([[score(k, n) for k in keys] for n in names], dtype=np.uint64)
    return scores.argmax(axis=0).tolist()
