"""Mooncake-format traces for the simulator (``lb.sim``) and the tools that replay them:
parsing (:func:`parse_trace`, strict, one clear error per bad line), the full blocks a
request may cache (:func:`cacheable_blocks`), the reference hit ratios (ideal and an LRU
oracle, :func:`reference_hit_ratios`) and the helpers the tools print with
(:func:`json_safe`, :func:`prompts_beyond_fit`). The hit-ratio definition and why only
full blocks are cached are in ``lb.sim``'s docstring. ``lb.sim`` re-exports every name.
"""

from __future__ import annotations

import json
import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Iterable

from lb.cost_model import CostModels
from lb.types import BLOCK_TOKENS, LBInputError

log = logging.getLogger(__name__)

@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One Mooncake trace line: ``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``.

    ``hash_ids`` are the trace's block ids in prompt order, the last one possibly
    for a partial block; only :func:`cacheable_blocks` of them are ever cached.
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple


def cacheable_blocks(r: TraceRequest, block_tokens: int = BLOCK_TOKENS) -> tuple:
    """The ids of ``r``'s *full* blocks: ``hash_ids[:input_length // block_tokens]``.

    Production hashes only full blocks (``kvstore/keys.py``), so a partial last
    block is never cached and never hit. When the trace lists fewer ids than full
    blocks, every listed id is taken as a full block.
    """
    return r.hash_ids[: r.input_length // block_tokens]


#: Longest prompt or output (tokens) a trace line may claim: far above any model's context, far
#: below what would turn the cost model's arithmetic into nonsense (a 10**18-token prompt).
MAX_TRACE_TOKENS = 1 << 24


def _field(d: dict, name: str) -> object:
    """``d[name]``; a missing field is a ``ValueError`` that names it (not a bare ``KeyError``)."""
    try:
        return d[name]
    except KeyError:
        raise ValueError(f'missing field "{name}"') from None


def _trace_int(d: dict, name: str, lo: int, hi: int) -> int:
    """``d[name]`` as a JSON integer in ``[lo, hi]`` (a bool, a float such as 1000.7 or 1000.0: refused)."""
    v = _field(d, name)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{name} must be an integer, got {v!r}")
    if not lo <= v <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def _trace_request(d: object) -> TraceRequest:
    """One decoded trace line, every field checked (raises TypeError or ValueError)."""
    if not isinstance(d, dict):
        raise TypeError(f"expected a JSON object, got {type(d).__name__}")
    ts = _field(d, "timestamp")
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"timestamp must be a finite number of ms >= 0, got {ts!r}")
    ids = _field(d, "hash_ids")
    if not isinstance(ids, list):
        raise TypeError(f"hash_ids must be a list of block hashes, got {type(ids).__name__} {ids!r:.40}")
    for i, h in enumerate(ids):
        # Integers of any sign and size (signed 64-bit hashes are common) or non-empty strings
        # (hex digests): opaque ids, only compared. Floats, bools, nulls and nested lists are not ids.
        if isinstance(h, bool) or not (isinstance(h, int) or (isinstance(h, str) and h)):
            raise ValueError(f"hash_ids[{i}] must be an integer or a non-empty string, got {h!r:.40}")
    return TraceRequest(float(ts), _trace_int(d, "input_length", 1, MAX_TRACE_TOKENS),
                        _trace_int(d, "output_length", 0, MAX_TRACE_TOKENS), tuple(ids))


