"""Direct writes: the client encodes a batch and writes its pack files itself; the daemon indexes them.

Who calls it: ``kvstore.client.remote.RemoteStore`` (so also every shard of a ``ShardedStore``)
for ``put`` and ``put_many`` when opened with ``kvstore.connect("grpc://H:P",
direct_writes="on")`` or ``"auto"``; the daemon answers with ``Describe`` and ``Commit``
(``kvstore.server.direct_rpc``), which calls ``kvstore.embedded.store.EmbeddedStore.commit_written``.

Why: over gRPC every payload byte crosses protobuf and a socket into the
daemon, whose one process then erasure-codes and writes the whole fleet's puts. Where
the targets are a distributed file system every engine host mounts (or S3), the client
can encode and write the fragments exactly as the embedded store does, on its own
cores, and the daemon stays the metadata service: it checks and commits index records.
This is ``kvstore.client.direct_reads`` (direct reads) for the write path.

Write steps (``DirectWrites.put_many``), in order, each for its reason:
  1. Once per client, on the first put: ``Describe`` -> the target table, the erasure
     code and the daemon store's encoding knobs (compression, pack size, fsync), and the
     caller's tenant secret, so fragment headers name the key the daemon stores the entry
     under (``kvstore.keys.tenant_key``; empty for the anonymous tenant: keys as sent), and
     ``writer_view``, a digest of all that, which every ``Commit`` carries back.
  2. Every item comes validated by the client (``kvstore.wire.encode_item``); check each
     against the daemon store's limits as the embedded store does (same errors, nothing
     written for a bad batch), drop repeats of a key within the batch, then encode and write it with
     the embedded store's own batch code (``FragmentWriter.write_packs``): chunks of about
     ``pack_bytes``, one pack file per target per chunk, each published atomically and
     durable first when the daemon's store fsyncs.
  3. One ``Commit`` with the records of every chunk written. The daemon checks them
     (erasure code, targets, sizes: else INVALID_ARGUMENT) and every pack (new, present on
     each target, its fragments end to end and nothing else, fresh: else it is *rejected*, and with it
     every pack of the commit), and indexes them all in one transaction, charged to the
     tenant's quota. The put is acknowledged only then: a key already live answers
     ``False``, as a put does.
  4. A pack none of whose entries was indexed (every key was live, or the commit was
     rejected) is removed; a rejected batch goes through ``PutStream`` whole.

Failures, each kept apart (a batch is all or nothing, as ``put_many``: never part of it
committed here and the rest refused there):
  * A chunk whose pack write fails on any target (a full or failing mount), or a commit the
    daemon rejects (a silently short write, a target it cannot reach, a commit stalled past
    half the orphan grace, a generation another writer took): every pack of the batch is
    removed and the whole batch goes through ``PutStream``, where the daemon replaces a
    failed target by a spare.
  * ``Commit`` refused as stale (``StaleDescribe``: the daemon restarted since ``Describe`` on
    another data directory, tenant secret or erasure code, or the token now names another
    tenant, so fragment headers would name keys the daemon does not index under and the
    acknowledged entries would read as lost): nothing was indexed; the packs are removed,
    the writer is replaced after a fresh ``Describe`` and the batch written again, once; stale
    again (the views keep differing: two daemons behind one address, say), the batch goes
    through ``PutStream`` and direct writes turn off for this client. Never an acknowledged
    put that reads back lost.
  * ``Commit`` refused with PERMISSION_DENIED (the daemon stopped allowing direct writes):
    they turn off for this client, the packs are removed, the batch goes through ``PutStream``.
  * ``Commit`` refused before indexing anything (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
    UNAUTHENTICATED): the packs are removed and the error raised, as a put would raise it.
  * Any other failure of ``Commit`` (the daemon down, a timeout): the error is raised and
    the packs stay, since the commit may have happened; if it did not, they are orphans.
    So is everything a client that crashes between steps 2 and 3 wrote: GC sweeps orphans
    after ``orphan_grace_s``. Never an index record without its fragments.

Modes (``ClientOptions.direct_writes``; environment ``KVSTORE_DIRECT_WRITES``): "off" (the
default), "on" (whenever the daemon allows them; if its targets cannot be opened here, off
with a warning), "auto" (on only when the daemon allows them and mode "auto" of direct
reads would turn on: no tokens, every target a local directory here, the daemon's
data-dir marker read back byte for byte).

Security. A direct write needs the client to be trusted with write access to every
target's files, which a writable DFS mount already implies; the daemon's
``allow_direct_writes`` is off by default. What the daemon indexes stays confined to the
caller: ``Commit`` translates keys exactly as ``Put`` does, so a tenant commits only
under its own stored keys, and every read checks each fragment's checksum and header
(key, generation, index) against the record, so a forged or damaged pack costs its writer
the entry and never returns wrong bytes to anyone. ``Describe`` gives a caller its own
tenant secret only when direct writes are allowed: it maps the caller's keys, and reveals
nothing of another tenant's (the server secret stays on the daemon).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from kvstore.embedded import codec
from kvstore.api import PutItem
from kvstore.config import StoreConfig, TargetSpec
from kvstore.client.direct_reads import DirectPath, auto_decision
from kvstore.errors import CapacityExceeded, InternalError, InvalidRequest, KVStoreError, StoreUnavailable
from kvstore.embedded.fragment_writes import FragmentWriter, PendingEntry
from kvstore.keys import tenant_key
from kvstore.proto import kvstore_pb2 as pb
from kvstore.errors import PermissionDenied, RequestTooLarge, ServerBusy, StaleDescribe, Unauthenticated
from kvstore.embedded.targets import Target, TargetPools, open_target
from kvstore.embedded.tuning import tune_malloc
from kvstore.wire import EncodedPut

log = logging.getLogger(__name__)

# Commit errors that mean "nothing was indexed": the packs of the batch may go at once. Not a
# ``CapacityExceeded`` whose ``created`` names entries the commit indexed before its eviction pass
# found no room (``_put_with``).
REFUSED = (InvalidRequest, ServerBusy, Unauthenticated, PermissionDenied, CapacityExceeded)

# The gRPC put of the client. It must take whatever the client let through to this path (each item
# within max_message_bytes, their total unbounded): it sends them in messages that fit, never refusing
# a piece after earlier pieces of its batch were committed (``kvstore.client.puts.Puts.send_fitting``).
PutFallback = Callable[[Sequence[EncodedPut]], list]


class DirectWriter:
    """A write-only worker over the daemon's targets (step 2): the embedded store's own write
    half (``kvstore.embedded.fragment_writes.FragmentWriter``) built over them.

    Invariants, each for its reason:
      1. It writes and removes only pack files of batches it encoded itself, and only
         before their ``Commit`` or after one that indexed none of their entries: the
         daemon owns the index and every file it names.
      2. Its encoding is the daemon store's (code, compression, pack size, fsync from
         ``Describe``), so a committed entry is indistinguishable from one put over gRPC.
    """

    def __init__(self, d: pb.DescribeReply, *, workers: int = 8):
        specs = tuple(TargetSpec(t.url, t.domain or "default", t.name) for t in d.targets)
        # Durability: fsync as the daemon's store; sync_mode "auto", resolved for this host's own mounts.
        self.config = StoreConfig(
            data_dir=d.data_dir or ".", ec_k=d.ec_k, ec_m=d.ec_m, ec_type=d.ec_type, targets=specs,
            max_value_bytes=d.max_value_bytes or StoreConfig.max_value_bytes,
            compression=d.compression or "none", zstd_level=d.zstd_level,
            min_compress_ratio=d.min_compress_ratio or StoreConfig.min_compress_ratio,
            pack_bytes=d.pack_bytes or StoreConfig.pack_bytes, fsync=d.fsync,
            parallel_writes=d.parallel_writes or "auto",
            orphan_grace_s=d.orphan_grace_s or StoreConfig.orphan_grace_s,
            default_ttl_s=d.default_ttl_s or None)
        self.targets: dict[str, Target] = {s.name: open_target(s) for s in specs}
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-dwrite-io")
        self._batch_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-dwrite")
        self.secret = bytes(d.key_secret)
        self.view = bytes(d.writer_view)  # sent with every Commit: the daemon refuses it once out of date
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {"direct_writes": 0, "direct_write_bytes": 0, "fallbacks": 0,
                                         "commits": 0, "rejected_packs": 0, "discarded_packs": 0}
        self.writer = FragmentWriter(self.config, self.targets, specs, codec.erasure_code(d.ec_k, d.ec_m, d.ec_type),
                                     TargetPools(self.config.read_workers), self._pool, self._batch_pool,
                                     count=self.count, now_ns=time.time_ns,
                                     on_pack_discarded=lambda: self.count("discarded_packs"))
        if self.config.tune_malloc:
            tune_malloc()  # as the embedded store does: buffers of 128 KiB+ without a fresh mmap each

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def stored_key(self, key: bytes) -> bytes:
        return tenant_key(key, self.secret) if self.secret else key

    def close(self) -> None:
        self._batch_pool.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self.writer.close()


class DirectWrites(DirectPath):
    """The direct-write path of one ``RemoteStore``: mode, Describe once, write, Commit, fall back.

    ``call(method, request)`` is the client's unary call (typed errors, token, deadline).
    ``put_many`` returns ``None`` when direct writes are not usable right now (off, the
    daemon unreachable before the first Describe, or it stopped allowing them): the caller
    then puts over gRPC as without this object.
    """

    option = "direct_writes"

    def __init__(self, mode: str, call: Callable[[str, Any], Any], url: str, *, max_items: int):
        super().__init__(mode, url)
        self.max_items = max_items
        self._call = call

    def writer(self) -> DirectWriter | None:
        w = self._current
        if w is not None or self._off:
            return w
        with self._lock:
            if self._current is not None or self._off:
                return self._current
            try:
                d = self._call("Describe", pb.DescribeRequest())
            except StoreUnavailable:
                return None  # unreachable or busy: this batch over gRPC (which raises the same), next time again
            except KVStoreError as exc:  # Describe refused (UNIMPLEMENTED, PERMISSION_DENIED, ...)
                return self._turn_off(f"Describe failed: {exc}")
            why = "" if d.direct_writes else "the daemon does not accept direct writes (allow_direct_writes = false)"
            if not why and self.mode == "auto":
                why = auto_decision(d)
            if why:
                return self._turn_off(why, warn=self.mode == "on")
            try:
                self._current = DirectWriter(d)
            except (KVStoreError, ImportError, OSError, ValueError) as exc:
                return self._turn_off(f"cannot open the daemon's targets here: {exc}", warn=True)
            self.reason = ""
            log.info("direct writes on for %s (%d targets)", self.url, len(self._current.targets))
            return self._current

    def _retire(self, w: DirectWriter, why: str) -> None:
        """Replace ``w`` (out of date) on the next ``writer()``: a fresh Describe, a new writer.
        Other threads may still be using ``w``: it closes last, with this object."""
        with self._lock:
            if self._current is w:
                self._retired.append(w)
                self._current = None
                self.reason = f"describing again ({why})"

    def put_many(self, items: Sequence[EncodedPut], fallback: PutFallback) -> list[bool] | None:
        """Steps 2-4 (module docstring) for puts validated and encoded by the client
        (``kvstore.wire.encode_item``, whose ``EncodedPut.item`` is the put with its key and kind
        checked and typed); ``None``: put these over gRPC instead. A Commit refused
        as stale (``StaleDescribe``) wrote nothing that stays: described again and rewritten
        once, then through ``fallback``."""
        if len(items) > self.max_items:
            return None  # the daemon refuses such a batch; its error comes from the gRPC path
        for attempt in (1, 2):
            w = self.writer()
            if w is None:
                return None
            try:
                return self._put_with(w, items, fallback)
            except StaleDescribe as exc:
                if attempt == 1:
                    self._retire(w, str(exc))
                    log.info("direct write to %s refused as stale (%s); describing again", self.url, exc)
                else:  # stale right after a fresh Describe: the views keep differing (two daemons behind one
                    # address, say); off, rather than two Describes and two discarded batches per put
                    self._turn_off(f"Commit refused as stale right after a fresh Describe ({exc})", warn=True)
        w.count("fallbacks", len(items))
        return fallback(items)

    def _put_with(self, w: DirectWriter, items: Sequence[EncodedPut], fallback: PutFallback) -> list[bool] | None:
        """One attempt of ``put_many`` with writer ``w``; ``StaleDescribe`` raised with its packs removed."""
        result = [False] * len(items)
        entries: list[PendingEntry] = []
        seen: set[bytes] = set()
        for i, enc in enumerate(items):  # validated before anything is written (step 2)
            it = enc.item  # key and kind checked and typed by the client (``encode_item``)
            ek = bytes((it.kind.code,)) + it.key
            stored = PutItem(w.stored_key(it.key), it.value, it.kind, it.ttl_s, it.layout, it.tokens)
            if ek in seen:  # stored once, but refused like any item (over max_value_bytes too), as put_many is
                w.writer.checked(stored)
            else:
                seen.add(ek)
                entries.append(PendingEntry(stored, i))
        w.writer.write_packs(entries)  # a bad item raises here, nothing left behind
        if any(not e.in_pack for e in entries):  # a pack failed here: the whole batch goes another way
            w.writer.discard_unindexed(entries)  # nothing indexed: every pack goes
            w.count("fallbacks", len(entries))
            return fallback(items)
        try:
            created, rejected = self._commit(w, items, entries) if entries else ([], {})
        except PermissionDenied as exc:
            w.writer.discard_unindexed(entries)
            self._turn_off(f"Commit refused: {exc}", warn=True)
            return None
        except CapacityExceeded as exc:
            if exc.created is not None and len(exc.created) == len(entries):
                # Indexed, then the eviction after it found no room: the packs of what it indexed stay.
                for e, c in zip(entries, exc.created):
                    e.created = c
                exc.widen_created([e.slot for e in entries], result)
            w.writer.discard_unindexed(entries)  # packs none of whose entries was indexed
            raise
        except RequestTooLarge as exc:  # over what the daemon's Commit takes: put as over gRPC, whose limits decide
            w.writer.discard_unindexed(entries)
            log.info("direct write refused by %s (%s); putting the batch through the daemon", self.url, exc)
            w.count("fallbacks", len(entries))
            return fallback(items)
        except (StaleDescribe, *REFUSED):  # nothing indexed: the packs go; put_many describes again on a stale one
            w.writer.discard_unindexed(entries)
            raise
        for e, c in zip(entries, created):
            e.created = result[e.slot] = c
        w.writer.discard_unindexed(entries)  # rejected packs included: nothing indexed
        for why in rejected.values():
            log.warning("direct write rejected by %s: %s; putting its entries through the daemon", self.url, why)
        w.count("commits")
        w.count("rejected_packs", len(rejected))
        w.count("direct_writes", sum(created))
        w.count("direct_write_bytes", sum(e.enc.meta_base.plain_len for e in entries if e.created))
        # Packs rejected there (then every one: a commit is all or nothing): the daemon writes them.
        rest = [e.slot for e in entries if e.enc.meta_base.gen in rejected]
        if rest:
            w.count("fallbacks", len(rest))
            try:
                got = fallback([items[i] for i in rest])
            except CapacityExceeded as exc:  # its ``created`` per item of the rest: per item of the batch
                exc.widen_created(rest, result)
                raise
            for i, c in zip(rest, got):
                result[i] = c
        return result

    def _commit(self, w: DirectWriter, items: Sequence[EncodedPut],
                entries: list[PendingEntry]) -> tuple[list[bool], dict[bytes, str]]:
        """One Commit for the written entries: (created per entry, rejected pack -> why)."""
        records = []
        for e in entries:
            it, m = items[e.slot].item, e.enc.meta_base
            r = pb.WrittenEntry(key=it.key, kind=e.enc.kind.value, k=m.k, m=m.m, tokens=m.tokens,
                                plain_len=m.plain_len, entry_len=m.entry_len, frag_len=m.frag_len, gen=m.gen,
                                targets=e.targets, offsets=e.offsets)
            if it.ttl_s is not None:
                r.ttl_s = it.ttl_s
            records.append(r)
        reply = self._call("Commit", pb.CommitRequest(entries=records, view=w.view))
        created = list(reply.created)
        if len(created) != len(records) or len(reply.rejected_packs) != len(reply.reasons):
            raise InternalError(f"Commit answered {len(created)} results for {len(records)} entries (a kvstore bug)")
        return created, dict(zip(reply.rejected_packs, reply.reasons))
