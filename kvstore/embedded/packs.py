"""Pack files of the embedded store: a batch's fragments published as one file per target,
and compaction of packs that are mostly dead.

``PackIO`` is a mixin of ``kvstore.embedded.store.EmbeddedStore`` beside ``FragmentIO`` (whose
``_encode``, ``_encode_entry``, ``_fan_out_writes`` and ``_read_verified`` it uses, with the store's
``config``, ``targets``, ``target_specs``, ``index``, ``_pool``, ``_batch_pool``,
``_count``, ``_touch``, ``_index_new``, ``_check_open``, ``clock`` and ``now_ns``). The
write half (``_put_packs`` and what it calls) is also the direct-writing client's
(``kvstore.client.direct_writes.DirectWriter``, which has no index); ``commit_written`` is the
daemon's side of those writes. Where packs sit in the write path is in ``kvstore.embedded.store``'s
docstring; their names in ``kvstore.embedded.targets``; their bookkeeping (record counts, dead
bytes, the compaction queue) in ``kvstore.embedded.index`` invariant 6; when GC compacts them
in ``kvstore.maintenance.passes``. The read path finds a packed fragment through
``kvstore.embedded.fragments.frag_loc``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Sequence

from kvstore.embedded import codec
from kvstore.api import EntryKind, PutItem, as_payload
from kvstore.errors import CorruptData, InvalidRequest, StoreUnavailable, Unrecoverable
from kvstore.embedded.fragments import (FilesSwept, GenerationTaken, IndexFull, WrittenTooLongAgo, _Encoded, expiry_ns,
                               in_flight, run_now)
from kvstore.embedded.index import STANDALONE, Meta, packed_bytes
from kvstore.embedded.placement import place
from kvstore.embedded.targets import pack_path

log = logging.getLogger("kvstore.embedded.store")


@dataclass(frozen=True, slots=True)
class CommitResult:
    """What ``PackIO.commit_written`` did: per entry, indexed now or not; and the packs it
    rejected (generation -> why), none of whose entries was indexed."""

    created: list[bool]
    rejected: dict[bytes, str]


@dataclass(frozen=True, slots=True)
class WrittenEntry:
    """An entry whose fragments a client wrote itself into pack files (``kvstore.client.direct_writes``),
    to be indexed by ``PackIO.commit_written``: the index record's fields the writer knows.
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


