"""``DaemonExecutor``: a thread pool whose workers never hold up process exit.

``concurrent.futures.ThreadPoolExecutor`` joins its (non-daemon) workers at interpreter
exit, so one call stuck in storage (a dead mount, a silent S3 endpoint, a device that
stalls) keeps the whole process alive however its owner shuts down. The store's I/O
pools, the daemon's RPC pools and the engine plugin's store calls run here instead:
at exit an unfinished call is abandoned, which the store is built to survive (a write
cut off before its index commit leaves only orphan fragments, swept by GC).

Contract: ``submit`` returns a ``concurrent.futures.Future``; ``map`` is the base
class's. After ``shutdown`` a submitted call comes back already cancelled (never
queued behind the stop markers, never an exception at submit). ``shutdown`` cancels
the calls that have not started and stops each worker once it is free; with ``wait``
it joins them, at most ``timeout_s`` in all, never the calling thread itself.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
import time
from typing import Any, Callable, Iterable


class DaemonExecutor(cf.Executor):
    """``submit(fn, *args, **kwargs)`` run on ``workers`` daemon threads (module docstring)."""

    def __init__(self, workers: int, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._lock = threading.Lock()  # submit vs shutdown: no job is queued behind the stop markers
        self._max, self._name = max(1, workers), name
        self._idle = threading.Semaphore(0)  # workers waiting for a call
        self._threads: list[threading.Thread] = []  # started on demand, up to ``workers``

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> cf.Future:
        """A future of ``fn(*args, **kwargs)``; after ``shutdown``, one already cancelled."""
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._closed:
                fut.cancel()
                return fut
            self._q.put((fut, fn, args, kwargs))
            if not self._idle.acquire(blocking=False) and len(self._threads) < self._max:
                t = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}", daemon=True)
                t.start()
                self._threads.append(t)
        return fut

    def _work(self) -> None:
        while (job := self._q.get()) is not None:
            fut, fn, args, kwargs = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                    fut.set_exception(exc)
            del job, fut, fn, args, kwargs  # drop references to the call while idle
            self._idle.release()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = True, timeout_s: float | None = None) -> None:
        """Stop (idempotent): cancel what never started, stop each worker once it is free;
        ``wait``: join the workers, at most ``timeout_s`` in all (``None``: until done).
        Calls already running always finish (``cancel_futures`` is accepted for the base
        class's signature: queued calls are cancelled either way)."""
        with self._lock:
            first = not self._closed
            self._closed = True
            if first:
                while True:  # cancel what never started
                    try:
                        job = self._q.get_nowait()
                    except queue.Empty:
                        break
                    if job is not None:
                        job[0].cancel()
                for _ in self._threads:
                    self._q.put(None)
        if wait:
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            me = threading.current_thread()
            for t in self._threads:
                if t is not me:
                    t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


def shutdown_all(pools: Iterable[cf.Executor], *, wait: bool, timeout_s: float | None) -> None:
    """Stop every pool, then (``wait``) join them within ONE ``timeout_s`` shared by all, not
    one each: a close with stuck calls on many pools still ends within its bound."""
    pools = list(pools)
    for p in pools:
        p.shutdown(wait=False)
    if wait:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for p in pools:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            p.shutdown(wait=True, timeout_s=left) if isinstance(p, DaemonExecutor) else p.shutdown(wait=True)
