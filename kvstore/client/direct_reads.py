"""Direct reads: the client reads and verifies an entry's fragments itself; the daemon says where.

Who calls it: ``kvstore.client.remote.RemoteStore`` (so also every shard of a
``ShardedStore``) when opened with ``kvstore.connect("grpc://H:P", direct_reads="on")``
or ``"auto"``; the daemon (``kvstore.server.service``) calls ``client_url`` for its
``Describe`` answer. Puts may be direct too (``kvstore.client.direct_writes``); deletes, lookups
and maintenance stay on gRPC.

Why: over gRPC every payload byte crosses protobuf and one loopback socket, a cost the
embedded store reading the same fragment files does not pay (``tools/bench_store.py
--remote`` measures both). Where the KV cache lives on a distributed file
system that every engine host mounts (or on S3), the bytes do not need the daemon:
it stays the metadata service (index, placement, LRU, TTL, tenants, GC, repair) and
the client reads the files, as the serving stack of V4.1 does.

Read steps (``DirectReads.get_many``), in order, each for its reason:
  1. Once per client, on the first read: ``Describe`` -> the daemon's target table
     (name -> URL, failure domain), erasure code and read knobs. A ``DirectReader``
     opens the same fsspec targets. Mode "auto" decides here whether to use them.
  2. Per batch: one ``Locate`` RPC -> per key ``found`` and the index record (k, m,
     sizes, generation, fragment targets) under the tenant's stored key. The daemon
     refreshes access times then, as a get does (a located entry is a used one), and
     counts the hit or miss. A key it does not find is answered here, with no other call.
  3. Per found key: ``kvstore.embedded.fragment_reads.FragmentReader.read_verified``, the embedded
     store's own read path: read the data fragments, check each fragment's checksum
     and header against the record, decode, check the entry checksum (in the caller's
     buffer for ``get_many_into``). Bytes that fail a check are never returned.
  4. Any failure in 3 -- one missing or corrupt fragment (a degraded read), a target
     that cannot be reached, fewer than k good fragments -- is not handled here: those
     keys go to the daemon's ``GetStream`` (``Get`` for one key) in one batch, whose
     read path counts the degraded read, marks the entry lost or raises
     ``Unrecoverable``. The direct reader never marks lost, repairs or writes, so the
     daemon's state stays the only truth.

Guarantees: the results and errors of the gRPC path (``kvstore.api``): the same bytes,
``NotFound`` for an absent key (a single ``get`` that Locate finds nothing for asks the
daemon's ``Get``, which also says ``Unrecoverable`` for a lost one), ``None`` slots in
batches. A record that goes stale
between Locate and the read (the entry deleted, evicted or re-put) finds its files gone
(step 4) or, within ``delete_grace_s``, still whole and verified against its own
generation; either way no unverified byte is returned.

Modes (``ClientOptions.direct_reads``; environment ``KVSTORE_DIRECT_READS``):

  ======  =====================================================================
  off     the default: every read over gRPC.
  on      direct reads whenever the daemon allows them (its Describe says so);
          if its targets cannot be opened here, off with a warning (reads stay
          correct over gRPC). For S3 and other object stores the client brings
          its own credentials (environment, instance role): Describe strips any
          ``user:password@`` from target URLs.
  auto    on only when (a) the daemon does not require tokens, (b) every target
          is a local path (a DFS mount included) whose root is a directory here,
          and (c) ``<data_dir>/kvstore.json``, the daemon's data-dir marker,
          reads here byte for byte as the daemon reports it: the client sees the
          daemon's own files. Anything else (S3 included) stays off; use "on".
  ======  =====================================================================

Security. A direct read needs the client to be trusted with read access to the
targets' files: all of them, every tenant's entries, the trust a DFS mount already
implies. What a tenant can *find* is still decided by the daemon: Locate translates
keys exactly as Get does (``kvstore.auth``), so a tenant locates only its own
entries; but nothing stops a client with file access from reading other files.
Deployments with untrusted tenants leave direct reads off, and may set the daemon's
``allow_direct_reads = false`` (Locate is then PERMISSION_DENIED and Describe lists no
targets). For the same reason "auto" never turns on against a daemon that requires
tokens; only an explicit "on" does.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from kvstore.embedded import codec
from kvstore.api import Entry, EntryInfo, EntryKind
from kvstore.config import StoreConfig, TargetSpec
from kvstore.errors import InternalError, InvalidRequest, KVStoreError, StoreClosed, StoreUnavailable
from kvstore.executors import DaemonExecutor, shutdown_all
from kvstore.embedded.datadir import FORMAT_FILE
from kvstore.embedded.fragment_reads import FragmentReader
from kvstore.embedded.index import Meta
from kvstore.keys import KEY_LEN
from kvstore.proto import kvstore_pb2 as pb
from kvstore.embedded.targets import Target, TargetPools, open_target
from kvstore.embedded.tuning import tune_malloc

log = logging.getLogger(__name__)

MODES = ("off", "on", "auto")
LOCAL_SCHEMES = ("", "file", "local")
REDESCRIBE_S = 10.0  # at most one Describe per this many seconds after a record names an unknown target
CLOSE_JOIN_S = 1.0  # close() waits this long for reads still running (a frozen target's are abandoned)


def parse_mode(value: Any, option: str = "direct_reads") -> str:
    """A ``direct_reads`` (or ``direct_writes``) option as one of ``MODES`` (bools and the usual
    spellings accepted)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    v = str(value).strip().lower()
    v = {"1": "on", "true": "on", "yes": "on", "0": "off", "false": "off", "no": "off", "": "off"}.get(v, v)
    if v not in MODES:
        raise InvalidRequest(f"{option} must be one of {list(MODES)} (or a bool), got {value!r}")
    return v


