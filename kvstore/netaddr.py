"""Listening addresses: how a ``host:port`` is spelled, and whether it can be listened on.

Both gRPC servers of the project check their address here before gRPC binds it: the
kvstore daemon (``kvstore.server``) and the entrypoint's servers. A busy port or a host
that is no address of this machine is then one clear ``InvalidRequest`` naming
``--host``/``--port``, never gRPC's C-core log line first.
"""

from __future__ import annotations

import errno
import socket

from kvstore.errors import InvalidRequest


def host_port(host: str, port: int) -> str:
    """``host:port``, a bare IPv6 address (``::1``) in brackets, as gRPC and URLs spell it."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def port_taken(host: str, port: int) -> bool:
    """True when something already listens on ``host:port`` (``port`` 0 never is): a bind
    with ``SO_REUSEADDR`` as gRPC's fails. Checked before gRPC binds, so a busy port is one
    clear line from the caller, not gRPC's C-core log line first; a race past this check
    still fails in gRPC's bind.

    A ``host`` gRPC could not bind either is ``InvalidRequest`` naming ``--host``, for the
    same reason: one that does not resolve, one that is no address of this machine (none
    of its addresses can be bound), or one whose every address refuses the bind (a port
    below 1024 without the privilege)."""
    name = host[1:-1] if host.startswith("[") and host.endswith("]") else host  # "[::1]", as in URLs
    try:
        infos = socket.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:  # UnicodeError: a label IDNA cannot encode (too long, ...)
        why = getattr(exc, "strerror", None) or exc
        raise InvalidRequest(f"cannot listen on --host {host!r}: it does not resolve ({why}); "
                             "give a local address, e.g. 127.0.0.1") from exc
    errors: list[OSError] = []
    for family, kind, proto, _, addr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return True
            errors.append(exc)
    if len(errors) < len(infos):
        return False  # some address binds: gRPC listens there
    if all(e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT) for e in errors):
        raise InvalidRequest(f"cannot listen on --host {host!r}: not an address of this machine; "
                             "give a local address, e.g. 127.0.0.1")
    raise InvalidRequest(f"cannot listen on --host {host!r} --port {port}: {errors[0].strerror or errors[0]}; "
                         "pick another --host/--port (--port 0: a free one)")
