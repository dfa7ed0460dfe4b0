"""Typed errors of the kvstore, shared by every store implementation.

Three kinds of failure are kept apart across the project (see STYLE.md):

1. An expected shortfall is a *return value*: a lookup that hits nothing
   returns ``LookupResult(hit_blocks=0, swa_at=None)``; it never raises.
2. Caller misuse raises a ``KVStoreError`` subclass below, with a message that
   says what to do. Errors caused by another exception are chained with
   ``from``.
3. Broken internal state raises ``InternalError`` whose message says it is a
   bug.

Every class carries a stable ``code`` string so that the gRPC layer can carry
the type across the wire and re-raise the same class on the client side
(``kvstore.wire``). The classes after ``InternalError`` belong to the gRPC service
rather than to a store: the refusals of a call (size and batch limits, auth, load, a
stale ``Describe``) and a call's missed deadline; ``ERRORS_BY_CODE`` names the others,
those every store raises.
"""

from __future__ import annotations

from typing import Iterable, Sequence


class KVStoreError(Exception):
    """Base of every error the store raises on purpose."""

    code = "KVSTORE_ERROR"


class InvalidRequest(KVStoreError, ValueError):
    """The caller passed something the store cannot accept (bad key, size, kind, layout)."""

    code = "INVALID_REQUEST"


class NotFound(KVStoreError, KeyError):
    """No live entry under this key and kind."""

    code = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "not found"


class Unrecoverable(KVStoreError):
    """Fewer than k good fragments remain: the entry cannot be rebuilt.

    ``key`` is the entry key and ``failed_targets`` names the targets whose
    fragment was missing or corrupt. The store marks the entry lost; lookups
    stop matching it until ``repair`` brings it back.
    """

    code = "UNRECOVERABLE"

    def __init__(self, message: str, *, key: bytes = b"", failed_targets: tuple[str, ...] = ()):
        super().__init__(message)
        self.key = key
        self.failed_targets = tuple(failed_targets)


class CorruptData(KVStoreError):
    """Bytes failed a checksum or a structural check (used inside the read path)."""

    code = "CORRUPT_DATA"


class IncompatibleFormat(KVStoreError):
    """The data directory or an entry was written by an incompatible format version."""

    code = "INCOMPATIBLE_FORMAT"


class CapacityExceeded(KVStoreError):
    """The store cannot make room: everything left is pinned or in use.

    ``result`` is the counts dict of the GC pass that raised it (``kvstore.maintenance.gc.run_gc``
    runs its other steps first), or of the repair pass that found the index map full
    (``kvstore.maintenance.check.repair``), so a caller can report what the pass did; ``None`` when
    the error comes from anything else (the daemon sends it along: ``kvstore.wire``).

    ``created``: raised by a put (or a direct write's commit) *after* its index commit, by the
    eviction that followed it, per item of the call whether that put indexed it (some may have
    been evicted again at once; a remote batch sent in pieces counts the earlier pieces' too);
    ``None`` when nothing was indexed, or when that is not known (a batch spread over shards).
    A writer must not remove the files of an item it says was indexed.
    """

    code = "CAPACITY_EXCEEDED"

    def __init__(self, message: str = "", *, result: dict | None = None, created: list[bool] | None = None):
        super().__init__(message)
        self.result = result
        self.created = created

    def widen_created(self, positions: Iterable[int], others: Sequence[bool]) -> None:
        """``created`` of the items at ``positions`` of a larger call (a put of some of its
        items) made per item of that call, ``others`` the flags of the rest; ``None`` stays."""
        if self.created is not None:
            full = list(others)
            for p, c in zip(positions, self.created):
                full[p] = c
            self.created = full


class StoreUnavailable(KVStoreError):
    """The store (a daemon, a target) cannot be reached right now; retrying may work."""

    code = "UNAVAILABLE"


class StoreClosed(KVStoreError):
    """The store was closed; open a new one with ``kvstore.connect``."""

    code = "CLOSED"


class InternalError(KVStoreError):
    """Broken internal state. This is a bug in kvstore; please report it with the message."""

    code = "INTERNAL"


class RequestTooLarge(InvalidRequest):
    """A message is over the gRPC size limit (``max_message_bytes``) of the client or the daemon."""

    code = "REQUEST_TOO_LARGE"


class BatchTooLarge(InvalidRequest):
    """A batch call has more items (or, for ``LookupMany``, chains or keys in all chains)
    than the daemon's ``max_batch_items``, which is ``limit`` (0: not known).

    Contract: the daemon raises it before any store work for that call, so a refused
    batch changed nothing and the client may resend it in pieces of at most ``limit``
    (``kvstore.client.transport`` does, once). Its wire ``code`` is ``InvalidRequest``'s;
    the limit travels beside it (``kvstore.wire.MD_BATCH_LIMIT``).
    """

    def __init__(self, message: str, *, limit: int = 0):
        super().__init__(message)
        self.limit = limit


class ServerBusy(StoreUnavailable):
    """The daemon is at its concurrency limit for this tenant or overall; retry with backoff."""

    code = "BUSY"


class DeadlineExceeded(StoreUnavailable):
    """A call got no answer within its deadline (gRPC's DEADLINE_EXCEEDED): the daemon may be
    reachable and still working on it. Client side only (the daemon never sends it); a
    ``StoreUnavailable``, so callers that retry on "daemon down" retry it too."""


class Unauthenticated(KVStoreError):
    """No bearer token, or one the daemon does not know."""

    code = "UNAUTHENTICATED"


class PermissionDenied(KVStoreError):
    """The token is valid but its tenant may not call this method (admin-only)."""

    code = "PERMISSION_DENIED"


class StaleDescribe(KVStoreError):
    """``Commit`` refused, nothing indexed: the writer's ``Describe`` (``writer_view``) is not what
    the daemon would answer now (since it, the data directory, tenant secret, erasure code, targets
    or encoding settings changed, or the token now names another tenant). The writer describes
    again and rewrites."""

    code = "STALE_DESCRIBE"


# code -> class, the errors of every store (the wire's own are added in ``kvstore.wire``).
ERRORS_BY_CODE: dict[str, type[KVStoreError]] = {
    cls.code: cls
    for cls in (
        KVStoreError,
        InvalidRequest,
        NotFound,
        Unrecoverable,
        CorruptData,
        IncompatibleFormat,
        CapacityExceeded,
        StoreUnavailable,
        StoreClosed,
        InternalError,
    )
}
