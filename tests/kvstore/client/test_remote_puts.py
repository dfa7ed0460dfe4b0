"""How ``kvstore.client.puts`` sends one piece of a ``put_many`` over gRPC (``send_fitting``),
against a fake transport: a daemon whose ``max_batch_items`` may change under the client.

The fake stands in for ``Puts.send_puts`` (one PutStream call): it refuses
a call over its current item limit with ``BatchTooLarge`` before storing anything (the
daemon's contract, ``kvstore.errors.BatchTooLarge``), and otherwise stores each item,
answering ``created`` as the daemon does. Every test checks that no item was sent twice and
that every item this call stored answers ``created=True``.
"""

from __future__ import annotations

import types

import pytest

from kvstore.api import PutItem
from kvstore.client.options import ClientOptions
from kvstore.client.puts import Puts
from kvstore.client.remote import RemoteStore
from kvstore.client.transport import Transport
from kvstore.errors import BatchTooLarge, RequestTooLarge
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import check_message_bytes, encode_item, fitting_runs


class FakeDaemon:
    """The calls a client made (item counts; refused ones too) and the keys it stored."""

    def __init__(self, limits: list[int]) -> None:
        self.limits = limits  # the item limit for each call in turn; the last one stays
        self.calls: list[int] = []
        self.refused: list[int] = []
        self.stored: dict[bytes, int] = {}

    def send(self, encs) -> list[bool]:
        limit = self.limits[min(len(self.calls), len(self.limits) - 1)]
        self.calls.append(len(encs))
        if len(encs) > limit:
            self.refused.append(len(encs))
            raise BatchTooLarge(f"{len(encs)} items is over max_batch_items={limit}", limit=limit)
        return self.store(encs)

    def store(self, encs) -> list[bool]:
        out = []
        for e in encs:
            key = e.message()
            out.append(key not in self.stored)
            self.stored[key] = self.stored.get(key, 0) + 1
        return out


def client(daemon: FakeDaemon, *, batch_items: int = 4096, message_bytes: int = 10**6) -> Puts:
    rpc = Transport("grpc://127.0.0.1:1", ClientOptions(max_batch_items=batch_items))  # its channel is never used
    rpc.options = types.SimpleNamespace(max_message_bytes=message_bytes, timeout_s=5)  # below ClientOptions' floor
    rs = Puts(rpc, None)  # put_many: over gRPC only
    rs.send_puts = daemon.send
    return rs


def items(n: int, size: int = 10) -> list:
    return [encode_item(PutItem(i.to_bytes(16, "big"), b"x" * size)) for i in range(n)]


def test_a_run_longer_than_the_learned_item_limit_is_split_before_it_is_sent() -> None:
    """Once a refusal taught the daemon's limit, each run is sent in pieces of it. Before, runs
    were split by bytes only, so a run longer than the learned limit was sent whole and refused
    once more (with nothing of the piece stored yet, the refusal escaped the call)."""
    encs = items(20)
    daemon = FakeDaemon([7])
    rs = client(daemon, batch_items=7)  # learned by an earlier call
    assert rs.send_fitting(encs) == [True] * 20
    assert daemon.refused == [] and daemon.calls == [7, 7, 6]
    assert sorted(daemon.stored.values()) == [1] * 20


def test_a_limit_learned_mid_piece_splits_the_later_runs_too() -> None:
    """The limit learned from a run refused after an earlier one was stored splits that run and
    every later one: one refused call in all (before, the last run of 10 was refused again)."""
    encs = items(50)
    daemon = FakeDaemon([100, 7])
    rs = client(daemon, message_bytes=20 * encs[0].nbytes)  # runs of 20, 20, 10 by bytes
    assert rs.send_fitting(encs) == [True] * 50
    assert daemon.refused == [20] and daemon.calls == [20, 20, 7, 7, 6, 7, 3]
    assert sorted(daemon.stored.values()) == [1] * 50 and rs._rpc.batch_items == 7


