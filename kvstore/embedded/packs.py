"""The records of packs written by a client (``kvstore.client.direct_writes``) and of their commit.

A direct writer encodes a batch and writes its pack files itself (``kvstore.embedded.fragment_writes``),
then asks the daemon to index them: ``WrittenEntry`` is one entry of such a batch as the daemon
receives it, ``CommitResult`` what ``kvstore.embedded.store.EmbeddedStore.commit_written`` did
with them. Pack files themselves: their names in ``kvstore.embedded.targets``, their writing in
``kvstore.embedded.fragment_writes``, their checks and compaction in ``kvstore.embedded.fragments``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What ``EmbeddedStore.commit_written`` did: per entry, indexed now or not; and the packs it
    rejected (generation -> why), none of whose entries was indexed."""

    created: list[bool]
    rejected: dict[bytes, str]


@dataclass(frozen=True, slots=True)
class WrittenEntry:
    """An entry whose fragments a client wrote itself into pack files (``kvstore.client.direct_writes``),
    to be indexed by ``EmbeddedStore.commit_written``: the index record's fields the writer knows.
    Fragment ``i`` is ``frag_len`` bytes at ``offsets[i]`` of ``pack_path(gen)`` on ``targets[i]``;
    ``ttl_s`` ``None`` means the store's default."""

    ek: bytes  # kind code || stored key
    k: int
    m: int
    tokens: int
    plain_len: int
    entry_len: int
    frag_len: int
    gen: bytes
    targets: tuple[str, ...]
    offsets: tuple[int, ...]
    ttl_s: float | None = None
