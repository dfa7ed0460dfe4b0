"""``KvstackConnector``: kvstack as a vLLM v1 KV connector (``KVConnectorBase_V1`` + ``SupportsHMA``).

Loaded by vLLM without patching it::

    --kv-transfer-config '{"kv_connector": "KvstackConnector",
                           "kv_connector_module_path": "engine_plugin.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"store_url": "grpc://127.0.0.1:7070"}}'

The options (``kv_connector_extra_config``) are ``engine_plugin.vllm_layout.ConnectorOptions``.
This module is a *binding*: it translates vLLM's hooks and KV layout. The core it
reuses is the reference engine's: ``tiers.StoreGateway`` (timeouts, circuit
breaker, length and layout checks on every read), ``saver.SaveQueue`` (the
bounded background put queue), ``devices`` (device backends, staging buffers)
and ``tiers.Metrics``. Keys come from ``kvstore.keys`` (vLLM's own chained
``request.block_hashes`` under a namespace of everything that changes KV bytes, the TP
rank included: each worker keys the hashes the scheduler sends under its own rank, and
the scheduler looks up rank 0's keys, so with TP > 1 a rank whose entry is missing fails
its own load and vLLM recomputes).

What is stored (``vllm_layout`` has the table): per block, one *block* entry
holding that block of every full-attention layer; for sliding-window groups
(hybrid models with vLLM's hybrid KV manager), one *swa* entry per snapshot
boundary ``H`` holding the window blocks the token at ``H`` attends to. Boundaries:
the end of each prompt (its last block boundary before its last token), every ``snapshot_interval_blocks``
blocks of a prompt, and the end of the output when the request finishes.

Scheduler side (the scheduler process; one ``KvstackConnector`` with role SCHEDULER)
---------------------------------------------------------------------------------
``get_num_new_matched_tokens(request, n)``: one store ``lookup`` of the keys past
vLLM's local hit ``n`` (never the prompt's last token). Without window groups the
hit is the longest stored block prefix; with them, it ends only at a boundary
whose snapshot is stored (``LookupResult.swa_at``), since vLLM cannot rebuild a
window it was never given: a hit whose windows cannot be restored is never
claimed. Side-effect free but for caching its answer per request; a store that is
down or slower than ``lookup_timeout_s`` gives 0 (counted ``store_unavailable``),
never an exception. How a hit is loaded (``load_mode``, default ``auto``):

* *asynchronous* (vLLM's ``load_kv_async``) where the store is remote (a daemon) or
  the model has several KV cache groups: the request waits in WAITING_FOR_REMOTE_KVS
  while other requests' steps go on, so a remote daemon never stalls them;
* *synchronous* for the embedded store and one full-attention group: the load runs on the loader
  thread from ``start_load_kv``, before the step's forward, and the first
  ``wait_for_layer_load`` waits for it; a local read costs less than the scheduler
  steps an asynchronous load adds. (vLLM can take a failed synchronous load back
  only as block ids, which are per group: hybrid models always load asynchronously.)
``update_state_after_alloc``: turns the cached answer into a load job naming the
allocated block ids per group (only blocks past the local hit are written).
``build_connector_meta``: this step's loads, and the saves of every block the step
completes (full groups) and of every snapshot boundary it reaches (window groups).
``request_finished`` / ``request_finished_all_groups``: schedules the end-of-output
snapshot; returns ``True`` (blocks kept) until the worker copied it out.

Worker side (each worker process; role WORKER)
----------------------------------------------
``register_kv_caches``: vLLM's per-layer tensors as they are; a block is opaque
bytes per layer (``tensor.select(block_dim, id)``: CPU and CUDA layouts differ,
and the namespace and each entry's recorded layout keep them apart).
``start_load_kv``: each new load job runs on the loader thread: verified reads into
staging buffers (``StoreGateway.read_into``), then copies into the layers' blocks.
``wait_for_save``: copies the step's completed blocks and snapshots out of the
layers and hands them to the save queue (a full queue drops the save, counted;
the forward never waits on the store).
``get_transfer_results``: loads that ended are ``finished_recving``. A block that is
missing, corrupt, of another layout or whose read failed is never used: with one
KV cache group its block ids (and every later one of the job) go to
``get_block_ids_with_load_errors`` and vLLM recomputes from there; with several
groups (block ids are per group) the request goes to ``failed_recving`` and vLLM
recomputes it whole. Either way the output equals a cold run (set vLLM's
``kv_load_failure_policy`` to ``recompute``; with ``fail`` vLLM fails the request).

Roles: ``kv_producer`` never loads (0 hit tokens), ``kv_consumer`` never saves;
``kv_both`` does both.

Counters (``tiers.Metrics``; in vLLM's connector stats, the log, and ``stats_file``):
``lookups``, ``hit_tokens``, ``hits_limited_by_window`` (a block hit cut back to a
restorable boundary), ``store_unavailable``, ``loads``, ``loaded_blocks``,
``bytes_loaded``, ``load_seconds`` (loader thread time: reads and copies), ``load_errors``, ``saves_enqueued``, ``saves_done``,
``saves_failed``, ``saves_dropped``, ``bytes_saved``, ``snapshots_saved``,
``snapshots_skipped`` plus the gateway's ``store_*`` counters.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorTransferResults,
                                                               SupportsHMA)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

import kvstore
from engine_plugin.devices import BufferPool, get_backend
from engine_plugin.saver import SaveQueue
from engine_plugin.tiers import Metrics, StoreGateway
from engine_plugin.vllm_layout import ConnectorOptions, GroupPlan, namespace_id, weights_id
from kvstore.api import Layout, PutItem
from kvstore.errors import InvalidRequest
from kvstore.keys import BlockHasher, Namespace

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

_SKIP = -1  # a block id slot the load must not write (a local prefix-cache hit already holds it)
_LOG_EVERY_S = 30.0


class _StoreRegistry:
    """One open store per (URL, options) per process, shared by the connectors in it.

    vLLM may run the scheduler and the worker connector in one process (one engine core
    without multiprocessing); an embedded store's LMDB index can be opened only once per
    process, and one client is cheaper than two anyway. Closed when its last user shuts down.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[str, list] = {}  # ident -> [store, users]

    def acquire(self, url: str, options: dict[str, Any]) -> Any:
        ident = json.dumps([url, sorted(options.items())], default=str)
        with self._lock:
            entry = self._open.get(ident)
            if entry is None:
                entry = self._open[ident] = [kvstore.connect(url, **options), 0]
            entry[1] += 1
            return entry[0]

    def release(self, store: Any) -> None:
        with self._lock:
            for ident, entry in list(self._open.items()):
                if entry[0] is store:
                    entry[1] -= 1
                    if entry[1] == 0:
                        del self._open[ident]
                        try:
                            store.close()
                        except Exception:  # noqa: BLE001 - closing at shutdown: nothing left to save
                            log.debug("closing the store raised", exc_info=True)
                    return


