"""``RemoteStore``: the ``KVStore`` protocol over gRPC, talking to one ``kvstore serve`` daemon.

``kvstore.connect("grpc://127.0.0.1:7070")`` returns one (``grpcs://`` for TLS);
a comma-separated list of URLs returns a ``kvstore.sharded.ShardedStore``.

TLS and options: ``kvstore.client_options`` (the URL scheme decides TLS).

Guarantees (same as the embedded store, see ``kvstore.api``):
  * Every method has the embedded store's semantics and raises the same
    ``kvstore.errors`` classes: the daemon sends the error's ``code`` in the
    trailing metadata and ``kvstore.server.wire.error_from_rpc`` rebuilds it.
  * Misuse that the embedded store rejects before touching data (a key that
    is not 16 bytes, an unknown kind, a value that is not bytes-like) is
    rejected here too, before anything is sent.
  * A daemon that is down, restarting or too slow (``timeout_s``) raises
    ``StoreUnavailable``; the channel reconnects by itself (backoff capped at
    ``max_reconnect_backoff_ms``), so the next call after a restart succeeds.
  * Oversized messages raise ``RequestTooLarge`` (an ``InvalidRequest``)
    naming the limit, never a silent failure: both ends use
    ``max_message_bytes``.

Batches travel as streams (``GetStream``, ``PutStream``; see kvstore.proto):
one message per value, so a batch is never one multi-MiB message, and values
are hand-encoded (``kvstore.server.wire``: one copy, not protobuf's two). A
daemon that predates them (UNIMPLEMENTED) is served with GetMany/PutMany from
then on. A ``put_many`` (or one of its pieces, below) whose encoded items add
up to more than ``max_message_bytes`` raises ``RequestTooLarge`` before
anything is sent, as the one-message PutMany did.

Direct reads (``kvstore.direct``; opt-in, ``direct_reads="on"`` or ``"auto"``): ``get``,
``get_entry``, ``get_many`` and ``get_many_into`` ask the daemon where an entry's
fragments are (``Locate``) and read and verify them from the shared targets in this
process; a key whose direct read fails in any way is read through the daemon as
without the option, so results and errors are the same. Requires read access to the
targets' files (see the security note there).

Direct writes (``kvstore.direct_writes``; opt-in, ``direct_writes="on"`` or ``"auto"``, and
the daemon's ``allow_direct_writes``): ``put`` and ``put_many`` encode and write pack files
into the shared targets in this process and ask the daemon only to index them (``Commit``);
the results and errors are those of a put over gRPC. Requires write access to the targets.

Batches larger than ``max_batch_items`` (the daemon's per-call limit, 4096 by
default) are validated whole, then sent as consecutive pieces of at most that
many items, results concatenated in order, as ``lookup`` and ``probe`` do for
long chains. Such a batch is not one unit on the daemon: see ``put_many``.

The daemon's own limit is learned, not configured twice: a daemon refuses a batch
over its ``max_batch_items`` with ``wire.BatchTooLarge`` carrying that limit, before
any store work (``kvstore.server.service``: nothing of the refused call was applied).
The client then lowers its piece size to that limit for good (this client, i.e. this
daemon) and resends the refused piece and the rest in pieces, once per batch call (a
second refusal is raised). So with the default option and a daemon at a lower limit the
first over-limit batch costs one refused call and every later one none; the steady
state sends no extra call. ``max_batch_items`` given to ``connect`` stays an upper
bound (pieces are never larger than it). ``lookup_many`` counts chains and keys in all
chains against the limit, as the daemon does. A daemon that predates this sends no limit
with its refusal: the ``InvalidRequest`` is raised as before (set ``max_batch_items``).
"""

from __future__ import annotations

import json
import logging
import threading
import dataclasses
from typing import Any, Callable, Iterator, Sequence

import grpc

from kvstore.client_options import ClientOptions, parse_address, refuse_tls_options, split_urls
from kvstore.api import (Entry, EntryInfo, EntryKind, Layout, LookupResult, PutItem, check_chain_ends, check_put_items,
                         writable_view)
