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
    5. Ctrl-C (SIGINT, ``KeyboardInterrupt``) during a run stops it with ONE
       line ``TOOL: interrupted`` on stderr and exit status 130 (128 + SIGINT),
       after the tool's own ``finally`` blocks stopped what it started
       (daemons, redis-server, Mooncake processes, client processes) and
       removed its temporary directories. Every tool's ``__main__`` block is
       ``run_main(main)``, which does this; a tool that has more to say (where
       its work directory was kept) prints its own ``TOOL: ...interrupted...``
       line and returns 130 itself. A second Ctrl-C while that cleanup runs is
       ignored, and a first one that arrives during a cleanup waits for it to end
       (``sigint_deferred``, around the tools' ``finally`` blocks), so that the
       cleanup finishes. Child processes that the tool
       stops itself are started so that a Ctrl-C on the terminal (sent to the
       whole process group) does not make each of them print a traceback.

Paths
    ``check_output_file`` / ``check_output_dir`` really try: they create and
    remove a temporary file in the directory (or its nearest existing
    ancestor), or open an existing file for appending without writing, so a
    read-only place is refused before the work even for root, for whom
    ``os.access`` says yes to everything.

The converters raise ``argparse.ArgumentTypeError``: argparse then names the
option in its one line (``argument --procs: must be an integer >= 1, got 0``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn, TypeVar

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


def _os_text(exc: OSError) -> str:
    return exc.strerror or " ".join(str(exc).split()) or type(exc).__name__


def _try_create_in(d: Path) -> str | None:
    """Create and remove a temporary file in directory ``d``: the OS error text if that fails."""
    try:
        fd, name = tempfile.mkstemp(prefix=".kvstack-write-check-", dir=d)
    except OSError as exc:
        return _os_text(exc)
    os.close(fd)
    try:
        os.unlink(name)
    except OSError:
        pass
    return None


def _creatable_under(path: Path) -> str | None:
    anc = _nearest_existing(path)
    if not anc.is_dir():
        return f"{path}: {anc} is not a directory"
    if err := _try_create_in(anc):
        return f"{path}: {anc} is not writable ({err})"
    return None


def check_output_file(path: str | os.PathLike, option: str = "--out") -> str | None:
    """Why ``path`` can not be written as a results file (None: it can): checked before the work.

    An existing file is opened for appending (nothing is written); a new one is tried by creating
    and removing a temporary file in its nearest existing directory."""
    p = Path(path)
    if p.exists():
        if not p.is_file():
            return f"{option} {p} exists and is not a regular file"
        try:
            with open(p, "ab"):
                pass
        except OSError as exc:
            return f"{option} {p} is not writable ({_os_text(exc)})"
        return None
    msg = _creatable_under(p)
    return f"{option} {msg}" if msg else None


def check_output_dir(path: str | os.PathLike, option: str = "--out") -> str | None:
    """Why ``path`` can not be used (or created) as a results directory (None: it can)."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            return f"{option} {p} exists and is not a directory"
        err = _try_create_in(p)
        return f"{option} {p} is not writable ({err})" if err else None
    msg = _creatable_under(p)
    return f"{option} {msg}" if msg else None


def check_existing_dir(path: str | os.PathLike, option: str) -> str | None:
    """Why ``path`` is not an existing writable directory (None: it is)."""
    p = Path(path)
    if not p.is_dir():
        return f"{option} {p} is not an existing directory"
    err = _try_create_in(p)
    return f"{option} {p} is not writable ({err})" if err else None


def _interrupt_once(signum, frame) -> None:
    """SIGINT: raise ``KeyboardInterrupt`` once; later ones are ignored so that cleanup finishes."""
    signal.signal(signal.SIGINT, lambda *_: None)  # a Python handler: children started later get the default
    raise KeyboardInterrupt


def run_main(main: Callable[[], int | None], prog: str | None = None) -> NoReturn:
    """Rule 5: run a tool's ``main()`` and exit with its status; Ctrl-C is one line and 130.

    ``KeyboardInterrupt`` reaches here only after the tool's ``finally`` blocks ran (they stop
    what the tool started); it becomes ``PROG: interrupted`` on stderr and exit status 130.
    ``prog`` defaults to the script's file name."""
    prog = prog or Path(sys.argv[0]).name
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _interrupt_once)
    except ValueError:  # not the main thread: leave SIGINT as it is
        pass
    try:
        status = main()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # nothing left to clean up: a second Ctrl-C changes nothing
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        status = 130
    sys.exit(status)


@contextlib.contextmanager
def _sigint_as(handler: Any) -> Iterator[Any]:
    """SIGINT goes to ``handler`` inside the block; yields the handler it replaced (``None``
    outside the main thread, where nothing is changed)."""
    try:
        old = signal.signal(signal.SIGINT, handler)
    except ValueError:
        yield None
        return
    try:
        yield old
    finally:
        signal.signal(signal.SIGINT, old)


@contextlib.contextmanager
def sigint_ignored_in_children() -> Iterator[None]:
    """Processes started inside this block ignore SIGINT (an inherited ``SIG_IGN``).

    For child processes the tool stops itself in its ``finally``: a Ctrl-C on the terminal
    reaches the whole process group, and each child would print its own ``KeyboardInterrupt``
    traceback. The tool ignores SIGINT only while inside (the time to start the processes)."""
    with _sigint_as(signal.SIG_IGN):
        yield


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """A tool's cleanup (rule 5): a Ctrl-C that arrives inside waits until the block is done,
    then interrupts as usual (``KeyboardInterrupt``), so a cleanup is never cut short half way
    (a child left running, a directory half removed). Blocks nest: an inner one hands the
    Ctrl-C to the outer one. A Ctrl-C after the first (ignored by ``run_main``'s handler)
    stays ignored. Outside the main thread: no change."""
    got: list[int] = []
    old = None
    try:
        with _sigint_as(lambda *_: got.append(1)) as old:
            yield
    finally:
        if got and callable(old):  # handed to the handler it deferred: an outer block's, or the raise
            old(signal.SIGINT, None)


def one_line(exc: BaseException) -> str:
    """``Type: message`` on one line (for the ``TOOL: error: ...`` of a run that failed)."""
    text = " ".join(str(exc).split()) or repr(exc)
    return f"{type(exc).__name__}: {text}"
