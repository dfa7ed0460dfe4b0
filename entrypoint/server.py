"""The entrypoint: request intake, prefix matching, dispatch, streaming, failover.

``Generate`` (see ``proto/serving.proto``) takes one request through the
hops, emitting a "hop" event for each so a client can draw the timeline:

  0. parse: request bytes that are not a ``GenerateRequest`` are
     INVALID_ARGUMENT (``entrypoint.rpc``; so for every method here);
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
     cached-token estimate uses the same cap;
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
no worker down. Before, these marked each worker down in turn, and the next
request found none up. A worker whose engine is broken says so itself
(UNAVAILABLE, on its calls and its ``Status``), and that marks it down.
The retry goes to another worker of the role: one that already failed this
request with INTERNAL or UNKNOWN is left out of the pick while any other up is
admitted by the LB (``entrypoint.health.Strikes.tiers``), so a worker whose handler fails every call
(it still answers ``Status``, so it stays up, and looks idle once its call has
ended) cannot take every retry while a healthy peer stays idle. With no other
worker up, the same one is tried again. Such a retry first waits a time drawn
uniformly from ``retry_backoff_s`` (20-100 ms; at most the client's remaining
time): requests failed by one worker together (an UNKNOWN, or a worker
without the retry alone) would otherwise be retried at the same instant and
land in one engine step again, a poison request taking its batch-mates with
it on every attempt.

Avoided workers (``entrypoint.health``): a call that ends INTERNAL or UNKNOWN,
or that runs out of the client's deadline or misses ``worker_timeout_s`` with no
progress from its worker (no reply; no decode token in that attempt), is a strike on its worker, and so
is a decode stream that stalls for ``worker_timeout_s`` after tokens; one with progress (a reply, a
decode stream that sent a token and did not stall) clears its strikes. A stream that stalls only
after its last token (every token delivered; its worker's final stats event late, as when it
flushes its saves) is progress: the request is complete, so its worker is neither struck nor
marked down, and the client's stream ends as usual, its decode hop without the worker's stats
(``stats_lost``; logged). Before, it was struck and marked down for a request it had served. Its last
token is always the ``max_new_tokens``-th: generation has no end-of-sequence token (none in ``Sampling``
or ``DecodeEvent``; the engine finishes a request only at ``max_new_tokens``, and a stream that ends
short is resumed elsewhere), so one that stalls with fewer delivered stalled mid-generation. After ``avoid_after`` (3)
strikes in a row the worker is avoided for ``avoid_for_s`` (30 s): every pick of its role leaves it out while
another worker of the role is up, not avoided, and admitted by the LB (when the
LB admits none of those, KV full or an SLO missed, it chooses again among all
the workers up: an avoided worker with room is never a refusal), so new requests no longer pay
a failed attempt and a backoff there first (before, such a worker looked idle
and took the first attempt of every request). It stays up, and with no other
worker it is picked all the same; after the cooldown it is tried again, and one
more strike avoids it again at once while one success clears it. A single
poison request costs each worker it tried one strike, and one client's short
deadline on a healthy but slow worker costs it one strike. So an engine that
hangs while its ``Status`` still answers is left out after a few requests even
when every client's deadline ends before ``worker_timeout_s`` (before, each
such call was the client's deadline only, and every request went on to it).

Clients: with client tokens (``entrypoint.client_tokens``), ``Generate`` acts for
its bearer token's tenant only (UNAUTHENTICATED without a known token,
PERMISSION_DENIED naming another tenant), checked before step 1; without
them, the request's ``tenant`` field is taken as sent.

Membership: ``Register`` and ``Deregister`` need the worker secret when one is
configured (``entrypoint.auth``: UNAUTHENTICATED otherwise, and nothing
changes); ``ListWorkers`` is open, unless there are client tokens: then it
takes one of them or the worker secret. Every call to a worker (every hop above, and
the heartbeat) carries the same secret, since the workers require it
(``entrypoint.instances`` opens the channels).

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
for longer than ``worker_timeout_s`` is served to its end (before, it was cut
at ``worker_timeout_s`` and its worker marked down). A worker call that runs
out of the client's time is the client's deadline passing, not the worker
failing: DEADLINE_EXCEEDED goes back to the client and no worker is marked
down (without progress from the worker it is a strike: "Avoided workers"). A
DEADLINE_EXCEEDED while the client still has time is the worker's own: RETRYABLE.
Backpressure: at most ``max_inflight`` requests at once; more get
RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import grpc

import kvstore
from entrypoint.auth import WorkerAuth, check_listen, check_secret
from entrypoint.client_tokens import ClientAuth, check_open_tenants
from entrypoint.dispatch import FAILED_HERE, RETRYABLE, Abort, Dispatch, StallWatch, StalledStream, start_call
from entrypoint.health import Outcome, StrikePolicy, Strikes
from entrypoint.instances import IncompatibleWorker, Registry, check_kv_compat
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from entrypoint.rpc import make_server
from entrypoint.tls import ChannelTLS, ServerTLS, server_address, warn_plaintext
from entrypoint.vision import SCOPE_METADATA, check_image_hash, tenant_scope
from kvstore.keys import BlockHasher, ImageSpan, Namespace, check_image_spans
from lb.cost_model import load_default
from lb.registry import KINDS, get_policy
from lb.types import DecodeRequest, LBInputError, PrefixHits, RouteRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EntrypointConfig:
    namespace: Namespace
    block_size: int = 16
    tenants: dict[str, bytes] = field(default_factory=lambda: {"default": b""})
    prefill_policy: str = "kvstack"
    decode_policy: str = "kvstack"
    ve_policy: str = "kvstack"
    max_attempts: int = 3
    max_inflight: int = 64
    # Bound on a unary worker call (Encode, Prefill: a 100k-token cold prefill on a CPU takes minutes), and on
    # a Decode stream's wait for its next event (its first included), not on the stream's length (module
    # docstring, Deadlines). A worker that misses it is marked down and the hop fails over.
    worker_timeout_s: float = 3600.0
    default_max_new_tokens: int = 16
    kv_bytes_per_token: float = 0.0  # the served model's global KV per token (0: the LB cost model's own)
    # Bound on prompt + max_new_tokens of one request (0: none). A request over it could never be
    # decoded (no pool holds it), so it is refused before its prefill, not after.
    max_model_len: int = 0
    # Shared secret of the membership calls and of every call to a worker ("": none; see
    # entrypoint.auth). Not in repr: logs.
    worker_secret: str = field(default="", repr=False)
    # Client bearer token -> tenant ({}: the request's tenant field is trusted; entrypoint.client_tokens).
    # Not in repr: logs.
    client_tokens: dict[str, str] = field(default_factory=dict, repr=False)
    # (low, high) s: a retry after INTERNAL/UNKNOWN waits a time drawn uniformly from it (at most the
    # client's remaining time), so the requests of one failed engine step do not share a step again.
    retry_backoff_s: tuple[float, float] = (0.02, 0.1)
    # How the entrypoint dials its workers (entrypoint.tls, hop 2): None: each worker's registered
    # address decides (grpcs:// with the system roots); set: TLS with these files, and a worker
    # that registers a plaintext address is refused.
    worker_tls: ChannelTLS | None = None
    # A worker whose last avoid_after calls all ended without progress (INTERNAL/UNKNOWN, a missed
    # worker_timeout_s, or the client's deadline passing with neither a reply nor a token from it) is left out
    # of the picks for avoid_for_s s while another worker of its role is up; the strikes never mark it down
    # (entrypoint.health; module docstring, Avoided workers).
    avoid_after: int = 3
    avoid_for_s: float = 30.0

    def __post_init__(self) -> None:
        """Checked here, before anything is started (``InvalidRequest`` naming the field)."""
        for name, low in (("block_size", 1), ("max_attempts", 1), ("max_inflight", 1),
                          ("default_max_new_tokens", 1), ("max_model_len", 0), ("avoid_after", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise kvstore.InvalidRequest(f"EntrypointConfig.{name} must be an int >= {low}, got {v!r}")
        if not (math.isfinite(self.worker_timeout_s) and self.worker_timeout_s > 0):
            raise kvstore.InvalidRequest(f"worker_timeout_s must be a finite number > 0, got {self.worker_timeout_s!r}")
        if not (math.isfinite(self.avoid_for_s) and self.avoid_for_s >= 0):
            raise kvstore.InvalidRequest(f"avoid_for_s must be a finite number >= 0, got {self.avoid_for_s!r}")
        b = self.retry_backoff_s
        if not (isinstance(b, tuple) and len(b) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                              and math.isfinite(x) for x in b) and 0 <= b[0] <= b[1]):
            raise kvstore.InvalidRequest(f"retry_backoff_s must be a tuple (low, high) of finite numbers of seconds "
                                         f"with 0 <= low <= high, got {b!r}")
        if not (math.isfinite(self.kv_bytes_per_token) and self.kv_bytes_per_token >= 0):
            raise kvstore.InvalidRequest(f"kv_bytes_per_token must be a finite number >= 0, "
                                         f"got {self.kv_bytes_per_token!r}")
        if not isinstance(self.worker_secret, str):
            raise kvstore.InvalidRequest(f"worker_secret must be a str, got {type(self.worker_secret).__name__}")
        if self.worker_secret:
            check_secret(self.worker_secret, "EntrypointConfig.worker_secret")
        if self.worker_tls is not None and not isinstance(self.worker_tls, ChannelTLS):
            raise kvstore.InvalidRequest(f"worker_tls must be an entrypoint.tls.ChannelTLS or None, "
                                         f"got {type(self.worker_tls).__name__}")
        # Tenants are isolated only by their salt (it enters every block key): an empty salt
        # shares every key with ``default``, and two tenants with one salt share each other's.
        seen: dict[bytes, str] = {}
        for tenant, salt in self.tenants.items():
            if not isinstance(salt, bytes):
                raise kvstore.InvalidRequest(f"tenant {tenant!r}: its salt must be bytes, got {type(salt).__name__}")
            if not salt and tenant != "default":
                raise kvstore.InvalidRequest(f"tenant {tenant!r} has an empty salt: it would share every KV key "
                                             "with tenant 'default'; give it a distinct non-empty salt")
            if salt in seen:
                raise kvstore.InvalidRequest(f"tenants {seen[salt]!r} and {tenant!r} have the same salt: they would "
                                             "share every KV key; give each a distinct salt")
            seen[salt] = tenant
        ClientAuth(self.client_tokens).check_tenants(self.tenants)
        for kind, name in (("prefill", self.prefill_policy), ("decode", self.decode_policy), ("ve", self.ve_policy)):
            if name not in KINDS[kind]:
                raise kvstore.InvalidRequest(f"unknown {kind} policy {name!r}; known: {', '.join(sorted(KINDS[kind]))}")


class EntrypointService(Dispatch, pbg.EntrypointServicer):
    def __init__(self, cfg: EntrypointConfig, store: kvstore.KVStore, registry: Registry):
        self.cfg, self.store, self.registry = cfg, store, registry
        models = load_default()
        # the LBs size a fetched block as the hits count it (block_size tokens, always) and its bytes per
        # token as the served model does (when configured; 0: the cost model's own)
        models = dataclasses.replace(models, transfer=dataclasses.replace(
            models.transfer, kv_bytes_per_token=cfg.kv_bytes_per_token or models.transfer.kv_bytes_per_token,
            block_tokens=cfg.block_size))
        self.lb_models = models  # a decode's KV bytes, as the Decode LB counts them (entrypoint.dispatch)
        self.prefill_lb = get_policy(cfg.prefill_policy, models, kind="prefill")
        self.decode_lb = get_policy(cfg.decode_policy, models, kind="decode")
        self.ve_lb = get_policy(cfg.ve_policy, models, kind="ve")
        self._slots = threading.BoundedSemaphore(cfg.max_inflight)
        self._lock = threading.Lock()
        self.strikes = Strikes(StrikePolicy(cfg.avoid_after, cfg.avoid_for_s), self._lock)
        self.auth = WorkerAuth(cfg.worker_secret)
        self.clients = ClientAuth(cfg.client_tokens)

    # ------------------------------------------------------------------ membership RPCs
    def Register(self, request, context):
        self.auth.check(context, f"Register of worker {request.worker_id!r}")  # before any change
        try:
            check_kv_compat(request, self.cfg.namespace, self.cfg.block_size)  # before the worker is polled
            self.registry.add(request.worker_id, request.role, request.address, block_size=request.block_size,
                              kv_namespace=request.kv_namespace if request.HasField("kv_namespace") else None)
        except IncompatibleWorker as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except kvstore.InvalidRequest as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.RegisterReply(ok=True, message=f"{request.worker_id} registered")

    def Deregister(self, request, context):
        self.auth.check(context, f"Deregister of worker {request.worker_id!r}")
        ok = self.registry.remove(request.worker_id)
        return pb.RegisterReply(ok=ok, message="removed" if ok else "unknown worker")

    def ListWorkers(self, request, context):
        if self.clients.enabled and not (self.auth.enabled and self.auth.admits(context.invocation_metadata())):
            self.clients.authenticate(context)  # a client token or the worker secret
        return pb.WorkerList(workers=[pb.WorkerInfo(worker_id=i.worker_id, role=i.role, address=i.address,
                                                    kv_namespace=i.kv_namespace, block_size=i.block_size)
                                      for i in self.registry.ready()])

    # ------------------------------------------------------------------ Generate
    def Generate(self, request, context):
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the entrypoint is serving {self.cfg.max_inflight} requests; retry later")
        try:
            yield from self._generate(request, context)
        except Abort as exc:
            context.abort(exc.code, exc.message)
        except LBInputError as exc:  # a request value the LB refuses is the caller's misuse, not UNKNOWN
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the load balancer refused the request: {exc}")
        finally:
            self._slots.release()

    def _validate(self, request, tenant: str) -> tuple[bytes, list[ImageSpan], int]:
        """Step 1: (``tenant``'s salt, image spans, max_new_tokens), or ``Abort`` with INVALID_ARGUMENT."""
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
        return salt, spans, max_new

    def _generate(self, request, context) -> Iterator[pb.GenerateEvent]:
        t0 = time.perf_counter()
        rid = request.request_id or uuid.uuid4().hex
        ms = lambda: (time.perf_counter() - t0) * 1e3  # noqa: E731

        def hop(name: str, **detail: Any) -> pb.GenerateEvent:
            detail["hop"] = name
            return pb.GenerateEvent(kind="hop", detail=json.dumps(detail), t_ms=ms())

        tenant = self.clients.tenant_of(context, request.tenant) or "default"
        salt, spans, max_new = self._validate(request, tenant)
        scope = ((SCOPE_METADATA, tenant_scope(tenant, salt)),)
        sampling = pb.Sampling(max_new_tokens=max_new, temperature=request.sampling.temperature,
                               seed=request.sampling.seed)
        prompt = list(request.token_ids)
        scope_key = scope[0][1].encode()  # this tenant's VE cache scope: the LB's affinity is per scope
        # 2. vision encoding
        for img in request.images:
            t = ms()
            inst, reply = self._call("ve", lambda i: self._ve_pick(img, scope_key, i), context,
                                     lambda i: self._tracked_encode(i, pb.EncodeRequest(request_id=rid, image=img),
                                                                    context, scope))
            prompt[img.start:img.start + img.length] = list(reply.token_ids)
            yield hop("ve", worker=inst.worker_id, cache_hit=reply.cache_hit, tokens=img.length,
                      encode_ms=reply.encode_ms, ms=ms() - t)
        # 3. prefix lookup
        hasher = BlockHasher(self.cfg.namespace, self.cfg.block_size, salt)
        keys = hasher.hash_blocks(prompt, spans)
        usable = self._reusable_blocks(prompt, keys)
        t = ms()
        try:
            hit = self.store.lookup(keys[:usable]) if usable else kvstore.LookupResult(0, None)
        except kvstore.KVStoreError as exc:  # a store that is down means a cold prefill, not a failure
            log.warning("store lookup failed (%s): routing as a miss", exc)
            hit = kvstore.LookupResult(0, None)
        yield hop("lookup", blocks=len(keys), hit_blocks=hit.hit_blocks, swa_at=hit.swa_at, ms=ms() - t)
        # 4. prefill
        t = ms()
        if max_new > 1:  # a decode hop follows: refuse now what it would refuse after the prefill
            self._check_decode_fits(DecodeRequest(context_tokens=len(prompt) + 1, max_new_tokens=max_new - 1))
        images = [pb.ImageSegment(image_hash=i.image_hash, start=i.start, length=i.length) for i in request.images]
        preq = pb.PrefillRequest(request_id=rid, token_ids=prompt, tenant_salt=salt, sampling=sampling,
                                 images=images)
        route = self._route_request(prompt, keys, hit.hit_blocks, request)
        slot = uuid.uuid4().hex  # this request's in-flight entry (request ids from clients may repeat)
        inst, prep = self._call("prefill", lambda tiers: self._prefill_pick(route, slot, tiers), context,
                                lambda i: self._tracked_prefill(i, slot, preq, context))
        self.registry.routed(inst.worker_id, keys)
        yield hop("prefill", worker=inst.worker_id, ms=ms() - t, **json.loads(prep.stats))
        generated = [prep.first_token]
        yield pb.GenerateEvent(kind="token", token_id=prep.first_token, index=0, t_ms=ms())
        ttft = ms()
        # 5. decode, with failover mid-stream
        attempts = 0
        failovers = []
        last_failure = ""  # why the last attempt failed, for the error when no worker is left
        failed_here: set[str] = set()  # decode workers that failed this request with FAILED_HERE
        dstats: dict = {}
        while len(generated) < max_new:
            dreq = DecodeRequest(context_tokens=len(prompt) + len(generated), max_new_tokens=max_new - len(generated),
                                 tbt_slo_ms=request.tbt_slo_ms or None)
            live = self.registry.ready("decode")
            if not live:
                raise Abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is up" +
                            (f" (after {attempts} failed attempts; last: {last_failure})" if attempts else ""))
            inst = self._decode_pick(dreq, slot, self.strikes.tiers(live, failed_here))  # in flight until it ends
            last_code = None  # this attempt's failure status, if it failed with one
            try:
                t = ms()
                before = len(generated)
                yield hop("decode_start", worker=inst.worker_id, resume_at=before)
                timeout = self._stream_timeout(context)  # the client's time only: see "Deadlines"
                dreq_pb = pb.DecodeRequest(request_id=rid, token_ids=prompt, generated=generated,
                                           tenant_salt=salt, sampling=sampling, images=images)
                watch, started = None, False
                try:
                    call = start_call(inst, lambda: inst.stub.Decode(dreq_pb, timeout=timeout))
                    if not context.add_callback(call.cancel):  # the client is already gone
                        call.cancel()
                    with StallWatch(call, self.cfg.worker_timeout_s) as watch:
                        for ev in call:
                            watch.progress()
                            if not started:  # its KV is in the worker's Status from now on
                                started = True
                                self._decode_started(inst, slot)
                            if ev.stats:
                                dstats = json.loads(ev.stats)
                                continue
                            if ev.index != len(generated):
                                raise Abort(grpc.StatusCode.INTERNAL, f"decode worker sent index {ev.index}, "
                                            f"expected {len(generated)}: this is a bug")
                            generated.append(ev.token_id)
                            watch.pause()  # the time the client takes to take the token is not the worker's
                            yield pb.GenerateEvent(kind="token", token_id=ev.token_id, index=ev.index, t_ms=ms())
                            watch.progress()
                except grpc.RpcError as exc:
                    if not context.is_active():  # the client left, or grpc cancelled the call at its deadline
                        if self._deadline_passed(context):
                            self.strikes.record(inst, Outcome.PROGRESS if len(generated) > before
                                                else Outcome.NO_PROGRESS)
                        return
                    if watch is not None and watch.stalled and len(generated) >= max_new:
                        # every token delivered, only its final stats event is late (the worker flushes
                        # its saves after the last token): the request is complete. Not the worker's
                        # fault to strike, mark down or fail over; the client's stream ends without them.
                        # (No early end: there is no EOS, a stream's last token is the max_new-th.)
                        log.warning("decode worker %s sent all %d tokens of %s, then nothing for %.1f s: ending "
                                    "the stream without its stats", inst.worker_id, max_new, rid,
                                    self.cfg.worker_timeout_s)
                        self.strikes.record(inst, Outcome.PROGRESS)
                        yield hop("decode", worker=inst.worker_id, tokens=len(generated), ms=ms() - t,
                                  stats_lost=f"none within worker_timeout_s ({self.cfg.worker_timeout_s} s)")
                        continue
                    if watch is not None and watch.stalled:  # the worker's: down, and the stream resumes
                        # a strike too, tokens sent or not: the heartbeat brings a hung engine back
                        self.strikes.record(inst, Outcome.NO_PROGRESS if len(generated) == before
                                            else Outcome.STALLED)
                        exc = StalledStream(inst, self.cfg.worker_timeout_s)
                    elif (exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout is not None
                          and self._out_of_clients_time(context)):  # else the worker's own: fail over
                        self.strikes.record(inst, Outcome.PROGRESS if len(generated) > before
                                            else Outcome.NO_PROGRESS)
                        raise Abort(exc.code(), f"the client's deadline passed during the decode stream on "
                                    f"worker {inst.worker_id}") from exc
                    if exc.code() not in RETRYABLE | FAILED_HERE:  # the request's fault: no failover
                        raise Abort(exc.code(), f"decode worker {inst.worker_id}: {exc.details()}") from exc
                    code, last_failure = str(exc.code()), f"decode worker {inst.worker_id}: {exc.details()}"
                    last_code = exc.code()
                else:
                    if len(generated) > before or len(generated) >= max_new:  # progress: resume (or done)
                        self.strikes.record(inst, Outcome.PROGRESS)
                        yield hop("decode", worker=inst.worker_id, tokens=len(generated), ms=ms() - t, **dstats)
                        continue
                    # A stream that ends without a token and without an error is a failed attempt, as a
                    # broken one is: retrying on the same footing would spin (and hold a slot) forever.
                    code = "ended without a token"
                    last_failure = (f"decode worker {inst.worker_id} ended its stream at token {len(generated)} of "
                                    f"{max_new} without a token or an error")
            finally:
                with self._lock:
                    inst.decodes.pop(slot, None)
            attempts += 1
            if last_code in FAILED_HERE:
                self.strikes.record(inst, Outcome.FAILED_HERE)
                failed_here.add(inst.worker_id)
            else:
                self.registry.mark_down(inst, f"decode stream failed: {code}")
            failovers.append({"worker": inst.worker_id, "at_token": len(generated), "ms": ms()})
            yield hop("failover", worker=inst.worker_id, code=code, resumed_at=len(generated), ms=ms() - t)
            if attempts >= self.cfg.max_attempts:
                raise Abort(last_code if last_code in FAILED_HERE else grpc.StatusCode.UNAVAILABLE,
                            f"decode failed on {attempts} attempts; last: {last_failure}")
            if last_code in FAILED_HERE:
                self._backoff(context)
        self.registry.routed(inst.worker_id, keys)
        summary = {"request_id": rid, "tokens": generated, "ttft_ms": ttft, "total_ms": ms(),
                   "prompt_tokens": len(prompt), "store_hit_blocks": hit.hit_blocks, "failovers": failovers}
        yield pb.GenerateEvent(kind="done", detail=json.dumps(summary), t_ms=ms())

    def _reusable_blocks(self, prompt, keys) -> int:
        """Blocks of ``keys`` an engine can reuse for ``prompt``: at most ``(len(prompt) - 1) // block_size``,
        since the last prompt token is always computed (its logits give the first output token). The
        engine plugin caps its own lookup by the same rule (``KVStoreConnector.get_num_new_matched_tokens``),
        so the lookup hop and the LB's cost see what the engine will load, not one block more."""
        return min(len(keys), (len(prompt) - 1) // self.cfg.block_size)

    def _route_request(self, prompt, keys, store_hit: int, request) -> RouteRequest:
        usable = keys[:self._reusable_blocks(prompt, keys)]
        in_store = set(usable[:store_hit]).__contains__  # the store is shared: one answer for every instance
        hits = {i.worker_id: PrefixHits.from_tiers(usable, device=i.holds, store=in_store)
                for i in self.registry.instances("prefill")}
        return RouteRequest(prompt_tokens=len(prompt), num_blocks=len(keys), hits=hits, block_hashes=tuple(keys),
                            ttft_slo_ms=request.ttft_slo_ms or None, block_tokens=self.cfg.block_size)


def serve(cfg: EntrypointConfig, store_url: str, *, host: str = "127.0.0.1", port: int = 0,
          heartbeat_s: float = 0.5, ready: Callable[[str], None] | None = None,
          stop: threading.Event | None = None, tls: ServerTLS | None = None) -> int:
    """Run the entrypoint until ``stop`` is set (or forever). Calls ``ready(address)`` once listening
    (``grpcs://HOST:PORT`` when ``tls`` is enabled: ``entrypoint.tls``, hop 1).

    A ``host`` beyond loopback without ``cfg.worker_secret`` (``entrypoint.auth.check_listen``),
    or with several tenants and no ``cfg.client_tokens`` (``entrypoint.client_tokens.check_open_tenants``),
    is refused before anything is opened. A failure while starting (a bad policy, a port
    that cannot be bound) raises after closing what was already opened (the store)."""
    from concurrent import futures

    if not (math.isfinite(heartbeat_s) and heartbeat_s > 0):
        raise kvstore.InvalidRequest(f"heartbeat_s must be a finite number > 0, got {heartbeat_s!r}")
    check_listen(host, cfg.worker_secret)
    check_open_tenants(host, cfg.tenants, ClientAuth(cfg.client_tokens))
    credentials = tls.credentials() if tls is not None else None  # the files read before anything is opened
    if cfg.worker_tls is not None:
        cfg.worker_tls.credentials()  # the same for the files it dials workers with
    store = kvstore.connect(store_url)
    registry = Registry(heartbeat_s=heartbeat_s, worker_secret=cfg.worker_secret, worker_tls=cfg.worker_tls)
    server = None
    try:
        service = EntrypointService(cfg, store, registry)
        server, bound = make_server(futures.ThreadPoolExecutor(max_workers=cfg.max_inflight + 8),
                                    [(service, pb.DESCRIPTOR.services_by_name["Entrypoint"])], host, port,
                                    credentials=credentials)
        server.start()
        registry.start()
        warn_plaintext("entrypoint", host, credentials is not None)
        if ready is not None:
            ready(server_address(host, bound, credentials is not None))
        stop = stop or threading.Event()
        stop.wait()
    finally:
        if server is not None:
            server.stop(grace=5).wait()
        registry.stop()
        store.close()
    return 0
