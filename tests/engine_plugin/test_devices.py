"""Transfer path pieces: backend registry, staging buffer pool, host LRU tier, gateway guards."""

from __future__ import annotations

import importlib.util
import logging
import threading
import time

import numpy as np
import pytest
import torch

from engine_plugin.devices import BACKENDS, BufferPool, DeviceBackend, get_backend
from engine_plugin.tiers import HostCache, Metrics, StoreGateway
from kvstore.api import EntryInfo, EntryKind
from kvstore.errors import InvalidRequest, StoreUnavailable


def test_backend_registry():
    assert set(BACKENDS) >= {"cpu", "cuda", "npu"}
    cpu = get_backend("cpu")
    dst, src = torch.zeros(4), torch.arange(4.0)
    cpu.sync_event(cpu.copy_async(dst, src, cpu.new_stream()))
    assert torch.equal(dst, src)
    with pytest.raises(InvalidRequest, match="known"):
        get_backend("tpu")


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu installed")
def test_npu_without_torch_npu_says_what_to_install():
    with pytest.raises(InvalidRequest, match="torch_npu"):
        get_backend("npu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present")
def test_cuda_absent_is_a_clear_error():
    with pytest.raises(InvalidRequest, match="cuda"):
        get_backend("cuda")


def test_buffer_pool_reuses_and_applies_backpressure():
    pool = BufferPool(DeviceBackend(), max_buffers_per_size=2)
    a, b = pool.acquire(64), pool.acquire(64)
    assert pool.acquire(64, timeout=0.01) is None  # exhausted: a shortfall, not a hang
    pool.release(a)
    assert pool.acquire(64, timeout=0.01) is a and pool.allocations == 2 and pool.reuses == 1
    got = []
    t = threading.Thread(target=lambda: got.append(pool.acquire(64, timeout=2)))
    t.start()
    pool.release(b)
    t.join()
    assert got == [b]


def test_buffer_pool_acquire_many_is_bounded_by_one_timeout():
    pool = BufferPool(DeviceBackend(), max_buffers_per_size=3)
    a = pool.acquire(64)
    pool.release(a)
    got = pool.acquire_many(64, 5, timeout=0.05)  # 1 reused + 2 new, then 0.05 s for the rest
    assert len(got) == 3 and got[0] is a and pool.allocations == 3 and pool.reuses == 1
    assert pool.acquire_many(64, 2, timeout=0.01) == []  # exhausted: a shortfall, not a hang
    threading.Timer(0.05, pool.release, (got[1],)).start()
    assert pool.acquire_many(64, 2, timeout=0.3) == [got[1]]  # woken by the release, then times out
    assert pool.acquire_many(64, 0) == []


def test_host_cache_lru_by_bytes():
    evicted = []
    hc = HostCache(3 * 64, on_evict=lambda k, key, t: evicted.append(key))
    for i in range(3):
        assert hc.put("block", bytes([i]) * 16, torch.zeros(16))
    hc.get("block", bytes([0]) * 16)  # refresh 0: 1 is now the oldest
    hc.put("block", bytes([3]) * 16, torch.zeros(16))
    assert evicted == [bytes([1]) * 16] and hc.used_bytes == 3 * 64 and len(hc) == 3
    assert not hc.put("block", b"x" * 16, torch.zeros(100))  # larger than the whole tier


def test_host_cache_hands_every_evicted_entry_over_when_a_callback_raises(caplog):
    """One put evicts three entries and ``on_evict`` raises for the first two: the third is
    still handed over (before: it was not, and its write-back save was lost), the first error
    is raised after that, the second is logged, and the tier holds exactly the new entry."""
    handed = []

    def on_evict(kind, key, t):
        handed.append(key)
        if len(handed) < 3:
            raise RuntimeError(f"injected: write-back of {key[:1].hex()} failed")
    hc = HostCache(3 * 64, on_evict=on_evict)
    keys = [bytes([i]) * 16 for i in range(3)]
    for k in keys:
        assert hc.put("block", k, torch.zeros(16))
    with caplog.at_level(logging.ERROR, logger="engine_plugin.tiers"):
        with pytest.raises(RuntimeError, match="write-back of 00 failed") as ei:
            hc.put("block", b"n" * 16, torch.zeros(48))
    assert handed == keys
    assert any("1 more on_evict" in n for n in ei.value.__notes__)
    logged = [r for r in caplog.records if r.exc_info and "write-back of 01" in str(r.exc_info[1])]
    assert len(logged) == 1, caplog.text
    assert [hk for hk, _ in hc.items()] == [("block", b"n" * 16)] and hc.used_bytes == 3 * 64
    assert hc.evictions == 3 and all(("block", k) not in hc for k in keys)


