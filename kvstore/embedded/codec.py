"""Entry and fragment codecs: the bytes that go to disk, and the checks on the way back.

Used by the fragment store's writer and reader (``kvstore.embedded.fragment_writes``,
``kvstore.embedded.fragment_reads``, ``kvstore.embedded.fastread``) and by maintenance that
rebuilds or reindexes fragments. ``encode_entry`` -> ``ErasureCode.encode`` ->
``frame_fragment`` on the write path; ``parse_fragment`` -> ``decode`` ->
``decode_entry`` on the read path (``decode_entry_pieces_into`` /
``decode_entry_into`` when the caller supplies the destination buffer). Every
parser here takes untrusted bytes and either returns verified data (or writes
it into the caller's buffer and verifies it there) or raises ``CorruptData`` /
``IncompatibleFormat``; none of them allocates more than the limits it is given.

Entry (the plain record, before erasure coding), little-endian::

    0      4     6    7     8       16      24     28        44    60    61   62      70      78
    +------+-----+----+-----+-------+-------+------+---------+-----+-----+----+-------+-------+---------+-------+
    | KVE1 | ver |kind|codec| plain | stored|tokens| xxh3-128| key |dtype|ndim|created|expires| dims    |payload|
    |      | u16 | u8 | u8  |len u64|len u64| u32  | of plain| 16 B| u8  | u8 | ns u64| ns u64|ndim*u64 |stored |
    +------+-----+----+-----+-------+-------+------+---------+-----+-----+----+-------+-------+---------+-------+

    codec 0 = raw, 1 = zstd. The checksum covers the *plain* payload, so a
    decompression bug is caught as well as a flipped bit. ``created`` and ``expires``
    (nanoseconds since the epoch, 0 = no expiry) are the put's, as its index record has
    them when it is written; they are what ``kvtool rebuild-index`` (``kvstore.maintenance.reindex``)
    gives an entry back when the index is lost. The key is the key as stored (a daemon's
    tenant key), so a rebuilt index holds every entry under the key it had.

Fragment file (one per target; ``body`` is a pyeclib fragment)::

    0      4     6     7   8   9    10    12    28    36        44       52
    +------+-----+-----+---+---+----+-----+-----+-----+---------+--------+------+
    | KVF1 | ver | idx | k | m |kind| pad | key | gen | entry   | body   | xxh3 | body ...
    |      | u16 | u8  |u8 |u8 | u8 | u16 | 16B | 8 B | len u64 | len u64| u64  |
    +------+-----+-----+---+---+----+-----+-----+-----+---------+--------+------+

    The xxh3-64 covers the header (with the checksum field zeroed) and the body,
    so a swapped, truncated or bit-flipped fragment is rejected *before* pyeclib
    sees it (pyeclib aborts the process on some malformed fragments).
"""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Callable, Iterator, NamedTuple

import xxhash
import zstandard

from kvstore.api import EntryKind, Layout
from kvstore.errors import CorruptData, IncompatibleFormat, InvalidRequest

ENTRY_MAGIC = b"KVE1"
FRAG_MAGIC = b"KVF1"
FORMAT_VERSION = 2  # 2: the entry header carries its created and expiry times (version 1 did not)

_ENTRY_HEAD = struct.Struct("<4sHBBQQI16s16sBBQQ")  # 78 bytes, then ndim * u64 dims
_FRAG_HEAD = struct.Struct("<4sHBBBBH16s8sQQQ")  # 60 bytes
ENTRY_HEADER_MIN = _ENTRY_HEAD.size
ENTRY_HEADER_MAX = ENTRY_HEADER_MIN + 8 * 8  # with 8 dims
MAX_SHARE_PADDING = 64  # zero bytes a code pads each data fragment's share of an entry with, at most
FRAG_HEADER_LEN = _FRAG_HEAD.size

CODEC_RAW = 0
CODEC_ZSTD = 1

_tls = threading.local()  # zstd contexts are not thread-safe; one per thread


