"""TLS on the entrypoint's gRPC hops: which files each side takes, and the scheme rule.

Without TLS the worker secret (``entrypoint.auth``) and the client tokens
(``entrypoint.client_tokens``) cross the network in clear text; TLS encrypts them and
lets each caller verify whom it talks to. The PEM files are read, checked and
turned into gRPC credentials by ``kvstore.tls``, as the kvstore daemon's are.

Hops and their files (every file a PEM path; the CA is the one that signed the
other side's certificate; without a CA file, the system roots):

  1. client -> entrypoint (``Generate``, ``ListWorkers``) and worker ->
     entrypoint (``Register``, ``Deregister``): the entrypoint's one port.
       * entrypoint: ``--tls-cert C --tls-key K`` serve TLS; ``--tls-client-ca
         CA`` adds mutual TLS: *every* caller, client or worker, must present
         a certificate signed by CA.
       * client (``entrypoint.client.Client``): address ``grpcs://HOST:PORT``,
         ``ca_file``; ``cert_file`` + ``key_file`` for mutual TLS.
       * worker: ``--entrypoint grpcs://HOST:PORT --entrypoint-ca FILE``;
         ``--entrypoint-cert`` + ``--entrypoint-key`` for mutual TLS.
  2. entrypoint -> worker (``Prefill``, ``Decode``, ``Encode``, ``Status``):
       * worker: ``--tls-cert C --tls-key K`` serve TLS, and the worker then
         registers its address as ``grpcs://HOST:PORT``; ``--tls-client-ca CA``
         adds mutual TLS (the entrypoint must present a certificate signed by CA).
       * entrypoint: ``--worker-ca FILE`` verifies the workers' certificates
         (without it, the system roots). ``--worker-cert`` + ``--worker-key``:
         the client certificate it presents to workers with ``--tls-client-ca``.
         Any of the three makes TLS to workers required: a worker that
         registers a plaintext address is refused (INVALID_ARGUMENT), so the
         secret is never sent in clear to it (a client certificate is for TLS
         alone; with only it, the workers are verified with the system roots).

The scheme decides, per address, as for the kvstore daemon's URLs
(``kvstore.client.options``): ``grpcs://HOST:PORT`` is TLS; ``HOST:PORT`` or
``grpc://HOST:PORT`` is plaintext, and client TLS files given for a plaintext
address are refused (``InvalidRequest``: "use grpcs://"), never silently
ignored. A TLS server's ``READY`` line says ``grpcs://HOST:PORT``, the address
to give its callers as is.

A server listening beyond loopback without TLS warns at start (``warn_plaintext``).

TLS replaces neither the worker secret nor the client tokens: they are still
required as before (mutual TLS is one more gate, at the transport).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import logging

import grpc

from entrypoint.auth import is_loopback
from kvstore.errors import InvalidRequest
from kvstore.tls import channel_credentials, check_server_files, failure_kind, server_credentials

ADDRESS_FORM = "HOST:PORT, grpc://HOST:PORT or grpcs://HOST:PORT (TLS)"


@dataclass(frozen=True, slots=True)
class ServerTLS:
    """The PEM files a server (the entrypoint, a worker) serves TLS with; all empty: plaintext.
    ``names``: the options they came from, for messages. A mix that cannot work (a cert
    without its key, a client CA without both) is ``InvalidRequest`` at construction."""

    cert: str = ""
    key: str = ""
    client_ca: str = ""  # set: mutual TLS, a caller needs a certificate signed by it
    names: tuple[str, str, str] = ("--tls-cert", "--tls-key", "--tls-client-ca")

    def __post_init__(self) -> None:
        check_server_files(self.cert, self.key, self.client_ca, self.names)

    @property
    def enabled(self) -> bool:
        return bool(self.cert)

    def credentials(self) -> grpc.ServerCredentials | None:
        """The files read and checked (``InvalidRequest`` naming a bad one); ``None``: plaintext."""
        return server_credentials(self.cert, self.key, self.client_ca, self.names) if self.enabled else None


@dataclass(frozen=True, slots=True)
class ChannelTLS:
    """The PEM files a caller verifies a TLS server with (``ca_file``; empty: the system roots)
    and presents to one that requires a client certificate (``cert_file`` + ``key_file``)."""

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    names: tuple[str, str, str] = ("ca_file", "cert_file", "key_file")

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise InvalidRequest(f"mutual TLS needs both {self.names[1]} and {self.names[2]} (the client "
                                 f"certificate and its private key); give both or neither")

    @property
    def given(self) -> bool:
        return bool(self.ca_file or self.cert_file)

    def given_names(self) -> str:
        """The ``names`` of the files given, comma-separated (for messages)."""
        return ", ".join(n for n, v in zip(self.names, (self.ca_file, self.cert_file, self.key_file)) if v)

    def credentials(self) -> grpc.ChannelCredentials:
        return channel_credentials(self.ca_file, self.cert_file, self.key_file, self.names)


def split_address(address: str) -> tuple[str, bool]:
    """``grpcs://HOST:PORT`` -> (``HOST:PORT``, True); ``grpc://HOST:PORT`` or ``HOST:PORT`` ->
    (``HOST:PORT``, False). Another scheme, or no port, is ``InvalidRequest``."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "grpc", address
    if scheme not in ("grpc", "grpcs") or not rest or ":" not in rest or "/" in rest:
        raise InvalidRequest(f"bad address {address!r}: expected {ADDRESS_FORM}")
    return rest, scheme == "grpcs"