def test_a_limit_that_drops_twice_in_one_piece_never_escapes_once_items_are_stored() -> None:
    """The daemon's limit drops while a piece is re-split after a first drop: the rest is
    re-split again from where it stopped. Before, the second refusal escaped to ``put_many``'s
    piece loop (``Transport.each_piece``), which learned from it and re-sent the whole piece: the items
    already stored answered ``created=False`` though this call stored them."""
    encs = items(50)
    daemon = FakeDaemon([100, 7, 3])
    rs = client(daemon, message_bytes=20 * encs[0].nbytes)  # runs of 20, 20, 10 by bytes
    assert rs.send_fitting(encs) == [True] * 50
    assert daemon.refused == [20, 7] and sorted(daemon.stored.values()) == [1] * 50
    assert rs._rpc.batch_items == 3 and daemon.calls[:3] == [20, 20, 7] and max(daemon.calls[3:]) == 3


class NoLimitNamed(FakeDaemon):
    """Lets its first call through whole, then refuses anything over ``limits[0]`` items
    naming no limit (``limit=0``)."""

    def send(self, encs) -> list[bool]:
        self.calls.append(len(encs))
        if len(self.calls) > 1 and len(encs) > self.limits[0]:
            self.refused.append(len(encs))
            raise BatchTooLarge("over max_batch_items", limit=0)
        return self.store(encs)


def test_refusals_that_name_no_lower_limit_halve_the_runs_and_end() -> None:
    """A refusal after part of the piece was stored that names no limit below what was sent
    halves the run, so the loop ends; a single item refused so is ``InvalidRequest``, not
    ``BatchTooLarge`` (which would make the caller re-send the whole piece)."""
    from kvstore.errors import InvalidRequest

    encs = items(40)
    daemon = NoLimitNamed([5])
    rs = client(daemon, message_bytes=10 * encs[0].nbytes)  # runs of 10
    assert rs.send_fitting(encs) == [True] * 40
    assert daemon.refused == [10] and sorted(daemon.stored.values()) == [1] * 40  # halved to 5, which fits

    stubborn = NoLimitNamed([0])
    rs = client(stubborn, message_bytes=10 * encs[0].nbytes)
    with pytest.raises(InvalidRequest, match="refused a 1-item put") as exc:
        rs.send_fitting(encs)
    assert not isinstance(exc.value, BatchTooLarge)
    assert stubborn.refused == [10, 5, 2, 1] and len(stubborn.stored) == 10


@pytest.mark.parametrize("size", [100, 1000, 16_000])
def test_runs_for_an_older_daemon_count_each_items_putmany_framing(size) -> None:
    """Without PutStream the client sends a ``PutManyRequest``, which frames every item (a tag and
    a length varint). Runs are sized by that framed size, so each request is within
    ``max_message_bytes`` however the batch falls. Before, they were summed unframed: a run of 64
    items exactly at the limit was 192 bytes over it and refused after earlier runs were stored."""
    from kvstore.wire import put_bytes  # PutMany's framing sizes: the compatibility path

    encs = items(200, size)
    limit = 64 * encs[0].nbytes
    sent: list[int] = []

    def call(method, req, *a, **kw):  # the channel's max_send_message_length, as gRPC enforces it
        assert method == "PutMany"
        if req.ByteSize() > limit:
            raise RequestTooLarge(f"{req.ByteSize()} bytes over {limit}")
        sent.append(req.ByteSize())
        return pb.PutManyReply(created=[True] * len(req.items))

    rs = client(FakeDaemon([10**6]), message_bytes=limit)
    rs._send_puts = types.MethodType(RemoteStore._send_puts, rs)
    rs._streams, rs._call = False, call
    assert rs._send_fitting(encs) == [True] * 200
    assert len(sent) > 1 and max(sent) <= limit
    assert all(s + put_bytes(encs[0], framed=True) > limit for s in sent[:-1])  # each run as full as it fits
    # the boundary: a run framed exactly at the limit fits, one byte over does not
    run = fitting_runs(encs, limit, framed=True)[0]
    exact = sum(put_bytes(e, framed=True) for e in encs[run])
    assert pb.PutManyRequest(items=[pb.PutRequest.FromString(e.message()) for e in encs[run]]).ByteSize() == exact
    check_message_bytes(encs[run], 200, exact, framed=True)
    with pytest.raises(RequestTooLarge):
        check_message_bytes(encs[run], 200, exact - 1, framed=True)
    check_message_bytes(encs[:64], 200, limit)  # a PutStream carries no framing: exactly at the limit fits
    with pytest.raises(RequestTooLarge):
        check_message_bytes(encs[:64], 200, limit, framed=True)