def _object_no_duplicates(pairs: list) -> dict:
    """``object_pairs_hook``: a JSON object that names a key twice is refused (``json`` keeps the last)."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen: set = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f'duplicate key "{dup}" in one object (which value is meant?)')
    return d


def parse_trace(lines: Iterable[str], limit: int | None = None, *,
                block_tokens: int = BLOCK_TOKENS, source: str = "trace") -> list[TraceRequest]:
    """Parse Mooncake JSON lines (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``).

    Blank lines are skipped; at most ``limit`` requests are returned. ``source`` names
    the input in every message (the tools pass ``"trace PATH"``).

    Refused, with one ``LBInputError`` that names ``source`` and the line number: a line
    that is not JSON, is nested too deeply for the parser, names a key twice in one
    object, misses a field (``missing field "output_length"``), or holds a value no
    trace can mean (a non-finite or negative timestamp, a length that is not an integer
    or is outside [1 (0 for the output), ``MAX_TRACE_TOKENS``], hash ids that are not a
    list of integers or non-empty strings).

    Kept, and counted in one warning: lines whose ``hash_ids`` do not cover
    ``input_length`` in blocks of ``block_tokens`` (consistent is ``len(hash_ids) ==
    ceil(input_length / block_tokens)``: the last block may be partial). The simulator
    takes compute from ``input_length`` and cache hits from the full blocks
    ``hash_ids[:input_length // block_tokens]``; when most lines disagree the trace was
    probably written for another block size than ``block_tokens``.

    Hash ids are opaque content keys, only compared for equality. Mooncake's ids are
    chained (a block's id depends on every block before it), so one id at two different
    positions in two requests contradicts the format; it is not refused: the caches are
    keyed by id alone, so such a block hits wherever it appears (a repeat of an id
    inside one request hits too once cached).
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens < 1:
        raise LBInputError(f"block_tokens must be an integer >= 1, got {block_tokens!r}")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
        raise LBInputError(f"limit must be None or an integer >= 0, got {limit!r}")
    out: list[TraceRequest] = []
    mismatched, first_mismatch = 0, 0
    for n, line in enumerate(lines, 1):
        if limit is not None and len(out) >= limit:
            break
        if not line.strip():
            continue
        try:
            r = _trace_request(json.loads(line, object_pairs_hook=_object_no_duplicates))
        except RecursionError:
            raise LBInputError(f"{source} line {n} is nested too deeply to be a Mooncake trace line "
                               f"(a JSON object of timestamp, input_length, output_length, hash_ids)") from None
        except (json.JSONDecodeError, TypeError, ValueError) as exc:
            raise LBInputError(f"{source} line {n} is not Mooncake format "
                               f"(timestamp, input_length, output_length, hash_ids): {exc}") from exc
        if len(r.hash_ids) != -(-r.input_length // block_tokens):
            mismatched += 1
            first_mismatch = first_mismatch or n
        out.append(r)
    if mismatched:
        log.warning(
            "%s: %d of %d lines have len(hash_ids) != ceil(input_length / %d) (the first on line %d); "
            "kept: compute follows input_length, cache hits follow the full blocks hash_ids[:input_length // %d]; "
            "if most lines disagree, the trace may use another block size than %d tokens",
            source, mismatched, len(out), block_tokens, first_mismatch, block_tokens, block_tokens)
    return out


class LRU:
    """Block-hash LRU of ``capacity`` blocks (None = unbounded, 0 = holds nothing).

    ``__contains__`` has no side effect; ``touch`` marks used; ``insert``
    adds (or touches) and returns the evicted hashes, oldest first.
    """

    __slots__ = ("capacity", "_d")

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 0:
            raise LBInputError(f"LRU capacity must be >= 0 or None, got {capacity}")
        self.capacity = capacity
        self._d: OrderedDict = OrderedDict()

    def __contains__(self, h) -> bool:
        return h in self._d

    def __len__(self) -> int:
        return len(self._d)

    def touch(self, h) -> None:
        if h in self._d:
            self._d.move_to_end(h)

    def insert(self, h) -> list:
        if self.capacity == 0:
            return [h]
        if h in self._d:
            self._d.move_to_end(h)
            return []
        self._d[h] = None
        evicted = []
        while self.capacity is not None and len(self._d) > self.capacity:
            evicted.append(self._d.popitem(last=False)[0])
        return evicted


def prefix_hits_lru(reqs: Sequence[TraceRequest], capacity: int | None, *, block_tokens: int = BLOCK_TOKENS) -> int:
    """Prefix-hit blocks of one LRU of ``capacity`` touched in arrival order (the oracle).

    Only each request's full blocks (:func:`cacheable_blocks`) are looked up and inserted.
    """
    lru, hits = LRU(capacity), 0
    for r in sorted(reqs, key=lambda r: r.timestamp_ms):
        full = cacheable_blocks(r, block_tokens)
        n = 0
        for h in full:
            if h not in lru:
                break
            n += 1
        hits += n
        for h in full:
            lru.insert(h)
    return hits


def reference_hit_ratios(reqs: Sequence[TraceRequest], capacity: int | None, *,
                         block_tokens: int = BLOCK_TOKENS) -> dict:
    """``{"ideal": ..., "lru_oracle": ...}``: prefix-hit full blocks / all listed blocks (see the module doc);
    NaN when the requests list no block (every ``hash_ids`` empty): no ratio, not 0."""
    total = sum(len(r.hash_ids) for r in reqs)
    if not total:
        return {"ideal": math.nan, "lru_oracle": math.nan}
    return {"ideal": prefix_hits_lru(reqs, None, block_tokens=block_tokens) / total,
            "lru_oracle": prefix_hits_lru(reqs, capacity, block_tokens=block_tokens) / total}


def json_safe(obj: object) -> object:
    """``obj`` with every non-finite float (NaN, inf) replaced by ``None``, so that
    ``json.dumps(..., allow_nan=False)`` writes valid JSON (dicts, lists and tuples are walked)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def prompts_beyond_fit(reqs: Sequence[TraceRequest], models: CostModels) -> tuple[int, int] | None:
    """``(requests whose input_length exceeds the largest prompt the prefill cost model was
    fitted on, that largest prompt)``; ``None`` when the model records no samples
    (``meta["prefill_samples"]`` rows of ``[prompt, cached, seconds]``, see tools/fit_cost_model.py)."""
    samples = models.meta.get("prefill_samples") if isinstance(models.meta, dict) else None
    try:
        largest = max(int(s[0]) for s in samples) if samples else None
    except (TypeError, ValueError, IndexError):
        return None
    if largest is None:
        return None
    return sum(1 for r in reqs if r.input_length > largest), largest
