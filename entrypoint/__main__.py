"""``python -m entrypoint``: run the entrypoint service on loopback.

The first line on stdout is ``READY <json>`` with the bound address; workers
join with ``python -m entrypoint.worker --role ... --entrypoint ADDRESS``.
A usage error (a bad flag value, an unknown model or policy, a tenant with
an empty or shared salt or given twice, a store that cannot be opened, a bad or
unreadable worker secret, a non-loopback ``--host`` without one, a TLS file
that is missing, not PEM or not matching) is one line on
stderr and exit code 2, never a traceback; it is found before anything listens.

Worker secret (``entrypoint.auth``): ``--worker-secret-file FILE``, else the
``KVSTACK_WORKER_SECRET`` environment variable; workers must have the same one
(they send it to ``Register``, and require it of the entrypoint's calls).
Without either, the entrypoint serves on loopback only and warns once.

Client tokens (``entrypoint.client_tokens``): ``--client-tokens FILE`` (the kvstore
daemon's tokens-file format) makes every ``Generate`` act for its bearer
token's tenant only. Without it the request's tenant field is trusted, and an
entrypoint with several tenants serves on loopback only.

TLS (``entrypoint.tls``, which says which hop uses which file): ``--tls-cert C
--tls-key K`` serve the entrypoint's port (clients' ``Generate`` and workers'
``Register`` alike) over TLS, and READY then says ``grpcs://HOST:PORT``;
``--tls-client-ca CA`` adds mutual TLS (every caller, client or worker, needs a
certificate signed by CA). ``--worker-ca FILE`` dials the workers over TLS
(they serve with their own ``--tls-cert``/``--tls-key``), verifying them with
FILE; ``--worker-cert``/``--worker-key``: the certificate presented to workers
that require one. Any of these three dials the workers over TLS only (with no
``--worker-ca``, verified with the system roots) and refuses a worker that
registers a plaintext address. A mix that cannot work (a cert without its key, ``--tls-client-ca``
without both) or a file that is not the PEM it should be is one line and exit
code 2, as is a key that does not match its certificate (found when binding).

``--max-model-len N``: prompt + ``max_new_tokens`` over N is refused
(INVALID_ARGUMENT) before any prefill; 0 is no bound. Default: the model
preset's ``max_model_len`` when it has one, else 0. A request no decode
worker up could hold even empty (its pool less the Decode LB's 5 % headroom)
is refused before its prefill (RESOURCE_EXHAUSTED) whatever this bound;
``--max-model-len`` states the limit to clients up front, also while no
decode worker is up.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading

import kvstore
from entrypoint._cli import OneLineParser, fail
from entrypoint.auth import SECRET_ENV, load_worker_secret
from entrypoint.config import EntrypointConfig
from entrypoint.server import serve
from entrypoint.tls import ChannelTLS, ServerTLS, add_serve_args
from kvstore.api import DTYPES
from kvstore.auth import read_tokens_file
from lb.registry import POLICIES
from lb.types import LBError


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m entrypoint", description="kvstack entrypoint")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (0: a free one, printed in READY)")
    ap.add_argument("--store", default="./kvstack-data", help="kvstore URL (a data directory or grpc://...)")
    ap.add_argument("--model", default="tiny", help="reference model preset (fixes the key namespace)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV block (the workers' too)")
    ap.add_argument("--tenant", action="append", default=[], metavar="NAME=SALT",
                    help="a tenant and its key salt (repeatable); default: one tenant 'default'")
    ap.add_argument("--prefill-policy", default="kvstack", choices=sorted(POLICIES),
                    help="prefill load-balancing policy (lb/registry.py)")
    ap.add_argument("--heartbeat-s", type=float, default=0.5,
                    help="seconds between worker Status checks (a worker missing 3 is dropped)")
    ap.add_argument("--worker-timeout-s", type=float, default=3600.0,
                    help="bound on one Encode/Prefill call, and on a Decode stream's wait for its next token "
                         "(not on its length)")
    ap.add_argument("--max-inflight", type=int, default=64, help="requests served at once; more get RESOURCE_EXHAUSTED")
    ap.add_argument("--max-model-len", type=int, default=None, metavar="N",
                    help="refuse prompt + max_new_tokens over N before any prefill (0: no bound; default: the "
                         "model preset's max_model_len if it has one, else 0)")
    ap.add_argument("--worker-secret-file", default="", metavar="FILE",
                    help=f"file holding the secret shared with the workers: they send it to Register, and "
                         f"it is sent on every call to them (default: ${SECRET_ENV}; none: loopback only, "
                         "with a warning)")
    ap.add_argument("--client-tokens", default="", metavar="FILE",
                    help="TOML file of client bearer tokens ([tokens] \"TOKEN\" = \"TENANT\"): each Generate then "
                         "acts for its token's tenant only (entrypoint.client_tokens; default: none, the request's "
                         "tenant field is trusted, and several tenants serve on loopback only)")
    t = add_serve_args(ap, "mutual TLS: every caller (client or worker) needs a certificate signed by this CA")
    t.add_argument("--worker-ca", default="", metavar="FILE",
                   help="call the workers over TLS only, verifying their certificates with this CA "
                        "(none but --worker-cert: TLS only all the same, verified with the system roots)")
    t.add_argument("--worker-cert", default="", metavar="FILE",
                   help="client certificate presented to workers started with --tls-client-ca; it too makes "
                        "the worker calls TLS only (a plaintext worker is refused)")
    t.add_argument("--worker-key", default="", metavar="FILE", help="the private key of --worker-cert")
    try:
        a = ap.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), its one line already printed
        return int(exc.code or 0)
    if not 0 <= a.port <= 65535:
        return fail(ap.prog, f"--port must be in [0, 65535], got {a.port}")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from engine_plugin.reference.config import model_preset

    tenants = {"default": b""}  # an explicit --tenant default=SALT replaces this one
    given: set[str] = set()
    for t in a.tenant:
        name, _, salt = t.partition("=")
        if not name:
            return fail(ap.prog, f"--tenant needs NAME=SALT, got {t!r}")
        if name in given:
            return fail(ap.prog, f"--tenant {name!r} is given twice; give each tenant once")
        given.add(name)
        tenants[name] = salt.encode()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        tls = ServerTLS(a.tls_cert, a.tls_key, a.tls_client_ca)
        worker_tls = (ChannelTLS(a.worker_ca, a.worker_cert, a.worker_key,
                                 names=("--worker-ca", "--worker-cert", "--worker-key"))
                      if a.worker_ca or a.worker_cert or a.worker_key else None)
        mcfg = model_preset(a.model)
        # The reference presets have no context length today (RoPE has no position limit): no bound.
        max_model_len = getattr(mcfg, "max_model_len", 0) if a.max_model_len is None else a.max_model_len
        cfg = EntrypointConfig(namespace=mcfg.namespace(), block_size=a.block_size, tenants=tenants,
                               prefill_policy=a.prefill_policy, max_inflight=a.max_inflight,
                               worker_timeout_s=a.worker_timeout_s,
                               kv_bytes_per_token=mcfg.d_global * DTYPES[mcfg.dtype],
                               max_model_len=max_model_len,
                               worker_secret=load_worker_secret(a.worker_secret_file),
                               client_tokens=read_tokens_file(a.client_tokens)[0] if a.client_tokens else {},
                               worker_tls=worker_tls)
        return serve(cfg, a.store, host=a.host, port=a.port, heartbeat_s=a.heartbeat_s, stop=stop, tls=tls,
                     ready=lambda addr: print("READY " + json.dumps({"address": addr}), flush=True))
    except (kvstore.KVStoreError, LBError, OSError) as exc:
        return fail(ap.prog, exc)


if __name__ == "__main__":
    sys.exit(main())
