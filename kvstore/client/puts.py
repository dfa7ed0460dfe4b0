"""``Puts``: how ``kvstore.client.remote.RemoteStore`` stores entries on one daemon.

A put comes validated and encoded (``kvstore.wire.encode_item``: ``RemoteStore``, or
``ShardedStore`` for its shards, does it once, before anything is sent; the ``EncodedPut``
carries the validated item for direct writes), and is sent as one
``Put`` (a single put), or, for ``put_many``, in pieces of at most the transport's
``batch_items`` (``kvstore.client.transport``), each piece written directly into the
targets (``kvstore.client.direct_writes``, when on) or sent as ``PutStream`` calls.

Rules:
  * Every item is validated before anything is sent, so bad input stores nothing.
  * A batch that spans pieces (or, through ``ShardedStore``, daemons) checks every value
    against the daemon's ``max_value_bytes`` first (``daemon_max_value_bytes``: asked once
    per client, and only for such a batch: a single put or a one-piece batch sends no extra
    call, the daemon refuses those whole), and every piece (with direct writes, every
    item) against ``max_message_bytes``.
  * A piece refused as over the daemon's ``max_batch_items`` stored nothing and is re-split
    (``Transport.each_piece``); a piece is never sent twice (``send_fitting``).
"""

from __future__ import annotations

import threading

from kvstore.client.direct_writes import DirectWrites
from kvstore.client.transport import Transport
from kvstore.errors import BatchTooLarge, CapacityExceeded, InvalidRequest
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import EncodedPut, check_message_bytes, check_value_sizes, fitting_runs


