"""The two lower tiers as the plugin sees them: a host (DRAM) LRU cache and a guarded store.

Who uses it: ``KVStoreConnector`` builds one ``HostCache``, one ``StoreGateway`` and one
``Metrics`` and hands them to its ``Loader`` and ``SaveQueue``; the vLLM binding
(``engine_plugin.vllm``) builds its own gateway and metrics.

``HostCache`` holds host tensors (pinned on accelerators) of block and SWA
entries under ``(kind, key)`` with a byte capacity and LRU eviction; an
evicted entry goes to ``on_evict`` (write-back to the store, per policy), every one of a
``put`` even when the callback raised for another (``HostCache.put``).

``StoreGateway`` wraps any ``kvstore.KVStore`` so that the engine never
hangs on it and never uses bad bytes:

1. every call runs on a small executor and is abandoned after
   ``timeout_s`` (reads: on the engine's critical path) or ``put_timeout_s``
   (background puts); a timeout is counted and treated like an outage;
2. after an outage the gateway is *open* for ``backoff_s``: calls return a
   shortfall at once (counted as ``store_skipped``) instead of paying the
   timeout again on every request. A store that answers and refuses a call for
   want of room (``CapacityExceeded``: a save that does not fit beside pinned
   entries, a tenant's quota) is not an outage: that call fails, counted
   ``store_refused``, and the breaker stays closed, so reads go on (a save over
   the capacity must not cut the engine off from the store, its reads included);
3. a read returns ``None`` for an entry that is missing, lost, corrupt, of
   the wrong size, or saved with another layout than the caller expects (the
   store checks checksums; the gateway checks lengths and, where the store
   reports it, the entry's dtype and shape: ``read_into(..., layout=)``), so
   the caller recomputes that part. A plain ``get_many`` returns bytes
   without their header, so where a read goes through one (a store without
   ``get_many_into``; the remote client reading through the daemon, whose
   ``EntryInfo.layout`` is then ``None``) only the length is checked: a
   second read per entry (``get_entry``) to learn the layout would double
   the load cost of every hit to catch a writer that broke the namespace;
4. ``read_into`` lands payloads straight in the caller's buffers (pinned
   staging buffers, or pool blocks on a host-resident backend). A store with
   ``get_many_into`` (``kvstore.api.ReadsInto``) writes them itself and
   verifies each entry's checksum over the buffer before the slot is reported
   good; such a call abandoned after its timeout may still be writing into
   those buffers, so its future comes back as ``IntoResult.pending`` and the
   caller must not reuse the buffers before it completed. A store with only
   ``get_many`` is read under the timeout and the bytes are copied on the
   *caller's* thread afterwards, so an abandoned call never writes into the
   buffers (``pending`` is always ``None`` there). ``inline=True`` reads a
   ``ReadsInto`` store on the caller's thread instead (no executor hop): for a
   caller that must wait for the writes to end anyway; a call slower than the
   timeout is counted and trips the breaker, and its verified slots are kept.
5. a store call that raises *anything* (a ``KVStoreError``, an ``OSError``,
   or an exception a broken store or client lets escape, such as a
   ``ValueError``), answers with the wrong number of slots, or answers a
   lookup out of range (``_bad_lookup``: more hits than keys asked, a
   negative, float or bool count, a snapshot past the hit) is a failed
   call: logged (with the traceback when unexpected), counted
   (``store_errors``) and handled as in 1-2, so the caller recomputes. So is an
   answer with a malformed slot (``_bad_slots``: a ``get_many`` slot that is
   neither ``None`` nor bytes-like, a ``get_many_into`` slot that is neither
   ``None`` nor an ``EntryInfo`` with an int ``nbytes``): the whole batch is
   then a miss, as no slot of a store that garbles its answers is trusted. Only
   the store call itself is guarded (``_guarded``): an exception in the
   plugin's own code around it is a bug and propagates.

``Metrics`` is a thread-safe counter set; ``snapshot()`` returns a dict.

The executor of 1 (``kvstore.executors.DaemonExecutor``) runs store calls on daemon
threads: a call abandoned at its timeout may hang forever (a dead mount, a silent
endpoint), and ``concurrent.futures`` would join its non-daemon worker at interpreter
exit, so the engine's process could never end (the embedded store's own I/O pools are
daemon threads too). After ``close`` a call is a shortfall, never an exception: its
future comes back cancelled.

The rule for abandoned calls: a call never waits in a queue. An abandoned call keeps
its thread until it returns, and the next call gets another thread, up to
``max_calls`` (default ``MAX_STORE_CALLS``; a connector passes ``ConnectorConfig.store_max_calls``)
calls running at once, abandoned ones included; the plugin itself runs at most three at a time
(a lookup, a load, a put), so a connector's floor is twice that (``MIN_STORE_CALLS``: room for one
abandoned call per path). A call
that finds all ``max_calls`` running fails at once, counted ``store_busy``, and trips
the breaker (2): with that many calls hung, the store is as good as down. So hung calls
cost at most ``max_calls`` threads, never delay a later call (a lookup, a read
holding staging buffers, a put) behind them, and once they end (or the store
recovers for new connections while fewer than ``max_calls`` hang) calls reach the
store again. A fixed pool of workers shared by every call would not: once all of them
hung, every later call would queue behind them, time out and trip the breaker, for good.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from kvstore.api import EntryInfo, EntryKind, KVStore, Layout, LookupResult, PutItem, ReadsInto, writable_view
from kvstore.errors import CapacityExceeded, InvalidRequest, KVStoreError
from kvstore.executors import DaemonExecutor

log = logging.getLogger(__name__)

MAX_STORE_CALLS = 16  # store calls running at once, abandoned ones included (module docstring)


class _StoreFault(Exception):
    """A store method raised something other than ``KVStoreError``/``OSError`` (a broken store
    or client): the gateway treats it as a failed call. Carries the original as ``__cause__``."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bad_lookup(res, n_keys: int) -> str | None:
    """Why a store's answer to a lookup of ``n_keys`` keys cannot be used, or ``None``.

    Checked, because the connector indexes blocks and plans chunks with it: ``hit_blocks``
    an int (not a bool) in ``[0, n_keys]``, ``swa_at`` ``None`` or an int in
    ``[0, hit_blocks]`` (``LookupResult`` does not validate its fields).
    """
    if not isinstance(res, LookupResult):
        return f"the store returned {type(res).__name__}, not a LookupResult"
    if not _is_int(res.hit_blocks) or not 0 <= res.hit_blocks <= n_keys:
        return f"the store answered hit_blocks={res.hit_blocks!r} to a lookup of {n_keys} keys"
    if res.swa_at is not None and (not _is_int(res.swa_at) or not 0 <= res.swa_at <= res.hit_blocks):
        return f"the store answered swa_at={res.swa_at!r} with hit_blocks={res.hit_blocks}"
    return None


