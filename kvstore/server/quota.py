"""Per-tenant quotas: no tenant can fill the daemon's store for the others.

Who calls it: the daemon's ``kvstore.server.tenant_writes.TenantWrites`` when
``tenant_quota_bytes`` > 0, around every ``Put``/``PutMany``/``PutStream`` and direct-write
``Commit`` (``reserve`` -> store write -> ``settle`` or ``cancel``) and after every
successful ``Delete``/``DeleteMany`` (``forget``).

The measure is the plain value bytes of the live entries a tenant created (what
the client sent; compression and parity are the operator's business). The quota is one
daemon's: in a sharded set (``kvstore.client.sharded``) each daemon charges only the keys
rendezvous hashing sends it, so a tenant holds up to ``shards x tenant_quota_bytes`` in all
(about ``1/shards`` of its bytes on each); size the per-daemon quota for that.

Accounting, persistent across restarts (LMDB at ``<data_dir>/server/quota``)::

    tenant_id (16 B) || ekey (17 B)  ->  plain_len u64     one row per entry the tenant created
    tenant_id (16 B)                 ->  total u64          sum of that tenant's rows

    tenant_id = BLAKE2b-128(tenant name)

The store also removes entries on its own (TTL expiry, capacity eviction, an
entry marked lost), so rows may be stale: ``prune`` recomputes a tenant's total
from its rows whose entries are still live. It runs when a put would go over,
at most once per ``PRUNE_EVERY_S`` per tenant (it reads every row of the tenant under
the daemon-wide quota lock), so a tenant is refused only when its *live* bytes plus the
put are over quota, as of its last prune: entries that expired since free their bytes
for puts within ``PRUNE_EVERY_S``.

Invariant: ``total + reserved <= quota`` after every successful ``reserve``;
reservations make concurrent puts of one tenant unable to overshoot together.
A re-put of an entry that is live is not charged (it stores nothing); if that
entry expires between the check and the put, the tenant may overshoot by at
most that one batch. An entry named twice in one batch is reserved once (the
store keeps one copy; ``TenantWrites.charged`` reserves the larger size).
A refused put raises ``CapacityExceeded`` (RESOURCE_EXHAUSTED on the wire) and
stores nothing.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import lmdb

from kvstore.errors import CapacityExceeded

log = logging.getLogger(__name__)
PRUNE_EVERY_S = 2.0  # a tenant's rows are re-read at most this often (module docstring)
_U64 = struct.Struct("<Q")


def tenant_id(name: str) -> bytes:
    return hashlib.blake2b(name.encode(), digest_size=16, person=b"kvstack-quota").digest()


class TenantQuota:
    """Per-tenant byte quota over one store. Thread-safe."""

    def __init__(self, path: Path, quota_bytes: int, store: Any, *, sync: bool = True):
        path.mkdir(parents=True, exist_ok=True)
        self.quota = quota_bytes
        self.store = store
        self.env = lmdb.open(str(path), map_size=1 << 30, sync=sync, max_dbs=1)
        self._lock = threading.Lock()
        self._reserved: dict[str, int] = {}
        self._pruned_at: dict[str, float] = {}  # tenant -> monotonic time of its last prune

    def close(self) -> None:
        self.env.close()

    # ---------------------------------------------------------------- reads
    def used(self, tenant: str) -> int:
        with self.env.begin() as txn:
            raw = txn.get(tenant_id(tenant))
        return _U64.unpack(raw)[0] if raw else 0

    def live(self, eks: list[bytes]) -> list[bool]:
        """Which of these entries are live now (a re-put of one stores nothing, so costs nothing)."""
        now = self.store.now_ns()
        with self.store.index.env.begin() as txn:
            metas = [self.store.index.get_meta(txn, ek) for ek in eks]
        return [m is not None and not m.expired(now) for m in metas]

    def prune(self, tenant: str) -> int:
        """Drop rows of entries that are no longer live; the recomputed total."""
        tid = tenant_id(tenant)
        with self.env.begin() as txn:
            cur = txn.cursor()
            rows = []
            if cur.set_range(tid):
                for k, v in cur:
                    if not k.startswith(tid):
                        break
                    if len(k) > len(tid):
                        rows.append((bytes(k), _U64.unpack(v)[0]))
        live = self.live([k[16:] for k, _ in rows])
        total = sum(n for (_, n), ok in zip(rows, live) if ok)
        dropped = sum(not ok for ok in live)
        if dropped or total != self.used(tenant):
            with self.env.begin(write=True) as txn:
                for (k, _), ok in zip(rows, live):
                    if not ok:
                        txn.delete(k)
                txn.put(tid, _U64.pack(total))
        if dropped:
            log.info("quota: %d stale rows of a tenant dropped (expired, evicted or lost)", dropped)
        return total

    # ---------------------------------------------------------------- the put protocol
    def reserve(self, tenant: str, nbytes: int) -> None:
        """Claim ``nbytes`` for a put about to run; raises ``CapacityExceeded`` when over."""
        with self._lock:
            held = self._reserved.get(tenant, 0)
            if self.used(tenant) + held + nbytes > self.quota:
                # A prune reads every row of the tenant under this daemon-wide lock: at most one
                # per PRUNE_EVERY_S per tenant, so a tenant hammering its full quota with refused
                # puts does not stall every other tenant's puts.
                last = self._pruned_at.get(tenant)
                fresh = last is not None and time.monotonic() - last < PRUNE_EVERY_S
                if fresh or self._prune_now(tenant) + held + nbytes > self.quota:
                    raise CapacityExceeded(
                        f"tenant quota exceeded: this put needs {nbytes} bytes and the tenant holds "
                        f"{self.used(tenant) + held} of its tenant_quota_bytes={self.quota}; delete "
                        "entries or ask the operator for a larger quota")
            self._reserved[tenant] = held + nbytes

    def _prune_now(self, tenant: str) -> int:
        self._pruned_at[tenant] = time.monotonic()
        return self.prune(tenant)

    def cancel(self, tenant: str, nbytes: int) -> None:
        with self._lock:
            left = self._reserved.get(tenant, 0) - nbytes
            if left > 0:
                self._reserved[tenant] = left
            else:
                self._reserved.pop(tenant, None)

    def settle(self, tenant: str, nbytes: int, created: Iterable[tuple[bytes, int]]) -> None:
        """Record the entries a put created (``(ekey, plain_len)``) and drop its reservation."""
        tid = tenant_id(tenant)
        with self._lock:
            with self.env.begin(write=True) as txn:
                raw = txn.get(tid)
                total = _U64.unpack(raw)[0] if raw else 0
                for ek, n in created:
                    old = txn.get(tid + ek)
                    total += n - (_U64.unpack(old)[0] if old else 0)
                    txn.put(tid + ek, _U64.pack(n))
                txn.put(tid, _U64.pack(total))
        self.cancel(tenant, nbytes)

    def forget(self, tenant: str, eks: Iterable[bytes]) -> None:
        """Entries the tenant deleted no longer count."""
        tid = tenant_id(tenant)
        with self._lock, self.env.begin(write=True) as txn:
            raw = txn.get(tid)
            total = _U64.unpack(raw)[0] if raw else 0
            for ek in eks:
                old = txn.get(tid + ek)
                if old is not None:
                    total -= _U64.unpack(old)[0]
                    txn.delete(tid + ek)
            txn.put(tid, _U64.pack(max(0, total)))
