"""The request path of ``Generate``: one request through its hops, one step after another.

``GeneratePipeline.run`` takes one ``GenerateRequest`` through the steps below, each a method
with a params record and a result record, in this order; each step yields the events it emits
(a "hop" event per hop, so a client can draw the timeline, and the tokens) and returns its
result to the next:

    step               params          result        events
    1. validate        the request     Admitted      none
    2. encode_images   EncodeParams    Encoded       "ve", one per image
    3. lookup_prefix   LookupParams    PrefixLookup  "lookup"
    4. prefill         PrefillParams   Prefilled     "prefill", token 0
    5. decode          DecodeParams    Decoded       "decode_start", tokens, then "decode" (served)
                                                     or "failover" (resumed elsewhere), per stream

then a "done" event with the request's summary. ``EntrypointService.Generate``
(``entrypoint.server``) runs it under its backpressure and turns an ``Abort`` into the call's
status. What each step does:

  0. parse: request bytes that are not a ``GenerateRequest`` are
     INVALID_ARGUMENT (``entrypoint.rpc``; so for every method of the service);
  1. validate (non-empty prompt, image spans inside the prompt and not
     overlapping, an ``image_hash`` that is the content hash of the
     ``image_data`` sent, known tenant, a finite temperature >= 0, SLOs
     ``ttft_slo_ms``/``tbt_slo_ms`` >= 0 and not NaN (0 or inf: none), prompt +
     ``max_new_tokens`` within ``max_model_len`` when that is set): misuse is
     INVALID_ARGUMENT before any hop, so a request that could never be decoded
     costs no prefill. An ``LBInputError`` that escapes a later hop all the same
     is INVALID_ARGUMENT too, never UNKNOWN;
  2. ``ve``: each image goes to a vision-encoder worker picked by the VE LB
     (image-hash affinity vs load: a worker's queue counts this entrypoint's Encode calls
     in flight there, so concurrent images spread); its tokens are spliced into the prompt.
     The VE cache is shared by all tenants, so the call carries the tenant's
     cache scope (``entrypoint.vision.tenant_scope``, gRPC metadata): an image
     sent by hash alone (empty ``image_data``) is found only if this tenant
     has sent its bytes before; otherwise the VE refuses it (INVALID_ARGUMENT).
     The hop (worker, ``cache_hit``, timings) never depends on other tenants'
     images: only this tenant's own entries hit, and the LB's affinity key is
     scoped (``entrypoint.vision.scoped_image_key``);
  3. ``lookup``: block hashes through ``kvstore.keys`` (tenant-salted), and the
     store's longest cached prefix (and SWA boundary) among the blocks an engine
     can reuse: at most ``(len(prompt) - 1) // block_size``, as the engine plugin
     caps it (the last prompt token is always computed); the prefill route's
     cached-token estimate uses the same cap. A store that is down is a miss;
  4. ``prefill``: a request whose KV (prompt + ``max_new_tokens``) no decode
     worker up could hold even empty (its capacity less the Decode LB's
     reserve) is refused first (RESOURCE_EXHAUSTED), not after a prefill paid
     for nothing; the Prefill LB picks an instance (estimated TTFT per tier),
     or admission control rejects the request (RESOURCE_EXHAUSTED with the
     LB's reason); the worker prefills and saves KV to the store;
  5. ``decode``: the Decode LB picks an instance, which loads the KV from the
     store and streams tokens.

  Each pick (VE, prefill, decode; ``entrypoint.dispatch``) reads the loads, chooses and counts the call
  in flight on the chosen instance under one lock, and the count is taken back
  when the call (or stream) ends: concurrent requests see each other's picks,
  so they spread instead of all going where the last heartbeat said was idle.
  A decode pick also counts the KV (context + ``max_new_tokens``) of this
  entrypoint's streams on an instance that its last heartbeat did not count yet
  (not started, or started after that ``Status`` was asked), so the requests picked
  between two heartbeats cannot together overcommit its KV capacity.

Failover: a worker that fails a call with a retryable status (``RETRYABLE``:
UNAVAILABLE, a broken stream, a missed ``worker_timeout_s``: the worker, or the way
to it, is gone) is marked down (that registration only: one that replaced it
under the same id since is left up, ``Registry.mark_down``) and the hop is
re-dispatched to another instance of its role, at most ``max_attempts`` times. A decode stream that breaks midway
resumes on another worker from the tokens already sent (a stream that ends
early with no token and no error counts as a failed attempt too, so it cannot
spin); the new worker loads
the KV persisted so far and recomputes only the tail, and since sampling
depends only on (seed, output index), the client sees one uninterrupted,
identical stream. A non-retryable status (INVALID_ARGUMENT, FAILED_PRECONDITION,
RESOURCE_EXHAUSTED, ...) from any hop is the request's, not the worker's: it is
returned to the client and the worker stays up.

INTERNAL and UNKNOWN (``FAILED_HERE``) are retried but take no worker down. A
worker answers INTERNAL when a request's engine step failed with it alone
(``entrypoint.engine_runner``: the requests of a failed step are dropped and the
engine goes on clean; when the step held several, each is first retried there
alone, so a batch-mate of a poison request is served by that worker and only
the one that fails alone gets INTERNAL), UNKNOWN when its handler raised: the
worker still serves, and why the request failed is not known. So the hop is
re-dispatched (the decode stream resumes) as above, within the same ``max_attempts``, and
the worker stays up: a request that was only batched with a failing one is
served, and one that every engine fails on (a poison request) fails after
``max_attempts`` tries with the worker's own status and message, having taken
no worker down, so the next request still finds workers up. A worker whose
engine is broken says so itself (UNAVAILABLE, on its calls and its ``Status``),
and that marks it down.
The retry goes to another worker of the role: one that already failed this
request with INTERNAL or UNKNOWN is left out of the pick while any other up is
admitted by the LB (``entrypoint.health.Strikes.tiers``), so a worker whose handler fails every call
(it still answers ``Status``, so it stays up, and looks idle once its call has
ended) cannot take every retry while a healthy peer stays idle. With no other
worker up, the same one is tried again. Such a retry first waits a time drawn
uniformly from ``retry_backoff_s`` (by default 20-100 ms; at most the client's remaining
time): requests failed by one worker together (an UNKNOWN, or a worker
without the retry alone) would otherwise be retried at the same instant and
land in one engine step again, a poison request taking its batch-mates with
it on every attempt.

Avoided workers (``entrypoint.health``): a call that ends INTERNAL or UNKNOWN,
or that runs out of the client's deadline or misses ``worker_timeout_s`` with no
progress from its worker (no reply; no decode token in that attempt), is a strike on its worker, and so
is a decode stream that stalls for ``worker_timeout_s`` after tokens; one with progress (a reply, a
decode stream that sent a token and did not stall) clears its strikes. A stream that stalls, or
ends with an error, only after its last token (every token delivered; its worker's final stats
event late or lost, as when it flushes its saves, or dies doing so) is progress: the request is
complete, so its worker is neither struck nor marked down here (its heartbeat tells whether it
is still up), nothing fails over, and the client's stream ends as usual, its decode hop without
the worker's stats (``stats_lost``; logged). Its last
token is always the ``max_new_tokens``-th: generation has no end-of-sequence token (none in ``Sampling``
or ``DecodeEvent``; the engine finishes a request only at ``max_new_tokens``, and a stream that ends
short is resumed elsewhere), so one that stalls with fewer delivered stalled mid-generation. After ``avoid_after`` (3)
strikes in a row the worker is avoided for ``avoid_for_s`` (30 s): every pick of its role leaves it out while
another worker of the role is up, not avoided, and admitted by the LB (when the
LB admits none of those, KV full or an SLO missed, it chooses again among all
the workers up: an avoided worker with room is never a refusal), so new requests do not pay
a failed attempt and a backoff there first (such a worker looks idle, and would
take the first attempt of every request). It stays up, and with no other
worker it is picked all the same; after the cooldown it is tried again, and one
more strike avoids it again at once while one success clears it. A single
poison request costs each worker it tried one strike, and one client's short
deadline on a healthy but slow worker costs it one strike. So an engine that
hangs while its ``Status`` still answers is left out after a few requests even
when every client's deadline ends before ``worker_timeout_s``.

Cancellation: a client that goes away cancels the in-flight worker call, at
every hop (``Encode``, ``Prefill``, the ``Decode`` stream): the worker stops
computing for it, and its in-flight counts and slot are taken back at once.
Deadlines: a unary worker call's (``Encode``, ``Prefill``) timeout is
``worker_timeout_s``, or the client's remaining time when that is shorter. A
``Decode`` stream is bounded by inactivity, not by its length: its timeout is
the client's remaining time alone (none without a client deadline), and it
fails over as a missed ``worker_timeout_s`` (that worker marked down, the
stream resumed elsewhere) only when ``worker_timeout_s`` pass without an event
from it, its first included (``entrypoint.dispatch.StallWatch``; the time the
client takes to read a token is not counted). A stream that produces tokens
for longer than ``worker_timeout_s`` is served to its end. A worker call that runs
out of the client's time is the client's deadline passing, not the worker
failing: DEADLINE_EXCEEDED goes back to the client and no worker is marked
down (without progress from the worker it is a strike: "Avoided workers"). A
DEADLINE_EXCEEDED while the client still has time is the worker's own: RETRYABLE.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Generator, Iterator

import grpc

import kvstore
from entrypoint.client_tokens import ClientAuth
from entrypoint.config import EntrypointConfig
from entrypoint.dispatch import FAILED_HERE, RETRYABLE, Abort, Deadlines, Dispatch, StallWatch, StalledStream
from entrypoint.health import Outcome, Strikes
from entrypoint.instances import Instance, Registry
from entrypoint.proto import serving_pb2 as pb
from entrypoint.vision import check_image_hash, tenant_scope
from kvstore.keys import BlockHasher, ImageSpan, check_image_spans
from lb.types import DecodeRequest, PrefixHits, RouteRequest

log = logging.getLogger(__name__)

Events = Generator[pb.GenerateEvent, None, Any]  # a step: the events it emits, then its result


class Timeline:
    """One request's clock and its events: every event's ``t_ms`` counts from the request's start."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def ms(self) -> float:
        return (time.perf_counter() - self._t0) * 1e3

    def hop(self, name: str, **detail: Any) -> pb.GenerateEvent:
        detail["hop"] = name
        return pb.GenerateEvent(kind="hop", detail=json.dumps(detail), t_ms=self.ms())

    def token(self, token_id: int, index: int) -> pb.GenerateEvent:
        return pb.GenerateEvent(kind="token", token_id=token_id, index=index, t_ms=self.ms())

    def done(self, summary: dict) -> pb.GenerateEvent:
        return pb.GenerateEvent(kind="done", detail=json.dumps(summary), t_ms=self.ms())


