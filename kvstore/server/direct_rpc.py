"""The daemon's direct-I/O calls: ``Describe``, ``Locate`` and ``Commit``.

``DirectCalls`` holds their handlers, each ``(request, tenant) -> reply``; the daemon
(``kvstore.server.service``) builds one over its parts and routes the calls to it. The
per-call steps around a handler (authentication, parsing, admission, error mapping) are
the dispatcher's (``kvstore.server.dispatch``), as for every call.

Direct reads (``kvstore.client.direct_reads``): ``Describe`` gives any authenticated client the
target table (URLs with credentials removed) and the erasure code; ``Locate`` is the
index half of a get: the same key validation and tenant translation, live entries
only, the same access-time refresh (LRU), hits and misses counted as ``op="locate"``;
it answers where the fragments are and moves no payload. The daemon stays the only
writer: a client whose direct read fails falls back to ``Get``/``GetStream``, and the
daemon's read path then counts the degraded read or marks the entry lost. With
``allow_direct_reads = false`` Locate is PERMISSION_DENIED and Describe shows no
targets (unless direct writes are allowed).

Direct writes (``kvstore.client.direct_writes``; ``allow_direct_writes``, off by default):
``Describe`` also gives the store's encoding knobs and the caller's own tenant secret;
``Commit`` is the index half of a put whose pack files the client wrote: keys validated
and translated as Put does, the records checked and indexed by
``EmbeddedStore.commit_written``, charged to the tenant's quota. Off: PERMISSION_DENIED.

A writer encodes fragment headers under the stored keys its ``Describe`` gave it, while
``Commit`` indexes the entries under the keys of the tenant calling now. The two differ when
the daemon restarted in between on another data directory (a new server secret) or tokens
file (the token now names another tenant): indexed anyway, every such entry would read as
lost though its put was acknowledged. So ``Describe`` hands out ``writer_view``, a digest
of what a writer keys and encodes by (``_writer_view``), every ``Commit`` must carry it back,
and the daemon refuses, before anything is checked or indexed, a Commit whose view is not the
current one (``StaleDescribe``: the writer describes again) or that has none (it cannot be
checked: PERMISSION_DENIED, and the client puts the batch through PutStream).
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from kvstore.api import EntryKind
from kvstore.auth import Tenant, TokenTable
from kvstore.client.direct_reads import client_url
from kvstore.embedded.datadir import FORMAT_FILE
from kvstore.embedded.index import ekey
from kvstore.embedded.packs import WrittenEntry
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.checks import BatchLimit, tenant_key, tenant_keys, ttl_of
from kvstore.server.config import ServerConfig
from kvstore.server.metrics import DaemonMetrics
from kvstore.server.tenant_writes import TenantWrites
from kvstore.errors import PermissionDenied, RequestTooLarge, StaleDescribe
from kvstore.wire import kind_or_default

PUT_FIELDS_BYTES = 256  # a PutRequest's bytes besides its value: key, kind, ttl, tokens, a layout

log = logging.getLogger(__name__)


class DirectCalls:
    """Describe, Locate and Commit (see the module docstring), over the daemon's store."""

    def __init__(self, cfg: ServerConfig, store: Any, tokens: TokenTable, metrics: DaemonMetrics,
                 batch: BatchLimit, writes: TenantWrites) -> None:
        self.cfg = cfg
        self.store = store
        self.tokens = tokens
        self.metrics = metrics
        self.batch = batch
        self.writes = writes

    def describe(self, r: pb.DescribeRequest, tenant: Tenant) -> pb.DescribeReply:
        """What a direct-reading or -writing client needs, fetched once per client
        (``kvstore.client.direct_reads``, ``kvstore.client.direct_writes``). ``max_value_bytes`` is not sensitive
        and goes to every client: ``kvstore.client.remote`` checks a batch that spans several calls
        or daemons against it before sending any of it."""
        st = self.store
        cfg = st.config
        out = pb.DescribeReply(direct_reads=self.cfg.allow_direct_reads, auth=self.tokens.enabled,
                               direct_writes=self.cfg.allow_direct_writes, max_value_bytes=cfg.max_value_bytes)
        if not (self.cfg.allow_direct_reads or self.cfg.allow_direct_writes):
            return out  # no target table for a daemon that serves neither
        out.ec_type, out.ec_k, out.ec_m = cfg.ec_type, cfg.ec_k, cfg.ec_m
        out.read_timeout_s, out.parallel_reads = cfg.read_timeout_s, cfg.parallel_reads
        for spec in st.target_specs:
            out.targets.add(name=spec.name, url=client_url(spec, st.targets.get(spec.name)), domain=spec.domain)
        if self.cfg.allow_direct_writes:  # how to encode as this store does, and whose keys
            out.key_secret = tenant.secret
            out.compression, out.zstd_level, out.min_compress_ratio = (
                cfg.compression, cfg.zstd_level, cfg.min_compress_ratio)
            out.pack_bytes, out.fsync, out.orphan_grace_s, out.parallel_writes = (
                cfg.pack_bytes, cfg.fsync, cfg.orphan_grace_s, cfg.parallel_writes)
            out.default_ttl_s = cfg.default_ttl_s or 0.0  # the expiry a writer's entry headers carry
            out.writer_view = self._writer_view(tenant)
        if not tenant.admin:
            # The data directory and its marker serve only mode "auto", which never turns on with
            # tokens (kvstore.client.direct_reads): a tenant's clients need the target table alone. Not a secret
            # kept: the default targets' URLs spell data_dir, and direct I/O means file access
            # to the targets anyway. tenant.secret (created 0600) is what needs the file mode.
            return out
        out.data_dir = str(st.data_dir)
        try:
            out.format_marker = (Path(st.data_dir) / FORMAT_FILE).read_bytes()
        except OSError as exc:  # the probe then fails on the client: "auto" stays off
            log.warning("describe: cannot read the data-dir marker: %s", exc)
        return out

    def _writer_view(self, tenant: Tenant) -> bytes:
        """``DescribeReply.writer_view`` for ``tenant``: a digest of everything a direct writer keys
        and encodes by (the tenant secret, the store's identity, erasure code, targets, encoding
        knobs). Computed per call, so a tokens file reloaded under a running daemon counts too."""
        st, cfg = self.store, self.store.config
        parts = (tenant.secret, st.index_id, cfg.ec_type, cfg.ec_k, cfg.ec_m, cfg.compression, cfg.zstd_level,
                 cfg.min_compress_ratio, cfg.pack_bytes, cfg.fsync, cfg.max_value_bytes,
                 tuple((s.name, s.url, s.domain) for s in st.target_specs))
        return hashlib.blake2b(repr(parts).encode(), digest_size=16, person=b"kvstack-wview").digest()

    def locate(self, r: pb.LocateRequest, tenant: Tenant) -> pb.LocateReply:
        """The index half of a get (module docstring): validate every key, then read the
        records in one transaction and refresh the access time of each live one."""
        if not self.cfg.allow_direct_reads:
            raise PermissionDenied("this daemon does not serve direct reads (allow_direct_reads = false); "
                                   "read through Get/GetStream")
        self.batch(len(r.keys), "locate")
        kind = EntryKind.parse(kind_or_default(r.kind))
        code, kv = kind.code, kind.value  # enum properties, read once per call, not per key
        eks = [ekey(code, k) for k in tenant_keys(tenant, r.keys)]  # validate every key first
        metas = self.store.locate(eks)
        hits = sum(m is not None for m in metas)
        self.metrics.hit("locate", kv, True, hits)
        self.metrics.hit("locate", kv, False, len(metas) - hits)
        return pb.LocateReply(locations=[
            pb.Location() if m is None else pb.Location(
                found=True, stored_key=ek[1:], kind=kv, k=m.k, m=m.m, entry_len=m.entry_len,
                plain_len=m.plain_len, frag_len=m.frag_len, gen=m.gen, targets=m.targets, tokens=m.tokens,
                offsets=m.offsets)
            for ek, m in zip(eks, metas)])

    def commit(self, r: pb.CommitRequest, tenant: Tenant) -> pb.CommitReply:
        """The index half of a put whose packs the client wrote (``kvstore.client.direct_writes``):
        keys validated and translated as Put does, the records checked and indexed by
        ``store.commit_written``, charged to the tenant's quota as a put is (each entry at least
        its stored entry bytes: the declared plain size is not trusted below that)."""
        if not self.cfg.allow_direct_writes:
            raise PermissionDenied("this daemon does not accept direct writes (allow_direct_writes = false); "
                                   "put through Put/PutStream")
        self.batch(len(r.entries), "commit")
        # Before anything else: the fragment headers name the stored keys of the writer's view, and
        # only entries whose view is the current one read back (module docstring).
        if not r.view:
            raise PermissionDenied("a Commit without writer_view cannot be checked against this daemon's keys; "
                                   "send the writer_view of a Describe, or put through Put/PutStream")
        if r.view != self._writer_view(tenant):
            raise StaleDescribe("this writer's Describe is out of date (since it, the daemon's data directory, "
                                "tenant secret, erasure code, targets or encoding settings changed, or the token "
                                "names another tenant); call Describe again and rewrite the batch")
        entries = []
        # What a Put could carry, so a Get can send it back (a GetReply holds fewer of a PutRequest's
        # fields). Bigger: refused whole, and the client puts the batch through gRPC, whose own limits
        # then decide as for any put: a value a Put stores is never refused here.
        most = self.cfg.max_message_bytes - PUT_FIELDS_BYTES
        for e in r.entries:
            if e.plain_len > most:
                raise RequestTooLarge(f"a written entry of {e.plain_len} bytes could not be read back within "
                                      f"max_message_bytes={self.cfg.max_message_bytes}; put it through the daemon")
            kind = EntryKind.parse(kind_or_default(e.kind))
            entries.append(WrittenEntry(
                ekey(kind.code, tenant_key(tenant, e.key)), e.k, e.m, e.tokens, e.plain_len, e.entry_len,
                e.frag_len, e.gen, tuple(e.targets), tuple(e.offsets), ttl_of(e)))
        res: list = []

        def index() -> list[bool]:
            res.append(self.store.commit_written(entries, shown=[bytes(e.key) for e in r.entries]))
            return res[0].created

        # Charged at least the entry's own bytes: plain_len is the writer's word, entry_len is bound
        # to the fragments the daemon checked (commit_written), so a lie cannot go under what is stored.
        created = self.writes.charged(tenant, [w.ek for w in entries],
                                      [max(w.plain_len, w.entry_len) for w in entries], index)
        self.metrics.bytes_in.inc(sum(w.plain_len for w, c in zip(entries, created) if c))
        return pb.CommitReply(created=created, rejected_packs=list(res[0].rejected),
                              reasons=list(res[0].rejected.values()))
