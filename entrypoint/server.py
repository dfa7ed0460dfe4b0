"""The entrypoint's gRPC service (``Entrypoint`` in ``proto/serving.proto``) and ``serve``.

``EntrypointService`` owns the parts of an entrypoint and wires them: the configuration
(``entrypoint.config``), the store, the instance registry (``entrypoint.instances``), one lock
shared by the strikes (``entrypoint.health``) and the dispatch of hops (``entrypoint.dispatch``),
and the request path (``entrypoint.generate``), which ``Generate`` runs. Start here, then read
``entrypoint.generate`` to follow one request hop by hop.

Generate: runs ``GeneratePipeline.run`` and streams its events. Backpressure: at most
``max_inflight`` requests at once; more get RESOURCE_EXHAUSTED. The request's ``Abort`` becomes
the call's status; an ``LBInputError`` that escapes a hop is INVALID_ARGUMENT, never UNKNOWN.

Clients: with client tokens (``entrypoint.client_tokens``), ``Generate`` acts for
its bearer token's tenant only (UNAUTHENTICATED without a known token,
PERMISSION_DENIED naming another tenant), checked before step 1; without
them, the request's ``tenant`` field is taken as sent.

Membership: ``Register`` and ``Deregister`` need the worker secret when one is
configured (``entrypoint.auth``: UNAUTHENTICATED otherwise, and nothing
changes); ``ListWorkers`` is open, unless there are client tokens: then it
takes one of them or the worker secret. Every call to a worker (every hop, and
the heartbeat) carries the same secret, since the workers require it
(``entrypoint.instances`` opens the channels).

Every method's request bytes are parsed by ``entrypoint.rpc`` first: bytes that are not its
request message are INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

import grpc

import kvstore
from entrypoint.auth import WorkerAuth, check_listen
from entrypoint.client_tokens import ClientAuth, check_open_tenants
from entrypoint.config import EntrypointConfig
from entrypoint.dispatch import Abort, Balancers, Deadlines, Dispatch
from entrypoint.generate import GeneratePipeline
from entrypoint.health import StrikePolicy, Strikes
from entrypoint.instances import IncompatibleWorker, Registry, check_kv_compat
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from entrypoint.rpc import make_server
from entrypoint.tls import ServerTLS, server_address, warn_plaintext
from lb.types import LBInputError


class EntrypointService(pbg.EntrypointServicer):
    """The ``Entrypoint`` service over ``store`` and ``registry`` (module docstring)."""

    def __init__(self, cfg: EntrypointConfig, store: kvstore.KVStore, registry: Registry):
        self.cfg, self.store, self.registry = cfg, store, registry
        self._slots = threading.BoundedSemaphore(cfg.max_inflight)
        # one lock for every instance's in-flight counts and strikes: a pick reads and counts under it
        self._lock = threading.Lock()
        self.strikes = Strikes(StrikePolicy(cfg.avoid_after, cfg.avoid_for_s), self._lock)
        self.auth = WorkerAuth(cfg.worker_secret)
        self.clients = ClientAuth(cfg.client_tokens)
        deadlines = Deadlines(cfg.worker_timeout_s, cfg.retry_backoff_s)
        self.dispatch = Dispatch(registry, self.strikes, self._lock, Balancers.build(cfg), deadlines,
                                 cfg.max_attempts)
        self.pipeline = GeneratePipeline(cfg, store, registry, self.dispatch, self.strikes, deadlines, self.clients)

    # ------------------------------------------------------------------ membership RPCs
    def Register(self, request, context):
        self.auth.check(context, f"Register of worker {request.worker_id!r}")  # before any change
        try:
            check_kv_compat(request, self.cfg.namespace, self.cfg.block_size)  # before the worker is polled
            self.registry.add(request.worker_id, request.role, request.address, block_size=request.block_size,
                              kv_namespace=request.kv_namespace if request.HasField("kv_namespace") else None)
        except IncompatibleWorker as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except kvstore.InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.RegisterReply(ok=True, message=f"{request.worker_id} registered")

    def Deregister(self, request, context):
        self.auth.check(context, f"Deregister of worker {request.worker_id!r}")
        ok = self.registry.remove(request.worker_id)
        return pb.RegisterReply(ok=ok, message="removed" if ok else "unknown worker")

    def ListWorkers(self, request, context):
        if self.clients.enabled and not (self.auth.enabled and self.auth.admits(context.invocation_metadata())):
            self.clients.authenticate(context)  # a client token or the worker secret
        return pb.WorkerList(workers=[pb.WorkerInfo(worker_id=i.worker_id, role=i.role, address=i.address,
                                                    kv_namespace=i.kv_namespace, block_size=i.block_size)
                                      for i in self.registry.ready()])

    # ------------------------------------------------------------------ Generate
    def Generate(self, request, context):
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the entrypoint is serving {self.cfg.max_inflight} requests; retry later")
        try:
            yield from self.pipeline.run(request, context)
        except Abort as exc:
            context.abort(exc.code, exc.message)
        except LBInputError as exc:  # a request value the LB refuses is the caller's misuse, not UNKNOWN
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the load balancer refused the request: {exc}")
        finally:
            self._slots.release()


def serve(cfg: EntrypointConfig, store_url: str, *, host: str = "127.0.0.1", port: int = 0,
          heartbeat_s: float = 0.5, ready: Callable[[str], None] | None = None,
          stop: threading.Event | None = None, tls: ServerTLS | None = None) -> int:
    """Run the entrypoint until ``stop`` is set (or forever). Calls ``ready(address)`` once listening
    (``grpcs://HOST:PORT`` when ``tls`` is enabled: ``entrypoint.tls``, hop 1).

    A ``host`` beyond loopback without ``cfg.worker_secret`` (``entrypoint.auth.check_listen``),
    or with several tenants and no ``cfg.client_tokens`` (``entrypoint.client_tokens.check_open_tenants``),
    is refused before anything is opened. A failure while starting (a bad policy, a port
    that cannot be bound) raises after closing what was already opened (the store)."""
    from concurrent import futures

    if not (math.isfinite(heartbeat_s) and heartbeat_s > 0):
        raise kvstore.InvalidRequest(f"heartbeat_s must be a finite number > 0, got {heartbeat_s!r}")
    check_listen(host, cfg.worker_secret)
    check_open_tenants(host, cfg.tenants, ClientAuth(cfg.client_tokens))
    credentials = tls.credentials() if tls is not None else None  # the files read before anything is opened
    if cfg.worker_tls is not None:
        cfg.worker_tls.credentials()  # the same for the files it dials workers with
    store = kvstore.connect(store_url)
    registry = Registry(heartbeat_s=heartbeat_s, worker_secret=cfg.worker_secret, worker_tls=cfg.worker_tls)
    server = None
    try:
        service = EntrypointService(cfg, store, registry)
        server, bound = make_server(futures.ThreadPoolExecutor(max_workers=cfg.max_inflight + 8),
                                    [(service, pb.DESCRIPTOR.services_by_name["Entrypoint"])], host, port,
                                    credentials=credentials)
        server.start()
        registry.start()
        warn_plaintext("entrypoint", host, credentials is not None)
        if ready is not None:
            ready(server_address(host, bound, credentials is not None))
        stop = stop or threading.Event()
        stop.wait()
    finally:
        if server is not None:
            server.stop(grace=5).wait()
        registry.stop()
        store.close()
    return 0