# ---------------------------------------------------------------------------- the steps' records
@dataclass(frozen=True, slots=True)
class Admitted:
    """Step 1's result: a valid request, and what the later steps take from it."""

    request_id: str
    tenant: str
    salt: bytes  # the tenant's: it enters every block key
    spans: list[ImageSpan]
    max_new: int  # max_new_tokens, or the configured default
    sampling: pb.Sampling  # as every worker gets it (max_new filled in)
    images: list[pb.ImageSegment]  # as the prefill and decode workers get them: no bytes
    ttft_slo_ms: float | None  # None: no SLO
    tbt_slo_ms: float | None


@dataclass(frozen=True, slots=True)
class EncodeParams:
    """Step 2: the images to encode into ``prompt``."""

    request_id: str
    prompt: list[int]  # image positions hold placeholders
    images: list[pb.ImageSegment]  # as the client sent them (with their bytes, or by hash alone)
    scope: str  # the tenant's VE cache scope (entrypoint.vision.tenant_scope)


@dataclass(frozen=True, slots=True)
class Encoded:
    """Step 2's result."""

    prompt: list[int]  # each image's tokens spliced in


@dataclass(frozen=True, slots=True)
class LookupParams:
    """Step 3: the prompt to hash into block keys (with its images and the tenant's salt)."""

    prompt: list[int]
    spans: list[ImageSpan]
    salt: bytes


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """Step 3's result."""

    keys: list[bytes]  # one per full block of the prompt
    hit: kvstore.LookupResult  # the store's cached prefix among the reusable blocks


