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
from kvstore.client.transport import Transport
from kvstore.errors import BatchTooLarge
from kvstore.wire import encode_item


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
    every later one: one refused call in all (the last run of 10 is not refused again)."""
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


