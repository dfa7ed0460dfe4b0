"""The load half of the transfer path: tiers -> pinned staging -> device, on the loader thread.

Who calls it: ``KVStoreConnector.start_load_kv`` submits ``load_snapshot`` and
``load_blocks`` (in that order, so layer 0's window is first) to its
single loader thread; ``wait_for_layer_load`` waits on their futures.

Per batch of ``load_batch_blocks`` blocks (numbered steps, with reasons):
  1. host-tier blocks are used in place (they already live in host memory);
  2. the rest get a staging buffer each from the ``BufferPool`` (pinned on
     accelerators: the copy engine can DMA from it), up to the first one the
     pool cannot give within the timeout (a hit is a prefix: later blocks
     would be useless without it);
  3. one ``StoreGateway.read_into`` lands the payloads *in those buffers*:
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
     events.
Returns are ``(good, events)``: the count of leading good blocks (or a flag
for the snapshot) and the events per layer group (``"global"``, ``"swa.<i>"``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from engine_plugin.connector import LoadSpec, Tier


class Loader:
    """Reads through the owning connector's tiers, gateway, buffers and backend."""

    def __init__(self, connector: Any, stream: Any):
        self.c = connector
        self.stream = stream

    def _read_staged(self, kind: str, keys: Sequence[bytes], nbytes: int) -> list[torch.Tensor | None]:
        """Steps 2-3: per key, a staging buffer holding its verified payload, or ``None``.

        The caller owns the returned buffers (release, or detach when promoted); buffers of
        failed slots are already back in the pool (or will be, once an abandoned read ended).
        """
        bufs: list[torch.Tensor] = []
        for _ in keys:
            buf = self.c.buffers.acquire(nbytes, timeout=self.c.cfg.store_timeout_s)
            if buf is None:
                self.c.metrics.inc("staging_exhausted")
                break
            bufs.append(buf)
        if not bufs:
            return [None] * len(keys)
        res = self.c.gateway.read_into(keys[: len(bufs)], [b.numpy() for b in bufs], kind=kind, nbytes=nbytes)
        if res.pending is not None:
            # The store may still be writing into every one of these buffers.
            res.pending.add_done_callback(lambda _f, held=bufs: [self.c.buffers.release(b) for b in held])
            return [None] * len(keys)
        out: list[torch.Tensor | None] = [None] * len(keys)
        for i, (buf, ok) in enumerate(zip(bufs, res.ok)):
            if ok:
                out[i] = buf
            else:
                self.c.buffers.release(buf)
        return out

    def _promote(self, kind: str, key: bytes, buf: torch.Tensor, typed: torch.Tensor) -> bool:
        """Step 4: hand the staging buffer itself to the host tier; True if it now owns it."""
        if self.c.cfg.promote_to_host and self.c.host.put(kind, key, typed):
            self.c.buffers.detach(buf)
            return True
        return False

    def load_snapshot(self, spec: LoadSpec, win: torch.Tensor) -> tuple[bool, dict]:
        key = spec.snapshot_key
        src = self.c.host.get("swa", key) if spec.snapshot_tier is Tier.HOST else None
        buf = None
        if src is None:
            buf = self._read_staged("swa", [key], self.c.snap_nbytes)[0]
            if buf is None:
                self.c.metrics.inc("snapshot_load_failed")
                return False, {}
            src = buf.view(self.c.dtype).view(self.c.snap_shape)
            if self._promote("swa", key, buf, src):
                buf = None
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
            staged = self._read_staged("block", [batch[i].key for i in need], self.c.block_nbytes) if need else []
            used, to_release = 0, []
            for i, buf in zip(need, staged):
                if buf is None:
                    break  # blocks past the first bad one are useless (a hit is a prefix)
                used += 1
                srcs[i] = buf.view(self.c.dtype).view(self.c.block_shape)
                if not self._promote("block", batch[i].key, buf, srcs[i]):
                    to_release.append(buf)
            for buf in staged[used + 1:]:  # verified but past the gap: no copy reads them
                if buf is not None:
                    self.c.buffers.release(buf)
            stop = False
            for b, src in zip(batch, srcs):
                if src is None:
                    stop = True
                    break
                ev = self.c.backend.copy_async(pool[b.block_id], src, self.stream)
                good += 1
            self.c.metrics.inc("bytes_loaded", used * self.c.block_nbytes)
            if to_release:
                self.c.backend.sync_event(ev)  # the staging buffers are free once the copies ran
                for buf in to_release:
                    self.c.buffers.release(buf)
            if stop:
                break
        return good, {"global": ev}
