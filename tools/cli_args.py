"""Argument checks shared by the command lines in ``tools/``.

Role
    Each tool builds its ``argparse`` parser with these ``type=`` converters
    and calls the ``check_*`` helpers on its paths *before* any work starts,
    so a bad argument costs nothing. Only the standard library is imported
    here, so ``--help`` and a refused argument answer at once.

The contract every tool in ``tools/`` keeps (stated once, here)
    1. ``--help`` works, without the tool's heavy imports (torch, the engine).
    2. A bad argument or bad input (a trace, a cost model, a path) is refused
       before any work with ONE line ``TOOL: error: ...`` on stderr (after
       argparse's usage line) and exit status 2, argparse's own convention.
    3. A run that fails once started (a daemon that does not come up, a
       client process that dies) stops promptly, cleans up what it started
       and says why in one line ``TOOL: error: ...``; exit status 1, the
       same status as a run whose checks failed.
    4. Never a traceback. A benchmark left with nothing to compare against
       is a bad argument (rule 2), not an empty table.

The converters raise ``argparse.ArgumentTypeError``: argparse then names the
option in its one line (``argument --procs: must be an integer >= 1, got 0``).
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")


def _bounds(lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    def f(x: float) -> str:
        return str(x) if isinstance(x, int) else f"{x:g}"

    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{f(lo)}, {f(hi)}]"
    if lo is not None:
        return f"> {f(lo)}" if lo_open else f">= {f(lo)}"
    return f"<= {f(hi)}"


def integer(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """``type=`` for an integer option in ``[lo, hi]`` (either bound may be None)."""

    def conv(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be an integer {_bounds(lo, hi)}, got {v}")
        return v

    return conv


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    """``type=`` for a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``); nan and inf are refused."""

    def conv(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        bad_lo = lo is not None and (v <= lo if lo_open else v < lo)
        if not math.isfinite(v) or bad_lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be a finite number {_bounds(lo, hi, lo_open)}, got {text!r}")
        return v

    return conv


def choice_bool(text: str) -> bool:
    """``type=`` for a true/false option (``true``, ``false``, ``1``, ``0``, ``yes``, ``no``)."""
    v = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.strip().lower())
    if v is None:
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return v


def csv_list(conv: Callable[[str], T]) -> Callable[[str], list[T]]:
    """``type=`` for a comma-separated list, each item through ``conv``; an empty list is refused."""

    def parse(text: str) -> list[T]:
        items = [p.strip() for p in text.split(",")]
        if not any(items):
            raise argparse.ArgumentTypeError("expected a comma-separated list, got nothing")
        if not all(items):
            raise argparse.ArgumentTypeError(f"empty item in {text!r} (a stray comma?)")
        out = []
        for item in items:
            try:
                out.append(conv(item))
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"item {item!r}: {exc}") from None
        return out

    return parse


def _nearest_existing(path: Path) -> Path:
    p = path.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _creatable_under(path: Path) -> str | None:
    anc = _nearest_existing(path)
    if not anc.is_dir():
        return f"{path}: {anc} is not a directory"
    if not os.access(anc, os.W_OK | os.X_OK):
        return f"{path}: {anc} is not writable"
    return None


def check_output_file(path: str | os.PathLike, option: str = "--out") -> str | None:
    """Why ``path`` can not be written as a results file (None: it can): checked before the work."""
    p = Path(path)
    if p.exists():
        if not p.is_file():
            return f"{option} {p} exists and is not a regular file"
        return None if os.access(p, os.W_OK) else f"{option} {p} is not writable"
    msg = _creatable_under(p)
    return f"{option} {msg}" if msg else None


def check_output_dir(path: str | os.PathLike, option: str = "--out") -> str | None:
    """Why ``path`` can not be used (or created) as a results directory (None: it can)."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            return f"{option} {p} exists and is not a directory"
        return None if os.access(p, os.W_OK | os.X_OK) else f"{option} {p} is not writable"
    msg = _creatable_under(p)
    return f"{option} {msg}" if msg else None


def check_existing_dir(path: str | os.PathLike, option: str) -> str | None:
    """Why ``path`` is not an existing writable directory (None: it is)."""
    p = Path(path)
    if not p.is_dir():
        return f"{option} {p} is not an existing directory"
    return None if os.access(p, os.W_OK | os.X_OK) else f"{option} {p} is not writable"


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (for the ``TOOL: error: ...`` of a run that failed)."""
    text = " ".join(str(exc).split()) or repr(exc)
    return f"{type(exc).__name__}: {text}"