def test_gateway_without_store_is_a_shortfall():
    gw = StoreGateway(None, Metrics())
    assert gw.lookup([b"k" * 16]) is None
    assert gw.get_many([b"k" * 16], kind="block", nbytes=4) == [None]
    assert gw.put_many([]) is False
    gw.close()


class _NativeStub:
    """A ``ReadsInto`` store in a few lines: fills each buffer with 1s, optionally slow or failing."""

    def __init__(self, delay_s: float = 0.0, exc: Exception | None = None):
        self.delay_s, self.exc = delay_s, exc

    def get_many_into(self, keys, outs, *, kind="block"):
        time.sleep(self.delay_s)
        if self.exc is not None:
            raise self.exc
        for o in outs:
            o[:4] = 1
        return [EntryInfo(k, EntryKind.BLOCK, 4) for k in keys]

    def get_many(self, keys, *, kind="block"):
        return [b"\x01" * 4 for _ in keys]


def test_gateway_inline_read_is_never_abandoned_but_trips_the_breaker():
    m = Metrics()
    gw = StoreGateway(_NativeStub(delay_s=0.15), m, timeout_s=0.05, backoff_s=60)
    outs = [np.zeros(4, np.uint8) for _ in range(2)]
    res = gw.read_into([b"k" * 16, b"j" * 16], outs, kind="block", nbytes=4, inline=True)
    assert res.ok == [True, True] and res.late and res.pending is None  # finished: kept
    assert all((o == 1).all() for o in outs) and m.get("store_timeouts") == 1 and not gw.available
    gw.close()
    gw = StoreGateway(_NativeStub(exc=StoreUnavailable("down")), m, timeout_s=0.05, backoff_s=60)
    res = gw.read_into([b"k" * 16], [np.zeros(4, np.uint8)], kind="block", nbytes=4, inline=True)
    assert res.ok == [False] and not res.late and m.get("store_errors") == 1 and not gw.available
    assert gw.read_into([b"k" * 16], [np.zeros(4, np.uint8)], kind="block", nbytes=4,
                        inline=True).ok == [False] and m.get("store_skipped") == 1  # breaker open
    gw.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_host_copy_is_exact_for_any_dtype_and_layout(dtype):
    from engine_plugin.devices import host_copy

    src = (torch.arange(24) % 7).to(dtype).view(4, 6)
    dst = torch.zeros(4, 6, dtype=dtype)
    host_copy(dst, src)
    assert torch.equal(dst, src)
    dst_t = torch.zeros(6, 4, dtype=dtype)
    host_copy(dst_t, src.t())  # non-contiguous source: falls back to Tensor.copy_
    assert torch.equal(dst_t, src.t())


def outstanding(pool: BufferPool) -> int:
    """Buffers the pool handed out that are neither back (released) nor given up (detached)."""
    with pool._cv:
        return sum(n - len(pool._free.get(size, [])) for size, n in pool._count.items())


class FailingAllocations(DeviceBackend):
    """``empty_host`` succeeds ``ok`` more times, then raises, as a pinned allocation can."""

    def __init__(self, ok: int):
        super().__init__()
        self.ok = ok

    def empty_host(self, nbytes: int) -> torch.Tensor:
        if self.ok <= 0:
            raise RuntimeError("injected: the pinned allocation failed")
        self.ok -= 1
        return super().empty_host(nbytes)


def test_a_failed_allocation_loses_no_buffer_and_no_slot():
    """What was taken before the failure goes back, and the failed allocation takes no slot:
    the pool keeps its full size (it must not shrink by every buffer in flight, for good)."""
    backend = FailingAllocations(ok=2)
    pool = BufferPool(backend, max_buffers_per_size=4)
    with pytest.raises(RuntimeError, match="injected"):
        pool.acquire_some(64, 3)  # the first by acquire, the second by acquire_many, the third fails
    assert outstanding(pool) == 0
    with pytest.raises(RuntimeError, match="injected"):
        pool.acquire_many(64, 3, timeout=0)  # two free ones, then an allocation fails
    assert outstanding(pool) == 0
    backend.ok = 2
    got = pool.acquire_many(64, 5, timeout=0)
    assert len(got) == 4 and pool.allocations == 4 and outstanding(pool) == 4
