"""The daemon: the ``kvstore.v1.KVStore`` gRPC service over one embedded store.

Who calls it: ``kvstore serve`` (``kvstore.server.cli``) and tests, as
``Daemon(server_cfg, store_cfg).start()`` ... ``stop()``.

What it is made of (each part is its own object; the daemon builds them, hands each
what it needs, and closes them in order):

==================  ====================================================================
part                what it does
==================  ====================================================================
``store``           the embedded store (``kvstore.embedded.store.EmbeddedStore``)
``quota``           per-tenant quotas (``kvstore.server.quota``; ``None`` when off)
``tokens``          bearer tokens and tenants (``kvstore.auth.TokenTable``)
``limiter``         admission, overall and per tenant (``kvstore.server.admission``)
``metrics``         Prometheus metrics (``kvstore.server.metrics``)
``watchdog``        the streaming calls' time bounds (``kvstore.server.watchdog``)
``passes``          the one maintenance slot (``kvstore.server.admin_rpc.PassSlot``)
RPC / read pools    gRPC's handler threads and GetStream's read-ahead
                    (``kvstore.executors.DaemonExecutor``: daemon threads)
``data``            Put, Get, Delete, Pin, Lookup, Probe and their batch and streamed forms
                    (``kvstore.server.data_rpc.DataCalls``)
``direct``          Describe, Locate, Commit (``kvstore.server.direct_rpc.DirectCalls``)
``admin``           Stats, Gc, Check, Repair, Maintain, Inspect, ExportIndex
                    (``kvstore.server.admin_rpc.AdminCalls``)
``dispatch``        the per-call steps around every handler: authenticate, parse, admit,
                    map errors, count (``kvstore.server.dispatch``)
==================  ====================================================================

The method tables (``methods``: the unary calls; ``reply_streams``: GetStream, Maintain,
ExportIndex; ``request_streams``: PutStream) name, per RPC, its request type, its handler
and whether it is admin-only; the dispatcher wraps each handler and registers them all as
one gRPC service, beside the standard health service.

Background GC runs in its own thread every ``gc_interval_s`` (a round is skipped while an
admin's gc, check or repair pass runs: ``PassSlot``); the store's GC works in bounded index
transactions, so requests are not stalled behind it. ``stop()`` drains: health goes
NOT_SERVING, gRPC stops accepting calls and gives in-flight ones ``drain_s`` to finish, GC
stops, then the store closes.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.auth import TokenTable, load_server_secret
from kvstore.config import StoreConfig
from kvstore.embedded.store import EmbeddedStore
from kvstore.errors import InvalidRequest
from kvstore.executors import DaemonExecutor
from kvstore.netaddr import host_port, port_taken
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.admin_rpc import AdminCalls, PassSlot
from kvstore.server.admission import Limiter
from kvstore.server.checks import BatchLimit
from kvstore.server.config import ServerConfig
from kvstore.server.data_rpc import DataCalls
from kvstore.server.direct_rpc import DirectCalls
from kvstore.server.dispatch import Dispatcher, Method
from kvstore.server.metrics import DaemonMetrics
from kvstore.server.quota import TenantQuota
from kvstore.server.tenant_writes import TenantWrites
from kvstore.server.watchdog import Watchdog
from kvstore.tls import server_credentials_from_pem

log = logging.getLogger(__name__)

SERVICE = "kvstore.v1.KVStore"
STOP_EXTRA_S = 5.0  # ``Daemon.stop`` ends within this long after the drain grace


class Daemon:
    """One daemon: a gRPC server, its store, metrics and the GC thread. Thread-safe.

    The daemon owns its store (one passed as ``store`` too): ``stop()`` closes it, and so
    does a start that fails (``__init__`` or ``start`` raising ``InvalidRequest``: port or
    metrics port in use, bad host, TLS key not matching its certificate), which leaves
    nothing open or listening behind.
    """

    def __init__(self, server_cfg: ServerConfig, store_cfg: StoreConfig, *, store: Any = None):
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
        self.watchdog: Watchdog | None = None
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

    def _build(self, server_cfg: ServerConfig, store_cfg: StoreConfig, tls_files: dict[str, bytes]) -> None:
        """The rest of ``__init__`` once the store is open: the parts, the gRPC server bound
        to its port (``InvalidRequest`` when it cannot be), the calls registered. Starts nothing."""
        if server_cfg.tenant_quota_bytes:
            self.quota = TenantQuota(Path(store_cfg.data_dir) / "server" / "quota", server_cfg.tenant_quota_bytes,
                                     self.store, sync=store_cfg.fsync)
        self.tokens = TokenTable()
        if server_cfg.tokens_file:
            secret_path = Path(server_cfg.tenant_secret_file or Path(store_cfg.data_dir) / "server" / "tenant.secret")
            self.tokens = TokenTable.load(server_cfg.tokens_file, load_server_secret(secret_path))
        self.limiter = Limiter(server_cfg.max_concurrent_requests, server_cfg.max_concurrent_per_tenant)
        self.metrics = DaemonMetrics(self.store)
        self.passes = PassSlot()
        self.watchdog = Watchdog()
        # Daemon threads (``kvstore.executors``): a call stuck in storage never holds up exit (``stop``).
        self._pool = DaemonExecutor(server_cfg.workers, "kvstore-rpc")
        # GetStream's read-ahead (one window per stream in flight; bounded by the RPC workers).
        self._read_pool = DaemonExecutor(server_cfg.workers, "kvstore-read")
        self.server = grpc.server(self._pool, options=[
            ("grpc.max_receive_message_length", server_cfg.max_message_bytes),
            ("grpc.max_send_message_length", server_cfg.max_message_bytes),
            ("grpc.so_reuseport", 0)])
        self.port = self._bind(server_cfg, tls_files)

        batch = BatchLimit(server_cfg.max_batch_items)
        writes = TenantWrites(self.store, self.quota)
        self.data = DataCalls(server_cfg, self.store, self.metrics, batch, writes, self._read_pool)
        self.direct = DirectCalls(server_cfg, self.store, self.tokens, self.metrics, batch, writes)
        self.admin = AdminCalls(server_cfg, self.store, self.tokens, self.limiter, self.metrics, batch,
                                self.passes, self.address)
        self.dispatch = Dispatcher(server_cfg, self.tokens, self.limiter, self.metrics, self.watchdog, batch)
        data, direct, admin = self.data, self.direct, self.admin
        self.methods: dict[str, Method] = {
            "Put": Method(pb.PutRequest, data.put),
            "PutMany": Method(pb.PutManyRequest, data.put_many),
            "Get": Method(pb.KeyRequest, data.get),
            "GetMany": Method(pb.GetManyRequest, data.get_many),
            "Delete": Method(pb.KeyRequest, data.one("delete")),
            "DeleteMany": Method(pb.KeysRequest, data.many("delete")),
            "Pin": Method(pb.KeyRequest, data.one("pin")),
            "PinMany": Method(pb.KeysRequest, data.many("pin")),
            "Unpin": Method(pb.KeyRequest, data.one("unpin")),
            "UnpinMany": Method(pb.KeysRequest, data.many("unpin")),
            "Lookup": Method(pb.LookupRequest, data.lookup),
            "LookupMany": Method(pb.LookupManyRequest, data.lookup_many),
            "Probe": Method(pb.ProbeRequest, data.probe),
            "Describe": Method(pb.DescribeRequest, direct.describe),
            "Locate": Method(pb.LocateRequest, direct.locate),
            "Commit": Method(pb.CommitRequest, direct.commit),
            "Stats": Method(pb.StatsRequest, admin.stats, admin=True),
            "Gc": Method(pb.GcRequest, admin.gc, admin=True),
            "Check": Method(pb.CheckRequest, admin.check, admin=True),
            "Repair": Method(pb.RepairRequest, admin.repair, admin=True),
            # Admin-only for the summary; per-key views are any tenant's, in its namespace (AdminCalls.inspect).
            "Inspect": Method(pb.InspectRequest, admin.inspect),
        }
        self.reply_streams: dict[str, Method] = {
            "GetStream": Method(pb.GetManyRequest, data.get_stream),
            "Maintain": Method(pb.MaintainRequest, admin.maintain, admin=True),
            "ExportIndex": Method(pb.ExportIndexRequest, admin.export_index, admin=True),
        }
        self.request_streams: dict[str, Method] = {
            "PutStream": Method(pb.PutRequest, data.put_stream),
        }
        self.server.add_generic_rpc_handlers((self.dispatch.generic_handler(
            SERVICE, self.methods, self.reply_streams, self.request_streams),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)

    def _bind(self, server_cfg: ServerConfig, tls_files: dict[str, bytes]) -> int:
        """The port the server listens on; ``InvalidRequest`` when it cannot be bound."""
        bind = host_port(server_cfg.host, server_cfg.port)
        try:
            if port_taken(server_cfg.host, server_cfg.port):  # refused below, before gRPC logs its own line
                port = 0
            elif server_cfg.tls:
                creds = server_credentials_from_pem(tls_files["tls_cert"], tls_files["tls_key"],
                                                    tls_files.get("tls_client_ca"))
                port = self.server.add_secure_port(bind, creds)
            else:
                port = self.server.add_insecure_port(bind)
        except RuntimeError:  # grpcio raises ("Failed to bind") where the port cannot be bound
            port = 0
        if not port:
            hint = "; or the TLS key does not match the certificate" if server_cfg.tls else ""
            raise InvalidRequest(f"cannot listen on {bind} (in use, or not a local address{hint}); "
                                 "pick another --host/--port (--port 0: a free one)")
        return port

    def _release(self) -> None:
        """Close what ``__init__`` opened, for a daemon that never started."""
        if self.server is not None:
            self.server.stop(None)
        for pool in (self._pool, self._read_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        if self.watchdog is not None:
            self.watchdog.close()
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
        try:
            self.server.start()
        except BaseException:
            self.watchdog.close()
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
        self.watchdog.close()
        self.store.close(wait_s=left())
        if self.quota is not None:
            self.quota.close()
        self._stop_done.set()
        log.info("kvstore daemon %s stopped", self.address)

    def wait(self) -> None:
        self.server.wait_for_termination()

    def _gc_loop(self) -> None:
        while not self._stop_gc.wait(self.cfg.gc_interval_s):
            # An admin's gc, check or repair pass is running (``PassSlot``): this round is
            # skipped rather than run beside it. The slot is neither held nor taken here, only
            # its flag read: an admin's call is never refused because of a background round.
            if self.passes.running:
                log.info("background gc: skipped, an admin's gc, check or repair pass is running")
                continue
            try:
                self.metrics.gc_done(self.store.gc())
            except Exception:  # noqa: BLE001 - a failed pass is logged; the next one retries
                log.exception("background gc failed")
