"""The local read fast paths of the store: an entry's k data fragments read from local
targets in few steps, trusted through the entry checksum (``kvstore.embedded.store``'s docstring,
"Read path").

``LocalFastReads`` is a part of ``kvstore.embedded.fragment_reads.FragmentReader``, built over
the reader's ``config``, ``targets`` and per-thread scratch buffer. Each fast path
returns ``None`` on anything unexpected, and ``FragmentReader.read_verified`` then takes the
verifying path, which finds the bad fragment, reads parity, counts the degraded read and
marks the entry lost if need be.

``fresh_bytes`` lets a plain ``get`` of a large raw entry take ``read_scatter`` too: the
kernel copies the fragments' payload straight into the ``bytes`` object returned, as
``os.read`` and ``file.read`` fill theirs, instead of into scratch and then once more into a
joined ``bytes`` (a copy of the whole payload: about a sixth of a 1 MiB get here).
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import xxhash

from kvstore.embedded import codec
from kvstore.errors import CorruptData, IncompatibleFormat
from kvstore.embedded.index import STANDALONE, Meta
from kvstore.config import StoreConfig
from kvstore.embedded.targets import LocalTarget, Target, fragment_path, fragment_prefix, pack_path


# CPython's own way to build a bytes object of known size: allocate it unfilled, fill it
# before anyone else holds it (what ``os.read`` does in C). Not on other interpreters.
try:
    _new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
    _new_bytes.restype, _new_bytes.argtypes = ctypes.py_object, (ctypes.c_char_p, ctypes.c_ssize_t)
    _bytes_buffer = ctypes.pythonapi.PyBytes_AsString
    _bytes_buffer.restype, _bytes_buffer.argtypes = ctypes.c_void_p, (ctypes.py_object,)
except (AttributeError, OSError):  # no ``ctypes.pythonapi``: gets join the fragments instead
    _new_bytes = None

# Below this a get's extra copy costs less than setting the direct read up (and CPython
# shares its empty bytes object, which must never be written).
FRESH_BYTES_MIN = 64 * 1024


def fresh_bytes(n: int) -> tuple[bytes, memoryview] | None:
    """A new, unfilled ``bytes`` of ``n`` bytes and a writable view of its buffer, or ``None``
    (``n`` under ``FRESH_BYTES_MIN``, or not CPython). Contract: the caller fills all ``n``
    bytes through the view before the object is hashed, compared or handed to anyone, and
    drops both unfilled when it cannot (no other reference exists until it returns it)."""
    if _new_bytes is None or n < FRESH_BYTES_MIN:
        return None
    b = _new_bytes(None, n)
    return b, memoryview((ctypes.c_char * n).from_address(_bytes_buffer(b))).cast("B")


def frag_loc(ek: bytes, meta: Meta, i: int) -> tuple[str, int | None]:
    """Where fragment ``i`` of a record lives on ``meta.targets[i]``: (its own file, ``None``)
    or (the batch's pack file, byte offset) -- see ``Meta.offsets``."""
    if meta.offsets and meta.offsets[i] != STANDALONE:
        return pack_path(meta.gen), meta.offsets[i]
    return fragment_path(ek[0], ek[1:], meta.gen, i), None


def _data_paths(ek: bytes, meta: Meta, roots: list[str]) -> list[tuple[str, int | None]]:
    """``frag_loc`` of the k data fragments as absolute local paths (the read fast paths)."""
    if not meta.offsets:
        rel = "/" + fragment_prefix(ek[0], ek[1:], meta.gen)
        return [(roots[i] + rel + str(i), None) for i in range(meta.k)]
    out = []
    for i in range(meta.k):
        rel, off = frag_loc(ek, meta, i)
        out.append((roots[i] + "/" + rel, off))
    return out


class LocalFastReads:
    """``read_fast`` and ``read_scatter`` (module docstring) over ``targets`` read as ``config``
    says; ``scratch(n)`` is the caller's reusable buffer of at least ``n`` bytes."""

    def __init__(self, config: StoreConfig, targets: dict[str, Target], scratch: Callable[[int], memoryview]):
        self.config = config
        self.targets = targets
        self._scratch = scratch

    def local_roots(self, meta: Meta) -> list[str] | None:
        """Roots of the k data fragments' targets when the local fast path applies."""
        if self.config.read_timeout_s or self.config.parallel_reads == "always":
            return None
        roots = []
        for name in meta.targets[: meta.k]:
            t = self.targets.get(name)
            if type(t) is not LocalTarget:
                return None
            roots.append(t.root)
        return roots

    def read_fast(self, ek: bytes, meta: Meta, roots: list[str],
                   out: memoryview | None) -> tuple[codec.EntryHeader, bytes | memoryview] | None:
        """The common case in few steps: the k data fragments of a systematic code, each read
        with one open + one ``preadv`` into the per-thread scratch, and trusted only when the
        *entry* checksum (xxh3-128 over the assembled payload) matches; fragment 0, which
        holds the entry header (layout, tokens) outside that checksum, is verified whole.
        Data fragments past 0 that hold part of the entry header (a small entry's) are verified
        whole too. Returns ``None`` on anything unexpected (missing, short or foreign fragment,
        checksum mismatch) and the caller takes the verifying path, which finds the bad fragment,
        reads parity, counts the degraded read and marks the entry lost if need be.
        """
        k, flen = meta.k, meta.frag_len
        slot = flen + 1  # one byte more, so that an over-long file shows as a wrong length
        scratch = self._scratch(slot * k)
        paths = _data_paths(ek, meta, roots)
        # Each fragment's header up to its checksum is known from the record: compare bytes
        # (``codec.fragment_id``; what parsing it and ``frame_matches`` would check).
        key, gen, m, elen, blen = ek[1:], meta.gen, meta.m, meta.entry_len, flen - codec.FRAG_HEADER_LEN
        bodies: dict[int, memoryview] = {}
        try:
            for i in range(k):
                path, off = paths[i]
                view = scratch[i * slot : (i + 1) * slot if off is None else i * slot + flen]
                fd = os.open(path, os.O_RDONLY)
                try:
                    n = os.preadv(fd, [view], off or 0)
                finally:
                    os.close(fd)
                if n != flen or view[: codec.FRAG_ID_LEN] != codec.fragment_id(i, k, m, ek[0], key, gen, elen, blen):
                    return None
                if i == 0 and not codec.fragment_checksum_ok(view[:flen]):
                    return None
                bodies[i] = view[codec.FRAG_HEADER_LEN : flen]
            pieces = codec.erasure_code(k, meta.m, self.config.ec_type).data_pieces(bodies)
            if pieces is None:
                return None
            limit = meta.plain_len  # the record's size (``FragmentReader.decode``)
            if out is None:
                h, plain = codec.decode_entry_pieces(pieces, max_plain=limit)
            else:
                h = codec.decode_entry_pieces_into(pieces, out, max_plain=limit)
                plain = out[: h.plain_len]
        except (OSError, CorruptData, IncompatibleFormat):
            return None
        if h.key != ek[1:] or h.kind.code != ek[0] or h.tokens != meta.tokens or h.plain_len != meta.plain_len:
            return None
        # The entry checksum covers the payload, not the entry header: a small entry's header
        # runs on into data fragments past 0, which are then verified whole as well.
        covered = len(pieces[0])
        for i in range(1, len(pieces)):
            if covered >= h.header_len:
                break
            if not codec.fragment_checksum_ok(scratch[i * slot : i * slot + flen]):
                return None
            covered += len(pieces[i])
        return h, plain

    def read_scatter(self, ek: bytes, meta: Meta, roots: list[str],
                      out: memoryview) -> tuple[codec.EntryHeader, memoryview] | None:
        """``read_fast`` for a raw entry read into a caller buffer: each data fragment is
        read with one ``preadv`` whose vector lands the payload bytes *directly* in ``out``
        (headers and padding go to a small scratch), so the only passes over the payload are
        the kernel's copy and the entry checksum. Same trust rule and ``None`` contract as
        ``read_fast``.

        Entry coordinates ``[0, hlen)`` are the entry header, ``[hlen, entry_len)`` the
        payload (``out[0:plain_len]``), ``[entry_len, k * share)`` the code's zero padding;
        data fragment ``i`` holds ``[i * share, (i + 1) * share)`` after its two headers.
        """
        k, flen = meta.k, meta.frag_len
        code = codec.erasure_code(k, meta.m, self.config.ec_type)
        lead = code.data_lead
        head = codec.FRAG_HEADER_LEN + (lead or 0)
        share = flen - head
        hlen, elen, plen = meta.entry_len - meta.plain_len, meta.entry_len, meta.plain_len
        if lead is None or not codec.ENTRY_HEADER_MIN <= hlen <= share or share * k < elen:
            return None  # compressed (stored != plain) or an unexpected geometry
        scratch = self._scratch(k * head + hlen + share + k)
        heads = [scratch[i * head : (i + 1) * head] for i in range(k)]
        ehead = scratch[k * head : k * head + hlen]
        pad = scratch[k * head + hlen : k * head + hlen + share]
        spare = scratch[k * head + hlen + share :]
        paths = _data_paths(ek, meta, roots)
        x0 = xxhash.xxh3_64()
        try:
            for i in range(k):
                lo, hi = i * share, (i + 1) * share
                iov = [heads[i]]
                if lo < hlen:
                    iov.append(ehead[lo : min(hi, hlen)])
                if hi > hlen and lo < elen:
                    iov.append(out[max(lo, hlen) - hlen : min(hi, elen) - hlen])
                if hi > elen:
                    iov.append(pad[: hi - max(lo, elen)])
                path, off = paths[i]
                if off is None:
                    iov.append(spare[i : i + 1])  # an over-long file shows as a wrong length
                fd = os.open(path, os.O_RDONLY)
                try:
                    n = os.preadv(fd, iov, off or 0)
                finally:
                    os.close(fd)
                if n != flen:
                    return None
                if (heads[i][: codec.FRAG_ID_LEN] != codec.fragment_id(i, k, meta.m, ek[0], ek[1:], meta.gen, elen,
                                                                        flen - codec.FRAG_HEADER_LEN)
                        or not code.data_lead_ok(heads[i][codec.FRAG_HEADER_LEN:], i, share, elen)):
                    return None
                if i == 0:  # fragment 0 carries the entry header: verify it whole
                    x0.update(heads[0][: codec.FRAG_ID_LEN])
                    x0.update(b"\0" * 8)
                    x0.update(heads[0][codec.FRAG_HEADER_LEN:])
                    for part in iov[1:-1] if off is None else iov[1:]:  # payload parts, not the spare byte
                        x0.update(part)
                    if x0.intdigest() != codec.fragment_checksum(heads[0]):
                        return None
            limit = max(self.config.max_value_bytes, plen)
            h = codec.decode_entry_header(ehead, max_plain=limit)
            if (h.codec != codec.CODEC_RAW or h.header_len != hlen or h.plain_len != plen
                    or h.stored_len != plen or h.key != ek[1:] or h.kind.code != ek[0] or h.tokens != meta.tokens):
                return None
            codec.verify_plain(h, out[:plen])
        except (OSError, CorruptData, IncompatibleFormat):
            return None
        return h, out[:plen]
