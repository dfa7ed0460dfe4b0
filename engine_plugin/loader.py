"""The load half of the transfer path: tiers -> pinned staging -> device, on the loader thread.

Who calls it: ``KVStoreConnector.start_load_kv`` submits ``load_snapshot`` and
``load_blocks`` (in that order, so layer 0's window is first) to its
single loader thread; ``wait_for_layer_load`` waits on their futures.

Per batch of ``load_batch_blocks`` blocks (numbered steps, with reasons):
  1. host-tier blocks are used in place (they already live in host memory);
  2. the rest are read with one ``get_many`` (bounded by the gateway timeout);
  3. each payload is copied into a staging buffer from the ``BufferPool``
     (pinned on accelerators: the copy engine can DMA from it) and promoted
     to the host tier;
  4. ``copy_async`` into the destination pool block on the load stream;
     blocks stop at the first missing one (later blocks are useless: a hit
     is a prefix);
  5. the batch's last event is synchronised *on this thread* before its
     staging buffers go back to the pool, so a buffer is never reused while
     a copy may still read it; the compute stream only waits on events.
Returns are ``(good, events)``: the count of leading good blocks (or a flag
for the snapshot) and the events per layer group (``"global"``, ``"swa.<i>"``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from engine_plugin.connector import LoadSpec, Tier
from engine_plugin.transfer import host_copy


class StagingExhausted(Exception):
    """No staging buffer within the timeout (a shortfall, handled as a failed load)."""


class Loader:
    """Reads through the owning connector's tiers, gateway, buffers and backend."""

    def __init__(self, connector: Any, stream: Any):
        self.c = connector
        self.stream = stream

    def _fill(self, data: bytes, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """Store bytes -> a staging buffer from the pool; returns (raw buffer, typed view)."""
        buf = self.c.buffers.acquire(len(data), timeout=self.c.cfg.store_timeout_s)
        if buf is None:
            raise StagingExhausted()
        buf.numpy()[:] = np.frombuffer(data, dtype=np.uint8)  # one memcpy, no torch thread pool
        return buf, buf.view(self.c.dtype).view(shape)

    def _promote(self, kind: str, key: bytes, src: torch.Tensor, nbytes: int, shape) -> None:
        if self.c.cfg.promote_to_host:
            t = self.c._host_tensor(nbytes, shape)
            host_copy(t, src)
            self.c.host.put(kind, key, t)

    def load_snapshot(self, spec: LoadSpec, win: torch.Tensor) -> tuple[bool, dict]:
        key = spec.snapshot_key
        src = self.c.host.get("swa", key) if spec.snapshot_tier is Tier.HOST else None
        buf = None
        if src is None:
            data = self.c.gateway.get_many([key], kind="swa", nbytes=self.c.snap_nbytes)[0]
            if data is None:
                self.c.metrics.inc("snapshot_load_failed")
                return False, {}
            try:
                buf, src = self._fill(data, self.c.snap_shape)
            except StagingExhausted:
                return False, {}
            self._promote("swa", key, src, self.c.snap_nbytes, self.c.snap_shape)
        events = {f"swa.{l}": self.c.backend.copy_async(win[l], src[l], self.stream)
                  for l in range(self.c.snap_shape[0])}  # layer by layer: layer 0 can start first
        if buf is not None:
            self.c.backend.sync_event(events[f"swa.{self.c.snap_shape[0] - 1}"])
            self.c.buffers.release(buf)
        self.c.metrics.inc("bytes_loaded", self.c.snap_nbytes)
        return True, events

    def load_blocks(self, spec: LoadSpec, pool: torch.Tensor) -> tuple[int, dict]:
        """Copy the spec's blocks into the pool; returns (leading good blocks, events)."""
        good, ev = 0, None
        nb = self.c.cfg.load_batch_blocks
        for s in range(0, len(spec.blocks), nb):
            batch = spec.blocks[s:s + nb]
            srcs: list[torch.Tensor | None] = [
                self.c.host.get("block", b.key) if b.tier is Tier.HOST else None for b in batch]
            need = [i for i, t in enumerate(srcs) if t is None]
            datas = self.c.gateway.get_many([batch[i].key for i in need], kind="block",
                                          nbytes=self.c.block_nbytes) if need else []
            staged = []
            for i, data in zip(need, datas):
                if data is None:
                    break
                try:
                    buf, srcs[i] = self._fill(data, self.c.block_shape)
                except StagingExhausted:
                    self.c.metrics.inc("staging_exhausted")
                    break
                staged.append(buf)
                self._promote("block", batch[i].key, srcs[i], self.c.block_nbytes, self.c.block_shape)
            stop = False
            for b, src in zip(batch, srcs):
                if src is None:
                    stop = True
                    break
                ev = self.c.backend.copy_async(pool[b.block_id], src, self.stream)
                good += 1
            self.c.metrics.inc("bytes_loaded", len(staged) * self.c.block_nbytes)
            if staged:
                self.c.backend.sync_event(ev)  # the staging buffers are free once the copies ran
                for buf in staged:
                    self.c.buffers.release(buf)
            if stop:
                break
        return good, {"global": ev}
