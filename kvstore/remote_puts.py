"""The writes of ``kvstore.remote.RemoteStore`` above the transport: ``put_many``, its checks
(``check_puts``, ``daemon_max_value_bytes``) and how a piece is sent (``_put_piece``,
``_send_fitting``).

``RemotePuts`` is a base of ``RemoteStore`` (kept apart so each file has one job): it uses the
store's ``_call``, ``_each_piece``, ``_pieces``, ``_learn``, ``_send_puts``, ``_guarded``,
``_check_open``, ``_lock``, ``_describe_lock``, ``_value_limit``/``_value_limit_asked``,
``_direct_w``, ``options`` and ``url``, and follows ``kvstore.remote``'s rules (every item
validated before anything is sent; a batch over the daemon's ``max_batch_items`` goes in
pieces, in order; a piece refused as over that limit stored nothing and is re-split).
"""

from __future__ import annotations

import logging
from typing import Sequence

import grpc

from kvstore.api import PutItem, check_put_items
from kvstore.errors import KVStoreError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.wire import (BatchTooLarge, EncodedPut, check_message_bytes, check_value_sizes, encode_item,
                                 fitting_runs)

log = logging.getLogger("kvstore.remote")


class RemotePuts:
    """``put_many`` over gRPC or direct writes (module docstring)."""

    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        """``kvstore.api``'s batched put; one ``created`` flag per item, in order.

        Every item is validated before anything is sent (``check_puts``), so bad input stores
        nothing. A batch of more than ``max_batch_items`` items (the option, or the daemon's
        lower limit once learned: module docstring) goes to the daemon as consecutive pieces
        of at most that many, so unlike the embedded store's ``put_many`` (one index commit
        for the whole batch) it is not one unit: a failure in a later piece (daemon down,
        quota, capacity) raises after the earlier pieces were stored. A piece refused as over
        the daemon's limit stored nothing and is resent in smaller pieces. Retrying the whole
        batch is safe: a put of a live key stores nothing (it answers ``created=False``)."""
        self._check_open()
        items = check_put_items(items)
        if not items:
            return []
        encs = [encode_item(it) for it in items]  # validate every item before sending any
        out: list[bool] = []
        for _, got in self._each_piece(len(items), lambda p: self._put_piece(items[p], encs[p]),
                                       check=lambda pieces: self.check_puts(encs, pieces)):
            out.extend(got)
        return out

    def check_puts(self, encs: list[EncodedPut], pieces: list[slice] | None = None, *,
                   spans: bool = False) -> None:
        """What ``put_many`` checks of a validated batch (``encs``, split as ``pieces``; default:
        as now) before sending any: for several pieces, or a batch that ``spans`` other daemons
        (``ShardedStore``), each value against this daemon's ``max_value_bytes`` (asked once);
        each piece (with direct writes, each item) against ``max_message_bytes``. One piece
        costs no call: the daemon refuses it whole."""
        pieces = self._pieces(len(encs)) if pieces is None else pieces
        if spans or len(pieces) > 1:
            check_value_sizes(encs, self.daemon_max_value_bytes())
        if self._direct_w is None:
            for p in pieces:
                check_message_bytes(encs[p], len(encs), self.options.max_message_bytes)
        else:  # written directly; a piece that goes through gRPC after all is sent in runs that fit (_send_fitting)
            for e in encs:
                check_message_bytes([e], len(encs), self.options.max_message_bytes)

    def daemon_max_value_bytes(self) -> int | None:
        """The daemon's ``max_value_bytes``, asked (``Describe``) on the first call and kept for
        this client's life. ``None`` when the daemon does not say: one that predates
        ``Describe`` (UNIMPLEMENTED) or that sends no limit (it is then not asked again).
        ``StoreUnavailable`` and the like are raised and asked again next time."""
        if self._value_limit_asked:
            return self._value_limit
        with self._describe_lock:
            if not self._value_limit_asked:
                try:
                    d = self._call("Describe", pb.DescribeRequest())
                except KVStoreError as exc:
                    cause = exc.__cause__
                    if not (isinstance(cause, grpc.RpcError) and cause.code() is grpc.StatusCode.UNIMPLEMENTED):
                        raise
                    log.info("%s does not answer Describe; batches spanning pieces are not checked against "
                             "its max_value_bytes", self.url)
                    d = None
                self._value_limit = (d.max_value_bytes or None) if d is not None else None
                self._value_limit_asked = True
        return self._value_limit

    def _put_piece(self, items: list[PutItem], encs: list[EncodedPut]) -> list[bool]:
        """One piece of ``put_many`` (at most ``_batch_items``): direct writes, else gRPC.
        A ``BatchTooLarge`` from either (Commit or PutStream refused) stored nothing."""
        if self._direct_w is not None:
            self._check_open()
            got = self._guarded(self._direct_w.put_many, items, self._put_many_rpc)
            if got is not None:
                return got
        return self._send_fitting(encs)

    def _put_many_rpc(self, items: Sequence[PutItem]) -> list[bool]:
        """Direct writes' fallback: (part of) one piece over gRPC, validated, encoded, ``_send_fitting``."""
        return self._send_fitting([encode_item(it) for it in items])

    def _send_fitting(self, encs: list[EncodedPut]) -> list[bool]:
        """One piece over gRPC as ``_send_puts`` of consecutive runs of at most ``max_message_bytes``
        (``wire.fitting_runs``). Without direct writes ``check_puts`` bounded the piece: one run. With
        them it bounded each item only (a piece written directly may be any size), so a piece that
        goes through gRPC after all (Commit refused an entry, a pack failed, direct writes turned
        off) is never refused whole after the earlier pieces were stored (review). A run refused as
        over the daemon's ``max_batch_items`` after an earlier one was stored teaches this client the
        limit (``_learn``) and is sent in pieces of it: re-sending the whole piece would put the
        earlier runs' items twice, answered ``created=False`` though this call stored them."""
        out: list[bool] = []
        for r in fitting_runs(encs, self.options.max_message_bytes):
            # Each run in pieces of the item limit known now: once a refusal taught a lower one,
            # a later run longer than it is not sent whole to be refused once more (QA).
            for q in self._pieces(r.stop, r.start):
                try:
                    out.extend(self._send_puts(encs[q]))
                except BatchTooLarge as exc:  # nothing of this run stored
                    if not out or not self._learn(exc, q.stop - q.start):
                        raise  # nothing of this piece stored either: _each_piece learns and re-splits it
                    for p in self._pieces(q.stop, q.start):
                        out.extend(self._send_puts(encs[p]))
        return out
