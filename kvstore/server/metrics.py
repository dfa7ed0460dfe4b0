"""Prometheus metrics of the daemon (prometheus-client, on a loopback port).

One ``DaemonMetrics`` per daemon, on its own ``CollectorRegistry`` (several
daemons in one test process never collide). The service records each call;
the store's own counters and capacity are read at scrape time by a collector,
so a scrape costs O(1) store work (no index walk).

=====================================  =========  ==========================================
metric                                 type       labels / meaning
=====================================  =========  ==========================================
kvstore_requests_total                 counter    method, code (gRPC status name)
kvstore_request_seconds                histogram  method
kvstore_hits_total                     counter    op (get, lookup, probe, locate), kind (block, swa)
kvstore_misses_total                   counter    op, kind
kvstore_bytes_in_total                 counter    payload bytes received by puts
kvstore_bytes_out_total                counter    payload bytes returned by gets (not direct reads)
kvstore_gc_runs_total                  counter    GC passes (background and on request)
kvstore_gc_reclaimed_bytes_total       counter    bytes GC freed (graveyard + orphans)
kvstore_inflight_requests              gauge      calls being served now
kvstore_degraded_reads_total           counter    reads that needed parity fragments
kvstore_unrecoverable_reads_total      counter    reads that found fewer than k good fragments
kvstore_lost_entries                   gauge      entries marked lost (until repair)
kvstore_used_bytes / capacity_bytes    gauge      stored fragment bytes / configured capacity
=====================================  =========  ==========================================

Lookups are counted per call this daemon answers: a ``Lookup`` (each piece of a chain
longer than ``max_batch_items``, which a client sends in pieces, counts once), and a
sharded client's ``Probe`` of its share of chains as ``op="probe"`` (a hit when any key
asked has a live block, or SWA, entry: the longest prefix is the client's to walk, so a
sharded set's lookups are counted once per shard asked, not once each).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _StoreCollector:
    """Reads the store's counters and capacity at scrape time."""

    def __init__(self, store: Any):
        self.store = store

    def describe(self) -> list:
        return []

    def collect(self):
        counters = dict(getattr(self.store, "counters", {}) or {})
        c = CounterMetricFamily("kvstore_degraded_reads", "reads that needed parity fragments")
        c.add_metric([], counters.get("degraded_reads", 0))
        yield c
        c = CounterMetricFamily("kvstore_unrecoverable_reads", "reads with fewer than k good fragments")
        c.add_metric([], counters.get("unrecoverable", 0))
        yield c
        c = CounterMetricFamily("kvstore_rejected_packs", "directly written packs found missing, short or stale "
                                "at Commit (their entries were put through the daemon)")
        c.add_metric([], counters.get("rejected_packs", 0))
        yield c
        used = lost = 0
        try:
            used = self.store.used_bytes()
            with self.store.index.env.begin() as txn:
                lost = txn.stat(self.store.index.db["lost"])["entries"]
        except Exception as exc:  # noqa: BLE001 - a scrape must never take the daemon down
            log.debug("metrics: store gauges unavailable: %s", exc)
        g = GaugeMetricFamily("kvstore_used_bytes", "stored fragment bytes")
        g.add_metric([], used)
        yield g
        g = GaugeMetricFamily("kvstore_capacity_bytes", "configured capacity (0: unbounded)")
        g.add_metric([], getattr(getattr(self.store, "config", None), "capacity_bytes", 0))
        yield g
        g = GaugeMetricFamily("kvstore_lost_entries", "entries marked lost until repair")
        g.add_metric([], lost)
        yield g


class DaemonMetrics:
    """The daemon's metrics; ``serve(host, port)`` exposes them over HTTP."""

    def __init__(self, store: Any):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvstore_requests", "gRPC calls", ["method", "code"], registry=r)
        self.latency = Histogram("kvstore_request_seconds", "gRPC call latency", ["method"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.hits = Counter("kvstore_hits", "hits", ["op", "kind"], registry=r)
        self.misses = Counter("kvstore_misses", "misses", ["op", "kind"], registry=r)
        self.bytes_in = Counter("kvstore_bytes_in", "payload bytes received", registry=r)
        self.bytes_out = Counter("kvstore_bytes_out", "payload bytes returned", registry=r)
        self.gc_runs = Counter("kvstore_gc_runs", "GC passes", registry=r)
        self.gc_reclaimed = Counter("kvstore_gc_reclaimed_bytes", "bytes reclaimed by GC", registry=r)
        self.inflight = Gauge("kvstore_inflight_requests", "calls being served", registry=r)
        r.register(_StoreCollector(store))
        self._http: Any = None
        self.port: int | None = None

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(method, code).inc()
        self.latency.labels(method).observe(seconds)

    def hit(self, op: str, kind: str, hit: bool, n: int = 1) -> None:
        if n:
            (self.hits if hit else self.misses).labels(op, kind).inc(n)

    def gc_done(self, result: dict) -> None:
        self.gc_runs.inc()
        self.gc_reclaimed.inc(max(0, int(result.get("reclaimed_bytes", 0) or 0)))

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint; returns the bound port (``port=0`` picks one)."""
        # "[::1]" as in URLs and as gRPC takes it; the HTTP server wants the bare address
        addr = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        self._http = (server, thread)
        self.port = server.server_address[1]
        return self.port

    def close(self) -> None:
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)
            self._http = None


