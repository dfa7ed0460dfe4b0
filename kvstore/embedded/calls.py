"""The call gate of the embedded store: its public calls refused once it closes, counted while
they run, and a deletion run again once the index's spare room is released on a full disk.

``in_flight`` and ``frees_space`` decorate ``kvstore.embedded.store.EmbeddedStore``'s public
methods; they use the store's own ``_calls``, ``_closed``, ``_in_flight``, ``_finish_close``
and ``room`` (``kvstore.embedded.diskroom.IndexRoom``).
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import lmdb

from kvstore.errors import StoreClosed

CLOSE_WAIT_S = 10.0  # close() waits this long for calls in flight on other threads


_CALL_DEPTH = threading.local()  # per thread: how many in_flight calls it is inside


def in_flight(fn: Callable) -> Callable:
    """A public call of the embedded store (``kvstore.embedded.store``): refused with ``StoreClosed``
    once ``close`` has begun, and counted while it runs. ``close`` shuts the index only when
    the count drops to zero: it waits up to ``CLOSE_WAIT_S``, and past that leaves the last
    call still running to shut it as it returns. So a call racing a close gets
    ``StoreClosed`` or its result, never an error from a closed LMDB. A call made from within
    one in flight on the same thread (a put's eviction, GC's stats) is part of it, never
    refused. An index write that finds its filesystem full raises ``CapacityExceeded``
    naming ENOSPC (``kvstore.embedded.diskroom``), not LMDB's error. Needs the store's ``_calls``,
    ``_closed``, ``_in_flight``, ``_finish_close`` and ``room``."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        depth = getattr(_CALL_DEPTH, "n", 0)
        with self._calls:
            if self._closed and not depth:
                raise StoreClosed("this store is closed; open a new one with kvstore.connect")
            self._in_flight += 1
        _CALL_DEPTH.n = depth + 1
        try:
            return fn(self, *args, **kwargs)
        except lmdb.Error as exc:  # the outermost call types a full filesystem (inner ones: ``frees_space``)
            if not depth and self.room.no_space(exc):
                raise self.room.full_error(exc, fn.__name__) from exc
            raise
        finally:
            _CALL_DEPTH.n = depth
            with self._calls:
                self._in_flight -= 1
                last = not self._in_flight
                if last:
                    self._calls.notify_all()
            if last and self._closed:
                self._finish_close(deferred=True)

    return call


def frees_space(fn: Callable) -> Callable:
    """A deletion of the embedded store (``delete``, ``gc``, ``evict_to``), inside ``in_flight``:
    when an index write of it finds no room on a full filesystem, the index's spare file is
    released and the call runs once more (``kvstore.embedded.diskroom``, step 2); a second failure
    ``in_flight`` raises as ``CapacityExceeded``. A transaction that failed changed nothing,
    and what committed before it stays done, so running the call again is safe."""

    @functools.wraps(fn)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return self.room.run_freeing(fn, self, *args, **kwargs)

    return call
