"""Calls whose request message never arrives: authenticated and admitted before it is awaited, so
they cannot take the daemon's handler threads (unary calls are taken as request streams)."""

from __future__ import annotations

import threading

import grpc
import pytest

import kvstore
from tests.kvstore.server.test_security import K, TOK_A, TOK_B, tokens_file  # noqa: F401 - fixture


def _stalled(stop: threading.Event):
    """A request iterator that sends nothing until ``stop``: the call's headers go out, its message never."""
    stop.wait(60)
    return
    yield  # noqa: unreachable


@pytest.mark.parametrize("token", [None, TOK_B], ids=["unauthenticated", "other-tenant"])
def test_stalled_unary_calls_cannot_take_every_handler_thread(make_daemon, tokens_file, token) -> None:  # noqa: F811
    """``workers`` unary calls whose request message never arrives, with no token at all or from
    one tenant far past ``max_concurrent_per_tenant``: each is refused (unauthenticated, or over
    its tenant's limit) before its message is awaited, so another tenant's put is served. (gRPC
    awaits a unary request's message on a handler thread before the handler runs: why the
    daemon takes unary calls as streams.)"""
    d = make_daemon(tokens_file=tokens_file, workers=4, max_concurrent_requests=3, max_concurrent_per_tenant=1)
    host = d.address.split("://")[1]
    stop = threading.Event()
    md = None if token is None else [("authorization", f"Bearer {token}")]
    chans = [grpc.insecure_channel(host) for _ in range(d.cfg.workers)]
    futs = [ch.stream_unary("/kvstore.v1.KVStore/Put").future(_stalled(stop), metadata=md) for ch in chans]
    try:
        with kvstore.connect(d.address, token=TOK_A, timeout_s=5) as a:
            assert a.put(K("victim"), b"served")
    finally:
        stop.set()
        for f in futs:
            f.cancel()
        for ch in chans:
            ch.close()
