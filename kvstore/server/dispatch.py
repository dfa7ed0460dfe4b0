"""The per-call steps every RPC of the daemon takes, around its handler.

Who uses it: ``kvstore.server.service.Daemon`` wraps each handler of its method tables
(``Method``: request type, handler, admin-only or not) with ``Dispatcher.unary``,
``Dispatcher.reply_stream`` or ``Dispatcher.request_stream`` and registers the result
with gRPC (``Dispatcher.generic_handler``).

Per call, in this order (each step for its reason):
  1. Authenticate the bearer token (before parsing: an anonymous caller gets no
     parser work done for it) and check admin-only methods.
  2. Parse the raw request bytes here (``request_deserializer=None``), so a
     malformed message, bad UTF-8 included, is INVALID_ARGUMENT, not gRPC's
     generic "exception deserializing request".
  3. Admit the call through the ``Limiter`` (RESOURCE_EXHAUSTED when full). This runs on a
     handler thread, so ``max_concurrent_requests < workers`` (checked) keeps threads free to
     answer refusals and health checks while admitted calls (a stalled stream) hold theirs.
  4. Call the handler. Handlers validate client keys (16 bytes) *before* mapping them to
     the tenant's stored keys, then call the store, which validates everything else before
     writing anything, so a bad batch stores nothing.
  5. A ``KVStoreError`` becomes a status + trailing metadata (``wire``); any
     other exception is a bug: INTERNAL, logged with its traceback. Every call is
     counted in the metrics with its status.

Every method is registered with gRPC as taking a request *stream*, unary ones included (the
wire is the same: a unary client sends its one message): gRPC reads a unary request's message
on a handler thread before calling the handler, so a call whose message never comes would hold
that thread with no token checked and no bound; taken as a stream, the call is authenticated and
admitted first, and its one message is awaited for at most ``stream_receive_s``.

The two streaming forms take the same steps. A reply stream's handler is a generator of
encoded messages; its admission slot is held until it ends, and the call is cut when none
of its messages can be sent for ``stream_send_s`` (``Watchdog``). A request stream is
admitted, then every message is received and parsed (bounded by ``max_batch_items``, in
total bytes by ``max_message_bytes``, and in time by ``stream_receive_s``) before the
handler sees the list; a stream short of the item count its client declared
(``wire.MD_STREAM_ITEMS``) is a client that went away, and nothing of it is applied.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Callable, Generator, Iterator

import grpc
from google.protobuf.message import DecodeError

from kvstore.auth import Tenant, TokenTable, require_admin
from kvstore.errors import InternalError, InvalidRequest, KVStoreError
from kvstore.server.admission import Limiter
from kvstore.server.checks import BatchLimit
from kvstore.server.config import ServerConfig
from kvstore.server.metrics import DaemonMetrics
from kvstore.server.watchdog import Watchdog
from kvstore.errors import RequestTooLarge
from kvstore.wire import INDEX_KEY_METHODS, MD_INDEX_KEYS, MD_STREAM_ITEMS, details_of, status_of

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Method:
    """One RPC: its request message type, its handler ``(request, tenant) -> reply``, and
    whether only an admin tenant may call it (checked in step 1)."""

    request: type
    handler: Callable[[Any, Tenant], Any]
    admin: bool = False


class ClientGone(Exception):
    """A request stream that ended short: fewer items than its client declared, or a cancelled call."""


def _cut(context: grpc.ServicerContext, why: str) -> Callable[[], None]:
    """A stream bound's action (``Watchdog.arm``): say why, then cancel the call."""
    def fire() -> None:
        log.warning("%s: cancelling the call from %s", why, context.peer())
        context.cancel()
    return fire


def _serialize(msg: Any) -> bytes:
    """Reply serializer: hand-encoded replies (``wire.encode_*``) are bytes already."""
    return msg if isinstance(msg, bytes) else msg.SerializeToString()


