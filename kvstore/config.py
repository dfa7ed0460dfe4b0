"""Store configuration: one frozen dataclass, filled from (highest first) explicit
overrides / CLI flags, ``KVSTORE_*`` environment variables, a TOML file, and the
embedded defaults.

Two ways in, two typing rules:

* ``StoreConfig(...)`` built directly takes every field in its declared type only
  (``fsync="false"``, ``ec_k=4.7``, ``targets="file:///x"`` are ``InvalidRequest``
  naming the field): nothing is guessed from a string.
* ``load_config`` (``kvstore.connect``'s keyword arguments, ``KVSTORE_<FIELD>``
  variables, the daemon's flags) parses text: ``"off"`` for a bool, ``"4"`` for an
  int, ``URL[#DOMAIN[#NAME]],...`` for ``targets``. A TOML file is typed already: a
  key of a number or bool field takes that TOML type only (``ec_k = "4"`` and
  ``fsync = "off"`` are refused, as ``fsync = 0`` is; ``TomlValue``); ``targets``
  may be text there too. Only the value that wins for a field has to parse; one that
  a higher source overrides is logged as a warning and ignored (``merge_sources``),
  so a stale variable never blocks a start that a flag has already corrected.
* A ``KVSTORE_<FIELD>`` variable set to the empty string counts as unset (the file's
  value or the default stands) and is logged as a warning naming it (``env_layer``):
  ``KVSTORE_TOKENS_FILE=`` must not turn off the daemon's auth that its config file
  turns on. An optional field (``default_ttl_s``, ``ec_k``) is cleared with ``none``.

Every default works on a laptop with no external service: one local data
directory holding ``ec_k + ec_m`` target subdirectories in a single failure
domain, so the code path is the same as with real disks.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence
from urllib.parse import unquote

from kvstore.errors import InternalError, InvalidRequest

ENV_PREFIX = "KVSTORE_"
DEFAULT_DATA_DIR = "./kvstack-data"
# ISA-L Reed-Solomon over a Cauchy matrix: MDS for every k+m (ISA-L's Vandermonde matrix
# is not for all of them), as fast as Vandermonde (tools/bench_store.py).
DEFAULT_EC_TYPE = "isa_l_rs_cauchy"
# What a data directory whose marker names no code was written with (before it was recorded).
LEGACY_EC_TYPE = "isa_l_rs_vand"
DEFAULT_EC_K, DEFAULT_EC_M = 4, 2  # a new data directory's code when ec_k / ec_m are unset
MAX_TTL_S = 100 * 365 * 86400.0  # expiry times are u64 nanoseconds: keep far from overflow
MAX_DURATION_S = 1e9  # any other time knob (~31 years): finite, and far from timestamp overflow
# How targets are written, for error messages: built directly, and as text (env, TOML, connect()).
TARGETS_FORM = ("a tuple of TargetSpec, e.g. (TargetSpec('file:///mnt/nvme0/kv', domain='rack1'), ...); "
                "as text (connect(), KVSTORE_TARGETS, a config file): 'URL[#DOMAIN[#NAME]],...', "
                "e.g. 'file:///mnt/nvme0/kv#rack1,file:///mnt/nvme1/kv#rack2'")

log = logging.getLogger(__name__)


def split_userinfo(url: str) -> tuple[str, str | None, str | None]:
    """``(url without its user:password@ part, user, password)``, the two percent-decoded
    (``None`` when the URL carries none): ``s3://key:secret@bucket/p`` -> ``("s3://bucket/p",
    "key", "secret")``. The userinfo ends at the last ``@`` before the first ``/``, ``?`` or
    ``#`` after ``://``; an ``@`` only past those, with a ``:`` before it (a password holding
    an unencoded ``/``, as AWS secret keys may), cannot be told from a path and is refused
    (``InvalidRequest``, which never shows the secret)."""
    if "://" not in url:
        return url, None, None
    scheme, rest = url.split("://", 1)
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    at = rest.rfind("@", 0, end)
    if at < 0:
        later = rest.find("@", end)
        if later > 0 and ":" in rest[:later] and not rest.startswith("/"):
            raise InvalidRequest(
                f"a {scheme}:// target URL has an '@' after a '/', '?' or '#' and a ':' before it: if it carries "
                "user:password@, percent-encode '/', '?' and '#' in them (%2F, %3F, %23), or give the "
                "credentials through the environment")
        return url, None, None
    user, _, password = rest[:at].partition(":")
    return f"{scheme}://{rest[at + 1:]}", unquote(user), unquote(password)


def redact_userinfo(text: str) -> str:
    """``text`` (a URL, a list of them, a message quoting one) with each ``user:password``
    replaced by ``***``, up to the last ``@`` of each URL: for messages about text that
    ``split_userinfo`` may not be able to parse."""
    return re.sub(r"://[^\s,'\"]*@", "://***@", text)


def strip_userinfo(url: str) -> str:
    """``url`` without a ``user:password@`` part (``split_userinfo``). What names, logs,
    errors and stats show of a target URL: credentials are never recorded in the index nor
    printed."""
    return split_userinfo(url)[0]


def localhost_file_url(url: str) -> str:
    """``file://localhost/PATH`` as ``file:///PATH`` (RFC 8089: host ``localhost`` is this
    machine); any other URL as written. fsspec reads everything after ``file://`` as the path,
    so unchanged the target would open ``<cwd>/localhost/PATH`` and compare unequal to ``file:///PATH``.
    Another word there stays a relative path (``file://d0`` is the directory ``d0``; see
    ``kvstore.embedded.datadir._absolute``), not a host."""
    scheme, sep, rest = url.partition("://")
    if sep and scheme == "file" and rest[:10].lower() == "localhost/":
        return f"{scheme}://{rest[9:]}"
    return url


def target_name(name: str) -> str:
    """A target name as configured, recorded and compared: without ``user:password@``
    (``strip_userinfo``) and with ``file://localhost/`` spelled ``file:///``
    (``localhost_file_url``), since a name defaults to its URL and those two URLs are one
    directory (a store created with ``file:///P`` opens again with ``file://localhost/P``).
    Names recorded in either spelling mean the same target."""
    return localhost_file_url(strip_userinfo(name))


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """A storage target: an fsspec URL plus a failure-domain label.

    ``name`` is the stable id the index records for every fragment placed here;
    it defaults to the URL without credentials (``target_name``), so renaming a mount
    point means giving the old name, and rotating a credential in the URL changes nothing.
    """

    url: str
    domain: str = "default"
    name: str = ""

    def __post_init__(self) -> None:
        """Every part a string (``TargetSpec(5)`` is ``InvalidRequest``), the URL non-empty;
        an empty name becomes the URL; a name never carries ``user:password@`` and spells
        ``file://localhost/`` as ``file:///`` (``target_name``)."""
        for part in ("url", "domain", "name"):
            if not isinstance(getattr(self, part), str):
                raise InvalidRequest(f"a target's {part} must be a string, got {getattr(self, part)!r} "
                                     "(a target is TargetSpec(url, domain='default', name=''))")
        if not self.url:
            raise InvalidRequest("a target needs a non-empty URL")
        object.__setattr__(self, "name", target_name(self.name or self.url))

    def __repr__(self) -> str:  # never the URL's credentials
        return f"TargetSpec(url={self.shown_url!r}, domain={self.domain!r}, name={self.name!r})"

    @property
    def shown_url(self) -> str:
        """The URL as logs, errors and stats show it: without credentials."""
        return strip_userinfo(self.url)

    @classmethod
    def parse(cls, text: str) -> "TargetSpec":
        """``URL[#DOMAIN[#NAME]]``, e.g. ``file:///mnt/nvme0/kv#rack1``."""
        parts = text.split("#")
        if any("@" in p for p in parts[1:]):  # "s3://k:pa#ss@b/p": the '#' cut the password
            raise InvalidRequest("a target's DOMAIN or NAME (after '#') holds an '@': if its URL carries "
                                 "user:password@, percent-encode '#' there (%23); names hold no '@'")
        if len(parts) > 3:
            raise InvalidRequest(f"bad target {redact_userinfo(text)!r}: expected URL[#DOMAIN[#NAME]]")
        return cls(parts[0], parts[1] if len(parts) > 1 and parts[1] else "default",
                   parts[2] if len(parts) > 2 else "")


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Knobs of the embedded store. Sizes in bytes, times in seconds."""

    data_dir: str = DEFAULT_DATA_DIR
    # The erasure code: None (unset) means the data directory's, as recorded when it was created
    # (DEFAULT_EC_K + DEFAULT_EC_M for a new one); a value that differs from the recorded one is
    # refused (kvstore.embedded.store), since the directory's targets and records were laid out for it.
    ec_k: int | None = None
    ec_m: int | None = None
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
    # How fsync makes a put's files durable (kvstore.embedded.durability.sync_plan): "file" fsyncs each file
    # and its directory; "fs" one syncfs per filesystem once the put's files are written;
    # "auto": "fs" where every target is a local ext4/xfs/btrfs directory on Linux >= 5.8, else "file".
    sync_mode: str = "auto"
    read_workers: int = 8  # threads reading and writing fragments in parallel
    fragment_read_retries: int = 1  # extra tries of a fragment read that failed transiently (EIO, checksum)
    read_timeout_s: float = 0.0  # >0: a fragment not read in time is skipped for parity (if k others are good)
    # >0: a fragment or pack write not done in time fails (a spare target takes it, or the put fails
    # with StoreUnavailable); each write then runs on its target's own threads, whatever parallel_writes
    # says (a write inline cannot be given up on). 0: wait for every write
    write_timeout_s: float = 0.0
    parallel_reads: str = "auto"  # "auto": fan out for remote targets only; "always"; "never"
    # "auto": fan out only writes that wait (fsync, remote targets, a single put's large fragments);
    # "always"; "never"
    parallel_writes: str = "auto"
    # Puts (single and batched) append each target's fragments to this process's open segment file
    # there (kvstore.embedded.segments), where every target is a local directory and write_timeout_s is
    # 0; elsewhere, or false: pack files per batch (pack_batches) and one file per fragment
    segments: bool = True
    segment_bytes: int = 64 * 1024 * 1024  # a segment file is sealed, and the next one started, past this
    pack_batches: bool = True  # put_many writes one pack file per target, not one file per fragment
    pack_bytes: int = 4 * 1024 * 1024  # a batch is cut into packs of about this many payload bytes
    pack_compact_ratio: float = 0.5  # GC moves a pack's live entries out once this share of it is dead
    tune_malloc: bool = True  # glibc: keep large buffers on the heap (process-wide; see kvstore.embedded.tuning)
    orphan_grace_s: float = 300.0  # unindexed fragments younger than this are an in-flight put
    delete_grace_s: float = 30.0  # deleted entries' fragments outlive the delete by this much
    access_flush_s: float = 1.0  # LRU access times are batched into one index write per interval
    lmdb_map_size: int = 8 * 1024**3
    # Kept free for the index on its filesystem (kvstore.embedded.diskroom): a spare file deletions and gc
    # release when the filesystem is full, so that they can commit; puts never spend it. 0: none
    index_reserve_bytes: int = 4 * 1024**2
    max_readers: int = 256
    clock_offset_s: float = 0.0  # added to the wall clock (a node whose clock is off; chaos tests of TTLs)

    def __post_init__(self) -> None:
        """Every knob checked before anything is created on disk: a bad value is one
        ``InvalidRequest`` naming the field, never an error from deep inside a put."""
        for f in dataclasses.fields(self):
            _check_type(self, f.name, str(f.type))
        k, m = self.ec_k, self.ec_m
        if k is not None or m is not None:
            k = DEFAULT_EC_K if k is None else k
            m = DEFAULT_EC_M if m is None else m
            if k < 1 or m < 0 or k + m > 32:
                raise InvalidRequest(f"erasure code {k}+{m} is out of range: need k >= 1, m >= 0, k+m <= 32")
            if m == 0 and k > 1:
                raise InvalidRequest("ec_m = 0 only makes sense with ec_k = 1 (one plain copy)")
        if not 0 < self.pack_compact_ratio <= 1:
            raise InvalidRequest(f"pack_compact_ratio must be in (0, 1], got {self.pack_compact_ratio}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise InvalidRequest("watermarks need 0 < low_watermark <= high_watermark <= 1")
        if self.compression not in ("zstd", "none"):
            raise InvalidRequest(f"compression must be 'zstd' or 'none', got {self.compression!r}")
        if not -(1 << 17) <= self.zstd_level <= 22:
            raise InvalidRequest(f"zstd_level must be in [-131072, 22] (zstd's levels), got {self.zstd_level}")
        if self.min_compress_ratio < 1:
            raise InvalidRequest(f"min_compress_ratio must be >= 1 (1.0: keep any saving), got {self.min_compress_ratio}")
        if self.sync_mode not in ("auto", "file", "fs"):
            raise InvalidRequest(f"sync_mode must be auto, file or fs, got {self.sync_mode!r}")
        for knob in ("parallel_reads", "parallel_writes"):
            if getattr(self, knob) not in ("auto", "always", "never"):
                raise InvalidRequest(f"{knob} must be auto, always or never, got {getattr(self, knob)!r}")
        if self.capacity_bytes < 0 or self.max_value_bytes <= 0 or self.pack_bytes <= 0 or self.segment_bytes <= 0:
            raise InvalidRequest("capacity_bytes must be >= 0, max_value_bytes, pack_bytes and segment_bytes > 0")
        if not 0 <= self.fragment_read_retries <= 16:
            raise InvalidRequest(f"fragment_read_retries must be in [0, 16], got {self.fragment_read_retries}")
        if not 1 <= self.read_workers <= 1024:
            raise InvalidRequest(f"read_workers must be in [1, 1024], got {self.read_workers}")
        if not 1 <= self.max_readers <= 1 << 20:
            raise InvalidRequest(f"max_readers must be in [1, {1 << 20}], got {self.max_readers}")
        if not 0 <= self.index_reserve_bytes <= 1 << 40:
            raise InvalidRequest(f"index_reserve_bytes must be in [0, 1 TiB], got {self.index_reserve_bytes}")
        if not 1 << 20 <= self.lmdb_map_size <= 1 << 46:
            raise InvalidRequest(f"lmdb_map_size must be in [1 MiB, 64 TiB], got {self.lmdb_map_size}")
        for knob in ("read_timeout_s", "write_timeout_s", "orphan_grace_s", "delete_grace_s", "access_flush_s"):
            if not 0 <= getattr(self, knob) <= MAX_DURATION_S:
                raise InvalidRequest(f"{knob} must be in [0, {MAX_DURATION_S:.0f}] seconds, got {getattr(self, knob)}")
        if not abs(self.clock_offset_s) <= MAX_DURATION_S:
            raise InvalidRequest(f"clock_offset_s must be within +-{MAX_DURATION_S:.0f} s, got {self.clock_offset_s}")
        if self.default_ttl_s is not None and not 0 < self.default_ttl_s <= MAX_TTL_S:
            raise InvalidRequest(f"default_ttl_s must be in (0, {MAX_TTL_S:.0f}] seconds (or unset for no expiry), "
                                 f"got {self.default_ttl_s}")
        if self.targets and k is not None and len(self.targets) < k + m:
            raise InvalidRequest(
                f"{len(self.targets)} targets cannot hold {k}+{m} fragments on "
                f"distinct targets; give at least {k + m}"
            )
        names = [t.name for t in self.targets]
        if len(set(names)) != len(names):
            raise InvalidRequest(f"target names must be unique, got {names}")

    def resolved_targets(self) -> tuple[TargetSpec, ...]:
        """The configured targets, or the embedded default: k+m subdirectories of data_dir
        (``ec_k``/``ec_m`` resolved: the store calls this once it has read its directory's)."""
        if self.targets:
            return self.targets
        if self.ec_k is None or self.ec_m is None:
            raise InternalError("the default targets need ec_k and ec_m resolved first (a kvstore bug)")
        root = Path(self.data_dir).resolve() / "targets"
        return tuple(
            TargetSpec(url=f"file://{root / f't{i}'}", domain="local", name=f"t{i}")
            for i in range(self.ec_k + self.ec_m)
        )


def _check_type(cfg: StoreConfig, name: str, want: str) -> None:
    """``cfg.<name>`` holds its declared type ``want`` (the annotation's text), else
    ``InvalidRequest`` naming the field. Text is never parsed here (that is
    ``load_config``'s job); a number is finite; ``data_dir`` may be a path object and
    ``targets`` a list, both normalised (to ``str``, to a tuple)."""
    v = getattr(cfg, name)
    if v is None and want.endswith("| None"):
        return
    kind = want.removesuffix(" | None")
    if kind in ("int", "float"):
        if isinstance(v, bool) or not isinstance(v, int if kind == "int" else (int, float)):
            raise InvalidRequest(f"{name} must be {'an integer' if kind == 'int' else 'a number'}, got {v!r}")
        if isinstance(v, float) and not math.isfinite(v):
            raise InvalidRequest(f"{name} must be a finite number, got {v}")
    elif kind == "bool":
        if not isinstance(v, bool):
            raise InvalidRequest(f"{name} must be True or False, got {v!r} (text such as 'off' is parsed only by "
                                 f"load_config: connect(), KVSTORE_{name.upper()}, a config file)")
    elif kind == "str":
        if name == "data_dir" and isinstance(v, os.PathLike):
            v = os.fspath(v)
            object.__setattr__(cfg, name, v)
        if not isinstance(v, str):
            raise InvalidRequest(f"{name} must be a string, got {v!r}")
    elif name == "targets":
        if not isinstance(v, (tuple, list)) or not all(isinstance(t, TargetSpec) for t in v):
            raise InvalidRequest(f"targets must be {TARGETS_FORM}; got {v!r}")
        object.__setattr__(cfg, name, tuple(v))
    else:  # a new field of a kind not handled above: checking it is part of adding it
        raise InternalError(f"StoreConfig field {name!r} of type {want!r} has no type check (a kvstore bug)")


def _parse_targets(value: Any) -> tuple[TargetSpec, ...]:
    """``targets`` from text (``URL[#DOMAIN[#NAME]],...``) or a list of ``TargetSpec``, TOML
    tables (``{url = ..., domain = ...}``), text or paths; anything else is ``TypeError``."""
    if isinstance(value, str):  # "a, b": spaces around the commas are not part of a URL
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected {TARGETS_FORM}")
    out = []
    for v in value:
        if isinstance(v, os.PathLike):
            v = os.fspath(v)
        if isinstance(v, TargetSpec):
            out.append(v)
        elif isinstance(v, Mapping):
            out.append(TargetSpec(**v))
        elif isinstance(v, str):
            out.append(TargetSpec.parse(v))
        else:
            raise TypeError(f"a target {v!r} is neither a TargetSpec, a table nor text; expected {TARGETS_FORM}")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class TomlValue:
    """A value read from a TOML file. TOML is typed, so text is not parsed for a number or
    bool field there (``port = "7071"`` is a slip, refused like ``fsync = 0``), while the
    same text from a variable or a flag (text by nature) is."""

    value: Any


def _text_refused(typ: Any) -> str:
    """What a number or bool field (``typ``, optional or not) wants, for refusing a TOML
    string; ``""`` for a field that takes text."""
    return {"int": "an integer", "float": "a number", "bool": "true or false"}.get(
        str(getattr(typ, "__name__", typ)).removesuffix(" | None"), "")


def _coerce(name: str, typ: Any, value: Any, source: str = "") -> Any:
    """Turn a TOML/env/flag value into the field's type, with a clear error naming the
    field and, when given, ``source`` (where the value came from: ``KVSTORE_EC_K``, a file).
    A ``TomlValue`` is unwrapped; text in one is refused for a number or bool field."""
    origin = typing.get_origin(typ)
    from_toml = isinstance(value, TomlValue)
    if from_toml:
        value = value.value
    try:
        if from_toml and isinstance(value, str) and _text_refused(typ):
            raise TypeError(f"expected {_text_refused(typ)}, got a TOML string; write it without quotes")
        if name == "targets":
            return _parse_targets(value)
        if typ is bool or typ == "bool":
            if isinstance(value, str):
                if value.lower() in ("1", "true", "yes", "on"):
                    return True
                if value.lower() in ("0", "false", "no", "off"):
                    return False
                raise ValueError("expected true/false, 1/0, yes/no or on/off")
            if not isinstance(value, bool):  # 5 or 0.0 is a slip, not a switch
                raise TypeError(f"expected true or false, got {type(value).__name__}")
            return value
        if origin is typing.Union or "None" in str(typ):
            if value in (None, "", "none", "None"):
                return None
            typ = "int" if "int" in str(typ) else "float"
        if isinstance(value, bool):
            raise TypeError("expected a number, got a bool")
        if typ in (int, "int"):
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError("expected a whole number")
                return int(value)
            return int(value)
        if typ in (float, "float"):
            v = float(value)
            if not math.isfinite(v):  # no knob takes one; an overridden one is then warned about too
                raise ValueError("expected a finite number")
            return v
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str):
            raise TypeError(f"expected a string, got {type(value).__name__}")
        return value
    except (TypeError, ValueError) as exc:
        where = f" in {source}" if source else ""
        # target URLs may carry user:password@ (never echoed)
        raise InvalidRequest(f"config field {name!r}{where}: cannot use {redact_userinfo(repr(value))} "
                             f"({redact_userinfo(str(exc))})") from exc


# One source's values: field name -> (where it came from, the raw value).
Layer = Mapping[str, tuple[str, Any]]


def merge_sources(layers: Sequence[Layer], coerce: Callable[[str, Any, str], Any]) -> dict[str, Any]:
    """Each field's value from ``layers`` (highest precedence first), coerced by
    ``coerce(name, raw, source)``.

    Only the value that wins must be usable: its error (``InvalidRequest``) is raised.
    A lower source's value is overridden; if it cannot be coerced it is logged as a
    warning naming its source and value, and ignored, so that a bad ``KVSTORE_PORT``
    does not stop ``kvstore serve --port 7071`` (it would, were the flag removed).
    """
    out: dict[str, Any] = {}
    for name in dict.fromkeys(n for layer in layers for n in layer):
        given = [layer[name] for layer in layers if name in layer]
        (source, raw), overridden = given[0], given[1:]
        out[name] = coerce(name, raw, source)
        for lower, lower_raw in overridden:
            try:
                coerce(name, lower_raw, lower)
            except InvalidRequest as exc:
                log.warning("%s; ignored: %s overrides it", exc, source)
    return out


def env_layer(env: Mapping[str, str], names: Iterable[str]) -> dict[str, tuple[str, Any]]:
    """The ``KVSTORE_<NAME>`` variables of ``env`` for ``names``, as a ``merge_sources``
    layer. One set to the empty string counts as unset, so the file's value or the default
    stands (as an empty ``KVSTORE_DATA_DIR`` in ``kvstore.connect``): ``KVSTORE_TLS_CERT=``
    or ``KVSTORE_TOKENS_FILE=`` must not silently turn off TLS or auth that the daemon's
    config file turns on. Each one ignored is logged as a warning naming it."""
    out: dict[str, tuple[str, Any]] = {}
    for name in names:
        var = ENV_PREFIX + name.upper()
        value = env.get(var)
        if value == "":
            log.warning("%s is set but empty; ignored (unset it, or give a value)", var)
        elif value is not None:
            out[name] = (var, value)
    return out


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """A TOML config file as a dict; an unreadable or malformed file (not UTF-8 text
    included) is ``InvalidRequest``."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise InvalidRequest(f"cannot read config file {path}: {exc}") from exc


def load_config(
    toml_path: str | os.PathLike | None = None,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> StoreConfig:
    """Build a ``StoreConfig``: overrides > ``KVSTORE_*`` env > TOML file > defaults.

    Overrides equal to ``None`` are ignored so that unset CLI flags fall through. An
    unknown field (override or TOML key) is ``InvalidRequest``; so is a value that
    cannot be parsed, unless a higher source overrides it (then it is a logged warning,
    see ``merge_sources``).
    """
    return store_config_from(toml_path, env, overrides, lambda k: f"argument {k}=")


def store_config_from(
    toml_path: str | os.PathLike | None,
    env: Mapping[str, str] | None,
    overrides: Mapping[str, Any],
    override_source: Callable[[str], str],
) -> StoreConfig:
    """``load_config`` with the overrides' source named by ``override_source(field)`` in
    messages (the daemon's CLI says ``option --ec-k``)."""
    fields = {f.name: f for f in dataclasses.fields(StoreConfig)}
    from_file: dict[str, tuple[str, Any]] = {}
    if toml_path is not None:
        doc = read_toml(toml_path)
        if "store" in doc or "server" in doc:  # the daemon's form: [store] (and [server], not ours) only
            stray = sorted(set(doc) - {"store", "server"})
            if stray:
                raise InvalidRequest(f"{toml_path}: a file with [store]/[server] tables holds nothing else at the "
                                     f"top level; move {stray} into [store]")
            doc = doc.get("store", {})
        if not isinstance(doc, dict):
            raise InvalidRequest(f"{toml_path}: 'store' must be a [store] table, got {doc!r}")
        for k, v in doc.items():
            if k not in fields:
                raise InvalidRequest(f"unknown config field {k!r} in {toml_path}; known: {sorted(fields)}")
            from_file[k] = (f"{toml_path}", TomlValue(v))
    from_env = env_layer(os.environ if env is None else env, fields)
    given: dict[str, tuple[str, Any]] = {}
    for k, v in overrides.items():
        if k not in fields:
            raise InvalidRequest(f"unknown store option {k!r}; known: {sorted(fields)}")
        if v is not None:
            given[k] = (override_source(k), v)
    values = merge_sources([given, from_env, from_file],
                           lambda k, v, source: _coerce(k, fields[k].type, v, source))
    return StoreConfig(**values)