class PackIO:
    """Pack writes and compaction (see the module docstring)."""

    def _write_pack(self, encs: Sequence[_Encoded], gen: bytes) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
        """A batch's fragments (all encoded with generation ``gen``), one pack file per target:
        each entry's fragments go to the targets rendezvous hashing picks for it, as single
        puts do, and each target's share is published with one atomic write (one fsync and
        one directory fsync instead of one per fragment). Per entry: (targets, offsets).
        Any failing target raises ``OSError`` after removing what was written; the caller
        then writes the batch fragment by fragment, where failed targets are replaced."""
        shares: dict[str, list[bytes]] = {}
        sizes: dict[str, int] = {}
        out = []
        for enc in encs:
            chosen = place(enc.key, self.target_specs, len(enc.frames))
            flen = enc.meta_base.frag_len
            offsets = []
            for name, frame in zip(chosen, enc.frames):
                offsets.append(sizes.get(name, 0))
                shares.setdefault(name, []).extend(frame)
                sizes[name] = offsets[-1] + flen
            out.append((tuple(chosen), tuple(offsets)))
        rel = pack_path(gen)
        errors: dict[str, OSError] = self._run_writes({name: (name, rel, parts) for name, parts in shares.items()},
                                                      fan_out=self._fan_out_writes(list(shares), in_batch=False))
        if not errors:
            try:
                self._sync_after(list(shares))
            except OSError as exc:
                errors["(syncfs)"] = exc
        if errors:
            self._discard_pack(gen, [n for n in shares if n not in errors])
            name, exc = next(iter(errors.items()))
            log.warning("pack %s: target %s failed (%s); its entries go the fallback way (fragment by "
                        "fragment here, or through the daemon for a direct writer)",
                        gen.hex(), name, exc)
            raise exc
        return out

    def _discard_pack(self, gen: bytes, names: Sequence[str]) -> int:
        """Remove a pack that no index record names (best effort: else an orphan); the bytes
        removed (a file not there, or not removed, counts nothing: GC's reclaimed bytes)."""
        freed = 0
        for name in names:
            t = self.targets.get(name)
            if t is not None:
                try:
                    size = t.stat(pack_path(gen))[0]
                    freed += size * t.delete(pack_path(gen))  # not counted when removed meanwhile
                except OSError:
                    pass  # not on this target, or an orphan GC will sweep
        return freed

    def _put_packs(self, items: Sequence[PutItem], todo: list[int], encs: dict, placed: dict,
                   offsets: dict) -> None:
        """Steps 3-4 for a batch: encode it in chunks of about ``pack_bytes`` payload bytes,
        each chunk one generation and one pack per target; a chunk's pack writes run on a
        thread while the next chunk is encoded (encoding holds the GIL, writes wait in the
        kernel); the last chunk's run here. Fills ``encs``, and ``placed`` and ``offsets``
        for the chunks written. A chunk whose packs fail stays unplaced: the caller writes
        it fragment by fragment."""
        writes = []
        chunk: list[int] = []
        size = 0
        gen = os.urandom(8)
        try:
            for n, i in enumerate(todo):
                it = items[i]
                encs[i] = self._encode(it.key, it.value, it.kind, it.ttl_s, it.layout, it.tokens, gen)
                chunk.append(i)
                size += encs[i].meta_base.plain_len
                last = n == len(todo) - 1
                if size >= self.config.pack_bytes or last:
                    # On a thread only while there is encoding left to overlap it with.
                    submit = run_now if last or self.config.parallel_writes == "never" else self._batch_pool.submit
                    writes.append((chunk, gen, submit(self._write_pack, [encs[j] for j in chunk], gen)))
                    chunk, size, gen = [], 0, os.urandom(8)
        except BaseException:  # a bad item: nothing of this batch may stay behind
            for _chunk, g, fut in writes:
                if fut.exception() is None:
                    self._discard_pack(g, list(self.targets))
            raise
        for chunk, _gen, fut in writes:
            try:
                for i, (names, offs) in zip(chunk, fut.result()):
                    placed[i], offsets[i] = names, offs
            except OSError:
                pass  # logged by _write_pack

    def _discard_unused_packs(self, encs: dict, placed: dict, offsets: dict, result: list[bool]) -> None:
        """After a batch's commit: remove each of its packs in which no entry was committed
        (every one lost its race to another writer)."""
        by_gen: dict[bytes, list[int]] = {}
        for i in offsets:
            by_gen.setdefault(encs[i].meta_base.gen, []).append(i)
        for gen, members in by_gen.items():
            if not any(result[i] for i in members):
                self._discard_pack(gen, sorted({n for i in members for n in placed[i]}))

    @in_flight
    def commit_written(self, entries: Sequence[WrittenEntry], *, shown: Sequence[bytes] = ()) -> CommitResult:
        """Index entries a client wrote into pack files itself (the daemon's ``Commit``;
        ``kvstore.client.direct_writes``): steps 5-6 of a put, after checking what the index will
        rely on. Per entry, ``created`` is ``False`` where a live entry of the key already
        exists (its bytes stay in the pack: the writer removes a pack none of whose entries
        was indexed) or where its pack was rejected.

        Checked first, all or nothing (``InvalidRequest``, nothing indexed), what only a
        wrong or malicious writer sends: the erasure code is this store's; the targets are
        k+m distinct known ones; sizes are consistent. Then per pack: it is new to the index
        (a generation names one batch; another writer may have claimed it first), and on
        every target it is present, exactly as long as the fragments placed in it (no bytes
        kept alive that no record counts or quota charges), and written less than half of
        ``orphan_grace_s`` ago (for sweeps of versions that do not record their decisions);
        and inside the index transaction, no orphan sweep has taken it (``_check_unswept_txn``:
        no hold on its path; and, if a sweep decided since the stats, still there). If any pack
        fails, or the index's write lock came too late for the oldest (``_check_in_time``), or a
        sweep took one (``FilesSwept``), every pack is ``rejected`` (generation
        -> why) and nothing indexed: a commit is all or nothing, as ``put_many``, and the
        writer puts the whole batch another way. The bytes themselves are not read: every
        read checks each fragment's checksum and header (key, generation, index) against the
        record, so a wrong byte is never returned. ``shown``: the keys as the caller sent them,
        one per entry, which the messages name (default: the stored keys).
        """
        self._check_open()
        if not entries:
            return CommitResult([], {})
        cfg = self.config
        now = self.now_ns()
        n = cfg.ec_k + cfg.ec_m
        need: dict[tuple[bytes, str], int] = {}
        records = []
        for j, e in enumerate(entries):
            what = f"written entry {(shown[j] if j < len(shown) else e.ek[1:]).hex()}"
            if (e.k, e.m) != (cfg.ec_k, cfg.ec_m):
                raise InvalidRequest(f"{what}: erasure code {e.k}+{e.m}; this store uses {cfg.ec_k}+{cfg.ec_m}")
            if len(e.targets) != n or len(set(e.targets)) != n or any(t not in self.targets for t in e.targets):
                raise InvalidRequest(f"{what}: needs {n} distinct targets of this store, got {list(e.targets)}")
            if len(e.offsets) != n or STANDALONE in e.offsets or len(e.gen) != 8:
                raise InvalidRequest(f"{what}: needs an 8-byte generation and {n} pack offsets")
            # The bytes are not read, so the sizes a quota charges must follow from what is checked:
            # the fragments (their packs' lengths are) hold at most padding beyond the entry, and
            # the entry at most a header beyond its payload (compressed: less). Before, a writer
            # could declare plain_len=0 for a megabyte of fragments and be charged nothing.
            share = e.frag_len - codec.FRAG_HEADER_LEN - (self.code.data_lead or 0)
            if not (0 <= e.plain_len <= cfg.max_value_bytes and 0 < e.entry_len <= e.k * share
                    and e.k * share - e.entry_len <= e.k * codec.MAX_SHARE_PADDING
                    and e.entry_len <= e.plain_len + codec.ENTRY_HEADER_MAX
                    and codec.FRAG_HEADER_LEN < e.frag_len and 0 <= e.tokens < 2**32):
                raise InvalidRequest(f"{what}: inconsistent sizes (plain {e.plain_len}, entry {e.entry_len}, "
                                     f"fragment {e.frag_len}) or tokens {e.tokens}")
            records.append((e.ek, Meta(e.k, e.m, e.tokens, e.plain_len, e.entry_len, e.frag_len, now, now,
                                       expiry_ns(e.ttl_s, cfg.default_ttl_s, now), e.gen, e.targets,
                                       offsets=e.offsets)))
            for name, off in zip(e.targets, e.offsets):
                need[(e.gen, name)] = max(need.get((e.gen, name), 0), off + e.frag_len)
        rejected: dict[bytes, str] = {}
        with self.index.env.begin() as txn:
            since = self.index.sweep_decisions(txn)  # before the stats below (``_check_unswept_txn``)
            for g in {g for g, _ in need}:
                if self.index.pack_info(txn, g) is not None:  # another commit (another writer's?) took it
                    rejected[g] = (f"pack generation {g.hex()} already holds indexed entries; each batch is "
                                   "written under a fresh random generation")
        file_now, now_s = self.file_clock(), self.clock()
        oldest = file_now - cfg.orphan_grace_s / 2
        written_at = now_s  # of the oldest pack indexed, on ``clock`` (``_check_in_time``)
        for (gen, name), size in need.items():
            if gen in rejected:
                continue
            try:
                got, mtime = self.targets[name].stat(pack_path(gen))
            except OSError as exc:  # FileNotFoundError included
                rejected[gen] = f"pack {gen.hex()} cannot be checked on target {name}: {exc}"
                continue
            if got != size:  # a writer's pack holds its entries' fragments and nothing else: no bytes unaccounted
                rejected[gen] = f"pack {gen.hex()} on target {name} has {got} bytes; its entries make {size}"
            elif mtime < oldest:
                rejected[gen] = (f"pack {gen.hex()} on target {name} was written more than orphan_grace_s/2 = "
                                 f"{cfg.orphan_grace_s / 2:.0f} s ago; GC may be sweeping it as an orphan")
            else:
                written_at = min(written_at, now_s - (file_now - mtime))
        if rejected:  # all or nothing, as put_many: the writer puts the whole batch another way
            why = next(iter(rejected.values()))
            for e in entries:
                rejected.setdefault(e.gen, f"another pack of this commit was rejected ({why})")
        keep = [j for j, e in enumerate(entries) if e.gen not in rejected]
        try:
            # The generations again, inside the index transaction: two commits naming one new
            # generation both pass the read above; only the first to take the lock indexes.
            made = self._index_new([records[j] for j in keep], now,
                                   written_at=(written_at, "committing written packs"),
                                   fresh_gens=sorted({entries[j].gen for j in keep}),
                                   unswept=(since, sorted((name, pack_path(g)) for g, name in need
                                                          if g not in rejected)))
        except (WrittenTooLongAgo, GenerationTaken, FilesSwept, IndexFull) as exc:  # all rejected, as above
            rejected.update({entries[j].gen: str(exc) for j in keep})
            keep, made = [], []
        created = [False] * len(entries)
        for j, c in zip(keep, made):
            created[j] = c
            if not c:  # a re-put of a live key: refresh it, as put does
                self._touch(records[j][0], now)
                self._count("puts_deduplicated")
        self._count("rejected_packs", len(rejected))
        for why in rejected.values():
            log.warning("commit: %s; its entries are not indexed", why)
        return CommitResult(created, rejected)

    def _rewrite(self, members: Sequence[tuple[bytes, Meta]]) -> int:
        """Compaction (``kvstore.maintenance.passes``): read these live entries of one pack, write
        them into a new pack, and swap each record whose generation did not change meanwhile;
        the old records go to the graveyard (readers holding them finish within the grace)
        and the old pack goes with the last of them. Times, TTL and pin are kept (the new
        entry headers carry the record's created and expiry times, as a put's do). An entry
        that fails to read stays where it is (if lost, the read marked it; if its targets could
        not be asked, ``StoreUnavailable``, it is moved by a later pass); so does one that cannot
        be encoded again (logged). Entries are moved, not put: a put's admission limits
        (``max_value_bytes``, capacity), which may have been lowered since they were stored, do
        not apply (``FragmentIO._encode_entry``; times are the old record's). Returns the count moved.
        ``StoreUnavailable`` (nothing moved; the pack stays queued) when the new pack cannot be
        written, or was written too long ago to be indexed safely (``_check_in_time``), or an orphan
        sweep took it before it was indexed (``FilesSwept``, ``_check_unswept_txn``)."""
        gen = os.urandom(8)
        with self.index.env.begin() as txn:  # before the new pack is written (``_check_unswept_txn``)
            since = self.index.sweep_decisions(txn)
        encs = []
        for ek, m in members:
            try:
                h, plain = self._read_verified(ek, m)
            except (Unrecoverable, StoreUnavailable) as exc:
                log.error("compaction: %s", exc)
                continue
            try:
                kind = EntryKind.from_code(ek[0])
                payload, lay = as_payload(bytes(plain), h.layout)
                encs.append((ek, m, self._encode_entry(ek[1:], kind, payload, lay, h.tokens, gen,
                                                                 m.created_ns, m.expires_ns)))
            except (InvalidRequest, CorruptData) as exc:  # a record this version cannot write back
                log.warning("compaction: entry %s stays in pack %s: %s", ek[1:].hex(), m.gen.hex(), exc)
        if not encs:
            return 0
        started = self.clock()
        try:
            locs = self._write_pack([e for _, _, e in encs], gen)
        except OSError as exc:  # the pack stays queued (``kvstore.maintenance.passes``): a later pass retries
            raise StoreUnavailable(f"compaction of {len(encs)} entries postponed: {exc}") from exc
        moved = 0
        now = self.now_ns()
        try:
            with self.index.env.begin(write=True) as txn:
                self._check_in_time(started, f"compacting {len(encs)} entries")
                self._check_unswept_txn(txn, since, sorted({(n, pack_path(gen)) for names, _ in locs for n in names}))
                dead = []
                for (ek, old, enc), (names, offs) in zip(encs, locs):
                    new = replace(enc.meta_base, targets=names, offsets=offs)
                    cur = self.index.get_meta(txn, ek)
                    if cur is None or cur.gen != old.gen:
                        dead.append(new)  # deleted, evicted or re-put meanwhile: our copy is dead on arrival
                        continue
                    self.index.remove_txn(txn, ek, cur, now)
                    self.index.insert_txn(txn, ek, replace(new, created_ns=cur.created_ns, access_ns=cur.access_ns,
                                                           expires_ns=cur.expires_ns, pinned=cur.pinned))
                    moved += 1
                for m in dead:  # counted once the pack has records (index invariant 6), as _index_new does
                    self.index.pack_dead_txn(txn, gen, packed_bytes(m))
        finally:  # nothing indexed (every copy dead on arrival, or too late: WrittenTooLongAgo; or
            # swept: FilesSwept; the old pack stays queued): the new pack goes
            if not moved:
                self._discard_pack(gen, sorted({n for names, _ in locs for n in names}))
        self._count("compacted_entries", moved)
        return moved
