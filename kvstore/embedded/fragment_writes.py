"""The write half of the fragment store: encoding a put, placing and publishing its fragments
(one file per fragment, or for a batch one pack file per target), and removing what will
never be indexed.

``FragmentWriter`` is built over what a write needs, passed explicitly: the config (encoding
knobs, durability, write timeouts, admission limits), the targets and their specs (placement),
the erasure code, the per-target pools (``kvstore.embedded.targets.TargetPools``), two
executors (``pool`` for single fragment writes, ``batch_pool`` for one entry or pack of a
batch each: a task never waits on a task queued behind it in its own pool), and
``count(name, n)`` and ``now_ns()``. It never touches an index: the embedded store
(``kvstore.embedded.fragments.FragmentStore``) commits what it wrote; the direct writer
(``kvstore.client.direct_writes``) hands its packs to the daemon's ``Commit``.

A put's entries go through it as ``PendingEntry`` records, one per entry, each step filling
in its part (encoding, placement, pack offsets, the write in flight; the store sets whether it
was indexed): ``write_entries`` (steps 3-4: each entry ``encode``d, then written as packs,
``write_packs``, or fragment by fragment, ``write_fragments``), then, once the index has
answered, ``discard_unindexed``. The write
steps, and why they are ordered as they are, are in ``kvstore.embedded.store``'s
docstring; pack names in ``kvstore.embedded.targets``; how files are made durable in
``kvstore.embedded.durability``.
"""

from __future__ import annotations

import errno
import logging
import os
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from kvstore.api import EntryKind, Layout, PutItem, as_payload, check_put_fields
from kvstore.config import MAX_TTL_S, StoreConfig, TargetSpec
from kvstore.embedded import codec
from kvstore.embedded.durability import RootSyncs, sync_plan
from kvstore.embedded.index import Meta, ekey
from kvstore.embedded.placement import by_spread, place
from kvstore.embedded.segments import Appended, Segment, Segments
from kvstore.embedded.targets import Target, TargetPools, fragment_path, pack_path
from kvstore.errors import CapacityExceeded, InvalidRequest, StoreUnavailable

log = logging.getLogger("kvstore.embedded.store")

# A single put's local writes of fragments this large run on threads with fsync off too
# (``FragmentWriter.fan_out_writes``): from about this size the kernel waits for the device to
# take dirty pages, and threads overlap that wait. Not a batch's packs: their writes already
# overlap the next chunk's encoding (``tools/bench_store.py`` compares the two ways).
PARALLEL_WRITE_MIN_BYTES = 512 * 1024



