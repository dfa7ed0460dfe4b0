"""The reference engine: paged global KV, chunked prefill, batched decode, a connector.

Who calls it: tests, ``tools/bench_engine.py`` and the walkthrough. Usage::

    eng = Engine(ReferenceModel(model_preset("tiny")), EngineConfig(block_size=16), connector=conn)
    eng.add_request("r1", prompt_ids, SamplingParams(max_new_tokens=8))
    outputs = eng.run_until_done()      # {request id: Request}

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
Sampling is greedy (``temperature == 0``) or Gumbel-max with noise seeded by
``(seed, output index)``, so a request's tokens do not depend on how its
prefix was obtained or on which engine continues it.
"""

from __future__ import annotations

import enum
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Sequence

import torch

from engine_plugin.connector import (ForwardContext, KVConnectorBase, RestorePlan, ScheduledChunk,
                                     SchedulerOutput, WindowSnapshot)
from engine_plugin.reference.config import EngineConfig
from engine_plugin.reference.model import ReferenceModel, WindowState
from engine_plugin.reference.pool import BlockPool
from kvstore.errors import InvalidRequest
from kvstore.keys import BlockHasher, ImageSpan, Namespace

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: int = 0
    output_offset: int = 0  # output index of this request's first token (a stream resumed elsewhere)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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
        self.transfer_params_out: dict | None = None
        self.first_token_step: int | None = None
        self.published = 0  # leading blocks already published in the device prefix cache
        self.hasher: BlockHasher | None = None  # the engine's, or one with this request's tenant salt
        self.images: tuple[ImageSpan, ...] = ()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output


class _PagedKV:
    """``GlobalKVAccess`` over one request's block table."""

    __slots__ = ("pool", "table", "B")

    def __init__(self, pool: BlockPool, block_ids: list[int]):
        self.pool, self.B = pool, pool.block_size
        self.table = torch.tensor(block_ids, dtype=torch.long, device=pool.kv.device)

    def read(self, end: int) -> torch.Tensor:
        nb = -(-end // self.B)
        return self.pool.kv[self.table[:nb]].reshape(-1, self.pool.kv.shape[-1])[:end]

    def write(self, start: int, g: torch.Tensor) -> None:
        pos = torch.arange(start, start + g.shape[0], device=g.device)
        self.pool.kv[self.table[pos // self.B], pos % self.B] = g


class Engine:
    """See the module docstring."""

    def __init__(self, model: ReferenceModel, config: EngineConfig = EngineConfig(), *,
                 connector: KVConnectorBase | None = None, namespace: Namespace | None = None):
        self.model, self.cfg, self.connector = model, config, connector
        mc = model.cfg
        self.pool = BlockPool(config.num_blocks, config.block_size, mc.d_global,
                              dtype=model.embed.weight.dtype, device=model.device)
        self.namespace = namespace or default_namespace(model)
        self.hasher = BlockHasher(self.namespace, config.block_size, config.tenant_salt)
        backend = getattr(connector, "backend", None)
        if backend is not None and backend.device.type != model.device.type:
            raise InvalidRequest(f"the connector moves KV to {backend.device} but the model runs on "
                                 f"{model.device}; give ConnectorConfig(device=...) the engine's device")
        if connector is not None:
            self.pool.on_evict.append(lambda h, b: connector.on_device_evict(h, self.pool.kv[b]))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished: dict[str, Request] = {}
        self.steps = 0
        self.rollbacks = 0
        self.kv_sent: set[str] = set()  # finished requests whose KV reached the store

    # ------------------------------------------------------------------ API
    def add_request(self, request_id: str, prompt: list[int], sampling: SamplingParams = SamplingParams(),
                    kv_transfer_params: dict | None = None, *, tenant_salt: bytes | None = None,
                    images: Sequence[ImageSpan] = ()) -> Request:
        """Queue a request. ``tenant_salt`` (default: the engine's) and the image spans enter its
        block hashes, exactly as the entrypoint computes them with ``kvstore.keys``."""
        if not prompt:
            raise InvalidRequest("a prompt needs at least one token")
        if max(prompt) >= self.model.cfg.vocab_size or min(prompt) < 0:
            raise InvalidRequest(f"token ids must be in [0, {self.model.cfg.vocab_size})")
        if sampling.max_new_tokens < 1:
            raise InvalidRequest("max_new_tokens must be >= 1")
        req = Request(request_id, prompt, sampling, kv_transfer_params)
        if tenant_salt is not None and tenant_salt != self.hasher.tenant_salt:
            req.hasher = BlockHasher(self.namespace, self.cfg.block_size, tenant_salt)
        else:
            req.hasher = self.hasher
        req.images = tuple(images)
        self.waiting.append(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

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
                toks, ch.start, req.window, _PagedKV(self.pool, req.block_ids), hook=hook)
        errors = conn.get_load_errors() if conn is not None else {}
        for rid, err in errors.items():
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
        """Ask the connector which finished requests' saves completed; adds them to ``kv_sent``."""
        if self.connector is None:
            return set()
        sent, _ = self.connector.get_finished(set(self.finished))
        self.kv_sent |= sent
        return sent

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
            total_blocks = -(-(len(prompt) + req.sampling.max_new_tokens) // B)
            if total_blocks > self.pool.num_blocks:
                raise InvalidRequest(f"request {req.request_id} needs {total_blocks} blocks; "
                                     f"the pool has {self.pool.num_blocks}")
            self.pool.acquire(dev)  # before allocate: the eviction must not take our own hits
            fresh = self.pool.allocate(total_blocks - len(dev))
            if fresh is None:
                self.pool.release(dev)
                break  # wait for running requests to free blocks
            self.waiting.popleft()
            req.block_ids = dev + fresh
            num_dev = len(dev) * B
            ext = 0
            if self.connector is not None:
                ext, _ = self.connector.get_num_new_matched_tokens(req, num_dev)
                self.connector.update_state_after_alloc(req, req.block_ids, ext)
                req.plan = self.connector.restore_plan(req)
                req.snapshot_boundaries = self.connector.snapshot_boundaries(req)
            else:
                start = max(0, num_dev - self.model.replay_span("exact")) if num_dev else None
                req.plan = RestorePlan(num_dev, start)
            self._apply_plan(req, req.plan)
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
        self.model.forward_chunk(toks, start, req.window, _PagedKV(self.pool, req.block_ids),
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
        gen = torch.Generator().manual_seed(sp.seed * 1_000_003 + sp.output_offset + len(req.output))
        u = torch.rand(logits.shape, generator=gen, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
        gumbel = -torch.log(-torch.log(u))
        return int(torch.argmax(logits.double().cpu() / sp.temperature + gumbel))

    def _finish(self, req: Request) -> None:
        req.status = Status.FINISHED
        self.running.remove(req)
        if self.connector is not None:
            _, req.transfer_params_out = self.connector.request_finished(req, req.block_ids)
        self.pool.release(req.block_ids)
        self.finished[req.request_id] = req


def default_namespace(model: ReferenceModel) -> Namespace:
    return model.cfg.namespace()
