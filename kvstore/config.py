"""Store configuration: one frozen dataclass, filled from (highest first) explicit
overrides / CLI flags, ``KVSTORE_*`` environment variables, a TOML file, and the
embedded defaults.

Every default works on a laptop with no external service: one local data
directory holding ``ec_k + ec_m`` target subdirectories in a single failure
domain, so the code path is the same as with real disks.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from kvstore.errors import InvalidRequest

ENV_PREFIX = "KVSTORE_"
DEFAULT_DATA_DIR = "./kvstack-data"
# ISA-L Reed-Solomon over a Cauchy matrix: MDS for every k+m (ISA-L's Vandermonde matrix
# is not for all of them), as fast as Vandermonde (tools/bench_store.py).
DEFAULT_EC_TYPE = "isa_l_rs_cauchy"
# What a data directory whose marker names no code was written with (before it was recorded).
LEGACY_EC_TYPE = "isa_l_rs_vand"


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """A storage target: an fsspec URL plus a failure-domain label.

    ``name`` is the stable id the index records for every fragment placed here;
    it defaults to the URL, so renaming a mount point means giving the old name.
    """

    url: str
    domain: str = "default"
    name: str = ""

    def __post_init__(self) -> None:
        if not self.url:
            raise InvalidRequest("a target needs a non-empty URL")
        if not self.name:
            object.__setattr__(self, "name", self.url)

    @classmethod
    def parse(cls, text: str) -> "TargetSpec":
        """``URL[#DOMAIN[#NAME]]``, e.g. ``file:///mnt/nvme0/kv#rack1``."""
        parts = text.split("#")
        if len(parts) > 3:
            raise InvalidRequest(f"bad target {text!r}: expected URL[#DOMAIN[#NAME]]")
        return cls(parts[0], parts[1] if len(parts) > 1 and parts[1] else "default",
                   parts[2] if len(parts) > 2 else "")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Knobs of the embedded store. Sizes in bytes, times in seconds."""

    data_dir: str = DEFAULT_DATA_DIR
    ec_k: int = 4
    ec_m: int = 2
    ec_type: str = ""  # pyeclib backend; "": the data directory's (DEFAULT_EC_TYPE for a new one)
    targets: tuple[TargetSpec, ...] = ()  # empty: k+m subdirectories of data_dir
    capacity_bytes: int = 0  # 0: unbounded (no capacity eviction)
    high_watermark: float = 0.95  # evict when stored bytes exceed this share of capacity
    low_watermark: float = 0.85  # ... down to this share
    default_ttl_s: float | None = None  # None: entries do not expire
    compression: str = "zstd"  # "zstd" or "none"
    zstd_level: int = 3
    min_compress_ratio: float = 1.1  # store raw unless zstd shrinks by at least this factor
    max_value_bytes: int = 64 * 1024 * 1024
    fsync: bool = True  # fragments and index durable before a put returns
    # How fsync makes a put's files durable (kvstore.targets.sync_plan): "file" fsyncs each file
    # and its directory; "fs" one syncfs per filesystem once the put's files are written;
    # "auto": "fs" where every target is a local ext4/xfs/btrfs directory on Linux >= 5.8, else "file".
    sync_mode: str = "auto"
    read_workers: int = 8  # threads reading and writing fragments in parallel
    fragment_read_retries: int = 1  # extra tries of a fragment read that failed transiently (EIO, checksum)
    read_timeout_s: float = 0.0  # >0: a fragment not read in time is skipped for parity (if k others are good)
    parallel_reads: str = "auto"  # "auto": fan out for remote targets only; "always"; "never"
    parallel_writes: str = "auto"  # "auto": fan out only writes that wait (fsync, remote targets); "always"; "never"
    pack_batches: bool = True  # put_many writes one pack file per target, not one file per fragment
    pack_bytes: int = 4 * 1024 * 1024  # a batch is cut into packs of about this many payload bytes
    pack_compact_ratio: float = 0.5  # GC moves a pack's live entries out once this share of it is dead
    tune_malloc: bool = True  # glibc: keep large buffers on the heap (process-wide; see kvstore.tuning)
    orphan_grace_s: float = 300.0  # unindexed fragments younger than this are an in-flight put
    delete_grace_s: float = 30.0  # deleted entries' fragments outlive the delete by this much
    access_flush_s: float = 1.0  # LRU access times are batched into one index write per interval
    lmdb_map_size: int = 8 * 1024**3
    max_readers: int = 256
    clock_offset_s: float = 0.0  # added to the wall clock (a node whose clock is off; chaos tests of TTLs)

    def __post_init__(self) -> None:
        if self.ec_k < 1 or self.ec_m < 0 or self.ec_k + self.ec_m > 32:
            raise InvalidRequest(
                f"erasure code {self.ec_k}+{self.ec_m} is out of range: need k >= 1, m >= 0, k+m <= 32"
            )
        if self.ec_m == 0 and self.ec_k > 1:
            raise InvalidRequest("ec_m = 0 only makes sense with ec_k = 1 (one plain copy)")
        if not 0 < self.pack_compact_ratio <= 1:
            raise InvalidRequest(f"pack_compact_ratio must be in (0, 1], got {self.pack_compact_ratio}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise InvalidRequest("watermarks need 0 < low_watermark <= high_watermark <= 1")
        if self.compression not in ("zstd", "none"):
            raise InvalidRequest(f"compression must be 'zstd' or 'none', got {self.compression!r}")
        if self.sync_mode not in ("auto", "file", "fs"):
            raise InvalidRequest(f"sync_mode must be auto, file or fs, got {self.sync_mode!r}")
        for knob in ("parallel_reads", "parallel_writes"):
            if getattr(self, knob) not in ("auto", "always", "never"):
                raise InvalidRequest(f"{knob} must be auto, always or never, got {getattr(self, knob)!r}")
        if self.capacity_bytes < 0 or self.max_value_bytes <= 0 or self.pack_bytes <= 0:
            raise InvalidRequest("capacity_bytes must be >= 0, max_value_bytes and pack_bytes > 0")
        if not 0 <= self.fragment_read_retries <= 16 or self.read_timeout_s < 0:
            raise InvalidRequest("fragment_read_retries must be in [0, 16] and read_timeout_s >= 0")
        if self.default_ttl_s is not None and self.default_ttl_s <= 0:
            raise InvalidRequest("default_ttl_s must be positive (or unset for no expiry)")
        if self.targets and len(self.targets) < self.ec_k + self.ec_m:
            raise InvalidRequest(
                f"{len(self.targets)} targets cannot hold {self.ec_k}+{self.ec_m} fragments on "
                f"distinct targets; give at least {self.ec_k + self.ec_m}"
            )
        names = [t.name for t in self.targets]
        if len(set(names)) != len(names):
            raise InvalidRequest(f"target names must be unique, got {names}")

    def resolved_targets(self) -> tuple[TargetSpec, ...]:
        """The configured targets, or the embedded default: k+m subdirectories of data_dir."""
        if self.targets:
            return self.targets
        root = Path(self.data_dir).resolve() / "targets"
        return tuple(
            TargetSpec(url=f"file://{root / f't{i}'}", domain="local", name=f"t{i}")
            for i in range(self.ec_k + self.ec_m)
        )


def _coerce(name: str, typ: Any, value: Any) -> Any:
    """Turn a TOML/env/flag value into the field's type, with a clear error."""
    origin = typing.get_origin(typ)
    try:
        if name == "targets":
            if isinstance(value, str):
                value = [v for v in value.split(",") if v]
            return tuple(
                v if isinstance(v, TargetSpec)
                else TargetSpec(**v) if isinstance(v, Mapping) else TargetSpec.parse(str(v))
                for v in value
            )
        if typ is bool or typ == "bool":
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if origin is typing.Union or "None" in str(typ):
            if value in (None, "", "none", "None"):
                return None
            return float(value)
        if typ in (int, "int"):
            return int(value)
        if typ in (float, "float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise InvalidRequest(f"config field {name!r}: cannot use {value!r} ({exc})") from exc


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """A TOML config file as a dict; an unreadable or malformed file is ``InvalidRequest``."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidRequest(f"cannot read config file {path}: {exc}") from exc


def load_config(
    toml_path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> StoreConfig:
    """Build a ``StoreConfig``: overrides > ``KVSTORE_*`` env > TOML file > defaults.

    Overrides equal to ``None`` are ignored so that unset CLI flags fall through.
    """
    fields = {f.name: f for f in dataclasses.fields(StoreConfig)}
    values: dict[str, Any] = {}
    if toml_path is not None:
        doc = read_toml(toml_path)
        doc = doc.get("store", doc)
        for k, v in doc.items():
            if k not in fields:
                raise InvalidRequest(f"unknown config field {k!r} in {toml_path}; known: {sorted(fields)}")
            values[k] = _coerce(k, fields[k].type, v)
    env = os.environ if env is None else env
    for k in fields:
        ev = env.get(ENV_PREFIX + k.upper())
        if ev is not None:
            values[k] = _coerce(k, fields[k].type, ev)
    for k, v in overrides.items():
        if k not in fields:
            raise InvalidRequest(f"unknown store option {k!r}; known: {sorted(fields)}")
        if v is not None:
            values[k] = _coerce(k, fields[k].type, v)
    return StoreConfig(**values)
