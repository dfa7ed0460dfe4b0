"""Device backends and pinned staging buffers: the GDR-style transfer path.

Who uses it: ``KVStoreConnector`` (a backend from ``get_backend(config.device)`` and a
``BufferPool``, for its saves and handed to its ``Loader``), the vLLM binding
(``engine_plugin.vllm``) and the GPU tests (``tests/engine_plugin/test_gpu.py``, run by
``tools/gpu_check.sh``).

Path of a load (store -> device)::

    store.get_many_into: fragment bodies --one copy, checksum verified over the
        destination--> pinned staging buffer (BufferPool, reused)
        --copy_async(non_blocking) on the side stream--> pool block on device
        --event--> compute stream waits on the event before the layer group

(stores without ``get_many_into``: ``get_many`` bytes under the gateway's
timeout, then one copy into the staging buffer on the loader thread).

On a *host-resident* backend (``DeviceBackend.host_resident``: the "device"
pool is ordinary host memory and ``copy_async`` is a memcpy on the calling
thread, i.e. ``cpu``) the staging hop buys nothing, so the loader lets the
store read straight into the destination pool blocks (``direct_reads``;
``loader`` says what that changes)::

    store.get_many_into: fragment bodies --one copy, checksum verified over the
        pool block itself--> pool block (no staging buffer, no second copy)

and of a save (device -> store): ``copy_async`` on the save stream into a
pinned buffer, an event, then a background thread waits on the event and
puts. One interface, three backends chosen at run time from ``BACKENDS``
(a registry with lazy imports, as fsspec does; add a row for a new device):

* ``cpu``: the same calls; copies are synchronous and events are no-ops;
  host-resident (direct reads into the pool).
* ``cuda``: pinned host memory, ``non_blocking`` copies, side streams, events;
  not host-resident (DMA from pinned staging).
* ``npu``: the same through ``torch_npu``; asking for it without
  ``torch_npu`` installed raises ``InvalidRequest`` with an install hint.

Invariant of ``BufferPool``: a buffer is either free (in its size class
list) or owned by exactly one in-flight transfer (a store read into it, or a
copy out of it); ``acquire`` blocks at most ``timeout`` seconds and returns
``None`` (a shortfall the caller counts) when the pool is exhausted, which is
the transfer path's backpressure. ``detach`` hands a buffer to a new owner for
good (the host tier, which keeps a loaded block instead of copying it); the
pool then counts it no longer and may allocate a replacement.
"""

from __future__ import annotations

import importlib
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from kvstore.errors import InvalidRequest


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy between contiguous host tensors with one memcpy on the calling thread.

    ``Tensor.copy_`` would fan out to torch's intra-op thread pool, which the
    loader and saver threads would then fight over with the engine's compute.
    """
    if dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype and dst.numel() == src.numel():
        np.copyto(dst.view(-1).view(torch.uint8).numpy(), src.view(-1).view(torch.uint8).numpy())
    else:
        dst.copy_(src)


class DeviceBackend:
    """CPU backend; the base of the accelerator backends (same call sequence everywhere)."""

    name = "cpu"
    # True: device tensors are plain host memory and ``copy_async`` completes before it
    # returns, so a store may write a pool block directly (no staging). A subclass whose
    # copies are asynchronous, or whose pool is not host memory, must set it False.
    host_resident = True

    def __init__(self, index: int = 0):
        self.index = index

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def empty_host(self, nbytes: int) -> torch.Tensor:
        """A host staging buffer (pinned on accelerators)."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def new_stream(self) -> Any:
        return None

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> Any:
        """Copy ``src`` into ``dst`` on ``stream``; returns an event marking completion."""
        host_copy(dst, src)
        return None

    def wait_event(self, event: Any) -> None:
        """Order the current (compute) stream after ``event``; no host wait."""

    def sync_event(self, event: Any) -> None:
        """Block the calling host thread until ``event`` completed."""

    def synchronize(self) -> None:
        pass


