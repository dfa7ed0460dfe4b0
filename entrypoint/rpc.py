"""Serving the ``kvstack.serving`` gRPC services (``proto/serving.proto``) with our own parsing.

Who calls it: ``entrypoint.server.serve`` (the ``Entrypoint`` service) and
``entrypoint.worker.serve`` (the ``Worker`` service), through ``make_server``.

Why not the generated ``add_*Servicer_to_server``: those hand gRPC the message's
``FromString`` as the request deserializer, and a request whose bytes do not
parse then fails inside gRPC with its generic INTERNAL "Exception
deserializing request!", which a client reads as a server bug (and the
entrypoint's failover as a retryable worker failure). Here every method is
registered with ``request_deserializer=None`` and the raw bytes are parsed
before the servicer's method is called; bytes that do not parse are
INVALID_ARGUMENT naming the method and the message type it expects, and the
servicer never sees them.

The handlers are built from the service descriptor, so every method of the
service is covered, including one added to the proto later; a servicer that
lacks one of them is refused at start (a bug, not a request error).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import grpc
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from kvstore.errors import InvalidRequest
from kvstore.netaddr import port_taken

MAX_MESSAGE_BYTES = 64 << 20  # gRPC send/receive limit of the entrypoint and the workers


def parse_request(method: MethodDescriptor, raw: bytes, context: grpc.ServicerContext) -> Any:
    """``raw`` parsed as ``method``'s request message; INVALID_ARGUMENT (aborts) when it does not parse."""
    cls = GetMessageClass(method.input_type)
    try:
        return cls.FromString(raw)
    except (DecodeError, ValueError) as exc:  # ValueError: e.g. bad UTF-8 in a string field
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"malformed {method.name} request ({len(raw)} bytes): {exc}; send a serialized "
                      f"{method.input_type.full_name}")


def _unary(method: MethodDescriptor, behaviour: Callable) -> Callable:
    def handle(raw: bytes, context: grpc.ServicerContext) -> Any:
        return behaviour(parse_request(method, raw, context), context)
    return handle


def _server_stream(method: MethodDescriptor, behaviour: Callable) -> Callable:
    def handle(raw: bytes, context: grpc.ServicerContext) -> Iterator[Any]:
        yield from behaviour(parse_request(method, raw, context), context)
    return handle


def add_service(server: grpc.Server, servicer: Any, service: ServiceDescriptor) -> None:
    """Register every method of ``service`` on ``server``, served by ``servicer``'s method of the same name."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    for m in service.methods:
        behaviour = getattr(servicer, m.name, None)
        if behaviour is None or m.client_streaming:
            raise TypeError(f"{type(servicer).__name__} cannot serve {m.full_name} (missing, or a client stream "
                            "entrypoint.rpc does not handle): this is a bug")
        serialize = GetMessageClass(m.output_type).SerializeToString
        if m.server_streaming:
            handlers[m.name] = grpc.unary_stream_rpc_method_handler(
                _server_stream(m, behaviour), request_deserializer=None, response_serializer=serialize)
        else:
            handlers[m.name] = grpc.unary_unary_rpc_method_handler(
                _unary(m, behaviour), request_deserializer=None, response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def make_server(executor: Any, services: Iterable[tuple[Any, ServiceDescriptor]], host: str,
                port: int, *, interceptors: Iterable[grpc.ServerInterceptor] = (),
                credentials: grpc.ServerCredentials | None = None) -> tuple[grpc.Server, int]:
    """A server (not started) with ``services`` added, bound to ``host:port``; returns it and the bound port.

    ``interceptors`` run before any handler, so before the request bytes are parsed (the
    worker's secret check, ``entrypoint.auth.server_interceptors``). ``credentials``: serve
    TLS (``entrypoint.tls.ServerTLS.credentials``); ``None``: plaintext. A port that cannot be
    bound (or a TLS key that does not match its certificate) raises ``InvalidRequest`` (after
    stopping the server)."""
    server = grpc.server(executor, interceptors=tuple(interceptors) or None,
                         options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                  ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)])
    for servicer, service in services:
        add_service(server, servicer, service)
    try:
        if port_taken(host, port):
            bound = 0
        elif credentials is not None:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
        else:
            bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # current grpcio raises ("Failed to bind"); older releases returned 0
        bound = 0
    if bound == 0:
        server.stop(None)
        hint = "; or the TLS key does not match the certificate" if credentials is not None else ""
        raise InvalidRequest(f"cannot bind {host}:{port} (in use, or not a local address{hint}); pick another "
                             "--host/--port (--port 0: a free one)")
    return server, bound
