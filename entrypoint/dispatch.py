"""Dispatch of one hop to a worker of its role: the LB picks, counted in flight, and the calls.

``Dispatch`` is owned by ``entrypoint.server.EntrypointService`` and used by the request path
(``entrypoint.generate``), one call per hop: ``encode`` (an image to a VE worker), ``prefill``,
and for the decode stream, which the request path reads itself, ``decode_pick``,
``start_decode``, ``decode_started`` and ``decode_ended``. It is handed its collaborators: the
instance registry, the strikes (``entrypoint.health``: each call's outcome is recorded there,
and picks prefer the workers it does not avoid), the service's one lock, the LBs
(``Balancers``) and the client's deadline rules (``Deadlines``). The failover rules it follows
(``RETRYABLE``, ``FAILED_HERE``) are stated in ``entrypoint.generate``'s module docstring
("Failover", "INTERNAL and UNKNOWN", "Cancellation", "Deadlines").

Every pick reads the loads, chooses and counts the call in flight on the chosen instance under
the one lock, and the count is taken back when the call (or stream) ends.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import grpc

from entrypoint.config import EntrypointConfig
from entrypoint.health import Outcome, Strikes
from entrypoint.instances import Instance, OpenDecode, Registry
from entrypoint.proto import serving_pb2 as pb
from entrypoint.vision import SCOPE_METADATA, scoped_image_key
from lb.cost_model import CostModels, load_default
from lb.decode import request_kv_bytes
from lb.registry import get_policy
from lb.types import DecodeInstance, DecodeRequest, PrefillInstance, QueuedPrefill, RouteRequest, VEInstance, VERequest


# The worker (or the way to it) failed, not this request: mark it down and fail over.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED})
# A worker still serving failed this call (an engine step, or its handler): retry within max_attempts,
# the worker stays up (``entrypoint.generate``'s module docstring, "INTERNAL and UNKNOWN").
FAILED_HERE = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
# How far this server's reckoning of a client's deadline may lag the client's own: the server's deadline is set
# from grpc-timeout when the call's headers arrive, so it falls after the client's by the time they took to get
# here (the send, scheduling on a loaded host, grpc-timeout rounded up). Two readings use it:
#   - a worker call that fails DEADLINE_EXCEEDED while its client has more than this left did not run out of the
#     client's time (its timeout was that time: it ends at or after the client's deadline), whatever its clock: the
#     status is the worker's own (an internal deadline), a worker failure, not the client's deadline;
#   - a client call cancelled with at most this left was cancelled at its deadline (grpc cancels the client's call,
#     and so, by its callback, the worker call), not by a client that left. The client's own grpc cancels it when
#     ITS deadline passes, and that cancel reaches this server before the server's deadline timer fires, the lag
#     above still left. grpc tells the handler nothing else (a cancel is a cancel), so the lag decides; it is wide
#     enough for a loaded host, where a narrower one read such a cancel as the client leaving and missed the
#     strike for a worker that made no progress in the client's whole time. A client that does leave within this
#     of its deadline is taken for its deadline: one strike at most, and only for a worker that made no progress.
CLIENTS_DEADLINE_SLACK_S = 0.25
# A client's remaining time above this is no deadline: grpc's server context reads about 9.2e18 s then, which a
# worker call cannot take as its timeout (grpc fails such a call DEADLINE_EXCEEDED at once).
NO_DEADLINE_S = 1e8


class Abort(Exception):
    """The request ends with ``code`` and ``message`` (``EntrypointService.Generate`` aborts the call)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class RegistrationGone(grpc.RpcError):
    """A worker call that could not start because its registration's channel was closed under it
    (``Registry.add`` replaced it, ``remove`` took it out: grpc raises ``ValueError``). It reads
    as UNAVAILABLE, so the hop fails over as for a worker gone (rather than the request failing
    UNKNOWN); ``mark_down`` of that old registration changes nothing."""

    def __init__(self, inst: Instance):
        super().__init__(f"worker {inst.worker_id}'s registration was replaced or removed")
        self._details = str(self)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