class CudaBackend(DeviceBackend):
    name = "cuda"
    host_resident = False

    def __init__(self, index: int = 0):
        super().__init__(index)
        if not torch.cuda.is_available():
            raise InvalidRequest("device 'cuda' asked for but torch.cuda.is_available() is False")

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def _mod(self):
        return torch.cuda

    def empty_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def new_stream(self) -> Any:
        return self._mod().Stream(device=self.device)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Any) -> Any:
        mod = self._mod()
        # the side stream must not start before producers on the compute stream finished
        stream.wait_stream(mod.current_stream(self.device))
        with mod.stream(stream):
            dst.copy_(src, non_blocking=True)
            ev = mod.Event()
            ev.record(stream)
        # keep both tensors alive until the copy ran on the side stream
        dst.record_stream(stream) if dst.device.type != "cpu" else src.record_stream(stream)
        return ev

    def wait_event(self, event: Any) -> None:
        if event is not None:
            self._mod().current_stream(self.device).wait_event(event)

    def sync_event(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def synchronize(self) -> None:
        self._mod().synchronize(self.device)


class NpuBackend(CudaBackend):
    """Ascend NPU through ``torch_npu``: the CUDA call sequence on ``torch.npu``."""

    name = "npu"

    def __init__(self, index: int = 0):
        DeviceBackend.__init__(self, index)
        try:
            importlib.import_module("torch_npu")
        except ImportError as exc:
            raise InvalidRequest(
                "device 'npu' needs torch_npu (pip install torch-npu matching your torch and CANN)"
            ) from exc
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            raise InvalidRequest("device 'npu' asked for but torch.npu.is_available() is False")

    @property
    def device(self) -> torch.device:
        return torch.device("npu", self.index)

    def _mod(self):
        return torch.npu  # type: ignore[attr-defined]


BACKENDS: dict[str, Callable[[int], DeviceBackend]] = {
    "cpu": DeviceBackend,
    "cuda": CudaBackend,
    "npu": NpuBackend,
}


def get_backend(spec: str) -> DeviceBackend:
    """``"cpu"``, ``"cuda"``, ``"cuda:1"``, ``"npu:0"`` -> a backend instance.

    An unknown name or an index that is not a non-negative integer raises ``InvalidRequest``.
    """
    if not isinstance(spec, str):
        raise InvalidRequest(f"a device is a string such as 'cpu' or 'cuda:0', got {spec!r}")
    name, sep, idx = spec.partition(":")
    try:
        factory = BACKENDS[name]
    except KeyError:
        raise InvalidRequest(f"unknown device backend {spec!r}; known: {sorted(BACKENDS)}") from None
    if sep and not (idx.isascii() and idx.isdigit()):
        raise InvalidRequest(f"device {spec!r}: the index after ':' must be a non-negative integer, "
                             f"as in '{name}:0'")
    return factory(int(idx) if idx else 0)


class BufferPool:
    """Reusable host staging buffers by size class (see the module docstring)."""

    def __init__(self, backend: DeviceBackend, max_buffers_per_size: int = 64):
        self.backend = backend
        self.max_per_size = max_buffers_per_size
        self._free: dict[int, list[torch.Tensor]] = {}
        self._count: dict[int, int] = {}
        self._cv = threading.Condition()
        self.allocations = 0
        self.reuses = 0

    def acquire(self, nbytes: int, timeout: float | None = None) -> torch.Tensor | None:
        with self._cv:
            free = self._free.setdefault(nbytes, [])
            room = lambda: self._count.get(nbytes, 0) < self.max_per_size  # noqa: E731
            if not self._cv.wait_for(lambda: bool(free) or room(), timeout=timeout):
                return None
            if free:
                self.reuses += 1
                return free.pop()
            return self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """A new buffer, counted only once it exists: a failed (pinned) allocation takes no slot.

        The caller holds the lock and has checked that the size class has room.
        """
        buf = self.backend.empty_host(nbytes)
        self._count[nbytes] = self._count.get(nbytes, 0) + 1
        self.allocations += 1
        return buf

    def acquire_many(self, nbytes: int, n: int, timeout: float | None = None) -> list[torch.Tensor]:
        """Up to ``n`` buffers under one lock; waits at most ``timeout`` in all (not per buffer).

        Returns fewer than ``n`` (possibly none) when the pool stays exhausted until the deadline:
        the same shortfall as ``acquire``, for a whole batch.
        """
        out: list[torch.Tensor] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            free = self._free.setdefault(nbytes, [])
            try:
                while len(out) < n:
                    if free:
                        self.reuses += 1
                        out.append(free.pop())
                    elif self._count.get(nbytes, 0) < self.max_per_size:
                        out.append(self._allocate(nbytes))
                    else:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            break
                        self._cv.wait(left)
            except BaseException:  # an allocation failed: what was taken goes back, not lost
                free.extend(out)
                self._cv.notify_all()
                raise
        return out

    def acquire_some(self, nbytes: int, n: int, timeout: float | None = None) -> list[torch.Tensor]:
        """Between 1 and ``n`` buffers: waits at most ``timeout`` for the first, then takes what
        is free (or may be allocated) at once, never waiting for more. ``[]`` when none came in
        time. For a caller that works in chunks bounded by the pool (the save path) and would
        rather start on what it can get than wait for a whole batch."""
        first = self.acquire(nbytes, timeout=timeout) if n > 0 else None
        if first is None:
            return []
        try:
            return [first] + self.acquire_many(nbytes, n - 1, timeout=0)
        except BaseException:  # an allocation for the rest failed: the first one goes back too
            self.release(first)
            raise

    def release(self, buf: torch.Tensor) -> None:
        with self._cv:
            self._free.setdefault(buf.numel(), []).append(buf)
            self._cv.notify_all()

    def detach(self, buf: torch.Tensor) -> None:
        """Give up an acquired buffer for good (it is not released; its slot is freed)."""
        with self._cv:
            n = buf.numel()
            if self._count.get(n, 0) < 1:
                raise RuntimeError(f"BufferPool.detach of a {n}-byte buffer the pool never handed out: a bug")
            self._count[n] -= 1
            self._cv.notify_all()