_BYTES_LIKE = (bytes, bytearray, memoryview)


def _bad_slots(res, n_keys: int, native: bool) -> str | None:
    """Why a store's answer to a batched read of ``n_keys`` keys cannot be used, or ``None``:
    not a list of ``n_keys`` slots, or a slot neither ``None`` nor what the read returns
    (bytes-like for ``get_many``; ``native``: an ``EntryInfo`` with an int ``nbytes`` and a
    ``Layout`` or ``None``, for ``get_many_into``)."""
    if not isinstance(res, list) or len(res) != n_keys:
        return f"the store answered {n_keys} keys with {len(res) if isinstance(res, list) else type(res).__name__}"
    for v in res:
        if v is None:
            continue
        if native:
            if (not isinstance(v, EntryInfo) or not _is_int(v.nbytes)
                    or not (v.layout is None or isinstance(v.layout, Layout))):
                return f"the store answered a slot with {type(v).__name__} {v!r:.80}, not an EntryInfo"
        elif not isinstance(v, _BYTES_LIKE):
            return f"the store answered a slot with {type(v).__name__}, not bytes"
    return None


def _guarded(fn: Callable) -> Callable:
    """``fn`` (a store method) with any unexpected exception turned into ``_StoreFault``.

    ``KVStoreError`` and ``OSError`` pass unchanged (the gateway and ``_read_into`` tell
    them apart); wrapping only the store call keeps the plugin's own bugs visible.
    """
    def call(*args, **kw):
        try:
            return fn(*args, **kw)
        except (KVStoreError, OSError):
            raise
        except Exception as exc:  # noqa: BLE001 - any store failure is a failed load, never the step's
            raise _StoreFault(f"{type(exc).__name__}: {exc}") from exc
    return call


