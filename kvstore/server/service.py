"""The daemon: the ``kvstore.v1.KVStore`` gRPC service over one embedded store.

Who calls it: ``kvstore serve`` (``kvstore.server.cli``) and tests, as
``Daemon(server_cfg, store_cfg).start()`` ... ``stop()``.

Per call, in this order (each step for its reason):
  1. Authenticate the bearer token (before parsing: an anonymous caller gets no
     parser work done for it) and check admin-only methods.
  2. Parse the raw request bytes ourselves (``request_deserializer=None``), so a
     malformed message, bad UTF-8 included, is INVALID_ARGUMENT, not gRPC's
     generic "exception deserializing request".
  3. Admit the call through the ``Limiter`` (RESOURCE_EXHAUSTED when full). This runs on a
     handler thread, so ``max_concurrent_requests < workers`` (checked) keeps threads free to
     answer refusals and health checks while admitted calls (a stalled stream) hold theirs.
  4. Validate client keys (16 bytes) *before* mapping them to the tenant's
     stored keys, then call the store. The store validates everything else
     before writing anything, so a bad batch stores nothing.
  5. A ``KVStoreError`` becomes a status + trailing metadata (``wire``); any
     other exception is a bug: INTERNAL, logged with its traceback.

A batch over ``max_batch_items`` is refused (``_batch``: ``wire.BatchTooLarge``, the
limit in the trailing metadata) before any store work, so a client that does not know
the limit learns it from the refusal and resends the batch in pieces (``kvstore.client.remote``).

The two streaming batch forms take the same steps: ``GetStream`` validates
every key first, then reads the keys a window (``GET_STREAM_WINDOW``) at a
time and sends the values in ``GetChunk`` messages (its admission slot held
until the stream ends; cut when nothing can be sent for ``stream_send_s``,
``Watchdog``); ``PutStream`` is admitted, then receives and parses every
item (bounded by ``max_batch_items``, in total bytes by ``max_message_bytes``, and in
time by ``stream_receive_s``), then stores them with one ``put_many`` exactly as PutMany does; a
stream short of the item count its client declared (``wire.MD_STREAM_ITEMS``) stores nothing.
Why streaming: one 16 MiB reply cost ~35 ms of protobuf building and
serializing plus ~28 ms in gRPC (one message, many slices) against ~10 ms for
16 streamed 1 MiB messages (tools/bench_remote.py; profile in its docstring).
Values are hand-encoded (``wire.encode_*``): one copy each instead of two.

The data calls' handlers (put, get, delete, pin, lookup, probe): ``kvstore.server.data_rpc``.
Direct reads and writes (``Describe``, ``Locate``, ``Commit``): ``kvstore.server.direct_rpc``.

Maintenance and inspection (``Stats``, ``Gc``, ``Check``, ``Repair``, ``Inspect``,
``Maintain``: those three with progress, and ``ExportIndex``: the index rows of ``kvtool
inspect --parquet``; the last two streamed as ``GetStream`` is):
``kvstore.server.admin_rpc``. ``Inspect`` answers ``kvtool inspect`` with the read-only
index views of ``kvstore.index_view``, the code the tool runs on a data directory, so
both print the same records; it touches nothing (no access time, no store counter).

Background GC runs in its own thread every ``gc_interval_s`` (a round is skipped while an
admin's gc, check or repair pass runs; those run one at a time); the store's GC works in
bounded index transactions, so requests are not stalled behind it.
``stop()`` drains: health goes NOT_SERVING, gRPC stops accepting calls and
gives in-flight ones ``drain_s`` to finish, GC stops, then the store closes.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Generator, Iterator

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.api import EntryKind, PutItem
from kvstore.config import StoreConfig
from kvstore.executors import DaemonExecutor
from kvstore.errors import CapacityExceeded, InternalError, InvalidRequest, KVStoreError, StoreUnavailable
from kvstore.config import MAX_TTL_S
from kvstore.embedded.index import ekey
from kvstore.keys import check_key, check_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.auth import Limiter, Tenant, TokenTable, load_server_secret, require_admin
from kvstore.server.config import ServerConfig, port_taken
from kvstore.server.admin_rpc import AdminRPC
from kvstore.server.data_rpc import DataRPC
from kvstore.server.direct_rpc import DirectRPC
from kvstore.server.metrics import DaemonMetrics
from kvstore.server.quota import TenantQuota
from kvstore.server.watchdog import Watchdog
from kvstore.tls import server_credentials_from_pem
from kvstore.wire import (INDEX_KEY_METHODS, MD_INDEX_KEYS, MD_STREAM_ITEMS, BatchTooLarge, RequestTooLarge,
                                 details_of, kind_or_default, layout_from_pb, status_of)

log = logging.getLogger(__name__)

SERVICE = "kvstore.v1.KVStore"
STOP_EXTRA_S = 5.0  # ``Daemon.stop`` ends within this long after the drain grace


def host_port(host: str, port: int) -> str:
    """``host:port``, a bare IPv6 address (``::1``) in brackets, as gRPC and URLs spell it."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _cut(context: grpc.ServicerContext, why: str) -> Callable[[], None]:
    """A stream bound's action (``Watchdog.arm``): say why, then cancel the call."""
    def fire() -> None:
        log.warning("%s: cancelling the call from %s", why, context.peer())
        context.cancel()
    return fire