def _zc(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_tls, "zc", None)
    if cache is None:
        cache = _tls.zc = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level)
    return c


def _zd() -> zstandard.ZstdDecompressor:
    d = getattr(_tls, "zd", None)
    if d is None:
        d = _tls.zd = zstandard.ZstdDecompressor()
    return d


class EntryHeader(NamedTuple):
    """An entry's header as read back (immutable; a tuple, as every read builds one)."""

    version: int
    kind: EntryKind
    codec: int
    plain_len: int
    stored_len: int
    tokens: int
    checksum: bytes
    key: bytes
    layout: Layout
    header_len: int
    created_ns: int = 0
    expires_ns: int = 0  # 0: no expiry


def encode_entry(
    key: bytes,
    kind: EntryKind,
    payload: bytes | memoryview,
    layout: Layout,
    tokens: int,
    *,
    compression: str,
    zstd_level: int,
    min_ratio: float,
    created_ns: int = 0,
    expires_ns: int = 0,
) -> bytes:
    """Self-describing entry bytes; zstd only when it shrinks by ``min_ratio`` or more.

    Early abort (as btrfs and ZFS do before compressing a whole extent): a payload of at
    least ``2 * ZSTD_PROBE`` bytes is compressed whole only when its first ``ZSTD_PROBE``
    bytes shrink by ``min_ratio``; KV tensors are near-incompressible noise (fp16/bf16
    mantissas), and compressing a 1 MiB block only to throw the result away costs more
    than writing it. A payload whose head is noise and whose tail is not is stored raw.
    """
    plain = memoryview(payload).cast("B")
    stored: bytes | memoryview = plain
    codec = CODEC_RAW
    if compression == "zstd" and len(plain) > 64 and _worth_compressing(plain, zstd_level, min_ratio):
        comp = _zc(zstd_level).compress(plain)
        if len(comp) * min_ratio <= len(plain):
            stored, codec = comp, CODEC_ZSTD
    if not 0 <= tokens < 2**32:
        raise InvalidRequest(f"tokens must be in [0, 2**32), got {tokens}")
    head = _ENTRY_HEAD.pack(
        ENTRY_MAGIC, FORMAT_VERSION, kind.code, codec, len(plain), len(stored), tokens,
        xxhash.xxh3_128_digest(plain), key, layout.dtype_code, len(layout.shape), created_ns, expires_ns,
    )
    dims = struct.pack(f"<{len(layout.shape)}Q", *layout.shape)
    return b"".join((head, dims, stored))


ZSTD_PROBE = 64 * 1024


def _worth_compressing(plain: memoryview, level: int, min_ratio: float) -> bool:
    if len(plain) < 2 * ZSTD_PROBE:
        return True
    return len(_zc(level).compress(plain[:ZSTD_PROBE])) * min_ratio <= ZSTD_PROBE


# Layouts read back, by (dtype code, dims): a model's blocks share a few, and a ``Layout`` is
# immutable, so every read of one shares one object instead of building and checking it anew.
_LAYOUTS_MAX = 1024
_layouts: dict[tuple[int, tuple[int, ...]], Layout] = {}
_DIMS = tuple(struct.Struct(f"<{n}Q") for n in range(9))  # ndim -> its dims' format


