"""kvstore: a crash-safe, erasure-coded KV block store for LLM KV caches.

Entry point for every caller::

    import kvstore
    store = kvstore.connect("./kvstack-data")          # embedded store on a local directory
    store = kvstore.connect("file:///var/lib/kv", ec_k=8, ec_m=3)
    store = kvstore.connect("grpc://127.0.0.1:7070")   # the daemon (see kvstore.server)

``connect`` picks the implementation by URL scheme from ``CONNECTORS`` (a
registry with lazy imports, as fsspec does); all of them satisfy
``kvstore.api.KVStore``.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from kvstore.api import Entry, EntryKind, KVStore, Layout, LookupResult, PutItem
from kvstore.config import StoreConfig, TargetSpec, load_config
from kvstore.errors import (
    CapacityExceeded,
    CorruptData,
    IncompatibleFormat,
    InvalidRequest,
    KVStoreError,
    NotFound,
    StoreUnavailable,
    Unrecoverable,
)

# URL scheme -> "module:function" taking (url, **overrides) and returning a KVStore.
CONNECTORS: dict[str, str] = {
    "": "kvstore.store:open_embedded",
    "file": "kvstore.store:open_embedded",
    "grpc": "kvstore.remote:open_grpc",  # the daemon (kvstore.server); a comma list of URLs: sharded
    "grpcs": "kvstore.remote:open_grpc",
}


def register_connector(scheme: str, target: str) -> None:
    """Register ``"module:function"`` as the opener of URLs with this scheme."""
    CONNECTORS[scheme] = target


def connect(url: str | None = None, **overrides: Any) -> KVStore:
    """Open a store. A plain path or ``file://`` URL opens the embedded store on that
    data directory; ``overrides`` are ``StoreConfig`` fields (they win over the
    ``KVSTORE_*`` environment and the defaults)."""
    url = url if url is not None else overrides.pop("data_dir", None) or StoreConfig.data_dir
    scheme = url.split("://", 1)[0] if "://" in url else ""
    try:
        target = CONNECTORS[scheme]
    except KeyError:
        raise InvalidRequest(
            f"no store for URL scheme {scheme!r} in {url!r}; known schemes: {sorted(s for s in CONNECTORS if s)}"
        ) from None
    mod_name, fn_name = target.split(":")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as exc:
        raise InvalidRequest(
            f"the {scheme!r} store needs an optional dependency ({exc}); install kvstack with the right extra"
        ) from exc
    opener: Callable[..., KVStore] = getattr(mod, fn_name)
    return opener(url, **overrides)


__all__ = [
    "CONNECTORS", "CapacityExceeded", "CorruptData", "Entry", "EntryKind", "IncompatibleFormat",
    "InvalidRequest", "KVStore", "KVStoreError", "Layout", "LookupResult", "NotFound", "PutItem",
    "StoreConfig", "StoreUnavailable", "TargetSpec", "Unrecoverable", "connect", "load_config",
    "register_connector",
]