def _serialize(msg: Any) -> bytes:
    """Reply serializer: hand-encoded replies (``wire.encode_*``) are bytes already."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


def _as_seen_by(tenant: Tenant, write: Callable[[], list[bool]]) -> list[bool]:
    """``write()``, a put or commit for ``tenant``. A tenant that is not an admin gets its
    capacity and storage errors without what they tell of the store as a whole: the bytes
    every tenant holds, that the rest is pinned, target names, paths (an admin's to see, as
    in ``_get``; QA). The error class, which says what to do, stays."""
    try:
        return write()
    except CapacityExceeded:
        if tenant.admin:
            raise
        raise CapacityExceeded("the store is full (what it holds cannot be evicted now, or its targets are out "
                               "of space); retry later, or ask its operator") from None
    except StoreUnavailable:
        if tenant.admin:
            raise
        raise StoreUnavailable("the store cannot take this write now: too many of its targets are failing or "
                               "too slow; retry later") from None


class _ClientGone(Exception):
    """A request stream that ended short: fewer items than its client declared, or a cancelled call."""


@dataclass(frozen=True, slots=True)
class _Method:
    request: type
    handler: Callable[[Any, Tenant], Any]
    admin: bool = False


class Daemon(DataRPC, DirectRPC, AdminRPC):
    """One daemon: a gRPC server, its store, metrics and the GC thread. Thread-safe.

    The daemon owns its store (one passed as ``store`` too): ``stop()`` closes it, and so
    does a start that fails (``__init__`` or ``start`` raising ``InvalidRequest``: port or
    metrics port in use, bad host, TLS key not matching its certificate), which leaves
    nothing open or listening behind.
    """

    def __init__(self, server_cfg: ServerConfig, store_cfg: StoreConfig, *, store: Any = None):
        from kvstore.embedded.store import EmbeddedStore

        self.cfg = server_cfg
        tls_files = server_cfg.read_tls_files()  # before opening anything: a bad setup fails fast
        if store is None:
            try:
                store = EmbeddedStore(store_cfg)
            except OSError as exc:  # a data_dir that is a file, under /proc, not writable, ...
                raise InvalidRequest(f"cannot open the store in data_dir {store_cfg.data_dir!r}: {exc}; "
                                     "give a directory this process can create and write") from exc
        self.store = store
        self.quota: TenantQuota | None = None
        self._pool: DaemonExecutor | None = None
        self._read_pool: DaemonExecutor | None = None
        self._watchdog: Watchdog | None = None  # started by start(): the streams' time bounds
        self.server: grpc.Server | None = None
        try:
            self._build(server_cfg, store_cfg, tls_files)
        except BaseException as exc:
            # Nothing was started yet: close what was opened (the store and quota hold LMDB
            # environments and their locks), so a refused start leaves nothing behind.
            self._release()
            if isinstance(exc, OSError):
                raise InvalidRequest(f"cannot start the daemon: {exc}") from exc
            raise
        self._stop_gc = threading.Event()
        self._gc_thread: threading.Thread | None = None
        self._stopped, self._stop_lock, self._stop_done = False, threading.Lock(), threading.Event()
        self._maintain_slot = threading.Semaphore(1)  # one admin pass at a time (AdminRPC._take_pass_slot)
        self._pass_running = threading.Event()  # set while an admin pass holds the slot: what background GC reads

    def _build(self, server_cfg: ServerConfig, store_cfg: StoreConfig, tls_files: dict[str, bytes]) -> None:
        """The rest of ``__init__`` once the store is open: quota, tokens, the gRPC server,
        bound to its port (``InvalidRequest`` when it cannot be). Starts nothing."""
        if server_cfg.tenant_quota_bytes:
            self.quota = TenantQuota(Path(store_cfg.data_dir) / "server" / "quota", server_cfg.tenant_quota_bytes,
                                     self.store, sync=store_cfg.fsync)
        self.tokens = TokenTable()
        if server_cfg.tokens_file:
            secret_path = Path(server_cfg.tenant_secret_file or Path(store_cfg.data_dir) / "server" / "tenant.secret")
            self.tokens = TokenTable.load(server_cfg.tokens_file, load_server_secret(secret_path))
        self.limiter = Limiter(server_cfg.max_concurrent_requests, server_cfg.max_concurrent_per_tenant)
        self.metrics = DaemonMetrics(self.store)
        self.methods: dict[str, _Method] = {
            "Put": _Method(pb.PutRequest, self._put),
            "PutMany": _Method(pb.PutManyRequest, self._put_many),
            "Get": _Method(pb.KeyRequest, self._get),
            "GetMany": _Method(pb.GetManyRequest, self._get_many),
            "Delete": _Method(pb.KeyRequest, self._one("delete")),
            "DeleteMany": _Method(pb.KeysRequest, self._many("delete")),
            "Pin": _Method(pb.KeyRequest, self._one("pin")),
            "PinMany": _Method(pb.KeysRequest, self._many("pin")),
            "Unpin": _Method(pb.KeyRequest, self._one("unpin")),
            "UnpinMany": _Method(pb.KeysRequest, self._many("unpin")),
            "Lookup": _Method(pb.LookupRequest, self._lookup),
            "LookupMany": _Method(pb.LookupManyRequest, self._lookup_many),
            "Probe": _Method(pb.ProbeRequest, self._probe),
            "Describe": _Method(pb.DescribeRequest, self._describe),
            "Locate": _Method(pb.LocateRequest, self._locate),
            "Commit": _Method(pb.CommitRequest, self._commit),
            "Stats": _Method(pb.StatsRequest, self._stats, admin=True),
            "Gc": _Method(pb.GcRequest, self._gc, admin=True),
            "Check": _Method(pb.CheckRequest, self._check, admin=True),
            "Repair": _Method(pb.RepairRequest, self._repair, admin=True),
            # Admin-only for the summary; per-key views are any tenant's, in its namespace (_inspect).
            "Inspect": _Method(pb.InspectRequest, self._inspect),
        }
        opts = [("grpc.max_receive_message_length", server_cfg.max_message_bytes),
                ("grpc.max_send_message_length", server_cfg.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        # Daemon threads (``kvstore.executors``): a call stuck in storage never holds up exit (``stop``).
        self._pool = DaemonExecutor(server_cfg.workers, "kvstore-rpc")
        # GetStream's read-ahead (one window per stream in flight; bounded by the RPC workers).
        self._read_pool = DaemonExecutor(server_cfg.workers, "kvstore-read")
        self.server = grpc.server(self._pool, options=opts)
        # Streaming batch forms, kept apart from ``methods`` (the unary table the fuzz tests walk).
        self.stream_methods: dict[str, _Method] = {
            "GetStream": _Method(pb.GetManyRequest, self._get_stream),
            "PutStream": _Method(pb.PutRequest, self._put_stream),
            "Maintain": _Method(pb.MaintainRequest, self._maintain, admin=True),
            "ExportIndex": _Method(pb.ExportIndexRequest, self._export_index, admin=True),
        }
        handlers = {name: grpc.unary_unary_rpc_method_handler(
            self._behaviour(name, m), request_deserializer=None,
            response_serializer=_serialize) for name, m in self.methods.items()}
        for name in ("GetStream", "Maintain", "ExportIndex"):  # the handlers yield encoded messages
            handlers[name] = grpc.unary_stream_rpc_method_handler(
                self._reply_stream(name, self.stream_methods[name]), request_deserializer=None,
                response_serializer=None)
        handlers["PutStream"] = grpc.stream_unary_rpc_method_handler(
            self._request_stream("PutStream", self.stream_methods["PutStream"]), request_deserializer=None,
            response_serializer=_serialize)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        bind = host_port(server_cfg.host, server_cfg.port)
        try:
            if port_taken(server_cfg.host, server_cfg.port):  # refused below, before gRPC logs its own line
                self.port = 0
            elif server_cfg.tls:
                creds = server_credentials_from_pem(tls_files["tls_cert"], tls_files["tls_key"],
                                                    tls_files.get("tls_client_ca"))
                self.port = self.server.add_secure_port(bind, creds)
            else:
                self.port = self.server.add_insecure_port(bind)
        except RuntimeError:  # current grpcio raises ("Failed to bind"); older releases returned 0
            self.port = 0
        if not self.port:
            hint = "; or the TLS key does not match the certificate" if server_cfg.tls else ""
            raise InvalidRequest(f"cannot listen on {bind} (in use, or not a local address{hint}); "
                                 "pick another --host/--port (--port 0: a free one)")

    def _release(self) -> None:
        """Close what ``__init__`` opened, for a daemon that never started."""
        if self.server is not None:
            self.server.stop(None)
        for pool in (self._pool, self._read_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self.store.close()
        if self.quota is not None:
            self.quota.close()

    # ------------------------------------------------------------------ life cycle
    @property
    def address(self) -> str:
        scheme = "grpcs" if self.cfg.tls else "grpc"
        return f"{scheme}://{host_port(self.cfg.host, self.port)}"

    def start(self) -> "Daemon":
        """Serve: gRPC, then metrics, then GC. If the metrics port cannot be bound, what was
        started is stopped and the store closed before ``InvalidRequest`` is raised."""
        self._watchdog = Watchdog()
        try:
            self.server.start()
        except BaseException:
            self._watchdog.close()
            raise
        if self.cfg.metrics_port >= 0:
            try:
                self.metrics.serve(self.cfg.host, self.cfg.metrics_port)
            except OSError as exc:
                self.stop(grace_s=0)
                raise InvalidRequest(
                    f"cannot serve metrics on {self.cfg.host}:{self.cfg.metrics_port} ({exc.strerror or exc}); "
                    "pick another --metrics-port (0: a free one, -1: no metrics)") from exc
        if self.cfg.gc_interval_s > 0:
            self._gc_thread = threading.Thread(target=self._gc_loop, name="kvstore-gc", daemon=True)
            self._gc_thread.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        self.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        log.info("kvstore daemon serving %s (tls=%s auth=%s)", self.address, self.cfg.tls, self.tokens.enabled)
        return self

    def stop(self, grace_s: float | None = None) -> None:
        """Drain and close; idempotent. In-flight calls get ``grace_s`` (default ``drain_s``);
        all of it ends within ``STOP_EXTRA_S`` after that: a call stuck in storage (a hung
        mount) is abandoned on its daemon thread, and the last call to return closes the
        index (``EmbeddedStore.close``); its client was already told UNAVAILABLE (a put may
        still commit: its outcome is unknown to the client, and a retry is safe)."""
        grace = self.cfg.drain_s if grace_s is None else grace_s
        with self._stop_lock:
            first, self._stopped = not self._stopped, True
        if not first:  # another caller is stopping it: return when that stop has ended
            self._stop_done.wait(grace + STOP_EXTRA_S + 1)
            return
        end = time.monotonic() + grace + STOP_EXTRA_S
        left = lambda: max(0.0, end - time.monotonic())  # noqa: E731
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait(left())
        self._stop_gc.set()
        if self._gc_thread is not None:
            self._gc_thread.join(left())
        self.metrics.close()
        for pool in (self._pool, self._read_pool):
            pool.shutdown(wait=True, timeout_s=left())
        if self._watchdog is not None:
            self._watchdog.close()
        self.store.close(wait_s=left())
        if self.quota is not None:
            self.quota.close()
        self._stop_done.set()
        log.info("kvstore daemon %s stopped", self.address)

    def wait(self) -> None:
        self.server.wait_for_termination()

    def _gc_loop(self) -> None:
        while not self._stop_gc.wait(self.cfg.gc_interval_s):
            # An admin's gc, check or repair pass is running (``AdminRPC._take_pass_slot``): this
            # round is skipped rather than run beside it. The slot is neither held nor taken here,
            # only its flag read: an admin's call is never refused because of a background round
            # (before, a look that took and gave back the slot made a call arriving then BUSY).
            if self._pass_running.is_set():
                log.info("background gc: skipped, an admin's gc, check or repair pass is running")
                continue
            try:
                self.metrics.gc_done(self.store.gc())
            except Exception:  # noqa: BLE001 - a failed pass is logged; the next one retries
                log.exception("background gc failed")

    # ------------------------------------------------------------------ dispatch
    @contextmanager
    def _guarded(self, name: str, context: grpc.ServicerContext) -> Iterator[None]:
        """Steps 5 and the metrics of one call: typed errors to status + metadata, the rest INTERNAL."""
        t0 = time.perf_counter()
        code = "OK"
        try:
            yield
        except KVStoreError as exc:
            status, md = status_of(exc)
            code = status.name
            context.set_trailing_metadata(md)
            context.abort(status, details_of(exc))
        except GeneratorExit:  # a streaming reply the client stopped reading (cancelled, timed out)
            code = "CANCELLED"
            raise
        except Exception as exc:  # noqa: BLE001 - anything untyped is a bug; say so
            if isinstance(exc, _ClientGone) or (isinstance(exc, grpc.RpcError) and not context.is_active()):
                code = "CANCELLED"  # a request stream's client went away mid-call: nothing applied (PutStream
                # receives and checks the whole stream first), not a bug
                log.info("%s: the client went away before sending its whole request; nothing applied", name)
                context.abort(grpc.StatusCode.CANCELLED, "the client cancelled the call")
            log.exception("%s failed", name)
            code = "INTERNAL"
            status, md = status_of(InternalError(str(exc)))
            context.set_trailing_metadata(md)
            context.abort(status, details_of(exc, f"internal error in {name} (a kvstore bug; see the daemon log): "))
        finally:
            self.metrics.observe(name, code, time.perf_counter() - t0)

    def _tenant(self, name: str, m: _Method, context: grpc.ServicerContext) -> Tenant:
        """Step 1; and ``MD_INDEX_KEYS`` (only on ``INDEX_KEY_METHODS``): an admin's keys are
        then index keys, stored as sent (``_inspect``'s rule)."""
        md = context.invocation_metadata()
        tenant = self.tokens.authenticate(md)
        if m.admin:
            require_admin(tenant, name)
        flag = next((v for k, v in md or () if k == MD_INDEX_KEYS), None)
        if flag is not None:
            if name not in INDEX_KEY_METHODS or flag != "1":
                raise InvalidRequest(f"metadata {MD_INDEX_KEYS}={flag!r} on {name}: only '1', and only on "
                                     f"{', '.join(sorted(INDEX_KEY_METHODS))}")
            if tenant.admin:
                return replace(tenant, secret=b"")
        return tenant

    @staticmethod
    def _parse(name: str, m: _Method, raw: bytes) -> Any:
        """Step 2."""
        try:
            return m.request.FromString(raw)
        except (DecodeError, ValueError) as exc:
            raise InvalidRequest(f"malformed {name} request ({len(raw)} bytes): {exc}") from exc

    @contextmanager
    def _admitted(self, tenant: Tenant) -> Iterator[None]:
        """Step 3, released when the call's store work is done (a stream: when it ends)."""
        self.limiter.acquire(tenant.name)
        self.metrics.inflight.inc()
        try:
            yield
        finally:
            self.metrics.inflight.dec()
            self.limiter.release(tenant.name)

    def _behaviour(self, name: str, m: _Method) -> Callable[[bytes, grpc.ServicerContext], Any]:
        def behaviour(raw: bytes, context: grpc.ServicerContext) -> Any:
            with self._guarded(name, context):
                tenant = self._tenant(name, m, context)
                req = self._parse(name, m, raw)
                with self._admitted(tenant):
                    return m.handler(req, tenant)

        return behaviour

    def _reply_stream(self, name: str, m: _Method) -> Callable[[bytes, grpc.ServicerContext], Iterator[bytes]]:
        """Server streaming: the handler is a generator of encoded messages; the slot is held until it ends."""
        def behaviour(raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            with self._guarded(name, context):
                tenant = self._tenant(name, m, context)
                req = self._parse(name, m, raw)
                with self._admitted(tenant):
                    yield from self._send_bound(name, m.handler(req, tenant), context)

        return behaviour

    def _request_stream(self, name: str, m: _Method) -> Callable[[Iterator[bytes], grpc.ServicerContext], Any]:
        """Client streaming: every message is received and parsed (bounded in count and total bytes)
        before the handler sees the list, as for one unary batch.

        A stream that ends with fewer items than its client declared (``MD_STREAM_ITEMS``), or
        whose call is no longer active, is a client that went away: nothing of it is applied.

        The call is admitted (its tenant's slot taken) before its items are received, and the
        receiving is bounded by ``stream_receive_s`` (then the call is cancelled): a client
        that sends slowly or not at all holds one of its own slots for that long at most,
        never every handler thread of the daemon."""
        def behaviour(raws: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            with self._guarded(name, context):
                tenant = self._tenant(name, m, context)
                declared = self._declared_items(name, context)
                with self._admitted(tenant):
                    with self._receive_bound(context):
                        reqs = self._receive(name, m, raws, declared, context)
                    return m.handler(reqs, tenant)

        return behaviour

    @contextmanager
    def _receive_bound(self, context: grpc.ServicerContext) -> Iterator[None]:
        """Cancel the call if it is still receiving after ``stream_receive_s`` (0: no bound)."""
        if not self.cfg.stream_receive_s:
            yield
            return
        token = object()
        self._watchdog.arm(token, self.cfg.stream_receive_s, _cut(
            context, f"PutStream not wholly received within stream_receive_s = {self.cfg.stream_receive_s:g} s"))
        try:
            yield
        finally:
            self._watchdog.disarm(token)

    def _send_bound(self, name: str, msgs: Generator[bytes, None, None],
                    context: grpc.ServicerContext) -> Iterator[bytes]:
        """``msgs``, the call cancelled when none of them can be sent for ``stream_send_s`` (0: no
        bound). gRPC resumes this generator once HTTP/2 flow control has let the message it yielded
        out, so the wait is armed over each ``yield`` alone: reading the store does not count. Flow
        control reopens a window at a time, not per message the client takes: a client reading
        less than that per ``stream_send_s`` is cut as well (QA: a 4 KiB-value stream read at one
        32 KiB message per 0.5 s waited 32 s on one send). The window is the client's (64 KiB, or
        grown by BDP probing, 32 MiB seen on loopback): a stream that fits in it just ends."""
        if not self.cfg.stream_send_s:
            yield from msgs
            return
        token, cut = object(), _cut(context, f"{name} could send nothing for stream_send_s = "
                                             f"{self.cfg.stream_send_s:g} s (its client stopped reading, or reads "
                                             "less than one flow-control window in that time)")
        try:
            for msg in msgs:
                self._watchdog.arm(token, self.cfg.stream_send_s, cut)
                yield msg
                self._watchdog.disarm(token)
        finally:
            self._watchdog.disarm(token)
            msgs.close()  # cut or gone: the handler's own cleanup runs now, as ``yield from`` would

    def _receive(self, name: str, m: _Method, raws: Iterator[bytes], declared: int | None,
                 context: grpc.ServicerContext) -> list[Any]:
        """Every message of a request stream, parsed, bounded in count and total bytes."""
        reqs, total = [], 0
        for raw in raws:
            if declared is not None and len(reqs) == declared:
                raise InvalidRequest(f"{name} sent more items than the {declared} it declared "
                                     f"in {MD_STREAM_ITEMS}; nothing stored")
            total += len(raw)
            if total > self.cfg.max_message_bytes:
                raise RequestTooLarge(
                    f"{name} of more than {self.cfg.max_message_bytes} bytes is over the daemon's "
                    "max_message_bytes; raise max_message_bytes on both the daemon and the client, "
                    "or send smaller batches")
            reqs.append(self._parse(name, m, raw))
            self._batch(len(reqs), name)
        if (declared is not None and len(reqs) != declared) or not context.is_active():
            raise _ClientGone(f"{len(reqs)} of {'?' if declared is None else declared} items received")
        return reqs

    # ------------------------------------------------------------------ helpers
    def _batch(self, n: int, what: str) -> None:
        """``BatchTooLarge`` (carrying this daemon's limit) when ``n`` items are over ``max_batch_items``.

        Contract: every handler calls it before any store work (and PutStream before it reads
        past the limit), so the refusal guarantees that nothing was applied; ``kvstore.client.remote``
        relies on that to learn the limit and resend the batch in pieces."""
        if n > self.cfg.max_batch_items:
            raise BatchTooLarge(f"{what} of {n} items is over max_batch_items={self.cfg.max_batch_items}; split it",
                                limit=self.cfg.max_batch_items)

    def _declared_items(self, name: str, context: grpc.ServicerContext) -> int | None:
        """The item count a stream's client declared (``MD_STREAM_ITEMS``), checked against
        ``max_batch_items`` before any item is read; None when it declared none."""
        raw = dict(context.invocation_metadata()).get(MD_STREAM_ITEMS)
        if raw is None:
            return None
        if not (isinstance(raw, str) and raw.isascii() and raw.isdigit()):
            raise InvalidRequest(f"{name}: metadata {MD_STREAM_ITEMS}={raw!r} is not a count of items")
        self._batch(int(raw), name)
        return int(raw)

    @staticmethod
    def _key(tenant: Tenant, key: bytes) -> bytes:
        return tenant.store_key(check_key(key))  # validate the client's key before mapping it

    @staticmethod
    def _keys(tenant: Tenant, keys: Any) -> list[bytes]:
        """``_key`` over a batch (every key validated before any is mapped)."""
        keys = check_keys(keys)
        return [tenant.store_key(k) for k in keys] if tenant.secret else keys

    @staticmethod
    def _ttl(r: pb.PutRequest | pb.WrittenEntry) -> float | None:
        """The request's TTL (``None``: unset, the store's default), checked."""
        ttl = r.ttl_s if r.HasField("ttl_s") else None
        if ttl is not None and not (math.isfinite(ttl) and 0 < ttl <= MAX_TTL_S):
            raise InvalidRequest(f"ttl_s must be positive and at most {MAX_TTL_S:.0f} s, got {ttl}")
        return ttl

    def _item(self, r: pb.PutRequest, tenant: Tenant) -> PutItem:
        ttl = self._ttl(r)
        if not 0 <= r.tokens < 2**32:
            raise InvalidRequest(f"tokens must be in [0, 2**32), got {r.tokens}")
        layout = layout_from_pb(r.layout) if r.HasField("layout") else None
        return PutItem(self._key(tenant, r.key), r.value, kind_or_default(r.kind), ttl, layout, int(r.tokens))

    def _store_put(self, items: list[PutItem], tenant: Tenant) -> list[bool]:
        """``store.put_many`` charged to the tenant's quota."""
        if self.quota is None:
            return _as_seen_by(tenant, lambda: self.store.put_many(items))
        return self._charged(tenant, [ekey(EntryKind.parse(it.kind).code, it.key) for it in items],
                             [len(it.value) for it in items], lambda: self.store.put_many(items))

    def _charged(self, tenant: Tenant, eks: list[bytes], sizes: list[int],
                 write: Callable[[], list[bool]]) -> list[bool]:
        """``write()``, a store write of entries ``eks`` of ``sizes`` plain bytes, charged to
        the tenant's quota: reserve what is not live yet, write, settle what was created.

        An entry named twice in one batch is stored once (the store skips the repeat), so it
        is reserved once, at the larger of its sizes: the reservation stays an upper bound
        of what the write can add, and ``settle`` records what was actually created."""
        if self.quota is None:
            return _as_seen_by(tenant, write)
        want: dict[bytes, int] = {}
        for ek, size in zip(eks, sizes):
            want[ek] = max(size, want.get(ek, 0))
        n = sum(size for size, live in zip(want.values(), self.quota.live(list(want))) if not live)
        self.quota.reserve(tenant.name, n)
        try:
            created = _as_seen_by(tenant, write)
        except BaseException:
            self.quota.cancel(tenant.name, n)
            raise
        self.quota.settle(tenant.name, n, [(ek, s) for ek, s, c in zip(eks, sizes, created) if c])
        return created

    def _forget(self, tenant: Tenant, deleted: list[tuple[bytes, str]]) -> None:
        if self.quota is not None and deleted:
            self.quota.forget(tenant.name, [ekey(EntryKind.parse(kind).code, key) for key, kind in deleted])
