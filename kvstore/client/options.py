"""How a client reaches a daemon: ``ClientOptions`` (from ``connect`` overrides and the
environment), daemon URLs (``parse_address``, ``split_urls``, ``shard_name``) and the TLS rule
(``refuse_tls_options``). Used by ``kvstore.client.connect`` (which opens a client for one
daemon or several), ``kvstore.client.transport`` (one daemon's channel) and
``kvstore.client.sharded`` (several).

TLS: the URL scheme decides, per URL, never the options:
  * ``grpcs://HOST:PORT`` is TLS. ``ca_file`` is the CA that signed the daemon's
    certificate (absent: the system roots, i.e. gRPC's bundled roots or
    ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``); ``cert_file`` + ``key_file`` add a
    client certificate (mutual TLS); ``server_name`` overrides the name checked.
    A certificate that does not verify fails the call with ``StoreUnavailable``
    within ``timeout_s`` (the message says to check ``ca_file``), never a hang.
  * ``grpc://HOST:PORT`` is plaintext. TLS options (``TLS_OPTIONS``: given to
    ``connect`` or taken from ``KVSTORE_CA_FILE`` / ``KVSTORE_CERT_FILE`` /
    ``KVSTORE_KEY_FILE``) with a ``grpc://`` URL raise ``InvalidRequest`` ("use
    grpcs://") at connect time, before any channel is opened: a client
    certificate never silently means a plaintext connection.
  * One exception, because the options (the environment above all) apply to every
    shard of a comma list: in a list with at least one ``grpcs://`` URL, the TLS
    options are for the ``grpcs://`` shards and the ``grpc://`` shards connect in
    plaintext (``kvstore.client.connect.open_grpc`` says so to each shard's client with
    ``ClientOptions.grpcs_in_set``, as ``ShardedStore`` does itself for such a
    list). A list of ``grpc://`` URLs only is refused as one ``grpc://`` URL is.

Options (``connect`` overrides, else environment): ``token``
(``KVSTORE_TOKEN``), ``ca_file`` (``KVSTORE_CA_FILE``), ``cert_file`` /
``key_file`` for mutual TLS (``KVSTORE_CERT_FILE`` / ``KVSTORE_KEY_FILE``),
``timeout_s`` (each call's deadline), ``maintenance_timeout_s`` (that of ``gc``, ``check``
and ``repair``, 3600 s by default; past it ``kvstore.errors.DeadlineExceeded``, a
``StoreUnavailable``), ``max_message_bytes``, ``server_name`` (TLS name override),
``direct_reads`` ("off" (default), "on", "auto"; ``KVSTORE_DIRECT_READS``),
``direct_writes`` (the same; ``KVSTORE_DIRECT_WRITES``). Bad options raise
``InvalidRequest`` at connect time: ``cert_file`` without ``key_file`` (or the
reverse), a TLS file that cannot be read or is not PEM, TLS options with ``grpc://``
URLs only (see TLS above), a URL not of the form ``URL_FORM``, a non-positive or
non-finite ``timeout_s`` or ``maintenance_timeout_s``.
"""

from __future__ import annotations

import ipaddress
import math
import os
from dataclasses import dataclass
from typing import Any

from kvstore.client.direct_reads import parse_mode
from kvstore.errors import InvalidRequest

