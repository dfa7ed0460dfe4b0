"""``Transport``: one daemon's gRPC channel and how every call of a client goes over it.

``kvstore.client.remote.RemoteStore`` owns one and hands it to its parts (``kvstore.client.puts``,
``kvstore.client.lookups``, ``kvstore.client.admin``, the direct read and write paths), which
make every call through it. It holds:

* the channel (TLS decided by the URL scheme: ``kvstore.client.options``), the stub, and
  the raw callables of the hand-encoded messages (``Put``, ``PutStream``, ``GetStream``;
  values are encoded once, by ``kvstore.wire``, not by protobuf);
* the call options: the bearer token's metadata and each call's deadline (``timeout_s``;
  a caller passes ``maintenance_timeout_s`` for whole-store passes);
* error mapping: every failed call raises a ``kvstore.errors`` class
  (``kvstore.wire.error_from_rpc``), and once ``close`` ran, a call cut off by it, or made
  after it, raises ``StoreClosed``, never gRPC's own errors;
* batching: a batch goes in consecutive pieces of at most ``batch_items`` items
  (``each_piece``). That starts at the ``max_batch_items`` option and is lowered, for good,
  to the daemon's own limit when the daemon refuses a piece with ``BatchTooLarge``
  naming it (``learn``); the refused piece stored nothing, so it and the rest are re-split
  and sent, once per batch call. The option stays an upper bound.

Reconnecting is gRPC's: the channel's backoff is capped at 1 s, so a call made more than
about a second after the daemon is back succeeds.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Callable, Iterator, Sequence

import grpc

from kvstore.api import EntryKind
from kvstore.client.options import ClientOptions, parse_address, refuse_tls_options
from kvstore.errors import BatchTooLarge, InternalError, KVStoreError, StoreClosed, StoreUnavailable
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.tls import channel_credentials
from kvstore.wire import MD_STREAM_ITEMS, EncodedPut, error_from_rpc

log = logging.getLogger("kvstore.client.remote")

_SERVICE = "/kvstore.v1.KVStore/"


class Transport:
    """The calls of one client to the daemon at ``url`` (module docstring). Thread-safe.

    ``InvalidRequest`` before any channel is opened for a bad URL, or for TLS options with
    a ``grpc://`` URL (unless ``options.grpcs_in_set``).
    """

    def __init__(self, url: str, options: ClientOptions):
        self.url = url
        self.address, tls = parse_address(url)
        self.options = o = options
        if not tls:
            refuse_tls_options(url, o)  # before opening anything
        opts = [("grpc.max_receive_message_length", o.max_message_bytes),
                ("grpc.max_send_message_length", o.max_message_bytes),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000)]
        if tls and o.server_name:
            opts.append(("grpc.ssl_target_name_override", o.server_name))
        if tls:  # the scheme alone decides; without ca_file, gRPC verifies against the system roots
            creds = channel_credentials(o.ca_file, o.cert_file, o.key_file)
            self._channel = grpc.secure_channel(self.address, creds, options=opts)
        else:
            self._channel = grpc.insecure_channel(self.address, options=opts)
        self.stub = pb_grpc.KVStoreStub(self._channel)
        # Raw-bytes callables for the hand-encoded requests (no request serializer: already bytes).
        self._put_raw = self._channel.unary_unary(_SERVICE + "Put", response_deserializer=pb.PutReply.FromString)
        self._get_stream = self._channel.unary_stream(
            _SERVICE + "GetStream", request_serializer=pb.GetManyRequest.SerializeToString,
            response_deserializer=pb.GetChunk.FromString)
        self._put_stream = self._channel.stream_unary(_SERVICE + "PutStream",
                                                      response_deserializer=pb.PutManyReply.FromString)
        self.md: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {o.token}"),) if o.token else ()
        self._closed = False
        self._lock = threading.Lock()
        # Items per batch call: the option, lowered to the daemon's max_batch_items once a
        # refusal told it (``learn``); only ever lowered, so pieces never grow past the option.
        self._batch_items = o.max_batch_items

    # ------------------------------------------------------------------ open, closed
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> bool:
        """Close the channel; True for the call that closed it, False once closed."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._channel.close()
            return True

    @staticmethod
    def closed_error() -> StoreClosed:
        return StoreClosed("this store is closed; open a new one with kvstore.connect")

    def check_open(self) -> None:
        """``StoreClosed`` after ``close``: every call checks first, an empty batch included."""
        if self._closed:
            raise self.closed_error()

    def raise_if_closed(self, err: Exception) -> None:
        """``StoreClosed`` when closed under a call and ``err`` is not a typed error."""
        if self._closed and not isinstance(err, KVStoreError):
            raise self.closed_error() from err

    def guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a direct-read or direct-write step: once this client is closed, a
        failure there (its workers stopped under it, its channel gone) is ``StoreClosed``."""
        try:
            return fn(*args)
        except StoreUnavailable as exc:
            if self._closed:
                raise self.closed_error() from exc
            raise
        except Exception as exc:
            self.raise_if_closed(exc)  # StoreClosed and the other typed errors pass through
            raise

    # ------------------------------------------------------------------ calls and their errors
    def typed(self, err: grpc.RpcError, where: str, timeout: float | None = None) -> KVStoreError:
        """``error_from_rpc``, except that a call cut off because this client was closed
        (cancelled, or its channel gone: ``StoreUnavailable``) is ``StoreClosed``. An error the
        daemon sent (typed in its metadata) stays what it is."""
        exc = error_from_rpc(err, where, timeout)
        return self.closed_error() if self._closed and isinstance(exc, StoreUnavailable) else exc

    @contextlib.contextmanager
    def typed_errors(self, where: str, timeout: float | None = None) -> Iterator[None]:
        """Within it, a failed call raises its ``kvstore.errors`` class (``typed``, named
        ``where``), and a call that ``close`` raced raises ``StoreClosed``."""
        try:
            yield
        except grpc.RpcError as err:
            raise self.typed(err, where, timeout) from err
        except ValueError as err:  # gRPC: "Cannot invoke RPC: Channel closed!" (close() raced this call)
            self.raise_if_closed(err)
            raise

    def call(self, method: str, req: Any, timeout_s: float | None = None, fn: Any = None,
             md: tuple[tuple[str, str], ...] = ()) -> Any:
        """The unary ``method`` (the stub's, or ``fn``) with ``req``; its answer, or a typed error."""
        self.check_open()
        timeout = timeout_s or self.options.timeout_s
        with self.typed_errors(f"{method} on {self.url}", timeout):
            return (fn or getattr(self.stub, method))(req, timeout=timeout, metadata=(*self.md, *md) or None)

    def stream(self, method: str, run: Callable[[], Any]) -> Any:
        """``run()``, a streaming call (invoking it and reading its answer), typed as ``call``."""
        self.check_open()
        with self.typed_errors(f"{method} on {self.url}"):
            return run()

    def put(self, enc: EncodedPut) -> bool:
        """One encoded put (``Put``): its ``created`` flag."""
        return self.call("Put", enc.message(), fn=self._put_raw).created

    def put_stream(self, encs: Sequence[EncodedPut]) -> list[bool]:
        """One ``PutStream`` of ``encs``, its ``created`` flags in order. Each item is encoded as
        gRPC asks for it (the next one is built while this one is sent); the count is declared
        (``MD_STREAM_ITEMS``), so a stream cut short (this process dies, the call is cancelled)
        stores nothing instead of its first items."""
        md = (*self.md, (MD_STREAM_ITEMS, str(len(encs))))
        reply = self.stream("PutStream", lambda: self._put_stream(
            (e.message() for e in encs), timeout=self.options.timeout_s, metadata=md))
        return self.check_count("PutStream", list(reply.created), len(encs))

    def get_stream(self, keys: list[bytes], k: EntryKind) -> list[bytes | None]:
        """One ``GetStream`` of validated ``keys``: per key its value, ``None`` when absent."""
        req = pb.GetManyRequest(keys=keys, kind=k.value)

        def run() -> list[bytes | None]:
            out: list[bytes | None] = []
            for c in self._get_stream(req, timeout=self.options.timeout_s, metadata=self.md or None):
                if c.index != len(out):
                    raise InternalError(f"GetStream sent index {c.index} at position {len(out)} (a kvstore bug)")
                out.extend(v.value if v.found else None for v in c.values)
            return self.check_count("GetStream", out, len(keys))

        return self.stream("GetStream", run)

    @staticmethod
    def check_count(method: str, got: list, want: int) -> list:
        if len(got) != want:
            raise InternalError(f"{method} answered {len(got)} results for {want} items (a kvstore bug)")
        return got

    # ------------------------------------------------------------------ batches in pieces
    @property
    def batch_items(self) -> int:
        """Items per batch call now (module docstring)."""
        return self._batch_items

    def pieces(self, n: int, off: int = 0) -> list[slice]:
        """Items ``off:n`` of a batch as consecutive pieces of at most ``batch_items``."""
        size = self._batch_items
        return [slice(o, min(o + size, n)) for o in range(off, n, size)]

    def each_piece(self, n: int, send: Callable[[slice], Any], *,
                   check: Callable[[list[slice]], None] | None = None) -> Iterator[tuple[slice, Any]]:
        """A batch of ``n`` items as consecutive pieces of at most ``batch_items``, in order:
        yields ``(piece, send(piece))``; the caller may stop early (``lookup``, ``probe``).

        ``check(pieces)`` runs on the pieces before the first is sent (and again on the rest,
        re-split, after a refusal). A piece the daemon refuses as over its ``max_batch_items``
        (``BatchTooLarge``: nothing of it was applied) teaches this client the daemon's limit
        (``learn``); that piece and the rest are then re-split and sent. Once per call: a
        second refusal, or one that says nothing new, is raised.
        """
        self.check_open()
        off, retried = 0, False
        while off < n:
            pieces = self.pieces(n, off)
            if check is not None:
                check(pieces)
            for p in pieces:
                try:
                    got = send(p)
                except BatchTooLarge as exc:
                    if retried or not self.learn(exc, p.stop - p.start):
                        raise
                    retried = True
                    break  # re-split from p.start (== off) with the learned limit
                off = p.stop
                yield p, got

    def learn(self, exc: BatchTooLarge, sent: int) -> bool:
        """Lower ``batch_items`` to the daemon's limit from its refusal of a ``sent``-item
        piece. False (the caller raises ``exc``) when the refusal names no usable limit, i.e.
        none below what was sent (no limit at all, or one that changed under us)."""
        if not 0 < exc.limit < sent:
            return False
        with self._lock:
            if exc.limit < self._batch_items:
                log.info("%s refused a %d-item batch (max_batch_items=%d); sending batches of at most %d",
                         self.url, sent, exc.limit, exc.limit)
                self._batch_items = exc.limit
        return True
