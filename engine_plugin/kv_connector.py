"""``KVStoreConnector``: the plugin's connector over host DRAM and a ``kvstore`` store.

Who calls it: an engine through the hooks of ``engine_plugin.contract`` (the
contract, with when/how often/guarantees for every hook). This module adds
the policy of *what* is loaded and saved; ``devices`` moves bytes and
``tiers`` guards the host cache and the store.

Tiers, fastest first: the engine's device pool (its prefix cache; the engine
matches it and passes ``num_computed_tokens``), then ``HostCache``, then the
store. A lookup walks them in that order and the hit is the longest prefix of
blocks each available in some tier. Store hits are promoted to the host tier;
device evictions are written back to the host tier; host evictions go to the
store when the save policy says so (``SAVE_POLICIES``). Its config record,
``ConnectorConfig``, lives in ``engine_plugin.connector_config`` (re-exported here).

Choosing the hit boundary H (``get_num_new_matched_tokens``), with reasons:
  1. H never covers the whole prompt: one token must run to give logits.
  2. With an SWA snapshot at H (host or store): no replay.
  3. Else, with a snapshot at S < H and ``H - S <= span``: stop at S; the
     prefill of ``[S, H)`` costs no more than the replay it avoids.
  4. Else replay ``[H - span, H)``; ``span = layout.replay_span(replay_policy)``.
     As in the public V4.1 serving code, an external hit with ``H <= span``
     is not adopted (the replay would cost as much as the recompute). A span
     shorter than exact (``KVLayout.approximate``) tags the engine's namespace
     (``namespace_tag``): what it computes after such a replay is approximate
     and never served to an engine that replays exactly.
Block entries hold only the global KV (``[block_size, d_global]``); SWA
entries are snapshots at chosen boundaries: end of the prompt, every
``snapshot_interval_blocks`` blocks, and the end of the output.

Failure handling: anything missing, lost, corrupt, wrong-sized or saved with
another layout (the dtype/shape recorded with the entry, where the store
reports it) at load time turns into a ``LoadError`` (engine recomputes from
the last good block, and the recomputed blocks are saved again, which heals
an entry the store marked lost); so does a load whose loader thread raised (a
bug, logged with its traceback, ``load_exceptions``: the load hooks never
raise). A store that is down or slow is skipped for ``store_backoff_s`` after
a failure (``StoreGateway``); any exception a store call raises, or a
malformed answer, counts as a failed call there, never as an error of the
step. Saves never block the step (bounded queue, drop + count; a step with
more blocks than ``staging_buffers`` is copied out in chunks that reuse the
pool, ``_save_blocks``). Close the connector before its store (the saver may
still be writing); ``close`` is idempotent, and any other hook after it raises
``StoreClosed``.

P/D handoff: a prefill engine's ``request_finished`` returns transfer params;
the decode engine loads the same blocks through its own connector (lookups
verify against the store, the params are never trusted as proof) once the
prefill side reported the request in ``get_finished`` and not in the
``get_failed_sends`` that follows it (a request with a save that failed or was
dropped: its decode recomputes what is missing; ``requests_save_incomplete``).
Without a store, or under ``write_back`` (blocks reach the store only when the
host tier evicts them), no request's blocks are sent on its behalf: every
request is in ``get_failed_sends``, and none is told to a decode as sent.

Counters (``metrics.snapshot()``): ``hit_tokens_{device,host,store}``,
``snapshot_hits``, ``replays``, ``replay_tokens``, ``hits_not_adopted``,
``loaded_tokens``, ``bytes_loaded``, ``load_errors``, ``load_missing``,
``load_bad_size``, ``load_exceptions``, ``snapshot_load_failed``, ``staging_exhausted``, ``direct_read_overruns``,
``store_errors``, ``store_timeouts``, ``store_skipped``, ``store_busy``, ``store_refused``, ``saves_enqueued``,
``saves_done``, ``saves_failed``, ``saves_dropped``, ``requests_save_incomplete``, ``bytes_saved``,
``snapshots_saved``, ``device_evictions_to_host``, ``host_evictions_{block,swa}``,
``save_enqueue_wait_max_s``.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from engine_plugin.connector_config import SAVE_POLICIES, ConnectorConfig, SavePolicy  # noqa: F401 - re-exported
from engine_plugin.contract import (BlockLoad, BlockSave, ConnectorMetadata, ForwardContext,
                                     KVConnectorBase, KVLayout, LoadError, LoadSpec, RestorePlan,
                                     SchedulerOutput, Tier, WindowSnapshot)
from engine_plugin.devices import BufferPool, get_backend
from engine_plugin.loader import EntryFormat, Loader
from engine_plugin.saver import SaveQueue
from engine_plugin.tiers import HostCache, Metrics, StoreGateway
from kvstore.api import KVStore, Layout, PutItem
from kvstore.errors import InvalidRequest, StoreClosed

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Plan:
    num_dev_tokens: int
    hit_tokens: int
    tiers: tuple[Tier, ...]  # one per external block, from num_dev_tokens // B on
    snapshot_tier: Tier | None
    rejected_short: bool = False  # an external hit <= span was not adopted (V4.1 rule)


@dataclass(slots=True)
class _Job:
    spec: LoadSpec
    swa: cf.Future | None
    glob: cf.Future | None


class KVStoreConnector(KVConnectorBase):
    """See the module docstring; hooks are documented in ``engine_plugin.contract``."""

    def __init__(self, layout: KVLayout, config: ConnectorConfig = ConnectorConfig(),
                 store: KVStore | None = None):
        """Bad arguments raise ``InvalidRequest`` here. The engine checks ``block_size`` and
        ``layout`` against its own when it is given this connector (``Engine.__init__``)."""
        if not isinstance(layout, KVLayout):
            raise InvalidRequest(f"layout must be a KVLayout (model.kv_layout()), got {type(layout).__name__}")
        if not isinstance(config, ConnectorConfig):
            raise InvalidRequest(f"config must be a ConnectorConfig, got {type(config).__name__}")
        self.layout, self.cfg = layout, config
        self.policy = SAVE_POLICIES[config.save_policy]
        self.span = layout.replay_span(config.replay_policy)
        # KV computed after an approximate replay must not reach engines that replay exactly
        # (the engine folds this into its namespace; contract.py, "Declared attributes").
        self.namespace_tag = f"replay-{config.replay_policy}" if layout.approximate(config.replay_policy) else ""
        self.B = self.block_size = config.block_size
        self._closed = False
        dtype = getattr(torch, layout.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise InvalidRequest(f"KVLayout.dtype {layout.dtype!r} is not a torch dtype name")
        self.dtype = dtype
        self.block_shape = (self.B, layout.d_global)
        self.snap_shape = tuple(layout.snapshot_shape)
        # What a loaded entry must have been saved as (dtype and shape), besides its byte count.
        self.block_layout = Layout(layout.dtype, self.block_shape)
        self.snap_layout = Layout(layout.dtype, self.snap_shape)
        isz = torch.empty((), dtype=self.dtype).element_size()
        self.block_nbytes = self.B * layout.d_global * isz
        self.snap_nbytes = isz * int(torch.Size(self.snap_shape).numel())
        self.metrics = Metrics()
        self.backend = get_backend(config.device)
        self.direct_reads = config.direct_reads and self.backend.host_resident
        self.host = HostCache(config.host_capacity_bytes, on_evict=self._host_evicted)
        self.gateway = StoreGateway(store, self.metrics, timeout_s=config.store_timeout_s,
                                    put_timeout_s=config.store_put_timeout_s,
                                    backoff_s=config.store_backoff_s, max_calls=config.store_max_calls)
        self.buffers = BufferPool(self.backend, config.staging_buffers)
        self.load_stream, self.save_stream = self.backend.new_stream(), self.backend.new_stream()
        self.loader = Loader(host=self.host, gateway=self.gateway, buffers=self.buffers, backend=self.backend,
                             metrics=self.metrics, stream=self.load_stream, dtype=self.dtype,
                             block=EntryFormat(self.block_shape, self.block_nbytes, self.block_layout),
                             snapshot=EntryFormat(self.snap_shape, self.snap_nbytes, self.snap_layout),
                             direct_reads=self.direct_reads, batch_blocks=config.load_batch_blocks,
                             timeout_s=config.store_timeout_s, promote=config.promote_to_host)
        self._loader = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-load")
        self._plans: dict[str, _Plan] = {}
        self._snapped: dict[str, set[int]] = {}  # request id -> boundaries already snapshotted
        self._reqs: dict[str, Any] = {}  # running requests (read-only: block table and hashes)
        self._pending: dict[str, LoadSpec] = {}
        self._jobs: dict[str, _Job] = {}
        self._errors: dict[str, LoadError] = {}
        self._step_events: list[Any] = []
        self._host_inserts: list[tuple[str, bytes, torch.Tensor]] = []
        self._meta = ConnectorMetadata()
        self._send_failed: set[str] = set()  # of the requests the last get_finished reported
        # whether a request's blocks reach the store on its behalf (else none is reported sent)
        self._sends_blocks = store is not None and self.policy.save_on_compute
        self.saves = SaveQueue(self.gateway, self.metrics, depth=config.save_queue_depth,
                               enqueue_timeout_s=config.save_enqueue_timeout_s)

    # ================================================================ scheduler side
    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed("this KVStoreConnector is closed; build a new one (and a new engine) to go on")

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        self._check_open()
        B, keys = self.B, request.block_hashes
        max_blocks = min(len(keys), (len(request.prompt_token_ids) - 1) // B)
        n_dev = num_computed_tokens // B
        n, tiers = n_dev, []
        while n < max_blocks and ("block", keys[n]) in self.host:
            tiers.append(Tier.HOST)
            n += 1
        store_swa = None
        if n < max_blocks:  # the gateway answers None at once while the store is marked down
            # The gateway answers at most as many hits as keys asked (a store that answers
            # more counts as failed: 0 hits), so n <= max_blocks, which leaves the prompt's
            # last token to compute even when the store holds every block of it.
            lr = self.gateway.lookup(keys[n:max_blocks])
            if lr is not None:
                tiers += [Tier.STORE] * lr.hit_blocks
                store_swa = n + lr.swa_at if lr.swa_at else None
                n += lr.hit_blocks
        H, snap = n, None
        if self.cfg.load_snapshots:
            for b in range(n, max(n_dev, 1) - 1, -1):  # largest boundary with a snapshot
                if ("swa", keys[b - 1]) in self.host:
                    snap = (b, Tier.HOST)
                elif b == store_swa:
                    snap = (b, Tier.STORE)
                if snap:
                    break
        rejected = False
        if snap and (snap[0] == n or (n - snap[0]) * B <= self.span):
            H, snap_tier = snap[0], snap[1]
        else:
            snap_tier = None
            if H > n_dev and H * B <= self.span and not self.cfg.adopt_short_hits:
                H, rejected = n_dev, True
        plan = _Plan(n_dev * B, H * B, tuple(tiers[: H - n_dev]), snap_tier, rejected)
        self._plans[request.request_id] = plan
        self._reqs[request.request_id] = request
        return plan.hit_tokens - plan.num_dev_tokens, False

    def update_state_after_alloc(self, request, block_ids: Sequence[int], num_external_tokens: int) -> None:
        self._check_open()
        rid = request.request_id
        plan = self._plans.get(rid)
        if plan is None:
            raise InvalidRequest(f"update_state_after_alloc({rid}) before get_num_new_matched_tokens")
        if num_external_tokens == 0 and plan.hit_tokens > plan.num_dev_tokens:
            plan = _Plan(plan.num_dev_tokens, plan.num_dev_tokens, (), None)
            self._plans[rid] = plan
        if plan.rejected_short:  # counted here, not in the (repeatable) matching hook
            self.metrics.inc("hits_not_adopted")
        first = plan.num_dev_tokens // self.B
        loads = tuple(BlockLoad(first + i, block_ids[first + i], request.block_hashes[first + i], t)
                      for i, t in enumerate(plan.tiers))
        snap_key = request.block_hashes[plan.hit_tokens // self.B - 1] if plan.snapshot_tier else None
        for t in plan.tiers:
            self.metrics.inc(f"hit_tokens_{t.value}", self.B)
        self.metrics.inc("hit_tokens_device", plan.num_dev_tokens)
        if loads or snap_key:
            self._pending[rid] = LoadSpec(rid, loads, first, snap_key, plan.snapshot_tier)

    def restore_plan(self, request) -> RestorePlan:
        plan = self._plans[request.request_id]
        H = plan.hit_tokens
        if H == 0 or plan.snapshot_tier is not None:
            if plan.snapshot_tier is not None:
                self.metrics.inc("snapshot_hits")
            return RestorePlan(H, None, plan.snapshot_tier)
        self.metrics.inc("replays")
        self.metrics.inc("replay_tokens", min(H, self.span))
        return RestorePlan(H, max(0, H - self.span))

    def snapshot_boundaries(self, request) -> set[int]:
        B, P = self.B, len(request.prompt_token_ids)
        H = self._plans[request.request_id].hit_tokens if request.request_id in self._plans else 0
        out = set()
        if self.cfg.snapshot_end_of_input and P // B:
            out.add(P // B * B)
        if self.cfg.snapshot_interval_blocks:
            step = self.cfg.snapshot_interval_blocks * B
            out.update(range(step, P + 1, step))
        return {b for b in out if b > H}

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        self._check_open()
        loads = tuple(self._pending.pop(rid) for rid in scheduler_output.new_request_ids
                      if rid in self._pending)
        saves = []
        if self.policy.save_on_compute:
            for ch in scheduler_output.chunks:
                req, plan = self._reqs.get(ch.request_id), self._plans.get(ch.request_id)
                if req is None or plan is None:
                    continue
                lo = max(ch.start // self.B, plan.hit_tokens // self.B)  # hits are stored already
                for i in range(lo, min((ch.start + ch.num_tokens) // self.B, len(req.block_hashes))):
                    saves.append(BlockSave(ch.request_id, i, req.block_ids[i], req.block_hashes[i]))
        return ConnectorMetadata(loads, tuple(saves))

    def request_finished(self, request, block_ids: Sequence[int]) -> tuple[bool, dict | None]:
        self._check_open()
        rid = request.request_id
        lw = getattr(request, "last_window", None)
        snapped = self._snapped.pop(rid, set())
        if (self.cfg.snapshot_end_of_output and lw is not None and lw[0] // self.B <= len(request.block_hashes)
                and lw[0] not in snapped):  # not already saved at that boundary
            b, win = lw
            key = request.block_hashes[b // self.B - 1]
            self.save_kv_layer("swa", [WindowSnapshot(rid, b, key, win)], None)
            self.wait_for_save()
        self._plans.pop(rid, None)
        self._reqs.pop(rid, None)
        self.saves.mark_finished(rid)
        params = {"kvstack": {"block_size": self.B, "computed_tokens": request.num_computed,
                              "saved_blocks": len(request.block_hashes)}}
        return False, params

    # ================================================================ worker side
    def start_load_kv(self, forward_context: ForwardContext) -> None:
        self._check_open()
        self._errors = {}
        for spec in self._meta.loads:
            win = forward_context.windows.get(spec.request_id)
            swa = (self._loader.submit(self.loader.load_snapshot, spec, win)
                   if spec.snapshot_key is not None and win is not None else None)
            glob = self._loader.submit(self.loader.load_blocks, spec, forward_context.kv_pool) if spec.blocks else None
            self._jobs[spec.request_id] = _Job(spec, swa, glob)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Each future is bounded: the loader's store calls all have timeouts. A load that
        # raised is not waited on here: get_load_errors reports it (the contract: never raises).
        attr = "glob" if layer_name == "global" else "swa"
        for job in self._jobs.values():
            fut = getattr(job, attr)
            if fut is not None and fut.exception() is None:
                self.backend.wait_event(fut.result()[1].get(layer_name))

    def _job_result(self, rid: str, fut: cf.Future, what: str, failed: Any) -> Any:
        """``fut``'s result, or ``failed`` when the loader raised: a bug or a store fault that got
        past the gateway, logged with its traceback; the request recomputes instead of the step
        raising (``wait_for_layer_load`` never raises, so neither does what reports its loads)."""
        exc = fut.exception()
        if exc is None:
            return fut.result()
        self.metrics.inc("load_exceptions")
        log.error("loading the %s of request %s raised; it recomputes from the first block loaded",
                  what, rid, exc_info=exc)
        self.backend.synchronize()  # copies it started on the load stream end before the recompute
        return failed

    def get_load_errors(self) -> dict[str, LoadError]:
        try:
            self._collect_loads()
        finally:  # a job is reported once: a failure here must not make every later step fail
            self._jobs.clear()
        return dict(self._errors)

    def _collect_loads(self) -> None:
        for rid, job in list(self._jobs.items()):
            spec = job.spec
            window_ok, good, reason = True, len(spec.blocks), ""
            if job.swa is not None:
                ok, events = self._job_result(rid, job.swa, "snapshot", (False, {}))
                for ev in events.values():
                    self.backend.wait_event(ev)
                if not ok:
                    window_ok, reason = False, "SWA snapshot missing or corrupt"
            elif spec.snapshot_key is not None:
                window_ok, reason = False, "no window buffer for the snapshot"
            if job.glob is not None:
                good, events = self._job_result(rid, job.glob, "blocks", (0, {}))
                self.backend.wait_event(events.get("global"))
                if good < len(spec.blocks):
                    reason = f"block {spec.first_block + good} missing, lost or corrupt"
            if good < len(spec.blocks) or not window_ok:
                self.metrics.inc("load_errors")
                valid = (spec.first_block + good) * self.B
                self._errors[rid] = LoadError(valid, window_ok and good == len(spec.blocks), reason)
                if rid in self._plans:  # the engine recomputes [valid, ...): save those blocks again,
                    self._plans[rid] = replace(self._plans[rid], hit_tokens=valid)  # healing the store
            self.metrics.inc("loaded_tokens", good * self.B)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        self._check_open()
        if layer_name == "global":
            self._save_blocks([sv for sv in self._meta.saves if sv.request_id not in self._errors],
                              kv_layer)
        elif layer_name == "swa":
            self._save_snapshots([s for s in kv_layer if s.request_id not in self._errors])
        else:
            raise InvalidRequest(f"unknown layer group {layer_name!r}; use 'global' or 'swa'")

    def wait_for_save(self) -> None:
        """Sync the step's D2H copies, then insert the snapshots they filled into the host tier.

        Each insert is done once and independently: the list is taken before the first one (a
        later call never repeats it), and one whose ``host.put`` raises (its write-back
        ``on_evict``) does not keep the others out. As in ``HostCache.put``: every insert runs,
        then the first exception is raised, the others logged and noted on it.
        """
        for ev in self._step_events:
            self.backend.sync_event(ev)
        self._step_events.clear()
        inserts, self._host_inserts = self._host_inserts, []  # only now: the D2H copies are complete
        first: Exception | None = None
        failed = 0
        for kind, key, t in inserts:
            try:
                self.host.put(kind, key, t)
            except Exception as exc:  # noqa: BLE001 - raised below, once every insert was done
                failed += 1
                if first is None:
                    first = exc
                else:
                    log.error("host tier insert of %s %s raised (after an earlier one of this step)",
                              kind, key.hex()[:16], exc_info=True)
        if first is not None:
            if failed > 1:
                first.add_note(f"{failed - 1} more host tier inserts of this wait_for_save raised (logged)")
            raise first

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        done, failed = self.saves.take_sent()
        if failed:
            self.metrics.inc("requests_save_incomplete", len(failed))
        # No store, or write-back: no request's blocks are saved on its behalf (write-back puts
        # a block only when the host tier evicts it), so none is reported sent, even one that
        # had no save at all: a decode told "sent" would find its KV missing.
        self._send_failed = failed if self._sends_blocks else set(done)
        return done, set()

    def get_failed_sends(self) -> set[str]:
        return set(self._send_failed)

    def request_aborted(self, request) -> None:
        """See ``engine_plugin.contract``: waits for the request's loads still running (they
        may write into its blocks), then forgets its plan, pending loads and errors."""
        rid = request.request_id
        job = self._jobs.pop(rid, None)
        if job is not None:
            for fut in (job.swa, job.glob):
                if fut is not None:
                    try:
                        fut.result()  # bounded: see wait_for_layer_load
                    except Exception:  # noqa: BLE001 - the request is dropped anyway; the cause was raised
                        log.debug("load of aborted request %s had failed", rid, exc_info=True)
        self._pending.pop(rid, None)
        self._errors.pop(rid, None)
        self._plans.pop(rid, None)
        self._reqs.pop(rid, None)
        self._snapped.pop(rid, None)
        self.saves.forget(rid)  # not ``saves.mark_finished``: get_finished never reports it

    def on_device_evict(self, key: bytes, block: torch.Tensor) -> None:
        self._check_open()
        t = self._host_tensor(self.block_nbytes, self.block_shape)
        self.backend.sync_event(self.backend.copy_async(t, block, self.save_stream))
        self.host.put("block", key, t)
        self.metrics.inc("device_evictions_to_host")

    def persist_host_tier(self) -> int:
        """Write every host-tier entry to the store (write-back policy: before a shutdown or
        a planned handoff, so that nothing only cached in DRAM is lost). Returns entries queued."""
        self._check_open()
        n = 0
        for (kind, key), t in self.host.items():
            shape = self.block_shape if kind == "block" else self.snap_shape
            item = PutItem(key, t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), kind=kind,
                           ttl_s=self.cfg.ttl_s, layout=Layout(self.layout.dtype, shape),
                           tokens=self.B if kind == "block" else 0)
            n += self.saves.submit([item], []) if self.gateway.store is not None else 0
        return n

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every save submitted before this call was attempted (tests, P/D handoff,
        shutdown; ``engine_plugin.saver`` guarantee 5); ``False`` if ``timeout`` seconds passed
        first (logged)."""
        self._check_open()
        done = self.saves.flush(timeout)
        if not done:
            log.warning("flush: saves submitted before it still pending after %s s", timeout)
        return done

    def close(self) -> None:
        """Drain the save queue and stop the threads. Close the connector before its store.

        Idempotent: a second call returns at once. Every other hook raises ``StoreClosed`` after it.
        """
        if self._closed:
            return
        self._closed = True
        self.saves.close()
        self._loader.shutdown(wait=True)
        self.gateway.close()

    # ================================================================ internals: loads
    def _host_tensor(self, nbytes: int, shape: tuple[int, ...]) -> torch.Tensor:
        return self.backend.empty_host(nbytes).view(self.dtype).view(shape)

    # ================================================================ internals: saves
    def _save_blocks(self, saves: Sequence[BlockSave], pool: torch.Tensor) -> None:
        """D2H the step's completed blocks in chunks bounded by the staging pool, then one submit.

        Per chunk: as many staging buffers as the pool gives (waiting only for the first),
        one copy each, a sync, the bytes taken out, the buffers released; then the next chunk
        reuses them. A step with more blocks than ``staging_buffers`` (a long prefill chunk)
        is thus saved whole, never dropped or stalled for lack of buffers. Buffers held
        elsewhere (staged loads) are waited for at most ``save_enqueue_timeout_s`` per step in
        all; what is left then is dropped (``saves_dropped``, logged): the step never waits
        longer. A full save queue still drops the step's job (``SaveQueue``: backpressure).
        """
        if not saves:
            return
        layout = Layout(self.layout.dtype, self.block_shape)
        items, rids = [], []
        deadline = time.monotonic() + self.cfg.save_enqueue_timeout_s
        i = 0
        while i < len(saves):
            bufs = self.buffers.acquire_some(self.block_nbytes, len(saves) - i,
                                             timeout=max(0.0, deadline - time.monotonic()))
            if not bufs:
                self.metrics.inc("saves_dropped", len(saves) - i)
                self.saves.mark_failed({sv.request_id for sv in saves[i:]})
                log.warning("no staging buffer free for %.3f s: %d block saves of this step dropped",
                            self.cfg.save_enqueue_timeout_s, len(saves) - i)
                break
            chunk, done = saves[i:i + len(bufs)], False
            try:
                events = [self.backend.copy_async(buf.view(self.dtype).view(self.block_shape), pool[sv.block_id],
                                                  self.save_stream) for sv, buf in zip(chunk, bufs)]
                for ev in events:  # the bytes are taken below: the copies must be complete
                    self.backend.sync_event(ev)
                items += [PutItem(sv.key, buf.numpy().tobytes(), kind="block", ttl_s=self.cfg.ttl_s,
                                  layout=layout, tokens=self.B) for sv, buf in zip(chunk, bufs)]
                rids += [sv.request_id for sv in chunk]
                done = True
            finally:  # bytes copied out (or the step fails): the buffers serve the next chunk or step
                if not done:  # a copy started, even by a copy_async that raised, must end first;
                    self.backend.synchronize()  # a sync that raises keeps them out of the pool
                for buf in bufs:
                    self.buffers.release(buf)
            i += len(chunk)
        if items and self.gateway.store is not None:
            self.saves.submit(items, rids)

    def _save_snapshots(self, snaps: list[WindowSnapshot]) -> None:
        if not snaps:
            return
        bufs, rids = [], []
        for s in snaps:
            t = self._host_tensor(self.snap_nbytes, self.snap_shape)
            self._step_events.append(self.backend.copy_async(t, s.window, self.save_stream))
            self._host_inserts.append(("swa", s.key, t))
            bufs.append((s.key, t.view(-1).view(torch.uint8)))
            rids.append(s.request_id)
        self.metrics.inc("snapshots_saved", len(snaps))
        for s in snaps:
            self._snapped.setdefault(s.request_id, set()).add(s.boundary)
        self._enqueue(bufs, rids, "swa", self.snap_shape, 0)

    def _enqueue(self, bufs, rids, kind, shape, tokens) -> None:
        """Hand D2H'd host tensors to the save queue; never blocks the step past the enqueue timeout."""
        if not bufs:
            return
        for ev in self._step_events:  # bytes are taken below: the copies must be complete
            self.backend.sync_event(ev)
        layout = Layout(self.layout.dtype, tuple(shape))
        items = [PutItem(key, buf.numpy().tobytes(), kind=kind, ttl_s=self.cfg.ttl_s, layout=layout,
                         tokens=tokens) for key, buf in bufs]
        if self.gateway.store is not None:
            self.saves.submit(items, rids)

    def _host_evicted(self, kind: str, key: bytes, t: torch.Tensor) -> None:
        self.metrics.inc(f"host_evictions_{kind}")
        if kind == "block" and self.policy.store_on_host_evict and self.gateway.store is not None:
            item = PutItem(key, t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), kind="block",
                           ttl_s=self.cfg.ttl_s, layout=Layout(self.layout.dtype, self.block_shape),
                           tokens=self.B)
            self.saves.submit([item], [])