def decode_entry_header(buf: bytes | memoryview, *, max_plain: int) -> EntryHeader:
    if len(buf) < ENTRY_HEADER_MIN:
        raise CorruptData(f"entry of {len(buf)} bytes is shorter than its header")
    magic, ver, kind_code, codec, plain_len, stored_len, tokens, csum, key, dt, ndim, created, expires = (
        _ENTRY_HEAD.unpack_from(buf, 0)
    )
    if magic != ENTRY_MAGIC:
        raise CorruptData("entry magic mismatch")
    if ver != FORMAT_VERSION:
        raise IncompatibleFormat(
            f"entry format version {ver}; this kvstore reads version {FORMAT_VERSION}"
        )
    if codec not in (CODEC_RAW, CODEC_ZSTD) or ndim > 8:
        raise CorruptData(f"entry header has codec={codec} ndim={ndim}")
    if plain_len > max_plain or stored_len > max_plain + 1024:
        raise CorruptData(f"entry claims {plain_len} plain bytes, over the limit {max_plain}")
    hlen = ENTRY_HEADER_MIN + 8 * ndim
    if len(buf) < hlen:
        raise CorruptData("entry truncated inside its dims")
    dims = _DIMS[ndim].unpack_from(buf, ENTRY_HEADER_MIN)
    layout = _layouts.get((dt, dims))
    try:
        kind = EntryKind.from_code(kind_code)
        if layout is None:
            layout = Layout.from_code(dt, dims)
            if len(_layouts) >= _LAYOUTS_MAX:
                _layouts.clear()
            _layouts[(dt, dims)] = layout
    except InvalidRequest as exc:
        raise CorruptData(f"entry header: {exc}") from exc
    return EntryHeader(ver, kind, codec, plain_len, stored_len, tokens, csum, key, layout, hlen, created, expires)


def decode_entry(buf: bytes | memoryview, *, max_plain: int) -> tuple[EntryHeader, bytes]:
    """Parse and verify an entry; returns its header and the plain payload."""
    h = decode_entry_header(buf, max_plain=max_plain)
    stored = memoryview(buf)[h.header_len : h.header_len + h.stored_len]
    if len(stored) != h.stored_len:
        raise CorruptData(f"entry payload truncated: {len(stored)} of {h.stored_len} bytes")
    if h.codec == CODEC_ZSTD:
        try:
            plain = _zd().decompress(stored, max_output_size=h.plain_len)
        except zstandard.ZstdError as exc:
            raise CorruptData(f"zstd payload does not decode: {exc}") from exc
    else:
        plain = bytes(stored)
    if len(plain) != h.plain_len or xxhash.xxh3_128_digest(plain) != h.checksum:
        raise CorruptData("entry checksum mismatch")
    return h, plain


def decode_entry_pieces(pieces: list[memoryview], *, max_plain: int) -> tuple[EntryHeader, bytes]:
    """``decode_entry`` over the entry split in pieces (views of fragment bodies).

    For a raw payload whose header fits in the first piece, the plain bytes are
    assembled with a single copy (the hot read path); anything else is joined
    first and handed to ``decode_entry``.
    """
    first = pieces[0]
    if len(first) >= ENTRY_HEADER_MIN + 64:
        h = decode_entry_header(first, max_plain=max_plain)
        if h.codec == CODEC_RAW and len(first) >= h.header_len:
            plain = b"".join([first[h.header_len:], *pieces[1:]])
            if len(plain) < h.stored_len:
                raise CorruptData(f"entry payload truncated: {len(plain)} of {h.stored_len} bytes")
            if len(plain) > h.stored_len:
                plain = plain[: h.stored_len]
            if len(plain) != h.plain_len or xxhash.xxh3_128_digest(plain) != h.checksum:
                raise CorruptData("entry checksum mismatch")
            return h, plain
    return decode_entry(b"".join(pieces), max_plain=max_plain)


def verify_plain(h: EntryHeader, plain: bytes | memoryview) -> None:
    """The entry checksum over the plain bytes where they will be used (never a staging copy)."""
    if len(plain) != h.plain_len or xxhash.xxh3_128_digest(plain) != h.checksum:
        raise CorruptData("entry checksum mismatch")


