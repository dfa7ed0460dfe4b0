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
all interfaces unless the operator says so. A host that does not resolve, or is no
address of this machine, is refused before gRPC sees it (``kvstore.netaddr.port_taken``).

A ``KVSTORE_<FIELD>`` variable set to the empty string counts as unset: the file's
value or the default stands, and a warning names it (``kvstore.config.env_layer``), so
``KVSTORE_TOKENS_FILE=`` or ``KVSTORE_TLS_CERT=`` never silently turns off the auth or
TLS that the file turns on.

Only the value that wins for a field must be usable: a bad ``KVSTORE_PORT`` or
file key that a flag (or, for a file key, a variable) overrides is logged as a
warning naming it, and the daemon starts (``kvstore.config.merge_sources``).

Validation (all ``InvalidRequest``, so ``kvstore serve`` exits 2 with one line):
a file with a ``[server]`` or ``[store]`` table may hold nothing else at the top
level; an unknown key anywhere is refused; an integer field takes an integer
only (``7070.9``, ``true`` and, in the file, ``"7070"`` are refused, never truncated
or parsed: text is parsed only from variables and flags); a float field takes a
finite number no larger than ``MAX_SECONDS`` (``inf``/``nan`` would turn into an
overflow in gRPC's stop or a silently disabled GC, so they are refused at load).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

from kvstore.config import StoreConfig, TomlValue, _coerce, env_layer, merge_sources, read_toml, store_config_from
from kvstore.errors import InvalidRequest
from kvstore.tls import check_server_files, read_pem

MiB = 1024 * 1024
# The largest time a float option may hold: about 31 years, far beyond any useful drain or GC
# period, and well inside what threading and gRPC timeouts accept (1e300 overflows them).
MAX_SECONDS = 1e9
# gRPC channel arguments are C ints: a larger message limit is an OverflowError inside gRPC.
MAX_MESSAGE_BYTES = 2**31 - 1
# The quota ledger stores totals as u64 (kvstore.server.quota); keep well clear of the top.
MAX_QUOTA_BYTES = 2**62


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Knobs of the daemon. Sizes in bytes, times in seconds; 0 disables where noted."""

    host: str = "127.0.0.1"
    port: int = 7070  # 0: pick a free port (printed at start)
    metrics_port: int = -1  # -1: no Prometheus endpoint; 0: pick a free port
    max_message_bytes: int = 96 * MiB  # gRPC send/receive limit, both directions
    max_batch_items: int = 4096  # more items in one batch call: INVALID_ARGUMENT
    # Calls admitted at once, overall and per tenant; over either: RESOURCE_EXHAUSTED (code BUSY).
    # A call is admitted or refused on a handler thread and a stream holds its thread while it
    # runs, so the overall limit must stay below ``workers``: the threads left over answer the
    # refusals (and health checks) at once, where they would otherwise queue. 0 (the default)
    # derives one from the other: 48 and 64 when both are 0; else 3/4 of workers, or a third more.
    max_concurrent_requests: int = 0
    max_concurrent_per_tenant: int = 32
    workers: int = 0  # gRPC handler threads (0: see above)
    gc_interval_s: float = 60.0  # background GC period; 0: no background GC
    drain_s: float = 10.0  # on SIGTERM: how long in-flight calls may finish
    # A call whose request (a PutStream's every item; any other call's one message) is not wholly
    # received within this long is cancelled, freeing its handler thread and admission slot (a
    # client sending slowly, or not at all, holds neither for ever); 0: no bound.
    stream_receive_s: float = 60.0
    # A GetStream that can send nothing for this long is cancelled (gRPC holds the handler thread
    # and admission slot until HTTP/2 flow control lets each message out: a client that stops
    # reading would hold them for ever). Flow control opens a window (~MiBs) at a time, so a client
    # reading under about one window per stream_send_s is cut too. Store reads do not count. 0: no bound.
    stream_send_s: float = 60.0
    tls_cert: str = ""  # PEM certificate chain of the daemon; empty: plaintext
    tls_key: str = ""
    tls_client_ca: str = ""  # set: mutual TLS, clients need a cert signed by this CA
    tokens_file: str = ""  # set: bearer-token auth, tenants namespaced (see kvstore.auth)
    tenant_secret_file: str = ""  # empty: <data_dir>/server/tenant.secret (created 0600)
    tenant_quota_bytes: int = 0  # >0: live plain bytes each tenant may hold here (per daemon; RESOURCE_EXHAUSTED over it)
    allow_direct_reads: bool = True  # answer Locate and show the target table (kvstore.client.direct_reads); false: PERMISSION_DENIED
    # Answer Commit: index packs clients wrote into the targets themselves (kvstore.client.direct_writes);
    # only for clients trusted with write access to every target's files. false: PERMISSION_DENIED.
    allow_direct_writes: bool = False

    def __post_init__(self) -> None:
        _check_types(self)
        if not 0 <= self.port <= 65535 or not -1 <= self.metrics_port <= 65535:
            raise InvalidRequest("port must be in [0, 65535]; metrics_port in [-1, 65535]")
        if not 64 * 1024 <= self.max_message_bytes <= MAX_MESSAGE_BYTES or self.max_batch_items < 1:
            raise InvalidRequest(f"max_message_bytes must be in [64 KiB, {MAX_MESSAGE_BYTES}] and "
                                 "max_batch_items >= 1")
        if self.max_concurrent_requests < 0 or self.max_concurrent_per_tenant < 1 or self.workers < 0:
            raise InvalidRequest("max_concurrent_per_tenant must be >= 1; max_concurrent_requests and workers "
                                 ">= 1 (0: derived)")
        if not (self.max_concurrent_requests or self.workers):
            object.__setattr__(self, "max_concurrent_requests", 48)
        if not self.workers:
            object.__setattr__(self, "workers", self.max_concurrent_requests + max(1, self.max_concurrent_requests // 3))
        if not self.max_concurrent_requests:
            object.__setattr__(self, "max_concurrent_requests", max(1, self.workers * 3 // 4))
        if self.max_concurrent_requests >= self.workers:
            raise InvalidRequest(
                f"max_concurrent_requests must be below workers (got {self.max_concurrent_requests} and "
                f"{self.workers}): calls are admitted on handler threads, so with every thread held by "
                "admitted calls the rest would queue instead of being refused; e.g. workers = "
                f"{self.max_concurrent_requests + max(1, self.max_concurrent_requests // 3)}")
        for name in ("gc_interval_s", "drain_s", "stream_receive_s", "stream_send_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and 0 <= v <= MAX_SECONDS):  # nan fails every comparison: check it
                raise InvalidRequest(f"{name} must be a finite number of seconds in [0, {MAX_SECONDS:.0e}], "
                                     f"got {v!r}")
        if not 0 <= self.tenant_quota_bytes <= MAX_QUOTA_BYTES:
            raise InvalidRequest(f"tenant_quota_bytes must be in [0, 2**62] (0: no per-tenant quota), "
                                 f"got {self.tenant_quota_bytes}")
        check_server_files(self.tls_cert, self.tls_key, self.tls_client_ca)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert)

    def read_tls_files(self) -> dict[str, bytes]:
        """The PEM files TLS needs, read and sanity-checked; ``InvalidRequest`` naming the problem."""
        want = {"tls_cert": "CERTIFICATE", "tls_key": "PRIVATE KEY", "tls_client_ca": "CERTIFICATE"}
        return {name: read_pem(getattr(self, name), f"{name} file", marker)
                for name, marker in want.items() if getattr(self, name)}


def _field_kind(typ: Any) -> str:
    """``"int"``, ``"float"``, ``"bool"``, ``"str"`` or ``""`` (anything else) for a field's type."""
    name = typ if isinstance(typ, str) else getattr(typ, "__name__", "")
    return name if name in ("int", "float", "bool", "str") else ""


_WANT = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}


