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
work costs time: the reference workload (:data:`SANE_MAX_TOKENS` uncached
prompt tokens, not counting the constant; a decode step of that many
requests and tokens) takes at least ``SANE_MAX_TOKENS / MAX_TOKENS_PER_S``
seconds (1 ms), so an all-zero model, or one whose only cost is 1e-23 s a
token, is refused as an infinite throughput; a prediction for
:data:`SANE_MAX_TOKENS` tokens is finite; ``r2`` is NaN (not fitted) or in
[0, 1]; ``kv_bytes_per_token`` > 0 and ``block_tokens`` an integer > 0.

Samples (``fit``): finite numbers >= 0, ``cached <= prompt``, and a time of
at least :data:`MIN_TIMING_S` (1 us). The fit weighs each row's squared error
by ``1 / t**2`` (relative error), so a row's pull grows without bound as its
time shrinks: a 0 s row would outweigh all others by ~1e12, a 1 ns one
(clock noise, a unit slip) about as much. 1 us is the resolution we state for
a timing: ``time.perf_counter`` around a call adds ~0.1 us of overhead and
jitter, under 10 % of 1 us, while no prefill or decode step (one kernel
launch is ~5 us) is shorter. Each bad row is refused with ``LBInputError``
naming it, never floored (a floored row would still be a made-up figure).
Rows the model predicts 0 s for (a prefill with ``prompt == cached``, a
decode step of 0 requests) carry nothing to fit and are dropped with a
logged warning. A fit with ``r2 < 0`` (worse than predicting the mean) is
refused: the samples do not follow the model. So is one whose times are all
equal: R^2 is then undefined (nothing varies to be explained, ``0 / 0``), so
the fit could not be judged at all (see :func:`nonneg_lstsq`).
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
    "MAX_TOKENS_PER_S",
    "NNLS_MAX_FEATURES",
    "MIN_TIMING_S",
]

log = logging.getLogger(__name__)

DEFAULT_PATH = Path(__file__).with_name("data") / "cost_model.json"
SANE_MAX_TOKENS = 10_000_000  # a prompt (prefill) or a batch (decode) any model must predict finitely
MAX_TOKENS_PER_S = 1e10  # no machine is faster: the reference workload must take >= SANE_MAX_TOKENS / this
NNLS_MAX_FEATURES = 8  # nonneg_lstsq enumerates 2**k supports
MIN_TIMING_S = 1e-6  # the shortest sample time a fit takes: the timing resolution (module doc, *Samples*)


