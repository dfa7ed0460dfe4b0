"""``RemoteStore``: the ``KVStore`` protocol over gRPC, talking to one ``kvstore serve`` daemon.

``kvstore.connect("grpc://127.0.0.1:7070")`` returns one (``grpcs://`` for TLS);
a comma-separated list of URLs returns a ``kvstore.client.sharded.ShardedStore``.

TLS and options: ``kvstore.client.options`` (the URL scheme decides TLS). Lookups:
``kvstore.client.remote_lookup``; maintenance, inspect and kvtool's delete: ``kvstore.client.remote_admin``;
``put_many`` and how its pieces are sent: ``kvstore.client.remote_puts``.

Guarantees (same as the embedded store, see ``kvstore.api``):
  * Every method has the embedded store's semantics and raises the same
    ``kvstore.errors`` classes: the daemon sends the error's ``code`` in the
    trailing metadata and ``kvstore.wire.error_from_rpc`` rebuilds it.
  * Misuse that the embedded store rejects before touching data (a key that
    is not 16 bytes, an unknown kind, a value that is not bytes-like) is
    rejected here too, before anything is sent.
  * A daemon that is down, restarting or too slow (``timeout_s``) raises
    ``StoreUnavailable``; the channel reconnects by itself (gRPC's backoff, capped
    at 1 s here), so a call made more than about a second after the daemon is back
    succeeds. One made sooner may still raise ``StoreUnavailable`` ("Connection
    refused": the channel waits out its backoff and fails fast meanwhile, rather than
    delay every call to a daemon that is really down); retry it after a short wait.
  * Oversized messages raise ``RequestTooLarge`` (an ``InvalidRequest``)
    naming the limit, never a silent failure: both ends use
    ``max_message_bytes``.

Batches travel as streams (``GetStream``, ``PutStream``; see kvstore.proto):
one message per value, so a batch is never one multi-MiB message, and values
are hand-encoded (``kvstore.wire``: one copy, not protobuf's two). A
daemon that predates them (UNIMPLEMENTED) is served with GetMany/PutMany from
then on. A ``put_many`` (or one of its pieces, below) whose encoded items add
up to more than ``max_message_bytes`` (with direct writes: any one item) raises
``RequestTooLarge`` before anything is sent, as the one-message PutMany did. With
direct writes a piece that goes through gRPC after all is sent in messages that fit.

Direct reads (``kvstore.client.direct_reads``; opt-in, ``direct_reads="on"`` or ``"auto"``): ``get``,
``get_entry``, ``get_many`` and ``get_many_into`` ask the daemon where an entry's
fragments are (``Locate``) and read and verify them from the shared targets in this
process; a key whose direct read fails in any way is read through the daemon as
without the option, so results and errors are the same. Requires read access to the
targets' files (see the security note there).

Direct writes (``kvstore.client.direct_writes``; opt-in, ``direct_writes="on"`` or ``"auto"``, and
the daemon's ``allow_direct_writes``): ``put`` and ``put_many`` encode and write pack files
into the shared targets in this process and ask the daemon only to index them (``Commit``);
the results and errors are those of a put over gRPC. Requires write access to the targets.

Batches larger than ``max_batch_items`` (the daemon's per-call limit, 4096 by
default) are validated whole, then sent as consecutive pieces of at most that
many items, results concatenated in order, as ``lookup`` and ``probe`` do for
long chains. Such a batch is not one unit on the daemon: see ``put_many``.

Bad input stores nothing, also across pieces: a ``put_many`` that spans more than one
piece (or, through ``ShardedStore``, more than one daemon) checks every value against the
daemon's ``max_value_bytes`` before the first piece is sent, raising the embedded store's
``InvalidRequest``. The limit is asked once per client (``Describe``), only when such a
batch comes: a single put or a one-piece batch sends no extra call (the daemon refuses
those whole). A daemon that does not say (one that predates it: ``Describe`` UNIMPLEMENTED,
or no limit in its answer) is not asked again, and its batches are checked as before: an
over-limit value then fails its own piece, after the earlier pieces were stored.
``get_many_into`` likewise checks every buffer (writable, contiguous, large enough) first.

Closing: a call racing ``close`` on another thread, and any call after it, raises
``StoreClosed``, never gRPC's own errors nor those of the direct paths' stopped workers.

The daemon's own limit is learned, not configured twice: a daemon refuses a batch
over its ``max_batch_items`` with ``wire.BatchTooLarge`` carrying that limit, before
any store work (``kvstore.server.service``: nothing of the refused call was applied).
The client then lowers its piece size to that limit for good and resends the refused
piece and the rest in pieces, once per batch call (a second refusal is raised): the
first over-limit batch costs one refused call, every later one none. ``max_batch_items`` given to ``connect`` stays an upper
bound (pieces are never larger than it). ``lookup_many`` counts chains and keys in all
chains against the limit, as the daemon does. A daemon that predates this sends no limit
with its refusal: the ``InvalidRequest`` is raised as before (set ``max_batch_items``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Callable, Iterator, Sequence

import grpc

from kvstore.client.options import ClientOptions, parse_address, refuse_tls_options, split_urls
from kvstore.api import Entry, EntryInfo, EntryKind, Layout, PutItem, writable_view
from kvstore.client.direct_reads import DirectReads, StagedInto, check_into_sizes, copy_into
from kvstore.client.direct_writes import DirectWrites
from kvstore.errors import InternalError, InvalidRequest, KVStoreError, StoreClosed, StoreUnavailable
from kvstore.keys import check_key, check_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.client.remote_admin import RemoteAdmin
from kvstore.client.remote_lookup import RemoteLookup
from kvstore.client.remote_puts import RemotePuts, Resplit
from kvstore.wire import (MD_STREAM_ITEMS, BatchTooLarge, EncodedPut, check_message_bytes, encode_item,
                                 error_from_rpc, fitting_runs, layout_from_pb)
from kvstore.tls import channel_credentials

log = logging.getLogger(__name__)


class _Unimplemented(Exception):
    """The daemon does not know a streaming method (it predates it); the caller falls back."""


class RemoteStore(RemotePuts, RemoteLookup, RemoteAdmin):
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
            creds = channel_credentials(o.ca_file, o.cert_file, o.key_file)
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
        # The daemon's max_value_bytes (``daemon_max_value_bytes``): asked once, for the first batch
        # that spans pieces or shards; None while not asked or when the daemon does not say.
        self._value_limit: int | None = None
        self._value_limit_asked = False
        self._describe_lock = threading.Lock()
        # Direct reads (kvstore.client.direct_reads): None when off; the daemon is first asked on the first read.
        self._direct = DirectReads(o.direct_reads, self._call, url) if o.direct_reads != "off" else None
        # Direct writes (kvstore.client.direct_writes): None when off; the daemon is first asked on the first put.
        self._direct_w = (DirectWrites(o.direct_writes, self._call, url, max_items=o.max_batch_items)
                          if o.direct_writes != "off" else None)

    # ------------------------------------------------------------------ plumbing
    @staticmethod
    def _closed_error() -> StoreClosed:
        return StoreClosed("this store is closed; open a new one with kvstore.connect")

    def _check_open(self) -> None:
        """``StoreClosed`` after ``close``: every call checks first, an empty batch included."""
        if self._closed:
            raise self._closed_error()

    def _raise_if_closed(self, err: Exception) -> None:
        """``StoreClosed`` when closed under a call and ``err`` is not a typed error."""
        if self._closed and not isinstance(err, KVStoreError):
            raise self._closed_error() from err

    def _typed(self, err: grpc.RpcError, where: str, timeout: float | None = None) -> KVStoreError:
        """``error_from_rpc``, except that a call cut off because this client was closed
        (cancelled, or its channel gone: ``StoreUnavailable``) is ``StoreClosed``. An error the
        daemon sent (typed in its metadata) stays what it is."""
        exc = error_from_rpc(err, where, timeout)
        return self._closed_error() if self._closed and isinstance(exc, StoreUnavailable) else exc

    def _call(self, method: str, req: Any, timeout_s: float | None = None, fn: Any = None,
              md: tuple[tuple[str, str], ...] = ()) -> Any:
        self._check_open()
        timeout = timeout_s or self.options.timeout_s
        try:
            return (fn or getattr(self._stub, method))(req, timeout=timeout, metadata=(*(self._md or ()), *md) or None)
        except grpc.RpcError as err:
            raise self._typed(err, f"{method} on {self.url}", timeout) from err
        except ValueError as err:  # gRPC: "Cannot invoke RPC: Channel closed!" (close() raced this call)
            self._raise_if_closed(err)
            raise

    def _guarded(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a direct-read or direct-write step: once this client is closed, a
        failure there (its workers stopped under it, its channel gone) is ``StoreClosed``."""
        try:
            return fn(*args)
        except StoreUnavailable as exc:
            if self._closed:
                raise self._closed_error() from exc
            raise
        except Exception as exc:
            self._raise_if_closed(exc)  # StoreClosed and the other typed errors pass through
            raise

    def _unimplemented(self, err: grpc.RpcError) -> bool:
        """True (and streams off from now on) when the daemon does not know a streaming method."""
        if err.code() is grpc.StatusCode.UNIMPLEMENTED:
            self._streams = False
            return True
        return False

    # ------------------------------------------------------------------ writes
    def put(self, key: bytes, value: Any, *, kind: str = "block", ttl_s: float | None = None,
            layout: Layout | None = None, tokens: int = 0) -> bool:
        self._check_open()  # first, as the embedded store, whatever the item
        item = PutItem(key, value, kind, ttl_s, layout, tokens)
        if self._direct_w is not None:
            return self.put_many([item])[0]
        return self._call("Put", encode_item(item).message(), fn=self._put_raw).created

    def _pieces(self, n: int, off: int = 0) -> list[slice]:
        """Items ``off:n`` of a batch as consecutive pieces of at most ``_batch_items``."""
        return [slice(o, min(o + self._batch_items, n)) for o in range(off, n, self._batch_items)]

    def _each_piece(self, n: int, send: Callable[[slice], Any], *,
                    check: Callable[[list[slice]], None] | None = None) -> Iterator[tuple[slice, Any]]:
        """A batch of ``n`` items as consecutive pieces of at most ``_batch_items``, in order:
        yields ``(piece, send(piece))``; the caller may stop early (``lookup``, ``probe``).

        ``check(pieces)`` runs on the pieces before the first is sent (and again on the rest,
        re-split, after a refusal). A piece the daemon refuses as over its ``max_batch_items``
        (``BatchTooLarge``: nothing of it was applied) teaches this client the daemon's limit
        (``_learn``); that piece and the rest are then re-split and sent. Once per call: a
        second refusal, or one that says nothing new, is raised.
        """
        self._check_open()
        off, retried = 0, False
        while off < n:
            pieces = self._pieces(n, off)
            if check is not None:
                check(pieces)
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

    def _send_puts(self, encs: list[EncodedPut]) -> list[bool]:
        """PutStream (PutMany for an older daemon) of at most ``max_batch_items`` encoded puts,
        checked against ``max_message_bytes`` as the call they go in counts them (``wire.put_bytes``)."""
        limit = self.options.max_message_bytes
        check_message_bytes(encs, len(encs), limit, framed=not self._streams)
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
        if len(fitting_runs(encs, limit, framed=True)) > 1:
            # Sized for a PutStream, and the daemon just turned out older: with a PutManyRequest's
            # framing they no longer fit one call. Nothing is sent: the caller re-splits from here
            # with the framing counted (``_send_fitting``), so that a later run refused cannot make
            # it send again runs already stored (QA: they came back created=False).
            raise Resplit
        check_message_bytes(encs, len(encs), limit, framed=True)
        reqs = [pb.PutRequest.FromString(e.message()) for e in encs]
        return self._check_count("PutMany", list(self._call("PutMany", pb.PutManyRequest(items=reqs)).created),
                                 len(encs))

    def _stream_call(self, method: str, run: Any) -> Any:
        """Run a streaming call (invoking it and reading its answer); typed errors as
        ``_call``, ``StoreClosed`` included; ``_Unimplemented`` for an older daemon."""
        self._check_open()
        try:
            return run()
        except grpc.RpcError as err:
            if not self._closed and self._unimplemented(err):
                raise _Unimplemented(method) from err
            raise self._typed(err, f"{method} on {self.url}") from err
        except ValueError as err:  # gRPC: "Cannot invoke RPC: Channel closed!" (close() raced this call)
            self._raise_if_closed(err)
            raise

    @staticmethod
    def _check_count(method: str, got: list, want: int) -> list:
        if len(got) != want:
            raise InternalError(f"{method} answered {len(got)} results for {want} items (a kvstore bug)")
        return got

    # ------------------------------------------------------------------ reads
    def get_entry(self, key: bytes, *, kind: str = "block") -> Entry:
        self._check_open()
        k = EntryKind.parse(kind)  # the kind first, as the embedded store
        key = check_key(key)
        if self._direct is not None:
            e = self._guarded(self._direct.get_entry, key, k)  # NotFound from Locate; None: through the daemon
            if e is not None:
                return e
        r = self._call("Get", pb.KeyRequest(key=key, kind=k.value))
        return Entry(key, k, layout_from_pb(r.layout), int(r.tokens), r.value)

    def get(self, key: bytes, *, kind: str = "block") -> bytes:
        return self.get_entry(key, kind=kind).data

    def get_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bytes | None]:
        self._check_open()
        k = EntryKind.parse(kind)  # first, as the embedded store: an empty batch too
        keys = check_keys(keys)
        if not keys:
            return []
        out: list[bytes | None] = []
        for _, got in self._each_piece(len(keys), lambda p: self._get_piece(keys[p], k)):  # in pieces, in order
            out.extend(got)
        return out

    def _get_piece(self, keys: list[bytes], k: EntryKind) -> list[bytes | None]:
        """One piece of ``get_many`` (at most ``max_batch_items`` keys): direct reads, else gRPC."""
        if self._direct is not None:
            got = self._guarded(self._direct.get_many, keys, k, self._get_many_rpc)
            if got is not None:
                return got
        return self._get_many_rpc(keys, k)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *,
                      kind: str = "block") -> list[EntryInfo | None]:
        """``kvstore.api``'s batched read into caller buffers. With direct reads the payloads
        are decoded straight into ``outs``; otherwise, and for keys read through the daemon,
        ``get_many`` plus one copy (``EntryInfo.layout``/``tokens`` are then ``None``).

        As the embedded store, nothing is written into any buffer for a batch that raises
        ``InvalidRequest``: the kind, every key and every buffer (writable, contiguous) are
        checked before any call, then (``stage_into``) every key is located or read, in
        pieces of at most ``max_batch_items``, and every buffer's size checked against it
        before the first byte is written (``finish_into``). The errors name ``outs[i]`` as
        the embedded store does."""
        self._check_open()
        keys = check_keys(keys)
        if len(outs) != len(keys):
            raise InvalidRequest(f"get_many_into: {len(keys)} keys but {len(outs)} output buffers")
        k = EntryKind.parse(kind)
        views = [writable_view(o, f"outs[{i}]") for i, o in enumerate(outs)]
        if not keys:
            return []
        staged = self.stage_into(keys, k)
        check_into_sizes(keys, [n for st in staged for n in st.sizes], views, k)
        return self.finish_into(staged, keys, views, k)

    def stage_into(self, keys: list[bytes], k: EntryKind) -> list[StagedInto]:
        """The first half of ``get_many_into`` (validated ``keys``), nothing written yet: per
        piece, in order, its keys located (direct reads) or read through the daemon, each
        ``StagedInto.sizes`` the plain size to check the buffers against."""
        return [got for _, got in self._each_piece(len(keys), lambda p: self._stage_piece(keys[p], k))]

    def _stage_piece(self, keys: list[bytes], k: EntryKind) -> StagedInto:
        if self._direct is not None:
            st = self._guarded(self._direct.stage_into, keys, k, self._get_many_rpc)
            if st is not None:
                return st
        datas = self._get_many_rpc(keys, k)
        return StagedInto([None if d is None else len(d) for d in datas], dict(enumerate(datas)))

    def finish_into(self, staged: list[StagedInto], keys: list[bytes], views: list[memoryview], k: EntryKind,
                    labels: Sequence[int] | None = None) -> list[EntryInfo | None]:
        """The second half of ``get_many_into``, once the caller checked every buffer against
        ``stage_into``'s sizes: read (direct) or copy each staged piece into ``views``.
        ``labels[i]`` is how the caller numbers ``views[i]`` (default ``i``), for the error of
        an entry re-put larger meanwhile, which is checked again before its piece is written."""
        labels = range(len(keys)) if labels is None else labels
        out: list[EntryInfo | None] = []
        at = 0
        for st in staged:
            p = slice(at, at + len(st.sizes))
            at = p.stop
            if st.reader is not None:
                self._check_open()
                out.extend(self._guarded(self._direct.finish_into, st, keys[p], views[p], k, self._get_many_rpc,
                                         labels[p]))
                continue
            done = copy_into(keys[p], list(st.fetched.values()), views[p], k, list(st.fetched), labels[p])
            out.extend(done[i] for i in range(len(st.sizes)))
        return out

    def direct_write_stats(self) -> dict:
        """This client's direct writes: mode, active (or why not), counters (``kvstore.client.direct_writes``)."""
        if self._direct_w is None:
            return {"mode": "off", "active": False, "reason": "direct_writes='off'", "counters": {}}
        return self._direct_w.stats()

    def direct_stats(self) -> dict:
        """This client's direct reads: mode, active (or why not), counters (``kvstore.client.direct_reads``)."""
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
        self._check_open()
        k = EntryKind.parse(kind).value  # the kind first, as the embedded store
        return self._call(method, pb.KeyRequest(key=check_key(key), kind=k)).ok

    def _many(self, method: str, keys: Sequence[bytes], kind: str, md: tuple[tuple[str, str], ...] = ()) -> list[bool]:
        """DeleteMany/PinMany/UnpinMany: every key validated, then pieces of at most
        ``max_batch_items`` in order (a failure in a later piece leaves earlier ones done)."""
        self._check_open()
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

    def pin_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._many("PinMany", keys, kind)

    def unpin_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._many("UnpinMany", keys, kind)

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
        from kvstore.client.sharded import ShardedStore

        return ShardedStore(urls, opts)
    return RemoteStore(urls[0], opts)