# ----------------------------------------------------------------------------- the daemon's half
def client_url(spec: TargetSpec, target: Target | None) -> str:
    """The URL a client should open for ``spec``: a local root as an absolute ``file://``
    path (the daemon's relative paths mean nothing elsewhere), anything else without the
    ``user:password@`` part (a client uses its own credentials)."""
    if target is not None and target.local:
        return f"file://{target.root}"
    return spec.shown_url


# ----------------------------------------------------------------------------- the client's half
def _local_root(url: str) -> str | None:
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    return rest if scheme in LOCAL_SCHEMES else None


def auto_decision(d: pb.DescribeReply) -> str:
    """Why mode "auto" stays off against this daemon ("" when it may turn on); see the module docstring."""
    if not d.direct_reads:
        return "the daemon does not serve direct reads (allow_direct_reads = false)"
    if d.auth:
        return ("the daemon requires tokens: 'auto' never reads tenants' files directly "
                "(direct_reads='on' if this client may read every tenant's files)")
    if not d.targets:
        return "the daemon reported no targets"
    for t in d.targets:
        root = _local_root(t.url)
        if root is None:
            return f"target {t.name} ({t.url.split('://', 1)[0]}://) is not a local path; use direct_reads='on'"
        if not os.path.isdir(root):
            return f"target {t.name}: {root} is not a directory on this host"
    marker = Path(d.data_dir) / FORMAT_FILE
    try:
        here = marker.read_bytes()
    except OSError as exc:
        return f"the daemon's data-dir marker {marker} is not readable here ({exc.strerror or exc})"
    if not d.format_marker or here != d.format_marker:
        return f"{marker} here is not the daemon's (another store at the same path)"
    return ""


@dataclass(frozen=True, slots=True)
class Located:
    """A found entry: its stored entry key (kind code || stored key) and the index record to
    read it with; ``meta`` is ``None`` for a record this client cannot use (read via the daemon)."""

    ek: bytes
    meta: Meta | None


