"""What the vLLM binding stores, derived from vLLM's KV cache config: no vLLM import here.

Who calls it: ``engine_plugin.vllm`` (both roles, at construction and in
``register_kv_caches``); tests build these records directly.

Contract
--------
* ``ConnectorOptions.parse(extra)`` turns ``kv_connector_extra_config`` into a
  checked record: an unknown key or a bad value raises ``InvalidRequest``
  naming it, so a typo fails at engine start, never silently.
* ``GroupPlan`` sorts vLLM's KV cache groups into the two kinds kvstack can
  restore exactly (``GROUP_KINDS``, a registry keyed by the spec's class name):

      =========  ==========================  ==================================
      kind       vLLM spec                   stored as
      =========  ==========================  ==================================
      full       FullAttentionSpec, MLA      one *block* entry per block: that
                                             block of every full layer
      window     SlidingWindowSpec           one *swa* entry per boundary H:
                                             the blocks holding the window that
                                             the token at H attends to
      =========  ==========================  ==================================

  Any other group kind (Mamba, chunked-local, ...) is refused at start with
  ``InvalidRequest``: its state cannot be restored exactly from these entries.
* ``namespace_id`` digests everything that changes the KV bytes of a block
  (model, its weights (``weights_id``: revision, quantization, dtype and
  configuration), cache dtype, block size, device type, the attention layout,
  TP rank and size, each group's kind, window and layers), so engines whose
  bytes differ never share a key (vLLM's block hashes cover only tokens, salt,
  LoRA and multimodal inputs). The worker also checks each entry's recorded
  layout (dtype and shape) on load: an entry of another physical layout is a
  miss, never loaded.

Window arithmetic (vLLM's ``SlidingWindowManager``): after ``H`` computed tokens
the next token attends to ``[H - W + 1, H]``, so the blocks ``first_window_block(H)
.. H // B - 1`` hold every key it reads. A snapshot at ``H`` stores exactly those.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from kvstore.errors import InvalidRequest


class GroupKind(enum.Enum):
    FULL = "full"
    WINDOW = "window"


# vLLM spec class name -> how its group is stored. Exact names: a subclass (e.g. RSWASpec,
# a FullAttentionSpec with other retention) is not assumed to behave like its base.
GROUP_KINDS: dict[str, GroupKind] = {
    "FullAttentionSpec": GroupKind.FULL,
    "MLAAttentionSpec": GroupKind.FULL,
    "SlidingWindowSpec": GroupKind.WINDOW,
    "SlidingWindowMLASpec": GroupKind.WINDOW,
}


@dataclass(frozen=True, slots=True)
class GroupInfo:
    index: int  # vLLM's group index (block ids come per group in this order)
    kind: GroupKind
    layer_names: tuple[str, ...]
    window: int = 0  # sliding window in tokens (WINDOW groups)


def first_window_block(boundary: int, window: int, block_size: int) -> int:
    """First block the token at ``boundary`` attends to in a ``window``-token sliding layer."""
    return max(0, boundary - window + 1) // block_size


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """vLLM's KV cache groups sorted by ``GROUP_KINDS``; block ids of a request come as one
    list per group, indexed by ``GroupInfo.index``."""

    block_size: int
    groups: tuple[GroupInfo, ...]

    @classmethod
    def from_kv_cache_config(cls, kv_cache_config: Any, block_size: int) -> "GroupPlan":
        out = []
        for i, g in enumerate(kv_cache_config.kv_cache_groups):
            spec = g.kv_cache_spec
            name = type(spec).__name__
            kind = GROUP_KINDS.get(name)
            if kind is None:
                raise InvalidRequest(
                    f"KvstackConnector cannot restore KV cache group {i} ({name}: layers "
                    f"{list(g.layer_names)[:4]}...) exactly; supported group kinds: {sorted(GROUP_KINDS)}")
            if spec.block_size != block_size:
                raise InvalidRequest(f"KV cache group {i} has block size {spec.block_size}, the scheduler "
                                     f"{block_size}: KvstackConnector needs one block size for every group")
            window = int(getattr(spec, "sliding_window", 0) or 0) if kind is GroupKind.WINDOW else 0
            out.append(GroupInfo(i, kind, tuple(sorted(g.layer_names)), window))
        return cls(block_size, tuple(out))

    def of_kind(self, kind: GroupKind) -> tuple[GroupInfo, ...]:
        return tuple(g for g in self.groups if g.kind is kind)

    @property
    def full(self) -> tuple[GroupInfo, ...]:
        return self.of_kind(GroupKind.FULL)

    @property
    def window(self) -> tuple[GroupInfo, ...]:
        return self.of_kind(GroupKind.WINDOW)

    def first_window_block(self, boundary: int) -> int:
        """First block of a snapshot at ``boundary``: the widest window group decides."""
        return min((first_window_block(boundary, g.window, self.block_size) for g in self.window),
                   default=boundary // self.block_size)

    def describe(self) -> str:
        return ";".join(f"g{g.index}:{g.kind.value}:w{g.window}:{','.join(g.layer_names)}" for g in self.groups)


def weights_id(model_config: Any) -> str:
    """What besides the model's name decides the KV its engine computes, from vLLM's
    ``ModelConfig``: the weights' revision and quantization, the model dtype, and the model's
    configuration as loaded (``hf_config``, overrides such as rope scaling applied; without
    it, the overrides as given). Stable across processes of one deployment."""
    parts = [str(getattr(model_config, name, None)) for name in ("revision", "quantization", "dtype")]
    hf = getattr(model_config, "hf_config", None)
    if hf is not None and hasattr(hf, "to_dict"):
        conf = {k: v for k, v in hf.to_dict().items() if k != "_name_or_path"}  # where it was loaded from: not what
        parts.append(json.dumps(conf, sort_keys=True, default=str))
    else:
        over = getattr(model_config, "hf_overrides", None)
        if callable(over):  # a function's repr names its address: its name instead
            parts.append(f"{getattr(over, '__module__', '')}.{getattr(over, '__qualname__', '')}")
        elif over:
            parts.append(json.dumps(over, sort_keys=True, default=str))
    return hashlib.blake2b("|".join(parts).encode(), digest_size=16).hexdigest()


def namespace_id(*, model: str, weights: str, cache_dtype: str, block_size: int, device: str, attn_layout: str,
                 tp_rank: int, tp_size: int, plan: GroupPlan) -> str:
    """The ``Namespace.kv_layout`` string of a vLLM engine (module docstring): short, stable,
    and different for anything that changes a block's bytes (``weights``: ``weights_id``)."""
    desc = "|".join([model, weights, cache_dtype, str(block_size), device, attn_layout, f"{tp_rank}/{tp_size}",
                     plan.describe()])
    return f"vllm-{device}-{attn_layout}-tp{tp_size}-" + hashlib.blake2b(desc.encode(), digest_size=8).hexdigest()


