"""``kvtool``: the operator's tool for a kvstack store.

Usage (global options go before or after the subcommand)::

    kvtool [--data-dir DIR | STORE] [--config FILE.toml] [--json] [-v] COMMAND [STORE] [options]
           [--token-file FILE] [--ca-file FILE] [--cert-file FILE --key-file FILE] [--timeout SECONDS]

    kvtool inspect ./kvstack-data                    # totals by kind, capacity, ages, degraded, lost
    kvtool inspect ./kvstack-data --key HEX --kind swa
    kvtool inspect ./kvstack-data --chain HEX,HEX,HEX
    kvtool inspect ./kvstack-data --parquet index.parquet
    kvtool gc --dry-run ./kvstack-data
    kvtool verify ./kvstack-data                     # exit 1 when anything is missing, corrupt or lost
    kvtool repair ./kvstack-data
    kvtool stats --json file:///var/lib/kv
    kvtool delete ./kvstack-data --key HEX --kind swa
    kvtool rebuild-index ./kvstack-data              # a new index from the fragments (index lost or damaged)
    kvtool migrate ./kvstack-data                    # an older format version to this one (processes stopped)
    KVSTORE_TOKEN=... kvtool verify grpc://10.0.0.5:7070 --timeout 600
    kvtool stats grpc://h1:7070,grpc://h2:7070        # a sharded set

The store is a path, a ``file://`` URL or any URL ``kvstore.connect`` knows
(e.g. a ``grpc://`` daemon once registered); without one, ``KVSTORE_DATA_DIR``,
then ``data_dir`` of ``--config``, then ``./kvstack-data``. ``--config`` is the
store config of a data directory; with a daemon URL it is a usage error (the
daemon runs under its own config).

A daemon (``grpc://HOST:PORT``, ``grpcs://`` for TLS, a comma list for a sharded
set) is reached with the client's environment (``DAEMON_ENV``: ``KVSTORE_TOKEN``,
``KVSTORE_CA_FILE``, ``KVSTORE_CERT_FILE``, ``KVSTORE_KEY_FILE``) or the flags
``--token-file``, ``--ca-file``, ``--cert-file``, ``--key-file`` (a flag wins over
its variable; there is no ``--token``: a token on the command line is visible to
every user in the process list). ``--timeout SECONDS`` is the deadline of every call
to the daemon (default: 60 s, and 3600 s for verify, repair, gc, rebuild-index and
inspect --parquet); past it
kvtool says so in one line and exits 2. These flags with a data directory are a
usage error, as ``--config`` with a daemon is. ``stats``, ``verify``, ``repair``,
``gc``, ``rebuild-index`` and ``inspect`` without ``--key``/``--chain`` (``--parquet`` too)
need an admin tenant's token when the daemon has a tokens file.

Contract:
* kvtool never creates a store: a local path without ``kvstore.json`` is a
  usage error (exit 2), so a typo cannot leave an empty store behind.
* stdout carries the result (text, or one JSON document with ``--json``);
  progress and errors go to stderr (progress of verify, repair and gc through a
  daemon too: its ``Maintain`` call; through a set of daemons each shard's phases are
  named after its URL). A ``KVStoreError`` (or an OS error on the
  data directory) is one line on stderr, never a traceback.
* A result that cannot be written (a full disk, stdout closed) is one line,
  ``kvtool: error: cannot write the result: REASON``, and exit 2, never 1 (which
  would read as problems found). A reader that left (``kvtool ... | head``) is not
  an error: the exit code is the command's.
* Exit codes: 0 healthy, 1 problems found, 2 usage error, store unreachable or
  result unwritable (see ``kvstore.cli.commands``), 130 interrupted (Ctrl-C: one line,
  ``kvtool: interrupted``, no traceback; while kvstore is still being imported too: the
  console script's entry is ``kvtool_entry.main``, which imports this module inside it).
* One store per run: two different ones (``kvtool A verify --data-dir B``, ``--data-dir``
  before and after the command, ``kvtool verify A --data-dir B``) are a usage error.
* gRPC's own C-core log (e.g. a TLS "Handshake failed" line) is silenced: ``main``
  sets ``GRPC_VERBOSITY=NONE`` before gRPC is loaded, unless the caller set
  ``GRPC_VERBOSITY`` (set it to see those lines).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import textwrap
from pathlib import Path
from typing import Callable, Iterator, Sequence

import kvstore
from kvstore.api import KVStore
from kvstore.cli.commands import COMMANDS, Command, Outcome
from kvstore.cli.conventions import EXIT_INTERRUPTED, ExitCode, given_file, one_line, seconds
from kvstore.cli.progress import ProgressBar
from kvstore.config import load_config
from kvstore.errors import CapacityExceeded, CorruptData, DeadlineExceeded, InvalidRequest, KVStoreError

PROG = "kvtool"


# A scheme ``kvstore.connect`` knows, then ":" but not "://": "grpc:/h:p", "grpcs:h:p" (a typo).
_MISTYPED_URL = re.compile(r"^\s*([A-Za-z][A-Za-z0-9+.-]*):(?!//)")


def _require_local_store(url: str) -> None:
    """A local data directory must already be a store (kvtool never creates one)."""
    from kvstore.embedded.datadir import FORMAT_FILE

    m = _MISTYPED_URL.match(url)
    scheme = m.group(1).lower() if m else ""
    if scheme in kvstore.CONNECTORS and scheme not in CONFIG_SCHEMES and not Path(url).exists():
        # "grpc:/h:p": a mistyped daemon URL, not a directory that does not exist (kvstore.connect's words)
        raise InvalidRequest(f"{url!r} is not a {scheme} URL: write {scheme}://HOST:PORT")
    path = Path(url[len("file://"):] if url.startswith("file://") else url)
    if not path.exists():
        raise InvalidRequest(f"{path} does not exist; give the data directory of an existing store")
    if not (path / FORMAT_FILE).is_file():
        index = path / "index" / "data.mdb"
        if not (index.is_file() and index.stat().st_size > 0):
            raise InvalidRequest(f"{path} is not a kvstore data directory (no {FORMAT_FILE}, no index)")
        # A store whose marker was lost: opening it rewrites the marker from the index
        # (kvstore.embedded.datadir), as the store and the daemon do.
        print(f"{PROG}: note: {path} has no {FORMAT_FILE}; opening it rewrites it from the index", file=sys.stderr)


# URL scheme -> check run before opening ("" is a plain path). Unlisted schemes open directly.
PRECHECKS: dict[str, Callable[[str], None]] = {"": _require_local_store, "file": _require_local_store}

# URL schemes whose store reads a store config (``--config``): a data directory. A daemon
# (``grpc://``) runs under its own config, so ``--config`` with any other scheme is a usage error.
CONFIG_SCHEMES: frozenset[str] = frozenset({"", "file"})

# How kvtool reaches a daemon: client option <- (flag, environment variable). A flag wins over
# its variable (``kvstore.client.options.ClientOptions.from_overrides``); the token comes from a file.
DAEMON_ENV: dict[str, tuple[str, str]] = {
    "token": ("--token-file", "KVSTORE_TOKEN"),
    "ca_file": ("--ca-file", "KVSTORE_CA_FILE"),
    "cert_file": ("--cert-file", "KVSTORE_CERT_FILE"),
    "key_file": ("--key-file", "KVSTORE_KEY_FILE"),
}
# client option -> the kvtool flag that sets it (for messages)
FLAG_OF: dict[str, str] = {**{o: f for o, (f, _) in DAEMON_ENV.items()},
                           "timeout_s": "--timeout", "maintenance_timeout_s": "--timeout"}

EPILOG = """\
daemons:
  STORE may be grpc://HOST:PORT (grpcs:// for TLS) or a comma list of them (a sharded set).
  These reach it, the flag winning over its variable:
    KVSTORE_TOKEN      bearer token (--token-file FILE reads it from a file); stats, verify,
                       repair, gc, rebuild-index, inspect's summary and --parquet need a token
                       of an admin tenant
    KVSTORE_CA_FILE    CA certificate (PEM) that signed the daemon's certificate (--ca-file)
    KVSTORE_CERT_FILE  client certificate for mutual TLS (--cert-file)
    KVSTORE_KEY_FILE   its private key (--key-file)
  --timeout SECONDS   deadline of each call to a daemon (default 60 s; 3600 s for verify,
                      repair, gc, rebuild-index and inspect --parquet); a call past it is one
                      error line, exit 2
  GRPC_VERBOSITY      unset: kvtool silences gRPC's own log lines; set it to see them

