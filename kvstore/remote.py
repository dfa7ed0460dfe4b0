"""``RemoteStore``: the ``KVStore`` protocol over gRPC, talking to one ``kvstore serve`` daemon.

``kvstore.connect("grpc://127.0.0.1:7070")`` returns one (``grpcs://`` for TLS);
a comma-separated list of URLs returns a ``kvstore.sharded.ShardedStore``.

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

Options (``connect`` overrides, else environment): ``token``
(``KVSTORE_TOKEN``), ``ca_file`` (``KVSTORE_CA_FILE``), ``cert_file`` /
``key_file`` for mutual TLS (``KVSTORE_CERT_FILE`` / ``KVSTORE_KEY_FILE``),
``timeout_s``, ``max_message_bytes``, ``server_name`` (TLS name override),
``direct_reads`` ("off" (default), "on", "auto"; ``KVSTORE_DIRECT_READS``),
``direct_writes`` (the same; ``KVSTORE_DIRECT_WRITES``). Bad options raise
``InvalidRequest`` at connect time: ``cert_file`` without ``key_file`` (or the
reverse), a TLS file that cannot be read or is not PEM, a URL not of the form
``URL_FORM``, a non-positive or non-finite ``timeout_s``.

Batches larger than ``max_batch_items`` (the daemon's per-call limit, 4096 by
default) are validated whole, then sent as consecutive pieces of at most that
many items, results concatenated in order, as ``lookup`` and ``probe`` do for
long chains. Such a batch is not one unit on the daemon: see ``put_many``.
"""

from __future__ import annotations

import json
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import grpc

from kvstore.api import Entry, EntryInfo, EntryKind, Layout, LookupResult, PutItem, writable_view
from kvstore.direct import DirectReads, copy_into, parse_mode
from kvstore.direct_writes import DirectWrites
from kvstore.errors import InternalError, InvalidRequest, StoreClosed
from kvstore.keys import check_key, check_keys
from kvstore.maintenance import Problem, ProblemKind
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server.wire import RequestTooLarge, error_from_rpc, layout_from_pb, put_parts, read_pem

MiB = 1024 * 1024
URL_FORM = "grpc://HOST:PORT[,grpc://HOST:PORT...] (grpcs:// for TLS; HOST a name, an IPv4 or a [IPv6] address)"
# gRPC channel arguments are C ints: a larger message limit is an OverflowError inside gRPC.
MAX_MESSAGE_BYTES = 2**31 - 1


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """How a client reaches a daemon (all optional)."""

    token: str = ""
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    server_name: str = ""
    timeout_s: float = 60.0
    max_message_bytes: int = 96 * MiB
    max_batch_items: int = 4096  # the daemon's default limit; longer chains and probes go in pieces
    direct_reads: str = "off"  # "off", "on" or "auto" (a bool: on/off); see kvstore.direct
    direct_writes: str = "off"  # the same modes; see kvstore.direct_writes

    ENV = {"token": "KVSTORE_TOKEN", "ca_file": "KVSTORE_CA_FILE", "cert_file": "KVSTORE_CERT_FILE",
           "key_file": "KVSTORE_KEY_FILE", "direct_reads": "KVSTORE_DIRECT_READS",
           "direct_writes": "KVSTORE_DIRECT_WRITES"}

    def __post_init__(self) -> None:
        object.__setattr__(self, "direct_reads", parse_mode(self.direct_reads))
        object.__setattr__(self, "direct_writes", parse_mode(self.direct_writes, "direct_writes"))
        if bool(self.cert_file) != bool(self.key_file):
            # Checked here: gRPC aborts the whole process (SIGABRT) on a certificate without its key.
            raise InvalidRequest("mutual TLS needs both cert_file and key_file (the client certificate and its "
                                 f"private key); got cert_file={self.cert_file!r}, key_file={self.key_file!r}")
        if (isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float))
                or not (math.isfinite(self.timeout_s) and 0 < self.timeout_s <= 1e9)):
            raise InvalidRequest(f"timeout_s must be a finite number of seconds in (0, 1e9], got {self.timeout_s!r}")
        for name, lo, hi in (("max_message_bytes", 64 * 1024, MAX_MESSAGE_BYTES), ("max_batch_items", 1, 2**31)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise InvalidRequest(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")

    @classmethod
    def from_overrides(cls, overrides: dict[str, Any]) -> "ClientOptions":
        fields = set(cls.__dataclass_fields__)
        unknown = set(overrides) - fields
        if unknown:
            raise InvalidRequest(f"unknown grpc client option(s) {sorted(unknown)}; known: {sorted(fields)}")
        vals = {k: os.environ[e] for k, e in cls.ENV.items() if e in os.environ}
        vals.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**vals)


def parse_address(url: str) -> tuple[str, bool]:
    """``grpc://host:port`` -> ("host:port", tls=False); ``grpcs://`` -> tls=True.

    HOST must be non-empty (a name, an IPv4 address, or an IPv6 address in brackets,
    ``[::1]``) and PORT an integer in [1, 65535]; one trailing ``/`` is allowed. Anything
    else raises ``InvalidRequest`` showing ``URL_FORM``, before any channel is opened.
    """
    scheme, sep, rest = url.partition("://")
    rest = rest[:-1] if rest.endswith("/") else rest
    host, colon, port = rest.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]") and len(host) > 2
    ok = (sep and scheme in ("grpc", "grpcs") and colon and host
          and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535
          and (bracketed or ":" not in host) and not any(c.isspace() or c in "/,@?#[]" for c in host.strip("[]")))
    if not ok:
        raise InvalidRequest(f"bad daemon URL {url!r}: expected {URL_FORM}")
    return rest, scheme == "grpcs"