def _stored_into(h: EntryHeader, pieces: list[memoryview], out: memoryview) -> None:
    """Write the plain payload of an entry whose *stored* bytes are ``pieces`` into ``out``.

    Raw: one copy of each piece into place. Zstd: the compressed pieces are joined (one copy
    of the smaller, compressed bytes) and decompressed straight into ``out`` through a stream
    reader's ``readinto``, so the plain bytes are written once. Verifies the checksum over
    ``out`` before returning.
    """
    if h.plain_len > len(out):
        raise CorruptData(f"entry claims {h.plain_len} plain bytes, the buffer sized from the "
                          f"index holds {len(out)}")
    if sum(len(p) for p in pieces) < h.stored_len:
        raise CorruptData(f"entry payload truncated: fewer than {h.stored_len} stored bytes")
    if h.codec == CODEC_RAW:
        if h.stored_len != h.plain_len:
            raise CorruptData(f"raw entry with {h.stored_len} stored and {h.plain_len} plain bytes")
        pos = 0
        for p in pieces:
            take = min(len(p), h.plain_len - pos)
            out[pos : pos + take] = p[:take]
            pos += take
            if pos == h.plain_len:
                break
        verify_plain(h, out[:pos])
        return
    stored = pieces[0][: h.stored_len] if len(pieces[0]) >= h.stored_len else b"".join(pieces)[: h.stored_len]
    try:
        reader = _zd().stream_reader(stored)
        pos = 0
        while pos < h.plain_len:
            got = reader.readinto(out[pos : h.plain_len])
            if not got:
                break
            pos += got
        if reader.readinto(bytearray(1)):  # more plain bytes than the header says
            raise CorruptData(f"zstd payload decodes to more than {h.plain_len} bytes")
    except zstandard.ZstdError as exc:
        raise CorruptData(f"zstd payload does not decode: {exc}") from exc
    verify_plain(h, out[:pos])


def decode_entry_into(buf: bytes | memoryview, out: memoryview, *, max_plain: int) -> EntryHeader:
    """``decode_entry`` writing the verified plain payload into ``out[:plain_len]``.

    ``out`` is a flat writable byte view (``kvstore.api.writable_view``). A payload longer
    than ``out`` is ``CorruptData`` (the caller sized ``out`` from the index, which vouches
    for the entry). On any error the contents of ``out`` are undefined.
    """
    h = decode_entry_header(buf, max_plain=max_plain)
    stored = memoryview(buf)[h.header_len : h.header_len + h.stored_len]
    if len(stored) != h.stored_len:
        raise CorruptData(f"entry payload truncated: {len(stored)} of {h.stored_len} bytes")
    _stored_into(h, [stored], out)
    return h


def decode_entry_pieces_into(pieces: list[memoryview], out: memoryview, *, max_plain: int) -> EntryHeader:
    """``decode_entry_pieces`` writing into ``out``: the plain bytes go from the fragment
    bodies to ``out`` with a single copy, and the checksum is verified over ``out``.

    ::

        pieces:  | entry header | payload ...  |  payload ...  |  payload ... pad |
                 '--- piece 0 ----------------''--- piece 1 --''--- piece k-1 ---'
        out:                    | payload ........................ |  (plain_len)
    """
    first = pieces[0]
    if len(first) < ENTRY_HEADER_MIN + 64:
        return decode_entry_into(b"".join(pieces), out, max_plain=max_plain)
    h = decode_entry_header(first, max_plain=max_plain)
    if len(first) < h.header_len:
        return decode_entry_into(b"".join(pieces), out, max_plain=max_plain)
    _stored_into(h, [first[h.header_len :], *pieces[1:]], out)
    return h


# ----------------------------------------------------------------------------- fragments


@dataclass(frozen=True, slots=True)
class FragmentHeader:
    index: int
    k: int
    m: int
    kind_code: int
    key: bytes
    gen: bytes
    entry_len: int
    body_len: int


FRAG_ID_LEN = FRAG_HEADER_LEN - 8  # the header up to its checksum: which fragment this is, and its size


def fragment_id(index: int, k: int, m: int, kind_code: int, key: bytes, gen: bytes, entry_len: int,
                body_len: int) -> bytes:
    """The first ``FRAG_ID_LEN`` header bytes of the fragment these fields describe (magic,
    version, index, k, m, kind, key, generation, entry and body lengths). A reader that knows
    all of them from the index compares bytes instead of parsing the header."""
    return _FRAG_HEAD.pack(FRAG_MAGIC, FORMAT_VERSION, index, k, m, kind_code, 0,
                           key, gen, entry_len, body_len, 0)[:FRAG_ID_LEN]


