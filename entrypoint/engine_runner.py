"""The engine side of a worker (``entrypoint.worker``): ``EngineRunner`` owns one engine and
steps it on one thread; ``request_stats`` gives a finished request's figures.

Threads: gRPC handler threads only *submit* work (``EngineRunner.submit``) and wait on
per-request queues; one runner thread owns the engine and steps it, so requests submitted
together are batched by the engine's scheduler and the engine is never touched from two
threads. Two others may end its requests, never touching the engine: ``stop`` and the step
watchdog; a lock, which the runner thread holds for all but the step itself, keeps them from
publishing to a request at the same time (``EngineRunner``, invariants).

Failures: a request the engine refuses (``InvalidRequest`` from ``add_request``: a prompt
too long for the pool, bad sampling) fails alone with INVALID_ARGUMENT. An engine step that
raises takes the requests it held out of the engine (``Engine.abort_request``: blocks freed,
the connector forgets them), so the next step starts from a clean engine. Which of them was
at fault is not known, so none fails yet when it held two or more: each is retried alone,
one after another (new requests wait meanwhile), until it has finished or sent one more
token, then set aside; once every turn alone is over, those that passed rejoin the batch. A
request continues after the tokens it has sent (prompt plus those tokens, at the next output
index, as a re-dispatched ``Decode`` does), so none is sent twice. Only a request that fails
alone (it held its step alone, or this was its turn) fails, with INTERNAL; so the batch-mate
of a poison request is served here, not failed with it (were both failed, with one worker
of the role the entrypoint's retries would tend to batch them again until the good one ran
out of attempts). This ends: a request is retried alone only after a step it shared
failed, and each turn ends with it failed, finished or one token further. If the engine can
not even drop a request, the worker reports itself down (``Status`` answers UNAVAILABLE)
rather than failing every request while looking healthy.

Cancellation: a request whose caller went away (the RPC was cancelled, or passed its
deadline) is cancelled (``EngineRunner.cancel``, from any thread; the worker calls it when
its RPC ends before the request did). The runner thread applies it before its next step:
the request leaves the engine (``Engine.abort_request``: blocks freed, the connector forgets
it), the inbox, the retry queue, the set-aside list and its turn alone, whichever holds it,
so it takes no more steps, batch slots or turns alone (rather than being decoded to
``max_new_tokens``, even retried alone after a failed step, while new requests wait).
The runner then holds no reference to it (its maps and queues do not leak it, and its handle
gets no more tokens and no final event). A request that already ended (``done`` or an
error) is not touched. Each one cancelled is
logged (info) and counted (``EngineRunner.cancelled``).

Stopping (``EngineRunner.stop``, at the worker's shutdown): the runner thread ends after its
current step, then every request it still holds (in the engine, waiting for or set aside after
a retry alone, in the inbox) ends with UNAVAILABLE "this worker is down: it is shutting down",
and so does each one submitted later, at once; ``Status`` answers UNAVAILABLE too. The RPC waiting
on each so ends with a status the entrypoint fails over on (the worker is marked down; a decode
stream resumes elsewhere after the tokens it sent). Without a final event their RPCs would
wait until grpc cut them at the end of the server's grace, and the entrypoint would see a bare
CANCELLED.

Stuck steps (``step_timeout_s`` > 0; the worker's ``--step-timeout-s``, default
``DEFAULT_STEP_TIMEOUT_S``): an ``engine.step()`` that never returns (a hung kernel, a deadlock)
blocks the runner thread, so nothing in the engine advances, new requests wait in the inbox and
cancels are never applied. A watchdog thread sees a step running for longer than
``step_timeout_s`` and takes the worker down for good, as ``stop`` does: ``broken`` is "engine
step stuck for N s" (``Status`` answers UNAVAILABLE with it, so the entrypoint's heartbeat keeps
the worker down rather than bringing it back to take more requests), one error is logged, and
every request held or waiting ends UNAVAILABLE "this worker is down: engine step stuck for N s",
as does each one submitted later, at once. It stays down until
the process is restarted, even if the step returns later: an engine whose step hung once can not
be trusted (its state, its device), and a worker that came back would only hang its next batch.
Should the step return, the runner thread publishes nothing of it and ends. Only ``step`` is
watched: the engine's bookkeeping calls (``add_request``, ``abort_request``) are not.

Idle: with no request to step, the runner thread still collects the connector's reports of
saves that ended (``Engine.collect_finished``, each ``_wake`` wait, only while the engine has
one unreported: ``Engine.has_pending_sends``), so the last requests' records (logits included)
leave the engine and get their ``send_state`` when their saves end, not when the next request
arrives (a step collects them otherwise).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from kvstore.errors import InvalidRequest
from kvstore.keys import ImageSpan

log = logging.getLogger(__name__)

# A step running longer than this takes the worker down for good (module docstring, "Stuck
# steps"). Generous: on CPU one step of a large model (prefill chunks across a batch, a window
# replay, loads from a slow store) can take minutes, and a false alarm loses a healthy worker
# until it is restarted; a merely slow worker is left out by the entrypoint's strikes meanwhile
# (entrypoint.health).
DEFAULT_STEP_TIMEOUT_S = 600.0


class Handle:
    """One submitted request: what was submitted, its engine record, and the queue of events for
    the RPC thread.

    Invariant: ``out`` holds the output tokens already put on ``events``, in order, and ``req``
    (the latest engine record) continues at output index ``base`` (``base <= len(out)``): a
    request retried alone re-enters the engine with ``out`` appended to its prompt, so no token
    is sent twice or skipped.

    ``ended`` is set once its last event (``done`` or an error) is on ``events``, ``cancelled``
    once ``EngineRunner.cancel`` was called for it. Events are put by one thread at a time: the
    runner's lock is held (the runner thread, or ``stop`` or the step watchdog ending it), or the
    handle was just taken from the inbox (``get_nowait`` hands each to one thread only).
    """

    __slots__ = ("events", "args", "req", "metrics_before", "out", "base", "ended", "cancelled")

    def __init__(self, args: tuple) -> None:
        self.events: queue.Queue = queue.Queue()
        self.args = args  # (rid, prompt, sampling, tenant_salt, images) as submitted
        self.req: Any = None
        self.metrics_before: dict[str, float] = {}
        self.out: list[int] = []
        self.base = 0
        self.ended = False
        self.cancelled = False

    def end(self, event: tuple) -> None:
        """Put the last event (``("done", request)`` or ``("error", code, message)``); a handle
        that already ended gets nothing more (one last event, never two)."""
        if self.ended:
            return
        self.ended = True
        self.events.put(event)


class EngineRunner:
    """Owns one engine; a single thread steps it. See the module docstring.

    Invariants:
    1. ``_lock`` is held by the runner thread for all it does but ``engine.step()``, and by
       ``stop`` and the step watchdog while they end requests: so a handle is never published to
       by two threads at once, and none gets a token after its last event.
    2. Once ``broken`` is set outside the runner thread (``stop``, the watchdog), every request
       held here has ended and the runner thread publishes nothing more: it stops at its next
       look under the lock (after a stuck step that returns, too). Set by the runner thread
       itself (an engine that can not drop a request), the thread ends them (``_go_down``).
    """

    def __init__(self, engine: Any, connector: Any, *, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S):
        if isinstance(step_timeout_s, bool) or not isinstance(step_timeout_s, (int, float)) \
                or not math.isfinite(step_timeout_s) or step_timeout_s < 0:
            raise InvalidRequest(f"step_timeout_s must be a finite number of seconds >= 0 (0: no step watchdog), "
                                 f"got {step_timeout_s!r}")
        self.engine, self.connector = engine, connector
        self.step_timeout_s = float(step_timeout_s)
        self._inbox: queue.Queue = queue.Queue()
        self._cancels: queue.Queue = queue.Queue()  # handles to cancel (EngineRunner.cancel), for the runner thread
        self.cancelled = 0  # requests cancelled before they ended (their caller went away)
        self._live: dict[str, Handle] = {}  # in the engine
        # Retry alone (see _step_failed): the requests of a failed step waiting for their turn, the
        # one taking it (the only request in the engine meanwhile), and those that passed it.
        self._retry: collections.deque[Handle] = collections.deque()
        self._alone: Handle | None = None
        self._passed: list[Handle] = []
        self._wake = threading.Event()
        self._stop = threading.Event()  # the runner thread ends at its next look (and the watchdog)
        self._lock = threading.Lock()  # see the class docstring, invariant 1
        self._step_started: float | None = None  # time.monotonic() at the start of the step running now
        self.broken: str | None = None  # why the engine can not be used any more (Status: UNAVAILABLE)
        self._thread = threading.Thread(target=self._loop, name="engine-runner", daemon=True)
        self._thread.start()
        self._watchdog: threading.Thread | None = None
        if self.step_timeout_s > 0:
            self._watchdog = threading.Thread(target=self._watch_steps, name="engine-step-watchdog", daemon=True)
            self._watchdog.start()

    def submit(self, rid: str, prompt: list[int], sampling: Any, *, tenant_salt: bytes,
               images: list[ImageSpan]) -> Handle:
        """Queue a request; its outcome arrives on the handle's ``events``: ``("token", id, i)``,
        ``("done", request)`` or ``("error", grpc.StatusCode, message)``."""
        h = Handle((rid, list(prompt), sampling, tenant_salt, list(images)))
        self._inbox.put(h)
        self._wake.set()
        if self.broken is not None:  # checked after the put: no request waits on a stopped runner
            self._fail_inbox()
        return h

    def cancel(self, h: Handle) -> None:
        """Cancel ``h``: its caller went away. Thread-safe; the runner thread applies it before
        its next step (``_apply_cancels``). No-op for a request that already ended, or twice."""
        if h.ended or h.cancelled:
            return
        h.cancelled = True  # read by the runner thread when it admits h (it may still be in the inbox)
        self._cancels.put(h)
        self._wake.set()

    def _apply_cancels(self) -> None:
        """Take each cancelled request out of whatever holds it here: the engine (its turn alone
        included), the retry queue or the set-aside list. One still in the inbox is dropped when
        admitted (``_enter``); one that ended is held by nothing, and is left alone."""
        while True:
            try:
                h = self._cancels.get_nowait()
            except queue.Empty:
                return
            rid = h.args[0]
            if self._alone is h:
                self._alone = None
            if self._live.get(rid) is h:
                del self._live[rid]
                self._abort(rid, f"cancelling {rid}")
                self._count_cancel(h, "in the engine")
            elif h in self._retry:
                self._retry.remove(h)
                self._count_cancel(h, "waiting for its retry alone")
            elif h in self._passed:
                self._passed.remove(h)
                self._count_cancel(h, "set aside after its retry alone")
            if self.broken is not None:
                self._go_down(f"this worker is down: {self.broken}", [])
                return

    def _count_cancel(self, h: Handle, where: str) -> None:
        self.cancelled += 1
        log.info("cancelled request %s %s after %d tokens: its caller went away", h.args[0], where, len(h.out))

    def _fail_inbox(self) -> None:
        """Fail every queued request with UNAVAILABLE (the runner is down; each is taken once)."""
        while True:
            try:
                h = self._inbox.get_nowait()
            except queue.Empty:
                return
            h.end(("error", grpc.StatusCode.UNAVAILABLE, f"this worker is down: {self.broken}"))

    def _admit(self) -> None:
        while True:
            try:
                h = self._inbox.get_nowait()
            except queue.Empty:
                return
            h.metrics_before = self.connector.metrics.snapshot()
            self._enter(h)

    def _enter(self, h: Handle) -> bool:
        """Add ``h`` to the engine, continuing after the tokens it has sent; on failure, fail it alone."""
        rid, prompt, sampling, salt, images = h.args
        if h.cancelled:  # its caller went away while it waited (inbox, retry queue, set aside)
            self._count_cancel(h, "before it entered the engine")
            return False
        if h.out:  # a retry: resume at the next output index, as a re-dispatched Decode does
            sampling = dataclasses.replace(sampling, max_new_tokens=sampling.max_new_tokens - len(h.out),
                                           output_offset=sampling.output_offset + len(h.out))
        try:
            h.req = self.engine.add_request(rid, prompt + h.out, sampling, tenant_salt=salt, images=images)
        except InvalidRequest as exc:
            h.end(("error", grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return False
        except Exception as exc:  # noqa: BLE001 - a bug must fail this request, not the runner thread
            log.exception("cannot admit %s", rid)
            h.end(("error", grpc.StatusCode.INTERNAL, f"internal error admitting the request: {exc}"))
            return False
        h.base = len(h.out)
        self._live[rid] = h
        return True

    def _publish(self) -> None:
        for rid, h in list(self._live.items()):
            req = h.req
            for i in range(len(h.out) - h.base, len(req.output)):
                h.events.put(("token", req.output[i], h.base + i))
                h.out.append(req.output[i])
            if req.status.value == "finished":
                del self._live[rid]
                self.engine.take_finished(rid)  # else the engine keeps every request it served
                h.end(("done", req))

    def _loop(self) -> None:
        """Apply cancels, admit, step, publish; all under the lock but the step itself (which the
        watchdog must be able to see stuck and act on meanwhile). A step that raises, or anything
        around it, fails its requests as ``_step_failed`` says, and the thread goes on."""
        while True:
            with self._lock:
                if self._stop.is_set():
                    return
                stepping = self._guarded(self._before_step)
                if stepping:
                    self._step_started = time.monotonic()
            if not stepping:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            failure = None
            try:
                self.engine.step()
            except Exception as exc:  # noqa: BLE001 - fail the waiting requests, keep serving others
                failure = exc
            with self._lock:
                self._step_started = None
                if self.broken is not None:  # stop() or the watchdog ended every request meanwhile
                    return  # (invariant 2): publish nothing of this step
                if failure is not None:
                    log.error("engine step failed", exc_info=failure)
                    self._step_failed(f"engine step failed: {failure}")
                else:
                    self._guarded(self._after_step)

    def _guarded(self, fn: Callable[[], bool | None]) -> bool:
        """``fn()``; one that raises fails the requests held as a failed step does. Lock held."""
        try:
            return bool(fn())
        except Exception as exc:  # noqa: BLE001 - fail the waiting requests, keep serving others
            log.exception("engine step failed")
            self._step_failed(f"engine step failed: {exc}")
            return False

    def _before_step(self) -> bool:
        """Apply cancels and fill the engine (the next turn alone, or the batch); whether to step."""
        self._apply_cancels()
        if self._stop.is_set():  # the engine broke while dropping a cancelled request
            return False
        while self._alone is None and self._retry:  # the next turn alone (nothing else is in the engine)
            self._alone = self._retry.popleft()
            if not self._enter(self._alone):
                self._alone = None
        if self._alone is None:
            for h in self._passed:  # every turn alone is over: they rejoin the batch
                self._enter(h)
            self._passed.clear()
            self._admit()
        if self.engine.has_work():
            return True
        if self.engine.has_pending_sends():  # idle: no step collects them (module docstring, "Idle")
            self.engine.collect_finished()
        return False

    def _after_step(self) -> None:
        self._publish()
        if self._alone is not None:
            self._end_turn_alone()

    def _end_turn_alone(self) -> None:
        """After a step of the request retried alone: its turn ends once it has finished or sent
        a token (it passed the step that failed in the batch); one not finished leaves the engine
        until every turn alone is over (``_passed``), then continues after the tokens it sent."""
        h = self._alone
        if h.req.request_id in self._live and len(h.out) == h.base:
            return
        self._alone = None
        if h.req.request_id in self._live:
            del self._live[h.req.request_id]
            self._abort(h.req.request_id, "setting aside a request that passed its retry alone")
            self._passed.append(h)
        if self.broken is not None:  # h is in _passed: _go_down fails it
            self._go_down(f"this worker is down: {self.broken}", [])

    def _step_failed(self, reason: str) -> None:
        """Take every live request out of the engine, so that the next step starts clean (a step
        that raised may have left any of them half-advanced; ``abort_request`` frees their blocks
        and makes the connector forget them). Then retry alone, one after another, each one that
        shared the failed step with another: which one was at fault is not known, and failing
        them all would fail the batch-mates of a poison request with it. One that fails alone
        (it held the step alone, or this was its retry alone) fails with INTERNAL. No loop: a
        request is retried alone only after a step it shared failed, and each retry alone ends
        with it failed, finished or one token further. If the engine can not even drop them, it
        is broken: the worker reports itself down from now on."""
        failed = list(self._live.values())
        for h in failed:
            self._abort(h.req.request_id, reason)
        self._live.clear()
        alone, self._alone = self._alone, None
        if self.broken is not None:
            self._go_down(reason, failed)
            return
        if alone is not None or len(failed) < 2:
            for h in failed:
                log.warning("request %s failed alone in its engine step: %s", h.args[0], reason)
                h.end(("error", grpc.StatusCode.INTERNAL, reason))
            return
        log.warning("%s; retrying its %d requests alone, one after another, before failing any: %s",
                    reason, len(failed), ", ".join(h.args[0] for h in failed))
        self._retry.extend(failed)

    def _abort(self, rid: str, why: str) -> None:
        try:
            self.engine.abort_request(rid)
            # one that finished in a step that then raised is not running (abort_request does
            # nothing) but is recorded as finished: drop the record, nothing will take it
            self.engine.take_finished(rid)
        except Exception as exc:  # noqa: BLE001 - the engine's state is broken: stop using it
            log.exception("cannot drop request %s from the engine; the worker goes down", rid)
            self.broken = f"{why}; then dropping {rid} failed: {exc}"

    def _go_down(self, reason: str, failed: list[Handle]) -> None:
        """The engine is broken: fail every request this runner holds, and stop. Lock held."""
        self._end_held(grpc.StatusCode.INTERNAL, reason, failed)
        self._stop.set()
        self._fail_inbox()

    def _end_held(self, code: grpc.StatusCode, message: str, also: Iterable[Handle] = ()) -> None:
        """End ``also`` and every request held here (in the engine, waiting for or taking its turn
        alone, set aside after it) with ``code`` and ``message``, and forget them. Lock held (or
        the runner thread gone); one that already ended is left as it is (``Handle.end``)."""
        held = [*also, *self._live.values(), *self._retry, *self._passed]
        if self._alone is not None:
            held.append(self._alone)
        self._live.clear()
        self._retry.clear()
        self._passed.clear()
        self._alone = None
        for h in held:
            h.end(("error", code, message))

    def _down(self, reason: str) -> None:
        """Go down for good from outside the runner thread (``stop``, the watchdog): ``broken``
        (the first reason given wins; ``Status`` answers UNAVAILABLE with it), the runner thread
        told to stop, and every request held, in the inbox, or submitted from now on ended
        UNAVAILABLE "this worker is down: ...". Lock held (or the runner thread gone)."""
        if self.broken is None:
            self.broken = reason
        self._stop.set()
        self._end_held(grpc.StatusCode.UNAVAILABLE, f"this worker is down: {self.broken}")
        self._fail_inbox()  # after broken is set: a submit from now on fails itself (submit)

    def _watch_steps(self) -> None:
        """The step watchdog (``step_timeout_s`` > 0): a step running for longer takes the worker
        down for good (module docstring, "Stuck steps"). Looks a few times per timeout, at least
        once a second; ends with the runner.

        It ends the requests itself, from this thread, against the runner's one-thread rule: the
        runner thread is the one stuck, so no one else can, and their callers would wait for ever.
        That is safe: it touches no engine, only the handles and the runner's own lists, under the
        lock the runner thread holds for everything but the step (class docstring, invariants)."""
        every = min(1.0, self.step_timeout_s / 4)
        while not self._stop.wait(every):
            with self._lock:
                started = self._step_started
                if started is None or self._stop.is_set():
                    continue
                stuck = time.monotonic() - started
                if stuck < self.step_timeout_s:
                    continue
                reason = f"engine step stuck for {stuck:.1f} s (step_timeout_s={self.step_timeout_s:g})"
                held = len(self._live) + len(self._retry) + len(self._passed) + self._inbox.qsize()
                log.error("%s; this worker goes down until it is restarted, ending its %d requests", reason, held)
                self._down(reason)
                return

    def load(self) -> dict[str, int]:
        eng = self.engine
        pending = sum(len(r.prompt_token_ids) - min(r.num_computed, len(r.prompt_token_ids))
                      for r in list(eng.waiting) + list(eng.running))
        used = eng.pool.num_blocks - eng.pool.num_available()
        block_bytes = eng.pool.kv[0].numel() * eng.pool.kv.element_size()
        waiting = len(eng.waiting) + self._inbox.qsize() + len(self._retry) + len(self._passed)
        return {"running": len(eng.running), "waiting": waiting,
                "pending_tokens": pending, "kv_used_bytes": used * block_bytes,
                "kv_capacity_bytes": eng.pool.num_blocks * block_bytes,
                "batch_tokens": sum(r.num_computed for r in eng.running)}

    def stop(self, reason: str = "it is shutting down") -> None:
        """Stop the runner thread (after its current step) and end every request it holds, and each
        submitted from now on, with UNAVAILABLE ``reason`` (module docstring, "Stopping"). Call it
        once the server takes no new calls; calling it again does nothing more.

        A thread still in an engine step after 5 s (one that never returns) is left to it, logged
        (not waited for when the watchdog already found it stuck); its requests are ended all the
        same, from here, under the lock: the process is going away, and a final event then matters
        more than the runner's one-thread rule. Should that step return, the thread publishes
        nothing and stops (class docstring, invariant 2). A thread stuck in another engine call
        holds the lock: after 5 s more the requests are ended without it (a race with a thread
        that may never run again, accepted at shutdown)."""
        stuck = self.broken is not None and self._step_started is not None  # the watchdog's doing
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=0 if stuck else 5)
        if self._thread.is_alive() and not stuck:
            log.error("the engine runner did not stop within 5 s (an engine step that does not return); "
                      "ending its requests anyway")
        locked = self._lock.acquire(timeout=5)  # not had: the thread hangs in an engine call other than step
        try:
            if not locked:
                log.error("the engine runner holds its lock after 5 s (an engine call that does not return); "
                          "ending its requests without it")
            self._down(reason)
        finally:
            if locked:
                self._lock.release()
        if self._watchdog is not None:
            self._watchdog.join(timeout=5)


def request_stats(h: Handle, connector: Any, block_nbytes: int, started: float) -> dict[str, Any]:
    """Per-request figures. Token counts come from the request (after a retry alone, from its
    last pass through the engine, whose prompt held the tokens already sent: ``h.base``); the
    per-tier split is the connector's counters over the request's lifetime (exact when it ran
    alone, shared with requests batched beside it otherwise)."""
    req = h.req
    after = connector.metrics.snapshot()
    d = {k: after.get(k, 0) - h.metrics_before.get(k, 0) for k in after}
    B = block_nbytes
    per_tier = {t: int(d.get(f"hit_tokens_{t}", 0)) for t in ("device", "host", "store")}
    return {
        "prompt_tokens": len(req.prompt_token_ids) - h.base,
        "hit_tokens": req.hit_tokens,
        "loaded_tokens_by_tier": per_tier,
        "bytes_by_tier": {t: n * B for t, n in per_tier.items()},
        "replayed_tokens": req.replayed_tokens,
        "prefilled_tokens": len(req.prompt_token_ids) - req.hit_tokens,
        "snapshot_hit": bool(d.get("snapshot_hits", 0)),
        "load_errors": int(d.get("load_errors", 0)),
        "elapsed_ms": (time.perf_counter() - started) * 1e3,
    }
