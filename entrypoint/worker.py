"""Engine worker process: the reference engine with the plugin, served over gRPC.

One process serves one role (``ve``, ``prefill`` or ``decode``; see
``entrypoint/proto/serving.proto``). The entrypoint dispatches to it and polls
``Status`` as the heartbeat. A VE worker (no engine runner) reports its
``Encode`` calls in flight as ``running`` there, so the VE LB sees its load.

The engine is stepped on one thread (``entrypoint.engine_runner``: threads, and what an
engine step that fails does to the requests it held).

P/D handoff goes through the store: ``Prefill`` replies only after the
connector has flushed the request's blocks and its end-of-input SWA snapshot
to the store, so the decode worker that gets the request next finds them.
``Decode`` takes the prompt plus the tokens already streamed, loads the cached
prefix through the plugin, and continues at the next output index (seeded
sampling depends only on the seed and the output index, so a re-dispatched
stream continues exactly where the dead one stopped).

VE cache trust: ``Encode`` refuses (INVALID_ARGUMENT) image bytes whose
``image_hash`` is not their content hash, before the cache is read or written;
an ``Encode`` hits (``cache_hit``; no encode) only entries its own cache scope
(gRPC metadata ``kvstack-image-scope``, a tenant-derived namespace the
entrypoint sends; empty when absent) has sent the bytes of, so nothing in the
reply depends on other tenants; ``Status.cached_images`` lists scoped keys
(``scoped_image_key``). See ``entrypoint.vision``.

Failures: a request the engine refuses fails alone with INVALID_ARGUMENT; the requests of an
engine step that raised are retried alone before any fails (``entrypoint.engine_runner``).
A ``Prefill`` or ``Decode`` whose caller goes away (the entrypoint cancels it when its client
left, or its deadline passed) cancels its request in the runner: it leaves the engine at once,
its blocks and batch slot freed, instead of being decoded to ``max_new_tokens``. At shutdown
(SIGTERM/SIGINT) new calls are refused and each request in flight ends UNAVAILABLE "this worker
is down: it is shutting down" at once (``entrypoint.engine_runner``, "Stopping"): the entrypoint
marks the worker down and fails the hop over (a decode stream resumes after the tokens sent).
An engine step that runs longer than ``--step-timeout-s`` (default 600 s; 0: off) is taken as
hung: the worker goes down until it is restarted, its requests end UNAVAILABLE "this worker is
down: engine step stuck for N s" and ``Status`` answers UNAVAILABLE, so the entrypoint's heartbeat
keeps it down (``entrypoint.engine_runner``, "Stuck steps").

Request bytes that do not parse as the method's message are INVALID_ARGUMENT
before any handler runs (``entrypoint.rpc``).

Callers: with the worker secret (``--worker-secret-file FILE``, else
``KVSTACK_WORKER_SECRET``; see ``entrypoint.auth``) every method here needs
it (metadata ``authorization: Bearer <secret>``; UNAUTHENTICATED otherwise,
before the request is parsed or any work is done), so only the entrypoint,
which sends it on every call, can reach the engine with a tenant's salt or an
image scope. Without one the worker serves on loopback only, and warns once
it serves.

TLS (``entrypoint.tls``, which says which hop uses which file): ``--tls-cert C
--tls-key K`` serve this worker's port over TLS; it then registers (and prints
in READY) ``grpcs://HOST:PORT``, and the entrypoint verifies it with its
``--worker-ca``. ``--tls-client-ca CA`` adds mutual TLS: the entrypoint must
present a certificate signed by CA (its ``--worker-cert``). To register with
a TLS entrypoint: ``--entrypoint grpcs://HOST:PORT --entrypoint-ca FILE`` (the
CA of the entrypoint's ``--tls-cert``), plus ``--entrypoint-cert`` and
``--entrypoint-key`` when it has ``--tls-client-ca``. TLS files for a
plaintext ``--entrypoint`` address, a cert without its key (or the reverse),
``--tls-client-ca`` without ``--tls-cert``/``--tls-key``, or a file that is
not the PEM it should be are usage errors (exit code 2).

Run: ``python -m entrypoint.worker --role decode --store ./kvstack-data``;
the first line on stdout is ``READY <json>`` with the bound address. With
``--entrypoint``, the worker registers there, sending the worker secret and,
for prefill and decode, its engine's KV namespace and block size (which must
be the entrypoint's: ``entrypoint.instances.check_kv_compat``). A usage error
(bad flag, unknown model, a bad or refused worker secret, a registration
refused as INVALID_ARGUMENT or FAILED_PRECONDITION, a non-loopback ``--host``
without a secret) is one line on stderr and exit code
2, an entrypoint that cannot be reached one line and exit code 1; never a
traceback.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import signal
import sys
import threading
import time
import uuid
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

import kvstore
from entrypoint import auth
from entrypoint._cli import OneLineParser, fail
from entrypoint.engine_runner import DEFAULT_STEP_TIMEOUT_S, EngineRunner, Handle, request_stats
from entrypoint.instances import kv_namespace_pb
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from entrypoint.rpc import make_server
from entrypoint.tls import (ChannelTLS, ServerTLS, add_serve_args, open_channel, server_address, split_address,
                            unreachable_hint, warn_plaintext)
from entrypoint.vision import SCOPE_METADATA, EncoderCache, VisionEncoder, check_image_hash
from kvstore.errors import InvalidRequest, StoreUnavailable
from kvstore.keys import ImageSpan

log = logging.getLogger(__name__)

ROLES = ("ve", "prefill", "decode")
ENTRYPOINT_TLS_NONE = ChannelTLS(names=("--entrypoint-ca", "--entrypoint-cert", "--entrypoint-key"))


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    role: str
    worker_id: str = ""
    host: str = "127.0.0.1"
    port: int = 0
    store_url: str = "./kvstack-data"
    model_preset: str = "tiny"
    block_size: int = 16
    num_blocks: int = 1024
    host_capacity_bytes: int = 64 * 1024 * 1024
    # An engine step running longer takes the worker down until it is restarted (entrypoint.engine_runner,
    # "Stuck steps"); 0: no watchdog. The default is generous: on CPU one step of a large model (prefill chunks,
    # a window replay, loads from a slow store) can take minutes, and a false alarm loses a healthy worker.
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    entrypoint: str = ""  # address to register with ("" = the entrypoint is told by whoever started us)
    # Sent with Register and required of every caller (entrypoint.auth); not in logs.
    worker_secret: str = field(default="", repr=False)
    tls: ServerTLS = ServerTLS()  # this worker's port (entrypoint.tls, hop 2); empty: plaintext
    entrypoint_tls: ChannelTLS = ENTRYPOINT_TLS_NONE  # how to reach --entrypoint over grpcs:// (hop 1)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise InvalidRequest(f"unknown worker role {self.role!r}; use one of {ROLES}")
        for name, low in (("block_size", 1), ("num_blocks", 1), ("host_capacity_bytes", 0), ("port", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InvalidRequest(f"WorkerConfig.{name} must be an int >= {low}, got {v!r}")
        if self.port > 65535:
            raise InvalidRequest(f"WorkerConfig.port must be <= 65535, got {self.port}")
        t = self.step_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidRequest(f"WorkerConfig.step_timeout_s must be a finite number of seconds >= 0 "
                                 f"(0: no step watchdog), got {t!r}")
        if self.worker_secret:
            auth.check_secret(self.worker_secret, "WorkerConfig.worker_secret")
        if self.entrypoint:  # a bad address, or TLS files for a plaintext one: refused before anything opens
            _, secure = split_address(self.entrypoint)
            if self.entrypoint_tls.given and not secure:
                raise InvalidRequest(f"{self.entrypoint_tls.names[0]}/{self.entrypoint_tls.names[1]} given for the "
                                     f"plaintext --entrypoint {self.entrypoint!r}: use grpcs://{self.entrypoint}"
                                     " for a TLS entrypoint, or drop them")
        elif self.entrypoint_tls.given:
            raise InvalidRequest("--entrypoint-ca/--entrypoint-cert are for registering: give --entrypoint too")


class WorkerService(pbg.WorkerServicer):
    def __init__(self, cfg: WorkerConfig, runner: EngineRunner | None, encoder: VisionEncoder | None):
        self.cfg, self.runner, self.encoder = cfg, runner, encoder
        self.cache = EncoderCache()
        self._encodes = 0  # Encode calls in flight (the VE's load in Status: it has no runner)
        self._encodes_lock = threading.Lock()
        self.block_token_bytes = 0
        if runner is not None:
            pool = runner.engine.pool
            self.block_token_bytes = pool.kv[0][0].numel() * pool.kv.element_size()

    def _need(self, role: str, ctx: grpc.ServicerContext) -> None:
        if self.cfg.role != role:
            ctx.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"worker {self.cfg.worker_id} has role {self.cfg.role}, not {role}")

    def Encode(self, request, context):
        self._need("ve", context)
        with self._encodes_lock:
            self._encodes += 1
        try:
            return self._encode(request, context)
        finally:
            with self._encodes_lock:
                self._encodes -= 1

    def _encode(self, request, context):
        img = request.image
        t0 = time.perf_counter()
        scope = dict(context.invocation_metadata() or ()).get(SCOPE_METADATA, "").encode()
        if img.image_data:  # never cache (or serve) tokens under a hash that is not these bytes' hash
            try:
                check_image_hash(img.image_hash, img.image_data)
            except InvalidRequest as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        # Only this scope's own entries hit: a hit on bytes another tenant sent would tell this
        # one (by cache_hit, or by the time saved) that someone else sent this image.
        toks = self.cache.get(img.image_hash, img.length, scope)
        hit = toks is not None
        if not hit:
            try:
                toks = self.encoder.encode(img.image_data, img.length)
            except InvalidRequest as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            self.cache.put(img.image_hash, toks, scope)
        return pb.EncodeReply(token_ids=toks, cache_hit=hit, encode_ms=(time.perf_counter() - t0) * 1e3)

    def _submit(self, request, context, prompt, max_new, offset):
        from engine_plugin.reference import SamplingParams

        sp = request.sampling
        try:
            sampling = SamplingParams(max_new_tokens=max_new, temperature=sp.temperature, seed=sp.seed,
                                      output_offset=offset)
            images = [ImageSpan(i.image_hash, i.start, i.length) for i in request.images]
        except InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        h = self.runner.submit(f"{request.request_id}/{uuid.uuid4().hex[:6]}", prompt, sampling,
                               tenant_salt=request.tenant_salt, images=images)
        # The RPC ends (its caller cancelled it, or its deadline passed) before the request did: cancel
        # it, so that it takes no more engine steps (a no-op once it ended). grpc runs the callback
        # when the call ends, even while this handler waits or is parked at a yield of a stream.
        if not context.add_callback(lambda: self.runner.cancel(h)):  # already over: no callback then
            self.runner.cancel(h)
        return h

    def _events(self, h: Handle, context):
        """The request's events until its last; a request whose caller went away is cancelled
        in the runner (``EngineRunner.cancel``) and the RPC ends CANCELLED."""
        try:
            while True:
                try:
                    ev = h.events.get(timeout=0.5)
                except queue.Empty:
                    if not context.is_active():
                        context.abort(grpc.StatusCode.CANCELLED, "the caller went away")
                    continue
                if ev[0] == "error":
                    context.abort(ev[1], ev[2])
                yield ev
                if ev[0] == "done":
                    return
        finally:  # also when the stream is closed at a yield; a no-op for a request that ended
            self.runner.cancel(h)

    def Prefill(self, request, context):
        self._need("prefill", context)
        t0 = time.perf_counter()
        h = self._submit(request, context, list(request.token_ids), 1, 0)
        first = None
        for ev in self._events(h, context):
            if ev[0] == "token" and first is None:
                first = ev[1]
        # Hand-off through the store: blocks and the end-of-input snapshot durable before replying.
        self.runner.connector.flush()
        st = request_stats(h, self.runner.connector, self.block_token_bytes, t0)
        return pb.PrefillReply(first_token=first, stats=json.dumps(st))

    def Decode(self, request, context):
        self._need("decode", context)
        t0 = time.perf_counter()
        done = list(request.generated)
        remaining = request.sampling.max_new_tokens - len(done)
        if remaining <= 0:
            return
        h = self._submit(request, context, list(request.token_ids) + done, remaining, len(done))
        for ev in self._events(h, context):
            if ev[0] == "token":
                yield pb.DecodeEvent(token_id=ev[1], index=len(done) + ev[2])
            elif ev[0] == "done":
                self.runner.connector.flush()
                st = request_stats(h, self.runner.connector, self.block_token_bytes, t0)
                yield pb.DecodeEvent(token_id=0, index=0, stats=json.dumps(st))

    def Status(self, request, context):
        if self.runner is not None and self.runner.broken is not None:  # the heartbeat marks us down
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.cfg.worker_id} is down: {self.runner.broken}")
        load = self.runner.load() if self.runner is not None else {"running": self._encodes, "waiting": 0}
        return pb.WorkerStatus(worker_id=self.cfg.worker_id, role=self.cfg.role,
                               cached_images=self.cache.keys(), **load)


def build(cfg: WorkerConfig) -> tuple[WorkerService, Any]:
    """The servicer and what must be closed at shutdown (store, runner).

    Every config is built (and checked) before the store is opened; a failure after that
    closes what was opened before it raises."""
    from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
    from engine_plugin.reference import Engine, EngineConfig, ReferenceModel, model_preset

    mcfg = model_preset(cfg.model_preset)
    if cfg.role == "ve":
        return WorkerService(cfg, None, VisionEncoder(mcfg.vocab_size, seed=mcfg.seed)), None
    ccfg = ConnectorConfig(block_size=cfg.block_size, host_capacity_bytes=cfg.host_capacity_bytes)
    ecfg = EngineConfig(block_size=cfg.block_size, num_blocks=cfg.num_blocks)
    store = kvstore.connect(cfg.store_url)
    conn = None
    try:
        model = ReferenceModel(mcfg)
        conn = KVStoreConnector(model.kv_layout(), ccfg, store)
        engine = Engine(model, ecfg, connector=conn)
        runner = EngineRunner(engine, conn, step_timeout_s=cfg.step_timeout_s)
    except BaseException:
        if conn is not None:
            conn.close()
        store.close()
        raise
    return WorkerService(cfg, runner, None), (runner, conn, store)


def _register(entrypoint: str, info: pb.WorkerInfo, secret: str = "", tls: ChannelTLS = ENTRYPOINT_TLS_NONE) -> None:
    """Register with the entrypoint, sending ``secret`` (if any), over TLS for a ``grpcs://``
    address (``tls``: its files); a failure is one typed error that says what to do."""
    try:
        with open_channel(entrypoint, tls) as ch:
            pbg.EntrypointStub(ch).Register(info, timeout=10, metadata=auth.metadata(secret))
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            given = "a different worker secret" if secret else "no worker secret"
            raise InvalidRequest(f"the entrypoint at {entrypoint} refused the registration: this worker sent "
                                 f"{given}; give it the entrypoint's ({auth.SECRET_ENV} or "
                                 "--worker-secret-file)") from None
        if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
            raise InvalidRequest(f"the entrypoint at {entrypoint} refused the registration: "
                                 f"{exc.details()}") from None
        hint = unreachable_hint(exc.details() or "", tls, split_address(entrypoint)[1])
        raise StoreUnavailable(f"the entrypoint at {entrypoint} is unreachable ({exc.code().name}){hint}; "
                               "start it first or fix --entrypoint") from None


def _close(closables: Any) -> None:
    if closables:
        runner, conn, store = closables
        runner.stop()
        conn.close()
        store.close()


def serve(cfg: WorkerConfig, *, ready_out=sys.stdout) -> int:
    """Serve until SIGTERM/SIGINT. A start-up failure (a non-loopback host without a worker
    secret, a port that cannot be bound, an entrypoint that cannot be reached or refuses us)
    raises a ``KVStoreError`` after closing what was opened."""
    auth.check_listen(cfg.host, cfg.worker_secret, server="worker", warn=False)  # before anything is opened
    credentials = cfg.tls.credentials()  # the TLS files read and checked before anything is opened, too
    if cfg.entrypoint and split_address(cfg.entrypoint)[1]:
        cfg.entrypoint_tls.credentials()
    svc, closables = build(cfg)
    server = None
    try:
        server, port = make_server(futures.ThreadPoolExecutor(max_workers=16),
                                   [(svc, pb.DESCRIPTOR.services_by_name["Worker"])], cfg.host, cfg.port,
                                   interceptors=auth.server_interceptors(cfg.worker_secret),
                                   credentials=credentials)
        server.start()
        address = server_address(cfg.host, port, credentials is not None)
        info = pb.WorkerInfo(worker_id=cfg.worker_id, role=cfg.role, address=address)
        if svc.runner is not None:  # the KV namespace and block size its keys are hashed with (checked there)
            eng = svc.runner.engine
            info.kv_namespace.CopyFrom(kv_namespace_pb(eng.namespace))
            info.block_size = eng.cfg.block_size
        if cfg.entrypoint:
            _register(cfg.entrypoint, info, cfg.worker_secret, cfg.entrypoint_tls)
    except BaseException:
        if server is not None:
            server.stop(grace=0).wait()
        _close(closables)
        raise
    if not cfg.worker_secret:  # only now: a start-up error stays one line on stderr
        auth.warn_no_secret("worker")
    warn_plaintext("worker", cfg.host, credentials is not None)
    print("READY " + json.dumps({"worker_id": cfg.worker_id, "role": cfg.role, "address": address}),
          file=ready_out, flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    # Shutdown, in this order: grpc refuses new calls from now (the calls in flight have 5 s); the runner
    # then ends each request it holds UNAVAILABLE, so their calls end at once with a status the entrypoint
    # fails over on (engine_runner, "Stopping"), not cut CANCELLED at the end of the grace; the store is
    # closed last, once no handler can flush to it.
    stopped = server.stop(grace=5)
    if svc.runner is not None:
        svc.runner.stop()
    stopped.wait()
    _close(closables)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m entrypoint.worker", description="kvstack engine worker")
    ap.add_argument("--role", required=True, choices=ROLES)
    ap.add_argument("--id", default="", help="worker id (default: the role and a random suffix)")
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (beyond loopback only with a worker secret)")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one, printed in READY)")
    ap.add_argument("--store", default="./kvstack-data", help="kvstore URL (a data directory or grpc://...)")
    ap.add_argument("--model", default="tiny", help="reference model preset")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the entrypoint's)")
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks in the engine's device pool")
    ap.add_argument("--step-timeout-s", type=float, default=DEFAULT_STEP_TIMEOUT_S, metavar="S",
                    help="an engine step running longer than S seconds (hung) takes this worker down until it is "
                         "restarted; 0: never (default: %(default)g, generous: on CPU one step of a large model "
                         "can take minutes)")
    ap.add_argument("--entrypoint", default="", help="entrypoint address to register with")
    ap.add_argument("--worker-secret-file", default="", metavar="FILE",
                    help=f"file holding the entrypoint's worker secret, sent with Register and required "
                         f"of every caller (default: ${auth.SECRET_ENV}; none: loopback only, with a warning)")
    t = add_serve_args(ap, "mutual TLS: the entrypoint needs a certificate signed by this CA (its --worker-cert)")
    t.add_argument("--entrypoint-ca", default="", metavar="FILE",
                   help="CA of a grpcs:// --entrypoint's certificate (default: the system roots)")
    t.add_argument("--entrypoint-cert", default="", metavar="FILE",
                   help="client certificate for an entrypoint with --tls-client-ca")
    t.add_argument("--entrypoint-key", default="", metavar="FILE", help="the private key of --entrypoint-cert")
    try:
        a = ap.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), its one line already printed
        return int(exc.code or 0)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        cfg = WorkerConfig(role=a.role, worker_id=a.id or f"{a.role}-{uuid.uuid4().hex[:6]}", host=a.host,
                           port=a.port, store_url=a.store, model_preset=a.model, block_size=a.block_size,
                           num_blocks=a.num_blocks, step_timeout_s=a.step_timeout_s, entrypoint=a.entrypoint,
                           worker_secret=auth.load_worker_secret(a.worker_secret_file),
                           tls=ServerTLS(a.tls_cert, a.tls_key, a.tls_client_ca),
                           entrypoint_tls=ChannelTLS(a.entrypoint_ca, a.entrypoint_cert, a.entrypoint_key,
                                                     names=ENTRYPOINT_TLS_NONE.names))
        return serve(cfg)
    except StoreUnavailable as exc:  # not a usage error: the same command may work later
        return fail(ap.prog, exc, code=1)
    except (kvstore.KVStoreError, OSError) as exc:
        return fail(ap.prog, exc)


if __name__ == "__main__":
    sys.exit(main())