exit codes: 0 healthy, 1 problems found (a shard of a sharded set did not answer; gc cannot get under capacity),
2 usage error, the store could not be reached or the result could not be written, 130 interrupted (Ctrl-C)
"""


def _common_options(subcommand: bool) -> argparse.ArgumentParser:
    """Global options; on subparsers their defaults are SUPPRESS so they never undo the top level's."""
    def dflt(v: object) -> object:
        return argparse.SUPPRESS if subcommand else v

    p = argparse.ArgumentParser(add_help=False)
    # Its own dest after the command: argparse copies a subcommand's values over the top
    # level's, so one dest would let ``--data-dir B`` there silently replace ``--data-dir A``
    # (or a hoisted ``A``) given before it; ``resolve_url`` compares every store given.
    p.add_argument("--data-dir", dest=STORE_DESTS[1] if subcommand else STORE_DESTS[0], metavar="DIR",
                   action=OneStore, default=dflt(None),
                   help="store path or URL (default: $KVSTORE_DATA_DIR, the config's data_dir, ./kvstack-data)")
    p.add_argument("--config", metavar="FILE.toml", default=dflt(None),
                   help="store config (TOML) of a data directory; not for a daemon URL")
    p.add_argument("--json", action="store_true", default=dflt(False), help="print one JSON document")
    p.add_argument("-v", "--verbose", action="count", default=dflt(0),
                   help="show store log messages (-v warnings, -vv info)")
    d = p.add_argument_group("daemon options (grpc:// and grpcs:// stores only)")
    d.add_argument("--token-file", metavar="FILE", type=given_file, default=dflt(None),
                   help="read the bearer token from FILE (default: $KVSTORE_TOKEN)")
    d.add_argument("--ca-file", metavar="FILE", type=given_file, default=dflt(None),
                   help="CA that signed the daemon's certificate (default: $KVSTORE_CA_FILE)")
    d.add_argument("--cert-file", metavar="FILE", type=given_file, default=dflt(None),
                   help="client certificate for mutual TLS (default: $KVSTORE_CERT_FILE)")
    d.add_argument("--key-file", metavar="FILE", type=given_file, default=dflt(None),
                   help="client private key for mutual TLS (default: $KVSTORE_KEY_FILE)")
    d.add_argument("--timeout", metavar="SECONDS", type=seconds, default=dflt(None),
                   help="deadline of each call to the daemon (default: 60, and 3600 for verify, repair, gc, "
                        "rebuild-index, inspect --parquet)")
    return p


