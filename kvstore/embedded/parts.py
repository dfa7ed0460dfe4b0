"""The parts an embedded store is made of, handed as one record to what works on them.

``kvstore.embedded.store.EmbeddedStore`` opens its data directory (``kvstore.embedded.datadir``),
then builds these parts and keeps them in ``StoreParts``; maintenance (``kvstore.maintenance``:
GC, eviction, check and repair, the orphan sweep, reindexing) and the stats summary
(``kvstore.embedded.stats``) take that record and work on the parts, never on the store
itself, so they need nothing of its call gate or its private state, and take their time from
its clocks (``clock`` for TTLs and grace periods, ``file_clock`` for the ages of files, whose
mtimes are stamped on this host's clock).
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from kvstore.config import StoreConfig, TargetSpec
from kvstore.embedded.access import AccessTimes
from kvstore.embedded.diskroom import IndexRoom
from kvstore.embedded.fragments import FragmentStore
from kvstore.embedded.index import Index
from kvstore.embedded.targets import Target

COUNTER_NAMES = ("puts", "puts_deduplicated", "gets", "get_misses", "degraded_reads", "unrecoverable", "bytes_in",
                 "bytes_out", "evicted", "fragment_rewrites", "compacted_entries", "read_retries", "read_timeouts",
                 "write_timeouts", "rejected_packs", "segments_started", "segment_syncs", "segment_write_failures")


class Counters:
    """The store's event counters (``COUNTER_NAMES``), thread-safe; ``values`` is the live dict
    that ``EmbeddedStore.counters`` and its stats show."""

    def __init__(self) -> None:
        self.values: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self._lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.values[name] += n


@dataclass(frozen=True, slots=True)
class StoreParts:
    """One open store's parts (module docstring). ``pool`` is the store's leaf executor (target
    probes are asked on it all at once); ``evict_lock`` lets one eviction pass run at a time
    in this process."""

    config: StoreConfig
    data_dir: Path
    index: Index
    targets: dict[str, Target]
    fragments: FragmentStore
    access: AccessTimes
    counters: Counters
    room: IndexRoom
    pool: Executor
    clock: Callable[[], float]
    file_clock: Callable[[], float]
    evict_lock: threading.Lock

    @property
    def target_specs(self) -> Sequence[TargetSpec]:
        return self.fragments.target_specs

    def now_ns(self) -> int:
        return int(self.clock() * 1e9)

    def used_bytes(self) -> int:
        with self.index.env.begin() as txn:
            return self.index.counter(txn, "used_bytes")