def run_now(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
    """``fn`` called in this thread, as a completed ``Future``: the inline twin of
    ``Executor.submit``, so one code path collects results and errors either way."""
    fut: Future = Future()
    try:
        fut.set_result(fn(*args, **kwargs))
    except BaseException as exc:  # handed to the caller, re-raised by ``result()``
        fut.set_exception(exc)
    return fut


def resolve_sync_mode(config: StoreConfig, targets: dict[str, Target]) -> str:
    """``config.sync_mode`` resolved for ``targets`` (``kvstore.embedded.durability.sync_plan``;
    "" with fsync off), logged; ``InvalidRequest`` for a mode these targets cannot have."""
    mode, why = sync_plan(config.sync_mode, list(targets.values())) if config.fsync else ("", "")
    if mode:
        log.info("durable writes: %s (%s)", "one syncfs per filesystem" if mode == "fs" else
                 "fsync per file and directory", why)
    return mode


def expiry_ns(ttl_s: float | None, default_ttl_s: float, now: int) -> int:
    """An entry's expiry time (0: none) from a put's ``ttl_s`` (``None``: the store's default)."""
    if ttl_s is None:
        ttl_s = default_ttl_s
    else:
        check_put_fields(ttl_s, 0, MAX_TTL_S)
    return now + int(ttl_s * 1e9) if ttl_s else 0


class Encoded:
    """One put, encoded: ``frames[i]`` is fragment ``i`` as ``codec.fragment_parts`` (header,
    body), ``meta_base`` its index record but for where the fragments land."""

    __slots__ = ("ek", "key", "kind", "meta_base", "frames")

    def __init__(self, ek: bytes, key: bytes, kind: EntryKind, meta_base: Meta, frames: list[list[bytes]]):
        self.ek, self.key, self.kind, self.meta_base, self.frames = ek, key, kind, meta_base, frames


@dataclass(slots=True, eq=False)
class PendingEntry:
    """One entry of a put in flight, from its checks to its index commit: each step of the
    write path (``kvstore.embedded.store``'s docstring) fills in its field, and the later
    steps read it. One record per entry, so what an entry is at each step is in one place.

    ``item``: the put, key and kind checked and typed (``kvstore.keys.check_key``,
    ``EntryKind``); ``slot``: its position in the caller's batch, where its ``created`` flag
    goes. Step 3 sets ``enc`` (``Encoded``); step 4 ``targets`` (fragment ``i`` on
    ``targets[i]``; ``None`` while not written), ``offsets`` (the fragments' offsets in the
    pack file on each target; ``()`` for one file per fragment) and, while its fragment
    writes run, ``write`` (a ``Future`` of ``targets``), and ``segment`` when they were appended
    to a segment (``kvstore.embedded.segments``: then ``offsets`` are in its files); step 5
    ``created`` (indexed by this put; ``False`` also where a live entry of its key won the race)."""

    item: PutItem
    slot: int
    enc: Encoded | None = None
    targets: tuple[str, ...] | None = None
    offsets: tuple[int, ...] = ()
    write: Future | None = None
    created: bool = False
    segment: Segment | None = None

    @property
    def in_pack(self) -> bool:
        """Written into its batch's pack files (not one file per fragment)."""
        return bool(self.offsets)

    def record(self) -> tuple[bytes, Meta]:
        """Its index record, ``(ek, meta)``, once written."""
        return self.enc.ek, replace(self.enc.meta_base, targets=self.targets, offsets=self.offsets,
                                    aligned=self.segment is not None)

    def files(self) -> list[tuple[str, str]]:
        """``(target, rel)`` of every file it sits in: its pack on each target, or each fragment file."""
        enc = self.enc
        if self.in_pack:
            return [(name, pack_path(enc.meta_base.gen)) for name in self.targets]
        return [(name, fragment_path(enc.kind.code, enc.key, enc.meta_base.gen, j))
                for j, name in enumerate(self.targets)]


def written_files(entries: Sequence[PendingEntry]) -> list[tuple[str, str]]:
    """``(target, rel)`` of every file the written entries sit in, each pack file once, sorted."""
    return sorted({f for e in entries if e.targets is not None for f in e.files()})


class FragmentWriter:
    """The write path over ``targets`` (module docstring)."""

    def __init__(self, config: StoreConfig, targets: dict[str, Target], target_specs: Sequence[TargetSpec],
                 code: Any, pools: TargetPools, pool: Executor, batch_pool: Executor, *,
                 count: Callable[..., None], now_ns: Callable[[], int],
                 on_pack_discarded: Callable[[], None] | None = None, sync_mode: str | None = None,
                 on_pack_deleted: Callable[[str, bytes], None] | None = None):
        self.config = config
        self.targets = targets
        self.target_specs = target_specs
        self.code = code
        self.pools = pools
        self._pool = pool
        self._batch_pool = batch_pool
        self._count = count
        self.now_ns = now_ns
        self._on_pack_discarded = on_pack_discarded
        self._sync_resolved = sync_mode
        self.roots = RootSyncs(targets)  # sync mode "fs": the syncfs descriptors, its segments' too
        # The segments puts append to (``kvstore.embedded.segments``), set by the store's fragment
        # store where they can be used; ``None``: packs per batch and files per fragment.
        self.segments: Segments | None = None
        # Told (target, generation) of each pack file ``discard_pack`` deleted: the store's reader
        # closes a descriptor it kept of it, so that its space is given back now.
        self._on_pack_deleted = on_pack_deleted

    # ------------------------------------------------------------------ fragment files
    def checked(self, item: PutItem) -> tuple[memoryview, Layout, int, int]:
        """A put validated (``InvalidRequest`` for the first bad field): (payload, layout,
        now_ns, expires_ns). ``item.key`` and ``item.kind`` come checked and typed from the
        caller's boundary (``kvstore.keys.check_key``, ``EntryKind.parse``); the value, its
        size, ``tokens`` and ``ttl_s`` are checked here. Every put passes here, also one that
        stores nothing because its key is live: a bad request is refused whether or not it would write."""
        payload, lay = as_payload(item.value, item.layout)
        if len(payload) > self.config.max_value_bytes:
            raise InvalidRequest(
                f"value of {len(payload)} bytes is over max_value_bytes={self.config.max_value_bytes}; "
                "split it or raise the limit in the store config"
            )
        check_put_fields(None, item.tokens, MAX_TTL_S)  # ttl_s: expiry_ns checks it
        now = self.now_ns()
        return payload, lay, now, expiry_ns(item.ttl_s, self.config.default_ttl_s, now)

    def encode(self, item: PutItem, gen: bytes | None = None) -> Encoded:
        """Step 3 for one put (key and kind typed, as ``checked`` takes them): checked, encoded
        under generation ``gen`` (default: a fresh one), and refused when it could never stay
        under the capacity (``CapacityExceeded``)."""
        payload, lay, now, expires = self.checked(item)
        enc = self.encode_entry(item.key, item.kind, payload, lay, item.tokens, gen or os.urandom(8), now, expires)
        cfg = self.config
        stored = enc.meta_base.frag_len * len(enc.frames)
        if cfg.capacity_bytes and stored > cfg.capacity_bytes * cfg.low_watermark:
            # It would be stored, then evicted by the next eviction: refuse it instead.
            raise CapacityExceeded(
                f"an entry of {stored} stored bytes cannot fit under the low watermark of capacity_bytes="
                f"{cfg.capacity_bytes} ({cfg.capacity_bytes * cfg.low_watermark:.0f} bytes); raise the capacity")
        return enc

    def encode_entry(self, key: bytes, k: EntryKind, payload: memoryview, lay: Layout, tokens: int, gen: bytes,
                      now: int, expires: int) -> Encoded:
        """The encoding half of ``encode``, no admission checks: compaction re-encodes stored
        entries with it (``FragmentStore.rewrite``), which a lowered limit must not refuse."""
        cfg = self.config
        entry = codec.encode_entry(key, k, payload, lay, tokens, compression=cfg.compression,
                                   zstd_level=cfg.zstd_level, min_ratio=cfg.min_compress_ratio,
                                   created_ns=now, expires_ns=expires)
        bodies = self.code.encode(entry)
        frames = [codec.fragment_parts(i, cfg.ec_k, cfg.ec_m, k.code, key, gen, len(entry), b)
                  for i, b in enumerate(bodies)]
        meta = Meta(k=cfg.ec_k, m=cfg.ec_m, tokens=tokens, plain_len=len(payload), entry_len=len(entry),
                    frag_len=codec.FRAG_HEADER_LEN + len(bodies[0]), created_ns=now, access_ns=now,
                    expires_ns=expires, gen=gen, targets=())
        return Encoded(ekey(k.code, key), key, k, meta, frames)

    def sync_mode(self) -> str:
        """How this host makes writes durable: "file" (fsync each file and its directory),
        "fs" (``sync_after``: one syncfs per filesystem) or "" (fsync off); resolved once
        (``resolve_sync_mode``), or as the store's data directory resolved it when opened."""
        if self._sync_resolved is None:
            self._sync_resolved = resolve_sync_mode(self.config, self.targets)
        return self._sync_resolved

    def hold_roots(self, names: Sequence[str]) -> None:
        """Sync mode "fs": before writing files to these targets, hold a descriptor of each one's
        filesystem for ``sync_after`` (``RootSyncs``). Nothing to do in the other modes."""
        if self.sync_mode() == "fs":
            for name in names:
                self.roots.hold(name)

    def sync_after(self, names: Sequence[str]) -> None:
        """Sync mode "fs": make the files just written to these targets durable, one syncfs
        per filesystem through the descriptor ``hold_roots`` opened before they were written
        (``OSError`` if that fails). Nothing to do in the other modes."""
        if self.sync_mode() != "fs":
            return
        done = set()
        for name in names:
            dev = self.roots.dev(name)
            if dev not in done:
                done.add(dev)
                self.roots.sync(name)

    def close(self) -> None:
        """Close the descriptors ``hold_roots`` held; called once no write is in flight."""
        self.roots.close()

    def fan_out_writes(self, names: Sequence[str], *, in_batch: bool, file_bytes: int = 0) -> bool:
        """Should writes to these targets run on threads? Only writes that wait pay for the
        hand-off: to a remote target always, to a local one when fsync waits for the device
        or when each file is large (``file_bytes``: a single put's fragment size, from
        ``PARALLEL_WRITE_MIN_BYTES`` on: the kernel then also waits, for the device to take
        dirty pages), and then only when the batch is not already spread over threads entry
        by entry. Writes of small files into the page cache are cheaper inline than handed to a
        thread (``tools/bench_store.py`` compares the two ways)."""
        mode = self.config.parallel_writes
        if mode != "auto":
            return mode == "always"
        if not all(self.targets[t].local for t in names if t in self.targets):
            return True
        return (self.sync_mode() == "file" or file_bytes >= PARALLEL_WRITE_MIN_BYTES) and not in_batch

    def write_fragments(self, enc: Encoded, *, in_batch: bool = False) -> tuple[str, ...]:
        """Write every fragment to a distinct target; replace failing targets by the next best."""
        n = len(enc.frames)
        order = place(enc.key, self.target_specs, len(self.target_specs))  # all targets, best first
        self.hold_roots(order)
        chosen = order[:n]
        spare = order[n:]
        failed: list[str] = []
        pending = list(range(n))
        while pending:
            fan_out = self.fan_out_writes(chosen, in_batch=in_batch, file_bytes=enc.meta_base.frag_len)
            errors = self.run_writes({i: (chosen[i], fragment_path(enc.kind.code, enc.key, enc.meta_base.gen, i),
                                           enc.frames[i]) for i in pending}, fan_out=fan_out)
            pending = []
            last_exc: OSError | None = None
            for i, exc in sorted(errors.items()):
                log.warning("fragment %d of %s failed on target %s: %s", i, enc.key.hex(), chosen[i], exc)
                failed.append(chosen[i])
                last_exc = exc
                pending.append(i)
            if pending and len(spare) < len(pending):
                self.discard(enc, {i: c for i, c in enumerate(chosen) if i not in pending})
                full = getattr(last_exc, "errno", None) == errno.ENOSPC
                raise (CapacityExceeded if full else StoreUnavailable)(
                    f"cannot place {n} fragments of {enc.key.hex()} on distinct targets; failed: "
                    f"{', '.join(failed)} (last error{' ENOSPC, the targets are full' if full else ''}: {last_exc})"
                ) from last_exc
            waiting = set(pending)
            for i in pending:  # the spare that keeps the fragments most spread over domains
                placed = [c for j, c in enumerate(chosen) if j not in waiting]
                chosen[i] = by_spread(spare, placed, self.target_specs)[0]
                spare.remove(chosen[i])
                waiting.discard(i)
        try:
            self.sync_after(chosen)
        except OSError as exc:
            self.discard(enc, dict(enumerate(chosen)))
            raise StoreUnavailable(f"fragments of {enc.key.hex()} could not be made durable: {exc}") from exc
        return tuple(chosen)

    def run_writes(self, jobs: dict[Any, tuple[str, str, Any]], *, fan_out: bool) -> dict[Any, OSError]:
        """Publish each job's data (``key -> (target name, rel, data)``) with ``Target.write``;
        the errors by key (empty: all written). ``fan_out``: the writes run on ``_pool``, else
        inline, one after the other. With ``write_timeout_s`` > 0 each write runs on its target's
        own write pool instead (a bulkhead: a hung target holds only its own threads), and one
        not done in time fails with ``TimeoutError`` (ETIMEDOUT) while its thread runs on: the
        caller treats it as any failed write (a spare target, or the put fails). A target with
        a write still running past its timeout is not asked for more (``Target.writes_stalled``)
        until that write ends. The file a late write publishes is one no record names for that
        place: the orphan sweep removes it (``kvstore.maintenance.orphans``)."""
        timeout = self.config.write_timeout_s
        fsync = self.sync_mode() == "file"
        errors: dict[Any, OSError] = {}
        futs: dict[Any, Future] = {}
        for key, (name, rel, data) in jobs.items():
            tgt = self.targets[name]
            if not timeout:
                futs[key] = (self._pool.submit if fan_out else run_now)(tgt.write, rel, data, fsync=fsync)
            elif why := tgt.writes_stalled():
                errors[key] = TimeoutError(errno.ETIMEDOUT, why)
            else:
                futs[key] = self.pools.get(name, "write").submit(tgt.write, rel, data, fsync=fsync)
        late = wait(futs.values(), timeout=timeout)[1] if timeout and futs else set()
        for key, f in futs.items():
            name, rel, _data = jobs[key]
            if f in late:
                self._count("write_timeouts")
                self.targets[name].write_stalled(f)
                errors[key] = TimeoutError(errno.ETIMEDOUT, f"writing {rel} on target {name} took over "
                                                            f"write_timeout_s={timeout} s")
                continue
            try:
                f.result()
            except OSError as exc:
                errors[key] = exc
        return errors

    def discard(self, enc: Encoded, placed: dict[int, str]) -> None:
        """Remove fragments of a put that will never be indexed (best effort: else orphans)."""
        for i, name in placed.items():
            t = self.targets.get(name)
            if t is not None:
                try:
                    t.delete(fragment_path(enc.kind.code, enc.key, enc.meta_base.gen, i))
                except OSError:
                    pass  # an orphan GC will sweep

    # ------------------------------------------------------------------ pack files
    def write_pack(self, encs: Sequence[Encoded], gen: bytes) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
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
        self.hold_roots(list(shares))
        errors: dict[str, OSError] = self.run_writes({name: (name, rel, parts) for name, parts in shares.items()},
                                                      fan_out=self.fan_out_writes(list(shares), in_batch=False))
        if not errors:
            try:
                self.sync_after(list(shares))
            except OSError as exc:
                errors["(syncfs)"] = exc
        if errors:
            self.discard_pack(gen, [n for n in shares if n not in errors])
            name, exc = next(iter(errors.items()))
            log.warning("pack %s: target %s failed (%s); its entries go the fallback way (fragment by "
                        "fragment here, or through the daemon for a direct writer)",
                        gen.hex(), name, exc)
            raise exc
        return out

    def discard_pack(self, gen: bytes, names: Sequence[str]) -> int:
        """Remove a pack that no index record names (best effort: else an orphan); the bytes
        removed (a file not there, or not removed, counts nothing: GC's reclaimed bytes)."""
        if self._on_pack_discarded is not None:
            self._on_pack_discarded()
        freed = 0
        for name in names:
            t = self.targets.get(name)
            if t is not None:
                try:
                    size = t.stat(pack_path(gen))[0]
                    deleted = t.delete(pack_path(gen))
                except OSError:
                    continue  # not on this target, or an orphan GC will sweep
                freed += size * deleted  # not counted when removed meanwhile
                if deleted and self._on_pack_deleted is not None:
                    self._on_pack_deleted(name, gen)
        return freed

    # ------------------------------------------------------------------ a put's steps 3-4, and its leftovers
    def write_entries(self, entries: Sequence[PendingEntry], *, packs: bool, since: int = 0) -> None:
        """Steps 3-4 of a put (``kvstore.embedded.store``): encode every entry, place it and make
        its fragments durable, filling in each entry's ``enc``, ``targets`` and ``offsets``.

        Where the store has segments, the whole put is appended to the active one
        (``append_entries``; ``since``: the sweep count read before this put's first write). A
        put whose append fails, a batch with ``packs`` (the store's ``pack_batches``) where there
        are no segments (first written as packs, ``write_packs``), a chunk whose packs fail, a
        batch without packs and a single put go fragment by fragment (``write_fragments``,
        where a failing target is replaced by a spare). Where writes wait (``fan_out_writes``)
        each entry's writes start on a thread as soon as it is encoded, so encoding the next
        overlaps them; otherwise they run inline. Anything raised (a bad item out of
        ``encode``, a write that found no spare) is raised once every write started has ended,
        with the fragments already written removed."""
        batch = len(entries) > 1
        if self.segments is not None:
            self.append_entries(entries, since)
        elif batch and packs:
            self.write_packs(entries)
        fan_out = batch and self.fan_out_writes(self.targets, in_batch=False)
        submit = self._batch_pool.submit if fan_out else run_now
        try:
            for e in entries:
                if e.targets is not None:  # in a pack
                    continue
                if e.enc is None:
                    e.enc = self.encode(e.item)
                e.write = submit(self.write_fragments, e.enc, in_batch=batch)
            for e in entries:
                if e.write is not None:
                    e.targets = e.write.result()
        except BaseException:
            for e in entries:
                if e.write is not None and e.targets is None:
                    try:
                        e.targets = e.write.result()
                    except BaseException:
                        continue
            for e in entries:
                if e.targets is not None:
                    self.discard(e.enc, dict(enumerate(e.targets)))
            raise

    def write_packs(self, entries: Sequence[PendingEntry]) -> None:
        """Steps 3-4 for a batch as packs: encode it in chunks of about ``pack_bytes`` payload
        bytes, each chunk one generation and one pack per target (``write_pack``); a chunk's
        pack writes run on a thread while the next chunk is encoded (encoding holds the GIL,
        writes wait in the kernel); the last chunk's run here. Sets every entry's ``enc``, and
        ``targets`` and ``offsets`` of those in the chunks written. A chunk whose packs fail
        stays unplaced (its failure logged): the caller writes it another way. A bad item
        raises, with every pack written so far removed."""
        writes: list[tuple[list[PendingEntry], bytes, Future]] = []
        chunk: list[PendingEntry] = []
        size = 0
        gen = os.urandom(8)
        try:
            for n, e in enumerate(entries):
                e.enc = self.encode(e.item, gen)
                chunk.append(e)
                size += e.enc.meta_base.plain_len
                last = n == len(entries) - 1
                if size >= self.config.pack_bytes or last:
                    # On a thread only while there is encoding left to overlap it with.
                    submit = run_now if last or self.config.parallel_writes == "never" else self._batch_pool.submit
                    writes.append((chunk, gen, submit(self.write_pack, [m.enc for m in chunk], gen)))
                    chunk, size, gen = [], 0, os.urandom(8)
        except BaseException:  # a bad item: nothing of this batch may stay behind
            for _chunk, g, fut in writes:
                if fut.exception() is None:
                    self.discard_pack(g, list(self.targets))
            raise
        for chunk, _gen, fut in writes:
            try:
                for e, (names, offs) in zip(chunk, fut.result()):
                    e.targets, e.offsets = names, offs
            except OSError:
                pass  # logged by write_pack

    def append_entries(self, entries: Sequence[PendingEntry], since: int) -> None:
        """Steps 3-4 as appends to the active segment (``kvstore.embedded.segments``): every entry
        encoded under the segment's generation, in chunks of about ``pack_bytes`` payload bytes;
        each chunk's fragments appended, one positioned write per target, on a thread while the
        next chunk is encoded (encoding holds the GIL, writes wait in the kernel); then all of
        them made durable (one flush per filesystem or file, shared with concurrent puts). Sets
        each entry's ``enc``, ``targets``, ``offsets`` and ``segment``. When an append or the
        flush fails (logged; the segment is sealed) the put is appended once more, to a new
        segment; when that fails too every entry stays unplaced, ``enc`` cleared, for the caller
        to write fragment by fragment under fresh generations. A bad item raises once the
        appends started have ended (what they wrote no record names). The segment stays in this
        put's use until ``discard_unindexed`` or ``release_segments``."""
        for _try in range(2):
            if self._append_once(entries, since):
                return
            for e in entries:
                e.enc = None
        log.warning("the put's %d entries go fragment by fragment", len(entries))

    def _append_once(self, entries: Sequence[PendingEntry], since: int) -> bool:
        """One try of ``append_entries``: whether the entries were appended and made durable."""
        seg = self.segments.acquire(since, [ekey(e.item.kind.code, e.item.key) for e in entries])
        appends: list[tuple[list[PendingEntry], list[tuple[tuple[str, ...], list[int]]], Future]] = []
        chunk: list[PendingEntry] = []
        size = 0
        try:
            for n, e in enumerate(entries):
                e.enc = self.encode(e.item, seg.gen)
                chunk.append(e)
                size += e.enc.meta_base.plain_len
                last = n == len(entries) - 1
                if size >= self.config.pack_bytes or last:
                    shares, placed = self._shares(chunk)
                    submit = run_now if last or self.config.parallel_writes == "never" else self._batch_pool.submit
                    appends.append((chunk, placed, submit(self.segments.append, seg, shares)))
                    chunk, size = [], 0
        except BaseException:
            wait([f for _c, _p, f in appends])
            self.segments.release(seg, indexed=False)
            raise
        try:
            done = [f.result() for _c, _p, f in appends]
            self.segments.make_durable(seg, Appended.merged(done))
        except OSError as exc:
            wait([f for _c, _p, f in appends])
            self.segments.release(seg, indexed=False)
            log.warning("segment %s: %s", seg.gen.hex(), exc)
            self._count("segment_write_failures")
            return False
        for (chunk, placed, _f), appended in zip(appends, done):
            for e, (names, slots) in zip(chunk, placed):
                e.targets = names
                e.offsets = tuple(appended.offsets[n][j] for n, j in zip(names, slots))
                e.segment = seg
        return True

    def _shares(self, chunk: Sequence[PendingEntry]) -> tuple[dict[str, list[list[bytes]]],
                                                               list[tuple[tuple[str, ...], list[int]]]]:
        """Each target's fragments of the encoded entries, in order, and per entry its targets
        (rendezvous placement, as every put's) and where each of its fragments is in those lists."""
        shares: dict[str, list[list[bytes]]] = {}
        placed = []
        for e in chunk:
            chosen = place(e.enc.key, self.target_specs, len(e.enc.frames))
            slots = []
            for name, frame in zip(chosen, e.enc.frames):
                share = shares.setdefault(name, [])
                slots.append(len(share))
                share.append(frame)
            placed.append((tuple(chosen), slots))
        return shares, placed

    def release_segments(self, entries: Sequence[PendingEntry], *, indexed_unknown: bool = False) -> None:
        """End the put's use of the segments its entries were appended to, saying whether a record
        in each was indexed (``indexed_unknown``: the index commit's outcome is not known, so the
        segment is kept as if one was)."""
        segs: dict[Segment, bool] = {}
        for e in entries:
            if e.segment is not None:
                segs[e.segment] = segs.get(e.segment, False) or e.created or indexed_unknown
                e.segment = None
        for seg, indexed in segs.items():
            self.segments.release(seg, indexed=indexed)

    def seal_segments(self, entries: Sequence[PendingEntry], why: str) -> None:
        """Seal the segments the entries were appended to: no later put appends there."""
        for seg in {e.segment for e in entries if e.segment is not None}:
            self.segments.seal(seg, why)

    def discard_unindexed(self, entries: Sequence[PendingEntry]) -> None:
        """Remove what the written entries that were not indexed (``created`` false) leave
        behind: each one's fragment files; and each pack in which no entry was indexed (every
        one lost its race to another writer, or nothing was committed). A loser's share of a
        pack with an indexed entry stays, counted dead (``kvstore.embedded.index`` invariant 6),
        as does what a segment holds (its files go when it is retired,
        ``kvstore.embedded.segments``); then the put's use of its segments ends."""
        for e in entries:
            if e.targets is not None and not e.created and not e.in_pack:
                self.discard(e.enc, dict(enumerate(e.targets)))
        packs: dict[bytes, list[PendingEntry]] = {}
        for e in entries:
            if e.in_pack and e.segment is None:
                packs.setdefault(e.enc.meta_base.gen, []).append(e)
        for gen, members in packs.items():
            if not any(e.created for e in members):
                self.discard_pack(gen, sorted({n for e in members for n in e.targets}))
        self.release_segments(entries)
