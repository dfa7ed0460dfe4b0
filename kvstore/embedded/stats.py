"""``EmbeddedStore.stats``: the store summary ``kvtool stats`` prints and the daemon's metrics
read, from the store's parts (``kvstore.embedded.parts.StoreParts``). Read-only: one index read
transaction (it counts every entry: O(index)) and each target asked whether it is up, all at once.
"""

from __future__ import annotations

from kvstore.api import EntryKind
from kvstore.embedded.parts import StoreParts


def stats(parts: StoreParts) -> dict:
    """Summary for ``kvtool stats`` and the daemon's metrics (counts entries: O(index))."""
    by_kind: dict[str, dict[str, int]] = {}
    oldest = newest = None
    with parts.index.env.begin() as txn:
        used = parts.index.counter(txn, "used_bytes")
        dead = parts.index.counter(txn, "pack_dead_bytes")
        lost = txn.stat(parts.index.db["lost"])["entries"]
        grave = txn.stat(parts.index.db["grave"])["entries"]
        for ek, raw in parts.index.iter_db(txn, "entries"):
            m = parts.index.unpack(txn, raw)
            d = by_kind.setdefault(EntryKind.from_code(ek[0]).value,
                                   {"entries": 0, "plain_bytes": 0, "stored_bytes": 0, "pinned": 0})
            d["entries"] += 1
            d["plain_bytes"] += m.plain_len
            d["stored_bytes"] += m.stored_bytes
            d["pinned"] += m.pinned
            oldest = m.created_ns if oldest is None else min(oldest, m.created_ns)
            newest = m.created_ns if newest is None else max(newest, m.created_ns)
    specs = parts.target_specs
    n_domains = len({t.domain for t in specs})
    up = dict(zip(parts.targets, parts.pool.map(lambda t: t.is_up(), parts.targets.values())))  # asked at once
    return {
        "data_dir": str(parts.data_dir),
        "entries": sum(d["entries"] for d in by_kind.values()),
        "by_kind": by_kind,
        "used_bytes": used,
        "pack_dead_bytes": dead,  # on disk in packs, no longer needed: GC compacts them away
        "capacity_bytes": parts.config.capacity_bytes,
        "lost_entries": lost,
        "graveyard_entries": grave,
        "oldest_created_s": oldest / 1e9 if oldest else None,
        "newest_created_s": newest / 1e9 if newest else None,
        "erasure_code": f"{parts.config.ec_type} {parts.config.ec_k}+{parts.config.ec_m}",
        "durable_writes": {"file": "fsync per file", "fs": "syncfs per filesystem"}.get(parts.fragments.writer.sync_mode(), "off"),
        "targets": [{"name": t.name, "url": t.shown_url, "domain": t.domain, "up": up[t.name]}
                    for t in specs],
        "failure_domains": n_domains,
        "failure_domain_note": (
            "all fragments share one failure domain: losing it loses everything"
            if n_domains == 1 else
            f"{n_domains} failure domains for {parts.config.ec_k + parts.config.ec_m} fragments per entry"
        ),
        "counters": dict(parts.counters.values),
    }
