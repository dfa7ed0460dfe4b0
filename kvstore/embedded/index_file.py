"""A look at the index's LMDB file with plain file I/O, before LMDB maps it.

Called by ``kvstore.embedded.index.Index`` just before ``lmdb.open``. LMDB maps ``data.mdb`` and
reads its pages straight from the mapping: a page past the end of a truncated file is a
``SIGBUS`` that kills the process (no error, no message, exit 135), so a file shorter than
its own meta pages say must be refused before anything is mapped.

What is read, for LMDB's 64-bit layout (``mdb.c``: an ``MDB_page`` header, then ``MDB_meta``),
from each of the two meta pages (page 0 at offset 0, page 1 at offset ``psize``; LMDB
writes them in turn)::

    offset  0     16     20    24     32       40                  88       136      144
            +-----+------+-----+------+--------+-------------------+--------+--------+-------+
            | page| magic| ver | addr | mapsize| dbs[0] (free DB): | dbs[1] | last_pg| txnid |
            | head| u32  | u32 | u64  | u64    | md_pad u32 = psize| 48 B   | u64    | u64   |
            +-----+------+-----+------+--------+-------------------+--------+--------+-------+

The file must hold pages ``0 .. last_pg``, taking the larger ``last_pg`` of the two meta
pages (the newer one's: a file never shrinks). A file whose first meta
page is not LMDB's (no magic) is left to ``lmdb.open``, which refuses it with an error of
its own (``MDB_INVALID``), never a signal; so is an empty or missing file (the data
directory refuses those first, ``kvstore.embedded.datadir``).
"""

from __future__ import annotations

import os
import struct

from kvstore.errors import CorruptData

MDB_MAGIC = 0xBEEFC0DE
_PAGE_HEAD = 16  # MDB_page header before the meta
_META_HEAD = struct.Struct("<II")  # magic, version (at _PAGE_HEAD)
_FREE_PAD = _PAGE_HEAD + 24  # dbs[0].md_pad: the page size
_LAST = struct.Struct("<Q")  # last_pg (txnid follows)
_LAST_OFF = _FREE_PAD + 2 * 48
_META_LEN = _LAST_OFF + _LAST.size + 8
_MIN_PAGE, _MAX_PAGE = 512, 1 << 16  # LMDB's page size is the OS page size, within these


def _meta(raw: bytes) -> tuple[int, int] | None:
    """(page size, last page number) of one meta page's bytes, or ``None`` when they
    are not an LMDB meta page."""
    if len(raw) < _META_LEN:
        return None
    magic, _version = _META_HEAD.unpack_from(raw, _PAGE_HEAD)
    if magic != MDB_MAGIC:
        return None
    psize = struct.unpack_from("<I", raw, _FREE_PAD)[0]
    return psize, _LAST.unpack_from(raw, _LAST_OFF)[0]


def check_index_file(index_dir: str, remedy: str) -> None:
    """``CorruptData`` naming ``<index_dir>/data.mdb`` and ``remedy`` (what the operator can do)
    when the file is shorter than its meta pages say (truncated: mapping it would be a
    SIGBUS), or when a meta page names an impossible page size or second meta page. Reads
    the first two pages with ``pread``; maps nothing."""
    path = os.path.join(index_dir, "data.mdb")
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # missing or unreadable: lmdb.open (or the data directory) says so
    try:
        size = os.fstat(fd).st_size
        first = _meta(os.pread(fd, _META_LEN, 0))
        if first is None:
            return  # not LMDB's: lmdb.open refuses it (MDB_INVALID)
        psize = first[0]
        if not (_MIN_PAGE <= psize <= _MAX_PAGE and psize & (psize - 1) == 0):
            raise CorruptData(f"the index file {path} cannot be opened: its meta page gives a page size of "
                              f"{psize} bytes; {remedy}")
        second = _meta(os.pread(fd, _META_LEN, psize)) if size >= psize + _META_LEN else None
        if second is None and size >= psize + _META_LEN:
            return  # its second meta page is not LMDB's: lmdb.open refuses it (MDB_INVALID)
        need = (max(first[1], second[1] if second else 1) + 1) * psize
        if size < need:
            raise CorruptData(
                f"the index file {path} cannot be opened: it is truncated ({size} bytes, where its meta pages "
                f"name {need}: {need // psize} pages of {psize}; mapping it would crash the process): {remedy}")
    finally:
        os.close(fd)
