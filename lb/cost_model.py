"""Cost models the load balancers use to turn tokens and bytes into seconds.

Role
    * :class:`PrefillCostModel` predicts the wall time of one prefill that
      computes ``suffix`` new tokens on top of ``cached`` tokens of context.
    * :class:`DecodeCostModel` predicts one decode step (TBT) from the batch.
    * :class:`TransferModel` predicts loading cached KV from a tier.

    Policies (``lb.prefill``, ``lb.decode``, ``lb.baselines``) and the trace
    simulator (``lb.sim``) call ``predict``; ``tools/fit_cost_model.py``
    calls ``fit`` on measured samples and writes ``lb/data/cost_model.json``;
    :func:`load_default` reads that file. All are pure and numpy-only.

Prefill features (least squares on relative error, coefficients >= 0)::

    t = c_const + c_tok * suffix + c_attn * (suffix * cached + suffix**2 / 2)

``suffix * cached + suffix**2 / 2`` is the number of (query, key) pairs of
causal attention over the suffix: the quadratic term. Linear layers are the
``suffix`` term; launch/scheduling overhead is the constant.

Decode features: ``t = c_const + c_tok * batch_tokens + c_req * batch_requests``
(attention reads every cached token once per step; per-request work is the
MLP/projection of the one new token).

Guarantees
    ``predict`` is monotone non-decreasing in every argument (coefficients
    are non-negative), returns 0 for zero work except the constant, and
    never raises on valid (non-negative) input.

Validation (every construction: a fit, ``from_json``, a caller): a model that
can not describe a machine is refused with ``LBInputError`` naming the field.
Coefficients are finite real numbers >= 0 (not NaN, inf, a JSON ``true``);
work costs time (a prefill has a per-token or attention cost, a decode step
some cost: an all-zero model has infinite throughput); a prediction for
:data:`SANE_MAX_TOKENS` tokens is finite; ``r2`` is a number <= 1 (NaN: not
fitted); ``kv_bytes_per_token`` > 0 and ``block_tokens`` an integer > 0.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from lb.types import BLOCK_TOKENS, LBInputError, TierBandwidth

__all__ = [
    "PrefillCostModel",
    "DecodeCostModel",
    "TransferModel",
    "CostModels",
    "DEFAULT_PATH",
    "load_default",
    "nonneg_lstsq",
    "SANE_MAX_TOKENS",
]

log = logging.getLogger(__name__)

DEFAULT_PATH = Path(__file__).with_name("data") / "cost_model.json"
SANE_MAX_TOKENS = 10_000_000  # a prompt (prefill) or a batch (decode) any model must predict finitely


def nonneg_lstsq(x: np.ndarray, y: np.ndarray, *, relative: bool = True) -> tuple[np.ndarray, float]:
    """Least squares with coefficients forced >= 0 (active-set: drop negatives, refit).

    ``relative`` minimises the squared *relative* error (rows weighted by
    ``1 / y``): timings span orders of magnitude and a short prefill
    mispredicted by 2x matters as much as a long one. Returns (coefficients,
    r2 of the unweighted fit). Small problems only (a handful of features).
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise LBInputError(f"fit expects X [n, k] and y [n]; got {x.shape} and {y.shape}")
    if x.shape[0] < x.shape[1]:
        raise LBInputError(f"fit needs at least {x.shape[1]} samples, got {x.shape[0]}")
    wt = 1.0 / np.maximum(y, 1e-12) if relative else np.ones_like(y)
    xw, yw = x * wt[:, None], y * wt
    active = np.ones(x.shape[1], dtype=bool)
    coef = np.zeros(x.shape[1])
    for _ in range(x.shape[1]):
        sol, *_ = np.linalg.lstsq(xw[:, active], yw, rcond=None)
        coef[:] = 0.0
        coef[active] = sol
        if (sol >= 0).all():
            break
        active[np.flatnonzero(active)[sol < 0]] = False
        if not active.any():
            break
    coef = np.clip(coef, 0.0, None)
    resid = y - x @ coef
    ss_tot = float(((y - y.mean()) ** 2).sum()) or 1.0
    return coef, 1.0 - float((resid**2).sum()) / ss_tot


