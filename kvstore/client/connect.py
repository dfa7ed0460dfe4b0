"""``open_grpc``: ``kvstore.connect``'s opener for ``grpc://`` and ``grpcs://`` URLs.

One URL opens a ``kvstore.client.remote.RemoteStore``; a comma-separated list of URLs a
``kvstore.client.sharded.ShardedStore`` over them. Registered in ``kvstore.CONNECTORS``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvstore.client.options import ClientOptions, parse_address, refuse_tls_options, split_urls
from kvstore.client.remote import RemoteStore
from kvstore.client.sharded import ShardedStore


def open_grpc(url: str, **overrides: Any) -> RemoteStore | ShardedStore:
    """``kvstore.connect`` opener for ``grpc://`` and ``grpcs://`` (a comma list: sharded).

    Options and every URL are checked (``split_urls``; TLS options with ``grpc://`` URLs
    only: ``refuse_tls_options``) before any channel is opened. In a list with a
    ``grpcs://`` URL the TLS options are for those shards (``kvstore.client.options``)."""
    opts = ClientOptions.from_overrides(overrides)
    urls = split_urls(url)
    if any(parse_address(u)[1] for u in urls):
        if len(urls) > 1 and opts.tls_given():
            opts = dataclasses.replace(opts, grpcs_in_set=True)
    else:
        refuse_tls_options(urls[0], opts)
    if len(urls) > 1:
        return ShardedStore(urls, opts)
    return RemoteStore(urls[0], opts)
