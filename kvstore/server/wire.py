"""What crosses the wire: error mapping and record conversion, shared by daemon and clients.

Errors
------
The daemon answers a ``KVStoreError`` with the gRPC status in ``STATUS_BY_CODE``
and trailing metadata ``kvstore-error-code`` (the class's ``code``); for
``Unrecoverable`` also ``kvstore-error-key`` (hex) and
``kvstore-failed-targets`` (comma list). ``error_from_rpc`` on the client
rebuilds the same class with the same message. A status without the metadata
(the daemon is down, gRPC refused an oversized message, a deadline passed) is
mapped by ``ERRORS_BY_STATUS``: UNAVAILABLE and DEADLINE_EXCEEDED become
``StoreUnavailable``, so "daemon down" is one retryable type for callers.

Conversions never trust the wire: kinds, layouts and keys are validated by the
store itself (``InvalidRequest`` -> INVALID_ARGUMENT).
"""

from __future__ import annotations

from typing import Any

import grpc

from kvstore.api import Layout
from kvstore.errors import (
    ERRORS_BY_CODE,
    InvalidRequest,
    KVStoreError,
    StoreUnavailable,
    Unrecoverable,
)
from kvstore.proto import kvstore_pb2 as pb

MD_CODE = "kvstore-error-code"
MD_KEY = "kvstore-error-key"
MD_TARGETS = "kvstore-failed-targets"


class RequestTooLarge(InvalidRequest):
    """A message is over the gRPC size limit (``max_message_bytes``) of the client or the daemon."""

    code = "REQUEST_TOO_LARGE"


class ServerBusy(StoreUnavailable):
    """The daemon is at its concurrency limit for this tenant or overall; retry with backoff."""

    code = "BUSY"


class Unauthenticated(KVStoreError):
    """No bearer token, or one the daemon does not know."""

    code = "UNAUTHENTICATED"


class PermissionDenied(KVStoreError):
    """The token is valid but its tenant may not call this method (admin-only)."""

    code = "PERMISSION_DENIED"


# code -> class, the store's errors plus the wire's own.
WIRE_ERRORS: dict[str, type[KVStoreError]] = {
    **ERRORS_BY_CODE,
    **{c.code: c for c in (RequestTooLarge, ServerBusy, Unauthenticated, PermissionDenied)},
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
}

# gRPC status without kvstore metadata -> the class the client raises.
ERRORS_BY_STATUS: dict[grpc.StatusCode, type[KVStoreError]] = {
    grpc.StatusCode.UNAVAILABLE: StoreUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: StoreUnavailable,
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
    return STATUS_BY_CODE.get(code, grpc.StatusCode.UNKNOWN), tuple(md)


def error_from_rpc(err: grpc.RpcError, where: str = "") -> KVStoreError:
    """The typed error a failed call stands for (the caller raises it ``from err``)."""
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
    if cls is not None:
        return cls(details)
    status = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    cls = ERRORS_BY_STATUS.get(status, KVStoreError)
    prefix = f"{where}: " if where else ""
    if cls is StoreUnavailable:
        return StoreUnavailable(f"{prefix}kvstore daemon unreachable ({status.name}: {details})")
    if cls is RequestTooLarge:
        return RequestTooLarge(
            f"{prefix}{details}; raise max_message_bytes on both the daemon and the client, "
            "or send smaller batches"
        )
    return cls(f"{prefix}{status.name}: {details}")


def layout_to_pb(layout: Layout, msg: pb.Layout) -> None:
    msg.dtype = layout.dtype
    msg.shape.extend(layout.shape)


def layout_from_pb(msg: pb.Layout) -> Layout:
    return Layout(msg.dtype, tuple(int(d) for d in msg.shape))


def kind_or_default(kind: str) -> str:
    return kind or "block"