_SHARED_STORES = _StoreRegistry()


# ---------------------------------------------------------------------------- metadata records
# The records below carry vLLM's block hashes, not store keys: a key's namespace holds the
# TP rank, and each worker keys the hashes under its own (the scheduler looks up rank 0's).
@dataclass(frozen=True, slots=True)
class BlockLoad:
    hash: bytes
    block_ids: tuple[int, ...]  # one per full group (``GroupPlan.full`` order)


@dataclass(frozen=True, slots=True)
class WindowLoad:
    hash: bytes  # the snapshot's: that of block ``boundary // B - 1``
    first_block: int  # block index of the snapshot's first block
    block_ids: tuple[tuple[int, ...], ...]  # per snapshot block, one id per window group (or _SKIP)


@dataclass(frozen=True, slots=True)
class LoadJob:
    request_id: str
    blocks: tuple[BlockLoad, ...]
    window: WindowLoad | None
    sync: bool = False  # loaded within the step that computes the request (module docstring)
    unmatched: bool = False  # vLLM admitted another count than offered: nothing to load, all failed


@dataclass(frozen=True, slots=True)
class BlockSave:
    request_id: str
    hash: bytes
    block_ids: tuple[int, ...]  # one per full group


@dataclass(frozen=True, slots=True)
class WindowSave:
    request_id: str
    hash: bytes
    boundary: int  # tokens before the snapshot: recorded as the entry's ``tokens``
    block_ids: tuple[tuple[int, ...], ...]  # per snapshot block, one id per window group
    finishing: bool = False  # the end-of-output snapshot: the request's blocks wait for it