log = logging.getLogger(__name__)


def warn_plaintext(server: str, host: str, tls: bool) -> None:
    """Warn (once per call: at start) when ``server`` ("entrypoint" or "worker") listens beyond
    loopback without TLS: the worker secret and the client tokens it is sent are then readable
    by anyone on the path (the listen itself is allowed: a private network may be trusted)."""
    if not tls and not is_loopback(host):
        log.warning("the %s listens on %s, beyond loopback, without TLS: the worker secret and client tokens "
                    "cross the network in clear text; give it --tls-cert and --tls-key (entrypoint.tls)",
                    server, host)


def add_serve_args(parser, client_ca_help: str):
    """Add the "TLS" option group with the files a server serves TLS with (``--tls-cert``,
    ``--tls-key``, ``--tls-client-ca``, whose help is ``client_ca_help``); returns the group,
    for the program's other TLS options."""
    t = parser.add_argument_group("TLS (entrypoint.tls; PEM files)")
    t.add_argument("--tls-cert", default="", metavar="FILE", help="serve TLS with this certificate (chain)")
    t.add_argument("--tls-key", default="", metavar="FILE", help="the private key of --tls-cert")
    t.add_argument("--tls-client-ca", default="", metavar="FILE", help=client_ca_help)
    return t


def server_address(host: str, port: int, tls: bool) -> str:
    """The address a server announces (``READY``, ``Register``): ``grpcs://`` when it serves TLS."""
    return f"grpcs://{host}:{port}" if tls else f"{host}:{port}"


def open_channel(address: str, tls: ChannelTLS | None = None, *,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to ``address``, TLS when its scheme is ``grpcs://`` (module docstring);
    ``InvalidRequest`` for TLS files with a plaintext address, before anything is opened."""
    target, secure = split_address(address)
    tls = tls or ChannelTLS()
    if secure:
        return grpc.secure_channel(target, tls.credentials(), options=list(options))
    if tls.given:
        raise InvalidRequest(f"{tls.given_names()} given for the plaintext address {address!r}: use grpcs://{target} "
                             "for TLS, or drop them")
    return grpc.insecure_channel(target, options=list(options))


def unreachable_hint(details: str, tls: ChannelTLS, secure: bool) -> str:
    """What to check when a call to a server failed UNAVAILABLE with ``details`` ("" when it
    says nothing about TLS): a failed handshake, or a connection the server closed at once."""
    kind = failure_kind(details)
    if kind == "handshake":
        return (f"; the TLS handshake failed: the server's certificate must be signed by {tls.names[0]}, "
                "and grpcs:// is only for a server that serves TLS")
    if kind == "closed":
        if not secure:
            return "; the server closed the connection: if it serves TLS, use grpcs://HOST:PORT and a CA file"
        return (f"; the server closed the connection: if it requires client certificates (mutual TLS), "
                f"give {tls.names[1]} and {tls.names[2]}")
    return ""