def _fits(kind: str, value: Any) -> bool:
    """``value`` already is of the field's type (a bool is no number: ``True`` is not ``1`` here)."""
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    return True


def _check_types(cfg: "ServerConfig") -> None:
    """Every field holds its declared type (``ServerConfig(port=7070.9)`` is refused, not truncated)."""
    for f in dataclasses.fields(cfg):
        kind, value = _field_kind(f.type), getattr(cfg, f.name)
        if not _fits(kind, value):
            raise InvalidRequest(f"server option {f.name!r} must be {_WANT[kind]}, got {value!r}")


def _coerce_server(name: str, value: Any, source: str) -> Any:
    """A ServerConfig field's value from ``source`` (TOML file, env, option), strictly typed:
    text is parsed (by ``_coerce``) only from env and options; a file's value (a
    ``TomlValue``) must already be of the field's type (``port = "7071"`` is refused)."""
    typ = SERVER_FIELDS[name].type
    kind = _field_kind(typ)
    from_toml = isinstance(value, TomlValue)
    if from_toml:
        value = value.value
    if kind == "int" and isinstance(value, float) and value.is_integer():
        value = int(value)  # TOML's 7070.0 is 7070; 7070.9 is refused below, never truncated
    if (from_toml or not isinstance(value, str)) and not _fits(kind, value):
        quoted = " (a TOML string: write it without quotes)" if isinstance(value, str) else ""
        raise InvalidRequest(f"server option {name!r} in {source} must be {_WANT[kind]}, got {value!r}{quoted}")
    return _coerce(name, typ, value, source)


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

    ``overrides`` may mix server and store fields. Raises ``InvalidRequest`` for an
    unknown name (option, ``[server]`` key, top-level key or table of a file with
    ``[server]``/``[store]`` tables), a value of the wrong type (an integer field
    given ``7070.9``, ``true`` or, in the file, ``"7070"``) and a value out of range (see
    ``ServerConfig``). A ``KVSTORE_<FIELD>`` variable set to ``""`` counts as unset (a
    logged warning names it; ``kvstore.config.env_layer``).
    A value that a higher source overrides is checked only to warn about it (logged,
    naming the variable or file and the value); it never stops the start.
    """
    env = os.environ if env is None else env
    from_file: dict[str, tuple[str, Any]] = {}
    tabled = False  # a file with [server] and/or [store] tables (else: a flat store-only file)
    if toml_path is not None:
        doc = read_toml(toml_path)
        tabled = "server" in doc or "store" in doc
        extra = sorted(set(doc) - {"server", "store"}) if tabled else []
        if extra:
            raise InvalidRequest(
                f"unknown top-level key(s) or table(s) {extra} in {toml_path}: a file with [server] or "
                "[store] tables holds only those two (store options go under [store])")
        for table in ("server", "store"):
            if table in doc and not isinstance(doc[table], dict):
                raise InvalidRequest(f"{toml_path}: {table!r} must be a [{table}] table, got {doc[table]!r}")
        for k, v in doc.get("server", {}).items():
            if k not in SERVER_FIELDS:
                raise InvalidRequest(f"unknown [server] option {k!r} in {toml_path}; known: {sorted(SERVER_FIELDS)}")
            from_file[k] = (str(toml_path), TomlValue(v))
    from_env = env_layer(env, SERVER_FIELDS)
    flags: dict[str, tuple[str, Any]] = {}
    store_over: dict[str, Any] = {}
    for k, v in overrides.items():
        if k in SERVER_FIELDS:
            if v is not None:
                flags[k] = (_flag(k), v)
        elif k in STORE_FIELDS:
            store_over[k] = v
        else:
            raise InvalidRequest(f"unknown option {k!r}")
    values = merge_sources([flags, from_env, from_file], _coerce_server)
    toml_for_store = toml_path
    if tabled and "store" not in doc:
        toml_for_store = None  # a server-only file: no store options in it
    store_cfg = store_config_from(toml_for_store, env, store_over, _flag)
    return ServerConfig(**values), store_cfg


def _flag(name: str) -> str:
    """How a field's flag is named in messages: ``option --gc-interval-s``."""
    return f"option --{name.replace('_', '-')}"