# Where the parsed arguments keep a ``--data-dir`` given before / after the command.
STORE_DESTS = ("data_dir", "data_dir_after_command")


class OneStore(argparse.Action):
    """``--data-dir``: a second, different store at the same place (``--data-dir A --data-dir
    B``, or ``kvtool A --data-dir B verify``) is a usage error, exit 2, not the last one winning."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        before = getattr(namespace, self.dest, None)
        if before is not None and before != values:
            raise argparse.ArgumentError(self, f"two stores given ({before!r} and {values!r}); give one")
        setattr(namespace, self.dest, values)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, parents=[_common_options(False)], epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     description="Inspect, verify, repair and clean a kvstack store.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=textwrap.fill(cmd.description or cmd.help, 80),
                           parents=[_common_options(True)], epilog=EPILOG,
                           formatter_class=argparse.RawDescriptionHelpFormatter)  # the epilog's layout kept
        p.add_argument("store", nargs="?", default=None, help="store path or URL")
        cmd.configure(p)
    return parser


_TAKES_VALUE = {"--data-dir", "--config", "--token-file", "--ca-file", "--cert-file", "--key-file", "--timeout"}


def hoist_leading_store(argv: Sequence[str]) -> list[str]:
    """Accept the store before the command too: ``kvtool STORE verify`` == ``kvtool verify STORE``.

    The first bare word that is not a command, when a command follows it, becomes
    ``--data-dir WORD``; anything else is left for argparse to judge. A different store given
    as well (``kvtool A verify --data-dir B``) is refused, not chosen (``resolve_url``).
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
    """The store to open: the one given (the ``STORE`` word, before or after the command, or
    ``--data-dir`` before or after it; the same one any number of times), else the config's.
    Raises ``InvalidRequest`` when two different stores are given (kvtool never guesses which)."""
    given = [getattr(args, "store", None)] + [getattr(args, dest, None) for dest in STORE_DESTS]
    stores = list(dict.fromkeys(g for g in given if g))
    if len(stores) > 1:
        raise InvalidRequest(f"two stores given ({' and '.join(repr(s) for s in stores)}); give one")
    if stores:
        return stores[0]
    return load_config(args.config).data_dir  # env KVSTORE_DATA_DIR > TOML data_dir > default


