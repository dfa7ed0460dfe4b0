"""Test helper: an entry's fragments on disk, wherever the store put them.

A single put leaves one file per fragment; a batched put leaves its fragments inside
the batch's pack files (``kvstore.embedded.targets``). Fault tests damage a fragment through a
``FragmentRef`` so that the same test covers both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvstore.api import EntryKind
from kvstore.embedded.fastread import frag_loc
from kvstore.embedded.index import ekey


@dataclass(frozen=True)
class FragmentRef:
    path: Path  # its own file, or the pack holding it
    offset: int | None  # None: the fragment is the whole file
    length: int
    target: str  # the target's name

    @property
    def packed(self) -> bool:
        return self.offset is not None

    def read_bytes(self) -> bytes:
        if not self.packed:
            return self.path.read_bytes()
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            return fh.read(self.length)

    def write_bytes(self, data: bytes) -> None:
        """Replace the fragment's bytes. Inside a pack its neighbours stay where they are:
        shorter data is padded with zeros (a torn write), longer data is cut."""
        if not self.packed:
            self.path.write_bytes(data)
            return
        fd = os.open(self.path, os.O_WRONLY)
        try:
            os.pwrite(fd, data[: self.length].ljust(self.length, b"\0"), self.offset)
        finally:
            os.close(fd)

    def remove(self) -> None:
        """Gone: its file deleted, or (in a pack, whose neighbours must stay) zeroed."""
        if self.packed:
            self.write_bytes(b"")
        else:
            self.path.unlink()


def fragment_refs(store, key: bytes, kind: str = "block") -> list[FragmentRef]:
    """Fragment i of a live or lost entry of an embedded store at position i ([]: no such entry)."""
    ek = ekey(EntryKind.parse(kind).code, key)
    with store.index.env.begin() as txn:
        m = store.index.get_meta(txn, ek) or store.index.get_lost(txn, ek)
    if m is None:
        return []
    out = []
    for i, t in enumerate(m.targets):
        rel, off = frag_loc(ek, m, i)
        out.append(FragmentRef(Path(store.targets[t].root) / rel, off, m.frag_len, t))
    return out


def assert_pack_refs_match_records(store) -> None:
    """``kvstore.embedded.index`` invariant 6: each pack's count equals the records stored in it."""
    want: dict[bytes, int] = {}
    with store.index.env.begin() as txn:
        metas = [store.index.unpack(txn, raw) for db in ("entries", "lost", "grave")
                 for _, raw in store.index.iter_db(txn, db)]
        have = {bytes(g): int.from_bytes(v[:8], "big") for g, v in store.index.iter_db(txn, "packs")}
    for m in metas:
        if m.offsets:
            want[m.gen] = want.get(m.gen, 0) + 1
    assert have == want
