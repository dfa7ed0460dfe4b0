"""The load half of the transfer path: tiers -> (pinned staging ->) device, on the loader thread.

Who calls it: ``KVStoreConnector`` builds one ``Loader`` from its own parts (host
tier, store gateway, staging pool, device backend, metrics, load stream, the
entry formats and the load knobs of its config); ``start_load_kv`` submits
``load_snapshot`` and ``load_blocks`` (in that order, so layer 0's window is
first) to its single loader thread, and ``wait_for_layer_load`` waits on their
futures. ``tools/bench_engine.py`` times ``load_blocks`` on its own.

Two ways to land store payloads, chosen per load (``direct_reads``, given at construction):

*Staged* (accelerators: the copy engine needs pinned memory to DMA from).
Per batch of ``load_batch_blocks`` blocks (numbered steps, with reasons):
  1. host-tier blocks are used in place (they already live in host memory);
  2. the rest get a staging buffer each from the ``BufferPool`` in one
     ``acquire_many`` (pinned on accelerators), as many as the pool gives
     within the timeout (a hit is a prefix: blocks past the last buffer would
     be useless without it);
  3. one ``StoreGateway.read_into`` lands the payloads *in those buffers*
     (an entry saved with another dtype or shape than the connector's layout
     is not ok, whatever its byte count):
     the store copies each payload from its fragment bodies into the buffer
     and verifies the entry checksum over the buffer, so the only host copy
     is storage -> pinned (stores without the native read: ``get_many`` plus
     one copy). A slot is used only when the gateway reports it ok (verified,
     exact size); a buffer of a read abandoned at its timeout goes back to the
     pool only once that read finished, since it may still write into it;
  4. a good buffer is promoted to the host tier *as is* (detached from the
     pool: no second copy), and ``copy_async`` copies it into the destination
     pool block on the load stream; blocks stop at the first bad one;
  5. the batch's last event is synchronised *on this thread* before its
     remaining staging buffers go back to the pool, so a buffer is never
     reused while a copy may still read it; the compute stream only waits on
     events. An exception past step 3 (a bug, or the host tier's eviction
     callback raising) gives them back too, after a device-wide sync
     (``_give_back``): the request recomputes, and the pool, which saves share,
     must not shrink with every such load.

*Direct* (host-resident backends, ``cpu``: the pool *is* host memory, so a
staging buffer would only add a second memcpy). Per batch:
  1. host-tier blocks are copied into their pool blocks (``copy_async``,
     synchronous on such a backend);
  2. one ``StoreGateway.read_into`` whose buffers are the destination pool
     blocks themselves (byte views of ``pool[block_id]``, no tensor per block):
     the store verifies each checksum over the pool block;
  3. the leading good blocks are reported; a pool block past the first bad one
     may hold anything (a failed entry's bytes, or good bytes nobody adopts):
     the engine recomputes every block from ``valid_tokens`` on, and it
     allocated these blocks to this request alone, so nothing else reads them;
  4. no promotion to the host tier: with device == host memory it would be a
     copy of the same bytes in the same DRAM. The block is in the engine's
     device prefix cache once committed, and the device pool's eviction writes
     it to the host tier (``on_device_evict``), as for any computed block.
  A direct read is *never abandoned*: the gateway gives up on a store call at
  its timeout, but a ``get_many_into`` still running would keep writing into
  blocks the engine is about to recompute (or hand to another request). So a
  native direct read runs *inline* on the loader thread (``read_into(...,
  inline=True)``, which also saves the hop to the gateway's executor): one
  slower than ``store_timeout_s`` trips the breaker like a timeout (counted
  ``store_timeouts`` and ``direct_read_overruns``, logged), and its entries,
  verified and complete, are used. This is the one place a load can outlast
  ``store_timeout_s``; ``ConnectorConfig(direct_reads=False)`` keeps the staged
  path, whose abandoned reads only ever hold staging buffers. A store with only
  ``get_many`` is read under the timeout as usual and the gateway copies the
  bytes after the call returned, so an abandoned call never writes anywhere.
  The SWA snapshot is read straight into the request's window buffer under the
  same rule when it is not promoted (with promotion, the staged buffer becomes
  the host entry, which costs the same one copy).

Returns are ``(good, events)``: the count of leading good blocks (or a flag
for the snapshot) and the events per layer group (``"global"``, ``"swa.<i>"``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from engine_plugin.contract import LoadSpec, Tier
from engine_plugin.devices import BufferPool, DeviceBackend
from engine_plugin.tiers import HostCache, Metrics, StoreGateway
from kvstore.api import Layout

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EntryFormat:
    """One kind of entry as the loader lands it: its tensor ``shape`` (in the loader's dtype),
    its ``nbytes``, and the ``kvstore.api.Layout`` it must have been saved with."""

    shape: tuple[int, ...]
    nbytes: int
    layout: Layout


class Loader:
    """Reads through the parts it is given: host tier, store gateway, staging pool, device backend.

    ``block`` and ``snapshot`` say what a block entry and an SWA snapshot are (``dtype`` is
    their element type); ``direct_reads`` allows the direct path where the destination
    permits it (a host-resident backend: see the module docstring); ``batch_blocks`` is the
    batch size of a blocks load; ``timeout_s`` bounds the wait for staging buffers;
    ``promote`` hands staged payloads to the host tier.
    """

    def __init__(self, *, host: HostCache, gateway: StoreGateway, buffers: BufferPool,
                 backend: DeviceBackend, metrics: Metrics, stream: Any, dtype: torch.dtype,
                 block: EntryFormat, snapshot: EntryFormat, direct_reads: bool, batch_blocks: int,
                 timeout_s: float, promote: bool):
        self.host, self.gateway, self.buffers = host, gateway, buffers
        self.backend, self.metrics, self.stream = backend, metrics, stream
        self.dtype, self.block, self.snapshot = dtype, block, snapshot
        self.direct_reads, self.batch_blocks = direct_reads, batch_blocks
        self.timeout_s, self.promote = timeout_s, promote

    # ------------------------------------------------------------------ shared
    def _layout(self, kind: str) -> Layout:
        """The ``kvstore.api.Layout`` an entry of ``kind`` must have been saved with."""
        return self.block.layout if kind == "block" else self.snapshot.layout

    def _read_direct(self, kind: str, keys: Sequence[bytes], outs: Sequence[np.ndarray],
                     nbytes: int) -> list[bool]:
        """One gateway read into engine-owned host memory; never returns while it may still write.

        ``inline``: it runs on this thread (no executor hop, and nothing left running to wait
        for); one slower than the timeout trips the breaker but keeps its verified entries.
        """
        res = self.gateway.read_into(keys, outs, kind=kind, nbytes=nbytes, layout=self._layout(kind),
                                       inline=True)
        if res.late:
            self.metrics.inc("direct_read_overruns")
            log.warning("a direct %s read of %d entries took longer than the store timeout; the "
                        "step waited for it (direct_reads=False keeps loads within the timeout)",
                        kind, len(keys))
        if res.pending is not None:
            raise RuntimeError("bug: an inline StoreGateway.read_into came back pending "
                               "(it may still write into the engine's blocks)")
        return res.ok

    def _read_staged(self, kind: str, keys: Sequence[bytes], nbytes: int) -> list[torch.Tensor | None]:
        """Staged steps 2-3: per key, a staging buffer holding its verified payload, or ``None``.

        The caller owns the returned buffers (release, or detach when promoted); buffers of
        failed slots are already back in the pool (or will be, once an abandoned read ended).
        """
        bufs = self.buffers.acquire_many(nbytes, len(keys), timeout=self.timeout_s)
        if len(bufs) < len(keys):
            self.metrics.inc("staging_exhausted")
        if not bufs:
            return [None] * len(keys)
        try:
            res = self.gateway.read_into(keys[: len(bufs)], [b.numpy() for b in bufs], kind=kind,
                                           nbytes=nbytes, layout=self._layout(kind))
        except BaseException:  # a bug past the gateway: the call ended, nothing writes into them
            for b in bufs:
                self.buffers.release(b)
            raise
        if res.pending is not None:
            # The store may still be writing into every one of these buffers.
            res.pending.add_done_callback(lambda _f, held=bufs: [self.buffers.release(b) for b in held])
            return [None] * len(keys)
        out: list[torch.Tensor | None] = [None] * len(keys)
        for i, (buf, ok) in enumerate(zip(bufs, res.ok)):
            if ok:
                out[i] = buf
            else:
                self.buffers.release(buf)
        return out

    def _promote(self, kind: str, key: bytes, buf: torch.Tensor, typed: torch.Tensor,
                 held: dict[int, torch.Tensor]) -> None:
        """Staged step 4: hand the staging buffer itself to the host tier, detached from the pool.

        ``held``: the caller's buffers still to give back to the pool, by ``id``; ``buf`` leaves
        it once the tier may own it. ``HostCache.put`` may raise from its eviction callback
        *after* the entry went in, so a raising put detaches the buffer too: the pool must never
        hand out a buffer the tier may serve (a lost buffer is only a new allocation).
        """
        if not self.promote:
            return
        kept = True  # stays True when put raises: the tier may hold the buffer
        try:
            kept = self.host.put(kind, key, typed)
        finally:
            if kept:
                self.buffers.detach(held.pop(id(buf)))

    def _give_back(self, held: dict[int, torch.Tensor]) -> None:
        """After an exception past staging: release the buffers still ``held`` once no copy reads them.

        The whole device is synchronised, not only the last event: a ``copy_async`` that raised
        may have queued its copy without returning an event. A sync that raises leaves them out.
        """
        if held:
            self.backend.synchronize()
        while held:
            self.buffers.release(held.popitem()[1])

    def _direct_ok(self, t: torch.Tensor, shape: tuple[int, ...]) -> bool:
        """Whether a store may write ``t`` (a pool, a window) directly: see the module docstring."""
        return (self.direct_reads and t.device.type == "cpu" and t.dtype == self.dtype
                and tuple(t.shape[-len(shape):]) == shape and t.is_contiguous())

    # ------------------------------------------------------------------ snapshot
    def load_snapshot(self, spec: LoadSpec, win: torch.Tensor) -> tuple[bool, dict]:
        key = spec.snapshot_key
        L = self.snapshot.shape[0]
        src = self.host.get("swa", key) if spec.snapshot_tier is Tier.HOST else None
        if (src is None and not self.promote
                and tuple(win.shape) == self.snapshot.shape and self._direct_ok(win, self.snapshot.shape)):
            ok = self._read_direct("swa", [key], [win.view(-1).view(torch.uint8).numpy()], self.snapshot.nbytes)[0]
            if not ok:
                self.metrics.inc("snapshot_load_failed")
                return False, {}
            self.metrics.inc("bytes_loaded", self.snapshot.nbytes)
            return True, {f"swa.{l}": None for l in range(L)}
        held: dict[int, torch.Tensor] = {}  # the staging buffer, until promoted or released
        try:
            if src is None:
                buf = self._read_staged("swa", [key], self.snapshot.nbytes)[0]
                if buf is None:
                    self.metrics.inc("snapshot_load_failed")
                    return False, {}
                held[id(buf)] = buf
                src = buf.view(self.dtype).view(self.snapshot.shape)
                self._promote("swa", key, buf, src, held)
            events = {f"swa.{l}": self.backend.copy_async(win[l], src[l], self.stream)
                      for l in range(L)}  # layer by layer: layer 0 can start first
            if held:
                self.backend.sync_event(events[f"swa.{L - 1}"])
                self.buffers.release(held.popitem()[1])
        except BaseException:
            self._give_back(held)
            raise
        self.metrics.inc("bytes_loaded", self.snapshot.nbytes)
        return True, events

    # ------------------------------------------------------------------ blocks
    def load_blocks(self, spec: LoadSpec, pool: torch.Tensor) -> tuple[int, dict]:
        """Copy the spec's blocks into the pool; returns (leading good blocks, events)."""
        if self._direct_ok(pool, self.block.shape) and pool.dim() == 1 + len(self.block.shape):
            return self._load_blocks_direct(spec, pool)
        return self._load_blocks_staged(spec, pool)

    def _load_blocks_direct(self, spec: LoadSpec, pool: torch.Tensor) -> tuple[int, dict]:
        rows = pool.view(pool.shape[0], -1).view(torch.uint8).numpy()  # [num_blocks, block_nbytes]
        host, nbytes, nb = self.host, self.block.nbytes, self.batch_blocks
        good, ev = 0, None
        for s in range(0, len(spec.blocks), nb):
            batch = spec.blocks[s:s + nb]
            from_store = []  # positions in batch read from the store
            for i, b in enumerate(batch):
                src = host.get("block", b.key) if b.tier is Tier.HOST else None
                if src is None:
                    from_store.append(i)
                else:
                    ev = self.backend.copy_async(pool[b.block_id], src, self.stream)
            ok = [True] * len(batch)
            if from_store:
                res = self._read_direct("block", [batch[i].key for i in from_store],
                                        [rows[batch[i].block_id] for i in from_store], nbytes)
                for i, r in zip(from_store, res):
                    ok[i] = r
            n = next((i for i, r in enumerate(ok) if not r), len(batch))
            good += n
            self.metrics.inc("bytes_loaded", nbytes * sum(1 for i in from_store if i < n))
            if n < len(batch):
                break  # blocks past the first bad one are useless (a hit is a prefix)
        return good, {"global": ev}

    def _load_blocks_staged(self, spec: LoadSpec, pool: torch.Tensor) -> tuple[int, dict]:
        good, ev = 0, None
        nb = self.batch_blocks
        for s in range(0, len(spec.blocks), nb):
            batch = spec.blocks[s:s + nb]
            srcs: list[torch.Tensor | None] = [
                self.host.get("block", b.key) if b.tier is Tier.HOST else None for b in batch]
            need = [i for i, t in enumerate(srcs) if t is None]
            staged = self._read_staged("block", [batch[i].key for i in need], self.block.nbytes) if need else []
            held = {id(b): b for b in staged if b is not None}  # to give back: not promoted nor released
            try:
                used, stop = 0, False
                for i, buf in zip(need, staged):
                    if buf is None:
                        break  # blocks past the first bad one are useless (a hit is a prefix)
                    used += 1
                    srcs[i] = buf.view(self.dtype).view(self.block.shape)
                    self._promote("block", batch[i].key, buf, srcs[i], held)
                for buf in staged[used + 1:]:  # verified but past the gap: no copy reads them
                    if buf is not None:
                        self.buffers.release(held.pop(id(buf)))
                for b, src in zip(batch, srcs):
                    if src is None:
                        stop = True
                        break
                    ev = self.backend.copy_async(pool[b.block_id], src, self.stream)
                    good += 1
                self.metrics.inc("bytes_loaded", used * self.block.nbytes)
                if held:
                    self.backend.sync_event(ev)  # the staging buffers are free once the copies ran
                    while held:
                        self.buffers.release(held.popitem()[1])
            except BaseException:  # a bug or a store fault past staging (the host tier's eviction)
                self._give_back(held)
                raise
            if stop:
                break
        return good, {"global": ev}
