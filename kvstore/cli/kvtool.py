"""``kvtool``: the operator's tool for a kvstack store.

Usage (global options go before or after the subcommand)::

    kvtool [--data-dir DIR | STORE] [--config FILE.toml] [--json] [-v] COMMAND [STORE] [options]

    kvtool inspect ./kvstack-data                    # totals by kind, capacity, ages, degraded, lost
    kvtool inspect ./kvstack-data --key HEX --kind swa
    kvtool inspect ./kvstack-data --chain HEX,HEX,HEX
    kvtool inspect ./kvstack-data --parquet index.parquet
    kvtool gc --dry-run ./kvstack-data
    kvtool verify ./kvstack-data                     # exit 1 when anything is missing, corrupt or lost
    kvtool repair ./kvstack-data
    kvtool stats --json file:///var/lib/kv
    kvtool delete ./kvstack-data --key HEX --kind swa

The store is a path, a ``file://`` URL or any URL ``kvstore.connect`` knows
(e.g. a ``grpc://`` daemon once registered); without one, ``KVSTORE_DATA_DIR``,
then ``data_dir`` of ``--config``, then ``./kvstack-data``. ``--config`` is the
store config of a data directory; with a daemon URL it is a usage error (the
daemon runs under its own config).

Contract:
* kvtool never creates a store: a local path without ``kvstore.json`` is a
  usage error (exit 2), so a typo cannot leave an empty store behind.
* stdout carries the result (text, or one JSON document with ``--json``);
  progress and errors go to stderr. A ``KVStoreError`` (or an OS error on the
  data directory) is one line on stderr, never a traceback.
* Exit codes: 0 healthy, 1 problems found, 2 usage error (see
  ``kvstore.cli.commands``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Iterator, Sequence

import kvstore
from kvstore.api import KVStore
from kvstore.cli.commands import COMMANDS, Command, ExitCode, Outcome
from kvstore.cli.progress import ProgressBar
from kvstore.config import load_config
from kvstore.errors import InvalidRequest, KVStoreError

PROG = "kvtool"


def _require_local_store(url: str) -> None:
    """A local data directory must already be a store (kvtool never creates one)."""
    from kvstore.datadir import FORMAT_FILE

    path = Path(url[len("file://"):] if url.startswith("file://") else url)
    if not path.exists():
        raise InvalidRequest(f"{path} does not exist; give the data directory of an existing store")
    if not (path / FORMAT_FILE).is_file():
        raise InvalidRequest(f"{path} is not a kvstore data directory (no {FORMAT_FILE})")


# URL scheme -> check run before opening ("" is a plain path). Unlisted schemes open directly.
PRECHECKS: dict[str, Callable[[str], None]] = {"": _require_local_store, "file": _require_local_store}

# URL schemes whose store reads a store config (``--config``): a data directory. A daemon
# (``grpc://``) runs under its own config, so ``--config`` with any other scheme is a usage error.
CONFIG_SCHEMES: frozenset[str] = frozenset({"", "file"})


def _common_options(subcommand: bool) -> argparse.ArgumentParser:
    """Global options; on subparsers their defaults are SUPPRESS so they never undo the top level's."""
    def dflt(v: object) -> object:
        return argparse.SUPPRESS if subcommand else v

    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--data-dir", dest="data_dir", metavar="DIR", default=dflt(None),
                   help="store path or URL (default: $KVSTORE_DATA_DIR, the config's data_dir, ./kvstack-data)")
    p.add_argument("--config", metavar="FILE.toml", default=dflt(None),
                   help="store config (TOML) of a data directory; not for a daemon URL")
    p.add_argument("--json", action="store_true", default=dflt(False), help="print one JSON document")
    p.add_argument("-v", "--verbose", action="count", default=dflt(0),
                   help="show store log messages (-v warnings, -vv info)")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, parents=[_common_options(False)],
                                     description="Inspect, verify, repair and clean a kvstack store.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, parents=[_common_options(True)])
        p.add_argument("store", nargs="?", default=None, help="store path or URL")
        cmd.configure(p)
    return parser


_TAKES_VALUE = {"--data-dir", "--config"}


def hoist_leading_store(argv: Sequence[str]) -> list[str]:
    """Accept the store before the command too: ``kvtool STORE verify`` == ``kvtool verify STORE``.

    The first bare word that is not a command, when a command follows it, becomes
    ``--data-dir WORD``; anything else is left for argparse to judge.
    """
    argv = list(argv)
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            break
        if tok in _TAKES_VALUE:
            i += 2
            continue
        if tok.startswith("-"):
            i += 1
            continue
        if tok not in COMMANDS and any(t in COMMANDS for t in argv[i + 1:]):
            return argv[:i] + ["--data-dir", tok] + argv[i + 1:]
        break
    return argv


def resolve_url(args: argparse.Namespace) -> str:
    if args.store and args.data_dir and args.store != args.data_dir:
        raise InvalidRequest(f"two stores given ({args.store!r} and --data-dir {args.data_dir!r}); give one")
    url = args.store or args.data_dir
    if url:
        return url
    return load_config(args.config).data_dir  # env KVSTORE_DATA_DIR > TOML data_dir > default


def open_store(url: str, config: str | None) -> KVStore:
    """Open the store at ``url``; ``config`` (a TOML store config) applies only to a data
    directory. Raises ``InvalidRequest`` for ``--config`` with another URL, or for a local
    path that is not an existing store."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if config and scheme not in CONFIG_SCHEMES:
        raise InvalidRequest(f"--config applies only to a data directory, not to {url}; "
                             "drop --config (the daemon uses its own config)")
    check = PRECHECKS.get(scheme)
    if check is not None:
        check(url)
    overrides = {"config_file": config} if config else {}
    return kvstore.connect(url, **overrides)


@contextlib.contextmanager
def store_logging(verbose: int) -> Iterator[None]:
    """Quiet the store's own log while kvtool runs (it reports problems itself; the
    per-fragment warnings would drown them); ``-v`` shows warnings, ``-vv`` info, on stderr.
    The logger's previous state is restored, so an in-process caller is left as it was."""
    lg = logging.getLogger("kvstore")
    old = (lg.level, lg.propagate, list(lg.handlers))
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{PROG}: %(levelname)s %(name)s: %(message)s"))
        lg.handlers, lg.propagate = [handler], False
        lg.setLevel(logging.WARNING if verbose == 1 else logging.INFO)
    else:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        lg.setLevel(old[0])
        lg.propagate, lg.handlers = old[1], old[2]


def emit(outcome: Outcome, as_json: bool) -> None:
    if as_json:
        print(json.dumps(outcome.data, indent=2, sort_keys=True, default=str))
    elif outcome.text:
        print(outcome.text)


def main(argv: Sequence[str] | None = None) -> int:
    """Run kvtool; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(hoist_leading_store(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), message already printed
        return int(exc.code or 0)
    with store_logging(args.verbose):
        return _run(COMMANDS[args.command], args)


def _run(cmd: Command, args: argparse.Namespace) -> int:
    try:
        store = open_store(resolve_url(args), args.config)
    except (KVStoreError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    progress = ProgressBar(sys.stderr)
    try:
        outcome = cmd.run(store, args, progress)
    except (KVStoreError, OSError) as exc:
        progress.close()
        print(f"{PROG}: error: {cmd.name}: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    finally:
        progress.close()
        store.close()
    try:
        emit(outcome, args.json)
        sys.stdout.flush()
    except BrokenPipeError:  # `kvtool ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return int(outcome.code)

if __name__ == "__main__":
    sys.exit(main())
