"""The reference engine: paged global KV, chunked prefill, batched decode, a connector.

Who calls it: the serving worker (``entrypoint.worker``), tests and ``tools/bench_engine.py``. Usage::

    eng = Engine(ReferenceModel(model_preset("tiny")), EngineConfig(block_size=16), connector=conn)
    eng.add_request("r1", prompt_ids, SamplingParams(max_new_tokens=8))
    outputs = eng.run_until_done()      # {request id: Request}
    eng.take_finished("r1")             # a long-running owner takes each finished request
    eng.kv_sent                         # P/D handoff: finished requests whose KV reached the store

One step (``step``), in order, and why:
  1. admit waiting requests: device prefix match, then the connector's match
     (``get_num_new_matched_tokens``), allocate blocks for prompt + output
     (reserved up front, so decode never runs out of blocks), then
     ``update_state_after_alloc`` and ``restore_plan``;
  2. schedule: one decode token per decoding request, then prefill chunks
     within the token budget, each chunk ending at a snapshot boundary;
  3. ``build_connector_meta`` -> ``start_load_kv`` (loads run beside compute);
  4. per request: the bounded replay if the plan needs one, then the chunk;
     the model calls ``wait_for_layer_load`` before each layer group;
  5. ``get_load_errors``: a request whose load failed is rolled back and
     re-planned from its last good token (its step results are discarded,
     so bad KV is never committed, sampled from or saved);
  6. ``save_kv_layer`` (completed blocks, window snapshots), ``wait_for_save``;
  7. commit: advance positions, publish completed blocks in the device prefix
     cache, sample, finish requests (``request_finished``, then free blocks).

Batching loops over requests inside a step (the model runs one request's
chunk at a time); the scheduler still runs several requests together.
Sampling is greedy (``temperature == 0``) or Gumbel-max with noise drawn from
numpy's SeedSequence over ``(seed, output index)`` (every uint64 seed its own
stream; torch's CPU generator would keep 32 bits of a seed), so a request's tokens do not depend on how its
prefix was obtained or on which engine continues it.

Misuse is refused by ``add_request`` (``InvalidRequest``) before anything is
queued, so a bad request never reaches ``step`` and never blocks the queue:
a prompt that is not a list of int ids in the vocabulary, a request that
needs more blocks than the whole pool has, a request id already waiting or
running. ``abort_request`` takes a request out at any time (a worker whose
step raised drops its requests with it) and frees its blocks. A connector
whose block size or KV layout does not fit is refused by ``Engine(...)``.
The engine's namespace covers the model's loaded weights (``ReferenceModel.model_id``)
and its connector's ``namespace_tag`` (KV computed after an approximate replay);
``add_request`` and ``step`` refuse to run once ``load_weights`` changed them
after the engine was built (build the engine after loading the weights).

P/D handoff signal: each finished request carries ``Request.send_state``
(``SendState``), PENDING until the connector reports its saves ended
(``get_finished``, read by ``collect_finished`` at the end of each step), then
SENT (all its KV reached the store: a decode engine may load it) or NOT_SENT.
A save may end after the request was taken (``take_finished``): the engine
keeps such a request in ``_sending`` until the connector reports it, and sets
the state on the record its owner took; a request added again under its id
meanwhile waits behind it and gets the state of its own saves (the connector
reports an id's requests in the order they finished). ``kv_sent`` / ``kv_send_failed`` are
views over the requests still in ``finished``. So the engine holds the signal of
a request only while it holds its record or its saves are in flight: bounded,
however many requests a worker serves (no set grows by an id per request
for the worker's life).
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import numbers
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from engine_plugin.contract import (ForwardContext, KVConnectorBase, KVLayout, RestorePlan, ScheduledChunk,
                                     SchedulerOutput, WindowSnapshot)
from engine_plugin.reference.config import EngineConfig
from engine_plugin.reference.model import ReferenceModel, WindowState, snapshot_shape
from engine_plugin.reference.pool import BlockPool, PagedKV
from kvstore.errors import InternalError, InvalidRequest
from kvstore.keys import BlockHasher, ImageSpan, Namespace, check_image_spans

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a request samples. ``temperature == 0`` is greedy; ``> 0`` is seeded Gumbel-max.

    Checked at construction (``InvalidRequest``): ``temperature`` is a finite number >= 0 (NaN
    would sample garbage, a negative one would silently be greedy); ``seed`` and
    ``output_offset`` are ints >= 0. ``max_new_tokens >= 1`` is checked by ``add_request``.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: int = 0
    output_offset: int = 0  # output index of this request's first token (a stream resumed elsewhere)

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not math.isfinite(t) or t < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        for name in ("max_new_tokens", "seed", "output_offset"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise InvalidRequest(f"SamplingParams.{name} must be an int, got {v!r}")
        if self.seed < 0 or self.output_offset < 0:
            raise InvalidRequest(f"seed and output_offset must be >= 0, got {self.seed} and {self.output_offset}")


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"  # taken out by ``Engine.abort_request``; never in ``finished``


class SendState(enum.Enum):
    """The P/D handoff signal of a finished request (``Request.send_state``; module docstring)."""

    PENDING = "pending"  # finished; the connector has not reported that its saves ended
    SENT = "sent"  # all its KV reached the store: a decode engine may be told to load it
    NOT_SENT = "not_sent"  # a save failed, was dropped or skipped, or none is sent (no store, write-back)


class Request:
    """One request's state. ``num_computed`` positions have global KV in ``block_ids``."""

    def __init__(self, request_id: str, prompt: list[int], sampling: SamplingParams,
                 kv_transfer_params: dict | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt)
        self.sampling = sampling
        self.kv_transfer_params = kv_transfer_params
        self.output: list[int] = []
        self.logits: list[torch.Tensor] = []  # logits of each sampled position
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.num_computed = 0
        self.window: WindowState | None = None
        self.plan: RestorePlan | None = None
        self.restore_pending = False
        self.hit_tokens = 0
        self.replayed_tokens = 0
        self.replay_s = 0.0  # wall time spent replaying (see EngineConfig.sync_timing)
        self.snapshot_boundaries: set[int] = set()
        self.last_window: tuple[int, torch.Tensor] | None = None  # latest block-boundary window
        self.status = Status.WAITING
        self.send_state: SendState | None = None  # set when it finishes, with a connector
        self.transfer_params_out: dict | None = None
        self.first_token_step: int | None = None
        self.published = 0  # leading blocks already published in the device prefix cache
        self.hasher: BlockHasher | None = None  # the engine's, or one with this request's tenant salt
        self.images: tuple[ImageSpan, ...] = ()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output