def daemon_options(args: argparse.Namespace) -> dict[str, object]:
    """The client options the daemon flags give (``kvstore.connect`` overrides); unset flags
    are left out, so the environment (``DAEMON_ENV``) applies. Raises ``InvalidRequest`` for a
    token file that cannot be read or is empty."""
    opts: dict[str, object] = {}
    for option, (flag, _env) in DAEMON_ENV.items():
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None and option == "token":
            try:
                value = Path(value).read_text().strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidRequest(f"--token-file {value}: cannot read it ({exc})") from exc
            if not value:
                raise InvalidRequest(f"--token-file {args.token_file} is empty; put the bearer token in it")
        if value is not None:
            opts[option] = value
    if args.timeout is not None:
        opts["timeout_s"] = opts["maintenance_timeout_s"] = args.timeout
    return opts


def open_store(url: str, config: str | None, daemon: dict[str, object] | None = None) -> KVStore:
    """Open the store at ``url``; ``config`` (a TOML store config) applies only to a data
    directory, ``daemon`` (``daemon_options``) only to a daemon URL. Raises ``InvalidRequest``
    for either with the other kind of store, for a mistyped daemon URL, or for a local path
    that is not an existing store."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if config and scheme not in CONFIG_SCHEMES:
        raise InvalidRequest(f"--config applies only to a data directory, not to {url}; "
                             "drop --config (the daemon uses its own config)")
    if daemon and scheme in CONFIG_SCHEMES:
        flags = ", ".join(dict.fromkeys(FLAG_OF[o] for o in daemon))
        raise InvalidRequest(f"{flags}: daemon options, for a grpc://HOST:PORT store, not for the data "
                             f"directory {url}; drop them")
    check = PRECHECKS.get(scheme)
    if check is not None:
        check(url)
    overrides = {"config_file": config} if config else dict(daemon or {})
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


def render(outcome: Outcome, as_json: bool) -> str | None:
    """What kvtool prints on stdout for ``outcome`` (``None``: nothing)."""
    if as_json:
        return json.dumps(outcome.data, indent=2, sort_keys=True, default=str)
    return outcome.text or None


class ResultUnwritable(Exception):
    """The process has no stdout to write the result to (``emit``)."""


def emit(outcome: Outcome, as_json: bool) -> None:
    """Print ``outcome`` on stdout and flush it. Raises ``OSError`` when stdout cannot be
    written (``BrokenPipeError`` when the reader left), ``ValueError`` when it is closed,
    and ``ResultUnwritable`` when there is no stdout at all (started with fd 1 closed)."""
    text = render(outcome, as_json)  # before writing: a rendering bug must not read as an I/O error
    if sys.stdout is None:
        raise ResultUnwritable("stdout is closed")
    if text is not None:
        print(text)
    sys.stdout.flush()


def _discard_stdout() -> None:
    """Point stdout's descriptor at the null device, so the interpreter's last flush of what
    could not be written does not fail again (a second error, exit 120)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        fd = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


