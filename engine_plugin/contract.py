"""The connector contract between an engine and the KV cache (shaped like vLLM's v1 KV connector).

An engine that knows vLLM's ``KVConnectorBase_V1`` knows this one. The
connector has two halves that may live in different processes; in the
reference engine both run in one process, but they only talk through
``ConnectorMetadata`` built by the scheduler half and bound on the worker half.

One engine step, in call order::

    admit:   get_num_new_matched_tokens -> (engine allocates) -> update_state_after_alloc
             -> restore_plan, snapshot_boundaries
    step:    build_connector_meta -> bind_connector_metadata -> start_load_kv
             -> [forward: wait_for_layer_load("swa.<i>" / "global") per group]
             -> get_load_errors -> save_kv_layer("global") -> save_kv_layer("swa")
             -> wait_for_save -> clear_connector_metadata -> get_finished
    finish:  request_finished (then the engine frees the blocks)

What the connector knows about the model is a ``KVLayout`` (global KV width,
dtype, snapshot shape, replay spans); it never imports the model.

Scheduler side (called by the scheduler, on the engine's main thread)
---------------------------------------------------------------------
``get_num_new_matched_tokens(request, num_computed_tokens) -> (int, bool)``
    When: before a waiting request is admitted, after the engine matched its
    own device prefix cache (``num_computed_tokens`` tokens, block-aligned).
    How often: possibly several times for the same request (it may not fit and
    be retried next step). Guarantees: no externally visible side effect (it
    may cache its answer per request); returns how many tokens *beyond*
    ``num_computed_tokens`` the connector can supply (block-aligned, never the
    whole prompt: at least one prompt token is left to compute) and whether the
    load is asynchronous (always ``False`` here: loads are layer-wise inside
    the step that first computes the request). A store that is down, slow or
    lost gives 0 (a shortfall, logged and counted), never an exception.
``update_state_after_alloc(request, block_ids, num_external_tokens)``
    When: once, right after the engine allocated the request's blocks.
    Guarantees: records which pool blocks the external tokens go into; with
    ``num_external_tokens == 0`` any cached plan for the request is dropped.
``restore_plan(request) -> RestorePlan`` (hybrid-model extension)
    When: after ``update_state_after_alloc``. Says how the sliding windows at
    the hit boundary are rebuilt: from a snapshot, or by replaying a bounded
    span. Side-effect free.
``snapshot_boundaries(request) -> set[int]`` (hybrid-model extension)
    Token positions (multiples of the block size) where the engine must hand
    a window snapshot to ``save_kv_layer("swa", ...)``; the scheduler ends
    prefill chunks there. Side-effect free.
``build_connector_meta(scheduler_output) -> ConnectorMetadata``
    When: once per engine step, after scheduling. Guarantees: the metadata
    names every load (request, pool blocks, tier) and every save (completed
    blocks not already cached) of this step; it resets the per-step state.
``request_finished(request, block_ids) -> (bool, dict | None)``
    When: once per request, when it finishes, before its blocks are freed.
    Returns whether the connector needs the blocks kept (``True``: free only
    after ``get_finished`` reports the request) and transfer params for a
    decode engine (P/D handoff). Saves the end-of-output window snapshot.
``request_aborted(request)``
    When: instead of ``request_finished``, for a request the engine drops
    (``Engine.abort_request``, e.g. after a step raised), before its blocks
    are freed; possibly mid-step. Guarantees: on return nothing of the
    connector still writes into the request's blocks or window, and nothing
    more is saved for it; the connector forgets it. Idempotent.

Declared attributes (checked by the engine at construction)
-----------------------------------------------------------
``block_size`` and ``layout`` (a ``KVLayout``): the block size and KV layout
the connector moves. The engine refuses (``InvalidRequest``) a connector
whose values differ from its own; ``None`` means "not declared".
``namespace_tag``: what the KV the engine computes depends on beyond the model
(``""``: nothing). A connector whose restores are approximate (a replay span
shorter than exact) declares one, and the engine folds it into its namespace, so
that KV computed after such a replay never meets exact KV in a shared store.

Lifetime: ``close()`` drains and stops; a second ``close()`` does nothing.
A connector used after ``close()`` raises ``kvstore.errors.StoreClosed``.

Worker side (called by the model runner during a step)
------------------------------------------------------
``bind_connector_metadata(meta)`` / ``clear_connector_metadata()``
    Around each step's forward passes.
``start_load_kv(forward_context)``
    When: once per step, before the first forward pass. Guarantees: returns
    at once; reads (tiers, store) and host-to-device copies run on a side
    thread and a side stream.
``wait_for_layer_load(layer_name)``
    When: before each layer group is used (``"swa.<i>"`` before layer i,
    ``"global"`` before the first layer that reads global KV). Guarantees: on
    return, every load of that group in this step has finished and is ordered
    before the compute stream's next kernel. It is bounded in time: every
    store call under it has a timeout (one exception, by choice: a read that
    writes straight into the engine's blocks on a host-resident backend is
    waited for past its timeout rather than left writing into blocks the
    engine recomputes; ``engine_plugin.loader``). It never raises for a failed
    load; a failed load is reported by ``get_load_errors``.
``get_load_errors() -> dict[str, LoadError]`` (vLLM: ``get_block_ids_with_load_errors``)
    When: after the step's forward passes, before any output is committed.
    Requests listed here computed with incomplete KV; the engine discards
    that step's results and recomputes from ``valid_tokens`` (a bounded
    replay then rebuilds the windows). Bad KV is never committed or saved.
    Never raises: a load that raised is reported here like any failed load,
    and is reported once (a later step does not see it again).
``save_kv_layer(layer_name, kv_layer, attn_metadata)``
    When: after the forward passes of a step, once per group (``"global"``
    with the paged pool, ``"swa"`` with the step's window snapshots).
    Guarantees: starts device-to-host copies on a side stream and enqueues
    store puts on a bounded background queue; never waits on the store (a
    full queue drops the save, counted, rather than stalling the forward).
``wait_for_save()``
    When: at the end of each step. Guarantees: on return the step's
    device-to-host copies are complete, so the pool blocks may be reused.
``get_finished(finished_req_ids) -> (sending_done, receiving_done)``
    When: once per step. Request ids whose asynchronous saves (sending) or
    loads (receiving) have completed since the last call, each reported once.
    A request is in ``sending_done`` once all its saves *ended*, whether they
    reached the store or not (as vLLM's ``finished_sending``): an engine that
    holds blocks for it (``request_finished`` returned ``True``) frees them
    then, so a failed save never leaks blocks. An id added again after its
    request finished (no abort between) is another request: each is reported
    once its own saves ended, an id's requests in the order they finished, at
    most one of them per call (the engine pairs a report with the id's oldest).
``get_failed_sends() -> set[str]``
    When: right after ``get_finished``. Those of the requests it just reported
    in ``sending_done`` with a save that did not reach the store (failed,
    dropped, skipped), or whose KV the connector does not send at all (no
    store; a write-back policy): their KV is not all in the store, so a decode
    engine must not be told it is (``Engine.kv_sent`` leaves them out and records
    them in ``kv_send_failed``). Side-effect free. Default: none.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from kvstore.api import DTYPES
from kvstore.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class KVLayout:
    """What a connector moves for one model, independent of the model's code.

    The engine exposes it (``ReferenceModel.kv_layout()``); the connector needs
    nothing else from the model. ``block_shape`` is one block entry
    (``[block_size, d_global]``), ``snapshot_shape`` one SWA window snapshot,
    ``replay_spans`` maps a replay policy name to its span in tokens.
    """

    d_global: int
    dtype: str  # a kvstore.api.DTYPES name, also the torch dtype name
    snapshot_shape: tuple[int, ...]
    replay_spans: tuple[tuple[str, int], ...]

    def __post_init__(self) -> None:
        if isinstance(self.d_global, bool) or not isinstance(self.d_global, int) or self.d_global < 1:
            raise InvalidRequest(f"KVLayout.d_global must be an int >= 1, got {self.d_global!r}")
        if self.dtype not in DTYPES:
            raise InvalidRequest(f"KVLayout.dtype {self.dtype!r} is unknown; use one of {sorted(DTYPES)}")
        shape = self.snapshot_shape
        if isinstance(shape, (list, torch.Size)):
            shape = tuple(shape)
            object.__setattr__(self, "snapshot_shape", shape)
        if (not isinstance(shape, tuple) or not shape
                or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape)):
            raise InvalidRequest(f"KVLayout.snapshot_shape must be a non-empty tuple of ints >= 0, got {shape!r}")
        for item in self.replay_spans:
            if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str)
                    or isinstance(item[1], bool) or not isinstance(item[1], int) or item[1] < 0):
                raise InvalidRequest(f"KVLayout.replay_spans holds (policy name, span >= 0) pairs, got {item!r}")

    def replay_span(self, policy: str) -> int:
        for name, span in self.replay_spans:
            if name == policy:
                return span
        raise InvalidRequest(f"unknown replay policy {policy!r}; known: {[n for n, _ in self.replay_spans]}")

    def approximate(self, policy: str) -> bool:
        """Does a replay under ``policy`` rebuild the windows only approximately? The longest
        span the layout declares is the exact one (the full receptive field); a shorter one
        is not, and so isn't the KV computed after it."""
        return self.replay_span(policy) < max(span for _, span in self.replay_spans)


