"""Daemon configuration: ``ServerConfig`` plus the store's ``StoreConfig``.

Sources, highest first: CLI flags, ``KVSTORE_<FIELD>`` environment variables,
a TOML file, the embedded defaults (127.0.0.1:7070, no TLS, no auth, data in
``./kvstack-data``). The TOML file has two tables::

    [store]            # kvstore.config.StoreConfig fields
    data_dir = "/var/lib/kvstack"
    [server]           # ServerConfig fields below
    port = 7070
    gc_interval_s = 60

Every listener binds to ``host`` (127.0.0.1 by default); nothing listens on
all interfaces unless the operator says so.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore.config import ENV_PREFIX, StoreConfig, _coerce, load_config, read_toml
from kvstore.errors import InvalidRequest

MiB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Knobs of the daemon. Sizes in bytes, times in seconds; 0 disables where noted."""

    host: str = "127.0.0.1"
    port: int = 7070  # 0: pick a free port (printed at start)
    metrics_port: int = -1  # -1: no Prometheus endpoint; 0: pick a free port
    max_message_bytes: int = 96 * MiB  # gRPC send/receive limit, both directions
    max_batch_items: int = 4096  # more items in one batch call: INVALID_ARGUMENT
    max_concurrent_requests: int = 64  # over this: RESOURCE_EXHAUSTED (code BUSY)
    max_concurrent_per_tenant: int = 32
    workers: int = 32  # gRPC handler threads
    gc_interval_s: float = 60.0  # background GC period; 0: no background GC
    drain_s: float = 10.0  # on SIGTERM: how long in-flight calls may finish
    tls_cert: str = ""  # PEM certificate chain of the daemon; empty: plaintext
    tls_key: str = ""
    tls_client_ca: str = ""  # set: mutual TLS, clients need a cert signed by this CA
    tokens_file: str = ""  # set: bearer-token auth, tenants namespaced (see kvstore.server.auth)
    tenant_secret_file: str = ""  # empty: <data_dir>/server/tenant.secret (created 0600)
    tenant_quota_bytes: int = 0  # >0: live plain bytes each tenant may hold (RESOURCE_EXHAUSTED over it)
    allow_direct_reads: bool = True  # answer Locate and show the target table (kvstore.direct); false: PERMISSION_DENIED
    # Answer Commit: index packs clients wrote into the targets themselves (kvstore.direct_writes);
    # only for clients trusted with write access to every target's files. false: PERMISSION_DENIED.
    allow_direct_writes: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535 or not -1 <= self.metrics_port <= 65535:
            raise InvalidRequest("port must be in [0, 65535]; metrics_port in [-1, 65535]")
        if self.max_message_bytes < 64 * 1024 or self.max_batch_items < 1:
            raise InvalidRequest("max_message_bytes must be >= 64 KiB and max_batch_items >= 1")
        if self.max_concurrent_requests < 1 or self.max_concurrent_per_tenant < 1 or self.workers < 1:
            raise InvalidRequest("concurrency limits and workers must be >= 1")
        if self.gc_interval_s < 0 or self.drain_s < 0:
            raise InvalidRequest("gc_interval_s and drain_s must be >= 0")
        if self.tenant_quota_bytes < 0:
            raise InvalidRequest("tenant_quota_bytes must be >= 0 (0: no per-tenant quota)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise InvalidRequest("TLS needs both tls_cert and tls_key")
        if self.tls_client_ca and not self.tls_cert:
            raise InvalidRequest("mutual TLS (tls_client_ca) needs tls_cert and tls_key as well")

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)


SERVER_FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}
STORE_FIELDS = {f.name: f for f in dataclasses.fields(StoreConfig)}
_overlap = set(SERVER_FIELDS) & set(STORE_FIELDS)
if _overlap:  # both read KVSTORE_<FIELD>: a shared name would be ambiguous
    raise RuntimeError(f"bug: ServerConfig and StoreConfig share field names {_overlap}")


def load_server_config(
    toml_path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> tuple[ServerConfig, StoreConfig]:
    """Both configs: flags (``overrides``, ``None`` = unset) > env > TOML > defaults.

    ``overrides`` may mix server and store fields; unknown names raise ``InvalidRequest``.
    """
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    if toml_path is not None:
        doc = read_toml(toml_path)
        if "server" in doc and "store" not in doc and set(doc) - {"server"}:
            raise InvalidRequest(f"{toml_path}: put store options under a [store] table next to [server]")
        for k, v in doc.get("server", {}).items():
            if k not in SERVER_FIELDS:
                raise InvalidRequest(f"unknown [server] option {k!r} in {toml_path}; known: {sorted(SERVER_FIELDS)}")
            values[k] = _coerce(k, SERVER_FIELDS[k].type, v)
    for k, f in SERVER_FIELDS.items():
        ev = env.get(ENV_PREFIX + k.upper())
        if ev is not None:
            values[k] = _coerce(k, f.type, ev)
    store_over: dict[str, Any] = {}
    for k, v in overrides.items():
        if k in SERVER_FIELDS:
            if v is not None:
                values[k] = _coerce(k, SERVER_FIELDS[k].type, v)
        elif k in STORE_FIELDS:
            store_over[k] = v
        else:
            raise InvalidRequest(f"unknown option {k!r}")
    toml_for_store = toml_path
    if toml_path is not None and "store" not in doc and "server" in doc:
        toml_for_store = None  # a server-only file: no store options in it
    store_cfg = load_config(toml_for_store, env=env, **store_over)
    return ServerConfig(**values), store_cfg
