"""A store write made for a tenant: charged to its quota, its errors as that tenant may see them.

Who uses it: the daemon's put handlers (``kvstore.server.data_rpc``: Put, PutMany,
PutStream, and deletes through ``forget``) and its direct-write ``Commit``
(``kvstore.server.direct_rpc``). One ``TenantWrites`` per daemon, over its store and its
``TenantQuota`` (``None``: no per-tenant quota, nothing charged).

Charging (``charged``): reserve the plain bytes of what is not live yet, write, then settle
what the write created (or cancel the reservation when it raised). An entry named twice in
one batch is stored once (the store skips the repeat), so it is reserved once, at the larger
of its sizes: the reservation stays an upper bound of what the write can add, and
``TenantQuota.settle`` records what was actually created.

What a tenant is told (``_as_seen_by``): a tenant that is not an admin gets its capacity and
storage errors without what they tell of the store as a whole (the bytes every tenant holds,
that the rest is pinned, target names, paths: an admin's to see, as in ``Get``). The error
class, which says what to do, stays.
"""

from __future__ import annotations

from typing import Any, Callable

from kvstore.api import EntryKind, PutItem
from kvstore.auth import Tenant
from kvstore.embedded.index import ekey
from kvstore.errors import CapacityExceeded, StoreUnavailable
from kvstore.server.quota import TenantQuota


def _as_seen_by(tenant: Tenant, write: Callable[[], list[bool]]) -> list[bool]:
    """``write()``, a put or commit for ``tenant``, its errors as that tenant may see them (module docstring)."""
    try:
        return write()
    except CapacityExceeded as exc:
        if tenant.admin:
            raise
        raise CapacityExceeded("the store is full (what it holds cannot be evicted now, or its targets are out "
                               "of space); retry later, or ask its operator", created=exc.created) from None
    except StoreUnavailable:
        if tenant.admin:
            raise
        raise StoreUnavailable("the store cannot take this write now: too many of its targets are failing or "
                               "too slow; retry later") from None


class TenantWrites:
    """Puts, commits and deletes of one daemon's store, charged to each tenant's quota."""

    def __init__(self, store: Any, quota: TenantQuota | None) -> None:
        self.store = store
        self.quota = quota

    def put(self, items: list[PutItem], tenant: Tenant) -> list[bool]:
        """``store.put_many`` charged to the tenant's quota."""
        if self.quota is None:
            return _as_seen_by(tenant, lambda: self.store.put_many(items))
        return self.charged(tenant, [ekey(EntryKind.parse(it.kind).code, it.key) for it in items],
                            [len(it.value) for it in items], lambda: self.store.put_many(items))

    def charged(self, tenant: Tenant, eks: list[bytes], sizes: list[int],
                write: Callable[[], list[bool]]) -> list[bool]:
        """``write()``, a store write of entries ``eks`` of ``sizes`` plain bytes, charged to
        the tenant's quota: reserve what is not live yet, write, settle what was created."""
        if self.quota is None:
            return _as_seen_by(tenant, write)
        want: dict[bytes, int] = {}
        for ek, size in zip(eks, sizes):
            want[ek] = max(size, want.get(ek, 0))
        n = sum(size for size, live in zip(want.values(), self.quota.live(list(want))) if not live)
        self.quota.reserve(tenant.name, n)
        try:
            created = _as_seen_by(tenant, write)
        except CapacityExceeded as exc:
            if exc.created is None:
                self.quota.cancel(tenant.name, n)
            else:  # indexed before the eviction that raised: charged as any put it created
                self.quota.settle(tenant.name, n, [(ek, s) for ek, s, c in zip(eks, sizes, exc.created) if c])
            raise
        except BaseException:
            self.quota.cancel(tenant.name, n)
            raise
        self.quota.settle(tenant.name, n, [(ek, s) for ek, s, c in zip(eks, sizes, created) if c])
        return created

    def forget(self, tenant: Tenant, deleted: list[tuple[bytes, str]]) -> None:
        """Entries ``(stored key, kind)`` the tenant deleted: no longer charged to it."""
        if self.quota is not None and deleted:
            self.quota.forget(tenant.name, [ekey(EntryKind.parse(kind).code, key) for key, kind in deleted])