class Tier(enum.Enum):
    """Where a cached block or snapshot comes from, fastest first."""

    DEVICE = "device"
    HOST = "host"
    STORE = "store"


class ConnectorRequest(Protocol):
    """What a connector reads from an engine request (the reference ``Request`` has it)."""

    request_id: str
    prompt_token_ids: list[int]
    block_hashes: list[bytes]  # prefix hashes of every full block known so far (kvstore.keys)
    block_ids: list[int]  # pool block table
    kv_transfer_params: dict | None


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """How a request's state at the hit boundary ``hit_tokens`` is rebuilt.

    ``replay_start is None`` means the windows come from a snapshot loaded
    with the global KV (or ``hit_tokens == 0``: nothing to rebuild). Otherwise
    tokens ``[replay_start, hit_tokens)`` are replayed (windows only).
    """

    hit_tokens: int
    replay_start: int | None
    snapshot_tier: Tier | None = None

    @property
    def needs_replay(self) -> bool:
        return self.replay_start is not None and self.replay_start < self.hit_tokens


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """One request's work in a step: tokens ``[start, start + num_tokens)``."""

    request_id: str
    start: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    new_request_ids: tuple[str, ...] = ()
    finished_request_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BlockLoad:
    block_index: int  # position of the block in the request (tokens [i*B, (i+1)*B))
    block_id: int  # destination pool block
    key: bytes
    tier: Tier


