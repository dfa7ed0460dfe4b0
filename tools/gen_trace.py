"""Generate a seeded conversation trace in the Mooncake format (JSON lines for ``replay_trace.py``).

Exact command (one shape; ``--shape list`` prints every shape with its parameters)::

    .venv/bin/python tools/gen_trace.py --shape agent --sessions 300 --seed 0 --out results/agent.jsonl

Each line is ``{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}``,
sorted by timestamp, ``hash_ids`` one id per 512-token block of the prompt (the last possibly partial).

The traffic model (every draw from one ``numpy`` generator seeded by ``--seed``: the same seed and
shape give the same file, byte for byte)
    1. *Sessions* start as a Poisson process (``session_rate_per_s``). A session is *long* with
       probability ``long_fraction``, else *short*; each kind draws its number of turns from a
       geometric distribution of its mean (``short_turns`` / ``long_turns``), at least one.
    2. *Shared system prompt*: every session opens with one of ``system_prompts`` system prompts of
       ``system_tokens`` tokens, picked with Zipf-like weights (1/k), so most sessions share the
       first one: its full blocks carry the same ids across sessions.
    3. *Turns*: turn 1's prompt is the system prompt plus a first message; turn k+1's prompt is turn
       k's prompt + turn k's output + a new message, so each turn's prompt extends the previous one
       and shares all of its full blocks. A long session's first message is a document
       (``doc_tokens``); other messages and outputs are log-normal (``msg_tokens``, ``out_tokens``:
       median and sigma). A session ends early once its next prompt would exceed ``max_context``.
    4. *Gaps*: the next turn arrives after the previous one's output (``out_tokens x
       decode_s_per_token``) plus a think time drawn from a Pareto (Lomax) distribution of shape
       ``gap_alpha`` and scale ``gap_scale_s`` (heavy-tailed: most follow-ups come quickly, a few
       after minutes), capped at ``gap_cap_s`` so that the trace's span stays bounded.

Block ids follow Mooncake's chaining: a block's id depends on its content *and* every block before
it (a dict from ``(parent id, content of this block)`` to a new integer), so two prompts share a
block id exactly when they share the whole prefix up to the end of that block. A partial last block
covers different content at the next turn, so it gets a new id (it is never cached anyway).

Exit status: 0 the trace was written; 2 a bad argument (refused in one line before any work).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tools.cli_args import check_output_file, integer

__all__ = ["Shape", "SHAPES", "generate", "generate_sessions", "write_jsonl", "BLOCK_TOKENS"]

BLOCK_TOKENS = 512  # Mooncake's block size: the hash_ids unit


@dataclass(frozen=True, slots=True)
class Shape:
    """Parameters of one traffic shape (token counts in tokens, times in seconds); see the module doc."""

    description: str
    session_rate_per_s: float = 0.05
    long_fraction: float = 0.2
    short_turns: float = 3.0  # mean turns of a short session (geometric, >= 1)
    long_turns: float = 12.0
    system_prompts: int = 3
    system_tokens: int = 2048
    doc_tokens: tuple = (20000.0, 0.5)  # (median, sigma) of a long session's first message
    msg_tokens: tuple = (400.0, 1.0)  # (median, sigma) of every other message
    out_tokens: tuple = (150.0, 0.8)  # (median, sigma) of every output
    max_output: int = 2048
    max_context: int = 131072
    decode_s_per_token: float = 0.03
    gap_alpha: float = 1.5
    gap_scale_s: float = 20.0
    gap_cap_s: float = 600.0


#: The shapes by name (a registry: a new shape is one entry). They differ on purpose in what a
#: router has to get right: how much of a prompt a warm instance holds, how long prompts are, how
#: bursty follow-ups are, and how many sessions share the system prompt.
SHAPES: dict[str, Shape] = {
    "chat": Shape("many short chat sessions, short messages, follow-ups after tens of seconds",
                  session_rate_per_s=0.1, long_fraction=0.1, short_turns=4.0, long_turns=10.0,
                  system_tokens=1536, doc_tokens=(8000.0, 0.6), msg_tokens=(250.0, 1.0)),
    "agent": Shape("coding agents: long sessions of quick tool-call turns with large tool outputs",
                   session_rate_per_s=0.02, long_fraction=0.5, short_turns=6.0, long_turns=25.0,
                   system_tokens=6144, system_prompts=2, doc_tokens=(6000.0, 0.8), msg_tokens=(1200.0, 1.2),
                   out_tokens=(200.0, 0.7), gap_alpha=1.3, gap_scale_s=3.0, max_context=98304),
    "longdoc": Shape("document Q&A: long documents, a few short follow-ups after long pauses",
                     session_rate_per_s=0.02, long_fraction=0.6, short_turns=2.0, long_turns=5.0,
                     system_tokens=1024, doc_tokens=(30000.0, 0.5), msg_tokens=(150.0, 0.8),
                     gap_alpha=1.2, gap_scale_s=60.0),
    "mixed": Shape("a mix of short chats and long document sessions, many system prompts",
                   session_rate_per_s=0.05, long_fraction=0.3, short_turns=3.0, long_turns=8.0,
                   system_prompts=6, system_tokens=3072, doc_tokens=(16000.0, 0.8), msg_tokens=(500.0, 1.1),
                   gap_alpha=1.5, gap_scale_s=15.0),
}


class _BlockIds:
    """Chained block ids: ``(parent id, block content) -> id``, a new integer for new content."""

    def __init__(self) -> None:
        self._ids: dict = {}

    def of(self, segments: list[tuple[int, int]], total: int) -> list[int]:
        """Ids of the blocks of a prompt made of ``segments`` ((segment id, tokens), in order), ``total``
        tokens in all: one per ``BLOCK_TOKENS`` block, the last possibly partial."""
        out, parent = [], -1
        pieces: list[tuple[int, int, int]] = []  # (segment id, start, end) inside the current block
        room = BLOCK_TOKENS
        for seg, n in segments:
            start = 0
            while start < n:
                take = min(room, n - start)
                pieces.append((seg, start, start + take))
                start += take
                room -= take
                if room == 0:
                    parent = self._id(parent, pieces)
                    out.append(parent)
                    pieces, room = [], BLOCK_TOKENS
        if pieces:
            out.append(self._id(parent, pieces))
        if len(out) != -(-total // BLOCK_TOKENS):
            raise RuntimeError(f"gen_trace bug: {len(out)} block ids for {total} tokens; please report it")
        return out

    def _id(self, parent: int, pieces: list) -> int:
        key = (parent, tuple(pieces))
        got = self._ids.get(key)
        if got is None:
            got = self._ids[key] = len(self._ids)
        return got


def _lognormal(rng: np.random.Generator, spec: tuple, lo: int = 1) -> int:
    median, sigma = spec
    return max(lo, int(round(median * float(np.exp(rng.normal(0.0, sigma))))))


def generate(shape: Shape, sessions: int, seed: int = 0) -> list[dict]:
    """The trace of ``sessions`` sessions of ``shape`` as Mooncake records, sorted by timestamp (ties
    by session, then turn): deterministic for ``(shape, sessions, seed)``."""
    rows = [(r["timestamp"], s, k, r) for s, turns in enumerate(generate_sessions(shape, sessions, seed))
            for k, r in enumerate(turns)]
    rows.sort(key=lambda r: r[:3])
    return [r[3] for r in rows]


def generate_sessions(shape: Shape, sessions: int, seed: int = 0) -> list[list[dict]]:
    """The same records as :func:`generate`, grouped by session, each session's turns in order."""
    if sessions < 1:
        raise ValueError(f"sessions must be >= 1, got {sessions}")
    rng = np.random.default_rng(seed)
    ids = _BlockIds()
    weights = 1.0 / np.arange(1, shape.system_prompts + 1)
    weights /= weights.sum()
    next_seg = shape.system_prompts  # segment ids 0 .. system_prompts-1 are the system prompts
    out: list[list[dict]] = []
    t_start = 0.0
    for _ in range(sessions):
        t_start += float(rng.exponential(1.0 / shape.session_rate_per_s))
        long = bool(rng.random() < shape.long_fraction)
        turns = int(rng.geometric(1.0 / (shape.long_turns if long else shape.short_turns)))
        segments = [(int(rng.choice(shape.system_prompts, p=weights)), shape.system_tokens)]
        tokens, t = shape.system_tokens, t_start
        out.append([])
        for k in range(turns):
            msg = _lognormal(rng, shape.doc_tokens if (long and k == 0) else shape.msg_tokens)
            answer = min(shape.max_output, _lognormal(rng, shape.out_tokens))
            if tokens + msg > shape.max_context:
                break
            segments.append((next_seg, msg))
            next_seg += 1
            tokens += msg
            out[-1].append({"timestamp": int(round(t * 1000)), "input_length": tokens, "output_length": answer,
                            "hash_ids": ids.of(segments, tokens)})
            segments.append((next_seg, answer))  # the answer becomes part of the next turn's prompt
            next_seg += 1
            tokens += answer
            gap = min(shape.gap_cap_s, shape.gap_scale_s * float(rng.pareto(shape.gap_alpha)))
            t += answer * shape.decode_s_per_token + gap
    return out