@dataclass(slots=True)
class KvstackMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = field(default_factory=list)
    block_saves: list[BlockSave] = field(default_factory=list)
    window_saves: list[WindowSave] = field(default_factory=list)


class KvstackConnectorStats(KVConnectorStats):
    """Counter deltas since the last report; aggregated across workers and intervals by sum."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "KvstackConnectorStats":
        out = dict(self.data)
        for k, v in (other.data or {}).items():
            out[k] = out.get(k, 0) + v
        return KvstackConnectorStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


# ---------------------------------------------------------------------------- scheduler records
@dataclass(frozen=True, slots=True)
class _Match:
    local_blocks: int
    hit_blocks: int  # boundary H in blocks (local + external)


@dataclass(slots=True)
class _Req:
    request: Any
    keys: list[bytes] = field(default_factory=list)
    hit_blocks: int = 0  # blocks that came from a hit at admission: not saved again
    next_save: int = 0  # first block index not yet considered for a save
    snapped: set[int] = field(default_factory=set)  # snapshot boundaries saved or loaded


class KvstackConnector(KVConnectorBase_V1, SupportsHMA):
    """See the module docstring."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.opts = ConnectorOptions.parse(tc.kv_connector_extra_config)
        self.B = vllm_config.cache_config.block_size
        self.plan = GroupPlan.from_kv_cache_config(kv_cache_config, self.B)
        self.loads_enabled = tc.kv_role != "kv_producer"
        embedded = "://" not in self.opts.store_url or self.opts.store_url.lower().startswith("file:")
        # vLLM takes a failed synchronous load back only as block ids of one group: a synchronous
        # load needs one full-attention group (a window is not named by block ids either)
        sync_ok = len(self.plan.groups) == 1 and not self.plan.window
        self.sync_loads = {"auto": embedded and sync_ok, "sync": True, "async": False}[self.opts.load_mode]
        if self.sync_loads and not sync_ok:
            raise InvalidRequest("load_mode sync needs a model with one full-attention KV cache group: vLLM "
                                 "takes a failed synchronous load back only as block ids; use auto or async")
        self.saves_enabled = tc.kv_role != "kv_consumer"
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kv_load_failure_policy is %r: a kvstack load that fails will fail its request "
                        "instead of being recomputed; set \"kv_load_failure_policy\": \"recompute\"",
                        tc.kv_load_failure_policy)
        self.metrics = Metrics()
        self._reported: dict[str, float] = {}
        self._last_log = time.monotonic()
        self._written: dict[str, float] | None = None  # the counters stats_file holds
        self._hasher = BlockHasher(self._namespace(vllm_config), self.B)
        self.store = _SHARED_STORES.acquire(self.opts.store_url, self._connect_options())
        worker = role == KVConnectorRole.WORKER
        self.gateway = StoreGateway(self.store, self.metrics,
                                    timeout_s=self.opts.load_timeout_s if worker else self.opts.lookup_timeout_s,
                                    put_timeout_s=self.opts.put_timeout_s, backoff_s=self.opts.backoff_s)
        # scheduler state
        self._reqs: dict[str, _Req] = {}
        self._matches: dict[str, _Match] = {}
        self._pending_loads: list[LoadJob] = []
        self._finishing: list[WindowSave] = []
        # worker state
        self._layers: dict[str, tuple[torch.Tensor, int]] = {}  # name -> (kv tensor, block dim)
        self._full_layers: list[str] = []
        self._window_layers: list[str] = []
        self._jobs: dict[str, tuple[LoadJob, cf.Future]] = {}
        self._invalid: set[int] = set()
        self._finishing_copied: set[str] = set()  # end-of-output snapshots copied out, not yet reported
        self._last_finished: set[str] = set()  # finished_req_ids of the previous get_transfer_results
        self.saves: SaveQueue | None = None
        if worker:
            self.saves = SaveQueue(self.gateway, self.metrics, depth=self.opts.save_queue_depth,
                                   enqueue_timeout_s=0.0)
            self._loader = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstack-load")
            self._reads = cf.ThreadPoolExecutor(max_workers=self.opts.load_parallel, thread_name_prefix="kvstack-read")
        log.info("KvstackConnector %s: store %s, namespace %s, groups %s, role %s", role.name,
                 self.opts.store_url, self._hasher.namespace.label(), self.plan.describe(), tc.kv_role)

    def _namespace(self, vc: "VllmConfig") -> Namespace:
        from vllm.platforms import current_platform

        pc = vc.parallel_config
        tp_rank = 0
        if self.role == KVConnectorRole.WORKER:
            try:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                tp_rank = get_tensor_model_parallel_rank()
            except Exception:  # noqa: BLE001 - no TP group (one worker): rank 0
                tp_rank = 0
        cache_dtype = str(vc.cache_config.cache_dtype)
        if cache_dtype == "auto":
            cache_dtype = str(vc.model_config.dtype).removeprefix("torch.")
        device = str(current_platform.device_type)
        try:
            from vllm.v1.attention.backends.utils import get_kv_cache_layout

            attn_layout = str(get_kv_cache_layout())
        except Exception:  # noqa: BLE001 - older layouts API: the device type alone tells them apart
            attn_layout = "default"
        model = self.opts.model_id or str(vc.model_config.model)
        ns_id = namespace_id(model=model, weights=weights_id(vc.model_config), cache_dtype=cache_dtype,
                             block_size=self.B, device=device,
                             attn_layout=attn_layout, tp_rank=tp_rank, tp_size=pc.tensor_parallel_size,
                             plan=self.plan)
        return Namespace(model_id=model, kv_layout=ns_id, dtype=cache_dtype, rank=tp_rank)

    def _connect_options(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.opts.extra)
        if "://" in self.opts.store_url and not self.opts.store_url.lower().startswith("file:"):
            out.setdefault("direct_reads", self.opts.direct_reads)
            if self.opts.token_file:
                with open(self.opts.token_file, encoding="utf-8") as f:
                    out["token"] = f.read().strip()
        return out

    # ============================================================ scheduler side
    def _state(self, request: "Request") -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None or st.request is not request:
            st = self._reqs[request.request_id] = _Req(request)
        hashes = request.block_hashes
        if len(st.keys) < len(hashes):
            st.keys += self._hasher.keys_for_engine_hashes(hashes[len(st.keys):])
        return st

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        st = self._state(request)  # saves need it too (a producer's)
        if not self.loads_enabled:
            return 0, False
        B = self.B
        max_blocks = min(len(st.keys), (request.num_tokens - 1) // B)  # never the last token
        local = num_computed_tokens // B
        cached = self._matches.get(request.request_id)
        if cached is not None and cached.local_blocks == local:
            # asked again for a request that did not fit yet: the same answer, not another lookup
            # (a block lost meanwhile fails its load, and vLLM recomputes it)
            return (cached.hit_blocks - local) * B, cached.hit_blocks > local and not self.sync_loads
        self._matches.pop(request.request_id, None)
        if local >= max_blocks:
            return 0, False
        self.metrics.inc("lookups")
        res = self.gateway.lookup(st.keys[local:max_blocks])
        if res is None:
            self.metrics.inc("store_unavailable")
            return 0, False
        hit = local + res.hit_blocks
        if self.plan.window:
            restorable = local + res.swa_at if res.swa_at else local
            if restorable < hit:
                self.metrics.inc("hits_limited_by_window")
            hit = restorable
        self._matches[request.request_id] = _Match(local, max(hit, local))
        if hit <= local:
            return 0, False
        return (hit - local) * B, not self.sync_loads

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        rid = request.request_id
        m = self._matches.pop(rid, None)  # the admission took the answer
        if num_external_tokens == 0:
            return
        st = self._state(request)
        if m is None or (m.hit_blocks - m.local_blocks) * self.B != num_external_tokens:
            # vLLM admitted another count than this connector offered: nothing it can load
            # matches, so the job fails whole (every allocated block named) and vLLM recomputes.
            log.warning("request %s: vLLM asked for %d external tokens, kvstack offered %s; recomputing",
                        rid, num_external_tokens, m and (m.hit_blocks - m.local_blocks) * self.B)
            ids = blocks.get_block_ids()
            every = tuple(BlockLoad(b"", tuple(ids[g.index][i] for g in self.plan.full))
                          for i in range(len(ids[self.plan.full[0].index]))) if self.plan.full else ()
            self._pending_loads.append(LoadJob(rid, every, WindowLoad(b"", 0, ()) if self.plan.window else None,
                                               self.sync_loads, unmatched=True))
            return
        ids = blocks.get_block_ids()
        hashes = st.request.block_hashes
        loads = tuple(BlockLoad(hashes[i], tuple(ids[g.index][i] for g in self.plan.full))
                      for i in range(m.local_blocks, m.hit_blocks)) if self.plan.full else ()
        window = None
        if self.plan.window:
            H = m.hit_blocks * self.B
            first = self.plan.first_window_block(H)
            window = WindowLoad(hashes[m.hit_blocks - 1], first, tuple(
                tuple(ids[g.index][j] if j >= m.local_blocks else _SKIP for g in self.plan.window)
                for j in range(first, m.hit_blocks)))
            st.snapped.add(H)
        st.hit_blocks = st.next_save = m.hit_blocks
        self.metrics.inc("hit_tokens", num_external_tokens)
        self._pending_loads.append(LoadJob(rid, loads, window, self.sync_loads))

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvstackMetadata:
        meta = KvstackMetadata(loads=self._pending_loads, window_saves=self._finishing)
        self._pending_loads, self._finishing = [], []
        if self.saves_enabled:
            spans = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
            cached = scheduler_output.scheduled_cached_reqs
            spans += list(zip(cached.req_ids, cached.num_computed_tokens))
            for rid, start in spans:
                n = scheduler_output.num_scheduled_tokens.get(rid, 0)
                st = self._reqs.get(rid)
                if st is not None and n > 0:
                    self._plan_saves(st, start, start + n, meta)
        self._maybe_report()
        return meta

    def _block_ids(self, rid: str) -> tuple[list[int], ...]:
        return self._kv_cache_manager.get_block_ids(rid)

    def _null_block_id(self) -> int:
        return self._kv_cache_manager.block_pool.null_block.block_id

    def _plan_saves(self, st: _Req, start: int, end: int, meta: KvstackMetadata) -> None:
        B = self.B
        self._state(st.request)  # keys for the blocks this step completes
        rid = st.request.request_id
        ids = self._block_ids(rid)
        lo, hi = max(start // B, st.next_save), min(end // B, len(st.keys))
        if self.plan.full:
            for i in range(lo, hi):
                meta.block_saves.append(BlockSave(rid, st.request.block_hashes[i],
                                                  tuple(ids[g.index][i] for g in self.plan.full)))
        st.next_save = max(st.next_save, hi)
        if not self.plan.window:
            return
        prompt = st.request.num_prompt_tokens
        # The prompt's last boundary that leaves a token to compute: the one the same prompt
        # sent again can hit (a hit never covers the last token), and within a block of the
        # end for a longer prompt that extends it.
        bounds = {(prompt - 1) // B * B}
        if self.opts.snapshot_interval_blocks:
            step = self.opts.snapshot_interval_blocks * B
            bounds.update(range(step, prompt + 1, step))
        for b in sorted(bounds):
            if start < b <= end and b // B > st.hit_blocks and b not in st.snapped and b // B <= len(st.keys):
                self._plan_window(st, b, ids, meta.window_saves, finishing=False)

    def _plan_window(self, st: _Req, boundary: int, ids: Sequence[Sequence[int]], out: list[WindowSave], *,
                     finishing: bool) -> bool:
        first, last = self.plan.first_window_block(boundary), boundary // self.B
        null = self._null_block_id()
        rows = []
        for j in range(first, last):
            row = tuple(ids[g.index][j] if j < len(ids[g.index]) else null for g in self.plan.window)
            if null in row:  # vLLM already freed a block of this window: it cannot be saved
                self.metrics.inc("snapshots_skipped")
                return False
            rows.append(row)
        st.snapped.add(boundary)
        out.append(WindowSave(st.request.request_id, st.request.block_hashes[last - 1], boundary, tuple(rows),
                              finishing))
        return True

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict | None]:
        return self._finished(request, (block_ids,))

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict | None]:
        return self._finished(request, block_ids)

    def _finished(self, request: "Request", block_ids: Sequence[Sequence[int]]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self._matches.pop(rid, None)
        if rid not in self._reqs or not (self.saves_enabled and self.plan.window and self.opts.snapshot_end_of_output):
            self._reqs.pop(rid, None)
            return False, None
        st = self._state(request)
        del self._reqs[rid]
        b = request.num_computed_tokens // self.B * self.B
        if b // self.B <= st.hit_blocks or b in st.snapped or b // self.B > len(st.keys):
            return False, None
        if len(block_ids) != len(self.plan.groups):
            return False, None
        return self._plan_window(st, b, block_ids, self._finishing, finishing=True), None

    # ============================================================ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        nb = self._kv_cache_config.num_blocks
        for name, t in kv_caches.items():
            dims = [d for d in range(min(2, t.dim())) if t.shape[d] == nb]
            if not dims:
                raise InvalidRequest(f"KV cache tensor of layer {name} has shape {tuple(t.shape)}: no dimension "
                                     f"of the {nb} blocks among its first two; unknown attention layout")
            self._layers[name] = (t, dims[-1] if t.shape[0] == 2 and len(dims) > 1 else dims[0])
        self._full_layers = [n for g in self.plan.full for n in g.layer_names]
        self._window_layers = [n for g in self.plan.window for n in g.layer_names]
        missing = [n for n in self._full_layers + self._window_layers if n not in self._layers]
        if missing:
            raise InvalidRequest(f"vLLM registered no KV cache for layers {missing[:4]}")
        first = next(iter(kv_caches.values()))
        self.backend = get_backend("cuda" if first.is_cuda else "cpu")
        self.buffers = BufferPool(self.backend, max(self.opts.load_parallel * self.opts.load_batch_blocks, 8))
        self._save_stream = self.backend.new_stream()
        self._load_stream = self.backend.new_stream()
        self._dtype = first.dtype
        self._block_shape = tuple(self._block_view(next(iter(self._layers))).shape)
        self._layer_nbytes = {n: self._block_view(n, 0).numel() * t.element_size()
                              for n, (t, _) in self._layers.items()}
        self._full_nbytes = sum(self._layer_nbytes[n] for n in self._full_layers)
        self._window_row_nbytes = sum(self._layer_nbytes[n] for n in self._window_layers)

    def _block_view(self, layer: str, block_id: int = 0) -> torch.Tensor:
        t, d = self._layers[layer]
        return t.select(d, block_id)

    def _entry_layout(self, n_layers: int, rows: int | None = None) -> Layout:
        """What an entry's bytes are: ``[rows,] layers, *block`` of the cache dtype; checked on load."""
        dtype = str(self._dtype).removeprefix("torch.")
        shape = ((rows,) if rows is not None else ()) + (n_layers,) + self._block_shape
        return Layout(dtype, shape)

    def _key(self, engine_hash: bytes) -> bytes:
        return self._hasher.keys_for_engine_hashes([engine_hash])[0]

    def _ids_by_layer(self, groups, ids: Sequence[int]) -> list[tuple[str, int]]:
        return [(n, bid) for g, bid in zip(groups, ids) for n in g.layer_names]

    # ---- saves
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for job in meta.loads:
            self.metrics.inc("loads")
            self._jobs[job.request_id] = (job, self._loader.submit(self._load, job))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Synchronous loads land before the first layer reads them (an entry holds every
        # layer of its block, so the read is the whole wait); asynchronous ones are not
        # this step's: their requests run only after get_transfer_results reported them.
        for job, fut in self._jobs.values():
            if job.sync:
                cf.wait([fut])

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # the step's blocks are copied out together in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvstackMetadata):
            return
        # A request whose synchronous load failed in this step was computed over blocks that
        # were not loaded: nothing it computed may be saved (vLLM learns of the failure only
        # after this call, from get_transfer_results, and recomputes from the first bad block).
        bad = {rid for rid, (job, fut) in self._jobs.items() if job.sync and not self._loaded_whole(job, fut)}
        if bad:
            log.warning("requests %s: their loads failed; this step's blocks of theirs are not saved", sorted(bad))
        block_saves = [sv for sv in meta.block_saves if sv.request_id not in bad]
        window_saves = [sv for sv in meta.window_saves if sv.request_id not in bad]
        items, copies = [], []
        if block_saves:
            layout = self._entry_layout(len(self._full_layers))
            for sv in block_saves:
                host = self._gather(self._ids_by_layer(self.plan.full, sv.block_ids), copies)
                items.append(PutItem(self._key(sv.hash), host.numpy(), kind="block", ttl_s=self.opts.ttl_s, layout=layout,
                                     tokens=self.B))
        for sv in window_saves:
            pairs = [p for row in sv.block_ids for p in self._ids_by_layer(self.plan.window, row)]
            host = self._gather(pairs, copies)
            items.append(PutItem(self._key(sv.hash), host.numpy(), kind="swa", ttl_s=self.opts.ttl_s,
                                 layout=self._entry_layout(len(self._window_layers), len(sv.block_ids)),
                                 tokens=sv.boundary))
        for ev in copies:
            self.backend.sync_event(ev)
        # the blocks of a finishing request may be freed once copied (or not saved): get_transfer_results says so
        self._finishing_copied.update(sv.request_id for sv in meta.window_saves if sv.finishing)
        if items:
            self.metrics.inc("snapshots_saved", len(window_saves))
            self.metrics.inc("bytes_saved", sum(it.value.nbytes for it in items))
            self.saves.submit(items, [])

    @staticmethod
    def _loaded_whole(job: LoadJob, fut: cf.Future) -> bool:
        """Whether a load job ended with every block (and its window) in place; waits for it."""
        try:
            good, window_ok = fut.result()
        except Exception:  # noqa: BLE001 - get_transfer_results logs it
            return False
        return good == len(job.blocks) and window_ok

    def _gather(self, pairs: Sequence[tuple[str, int]], events: list) -> torch.Tensor:
        """The blocks ``pairs`` (layer, block id) back to back in one new host tensor (uint8)."""
        n = sum(self._layer_nbytes[name] for name, _ in pairs)
        host = self.backend.empty_host(n)
        off = 0
        for name, bid in pairs:
            src = self._block_view(name, bid)
            nb = self._layer_nbytes[name]
            dst = host[off:off + nb].view(src.dtype).view(src.shape)
            events.append(self.backend.copy_async(dst, src, self._save_stream))
            off += nb
        return host

    # ---- loads
    def _scatter(self, buf: torch.Tensor, pairs: Sequence[tuple[str, int]], events: list) -> None:
        off = 0
        for name, bid in pairs:
            nb = self._layer_nbytes[name]
            if bid != _SKIP:
                dst = self._block_view(name, bid)
                events.append(self.backend.copy_async(dst, buf[off:off + nb].view(dst.dtype).view(dst.shape),
                                                      self._load_stream))
            off += nb

    def _read(self, keys: list[bytes], kind: str, nbytes: int, layout: Layout) -> tuple[list[torch.Tensor], list[bool]]:
        bufs = self.buffers.acquire_many(nbytes, len(keys), timeout=self.opts.load_timeout_s)
        if len(bufs) < len(keys):
            for b in bufs:
                self.buffers.release(b)
            return [], [False] * len(keys)
        res = self.gateway.read_into(keys, [b.numpy() for b in bufs], kind=kind, nbytes=nbytes, layout=layout)
        if res.pending is not None:  # abandoned at its timeout, may still write: never reuse them
            for b in bufs:
                self.buffers.detach(b)
            return [], [False] * len(keys)
        return bufs, list(res.ok)

    def _load(self, job: LoadJob) -> tuple[int, bool]:
        """``(blocks loaded, window loaded)``: a prefix of the job's blocks, then its window."""
        good, events = 0, []
        window_ok = job.window is None
        t0 = time.perf_counter()
        try:
            if job.unmatched:  # an admission kvstack could not match (update_state_after_alloc)
                return 0, job.window is None
            layout = self._entry_layout(len(self._full_layers))
            step, par = self.opts.load_batch_blocks, self.opts.load_parallel
            chunks = [job.blocks[lo:lo + step] for lo in range(0, len(job.blocks), step)]
            failed = False
            for w0 in range(0, len(chunks), par):  # ``par`` store reads at once, scattered in order
                wave = chunks[w0:w0 + par]
                futs = [self._reads.submit(self._read, self._hasher.keys_for_engine_hashes([b.hash for b in c]),
                                           "block", self._full_nbytes, layout) for c in wave]
                results = [f.result() for f in futs]  # each bounded by the gateway's timeout
                try:
                    for chunk, (bufs, ok) in zip(wave, results):
                        done = 0
                        for bl, buf, fine in zip(chunk, bufs, ok):
                            if not fine:
                                break
                            self._scatter(buf, self._ids_by_layer(self.plan.full, bl.block_ids), events)
                            done += 1
                        good += done
                        if done < len(chunk):  # a prefix only: vLLM recomputes from the first bad block
                            failed = True
                            break
                    for ev in events:
                        self.backend.sync_event(ev)
                    events.clear()
                finally:
                    for bufs, _ in results:
                        for b in bufs:
                            self.buffers.release(b)
                if failed:
                    break
            if good == len(job.blocks) and job.window is not None:
                w = job.window
                rows = len(w.block_ids)
                nbytes = rows * self._window_row_nbytes
                bufs, ok = self._read([self._key(w.hash)], "swa", nbytes, self._entry_layout(len(self._window_layers), rows))
                try:
                    if ok and ok[0]:
                        pairs = [p for row in w.block_ids for p in self._ids_by_layer(self.plan.window, row)]
                        self._scatter(bufs[0], pairs, events)
                        for ev in events:
                            self.backend.sync_event(ev)
                        window_ok = True
                finally:
                    for b in bufs:
                        self.buffers.release(b)
        finally:
            for ev in events:  # copies started must end before the blocks are handed back
                self.backend.sync_event(ev)
        self.metrics.inc("load_seconds", time.perf_counter() - t0)
        self.metrics.inc("loaded_blocks", good)
        self.metrics.inc("bytes_loaded", good * self._full_nbytes
                         + (len(job.window.block_ids) * self._window_row_nbytes if job.window and window_ok else 0))
        return good, window_ok

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        out = KVConnectorTransferResults()
        for rid, (job, fut) in list(self._jobs.items()):
            if job.sync:
                cf.wait([fut])  # normally already waited for by the forward's first layer
            elif not fut.done():
                continue
            del self._jobs[rid]
            if not job.sync:
                out.finished_recving.add(rid)
            try:
                good, window_ok = fut.result()
            except Exception:  # noqa: BLE001 - a bug in the load path: logged, and the request recomputes
                log.exception("kvstack load of request %s raised; it is recomputed", rid)
                good, window_ok = 0, False
            if good < len(job.blocks) or not window_ok:
                self.metrics.inc("load_errors")
                if len(self.plan.groups) == 1 and window_ok:  # one group: recompute from the first bad block
                    for bl in job.blocks[good:]:
                        self._invalid.update(bl.block_ids)
                else:  # block ids are per group: only the whole request can be named
                    out.failed_recving.add(rid)
        # vLLM: a finished_sending id must be in this call's finished_req_ids or an earlier one's;
        # a finishing snapshot is copied in the step whose finished_req_ids names its request.
        seen = finished_req_ids | self._last_finished
        done = self._finishing_copied & seen
        self._finishing_copied -= done
        self._last_finished = set(finished_req_ids)
        out.finished_sending |= done
        self._maybe_report()
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid = self._invalid, set()
        return out

    # ============================================================ both sides
    def get_kv_connector_stats(self) -> KvstackConnectorStats | None:
        snap = self.metrics.snapshot()
        delta = {k: v - self._reported.get(k, 0) for k, v in snap.items() if v != self._reported.get(k, 0)}
        self._reported = snap
        return KvstackConnectorStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvstackConnectorStats:
        return KvstackConnectorStats(data=dict(data or {}))

    def _maybe_report(self) -> None:
        """The counters to ``stats_file`` (when set, on every change) and to the log (every 30 s)."""
        snap = self.metrics.snapshot()
        if self.opts.stats_file and snap != self._written:
            path = f"{self.opts.stats_file}.{self.role.name.lower()}.{os.getpid()}.json"
            tmp = path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(snap, f)
            os.replace(tmp, path)
            self._written = snap
        now = time.monotonic()
        if now - self._last_log >= _LOG_EVERY_S and snap:
            self._last_log = now
            log.info("kvstack connector %s counters: %s", self.role.name.lower(), snap)

    def shutdown(self) -> None:
        if self.saves is not None:
            self.saves.close()
            self._loader.shutdown(wait=True)
            self._reads.shutdown(wait=True)
        self._maybe_report()
        log.info("kvstack connector %s counters at shutdown: %s", self.role.name.lower(), self.metrics.snapshot())
        self.gateway.close()
        _SHARED_STORES.release(self.store)
