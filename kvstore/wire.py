"""What crosses the wire: error mapping and record conversion, shared by daemon and clients.

Errors
------
The daemon answers a ``KVStoreError`` with the gRPC status in ``STATUS_BY_CODE``
and trailing metadata ``kvstore-error-code`` (the class's ``code``); for
``Unrecoverable`` also ``kvstore-error-key`` (hex) and
``kvstore-failed-targets`` (comma list); for ``BatchTooLarge`` (code
``INVALID_REQUEST``: it is an ``InvalidRequest``) also ``kvstore-max-batch-items``,
the daemon's limit, from which ``kvstore.client.transport`` learns how to split; for a
``CapacityExceeded`` raised by a GC pass also ``kvstore-gc-result``, the pass's counts (JSON).
The classes themselves live in ``kvstore.errors``. ``error_from_rpc`` on the client
rebuilds the same class with the same message (the wire's own refusals, ``Unauthenticated``,
``ServerBusy`` and ``PermissionDenied``, with the call and daemon URL appended: which shard).
A status without the metadata (the daemon is down, gRPC refused an oversized message, a deadline passed) is
mapped by ``ERRORS_BY_STATUS``: UNAVAILABLE and DEADLINE_EXCEEDED become
``StoreUnavailable``, so "daemon down" is one retryable type for callers (a
failed TLS handshake too: gRPC reports it as UNAVAILABLE; the message then
says to check ``ca_file`` and the URL scheme). DEADLINE_EXCEEDED is its
subclass ``DeadlineExceeded``, whose message names the call's deadline.

Conversions never trust the wire: kinds, layouts and keys are validated by the
store itself (``InvalidRequest`` -> INVALID_ARGUMENT).

Hand encoders
-------------
The messages that carry multi-MiB values (``PutRequest``, ``GetReply``,
``GetChunk``) are *encoded* here by hand, never decoded: building a upb message
copies the value into its arena and ``SerializeToString`` copies it again,
while ``b"".join((head, value, tail))`` copies it once. The output is the
canonical protobuf encoding, byte for byte what ``SerializeToString`` gives
(fields in number order, proto3 defaults left out; tests compare the two), so
any protobuf peer reads it. Decoding stays with upb, which validates::

    PutRequest: [0a len key] [12 len value] [1a len kind] [21 f64 ttl_s]
                [2a len Layout{0a len dtype, 12 len packed shape}] [30 varint tokens]
    GetReply:   [0a len value] [12 len Layout] [18 varint tokens] [22 len kind]
    GetChunk:   [08 varint index] then per value [12 len MaybeValue{08 01 found, 12 len value}]

A client's put (``encode_item`` -> ``EncodedPut``) is validated as the embedded store
validates it, then encoded this way, so a bad item is refused before anything is sent.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Any, Sequence

import grpc

from kvstore.api import EntryKind, Layout, PutItem, as_payload, check_put_fields, check_put_item
from kvstore.config import MAX_TTL_S
from kvstore.errors import (
    ERRORS_BY_CODE,
    BatchTooLarge,
    CapacityExceeded,
    DeadlineExceeded,
    InvalidRequest,
    KVStoreError,
    PermissionDenied,
    RequestTooLarge,
    ServerBusy,
    StaleDescribe,
    StoreUnavailable,
    Unauthenticated,
    Unrecoverable,
)
from kvstore.keys import check_key
from kvstore.proto import kvstore_pb2 as pb
from kvstore.tls import failure_kind

MD_CODE = "kvstore-error-code"
MD_KEY = "kvstore-error-key"
MD_TARGETS = "kvstore-failed-targets"
MD_BATCH_LIMIT = "kvstore-max-batch-items"
MD_GC_RESULT = "kvstore-gc-result"  # a CapacityExceeded's ``result`` (the GC pass's counts), as JSON
MD_CREATED = "kvstore-created"  # a CapacityExceeded's ``created``: one "1" or "0" per item of the call
# Request metadata of a PutStream: how many items the client sends. gRPC's server cannot tell a
# client's cancel from its end of stream when the cancel lands while the daemon waits for the next
# message (both end the request iterator); with the count declared, a short stream is a client
# that went away, and nothing of it is stored.
MD_STREAM_ITEMS = "kvstore-stream-items"
# Request metadata of Delete/DeleteMany ("1"): keys named as ``Inspect`` names them -- an admin
# tenant's are index keys (as ``Check`` and kvtool on a data directory print them), any other
# tenant's its own keys. ``kvtool delete`` sends it, so it deletes what ``kvtool inspect`` shows.
MD_INDEX_KEYS = "kvstore-index-keys"
INDEX_KEY_METHODS = frozenset({"Delete", "DeleteMany"})


# code -> class, the store's errors plus the wire's own.
WIRE_ERRORS: dict[str, type[KVStoreError]] = {
    **ERRORS_BY_CODE,
    **{c.code: c for c in (RequestTooLarge, ServerBusy, Unauthenticated, PermissionDenied, StaleDescribe)},
}

STATUS_BY_CODE: dict[str, grpc.StatusCode] = {
    "KVSTORE_ERROR": grpc.StatusCode.UNKNOWN,
    "INVALID_REQUEST": grpc.StatusCode.INVALID_ARGUMENT,
    "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
    "UNRECOVERABLE": grpc.StatusCode.DATA_LOSS,
    "CORRUPT_DATA": grpc.StatusCode.DATA_LOSS,
    "INCOMPATIBLE_FORMAT": grpc.StatusCode.FAILED_PRECONDITION,
    "CAPACITY_EXCEEDED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
    "CLOSED": grpc.StatusCode.UNAVAILABLE,
    "INTERNAL": grpc.StatusCode.INTERNAL,
    "REQUEST_TOO_LARGE": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "BUSY": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
    "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
    "STALE_DESCRIBE": grpc.StatusCode.ABORTED,
}

# gRPC status without kvstore metadata -> the class the client raises.
ERRORS_BY_STATUS: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.UNAVAILABLE: StoreUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: StoreUnavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: RequestTooLarge,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}


def status_of(exc: KVStoreError) -> tuple[grpc.StatusCode, tuple[tuple[str, str], ...]]:
    """The gRPC status and trailing metadata that carry ``exc``."""
    code = getattr(exc, "code", "KVSTORE_ERROR")
    md: list[tuple[str, str]] = [(MD_CODE, code)]
    if isinstance(exc, Unrecoverable):
        md += [(MD_KEY, exc.key.hex()), (MD_TARGETS, ",".join(exc.failed_targets))]
    if isinstance(exc, BatchTooLarge) and exc.limit > 0:
        md.append((MD_BATCH_LIMIT, str(exc.limit)))
    if isinstance(exc, CapacityExceeded) and exc.result is not None:
        md.append((MD_GC_RESULT, json.dumps(exc.result, default=str)))
    if isinstance(exc, CapacityExceeded) and exc.created is not None:
        md.append((MD_CREATED, "".join("1" if c else "0" for c in exc.created)))
    return STATUS_BY_CODE.get(code, grpc.StatusCode.UNKNOWN), tuple(md)


MAX_DETAILS = 2000  # UTF-8 bytes of an error message sent as a call's details


def details_of(exc: BaseException, prefix: str = "") -> str:
    """``prefix + str(exc)``, cut to ``MAX_DETAILS`` UTF-8 bytes: a message may quote the
    request (a kind or layout of 20,000 characters), and details over gRPC's 16 KiB metadata
    limit lose the whole status, typed error code included. gRPC percent-encodes non-ASCII
    bytes (3 characters each), so the bound is on bytes: at most 6,000 characters on the wire."""
    text = prefix + str(exc)
    raw = text.encode("utf-8", "replace")
    if len(raw) <= MAX_DETAILS:
        return text
    return raw[: MAX_DETAILS - 40].decode("utf-8", "ignore") + f"... ({len(text)} characters)"


def error_from_rpc(err: grpc.RpcError, where: str = "", timeout_s: float | None = None) -> KVStoreError:
    """The typed error a failed call stands for (the caller raises it ``from err``);
    ``timeout_s``, the call's deadline, is named in a ``DeadlineExceeded``'s message."""
    md: dict[str, Any] = {}
    try:
        md = {k: v for k, v in (err.trailing_metadata() or ())}
    except Exception:  # a channel-level failure may have no metadata at all
        md = {}
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    cls = WIRE_ERRORS.get(md.get(MD_CODE, ""))
    if cls is Unrecoverable:
        targets = tuple(t for t in md.get(MD_TARGETS, "").split(",") if t)
        return Unrecoverable(details, key=bytes.fromhex(md.get(MD_KEY, "")), failed_targets=targets)
    if cls is InvalidRequest and _batch_limit(md.get(MD_BATCH_LIMIT)):
        return BatchTooLarge(details, limit=_batch_limit(md.get(MD_BATCH_LIMIT)))
    if cls is CapacityExceeded:
        created = md.get(MD_CREATED)
        return CapacityExceeded(details, result=_gc_result(md.get(MD_GC_RESULT)),
                                created=None if created is None else [c == "1" for c in created])
    if cls in (Unauthenticated, ServerBusy, PermissionDenied, StaleDescribe) and where:  # no store message to keep
        return cls(f"{details} ({where})")  # word for word: say which daemon refused (one shard of a set)
    if cls is not None:
        return cls(details)
    status = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    cls = ERRORS_BY_STATUS.get(status, KVStoreError)
    prefix = f"{where}: " if where else ""
    if cls is DeadlineExceeded:
        within = f"within {timeout_s:g} s" if timeout_s else "within the call's deadline"
        return DeadlineExceeded(f"{prefix}no answer from the kvstore daemon {within} ({status.name}); "
                                "it may be hung, overloaded or still working on the call")
    if cls is StoreUnavailable:
        hint = {"handshake": TLS_HINT, "closed": CLOSED_HINT}.get(failure_kind(details), "")
        return StoreUnavailable(f"{prefix}kvstore daemon unreachable ({status.name}: {details}){hint}")
    if cls is RequestTooLarge:
        return RequestTooLarge(
            f"{prefix}{details}; raise max_message_bytes on both the daemon and the client, "
            "or send smaller batches"
        )
    return cls(f"{prefix}{status.name}: {details}")


# A daemon that closes the connection at once: most often TLS on one side only, or a
# daemon requiring client certificates (mutual TLS) that got none; said as a possibility.
CLOSED_HINT = ("; the daemon closed the connection: if it serves TLS use grpcs://, and if it requires "
               "client certificates give cert_file and key_file")
TLS_HINT = ("; the TLS handshake failed: the daemon's certificate must be signed by ca_file (without ca_file, "
            "by a CA in the system roots), and grpcs:// is only for a TLS daemon")


def _gc_result(raw: Any) -> dict | None:
    """A ``MD_GC_RESULT`` value: the counts dict, or None when absent or not a JSON object."""
    try:
        got = json.loads(raw) if isinstance(raw, str) else None
    except ValueError:
        return None
    return got if isinstance(got, dict) else None


def _batch_limit(raw: Any) -> int:
    """``MD_BATCH_LIMIT``'s value as a positive int; 0 when absent or not one (never trusted blindly)."""
    if isinstance(raw, bytes):
        raw = raw.decode("ascii", "replace")
    if isinstance(raw, str) and raw.isascii() and raw.isdigit() and 0 < int(raw) <= 2**31:
        return int(raw)
    return 0


