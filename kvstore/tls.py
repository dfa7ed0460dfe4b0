"""TLS material for gRPC, shared by the kvstore daemon and its clients and by the entrypoint's
hops (``entrypoint.tls``): one place that reads the PEM files, says which files go together,
builds gRPC credentials from them and recognises a failed handshake in gRPC's details.

Who calls it: ``kvstore.server.config`` (the daemon's ``tls_*`` files), ``kvstore.server.service``
(its secure port), ``kvstore.client.remote`` (a ``grpcs://`` channel), ``kvstore.wire`` (the hint
in an UNAVAILABLE error), and ``entrypoint.tls``. Each caller passes the *names* of its options
(``tls_cert`` for the daemon's config, ``--tls-cert`` for the entrypoint's command line), so every
message names what the user typed.

Guarantees: a file that cannot be read, or holds no PEM block of the expected kind, is
``InvalidRequest`` naming the option and the path, before any port or channel is opened; a
key that does not match its certificate is refused before any port is bound
(``server_credentials``) or channel opened (``channel_credentials``), with
``check_key_pair``, never silently served as plaintext.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from kvstore.errors import InvalidRequest

# The daemon's option names (its TOML keys); the entrypoint passes its flags instead.
SERVER_NAMES = ("tls_cert", "tls_key", "tls_client_ca")
CLIENT_NAMES = ("ca_file", "cert_file", "key_file")

# Substrings (lower case) of gRPC's details for a failed TLS handshake: an untrusted server
# certificate (CERTIFICATE_VERIFY_FAILED) or TLS to a plaintext server (WRONG_VERSION_NUMBER).
# Not bare "tls"/"ssl": a host name in the details may contain them.
_HANDSHAKE_MARKERS = ("handshake failed", "certificate_verify_failed", "wrong_version_number", "ssl_error")


def read_pem(path: str, option: str, marker: str) -> bytes:
    """A TLS file (a server's or a client's), read and sanity-checked: ``InvalidRequest``
    naming ``option`` and the file when it cannot be read or holds no PEM ``marker`` block."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequest(f"TLS setup: cannot read {option} {path!r} ({exc.strerror or exc}); "
                             "fix the path or drop the option") from exc
    if b"-----BEGIN" not in data or marker.encode() not in data:
        raise InvalidRequest(f"TLS setup: {option} {path!r} is not a PEM {marker.lower()}")
    return data


def check_server_files(cert: str, key: str, client_ca: str, names: tuple[str, str, str] = SERVER_NAMES) -> None:
    """Refuse (``InvalidRequest``) server TLS files that cannot work together: a certificate
    without its key (or the reverse), a client CA (mutual TLS) without both."""
    if bool(cert) != bool(key):
        raise InvalidRequest(f"TLS needs both {names[0]} and {names[1]}")
    if client_ca and not cert:
        raise InvalidRequest(f"mutual TLS ({names[2]}) needs {names[0]} and {names[1]} as well")


def server_credentials(cert: str, key: str, client_ca: str = "",
                       names: tuple[str, str, str] = SERVER_NAMES) -> grpc.ServerCredentials:
    """gRPC server credentials from PEM files (checked: ``check_server_files``, ``read_pem``).
    With ``client_ca`` a client must present a certificate signed by it (mutual TLS)."""
    check_server_files(cert, key, client_ca, names)
    pems = (read_pem(cert, names[0], "CERTIFICATE"), read_pem(key, names[1], "PRIVATE KEY"),
            read_pem(client_ca, names[2], "CERTIFICATE") if client_ca else None)
    check_key_pair(cert, key, names)
    return server_credentials_from_pem(*pems)


def check_key_pair(cert: str, key: str, names: tuple[str, ...] = SERVER_NAMES) -> None:
    """``InvalidRequest`` unless ``key`` is the private key of ``cert`` (PEM files). Checked with
    the standard ``ssl`` module, so a mismatch is one message before any port is bound, instead
    of gRPC's own log lines and a failed bind."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except (ssl.SSLError, OSError) as exc:
        raise InvalidRequest(f"TLS setup: the TLS key does not match the certificate (or cannot be used: "
                             f"{getattr(exc, 'reason', None) or exc}): {names[1]} {key!r}, {names[0]} {cert!r}"
                             ) from exc


def server_credentials_from_pem(cert: bytes, key: bytes, client_ca: bytes | None) -> grpc.ServerCredentials:
    """gRPC server credentials from PEM bytes already read (``server_credentials`` reads the files)."""
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def channel_credentials(ca_file: str = "", cert_file: str = "", key_file: str = "",
                        names: tuple[str, str, str] = CLIENT_NAMES) -> grpc.ChannelCredentials:
    """gRPC channel credentials: the server's certificate must be signed by ``ca_file`` (none:
    the system roots); ``cert_file`` + ``key_file`` (both or neither) are a client certificate
    for a server that requires one (mutual TLS). A key that is not the certificate's is
    ``InvalidRequest`` here (``check_key_pair``), not gRPC's "Failed to create security
    handshaker" at the first call."""
    if bool(cert_file) != bool(key_file):
        raise InvalidRequest(f"mutual TLS needs both {names[1]} and {names[2]} (the client certificate and its "
                             f"private key); got {names[1]}={cert_file!r}, {names[2]}={key_file!r}")
    root = read_pem(ca_file, names[0], "CERTIFICATE") if ca_file else None
    key = read_pem(key_file, names[2], "PRIVATE KEY") if key_file else None
    chain = read_pem(cert_file, names[1], "CERTIFICATE") if cert_file else None
    if cert_file:  # each file readable and PEM (said first), then whether they go together
        check_key_pair(cert_file, key_file, (names[1], names[2]))
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)


def failure_kind(details: str) -> str:
    """What gRPC's ``details`` of an UNAVAILABLE call say about TLS: ``"handshake"`` (a failed
    handshake: an untrusted certificate, TLS to a plaintext server), ``"closed"`` (the server
    closed the connection at once: most often plaintext to a TLS server, or no client
    certificate for a server requiring one) or ``""`` (nothing about TLS). "Closed" is a
    connect failure only: gRPC says "Stream removed (Socket closed)" for a call whose stream was
    running when the server went away (a daemon killed mid-call), which says nothing about TLS."""
    low = details.lower()
    if any(m in low for m in _HANDSHAKE_MARKERS):
        return "handshake"
    return "closed" if "socket closed" in low and "stream removed" not in low else ""