from kvstore.direct import DirectReads, copy_into
from kvstore.direct_writes import DirectWrites
from kvstore.errors import InternalError, InvalidRequest, StoreClosed
from kvstore.keys import check_key, check_keys
from kvstore.maintenance import Problem, ProblemKind
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server.wire import (MD_INDEX_KEYS, MD_STREAM_ITEMS, BatchTooLarge, EncodedPut, RequestTooLarge,
                                 encode_item, error_from_rpc, layout_from_pb, read_pem)

log = logging.getLogger(__name__)



class _Unimplemented(Exception):
    """The daemon does not know a streaming method (it predates it); the caller falls back."""


class RemoteStore:
    """``kvstore.api.KVStore`` over gRPC. Thread-safe (one channel, shared).

    ``url``'s scheme decides TLS (module docstring): ``InvalidRequest`` before any channel
    is opened for TLS options with a ``grpc://`` URL (unless ``options.grpcs_in_set``).
    """

    def __init__(self, url: str, options: ClientOptions | None = None):
        self.url = url
        self.address, tls = parse_address(url)
        self.options = o = options or ClientOptions()
        if not tls:
            refuse_tls_options(url, o)  # before opening anything
        opts = [("grpc.max_receive_message_length", o.max_message_bytes),
                ("grpc.max_send_message_length", o.max_message_bytes),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000)]
        if tls and o.server_name:
            opts.append(("grpc.ssl_target_name_override", o.server_name))
        if tls:  # the scheme alone decides; without ca_file, gRPC verifies against the system roots
            creds = grpc.ssl_channel_credentials(
                root_certificates=read_pem(o.ca_file, "ca_file", "CERTIFICATE") if o.ca_file else None,
                private_key=read_pem(o.key_file, "key_file", "PRIVATE KEY") if o.key_file else None,
                certificate_chain=read_pem(o.cert_file, "cert_file", "CERTIFICATE") if o.cert_file else None)
            self._channel = grpc.secure_channel(self.address, creds, options=opts)
        else:
            self._channel = grpc.insecure_channel(self.address, options=opts)
        self._stub = pb_grpc.KVStoreStub(self._channel)
        # Raw-bytes callables for the hand-encoded requests (no request serializer: already bytes).
        svc = "/kvstore.v1.KVStore/"
        self._put_raw = self._channel.unary_unary(svc + "Put", response_deserializer=pb.PutReply.FromString)
        self._get_stream = self._channel.unary_stream(
            svc + "GetStream", request_serializer=pb.GetManyRequest.SerializeToString,
            response_deserializer=pb.GetChunk.FromString)
        self._put_stream = self._channel.stream_unary(svc + "PutStream",
                                                      response_deserializer=pb.PutManyReply.FromString)
        self._streams = True  # False once the daemon answered UNIMPLEMENTED (an older daemon)
        self._md = (("authorization", f"Bearer {o.token}"),) if o.token else None
        self._closed = False
        self._lock = threading.Lock()
        # Items per batch call: the option, lowered to the daemon's max_batch_items once a
        # refusal told it (``_learn``); only ever lowered, so pieces never grow past the option.
        self._batch_items = o.max_batch_items
        # Direct reads (kvstore.direct): None when off; the daemon is first asked on the first read.
        self._direct = DirectReads(o.direct_reads, self._call, url) if o.direct_reads != "off" else None
        # Direct writes (kvstore.direct_writes): None when off; the daemon is first asked on the first put.
        self._direct_w = (DirectWrites(o.direct_writes, self._call, url, max_items=o.max_batch_items)
                          if o.direct_writes != "off" else None)

    # ------------------------------------------------------------------ plumbing
    def _check_open(self) -> None:
        """``StoreClosed`` after ``close``: every call checks first, an empty batch included."""
        if self._closed:
            raise StoreClosed("this store is closed; open a new one with kvstore.connect")

    def _call(self, method: str, req: Any, timeout_s: float | None = None, fn: Any = None,
              md: tuple[tuple[str, str], ...] = ()) -> Any:
        self._check_open()
        timeout = timeout_s or self.options.timeout_s
        try:
            return (fn or getattr(self._stub, method))(req, timeout=timeout, metadata=(*(self._md or ()), *md) or None)
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"{method} on {self.url}", timeout) from err

    def _unimplemented(self, err: grpc.RpcError) -> bool:
        """True (and streams off from now on) when the daemon does not know a streaming method."""
        if err.code() is grpc.StatusCode.UNIMPLEMENTED:
            self._streams = False
            return True
        return False

    # ------------------------------------------------------------------ writes
    def put(self, key: bytes, value: Any, *, kind: str = "block", ttl_s: float | None = None,
            layout: Layout | None = None, tokens: int = 0) -> bool:
        item = PutItem(key, value, kind, ttl_s, layout, tokens)
        if self._direct_w is not None:
            return self.put_many([item])[0]
        return self._call("Put", encode_item(item).message(), fn=self._put_raw).created

    def _each_piece(self, n: int, send: Callable[[slice], Any], *,
                    check: Callable[[slice], None] | None = None) -> Iterator[tuple[slice, Any]]:
        """A batch of ``n`` items as consecutive pieces of at most ``_batch_items``, in order:
        yields ``(piece, send(piece))``; the caller may stop early (``lookup``, ``probe``).

        ``check(piece)`` runs on every piece before the first is sent (and again on the rest,
        re-split, after a refusal). A piece the daemon refuses as over its ``max_batch_items``
        (``BatchTooLarge``: nothing of it was applied) teaches this client the daemon's limit
        (``_learn``); that piece and the rest are then re-split and sent. Once per call: a
        second refusal, or one that says nothing new, is raised.
        """
        self._check_open()
        off, retried = 0, False
        while off < n:
            step = self._batch_items
            pieces = [slice(o, min(o + step, n)) for o in range(off, n, step)]
            if check is not None:
                for p in pieces:
                    check(p)
            for p in pieces:
                try:
                    got = send(p)
                except BatchTooLarge as exc:
                    if retried or not self._learn(exc, p.stop - p.start):
                        raise
                    retried = True
                    break  # re-split from p.start (== off) with the learned limit
                off = p.stop
                yield p, got

    def _learn(self, exc: BatchTooLarge, sent: int) -> bool:
        """Lower ``_batch_items`` to the daemon's limit from its refusal of a ``sent``-item
        piece. False (the caller raises ``exc``) when the refusal names no usable limit, i.e.
        none below what was sent: an older daemon, or a limit that changed under us."""
        if not 0 < exc.limit < sent:
            return False
        with self._lock:
            if exc.limit < self._batch_items:
                log.info("%s refused a %d-item batch (max_batch_items=%d); sending batches of at most %d",
                         self.url, sent, exc.limit, exc.limit)
                self._batch_items = exc.limit
        return True

    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        """``kvstore.api``'s batched put; one ``created`` flag per item, in order.

        Every item is validated (and, without direct writes, every piece's size checked
        against ``max_message_bytes``) before anything is sent. A batch of more than
        ``max_batch_items`` items (the option, or the daemon's lower limit once learned:
        module docstring) goes to the daemon as consecutive pieces of at most that many, so
        unlike the embedded store's ``put_many`` (one index commit for the whole batch) it is
        not one unit: a failure in a later piece (daemon down, quota, capacity) raises after
        the earlier pieces were stored. A piece refused as over the daemon's limit stored
        nothing and is resent in smaller pieces. Retrying the whole batch is safe: a put of a
        live key stores nothing (it then answers ``created=False`` for those).
        """
        self._check_open()
        items = check_put_items(items)
        if not items:
            return []
        encs = [encode_item(it) for it in items]  # validate every item before sending any
        # Every piece fits in one call before the first is sent (``_each_piece``'s check).
        check = None if self._direct_w is not None else (lambda p: self._check_bytes(encs[p], len(items)))
        out: list[bool] = []
        for _, got in self._each_piece(len(items), lambda p: self._put_piece(items[p], encs[p]), check=check):
            out.extend(got)
        return out

    def _put_piece(self, items: list[PutItem], encs: list[EncodedPut]) -> list[bool]:
        """One piece of ``put_many`` (at most ``_batch_items``): direct writes, else gRPC.
        A ``BatchTooLarge`` from either (Commit or PutStream refused) stored nothing."""
        if self._direct_w is not None:
            self._check_open()
            got = self._direct_w.put_many(items, self._put_many_rpc)
            if got is not None:
                return got
        return self._send_puts(encs)

    def _check_bytes(self, encs: list[EncodedPut], batch: int) -> None:
        """``RequestTooLarge`` when these encoded puts are over ``max_message_bytes`` together."""
        total = sum(e.nbytes for e in encs)
        if total > self.options.max_message_bytes:
            what = f"put_many of {len(encs)} items" if len(encs) == batch else (
                f"a {len(encs)}-item piece of a put_many of {batch} items")
            raise RequestTooLarge(
                f"{what} ({total} bytes) is over this client's max_message_bytes="
                f"{self.options.max_message_bytes}; raise max_message_bytes on both the daemon and the client, "
                "or send smaller batches")

    def _put_many_rpc(self, items: Sequence[PutItem]) -> list[bool]:
        """One piece over gRPC (also direct writes' fallback): validated, encoded, sent."""
        return self._send_puts([encode_item(it) for it in items])

    def _send_puts(self, encs: list[EncodedPut]) -> list[bool]:
        """PutStream (PutMany for an older daemon) of at most ``max_batch_items`` encoded puts."""
        self._check_bytes(encs, len(encs))
        if self._streams:
            try:
                # Each item is encoded as gRPC asks for it: the next one is built while this one is sent.
                # The count declared, so a stream cut short (this process dies, the call is cancelled)
                # stores nothing instead of its first items.
                md = (*(self._md or ()), (MD_STREAM_ITEMS, str(len(encs))))
                reply = self._stream_call("PutStream", lambda: self._put_stream(
                    (e.message() for e in encs), timeout=self.options.timeout_s, metadata=md))
            except _Unimplemented:
                reply = None
            if reply is not None:
                return self._check_count("PutStream", list(reply.created), len(encs))
        reqs = [pb.PutRequest.FromString(e.message()) for e in encs]
        return self._check_count("PutMany", list(self._call("PutMany", pb.PutManyRequest(items=reqs)).created),
                                 len(encs))

    def _stream_call(self, method: str, run: Any) -> Any:
        """Run a streaming call; typed errors as ``_call``; ``_Unimplemented`` for an older daemon."""
        self._check_open()
        try:
            return run()
        except grpc.RpcError as err:
            if self._unimplemented(err):
                raise _Unimplemented(method) from err
            raise error_from_rpc(err, f"{method} on {self.url}") from err

    @staticmethod
    def _check_count(method: str, got: list, want: int) -> list:
        if len(got) != want:
            raise InternalError(f"{method} answered {len(got)} results for {want} items (a kvstore bug)")
        return got

    # ------------------------------------------------------------------ reads
    def get_entry(self, key: bytes, *, kind: str = "block") -> Entry:
        key = check_key(key)
        k = EntryKind.parse(kind)
        if self._direct is not None:
            e = self._direct.get_entry(key, k)  # NotFound from Locate; None: read through the daemon
            if e is not None:
                return e
        r = self._call("Get", pb.KeyRequest(key=key, kind=k.value))
        return Entry(key, k, layout_from_pb(r.layout), int(r.tokens), r.value)

    def get(self, key: bytes, *, kind: str = "block") -> bytes:
        return self.get_entry(key, kind=kind).data

    def get_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bytes | None]:
        self._check_open()
        keys = check_keys(keys)
        if not keys:
            return []
        k = EntryKind.parse(kind)
        out: list[bytes | None] = []
        for _, got in self._each_piece(len(keys), lambda p: self._get_piece(keys[p], k)):  # in pieces, in order
            out.extend(got)
        return out

    def _get_piece(self, keys: list[bytes], k: EntryKind) -> list[bytes | None]:
        """One piece of ``get_many`` (at most ``max_batch_items`` keys): direct reads, else gRPC."""
        if self._direct is not None:
            got = self._direct.get_many(keys, k, self._get_many_rpc)
            if got is not None:
                return got
        return self._get_many_rpc(keys, k)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *,
                      kind: str = "block") -> list[EntryInfo | None]:
        """``kvstore.api``'s batched read into caller buffers. With direct reads the payloads
        are decoded straight into ``outs`` (sizes checked against the located records before
        anything is read); otherwise, and for keys read through the daemon, ``get_many`` plus
        one copy (``EntryInfo.layout``/``tokens`` are then ``None``). Every key and buffer is
        checked first; more than ``max_batch_items`` keys are read in pieces, in order."""
        self._check_open()
        if len(outs) != len(keys):
            raise InvalidRequest(f"get_many_into: {len(keys)} keys but {len(outs)} output buffers")
        keys = [check_key(x) for x in keys]
        k = EntryKind.parse(kind)
        views = [writable_view(o, f"outs[{i}]") for i, o in enumerate(outs)]
        if not keys:
            return []
        out: list[EntryInfo | None] = []
        for _, got in self._each_piece(len(keys), lambda p: self._get_into_piece(keys[p], views[p], k)):
            out.extend(got)
        return out

    def _get_into_piece(self, keys: list[bytes], views: list[memoryview], k: EntryKind) -> list[EntryInfo | None]:
        """One piece of ``get_many_into``: direct reads, else gRPC plus one copy."""
        if self._direct is not None:
            got = self._direct.get_many_into(keys, views, k, self._get_many_rpc)
            if got is not None:
                return got
        done = copy_into(keys, self._get_many_rpc(keys, k), views, k, range(len(keys)))
        return [done[i] for i in range(len(keys))]

    def direct_write_stats(self) -> dict:
        """This client's direct writes: mode, active (or why not), counters (``kvstore.direct_writes``)."""
        if self._direct_w is None:
            return {"mode": "off", "active": False, "reason": "direct_writes='off'", "counters": {}}
        return self._direct_w.stats()

    def direct_stats(self) -> dict:
        """This client's direct reads: mode, active (or why not), counters (``kvstore.direct``)."""
        if self._direct is None:
            return {"mode": "off", "active": False, "reason": "direct_reads='off'", "counters": {}}
        return self._direct.stats()

    def _get_many_rpc(self, keys: list[bytes], k: EntryKind) -> list[bytes | None]:
        """The batched get over gRPC (GetStream; GetMany for an older daemon)."""
        req = pb.GetManyRequest(keys=keys, kind=k.value)
        if self._streams:
            def run() -> list[bytes | None]:
                out: list[bytes | None] = []
                for c in self._get_stream(req, timeout=self.options.timeout_s, metadata=self._md):
                    if c.index != len(out):
                        raise InternalError(f"GetStream sent index {c.index} at position {len(out)} (a kvstore bug)")
                    out.extend(v.value if v.found else None for v in c.values)
                return self._check_count("GetStream", out, len(keys))

            try:
                return self._stream_call("GetStream", run)
            except _Unimplemented:
                pass
        r = self._call("GetMany", req)
        return self._check_count("GetMany", [v.value if v.found else None for v in r.values], len(keys))

    # ------------------------------------------------------------------ delete, pin
    def _one(self, method: str, key: bytes, kind: str) -> bool:
        return self._call(method, pb.KeyRequest(key=check_key(key), kind=EntryKind.parse(kind).value)).ok

    def _many(self, method: str, keys: Sequence[bytes], kind: str, md: tuple[tuple[str, str], ...] = ()) -> list[bool]:
        """DeleteMany/PinMany/UnpinMany: every key validated, then pieces of at most
        ``max_batch_items`` in order (a failure in a later piece leaves earlier ones done)."""
        k = EntryKind.parse(kind).value
        reqs = [pb.KeyRequest(key=check_key(x), kind=k) for x in keys]

        def send(p: slice) -> list[bool]:
            reply = self._call(method, pb.KeysRequest(keys=reqs[p]), md=md)
            return self._check_count(method, list(reply.ok), len(reqs[p]))

        out: list[bool] = []
        for _, got in self._each_piece(len(reqs), send):
            out.extend(got)
        return out

    def delete(self, key: bytes, *, kind: str = "block") -> bool:
        return self._one("Delete", key, kind)

    def pin(self, key: bytes, *, kind: str = "block") -> bool:
        return self._one("Pin", key, kind)

    def unpin(self, key: bytes, *, kind: str = "block") -> bool:
        return self._one("Unpin", key, kind)

    def delete_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._many("DeleteMany", keys, kind)

    def delete_index_keys(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        """``kvtool delete``: ``delete_many`` of keys named as ``inspect_entries`` names them (an
        admin tenant: index keys, as ``check`` and kvtool on a data directory print them; any
        other tenant: its own keys), so it deletes what ``kvtool inspect`` shows."""
        return self._many("DeleteMany", keys, kind, md=((MD_INDEX_KEYS, "1"),))

    def pin_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._many("PinMany", keys, kind)

    def unpin_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._many("UnpinMany", keys, kind)

    # ------------------------------------------------------------------ lookup
    @staticmethod
    def _result(r: pb.LookupReply) -> LookupResult:
        return LookupResult(int(r.hit_blocks), int(r.swa_at) if r.HasField("swa_at") else None)

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest prefix; a chain longer than ``max_batch_items`` is looked up piece by piece,
        each piece only while every key before it hit (a 100k-token prompt in 16-token blocks
        is a 6,250-key chain)."""
        keys = check_keys(keys)
        hit, swa_at = 0, None
        for p, r in self._each_piece(len(keys), lambda p: self._result(
                self._call("Lookup", pb.LookupRequest(keys=keys[p])))):
            hit = p.start + r.hit_blocks
            if r.swa_at is not None:
                swa_at = p.start + r.swa_at
            if r.hit_blocks < p.stop - p.start:
                break
        return LookupResult(hit, swa_at)

    def lookup_many(self, chains: Sequence[Sequence[bytes]]) -> list[LookupResult]:
        """One result per chain, in order. The daemon limits both the chains of one LookupMany
        and the keys in all of them to its ``max_batch_items``: chains go in pieces of whole
        chains within both (``_batch_items``), a chain longer than that alone through
        ``lookup``. A piece refused as too large re-splits once with the learned limit, as
        ``_each_piece`` does."""
        self._check_open()
        msgs = [check_keys(c) for c in chains]  # every chain validated before anything is sent
        out: list[LookupResult] = []
        i, retried = 0, False
        while i < len(msgs):
            limit = self._batch_items
            if len(msgs[i]) > limit:
                out.append(self.lookup(msgs[i]))
                i += 1
                continue
            j, n_keys = i, 0
            while j < len(msgs) and j - i < limit and n_keys + len(msgs[j]) <= limit:
                n_keys += len(msgs[j])
                j += 1
            try:
                reply = self._call("LookupMany", pb.LookupManyRequest(
                    chains=[pb.LookupRequest(keys=c) for c in msgs[i:j]]))
            except BatchTooLarge as exc:
                if retried or not self._learn(exc, max(j - i, n_keys)):
                    raise
                retried = True
                continue  # the same chains again, within the learned limit
            out.extend(self._result(r) for r in self._check_count("LookupMany", list(reply.results), j - i))
            i = j
        return out

    def probe(self, keys: Sequence[bytes], *, until_miss: bool = False,
              chain_ends: Sequence[int] | None = None) -> tuple[bytes, bytes]:
        """Per key: (1 if a live block entry, 1 if also a live SWA entry), as two byte strings.
        ``until_miss`` (``keys`` are one chain's share, in chain order): the strings may end
        at the first key without a live block (``EmbeddedStore.probe``); pieces after it are
        not asked for. ``chain_ends`` (several chains' shares, ``Index.probe``): each piece
        carries the ends of the shares within it, and the answer covers every key."""
        keys = check_keys(keys)
        ends = check_chain_ends(chain_ends, len(keys), until_miss=until_miss)
        block, swa = [], []

        def ask(p: slice) -> Any:
            # the distinct ends inside the piece (empty shares dropped): never more than its keys
            cut = None if ends is None else sorted({e - p.start for e in ends if p.start < e < p.stop} | {p.stop - p.start})
            return self._call("Probe", pb.ProbeRequest(keys=keys[p], until_miss=until_miss, chain_ends=cut))

        for p, r in self._each_piece(len(keys), ask):
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

    # ------------------------------------------------------------------ maintenance
    def stats(self) -> dict:
        return json.loads(self._call("Stats", pb.StatsRequest()).json)

    def gc(self, *, dry_run: bool = False) -> dict:
        """The daemon's GC pass; waits up to ``maintenance_timeout_s`` (then ``DeadlineExceeded``)."""
        return json.loads(self._call("Gc", pb.GcRequest(dry_run=dry_run),
                                     timeout_s=self.options.maintenance_timeout_s).json)

    def check(self, fix: bool = False) -> list:
        """The daemon's consistency check; waits up to ``maintenance_timeout_s``."""
        r = self._call("Check", pb.CheckRequest(fix=fix), timeout_s=self.options.maintenance_timeout_s)
        return [Problem(ProblemKind(p.kind), p.key, p.entry_kind, p.target, p.detail, p.fixed) for p in r.problems]

    def repair(self) -> dict:
        """The daemon's repair pass; waits up to ``maintenance_timeout_s``."""
        return json.loads(self._call("Repair", pb.RepairRequest(), timeout_s=self.options.maintenance_timeout_s).json)

    # ------------------------------------------------------------------ inspect (read-only, kvtool)
    def inspect_summary(self) -> dict:
        """The store summary ``kvtool inspect`` shows (``kvstore.cli.index_view.summarize``,
        computed by the daemon). Needs an admin tenant (``PermissionDenied`` otherwise)."""
        return json.loads(self._call("Inspect", pb.InspectRequest()).json)

    def inspect_entries(self, keys: Sequence[bytes], *, kind: str = "block") -> list[dict]:
        """Per key, in order, its index view (``index_view.entry_view``: state live/lost/absent,
        sizes, times, fragments). Read-only: nothing is read or refreshed. An admin tenant
        names index keys; any other tenant its own keys (kvstore.proto's ``Inspect``)."""
        keys = check_keys(keys)
        k = EntryKind.parse(kind).value
        out: list[dict] = []
        for _, got in self._each_piece(len(keys), lambda p: self._inspect_piece(
                pb.InspectRequest(keys=keys[p], kind=k), "entries", p.stop - p.start)):
            out.extend(got)
        return out

    def inspect_chain(self, keys: Sequence[bytes]) -> list[dict]:
        """Per position of a prefix chain, the state of its block and of its SWA entry
        (``index_view.chain_view``); read-only, keys as for ``inspect_entries``."""
        keys = check_keys(keys)
        out: list[dict] = []
        for p, got in self._each_piece(len(keys), lambda p: self._inspect_piece(
                pb.InspectRequest(keys=keys[p], chain=True), "positions", p.stop - p.start)):
            for row in got:
                row["position"] += p.start  # each piece numbers its own positions from 0
            out.extend(got)
        return out

    def _inspect_piece(self, req: pb.InspectRequest, field: str, n: int) -> list[dict]:
        return self._check_count("Inspect", json.loads(self._call("Inspect", req).json)[field], n)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._channel.close()
                if self._direct is not None:
                    self._direct.close()
                if self._direct_w is not None:
                    self._direct_w.close()

    def __enter__(self) -> "RemoteStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_grpc(url: str, **overrides: Any):
    """``kvstore.connect`` opener for ``grpc://`` and ``grpcs://`` (a comma list: sharded).

    Options and every URL are checked (``split_urls``; TLS options with ``grpc://`` URLs
    only: ``refuse_tls_options``) before any channel is opened. In a list with a
    ``grpcs://`` URL the TLS options are for those shards (module docstring)."""
    opts = ClientOptions.from_overrides(overrides)
    urls = split_urls(url)
    if any(parse_address(u)[1] for u in urls):
        if len(urls) > 1 and opts.tls_given():
            opts = dataclasses.replace(opts, grpcs_in_set=True)
    else:
        refuse_tls_options(urls[0], opts)
    if len(urls) > 1:
        from kvstore.sharded import ShardedStore

        return ShardedStore(urls, opts)
    return RemoteStore(urls[0], opts)