def _layout_matches(got: Layout | None, want: Layout | None) -> bool:
    """Whether an entry saved as ``got`` may be used as ``want``; unknown on either side: yes."""
    if got is None or want is None:
        return True
    return got.dtype == want.dtype and tuple(got.shape) == tuple(want.shape)


class Metrics:
    def __init__(self) -> None:
        self._c: dict[str, float] = {}
        self._lock = threading.Lock()

    def inc(self, name: str, n: float = 1) -> None:
        with self._lock:
            self._c[name] = self._c.get(name, 0) + n

    def observe_max(self, name: str, v: float) -> None:
        with self._lock:
            self._c[name] = max(self._c.get(name, v), v)

    def get(self, name: str) -> float:
        with self._lock:
            return self._c.get(name, 0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._c)


HostKey = tuple[str, bytes]  # (kind, key)


class HostCache:
    """Byte-bounded LRU of host tensors. Invariant: ``used_bytes`` = sum of held nbytes <= capacity."""

    def __init__(self, capacity_bytes: int, on_evict: Callable[[str, bytes, torch.Tensor], None] | None = None):
        self.capacity = capacity_bytes
        self.on_evict = on_evict
        self._d: OrderedDict[HostKey, torch.Tensor] = OrderedDict()
        self.used_bytes = 0
        self._lock = threading.RLock()
        self.evictions = 0

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def __contains__(self, hk: HostKey) -> bool:
        with self._lock:
            return hk in self._d

    def get(self, kind: str, key: bytes) -> torch.Tensor | None:
        """The entry, refreshed as most recently used; ``None`` if absent."""
        with self._lock:
            t = self._d.get((kind, key))
            if t is not None:
                self._d.move_to_end((kind, key))
            return t

    def put(self, kind: str, key: bytes, t: torch.Tensor) -> bool:
        """Insert (or refresh) an entry; evicts LRU entries to fit. False if it can never fit.

        Every entry evicted here is handed to ``on_evict`` (after the lock is let go), even when
        the callback raised for another: each may be a write-back save that would be lost. If any
        raised, the first exception is raised once all were handed over (the others are logged,
        with tracebacks, and noted on it); the tier is consistent then: the new entry is in,
        the evicted ones are out, ``used_bytes`` counts what is held.
        """
        n = self._nbytes(t)
        if n > self.capacity:
            return False
        evicted = []
        with self._lock:
            old = self._d.pop((kind, key), None)
            if old is not None:
                self.used_bytes -= self._nbytes(old)
            while self.used_bytes + n > self.capacity and self._d:
                hk, v = self._d.popitem(last=False)
                self.used_bytes -= self._nbytes(v)
                self.evictions += 1
                evicted.append((hk, v))
            self._d[(kind, key)] = t
            self.used_bytes += n
        if self.on_evict is not None and evicted:
            self._hand_over(evicted)
        return True

    def _hand_over(self, evicted: list[tuple[HostKey, torch.Tensor]]) -> None:
        """``on_evict`` for each evicted entry, outside the lock (it may enqueue store work); a
        callback that raises does not keep the later entries from theirs (see ``put``)."""
        first: Exception | None = None
        failed = 0
        for (kind, key), v in evicted:
            try:
                self.on_evict(kind, key, v)
            except Exception as exc:  # noqa: BLE001 - raised below, once every entry was handed over
                failed += 1
                if first is None:
                    first = exc
                else:
                    log.error("host tier: on_evict raised for %s %s (after an earlier one of the same put)",
                              kind, key.hex()[:16], exc_info=True)
        if first is not None:
            if failed > 1:
                first.add_note(f"{failed - 1} more on_evict calls of this HostCache.put raised (logged)")
            raise first

    def items(self) -> list[tuple[HostKey, torch.Tensor]]:
        """A snapshot of the entries, least recently used first (no access-time side effect)."""
        with self._lock:
            return list(self._d.items())

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.used_bytes = 0

    def __len__(self) -> int:
        return len(self._d)


