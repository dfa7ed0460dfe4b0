"""Block keys: the only place in the project where prefix hashes are computed.

The entrypoint (to ask the store what is cached) and the engine plugin (to load
and save blocks) both call this module; nobody re-implements it.

Contract
--------
* A key is ``KEY_LEN`` (16) bytes: 128 bits of BLAKE2b, stable across
  processes, machines and Python versions (never Python's ``hash()``).
* The chain starts at a *root* that digests the namespace (model id, KV layout
  id, dtype, parallel rank), the block size and the tenant salt. Two tenants,
  two models or two ranks therefore never share a key, even for equal tokens.
* Block ``i`` covers tokens ``[i*B, (i+1)*B)``. Its hash digests the parent
  hash, the block's token ids (little-endian uint32, or uint64 for ids past
  2**32, tagged so the two never collide) and, for every image span overlapping the block, the image
  hash with the span's start and length. Equal prefix => equal hash; any change
  in a block changes its hash and every later one.
* Only *full* blocks are hashed: a partial last block is never hashed as a full
  one (``hash_blocks`` ignores the tail shorter than ``B``).

Example::

    ns = Namespace(model_id="deepseek-v4.1-flash", kv_layout="global-fp4", dtype="uint8", rank=0)
    hasher = BlockHasher(ns, block_size=512, tenant_salt=b"tenant-a")
    keys = hasher.hash_blocks(token_ids, images=[ImageSpan(img_hash, start=900, length=256)])
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Iterable, NewType, Sequence

from kvstore.errors import InvalidRequest

KEY_LEN = 16
"""Bytes in every block key (128-bit prefix hash)."""

BlockHash = NewType("BlockHash", bytes)

_DOMAIN = b"kvstack.keys.v1"


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_LEN, person=b"kvstack-block")
    for p in parts:
        h.update(struct.pack("<Q", len(p)))  # length-prefix each part: no ambiguity between parts
        h.update(p)
    return h.digest()


@dataclass(frozen=True, slots=True)
class Namespace:
    """What makes KV incompatible: the model, its KV layout, dtype and parallel rank."""

    model_id: str
    kv_layout: str = "global"
    dtype: str = "bfloat16"
    rank: int = 0

    def __post_init__(self) -> None:
        if not self.model_id:
            raise InvalidRequest("Namespace.model_id must be a non-empty string")
        if self.rank < 0:
            raise InvalidRequest(f"Namespace.rank must be >= 0, got {self.rank}")

    def canonical(self) -> bytes:
        """Canonical bytes: UTF-8 fields, length-prefixed, rank as little-endian u32."""
        out = bytearray()
        for s in (self.model_id, self.kv_layout, self.dtype):
            b = s.encode("utf-8")
            out += struct.pack("<I", len(b)) + b
        out += struct.pack("<I", self.rank)
        return bytes(out)

    def label(self) -> str:
        """Human-readable label used by ``kvtool inspect``."""
        return f"{self.model_id}/{self.kv_layout}/{self.dtype}/r{self.rank}"


def image_hash(data: bytes) -> bytes:
    """The content hash of an image's bytes: the ``ImageSpan.image_hash`` that enters the block keys
    of the blocks its tokens overlap (and the vision encoder's cache key)."""
    return hashlib.blake2b(data, digest_size=16, person=b"kvstack-image").digest()


@dataclass(frozen=True, slots=True)
class ImageSpan:
    """An image's tokens: ``length`` positions starting at ``start``, identified by ``image_hash``."""

    image_hash: bytes
    start: int
    length: int

    def __post_init__(self) -> None:
        if not self.image_hash:
            raise InvalidRequest("ImageSpan.image_hash must be non-empty bytes")
        if self.start < 0 or self.length <= 0:
            raise InvalidRequest(
                f"ImageSpan needs start >= 0 and length > 0, got start={self.start} length={self.length}"
            )

    @property
    def end(self) -> int:
        return self.start + self.length


def check_image_spans(spans: Sequence[ImageSpan], n_tokens: int) -> tuple[ImageSpan, ...]:
    """``spans`` for a prompt of ``n_tokens`` tokens, as a tuple; ``InvalidRequest`` unless it is a
    list or tuple of ``ImageSpan`` each inside the prompt, no two overlapping (each position
    holds at most one image's tokens)."""
    if not isinstance(spans, (list, tuple)) or not all(isinstance(sp, ImageSpan) for sp in spans):
        raise InvalidRequest(f"images must be a list of ImageSpan, got {spans!r:.200}")
    ordered = sorted(spans, key=lambda sp: sp.start)
    for sp in ordered:
        if sp.end > n_tokens:
            raise InvalidRequest(f"image span [{sp.start}, {sp.end}) lies outside the {n_tokens}-token prompt")
    for a, b in zip(ordered, ordered[1:]):
        if b.start < a.end:
            raise InvalidRequest(f"image spans [{a.start}, {a.end}) and [{b.start}, {b.end}) overlap: each "
                                 "prompt position may hold at most one image's tokens")
    return tuple(spans)


def _tokens_bytes(tokens: Sequence[int]) -> bytes:
    # uint32 covers every real vocabulary; wider ids switch to uint64 with a marker so
    # the two encodings can never collide.
    try:
        return b"\x04" + struct.pack(f"<{len(tokens)}I", *tokens)
    except struct.error:
        try:
            return b"\x08" + struct.pack(f"<{len(tokens)}Q", *tokens)
        except struct.error as exc:
            raise InvalidRequest("token ids must be integers in [0, 2**64)") from exc


class BlockHasher:
    """Computes the chained prefix hashes of one namespace and tenant.

    Invariants:
      1. ``root`` depends only on (namespace, block size, tenant salt): the same
         inputs on any machine give the same keys.
      2. ``hash_blocks(t)[:n] == hash_blocks(t[:n*B])`` for every n: a prefix's
         keys are a prefix of the keys.
    """

    __slots__ = ("namespace", "block_size", "tenant_salt", "root")

    def __init__(self, namespace: Namespace, block_size: int, tenant_salt: bytes = b""):
        if block_size <= 0:
            raise InvalidRequest(f"block_size must be positive, got {block_size}")
        if not isinstance(tenant_salt, (bytes, bytearray)):
            raise InvalidRequest("tenant_salt must be bytes")
        self.namespace = namespace
        self.block_size = block_size
        self.tenant_salt = bytes(tenant_salt)
        self.root = BlockHash(
            _digest(_DOMAIN, namespace.canonical(), struct.pack("<I", block_size), self.tenant_salt)
        )

    def num_full_blocks(self, num_tokens: int) -> int:
        return num_tokens // self.block_size

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        images: Iterable[ImageSpan] = (),
        *,
        parent: BlockHash | None = None,
        start_block: int = 0,
    ) -> list[BlockHash]:
        """Hashes of every *full* block of ``token_ids``.

        ``parent``/``start_block`` continue an existing chain: pass the hash of
        block ``start_block - 1`` and the tokens from ``start_block * B`` on.
        Image spans use absolute token positions.
        """
        spans = sorted(images, key=lambda s: (s.start, s.end))
        B = self.block_size
        if parent is None and start_block != 0:
            raise InvalidRequest("continuing a chain at start_block > 0 needs its parent hash")
        prev = parent if parent is not None else self.root
        out: list[BlockHash] = []
        n_full = len(token_ids) // B
        for i in range(n_full):
            lo = (start_block + i) * B
            hi = lo + B
            parts = [prev, _tokens_bytes(token_ids[i * B : (i + 1) * B])]
            for s in spans:
                if s.start < hi and s.end > lo:
                    parts.append(s.image_hash + struct.pack("<qq", s.start, s.length))
            prev = BlockHash(_digest(*parts))
            out.append(prev)
        return out

    def keys_for_engine_hashes(self, engine_hashes: Sequence[bytes]) -> list[BlockHash]:
        """Keys for blocks whose chained prefix hashes an engine computed itself (vLLM's
        ``request.block_hashes``, which already fold in the cache salt, image hashes and LoRA).

        Key ``i`` digests this hasher's root and engine hash ``i``. An engine's chained hash
        ``i`` depends on every token of blocks ``0..i``, so key ``i`` does too; the root adds
        what the engine's hash leaves out (namespace, block size, tenant salt), so two engines
        whose KV bytes differ never share a key. Invariant 2 holds for these keys as well.
        """
        return [BlockHash(_digest(self.root, b"engine-hash", bytes(h))) for h in engine_hashes]


