"""The daemon's data calls: put, get (unary and streamed), delete, pin, lookup, probe.

``DataCalls`` holds their handlers, each ``(request, tenant) -> reply``; the daemon
(``kvstore.server.service``) builds one over its parts and routes the calls to it. The
per-call steps around a handler (authentication, parsing, admission, error mapping) are
the dispatcher's (``kvstore.server.dispatch``), as for every call.

Batches are checked whole (``checks``) before any store work. The two streaming forms:
``GetStream`` validates every key first, then reads the keys a window
(``GET_STREAM_WINDOW``) at a time and sends the values in ``GetChunk`` messages;
``PutStream`` gets every item of its stream, received and parsed by the dispatcher, and
stores them with one ``put_many`` exactly as ``PutMany`` does. Streaming spares building
and serializing one large protobuf message (each a copy of every value; tools/bench_remote.py
measures the remote batch path). Values are hand-encoded
(``wire.encode_*``): one copy each instead of two.
"""

from __future__ import annotations

from concurrent.futures import wait
from typing import Any, Callable, Iterator, Sequence

from kvstore.api import EntryKind, LookupResult
from kvstore.auth import Tenant
from kvstore.errors import NotFound, StoreUnavailable, Unrecoverable
from kvstore.executors import DaemonExecutor
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.checks import BatchLimit, put_item, tenant_key, tenant_keys
from kvstore.server.config import ServerConfig
from kvstore.server.metrics import DaemonMetrics
from kvstore.server.tenant_writes import TenantWrites
from kvstore.errors import RequestTooLarge
from kvstore.wire import encode_get_chunk, encode_get_reply, kind_or_default

# GetStream: keys per store.get_many (a window; the next is read while this one is sent), and
# the most value bytes packed into one GetChunk (per-message cost matters for small values;
# one message per value for large ones). Chosen with tools/bench_remote.py.
GET_STREAM_WINDOW = 8
GET_STREAM_CHUNK_BYTES = 1 << 20


def _lookup_pb(r: LookupResult) -> pb.LookupReply:
    out = pb.LookupReply(hit_blocks=r.hit_blocks)
    if r.swa_at is not None:
        out.swa_at = r.swa_at
    return out