def _all_nonneg(*values: float) -> bool:
    """All real numbers (not bool), finite and >= 0 (a NaN coefficient would pass a bare ``< 0`` check)."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in values)


def _check_model(name: str, coefs: tuple, r2: float, work: tuple, big: float) -> None:
    """The shared checks of the module doc's *Validation*; ``work`` are the coefficients that make work
    cost time (one must be > 0), ``big`` the prediction for :data:`SANE_MAX_TOKENS` tokens."""
    if not _all_nonneg(*coefs):
        raise LBInputError(f"{name} coefficients must be finite numbers >= 0, got {coefs}")
    if not any(v > 0 for v in work):
        raise LBInputError(f"{name} predicts no time for any work (coefficients {coefs}): infinite throughput")
    if not math.isfinite(big):
        raise LBInputError(f"{name} predicts a non-finite time for {SANE_MAX_TOKENS} tokens (coefficients {coefs})")
    if not (isinstance(r2, (int, float)) and not isinstance(r2, bool) and (math.isnan(r2) or r2 <= 1)):
        raise LBInputError(f"{name}.r2 must be a number <= 1 (NaN: not fitted), got {r2!r}")


@dataclass(frozen=True, slots=True)
class PrefillCostModel:
    """``t = const + tok * suffix + attn * (suffix*cached + suffix^2/2)`` seconds."""

    const_s: float = 2e-3
    per_token_s: float = 2e-4
    per_attn_pair_s: float = 1e-9
    r2: float = float("nan")

    def __post_init__(self) -> None:
        coefs = (self.const_s, self.per_token_s, self.per_attn_pair_s)
        big = (self.predict(SANE_MAX_TOKENS) if _all_nonneg(*coefs) else math.nan)
        _check_model("PrefillCostModel", coefs, self.r2, coefs[1:], big)

    @staticmethod
    def features(suffix: np.ndarray, cached: np.ndarray) -> np.ndarray:
        s = np.asarray(suffix, dtype=np.float64)
        c = np.asarray(cached, dtype=np.float64)
        return np.stack([np.ones_like(s), s, s * c + s * s / 2.0], axis=-1)

    @classmethod
    def fit(cls, samples: Iterable[Sequence[float]]) -> "PrefillCostModel":
        """Fit on ``(prompt_tokens, cached_tokens, seconds)`` samples."""
        arr = np.asarray(list(samples), dtype=np.float64)
        if arr.ndim != 2 or arr.shape[1] != 3:
            raise LBInputError("PrefillCostModel.fit expects (prompt_tokens, cached_tokens, seconds) rows")
        if (arr[:, 1] > arr[:, 0]).any() or (arr < 0).any() or not np.isfinite(arr).all():
            raise LBInputError("each sample needs 0 <= cached_tokens <= prompt_tokens and seconds >= 0")
        suffix = arr[:, 0] - arr[:, 1]
        coef, r2 = nonneg_lstsq(cls.features(suffix, arr[:, 1]), arr[:, 2])
        return cls(float(coef[0]), float(coef[1]), float(coef[2]), r2)

    def predict(self, prompt_tokens: float, cached_tokens: float = 0.0) -> float:
        """Seconds to prefill ``prompt_tokens`` of which ``cached_tokens`` are already loaded."""
        suffix = max(0.0, float(prompt_tokens) - float(cached_tokens))
        if suffix == 0.0:
            return 0.0
        cached = max(0.0, float(cached_tokens))
        return self.const_s + self.per_token_s * suffix + self.per_attn_pair_s * (suffix * cached + suffix * suffix / 2.0)

    def predict_many(self, prompt_tokens: np.ndarray, cached_tokens: np.ndarray) -> np.ndarray:
        p = np.asarray(prompt_tokens, dtype=np.float64)
        c = np.asarray(cached_tokens, dtype=np.float64)
        suffix = np.clip(p - c, 0.0, None)
        t = self.features(suffix, c) @ np.array([self.const_s, self.per_token_s, self.per_attn_pair_s])
        return np.where(suffix > 0, t, 0.0)


@dataclass(frozen=True, slots=True)
class DecodeCostModel:
    """``tbt = const + tok * batch_tokens + req * batch_requests`` seconds per step."""

    const_s: float = 5e-3
    per_token_s: float = 2e-8
    per_request_s: float = 2e-4
    r2: float = float("nan")

    def __post_init__(self) -> None:
        coefs = (self.const_s, self.per_token_s, self.per_request_s)
        big = (self.predict(SANE_MAX_TOKENS, SANE_MAX_TOKENS) if _all_nonneg(*coefs) else math.nan)
        _check_model("DecodeCostModel", coefs, self.r2, coefs, big)

    @classmethod
    def fit(cls, samples: Iterable[Sequence[float]]) -> "DecodeCostModel":
        """Fit on ``(batch_tokens, batch_requests, seconds_per_step)`` samples."""
        arr = np.asarray(list(samples), dtype=np.float64)
        if arr.ndim != 2 or arr.shape[1] != 3 or (arr < 0).any() or not np.isfinite(arr).all():
            raise LBInputError("DecodeCostModel.fit expects non-negative (batch_tokens, batch_requests, seconds) rows")
        x = np.stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]], axis=-1)
        coef, r2 = nonneg_lstsq(x, arr[:, 2])
        return cls(float(coef[0]), float(coef[1]), float(coef[2]), r2)

    def predict(self, batch_tokens: float, batch_requests: float) -> float:
        if batch_requests <= 0:
            return 0.0
        return self.const_s + self.per_token_s * batch_tokens + self.per_request_s * batch_requests


@dataclass(frozen=True, slots=True)
class TransferModel:
    """Time to load cached KV blocks from a tier: ``bytes / bandwidth + latency``."""

    kv_bytes_per_token: float = 16384.0
    block_tokens: int = BLOCK_TOKENS

    def __post_init__(self) -> None:
        if not (_all_nonneg(self.kv_bytes_per_token, self.block_tokens) and isinstance(self.block_tokens, int)
                and self.kv_bytes_per_token > 0 and self.block_tokens > 0):
            raise LBInputError(f"TransferModel needs finite kv_bytes_per_token > 0 and an integer block_tokens > 0, "
                               f"got {self.kv_bytes_per_token!r} and {self.block_tokens!r}")

    def block_bytes(self) -> float:
        return self.kv_bytes_per_token * self.block_tokens

    def host_s(self, blocks: int, bw: TierBandwidth) -> float:
        if blocks <= 0:
            return 0.0
        return blocks * self.block_bytes() / bw.host_bytes_per_s + bw.host_latency_s

    def store_s(self, blocks: int, bw: TierBandwidth) -> float:
        if blocks <= 0:
            return 0.0
        return blocks * self.block_bytes() / bw.store_bytes_per_s + bw.store_latency_s

    def fetch_s(self, host_blocks: int, store_blocks: int, bw: TierBandwidth) -> float:
        """Host and store reads are issued together (separate links): the slower one bounds."""
        return max(self.host_s(host_blocks, bw), self.store_s(store_blocks, bw))


@dataclass(frozen=True, slots=True)
class CostModels:
    """The three models together, as stored in ``lb/data/cost_model.json``."""

    prefill: PrefillCostModel = field(default_factory=PrefillCostModel)
    decode: DecodeCostModel = field(default_factory=DecodeCostModel)
    transfer: TransferModel = field(default_factory=TransferModel)
    meta: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(
            {
                "format": 1,
                "prefill": asdict(self.prefill),
                "decode": asdict(self.decode),
                "transfer": asdict(self.transfer),
                "meta": self.meta,
            },
            indent=2,
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, text: str) -> "CostModels":
        try:
            d = json.loads(text)
            if not isinstance(d, dict):
                raise TypeError(f"expected a JSON object, got {type(d).__name__}")
            if d.get("format") != 1:
                raise LBInputError(f"cost model format {d.get('format')!r} is not 1; refit with tools/fit_cost_model.py")
            return cls(
                PrefillCostModel(**d["prefill"]),
                DecodeCostModel(**d["decode"]),
                TransferModel(**d["transfer"]),
                dict(d.get("meta", {})),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise LBInputError(f"malformed cost model JSON ({exc}); refit with tools/fit_cost_model.py") from exc

    @classmethod
    def load(cls, path: str | Path) -> "CostModels":
        return cls.from_json(Path(path).read_text())


def load_default() -> CostModels:
    """The committed fit (``lb/data/cost_model.json``); built-in defaults if it is absent."""
    if DEFAULT_PATH.exists():
        return CostModels.load(DEFAULT_PATH)
    log.warning("%s not found; using built-in cost model defaults (run tools/fit_cost_model.py)", DEFAULT_PATH)
    return CostModels()
