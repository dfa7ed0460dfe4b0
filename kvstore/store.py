"""The embedded store: LMDB index + erasure-coded fragments on fsspec targets.

``kvstore.connect(path)`` returns an ``EmbeddedStore``. Several processes may
open the same data directory at once (LMDB serialises writers across
processes); within a process the store is thread-safe.

Data directory::

    <data_dir>/kvstore.json     format version and creation time (written last on first open)
    <data_dir>/index/           LMDB environment (see kvstore.index)
    <data_dir>/targets/t0..tN   the embedded default targets (k+m, one failure domain)

Write path (``put``), in this order, each step for the reason given:
  1. Validate key, kind, layout and size: nothing is written for a bad request.
  2. If a live entry exists, refresh its access time and return ``False``: a
     re-put stores no second copy.
  3. Encode (header + zstd-if-it-pays), erasure-code into k+m fragments, give
     the put a fresh 8-byte generation so its file names are unique.
  4. Write every fragment atomically (tmp + fsync + rename + dir fsync) to its
     rendezvous-chosen target; a failing target is replaced by the next best.
  5. Only then commit the index record (LMDB, fsync). A crash before 5 leaves
     orphan fragments that GC sweeps after ``orphan_grace_s``; never an index
     record without its fragments. If another writer committed the same key
     first, our fragments are removed and the put returns ``False``.
  6. Above the capacity high watermark, evict LRU entries down to the low one.

Read path (``get``): read the k data fragments (in parallel for remote targets), verify each one's
checksum and header against the index; on any failure read parity fragments
until k are good; decode; verify the entry checksum; return. Fewer than k good
fragments: mark the entry lost and raise ``Unrecoverable``. ``get_many_into``
is the same path, except that the decode writes the payload into the caller's
buffer (one copy from the fragment bodies) and the checksum is verified there.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from kvstore import codec
from kvstore.api import Entry, EntryInfo, EntryKind, Layout, LookupResult, PutItem, writable_view
from kvstore.config import StoreConfig, load_config
from kvstore.errors import (
    CapacityExceeded,
    CorruptData,
    IncompatibleFormat,
    InvalidRequest,
    NotFound,
    StoreClosed,
    StoreUnavailable,
    Unrecoverable,
)
from kvstore.index import Index, Meta, ekey
from kvstore.keys import KEY_LEN, check_key
from kvstore.placement import place
from kvstore.targets import Target, TargetUnavailable, fragment_path, open_target

log = logging.getLogger(__name__)

DATA_FORMAT_VERSION = 1
MAX_TTL_S = 100 * 365 * 86400.0  # expiry times are u64 nanoseconds: keep far from overflow
_SCRATCH_MAX = 16 * 1024 * 1024  # larger reads get a fresh buffer instead of a cached one
FORMAT_FILE = "kvstore.json"


def _payload(value: Any, layout: Layout | None) -> tuple[memoryview, Layout]:
    """Normalise a value to contiguous bytes plus its layout (misuse raises InvalidRequest)."""
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        lay = layout or Layout(str(arr.dtype), tuple(arr.shape))
        mv = memoryview(arr).cast("B") if arr.size else memoryview(b"")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        mv = memoryview(value).cast("B")
        lay = layout or Layout.for_bytes(len(mv))
    else:
        raise InvalidRequest(
            f"a value must be bytes-like or a numpy array, got {type(value).__name__}"
        )
    lay.validate(len(mv))
    return mv, lay


class _Encoded:
    __slots__ = ("ek", "key", "kind", "meta_base", "frames")

    def __init__(self, ek: bytes, key: bytes, kind: EntryKind, meta_base: Meta, frames: list[bytes]):
        self.ek, self.key, self.kind, self.meta_base, self.frames = ek, key, kind, meta_base, frames


class EmbeddedStore:
    """In-process implementation of ``kvstore.api.KVStore``. See the module docstring."""

    def __init__(self, config: StoreConfig, *, clock: Callable[[], float] = time.time):
        self.config = config
        if config.clock_offset_s:
            base, offset = clock, config.clock_offset_s
            clock = lambda: base() + offset  # noqa: E731 - a skewed node (TTLs, grace periods)
        self.clock = clock
        self.data_dir = Path(config.data_dir).resolve()
        self._closed = False
        fresh = self._open_data_dir()
        self.target_specs = config.resolved_targets()
        self.targets: dict[str, Target] = {s.name: open_target(s) for s in self.target_specs}
        if fresh:
            for t in self.targets.values():
                t.create_root()
        self.index = Index(str(self.data_dir / "index"), map_size=config.lmdb_map_size,
                           sync=config.fsync, max_readers=config.max_readers)
        self.code = codec.erasure_code(config.ec_k, config.ec_m, config.ec_type)
        # Two pools, so that no task ever waits on a task queued behind it in its own pool:
        # ``_pool`` runs single fragment reads/writes (leaf work); ``_batch_pool`` runs one
        # entry of a batch each, and those submit their fragment I/O to ``_pool``.
        self._pool = ThreadPoolExecutor(max_workers=config.read_workers, thread_name_prefix="kvstore-io")
        self._batch_pool = ThreadPoolExecutor(max_workers=config.read_workers, thread_name_prefix="kvstore-batch")
        self._tls = threading.local()
        self._touch_lock = threading.Lock()
        self._touches: dict[bytes, int] = {}
        self._last_flush = self.clock()
        self._evict_lock = threading.Lock()
        self._counters_lock = threading.Lock()
        self.counters: dict[str, int] = {
            "puts": 0, "puts_deduplicated": 0, "gets": 0, "get_misses": 0, "degraded_reads": 0,
            "unrecoverable": 0, "bytes_in": 0, "bytes_out": 0, "evicted": 0, "fragment_rewrites": 0,
            "read_retries": 0, "read_timeouts": 0,
        }
        if not fresh:
            missing = [n for n, t in self.targets.items() if not t.is_up()]
            if missing:
                log.warning("targets down at open: %s (reads will be degraded)", ", ".join(missing))

    # ------------------------------------------------------------------ set-up
    def _open_data_dir(self) -> bool:
        fmt = self.data_dir / FORMAT_FILE
        if fmt.exists():
            try:
                doc = json.loads(fmt.read_text())
                ver = int(doc["format_version"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise IncompatibleFormat(
                    f"{fmt} is unreadable ({exc}); this is not a kvstore data directory or it is damaged"
                ) from exc
            if ver != DATA_FORMAT_VERSION:
                raise IncompatibleFormat(
                    f"data directory {self.data_dir} has format version {ver}, this kvstore reads "
                    f"version {DATA_FORMAT_VERSION}; open it with a matching kvstack release or "
                    "start a fresh directory"
                )
            return False
        if self.data_dir.exists() and any(p.name not in ("index", "targets") for p in self.data_dir.iterdir()):
            raise InvalidRequest(
                f"{self.data_dir} exists, is not empty and has no {FORMAT_FILE}: refusing to use it "
                "as a kvstore data directory; pass an empty or new directory"
            )
        self.data_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.data_dir / f".{FORMAT_FILE}.tmp"
        tmp.write_text(json.dumps({"format_version": DATA_FORMAT_VERSION, "created": time.time()}))
        os.replace(tmp, fmt)
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this store is closed; open a new one with kvstore.connect")

    def now_ns(self) -> int:
        return int(self.clock() * 1e9)

    def _count(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            self.counters[name] += n

    # ------------------------------------------------------------------ write path
    def _encode(self, key: bytes, value: Any, kind: str | EntryKind, ttl_s: float | None,
                layout: Layout | None, tokens: int) -> _Encoded:
        key = check_key(key)
        k = EntryKind.parse(kind)
        payload, lay = _payload(value, layout)
        if len(payload) > self.config.max_value_bytes:
            raise InvalidRequest(
                f"value of {len(payload)} bytes is over max_value_bytes={self.config.max_value_bytes}; "
                "split it or raise the limit in the store config"
            )
        if ttl_s is None:
            ttl_s = self.config.default_ttl_s
        elif not 0 < ttl_s <= MAX_TTL_S:  # also rejects NaN
            raise InvalidRequest(f"ttl_s must be in (0, {MAX_TTL_S:.0f}] seconds (or None for the default), "
                                 f"got {ttl_s}")
        if not isinstance(tokens, int) or tokens < 0:
            raise InvalidRequest(f"tokens must be a non-negative int, got {tokens!r}")
        entry = codec.encode_entry(key, k, payload, lay, tokens, compression=self.config.compression,
                                   zstd_level=self.config.zstd_level, min_ratio=self.config.min_compress_ratio)
        bodies = self.code.encode(entry)
        gen = os.urandom(8)
        cfg = self.config
        frames = [
            codec.frame_fragment(codec.FragmentHeader(i, cfg.ec_k, cfg.ec_m, k.code, key, gen, len(entry), len(b)), b)
            for i, b in enumerate(bodies)
        ]
        now = self.now_ns()
        meta = Meta(k=cfg.ec_k, m=cfg.ec_m, tokens=tokens, plain_len=len(payload), entry_len=len(entry),
                    frag_len=len(frames[0]), created_ns=now, access_ns=now,
                    expires_ns=now + int(ttl_s * 1e9) if ttl_s else 0, gen=gen, targets=())
        return _Encoded(ekey(k.code, key), key, k, meta, frames)

    def _write_fragments(self, enc: _Encoded) -> tuple[str, ...]:
        """Write every fragment to a distinct target; replace failing targets by the next best."""
        n = len(enc.frames)
        order = place(enc.key, self.target_specs, len(self.target_specs))  # all targets, best first
        chosen = order[:n]
        spare = order[n:]
        failed: list[str] = []
        pending = list(range(n))
        while pending:
            futs = {
                i: self._pool.submit(
                    self.targets[chosen[i]].write,
                    fragment_path(enc.kind.code, enc.key, enc.meta_base.gen, i),
                    enc.frames[i], fsync=self.config.fsync,
                )
                for i in pending
            }
            pending = []
            last_exc: OSError | None = None
            for i, f in futs.items():
                try:
                    f.result()
                except OSError as exc:
                    log.warning("fragment %d of %s failed on target %s: %s", i, enc.key.hex(), chosen[i], exc)
                    failed.append(chosen[i])
                    last_exc = exc
                    pending.append(i)
            if pending and len(spare) < len(pending):
                self._discard(enc, {i: c for i, c in enumerate(chosen) if i not in pending})
                cls = CapacityExceeded if getattr(last_exc, "errno", None) == errno.ENOSPC else StoreUnavailable
                raise cls(
                    f"cannot place {n} fragments of {enc.key.hex()} on distinct targets; failed: "
                    f"{', '.join(failed)} (last error: {last_exc})"
                ) from last_exc
            for i in pending:
                chosen[i] = spare.pop(0)
        return tuple(chosen)

    def _discard(self, enc: _Encoded, placed: dict[int, str]) -> None:
        """Remove fragments of a put that will never be indexed (best effort: else orphans)."""
        for i, name in placed.items():
            t = self.targets.get(name)
            if t is not None:
                try:
                    t.delete(fragment_path(enc.kind.code, enc.key, enc.meta_base.gen, i))
                except OSError:
                    pass  # an orphan GC will sweep

    def put(self, key: bytes, value: Any, *, kind: str = "block", ttl_s: float | None = None,
            layout: Layout | None = None, tokens: int = 0) -> bool:
        return self.put_many([PutItem(key, value, kind, ttl_s, layout, tokens)])[0]

    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        """Batched put: fragments of all items written in parallel, then one index commit."""
        self._check_open()
        if not items:
            return []
        now = self.now_ns()
        # 1-2: skip live keys (and duplicates inside the batch) before doing any work.
        result = [False] * len(items)
        todo: list[int] = []
        seen: set[bytes] = set()
        with self.index.env.begin() as txn:
            for i, it in enumerate(items):
                ek = ekey(EntryKind.parse(it.kind).code, check_key(it.key))
                if ek in seen:
                    continue
                seen.add(ek)
                m = self.index.get_meta(txn, ek)
                if m is not None and not (m.expires_ns and m.expires_ns <= now):
                    self._touch(ek, now)
                    self._count("puts_deduplicated")
                    continue
                todo.append(i)
        encs = {i: self._encode(items[i].key, items[i].value, items[i].kind, items[i].ttl_s,
                                items[i].layout, items[i].tokens) for i in todo}
        # 3-4: fragments durable first (in parallel across items).
        placed: dict[int, tuple[str, ...]] = {}
        futs = {i: self._batch_pool.submit(self._write_fragments, e) for i, e in encs.items()} if len(encs) > 1 else {}
        try:
            for i, e in encs.items():
                placed[i] = futs[i].result() if futs else self._write_fragments(e)
        except BaseException:
            for i, f in futs.items():
                if i not in placed:
                    try:
                        placed[i] = f.result()
                    except BaseException:
                        continue
            for i, names in placed.items():
                self._discard(encs[i], dict(enumerate(names)))
            raise
        # 5: one index transaction for the batch.
        losers: list[int] = []
        with self.index.env.begin(write=True) as txn:
            for i, e in encs.items():
                old = self.index.get_meta(txn, e.ek)
                if old is not None:
                    if not (old.expires_ns and old.expires_ns <= now):
                        losers.append(i)  # a concurrent writer won; ours are orphans to remove
                        continue
                    self.index.remove_txn(txn, e.ek, old, now)
                lost = self.index.get_lost(txn, e.ek)
                if lost is not None:
                    self.index.drop_lost_txn(txn, e.ek, lost, now, to_grave=True)
                self.index.insert_txn(txn, e.ek, replace(e.meta_base, targets=placed[i]))
                result[i] = True
            self._flush_touches_txn(txn)
        for i in losers:
            self._discard(encs[i], dict(enumerate(placed[i])))
        n_new = sum(result)
        self._count("puts", n_new)
        self._count("bytes_in", sum(encs[i].meta_base.plain_len for i in encs if result[i]))
        # 6: keep inside capacity.
        if n_new and self.config.capacity_bytes:
            self._evict_if_needed()
        return result

    # ------------------------------------------------------------------ read path
    def _read_fragment(self, meta: Meta, ek: bytes, i: int, into: memoryview | None = None) -> memoryview:
        """One verified fragment body (a view into ``into`` when given); raises OSError or CorruptData."""
        t = self.targets.get(meta.targets[i])
        if t is None:
            raise TargetUnavailable(2, f"target {meta.targets[i]} is not configured")
        rel = fragment_path(ek[0], ek[1:], meta.gen, i)
        tries = 1 + self.config.fragment_read_retries
        for attempt in range(tries):
            try:
                if into is None:
                    raw: bytes | memoryview = t.read(rel)
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
        if (fh.index != i or fh.key != ek[1:] or fh.gen != meta.gen or fh.kind_code != ek[0]
                or fh.entry_len != meta.entry_len or fh.k != meta.k or fh.m != meta.m):
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

    def _gather(self, meta: Meta, ek: bytes, scratch: memoryview | None = None) -> tuple[dict[int, memoryview], list[str]]:
        """At least k verified bodies if possible (data fragments first); failed target names.

        Fragment ``i`` is read into slot ``i`` of ``scratch`` (``frag_len + 1`` bytes
        each); the returned bodies are views into it, valid until the caller reuses it.

        With ``read_timeout_s`` > 0 a fragment not back in time is counted as failed and
        the next one is read instead, so one slow target does not stall a get while k
        others answer; if fewer than k arrive otherwise, the late reads are awaited after
        all (a slow target is not a lost one). Those late reads may still be writing into
        their slots, so the buffer is a fresh one, never the reused per-thread scratch.
        """
        slot = meta.frag_len + 1
        timeout = self.config.read_timeout_s
        if scratch is None:
            n_bytes = slot * len(meta.targets)
            scratch = memoryview(bytearray(n_bytes)) if timeout else self._scratch(n_bytes)
        good: dict[int, memoryview] = {}
        failed: list[str] = []
        late: dict[int, Future] = {}
        n = len(meta.targets)
        parallel = self._parallel(meta) or timeout > 0
        nxt = 0
        while len(good) < meta.k and nxt < n:
            want = list(range(nxt, min(n, nxt + meta.k - len(good))))
            nxt = want[-1] + 1
            views = {i: scratch[i * slot : (i + 1) * slot] for i in want}
            outs: list[tuple[int, memoryview | None, Exception | None]] = []
            if parallel and (len(want) > 1 or timeout):
                futs = {self._pool.submit(self._read_fragment, meta, ek, i, views[i]): i for i in want}
                done, slow = wait(futs, timeout=timeout or None)
                for f in slow:
                    late[futs[f]] = f
                    self._count("read_timeouts")
                    outs.append((futs[f], None, TimeoutError(f"no answer within read_timeout_s={timeout}")))
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
        for i, f in late.items():
            if len(good) >= meta.k:
                break
            try:
                good[i] = f.result()  # bounded by the target itself: better late than lost
            except (OSError, CorruptData):
                continue
            failed.remove(meta.targets[i])
        return good, failed

    def _decode(self, meta: Meta, ek: bytes, good: dict[int, memoryview], failed: list[str],
                out: memoryview | None = None) -> tuple[codec.EntryHeader, bytes | memoryview]:
        """Decode and verify an entry from ``good`` bodies; with ``out`` (a flat writable
        view of at least ``meta.plain_len`` bytes) the plain bytes are written there and
        verified in place, and the returned payload is the view ``out[:plain_len]``."""
        code = codec.erasure_code(meta.k, meta.m, self.config.ec_type)
        limit = max(self.config.max_value_bytes, meta.plain_len)
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
            return h, plain
        except CorruptData as exc:
            raise Unrecoverable(
                f"entry {ek[1:].hex()} failed verification after decoding ({exc})",
                key=ek[1:], failed_targets=tuple(failed),
            ) from exc

    def _read_verified(self, ek: bytes, meta: Meta,
                       out: memoryview | None = None) -> tuple[codec.EntryHeader, bytes | memoryview]:
        good, failed = self._gather(meta, ek)
        if len(good) < meta.k:
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

    def _mark_lost(self, ek: bytes, meta: Meta) -> None:
        self._count("unrecoverable")
        with self.index.env.begin(write=True) as txn:
            cur = self.index.get_meta(txn, ek)
            if cur is not None and cur.gen == meta.gen:
                self.index.mark_lost_txn(txn, ek, cur)
        log.error("entry %s marked lost", ek[1:].hex())

    def _live_meta(self, ek: bytes, now: int) -> Meta | None:
        with self.index.env.begin() as txn:
            m = self.index.get_meta(txn, ek)
        if m is None or (m.expires_ns and m.expires_ns <= now):
            return None
        return m

    def get_entry(self, key: bytes, *, kind: str = "block") -> Entry:
        self._check_open()
        k = EntryKind.parse(kind)
        ek = ekey(k.code, check_key(key))
        now = self.now_ns()
        meta = self._live_meta(ek, now)
        self._count("gets")
        if meta is None:
            self._count("get_misses")
            raise NotFound(f"no {k.value} entry for key {ek[1:].hex()}")
        h, plain = self._read_verified(ek, meta)
        self._count("bytes_out", len(plain))
        self._touch(ek, now)
        return Entry(ek[1:], k, h.layout, h.tokens, plain)

    def get(self, key: bytes, *, kind: str = "block") -> bytes:
        return self.get_entry(key, kind=kind).data

    def get_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bytes | None]:
        """Batched get; a missing or unrecoverable entry is ``None`` in its slot."""
        entries = self.get_entries(keys, kind=kind)
        return [None if e is None else e.data for e in entries]

    def get_entries(self, keys: Sequence[bytes], *, kind: str = "block") -> list[Entry | None]:
        self._check_open()
        k = EntryKind.parse(kind)
        eks = [ekey(k.code, check_key(key)) for key in keys]
        now = self.now_ns()
        with self.index.env.begin() as txn:
            metas = [self.index.get_meta(txn, ek) for ek in eks]
        self._count("gets", len(eks))

        def one(i: int) -> Entry | None:
            m = metas[i]
            if m is None or (m.expires_ns and m.expires_ns <= now):
                self._count("get_misses")
                return None
            try:
                h, plain = self._read_verified(eks[i], m)
            except Unrecoverable as exc:
                log.error("get_many: %s", exc)
                return None
            self._count("bytes_out", len(plain))
            self._touch(eks[i], now)
            return Entry(eks[i][1:], k, h.layout, h.tokens, plain)

        live = [m for m in metas if m is not None]
        if len(eks) == 1 or not any(self._parallel(m) for m in live):
            # Local targets: a plain loop beats the thread hand-off (tools/bench_store.py).
            return [one(i) for i in range(len(eks))]
        return list(self._batch_pool.map(one, range(len(eks))))

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *,
                      kind: str = "block") -> list[EntryInfo | None]:
        """Batched get straight into caller buffers (``kvstore.api``, "Reading into caller
        buffers"): fragments are read and verified as in ``get_many``, the payload pieces
        are copied from the fragment bodies into ``outs[i]`` (one copy; zstd entries are
        decompressed into it), and the entry checksum is verified over ``outs[i]``.

        Every buffer is checked against the index's plain size before any fragment is
        read, so a too-small one raises ``InvalidRequest`` with nothing written.
        """
        self._check_open()
        if len(outs) != len(keys):
            raise InvalidRequest(f"get_many_into: {len(keys)} keys but {len(outs)} output buffers")
        k = EntryKind.parse(kind)
        eks = [ekey(k.code, check_key(key)) for key in keys]
        views = [writable_view(o, f"outs[{i}]") for i, o in enumerate(outs)]
        now = self.now_ns()
        with self.index.env.begin() as txn:
            metas = [self.index.get_meta(txn, ek) for ek in eks]
        for i, m in enumerate(metas):
            if m is not None and m.plain_len > len(views[i]):
                raise InvalidRequest(
                    f"outs[{i}] holds {len(views[i])} bytes but the {k.value} entry {eks[i][1:].hex()} "
                    f"has {m.plain_len}; size the buffers from the entry layout"
                )
        self._count("gets", len(eks))

        def one(i: int) -> EntryInfo | None:
            m = metas[i]
            if m is None or (m.expires_ns and m.expires_ns <= now):
                self._count("get_misses")
                return None
            try:
                h, _ = self._read_verified(eks[i], m, views[i])
            except Unrecoverable as exc:
                log.error("get_many_into: %s", exc)
                return None
            self._count("bytes_out", h.plain_len)
            self._touch(eks[i], now)
            return EntryInfo(eks[i][1:], k, h.plain_len, h.layout, h.tokens)

        live = [m for m in metas if m is not None]
        if len(eks) == 1 or not any(self._parallel(m) for m in live):
            return [one(i) for i in range(len(eks))]  # local targets: as in get_entries
        return list(self._batch_pool.map(one, range(len(eks))))

    # ------------------------------------------------------------------ access times (approximate LRU)
    def _touch(self, ek: bytes, now: int) -> None:
        with self._touch_lock:
            self._touches[ek] = now
            due = self.clock() - self._last_flush >= self.config.access_flush_s
        if due:
            self.flush_touches()

    def _flush_touches_txn(self, txn) -> None:
        with self._touch_lock:
            pending, self._touches = self._touches, {}
            self._last_flush = self.clock()
        for ek, ts in pending.items():
            self.index.touch_txn(txn, ek, ts)

    def flush_touches(self) -> None:
        """Write batched access times to the LRU ordering (one transaction)."""
        with self.index.env.begin(write=True) as txn:
            self._flush_touches_txn(txn)

    # ------------------------------------------------------------------ delete, pin
    def delete(self, key: bytes, *, kind: str = "block") -> bool:
        self._check_open()
        ek = ekey(EntryKind.parse(kind).code, check_key(key))
        now = self.now_ns()
        with self.index.env.begin(write=True) as txn:
            m = self.index.get_meta(txn, ek)
            if m is not None:
                self.index.remove_txn(txn, ek, m, now)
                return True
            lost = self.index.get_lost(txn, ek)
            if lost is not None:
                self.index.drop_lost_txn(txn, ek, lost, now, to_grave=True)
                return True
        return False

    def _set_pinned(self, key: bytes, kind: str, pinned: bool) -> bool:
        self._check_open()
        ek = ekey(EntryKind.parse(kind).code, check_key(key))
        with self.index.env.begin(write=True) as txn:
            m = self.index.get_meta(txn, ek)
            if m is None:
                return False
            if m.pinned != pinned:
                self.index.update_txn(txn, ek, m, replace(m, pinned=pinned))
        return True

    def pin(self, key: bytes, *, kind: str = "block") -> bool:
        """Exempt a live entry from capacity eviction (TTL still applies). False if absent."""
        return self._set_pinned(key, kind, True)

    def unpin(self, key: bytes, *, kind: str = "block") -> bool:
        return self._set_pinned(key, kind, False)

    # ------------------------------------------------------------------ lookup
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        self._check_open()
        if not all(type(k) is bytes and len(k) == KEY_LEN for k in keys):
            keys = [check_key(k) for k in keys]
        hit, swa = self.index.lookup(keys, EntryKind.BLOCK.code, EntryKind.SWA.code, self.now_ns())
        return LookupResult(hit, swa)

    def lookup_many(self, chains: Sequence[Sequence[bytes]]) -> list[LookupResult]:
        return [self.lookup(c) for c in chains]

    # ------------------------------------------------------------------ capacity
    def used_bytes(self) -> int:
        with self.index.env.begin() as txn:
            return self.index.counter(txn, "used_bytes")

    def _evict_if_needed(self) -> int:
        cap = self.config.capacity_bytes
        if not cap or self.used_bytes() <= cap * self.config.high_watermark:
            return 0
        if not self._evict_lock.acquire(blocking=False):
            return 0  # another thread of this process is evicting
        try:
            return self.evict_to(int(cap * self.config.low_watermark))
        finally:
            self._evict_lock.release()

    def evict_to(self, goal_bytes: int, *, dry_run: bool = False) -> int:
        """Evict least-recently-used unpinned entries until at most ``goal_bytes`` are used."""
        self.flush_touches()
        evicted = 0
        now = self.now_ns()
        while True:
            with self.index.env.begin(write=not dry_run) as txn:
                used = self.index.counter(txn, "used_bytes")
                if used <= goal_bytes:
                    break
                batch = list(self.index.oldest(txn, "lru", limit=256))
                if not batch:
                    raise CapacityExceeded(
                        f"store holds {used} bytes over the goal {goal_bytes} and everything left "
                        "is pinned; unpin entries or raise capacity_bytes"
                    )
                for _t, ek in batch:
                    m = self.index.get_meta(txn, ek)
                    if m is None:
                        continue
                    if not dry_run:
                        self.index.remove_txn(txn, ek, m, now)
                    used -= m.stored_bytes
                    evicted += 1
                    if used <= goal_bytes:
                        break
                if dry_run:
                    break
        self._count("evicted", evicted if not dry_run else 0)
        if evicted and not dry_run:
            log.info("evicted %d entries to get under %d bytes", evicted, goal_bytes)
        return evicted

    # ------------------------------------------------------------------ maintenance, stats
    def gc(self, *, dry_run: bool = False, orphans: bool = True, progress: Callable | None = None) -> dict:
        from kvstore.maintenance import run_gc

        self._check_open()
        return run_gc(self, dry_run=dry_run, sweep_orphans=orphans, progress=progress)

    def check(self, fix: bool = False, *, progress: Callable | None = None) -> list:
        from kvstore.maintenance import check

        self._check_open()
        return check(self, fix=fix, progress=progress)

    def repair(self, *, progress: Callable | None = None) -> dict:
        from kvstore.maintenance import repair

        self._check_open()
        return repair(self, progress=progress)

    def stats(self) -> dict:
        from kvstore.maintenance import stats

        self._check_open()
        return stats(self)

    def close(self) -> None:
        if self._closed:
            return
        try:
            self.flush_touches()
        finally:
            self._closed = True
            self._batch_pool.shutdown(wait=True)
            self._pool.shutdown(wait=True)
            self.index.close()

    def __enter__(self) -> "EmbeddedStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_embedded(url: str, **overrides: Any) -> EmbeddedStore:
    """``kvstore.connect`` opener for plain paths and ``file://`` URLs."""
    path = url[len("file://"):] if url.startswith("file://") else url
    clock = overrides.pop("clock", None)
    config_file = overrides.pop("config_file", None)
    cfg = load_config(config_file, data_dir=path, **overrides)
    return EmbeddedStore(cfg, clock=clock or time.time)
