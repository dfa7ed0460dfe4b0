"""The vision encoder (VE) of the reference stack: image bytes -> image token ids.

A small real torch module with seeded weights (no download): the image bytes
are cut into ``length`` equal patches, each patch embedded by a fixed random
projection and quantised to the nearest entry of a codebook of the model's
vocabulary (vector quantisation, as discrete visual tokenizers do). The same
bytes always give the same tokens, on any machine.

``EncoderCache`` is the VE output cache keyed by image hash; the VE load
balancer routes an image to the instance whose cache holds it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np
import torch

from kvstore.errors import InvalidRequest

PATCH_BYTES = 64


def image_hash(data: bytes) -> bytes:
    """Content hash of an image (the VE cache key and the ``ImageSpan`` hash)."""
    return hashlib.blake2b(data, digest_size=16, person=b"kvstack-image").digest()


class VisionEncoder(torch.nn.Module):
    def __init__(self, vocab_size: int, *, dim: int = 32, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.proj = torch.nn.Parameter(torch.randn(PATCH_BYTES, dim, generator=g) / PATCH_BYTES**0.5,
                                       requires_grad=False)
        self.codebook = torch.nn.Parameter(torch.randn(vocab_size, dim, generator=g), requires_grad=False)

    @torch.no_grad()
    def encode(self, data: bytes, length: int) -> list[int]:
        if length <= 0:
            raise InvalidRequest(f"an image needs a positive token length, got {length}")
        if not data:
            raise InvalidRequest("image bytes are empty and the VE cache does not hold this image")
        raw = np.frombuffer(data, dtype=np.uint8)
        # Resample the bytes onto length x PATCH_BYTES positions: every patch sees its part of the image.
        idx = np.linspace(0, len(raw) - 1, num=length * PATCH_BYTES).astype(np.int64)
        x = torch.from_numpy(raw[idx].astype(np.float32) / 127.5 - 1.0).reshape(length, PATCH_BYTES)
        emb = x @ self.proj
        d = torch.cdist(emb, self.codebook)
        return [int(t) for t in torch.argmin(d, dim=1)]


class EncoderCache:
    """LRU of image hash -> token ids, bounded in entries. Thread-safe."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._d: OrderedDict[bytes, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, h: bytes) -> list[int] | None:
        with self._lock:
            v = self._d.get(h)
            if v is not None:
                self._d.move_to_end(h)
            return v

    def put(self, h: bytes, tokens: list[int]) -> None:
        with self._lock:
            self._d[h] = tokens
            self._d.move_to_end(h)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._d)