def layout_to_pb(layout: Layout, msg: pb.Layout) -> None:
    msg.dtype = layout.dtype
    msg.shape.extend(layout.shape)


def layout_from_pb(msg: pb.Layout) -> Layout:
    return Layout(msg.dtype, tuple(int(d) for d in msg.shape))


def kind_or_default(kind: str) -> str:
    return kind or "block"


# ---------------------------------------------------------------------- hand encoders
def _varint(n: int) -> bytes:
    """Protobuf varint of ``n``; a negative int64 is its 64-bit two's complement (10 bytes)."""
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _len_field(tag: int, data: bytes) -> bytes:
    """A length-delimited field, left out when empty (proto3 default)."""
    return bytes((tag,)) + _varint(len(data)) + data if data else b""


def _layout_bytes(layout: Layout) -> bytes:
    shape = b"".join(_varint(int(d)) for d in layout.shape)
    return _len_field(0x0A, layout.dtype.encode()) + _len_field(0x12, shape)


def put_parts(key: bytes, value_len: int, kind: str, ttl_s: float | None, layout: Layout,
              tokens: int) -> tuple[bytes, bytes]:
    """``(head, tail)`` of an encoded ``PutRequest``: the message is ``head + value + tail``.

    ``layout`` is always sent; ``ttl_s`` only when set.
    """
    head = _len_field(0x0A, key) + (b"\x12" + _varint(value_len) if value_len else b"")
    tail = _len_field(0x1A, kind.encode())
    if ttl_s is not None:
        tail += b"\x21" + struct.pack("<d", float(ttl_s))
    tail += b"\x2a" + _varint(len(lb := _layout_bytes(layout))) + lb
    if tokens:
        tail += b"\x30" + _varint(tokens)
    return head, tail