class StalledStream(grpc.RpcError):
    """A Decode stream that ``StallWatch`` cancelled: no event for ``idle_s``. It reads as
    DEADLINE_EXCEEDED (``RETRYABLE``): the worker missed ``worker_timeout_s``, is marked down, and
    the stream resumes elsewhere, as for a unary call that missed it."""

    def __init__(self, inst: Instance, idle_s: float):
        super().__init__(f"worker {inst.worker_id} sent no decode event for {idle_s:g} s")
        self._details = str(self)

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details


def start_call(inst: Instance, start: Callable[[], Any]) -> Any:
    """``start()`` (a call on ``inst``'s stub), with a closed registration's ``ValueError`` as
    ``RegistrationGone``."""
    try:
        return start()
    except ValueError as exc:
        if not inst.closed:
            raise
        raise RegistrationGone(inst) from exc


class StallWatch:
    """Cancels a worker's stream (``call``) once ``idle_s`` pass without an event from it (its
    first included): a Decode stream is bounded by inactivity, not by its total duration
    (``entrypoint.generate``, "Deadlines"). ``stalled`` is set before the cancel, so the
    stream's CANCELLED reads as the worker's stall, not the client's. Use as a context manager
    around the stream's iteration, calling ``progress()`` on each event; one thread, sleeping.

    Only the time spent waiting on the worker counts: call ``pause()`` before handing an event
    to the consumer (a generator's ``yield``: the client may take its time to read it, or grpc's
    flow control may hold the write) and ``progress()`` when it is taken. While paused the watch
    never fires, so a slow client reader is never taken for a stalled worker."""

    def __init__(self, call: Any, idle_s: float):
        self._call, self._idle_s = call, idle_s
        self._last: float | None = time.monotonic()  # None: paused (the consumer holds the event)
        self._done = threading.Event()
        self.stalled = False

    def __enter__(self) -> "StallWatch":
        threading.Thread(target=self._run, name="decode-stall-watch", daemon=True).start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()

    def progress(self) -> None:
        """An event came from the worker (or the consumer took the last one): count ``idle_s`` from now."""
        self._last = time.monotonic()

    def pause(self) -> None:
        """The consumer holds an event: nothing is counted until the next ``progress()``."""
        self._last = None

    def _run(self) -> None:
        while True:
            last = self._last  # read once: the other thread may pause or resume meanwhile
            left = self._idle_s if last is None else last + self._idle_s - time.monotonic()
            if left <= 0:
                self.stalled = True  # before the cancel: the stream's CANCELLED is read after it
                self._call.cancel()
                return
            if self._done.wait(left):
                return


@dataclass(frozen=True, slots=True)
class Deadlines:
    """How the client's deadline and ``worker_timeout_s`` bound a worker call (``entrypoint.generate``,
    "Deadlines"); ``retry_backoff_s``: the wait before a retry after ``FAILED_HERE``. Each method
    reads the client's call (``context``) as it is now."""

    worker_timeout_s: float
    retry_backoff_s: tuple[float, float]

    def unary_timeout(self, context) -> float:
        """A unary worker call's timeout: ``worker_timeout_s``, or the client's remaining time if shorter."""
        rem = context.time_remaining()
        return self.worker_timeout_s if rem is None else max(0.001, min(rem, self.worker_timeout_s))

    @staticmethod
    def stream_timeout(context) -> float | None:
        """A Decode stream's timeout: the client's remaining time (``None``: no client deadline). Its
        inactivity is bounded by ``StallWatch``, not here."""
        rem = context.time_remaining()
        return None if rem is None or rem > NO_DEADLINE_S else max(0.001, rem)

    def backoff(self, context) -> None:
        """Wait before a retry after ``FAILED_HERE``: a time drawn uniformly from ``retry_backoff_s``,
        at most the client's remaining time (``entrypoint.generate``, "INTERNAL and UNKNOWN"). A
        client that left during the wait gets no retry: ``Abort`` (CANCELLED)."""
        delay = random.uniform(*self.retry_backoff_s)
        rem = context.time_remaining()
        time.sleep(delay if rem is None else max(0.0, min(delay, rem)))
        if not context.is_active():
            raise Abort(grpc.StatusCode.CANCELLED, "the client went away before the retry")

    def clients_deadline(self, context) -> bool:
        """Whether a worker call made now has the client's remaining time as its timeout (shorter than
        ``worker_timeout_s``): its DEADLINE_EXCEEDED is then the client's deadline, not the worker's."""
        rem = context.time_remaining()
        return rem is not None and rem < self.worker_timeout_s

    @staticmethod
    def out_of_clients_time(context) -> bool:
        """Whether a worker call that just failed DEADLINE_EXCEEDED, with the client's remaining time as its
        timeout, ran out of it: the client has (almost) no time left (``CLIENTS_DEADLINE_SLACK_S``)."""
        rem = context.time_remaining()
        return rem is not None and rem <= CLIENTS_DEADLINE_SLACK_S

    @staticmethod
    def deadline_passed(context) -> bool:
        """Whether the client's call, just cancelled, was cancelled at its deadline rather than by a client that
        left: at most ``CLIENTS_DEADLINE_SLACK_S`` of it is left (the client's own cancel at its deadline arrives
        with that lag still left here). A client without a deadline reads about 9.2e18 s left: never."""
        rem = context.time_remaining()
        return rem is not None and rem <= CLIENTS_DEADLINE_SLACK_S