class DirectReader:
    """A read-only worker over the daemon's targets (steps 1 and 3): the embedded store's own
    read half (``kvstore.embedded.fragment_reads.FragmentReader``) built over them.

    Invariants, each for its reason:
      1. It never writes, deletes, marks lost or repairs: it has no write half, and the
         reader's ``mark_lost`` only counts. The daemon owns every state change.
      2. ``read`` returns a payload only from a clean read: any failure, and any read
         that needed parity (degraded), returns ``None``, meaning "ask the daemon", so
         the daemon's degraded and lost accounting sees every damaged entry.
      3. No fragment read is retried here (``fragment_read_retries = 0``): a failed read
         is cheaper to hand to the daemon, which retries with its own policy.
    """

    def __init__(self, d: pb.DescribeReply, *, workers: int = 8):
        specs = tuple(TargetSpec(t.url, t.domain or "default", t.name) for t in d.targets)
        self.config = StoreConfig(
            data_dir=d.data_dir or ".", ec_k=d.ec_k, ec_m=d.ec_m, ec_type=d.ec_type, targets=specs,
            max_value_bytes=d.max_value_bytes or StoreConfig.max_value_bytes,
            read_timeout_s=d.read_timeout_s, parallel_reads=d.parallel_reads or "auto",
            fragment_read_retries=0, read_workers=workers)
        self.targets: dict[str, Target] = {s.name: open_target(s) for s in specs}
        codec.erasure_code(d.ec_k, d.ec_m, d.ec_type)  # an unknown code is refused here, as the daemon would
        self._pool = DaemonExecutor(workers, "kvstore-direct-io")
        self._batch_pool = DaemonExecutor(workers, "kvstore-direct")
        self._pools = TargetPools(workers)
        self._flags = threading.local()  # per read: did the read path report a degraded read?
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {
            "direct_reads": 0, "direct_bytes": 0, "fallbacks": 0, "degraded_reads": 0, "unrecoverable": 0,
            "read_retries": 0, "read_timeouts": 0}
        self.reader = FragmentReader(self.config, self.targets, self._pools, self._pool, count=self.count,
                                     mark_lost=self._lost)
        if self.config.tune_malloc:
            tune_malloc()  # as the embedded store does: read buffers of 128 KiB+ without a fresh mmap each

    def count(self, name: str, n: int = 1) -> None:
        if name == "degraded_reads":
            self._flags.degraded = True  # invariant 2: this read goes to the daemon
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def _lost(self, ek: bytes, meta: Meta) -> None:
        self.count("unrecoverable")  # invariant 1: only the daemon marks entries lost

    # reads ------------------------------------------------------------------------------
    def read(self, loc: Located, out: memoryview | None = None) -> tuple[codec.EntryHeader, Any] | None:
        """The verified header and payload of ``loc`` (in ``out`` when given), or ``None``:
        read it through the daemon (invariant 2)."""
        if loc.meta is None:
            self.count("fallbacks")
            return None
        self._flags.degraded = False
        try:
            h, plain = self.reader.read_verified(loc.ek, loc.meta, out)
        except (KVStoreError, OSError) as exc:
            log.info("direct read of %s failed, reading through the daemon: %s", loc.ek[1:].hex(), exc)
            self.count("fallbacks")
            return None
        if self._flags.degraded:
            log.info("direct read of %s was degraded, reading through the daemon", loc.ek[1:].hex())
            self.count("fallbacks")
            return None
        self.count("direct_reads")
        self.count("direct_bytes", h.plain_len)
        return h, plain

    def read_many(self, locs: Sequence[Located], outs: Sequence[memoryview | None]) -> list:
        """``read`` for each; fanned out over threads only when some target is not local
        (page-cache reads of local files are faster on one thread, as in the embedded store)."""
        remote = any(not self.targets[t].local for loc in locs if loc.meta is not None
                     for t in loc.meta.targets[: loc.meta.k] if t in self.targets)
        if len(locs) < 2 or not remote:
            return [self.read(loc, out) for loc, out in zip(locs, outs)]
        return list(self._batch_pool.map(self.read, locs, outs))

    def close(self) -> None:
        # Bounded: a read stuck on a frozen target holds its thread for the target's own timeout.
        shutdown_all([self._batch_pool, self._pool, *self._pools.all()], wait=True, timeout_s=CLOSE_JOIN_S)
        self.reader.close()  # its kept pack descriptors (a read still in flight closes its own)