class Puts:
    """``put`` and ``put_many`` to one daemon over ``rpc``, with its direct writes ``direct``
    (``None`` when off). Thread-safe."""

    def __init__(self, rpc: Transport, direct: DirectWrites | None):
        self._rpc = rpc
        self._direct = direct
        # The daemon's max_value_bytes (``daemon_max_value_bytes``): asked once, for the first batch
        # that spans pieces or shards; None while not asked or when the daemon sets none.
        self._value_limit: int | None = None
        self._value_limit_asked = False
        self._describe_lock = threading.Lock()

    def put(self, enc: EncodedPut) -> bool:
        """One put (``kvstore.api``'s ``put``), validated and encoded as ``enc``: with direct
        writes as a one-item ``put_many``."""
        if self._direct is not None:
            return self.put_many([enc])[0]
        return self._rpc.put(enc)

    def put_many(self, encs: list[EncodedPut]) -> list[bool]:
        """``kvstore.api``'s batched put of items validated and encoded as ``encs``; one
        ``created`` flag per item, in order.

        The batch is checked whole before anything is sent (``check_puts``), so bad input
        stores nothing. A batch of more than ``max_batch_items`` items (the option, or the daemon's
        lower limit once learned: ``kvstore.client.transport``) goes to the daemon as consecutive
        pieces of at most that many, so unlike the embedded store's ``put_many`` (one index commit
        for the whole batch) it is not one unit: a failure in a later piece (daemon down,
        quota, capacity) raises after the earlier pieces were stored. A piece refused as over
        the daemon's limit stored nothing and is resent in smaller pieces. Retrying the whole
        batch is safe: a put of a live key stores nothing (it answers ``created=False``)."""
        self._rpc.check_open()
        if not encs:
            return []
        out: list[bool] = []
        try:
            for _, got in self._rpc.each_piece(len(encs), lambda p: self._put_piece(encs[p]),
                                               check=lambda pieces: self.check_puts(encs, pieces)):
                out.extend(got)
        except CapacityExceeded as exc:
            _created_of_all(exc, out, len(encs))
            raise
        return out

    def check_puts(self, encs: list[EncodedPut], pieces: list[slice] | None = None, *,
                   spans: bool = False) -> None:
        """What ``put_many`` checks of a validated batch (``encs``, split as ``pieces``; default:
        as now) before sending any: for several pieces, or a batch that ``spans`` other daemons
        (``ShardedStore``), each value against this daemon's ``max_value_bytes`` (asked once);
        each piece (with direct writes, each item) against ``max_message_bytes``. One piece
        costs no call: the daemon refuses it whole."""
        pieces = self._rpc.pieces(len(encs)) if pieces is None else pieces
        if spans or len(pieces) > 1:
            check_value_sizes(encs, self.daemon_max_value_bytes())
        limit = self._rpc.options.max_message_bytes
        if self._direct is None:
            for p in pieces:
                check_message_bytes(encs[p], len(encs), limit)
        else:  # written directly; a piece that goes through gRPC after all is sent in runs that fit (send_fitting)
            for e in encs:
                check_message_bytes([e], len(encs), limit)

    def daemon_max_value_bytes(self) -> int | None:
        """The daemon's ``max_value_bytes``, asked (``Describe``) on the first call and kept for
        this client's life; ``None`` when the daemon sets none. ``StoreUnavailable`` and the
        like are raised and asked again next time."""
        if self._value_limit_asked:
            return self._value_limit
        with self._describe_lock:
            if not self._value_limit_asked:
                d = self._rpc.call("Describe", pb.DescribeRequest())
                self._value_limit = d.max_value_bytes or None
                self._value_limit_asked = True
        return self._value_limit

    def _put_piece(self, encs: list[EncodedPut]) -> list[bool]:
        """One piece of ``put_many`` (at most ``batch_items``): direct writes, else gRPC. Direct
        writes fall back to ``send_fitting`` for (part of) the piece. A ``BatchTooLarge`` from
        either (Commit or PutStream refused) stored nothing."""
        if self._direct is not None:
            self._rpc.check_open()
            got = self._rpc.guarded(self._direct.put_many, encs, self.send_fitting)
            if got is not None:
                return got
        return self.send_fitting(encs)

    def send_puts(self, encs: list[EncodedPut]) -> list[bool]:
        """One ``PutStream`` of at most ``batch_items`` encoded puts, checked against
        ``max_message_bytes`` first (``RequestTooLarge``, nothing sent)."""
        check_message_bytes(encs, len(encs), self._rpc.options.max_message_bytes)
        return self._rpc.put_stream(encs)

    def send_fitting(self, encs: list[EncodedPut]) -> list[bool]:
        """One piece over gRPC as ``send_puts`` of consecutive runs of at most ``max_message_bytes``
        (``wire.fitting_runs``), each in pieces of the item limit known now (``Transport.pieces``).
        Without direct writes ``check_puts`` bounded the piece: one run. With them it bounded
        each item only (a piece written directly may be any size), so a piece that goes through
        gRPC after all (Commit refused an entry, a pack failed, direct writes turned off) is
        never refused whole after the earlier pieces were stored.

        A refusal as over the daemon's ``max_batch_items`` (``BatchTooLarge``: nothing of that run
        stored) with nothing of this piece stored yet is raised, for ``each_piece`` to learn and
        re-split the piece. Once anything of it is stored, none escapes (re-sending the whole piece
        would put the stored items twice, answered ``created=False`` though this call stored them):
        the rest is re-split from where it stopped, at the limit the refusal names (``learn``), or
        at half the refused run when it names none below it (no limit, or one that rose under
        us). Each refusal lowers the run length, so the loop ends, also when the limit drops
        again while the rest is sent; a one-item run refused is ``InvalidRequest``."""
        out: list[bool] = []
        cap = len(encs)  # items per call, lowered by refusals that teach no usable limit
        while True:
            off = len(out)
            try:
                for r in fitting_runs(encs[off:], self._rpc.options.max_message_bytes):
                    for q in self._rpc.pieces(off + r.stop, off + r.start):
                        for p in (slice(i, min(i + cap, q.stop)) for i in range(q.start, q.stop, cap)):
                            out.extend(self.send_puts(encs[p]))
                return out
            except CapacityExceeded as exc:
                _created_of_all(exc, out, len(encs))
                raise
            except BatchTooLarge as exc:  # nothing of this run stored
                if not out:
                    raise  # nothing of this piece stored either: each_piece learns and re-splits it
                sent = p.stop - p.start
                if not self._rpc.learn(exc, sent):
                    if sent == 1:
                        raise InvalidRequest(
                            f"{self._rpc.url} refused a 1-item put as over its max_batch_items after {len(out)} "
                            f"items of this {len(encs)}-item piece were stored; check the daemon's "
                            "max_batch_items") from exc
                    cap = sent // 2


def _created_of_all(exc: CapacityExceeded, before: list[bool], n: int) -> None:
    """``exc.created`` (per item of the request that raised it, sent after the ``before``
    items of an ``n``-item call stored theirs) as per item of the whole call."""
    exc.widen_created(range(len(before), n), before + [False] * (n - len(before)))
