"""The LMDB index: entry metadata plus the orderings GC needs.

The embedded store's parts (``kvstore.embedded.parts``) and its maintenance (``kvstore.maintenance``)
read and write it; readers of records elsewhere use ``Meta`` and ``ekey``. LMDB gives
one writer at a time across threads *and processes*, MVCC readers that never
block, and durable commits (``sync=True``), which is what lets several
processes share one data directory.

Sub-databases (``ek`` is the 17-byte entry key ``kind code || block hash``)::

    entries  ek                     -> Meta       live entries only (lookup's hot path)
    lost     ek                     -> Meta       unrecoverable entries, until repair/delete
    lru      access_ns(u64 BE)||ek  -> ''         unpinned live entries, oldest first
    ttl      expires_ns(u64 BE)||ek -> ''         live entries with a TTL, soonest first
    grave    deleted_ns(u64 BE)||ek||gen -> Meta  deleted entries whose fragments await removal
    packs    gen                    -> records, bytes, dead bytes (3 x u64) of pack ``gen`` (below)
    members  gen||ek                -> ''          the records stored in pack ``gen``
    compact  gen                    -> ''          packs mostly dead: GC moves their live entries out
    tids     u16 id                 -> target name (fragment locations are stored as ids)
    info     name                   -> u64 counters (used_bytes, degraded_reads, ...); and
             b"identity"            -> 16 random bytes set when the index is created, which the data
                                       directory's marker repeats (``kvstore.embedded.store``): an index that is
                                       missing, emptied or another directory's is refused at open
             b"code"                -> JSON {ec_type, ec_k, ec_m}: the directory's erasure code, set in
                                       the same transaction (the marker repeats it; this copy is the one
                                       creators racing each other agree on)
             b"path\0"||target||b"\0"||rel -> who (b"s" sweep, b"r" repair) || pid || start time (u64 BE
                                       each): a fragment path taken while its I/O runs outside any write
                                       transaction (``Index.take_path_txn``; ``kvstore.embedded.pathholds``). A hold
                                       whose process is gone, or whose pid is this process's but that this
                                       ``Index`` did not take (a daemon restarted as a container's pid 1
                                       again), holds nothing and is dropped at open. Assumes one host and
                                       one pid namespace for every process on the directory (a holder in
                                       another namespace may look gone while it runs, or alive when gone)
             b"sweep_decisions"     -> u64: counts each orphan sweep's taking the paths of unindexed files to
                                       delete them, and its having deleted them (``kvstore.maintenance.orphans``); a
                                       writer's index transaction compares it with the value it read before
                                       writing its first file

Invariants (each write transaction keeps them):
  1. An ``entries`` record exists only after all of its fragments were durably
     written (the store writes fragments first, then commits the index).
  2. Every unpinned ``entries`` record has exactly one ``lru`` record, keyed by
     its ``access_ns``; pinned ones have none, so eviction never even sees them.
  3. Every record with ``expires_ns > 0`` has exactly one ``ttl`` record.
  4. ``info.used_bytes`` equals the fragment bytes of ``entries`` plus ``lost``.
  5. A record leaves ``entries`` (delete, eviction, expiry) by moving to
     ``grave`` in the same transaction; its fragments are removed only after
     ``delete_grace_s`` so a reader that already holds the metadata can finish.
  6. A record with ``offsets`` (a batched put's entry: its fragments sit in the
     batch's pack files, see ``kvstore.embedded.targets``) is counted once in ``packs[gen]``
     and has one ``members`` record while it is in ``entries``, ``lost`` or
     ``grave``; the pack files are removed only when that count drops to zero (the
     last record purged from ``grave``). Until then a purged record's pack bytes
     are *dead*: counted in the pack's dead bytes and in ``info.pack_dead_bytes``
     (as are the pack copies of fragments repair rebuilt as their own files, and the
     share of an entry that lost its put race in a pack whose other entries were stored). A
     pack whose dead bytes reach ``compact_ratio`` of its bytes is queued in
     ``compact``; GC rewrites its live entries into a new pack, so dead bytes
     stay bounded without an operator.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, replace
from itertools import compress, count
from operator import not_
from typing import Callable, Iterable, Iterator, Sequence

import lmdb

from kvstore.config import target_name
from kvstore.errors import CorruptData, IncompatibleFormat, InternalError, InvalidRequest, StoreUnavailable
from kvstore.embedded.index_file import check_index_file
from kvstore.embedded.pathholds import PathHolds

INDEX_FORMAT = 1

# version, flags, k, m, n_frag, tokens, plain_len, entry_len, frag_len, created_ns, access_ns, expires_ns, gen;
# then n_frag u16 target ids; version 2 (packed) adds n_frag u64 offsets.
_META = struct.Struct("<BBBBBIQQQQQQ8s")
STANDALONE = (1 << 64) - 1  # an ``offsets`` slot whose fragment is its own file (rebuilt by repair)
_EXPIRES_OFF = 1 + 1 + 1 + 1 + 1 + 4 + 8 + 8 + 8 + 8 + 8  # byte offset of expires_ns inside a Meta record
FLAG_PINNED = 1
FLAG_ALIGNED = 2  # ``Meta.aligned``
_U64 = struct.Struct(">Q")
_PACK = struct.Struct(">QQQ")  # records stored in the pack, their bytes in it, dead bytes in it
_EXP = struct.Struct("<Q")  # expires_ns as stored in a Meta record


_TAILS: dict[tuple[int, int], struct.Struct] = {}  # (record version, n_frag) -> its ids (and offsets)


def _tail(ver: int, n: int) -> struct.Struct:
    """The format of a record's target ids (and, version 2, offsets) after ``_META``."""
    t = _TAILS[(ver, n)] = struct.Struct(f">{n}H{n}Q" if ver == 2 else f">{n}H")
    return t


