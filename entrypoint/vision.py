"""The vision encoder (VE) of the reference stack: image bytes -> image token ids.

A small real torch module with seeded weights (no download): the image bytes
are cut into ``length`` equal patches, each patch embedded by a fixed random
projection and quantised to the nearest entry of a codebook of the model's
vocabulary (vector quantisation, as discrete visual tokenizers do). The same
bytes always give the same tokens, on any machine.

``EncoderCache`` is the VE output cache keyed by image hash
(``kvstore.keys.image_hash``, the hash that also enters the block keys) and token
length (the same bytes give other tokens at another length); the
VE load balancer routes an image to the instance whose cache holds it for the
request's scope (``scoped_image_key``, the keys a VE worker's ``Status``
reports).

Trust: the cache is shared by every tenant, so an entry is only ever written
for a hash that was checked against the bytes that were encoded
(``check_image_hash``), and every lookup is scoped: it hits only if the same
scope (a tenant-derived namespace the entrypoint sends) has itself sent that
image's bytes before. A tenant can therefore neither poison another's entry
(a hash that does not match its bytes is refused), nor read an image it never
had (another tenant's hash alone gets nothing), nor learn that another tenant
sent an image: its bytes are a miss for it (``cache_hit`` false, encoded
again, so the time taken is a miss's too) until it has sent them itself, and
the VE LB's affinity follows scoped keys, so the worker picked does not tell
either. (Other tenants' traffic still moves load and LRU evictions: that
reveals how busy the VE is, not which images it saw.)
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict

import numpy as np
import torch

from kvstore.errors import InvalidRequest
from kvstore.keys import image_hash

PATCH_BYTES = 64
SCOPE_METADATA = "kvstack-image-scope"  # gRPC metadata on Encode: the caller's tenant-derived cache scope


def tenant_scope(tenant: str, salt: bytes) -> str:
    """The VE cache scope of a tenant (hex; sent as ``SCOPE_METADATA``): distinct per tenant."""
    return hashlib.blake2b(tenant.encode() + b"\0" + salt, digest_size=16, person=b"kvstack-vescope").hexdigest()


def scoped_image_key(scope: bytes, h: bytes) -> bytes:
    """The VE LB's affinity key of image hash ``h`` for cache scope ``scope`` (the bytes of a
    ``tenant_scope``): what a VE worker's ``Status.cached_images`` lists, one per scope holding it."""
    return hashlib.blake2b(scope + b"\0" + h, digest_size=16, person=b"kvstack-vekey").digest()


def check_image_hash(claimed: bytes, data: bytes) -> None:
    """Refuse (``InvalidRequest``) image bytes whose content hash is not ``claimed``."""
    if image_hash(data) != claimed:
        raise InvalidRequest(f"image_hash {claimed.hex()} does not match the image bytes sent "
                             "(it must be kvstore.keys.image_hash(image_data))")


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
    """LRU of (image hash, token length) -> token ids, bounded in entries. Thread-safe.

    Invariants (module docstring, "Trust"):
      1. ``put`` is only called with a hash verified against the encoded bytes, so an entry's
         tokens are the image's at that length, whoever put it.
      2. Each entry records the scopes that proved they hold the bytes (by sending them) for its
         length; a lookup hits only for one of them, with or without bytes, so neither a hash
         alone nor the answer to one's own bytes says anything about other scopes, and another
         scope's put of the image at another length changes nothing of this one's entries.
    """

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self._d: OrderedDict[tuple[bytes, int], tuple[list[int], set[bytes]]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, h: bytes, length: int, scope: bytes) -> list[int] | None:
        """The tokens of ``h`` at ``length`` if ``scope`` has put them (sent the bytes) and they are
        still cached."""
        with self._lock:
            e = self._d.get((h, length))
            if e is None or scope not in e[1]:
                return None
            self._d.move_to_end((h, length))
            return e[0]

    def put(self, h: bytes, tokens: list[int], scope: bytes) -> None:
        """``tokens`` (``len(tokens)`` of them) of the image hashed ``h``, sent by ``scope``."""
        with self._lock:
            k = (h, len(tokens))
            e = self._d.get(k)
            self._d[k] = (tokens, (e[1] if e else set()) | {scope})
            self._d.move_to_end(k)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)

    def keys(self) -> list[bytes]:
        """The scoped keys (``scoped_image_key``) of every (image, scope holding it at some length)."""
        with self._lock:
            held = {(sc, h) for (h, _), (_, scopes) in self._d.items() for sc in scopes}
        return [scoped_image_key(sc, h) for sc, h in sorted(held)]