def test_a_piece_checked_for_an_older_daemon_counts_its_framing() -> None:
    """``check_puts`` (no direct writes: the piece goes as one call) refuses, before sending
    anything, a piece that fits as a PutStream but not as a ``PutManyRequest`` once the daemon
    is known to lack PutStream."""
    encs = items(64, 1000)
    rs = client(FakeDaemon([10**6]), message_bytes=64 * encs[0].nbytes)
    rs.check_puts(encs)
    rs._streams = False
    with pytest.raises(RequestTooLarge):
        rs.check_puts(encs)


def test_a_run_sized_for_putstream_that_meets_an_older_daemon_goes_in_framed_runs() -> None:
    """The first PutStream of a client answered UNIMPLEMENTED: the run, sized for a stream, is
    sent as PutMany in runs that fit framed, not as one request over the limit."""
    from kvstore.client.remote import _Unimplemented

    encs = items(64, 1000)
    limit = 64 * encs[0].nbytes  # exactly at the limit as a stream
    sent: list[int] = []

    def call(method, req, *a, **kw):
        if req.ByteSize() > limit:
            raise RequestTooLarge(f"{req.ByteSize()} bytes over {limit}")
        sent.append(len(req.items))
        return pb.PutManyReply(created=[True] * len(req.items))

    def older(method, run):
        rs._streams = False
        raise _Unimplemented(method)

    rs = client(FakeDaemon([10**6]), message_bytes=limit)
    rs._send_puts = types.MethodType(RemoteStore._send_puts, rs)
    rs._call, rs._stream_call, rs._md = call, older, None
    assert rs._send_fitting(encs) == [True] * 64
    assert sum(sent) == 64 and len(sent) == 2 and rs._streams is False


def test_an_older_daemons_limit_dropping_mid_piece_stores_nothing_twice():
    """The real ``_send_puts`` against an older daemon (PutStream UNIMPLEMENTED) whose item limit
    drops from 100 to 1 after its first PutMany. A piece sized for a PutStream that no longer fits
    one PutMany was sent by ``_send_puts`` in framed runs of its own; when a later run was refused,
    the runs it had stored were lost to the caller, which re-sent the whole piece: 38 items stored
    twice and answered created=False (QA). Now ``_send_puts`` asks for a re-split before sending."""
    from kvstore.client.remote import _Unimplemented

    daemon = FakeDaemon([100, 1])
    encs = items(40, size=5)
    limit = sum(e.nbytes for e in encs)  # fits one PutStream, not one PutMany
    assert len(fitting_runs(encs, limit, framed=True)) == 2
    rs = client(daemon, message_bytes=limit)
    del rs._send_puts  # the real one, over the fakes below
    rs.options.timeout_s = 5

    def older_stream(method, run):
        rs._streams = False  # as _unimplemented does on UNIMPLEMENTED
        raise _Unimplemented(method)

    rs._stream_call = older_stream
    sent = lambda req: types.SimpleNamespace(message=req.SerializeToString)  # noqa: E731 - as EncodedPut
    rs._call = lambda method, req, *a, **k: pb.PutManyReply(created=daemon.send([sent(r) for r in req.items]))
    rs._md = None
    assert rs._send_fitting(encs) == [True] * 40
    assert len(daemon.stored) == 40 and max(daemon.stored.values()) == 1