class Engine:
    """See the module docstring."""

    def __init__(self, model: ReferenceModel, config: EngineConfig = EngineConfig(), *,
                 connector: KVConnectorBase | None = None, namespace: Namespace | None = None):
        """Misconfiguration raises ``InvalidRequest`` here, not inside a later ``generate``: a
        connector whose block size or ``KVLayout`` (global KV width, dtype, snapshot shape)
        differs from this engine's and model's (``_check_connector``)."""
        self.model, self.cfg, self.connector = model, config, connector
        mc = model.cfg
        if connector is not None:
            _check_connector(connector, model, config)
        self.pool = BlockPool(config.num_blocks, config.block_size, mc.d_global,
                              dtype=model.embed.weight.dtype, device=model.device)
        self.namespace = namespace or default_namespace(model)
        tag = getattr(connector, "namespace_tag", "")
        if tag:  # approximate restores: this engine's KV is not exact KV (contract.py, "Declared attributes")
            self.namespace = replace(self.namespace, kv_layout=f"{self.namespace.kv_layout}+{tag}")
        # The weights this engine's namespace, pool and prefix cache belong to (see _check_model).
        self._model_id = model.model_id
        self.hasher = BlockHasher(self.namespace, config.block_size, config.tenant_salt)
        backend = getattr(connector, "backend", None)
        if backend is not None and backend.device.type != model.device.type:
            raise InvalidRequest(f"the connector moves KV to {backend.device} but the model runs on "
                                 f"{model.device}; give ConnectorConfig(device=...) the engine's device")
        if connector is not None:
            self.pool.on_evict.append(lambda h, b: connector.on_device_evict(h, self.pool.kv[b]))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished requests, kept until their consumer takes them (``take_finished``): a
        # long-running owner (``entrypoint.engine_runner``) must take each one, or this grows
        # with every request served. ``_newly_finished``: those not yet handed to
        # ``connector.get_finished`` (it gets each request once, in the step it finished).
        self.finished: dict[str, Request] = {}
        self._newly_finished: list[str] = []
        # Finished requests whose saves the connector has not yet reported ended (``send_state``
        # PENDING), taken or not: the connector reports each one once (its ``get_finished``
        # contract), so this holds only requests with saves in flight. Per id, oldest first: an id
        # reused while its earlier request's saves run does not take over; the connector reports
        # an id's requests in the order they finished (``engine_plugin.saver``, guarantee 3).
        self._sending: dict[str, deque[Request]] = {}
        self.steps = 0
        self.rollbacks = 0

    # ------------------------------------------------------------------ API
    def add_request(self, request_id: str, prompt: Sequence[int], sampling: SamplingParams = SamplingParams(),
                    kv_transfer_params: dict | None = None, *, tenant_salt: bytes | None = None,
                    images: Sequence[ImageSpan] = ()) -> Request:
        """Queue a request. ``tenant_salt`` (default: the engine's) and the image spans enter its
        block hashes, exactly as the entrypoint computes them with ``kvstore.keys``.

        Raises ``InvalidRequest``, and queues nothing, for: an id already waiting or running;
        a prompt that is not a non-empty list/tuple of int token ids in ``[0, vocab_size)``
        (a str, a tensor or float ids are refused, never truncated); ``max_new_tokens < 1``;
        a request whose prompt plus output needs more blocks than the whole pool has (it
        could never be admitted, and would block every request queued behind it); ``images``
        that are not ``ImageSpan``s inside the prompt, or overlap (``kvstore.keys.check_image_spans``).
        """
        self._check_model()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"a request id is a non-empty str, got {request_id!r}")
        if any(r.request_id == request_id for r in itertools.chain(self.waiting, self.running)):
            raise InvalidRequest(f"request id {request_id!r} is already waiting or running; "
                                 "use a unique id per request")
        if not isinstance(sampling, SamplingParams):
            raise InvalidRequest(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        prompt = self._token_ids(prompt)
        images = check_image_spans(images, len(prompt))
        if sampling.max_new_tokens < 1:
            raise InvalidRequest("max_new_tokens must be >= 1")
        total_blocks = -(-(len(prompt) + sampling.max_new_tokens) // self.cfg.block_size)
        if total_blocks > self.pool.num_blocks:
            raise InvalidRequest(f"request {request_id} needs {total_blocks} blocks "
                                 f"({len(prompt)} prompt + {sampling.max_new_tokens} new tokens); the pool "
                                 f"has {self.pool.num_blocks}: shorten it or give EngineConfig more num_blocks")
        req = Request(request_id, prompt, sampling, kv_transfer_params)
        if tenant_salt is not None and tenant_salt != self.hasher.tenant_salt:
            req.hasher = BlockHasher(self.namespace, self.cfg.block_size, tenant_salt)
        else:
            req.hasher = self.hasher
        req.images = images
        self.waiting.append(req)
        return req

    def _check_model(self) -> None:
        """Refuse to run once the model's weights changed after this engine was built.

        Refused, not re-derived: the namespace was hashed into queued requests' block
        hashes, and the device pool and prefix cache hold KV of the old weights. The
        connector holds no namespace (it moves KV under the keys the engine gives it).
        """
        if self.model.model_id != self._model_id:
            raise InvalidRequest(f"the model's weights changed after this Engine was built (model_id "
                                 f"{self._model_id!r} -> {self.model.model_id!r}); call load_weights "
                                 "before building the Engine, or build a new Engine")

    def _token_ids(self, prompt: Sequence[int]) -> list[int]:
        """``prompt`` as a list of python ints, or ``InvalidRequest`` saying what is wrong."""
        if not isinstance(prompt, (list, tuple)):
            raise InvalidRequest(f"a prompt is a list of int token ids, got {type(prompt).__name__}"
                                 + (" (tokenize it first)" if isinstance(prompt, (str, bytes)) else
                                    " (use .tolist())" if hasattr(prompt, "tolist") else ""))
        if not prompt:
            raise InvalidRequest("a prompt needs at least one token")
        bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)), None)
        if bad is not None:
            raise InvalidRequest(f"token ids must be ints, got {bad!r} ({type(bad).__name__})")
        ids = [int(t) for t in prompt]
        vocab = self.model.cfg.vocab_size
        if max(ids) >= vocab or min(ids) < 0:
            raise InvalidRequest(f"token ids must be in [0, {vocab})")
        return ids

    def abort_request(self, request_id: str) -> bool:
        """Take a waiting or running request out and free its blocks; False if it is neither.

        Its results so far are dropped (it never enters ``finished``; status ``ABORTED``),
        its published prefix blocks stay in the device prefix cache (they hold verified KV),
        and the connector forgets it (``KVConnectorBase.request_aborted``) without saving
        anything more for it. Safe after a ``step`` that raised: that is what it is for.
        """
        req = next((r for r in self.waiting if r.request_id == request_id), None)
        if req is not None:
            self.waiting.remove(req)
        else:
            req = next((r for r in self.running if r.request_id == request_id), None)
            if req is None:
                return False
            self.running.remove(req)
            if self.connector is not None:
                self.connector.request_aborted(req)
            self.pool.release(req.block_ids)
            req.block_ids = []
        req.status = Status.ABORTED
        return True

    def take_finished(self, request_id: str) -> Request | None:
        """Remove a finished request from ``finished`` and return it; ``None`` if it is not there.

        The engine keeps a finished request until its consumer takes it: an owner that runs
        for long (a worker) takes each request once it has read its results, so the engine
        holds O(1) finished records however many it has served. A request taken while its
        saves run still gets its ``send_state`` from a later ``collect_finished``.
        """
        return self.finished.pop(request_id, None)

    @property
    def kv_sent(self) -> set[str]:
        """Ids in ``finished`` whose KV all reached the store (``SendState.SENT``): the P/D
        handoff signal. A request taken before its saves ended gets it on its record."""
        return {rid for rid, r in self.finished.items() if r.send_state is SendState.SENT}

    @property
    def kv_send_failed(self) -> set[str]:
        """Ids in ``finished`` whose KV is not all in the store (``SendState.NOT_SENT``)."""
        return {rid for rid, r in self.finished.items() if r.send_state is SendState.NOT_SENT}

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_sends(self) -> bool:
        """Whether a finished request's saves are still unreported (``send_state`` PENDING): an
        owner that stops stepping when idle calls ``collect_finished`` while this holds, else the
        engine keeps those records until the next step."""
        return bool(self._sending)

    def run_until_done(self, max_steps: int = 1_000_000) -> dict[str, Request]:
        for _ in range(max_steps):
            if not self.has_work():
                break
            self.step()
        return self.finished

    def generate(self, prompt: list[int], sampling: SamplingParams = SamplingParams(),
                 request_id: str | None = None) -> Request:
        rid = request_id or f"req-{len(self.finished) + len(self.running) + len(self.waiting)}-{self.steps}"
        self.add_request(rid, prompt, sampling)
        self.run_until_done()
        return self.finished[rid]

    # ------------------------------------------------------------------ step
    def step(self) -> None:
        self._check_model()  # before anything runs: a step on changed weights would mix two models
        self.steps += 1
        new_ids = self._admit()
        chunks = self._schedule()
        conn = self.connector
        reqs = {r.request_id: r for r in self.running}
        if conn is not None:
            conn.bind_connector_metadata(conn.build_connector_meta(
                SchedulerOutput(tuple(chunks), tuple(new_ids))))
            conn.start_load_kv(ForwardContext(self.pool.kv, {
                rid: reqs[rid].window.buf for rid in new_ids if reqs[rid].window is not None}))
        hook = conn.wait_for_layer_load if conn is not None else None
        results: dict[str, torch.Tensor | None] = {}
        snaps: list[WindowSnapshot] = []
        for ch in chunks:
            req = reqs[ch.request_id]
            if req.restore_pending:
                self._replay(req, hook)
            toks = torch.tensor(req.all_token_ids[ch.start:ch.start + ch.num_tokens], dtype=torch.long)
            results[req.request_id] = self.model.forward_chunk(
                toks, ch.start, req.window, PagedKV(self.pool, req.block_ids), hook=hook)
        errors = conn.get_load_errors() if conn is not None else {}
        for rid, err in errors.items():
            if rid not in reqs:
                raise InternalError(f"bug: the connector reports a load error for {rid!r}, "
                                    "which is not running")
            self._rollback(reqs[rid], err.valid_tokens, err.window_ok)
            results.pop(rid, None)
            log.warning("request %s: KV load failed (%s); recomputing from token %d",
                        rid, err.reason, err.valid_tokens)
        done = [ch for ch in chunks if ch.request_id in results]
        for ch in done:
            req, end = reqs[ch.request_id], ch.start + ch.num_tokens
            if end % self.cfg.block_size == 0 and end > 0:
                snap = (end, req.window.export())
                req.last_window = snap
                if end in req.snapshot_boundaries and len(req.block_hashes) >= end // self.cfg.block_size:
                    snaps.append(WindowSnapshot(req.request_id, end,
                                                req.block_hashes[end // self.cfg.block_size - 1], snap[1]))
        if conn is not None:
            conn.save_kv_layer("global", self.pool.kv, None)
            conn.save_kv_layer("swa", snaps, None)
            conn.wait_for_save()
            conn.clear_connector_metadata()
        for ch in done:
            self._commit(reqs[ch.request_id], ch, results[ch.request_id])
        self.collect_finished()

    def collect_finished(self) -> set[str]:
        """Ask the connector which finished requests' saves ended and set their ``send_state``:
        SENT for those whose KV all reached the store (returned), NOT_SENT for the others."""
        newly = set(self._newly_finished)
        if self.connector is None:
            self._newly_finished.clear()
            return set()
        # only those finished since the last call (the contract: each reported once), not
        # every record still in ``finished``: that set grew with every request served.
        # Cleared after the call returned, so a call that raised hands them over again.
        done, _ = self.connector.get_finished(newly)
        self._newly_finished.clear()
        failed = self.connector.get_failed_sends() & done
        for rid in done:
            reqs = self._sending.get(rid)  # None: not finished here (a connector's bug); ignored
            if reqs:  # the oldest of the id: the connector reports them in the order they finished
                req = reqs.popleft()
                if not reqs:
                    del self._sending[rid]
                req.send_state = SendState.NOT_SENT if rid in failed else SendState.SENT
        return done - failed

    # ------------------------------------------------------------- internals
    def _admit(self) -> list[str]:
        new_ids = []
        B = self.cfg.block_size
        while self.waiting and len(self.running) < self.cfg.max_running:
            req = self.waiting[0]
            prompt = req.prompt_token_ids
            req.block_hashes = req.hasher.hash_blocks(prompt, req.images)
            max_hit = (len(prompt) - 1) // B  # leave >= 1 token to compute: it yields the logits
            dev = self.pool.match_prefix(req.block_hashes[:max_hit])
            total_blocks = -(-(len(prompt) + req.sampling.max_new_tokens) // B)  # <= num_blocks: add_request
            self.pool.acquire(dev)  # before allocate: the eviction must not take our own hits
            try:
                fresh = self.pool.allocate(total_blocks - len(dev))
            except BaseException:  # an on_evict callback raised: the request stays waiting, holding nothing
                self.pool.release(dev)
                raise
            if fresh is None:
                self.pool.release(dev)
                break  # wait for running requests to free blocks
            self.waiting.popleft()
            req.block_ids = dev + fresh
            num_dev = len(dev) * B
            ext = 0
            try:
                if self.connector is not None:
                    ext, _ = self.connector.get_num_new_matched_tokens(req, num_dev)
                    self.connector.update_state_after_alloc(req, req.block_ids, ext)
                    req.plan = self.connector.restore_plan(req)
                    req.snapshot_boundaries = self.connector.snapshot_boundaries(req)
                else:
                    start = max(0, num_dev - self.model.replay_span("exact")) if num_dev else None
                    req.plan = RestorePlan(num_dev, start)
                self._apply_plan(req, req.plan)
            except BaseException:  # neither waiting nor running: give its blocks back, then fail
                if self.connector is not None:
                    self.connector.request_aborted(req)
                self.pool.release(req.block_ids)
                req.block_ids, req.status = [], Status.ABORTED
                raise
            req.status = Status.RUNNING
            self.running.append(req)
            new_ids.append(req.request_id)
        return new_ids

    def _apply_plan(self, req: Request, plan: RestorePlan) -> None:
        req.hit_tokens = req.num_computed = plan.hit_tokens
        if plan.needs_replay:
            req.window = WindowState.empty(self.model.cfg, self.model.device, end=plan.replay_start)
            req.window.valid = 0  # a truncated window: positions before replay_start are unseen
            req.restore_pending = True
        else:
            req.window = WindowState.empty(self.model.cfg, self.model.device, end=plan.hit_tokens)
            req.restore_pending = False

    def _replay(self, req: Request, hook) -> None:
        start, end = req.plan.replay_start, req.plan.hit_tokens
        toks = torch.tensor(req.all_token_ids[start:end], dtype=torch.long)
        t0 = time.perf_counter()
        self.model.forward_chunk(toks, start, req.window, PagedKV(self.pool, req.block_ids),
                                 replay=True, hook=hook)
        if self.cfg.sync_timing and self.model.device.type != "cpu":
            torch.cuda.synchronize(self.model.device)  # timing only: costs the overlap
        req.replay_s += time.perf_counter() - t0
        req.replayed_tokens += end - start
        req.restore_pending = False

    def _rollback(self, req: Request, valid_tokens: int, window_ok: bool) -> None:
        """Discard this step's work of ``req`` and restart from its last good token."""
        # The windows are always rebuilt by a replay: this step's forward already advanced them,
        # and a failed load leaves no snapshot to start from. window_ok is informational here.
        self.rollbacks += 1
        valid = min(valid_tokens, req.plan.hit_tokens)
        plan = RestorePlan(valid, max(0, valid - self.model.replay_span("exact")) if valid else None)
        req.plan = plan
        self._apply_plan(req, plan)
        if self.connector is not None:  # boundaries at or below the old hit are now computed here
            req.snapshot_boundaries = self.connector.snapshot_boundaries(req)

    def _schedule(self) -> list[ScheduledChunk]:
        budget = self.cfg.max_batched_tokens
        chunks = []
        for req in self.running:  # decodes first: they are latency-bound
            if req.num_computed >= len(req.prompt_token_ids) and budget > 0:
                chunks.append(ScheduledChunk(req.request_id, req.num_computed, 1))
                budget -= 1
        for req in self.running:
            n_prompt = len(req.prompt_token_ids)
            if req.num_computed < n_prompt and budget > 0:
                end = min(n_prompt, req.num_computed + self.cfg.chunk_size, req.num_computed + budget)
                nxt = [b for b in req.snapshot_boundaries if req.num_computed < b < end]
                end = min(nxt) if nxt else end
                chunks.append(ScheduledChunk(req.request_id, req.num_computed, end - req.num_computed))
                budget -= end - req.num_computed
        return chunks

    def _commit(self, req: Request, ch: ScheduledChunk, logits: torch.Tensor | None) -> None:
        B = self.cfg.block_size
        req.num_computed = ch.start + ch.num_tokens
        toks = req.all_token_ids
        if req.num_computed >= len(req.prompt_token_ids):  # last prompt chunk or a decode step
            tok = self._sample(req, logits)
            req.output.append(tok)
            req.logits.append(logits)
            if req.first_token_step is None:
                req.first_token_step = self.steps
            toks = req.all_token_ids
        n_full = len(toks) // B
        if n_full > len(req.block_hashes):  # extend the hash chain (kvstore.keys is the only hasher)
            k = len(req.block_hashes)
            req.block_hashes += req.hasher.hash_blocks(
                toks[k * B:n_full * B], req.images, parent=req.block_hashes[-1] if k else None, start_block=k)
        for i in range(req.published, min(req.num_computed // B, len(req.block_hashes))):
            # publish completed blocks in the device prefix cache; if another block already
            # holds this hash (two requests computed it), ours stays private and is freed later
            self.pool.register(req.block_ids[i], req.block_hashes[i])
            req.published = i + 1
        if len(req.output) >= req.sampling.max_new_tokens:
            self._finish(req)

    def _sample(self, req: Request, logits: torch.Tensor) -> int:
        sp = req.sampling
        if sp.temperature <= 0:
            return int(torch.argmax(logits))
        # numpy's SeedSequence hashes the whole (seed, index) pair, any size: torch's CPU generator
        # keeps only 32 bits of its seed, so seeds 2**32 apart (or seed + index folded into one
        # number) shared one noise stream
        rng = np.random.default_rng((sp.seed, sp.output_offset + len(req.output)))
        u = torch.from_numpy(rng.random(tuple(logits.shape))).clamp_(1e-12, 1 - 1e-12)
        gumbel = -torch.log(-torch.log(u))
        return int(torch.argmax(logits.double().cpu() / sp.temperature + gumbel))

    def _finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        self.running.remove(req)
        if self.connector is not None:
            _, req.transfer_params_out = self.connector.request_finished(req, req.block_ids)
            req.send_state = SendState.PENDING
            self._sending.setdefault(req.request_id, deque()).append(req)
        self.pool.release(req.block_ids)
        self.finished[req.request_id] = req
        self._newly_finished.append(req.request_id)


def default_namespace(model: ReferenceModel) -> Namespace:
    """The model's namespace: its config *and* loaded weights (``ReferenceModel.model_id``)."""
    return model.namespace()


def _check_connector(connector: KVConnectorBase, model: ReferenceModel, config: EngineConfig) -> None:
    """Refuse a connector that would move KV of another shape than this engine's pool holds.

    Checked: the connector's block size (one store entry is one pool block) and its
    ``KVLayout``: global KV width, dtype (a float16 layout on a float32 model would save
    down-cast KV under the float32 namespace) and window snapshot shape. A connector that
    does not declare them (``None``) is not checked.
    """
    B = getattr(connector, "block_size", None)
    if B is not None and B != config.block_size:
        raise InvalidRequest(f"the connector's block_size is {B} but the engine's is {config.block_size}; "
                             "give ConnectorConfig and EngineConfig the same block_size")
    lay = getattr(connector, "layout", None)
    if not isinstance(lay, KVLayout):
        return
    mc = model.cfg
    pool_dtype = str(model.embed.weight.dtype).removeprefix("torch.")
    want = {"d_global": mc.d_global, "dtype": pool_dtype, "snapshot_shape": snapshot_shape(mc)}
    got = {"d_global": lay.d_global, "dtype": lay.dtype, "snapshot_shape": tuple(lay.snapshot_shape)}
    diff = [f"{k} {got[k]!r} (the model has {want[k]!r})" for k in want if got[k] != want[k]]
    if diff:
        raise InvalidRequest("the connector's KVLayout does not fit the model: " + ", ".join(diff)
                             + "; build the connector with model.kv_layout()")