def check_key(key: bytes) -> bytes:
    """Validate a store key (misuse raises ``InvalidRequest``)."""
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidRequest(f"a key must be bytes, got {type(key).__name__}")
    key = bytes(key)
    if len(key) != KEY_LEN:
        raise InvalidRequest(
            f"a key must be exactly {KEY_LEN} bytes (a kvstore.keys block hash), got {len(key)}"
        )
    return key


def tenant_key(key: bytes, secret: bytes) -> bytes:
    """The key a daemon stores tenant ``secret``'s ``key`` under (``kvstore.auth``):
    keyed BLAKE2b-128, so two tenants' equal keys are unrelated and unguessable without the
    secret. A direct-writing client (``kvstore.client.direct_writes``) names its fragments with it."""
    return hashlib.blake2b(key, key=secret, digest_size=KEY_LEN, person=b"kvstack-tenant").digest()


_PLAIN, _KEY_LENS = frozenset((bytes,)), frozenset((KEY_LEN,))


def check_keys(keys: Sequence[bytes]) -> list[bytes]:
    """``check_key`` over a batch, with one cheap pass for the common all-valid case."""
    if isinstance(keys, (bytes, bytearray, memoryview, str)):
        raise InvalidRequest(f"expected a sequence of {KEY_LEN}-byte keys, got one {type(keys).__name__}; "
                             "wrap a single key in a list")
    try:
        keys = list(keys)
    except TypeError:
        raise InvalidRequest(f"expected a sequence of {KEY_LEN}-byte keys, got {type(keys).__name__}") from None
    if set(map(type, keys)) <= _PLAIN and set(map(len, keys)) <= _KEY_LENS:  # C loops: 1,000 keys in ~20 µs
        return keys
    return [check_key(k) for k in keys]
