"""The local read fast paths of the store: an entry's k data fragments read from local
targets in few steps, trusted through the entry checksum (``kvstore.embedded.store``'s docstring,
"Read path").

``LocalFastReads`` is a part of ``kvstore.embedded.fragment_reads.FragmentReader``, built over
the reader's ``config``, ``targets``, per-thread scratch buffer and kept pack descriptors
(``kvstore.embedded.openfiles.OpenFiles``): a fragment inside a pack is one ``preadv`` on the
pack's kept descriptor, one in a file of its own an open, a ``preadv`` and a close. Each fast path
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
from kvstore.embedded.openfiles import OpenFiles
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


_PLANS_MAX = 256  # geometries kept (``LocalFastReads._plan``); a model's blocks share a few


class _ScatterPlan:
    """Where ``read_scatter``'s vector puts each byte of each data fragment of one geometry
    (k, m, fragment, entry and plain sizes), as slices: fragment ``i`` is read at scratch
    ``frags[i][0]`` (its headers, ``head`` bytes), then into ``scratch[eh]`` (part of the entry
    header), ``out[osl]`` (part of the payload) and ``scratch[pad]`` (the code's zero
    padding), each ``None`` where the fragment holds none. Entry coordinates ``[0, hlen)``
    are the entry header, ``[hlen, entry_len)`` the payload, ``[entry_len, k * share)`` the
    padding; data fragment ``i`` holds ``[i * share, (i + 1) * share)`` after its headers.
    The scratch holds the k fragment headers, then the entry header, the padding, and one
    spare byte per fragment (``spare + i``: where an over-long file of its own shows)."""

    __slots__ = ("head", "share", "hlen", "frags", "ehead", "spare", "scratch_len", "lead_ok")

    def __init__(self, k: int, head: int, share: int, hlen: int, elen: int, lead_ok: Callable):
        self.head, self.share, self.hlen, self.lead_ok = head, share, hlen, lead_ok
        eh0 = k * head
        pad0 = eh0 + hlen
        self.ehead = slice(eh0, pad0)
        self.spare = pad0 + share
        self.scratch_len = self.spare + k
        frags = []
        for i in range(k):
            lo, hi = i * share, (i + 1) * share
            eh = slice(eh0 + lo, eh0 + min(hi, hlen)) if lo < hlen else None
            osl = slice(max(lo, hlen) - hlen, min(hi, elen) - hlen) if hi > hlen and lo < elen else None
            pad = slice(pad0, pad0 + hi - max(lo, elen)) if hi > elen else None
            frags.append((i * head, eh, osl, pad))
        self.frags = tuple(frags)


def frag_loc(ek: bytes, meta: Meta, i: int) -> tuple[str, int | None]:
    """Where fragment ``i`` of a record lives on ``meta.targets[i]``: (its own file, ``None``)
    or (the batch's pack file, byte offset) -- see ``Meta.offsets``."""
    if meta.offsets and meta.offsets[i] != STANDALONE:
        return pack_path(meta.gen), meta.offsets[i]
    return fragment_path(ek[0], ek[1:], meta.gen, i), None


def _data_paths(ek: bytes, meta: Meta, roots: list[str]) -> list[tuple[str, int | None]]:
    """``frag_loc`` of the k data fragments as absolute local paths (the read fast paths)."""
    k = meta.k
    offsets = meta.offsets
    if not offsets:
        rel = "/" + fragment_prefix(ek[0], ek[1:], meta.gen)
        return [(roots[i] + rel + str(i), None) for i in range(k)]
    pack = "/" + pack_path(meta.gen)  # the same for every fragment of the entry
    out = []
    for i in range(k):
        off = offsets[i]
        if off == STANDALONE:
            out.append((roots[i] + "/" + fragment_path(ek[0], ek[1:], meta.gen, i), None))
        else:
            out.append((roots[i] + pack, off))
    return out


class _Reads:
    """The k positioned reads of one fast-path get: pack fragments through the reader's kept
    descriptors (``kvstore.embedded.openfiles``), a fragment in its own file opened, read and
    closed. ``release`` gives the kept descriptors back: once, in a ``finally``."""

    __slots__ = ("files", "paths", "held", "per", "whole")

    def __init__(self, files: OpenFiles, paths: list[tuple[str, int | None]]):
        self.files = files
        self.paths = paths
        packed = [p for p, off in paths if off is not None]
        self.held = files.hold(packed) if packed else []
        if len(self.held) == len(paths):
            self.per: list = self.held
            self.whole: list[bool] | None = None  # every fragment in a pack
        else:  # some fragments in files of their own (rebuilt by repair): ``None`` in their slots
            it = iter(self.held)
            self.per = [None if off is None else next(it) for _, off in paths]
            self.whole = [off is None for _, off in paths]

    def preadv(self, i: int, iov: list) -> int:
        h = self.per[i]
        if h is None:
            fd = os.open(self.paths[i][0], os.O_RDONLY)
            try:
                return os.preadv(fd, iov, 0)
            finally:
                os.close(fd)
        try:
            return os.preadv(h.fd, iov, self.paths[i][1])
        except OSError:
            self.files.discard(h)  # a failing descriptor is not kept: the next read opens the path again
            raise

    def release(self) -> None:
        if self.held:
            self.files.release(self.held)


class LocalFastReads:
    """``read_fast`` and ``read_scatter`` (module docstring) over ``targets`` read as ``config``
    says; ``scratch(n)`` is the caller's reusable buffer of at least ``n`` bytes; ``files`` the
    reader's kept pack descriptors."""

    def __init__(self, config: StoreConfig, targets: dict[str, Target], scratch: Callable[[int], memoryview],
                 files: OpenFiles):
        self.config = config
        self.targets = targets
        self._scratch = scratch
        self.files = files
        self._code = codec.erasure_code  # (k, m, type) -> the cached code object
        self._plans: dict[tuple[int, int, int, int, int], _ScatterPlan | bool] = {}  # ``_plan``

    def local_roots(self, meta: Meta) -> list[str] | None:
        """Roots of the k data fragments' targets when the local fast path applies."""
        if self.config.read_timeout_s or self.config.parallel_reads == "always":
            return None
        roots = []
        targets = self.targets
        for name in meta.targets[: meta.k]:
            t = targets.get(name)
            if type(t) is not LocalTarget:
                return None
            roots.append(t.root)
        return roots

    def read_fast(self, ek: bytes, meta: Meta, roots: list[str],
                   out: memoryview | None) -> tuple[codec.EntryHeader, bytes | memoryview] | None:
        """The common case in few steps: the k data fragments of a systematic code, each read
        with one ``preadv`` into the per-thread scratch (a pack through its kept descriptor, a
        fragment file of its own through an open), and trusted only when the
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
        # Each fragment's header up to its checksum is known from the record: compare bytes
        # (``codec.fragment_id``; what parsing it and ``frame_matches`` would check).
        id0 = codec.fragment_id(0, k, meta.m, ek[0], ek[1:], meta.gen, meta.entry_len, flen - codec.FRAG_HEADER_LEN)
        same = codec.fragment_id_at
        bodies: dict[int, memoryview] = {}
        try:
            reads = _Reads(self.files, _data_paths(ek, meta, roots))
            try:
                for i in range(k):
                    lo = i * slot
                    view = scratch[lo : lo + slot if reads.paths[i][1] is None else lo + flen]
                    if reads.preadv(i, [view]) != flen or not same(i, scratch, lo, id0):
                        return None
                    bodies[i] = view[codec.FRAG_HEADER_LEN : flen]
            finally:
                reads.release()
            if not codec.fragment_checksum_ok(scratch[:flen]):
                return None
            pieces = self._code(k, meta.m, self.config.ec_type).data_pieces(bodies)
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
        ``read_fast``. Where each byte of each fragment goes is the entry's geometry's
        ``_ScatterPlan``, worked out once per geometry (a model's blocks share a few).
        """
        k, flen, elen, plen = meta.k, meta.frag_len, meta.entry_len, meta.plain_len
        geo = (k, meta.m, flen, elen, plen)
        plan = self._plans.get(geo)
        if plan is None:
            plan = self._plan(geo)
        if not plan:
            return None  # compressed (stored != plain) or an unexpected geometry
        scratch = self._scratch(plan.scratch_len)
        fhl, head, hlen = codec.FRAG_HEADER_LEN, plan.head, plan.hlen
        id0 = codec.fragment_id(0, k, meta.m, ek[0], ek[1:], meta.gen, elen, flen - fhl)
        same = codec.fragment_id_at
        lead_ok = plan.lead_ok
        share = plan.share
        try:
            reads = _Reads(self.files, _data_paths(ek, meta, roots))
            try:
                whole = reads.whole
                for i, (at, eh, osl, pad) in enumerate(plan.frags):
                    iov = [scratch[at : at + head]]
                    if eh is not None:
                        iov.append(scratch[eh])
                    if osl is not None:
                        iov.append(out[osl])
                    if pad is not None:
                        iov.append(scratch[pad])
                    if whole and whole[i]:  # a file of its own: an over-long one shows as a wrong length
                        iov.append(scratch[plan.spare + i : plan.spare + i + 1])
                    if (reads.preadv(i, iov) != flen or not same(i, scratch, at, id0)
                            or not lead_ok(scratch[at + fhl : at + head], i, share, elen)):
                        return None
                    if i == 0:  # fragment 0 carries the entry header: verify it whole
                        x0 = xxhash.xxh3_64(scratch[: codec.FRAG_ID_LEN])
                        x0.update(codec.ZERO_CSUM)
                        x0.update(scratch[fhl:head])
                        for part in iov[1 : len(iov) - 1] if whole and whole[0] else iov[1:]:
                            x0.update(part)  # payload parts, not the spare byte
                        if x0.intdigest() != codec.fragment_checksum(scratch):
                            return None
            finally:
                reads.release()
            ehead = scratch[plan.ehead]
            h = codec.decode_entry_header(ehead, max_plain=max(self.config.max_value_bytes, plen))
            if (h.codec != codec.CODEC_RAW or h.header_len != hlen or h.plain_len != plen
                    or h.stored_len != plen or h.key != ek[1:] or h.kind.code != ek[0] or h.tokens != meta.tokens):
                return None
            codec.verify_plain(h, out[:plen])
        except (OSError, CorruptData, IncompatibleFormat):
            return None
        return h, out[:plen]

    def _plan(self, geo: tuple[int, int, int, int, int]) -> "_ScatterPlan | bool":
        """Work out (and keep) the ``_ScatterPlan`` of geometry ``geo``; ``False`` where the
        scatter read does not apply (kept too, so that such entries' gets do not work it out again)."""
        k, m, flen, elen, plen = geo
        code = self._code(k, m, self.config.ec_type)
        lead = code.data_lead
        hlen = elen - plen
        head = codec.FRAG_HEADER_LEN + (lead or 0)
        share = flen - head
        plan: _ScatterPlan | bool = False
        if lead is not None and codec.ENTRY_HEADER_MIN <= hlen <= share and share * k >= elen:
            plan = _ScatterPlan(k, head, share, hlen, elen, code.data_lead_ok)
        if len(self._plans) >= _PLANS_MAX:
            self._plans.clear()
        self._plans[geo] = plan
        return plan