@dataclass(frozen=True, slots=True)
class Meta:
    """Index record of one entry. Times are nanoseconds since the epoch (0 = none)."""

    k: int
    m: int
    tokens: int
    plain_len: int  # payload bytes before compression
    entry_len: int  # encoded entry bytes (header + stored payload) before erasure coding
    frag_len: int  # bytes of each fragment file (all equal)
    created_ns: int
    access_ns: int
    expires_ns: int
    gen: bytes  # 8 random bytes, unique per put (per batch when packed): names its fragment or pack files
    targets: tuple[str, ...]  # fragment i lives on targets[i]
    pinned: bool = False
    # () : fragment i is its own file (``fragment_path``). Else fragment i is ``frag_len`` bytes
    # at offsets[i] of the pack file ``pack_path(gen)`` on targets[i], or its own file where
    # offsets[i] == STANDALONE.
    offsets: tuple[int, ...] = ()
    # Appended to a segment (``kvstore.embedded.segments``): each fragment in the pack file starts a
    # block and owns every byte up to the next ``ALIGN`` boundary, which GC may free with it.
    aligned: bool = False

    @property
    def stored_bytes(self) -> int:
        return self.frag_len * len(self.targets)

    def expired(self, now_ns: int) -> bool:
        """Past its TTL at ``now_ns``: absent to every read, lookup and pin, whether or not GC
        has removed it yet (the one expiry rule; ``Index._live_iter`` applies it to raw records)."""
        return bool(self.expires_ns) and self.expires_ns <= now_ns


def packed_bytes(m: Meta) -> int:
    """Bytes of a record's fragments that sit in its pack (0 for fragment files)."""
    return m.frag_len * sum(1 for o in m.offsets if o != STANDALONE) if m.offsets else 0


def index_remedy(path: str) -> str:
    """What an operator can do about the damaged index at ``path`` (``<data_dir>/index``)."""
    data_dir = os.path.dirname(os.path.abspath(path))
    return (f"rebuild it from the fragments with `kvtool rebuild-index {data_dir}` (the damaged index is moved "
            "aside), or restore it from a copy")


def ekey(kind_code: int, key: bytes) -> bytes:
    return bytes((kind_code,)) + key


