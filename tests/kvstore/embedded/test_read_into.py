"""``get_many_into`` and ``kvstore.api.read_into``: payloads land in caller buffers, verified there.

The same cases run against the embedded store's native method and against the
``get_many`` fallback of ``read_into`` (a store that lacks the method), so both
sides of the contract in ``kvstore.api`` are held to the same guarantees.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvstore
from kvstore import InvalidRequest, PutItem
from kvstore.embedded import codec
from kvstore.api import EntryInfo, EntryKind, Layout, ReadsInto, read_into, writable_view
from kvstore.errors import CorruptData

from tests.kvstore.conftest import assert_clean, value_for
from tests.fragments import fragment_refs

N = 12


class GetManyOnly:
    """A store with only the plain protocol (as the remote and sharded clients are today)."""

    def __init__(self, store):
        self._s = store

    def get_many(self, keys, *, kind="block"):
        return self._s.get_many(keys, kind=kind)


@pytest.fixture(params=["native", "fallback"])
def reader(request, store):
    """``read(keys, outs, kind)`` through the store's method or through the fallback."""
    target = store if request.param == "native" else GetManyOnly(store)
    return lambda keys, outs, kind="block": read_into(target, keys, outs, kind=kind)


def _bufs(n: int, size: int) -> list[np.ndarray]:
    return [np.full(size, 0xAB, dtype=np.uint8) for _ in range(n)]


def test_the_embedded_store_reads_into_natively(store):
    assert isinstance(store, ReadsInto)
    assert not isinstance(GetManyOnly(store), ReadsInto)


@pytest.mark.parametrize("compressible", [True, False], ids=["zstd", "raw"])
def test_round_trip(store, reader, keys, compressible):
    vals = [value_for(k, 6000) if compressible else os.urandom(6000) for k in keys[:N]]
    store.put_many([PutItem(k, v, tokens=16) for k, v in zip(keys, vals)])
    outs = _bufs(N, 6000 + 100)  # larger than the entries: only the first nbytes are written
    infos = reader(keys[:N], outs)
    for k, v, out, info in zip(keys, vals, outs, infos):
        assert isinstance(info, EntryInfo) and info.key == k and info.kind is EntryKind.BLOCK
        assert info.nbytes == 6000
        assert out[:6000].tobytes() == v
        assert (out[6000:] == 0xAB).all()
    assert_clean(store)


def test_header_comes_back_natively(store, keys):
    arr = np.arange(2 * 16 * 8, dtype=np.float16).reshape(2, 16, 8)
    store.put(keys[0], arr, tokens=16, kind="swa")
    out = np.zeros_like(arr)
    (info,) = store.get_many_into([keys[0]], [out], kind="swa")
    assert info == EntryInfo(keys[0], EntryKind.SWA, arr.nbytes, Layout("float16", (2, 16, 8)), 16)
    assert np.array_equal(out, arr)
    assert store.counters["bytes_out"] == arr.nbytes


def test_into_tensor_storage_views(store, keys):
    torch = pytest.importorskip("torch")
    v = os.urandom(4096)
    store.put(keys[0], v)
    t = torch.empty(4096, dtype=torch.uint8)  # the plugin passes staging tensors this way
    (info,) = store.get_many_into([keys[0]], [t.numpy()])
    assert info.nbytes == 4096 and t.numpy().tobytes() == v


def test_too_small_buffer_is_misuse(store, reader, keys):
    store.put_many([PutItem(k, value_for(k)) for k in keys[:3]])
    outs = _bufs(3, 4000)
    outs[1] = np.zeros(3999, dtype=np.uint8)
    with pytest.raises(InvalidRequest, match=r"outs\[1\] holds 3999 bytes"):
        reader(keys[:3], outs)


def test_native_size_check_happens_before_any_read(store, keys):
    store.put_many([PutItem(k, value_for(k)) for k in keys[:3]])
    outs = _bufs(3, 4000)
    outs[2] = np.zeros(10, dtype=np.uint8)
    with pytest.raises(InvalidRequest):
        store.get_many_into(keys[:3], outs)
    assert (outs[0] == 0xAB).all() and store.counters["gets"] == 0


@pytest.mark.parametrize("bad, match", [
    (lambda: b"\0" * 4000, "read-only"),
    (lambda: np.zeros((4000, 2), dtype=np.uint8)[:, 0], "C-contiguous"),
    (lambda: 4000, "buffer protocol"),
])
def test_unusable_buffers_are_misuse(store, reader, keys, bad, match):
    store.put(keys[0], value_for(keys[0]))
    with pytest.raises(InvalidRequest, match=match):
        reader([keys[0]], [bad()])


def test_count_mismatch_is_misuse(store, reader, keys):
    with pytest.raises(InvalidRequest, match="2 keys but 1"):
        reader(keys[:2], _bufs(1, 10))


