"""Transfer path pieces: backend registry, staging buffer pool, host LRU tier, gateway guards."""

from __future__ import annotations

import importlib.util
import threading

import pytest
import torch

from engine_plugin.tiers import HostCache, Metrics, StoreGateway
from engine_plugin.transfer import BACKENDS, BufferPool, DeviceBackend, get_backend
from kvstore.errors import InvalidRequest


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


def test_host_cache_lru_by_bytes():
    evicted = []
    hc = HostCache(3 * 64, on_evict=lambda k, key, t: evicted.append(key))
    for i in range(3):
        assert hc.put("block", bytes([i]) * 16, torch.zeros(16))
    hc.get("block", bytes([0]) * 16)  # refresh 0: 1 is now the oldest
    hc.put("block", bytes([3]) * 16, torch.zeros(16))
    assert evicted == [bytes([1]) * 16] and hc.used_bytes == 3 * 64 and len(hc) == 3
    assert not hc.put("block", b"x" * 16, torch.zeros(100))  # larger than the whole tier


def test_gateway_without_store_is_a_shortfall():
    gw = StoreGateway(None, Metrics())
    assert gw.lookup([b"k" * 16]) is None
    assert gw.get_many([b"k" * 16], kind="block", nbytes=4) == [None]
    assert gw.put_many([]) is False
    gw.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_host_copy_is_exact_for_any_dtype_and_layout(dtype):
    from engine_plugin.transfer import host_copy

    src = (torch.arange(24) % 7).to(dtype).view(4, 6)
    dst = torch.zeros(4, 6, dtype=dtype)
    host_copy(dst, src)
    assert torch.equal(dst, src)
    dst_t = torch.zeros(6, 4, dtype=dtype)
    host_copy(dst_t, src.t())  # non-contiguous source: falls back to Tensor.copy_
    assert torch.equal(dst_t, src.t())