FRAG_INDEX_AT = 6  # the fragment index byte inside ``fragment_id`` (after magic and version)


def fragment_id_at(index: int, buf: memoryview, at: int, id0: bytes) -> bool:
    """Is ``buf[at : at + FRAG_ID_LEN]`` the ``fragment_id`` of fragment ``index`` of the entry
    whose fragment 0 has ``id0``? The ids differ only in the index byte, so one id packed per
    entry serves all of its fragments (the read fast paths). ``buf`` is left as it was."""
    if buf[at + FRAG_INDEX_AT] != index:
        return False
    buf[at + FRAG_INDEX_AT] = 0
    same = buf[at : at + FRAG_ID_LEN] == id0
    buf[at + FRAG_INDEX_AT] = index
    return same


ZERO_CSUM = b"\0" * 8  # the checksum field as hashed: zeros
_CSUM = struct.Struct("<Q")


def fragment_parts(index: int, k: int, m: int, kind_code: int, key: bytes, gen: bytes, entry_len: int,
                   body: bytes) -> list[bytes]:
    """A fragment as [header, body]: written back to back (``writev``) they are the bytes
    ``frame_fragment`` joins, without copying the body (the write path's form)."""
    head = _FRAG_HEAD.pack(FRAG_MAGIC, FORMAT_VERSION, index, k, m, kind_code, 0,
                           key, gen, entry_len, len(body), 0)[:FRAG_ID_LEN]
    x = xxhash.xxh3_64(head)
    x.update(ZERO_CSUM)
    x.update(body)
    return [head + _CSUM.pack(x.intdigest()), body]


def frame_fragment(h: FragmentHeader, body: bytes) -> bytes:
    """One fragment's bytes: header (with the checksum over header and body) then body."""
    return b"".join(fragment_parts(h.index, h.k, h.m, h.kind_code, h.key, h.gen, h.entry_len, body))


def fragment_checksum(buf: bytes | memoryview) -> int:
    """The xxh3-64 a fragment's header records (see ``parse_fragment`` for what it covers)."""
    return _FRAG_HEAD.unpack_from(buf, 0)[-1]


def fragment_checksum_ok(buf: bytes | memoryview) -> bool:
    """Does the whole fragment ``buf`` (header and body) match the checksum its header records?"""
    x = xxhash.xxh3_64()
    x.update(buf[:FRAG_ID_LEN])
    x.update(ZERO_CSUM)
    x.update(buf[FRAG_HEADER_LEN:])
    return x.intdigest() == fragment_checksum(buf)


def peek_fragment(buf: bytes | memoryview, *, max_body: int) -> tuple[FragmentHeader, memoryview]:
    """A fragment's header and body view, checking structure (magic, version, lengths) but
    *not* the checksum (``parse_fragment`` adds that). The read fast paths check neither
    this way: they know the header from the index record (``fragment_id``)."""
    if len(buf) < FRAG_HEADER_LEN:
        raise CorruptData(f"fragment of {len(buf)} bytes is shorter than its header")
    magic, ver, idx, k, m, kind, _pad, key, gen, entry_len, blen, _csum = _FRAG_HEAD.unpack_from(buf, 0)
    if magic != FRAG_MAGIC:
        raise CorruptData("fragment magic mismatch")
    if ver != FORMAT_VERSION:
        raise IncompatibleFormat(f"fragment format version {ver}; expected {FORMAT_VERSION}")
    got = len(buf) - FRAG_HEADER_LEN
    if blen > max_body or got != blen:
        raise CorruptData(f"fragment body is {got} bytes, header says {blen}")
    return FragmentHeader(idx, k, m, kind, key, gen, entry_len, blen), memoryview(buf)[FRAG_HEADER_LEN:]


