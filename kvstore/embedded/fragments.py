"""Fragment I/O of the embedded store: encoding and placing a put's fragments, and
reading, verifying and decoding an entry's fragments.

``FragmentIO`` is a mixin of ``kvstore.embedded.store.EmbeddedStore`` (kept apart so each file
has one job): it uses the store's ``config``, ``targets``, ``target_specs``, ``code``,
``_pool``, ``_tls``, ``_count``, ``_mark_lost`` and ``now_ns``; it keeps its per-target read
pools itself (``_target_pool``; the host stops ``_target_pools_all()`` with its own pools when
it closes). The write and read steps, and why they are ordered as they are, are in
``kvstore.embedded.store``'s docstring; the local read fast paths it tries first are in
``kvstore.embedded.fastread`` (its base class).
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from concurrent.futures import Future, wait
from typing import Any, Callable, Sequence

import lmdb

from kvstore.embedded import codec
from kvstore.api import EntryKind, Layout, as_payload, check_put_fields
from kvstore.config import MAX_TTL_S
from kvstore.executors import DaemonExecutor
from kvstore.errors import (CapacityExceeded, CorruptData, IncompatibleFormat, InvalidRequest, StoreClosed,
                            StoreUnavailable, Unrecoverable)
from kvstore.embedded.fastread import LocalFastReads, frag_loc, fresh_bytes
from kvstore.embedded.index import Meta, ekey
from kvstore.keys import check_key
from kvstore.embedded.placement import place
from kvstore.embedded.durability import sync_plan, syncfs
from kvstore.embedded.targets import TargetUnavailable, TargetUnreachable, fragment_path, pack_path

log = logging.getLogger("kvstore.embedded.store")

_SCRATCH_MAX = 16 * 1024 * 1024  # larger reads get a fresh buffer instead of a cached one
# A single put's local writes of fragments this large run on threads with fsync off too
# (``_fan_out_writes``). Single puts, 4+2, the two ways interleaved in one process (ext4, 2 cores;
# time threaded / inline): 1 MiB entries (256 KiB files) 1.19x, 2 MiB 0.83x, 4 MiB 0.78x, 8 MiB
# 0.68x. Not a batch's packs: their writes already overlap the next chunk's encoding, and threads
# gained nothing there (4 MiB x 8: 1.02x; 1 MiB x 16: 1.07x).
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


CLOSE_WAIT_S = 10.0  # close() waits this long for calls in flight on other threads


_CALL_DEPTH = threading.local()  # per thread: how many in_flight calls it is inside


def in_flight(fn: Callable) -> Callable:
    """A public call of the embedded store (``kvstore.embedded.store``): refused with ``StoreClosed``
    once ``close`` has begun, and counted while it runs. ``close`` shuts the index only when
    the count drops to zero: it waits up to ``CLOSE_WAIT_S``, and past that leaves the last
    call still running to shut it as it returns. So a call racing a close gets
    ``StoreClosed`` or its result, never an error from a closed LMDB. A call made from within
    one in flight on the same thread (a put's eviction, GC's stats) is part of it, never
    refused. An index write that finds its filesystem full raises ``CapacityExceeded``
    naming ENOSPC (``kvstore.embedded.diskroom``), not LMDB's error. Needs the store's ``_calls``,
    ``_closed``, ``_in_flight``, ``_finish_close`` and ``room``."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_CALL_DEPTH, "n", 0)
        with self._calls:
            if self._closed and not depth:
                raise StoreClosed("this store is closed; open a new one with kvstore.connect")
            self._in_flight += 1
        _CALL_DEPTH.n = depth + 1
        try:
            return fn(self, *args, **kwargs)
        except lmdb.Error as exc:  # the outermost call types a full filesystem (inner ones: ``frees_space``)
            if not depth and self.room.no_space(exc):
                raise self.room.full_error(exc, fn.__name__) from exc
            raise
        finally:
            _CALL_DEPTH.n = depth
            with self._calls:
                self._in_flight -= 1
                last = not self._in_flight
                if last:
                    self._calls.notify_all()
            if last and self._closed:
                self._finish_close(deferred=True)

    return call


