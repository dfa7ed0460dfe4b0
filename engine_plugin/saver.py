"""The background save path: a bounded queue of store puts and one saver thread.

Who calls it: ``KVStoreConnector`` (``submit`` from the engine thread after the
device-to-host copies completed, ``take_sent`` from ``get_finished``, ``flush``/``close``
at shutdown) and the vLLM binding (``engine_plugin.vllm``: ``submit``, ``close``).

Guarantees:
  1. ``submit`` never blocks longer than ``enqueue_timeout_s``: a full queue
     (a slow store) drops the job, counted as ``saves_dropped``, instead of
     stalling the forward pass. That is the backpressure.
  2. Items carry their own ``bytes`` (copied out of the staging buffers
     before ``submit``), so a put that outlives a gateway timeout can never
     read a buffer that was reused meanwhile.
  3. Per request, in-flight jobs are counted; a finished request whose jobs
     are all done is reported once by ``take_sent`` (``get_finished``), with the
     subset whose KV did not all reach the store: a job dropped (queue full, exit,
     or ``mark_failed`` by the connector for a save it could not copy out), failed
     (the put returned a shortfall) or raised marks its requests failed until they
     are reported. Both are told apart so that the engine can free what it holds
     for a request either way and still know whether a decode may load it.
     Counts are kept per *incarnation* of an id (a tag taken at its first job in flight):
     ``forget`` (an abort) ends the current one, and its jobs still in flight keep
     counting under their old tag, apart from those of a request re-added under the same
     id (``EngineRunner`` retries a request alone under its id; clients reuse ids). So the
     new request is reported once *its* jobs end, whatever the aborted one's do, and an
     aborted job that fails marks nothing. (One count per id, shared, would let the aborted
     jobs' end clear the id's marks, and the new request would never be reported: it would
     stay PENDING in the engine's ``_sending`` for ever.) ``mark_finished`` ends the current
     incarnation too: a request re-added under the id of a finished one whose saves still
     run (no abort between) counts its own jobs and marks apart, and ``take_sent`` reports
     an id's finished incarnations one at a time, oldest first, each once its own jobs
     ended, with its own outcome (at most once per id per call, so an owner that pairs each
     report of an id with its oldest record waiting, as ``Engine.collect_finished`` does,
     gives each record its own). (Were the new request's jobs counted with the finished
     one's, the finished one would be reported with the new one's failures, or the new
     one's finish folded into its report: the new one reported sent for saves it never
     made, or the engine's record of the finished one PENDING for ever.)
  4. The saver thread never dies on an error: it logs, counts, goes on.
  5. ``flush`` waits for the jobs submitted before it was called, not for an empty
     queue: jobs get a ticket in queue order (``submit`` holds ``_submit_lock`` across
     the put, so tickets and queue order agree) and the single saver thread completes
     them in that order, so ``flush`` waits until the completed count reaches the
     ticket count it saw. Under steady save traffic from other requests it still
     returns (a P/D handoff waits for its own request's saves, not everyone's).
  6. ``close`` is idempotent: the first call drains the queue and stops the
     thread with one sentinel; later calls return at once (a second sentinel
     nobody reads would make every later ``flush`` wait forever). ``submit``
     after ``close`` raises ``StoreClosed``; ``flush`` after it returns at once
     (``close`` drained everything).
  7. A process that ends without ``close`` loses no queued save it can write in
     time: at interpreter exit the queue is flushed *before* ``concurrent.futures``
     stops taking work, which a store's own calls may need (``_flush_at_exit``).
     Exit waits at most ``EXIT_FLUSH_S`` for all queues together, says so in one
     line, and on the deadline or Ctrl-C drops what is left quietly (one line,
     counted as ``saves_dropped``); a gateway call that hangs does not hold exit up
     (it runs on a daemon thread, ``kvstore.executors.DaemonExecutor``, as do the
     embedded store's own I/O pools). Flushed any later, the saves still queued
     would fail with "cannot schedule new futures" and be silently missing from
     the store.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

from engine_plugin.tiers import Metrics, StoreGateway
from kvstore.api import PutItem
from kvstore.errors import StoreClosed

log = logging.getLogger(__name__)

EXIT_FLUSH_S = 60.0  # the most interpreter exit waits for queued saves, all queues together (guarantee 7)
_exit_deadline: float | None = None  # monotonic time the exit flush gives up, set by the first queue asked


def _flush_at_exit(q: "SaveQueue") -> None:
    """Register guarantee 7's exit hook for ``q`` (held weakly: a queue that is gone or
    closed costs nothing at exit). ``threading``'s exit hooks run before the non-daemon
    threads are joined and in reverse order of registration, so this one runs before
    ``concurrent.futures``' own hook (registered when it was imported) refuses new work;
    ``atexit`` hooks run only after that, too late. ``threading._register_atexit`` is
    the hook ``concurrent.futures`` itself uses; without it (another Python) ``atexit``
    is the fallback."""
    ref = weakref.ref(q)

    def flush() -> None:
        sq = ref()
        if sq is not None:
            sq.drain_at_exit()

    register = getattr(threading, "_register_atexit", None)
    try:
        (register or atexit.register)(flush)
    except RuntimeError:  # created while the interpreter is already exiting: nothing to hook into
        pass


@dataclass(frozen=True, slots=True)
class SaveJob:
    items: tuple[PutItem, ...]
    request_ids: tuple[str, ...]
    tags: tuple[int, ...]  # per request id, the incarnation it was submitted for (guarantee 3)


@dataclass(slots=True)
class _Ended:
    """A finished incarnation of a request id, not yet reported by ``take_sent`` (guarantee 3)."""

    tag: int | None  # the tag of its jobs while some are in flight; None once all ended
    failed: bool  # one of its saves did not reach the store


class SaveQueue:
    def __init__(self, gateway: StoreGateway, metrics: Metrics, *, depth: int, enqueue_timeout_s: float):
        self.gateway, self.metrics = gateway, metrics
        self.enqueue_timeout_s = enqueue_timeout_s
        self._q: queue.Queue[SaveJob | None] = queue.Queue(maxsize=depth)
        self._lock = threading.Lock()
        # Invariants (guarantee 3), all under ``_lock``:
        #  1. ``_tag[rid]`` exists iff the current (running) incarnation of ``rid`` has jobs in
        #     flight; their count is ``_inflight[_tag[rid]]`` (> 0). Tags are never reused.
        #  2. A tag in ``_inflight`` that is neither an id's ``_tag`` nor in ``_ending`` belongs to
        #     an aborted incarnation: its count only runs down to its removal; it marks nothing.
        #  3. ``_ending[tag]`` is the finished incarnation whose jobs in flight carry ``tag``; it
        #     is also in ``_ended`` until reported, its ``tag`` set to None once they all ended.
        #  4. ``_failed`` is about current incarnations only (``mark_finished`` moves the mark to
        #     the ``_Ended``); ``_ended`` holds an id until ``take_sent`` reported all of its
        #     finished incarnations, never for ever (``forget`` touches only the current one).
        self._next_tag = 0
        self._tag: dict[str, int] = {}  # request id -> tag of its current incarnation's jobs in flight
        self._inflight: dict[int, int] = {}  # tag -> jobs in flight
        self._ending: dict[int, _Ended] = {}  # tag -> the finished incarnation whose jobs carry it
        self._ended: dict[str, deque[_Ended]] = {}  # request id -> finished, unreported; oldest first
        self._failed: set[str] = set()  # current requests with a save that did not reach the store
        self._closed = False
        self._submit_lock = threading.Lock()  # one put at a time: tickets follow queue order (guarantee 5)
        self._progress = threading.Condition()  # guards _submitted and _completed
        self._submitted = 0  # jobs that entered the queue
        self._completed = 0  # of those, attempted by the saver (a prefix of queue order)
        self._dropping = False  # set at exit past the deadline (guarantee 7)
        self._thread = threading.Thread(target=self._loop, name="kv-save", daemon=True)
        self._thread.start()
        _flush_at_exit(self)

    def submit(self, items: list[PutItem], request_ids: list[str]) -> bool:
        if self._closed:
            raise StoreClosed("the save queue is closed (its connector was closed)")
        if not items:
            return True
        with self._lock:
            tags = []
            for rid in request_ids:
                tag = self._tag.get(rid)
                if tag is None:  # the first job in flight of this incarnation
                    tag = self._tag[rid] = self._next_tag
                    self._next_tag += 1
                self._inflight[tag] = self._inflight.get(tag, 0) + 1
                tags.append(tag)
        job = SaveJob(tuple(items), tuple(request_ids), tuple(tags))
        t0 = time.perf_counter()
        try:
            with self._submit_lock:
                self._q.put(job, timeout=self.enqueue_timeout_s)
                with self._progress:
                    self._submitted += 1
        except queue.Full:
            self.metrics.inc("saves_dropped", len(items))
            log.warning("save queue full: dropping %d entries (the store is too slow)", len(items))
            self._done(job, ok=False)
            return False
        finally:
            self.metrics.observe_max("save_enqueue_wait_max_s", time.perf_counter() - t0)
        self.metrics.inc("saves_enqueued", len(items))
        return True

    def mark_finished(self, request_id: str) -> None:
        """The current incarnation of ``request_id`` finished: it is reported by ``take_sent``
        once its jobs in flight ended, after the id's earlier finished ones; a job submitted
        under the id from now on is a new incarnation's (guarantee 3)."""
        with self._lock:
            end = _Ended(self._tag.pop(request_id, None), request_id in self._failed)
            self._failed.discard(request_id)
            if end.tag is not None:  # jobs of it in flight (invariant 1)
                self._ending[end.tag] = end
            self._ended.setdefault(request_id, deque()).append(end)

    def mark_failed(self, request_ids) -> None:
        """Saves of these requests were dropped before ``submit`` (guarantee 3)."""
        with self._lock:
            self._failed.update(request_ids)

    def forget(self, request_id: str) -> None:
        """An aborted request: it is never reported, so keep no mark for it. Its jobs still in
        flight run down under their tag (invariant 2); a request re-added under the same id
        starts a new incarnation, counted apart. The id's finished incarnations not yet
        reported are not this one: they are still reported (invariant 4)."""
        with self._lock:
            self._failed.discard(request_id)
            self._tag.pop(request_id, None)

    def take_sent(self) -> tuple[set[str], set[str]]:
        """``(done, failed)``: finished requests whose saves all ended, reported once, and those
        of them with a save that did not reach the store (guarantee 3). Per id, its oldest finished
        incarnation not yet reported, once that one's jobs all ended: at most one per call."""
        sent: set[str] = set()
        failed: set[str] = set()
        with self._lock:
            for rid, ends in list(self._ended.items()):
                if ends[0].tag is not None:  # its jobs still run; the id's later ones wait behind it
                    continue
                end = ends.popleft()
                if not ends:
                    del self._ended[rid]
                sent.add(rid)
                if end.failed:
                    failed.add(rid)
        return sent, failed

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted before this call was attempted (guarantee 5: not
        for an empty queue); ``False`` if ``timeout`` seconds passed first."""
        if self._closed:
            return True  # close() drained the queue, and no thread reads it any more
        with self._progress:
            target = self._submitted
            return self._progress.wait_for(lambda: self._completed >= target or self._closed, timeout)

    def close(self) -> None:
        """Drain the queue and stop the saver thread; idempotent (guarantee 6)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._q.join()
        self._q.put(None)
        self._thread.join(timeout=10)

    def drain_at_exit(self) -> None:
        """Guarantee 7: flush what is queued within the exit deadline, else drop it."""
        global _exit_deadline
        if self._closed:
            return
        with self._progress:
            pending = self._submitted - self._completed
        if not pending:
            return
        now = time.monotonic()
        if _exit_deadline is None:
            _exit_deadline = now + EXIT_FLUSH_S
        left = max(0.0, _exit_deadline - now)
        log.warning("exit: writing %d queued KV save job(s) to the store (at most %.0f s; Ctrl-C drops them)",
                    pending, left)
        why = f"not written within {EXIT_FLUSH_S:.0f} s"
        try:
            done = self.flush(left)
        except KeyboardInterrupt:
            done, why = False, "interrupted"
        if not done:
            self._dropping = True  # the saver drops the rest without calling the store
            with self._progress:
                left_jobs = self._submitted - self._completed
            log.warning("exit: %d queued KV save job(s) dropped (%s)", left_jobs, why)

    def _done(self, job: SaveJob, ok: bool) -> None:
        """``job`` ended (``ok``: all of it reached the store); its requests' counts go down."""
        with self._lock:
            for rid, tag in zip(job.request_ids, job.tags):
                current = self._tag.get(rid) == tag
                end = self._ending.get(tag)  # neither: an aborted incarnation (invariant 2)
                if not ok:
                    if current:
                        self._failed.add(rid)
                    elif end is not None:
                        end.failed = True
                left = self._inflight[tag] - 1
                if left:
                    self._inflight[tag] = left
                    continue
                del self._inflight[tag]
                if current:
                    del self._tag[rid]
                elif end is not None:  # a finished incarnation's last job: take_sent may report it
                    del self._ending[tag]
                    end.tag = None

    def _loop(self) -> None:
        while True:
            job = self._q.get()
            ok = False
            try:
                if job is None:
                    return
                if self._dropping:
                    self.metrics.inc("saves_dropped", len(job.items))
                elif self.gateway.put_many(job.items):
                    self.metrics.inc("saves_done", len(job.items))
                    self.metrics.inc("bytes_saved", sum(len(it.value) for it in job.items))
                    ok = True
                else:
                    self.metrics.inc("saves_failed", len(job.items))
            except Exception:  # the saver must survive anything: log, count, go on
                log.exception("save job failed")
                self.metrics.inc("saves_failed", len(job.items) if job else 0)
            finally:
                if job is not None:
                    self._done(job, ok)  # even after an exception: else never reported
                    with self._progress:
                        self._completed += 1
                        self._progress.notify_all()
                self._q.task_done()