def check_into_sizes(keys: Sequence[bytes], sizes: Sequence[int | None], views: Sequence[memoryview],
                     kind: EntryKind, labels: Sequence[int] | None = None) -> None:
    """The embedded store's ``InvalidRequest`` (``EmbeddedStore.get_many_into``) for the first
    ``i`` whose entry (plain size ``sizes[i]``; ``None``: absent) does not fit ``views[i]``;
    the message names ``outs[labels[i]]`` (default ``outs[i]``), the caller's numbering."""
    for i, n in enumerate(sizes):
        if n is not None and n > len(views[i]):
            raise InvalidRequest(
                f"outs[{i if labels is None else labels[i]}] holds {len(views[i])} bytes but the {kind.value} "
                f"entry {bytes(keys[i]).hex()} has {n}; size the buffers from the entry layout")


def copy_into(keys: Sequence[bytes], datas: Sequence[bytes | None], views: Sequence[memoryview],
              kind: EntryKind, positions: Sequence[int],
              labels: Sequence[int] | None = None) -> dict[int, EntryInfo | None]:
    """Copy ``datas[j]`` (a verified payload from ``get_many``) into ``views[positions[j]]``,
    as ``kvstore.api.read_into``'s fallback does; {position: EntryInfo or None}. Every size
    is checked (``check_into_sizes``, ``labels`` as there) before anything is copied."""
    positions = list(positions)
    check_into_sizes([keys[i] for i in positions], [None if d is None else len(d) for d in datas],
                     [views[i] for i in positions], kind, [i if labels is None else labels[i] for i in positions])
    out: dict[int, EntryInfo | None] = {}
    for i, data in zip(positions, datas):
        if data is None:
            out[i] = None
            continue
        n = len(data)
        views[i][:n] = memoryview(data).cast("B")
        out[i] = EntryInfo(bytes(keys[i]), kind, n)
    return out


@dataclass(slots=True)
class StagedInto:
    """The first half of one ``get_many_into`` piece (``RemoteStore.stage_into``), before any
    buffer is written: ``sizes[i]``, key ``i``'s plain size to check its buffer against
    (``None``: no live entry); ``fetched``, {i: payload or None} already read through the
    daemon (to copy); ``reader`` and ``locs``, the located entries still to read directly
    (``None``: read nothing directly)."""

    sizes: list[int | None]
    fetched: dict[int, bytes | None]
    reader: DirectReader | None = None
    locs: list[Located | None] | None = None


GetMany = Callable[[list[bytes], EntryKind], list]  # the gRPC batched get of the client


class DirectPath:
    """What the direct-read and direct-write paths of one client share (``DirectReads`` here,
    ``kvstore.client.direct_writes.DirectWrites``): the mode, the worker over the daemon's targets
    (``_current``: a reader or writer, ``None`` while off or not described yet), the ones it
    replaced (``_retired``: other threads may still use them, so they close last), turning
    off with a reason, and counters summed over all of them."""

    option = "direct_reads"

    def __init__(self, mode: str, url: str):
        self.mode = parse_mode(mode, self.option)
        self.url = url
        self._lock = threading.RLock()  # set-up and turning off; the hot path never takes it once on
        self._current: Any = None
        self._retired: list[Any] = []
        self._off = self.mode == "off"
        self.reason = f"{self.option}='off'" if self._off else "not described yet"

    def _turn_off(self, why: str, *, warn: bool = False) -> None:
        with self._lock:
            if self._current is not None:  # other threads may still be using it: close it last
                self._retired.append(self._current)
            self._off, self.reason, self._current = True, why, None
        (log.warning if warn else log.info)("%s off for %s: %s", self.option.replace("_", " "), self.url, why)
        return None

    def _all(self) -> list[Any]:
        return [*self._retired, *([self._current] if self._current is not None else [])]

    def stats(self) -> dict:
        """Mode, whether the path is active (and why not), and this client's counters."""
        total: dict[str, int] = {}
        for w in self._all():
            for k, v in w.counters.items():
                total[k] = total.get(k, 0) + v
        return {"mode": self.mode, "active": self._current is not None and not self._off,
                "reason": self.reason, "counters": total}

    def close(self) -> None:
        with self._lock:
            workers = self._all()
            for w in workers:
                w.close()
            self._retired, self._current, self._off = workers, None, True  # counters stay readable
            self.reason = "closed"