@dataclass(frozen=True, slots=True)
class PrefillParams:
    """Step 4: the prompt to prefill, with what the Prefill LB weighs."""

    request_id: str
    prompt: list[int]
    keys: list[bytes]
    store_hit: int  # blocks the store holds (PrefixLookup.hit.hit_blocks)
    salt: bytes
    sampling: pb.Sampling
    images: list[pb.ImageSegment]
    max_new: int
    ttft_slo_ms: float | None


@dataclass(frozen=True, slots=True)
class Prefilled:
    """Step 4's result: the worker that prefilled, the first token and when the client had it."""

    worker: Instance
    first_token: int
    slot: str  # the request's in-flight entry on its instances (request ids from clients may repeat)
    ttft_ms: float


@dataclass(frozen=True, slots=True)
class DecodeParams:
    """Step 5: the rest of the tokens, after ``first_token``."""

    request_id: str
    prompt: list[int]
    salt: bytes
    sampling: pb.Sampling
    images: list[pb.ImageSegment]
    max_new: int
    tbt_slo_ms: float | None
    slot: str
    first_token: int


@dataclass(slots=True)
class Decoded:
    """Step 5's result, filled in as the streams go (``_decode_attempt`` appends the tokens)."""

    tokens: list[int]  # every token sent to the client, the prefill's first included
    failovers: list[dict] = field(default_factory=list)
    stats: dict = field(default_factory=dict)  # the last decode worker's final stats
    last_worker: Instance | None = None  # the worker of the last attempt (None: no decode hop was needed)
    client_left: bool = False  # the client went away (or its deadline passed) during a stream


