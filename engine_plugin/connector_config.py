"""``ConnectorConfig`` and the save policies: every knob of ``KVStoreConnector``, checked up front.

Who calls it: whoever builds a ``KVStoreConnector`` (tests, ``entrypoint.worker``,
``tools/bench_engine.py``); ``engine_plugin.kv_connector`` re-exports both names.

Contract: a ``ConnectorConfig`` that was built is valid. Every field is checked in
``__post_init__`` and a bad one raises ``InvalidRequest`` naming the field, so a
misconfiguration fails where the config is written, never at the first step that
uses the field. The record is frozen: a connector reads it once, at construction.

``SAVE_POLICIES`` maps a ``save_policy`` name to what it saves, and when:

    ==============  =====================================================
    policy          a completed block goes to the store ...
    ==============  =====================================================
    write_through   at once (``save_kv_layer``), from the engine's step
    write_back      when the host tier evicts it, or ``persist_host_tier``
    ==============  =====================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine_plugin.tiers import MAX_STORE_CALLS
from kvstore.errors import InvalidRequest


@dataclass(frozen=True, slots=True)
class SavePolicy:
    save_on_compute: bool  # put every completed block to the store right away
    store_on_host_evict: bool  # put a block to the store when the host tier evicts it


SAVE_POLICIES: dict[str, SavePolicy] = {
    "write_through": SavePolicy(save_on_compute=True, store_on_host_evict=False),
    "write_back": SavePolicy(save_on_compute=False, store_on_host_evict=True),
}


# The fewest ``store_max_calls``: a lookup (engine thread), a load (loader thread) and a put
# (saver thread) may run at once, and the gateway counts an abandoned call (timed out, still
# running: ``engine_plugin.tiers``) against the bound until it returns. So each path gets one
# call abandoned by a slow moment of the store and still room for its next: 3 running + 3
# abandoned. At 3, one lookup that timed out plus a put and a load filled every slot, and the
# next call failed ``store_busy`` and tripped the breaker on a store that had merely been slow.
MIN_STORE_CALLS = 6


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    block_size: int = 16
    device: str = "cpu"  # a key of devices.BACKENDS, optionally with ":index"
    host_capacity_bytes: int = 256 * 1024 * 1024
    save_policy: str = "write_through"
    replay_policy: str = "exact"  # a name in KVLayout.replay_spans
    load_snapshots: bool = True
    snapshot_end_of_input: bool = True
    snapshot_end_of_output: bool = True
    snapshot_interval_blocks: int = 0  # 0: no interval snapshots
    adopt_short_hits: bool = False  # V4.1 rule: an external hit no longer than the span is not adopted
    promote_to_host: bool = True  # blocks read straight into a host-resident pool are not (loader)
    # Host-resident backends (cpu): the store reads straight into the pool blocks, no staging
    # buffer and no second copy; an overrun read is then waited for (see engine_plugin.loader).
    direct_reads: bool = True
    store_timeout_s: float = 2.0  # reads (lookup, get_many): on the critical path of a request
    store_put_timeout_s: float = 30.0  # background puts
    store_backoff_s: float = 5.0
    # Store calls running at once, abandoned (timed-out, maybe hung) ones included: each holds
    # a thread; past it a call fails at once (``store_busy``) and trips the breaker. At least
    # MIN_STORE_CALLS: the connector runs a lookup, a load and a put at once (``engine_plugin.tiers``).
    store_max_calls: int = MAX_STORE_CALLS
    save_queue_depth: int = 32
    save_enqueue_timeout_s: float = 0.05
    staging_buffers: int = 256  # per size class
    load_batch_blocks: int = 64  # blocks per store read / staging batch
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        """Every field is checked here (``InvalidRequest`` naming it), not when first used."""
        if self.save_policy not in SAVE_POLICIES:
            raise InvalidRequest(f"unknown save_policy {self.save_policy!r}; known: {sorted(SAVE_POLICIES)}")
        for name, low in (("block_size", 1), ("host_capacity_bytes", 0), ("snapshot_interval_blocks", 0),
                          ("save_queue_depth", 1), ("staging_buffers", 1), ("load_batch_blocks", 1),
                          ("store_max_calls", MIN_STORE_CALLS)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InvalidRequest(f"ConnectorConfig.{name} must be an int >= {low}, got {v!r}")
        if self.staging_buffers < self.load_batch_blocks:
            raise InvalidRequest("staging_buffers must be >= load_batch_blocks >= 1")
        for name, positive in (("store_timeout_s", True), ("store_put_timeout_s", True),
                               ("store_backoff_s", False), ("save_enqueue_timeout_s", False)):
            v = getattr(self, name)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or v < 0 or (positive and v == 0)):
                raise InvalidRequest(f"ConnectorConfig.{name} must be a finite number "
                                     f"{'> 0' if positive else '>= 0'}, got {v!r}")
        if self.ttl_s is not None and (isinstance(self.ttl_s, bool) or not isinstance(self.ttl_s, (int, float))
                                       or not math.isfinite(self.ttl_s) or self.ttl_s <= 0):
            raise InvalidRequest(f"ConnectorConfig.ttl_s must be None or a finite number > 0, got {self.ttl_s!r}")
        if not isinstance(self.device, str) or not isinstance(self.replay_policy, str):
            raise InvalidRequest("ConnectorConfig.device and replay_policy are strings")