def encode_get_reply(value: Any, layout: Layout, tokens: int, kind: str) -> bytes:
    """An encoded ``GetReply`` (``layout`` always sent, as ``layout_to_pb`` into a set field does)."""
    lb = _layout_bytes(layout)
    parts = [b"\x0a" + _varint(len(value)), value] if len(value) else []
    parts.append(b"\x12" + _varint(len(lb)) + lb)
    if tokens:
        parts.append(b"\x18" + _varint(tokens))
    parts.append(_len_field(0x22, kind.encode()))
    return b"".join(parts)


def encode_maybe_value(value: Any | None) -> list[Any]:
    """The parts of one encoded ``GetChunk.values`` element (a ``MaybeValue``; None: not found)."""
    if value is None:
        return [b"\x12\x00"]
    if not len(value):
        return [b"\x12\x02\x08\x01"]
    inner = b"\x08\x01\x12" + _varint(len(value))
    return [b"\x12" + _varint(len(inner) + len(value)) + inner, value]


def encode_get_chunk(index: int, values: Sequence[Any | None]) -> bytes:
    """An encoded ``GetChunk``: ``values[j]`` answers key ``index + j`` (None: not found)."""
    parts: list[Any] = [b"\x08" + _varint(index)] if index else []
    for v in values:
        parts += encode_maybe_value(v)
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class EncodedPut:
    """One validated put, encoded as ``head + value + tail`` (a ``PutRequest``; ``wire.put_parts``),
    and ``item``, the put as validated: its key ``bytes`` and its kind an ``EntryKind``, the
    other fields as the caller gave them (what a direct write encodes itself)."""

    head: bytes
    value: memoryview
    tail: bytes
    item: PutItem

    @property
    def nbytes(self) -> int:
        return len(self.head) + self.value.nbytes + len(self.tail)

    def message(self) -> bytes:
        return b"".join((self.head, self.value, self.tail))  # the one copy of the value


