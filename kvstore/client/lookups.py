"""``Lookups``: the prefix lookups of ``kvstore.client.remote.RemoteStore`` on one daemon:
``lookup``, ``lookup_many`` and ``probe``.

Keys come validated (``RemoteStore`` checks them, once, before anything is sent); a
chain longer than the transport's
``batch_items`` (``kvstore.client.transport``) goes in pieces, in order, each piece asked
only while the keys before it all hit.
"""

from __future__ import annotations

from typing import Any

from kvstore.api import LookupResult
from kvstore.client.transport import Transport
from kvstore.errors import BatchTooLarge, InternalError
from kvstore.proto import kvstore_pb2 as pb


class Lookups:
    """``lookup``, ``lookup_many`` and ``probe`` over ``rpc`` (module docstring)."""

    def __init__(self, rpc: Transport):
        self._rpc = rpc

    @staticmethod
    def _result(r: pb.LookupReply) -> LookupResult:
        return LookupResult(int(r.hit_blocks), int(r.swa_at) if r.HasField("swa_at") else None)

    def lookup(self, keys: list[bytes]) -> LookupResult:
        """Longest prefix of validated ``keys``; a chain longer than ``max_batch_items`` is
        looked up piece by piece, each piece only while every key before it hit (a 100k-token
        prompt in 16-token blocks is a 6,250-key chain)."""
        hit, swa_at = 0, None
        for p, r in self._rpc.each_piece(len(keys), lambda p: self._result(
                self._rpc.call("Lookup", pb.LookupRequest(keys=keys[p])))):
            hit = p.start + r.hit_blocks
            if r.swa_at is not None:
                swa_at = p.start + r.swa_at
            if r.hit_blocks < p.stop - p.start:
                break
        return LookupResult(hit, swa_at)

    def lookup_many(self, msgs: list[list[bytes]]) -> list[LookupResult]:
        """One result per validated chain, in order. The daemon limits both the chains of one LookupMany
        and the keys in all of them to its ``max_batch_items``: chains go in pieces of whole
        chains within both (``batch_items``), a chain longer than that alone through
        ``lookup``. A piece refused as too large re-splits once with the learned limit, as
        ``Transport.each_piece`` does."""
        out: list[LookupResult] = []
        i, retried = 0, False
        while i < len(msgs):
            limit = self._rpc.batch_items
            if len(msgs[i]) > limit:
                out.append(self.lookup(msgs[i]))
                i += 1
                continue
            j, n_keys = i, 0
            while j < len(msgs) and j - i < limit and n_keys + len(msgs[j]) <= limit:
                n_keys += len(msgs[j])
                j += 1
            try:
                reply = self._rpc.call("LookupMany", pb.LookupManyRequest(
                    chains=[pb.LookupRequest(keys=c) for c in msgs[i:j]]))
            except BatchTooLarge as exc:
                if retried or not self._rpc.learn(exc, max(j - i, n_keys)):
                    raise
                retried = True
                continue  # the same chains again, within the learned limit
            out.extend(self._result(r) for r in self._rpc.check_count("LookupMany", list(reply.results), j - i))
            i = j
        return out

    def probe(self, keys: list[bytes], until_miss: bool, ends: list[int] | None) -> tuple[bytes, bytes]:
        """Per validated key: (1 if a live block entry, 1 if also a live SWA entry), as two byte strings.
        ``until_miss`` (``keys`` are one chain's share, in chain order): the strings may end
        at the first key without a live block (``EmbeddedStore.probe``); pieces after it are
        not asked for. ``ends`` (several chains' shares, ``Index.probe``'s ``chain_ends``, checked
        by ``kvstore.api.check_chain_ends``): each piece carries the ends of the shares within it,
        and the answer covers every key."""
        block, swa = [], []

        def ask(p: slice) -> Any:
            # the distinct ends inside the piece (empty shares dropped): never more than its keys
            cut = None if ends is None else sorted({e - p.start for e in ends if p.start < e < p.stop} | {p.stop - p.start})
            return self._rpc.call("Probe", pb.ProbeRequest(keys=keys[p], until_miss=until_miss, chain_ends=cut))

        for p, r in self._rpc.each_piece(len(keys), ask):
            n = p.stop - p.start
            short = len(r.block) < n
            if len(r.swa) != len(r.block) or len(r.block) > n or (
                    short and (not until_miss or r.block[-1:] != b"\0")):
                raise InternalError(f"Probe answered {len(r.block)}/{len(r.swa)} flags for {n} keys (a kvstore bug)")
            block.append(r.block)
            swa.append(r.swa)
            if until_miss and 0 in r.block:
                break
        if ends is None:
            return b"".join(block), b"".join(swa)
        # A share cut by a piece boundary was read on in the next piece: after its first miss,
        # answer 0 as one daemon does.
        block_all, swa_all = bytearray(b"".join(block)), bytearray(b"".join(swa))
        for a, b in zip([0] + ends, ends):
            miss = block_all.find(0, a, b)
            if miss >= 0:
                block_all[miss:b] = swa_all[miss:b] = bytes(b - miss)
        return bytes(block_all), bytes(swa_all)