MiB = 1024 * 1024
URL_FORM = "grpc://HOST:PORT[,grpc://HOST:PORT...] (grpcs:// for TLS; HOST a name, an IPv4 or a [IPv6] address)"
# gRPC channel arguments are C ints: a larger message limit is an OverflowError inside gRPC.
MAX_MESSAGE_BYTES = 2**31 - 1
# Options that only mean something over TLS: with a grpc:// URL they are refused (module docstring).
TLS_OPTIONS = ("ca_file", "cert_file", "key_file", "server_name")


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How a client reaches a daemon (all optional)."""

    token: str = ""
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    timeout_s: float = 60.0
    # Deadline of the maintenance calls (gc, check, repair): they walk the whole store.
    maintenance_timeout_s: float = 3600.0
    max_message_bytes: int = 96 * MiB
    max_batch_items: int = 4096  # the daemon's default limit; longer chains and probes go in pieces
    direct_reads: str = "off"  # "off", "on" or "auto" (a bool: on/off); see kvstore.client.direct_reads
    direct_writes: str = "off"  # the same modes; see kvstore.client.direct_writes
    # Not a connect option: set by ``open_grpc`` when the URL list has a grpcs:// URL, so the
    # TLS options are for those shards and a grpc:// shard of the list ignores them (plaintext).
    grpcs_in_set: bool = False

    INTERNAL = frozenset({"grpcs_in_set"})
    ENV = {"token": "KVSTORE_TOKEN", "ca_file": "KVSTORE_CA_FILE", "cert_file": "KVSTORE_CERT_FILE",
           "key_file": "KVSTORE_KEY_FILE", "direct_reads": "KVSTORE_DIRECT_READS",
           "direct_writes": "KVSTORE_DIRECT_WRITES"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "direct_reads", parse_mode(self.direct_reads))
        object.__setattr__(self, "direct_writes", parse_mode(self.direct_writes, "direct_writes"))
        if not isinstance(self.grpcs_in_set, bool):
            raise InvalidRequest(f"grpcs_in_set must be a bool, got {self.grpcs_in_set!r}")
        if bool(self.cert_file) != bool(self.key_file):
            # Checked here: gRPC aborts the whole process (SIGABRT) on a certificate without its key.
            raise InvalidRequest("mutual TLS needs both cert_file and key_file (the client certificate and its "
                                 f"private key); got cert_file={self.cert_file!r}, key_file={self.key_file!r}")
        if not isinstance(self.token, str):
            raise InvalidRequest(f"token must be a string, got {type(self.token).__name__}")
        # As a token file's: surrounding whitespace is not the token (a KVSTORE_TOKEN="$(cat f)"
        # style value ends with a newline, which gRPC refuses as "INTERNAL: Invalid metadata").
        token = self.token.strip()
        if any(not 0x20 < ord(c) < 0x7F for c in token):  # never echoed: it is a secret
            raise InvalidRequest("token (KVSTORE_TOKEN or --token-file) holds a space, control or non-ASCII "
                                 "character; a bearer token is printable ASCII: check how it was set")
        object.__setattr__(self, "token", token)
        for name in ("timeout_s", "maintenance_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and 0 < v <= 1e9):
                raise InvalidRequest(f"{name} must be a finite number of seconds in (0, 1e9], got {v!r}")
        for name, lo, hi in (("max_message_bytes", 64 * 1024, MAX_MESSAGE_BYTES), ("max_batch_items", 1, 2**31)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise InvalidRequest(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")

    @classmethod
    def from_overrides(cls, overrides: dict[str, Any]) -> "ClientOptions":
        fields = set(cls.__dataclass_fields__) - cls.INTERNAL
        unknown = set(overrides) - fields
        if unknown:
            raise InvalidRequest(f"unknown grpc client option(s) {sorted(unknown)}; known: {sorted(fields)}")
        vals = {k: os.environ[e] for k, e in cls.ENV.items() if e in os.environ}
        vals.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**vals)

    def tls_given(self) -> list[str]:
        """The ``TLS_OPTIONS`` that are set (from ``connect`` or the environment)."""
        return [n for n in TLS_OPTIONS if getattr(self, n)]


def refuse_tls_options(url: str, o: ClientOptions) -> None:
    """``InvalidRequest`` when TLS options are set for the plaintext ``grpc://`` ``url``
    (and ``o`` is not for a URL list with a grpcs:// URL; module docstring)."""
    given = o.tls_given()
    if given and not o.grpcs_in_set:
        env = [ClientOptions.ENV[n] for n in given if n in ClientOptions.ENV]
        src = f" (or {'/'.join(env)} in the environment)" if env else ""
        raise InvalidRequest(
            f"{url} is plaintext but TLS option(s) {', '.join(given)} were given{src}: the URL scheme decides, "
            f"use {'grpcs' + url[len('grpc'):]} for TLS or drop the option(s)")


def parse_address(url: str) -> tuple[str, bool]:
    """``grpc://host:port`` -> ("host:port", tls=False); ``grpcs://`` -> tls=True.

    HOST must be non-empty (a name, an IPv4 address, or an IPv6 address in brackets,
    ``[::1]``) and PORT an integer in [1, 65535]; one trailing ``/`` is allowed. Anything
    else raises ``InvalidRequest`` showing ``URL_FORM``, before any channel is opened.
    """
    scheme, sep, rest = url.partition("://")
    rest = rest[:-1] if rest.endswith("/") else rest
    host, colon, port = rest.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
    ok = (sep and scheme in ("grpc", "grpcs") and colon and host
          and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535
          and (bracketed or ":" not in host) and not any(c.isspace() or c in "/,@?#[]" for c in host.strip("[]")))
    if not ok:
        raise InvalidRequest(f"bad daemon URL {url!r}: expected {URL_FORM}")
    return rest, scheme == "grpcs"


def shard_name(url: str) -> str:
    """The name shard placement hashes for the daemon at ``url`` (``kvstore.client.sharded``): the
    URL with the spellings of one address made equal (host case, a trailing ``.`` of a
    host name, leading zeros of the port, the forms of an IPv6 address, a trailing ``/``),
    so clients that write the same address differently place keys alike. The usual
    spelling (``grpc://host:port``, lower case) is its own name. Different names of one
    host (``localhost`` and ``127.0.0.1``, two DNS names) stay different shards: every
    client must name each daemon by the same host."""
    addr, tls = parse_address(url)
    host, _, port = addr.rpartition(":")
    if host.startswith("["):
        try:  # the zone of "fe80::1%eth0" keeps its case: interface names are case-sensitive
            host = f"[{ipaddress.IPv6Address(host[1:-1].replace('%25', '%', 1)).compressed}]"
        except ValueError:
            host = host.lower()  # not an address (gRPC refuses it when connecting)
    else:
        host = host.lower()
        host = (host.rstrip(".") or host) if len(host) > 1 else host
    return f"{'grpcs' if tls else 'grpc'}://{host}:{int(port)}"


def split_urls(url: str) -> list[str]:
    """A comma list of daemon URLs, each checked by ``parse_address``; an empty entry (a
    leading, trailing or doubled comma) is refused as any other malformed URL is."""
    urls = [u.strip() for u in url.split(",")]
    if not all(urls):
        raise InvalidRequest(f"bad daemon URL list {url!r}: an empty entry (a stray comma?); expected {URL_FORM}")
    for u in urls:
        parse_address(u)
    # One spelling per daemon: shard placement hashes the URL, so "grpc://h:p/" must place as "grpc://h:p".
    return [u[:-1] if u.endswith("/") else u for u in urls]
