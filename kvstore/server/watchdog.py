"""One thread that cancels the daemon's streaming calls that stopped moving.

Who uses it: the daemon's dispatcher (``kvstore.server.dispatch``), for the two bounds of
its streaming calls: ``stream_receive_s`` (a PutStream must be wholly received within it)
and ``stream_send_s`` (each message of a reply stream must get out within it). Without them
a client that sends or reads nothing holds a handler thread and an admission slot for ever.

Contract: ``arm(token, after_s, fire)`` calls ``fire()`` once, on the watchdog's thread,
``after_s`` seconds from now unless ``disarm(token)`` (or a later ``arm`` of the same token,
which restarts the wait) comes first. ``fire`` must be quick and must not raise (the calls'
``context.cancel`` is both); an exception is logged, never propagated. Arming and disarming
are a dict update under a lock (a stream arms once per message), and the thread wakes only
for the earliest deadline, not per message. ``close()`` stops the thread; nothing fires after.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Hashable

log = logging.getLogger("kvstore.server")


class Watchdog:
    """Deadlines per token, fired on one daemon thread (module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cv = threading.Condition()
        self._due: dict[Hashable, tuple[float, Callable[[], None]]] = {}  # token -> (deadline, fire)
        self._wake_at: float | None = None  # when the thread wakes next (None: when notified)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvstore-watchdog", daemon=True)
        self._thread.start()

    def arm(self, token: Hashable, after_s: float, fire: Callable[[], None]) -> None:
        deadline = self._clock() + after_s
        with self._cv:
            self._due[token] = (deadline, fire)
            if self._wake_at is None or deadline < self._wake_at:
                self._cv.notify()

    def disarm(self, token: Hashable) -> None:
        with self._cv:
            self._due.pop(token, None)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._due.clear()
            self._cv.notify()
        self._thread.join(5)

    def _run(self) -> None:
        with self._cv:
            while not self._closed:
                now = self._clock()
                fired = [(t, fire) for t, (deadline, fire) in self._due.items() if deadline <= now]
                for t, _ in fired:
                    del self._due[t]
                if fired:
                    self._cv.release()  # fire outside the lock: a fire may arm or disarm
                    try:
                        for _, fire in fired:
                            try:
                                fire()
                            except Exception:  # noqa: BLE001 - one bad callback must not stop the others
                                log.exception("watchdog callback failed")
                    finally:
                        self._cv.acquire()
                    continue
                self._wake_at = min((d for d, _ in self._due.values()), default=None)
                self._cv.wait(None if self._wake_at is None else self._wake_at - now)
                self._wake_at = None
