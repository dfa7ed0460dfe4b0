"""The kvstore daemon: the embedded store served over gRPC (service ``kvstore.v1.KVStore``).

Run it::

    kvstore serve                                   # ./kvstack-data, 127.0.0.1:7070
    kvstore serve --port 0 --metrics-port 0         # free ports, printed at start
    kvstore serve --config kvstore.toml --tokens-file tokens.toml --tls-cert c.pem --tls-key k.pem

and reach it with ``kvstore.connect("grpc://127.0.0.1:7070")`` (``grpcs://`` for
TLS; a comma list of URLs gives a ``ShardedStore``).

The service contract
--------------------
1. Semantics. Each RPC does what the same-named ``kvstore.api.KVStore``
   method does on the embedded store, nothing more: ``Put`` of a live
   ``(kind, key)`` returns ``created=false`` and stores no copy; an
   acknowledged ``Put``/``PutMany`` is durable (fragments fsynced, index
   committed) before the reply is sent, so it survives a daemon crash;
   ``Lookup`` has no side effect; ``GetMany`` answers a missing or
   unrecoverable entry with ``found=false`` in its slot.
2. Batches (``PutMany``, ``GetMany``, ``DeleteMany``, ``PinMany``,
   ``UnpinMany``, ``LookupMany``) keep the caller's order. A batch is
   validated whole before anything is written: one bad item fails the call
   with INVALID_ARGUMENT and stores nothing. More than ``max_batch_items``
   items is INVALID_ARGUMENT, refused before any store work, with the limit in
   trailing metadata ``kvstore-max-batch-items`` (``kvstore.errors.BatchTooLarge``):
   clients learn it there and re-send in pieces.
3. ``Probe`` answers, per key, "live block?" and "live SWA?"; the sharded
   client uses it to compute a chain's longest prefix across daemons.
4. Errors. A store error is a gRPC status plus trailing metadata
   ``kvstore-error-code`` (``KVStoreError.code``); clients re-raise the same
   class (see ``kvstore.wire``). A malformed message (truncated, bad
   UTF-8, wrong types) is INVALID_ARGUMENT. A message over
   ``max_message_bytes`` is RESOURCE_EXHAUSTED (gRPC's own check, on both
   ends); a daemon or tenant at its concurrency limit is RESOURCE_EXHAUSTED
   with code ``BUSY`` (``kvstore.errors.ServerBusy``, a ``StoreUnavailable``: retry), and
   so is a ``Gc``, ``Check``, ``Repair`` or ``Maintain`` call while another gc,
   check or repair pass runs on the daemon (one pass at a time: ``admin_rpc``;
   background GC skips its round instead). An unreachable daemon is
   ``StoreUnavailable``.
5. Security. Listeners bind 127.0.0.1 unless configured otherwise. Optional
   TLS and mutual TLS from PEM files. With a tokens file, every call needs
   ``authorization: Bearer <token>`` (else UNAUTHENTICATED), keys are stored
   under a per-tenant keyed hash (``kvstore.auth``): tenants cannot
   read, delete, look up, or detect each other's entries. ``Stats``, ``Gc``,
   ``Check``, ``Repair``, ``Maintain``, ``ExportIndex`` and ``Inspect``'s store summary need an admin tenant
   (PERMISSION_DENIED); ``Inspect`` of keys (read-only: nothing touched) shows
   a non-admin tenant its own keys only, mapped into its namespace as by a get.
6. Direct reads (``kvstore.client.direct_reads``): ``Describe`` returns the target table
   and erasure code; ``Locate`` returns the index records of a batch of keys
   (tenant-namespaced, access times refreshed as by a get, counted as
   ``op="locate"``), so a client that mounts the same targets reads and
   verifies the fragments itself and falls back to ``Get`` on any failure.
   ``allow_direct_reads = false`` refuses Locate (PERMISSION_DENIED).
7. Health: the standard ``grpc.health.v1.Health`` service reports SERVING for
   ``""`` and ``kvstore.v1.KVStore``; NOT_SERVING once a drain has begun.
8. Shutdown (SIGTERM/SIGINT): stop accepting, let in-flight calls finish
   within ``drain_s``, stop GC, close the store.

Modules: ``config`` (ServerConfig), ``service`` (Daemon: owns the parts below and
routes each RPC to its handler), ``dispatch`` (the per-call steps: authenticate, parse,
admit, map errors), ``data_rpc``, ``direct_rpc`` and ``admin_rpc`` (the handlers),
``checks`` (request fields checked at the boundary), ``tenant_writes`` (writes charged
to a tenant's quota), ``quota``, ``admission`` (the Limiter), ``metrics`` (Prometheus),
``watchdog`` (stream time bounds), ``cli`` (``kvstore serve``). Tokens and tenants are
``kvstore.auth``; the wire codec shared with the clients is ``kvstore.wire``.
"""

from kvstore.server.config import ServerConfig, load_server_config
from kvstore.server.service import Daemon

__all__ = ["Daemon", "ServerConfig", "load_server_config"]
