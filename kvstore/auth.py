"""Bearer tokens and tenants: the tokens file, who a call acts for, and the keys a tenant's entries are stored under.

Who uses it: the daemon (``kvstore.server``: ``TokenTable`` authenticates every call,
``Tenant.store_key`` maps its keys) and the entrypoint's client tokens, which read the
same tokens file format (``read_tokens_file``). The daemon's admission limits are its
own: ``kvstore.server.admission``.

Tokens file (TOML, so UTF-8), read once at start::

    admin_tenants = ["ops"]          # may call Stats, Gc, Check, Repair, Maintain, ExportIndex, Inspect's summary
    [tokens]
    "b64-random-token-1" = "tenant-a"
    "b64-random-token-2" = "tenant-a"  # several tokens may map to one tenant
    "b64-random-token-3" = "ops"

Every call then carries ``authorization: Bearer <token>``. No token or an
unknown one is UNAUTHENTICATED (compared in constant time).

Tenant namespacing (why a tenant cannot read, look up, delete or even infer
the presence of another tenant's entries): the daemon never stores a client
key as is. It stores ``tenant_key(key) = BLAKE2b-128(key, key=tenant_secret)``
with ``tenant_secret = BLAKE2b-256(tenant id, key=server_secret)``. The server
secret is 32 random bytes kept in ``tenant_secret_file`` (created 0600 on
first start), so keys are stable across restarts and unguessable without the
file. Two tenants sending the *same* prompt hash produce unrelated stored
keys: no shared entry, no dedup signal, no lookup hit. Without a tokens file
there is one anonymous tenant whose keys are stored as sent (so ``kvtool`` on
the data directory and the daemon see the same entries).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.errors import InvalidRequest
from kvstore.keys import tenant_key
from kvstore.errors import PermissionDenied, Unauthenticated

log = logging.getLogger(__name__)

ANONYMOUS = ""


@dataclass(frozen=True, slots=True)
class Tenant:
    """Who a call acts for. ``secret`` is empty for the anonymous tenant (keys stored as sent)."""

    name: str
    secret: bytes = b""
    admin: bool = False

    def store_key(self, key: bytes) -> bytes:
        """The key stored for this tenant's ``key`` (identity for the anonymous tenant)."""
        if not self.secret:
            return key
        return tenant_key(key, self.secret)


ANONYMOUS_TENANT = Tenant(ANONYMOUS, b"", admin=True)


def load_server_secret(path: Path) -> bytes:
    """Read the 32-byte server secret, creating it (0600, atomically) when absent."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_bytes(32))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another daemon created it first: keep theirs
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
        data = path.read_bytes()
    if len(data) < 16:
        raise InvalidRequest(f"tenant secret file {path} holds {len(data)} bytes; need at least 16")
    return data


def read_tokens_file(tokens_file: str) -> tuple[dict[str, str], set[str]]:
    """(token -> tenant name, admin tenant names) of a tokens file (module docstring); its
    misuse is ``InvalidRequest`` naming the file. The daemon (``TokenTable.load``) and the
    entrypoint's client tokens (``entrypoint.client_tokens``) read the one format."""
    try:
        with open(tokens_file, "rb") as fh:
            doc = tomllib.load(fh)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:  # tomllib reads UTF-8 only
        raise InvalidRequest(f"cannot read tokens file {tokens_file}: {exc}") from exc
    unknown = sorted(set(doc) - {"tokens", "admin_tenants"})
    if unknown:
        raise InvalidRequest(f"{tokens_file}: unknown key(s) {unknown}; a tokens file has [tokens] and "
                             "admin_tenants only")
    tokens = doc.get("tokens")
    if not isinstance(tokens, dict) or not tokens:
        raise InvalidRequest(f"{tokens_file} needs a non-empty [tokens] table of token = \"tenant\"")
    admin_list = doc.get("admin_tenants", [])
    # A string here would be iterated letter by letter: "ops" would make tenants o, p and s admins.
    if not isinstance(admin_list, list) or not all(isinstance(a, str) and a for a in admin_list):
        raise InvalidRequest(f"{tokens_file}: admin_tenants must be a list of tenant names, e.g. "
                             f"admin_tenants = [\"ops\"]; got {admin_list!r}")
    for tok, name in tokens.items():
        if not isinstance(name, str) or not name or len(tok) < 8:
            raise InvalidRequest(f"{tokens_file}: each token needs >= 8 characters and a tenant name")
        if not (tok.isascii() and tok.isprintable()) or tok != tok.strip():
            # a client sends it in a gRPC header: such a token could never authenticate
            raise InvalidRequest(f"{tokens_file}: the token of tenant {name!r} must be printable ASCII with no "
                                 "leading or trailing spaces")
    return dict(tokens), set(admin_list)


@dataclass(frozen=True, slots=True)
class TokenTable:
    """Bearer token -> tenant, from a tokens file. Empty table: auth disabled."""

    tenants_by_token: dict[bytes, Tenant] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.tenants_by_token)

    @classmethod
    def load(cls, tokens_file: str, server_secret: bytes) -> "TokenTable":
        tokens, admins = read_tokens_file(tokens_file)
        out: dict[bytes, Tenant] = {}
        for tok, name in tokens.items():
            secret = hashlib.blake2b(name.encode(), key=server_secret[:64], digest_size=32,
                                     person=b"kvstack-tsecret").digest()
            out[tok.encode()] = Tenant(name, secret, admin=name in admins)
        log.info("auth: %d tokens for %d tenants", len(out), len({t.name for t in out.values()}))
        return cls(out)

    def authenticate(self, metadata: tuple[tuple[str, str], ...] | None) -> Tenant:
        """The tenant of a call's metadata; raises ``Unauthenticated``."""
        if not self.enabled:
            return ANONYMOUS_TENANT
        header = ""
        for k, v in metadata or ():
            if k == "authorization":
                header = v if isinstance(v, str) else v.decode("utf-8", "replace")
                break
        if not header.startswith("Bearer ") or len(header) <= 7:
            raise Unauthenticated("missing bearer token: send metadata 'authorization: Bearer <token>'")
        given = header[7:].strip().encode()
        found = None
        for tok, tenant in self.tenants_by_token.items():  # constant time per comparison
            if hmac.compare_digest(tok, given):
                found = tenant
        if found is None:
            raise Unauthenticated("unknown bearer token")
        return found


def require_admin(tenant: Tenant, method: str) -> None:
    """``PermissionDenied`` unless ``tenant`` is an admin (``admin_tenants`` of the tokens file)."""
    if not tenant.admin:
        raise PermissionDenied(f"{method} needs an admin tenant (admin_tenants in the tokens file)")