class Index:
    """LMDB-backed metadata. Methods named ``*_txn`` take an open transaction."""

    DBS = (b"entries", b"lost", b"lru", b"ttl", b"grave", b"packs", b"members", b"compact", b"tids", b"info")

    def __init__(self, path: str, *, map_size: int, sync: bool, max_readers: int = 256,
                 compact_ratio: float = 0.5):
        self.compact_ratio = compact_ratio
        os.makedirs(path, exist_ok=True)
        remedy = index_remedy(path)
        check_index_file(path, remedy)  # a truncated file is refused before LMDB maps it (a SIGBUS)
        try:
            self.env = lmdb.open(
                path, map_size=map_size, max_dbs=len(self.DBS) + 1, sync=sync, metasync=sync,
                max_readers=max_readers, readahead=False,
            )
        except lmdb.Error as exc:  # not an LMDB file (damaged, truncated), or an environment LMDB refuses
            if any(m in str(exc) for m in ("Permission denied", "Read-only file system")):
                raise InvalidRequest(f"the index at {path} cannot be opened for writing ({exc}): the store "
                                     "needs write access to its data directory, even to read it") from exc
            if "already open in this process" in str(exc):  # a store not yet closed (its last call still running)
                raise StoreUnavailable(f"the index at {path} is still open in this process ({exc}): close the "
                                       "store that holds it, or retry once its calls have ended") from exc
            raise CorruptData(f"the index at {path} cannot be opened ({exc}); {remedy}") from exc
        try:
            self.db = {name.decode(): self.env.open_db(name) for name in self.DBS}
            self._tid: dict[str, int] = {}
            self._tname: dict[int, str] = {}
            with self.env.begin(write=True) as txn:
                fmt = txn.get(b"format", db=self.db["info"])
                if fmt is None:
                    txn.put(b"format", _U64.pack(INDEX_FORMAT), db=self.db["info"])
                elif _U64.unpack(fmt)[0] != INDEX_FORMAT:
                    raise IncompatibleFormat(
                        f"index at {path} has format {_U64.unpack(fmt)[0]}; this kvstore reads {INDEX_FORMAT}"
                    )
                self.paths = PathHolds(self.db["info"])
                self.paths.drop_stale_txn(txn)  # left by a crash, or by this pid's earlier process
            self._load_tids()
        except lmdb.Error as exc:
            self.env.close()
            raise CorruptData(f"the index at {path} is damaged ({exc}); {remedy}") from exc
        except BaseException:
            self.env.close()
            raise

    def settle(self, proposed_id: bytes, propose_code: Callable[[lmdb.Transaction], dict]) -> tuple[bytes, dict]:
        """This index's identity and erasure code (see ``info``), set in one write transaction
        if it has none yet: the identity to ``proposed_id``, the code to what
        ``propose_code(txn)`` says (a dict of ``ec_type``, ``ec_k``, ``ec_m``). Several
        processes creating one directory at once agree: the first one wins, and the others
        read its identity and code here."""
        with self.env.begin(write=True) as txn:
            info = self.db["info"]
            ident = txn.get(b"identity", db=info)
            if ident is None:
                ident = proposed_id
                txn.put(b"identity", ident, db=info)
            raw = txn.get(b"code", db=info)
            if raw is None:
                code = propose_code(txn)
                txn.put(b"code", json.dumps(code, sort_keys=True).encode(), db=info)
            else:
                code = json.loads(bytes(raw))
            return bytes(ident), code

    def first_record(self, txn: lmdb.Transaction) -> Meta | None:
        """Any one record (live, else lost), or ``None`` for an empty index."""
        for name in ("entries", "lost"):
            for _ek, raw in txn.cursor(db=self.db[name]):
                return self.unpack(txn, raw)
        return None

    def close(self) -> None:
        """Give back the fragment paths this process still holds here (those whose give-back
        failed: ``kvstore.embedded.pathholds`` rule 5; never raises an LMDB error), then close."""
        self.paths.close(self.env)
        self.env.close()

    # ------------------------------------------------------------------ target ids
    def _load_tids(self) -> None:
        """Load the target table. A name recorded with credentials (an index written before
        names dropped ``user:password@``, see ``TargetSpec``) is rewritten without them, and one
        spelled ``file://localhost/`` as ``file:///`` (``target_name``), so its records name
        the target as configured today. (LMDB copies pages on write: the
        old page stays in the file as a free page until a later write reuses it, and
        ``mdb_copy -c`` drops it at once.)"""
        with self.env.begin(write=True) as txn:
            for k, v in list(txn.cursor(db=self.db["tids"])):
                i, name = struct.unpack(">H", k)[0], target_name(v.decode())
                if name != v.decode():
                    txn.put(k, name.encode(), db=self.db["tids"])
                self._tid.setdefault(name, i)
                self._tname[i] = name

    def target_names(self) -> set[str]:
        """Every target name the index has recorded (fragments of some record sat there)."""
        with self.env.begin() as txn:
            return {target_name(v.decode()) for _, v in txn.cursor(db=self.db["tids"])}

    def has_live(self) -> bool:
        """True when ``entries`` holds a record."""
        with self.env.begin() as txn:
            return txn.cursor(db=self.db["entries"]).first()

    def _target_id(self, txn: lmdb.Transaction, name: str) -> int:
        i = self._tid.get(name)
        if i is not None:
            return i
        # Another process may have assigned it since we loaded: re-read inside the write txn.
        for k, v in txn.cursor(db=self.db["tids"]):
            if target_name(v.decode()) == name:
                i = struct.unpack(">H", k)[0]
                break
        else:
            i = max([struct.unpack(">H", k)[0] for k, _ in txn.cursor(db=self.db["tids"])] + [-1]) + 1
            txn.put(struct.pack(">H", i), name.encode(), db=self.db["tids"])
        self._tid[name], self._tname[i] = i, name
        return i

    def _target_name(self, txn: lmdb.Transaction, i: int) -> str:
        name = self._tname.get(i)
        if name is None:
            raw = txn.get(struct.pack(">H", i), db=self.db["tids"])
            if raw is None:
                raise InternalError(f"index names target id {i} that has no name: this is a bug")
            name = self._tname[i] = target_name(raw.decode())
            self._tid.setdefault(name, i)
        return name

    # ------------------------------------------------------------------ records
    def pack(self, txn: lmdb.Transaction, m: Meta) -> bytes:
        ids = [self._target_id(txn, t) for t in m.targets]
        flags = (FLAG_PINNED if m.pinned else 0) | (FLAG_ALIGNED if m.aligned else 0)
        head = _META.pack(2 if m.offsets else 1, flags, m.k, m.m, len(ids), m.tokens,
                          m.plain_len, m.entry_len, m.frag_len, m.created_ns, m.access_ns, m.expires_ns, m.gen)
        if m.offsets:
            return head + struct.pack(f">{len(ids)}H{len(ids)}Q", *ids, *m.offsets)
        return head + struct.pack(f">{len(ids)}H", *ids)

    def unpack(self, txn: lmdb.Transaction, raw: bytes) -> Meta:
        (ver, flags, k, m, n, tokens, plain_len, entry_len, frag_len, created, access, expires,
         gen) = _META.unpack_from(raw, 0)
        if ver not in (1, 2):
            raise InternalError(f"index record version {ver}: this is a bug or a foreign index")
        tail = _TAILS.get((ver, n)) or _tail(ver, n)
        locs = tail.unpack_from(raw, _META.size)
        ids, offsets = (locs[:n], locs[n:]) if ver == 2 else (locs, ())
        try:
            names = tuple(map(self._tname.__getitem__, ids))  # every read's path: a C loop over known ids
        except KeyError:  # an id another process assigned since this one loaded the table
            names = tuple(self._target_name(txn, i) for i in ids)
        return Meta(k, m, tokens, plain_len, entry_len, frag_len, created, access, expires, gen,
                    names, bool(flags & FLAG_PINNED), offsets, bool(flags & FLAG_ALIGNED))

    @staticmethod
    def expires_of(raw: bytes) -> int:
        return _EXP.unpack_from(raw, _EXPIRES_OFF)[0]

    # ------------------------------------------------------------------ counters
    def add_counter(self, txn: lmdb.Transaction, name: str, delta: int) -> None:
        k = name.encode()
        cur = txn.get(k, db=self.db["info"])
        val = (_U64.unpack(cur)[0] if cur else 0) + delta
        if val < 0:
            raise InternalError(f"counter {name} went negative ({val}): this is a bug")
        txn.put(k, _U64.pack(val), db=self.db["info"])

    def counter(self, txn: lmdb.Transaction, name: str) -> int:
        cur = txn.get(name.encode(), db=self.db["info"])
        return _U64.unpack(cur)[0] if cur else 0

    # ------------------------------------------------------------------ taken paths
    def take_path_txn(self, txn: lmdb.Transaction, target: str, rel: str, who: str) -> bool:
        """Take fragment path ``rel`` on ``target`` for ``who`` ("sweep": deleting the stale copy
        there; "repair": writing a rebuilt fragment there, to record it): False when a live
        process (this one included) holds it, else held for this process until given back
        (``release_paths``), and True. A holder whose process is gone (it crashed with the
        path taken; its pid now another process's) holds nothing: it writes, deletes and
        records no more. One host, one pid namespace: see ``kvstore.embedded.pathholds``."""
        return self.paths.take_txn(txn, target, rel, who)

    def path_recorded_txn(self, txn: lmdb.Transaction, target: str, rel: str) -> bool:
        """Does any hold record sit at this path (live holder or not; ``PathHolds.recorded_txn``)?"""
        return self.paths.recorded_txn(txn, target, rel)

    def sweep_decisions(self, txn: lmdb.Transaction) -> int:
        """The orphan sweeps' count of decisions to delete unindexed files, and of deletes done
        (``info`` ``sweep_decisions``; ``kvstore.maintenance.orphans``): a writer that reads it before its
        first file and finds it unchanged in its index transaction knows none of its files was
        taken for an orphan."""
        return self.counter(txn, "sweep_decisions")

    def release_path_txn(self, txn: lmdb.Transaction, target: str, rel: str) -> None:
        """Give back a path ``take_path_txn`` took, inside ``txn`` (none held: nothing)."""
        self.paths.release_txn(txn, target, rel)

    def release_paths(self, paths: Iterable[tuple[str, str]]) -> None:
        """Give back ``(target, rel)`` paths ``take_path_txn`` took, in a write transaction of
        its own. Never raises an LMDB error (the map full, say): that is logged, and the holds
        left hold nothing for this process and are retried (``kvstore.embedded.pathholds``)."""
        self.paths.release(self.env, paths)

    # ------------------------------------------------------------------ live entries
    def get_meta(self, txn: lmdb.Transaction, ek: bytes) -> Meta | None:
        raw = txn.get(ek, db=self.db["entries"])
        return None if raw is None else self.unpack(txn, raw)

    def insert_txn(self, txn: lmdb.Transaction, ek: bytes, m: Meta) -> None:
        """Add a live entry (the caller checked that ``ek`` is free)."""
        txn.put(ek, self.pack(txn, m), db=self.db["entries"])
        if not m.pinned:
            txn.put(_U64.pack(m.access_ns) + ek, b"", db=self.db["lru"])
        if m.expires_ns:
            txn.put(_U64.pack(m.expires_ns) + ek, b"", db=self.db["ttl"])
        self.add_counter(txn, "used_bytes", m.stored_bytes)
        if m.offsets:
            txn.put(m.gen + ek, b"", db=self.db["members"])
            self._pack_update(txn, m.gen, 1, packed_bytes(m), 0)

    def _pack_update(self, txn: lmdb.Transaction, gen: bytes, d_refs: int, d_bytes: int, d_dead: int) -> int:
        """Apply deltas to pack ``gen``'s record (invariant 6); returns its record count. At
        zero the record goes, and its dead bytes with it (the caller deletes the files)."""
        cur = txn.get(gen, db=self.db["packs"])
        refs, nbytes, dead = _PACK.unpack(cur) if cur else (0, 0, 0)
        refs, nbytes, dead = refs + d_refs, nbytes + d_bytes, dead + d_dead
        if min(refs, nbytes, dead) < 0:
            raise InternalError(f"pack {gen.hex()} counts went negative: this is a bug")
        if refs:
            txn.put(gen, _PACK.pack(refs, nbytes, dead), db=self.db["packs"])
            self.add_counter(txn, "pack_dead_bytes", d_dead)
            if d_dead and dead >= self.compact_ratio * nbytes:
                txn.put(gen, b"", db=self.db["compact"])
        else:
            txn.delete(gen, db=self.db["packs"])
            txn.delete(gen, db=self.db["compact"])
            self.add_counter(txn, "pack_dead_bytes", d_dead - dead)
        return refs

    def pack_dead_txn(self, txn: lmdb.Transaction, gen: bytes, nbytes: int) -> None:
        """Count ``nbytes`` of pack ``gen`` that no record will ever name (a race loser's
        share) as its bytes and dead bytes at once (invariant 6). No-op for a pack without
        records: its writer removes it."""
        if nbytes and txn.get(gen, db=self.db["packs"]) is not None:
            self._pack_update(txn, gen, 0, nbytes, nbytes)

    def pack_info(self, txn: lmdb.Transaction, gen: bytes) -> tuple[int, int, int] | None:
        """(records, bytes, dead bytes) of pack ``gen``; ``None`` when no record is stored in it."""
        cur = txn.get(gen, db=self.db["packs"])
        return None if cur is None else _PACK.unpack(cur)

    def pack_members(self, txn: lmdb.Transaction, gen: bytes) -> list[bytes]:
        """Entry keys of the records stored in pack ``gen`` (live, lost or in the graveyard)."""
        cur = txn.cursor(db=self.db["members"])
        out = []
        if cur.set_range(gen):
            for k in cur.iternext(values=False):
                if k[:8] != gen:
                    break
                out.append(bytes(k[8:]))
        return out

    def purge_grave_txn(self, txn: lmdb.Transaction, grave_key: bytes, m: Meta) -> tuple[bool, int | None]:
        """Drop a graveyard record (its own fragment files are the caller's to delete): (dropped
        here, not by another pass first; when it was the last record of its pack, the pack's
        bytes, its files may go too, else ``None``). A record another process purged first is
        not counted twice."""
        if not txn.delete(grave_key, db=self.db["grave"]):
            return False, None
        if not m.offsets:
            return True, None
        txn.delete(m.gen + grave_key[8:25], db=self.db["members"])
        info = self.pack_info(txn, m.gen)
        return True, (info[1] if self._pack_update(txn, m.gen, -1, 0, packed_bytes(m)) == 0 and info else None)

    def _unlink_orderings(self, txn: lmdb.Transaction, ek: bytes, m: Meta) -> None:
        if not m.pinned:
            txn.delete(_U64.pack(m.access_ns) + ek, db=self.db["lru"])
        if m.expires_ns:
            txn.delete(_U64.pack(m.expires_ns) + ek, db=self.db["ttl"])

    def remove_txn(self, txn: lmdb.Transaction, ek: bytes, m: Meta, now_ns: int) -> None:
        """Take a live entry out of the index; its fragments go to the graveyard."""
        txn.delete(ek, db=self.db["entries"])
        self._unlink_orderings(txn, ek, m)
        txn.put(_U64.pack(now_ns) + ek + m.gen, self.pack(txn, m), db=self.db["grave"])
        self.add_counter(txn, "used_bytes", -m.stored_bytes)

    def update_txn(self, txn: lmdb.Transaction, ek: bytes, old: Meta, new: Meta) -> None:
        """Replace a live record, keeping the orderings in step (same fragments or not)."""
        self._unlink_orderings(txn, ek, old)
        txn.put(ek, self.pack(txn, new), db=self.db["entries"])
        if not new.pinned:
            txn.put(_U64.pack(new.access_ns) + ek, b"", db=self.db["lru"])
        if new.expires_ns:
            txn.put(_U64.pack(new.expires_ns) + ek, b"", db=self.db["ttl"])
        self.add_counter(txn, "used_bytes", new.stored_bytes - old.stored_bytes)
        self._moved_out(txn, old, new)

    def _moved_out(self, txn: lmdb.Transaction, old: Meta, new: Meta) -> None:
        """Repair rebuilt some of ``old``'s packed fragments as their own files (``new``): their
        copies in the pack are dead bytes from now on (invariant 6)."""
        if old.offsets and old.gen == new.gen and packed_bytes(new) < packed_bytes(old):
            self._pack_update(txn, old.gen, 0, 0, packed_bytes(old) - packed_bytes(new))

    def touch_txn(self, txn: lmdb.Transaction, ek: bytes, access_ns: int) -> None:
        m = self.get_meta(txn, ek)
        if m is None or access_ns <= m.access_ns:
            return
        self.update_txn(txn, ek, m, replace(m, access_ns=access_ns))

    # ------------------------------------------------------------------ lost entries
    def mark_lost_txn(self, txn: lmdb.Transaction, ek: bytes, m: Meta) -> None:
        txn.delete(ek, db=self.db["entries"])
        self._unlink_orderings(txn, ek, m)
        txn.put(ek, self.pack(txn, m), db=self.db["lost"])
        self.add_counter(txn, "lost_total", 1)

    def get_lost(self, txn: lmdb.Transaction, ek: bytes) -> Meta | None:
        raw = txn.get(ek, db=self.db["lost"])
        return None if raw is None else self.unpack(txn, raw)

    def lost_records(self, txn: lmdb.Transaction) -> list[tuple[bytes, Meta]]:
        """Every lost record (unrecoverable entries are few: a failure each), for GC's expiry
        and eviction of them."""
        return [(bytes(ek), self.unpack(txn, raw)) for ek, raw in txn.cursor(db=self.db["lost"])]

    def drop_lost_txn(self, txn: lmdb.Transaction, ek: bytes, m: Meta, now_ns: int, *, to_grave: bool) -> None:
        old = None if to_grave else self.get_lost(txn, ek)  # restoring: what repair may have moved out
        txn.delete(ek, db=self.db["lost"])
        if to_grave:
            txn.put(_U64.pack(now_ns) + ek + m.gen, self.pack(txn, m), db=self.db["grave"])
            self.add_counter(txn, "used_bytes", -m.stored_bytes)
        else:  # restored: back to live (as repaired, ``m``), keeping its bytes counted
            txn.put(ek, self.pack(txn, m), db=self.db["entries"])
            if old is not None:
                self._moved_out(txn, old, m)
            if not m.pinned:
                txn.put(_U64.pack(m.access_ns) + ek, b"", db=self.db["lru"])
            if m.expires_ns:
                txn.put(_U64.pack(m.expires_ns) + ek, b"", db=self.db["ttl"])

    # ------------------------------------------------------------------ scans for GC and tools
    def iter_db(self, txn: lmdb.Transaction, name: str, after: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) of sub-database ``name`` in key order; with ``after``, from the first key
        past it (a walk resumed in a new transaction)."""
        cur = txn.cursor(db=self.db[name])
        if after is None:
            yield from cur
            return
        if not cur.set_range(after):
            return
        if cur.key() == after:
            if not cur.next():
                return
        yield from cur.iternext()

    def oldest(self, txn: lmdb.Transaction, name: str, before_ns: int | None = None,
               limit: int | None = None) -> Iterator[tuple[int, bytes]]:
        """(time, rest of key) from the ``lru``/``ttl``/``grave`` ordering, oldest first."""
        n = 0
        for k, _ in txn.cursor(db=self.db[name]):
            t = _U64.unpack_from(k, 0)[0]
            if before_ns is not None and t >= before_ns:
                return
            yield t, k[8:]
            n += 1
            if limit is not None and n >= limit:
                return

    # ------------------------------------------------------------------ lookup
    def _none_expired(self, txn: lmdb.Transaction, now_ns: int) -> bool:
        """True when no record has expired yet: the soonest ``ttl`` key is in the future (or
        there is none). By invariant 3 every expiring live entry has a ``ttl`` record, so then
        no live record needs its own expiry check (lookup's common case: GC keeps expired
        records few and short-lived)."""
        first = txn.cursor(db=self.db["ttl"])
        return not first.first() or _U64.unpack_from(first.key())[0] > now_ns

    @staticmethod
    def _live_iter(cur: lmdb.Cursor, eks: Iterable[bytes], fresh: bool, now_ns: int) -> Iterator[bool]:
        """Per record key of ``eks``, lazily (each read when asked for): True when its record
        is present and has not expired (lookup's expiry rule). When nothing has expired
        (``fresh``, see ``_none_expired``) only presence is asked: positioning the cursor
        copies no value, cheaper than ``getmulti`` for a found key."""
        if fresh:
            return map(cur.set_key, eks)
        unpack, off, value = _EXP.unpack_from, _EXPIRES_OFF, cur.value
        return (cur.set_key(ek) and not 0 < unpack(value(), off)[0] <= now_ns for ek in eks)

    @classmethod
    def _live_flags(cls, cur: lmdb.Cursor, eks: list[bytes], fresh: bool, now_ns: int) -> list[bool]:
        """``_live_iter`` over all of ``eks``."""
        return list(cls._live_iter(cur, eks, fresh, now_ns))

    @classmethod
    def _hit(cls, cur: lmdb.Cursor, ekeys: Iterable[bytes], n: int, fresh: bool, now_ns: int) -> int:
        """How many of the ``n`` record keys ``ekeys`` (a chain's blocks, in order) are live
        before the first that is not; none past that one is read (C loops, as fast as a list)."""
        return next(compress(count(), map(not_, cls._live_iter(cur, ekeys, fresh, now_ns))), n)

    def probe(self, keys: Sequence[bytes], block_code: int, swa_code: int, now_ns: int, *,
              until_miss: bool = False, chain_ends: Sequence[int] | None = None) -> tuple[bytes, bytes]:
        """Per key, independently: 1 if a live block entry, and 1 if *also* a live SWA entry
        (what ``lookup`` of that key alone would say); two byte strings, one read transaction,
        O(len(keys)). A sharded client probes every key of a chain on its shard and walks the
        prefix itself. ``until_miss`` (``keys`` are one chain's share, in chain order): stop
        after the first key without a live block entry, so the strings end with that key's 0
        (or cover every key when all are live): O(hit) reads, as ``lookup``. ``chain_ends``
        (``keys`` are several chains' shares one after another, share j ending before index
        ``chain_ends[j]``; checked by ``kvstore.api.check_chain_ends``): each share is read as
        ``until_miss`` reads one, and the strings cover every key, a key not read answering 0.
        """
        bp, sp = bytes((block_code,)), bytes((swa_code,))
        with self.env.begin() as txn:
            fresh = self._none_expired(txn, now_ns)
            cur = txn.cursor(db=self.db["entries"])
            if until_miss:
                hit = self._hit(cur, map(bp.__add__, keys), len(keys), fresh, now_ns)
                blocks = [True] * hit + [False] * (hit < len(keys))
            elif chain_ends is not None:
                blocks, start = [False] * len(keys), 0
                for end in chain_ends:
                    hit = self._hit(cur, map(bp.__add__, keys[start:end]), end - start, fresh, now_ns)
                    blocks[start:start + hit] = [True] * hit
                    start = end
            else:
                blocks = self._live_flags(cur, [bp + k for k in keys], fresh, now_ns)
            swas = self._live_flags(cur, [sp + k for k, b in zip(keys, blocks) if b], fresh, now_ns)
        it = iter(swas)
        return bytes(blocks), bytes(b and next(it) for b in blocks)

    def lookup(self, keys: Sequence[bytes], block_code: int, swa_code: int, now_ns: int) -> tuple[int, int | None]:
        """Longest live block prefix of the chain ``keys`` and the last SWA boundary within it.

        O(hit) point reads in one read transaction: at most ``hit + 1`` block keys and ``hit``
        SWA keys (usually a few, snapshots being near the hit); nothing is written.
        """
        if not keys:
            return 0, None
        bp, sp = bytes((block_code,)), bytes((swa_code,))
        with self.env.begin() as txn:
            cur = txn.cursor(db=self.db["entries"])
            fresh = self._none_expired(txn, now_ns)
            # The prefix ends at the first block that is not live; no key past it is read, so a
            # chain that misses early costs its hit, not its length (a new prompt: one read).
            hit = self._hit(cur, map(bp.__add__, keys), len(keys), fresh, now_ns)
            # The last live SWA entry at or below the hit: SWA keys read backwards from the hit,
            # lazily, stopping at the first live one (snapshots sit at turn ends and fixed
            # intervals, so usually a few reads; with no snapshot, each SWA key once).
            swa_live = self._live_iter(cur, map(sp.__add__, reversed(keys[:hit])), fresh, now_ns)
            swa_at = next(compress(range(hit, 0, -1), swa_live), None)
            return hit, swa_at