def parse_fragment(buf: bytes | memoryview, *, max_body: int) -> tuple[FragmentHeader, memoryview]:
    """Verify a fragment file's bytes; return its header and a view of its body."""
    fh, body = peek_fragment(buf, max_body=max_body)
    if not fragment_checksum_ok(buf):
        raise CorruptData("fragment checksum mismatch")
    return fh, body


# ----------------------------------------------------------------------------- erasure codes


class ErasureCode:
    """k data + m parity fragments; any k of them give the entry back.

    ``encode`` returns k+m bodies; ``decode`` takes ``{index: body}`` with at
    least k *verified* bodies; ``reconstruct`` rebuilds the listed indexes.
    """

    def __init__(self, k: int, m: int, ec_type: str):
        self.k, self.m, self.ec_type = k, m, ec_type

    def encode(self, data: bytes) -> list[bytes]:
        raise NotImplementedError

    def decode(self, frags: dict[int, bytes]) -> bytes:
        raise NotImplementedError

    def data_pieces(self, frags: dict[int, memoryview]) -> list[memoryview] | None:
        """Views whose concatenation is the encoded data, when all k data fragments are
        at hand (a systematic code stores the data verbatim); ``None`` otherwise. The
        caller verifies the result's checksum, so a wrong answer here is caught."""
        return None

    def reconstruct(self, frags: dict[int, bytes], missing: list[int]) -> dict[int, bytes]:
        raise NotImplementedError

    # Scatter reads (``kvstore.embedded.fastread``): a systematic code stores data fragment ``i``'s
    # body as ``data_lead`` bytes of its own header, then ``entry[i*share:(i+1)*share]``
    # (``share = body_len - data_lead``; the last one zero-padded), so a reader can land
    # those bytes straight in their final place and check the lead with ``data_lead_ok``.
    data_lead: int | None = None  # None: not systematic, no scatter reads

    def data_lead_ok(self, lead: memoryview, i: int, share: int, entry_len: int) -> bool:
        return False


class PyECLibCode(ErasureCode):
    """Reed-Solomon through pyeclib/liberasurecode (ISA-L by default)."""

    def __init__(self, k: int, m: int, ec_type: str):
        super().__init__(k, m, ec_type)
        from pyeclib.ec_iface import ECDriver, ECDriverError

        self._err = ECDriverError
        try:
            self._driver = ECDriver(k=k, m=m, ec_type=ec_type)
        except ECDriverError as exc:
            raise InvalidRequest(
                f"erasure code {ec_type} {k}+{m} is not available here ({exc}); "
                "try ec_type='isa_l_rs_cauchy' or 'liberasurecode_rs_vand'"
            ) from exc

    def encode(self, data: bytes) -> list[bytes]:
        return self._driver.encode(bytes(data))

    # liberasurecode's fragment header (fragment_header_t, 80 bytes): idx u32 at 0,
    # data size u32 at 4, backend metadata size u32 at 8, original data size u64 at 12.
    _LIBEC_HEAD = 80
    _LIBEC_FIELDS = struct.Struct("<IIIQ")

    def data_pieces(self, frags: dict[int, memoryview]) -> list[memoryview] | None:
        if not all(i in frags for i in range(self.k)):
            return None
        pieces = []
        remaining = None
        for i in range(self.k):
            f = frags[i]
            if len(f) < self._LIBEC_HEAD:
                return None
            idx, size, md, orig = self._LIBEC_FIELDS.unpack_from(f, 0)
            if idx != i or md != 0 or self._LIBEC_HEAD + size > len(f):
                return None
            if remaining is None:
                remaining = orig
            take = min(size, remaining)
            pieces.append(f[self._LIBEC_HEAD : self._LIBEC_HEAD + take])
            remaining -= take
        return pieces if remaining == 0 else None

    data_lead = _LIBEC_HEAD

    def data_lead_ok(self, lead: memoryview, i: int, share: int, entry_len: int) -> bool:
        return self._LIBEC_FIELDS.unpack_from(lead, 0) == (i, share, 0, entry_len)

    def decode(self, frags: dict[int, bytes]) -> bytes:
        if len(frags) < self.k:
            raise CorruptData(f"{len(frags)} good fragments, need {self.k}")
        # pyeclib needs real ``bytes`` (it aborts the process on a memoryview).
        try:
            return self._driver.decode([bytes(frags[i]) for i in sorted(frags)])
        except self._err as exc:
            raise CorruptData(f"erasure decode failed: {exc}") from exc

    def reconstruct(self, frags: dict[int, bytes], missing: list[int]) -> dict[int, bytes]:
        try:
            out = self._driver.reconstruct([bytes(frags[i]) for i in sorted(frags)], list(missing))
        except self._err as exc:
            raise CorruptData(f"erasure reconstruct failed: {exc}") from exc
        return dict(zip(missing, out))