class Dispatcher:
    """Steps 1-5 (module docstring) for every call, over the parts the daemon hands it."""

    def __init__(self, cfg: ServerConfig, tokens: TokenTable, limiter: Limiter, metrics: DaemonMetrics,
                 watchdog: Watchdog, batch: BatchLimit) -> None:
        self.cfg = cfg
        self.tokens = tokens
        self.limiter = limiter
        self.metrics = metrics
        self.watchdog = watchdog
        self.batch = batch

    def generic_handler(self, service: str, unary: dict[str, Method], reply_streams: dict[str, Method],
                        request_streams: dict[str, Method]) -> grpc.GenericRpcHandler:
        """One gRPC handler for ``service``: every method of the three tables, wrapped in the steps."""
        # Unary requests taken as streams of one message (module docstring).
        handlers = {name: grpc.stream_unary_rpc_method_handler(
            self.unary(name, m), request_deserializer=None,
            response_serializer=_serialize) for name, m in unary.items()}
        for name, m in reply_streams.items():  # the handlers yield encoded messages
            handlers[name] = grpc.stream_stream_rpc_method_handler(
                self.reply_stream(name, m), request_deserializer=None, response_serializer=None)
        for name, m in request_streams.items():
            handlers[name] = grpc.stream_unary_rpc_method_handler(
                self.request_stream(name, m), request_deserializer=None, response_serializer=_serialize)
        return grpc.method_handlers_generic_handler(service, handlers)

    # ------------------------------------------------------------------ the three call shapes
    def unary(self, name: str, m: Method) -> Callable[[Iterator[bytes], grpc.ServicerContext], Any]:
        def behaviour(raws: Iterator[bytes], context: grpc.ServicerContext) -> Any:
            with self._guarded(name, context):
                tenant = self._tenant(name, m, context)
                with self._admitted(tenant):
                    req = self._parse(name, m, self._receive_one(name, raws, context))
                    return m.handler(req, tenant)

        return behaviour

    def reply_stream(self, name: str, m: Method) -> Callable[[Iterator[bytes], grpc.ServicerContext], Iterator[bytes]]:
        """Server streaming: the handler is a generator of encoded messages; the slot is held until it ends."""
        def behaviour(raws: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
            with self._guarded(name, context):
                tenant = self._tenant(name, m, context)
                with self._admitted(tenant):
                    req = self._parse(name, m, self._receive_one(name, raws, context))
                    yield from self._send_bound(name, m.handler(req, tenant), context)

        return behaviour

    def request_stream(self, name: str, m: Method) -> Callable[[Iterator[bytes], grpc.ServicerContext], Any]:
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
                    with self._receive_bound(name, context):
                        reqs = self._receive(name, m, raws, declared, context)
                    return m.handler(reqs, tenant)

        return behaviour

    # ------------------------------------------------------------------ the steps
    @contextmanager
    def _guarded(self, name: str, context: grpc.ServicerContext) -> Iterator[None]:
        """Step 5 and the metrics of one call: typed errors to status + metadata, the rest INTERNAL."""
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
            if isinstance(exc, ClientGone) or (isinstance(exc, grpc.RpcError) and not context.is_active()):
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

    def _tenant(self, name: str, m: Method, context: grpc.ServicerContext) -> Tenant:
        """Step 1; and ``MD_INDEX_KEYS`` (only on ``INDEX_KEY_METHODS``): an admin's keys are
        then index keys, stored as sent (``AdminCalls.inspect``'s rule)."""
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
    def _parse(name: str, m: Method, raw: bytes) -> Any:
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

    # ------------------------------------------------------------------ stream bounds
    def _receive_one(self, name: str, raws: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """A unary call's one request message, awaited for at most ``stream_receive_s``."""
        with self._receive_bound(name, context):
            raw = next(raws, None)
        if raw is None:
            if not context.is_active():
                raise ClientGone(f"{name}: the call ended before its request came")
            raise InvalidRequest(f"a {name} call without its request message")
        return raw

    @contextmanager
    def _receive_bound(self, name: str, context: grpc.ServicerContext) -> Iterator[None]:
        """Cancel the call if it is still receiving after ``stream_receive_s`` (0: no bound)."""
        if not self.cfg.stream_receive_s:
            yield
            return
        token = object()
        self.watchdog.arm(token, self.cfg.stream_receive_s, _cut(
            context, f"{name} not wholly received within stream_receive_s = {self.cfg.stream_receive_s:g} s"))
        try:
            yield
        finally:
            self.watchdog.disarm(token)

    def _send_bound(self, name: str, msgs: Generator[bytes, None, None],
                    context: grpc.ServicerContext) -> Iterator[bytes]:
        """``msgs``, the call cancelled when none of them can be sent for ``stream_send_s`` (0: no
        bound). gRPC resumes this generator once HTTP/2 flow control has let the message it yielded
        out, so the wait is armed over each ``yield`` alone: reading the store does not count. Flow
        control reopens a window at a time, not per message the client takes: a client reading
        less than one window per ``stream_send_s`` is cut as well, though it reads. The window is
        the client's (64 KiB, or grown by BDP probing): a stream that fits in it just ends."""
        if not self.cfg.stream_send_s:
            yield from msgs
            return
        token, cut = object(), _cut(context, f"{name} could send nothing for stream_send_s = "
                                             f"{self.cfg.stream_send_s:g} s (its client stopped reading, or reads "
                                             "less than one flow-control window in that time)")
        try:
            for msg in msgs:
                self.watchdog.arm(token, self.cfg.stream_send_s, cut)
                yield msg
                self.watchdog.disarm(token)
        finally:
            self.watchdog.disarm(token)
            msgs.close()  # cut or gone: the handler's own cleanup runs now, as ``yield from`` would

    def _receive(self, name: str, m: Method, raws: Iterator[bytes], declared: int | None,
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
            self.batch(len(reqs), name)
        if (declared is not None and len(reqs) != declared) or not context.is_active():
            raise ClientGone(f"{len(reqs)} of {'?' if declared is None else declared} items received")
        return reqs

    def _declared_items(self, name: str, context: grpc.ServicerContext) -> int | None:
        """The item count a stream's client declared (``MD_STREAM_ITEMS``), checked against
        ``max_batch_items`` before any item is read; None when it declared none."""
        raw = dict(context.invocation_metadata()).get(MD_STREAM_ITEMS)
        if raw is None:
            return None
        if not (isinstance(raw, str) and raw.isascii() and raw.isdigit()):
            raise InvalidRequest(f"{name}: metadata {MD_STREAM_ITEMS}={raw!r} is not a count of items")
        self.batch(int(raw), name)
        return int(raw)