def frees_space(fn: Callable) -> Callable:
    """A deletion of the embedded store (``delete``, ``gc``, ``evict_to``), inside ``in_flight``:
    when an index write of it finds no room on a full filesystem, the index's spare file is
    released and the call runs once more (``kvstore.embedded.diskroom``, step 2); a second failure
    ``in_flight`` raises as ``CapacityExceeded``. A transaction that failed changed nothing,
    and what committed before it stays done, so running the call again is safe."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except lmdb.Error as exc:
            if not self.room.no_space(exc) or not self.room.release():
                raise
        return fn(self, *args, **kwargs)

    return call


def expiry_ns(ttl_s: float | None, default_ttl_s: float, now: int) -> int:
    """An entry's expiry time (0: none) from a put's ``ttl_s`` (``None``: the store's default)."""
    if ttl_s is None:
        ttl_s = default_ttl_s
    else:
        check_put_fields(ttl_s, 0, MAX_TTL_S)
    return now + int(ttl_s * 1e9) if ttl_s else 0


_TARGET_POOLS_LOCK = threading.Lock()  # creating a target's read pool (``FragmentIO._target_pool``)


class WrittenTooLongAgo(StoreUnavailable):
    """Files about to be indexed were written over ``orphan_grace_s / 2`` ago: an orphan sweep
    (GC, ``check(fix=True)``, in this process or another) may be removing them, so they are
    not indexed (``FragmentIO._check_in_time``). Raised inside the index transaction, which
    it aborts; the writer removes its files and the put stores nothing."""


class IndexFull(CapacityExceeded):
    """The index commit of new records found no room on the index's filesystem (ENOSPC;
    ``kvstore.embedded.diskroom``): nothing was indexed, and the writer removes its files."""


class FilesSwept(StoreUnavailable):
    """Files about to be indexed were taken by an orphan sweep (``kvstore.maintenance.orphans``: a hold
    record sits on the path of one, or, the sweep count having moved since the writer read it,
    one is gone or cannot be asked): ``FragmentIO._check_unswept_txn``. Raised inside the index
    transaction, which it aborts; the writer removes its files and stores nothing (a put
    writes them again, under a new generation)."""


class GenerationTaken(StoreUnavailable):
    """Pack generations about to be indexed (``gens``) already hold indexed entries: another
    commit claimed them between this one's checks and its index transaction (``PackIO.commit_written``).
    Raised inside that transaction, which it aborts: nothing of the commit is indexed."""

    def __init__(self, gens: Sequence[bytes]):
        super().__init__(f"pack generations {', '.join(g.hex() for g in gens)} already hold indexed entries")
        self.gens = tuple(gens)


class _Encoded:
    """One put, encoded: ``frames[i]`` is fragment ``i`` as ``codec.fragment_parts`` (header,
    body), ``meta_base`` its index record but for where the fragments land."""

    __slots__ = ("ek", "key", "kind", "meta_base", "frames")

    def __init__(self, ek: bytes, key: bytes, kind: EntryKind, meta_base: Meta, frames: list[list[bytes]]):
        self.ek, self.key, self.kind, self.meta_base, self.frames = ek, key, kind, meta_base, frames



def _frame_matches(fh: codec.FragmentHeader, ek: bytes, meta: Meta, i: int) -> bool:
    """Is this fragment header the one the index record expects in slot ``i``?"""
    return (fh.index == i and fh.key == ek[1:] and fh.gen == meta.gen and fh.kind_code == ek[0]
            and fh.entry_len == meta.entry_len and fh.k == meta.k and fh.m == meta.m)


class FragmentIO(LocalFastReads):
    """Write and read paths over the targets (see the module docstring)."""

    # ------------------------------------------------------------------ write path
    def _check_in_time(self, written_at: float, what: str) -> None:
        """``WrittenTooLongAgo`` when files written from ``written_at`` (``clock``) on are over
        ``orphan_grace_s / 2`` old now. Called inside the write transaction that would index
        them, so after any wait for LMDB's writer lock: a sweep takes its time before reading
        which records exist, so files indexed within half the grace are never swept
        (``kvstore.maintenance.passes``). A grace of 0 protects no write: nothing to check."""
        grace = self.config.orphan_grace_s
        took = self.clock() - written_at
        if grace and took > grace / 2:
            raise WrittenTooLongAgo(f"{what} took {took:.0f} s to reach the index, over orphan_grace_s/2 = "
                                    f"{grace / 2:.0f} s, so GC may be sweeping their files: nothing was stored; "
                                    "retry (in smaller batches), or raise orphan_grace_s")

    def _check_unswept_txn(self, txn: Any, since: int, paths: Sequence[tuple[str, str]]) -> None:
        """``FilesSwept`` unless every file of ``paths`` (``(target, rel)``, all written after
        ``since`` was read from ``Index.sweep_decisions``) is safe from the orphan sweep. Called
        inside the write transaction that would index them, so no sweep decides meanwhile: a
        hold record on a path means a sweep is deleting it (whoever holds it, live or not); and
        a sweep count other than ``since`` means a sweep decided since, so each file must still
        be there (one stat per file, only then). See ``kvstore.maintenance.orphans`` for why that suffices."""
        for name, rel in paths:
            if self.index.path_recorded_txn(txn, name, rel):
                raise FilesSwept(f"{rel} on target {name} is being deleted by an orphan sweep (a GC with an "
                                 "orphan_grace_s shorter than this write took): nothing was stored")
        if self.index.sweep_decisions(txn) == since:
            return
        for name, rel in paths:
            try:
                self.targets[name].stat(rel)
            except OSError as exc:
                raise FilesSwept(f"{rel} on target {name} is gone since it was written ({exc}): an orphan sweep "
                                 "took it; nothing was stored") from exc

    @staticmethod
    def _paths_of(encs: dict[int, _Encoded], placed: dict[int, tuple[str, ...]],
                  offsets: dict[int, tuple[int, ...]]) -> list[tuple[str, str]]:
        """``(target, rel)`` of every file the placed entries sit in: each fragment file, and
        each pack file once."""
        out: set[tuple[str, str]] = set()
        for i, names in placed.items():
            enc = encs[i]
            if offsets.get(i):
                out.update((name, pack_path(enc.meta_base.gen)) for name in names)
            else:
                out.update((name, fragment_path(enc.kind.code, enc.key, enc.meta_base.gen, j))
                           for j, name in enumerate(names))
        return sorted(out)

    def _checked(self, key: bytes, value: Any, kind: str | EntryKind, ttl_s: float | None,
                 layout: Layout | None, tokens: int) -> tuple[bytes, EntryKind, memoryview, Layout, int, int]:
        """A put's arguments validated (``InvalidRequest`` for the first bad one): (key, kind,
        payload, layout, now_ns, expires_ns). Every put passes here, also one that stores
        nothing because its key is live: a bad request is refused whether or not it would write."""
        key = check_key(key)
        k = EntryKind.parse(kind)
        payload, lay = as_payload(value, layout)
        if len(payload) > self.config.max_value_bytes:
            raise InvalidRequest(
                f"value of {len(payload)} bytes is over max_value_bytes={self.config.max_value_bytes}; "
                "split it or raise the limit in the store config"
            )
        check_put_fields(None, tokens, MAX_TTL_S)  # ttl_s: expiry_ns checks it
        now = self.now_ns()
        return key, k, payload, lay, now, expiry_ns(ttl_s, self.config.default_ttl_s, now)

    def _encode(self, key: bytes, value: Any, kind: str | EntryKind, ttl_s: float | None,
                layout: Layout | None, tokens: int, gen: bytes | None = None) -> _Encoded:
        key, k, payload, lay, now, expires = self._checked(key, value, kind, ttl_s, layout, tokens)
        enc = self._encode_entry(key, k, payload, lay, tokens, gen or os.urandom(8), now, expires)
        cfg = self.config
        stored = enc.meta_base.frag_len * len(enc.frames)
        if cfg.capacity_bytes and stored > cfg.capacity_bytes * cfg.low_watermark:
            # It would be stored, then evicted by the next eviction: refuse it instead.
            raise CapacityExceeded(
                f"an entry of {stored} stored bytes cannot fit under the low watermark of capacity_bytes="
                f"{cfg.capacity_bytes} ({cfg.capacity_bytes * cfg.low_watermark:.0f} bytes); raise the capacity")
        return enc

    def _encode_entry(self, key: bytes, k: EntryKind, payload: memoryview, lay: Layout, tokens: int, gen: bytes,
                      now: int, expires: int) -> _Encoded:
        """The encoding half of ``_encode``, no admission checks: compaction re-encodes stored
        entries with it (``PackIO._rewrite``), which a lowered limit must not refuse."""
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
        return _Encoded(ekey(k.code, key), key, k, meta, frames)

    def _sync_mode(self) -> str:
        """How this host makes writes durable: "file" (fsync each file and its directory),
        "fs" (``_sync_after``: one syncfs per filesystem) or "" (fsync off); resolved once
        from ``config.sync_mode`` and the targets (``kvstore.embedded.durability.sync_plan``)."""
        mode = getattr(self, "_sync_resolved", None)
        if mode is None:
            mode, why = sync_plan(self.config.sync_mode, list(self.targets.values())) if self.config.fsync else ("", "")
            if mode:
                log.info("durable writes: %s (%s)", "one syncfs per filesystem" if mode == "fs" else
                         "fsync per file and directory", why)
            self._sync_resolved = mode
        return mode

    def _sync_after(self, names: Sequence[str]) -> None:
        """Sync mode "fs": make the files just written to these targets durable, one syncfs
        per filesystem (``OSError`` if that fails). Nothing to do in the other modes."""
        if self._sync_mode() != "fs":
            return
        devs = getattr(self, "_target_devs", None)
        if devs is None:
            devs = self._target_devs = {}
        done = set()
        for name in names:
            root = self.targets[name].root
            if name not in devs:
                devs[name] = os.stat(root).st_dev
            if devs[name] not in done:
                done.add(devs[name])
                syncfs(root)

    def _fan_out_writes(self, names: Sequence[str], *, in_batch: bool, file_bytes: int = 0) -> bool:
        """Should writes to these targets run on threads? Only writes that wait pay for the
        hand-off: to a remote target always, to a local one when fsync waits for the device
        or when each file is large (``file_bytes``: a single put's fragment size, from
        ``PARALLEL_WRITE_MIN_BYTES`` on: the kernel then also waits, for the device to take
        dirty pages), and then only when the batch is not already spread over threads entry
        by entry. Writes of small files into the page cache are cheaper inline (128 KiB puts,
        fsync off, the two ways interleaved in one process: single puts 82 -> 141 MiB/s,
        batches of 16 67 -> 122)."""
        mode = self.config.parallel_writes
        if mode != "auto":
            return mode == "always"
        if not all(self.targets[t].local for t in names if t in self.targets):
            return True
        return (self._sync_mode() == "file" or file_bytes >= PARALLEL_WRITE_MIN_BYTES) and not in_batch

    def _write_fragments(self, enc: _Encoded, *, in_batch: bool = False) -> tuple[str, ...]:
        """Write every fragment to a distinct target; replace failing targets by the next best."""
        n = len(enc.frames)
        order = place(enc.key, self.target_specs, len(self.target_specs))  # all targets, best first
        chosen = order[:n]
        spare = order[n:]
        failed: list[str] = []
        pending = list(range(n))
        while pending:
            fan_out = self._fan_out_writes(chosen, in_batch=in_batch, file_bytes=enc.meta_base.frag_len)
            errors = self._run_writes({i: (chosen[i], fragment_path(enc.kind.code, enc.key, enc.meta_base.gen, i),
                                           enc.frames[i]) for i in pending}, fan_out=fan_out)
            pending = []
            last_exc: OSError | None = None
            for i, exc in sorted(errors.items()):
                log.warning("fragment %d of %s failed on target %s: %s", i, enc.key.hex(), chosen[i], exc)
                failed.append(chosen[i])
                last_exc = exc
                pending.append(i)
            if pending and len(spare) < len(pending):
                self._discard(enc, {i: c for i, c in enumerate(chosen) if i not in pending})
                full = getattr(last_exc, "errno", None) == errno.ENOSPC
                raise (CapacityExceeded if full else StoreUnavailable)(
                    f"cannot place {n} fragments of {enc.key.hex()} on distinct targets; failed: "
                    f"{', '.join(failed)} (last error{' ENOSPC, the targets are full' if full else ''}: {last_exc})"
                ) from last_exc
            for i in pending:
                chosen[i] = spare.pop(0)
        try:
            self._sync_after(chosen)
        except OSError as exc:
            self._discard(enc, dict(enumerate(chosen)))
            raise StoreUnavailable(f"fragments of {enc.key.hex()} could not be made durable: {exc}") from exc
        return tuple(chosen)

    def _run_writes(self, jobs: dict[Any, tuple[str, str, Any]], *, fan_out: bool) -> dict[Any, OSError]:
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
        fsync = self._sync_mode() == "file"
        errors: dict[Any, OSError] = {}
        futs: dict[Any, Future] = {}
        for key, (name, rel, data) in jobs.items():
            tgt = self.targets[name]
            if not timeout:
                futs[key] = (self._pool.submit if fan_out else run_now)(tgt.write, rel, data, fsync=fsync)
            elif why := tgt.writes_stalled():
                errors[key] = TimeoutError(errno.ETIMEDOUT, why)
            else:
                futs[key] = self._target_pool(name, "write").submit(tgt.write, rel, data, fsync=fsync)
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

    def _discard(self, enc: _Encoded, placed: dict[int, str]) -> None:
        """Remove fragments of a put that will never be indexed (best effort: else orphans)."""
        for i, name in placed.items():
            t = self.targets.get(name)
            if t is not None:
                try:
                    t.delete(fragment_path(enc.kind.code, enc.key, enc.meta_base.gen, i))
                except OSError:
                    pass  # an orphan GC will sweep

    # ------------------------------------------------------------------ read path
    def _read_fragment(self, meta: Meta, ek: bytes, i: int, into: memoryview | None = None) -> memoryview:
        """One verified fragment body (a view into ``into`` when given); raises OSError or CorruptData."""
        t = self.targets.get(meta.targets[i])
        if t is None:
            raise TargetUnavailable(2, f"target {meta.targets[i]} is not configured")
        rel, off = frag_loc(ek, meta, i)
        tries = 1 + self.config.fragment_read_retries
        for attempt in range(tries):
            try:
                if off is not None:  # exactly its bytes of the pack
                    buf = memoryview(bytearray(meta.frag_len)) if into is None else into[: meta.frag_len]
                    raw: bytes | memoryview = buf[: t.read_into(rel, buf, off)]
                elif into is None:
                    raw = t.read(rel)
                else:
                    # One byte more than expected, so that an over-long file is caught as corrupt.
                    raw = into[: t.read_into(rel, into)]
                try:
                    fh, body = codec.parse_fragment(raw, max_body=meta.frag_len)
                except IncompatibleFormat as exc:
                    # The index vouches for this entry's format: one fragment whose header claims
                    # another version is a damaged fragment (read parity), not a failed get.
                    raise CorruptData(f"fragment {i} on {meta.targets[i]}: {exc}") from exc
                break
            except (FileNotFoundError, TargetUnavailable):
                raise  # gone is not transient: read parity instead of retrying
            except (OSError, CorruptData) as exc:
                # An I/O error or a checksum mismatch may be transient (a flaky path, a bit
                # flipped in transit): retry a bounded number of times, then give up on it.
                if attempt + 1 >= tries:
                    raise
                self._count("read_retries")
                log.info("fragment %d of %s on %s: retrying after %s", i, ek[1:].hex(), meta.targets[i], exc)
        if not _frame_matches(fh, ek, meta, i):
            raise CorruptData(f"fragment {i} on {meta.targets[i]} belongs to another entry or slot")
        return body

    def _scratch(self, nbytes: int) -> memoryview:
        """A per-thread reusable read buffer: warm pages instead of fresh allocations per get."""
        if nbytes > _SCRATCH_MAX:
            return memoryview(bytearray(nbytes))
        buf = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._tls.buf = bytearray(max(nbytes, 1 << 20))
        return memoryview(buf)

    def _parallel(self, meta: Meta) -> bool:
        mode = self.config.parallel_reads
        if mode == "auto":
            # Page-cache reads of local files are faster on one thread than fanned out
            # (measured: tools/bench_store.py); remote targets gain from parallel requests.
            return not all(self.targets[t].local for t in meta.targets[: meta.k] if t in self.targets)
        return mode == "always"

    def _gather(self, meta: Meta, ek: bytes,
                scratch: memoryview | None = None) -> tuple[dict[int, memoryview], list[str], list[str]]:
        """At least k verified bodies if possible (data fragments first); failed target names;
        of those, the ones that could not be asked (``TargetUnreachable``: nothing is known of
        their fragments, so a shortfall they cause is not a loss).

        Fragment ``i`` is read into slot ``i`` of ``scratch`` (``frag_len + 1`` bytes
        each); the returned bodies are views into it, valid until the caller reuses it.

        With ``read_timeout_s`` > 0 a fragment not back in time is counted as failed and
        the next one is read instead, so one slow target does not stall a get while k
        others answer; if fewer than k arrive otherwise, the late reads are awaited after
        all (a slow target is not a lost one). Those late reads may still be writing into
        their slots, so the buffer is a fresh one, never the reused per-thread scratch. A
        target that already holds ``STALLED_READS_LIMIT`` such reads is not asked at all
        (``Target.stalled``; ``TargetUnreachable``): a frozen endpoint holds each read for
        its client's whole timeout. Reads run on their target's own pool (``_target_pool``),
        so a frozen target's stuck reads never delay another target's; one still queued at
        the timeout is cancelled, not left to start later and get stuck in turn (and read
        here after all if fewer than k arrive otherwise: a busy target is not a lost one).
        """
        slot = meta.frag_len + 1
        timeout = self.config.read_timeout_s
        if scratch is None:
            n_bytes = slot * len(meta.targets)
            scratch = memoryview(bytearray(n_bytes)) if timeout else self._scratch(n_bytes)
        good: dict[int, memoryview] = {}
        failed: list[str] = []
        unreachable: list[str] = []
        late: dict[int, Future] = {}
        queued: list[int] = []  # reads cancelled at the timeout before they started
        n = len(meta.targets)
        parallel = self._parallel(meta) or timeout > 0
        nxt = 0
        while len(good) < meta.k and nxt < n:
            want = list(range(nxt, min(n, nxt + meta.k - len(good))))
            nxt = want[-1] + 1
            views = {i: scratch[i * slot : (i + 1) * slot] for i in want}
            outs: list[tuple[int, memoryview | None, Exception | None]] = []
            if parallel and (len(want) > 1 or timeout):
                futs = {}
                for i in want:
                    t = self.targets.get(meta.targets[i])
                    why = t.stalled() if t is not None and timeout else ""
                    if why:  # its stuck reads hold all they may: parity instead
                        outs.append((i, None, TargetUnreachable(errno.EHOSTUNREACH, why)))
                    else:
                        futs[self._target_pool(meta.targets[i]).submit(
                            self._read_fragment, meta, ek, i, views[i])] = i
                done, slow = wait(futs, timeout=timeout or None) if futs else (set(), set())
                for f in slow:
                    self._count("read_timeouts")
                    outs.append((futs[f], None, TimeoutError(f"no answer within read_timeout_s={timeout}")))
                    if f.cancel():  # still queued behind its target's other reads: never started
                        queued.append(futs[f])
                        continue
                    late[futs[f]] = f
                    t = self.targets.get(meta.targets[futs[f]])
                    if t is not None:
                        t.read_stalled(f)
                for f in done:
                    try:
                        outs.append((futs[f], f.result(), None))
                    except (OSError, CorruptData) as exc:
                        outs.append((futs[f], None, exc))
            else:
                for i in want:
                    try:
                        outs.append((i, self._read_fragment(meta, ek, i, views[i]), None))
                    except (OSError, CorruptData) as exc:
                        outs.append((i, None, exc))
            for i, body, exc in outs:
                if body is not None:
                    good[i] = body
                else:
                    log.warning("fragment %d of %s on %s unusable: %s", i, ek[1:].hex(), meta.targets[i], exc)
                    failed.append(meta.targets[i])
                    if isinstance(exc, TargetUnreachable):
                        unreachable.append(meta.targets[i])
        # Fewer than k in time: the late reads are awaited (bounded by the target itself), then
        # the cancelled ones read here: a slow or busy target is not a lost one.
        second = [(i, f.result) for i, f in late.items()] + [
            (i, functools.partial(self._read_fragment, meta, ek, i, scratch[i * slot:(i + 1) * slot]))
            for i in queued]
        for i, fetch in second:
            if len(good) >= meta.k:
                break
            try:
                good[i] = fetch()
            except TargetUnreachable:
                unreachable.append(meta.targets[i])
                continue
            except (OSError, CorruptData):
                continue
            failed.remove(meta.targets[i])
        return good, failed, unreachable

    def _target_pool(self, name: str, op: str = "read") -> DaemonExecutor:
        """The pool that runs target ``name``'s fragment reads in ``_gather`` (``op`` "read"), or
        its writes under ``write_timeout_s`` (``op`` "write"; ``_run_writes``): ``read_workers``
        threads, started on demand, one pool per target and op, a bulkhead, so that I/O stuck
        on one target cannot hold the threads the others' need."""
        pools = self.__dict__.setdefault("_target_pools", {})
        pool = pools.get((name, op))
        if pool is None:
            with _TARGET_POOLS_LOCK:
                pool = pools.get((name, op))
                if pool is None:
                    pool = pools[name, op] = DaemonExecutor(self.config.read_workers, f"kvstore-{op}-{name}")
        return pool

    def _target_pools_all(self) -> list[DaemonExecutor]:
        return list(self.__dict__.get("_target_pools", {}).values())

    def _decode(self, meta: Meta, ek: bytes, good: dict[int, memoryview], failed: list[str],
                out: memoryview | None = None) -> tuple[codec.EntryHeader, bytes | memoryview]:
        """Decode and verify an entry from ``good`` bodies; with ``out`` (a flat writable
        view of at least ``meta.plain_len`` bytes) the plain bytes are written there and
        verified in place, and the returned payload is the view ``out[:plain_len]``."""
        code = codec.erasure_code(meta.k, meta.m, self.config.ec_type)
        # The record's plain size is the limit: a header claiming more (a forged direct-write
        # record: a small plain_len charged, a large decompression) is refused before decoding.
        limit = meta.plain_len
        try:
            pieces = code.data_pieces(good)
            try:
                if pieces is None:
                    raise CorruptData("not all data fragments at hand")
                if out is None:
                    h, plain = codec.decode_entry_pieces(pieces, max_plain=limit)
                else:
                    h = codec.decode_entry_pieces_into(pieces, out, max_plain=limit)
                    plain = out[: h.plain_len]
            except CorruptData:
                # Slow path: the erasure decoder (degraded reads, or a fast path that disagreed).
                # With ``out`` it rewrites the whole payload and verifies it again in place.
                buf = code.decode(good)[: meta.entry_len]
                if out is None:
                    h, plain = codec.decode_entry(buf, max_plain=limit)
                else:
                    h = codec.decode_entry_into(buf, out, max_plain=limit)
                    plain = out[: h.plain_len]
            if h.key != ek[1:] or h.kind.code != ek[0]:
                raise CorruptData("decoded entry names another key")
            if h.plain_len != meta.plain_len or h.tokens != meta.tokens:  # as the fast paths check
                raise CorruptData(f"decoded entry holds {h.plain_len} plain bytes and {h.tokens} tokens, its record "
                                  f"{meta.plain_len} and {meta.tokens}")
            return h, plain
        except CorruptData as exc:
            raise Unrecoverable(
                f"entry {ek[1:].hex()} failed verification after decoding ({exc})",
                key=ek[1:], failed_targets=tuple(failed),
            ) from exc

    def _read_verified(self, ek: bytes, meta: Meta,
                       out: memoryview | None = None) -> tuple[codec.EntryHeader, bytes | memoryview]:
        roots = self._local_roots(meta)
        if roots is not None and out is not None:
            got = self._read_scatter(ek, meta, roots, out)
            if got is not None:
                return got
        elif roots is not None and meta.entry_len - meta.plain_len >= codec.ENTRY_HEADER_MIN:  # raw: a direct read
            fresh = fresh_bytes(meta.plain_len)
            if fresh is not None and (got := self._read_scatter(ek, meta, roots, fresh[1])) is not None:
                return got[0], fresh[0]  # filled whole (``_read_scatter``), so ``fresh_bytes``'s contract holds
        if roots is not None:
            got = self._read_fast(ek, meta, roots, out)
            if got is not None:
                return got
        good, failed, unreachable = self._gather(meta, ek)
        if len(good) < meta.k:
            unknown = sorted(set(meta.targets) - set(self.targets))
            if unknown:  # a configuration that lacks targets is not a loss: nothing is marked
                raise StoreUnavailable(
                    f"entry {ek[1:].hex()} has fragments on targets {', '.join(unknown)}, which this store "
                    "was not opened with; open the data directory with the targets it was written to")
            if len(good) + len(unreachable) >= meta.k:  # readable, for all we know: not a loss either
                raise StoreUnavailable(
                    f"entry {ek[1:].hex()}: targets {', '.join(sorted(set(unreachable)))} could not be reached "
                    f"({len(good)} of {meta.k} needed fragments read); nothing is marked lost, retry when they answer")
            self._mark_lost(ek, meta)
            raise Unrecoverable(
                f"entry {ek[1:].hex()} ({EntryKind.from_code(ek[0]).value}) has {len(good)} good fragments, "
                f"needs {meta.k}; failed targets: {', '.join(failed) or 'none'}. "
                "Bring the targets back and run `kvtool repair`.",
                key=ek[1:], failed_targets=tuple(failed),
            )
        if failed:
            self._count("degraded_reads")
        try:
            return self._decode(meta, ek, good, failed, out)
        except Unrecoverable:
            self._mark_lost(ek, meta)
            raise