def split_urls(url: str) -> list[str]:
    """A comma list of daemon URLs, each checked by ``parse_address``; an empty entry (a
    leading, trailing or doubled comma) is refused as any other malformed URL is."""
    urls = [u.strip() for u in url.split(",")]
    if not all(urls):
        raise InvalidRequest(f"bad daemon URL list {url!r}: an empty entry (a stray comma?); expected {URL_FORM}")
    for u in urls:
        parse_address(u)
    # One spelling per daemon: shard placement hashes the URL, so "grpc://h:p/" must place as "grpc://h:p".
    return [u[:-1] if u.endswith("/") else u for u in urls]


@dataclass(frozen=True, slots=True)
class EncodedPut:
    """One validated put, encoded as ``head + value + tail`` (a ``PutRequest``; ``wire.put_parts``)."""

    head: bytes
    value: memoryview
    tail: bytes

    @property
    def nbytes(self) -> int:
        return len(self.head) + self.value.nbytes + len(self.tail)

    def message(self) -> bytes:
        return b"".join((self.head, self.value, self.tail))  # the one copy of the value


def encode_item(it: PutItem) -> EncodedPut:
    """Validate one put client-side, as the embedded store does before writing, and encode it."""
    from kvstore.api import as_payload as _payload

    key = check_key(it.key)
    kind = EntryKind.parse(it.kind).value
    mv, layout = _payload(it.value, it.layout)
    if not isinstance(it.tokens, int) or it.tokens < 0:
        raise InvalidRequest(f"tokens must be a non-negative int, got {it.tokens!r}")
    if it.ttl_s is not None and it.ttl_s <= 0:
        raise InvalidRequest(f"ttl_s must be positive (or None for the default), got {it.ttl_s}")
    head, tail = put_parts(key, mv.nbytes, kind, it.ttl_s, layout, it.tokens)
    return EncodedPut(head, mv, tail)


def normalize_item(it: PutItem) -> pb.PutRequest:
    """``encode_item`` as a ``PutRequest`` message (validation as there)."""
    return pb.PutRequest.FromString(encode_item(it).message())


class _Unimplemented(Exception):
    """The daemon does not know a streaming method (it predates it); the caller falls back."""