def encode_item(it: PutItem) -> EncodedPut:
    """Validate one put client-side, as the embedded store does before writing, and encode it."""
    key = check_key(check_put_item(it).key)
    kind = EntryKind.parse(it.kind)
    mv, layout = as_payload(it.value, it.layout)
    check_put_fields(it.ttl_s, it.tokens, MAX_TTL_S)
    head, tail = put_parts(key, mv.nbytes, kind.value, it.ttl_s, layout, it.tokens)
    return EncodedPut(head, mv, tail, PutItem(key, it.value, kind, it.ttl_s, it.layout, it.tokens))


def fitting_runs(encs: Sequence[EncodedPut], limit: int) -> list[slice]:
    """``encs`` as consecutive runs whose ``nbytes`` (each item one PutStream message) add up to
    at most ``limit`` each, in order (one run when they all fit together; an item over ``limit``
    alone is a run of its own, for the sender to refuse). ``kvstore.client.puts`` sends a
    direct-write piece that falls back to gRPC so."""
    runs: list[slice] = []
    start, total = 0, 0
    for i, e in enumerate(encs):
        size = e.nbytes
        if i > start and total + size > limit:
            runs.append(slice(start, i))
            start, total = i, 0
        total += size
    if start < len(encs):
        runs.append(slice(start, len(encs)))
    return runs


def check_message_bytes(encs: Sequence[EncodedPut], batch: int, limit: int) -> None:
    """``RequestTooLarge`` when these encoded puts (of a ``put_many`` of ``batch`` items) are over
    a client's ``max_message_bytes`` (``limit``) together, each counted as its ``nbytes``."""
    total = sum(e.nbytes for e in encs)
    if total > limit:
        what = f"put_many of {len(encs)} items" if len(encs) == batch else (
            f"a {len(encs)}-item piece of a put_many of {batch} items")
        raise RequestTooLarge(f"{what} ({total} bytes) is over this client's max_message_bytes={limit}; "
                              "raise max_message_bytes on both the daemon and the client, or send smaller batches")


def check_value_sizes(encs: Sequence[EncodedPut], limit: int | None) -> None:
    """The embedded store's ``InvalidRequest`` (its message word for word) for the
    first value over ``limit`` (a daemon's ``max_value_bytes``; ``None``: unknown, no check)."""
    if not limit:
        return
    for e in encs:
        if e.value.nbytes > limit:
            raise InvalidRequest(f"value of {e.value.nbytes} bytes is over max_value_bytes={limit}; "
                                 "split it or raise the limit in the store config")