class DirectReads(DirectPath):
    """The direct-read path of one ``RemoteStore``: mode, Describe once, Locate, read, fall back.

    ``call(method, request)`` is the client's unary call (typed errors, its token and
    deadline). Every public method returns ``None`` when direct reads are not usable right
    now (off, not yet described because the daemon is unreachable, or the daemon stopped
    allowing them): the caller then reads over gRPC as without this object.
    """

    def __init__(self, mode: str, call: Callable[[str, Any], Any], url: str):
        super().__init__(mode, url)
        self._call = call
        self._stale = False
        self._described_at = 0.0

    # set-up (step 1) ------------------------------------------------------------------
    def reader(self) -> DirectReader | None:
        r = self._current
        if r is not None and not self._stale:
            return r
        if self._off:
            return None
        with self._lock:
            if self._off:
                return None  # another thread's Describe turned them off
            if self._current is not None and (not self._stale or time.monotonic() - self._described_at < REDESCRIBE_S):
                return self._current
            return self._describe()

    def _describe(self) -> DirectReader | None:
        try:
            d = self._call("Describe", pb.DescribeRequest())
        except StoreUnavailable:
            return self._current  # unreachable or busy: try again on the next read
        except StoreClosed:
            raise  # this client was closed meanwhile: nothing to decide about the daemon
        except KVStoreError as exc:  # Describe refused (UNIMPLEMENTED, PERMISSION_DENIED, ...)
            return self._turn_off(f"Describe failed: {exc}")
        self._described_at = time.monotonic()
        self._stale = False
        why = auto_decision(d) if self.mode == "auto" else (
            "" if d.direct_reads else "the daemon does not serve direct reads (allow_direct_reads = false)")
        if why:
            return self._turn_off(why, warn=self.mode == "on")
        try:
            new = DirectReader(d)
        except (KVStoreError, ImportError, OSError, ValueError) as exc:
            return self._turn_off(f"cannot open the daemon's targets here: {exc}", warn=True)
        if self._current is not None:
            self._retired.append(self._current)
        self._current = new
        self.reason = ""
        log.info("direct reads on for %s (%d targets)", self.url, len(new.targets))
        return new

    # Locate (step 2) --------------------------------------------------------------------
    def locate(self, keys: Sequence[bytes], kind: EntryKind, r: DirectReader) -> list[Located | None] | None:
        """Per key: ``None`` (no live entry) or a ``Located``; ``None`` overall: use gRPC."""
        try:
            reply = self._call("Locate", pb.LocateRequest(keys=keys, kind=kind.value))
        except KVStoreError as exc:
            if exc.code != "PERMISSION_DENIED":  # kvstore.wire.PermissionDenied
                raise  # what a Get would raise too (unreachable, busy, bad key, ...)
            return self._turn_off(f"Locate refused: {exc}", warn=True)  # the daemon stopped allowing them
        if len(reply.locations) != len(keys):
            raise InternalError(f"Locate answered {len(reply.locations)} records for {len(keys)} keys (a kvstore bug)")
        out: list[Located | None] = []
        prefix, kv = bytes((kind.code,)), kind.value
        for loc in reply.locations:  # the hot loop of every batch: attribute reads only
            if not loc.found:
                out.append(None)
                continue
            skey, gen, k, m = loc.stored_key, loc.gen, loc.k, loc.m
            targets, offsets = tuple(loc.targets), tuple(loc.offsets)
            if (len(skey) != KEY_LEN or len(gen) != 8 or k < 1 or len(targets) != k + m or loc.kind != kv
                    or not loc.frag_len or len(offsets) not in (0, k + m)):
                log.warning("Locate sent an unusable record for %s; reading it through the daemon", skey.hex())
                out.append(Located(prefix + skey, None))
                continue
            out.append(Located(prefix + skey, Meta(k, m, loc.tokens, loc.plain_len, loc.entry_len, loc.frag_len,
                                                   0, 0, 0, gen, targets, offsets=offsets)))
        return out

    def _retried(self, r: DirectReader, loc: Located) -> None:
        """A located entry read through the daemon: if its record names a target this client
        has not heard of (the daemon's table changed), Describe again (rate-limited)."""
        if loc.meta is not None and any(t not in r.targets for t in loc.meta.targets):
            self._stale = True

    # the reads the client exposes (steps 2-4) -------------------------------------------
    def get_entry(self, key: bytes, kind: EntryKind) -> Entry | None:
        r = self.reader()
        locs = self.locate([key], kind, r) if r is not None else None
        if locs is None:
            return None
        if locs[0] is None:  # absent, expired or lost: the caller's Get says which, as the daemon
            return None      # (a lost entry is Unrecoverable there on every read, not NotFound)
        got = r.read(locs[0])
        if got is None:
            self._retried(r, locs[0])
            return None  # the caller's Get: the daemon's read path decides
        h, plain = got
        return Entry(key, kind, h.layout, h.tokens, bytes(plain))

    def _read_located(self, r: DirectReader, locs: list, views: list[memoryview] | None) -> tuple[list, list[int]]:
        """Read every located entry (into ``views[i]`` when given): ([(i, (header, payload))] of
        those read and verified, [i] of those to retry through the daemon)."""
        found = [i for i, loc in enumerate(locs) if loc is not None]
        got = r.read_many([locs[i] for i in found], [None] * len(found) if views is None else [views[i] for i in found])
        read, retry = [], []
        for i, g in zip(found, got):
            if g is None:
                retry.append(i)
                self._retried(r, locs[i])
            else:
                read.append((i, g))
        return read, retry

    def get_many(self, keys: list[bytes], kind: EntryKind, fallback: GetMany) -> list[bytes | None] | None:
        r = self.reader()
        locs = self.locate(keys, kind, r) if r is not None else None
        if locs is None:
            return None
        read, retry = self._read_located(r, locs, None)
        out: list[bytes | None] = [None] * len(keys)
        for i, (_, plain) in read:
            out[i] = bytes(plain)
        if retry:
            for i, v in zip(retry, fallback([keys[i] for i in retry], kind)):
                out[i] = v
        return out

    def stage_into(self, keys: list[bytes], kind: EntryKind, fallback: GetMany) -> StagedInto | None:
        """``get_many_into``'s first half, nothing written: Locate (step 2) gives every entry's
        plain size, so the caller checks every buffer before anything is read (``kvstore.api``);
        a record this client cannot use is read through the daemon now, for its size. ``None``:
        direct reads are not usable now (read over gRPC)."""
        r = self.reader()
        locs = self.locate(keys, kind, r) if r is not None else None
        if locs is None:
            return None
        unusable = [i for i, loc in enumerate(locs) if loc is not None and loc.meta is None]
        fetched: dict[int, bytes | None] = {}
        if unusable:
            r.count("fallbacks", len(unusable))
            fetched = dict(zip(unusable, fallback([keys[i] for i in unusable], kind)))
        sizes: list[int | None] = []
        for i, loc in enumerate(locs):
            if i in fetched:
                sizes.append(None if fetched[i] is None else len(fetched[i]))
            else:
                sizes.append(None if loc is None else loc.meta.plain_len)
        return StagedInto(sizes, fetched, r, [None if i in fetched else loc for i, loc in enumerate(locs)])

    def finish_into(self, st: StagedInto, keys: list[bytes], views: list[memoryview], kind: EntryKind,
                    fallback: GetMany, labels: Sequence[int]) -> list[EntryInfo | None]:
        """``get_many_into``'s second half, once the caller checked every buffer against
        ``st.sizes``: read the located entries into ``views`` (steps 3-4), copy those read
        through the daemon (``copy_into``; ``labels`` name the buffers in its errors)."""
        read, retry = self._read_located(st.reader, st.locs, views)
        out: list[EntryInfo | None] = [None] * len(keys)
        for i, (h, _) in read:
            out[i] = EntryInfo(keys[i], kind, h.plain_len, h.layout, h.tokens)
        if retry:
            st.fetched.update(zip(retry, fallback([keys[i] for i in retry], kind)))
        if st.fetched:
            for i, info in copy_into(keys, list(st.fetched.values()), views, kind, list(st.fetched), labels).items():
                out[i] = info
        return out
