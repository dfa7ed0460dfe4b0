"""The paged global-KV pool with a prefix cache: the device tier (HBM) of the plugin.

Who calls it: the engine (allocate / free / match / register) and, through
``on_evict``, the connector (write-back of evicted blocks to the host tier);
``tools/fit_cost_model.py`` times its layers over one directly.

Layout: ``kv`` is ``[num_blocks, block_size, d_global]`` on the engine device;
a request's block table maps its block index i to a pool block id.

Invariants (with reasons):
  1. A block is in exactly one of: free list, evictable LRU (refcount 0, has a
     hash), in use (refcount > 0). Eviction takes only from the LRU, so a block
     a running request reads is never overwritten.
  2. ``by_hash[h] == b`` iff block b holds the verified global KV of the block
     whose prefix hash is h. A block gets a hash only after its content is
     complete and correct (computed, or loaded and verified): a hit never reads
     a partial or unverified block.
  3. ``on_evict(hash, block_id)`` runs before an evicted block is reused, while
     its content is still intact, so the callback may copy it out.
  4. A callback that raises (the connector's host tier may: ``HostCache.put``)
     does not break 1-2: the block is unmapped before the callbacks run and
     goes to the free list, every callback still runs, then the first
     exception is raised; ``allocate`` hands back the blocks it had gathered.
     The eviction is not undone: the callback may have copied the block out
     already (``HostCache.put`` raises after storing), and a block that stayed
     cached would raise again at every later allocation.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import torch

from kvstore.errors import InternalError, InvalidRequest

log = logging.getLogger(__name__)

EvictCallback = Callable[[bytes, int], None]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, d_global: int, *, dtype: torch.dtype,
                 device: torch.device | str):
        if num_blocks < 1:
            raise InvalidRequest("a pool needs at least one block")
        self.block_size = block_size
        self.kv = torch.zeros(num_blocks, block_size, d_global, dtype=dtype, device=device)
        self.refcount = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.by_hash: dict[bytes, int] = {}
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # LRU order, oldest first
        self.on_evict: list[EvictCallback] = []
        self.evictions = 0

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[0]

    def num_available(self) -> int:
        return len(self.free) + len(self.evictable)

    def match_prefix(self, hashes: list[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``. No side effects."""
        out = []
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for b in block_ids:
            if self.refcount[b] == 0:
                self.evictable.pop(b, None)
            self.refcount[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks, evicting LRU cached blocks if needed; ``None`` if they do not fit.

        If an ``on_evict`` callback raises, its exception propagates and nothing is allocated:
        the blocks gathered so far go back to the free list (invariant 4).
        """
        if n > self.num_available():
            return None
        out: list[int] = []
        try:
            for _ in range(n):
                b = self.free.pop() if self.free else self._evict_oldest()
                self.refcount[b] = 1
                out.append(b)
        except BaseException:
            for b in reversed(out):  # reversed: the free list is as it was before the call
                self.refcount[b] = 0
                self.free.append(b)
            raise
        return out

    def _evict_oldest(self) -> int:
        """Take the least recently used cached block out of the prefix cache, hand it to every
        ``on_evict`` callback and return it (in no list: the caller owns it). If a callback
        raised, the block goes to the free list and the first exception is raised (invariant 4)."""
        b, _ = self.evictable.popitem(last=False)
        h = self.block_hash[b]
        if h is None:
            raise InternalError(f"bug: evictable block {b} has no hash")
        # unmapped first: whatever a callback raises, no hash maps to a block outside the LRU
        del self.by_hash[h]
        self.block_hash[b] = None
        self.evictions += 1
        errors: list[Exception] = []
        for cb in self.on_evict:  # every callback, even after one raised (each may copy it out)
            try:
                cb(h, b)
            except Exception as exc:  # noqa: BLE001 - raised below, after the pool is consistent
                errors.append(exc)
        if errors:
            self.free.append(b)
            for exc in errors[1:]:
                log.error("another on_evict callback failed for block %d", b, exc_info=exc)
            raise errors[0]
        return b

    def register(self, block_id: int, h: bytes) -> int:
        """Publish ``block_id`` as holding hash ``h``; returns the block that holds it now.

        If another block already holds ``h`` (two requests computed the same
        block), the existing one stays canonical and ``block_id`` stays private.
        """
        if self.refcount[block_id] <= 0:
            raise InternalError(f"bug: registering block {block_id} that is not in use")
        cur = self.by_hash.get(h)
        if cur is not None:
            return cur
        if self.block_hash[block_id] is not None:
            return block_id
        self.block_hash[block_id] = h
        self.by_hash[h] = block_id
        return block_id

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference per block; hashed blocks become evictable, others free."""
        for b in reversed(block_ids):  # tail first: the LRU evicts a prefix's tail before its head
            if self.refcount[b] <= 0:
                raise InternalError(f"bug: releasing block {b} with refcount {self.refcount[b]}")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if self.block_hash[b] is not None:
                    self.evictable[b] = None
                else:
                    self.free.append(b)

    def drop_cached(self) -> int:
        """Evict every unused cached block (through ``on_evict``); returns how many.

        A callback that raises stops it there, the pool consistent (invariant 4)."""
        n = 0
        while self.evictable:
            self.free.append(self._evict_oldest())
            n += 1
        return n


class PagedKV:
    """``GlobalKVAccess`` (``engine_plugin.reference.model``) over one request's block table in
    ``pool``: the engine's accessor, also used by ``tools/fit_cost_model.py``."""

    __slots__ = ("pool", "table", "B")

    def __init__(self, pool: BlockPool, block_ids: list[int]):
        self.pool, self.B = pool, pool.block_size
        self.table = torch.tensor(block_ids, dtype=torch.long, device=pool.kv.device)

    def read(self, end: int) -> torch.Tensor:
        nb = -(-end // self.B)
        return self.pool.kv[self.table[:nb]].reshape(-1, self.pool.kv.shape[-1])[:end]

    def write(self, start: int, g: torch.Tensor) -> None:
        pos = torch.arange(start, start + g.shape[0], device=g.device)
        self.pool.kv[self.table[pos // self.B], pos % self.B] = g
