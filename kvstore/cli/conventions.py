"""What every command-line tool of kvstore does alike: exit codes, argument values, log
levels, one-line errors.

Who uses it: ``kvtool`` (``kvstore.cli.kvtool`` and its subcommands, ``kvstore.cli.commands``)
and ``kvstore serve`` (``kvstore.server.cli``). The conventions:

* Exit codes (``ExitCode``): 0 healthy / done; 1 problems found; 2 usage error, a store or
  daemon that could not be opened or reached, a result that could not be written.
  ``EXIT_INTERRUPTED`` (130, 128 + SIGINT, as a shell reports it) for Ctrl-C.
* A bad argument value is refused by argparse (exit 2, its usage line) through the value
  types here (``parse_key``, ``parse_chain``, ``non_negative_int``, ``seconds``,
  ``given_file``, ``output_file``), never a traceback.
* An error is one line on stderr, naming the tool (``one_line`` folds a message's
  whitespace into one line).
"""

from __future__ import annotations

import argparse
import enum
import math

from kvstore.errors import InvalidRequest
from kvstore.keys import KEY_LEN


class ExitCode(enum.IntEnum):
    OK = 0
    PROBLEMS = 1
    USAGE = 2


# Exit code of a run stopped by Ctrl-C (SIGINT): 128 + the signal's number, as a shell reports it.
EXIT_INTERRUPTED = 130


def one_line(text: object) -> str:
    """``text`` with its whitespace (newlines included) folded into single spaces."""
    return " ".join(str(text).split())


# ----------------------------------------------------------------------------- argument values
def parse_key(text: str) -> bytes:
    """A block key as hex (argparse ``type``: a bad value is a usage error, exit 2)."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not hex; a key is {2 * KEY_LEN} hex digits") from None
    if len(key) != KEY_LEN:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {len(key)} bytes; a key is {KEY_LEN} bytes ({2 * KEY_LEN} hex digits)")
    return key


def parse_chain(text: str) -> list[bytes]:
    """A prefix chain as comma-separated hex keys, or ``@FILE``: the keys read from FILE,
    separated by commas, spaces or newlines (a chain too long for one argument), argparse
    ``type``. An empty chain or an unreadable file is a usage error."""
    source = text
    if text.startswith("@"):
        try:
            with open(text[1:], encoding="ascii") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read the chain from {text[1:]!r}: "
                                             f"{getattr(exc, 'strerror', None) or exc}") from None
    chain = [parse_key(part) for part in source.replace(",", " ").split()]
    if not chain:
        raise argparse.ArgumentTypeError(f"{text!r} names no key; give one or more {2 * KEY_LEN}-digit hex keys, "
                                         "comma separated, or @FILE")
    return chain


def non_negative_int(text: str) -> int:
    """A count such as ``--limit`` (argparse ``type``: negative or not a number is exit 2)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number; give 0 or more") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative; give 0 or more")
    return n


def seconds(text: str) -> float:
    """A time such as ``--timeout`` (argparse ``type``: not a positive, finite number is exit 2)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(v) and 0 < v <= 1e9):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds above 0")
    return v


def given_file(text: str) -> str:
    """A file the tool reads (argparse ``type``: an empty name is a usage error, exit 2)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty file name; give the path of the file")
    return text


def output_file(text: str) -> str:
    """A file the tool writes (argparse ``type``: an empty name is a usage error, exit 2)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty file name; give the path of the file to write")
    return text


# ----------------------------------------------------------------------------- logging
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(text: str) -> str:
    """``--log-level`` checked (``logging.basicConfig`` raises a bare ``ValueError`` on a bad one)."""
    level = text.strip().upper()
    if level not in LOG_LEVELS:
        raise InvalidRequest(f"unknown --log-level {text!r}; use one of {', '.join(LOG_LEVELS)}")
    return level