def test_missing_and_expired_are_none(store, reader, keys, clock):
    store.put(keys[0], value_for(keys[0]))
    store.put(keys[1], value_for(keys[1]), ttl_s=5)
    clock.advance(10)
    outs = _bufs(3, 4000)
    infos = reader([keys[0], keys[1], keys[2]], outs)
    assert infos[0] is not None and infos[1] is None and infos[2] is None
    assert outs[0].tobytes() == value_for(keys[0])


def test_kinds_are_separate(store, reader, keys):
    store.put(keys[0], b"b" * 100, kind="block")
    store.put(keys[0], b"s" * 200, kind="swa")
    out = _bufs(1, 300)
    (info,) = reader([keys[0]], out, "swa")
    assert info.nbytes == 200 and info.kind is EntryKind.SWA and out[0][:200].tobytes() == b"s" * 200


def _flip(path, at=-10):
    b = bytearray(path.read_bytes())
    b[at] ^= 0xFF
    path.write_bytes(bytes(b))


@pytest.mark.parametrize("compressible", [True, False], ids=["zstd", "raw"])
@pytest.mark.parametrize("frag", [0, 3])
def test_corrupt_data_fragment_is_reconstructed_into_the_buffer(store, reader, keys, compressible, frag):
    vals = [value_for(k, 6000) if compressible else os.urandom(6000) for k in keys[:4]]
    store.put_many([PutItem(k, v) for k, v in zip(keys, vals)])
    _flip(fragment_refs(store, keys[1])[frag])
    outs = _bufs(4, 6000)
    infos = reader(keys[:4], outs)
    assert all(i is not None for i in infos)
    assert [o.tobytes() for o in outs] == vals
    assert store.counters["degraded_reads"] == 1
    store.check(fix=True)
    assert_clean(store)


def test_unrecoverable_is_none_and_marked_lost(store, reader, keys):
    store.put_many([PutItem(k, value_for(k, 6000)) for k in keys[:4]])
    for f in fragment_refs(store, keys[2])[:3]:  # m + 1 = 3 damaged of 4+2
        _flip(f)
    outs = _bufs(4, 6000)
    infos = reader(keys[:4], outs)
    assert [i is None for i in infos] == [False, False, True, False]
    assert outs[3].tobytes() == value_for(keys[3], 6000)
    assert store.lookup(keys[:4]).hit_blocks == 2


def test_plain_copy_store(data_dir, keys, clock):
    """k=1, m=0: the single fragment is the data piece; corruption there is unrecoverable."""
    with kvstore.connect(str(data_dir), ec_k=1, ec_m=0, fsync=False, clock=clock) as s:
        s.put_many([PutItem(k, os.urandom(5000)) for k in keys[:2]])
        want = s.get_many(keys[:2])
        _flip(fragment_refs(s, keys[1])[0])
        outs = _bufs(2, 5000)
        infos = s.get_many_into(keys[:2], outs)
        assert infos[1] is None and outs[0].tobytes() == want[0]


# ----------------------------------------------------------------------------- codec level


def _entry(payload: bytes, compression: str) -> bytes:
    return codec.encode_entry(b"k" * 16, EntryKind.BLOCK, payload, Layout.for_bytes(len(payload)), 0,
                              compression=compression, zstd_level=3, min_ratio=1.1)


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_codec_pieces_into_matches_decode_entry(compression):
    payload = bytes(range(256)) * 40
    buf = _entry(payload, compression)
    pieces = [memoryview(buf)[i:i + 1000] for i in range(0, len(buf), 1000)]
    out = writable_view(bytearray(len(payload)))
    h = codec.decode_entry_pieces_into(pieces, out, max_plain=1 << 20)
    assert h.plain_len == len(payload) and bytes(out) == payload
    assert h.codec == (codec.CODEC_ZSTD if compression == "zstd" else codec.CODEC_RAW)


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_codec_into_rejects_a_flipped_payload_bit(compression):
    payload = bytes(range(256)) * 40
    buf = bytearray(_entry(payload, compression))
    buf[-5] ^= 0x01
    with pytest.raises(CorruptData):
        codec.decode_entry_into(bytes(buf), writable_view(bytearray(len(payload))), max_plain=1 << 20)


def test_codec_into_rejects_an_entry_larger_than_the_buffer():
    payload = os.urandom(1000)
    with pytest.raises(CorruptData, match="buffer"):
        codec.decode_entry_into(_entry(payload, "none"), writable_view(bytearray(999)), max_plain=1 << 20)


def test_codec_into_rejects_zstd_that_decodes_too_long():
    payload = b"x" * 4000
    buf = bytearray(_entry(payload, "zstd"))
    h = codec.decode_entry_header(buf, max_plain=1 << 20)
    buf[8:16] = (3000).to_bytes(8, "little")  # header claims fewer plain bytes than the frame holds
    with pytest.raises(CorruptData):
        codec.decode_entry_into(bytes(buf), writable_view(bytearray(h.plain_len)), max_plain=1 << 20)
