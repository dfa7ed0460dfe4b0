"""Access times of the embedded store, batched: the approximate LRU that capacity eviction reads.

A get (or a re-put, or a located entry) records its entry's access time here in memory
(``touch``); they reach the index's ``lru`` ordering in one write transaction, at most every
``access_flush_s`` (on whatever thread reads next), inside a put's index commit, at the first
step of GC, and when the store closes. Access times are approximate by design: a read never
fails for them, and on a full index filesystem a flush that is not a caller's own is dropped
and logged (``flush_or_drop``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable

import lmdb

from kvstore.embedded.diskroom import IndexRoom
from kvstore.embedded.index import Index

log = logging.getLogger("kvstore.embedded.store")


class AccessTimes:
    """Pending access times (entry key -> ns) and their flush into ``index`` (module docstring)."""

    def __init__(self, index: Index, room: IndexRoom, clock: Callable[[], float], flush_s: float):
        self.index = index
        self.room = room
        self.clock = clock
        self.flush_s = flush_s
        self._lock = threading.Lock()
        self._pending: dict[bytes, int] = {}
        self._last_flush = clock()

    def touch(self, ek: bytes, now: int) -> None:
        """Record a use of ``ek`` at ``now``; flush when ``flush_s`` has passed since the last."""
        self.touch_many((ek,), now)

    def touch_many(self, eks: Iterable[bytes], now: int) -> None:
        """``touch`` of each of ``eks`` (a batched get's), in one round of the lock."""
        with self._lock:
            self._pending.update(dict.fromkeys(eks, now))
            due = self.clock() - self._last_flush >= self.flush_s
        if due:  # on whatever thread reads (a batch worker too): not a public call of its own
            self.flush_or_drop()

    def pending(self) -> dict[bytes, int]:
        """A copy of the access times not yet written, read under the lock, not flushed (a GC
        dry run writes nothing, yet orders the LRU as the real pass will)."""
        with self._lock:
            return dict(self._pending)

    def flush_txn(self, txn: Any) -> None:
        """Write the pending access times inside ``txn`` (a caller's write transaction)."""
        with self._lock:
            pending, self._pending = self._pending, {}
            self._last_flush = self.clock()
        for ek, ts in pending.items():
            self.index.touch_txn(txn, ek, ts)

    def flush(self) -> None:
        """Write the pending access times in a transaction of their own."""
        with self.index.env.begin(write=True) as txn:
            self.flush_txn(txn)

    def flush_or_drop(self) -> None:
        """``flush``; on a full index filesystem the times are dropped and logged instead (a
        read or a close never fails for them)."""
        try:
            self.flush()
        except lmdb.Error as exc:
            if not self.room.no_space(exc):
                raise
            log.warning("access times not written, the index's filesystem is full: %s", exc)
