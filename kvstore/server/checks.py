"""A request's fields checked at the daemon's boundary, before any store work.

Who uses it: the daemon's call handlers (``kvstore.server.data_rpc``, ``direct_rpc``,
``admin_rpc``) and its dispatcher (``kvstore.server.dispatch``, for a request stream's
item count). Each check raises ``InvalidRequest`` (or ``BatchTooLarge``) and has no side
effect, so a call refused here changed nothing.

* ``BatchLimit``: a batch over ``max_batch_items`` is ``kvstore.errors.BatchTooLarge``, carrying the
  limit in the trailing metadata (``kvstore-max-batch-items``). Every handler calls it before
  any store work (and PutStream before it reads past the limit), so the refusal guarantees
  that nothing was applied; ``kvstore.client.remote`` relies on that to learn the limit and
  resend the batch in pieces.
* ``tenant_key``/``tenant_keys``: a client's key is validated (16 bytes) *before* it is mapped
  to the tenant's stored key (``kvstore.auth.Tenant.store_key``); a batch is validated whole
  before any key is mapped.
* ``ttl_of`` and ``put_item``: a put's TTL and token count in range, its layout converted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvstore.api import PutItem
from kvstore.auth import Tenant
from kvstore.config import MAX_TTL_S
from kvstore.errors import InvalidRequest
from kvstore.keys import check_key, check_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.errors import BatchTooLarge
from kvstore.wire import kind_or_default, layout_from_pb


@dataclass(frozen=True, slots=True)
class BatchLimit:
    """``max_batch_items`` of one daemon; calling it checks a batch of ``n`` items (module docstring)."""

    max_items: int

    def __call__(self, n: int, what: str) -> None:
        if n > self.max_items:
            raise BatchTooLarge(f"{what} of {n} items is over max_batch_items={self.max_items}; split it",
                                limit=self.max_items)


def tenant_key(tenant: Tenant, key: bytes) -> bytes:
    """The stored key of the client's ``key`` for ``tenant``, the key validated first."""
    return tenant.store_key(check_key(key))


def tenant_keys(tenant: Tenant, keys: Any) -> list[bytes]:
    """``tenant_key`` over a batch (every key validated before any is mapped)."""
    keys = check_keys(keys)
    return [tenant.store_key(k) for k in keys] if tenant.secret else keys


def ttl_of(r: pb.PutRequest | pb.WrittenEntry) -> float | None:
    """The request's TTL (``None``: unset, the store's default), checked."""
    ttl = r.ttl_s if r.HasField("ttl_s") else None
    if ttl is not None and not (math.isfinite(ttl) and 0 < ttl <= MAX_TTL_S):
        raise InvalidRequest(f"ttl_s must be positive and at most {MAX_TTL_S:.0f} s, got {ttl}")
    return ttl


def put_item(r: pb.PutRequest, tenant: Tenant) -> PutItem:
    """A ``PutRequest`` as the store's ``PutItem`` under the tenant's stored key, checked."""
    ttl = ttl_of(r)
    if not 0 <= r.tokens < 2**32:
        raise InvalidRequest(f"tokens must be in [0, 2**32), got {r.tokens}")
    layout = layout_from_pb(r.layout) if r.HasField("layout") else None
    return PutItem(tenant_key(tenant, r.key), r.value, kind_or_default(r.kind), ttl, layout, int(r.tokens))