@dataclass(frozen=True, slots=True)
class Balancers:
    """The three LBs of the entrypoint and the cost models they were built with (``models``: a
    decode's KV bytes, as the Decode LB counts them)."""

    prefill: Any
    decode: Any
    ve: Any
    models: CostModels

    @classmethod
    def build(cls, cfg: EntrypointConfig) -> "Balancers":
        """The policies ``cfg`` names over the committed cost models, which size a fetched block as
        the hits count it (``block_size`` tokens, always) and its bytes per token as the served
        model does (``kv_bytes_per_token`` when set; 0: the cost model's own)."""
        models = load_default()
        models = dataclasses.replace(models, transfer=dataclasses.replace(
            models.transfer, kv_bytes_per_token=cfg.kv_bytes_per_token or models.transfer.kv_bytes_per_token,
            block_tokens=cfg.block_size))
        return cls(prefill=get_policy(cfg.prefill_policy, models, kind="prefill"),
                   decode=get_policy(cfg.decode_policy, models, kind="decode"),
                   ve=get_policy(cfg.ve_policy, models, kind="ve"), models=models)


class Dispatch:
    """Picks a worker for a hop and calls it, failing over within ``max_attempts`` (module docstring).

    Invariants:
      1. A pick's snapshot of the loads, the LB's choice and the count of the call in flight on the
         chosen instance (``Instance.encodes``, ``inflight``, ``decodes``) happen under ``lock``, so
         concurrent requests see each other's picks and spread.
      2. Each count is taken back when its call or stream ends, whatever the outcome (``encode`` and
         ``prefill`` themselves; a decode stream by ``decode_ended``, which the request path calls).
    """

    def __init__(self, registry: Registry, strikes: Strikes, lock: threading.Lock, lbs: Balancers,
                 deadlines: Deadlines, max_attempts: int):
        self.registry, self.strikes, self.lbs, self.deadlines = registry, strikes, lbs, deadlines
        self.max_attempts = max_attempts
        self._lock = lock

    # ------------------------------------------------------------------ the hops
    def encode(self, request_id: str, img: pb.ImageSegment, scope: str, context) -> tuple[Instance, pb.EncodeReply]:
        """``Encode`` of ``img`` on a VE worker the VE LB picks, with failover; ``scope``: the
        tenant's VE cache scope (``entrypoint.vision.tenant_scope``), sent as call metadata and the
        key of the LB's affinity."""
        metadata = ((SCOPE_METADATA, scope),)
        key = scope.encode()
        return self.call("ve", lambda tiers: self._ve_pick(img, key, tiers), context,
                         lambda i: self._tracked_encode(i, pb.EncodeRequest(request_id=request_id, image=img),
                                                        context, metadata))

    def prefill(self, route: RouteRequest, slot: str, preq: pb.PrefillRequest,
                context) -> tuple[Instance, pb.PrefillReply]:
        """``Prefill`` on a worker the Prefill LB picks for ``route``, with failover; ``slot``: the
        request's in-flight entry there (``Instance.inflight``)."""
        return self.call("prefill", lambda tiers: self._prefill_pick(route, slot, tiers), context,
                         lambda i: self._tracked_prefill(i, slot, preq, context))

    def call(self, role: str, pick: Callable[[list[list[Instance]]], Instance], context,
             fn: Callable[[Instance], Any]) -> tuple[Instance, Any]:
        """Pick an instance of ``role`` and call it; on a retryable failure mark it down and retry.
        ``pick`` gets the live instances as ``Strikes.tiers`` orders them (see ``_choose``)."""
        last = None
        failed_here: set[str] = set()  # workers that failed this call with FAILED_HERE: tried again last
        for attempt in range(self.max_attempts):
            live = self.registry.ready(role)
            if not live:  # after a failed attempt, say why it failed (as the decode hop does)
                raise Abort(grpc.StatusCode.UNAVAILABLE, f"no {role} worker is up" + (
                    f" (after {attempt} failed attempts; last: {role} worker {inst.worker_id}: {last.code()}: "
                    f"{last.details()})" if last is not None else ""))
            inst = pick(self.strikes.tiers(live, failed_here))
            clients_deadline = self.deadlines.clients_deadline(context)  # before fn takes its timeout
            try:
                reply = fn(inst)
            except Abort as exc:  # the worker call cancelled: the client left, or its deadline passed
                if exc.code == grpc.StatusCode.CANCELLED and self.deadlines.deadline_passed(context):
                    self.strikes.record(inst, Outcome.NO_PROGRESS)  # no reply in the client's time
                raise
            except grpc.RpcError as exc:
                if (exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and clients_deadline
                        and self.deadlines.out_of_clients_time(context)):  # else the worker's own: RETRYABLE
                    self.strikes.record(inst, Outcome.NO_PROGRESS)  # no reply in the client's time
                    raise Abort(exc.code(), f"the client's deadline passed during the {role} call on worker "
                                f"{inst.worker_id}") from exc
                if exc.code() not in RETRYABLE | FAILED_HERE or not context.is_active():
                    raise Abort(exc.code(), f"{role} worker {inst.worker_id}: {exc.details()}") from exc
                if exc.code() in FAILED_HERE:
                    self.strikes.record(inst, Outcome.FAILED_HERE)
                    failed_here.add(inst.worker_id)
                    if attempt + 1 < self.max_attempts:
                        self.deadlines.backoff(context)
                else:
                    if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:  # no reply in worker_timeout_s
                        self.strikes.record(inst, Outcome.NO_PROGRESS)  # (entrypoint.health: hung engines)
                    self.registry.mark_down(inst, f"{role} call failed: {exc.code()}")
                last = exc
            else:
                self.strikes.record(inst, Outcome.PROGRESS)
                return inst, reply
        code = last.code() if last is not None and last.code() in FAILED_HERE else grpc.StatusCode.UNAVAILABLE
        raise Abort(code, f"{role} failed on {self.max_attempts} attempts; last: "
                    f"{f'{inst.worker_id}: {last.code()}: {last.details()}' if last is not None else '?'}")

    # ------------------------------------------------------------------ the decode stream
    def decode_pick(self, dreq: DecodeRequest, slot: str, tiers: list[list[Instance]]) -> Instance:
        """The Decode LB's pick, counted in flight there (``Instance.decodes[slot]``: an ``OpenDecode``
        with its context tokens and the KV bytes the LB counted for it) before the lock is let go; the
        caller marks it started on its first event (``decode_started``) and takes it back when the
        stream ends (``decode_ended``).

        An instance's running requests and batch tokens are the larger of what its last ``Status``
        said (every entrypoint's, as of the last heartbeat) and this entrypoint's own decode streams
        open there (current): without the latter, every request picked between two heartbeats saw
        the same figures and went to the same instance. Its KV in use is what its last ``Status``
        said plus the KV of this entrypoint's streams that ``Status`` did not count yet (see
        ``decode_snapshot``), so the requests picked between two heartbeats cannot together be
        placed on one instance beyond its KV capacity."""
        with self._lock:  # snapshot, choice and count together: concurrent picks see each other
            inst = self._choose(tiers, "decode",
                                lambda tier: self.lbs.decode.choose(dreq, [self.decode_snapshot(i) for i in tier]))
            inst.decodes[slot] = OpenDecode(dreq.context_tokens, request_kv_bytes(dreq, self.lbs.models))
        return inst

    @staticmethod
    def start_decode(inst: Instance, dreq: pb.DecodeRequest, timeout: float | None, context) -> Any:
        """The ``Decode`` stream of ``dreq`` on ``inst``, which a client that goes away cancels."""
        call = start_call(inst, lambda: inst.stub.Decode(dreq, timeout=timeout))
        if not context.add_callback(call.cancel):  # the client is already gone
            call.cancel()
        return call

    def decode_started(self, inst: Instance, slot: str) -> None:
        """The stream ``slot`` on ``inst`` sent its first event: a ``Status`` asked from now on counts its KV."""
        with self._lock:
            d = inst.decodes.get(slot)
            if d is not None and d.started_at is None:
                inst.decodes[slot] = dataclasses.replace(d, started_at=time.monotonic())

    def decode_ended(self, inst: Instance, slot: str) -> None:
        """The stream ``slot`` on ``inst`` ended (served, failed or cancelled): no longer in flight there."""
        with self._lock:
            inst.decodes.pop(slot, None)

    def check_decode_fits(self, dreq: DecodeRequest) -> None:
        """``Abort`` (RESOURCE_EXHAUSTED) before the prefill when no decode worker up could hold
        ``dreq``'s KV even empty: its capacity less what the Decode LB keeps free
        (``kv_limit_bytes``: kvstack's 5 % headroom). The decode hop would refuse it after the
        prefill, which would then be paid for nothing. Nothing is checked while no decode worker
        up has reported a capacity: the decode hop says what is wrong then."""
        caps = [i.status.kv_capacity_bytes for i in self.registry.ready("decode")
                if i.status is not None and i.status.kv_capacity_bytes > 0]
        if not caps:
            return
        need = request_kv_bytes(dreq, self.lbs.models)
        most = max(self.lbs.decode.kv_limit_bytes(c) for c in caps)
        if need > most:
            raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"decode admission control: the request needs {need / 2**20:.1f} MiB of KV "
                        f"({dreq.context_tokens + dreq.max_new_tokens} tokens), more than any decode worker up "
                        f"takes even when empty ({most / 2**20:.1f} MiB: its capacity less the decode "
                        f"policy's reserve); ask for fewer new tokens or shorten the prompt")

    @staticmethod
    def decode_snapshot(i: Instance) -> DecodeInstance:
        """``i`` as the Decode LB sees it (under the entrypoint's lock: ``i.decodes``).

        KV in use: the last ``Status``'s ``kv_used_bytes`` plus the ``kv_bytes`` of each stream of
        ``i.decodes`` that ``Status`` may not count: one not started yet (the worker may not have
        admitted it), or started after that ``Status`` was asked. Counted twice for a moment at
        worst (a stream admitted but not yet started), never left out."""
        st = i.status
        unreported = sum(d.kv_bytes for d in i.decodes.values()
                         if d.started_at is None or d.started_at >= i.status_asked_at)
        return DecodeInstance(i.worker_id, kv_used_bytes=(st.kv_used_bytes if st else 0) + math.ceil(unreported),
                              kv_capacity_bytes=(st.kv_capacity_bytes or 1) if st else 1,
                              batch_tokens=max(sum(d.context_tokens for d in i.decodes.values()),
                                               st.batch_tokens if st else 0),
                              running_requests=max(len(i.decodes), st.running if st else 0))

    # ------------------------------------------------------------------ picks and tracked calls
    @staticmethod
    def _unary(fut: grpc.Future, context, inst: Instance, method: str) -> Any:
        """The reply of the unary worker call ``fut``, which a client that goes away cancels (a
        blocking call would go on, its worker computing and its counts held, until it ended). Its
        cancellation is ``Abort`` with CANCELLED, the client's: no failover, no worker marked down."""
        if not context.add_callback(fut.cancel):  # the client is already gone (grpc: no callback then)
            fut.cancel()
        try:
            return fut.result()
        except grpc.FutureCancelledError as exc:
            raise Abort(grpc.StatusCode.CANCELLED, f"the client went away during {method} on worker "
                        f"{inst.worker_id}") from exc

    @staticmethod
    def _choose(tiers: list[list[Instance]], role: str, choose: Callable[[list[Instance]], Any]) -> Instance:
        """The instance the LB chooses (``choose(tier)``: its ``Decision`` among ``tier``) in the first of
        ``tiers`` (``Strikes.tiers``: the preferred workers first, all live ones last) where it chooses one;
        ``Abort`` (RESOURCE_EXHAUSTED, the LB's reason over the widest tier) when it refuses in every tier.
        The caller holds the lock. Every tier is offered, not only the preferred one, so that a request
        is not refused while an avoided worker, or one that failed this request, is idle with room."""
        for tier in tiers:
            decision = choose(tier)
            if decision.chosen is not None:
                return next(i for i in tier if i.worker_id == decision.chosen)
        raise Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{role} admission control: {decision.reason}")

    def _ve_pick(self, img, scope: bytes, tiers: list[list[Instance]]) -> Instance:
        """The VE LB's pick, counted in flight there (``Instance.encodes``) before the lock is let go.

        An instance's queue is the larger of what its last ``Status`` said (encodes in flight there,
        from every entrypoint, as of the last heartbeat) and this entrypoint's own Encode calls in
        flight there (current): without the latter, every uncached image picked between two
        heartbeats saw the same queues and went to the first instance."""
        def snap(i: Instance) -> VEInstance:
            return VEInstance(i.worker_id, queue_images=max(i.encodes, (i.status.waiting + i.status.running)
                                                            if i.status else 0),
                              cached_images=frozenset(i.status.cached_images) if i.status else frozenset())

        req = VERequest((scoped_image_key(scope, img.image_hash),))  # affinity to this tenant's own entries only
        with self._lock:  # snapshot, choice and count together: concurrent picks see each other
            inst = self._choose(tiers, "ve", lambda tier: self.lbs.ve.choose(req, [snap(i) for i in tier]))
            inst.encodes += 1
        return inst

    def _tracked_encode(self, inst: Instance, ereq, context, metadata):
        """``Encode`` on ``inst`` (picked, and counted in flight, by ``_ve_pick``); uncounted when it ends."""
        try:
            timeout = self.deadlines.unary_timeout(context)
            fut = start_call(inst, lambda: inst.stub.Encode.future(ereq, timeout=timeout, metadata=metadata))
            return self._unary(fut, context, inst, "Encode")
        finally:
            with self._lock:
                inst.encodes -= 1

    def _prefill_pick(self, route: RouteRequest, slot: str, tiers: list[list[Instance]]) -> Instance:
        """The Prefill LB's pick, counted in flight there (``Instance.inflight[slot]``) before the lock
        is let go, as ``_ve_pick`` does: were the queues read under the lock and the new entry added
        after it, concurrent requests would all see the same queues and pick the same instance."""
        def snap(i: Instance) -> PrefillInstance:
            return PrefillInstance(i.worker_id, queue=tuple(QueuedPrefill(s, c) for s, c in i.inflight.values()))

        with self._lock:  # snapshot, choice and count together: concurrent picks see each other
            inst = self._choose(tiers, "prefill", lambda tier: self.lbs.prefill.choose(route, [snap(i) for i in tier]))
            cached = route.cached_tokens(route.hit_of(inst.worker_id).total)  # capped as the lookup hop caps it
            inst.inflight[slot] = (max(0, route.prompt_tokens - cached), cached)
        return inst

    def _tracked_prefill(self, inst: Instance, slot: str, preq, context):
        """``Prefill`` on ``inst`` (picked, and counted in flight, by ``_prefill_pick``); uncounted when it ends."""
        try:
            timeout = self.deadlines.unary_timeout(context)
            fut = start_call(inst, lambda: inst.stub.Prefill.future(preq, timeout=timeout))
            return self._unary(fut, context, inst, "Prefill")
        finally:
            with self._lock:
                inst.inflight.pop(slot, None)