class RemoteStore:
    """``kvstore.api.KVStore`` over gRPC. Thread-safe (one channel, shared)."""

    def __init__(self, url: str, options: ClientOptions | None = None):
        self.url = url
        self.address, tls = parse_address(url)
        self.options = o = options or ClientOptions()
        opts = [("grpc.max_receive_message_length", o.max_message_bytes),
                ("grpc.max_send_message_length", o.max_message_bytes),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.min_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000)]
        if o.server_name:
            opts.append(("grpc.ssl_target_name_override", o.server_name))
        if tls or o.ca_file:
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
        # Direct reads (kvstore.direct): None when off; the daemon is first asked on the first read.
        self._direct = DirectReads(o.direct_reads, self._call, url) if o.direct_reads != "off" else None
        # Direct writes (kvstore.direct_writes): None when off; the daemon is first asked on the first put.
        self._direct_w = (DirectWrites(o.direct_writes, self._call, url, max_items=o.max_batch_items)
                          if o.direct_writes != "off" else None)

    # ------------------------------------------------------------------ plumbing
    def _call(self, method: str, req: Any, timeout_s: float | None = None, fn: Any = None) -> Any:
        if self._closed:
            raise StoreClosed("this store is closed; open a new one with kvstore.connect")
        try:
            return (fn or getattr(self._stub, method))(req, timeout=timeout_s or self.options.timeout_s,
                                                       metadata=self._md)
        except grpc.RpcError as err:
            raise error_from_rpc(err, f"{method} on {self.url}") from err

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

    def _pieces(self, n: int) -> list[slice]:
        """A batch of ``n`` items as consecutive pieces of at most ``max_batch_items``."""
        step = self.options.max_batch_items
        return [slice(off, off + step) for off in range(0, n, step)]

    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        """``kvstore.api``'s batched put; one ``created`` flag per item, in order.

        Every item is validated (and, without direct writes, every piece's size checked
        against ``max_message_bytes``) before anything is sent. A batch of more than
        ``max_batch_items`` items goes to the daemon as consecutive pieces of at most that
        many, so unlike the embedded store's ``put_many`` (one index commit for the whole
        batch) it is not one unit: a failure in a later piece (daemon down, quota, capacity)
        raises after the earlier pieces were stored. Retrying the whole batch is safe: a put
        of a live key stores nothing (it then answers ``created=False`` for those).
        """
        items = list(items)
        if not items:
            return []
        encs = [encode_item(it) for it in items]  # validate every item before sending any
        pieces = self._pieces(len(items))
        if self._direct_w is None:
            for p in pieces:  # every piece fits in one call before the first is sent
                self._check_bytes(encs[p], len(items))
        out: list[bool] = []
        for p in pieces:
            out.extend(self._put_piece(items[p], encs[p]))
        return out

    def _put_piece(self, items: list[PutItem], encs: list[EncodedPut]) -> list[bool]:
        """One piece of ``put_many`` (at most ``max_batch_items``): direct writes, else gRPC."""
        if self._direct_w is not None:
            if self._closed:
                raise StoreClosed("this store is closed; open a new one with kvstore.connect")
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
                reply = self._stream_call("PutStream", lambda: self._put_stream(
                    (e.message() for e in encs), timeout=self.options.timeout_s, metadata=self._md))
            except _Unimplemented:
                reply = None
            if reply is not None:
                return self._check_count("PutStream", list(reply.created), len(encs))
        reqs = [pb.PutRequest.FromString(e.message()) for e in encs]
        return self._check_count("PutMany", list(self._call("PutMany", pb.PutManyRequest(items=reqs)).created),
                                 len(encs))

    def _stream_call(self, method: str, run: Any) -> Any:
        """Run a streaming call; typed errors as ``_call``; ``_Unimplemented`` for an older daemon."""
        if self._closed:
            raise StoreClosed("this store is closed; open a new one with kvstore.connect")
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
        keys = check_keys(keys)
        if not keys:
            return []
        k = EntryKind.parse(kind)
        out: list[bytes | None] = []
        for p in self._pieces(len(keys)):  # more than max_batch_items keys: in pieces, in order
            out.extend(self._get_piece(keys[p], k))
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
        if len(outs) != len(keys):
            raise InvalidRequest(f"get_many_into: {len(keys)} keys but {len(outs)} output buffers")
        keys = [check_key(x) for x in keys]
        k = EntryKind.parse(kind)
        views = [writable_view(o, f"outs[{i}]") for i, o in enumerate(outs)]
        if not keys:
            return []
        out: list[EntryInfo | None] = []
        for p in self._pieces(len(keys)):
            out.extend(self._get_into_piece(keys[p], views[p], k))
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

    def _many(self, method: str, keys: Sequence[bytes], kind: str) -> list[bool]:
        """DeleteMany/PinMany/UnpinMany: every key validated, then pieces of at most
        ``max_batch_items`` in order (a failure in a later piece leaves earlier ones done)."""
        k = EntryKind.parse(kind).value
        reqs = [pb.KeyRequest(key=check_key(x), kind=k) for x in keys]
        out: list[bool] = []
        for p in self._pieces(len(reqs)):
            out.extend(self._check_count(method, list(self._call(method, pb.KeysRequest(keys=reqs[p])).ok),
                                         len(reqs[p])))
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

    # ------------------------------------------------------------------ lookup
    @staticmethod
    def _result(r: pb.LookupReply) -> LookupResult:
        return LookupResult(int(r.hit_blocks), int(r.swa_at) if r.HasField("swa_at") else None)

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        """Longest prefix; a chain longer than ``max_batch_items`` is looked up piece by piece,
        each piece only while every key before it hit (a 100k-token prompt in 16-token blocks
        is a 6,250-key chain)."""
        keys = check_keys(keys)
        step = self.options.max_batch_items
        hit, swa_at = 0, None
        for off in range(0, len(keys), step):
            r = self._result(self._call("Lookup", pb.LookupRequest(keys=keys[off:off + step])))
            hit = off + r.hit_blocks
            if r.swa_at is not None:
                swa_at = off + r.swa_at
            if r.hit_blocks < len(keys[off:off + step]):
                break
        return LookupResult(hit, swa_at)

    def lookup_many(self, chains: Sequence[Sequence[bytes]]) -> list[LookupResult]:
        msgs = [pb.LookupRequest(keys=check_keys(c)) for c in chains]
        if not msgs:
            return []
        limit = self.options.max_batch_items  # the daemon counts chains, and keys in all chains
        if len(msgs) > limit or sum(len(m.keys) for m in msgs) > limit:
            out: list[LookupResult] = []
            piece: list = []
            n_keys = 0

            def send() -> None:
                if piece:
                    out.extend(self._result(r) for r in
                               self._call("LookupMany", pb.LookupManyRequest(chains=piece)).results)
                    piece.clear()

            for m in msgs:  # pieces of whole chains within both limits, in order; a longer chain alone
                if len(m.keys) > limit:
                    send()
                    out.append(self.lookup(m.keys))
                    continue
                if len(piece) == limit or n_keys + len(m.keys) > limit:
                    send()
                if not piece:
                    n_keys = 0
                piece.append(m)
                n_keys += len(m.keys)
            send()
            return out
        return [self._result(r) for r in self._call("LookupMany", pb.LookupManyRequest(chains=msgs)).results]

    def probe(self, keys: Sequence[bytes], *, until_miss: bool = False) -> tuple[bytes, bytes]:
        """Per key: (1 if a live block entry, 1 if also a live SWA entry), as two byte strings.
        ``until_miss`` (``keys`` are one chain's share, in chain order): the strings may end
        at the first key without a live block (``EmbeddedStore.probe``); pieces after it are
        not asked for."""
        keys = check_keys(keys)
        step = self.options.max_batch_items
        block, swa = [], []
        for off in range(0, len(keys), step):
            n = len(keys[off:off + step])
            r = self._call("Probe", pb.ProbeRequest(keys=keys[off:off + step], until_miss=until_miss))
            short = len(r.block) < n
            if len(r.swa) != len(r.block) or len(r.block) > n or (short and (not until_miss or r.block[-1:] != b"\0")):
                raise InternalError(f"Probe answered {len(r.block)}/{len(r.swa)} flags for {n} keys (a kvstore bug)")
            block.append(r.block)
            swa.append(r.swa)
            if until_miss and 0 in r.block:
                break
        return b"".join(block), b"".join(swa)

    # ------------------------------------------------------------------ maintenance
    def stats(self) -> dict:
        return json.loads(self._call("Stats", pb.StatsRequest()).json)

    def gc(self, *, dry_run: bool = False) -> dict:
        return json.loads(self._call("Gc", pb.GcRequest(dry_run=dry_run), timeout_s=3600).json)

    def check(self, fix: bool = False) -> list:
        r = self._call("Check", pb.CheckRequest(fix=fix), timeout_s=3600)
        return [Problem(ProblemKind(p.kind), p.key, p.entry_kind, p.target, p.detail, p.fixed) for p in r.problems]

    def repair(self) -> dict:
        return json.loads(self._call("Repair", pb.RepairRequest(), timeout_s=3600).json)

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

    Options and every URL are checked (``split_urls``) before any channel is opened."""
    opts = ClientOptions.from_overrides(overrides)
    urls = split_urls(url)
    if len(urls) > 1:
        from kvstore.sharded import ShardedStore

        return ShardedStore(urls, opts)
    return RemoteStore(urls[0], opts)
