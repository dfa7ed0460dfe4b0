"""Client tokens: which tenant a ``Generate`` acts for.

Why: a request's tenant chooses the salt of every KV key it looks up and
writes. Were the ``tenant`` field of a ``GenerateRequest`` trusted as sent,
any client could name another tenant and learn which prompts that tenant has
cached (the lookup hop reports the cached tokens, and the time to the first
token shows them), the leak the store's tenant isolation exists to prevent.

Tokens file (TOML, the kvstore daemon's format, ``kvstore.auth``;
``admin_tenants`` is accepted and means nothing here)::

    [tokens]
    "b64-random-token-1" = "acme"
    "b64-random-token-2" = "globex"

With a tokens file (``--client-tokens FILE``; ``ClientAuth.load``):
  * ``Generate`` and ``ListWorkers`` carry ``authorization: Bearer <token>``;
    no token or an unknown one is UNAUTHENTICATED before anything else runs
    (``ListWorkers`` also takes the worker secret, which the workers hold);
  * the request acts for the token's tenant. An empty ``tenant`` field means
    that one; naming another tenant is PERMISSION_DENIED, with one message
    whether or not that tenant exists, so a token cannot probe tenant names;
  * every tenant a token names must be configured (``--tenant NAME=SALT``):
    a token for an unknown tenant is a start-up error, not a request error.

Without one, the ``tenant`` field is taken as sent: right for one tenant, or
for callers the operator trusts. ``check_open_tenants`` refuses an entrypoint
that would serve several tenants that way beyond loopback.
"""

from __future__ import annotations

import logging
from typing import Iterable

import grpc

from entrypoint.auth import is_loopback
from kvstore.errors import InvalidRequest
from kvstore.auth import Tenant, TokenTable, read_tokens_file
from kvstore.errors import Unauthenticated

log = logging.getLogger(__name__)


class ClientAuth:
    """Bearer token -> tenant name of the entrypoint's clients. Empty: the tenant field is trusted."""

    def __init__(self, tenant_by_token: dict[str, str] | None = None):
        self._tenant_by_token = dict(tenant_by_token or {})
        self._table = TokenTable({tok.encode(): Tenant(name) for tok, name in self._tenant_by_token.items()})

    @classmethod
    def load(cls, tokens_file: str = "") -> "ClientAuth":
        """The tokens of ``tokens_file`` (none for ""); ``InvalidRequest`` for a bad file."""
        return cls(read_tokens_file(tokens_file)[0] if tokens_file else None)

    @property
    def enabled(self) -> bool:
        return self._table.enabled

    @property
    def tenants(self) -> set[str]:
        return set(self._tenant_by_token.values())

    def __repr__(self) -> str:  # never the tokens: they end up in logs
        return f"ClientAuth({len(self._tenant_by_token)} tokens, tenants {sorted(self.tenants)})"

    def check_tenants(self, configured: Iterable[str]) -> None:
        """``InvalidRequest`` when a token names a tenant that is not configured."""
        missing = sorted(self.tenants - set(configured))
        if missing:
            raise InvalidRequest(f"the client tokens name tenant(s) {missing} that are not configured; "
                                 "give each one --tenant NAME=SALT")

    def tenant_of(self, context: grpc.ServicerContext, asked: str) -> str:
        """The tenant a call acts for: ``asked`` (the request's field) when there are no tokens,
        else the token's; aborts the call (UNAUTHENTICATED, PERMISSION_DENIED) otherwise."""
        if not self.enabled:
            return asked
        name = self.authenticate(context)
        if asked and asked != name:
            log.warning("refused a request for tenant %r from %s: its token is another tenant's", asked, context.peer())
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"this token acts for its own tenant only; send tenant {name!r} or leave it empty")
        return name

    def authenticate(self, context: grpc.ServicerContext) -> str:
        """The token's tenant; aborts with UNAUTHENTICATED for no token or an unknown one."""
        try:
            return self._table.authenticate(context.invocation_metadata()).name
        except Unauthenticated as exc:
            log.warning("refused a call from %s: %s", context.peer(), exc)
            context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{exc} (a client token of the entrypoint's "
                                                           "--client-tokens file)")
            raise  # context.abort raises; this line is never reached


def check_open_tenants(host: str, tenants: Iterable[str], auth: ClientAuth) -> None:
    """Refuse (``InvalidRequest``) an entrypoint beyond loopback that serves several tenants
    without client tokens: anyone who reaches it could act for any of them."""
    names = sorted(tenants)
    if len(names) > 1 and not auth.enabled and not is_loopback(host):
        raise InvalidRequest(f"the entrypoint listens on {host}, beyond loopback, with tenants {names} but no "
                             "client tokens: any client could name any tenant and see its cached prompts; "
                             "give --client-tokens FILE")
