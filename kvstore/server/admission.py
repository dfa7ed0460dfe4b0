"""Admission: how many calls the daemon runs at once, overall and per tenant.

``Limiter`` counts in-flight calls overall and per tenant and refuses, without queueing,
a call over either bound (RESOURCE_EXHAUSTED, ``ServerBusy``): a client retries with
backoff instead of piling onto a saturated daemon. The daemon's dispatcher
(``kvstore.server.dispatch``) takes a slot once a call is authenticated (a unary call or a
reply stream: parsed too) and gives it back when the call's store work is done (a stream:
when it ends).
"""

from __future__ import annotations

import threading

from kvstore.errors import ServerBusy


class Limiter:
    """Bounded in-flight calls, overall and per tenant; refuses instead of queueing."""

    def __init__(self, total: int, per_tenant: int):
        self.total, self.per_tenant = total, per_tenant
        self._lock = threading.Lock()
        self._n = 0
        self._by_tenant: dict[str, int] = {}

    def acquire(self, tenant: str) -> None:
        with self._lock:
            mine = self._by_tenant.get(tenant, 0)
            if self._n >= self.total:
                raise ServerBusy(f"daemon busy: {self._n} calls in flight (max_concurrent_requests={self.total}); retry")
            if mine >= self.per_tenant:
                raise ServerBusy(
                    f"tenant busy: {mine} calls in flight (max_concurrent_per_tenant={self.per_tenant}); retry")
            self._n += 1
            self._by_tenant[tenant] = mine + 1

    def release(self, tenant: str) -> None:
        with self._lock:
            self._n -= 1
            left = self._by_tenant[tenant] - 1
            if left:
                self._by_tenant[tenant] = left
            else:
                del self._by_tenant[tenant]

    @property
    def in_flight(self) -> int:
        return self._n