@contextlib.contextmanager
def quiet_grpc_core() -> Iterator[None]:
    """``GRPC_VERBOSITY=NONE`` for this run, so gRPC's C core prints no log line of its own
    (a TLS failure's "Handshake failed", connectivity notes) before kvtool's one-line error.
    Only when the caller has not set ``GRPC_VERBOSITY`` and gRPC is not loaded yet (the core
    reads it once, when it starts: a console-script run, where kvtool's imports do not load
    gRPC until a daemon URL is opened). The variable is put back as it was afterwards."""
    if "GRPC_VERBOSITY" in os.environ or "grpc" in sys.modules:
        yield
        return
    os.environ["GRPC_VERBOSITY"] = "NONE"
    try:
        yield
    finally:
        os.environ.pop("GRPC_VERBOSITY", None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run kvtool; returns the exit code (the console script exits with it). Ctrl-C (SIGINT)
    is one line, ``kvtool: interrupted``, and ``EXIT_INTERRUPTED``, never a traceback; the
    store is closed first (``_run``), and what the pass did before it stays done."""
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(hoist_leading_store(sys.argv[1:] if argv is None else argv))
        except SystemExit as exc:  # argparse: --help (0) or a usage error (2), message already printed
            return int(exc.code or 0)
        with store_logging(args.verbose), quiet_grpc_core():
            return _run(COMMANDS[args.command], args)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _error_line(cmd: Command, exc: BaseException) -> str:
    """kvtool's one line for a failed command: what the command needs, not the RPC that said no."""
    code = getattr(exc, "code", "")
    if code == "PERMISSION_DENIED":
        return (f"{cmd.name} needs an admin tenant's token: set KVSTORE_TOKEN (or --token-file) to a token of a "
                f"tenant in the daemon's admin_tenants (the daemon said: {exc})")
    if code == "UNAUTHENTICATED":
        return (f"{cmd.name}: the daemon needs a bearer token it knows: set KVSTORE_TOKEN (or --token-file) "
                f"(the daemon said: {exc})")
    if isinstance(exc, DeadlineExceeded):
        return f"{cmd.name}: {exc}; --timeout SECONDS sets how long kvtool waits"
    return f"{cmd.name}: {exc}"


def _open(cmd: Command, args: argparse.Namespace, progress: ProgressBar) -> KVStore:
    """``open_store`` for ``cmd``; a data directory refused for its index (``CorruptData``) is
    handed to ``cmd.recover`` first when the command has one (``rebuild-index``)."""
    url = resolve_url(args)
    try:
        return open_store(url, args.config, daemon_options(args))
    except CorruptData:
        scheme = url.split("://", 1)[0] if "://" in url else ""
        if cmd.recover is None or scheme not in CONFIG_SCHEMES:
            raise
    args.recovered = cmd.recover(url, args.config, progress)
    return open_store(url, args.config, daemon_options(args))


def data_dir_of(cmd: Command, args: argparse.Namespace) -> str:
    """The data directory a command that works on one without opening it (``on_data_dir``)
    is given: a path or ``file://`` URL. A daemon URL or daemon options are a usage error
    (``InvalidRequest``): such a command needs the directory itself."""
    from kvstore.embedded.datadir import file_url_path

    url = resolve_url(args)
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in CONFIG_SCHEMES:
        raise InvalidRequest(f"{cmd.name} works on a data directory, not on {url}: stop the daemon and run "
                             f"`kvtool {cmd.name}` on its data directory")
    daemon = daemon_options(args)
    if daemon:
        flags = ", ".join(dict.fromkeys(FLAG_OF[o] for o in daemon))
        raise InvalidRequest(f"{flags}: daemon options, for a grpc://HOST:PORT store, not for the data "
                             f"directory {url}; drop them")
    return file_url_path(url)


def _run(cmd: Command, args: argparse.Namespace) -> int:
    progress = ProgressBar(sys.stderr)
    if cmd.run is None:  # works on the data directory itself (``Command.on_data_dir``)
        try:
            outcome = cmd.on_data_dir(data_dir_of(cmd, args), args, progress)
        except (KVStoreError, OSError) as exc:
            print(f"{PROG}: error: {one_line(_error_line(cmd, exc))}", file=sys.stderr)
            return int(ExitCode.USAGE)
        finally:
            progress.close()
        return _emit(cmd, outcome, args.json)
    try:
        store = _open(cmd, args, progress)
    except (KVStoreError, OSError) as exc:
        progress.close()
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    try:
        outcome = cmd.run(store, args, progress)
    except (KVStoreError, OSError) as exc:
        progress.close()
        print(f"{PROG}: error: {one_line(_error_line(cmd, exc))}", file=sys.stderr)
        # a store that cannot get under its capacity is a problem found, not a usage error
        return int(ExitCode.PROBLEMS if isinstance(exc, CapacityExceeded) else ExitCode.USAGE)
    finally:
        progress.close()
        store.close()
    return _emit(cmd, outcome, args.json)


def _emit(cmd: Command, outcome: Outcome, as_json: bool) -> int:
    """Print ``outcome`` (``emit``), then its error lines; the exit code (module contract)."""
    try:
        emit(outcome, as_json)
    except BrokenPipeError:  # `kvtool ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, ResultUnwritable) as exc:
        # A full disk, a closed stdout: the result is lost, which is not "problems found" (1).
        _discard_stdout()
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"{PROG}: error: cannot write the result: {one_line(reason)}", file=sys.stderr)
        return int(ExitCode.USAGE)
    for line in outcome.errors:  # after the result: what was done first, then what was not
        print(f"{PROG}: error: {cmd.name}: {line}", file=sys.stderr)
    return int(outcome.code)

if __name__ == "__main__":
    sys.exit(main())