def _num(name: str, v: Any, *, low: float, integer: bool = False, allow_none: bool = False) -> Any:
    if v is None and allow_none:
        return None
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and v >= low
    if integer:
        ok = ok and float(v).is_integer()
    if not ok:
        raise InvalidRequest(f"kv_connector_extra_config.{name} must be a {'whole ' if integer else ''}number "
                             f">= {low}{' or null' if allow_none else ''}, got {v!r}")
    return int(v) if integer else float(v)


@dataclass(frozen=True, slots=True)
class ConnectorOptions:
    """``kv_connector_extra_config`` of ``KvstackConnector`` (README, engine teams)."""

    store_url: str
    token_file: str | None = None  # bearer token for a daemon that requires one (else KVSTORE_TOKEN)
    direct_reads: str = "off"  # kvstore.connect's direct_reads: off | on | auto
    model_id: str | None = None  # namespace model name; default: vLLM's model name or path
    ttl_s: float | None = None
    lookup_timeout_s: float = 1.0  # scheduler side: a slower store gives 0 hit tokens
    load_timeout_s: float = 30.0  # worker side, per store read (async: off the step's path)
    put_timeout_s: float = 30.0
    backoff_s: float = 5.0  # a failed store is skipped this long
    load_mode: str = "auto"  # auto | sync | async (engine_plugin.vllm: how a hit is loaded)
    save_queue_depth: int = 64
    load_batch_blocks: int = 64
    load_parallel: int = 2  # store reads of one load running at once
    snapshot_interval_blocks: int = 0  # window snapshots every N blocks of a prompt (0: none)
    snapshot_end_of_output: bool = True
    stats_file: str | None = None  # JSON of the counters, rewritten by each role as they change
    extra: Mapping[str, Any] = field(default_factory=dict)  # passed to kvstore.connect as is

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> "ConnectorOptions":
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidRequest(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        url = extra.get("store_url")
        if not isinstance(url, str) or not url.strip():
            raise InvalidRequest("kv_connector_extra_config.store_url is required: a data directory, "
                                 "grpc://HOST:PORT, grpcs://HOST:PORT or a comma list of daemons")
        if extra.get("load_mode", "auto") not in ("auto", "sync", "async"):
            raise InvalidRequest(f"kv_connector_extra_config.load_mode is auto, sync or async, "
                                 f"got {extra['load_mode']!r}")
        if extra.get("direct_reads", "off") not in ("off", "on", "auto"):
            raise InvalidRequest(f"kv_connector_extra_config.direct_reads is off, on or auto, "
                                 f"got {extra['direct_reads']!r}")
        for name in ("token_file", "model_id", "stats_file"):
            if extra.get(name) is not None and not isinstance(extra[name], str):
                raise InvalidRequest(f"kv_connector_extra_config.{name} must be a string")
        if not isinstance(extra.get("snapshot_end_of_output", True), bool):
            raise InvalidRequest("kv_connector_extra_config.snapshot_end_of_output must be true or false")
        if not isinstance(extra.get("extra", {}), Mapping):
            raise InvalidRequest("kv_connector_extra_config.extra must be an object")
        for name, low, integer, none in (("ttl_s", 1e-9, False, True), ("lookup_timeout_s", 1e-9, False, False),
                                         ("load_timeout_s", 1e-9, False, False),
                                         ("put_timeout_s", 1e-9, False, False), ("backoff_s", 0, False, False),
                                         ("save_queue_depth", 1, True, False), ("load_batch_blocks", 1, True, False),
                                         ("load_parallel", 1, True, False),
                                         ("snapshot_interval_blocks", 0, True, False)):
            if name in extra:
                extra[name] = _num(name, extra[name], low=low, integer=integer, allow_none=none)
        return cls(**extra)
