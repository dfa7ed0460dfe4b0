"""``kvstore`` console script: ``kvstore serve`` runs the daemon in the foreground.

Flags are generated from the ``ServerConfig`` and ``StoreConfig`` fields
(``--gc-interval-s``, ``--data-dir``, ``--ec-k``, ``--targets URL,URL`` ...), so
every knob has a flag, a ``KVSTORE_<FIELD>`` variable and a TOML key, with
precedence flags > env > TOML > defaults. With no flags at all it serves
``./kvstack-data`` on 127.0.0.1:7070. Only the values used must be valid: a bad
``KVSTORE_PORT=abc`` under ``--port 7071`` (or a bad file key under a variable or
flag) is logged as a warning naming it, and the daemon starts.

On start it prints one line to stdout, ``kvstore serving grpc://HOST:PORT``
(plus ``metrics http://HOST:PORT/metrics`` when enabled), so scripts and tests
can read the bound address when ``--port 0`` picked a free one. SIGTERM or
SIGINT drains and exits 0.

A start that cannot succeed (a bad option or config file, a data directory that
cannot be opened, a port in use, a TLS key that does not match its certificate)
prints one line, ``kvstore serve: <what is wrong and what to do>``, to stderr
and exits 2, with nothing left open.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from typing import Sequence

from kvstore.cli.conventions import LOG_LEVELS, ExitCode, log_level
from kvstore.errors import KVStoreError
from kvstore.netaddr import host_port
from kvstore.server.config import SERVER_FIELDS, STORE_FIELDS, load_server_config
from kvstore.server.service import Daemon


# Fields whose unset default means something the value alone does not say.
_DEFAULT_HELP = {"ec_k": "the data directory's (4 for a new one)", "ec_m": "the data directory's (2 for a new one)",
                 "ec_type": "the data directory's (isa_l_rs_cauchy for a new one)",
                 "metrics_port": "-1 (no Prometheus endpoint; 0: a free port)",
                 "port": "7070 (0: a free port, printed at start)",
                 "max_concurrent_requests": "48, or 3/4 of --workers (must stay below it)",
                 "workers": "64, or a third more than --max-concurrent-requests",
                 "targets": "the data directory's recorded targets, else k+m subdirectories of it; "
                            "URL[#DOMAIN[#NAME]],... e.g. file:///mnt/nvme0/kv#rack1,s3://bucket/kv#az1",
                 "tokens_file": "none (one anonymous tenant); a TOML file: admin_tenants = [...] "
                                "and a [tokens] table of \"token\" = \"tenant\""}


def _add_fields(group: argparse._ArgumentGroup, fields: dict) -> None:
    for name, f in fields.items():
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, metavar=name.upper(),
                           help=f"default: {_DEFAULT_HELP.get(name, repr(f.default))}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvstore", description="kvstore daemon")
    sub = ap.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the kvstore gRPC daemon in the foreground")
    serve.add_argument("--config", default=None, help="TOML file with [server] and [store] tables")
    serve.add_argument("--log-level", default="INFO", help=f"one of {', '.join(LOG_LEVELS)} (default: INFO)")
    _add_fields(serve.add_argument_group("server"), SERVER_FIELDS)
    _add_fields(serve.add_argument_group("store"), STORE_FIELDS)
    return ap


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=log_level(args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    over = {k: getattr(args, k) for k in (*SERVER_FIELDS, *STORE_FIELDS)}
    server_cfg, store_cfg = load_server_config(args.config, **over)
    daemon = Daemon(server_cfg, store_cfg).start()
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        logging.getLogger(__name__).info("signal %d: draining", signum)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    line = f"kvstore serving {daemon.address} data {store_cfg.data_dir}"
    if daemon.metrics.port is not None:
        line += f" metrics http://{host_port(server_cfg.host, daemon.metrics.port)}/metrics"
    print(line, flush=True)
    while not stop.wait(1.0):
        pass
    daemon.stop()
    print("kvstore stopped", flush=True)
    return int(ExitCode.OK)


COMMANDS = {"serve": serve}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except KVStoreError as exc:
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    except OSError as exc:  # the environment refused something (a file, a socket): say what, no traceback
        print(f"kvstore {args.command}: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)


if __name__ == "__main__":
    sys.exit(main())