@dataclass(frozen=True, slots=True)
class IntoResult:
    """Outcome of ``StoreGateway.read_into``.

    ``ok[i]``: ``outs[i]`` holds a verified payload of exactly the expected size.
    ``pending``: not ``None`` when the call was abandoned at its timeout and may still
    write into the buffers; every ``ok`` is then ``False`` and the buffers may be reused
    only once this future is done (``add_done_callback``).
    ``late``: an ``inline`` call finished after its timeout; it was counted and tripped the
    breaker as a timeout, but it *did* finish, so its ``ok`` slots are as good as any.
    """

    ok: list[bool]
    pending: cf.Future | None = None
    late: bool = False  # an inline call that took longer than its timeout (counted as one)


class StoreGateway:
    """Timeouts, a circuit breaker and length checks around a ``KVStore`` (see module doc)."""

    def __init__(self, store: KVStore | None, metrics: Metrics, *, timeout_s: float = 2.0,
                 put_timeout_s: float = 30.0, backoff_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, max_calls: int = MAX_STORE_CALLS):
        self.store, self.metrics = store, metrics
        self.timeout_s, self.put_timeout_s = timeout_s, put_timeout_s
        self.backoff_s, self.clock = backoff_s, clock
        self._open_until = 0.0
        self.max_calls = max_calls
        self._pool = DaemonExecutor(max_calls, "kv-store")
        self._running = 0  # calls submitted and not yet ended (abandoned ones included)
        self._running_lock = threading.Lock()
        self.last_error = ""
        self._native_into = isinstance(store, ReadsInto)  # checked once: a Protocol isinstance is slow

    @property
    def available(self) -> bool:
        return self.store is not None and self.clock() >= self._open_until

    def _call(self, what: str, fn, *args, timeout: float | None = None, **kw):
        """``(ok, result)``; never raises for store trouble, never waits past the timeout."""
        ok, res, _ = self._run(what, fn, *args, timeout=timeout, **kw)
        return ok, res

    def _run(self, what: str, fn, *args, timeout: float | None = None, **kw):
        """``(ok, result, abandoned)``: as ``_call``, plus the future of a call given up at
        its timeout (it may still be running), else ``None``."""
        if self.store is None:
            return False, None, None
        if not self.available:
            self.metrics.inc("store_skipped")
            return False, None, None
        timeout = self.timeout_s if timeout is None else timeout
        fut = self._submit(fn, *args, **kw)
        if fut is None:
            self._trip(what, f"all {self.max_calls} store call threads are held by calls that have not "
                       "returned (abandoned at their timeout)", "store_busy")
            return False, None, None
        try:
            return True, fut.result(timeout=timeout), None
        except cf.CancelledError:  # the gateway was closed meanwhile: no store any more
            return False, None, None
        except cf.TimeoutError:
            self._trip(what, f"timed out after {timeout}s", "store_timeouts")
            return False, None, fut
        except CapacityExceeded as exc:
            self._refused(what, exc)
        except (KVStoreError, OSError) as exc:
            self._trip(what, f"{type(exc).__name__}: {exc}", "store_errors")
        except _StoreFault as exc:
            self._trip(what, str(exc), "store_errors", exc=exc.__cause__)
        return False, None, None

    def _submit(self, fn, *args, **kw) -> cf.Future | None:
        """``fn`` on a thread of its own at once, or ``None`` when ``max_calls`` calls are
        running: never queued behind calls that may never return (module docstring). The
        executor has ``max_calls`` workers, so with fewer calls running one is free (or is
        started): a call waits at most for a worker that just ended a call to take it."""
        with self._running_lock:
            if self._running >= self.max_calls:
                return None
            self._running += 1
        fut = self._pool.submit(fn, *args, **kw)
        fut.add_done_callback(self._ended)
        return fut

    def _ended(self, _fut: cf.Future) -> None:
        with self._running_lock:
            self._running -= 1

    @property
    def running_calls(self) -> int:
        """Store calls running now, abandoned ones included."""
        with self._running_lock:
            return self._running

    def _run_inline(self, what: str, fn, *args, **kw):
        """``(ok, result, late)``: ``fn`` on the calling thread, for a caller that would wait
        for it past any timeout anyway (no executor hop). A call slower than ``timeout_s`` is
        counted and trips the breaker like a timeout, but its result is returned."""
        if self.store is None:
            return False, None, False
        if not self.available:
            self.metrics.inc("store_skipped")
            return False, None, False
        t0 = time.monotonic()
        try:
            res = fn(*args, **kw)
        except CapacityExceeded as exc:
            self._refused(what, exc)
            return False, None, False
        except (KVStoreError, OSError) as exc:
            self._trip(what, f"{type(exc).__name__}: {exc}", "store_errors")
            return False, None, False
        except _StoreFault as exc:
            self._trip(what, str(exc), "store_errors", exc=exc.__cause__)
            return False, None, False
        took = time.monotonic() - t0
        if took > self.timeout_s:
            self._trip(what, f"took {took:.2f}s, over the {self.timeout_s}s timeout", "store_timeouts")
        return True, res, took > self.timeout_s

    def _refused(self, what: str, exc: CapacityExceeded) -> None:
        """A call the store answered by refusing it for want of room: counted, the breaker left
        closed (module docstring, 2)."""
        self.metrics.inc("store_refused")
        self.last_error = f"{what}: {type(exc).__name__}: {exc}"
        log.warning("kv store %s refused (%s); the store stays in use", what, exc)

    def _trip(self, what: str, reason: str, counter: str, exc: BaseException | None = None) -> None:
        """Count a failed call and open the breaker; ``exc``: an unexpected exception, logged
        with its traceback (a broken store is worth a stack, an outage is not)."""
        self.metrics.inc(counter)
        self._open_until = self.clock() + self.backoff_s
        self.last_error = f"{what}: {reason}"
        log.warning("kv store %s failed (%s); running without the store for %.1fs",
                    what, reason, self.backoff_s, exc_info=exc)

    def lookup(self, keys: Sequence[bytes]) -> LookupResult | None:
        if not keys:
            return LookupResult(0, None)
        if self.store is None:
            return None
        ok, res = self._call("lookup", _guarded(self.store.lookup), list(keys))
        if not ok:
            return None
        bad = _bad_lookup(res, len(keys))
        if bad:  # a store fault, never an exception in the engine's admit step
            self._trip("lookup", bad, "store_errors")
            return None
        return res

    def get_many(self, keys: Sequence[bytes], *, kind: str, nbytes: int) -> list[bytes | None]:
        """Payloads, ``None`` where missing/lost/corrupt/wrong-sized or the store failed."""
        if self.store is None:
            return [None] * len(keys)
        ok, res = self._call(f"get_many({kind})", _guarded(self.store.get_many), list(keys), kind=kind)
        if not ok:
            return [None] * len(keys)
        bad = _bad_slots(res, len(keys), native=False)
        if bad:
            self._trip(f"get_many({kind})", bad, "store_errors")
            return [None] * len(keys)
        out: list[bytes | None] = []
        for v in res:
            if v is None:
                self.metrics.inc("load_missing")
            elif len(v) != nbytes:
                self.metrics.inc("load_bad_size")
                log.warning("store entry of %d bytes where %d were expected; not used", len(v), nbytes)
                v = None
            out.append(v)
        return out

    def read_into(self, keys: Sequence[bytes], outs: Sequence[Any], *, kind: str,
                  nbytes: int, layout: Layout | None = None, inline: bool = False) -> IntoResult:
        """Verified payloads of exactly ``nbytes`` straight into ``outs`` (see ``IntoResult``).

        A slot is not ok where the entry is missing, lost, corrupt, of the wrong size, saved
        with another dtype or shape than ``layout`` (counted ``load_bad_size`` like a wrong
        size: an entry of the right byte count but another layout is not this KV), or the
        store failed; the contents of a buffer that is not ok are undefined. The layout is
        checked where the store reports it (``EntryInfo.layout``); a ``get_many``-only store,
        or the ``get_many`` fallback of ``_read_into``, reports none, so only the length is
        checked there (module docstring, point 3). ``inline``: a
        ``ReadsInto`` store is read on the calling thread and never abandoned (for a caller
        that must wait for any write into ``outs`` to end: ``loader``'s direct reads); a
        slow call is reported ``late``. A ``get_many``-only store is read as without it.
        """
        if self.store is None:
            return IntoResult([False] * len(keys))
        if not self._native_into:
            # get_many under the timeout, the copy here: a late reply then writes nothing.
            good = []
            for data, out in zip(self.get_many(keys, kind=kind, nbytes=nbytes), outs):
                if data is not None:
                    writable_view(out)[:nbytes] = memoryview(data).cast("B")
                good.append(data is not None)
            return IntoResult(good)
        abandoned, late = None, False
        if inline:
            ok, res, late = self._run_inline(f"read_into({kind})", self._read_into, keys, outs, kind, nbytes)
        else:
            ok, res, abandoned = self._run(f"read_into({kind})", self._read_into, list(keys), list(outs),
                                           kind, nbytes)
        if not ok:
            return IntoResult([False] * len(keys), abandoned)
        bad = _bad_slots(res, len(keys), native=True)
        if bad:
            self._trip(f"read_into({kind})", bad, "store_errors")
            return IntoResult([False] * len(keys), late=late)
        good = []
        for info in res:
            ok = False
            if info is None:
                self.metrics.inc("load_missing")
            elif info.nbytes != nbytes:
                self.metrics.inc("load_bad_size")
                log.warning("store entry of %d bytes where %d were expected; not used", info.nbytes, nbytes)
            elif not _layout_matches(info.layout, layout):
                self.metrics.inc("load_bad_size")
                log.warning("store %s entry saved as %s%s where %s%s was expected; not used", kind,
                            info.layout.dtype, list(info.layout.shape), layout.dtype, list(layout.shape))
            else:
                ok = True
            good.append(ok)
        return IntoResult(good, late=late)

    def _read_into(self, keys: list[bytes], outs: list[Any], kind: str, nbytes: int) -> list[EntryInfo | None]:
        """For a ``ReadsInto`` store, on the gateway's executor (so the timeout covers it) or
        inline. An entry larger than its buffer makes the store refuse the whole batch (caller
        misuse there); here it is one wrong-sized entry, so the batch is read again with
        ``get_many`` and that entry is left out, as ``get_many`` callers always had it."""
        try:
            return _guarded(self.store.get_many_into)(keys, outs, kind=kind)
        except InvalidRequest:
            datas = _guarded(self.store.get_many)(keys, kind=kind)  # a bad key raises again: a real error
        bad = _bad_slots(datas, len(keys), native=False)
        if bad:
            raise _StoreFault(f"get_many: {bad}")
        k = EntryKind.parse(kind)
        infos: list[EntryInfo | None] = []
        for key, data, out in zip(keys, datas, outs):
            if data is not None and len(data) == nbytes:
                writable_view(out)[:nbytes] = memoryview(data).cast("B")
            infos.append(None if data is None else EntryInfo(key, k, len(data)))
        return infos

    def put_many(self, items: Sequence[PutItem]) -> bool:
        if self.store is None:
            return False
        # puts run on the background saver: a longer timeout stalls nobody, and a big batch
        # of fsync'ed erasure-coded writes legitimately takes seconds on a busy disk
        ok, _ = self._call("put_many", _guarded(self.store.put_many), list(items), timeout=self.put_timeout_s)
        return ok

    def close(self) -> None:
        self._pool.shutdown(wait=False)
