"""The worker secret: who may join (``Register``) or remove (``Deregister``) entrypoint workers.

Why: ``Register`` replaces the address of a worker id. Without a check, any
process that can reach the entrypoint could point a worker id at itself and
receive every prompt routed there (or ``Deregister`` the fleet). So the
entrypoint and its workers share one secret, and the membership calls carry it
as gRPC metadata ``authorization: Bearer <secret>`` (the kvstore daemon's
bearer-token convention, ``kvstore/server/auth.py``). A missing or wrong
secret is UNAUTHENTICATED and changes nothing; it is compared in constant time.
A worker restarted after a failover re-registers under its old id with the
same secret, which replaces its old address as before.

Where the secret comes from, highest first (``load_worker_secret``):
  1. ``--worker-secret-file FILE`` (its content, surrounding whitespace
     stripped; a file, not a flag value, so it never shows in ``ps``);
  2. the ``KVSTACK_WORKER_SECRET`` environment variable;
  3. none.
The same two sources serve ``python -m entrypoint`` and
``python -m entrypoint.worker``. A secret is 16 to 4096 printable ASCII
characters without spaces (a gRPC metadata value), e.g.
``python -c "import secrets; print(secrets.token_urlsafe(32))"``.

No secret at all (``check_listen``): an entrypoint listening on a loopback
address accepts membership calls without one and logs one warning at start,
so a laptop stack needs no configuration; one listening on any other address
refuses to start, since there the whole network could re-route its workers.
``entrypoint.cluster.Cluster`` (the walkthrough, the tests, the benchmarks)
generates a random secret per stack and hands it to the entrypoint and the
workers it starts through the environment, so even the zero-configuration
walkthrough runs with membership authenticated.

Scope: only the membership calls. ``ListWorkers`` (read-only) stays open, and
the workers' own service (``Prefill``, ``Decode``, ...) does not check callers.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from typing import Mapping

import grpc

from kvstore.errors import InvalidRequest

log = logging.getLogger(__name__)

SECRET_ENV = "KVSTACK_WORKER_SECRET"
HEADER = "authorization"
MIN_SECRET_CHARS = 16
MAX_SECRET_CHARS = 4096


def check_secret(secret: str, source: str) -> str:
    """``secret`` if it is usable (module docstring), else ``InvalidRequest`` naming ``source``."""
    if not MIN_SECRET_CHARS <= len(secret) <= MAX_SECRET_CHARS or not all("!" <= c <= "~" for c in secret):
        raise InvalidRequest(f"the worker secret from {source} must be {MIN_SECRET_CHARS} to {MAX_SECRET_CHARS} "
                             f"printable ASCII characters without spaces (got {len(secret)} characters); "
                             "e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return secret


def load_worker_secret(secret_file: str = "", env: Mapping[str, str] | None = None) -> str:
    """The configured worker secret ("" when none); ``InvalidRequest`` for an unreadable file or a bad secret."""
    env = os.environ if env is None else env
    if secret_file:
        try:
            with open(secret_file, encoding="ascii") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequest(f"cannot read --worker-secret-file {secret_file}: {exc}") from exc
        return check_secret(text.strip(), f"--worker-secret-file {secret_file}")
    if env.get(SECRET_ENV):
        return check_secret(env[SECRET_ENV], SECRET_ENV)
    return ""


def metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """The call metadata a worker sends with its membership calls (none without a secret)."""
    return ((HEADER, f"Bearer {secret}"),) if secret else ()


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_listen(host: str, secret: str) -> None:
    """Refuse (``InvalidRequest``) an entrypoint on a non-loopback ``host`` without a secret;
    warn once (here, at start) for one on loopback."""
    if secret:
        return
    if not is_loopback(host):
        raise InvalidRequest(f"the entrypoint listens on {host}, beyond loopback, but has no worker secret: anyone "
                             f"who can reach it could register workers; set {SECRET_ENV} or --worker-secret-file "
                             "(and the same for the workers)")
    log.warning("no worker secret configured: any local process can register or deregister workers "
                "(set %s or --worker-secret-file, and the same for the workers)", SECRET_ENV)


class WorkerAuth:
    """Checks the worker secret of one membership call. No secret configured: everyone passes."""

    def __init__(self, secret: str):
        self._secret = f"Bearer {secret}".encode() if secret else b""

    @property
    def enabled(self) -> bool:
        return bool(self._secret)

    def check(self, context: grpc.ServicerContext, what: str) -> None:
        """Abort the call with UNAUTHENTICATED unless it carries the secret."""
        if not self._secret:
            return
        given = b""
        for k, v in context.invocation_metadata() or ():
            if k == HEADER:
                given = v if isinstance(v, bytes) else v.encode("utf-8", "replace")
                break
        if not hmac.compare_digest(given, self._secret):
            log.warning("refused %s from %s: %s worker secret", what, context.peer(),
                        "wrong" if given else "no")
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          f"{what} needs the worker secret: send metadata '{HEADER}: Bearer <secret>' with the "
                          f"entrypoint's secret ({SECRET_ENV} or --worker-secret-file on the worker)")