def nonneg_lstsq(x: np.ndarray, y: np.ndarray, *, relative: bool = True) -> tuple[np.ndarray, float]:
    """Least squares with coefficients forced >= 0 (exact NNLS by enumerating supports).

    ``relative`` minimises the squared *relative* error (rows weighted by
    ``1 / y``, so every ``y`` must be > 0): timings span orders of magnitude
    and a short prefill mispredicted by 2x matters as much as a long one.
    Returns (coefficients, r2 of the unweighted fit). Every ``y`` equal is
    refused with ``LBInputError``: R^2 = 1 - SSE / SS_tot is then 0 / 0,
    undefined, and no figure (1 or anything else) would say whether the
    model fits; samples must vary the work so that the time varies.

    Method: the optimum is a non-negative combination of linearly
    independent columns with all weights > 0 (Caratheodory), so on that
    support it is the unconstrained least-squares solution. Solving the
    unconstrained problem on every subset of the columns (2**k of them),
    keeping the feasible (all >= 0) solutions and taking the one of least
    weighted SSE is therefore exact, and cheap for the handful of features
    used here (at most :data:`NNLS_MAX_FEATURES`). Columns are scaled to
    unit norm first (prefill features span ~1 to ~1e9).
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 2 or y.ndim != 1 or x.shape[0] != y.shape[0]:
        raise LBInputError(f"fit expects X [n, k] and y [n]; got {x.shape} and {y.shape}")
    if x.shape[0] < x.shape[1]:
        raise LBInputError(f"fit needs at least {x.shape[1]} samples, got {x.shape[0]}")
    if not 1 <= x.shape[1] <= NNLS_MAX_FEATURES:
        raise LBInputError(f"fit takes 1 to {NNLS_MAX_FEATURES} features, got {x.shape[1]}")
    if not (np.isfinite(x).all() and np.isfinite(y).all()):
        raise LBInputError("fit expects finite X and y")
    if relative and not (y > 0).all():
        raise LBInputError(f"a relative fit needs every y > 0; row {int(np.flatnonzero(~(y > 0))[0])} is not")
    ss_tot = float(((y - y.mean()) ** 2).sum())
    if np.ptp(y) == 0 or not ss_tot > 0:  # ptp: the mean of equal floats may be off by an ulp, ss_tot not 0
        raise LBInputError(f"all {len(y)} samples have the same y ({float(y[0]):g}): R^2 is undefined (no variance to "
                           f"explain), so the fit can not be judged; time samples that vary the work")
    wt = 1.0 / y if relative else np.ones_like(y)
    xw, yw = x * wt[:, None], y * wt
    norms = np.linalg.norm(xw, axis=0)
    norms[norms == 0] = 1.0
    xs = xw / norms
    k = x.shape[1]
    coef, best = np.zeros(k), float((yw**2).sum())  # the empty support
    for support in range(1, 1 << k):
        cols = [j for j in range(k) if support >> j & 1]
        sol, *_ = np.linalg.lstsq(xs[:, cols], yw, rcond=None)
        if not (sol >= 0).all():
            continue
        sse = float(((xs[:, cols] @ sol - yw) ** 2).sum())
        if sse < best:
            best, coef = sse, np.zeros(k)
            coef[cols] = sol
    coef = coef / norms
    resid = y - x @ coef
    return coef, 1.0 - float((resid**2).sum()) / ss_tot


def _all_nonneg(*values: float) -> bool:
    """All real numbers (not bool), finite and >= 0 (a NaN coefficient would pass a bare ``< 0`` check)."""
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in values)


def _check_model(name: str, coefs: tuple, r2: float, work_s: float, big: float) -> None:
    """The shared checks of the module doc's *Validation*; ``work_s`` is the predicted time of the
    reference workload, ``big`` the prediction for :data:`SANE_MAX_TOKENS` tokens."""
    if not _all_nonneg(*coefs):
        raise LBInputError(f"{name} coefficients must be finite numbers >= 0, got {coefs}")
    if not work_s >= SANE_MAX_TOKENS / MAX_TOKENS_PER_S:
        raise LBInputError(f"{name} predicts {work_s:.3g} s for the work of {SANE_MAX_TOKENS} tokens (coefficients "
                           f"{coefs}): over {MAX_TOKENS_PER_S:.0e} tokens/s, an infinite throughput")
    if not math.isfinite(big):
        raise LBInputError(f"{name} predicts a non-finite time for {SANE_MAX_TOKENS} tokens (coefficients {coefs})")
    if not (isinstance(r2, (int, float)) and not isinstance(r2, bool) and (math.isnan(r2) or 0 <= r2 <= 1)):
        raise LBInputError(f"{name}.r2 must be a number in [0, 1] (NaN: not fitted), got {r2!r}")


def _fit_rows(name: str, samples: Iterable[Sequence[float]], columns: str) -> np.ndarray:
    """``samples`` as an [n, 3] array after the row checks of the module doc's *Samples*; the
    last column is seconds."""
    try:
        arr = np.asarray(list(samples), dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise LBInputError(f"{name}.fit expects ({columns}) rows of numbers: {exc}") from exc
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise LBInputError(f"{name}.fit expects ({columns}) rows, got an array of shape {arr.shape}")
    bad = ~np.isfinite(arr).all(axis=1) | (arr < 0).any(axis=1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LBInputError(f"{name}.fit: sample {i} {tuple(arr[i].tolist())} must be finite numbers >= 0 "
                           f"({columns})")
    short = arr[:, 2] < MIN_TIMING_S
    if short.any():
        i = int(np.flatnonzero(short)[0])
        raise LBInputError(f"{name}.fit: sample {i} {tuple(arr[i].tolist())} takes {arr[i, 2]:.3g} s "
                           f"({short.sum()} such rows), below the timing resolution {MIN_TIMING_S:g} s: no real "
                           f"prefill or decode step is that short (a clock or unit error); re-time or drop these rows")
    return arr


def _drop_idle(name: str, arr: np.ndarray, idle: np.ndarray, what: str) -> np.ndarray:
    """``arr`` without the ``idle`` rows (the model predicts 0 s for them), with a warning if any."""
    if idle.any():
        log.warning("%s.fit: dropped %d of %d samples with %s (the model predicts 0 s there)",
                    name, int(idle.sum()), len(arr), what)
    return arr[~idle]


def _check_r2(name: str, r2: float) -> None:
    if r2 < 0:
        raise LBInputError(f"{name}.fit: R^2 = {r2:.3g} < 0, worse than predicting the mean: the samples do "
                           f"not follow the model; check their units and timings")


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
        _check_model("PrefillCostModel", coefs, self.r2, big - self.const_s, big)

    @staticmethod
    def features(suffix: np.ndarray, cached: np.ndarray) -> np.ndarray:
        s = np.asarray(suffix, dtype=np.float64)
        c = np.asarray(cached, dtype=np.float64)
        return np.stack([np.ones_like(s), s, s * c + s * s / 2.0], axis=-1)

    @classmethod
    def fit(cls, samples: Iterable[Sequence[float]]) -> "PrefillCostModel":
        """Fit on ``(prompt_tokens, cached_tokens, seconds)`` samples."""
        name = "PrefillCostModel"
        arr = _fit_rows(name, samples, "prompt_tokens, cached_tokens, seconds")
        over = arr[:, 1] > arr[:, 0]
        if over.any():
            i = int(np.flatnonzero(over)[0])
            raise LBInputError(f"{name}.fit: sample {i} {tuple(arr[i].tolist())} needs "
                               f"cached_tokens <= prompt_tokens")
        arr = _drop_idle(name, arr, arr[:, 0] == arr[:, 1], "prompt_tokens == cached_tokens")
        suffix = arr[:, 0] - arr[:, 1]
        coef, r2 = nonneg_lstsq(cls.features(suffix, arr[:, 1]), arr[:, 2])
        _check_r2(name, r2)
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
        _check_model("DecodeCostModel", coefs, self.r2, big, big)

    @classmethod
    def fit(cls, samples: Iterable[Sequence[float]]) -> "DecodeCostModel":
        """Fit on ``(batch_tokens, batch_requests, seconds_per_step)`` samples."""
        name = "DecodeCostModel"
        arr = _fit_rows(name, samples, "batch_tokens, batch_requests, seconds")
        arr = _drop_idle(name, arr, arr[:, 1] == 0, "batch_requests == 0")
        x = np.stack([np.ones(len(arr)), arr[:, 0], arr[:, 1]], axis=-1)
        coef, r2 = nonneg_lstsq(x, arr[:, 2])
        _check_r2(name, r2)
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
