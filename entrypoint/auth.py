"""The worker secret: who may join (``Register``) or remove (``Deregister``) entrypoint
workers, and who may call the workers themselves.

Why: ``Register`` replaces the address of a worker id. Without a check, any
process that can reach the entrypoint could point a worker id at itself and
receive every prompt routed there (or ``Deregister`` the fleet). And a worker
trusts what its callers send (the tenant salt that enters every KV key, the VE
cache scope, the request size): a process that calls it directly could write
or read KV under any tenant's salt, past the entrypoint's tenant handling and
request limits. So the entrypoint and its workers share one secret, carried as
gRPC metadata ``authorization: Bearer <secret>`` (the kvstore daemon's
bearer-token convention, ``kvstore/auth.py``). A missing or wrong
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

No secret at all (``check_listen``): an entrypoint or a worker listening on a
loopback address accepts calls without one and logs one warning once it
serves, so a laptop stack needs no configuration; one listening on any other
address refuses to start, since there the whole network could re-route the
workers or call them. ``entrypoint.walkthrough.launcher.Cluster`` (the
walkthrough's stacks, and the end-to-end tests') generates a random secret per
stack and hands it to the entrypoint and the workers it starts through the
environment, so even the zero-configuration walkthrough runs authenticated.

Scope, when a secret is configured:
  * entrypoint: ``Register`` and ``Deregister`` need it (``WorkerAuth.check``
    in the handler, before any change). ``ListWorkers`` (read-only) and
    ``Generate`` (the clients' call) do not: without client tokens both are
    open; with them (``--client-tokens``, ``entrypoint.client_tokens``) ``Generate``
    needs a client token and ``ListWorkers`` a client token or this secret.
  * worker: every method of its ``Worker`` service (``Prefill``, ``Decode``,
    ``Encode``, ``Status``, and any added later) needs it
    (``server_interceptors``: a server interceptor, so a refused call reaches
    no handler, not even the request parser).
  * the entrypoint sends it on every call it makes to a worker
    (``client_interceptor``, on every channel ``entrypoint.instances`` opens),
    after the call's own metadata (the VE cache scope on ``Encode``); a worker
    sends it with ``Register`` (``metadata``).
Transport: the secret (and a client's token) is plain call metadata, so over a
plaintext connection it crosses the network in clear. Beyond loopback, serve
TLS on both hops (``entrypoint.tls``, which says which hop takes which file):
the entrypoint's ``--tls-cert``/``--tls-key`` protect ``Register`` (the worker
dials ``--entrypoint grpcs://...`` with ``--entrypoint-ca``) and ``Generate``;
each worker's ``--tls-cert``/``--tls-key`` with the entrypoint's ``--worker-ca``
protect the calls that carry the secret to the workers. TLS does not replace the
secret: a worker still requires it, and the entrypoint still checks it.
A worker given a secret that its entrypoint lacks registers, but refuses the
entrypoint's first ``Status``; the registry then drops it and refuses the
``Register`` (INVALID_ARGUMENT naming the mismatch), so the worker exits
instead of serving nobody.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from dataclasses import dataclass
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
    """The call metadata that carries ``secret`` (none without a secret)."""
    return ((HEADER, f"Bearer {secret}"),) if secret else ()


def is_loopback(host: str) -> bool:
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


# What a caller could do to a server of this kind that has no secret: the reason in its messages.
_OPEN_RISK = {
    "entrypoint": "register or deregister workers",
    "worker": "send this worker requests under any tenant's salt, past the entrypoint's checks",
}


def check_listen(host: str, secret: str, *, server: str = "entrypoint", warn: bool = True) -> None:
    """Refuse (``InvalidRequest``) a ``server`` ("entrypoint" or "worker") on a non-loopback
    ``host`` without a secret; with ``warn``, warn once (here) for one on loopback.

    A worker calls it with ``warn=False`` before it opens anything and ``warn_no_secret``
    once it serves, so that a start-up error stays the one line on stderr."""
    if secret:
        return
    if not is_loopback(host):
        raise InvalidRequest(f"the {server} listens on {host}, beyond loopback, but has no worker secret: anyone "
                             f"who can reach it could {_OPEN_RISK[server]}; set {SECRET_ENV} or "
                             "--worker-secret-file (the same on the entrypoint and every worker)")
    if warn:
        warn_no_secret(server)


def warn_no_secret(server: str) -> None:
    """The one warning of a ``server`` that serves on loopback without a secret."""
    log.warning("no worker secret configured: any local process can %s (set %s or --worker-secret-file, "
                "the same on the entrypoint and every worker)", _OPEN_RISK[server], SECRET_ENV)


class WorkerAuth:
    """Checks the worker secret of one call. No secret configured: everyone passes."""

    def __init__(self, secret: str):
        self._secret = f"Bearer {secret}".encode() if secret else b""

    @property
    def enabled(self) -> bool:
        return bool(self._secret)

    @staticmethod
    def _given(invocation_metadata) -> bytes:
        for k, v in invocation_metadata or ():
            if k == HEADER:
                return v if isinstance(v, bytes) else v.encode("utf-8", "replace")
        return b""

    def admits(self, invocation_metadata) -> bool:
        """Whether call metadata (``(key, value)`` pairs) carries the secret; compared in constant time."""
        return not self._secret or hmac.compare_digest(self._given(invocation_metadata), self._secret)

    def check(self, context: grpc.ServicerContext, what: str) -> None:
        """Abort the call with UNAUTHENTICATED unless it carries the secret."""
        if not self.admits(context.invocation_metadata()):
            self.refuse(context, what)

    def refuse(self, context: grpc.ServicerContext, what: str) -> None:
        """Log and abort (raises) with UNAUTHENTICATED: ``what`` came without the secret, or a wrong one."""
        given = self._given(context.invocation_metadata())
        log.warning("refused %s from %s: %s worker secret", what, context.peer(), "wrong" if given else "no")
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      f"{what} needs the worker secret: send metadata '{HEADER}: Bearer <secret>' with the "
                      f"secret the entrypoint and its workers share ({SECRET_ENV} or --worker-secret-file)")


class _RequireSecret(grpc.ServerInterceptor):
    """Every call to the server must carry the secret; a refused one gets a handler that only
    aborts, so the servicer (and the request parser of ``entrypoint.rpc``) never runs."""

    def __init__(self, auth: WorkerAuth):
        self._auth = auth

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or self._auth.admits(handler_call_details.invocation_metadata):
            return handler
        what = handler_call_details.method.rsplit("/", 1)[-1]  # "/kvstack.serving.Worker/Prefill" -> "Prefill"

        def refuse(request, context):
            self._auth.refuse(context, what)

        def refuse_stream(request, context):
            self._auth.refuse(context, what)
            yield from ()  # a generator, as a streaming behaviour is

        if handler.request_streaming:  # no such method in the Worker service; refused the same way
            return (grpc.stream_stream_rpc_method_handler(refuse_stream) if handler.response_streaming
                    else grpc.stream_unary_rpc_method_handler(refuse))
        return (grpc.unary_stream_rpc_method_handler(refuse_stream) if handler.response_streaming
                else grpc.unary_unary_rpc_method_handler(refuse))


def server_interceptors(secret: str) -> tuple[grpc.ServerInterceptor, ...]:
    """What a worker's server needs to require ``secret`` on every call (nothing without one)."""
    return (_RequireSecret(WorkerAuth(secret)),) if secret else ()


@dataclass(frozen=True, slots=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: tuple | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _SendSecret(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the secret to the metadata of every call, after the metadata the call already has."""

    def __init__(self, secret: str):
        self._metadata = metadata(secret)

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, tuple(d.metadata or ()) + self._metadata,
                            getattr(d, "credentials", None), getattr(d, "wait_for_ready", None),
                            getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)


def client_interceptor(secret: str) -> grpc.UnaryUnaryClientInterceptor | None:
    """What a channel to a worker needs to send ``secret`` on every call (``None`` without one);
    use as ``grpc.intercept_channel(channel, interceptor)``. Covers unary and server-streaming
    calls, all the ``Worker`` service has."""
    return _SendSecret(secret) if secret else None