class DataCalls:
    """Put, Get, GetMany, GetStream, Delete, Pin, Unpin (and their batch forms), Lookup,
    LookupMany and Probe (module docstring), over the daemon's store. ``read_pool`` runs
    GetStream's read-ahead (one window per stream in flight)."""

    def __init__(self, cfg: ServerConfig, store: Any, metrics: DaemonMetrics, batch: BatchLimit,
                 writes: TenantWrites, read_pool: DaemonExecutor) -> None:
        self.cfg = cfg
        self.store = store
        self.metrics = metrics
        self.batch = batch
        self.writes = writes
        self.read_pool = read_pool

    def put(self, r: pb.PutRequest, tenant: Tenant) -> pb.PutReply:
        item = put_item(r, tenant)
        if self.writes.put([item], tenant)[0]:
            self.metrics.bytes_in.inc(len(item.value))
            return pb.PutReply(created=True)
        return pb.PutReply(created=False)

    def put_many(self, r: pb.PutManyRequest, tenant: Tenant) -> pb.PutManyReply:
        return self._put_items(r.items, tenant)

    def put_stream(self, reqs: list[pb.PutRequest], tenant: Tenant) -> pb.PutManyReply:
        return self._put_items(reqs, tenant)

    def _put_items(self, reqs: Sequence[pb.PutRequest], tenant: Tenant) -> pb.PutManyReply:
        """PutMany and PutStream: validate every item, then one store.put_many (a bad batch stores nothing)."""
        self.batch(len(reqs), "put_many")
        items = [put_item(it, tenant) for it in reqs]
        created = self.writes.put(items, tenant)
        # From the items: ``len(req.value)`` would copy each value out of its message once more.
        self.metrics.bytes_in.inc(sum(len(it.value) for it, c in zip(items, created) if c))
        return pb.PutManyReply(created=created)

    def get(self, r: pb.KeyRequest, tenant: Tenant) -> bytes:
        kind = kind_or_default(r.kind)
        key = tenant_key(tenant, r.key)
        try:
            e = self.store.get_entry(key, kind=kind)
        except NotFound as exc:  # named by the client's key, not the tenant's stored one
            self.metrics.hit("get", kind, False)
            raise NotFound(str(exc).replace(key.hex(), r.key.hex())) from None
        except Unrecoverable as exc:
            self.metrics.hit("get", kind, False)  # no value returned: a miss, as get_many counts it
            if tenant.admin:
                raise Unrecoverable(str(exc).replace(key.hex(), r.key.hex()), key=r.key,
                                    failed_targets=exc.failed_targets) from None
            # Target names may spell bucket and mount paths: an admin's to see (as in Inspect).
            raise Unrecoverable(
                f"entry {r.key.hex()} ({kind}) is lost: {len(exc.failed_targets)} of its fragments failed and "
                "too few are left to rebuild it; an admin can bring the targets back and run `kvtool repair`",
                key=r.key) from None
        except StoreUnavailable:
            self.metrics.hit("get", kind, False)
            if tenant.admin:
                raise
            raise StoreUnavailable(f"entry {r.key.hex()} ({kind}) cannot be read now: too many of its targets "
                                   "are unavailable; nothing is marked lost, retry later") from None
        self.metrics.hit("get", kind, True)
        self.metrics.bytes_out.inc(len(e.data))
        return encode_get_reply(e.data, e.layout, e.tokens, e.kind.value)  # one copy of the value, not two

    def get_many(self, r: pb.GetManyRequest, tenant: Tenant) -> pb.GetManyReply:
        self.batch(len(r.keys), "get_many")
        kind = kind_or_default(r.kind)
        keys = tenant_keys(tenant, r.keys)
        # Read a window at a time and stop once the reply would be over max_message_bytes: the
        # values are held until the one reply is built, so a key repeated 4096 times must not
        # decode 4096 values first, only for gRPC to refuse the reply.
        vals: list[bytes | None] = []
        total = 0
        for i in range(0, len(keys), GET_STREAM_WINDOW):
            got = self.store.get_many(keys[i:i + GET_STREAM_WINDOW], kind=kind)
            total += sum(len(v) for v in got if v is not None)
            if total > self.cfg.max_message_bytes:
                raise RequestTooLarge(
                    f"GetMany reply of more than {self.cfg.max_message_bytes} bytes is over the daemon's "
                    "max_message_bytes; read through GetStream (kvstore.client.remote does) or ask for fewer keys")
            vals += got
        hits = sum(v is not None for v in vals)
        self.metrics.hit("get", kind, True, hits)
        self.metrics.hit("get", kind, False, len(vals) - hits)
        self.metrics.bytes_out.inc(sum(len(v) for v in vals if v is not None))
        return pb.GetManyReply(values=[pb.MaybeValue(found=False) if v is None else pb.MaybeValue(found=True, value=v)
                                       for v in vals])

    def get_stream(self, r: pb.GetManyRequest, tenant: Tenant) -> Iterator[bytes]:
        """``get_many`` as a stream of ``GetChunk``: window k+1 is read while window k is sent.

        Every key is validated before the first read. A window is one ``store.get_many``
        (one index read, the store's own batch parallelism), run on ``read_pool`` one
        window ahead of the sender, so disk/decode work overlaps gRPC's sending; at most
        two windows are held. A window's values go out in chunks of up to
        ``GET_STREAM_CHUNK_BYTES`` and the message limit (one value per chunk when values are that large).
        """
        self.batch(len(r.keys), "get_many")
        kind = kind_or_default(r.kind)
        keys = tenant_keys(tenant, r.keys)
        starts = list(range(0, len(keys), GET_STREAM_WINDOW))
        # within the message limit too (a daemon may set it below a chunk; 4 KiB for framing)
        chunk_bytes = min(GET_STREAM_CHUNK_BYTES, self.cfg.max_message_bytes - 4096)

        def read(start: int) -> list[bytes | None]:
            return self.store.get_many(keys[start:start + GET_STREAM_WINDOW], kind=kind)

        pending = self.read_pool.submit(read, starts[0]) if starts else None
        try:
            for n, start in enumerate(starts):
                vals = pending.result()
                pending = self.read_pool.submit(read, starts[n + 1]) if n + 1 < len(starts) else None
                hits = sum(v is not None for v in vals)
                self.metrics.hit("get", kind, True, hits)
                self.metrics.hit("get", kind, False, len(vals) - hits)
                self.metrics.bytes_out.inc(sum(len(v) for v in vals if v is not None))
                first, size = 0, 0
                for j, v in enumerate(vals):
                    n_bytes = 0 if v is None else len(v)
                    if j > first and size + n_bytes > chunk_bytes:
                        yield encode_get_chunk(start + first, vals[first:j])
                        first, size = j, 0
                    size += n_bytes
                yield encode_get_chunk(start + first, vals[first:])
        finally:
            if pending is not None:  # the client went away: let the read in flight finish before releasing
                wait([pending])

    def one(self, op: str) -> Callable[[pb.KeyRequest, Tenant], pb.BoolReply]:
        def handler(r: pb.KeyRequest, tenant: Tenant) -> pb.BoolReply:
            key, kind = tenant_key(tenant, r.key), kind_or_default(r.kind)
            ok = getattr(self.store, op)(key, kind=kind)
            if ok and op == "delete":
                self.writes.forget(tenant, [(key, kind)])
            return pb.BoolReply(ok=ok)
        return handler

    def many(self, op: str) -> Callable[[pb.KeysRequest, Tenant], pb.BoolsReply]:
        def handler(r: pb.KeysRequest, tenant: Tenant) -> pb.BoolsReply:
            self.batch(len(r.keys), f"{op}_many")
            # Validate every key and kind before applying any: a bad item changes nothing.
            args = [(tenant_key(tenant, k.key), EntryKind.parse(kind_or_default(k.kind)).value) for k in r.keys]
            fn = getattr(self.store, op)
            oks = [fn(key, kind=kind) for key, kind in args]
            if op == "delete":
                self.writes.forget(tenant, [a for a, ok in zip(args, oks) if ok])
            return pb.BoolsReply(ok=oks)
        return handler

    def _lookup_one(self, keys: Any, tenant: Tenant) -> LookupResult:
        self.batch(len(keys), "lookup chain")
        res = self.store.lookup(tenant_keys(tenant, keys))
        self.metrics.hit("lookup", "block", res.hit_blocks > 0)
        self.metrics.hit("lookup", "swa", res.swa_at is not None)
        return res

    def lookup(self, r: pb.LookupRequest, tenant: Tenant) -> pb.LookupReply:
        return _lookup_pb(self._lookup_one(r.keys, tenant))

    def lookup_many(self, r: pb.LookupManyRequest, tenant: Tenant) -> pb.LookupManyReply:
        self.batch(len(r.chains), "lookup_many")
        self.batch(sum(len(c.keys) for c in r.chains), "lookup_many (keys in all chains)")
        return pb.LookupManyReply(results=[_lookup_pb(self._lookup_one(c.keys, tenant)) for c in r.chains])

    def probe(self, r: pb.ProbeRequest, tenant: Tenant) -> pb.ProbeReply:
        self.batch(len(r.keys), "probe")
        self.batch(len(r.chain_ends), "probe chains")
        block, swa = self.store.probe(tenant_keys(tenant, r.keys), until_miss=r.until_miss,
                                      chain_ends=list(r.chain_ends) if r.chain_ends else None)
        self.metrics.hit("probe", "block", 1 in block, bool(block))
        self.metrics.hit("probe", "swa", 1 in swa, bool(block))
        return pb.ProbeReply(block=block, swa=swa)

