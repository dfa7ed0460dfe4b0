"""Configuration of the reference model and engine.

``ModelConfig`` fixes the architecture (and therefore the KV layout the store
persists); ``EngineConfig`` fixes the runtime (pool size, chunking, batching).
Both are frozen: a running engine never changes shape. Named presets live in
``MODEL_PRESETS`` (a registry: add a row, do not add an ``if``).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields, replace

from kvstore.errors import InvalidRequest
from kvstore.keys import Namespace

#: Dtype names a reference model may run in (``model.TORCH_DTYPES`` maps each to torch).
MODEL_DTYPES: tuple[str, ...] = ("float32", "float64", "bfloat16", "float16")

# Fields of ``ModelConfig`` that change neither the weights nor the KV: left out of ``model_id``
# (``name`` is its readable prefix instead).
_ID_EXEMPT = frozenset({"name"})


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A hybrid stack in the shape of DeepSeek V4.1 (see ``model.py``).

    Invariants (checked in ``__post_init__``; misuse raises ``InvalidRequest``):
      1. ``window >= 1``: a sliding window sees at least the current token.
      2. ``d_rope`` is even: RoPE rotates pairs of channels.
      3. ``n_swa_layers >= 1`` and ``n_cross_layers >= 1``: the global KV is
         produced by the first stack and consumed by the second.
      4. sizes are positive ints (``d_rope`` may be 0), ``rope_theta`` and
         ``init_std`` positive finite numbers, ``dtype`` one of ``MODEL_DTYPES``.
      5. ``model_id`` covers every field but ``name`` (see there): two configs
         whose weights or KV differ never share cache keys.
    """

    vocab_size: int = 128
    d_model: int = 64
    n_heads: int = 4
    head_dim: int = 16
    n_swa_layers: int = 2  # L1: sliding-window layers that produce the global KV
    n_cross_layers: int = 2  # L2: window self-attention + full attention over global KV
    window: int = 8  # W: a position attends to itself and the W-1 before it
    d_latent: int = 24  # global KV part used as key and value (MLA-style latent)
    d_rope: int = 8  # global KV part that carries RoPE (key only)
    d_ff: int = 128
    rope_theta: float = 10000.0
    init_std: float = 0.15
    seed: int = 0
    dtype: str = "float32"
    name: str = "kvstack-ref"

    def __post_init__(self) -> None:
        for f in ("vocab_size", "d_model", "n_heads", "head_dim", "n_swa_layers", "n_cross_layers",
                  "window", "d_latent", "d_rope", "d_ff", "seed"):
            v = getattr(self, f)
            if not _is_int(v) or v < (0 if f in ("d_rope", "seed") else 1):
                raise InvalidRequest(f"ModelConfig.{f} must be an int >= {0 if f in ('d_rope', 'seed') else 1}, "
                                     f"got {v!r}")
        for f in ("rope_theta", "init_std"):
            v = getattr(self, f)
            if not _is_real(v) or v <= 0:
                raise InvalidRequest(f"ModelConfig.{f} must be a finite number > 0, got {v!r}")
            object.__setattr__(self, f, float(v))  # 10000 and 10000.0 are one config (and one model_id)
        if self.dtype not in MODEL_DTYPES:
            raise InvalidRequest(f"ModelConfig.dtype {self.dtype!r} is not supported; use one of {MODEL_DTYPES}")
        if not isinstance(self.name, str) or not self.name:
            raise InvalidRequest(f"ModelConfig.name must be a non-empty string, got {self.name!r}")
        if self.d_rope % 2 or self.head_dim % 2:
            raise InvalidRequest("d_rope and head_dim must be even (RoPE rotates channel pairs)")
        if self.n_swa_layers < 1 or self.n_cross_layers < 1:
            raise InvalidRequest("the reference model needs n_swa_layers >= 1 and n_cross_layers >= 1")

    @property
    def d_global(self) -> int:
        """Width of the per-token global KV vector the store persists (``d_g``)."""
        return self.d_latent + self.d_rope

    @property
    def n_layers(self) -> int:
        return self.n_swa_layers + self.n_cross_layers

    def namespace(self, rank: int = 0) -> Namespace:
        """The store key namespace of this model's global KV (the entrypoint hashes with it too)."""
        return Namespace(model_id=self.model_id, kv_layout=f"global-d{self.d_global}", dtype=self.dtype,
                         rank=rank)

    @property
    def model_id(self) -> str:
        """Identity used in the key namespace: every field that changes the weights or the KV.

        A readable prefix (name, main sizes, seed) plus a digest of *all* fields but ``name``
        (``_ID_EXEMPT``), so a field added later is covered without anyone remembering to
        add it here: ``init_std``, ``d_ff``, ``rope_theta`` or the ``d_latent``/``d_rope``
        split change the weights or the stored KV while leaving the readable part unchanged,
        and two models that share a namespace load each other's KV.
        """
        canon = ";".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                         if f.name not in _ID_EXEMPT)
        digest = hashlib.blake2b(canon.encode(), digest_size=8).hexdigest()
        return (f"{self.name}-v{self.vocab_size}-d{self.d_model}-h{self.n_heads}x{self.head_dim}"
                f"-L{self.n_swa_layers}+{self.n_cross_layers}-W{self.window}-g{self.d_global}"
                f"-s{self.seed}-{digest}")


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Unit tests: fast, window small enough that replay spans cross blocks of 16.
    "tiny": ModelConfig(),
    # Benchmarks: V4.1-like window of 128; wide enough that prefill is compute-bound.
    "bench": ModelConfig(vocab_size=1024, d_model=256, n_heads=4, head_dim=64, n_swa_layers=2,
                         n_cross_layers=2, window=128, d_latent=112, d_rope=16, d_ff=512,
                         init_std=0.08),
}


def model_preset(name: str, /, **overrides) -> ModelConfig:
    """The preset ``name`` with ``overrides`` (``ModelConfig`` fields) applied.

    ``name`` is positional-only, so ``model_preset("tiny", name="mine")`` overrides
    ``ModelConfig.name``. An unknown preset, an unknown field or a bad value raises
    ``InvalidRequest`` naming it.
    """
    try:
        base = MODEL_PRESETS[name]
    except (KeyError, TypeError):
        raise InvalidRequest(f"unknown model preset {name!r}; known: {sorted(MODEL_PRESETS)}") from None
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise InvalidRequest(f"unknown ModelConfig field(s) {unknown}; known: {sorted(known)}")
    return replace(base, **overrides)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Runtime knobs of the reference engine.

    ``block_size`` must equal the store's block size (the hasher's), because a
    paged block is exactly one store block entry.
    """

    block_size: int = 16
    num_blocks: int = 256  # device pool size (blocks of global KV)
    chunk_size: int = 64  # max prefill tokens of one request per step
    max_batched_tokens: int = 256  # token budget of one step across requests
    max_running: int = 8  # requests running at once
    device: str = "cpu"  # a key of engine_plugin.devices.BACKENDS
    tenant_salt: bytes = b""
    sync_timing: bool = False  # synchronize the device around replays so replay_s is exact

    def __post_init__(self) -> None:
        for f in ("block_size", "num_blocks", "chunk_size", "max_batched_tokens", "max_running"):
            v = getattr(self, f)
            if not _is_int(v) or v < 1:
                raise InvalidRequest(f"EngineConfig.{f} must be a positive int, got {v!r}")
        if not isinstance(self.tenant_salt, bytes):
            raise InvalidRequest(f"EngineConfig.tenant_salt must be bytes, got {type(self.tenant_salt).__name__}")