def write_jsonl(records: list[dict], path: Path) -> None:
    """One JSON object per line, keys in Mooncake's order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in records:
            fh.write(json.dumps(r, separators=(", ", ": ")) + "\n")


def _shape_arg(text: str) -> str:
    if text != "list" and text not in SHAPES:
        raise argparse.ArgumentTypeError(f"unknown shape {text!r}; known: {', '.join(SHAPES)} (or 'list')")
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gen_trace.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=_shape_arg, required=True, help=f"one of {', '.join(SHAPES)}, or 'list'")
    ap.add_argument("--sessions", type=integer(1, 10_000_000), default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="output .jsonl (required unless --shape list)")
    args = ap.parse_args(argv)
    if args.shape == "list":
        for name, sh in SHAPES.items():
            print(f"{name}: {json.dumps(asdict(sh))}")
        return 0
    if args.out is None:
        ap.error("--out is required")
    if msg := check_output_file(args.out):
        ap.error(msg)
    shape = SHAPES[args.shape]
    records = generate(shape, args.sessions, args.seed)
    write_jsonl(records, args.out)
    print(f"wrote {len(records)} requests of {args.sessions} {args.shape} sessions to {args.out}")
    return 0


if __name__ == "__main__":
    from tools.cli_args import run_main

    run_main(main)