class AttemptEnd(enum.Enum):
    SERVED = "served"  # tokens sent (or every token delivered): go on, or done
    FAILED = "failed"  # fail over to another worker
    CLIENT_LEFT = "client left"  # the client's call ended: the request ends with no "done"


@dataclass(frozen=True, slots=True)
class DecodeAttempt:
    """How one decode stream on one worker ended (``_decode_attempt``)."""

    end: AttemptEnd
    started_ms: float = 0.0
    code: str = ""  # FAILED: what the failover hop reports
    status: grpc.StatusCode | None = None  # FAILED with a worker's status: it
    reason: str = ""  # FAILED: why, for the error when no attempt is left
    stats_lost: str = ""  # SERVED with every token, why the worker's stats never came


# ---------------------------------------------------------------------------- the pipeline
class GeneratePipeline:
    """The steps of one ``Generate`` (module docstring), over the entrypoint's parts: its
    configuration, the store, the instance registry, the dispatch of hops, the strikes, the
    client's deadline rules and the client tokens."""

    def __init__(self, cfg: EntrypointConfig, store: kvstore.KVStore, registry: Registry, dispatch: Dispatch,
                 strikes: Strikes, deadlines: Deadlines, clients: ClientAuth):
        self.cfg, self.store, self.registry, self.dispatch = cfg, store, registry, dispatch
        self.strikes, self.deadlines, self.clients = strikes, deadlines, clients

    def run(self, request: pb.GenerateRequest, context) -> Iterator[pb.GenerateEvent]:
        """Every event of ``request``, step by step; raises ``Abort`` with the status the request ends with."""
        clock = Timeline()
        rid = request.request_id or uuid.uuid4().hex
        tenant = self.clients.tenant_of(context, request.tenant) or "default"
        req = self.validate(request, rid, tenant)
        enc = yield from self.encode_images(EncodeParams(
            request_id=rid, prompt=list(request.token_ids), images=list(request.images),
            scope=tenant_scope(tenant, req.salt)), context, clock)
        look = yield from self.lookup_prefix(LookupParams(prompt=enc.prompt, spans=req.spans, salt=req.salt), clock)
        pre = yield from self.prefill(PrefillParams(
            request_id=rid, prompt=enc.prompt, keys=look.keys, store_hit=look.hit.hit_blocks, salt=req.salt,
            sampling=req.sampling, images=req.images, max_new=req.max_new, ttft_slo_ms=req.ttft_slo_ms),
            context, clock)
        dec = yield from self.decode(DecodeParams(
            request_id=rid, prompt=enc.prompt, salt=req.salt, sampling=req.sampling, images=req.images,
            max_new=req.max_new, tbt_slo_ms=req.tbt_slo_ms, slot=pre.slot, first_token=pre.first_token),
            context, clock)
        if dec.client_left:
            return
        self.registry.routed((dec.last_worker or pre.worker).worker_id, look.keys)
        summary = {"request_id": rid, "tokens": dec.tokens, "ttft_ms": pre.ttft_ms, "total_ms": clock.ms(),
                   "prompt_tokens": len(enc.prompt), "store_hit_blocks": look.hit.hit_blocks,
                   "failovers": dec.failovers}
        yield clock.done(summary)

    # ------------------------------------------------------------------ 1. validate
    def validate(self, request: pb.GenerateRequest, request_id: str, tenant: str) -> Admitted:
        """Step 1: the request as the later steps take it, or ``Abort`` with INVALID_ARGUMENT."""
        toks = request.token_ids
        if not toks:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty: send at least one token id")
        salt = self.cfg.tenants.get(tenant)
        if salt is None:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown tenant {tenant!r}")
        temp = request.sampling.temperature
        if not math.isfinite(temp) or temp < 0:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"temperature must be a finite number >= 0 (0 = greedy), got {temp!r}")
        for name in ("ttft_slo_ms", "tbt_slo_ms"):  # the LBs refuse these, but only at their hop (after a prefill)
            slo = getattr(request, name)
            if math.isnan(slo) or slo < 0:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{name} must be a number of ms >= 0 (0 or inf = no SLO), got {slo!r}")
        max_new = request.sampling.max_new_tokens or self.cfg.default_max_new_tokens
        bound = self.cfg.max_model_len
        if bound and len(toks) + max_new > bound:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT,
                        f"prompt ({len(toks)} tokens) + max_new_tokens ({max_new}) = {len(toks) + max_new} "
                        f"exceeds max_model_len {bound}: shorten the prompt or ask for at most "
                        f"{max(0, bound - len(toks))} new tokens")
        spans = []
        for img in request.images:
            try:  # a span needs a hash and a length > 0 (ImageSpan), bytes that match its hash
                spans.append(ImageSpan(img.image_hash, img.start, img.length))
                if img.image_data:
                    check_image_hash(img.image_hash, img.image_data)
            except kvstore.InvalidRequest as exc:
                raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        try:  # inside the prompt, not overlapping: the rule kvstore.keys hashes by, checked by its own code
            check_image_spans(spans, len(toks))
        except kvstore.InvalidRequest as exc:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        sampling = pb.Sampling(max_new_tokens=max_new, temperature=temp, seed=request.sampling.seed)
        images = [pb.ImageSegment(image_hash=i.image_hash, start=i.start, length=i.length) for i in request.images]
        return Admitted(request_id=request_id, tenant=tenant, salt=salt, spans=spans, max_new=max_new,
                        sampling=sampling, images=images, ttft_slo_ms=request.ttft_slo_ms or None,
                        tbt_slo_ms=request.tbt_slo_ms or None)

    # ------------------------------------------------------------------ 2. encode images
    def encode_images(self, p: EncodeParams, context, clock: Timeline) -> Events:
        """Step 2: each image to a VE worker, its tokens spliced into the prompt; a ``ve`` hop each."""
        prompt = list(p.prompt)
        for img in p.images:
            t = clock.ms()
            inst, reply = self.dispatch.encode(p.request_id, img, p.scope, context)
            prompt[img.start:img.start + img.length] = list(reply.token_ids)
            yield clock.hop("ve", worker=inst.worker_id, cache_hit=reply.cache_hit, tokens=img.length,
                            encode_ms=reply.encode_ms, ms=clock.ms() - t)
        return Encoded(prompt)

    # ------------------------------------------------------------------ 3. look up the prefix
    def lookup_prefix(self, p: LookupParams, clock: Timeline) -> Events:
        """Step 3: the prompt's block keys and the store's cached prefix among the reusable blocks."""
        hasher = BlockHasher(self.cfg.namespace, self.cfg.block_size, p.salt)
        keys = hasher.hash_blocks(p.prompt, p.spans)
        usable = self._reusable_blocks(p.prompt, keys)
        t = clock.ms()
        try:
            hit = self.store.lookup(keys[:usable]) if usable else kvstore.LookupResult(0, None)
        except kvstore.KVStoreError as exc:  # a store that is down means a cold prefill, not a failure
            log.warning("store lookup failed (%s): routing as a miss", exc)
            hit = kvstore.LookupResult(0, None)
        yield clock.hop("lookup", blocks=len(keys), hit_blocks=hit.hit_blocks, swa_at=hit.swa_at, ms=clock.ms() - t)
        return PrefixLookup(keys, hit)

    def _reusable_blocks(self, prompt: list[int], keys: list[bytes]) -> int:
        """Blocks of ``keys`` an engine can reuse for ``prompt``: at most ``(len(prompt) - 1) // block_size``,
        since the last prompt token is always computed (its logits give the first output token). The
        engine plugin caps its own lookup by the same rule (``KVStoreConnector.get_num_new_matched_tokens``),
        so the lookup hop and the LB's cost see what the engine will load, not one block more."""
        return min(len(keys), (len(prompt) - 1) // self.cfg.block_size)

    # ------------------------------------------------------------------ 4. prefill
    def prefill(self, p: PrefillParams, context, clock: Timeline) -> Events:
        """Step 4: refuse what no decode worker could hold, then prefill on the worker the Prefill LB
        picks; its ``prefill`` hop and the first token."""
        t = clock.ms()
        if p.max_new > 1:  # a decode hop follows: refuse now what it would refuse after the prefill
            self.dispatch.check_decode_fits(DecodeRequest(context_tokens=len(p.prompt) + 1,
                                                          max_new_tokens=p.max_new - 1))
        preq = pb.PrefillRequest(request_id=p.request_id, token_ids=p.prompt, tenant_salt=p.salt,
                                 sampling=p.sampling, images=p.images)
        route = self._route_request(p)
        slot = uuid.uuid4().hex  # this request's in-flight entry (request ids from clients may repeat)
        inst, reply = self.dispatch.prefill(route, slot, preq, context)
        self.registry.routed(inst.worker_id, p.keys)
        yield clock.hop("prefill", worker=inst.worker_id, ms=clock.ms() - t, **json.loads(reply.stats))
        yield clock.token(reply.first_token, 0)
        return Prefilled(inst, reply.first_token, slot, clock.ms())

    def _route_request(self, p: PrefillParams) -> RouteRequest:
        """What the Prefill LB weighs: each instance's cached prefix (its recent routes, and the store's
        hit, which every instance shares), capped at the reusable blocks."""
        usable = p.keys[:self._reusable_blocks(p.prompt, p.keys)]
        in_store = set(usable[:p.store_hit]).__contains__  # the store is shared: one answer for every instance
        hits = {i.worker_id: PrefixHits.from_tiers(usable, device=i.holds, store=in_store)
                for i in self.registry.instances("prefill")}
        return RouteRequest(prompt_tokens=len(p.prompt), num_blocks=len(p.keys), hits=hits,
                            block_hashes=tuple(p.keys), ttft_slo_ms=p.ttft_slo_ms, block_tokens=self.cfg.block_size)

    # ------------------------------------------------------------------ 5. decode, with failover
    def decode(self, p: DecodeParams, context, clock: Timeline) -> Events:
        """Step 5: the remaining tokens, stream after stream: a stream that fails resumes on another
        worker from the tokens sent, within ``max_attempts`` (module docstring, "Failover")."""
        out = Decoded(tokens=[p.first_token])
        attempts, last_failure = 0, ""  # last_failure: why the last attempt failed, for the final error
        failed_here: set[str] = set()  # decode workers that failed this request with FAILED_HERE
        while len(out.tokens) < p.max_new:
            dreq = DecodeRequest(context_tokens=len(p.prompt) + len(out.tokens),
                                 max_new_tokens=p.max_new - len(out.tokens), tbt_slo_ms=p.tbt_slo_ms)
            live = self.registry.ready("decode")
            if not live:
                raise Abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is up" +
                            (f" (after {attempts} failed attempts; last: {last_failure})" if attempts else ""))
            inst = self.dispatch.decode_pick(dreq, p.slot, self.strikes.tiers(live, failed_here))  # in flight
            out.last_worker = inst
            try:
                a = yield from self._decode_attempt(p, inst, out, context, clock)
            finally:
                self.dispatch.decode_ended(inst, p.slot)
            if a.end is AttemptEnd.CLIENT_LEFT:
                out.client_left = True
                return out
            if a.end is AttemptEnd.SERVED:
                continue
            attempts += 1
            last_failure = a.reason
            if a.status in FAILED_HERE:
                self.strikes.record(inst, Outcome.FAILED_HERE)
                failed_here.add(inst.worker_id)
            else:
                self.registry.mark_down(inst, f"decode stream failed: {a.code}")
            out.failovers.append({"worker": inst.worker_id, "at_token": len(out.tokens), "ms": clock.ms()})
            yield clock.hop("failover", worker=inst.worker_id, code=a.code, resumed_at=len(out.tokens),
                            ms=clock.ms() - a.started_ms)
            if attempts >= self.cfg.max_attempts:
                raise Abort(a.status if a.status in FAILED_HERE else grpc.StatusCode.UNAVAILABLE,
                            f"decode failed on {attempts} attempts; last: {last_failure}")
            if a.status in FAILED_HERE:
                self.deadlines.backoff(context)
        return out

    def _decode_attempt(self, p: DecodeParams, inst: Instance, out: Decoded, context, clock: Timeline) -> Events:
        """One decode stream on ``inst`` from the tokens sent so far: its ``decode_start`` hop, its
        tokens (appended to ``out.tokens``), its ``decode`` hop when served, and how it ended. The
        strikes of ``inst`` are recorded here; failing over is the caller's."""
        t, before = clock.ms(), len(out.tokens)
        yield clock.hop("decode_start", worker=inst.worker_id, resume_at=before)
        timeout = self.deadlines.stream_timeout(context)  # the client's time only: see "Deadlines"
        dreq = pb.DecodeRequest(request_id=p.request_id, token_ids=p.prompt, generated=out.tokens,
                                tenant_salt=p.salt, sampling=p.sampling, images=p.images)
        watch = None
        try:
            call = self.dispatch.start_decode(inst, dreq, timeout, context)
            with StallWatch(call, self.cfg.worker_timeout_s) as watch:
                yield from self._relay(call, watch, inst, p.slot, out, clock)
        except grpc.RpcError as exc:
            stalled = watch is not None and watch.stalled
            a = self._broken_stream(exc, p, inst, stalled, timeout, before, out, context)
        else:
            a = self._ended_stream(p, inst, before, out)
        if a.end is AttemptEnd.SERVED:
            extra = {"stats_lost": a.stats_lost} if a.stats_lost else out.stats
            yield clock.hop("decode", worker=inst.worker_id, tokens=len(out.tokens), ms=clock.ms() - t, **extra)
        return DecodeAttempt(a.end, t, a.code, a.status, a.reason, a.stats_lost)

    def _relay(self, call: Any, watch: StallWatch, inst: Instance, slot: str, out: Decoded,
               clock: Timeline) -> Iterator[pb.GenerateEvent]:
        """The stream's tokens to the client as they come; its final stats kept in ``out.stats``."""
        started = False
        for ev in call:
            watch.progress()
            if not started:  # its KV is in the worker's Status from now on
                started = True
                self.dispatch.decode_started(inst, slot)
            if ev.stats:
                out.stats = json.loads(ev.stats)
                continue
            if ev.index != len(out.tokens):
                raise Abort(grpc.StatusCode.INTERNAL, f"decode worker sent index {ev.index}, "
                            f"expected {len(out.tokens)}: this is a bug")
            out.tokens.append(ev.token_id)
            watch.pause()  # the time the client takes to take the token is not the worker's
            yield clock.token(ev.token_id, ev.index)
            watch.progress()

    def _ended_stream(self, p: DecodeParams, inst: Instance, before: int, out: Decoded) -> DecodeAttempt:
        """A stream that ended without an error: served if it sent a token (or every token is sent)."""
        if len(out.tokens) > before or len(out.tokens) >= p.max_new:  # progress: resume (or done)
            self.strikes.record(inst, Outcome.PROGRESS)
            return DecodeAttempt(AttemptEnd.SERVED)
        # A stream that ends without a token and without an error is a failed attempt, as a
        # broken one is: retrying on the same footing would spin (and hold a slot) forever.
        return DecodeAttempt(AttemptEnd.FAILED, code="ended without a token",
                             reason=f"decode worker {inst.worker_id} ended its stream at token {len(out.tokens)} "
                                    f"of {p.max_new} without a token or an error")

    def _broken_stream(self, exc: grpc.RpcError, p: DecodeParams, inst: Instance, stalled: bool,
                       timeout: float | None, before: int, out: Decoded, context) -> DecodeAttempt:
        """A stream that ended with ``exc`` (``stalled``: its stall watch cancelled it): whose failure
        it is, its worker's strike, and whether the request fails over. Called while handling ``exc``."""
        progressed = len(out.tokens) > before
        if not context.is_active():  # the client left, or grpc cancelled the call at its deadline
            if self.deadlines.deadline_passed(context):
                self.strikes.record(inst, Outcome.PROGRESS if progressed else Outcome.NO_PROGRESS)
            return DecodeAttempt(AttemptEnd.CLIENT_LEFT)
        if len(out.tokens) >= p.max_new:
            # every token delivered, only its final stats event is late or lost (the worker flushes
            # its saves after the last token, and may die doing so): the request is complete. Not
            # the worker's fault to strike, mark down or fail over; the client's stream ends without
            # them. (No early end: there is no EOS, a stream's last token is the max_new-th.)
            why = (f"none within worker_timeout_s ({self.cfg.worker_timeout_s} s)" if stalled
                   else f"the stream ended {exc.code().name} after the last token: {exc.details()}")
            log.warning("decode worker %s sent all %d tokens of %s, then %s: ending the stream without its "
                        "stats", inst.worker_id, p.max_new, p.request_id, why)
            self.strikes.record(inst, Outcome.PROGRESS)
            return DecodeAttempt(AttemptEnd.SERVED, stats_lost=why)
        if stalled:  # the worker's: down, and the stream resumes
            # a strike too, tokens sent or not: the heartbeat brings a hung engine back
            self.strikes.record(inst, Outcome.STALLED if progressed else Outcome.NO_PROGRESS)
            exc = StalledStream(inst, self.cfg.worker_timeout_s)
        elif (exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None
              and self.deadlines.out_of_clients_time(context)):  # else the worker's own: fail over
            self.strikes.record(inst, Outcome.PROGRESS if progressed else Outcome.NO_PROGRESS)
            raise Abort(exc.code(), f"the client's deadline passed during the decode stream on "
                        f"worker {inst.worker_id}") from exc
        if exc.code() not in RETRYABLE | FAILED_HERE:  # the request's fault: no failover
            raise Abort(exc.code(), f"decode worker {inst.worker_id}: {exc.details()}") from exc
        return DecodeAttempt(AttemptEnd.FAILED, code=str(exc.code()), status=exc.code(),
                             reason=f"decode worker {inst.worker_id}: {exc.details()}")
