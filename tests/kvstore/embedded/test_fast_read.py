"""The local read fast paths (``LocalFastReads.read_fast`` and ``read_scatter``).

They skip the per-fragment checksums of data fragments 1..k-1 and trust the entry
checksum instead; these tests hold them to the same guarantee as the verifying path:
a byte flipped anywhere in any fragment file never changes what a read returns
(payload, tokens, layout), and a flip the fast path cannot use sends the read down the
verifying path, which counts the degraded read.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import kvstore
from kvstore.api import EntryKind
from kvstore.embedded import codec
from kvstore.embedded.fastread import LocalFastReads
from kvstore.embedded.index import ekey
from tests.fragments import fragment_refs


@pytest.fixture
def spy(monkeypatch):
    """Counts of reads each fast path answered (``None`` means it handed over)."""
    hits = {"fast": 0, "scatter": 0}
    for name, attr in (("fast", "read_fast"), ("scatter", "read_scatter")):
        orig = getattr(LocalFastReads, attr)

        def wrapped(self, *a, _orig=orig, _name=name):
            got = _orig(self, *a)
            hits[_name] += got is not None
            return got

        monkeypatch.setattr(LocalFastReads, attr, wrapped)
    return hits


@pytest.mark.parametrize("ec", [(4, 2), (3, 1), (1, 0)], ids=["4+2", "3+1", "1+0"])
def test_round_trip_over_sizes(tmp_path, spy, ec):
    s = kvstore.connect(str(tmp_path / "s"), fsync=False, compression="none", ec_k=ec[0], ec_m=ec[1])
    try:
        for size in (0, 1, 63, 100, 1000, 4095, 65536, 131072 + 3, 1 << 20):
            key, val = os.urandom(16), os.urandom(size)
            s.put(key, val, tokens=size % 97)
            e = s.get_entry(key)
            assert e.data == val and e.tokens == size % 97
            out = bytearray(size + 7)
            info = s.get_many_into([key], [out])[0]
            assert info is not None and bytes(out[:size]) == val and info.tokens == size % 97
        # Every get_entry took a fast path: ``_read_fast``, or ``_read_scatter`` straight into the
        # returned bytes from ``fastread.FRESH_BYTES_MIN`` on (131075 and 1 MiB; and 65536 at 1+0,
        # whose entry header needs no padding share); every large enough get_many_into the latter.
        assert spy["fast"] + spy["scatter"] >= 9 + 4
        assert spy["scatter"] >= 4 + 2
    finally:
        s.close()


def _entry_len(store, key: bytes) -> int:
    from kvstore.api import EntryKind
    from kvstore.embedded.index import ekey

    with store.index.env.begin() as txn:
        return store.index.get_meta(txn, ekey(EntryKind.BLOCK.code, key)).entry_len


def _put_flipped(store, frag: int, off: int, mask: int, value, **put) -> bytes:
    """A fresh entry's key, put with ``put`` and with byte ``off`` of its fragment ``frag``
    XORed with ``mask``."""
    key = os.urandom(16)
    store.put(key, value, **put)
    ref = fragment_refs(store, key)[frag]
    raw = bytearray(ref.read_bytes())
    raw[off] ^= mask
    ref.write_bytes(bytes(raw))
    return key


def test_a_flipped_byte_anywhere_never_changes_the_result(tmp_path):
    s = kvstore.connect(str(tmp_path / "s"), fsync=False, compression="none")
    k = s.config.ec_k
    arr = np.random.default_rng(0).standard_normal((3, 5000)).astype(np.float16)
    try:
        probe = os.urandom(16)
        s.put(probe, arr, tokens=77)
        size = fragment_refs(s, probe)[0].length
        share = size - codec.FRAG_HEADER_LEN - 80  # the ISA-L code's own header is 80 bytes
        padding = k * share - _entry_len(s, probe)
        lead = codec.FRAG_HEADER_LEN
        offsets = [0, 8, lead - 4, lead + 2, lead + 85, lead + 100, lead + 150, size // 2, size - 1]
        for frag in range(k):
            for off in offsets:
                key = _put_flipped(s, frag, off, 0x5A, arr, tokens=77)
                before = s.counters["degraded_reads"]
                e = s.get_entry(key)
                assert e.data == arr.tobytes() and e.tokens == 77, (frag, off)
                assert e.layout.shape == (3, 5000), (frag, off)
                out = np.zeros(arr.size, dtype=np.float16)
                info = s.get_many_into([key], [out])[0]
                assert info is not None and info.tokens == 77 and np.array_equal(out, arr.ravel()), (frag, off)
                unused = (frag == k - 1 and off >= size - padding) or (
                    frag > 0 and lead - 8 <= off < lead)
                if not unused:
                    # (unused by the fast path, so unseen until a scrub: the code's zero padding,
                    # and the frame checksums of fragments 1..k-1, whose bytes it does not check)
                    assert s.counters["degraded_reads"] > before, (frag, off, "damage must be seen")
    finally:
        s.close()


@pytest.mark.parametrize("shape", [(2, 4), (1, 1, 1, 1, 1, 1, 1, 3)], ids=["2d", "8d"])
def test_a_small_entrys_header_in_later_fragments_is_verified(tmp_path, shape):
    """A small entry's header (its layout: dtype, dims) runs on past fragment 0 into data
    fragments 1..k-1, outside the entry checksum. A byte flipped anywhere in those fragments'
    bodies never changes the layout, payload or tokens a read returns, and is seen (a degraded
    read). Before, the fast path returned e.g. int8 for uint8, or a shape of 2**63 elements."""
    from kvstore import Layout

    s = kvstore.connect(str(tmp_path / "s"), fsync=False)
    layout = Layout("uint8", shape)
    val = bytes(range(int(np.prod(shape))))
    try:
        probe = os.urandom(16)
        s.put(probe, val, layout=layout, tokens=5)
        assert _entry_len(s, probe) > len(fragment_refs(s, probe)[0].read_bytes()) - codec.FRAG_HEADER_LEN - 80
        for frag in range(1, s.config.ec_k):
            size = fragment_refs(s, probe)[frag].length
            for off in range(codec.FRAG_HEADER_LEN + 80, size):  # the fragment's share of the entry
                key = _put_flipped(s, frag, off, 0x01, val, layout=layout, tokens=5)
                before = s.counters["degraded_reads"]
                e = s.get_entry(key)
                assert (e.data, e.layout, e.tokens) == (val, layout, 5), (frag, off)
                out = bytearray(len(val))
                info = s.get_many_into([key], [out])[0]
                assert (bytes(out), info.layout, info.tokens) == (val, layout, 5), (frag, off)
                assert s.counters["degraded_reads"] > before, (frag, off, "damage must be seen")
    finally:
        s.close()


def test_a_large_get_is_read_straight_into_the_bytes_it_returns(tmp_path, spy):
    """From ``fastread.FRESH_BYTES_MIN`` on, a get of a raw entry is read by ``_read_scatter``
    into a new ``bytes`` (no joined copy). What it returns is an ordinary, independent bytes
    object; a byte flipped in any data fragment is seen (a degraded read) and never returned,
    and a compressed entry still reads through the other path."""
    from kvstore.embedded.fastread import FRESH_BYTES_MIN

    s = kvstore.connect(str(tmp_path / "s"), fsync=False, compression="none")
    z = kvstore.connect(str(tmp_path / "z"), fsync=False, compression="zstd", min_compress_ratio=1.0)
    val = np.random.default_rng(1).standard_normal(FRESH_BYTES_MIN).astype(np.float16).tobytes()
    try:
        key = os.urandom(16)
        s.put(key, val)
        a, b = s.get(key), s.get(key)
        assert type(a) is bytes and a == val and b == val and a is not b and hash(a) == hash(val)
        assert spy["scatter"] == 2 and spy["fast"] == 0
        for frag in range(s.config.ec_k):
            size = fragment_refs(s, key)[frag].length
            last = size - 1 if frag < s.config.ec_k - 1 else size - 64  # (the code's zero padding ends the last)
            for off in (0, codec.FRAG_HEADER_LEN + 100, size // 2, last):
                bad = _put_flipped(s, frag, off, 0xFF, val)
                before = s.counters["degraded_reads"]
                assert s.get(bad) == val, (frag, off)
                assert s.counters["degraded_reads"] > before, (frag, off, "damage must be seen")
        zkey = os.urandom(16)
        z.put(zkey, bytes(len(val)))
        assert z.get(zkey) == bytes(len(val)) and spy["fast"] == 1
    finally:
        s.close()
        z.close()


# ----------------------------------------------------------------------------- kept pack descriptors
def _packed_store(tmp_path, n: int = 8, size: int = 20000):
    s = kvstore.connect(str(tmp_path / "s"), fsync=False, compression="none")
    vals = {os.urandom(16): os.urandom(size) for _ in range(n)}
    s.put_many([kvstore.PutItem(k, v) for k, v in vals.items()])
    assert all(r.packed for k in vals for r in fragment_refs(s, k))
    return s, vals


@pytest.fixture
def opens(monkeypatch):
    """The pack files ``os.open`` opened."""
    seen: list[str] = []
    real = os.open

    def counting(path, flags, *a, **kw):
        if str(path).endswith(".pack"):
            seen.append(str(path))
        return real(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", counting)
    return seen


def test_gets_of_packed_entries_reuse_kept_descriptors(tmp_path, spy, opens):
    s, vals = _packed_store(tmp_path)
    del opens[:]  # those of the put
    try:
        assert s.get_many(list(vals)) == list(vals.values())
        first = len(opens)
        assert 0 < first <= s.config.ec_k + s.config.ec_m  # one per pack (target) read, not per fragment
        for _ in range(3):
            for k, v in vals.items():
                assert s.get(k) == v
                out = bytearray(len(v))
                assert s.get_many_into([k], [out])[0] is not None and out == v
        assert len(opens) == first and spy["fast"] + spy["scatter"] == 8 + 3 * 2 * 8
    finally:
        s.close()


def test_the_descriptor_bound_holds_in_a_store(tmp_path, opens):
    s, vals = _packed_store(tmp_path, n=4)
    for _ in range(3):  # three more batches: three more packs per target
        more = {os.urandom(16): os.urandom(3000) for _ in range(3)}
        s.put_many([kvstore.PutItem(k, v) for k, v in more.items()])
        vals.update(more)
    files = s.fragments.reader.files
    files.capacity = 2
    try:
        for _ in range(2):
            assert s.get_many(list(vals)) == list(vals.values())
            assert len(files) <= 2
    finally:
        s.close()


def test_a_pack_deleted_under_a_kept_descriptor(tmp_path, spy):
    """Deleted after its descriptor was kept: the same verified bytes through it (a pack's bytes
    never change); ``check`` opens afresh and reports it; once forgotten (the deleter's hook),
    a get reads parity instead, a degraded read with the right bytes."""
    from kvstore.maintenance.problems import ProblemKind

    s, vals = _packed_store(tmp_path, n=4)
    try:
        k0 = next(iter(vals))
        assert s.get(k0) == vals[k0]
        ref = fragment_refs(s, k0)[0]
        ref.path.unlink()
        assert s.get(k0) == vals[k0] and s.counters["degraded_reads"] == 0
        assert {p.kind for p in s.check()} == {ProblemKind.MISSING_FRAGMENT}
        with s.index.env.begin() as txn:
            gen = s.index.get_meta(txn, ekey(EntryKind.BLOCK.code, k0)).gen
        s.fragments.reader.forget_pack(ref.target, gen)
        assert str(ref.path) not in s.fragments.reader.files._kept
        assert [s.get(k) for k in vals] == list(vals.values())
        data_there = [k for k in vals if any(r.target == ref.target for r in fragment_refs(s, k)[: s.config.ec_k])]
        assert s.counters["degraded_reads"] == len(data_there) > 0
    finally:
        s.close()


def test_closing_the_store_closes_its_descriptors(tmp_path):
    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    s, vals = _packed_store(tmp_path)
    s.close()
    before = fds()
    s = kvstore.connect(str(tmp_path / "s"), fsync=False)
    assert s.get_many(list(vals)) == list(vals.values())
    assert len(s.fragments.reader.files) > 0
    s.close()
    assert fds() == before


def test_concurrent_readers_of_packed_entries(tmp_path):
    import threading

    s, vals = _packed_store(tmp_path, n=16, size=70000)
    s.fragments.reader.files.capacity = 3  # fewer than the targets read: evictions race the reads
    wrong: list[bytes] = []
    keys = list(vals)

    def reader(seed: int) -> None:
        for j in range(60):
            k = keys[(seed * 5 + j) % len(keys)]
            if j % 2:
                got = s.get(k)
            else:
                out = bytearray(len(vals[k]))
                s.get_many_into([k], [out])
                got = bytes(out)
            if got != vals[k]:
                wrong.append(k)

    try:
        threads = [threading.Thread(target=reader, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert wrong == [] and s.counters["degraded_reads"] == 0
        assert all(h.refs == 0 for h in s.fragments.reader.files._kept.values())
    finally:
        s.close()
