"""The writes of ``kvstore.client.remote.RemoteStore`` above the transport: ``put_many``, its checks
(``check_puts``, ``daemon_max_value_bytes``) and how a piece is sent (``_put_piece``,
``_send_fitting``).

``RemotePuts`` is a base of ``RemoteStore`` (kept apart so each file has one job): it uses the
store's ``_call``, ``_each_piece``, ``_pieces``, ``_learn``, ``_send_puts``, ``_guarded``,
``_check_open``, ``_lock``, ``_describe_lock``, ``_value_limit``/``_value_limit_asked``,
``_direct_w``, ``options`` and ``url``, and follows ``kvstore.client.remote``'s rules (every item
validated before anything is sent; a batch over the daemon's ``max_batch_items`` goes in
pieces, in order; a piece refused as over that limit stored nothing and is re-split).
"""

from __future__ import annotations

import logging
from typing import Sequence

import grpc

from kvstore.api import PutItem, check_put_items
from kvstore.errors import InternalError, InvalidRequest, KVStoreError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import (BatchTooLarge, EncodedPut, check_message_bytes, check_value_sizes, encode_item,
                                 fitting_runs)

log = logging.getLogger("kvstore.client.remote")


class Resplit(Exception):
    """Raised by ``_send_puts`` before sending anything: the puts it was given were sized for a
    PutStream and no longer fit one PutMany call (the daemon just turned out older); the caller
    re-splits them, the framing counted now."""


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
                check_message_bytes(encs[p], len(encs), self.options.max_message_bytes, framed=not self._streams)
        else:  # written directly; a piece that goes through gRPC after all is sent in runs that fit (_send_fitting)
            for e in encs:
                check_message_bytes([e], len(encs), self.options.max_message_bytes, framed=not self._streams)

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
        (``wire.fitting_runs``, framed as a ``PutManyRequest`` for an older daemon), each in pieces
        of the item limit known now (``_pieces``). Without direct writes ``check_puts`` bounded the
        piece: one run. With them it bounded each item only (a piece written directly may be any
        size), so a piece that goes through gRPC after all (Commit refused an entry, a pack
        failed, direct writes turned off) is never refused whole after the earlier pieces were
        stored (review).

        A refusal as over the daemon's ``max_batch_items`` (``BatchTooLarge``: nothing of that run
        stored) with nothing of this piece stored yet is raised, for ``_each_piece`` to learn and
        re-split the piece. Once anything of it is stored, none escapes (re-sending the whole piece
        would put the stored items twice, answered ``created=False`` though this call stored them):
        the rest is re-split from where it stopped, at the limit the refusal names (``_learn``), or
        at half the refused run when it names none below it (an older daemon, a limit that rose
        under us). Each refusal lowers the run length, so the loop ends; a one-item run refused is
        ``InvalidRequest`` (QA: a limit that dropped twice in one call re-sent the piece)."""
        out: list[bool] = []
        cap = len(encs)  # items per call, lowered by refusals that teach no usable limit
        while True:
            off = len(out)
            try:
                for r in fitting_runs(encs[off:], self.options.max_message_bytes, framed=not self._streams):
                    for q in self._pieces(off + r.stop, off + r.start):
                        for p in (slice(i, min(i + cap, q.stop)) for i in range(q.start, q.stop, cap)):
                            out.extend(self._send_puts(encs[p]))
                return out
            except Resplit:  # nothing of this run sent; the runs from here are sized as PutMany now
                if self._streams:  # only an older daemon's fallback raises it; never loop on it
                    raise InternalError("_send_puts asked for a re-split while PutStream is on") from None
                continue
            except BatchTooLarge as exc:  # nothing of this run stored
                if not out:
                    raise  # nothing of this piece stored either: _each_piece learns and re-splits it
                sent = p.stop - p.start
                if not self._learn(exc, sent):
                    if sent == 1:
                        raise InvalidRequest(
                            f"{self.url} refused a 1-item put as over its max_batch_items after {len(out)} items "
                            f"of this {len(encs)}-item piece were stored; check the daemon's "
                            "max_batch_items") from exc
                    cap = sent // 2