@dataclass(frozen=True, slots=True)
class LoadSpec:
    request_id: str
    blocks: tuple[BlockLoad, ...]
    first_block: int  # index of blocks[0]; blocks are consecutive
    snapshot_key: bytes | None = None  # SWA snapshot at the hit boundary, if loaded
    snapshot_tier: Tier | None = None


@dataclass(frozen=True, slots=True)
class BlockSave:
    request_id: str
    block_index: int
    block_id: int
    key: bytes


@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[BlockSave, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadError:
    """A load that did not deliver: positions ``[0, valid_tokens)`` are good.

    ``window_ok`` is False when the windows at the boundary are not usable
    (the snapshot failed, or the boundary moved), so a replay must rebuild them.
    """

    valid_tokens: int
    window_ok: bool
    reason: str


@dataclass(frozen=True, slots=True)
class WindowSnapshot:
    """A window state handed to ``save_kv_layer("swa", ...)``."""

    request_id: str
    boundary: int  # token position (a multiple of the block size)
    key: bytes  # block hash of block boundary/B - 1
    window: torch.Tensor  # [n_layers, 2, W-1, n_heads, head_dim]


@dataclass(slots=True)
class ForwardContext:
    """What ``start_load_kv`` may touch: the pool and the requests' window buffers."""

    kv_pool: torch.Tensor  # [num_blocks, block_size, d_global]
    windows: dict[str, torch.Tensor] = field(default_factory=dict)  # request id -> window buffer


class KVConnectorBase(abc.ABC):
    """The contract; see the module docstring for when each hook runs and what it guarantees."""

    #: What the engine checks at construction (module docstring); ``None``: not declared.
    block_size: int | None = None
    layout: KVLayout | None = None
    namespace_tag: str = ""

    # ---- scheduler side
    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_computed_tokens: int) -> tuple[int, bool]: ...

    @abc.abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_external_tokens: int) -> None: ...

    @abc.abstractmethod
    def restore_plan(self, request: ConnectorRequest) -> RestorePlan: ...

    @abc.abstractmethod
    def snapshot_boundaries(self, request: ConnectorRequest) -> set[int]: ...

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata: ...

    @abc.abstractmethod
    def request_finished(self, request: ConnectorRequest,
                         block_ids: Sequence[int]) -> tuple[bool, dict | None]: ...

    # ---- worker side
    def bind_connector_metadata(self, meta: ConnectorMetadata) -> None:
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = ConnectorMetadata()

    @abc.abstractmethod
    def start_load_kv(self, forward_context: ForwardContext) -> None: ...

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_name: str) -> None: ...

    @abc.abstractmethod
    def get_load_errors(self) -> dict[str, LoadError]: ...

    @abc.abstractmethod
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None: ...

    @abc.abstractmethod
    def wait_for_save(self) -> None: ...

    @abc.abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]: ...

    def get_failed_sends(self) -> set[str]:
        """See the module docstring: of the last ``get_finished``'s ``sending_done``, those whose
        KV did not all reach the store. Default: none."""
        return set()

    def request_aborted(self, request: ConnectorRequest) -> None:
        """The engine drops ``request`` (see the module docstring). Default: nothing to forget."""

    def on_device_evict(self, key: bytes, block: torch.Tensor) -> None:
        """The engine's pool evicts a cached block (content still intact). Default: drop it."""

    def close(self) -> None:
        """Drain background work and release buffers."""