class NoCode(ErasureCode):
    """k=1, m=0: one plain copy (for tests and single-disk laptops)."""

    def encode(self, data: bytes) -> list[bytes]:
        return [bytes(data)]

    def decode(self, frags: dict[int, bytes]) -> bytes:
        if 0 not in frags:
            raise CorruptData("the only fragment is gone")
        return bytes(frags[0])

    def data_pieces(self, frags: dict[int, memoryview]) -> list[memoryview] | None:
        return [frags[0]] if 0 in frags else None

    data_lead = 0

    def data_lead_ok(self, lead: memoryview, i: int, share: int, entry_len: int) -> bool:
        return i == 0 and share == entry_len

    def reconstruct(self, frags: dict[int, bytes], missing: list[int]) -> dict[int, bytes]:
        raise CorruptData("no parity to reconstruct from")


# ec_type -> factory. Add a row to support another backend.
ERASURE_CODES: dict[str, Callable[[int, int, str], ErasureCode]] = {
    "isa_l_rs_vand": PyECLibCode,
    "isa_l_rs_cauchy": PyECLibCode,
    "liberasurecode_rs_vand": PyECLibCode,
    "none": NoCode,
}

_codes: dict[tuple[int, int, str], ErasureCode] = {}
_codes_lock = threading.Lock()


def erasure_code(k: int, m: int, ec_type: str) -> ErasureCode:
    """A cached codec for (k, m, type); entries record k and m, so old ones stay readable."""
    if m == 0:
        ec_type = "none"
    key = (k, m, ec_type)
    code = _codes.get(key)  # every read asks: a dict read needs no lock (entries are only added)
    if code is not None:
        return code
    with _codes_lock:
        code = _codes.get(key)
        if code is None:
            try:
                factory = ERASURE_CODES[ec_type]
            except KeyError:
                raise InvalidRequest(
                    f"unknown ec_type {ec_type!r}; known: {sorted(ERASURE_CODES)}"
                ) from None
            code = _codes[key] = factory(k, m, ec_type)
    return code


def split_pack(buf: bytes | memoryview) -> Iterator[tuple[int, memoryview]]:
    """The fragments of a pack file (``kvstore.embedded.targets.pack_path``: fragments back to back), as
    (offset, bytes), each delimited by its header's body length; nothing is verified here (the
    caller parses each with ``parse_fragment``). Where a header is not one (a damaged stretch),
    the next fragment magic is looked for, so one bad fragment costs only itself; a false
    match in a body fails its checksum later."""
    view = memoryview(buf)
    data: bytes | None = None  # for ``find`` (a memoryview has none), made on the first damaged stretch
    off = 0
    while off + FRAG_HEADER_LEN <= len(view):
        magic, ver, *_rest, blen, _csum = _FRAG_HEAD.unpack_from(view, off)
        end = off + FRAG_HEADER_LEN + blen
        if magic == FRAG_MAGIC and ver == FORMAT_VERSION and end <= len(view):
            yield off, view[off:end]
            off = end
            continue
        data = bytes(view) if data is None else data
        off = data.find(FRAG_MAGIC, off + 1)
        if off < 0:
            return
