"""Shared command-line conventions of the entrypoint's programs (``python -m entrypoint``,
``python -m entrypoint.worker``, ``kvstack``).

A usage error is *one line* on stderr, ``PROG: error: WHAT TO FIX``, and exit
code 2; never a traceback and never the usage block (``--help`` prints that).
``OneLineParser`` makes argparse's own errors follow the rule; ``fail`` prints
an error the program found itself (a typed ``kvstore``/``lb`` error, an
``OSError``) the same way and returns the exit code.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows an option's default, unless it has none to show (``""``, ``None``, ``[]``:
    "(default: )" says nothing; the option's help says what its absence means)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in ("", None, []):
            return action.help
        return super()._get_help_string(action)


class OneLineParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose usage errors are one line (module docstring)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _DefaultsHelp)  # --help shows defaults
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def fail(prog: str, exc: BaseException | str, code: int = 2) -> int:
    """Print ``prog: error: exc`` on one line to stderr; return ``code`` (2: a usage error)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
    return code
