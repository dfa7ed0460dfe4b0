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
import os
import re
from typing import Any, Callable

from kvstore.api import Entry, EntryKind, KVStore, Layout, LookupResult, PutItem
from kvstore.config import DEFAULT_DATA_DIR, ENV_PREFIX, StoreConfig, TargetSpec, load_config
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
    "": "kvstore.embedded.store:open_embedded",
    "file": "kvstore.embedded.store:open_embedded",
    "grpc": "kvstore.client.connect:open_grpc",  # the daemon (kvstore.server); a comma list of URLs: sharded
    "grpcs": "kvstore.client.connect:open_grpc",
}


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
# The scheme of each entry of a comma list of URLs (the daemon's sharded form).
_LIST_SCHEMES = re.compile(r"(^|,)(\s*)([A-Za-z][A-Za-z0-9+.-]*)(?=://)")
LOCAL_SCHEMES = ("", "file")  # the embedded store on a local directory


def register_connector(scheme: str, target: str) -> None:
    """Register ``"module:function"`` as the opener of URLs with this scheme (a scheme is
    case-insensitive, RFC 3986 3.1: it is kept lowercased)."""
    CONNECTORS[scheme.lower()] = target


def _lowercase_schemes(url: str, scheme: str) -> str:
    """``url`` with its scheme lowercased, as the openers compare schemes as written (and
    sharded placement hashes the URL: ``GRPC://h:p`` must place as ``grpc://h:p``). A
    local path is left as written past its ``file:``, a comma list (not local: a path may
    hold commas) has each entry's scheme lowercased."""
    if scheme in LOCAL_SCHEMES:
        return scheme + url[len(scheme):] if scheme else url
    return _LIST_SCHEMES.sub(lambda m: m.group(1) + m.group(2) + m.group(3).lower(), url)


def connect(url: str | os.PathLike | None = None, **overrides: Any) -> KVStore:
    """Open a store. A plain path or ``file://`` URL opens the embedded store on that
    data directory (no URL: ``data_dir`` if given, else ``KVSTORE_DATA_DIR``, else
    ``./kvstack-data``); ``overrides`` are ``StoreConfig`` fields (they win over the
    ``KVSTORE_*`` environment and the defaults; one given as ``None`` counts as not
    given, ``data_dir=None`` included). A URL that is not one of these forms raises
    ``InvalidRequest``: nothing is created for a mistyped one.

    Schemes are case-insensitive (``FILE:///p`` is ``file:///p``). A ``file:`` URL
    holds a path only: a query or fragment (``file:///p?x=1``, ``file:///p#a``) is
    refused, not made part of a directory name (a plain path may contain ``?`` and
    ``#``; the path of a ``file:`` URL is taken as written, not percent-decoded)."""
    data_dir = overrides.pop("data_dir", None)
    if url is None:
        url = data_dir if data_dir is not None else (os.environ.get(ENV_PREFIX + "DATA_DIR") or DEFAULT_DATA_DIR)
    elif data_dir is not None:
        raise InvalidRequest("give the data directory once: as the URL or as data_dir, not both")
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.replace(",", "").strip():
        raise InvalidRequest(f"a store URL is a non-empty string (a path, file://PATH or grpc://HOST:PORT), "
                             f"got {url!r}")
    if "://" in url:
        scheme = url.lstrip(", ").split("://", 1)[0].lower()  # a stray leading comma: the opener's own message
    else:
        m = _SCHEME.match(url)
        scheme = m.group(1).lower() if m and m.group(1).lower() in CONNECTORS else ""
        if scheme and scheme != "file":  # "grpc:/host:port", "grpc:host:port": a typo, not a directory name
            raise InvalidRequest(f"{url!r} is not a {scheme} URL: write {scheme}://HOST:PORT")
    try:
        target = CONNECTORS[scheme]
    except KeyError:
        raise InvalidRequest(
            f"no store for URL scheme {scheme!r} in {url!r}; known schemes: {sorted(s for s in CONNECTORS if s)}"
        ) from None
    if scheme == "file" and not url[:5].lower() == "file:":  # " file:///p", ",file:///p": not a directory name
        raise InvalidRequest(f"{url!r}: stray characters before 'file:'; write file:///PATH or a plain path")
    if scheme == "file" and ("?" in url or "#" in url):
        raise InvalidRequest(f"{url!r}: a file URL cannot hold a query ('?') or fragment ('#'); "
                             "give the directory as a plain path if its name contains one")
    url = _lowercase_schemes(url, scheme)
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
