"""The one store API: typed records and the ``KVStore`` protocol.

Every implementation (the embedded store in ``kvstore.embedded.store``, the gRPC client
of the daemon, the sharded client) satisfies ``KVStore``; the entrypoint, the
engine plugin, ``kvtool`` and the tests are written against this protocol,
never against one implementation.

Semantics every implementation guarantees
-----------------------------------------
* Identity of an entry is ``(kind, key)``: a block entry and an SWA entry may
  share the same 16-byte block hash (the SWA snapshot *at* that block's end).
* ``put`` of a live ``(kind, key)`` stores no second copy; it refreshes the
  entry's access time and returns ``False``. A new entry returns ``True``
  once all fragments are durable and the index committed: an acknowledged put
  survives a crash.
* ``get`` never returns bytes that failed a checksum. It raises ``NotFound``
  for an absent entry and ``Unrecoverable`` when fewer than k fragments are
  good (the entry is then marked lost and ``lookup`` stops matching it).
* ``get_many`` is the batched read: a missing or unrecoverable entry is a
  shortfall, returned as ``None`` in its slot (it is logged and counted).
* ``lookup`` has one side effect: none. It does not refresh access times (a
  lookup is not a use; the load that follows is).

Reading into caller buffers (optional method, and a helper that always works)
-----------------------------------------------------------------------------
``get_many_into(keys, outs, *, kind)`` is the zero-staging batched read: the
payload of ``keys[i]`` lands in the caller's writable buffer ``outs[i]`` (for
instance the numpy view of a pinned host tensor, ``tensor.numpy()``), so a
caller that would copy ``get_many``'s bytes into its own buffer anyway saves
that copy. It is optional: a store that has it satisfies ``ReadsInto``; every
caller goes through ``read_into(store, keys, outs, kind=...)``, which uses the
method when present and otherwise ``get_many`` plus one copy, so remote and
sharded stores work unchanged. Guarantees of both:

1. Slot ``i`` of the result is an ``EntryInfo`` only once the entry checksum
   was verified over ``outs[i][:nbytes]`` itself (the destination, not a
   staging copy; the fallback copies bytes ``get_many`` verified); it is
   ``None`` for a missing or unrecoverable entry, exactly where ``get_many``
   gives ``None``. The contents of ``outs[i]`` are undefined in a ``None``
   slot and past ``nbytes`` (a failed attempt may have written there).
2. ``outs[i]`` must be writable, C-contiguous and hold at least the entry's
   plain size; a shorter one raises ``InvalidRequest`` (caller misuse: size
   buffers from the layout). The store checks sizes against its index before
   reading anything; the fallback can only check after ``get_many``, so the
   contents of all ``outs`` are undefined after that error.
3. ``len(outs) == len(keys)``, and no two ``outs`` may overlap.
"""

from __future__ import annotations

import enum
import operator
from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from kvstore.errors import InvalidRequest


class EntryKind(enum.Enum):
    """Kinds of entries. The value is the public name; ``code`` is the on-disk byte."""

    BLOCK = "block"  # one block's global KV
    SWA = "swa"  # a sliding-window snapshot at a block boundary

    @property
    def code(self) -> int:
        return _KIND_CODES[self._value_]  # by value: a str hashes in C, an enum member in Python

    @staticmethod
    def codes() -> frozenset[int]:
        """Every kind's on-disk byte."""
        return frozenset(_KIND_CODES.values())

    @classmethod
    def parse(cls, kind: "str | EntryKind") -> "EntryKind":
        if isinstance(kind, EntryKind):
            return kind
        found = _KINDS_BY_VALUE.get(kind) if isinstance(kind, str) else None
        if found is not None:  # every read names its kind: a dict lookup, not the enum's call
            return found
        try:
            return cls(kind)
        except ValueError:
            raise InvalidRequest(
                f"unknown entry kind {kind!r}; use one of {[k.value for k in cls]}"
            ) from None

    @classmethod
    def from_code(cls, code: int) -> "EntryKind":
        try:
            return _KINDS_BY_CODE[code]
        except KeyError:
            raise InvalidRequest(f"unknown entry kind code {code}") from None


_KIND_CODES = {EntryKind.BLOCK.value: 1, EntryKind.SWA.value: 2}  # by the kind's value
_KINDS_BY_VALUE = {k.value: k for k in EntryKind}
_KINDS_BY_CODE = {c: _KINDS_BY_VALUE[v] for v, c in _KIND_CODES.items()}

# dtype name -> itemsize. A registry, not a chain of ifs: add a row to support a dtype.
# Names follow torch/numpy spelling; fp8/fp4 payloads travel as their storage bytes.
DTYPES: dict[str, int] = {
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float16": 2,
    "bfloat16": 2,
    "int16": 2,
    "float32": 4,
    "int32": 4,
    "int64": 8,
    "float64": 8,
}
_DTYPE_CODES = {name: i + 1 for i, name in enumerate(DTYPES)}
_DTYPES_BY_CODE = {v: k for k, v in _DTYPE_CODES.items()}


@dataclass(frozen=True, slots=True)
class Layout:
    """What the payload bytes are: a dtype name from ``DTYPES`` and a shape.

    Invariant: ``nbytes == prod(shape) * itemsize``; ``validate`` checks it
    against the payload so that an entry never claims a layout it does not have.
    """

    dtype: str = "uint8"
    shape: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if type(self.shape) is tuple and all(type(d) is int for d in self.shape):
            return
        # A list (JSON, a caller), numpy or torch sizes: stored as the tuple of ints they mean.
        try:
            if isinstance(self.shape, (str, bytes)) or any(isinstance(d, bool) for d in self.shape):
                raise TypeError
            object.__setattr__(self, "shape", tuple(operator.index(d) for d in self.shape))
        except TypeError:
            raise InvalidRequest(f"a layout shape is a tuple of ints, got {self.shape!r}") from None

    @property
    def dtype_code(self) -> int:
        try:
            return _DTYPE_CODES[self.dtype]
        except KeyError:
            raise InvalidRequest(
                f"unknown layout dtype {self.dtype!r}; known dtypes: {sorted(DTYPES)}"
            ) from None

    @classmethod
    def from_code(cls, code: int, shape: tuple[int, ...]) -> "Layout":
        try:
            return cls(_DTYPES_BY_CODE[code], tuple(shape))
        except KeyError:
            raise InvalidRequest(f"unknown layout dtype code {code}") from None

    @property
    def nbytes(self) -> int:
        n = DTYPES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def validate(self, payload_len: int) -> None:
        self.dtype_code  # raises on an unknown dtype
        # Dims cross the wire as int64 and are stored as u64: each one an integer in [0, 2**63).
        try:
            dims = [operator.index(d) for d in self.shape]
        except TypeError:
            dims = [-1]
        if len(dims) > 8 or not all(0 <= d < 2**63 for d in dims):
            raise InvalidRequest(f"bad layout shape {self.shape}: at most 8 dims, each an integer in [0, 2**63)")
        if self.nbytes != payload_len:
            raise InvalidRequest(
                f"layout {self.dtype}{list(self.shape)} describes {self.nbytes} bytes "
                f"but the value has {payload_len}"
            )

    @classmethod
    def for_bytes(cls, n: int) -> "Layout":
        return cls("uint8", (n,))


def as_payload(value: Any, layout: Layout | None) -> tuple[memoryview, Layout]:
    """A put value as contiguous bytes plus its layout (bytes-like: ``uint8[n]``; numpy: its own).

    Every store implementation normalises values through this, so they accept the same
    values and raise the same ``InvalidRequest`` for the rest."""
    if isinstance(value, np.ndarray):
        arr = np.ascontiguousarray(value)
        lay = layout or Layout(str(arr.dtype), tuple(arr.shape))
        mv = memoryview(arr).cast("B") if arr.size else memoryview(b"")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        mv = memoryview(value).cast("B")
        lay = layout or Layout.for_bytes(len(mv))
    else:
        raise InvalidRequest(
            f"a value must be bytes-like or a numpy array, got {type(value).__name__}"
        )
    lay.validate(len(mv))
    return mv, lay


@dataclass(frozen=True, slots=True)
class Entry:
    """A decoded entry: verified plain bytes plus the header that describes them."""

    key: bytes
    kind: EntryKind
    layout: Layout
    tokens: int
    data: bytes

    def array(self) -> np.ndarray:
        """The payload as a numpy array (bfloat16/fp8 come back as raw same-width ints)."""
        np_dtype = {
            "bfloat16": np.uint16,
            "float8_e4m3fn": np.uint8,
            "float8_e5m2": np.uint8,
        }.get(self.layout.dtype, self.layout.dtype)
        return np.frombuffer(self.data, dtype=np_dtype).reshape(self.layout.shape)


@dataclass(frozen=True, slots=True)
class PutItem:
    """One entry of a batched put."""

    key: bytes
    value: Any  # bytes-like or numpy array
    kind: str | EntryKind = "block"
    ttl_s: float | None = None
    layout: Layout | None = None
    tokens: int = 0


def check_put_item(it: Any) -> PutItem:
    """``it`` when it is a ``PutItem``, else ``InvalidRequest``."""
    if not isinstance(it, PutItem):
        raise InvalidRequest(f"put_many takes kvstore.PutItem(key, value, ...) items, got {type(it).__name__}")
    return it


MAX_TOKENS = 2**32  # an entry's token count is stored as u32


def check_put_fields(ttl_s: Any, tokens: Any, max_ttl_s: float) -> None:
    """A put's ``ttl_s`` (``None``, or a real number in ``(0, max_ttl_s]``; not a bool) and
    ``tokens`` (an int in ``[0, 2**32)``; not a bool), else ``InvalidRequest``. Every store
    and client checks a put with this before anything is written or sent."""
    if ttl_s is not None and (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float))
                              or not 0 < ttl_s <= max_ttl_s):  # and NaN
        raise InvalidRequest(f"ttl_s must be in (0, {max_ttl_s:.0f}] seconds (a number, or None for the "
                             f"default), got {ttl_s!r}")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or not 0 <= tokens < MAX_TOKENS:
        raise InvalidRequest(f"tokens must be an int in [0, 2**32), got {tokens!r}")


def check_put_items(items: Any) -> list[PutItem]:
    """``put_many``'s argument as a list of ``PutItem`` (any iterable of them), else
    ``InvalidRequest``: every store checks it so before doing anything."""
    if isinstance(items, (PutItem, str, bytes, bytearray, memoryview)) or items is None:
        raise InvalidRequest(f"put_many takes a list of kvstore.PutItem, got {type(items).__name__}")
    try:
        out = list(items)
    except TypeError:
        raise InvalidRequest(f"put_many takes a list of kvstore.PutItem, got {type(items).__name__}") from None
    for it in out:
        check_put_item(it)
    return out


@dataclass(frozen=True, slots=True)
class LookupResult:
    """Longest cached prefix of a chain of block keys.

    ``hit_blocks``: how many leading keys of the chain have a live block entry
    (0 means a miss). ``swa_at``: the largest ``n <= hit_blocks`` such that an
    SWA snapshot exists at the end of block ``n - 1``, or ``None``. The snapshot
    is *at the hit boundary* exactly when ``swa_at == hit_blocks``.
    """

    hit_blocks: int
    swa_at: int | None = None

    @property
    def swa_at_boundary(self) -> bool:
        return self.swa_at is not None and self.swa_at == self.hit_blocks


def check_chain_ends(ends: Any, n_keys: int, *, until_miss: bool = False) -> list[int] | None:
    """A probe's ``chain_ends`` (``Index.probe``): ``None``, or non-decreasing ends within
    ``[0, n_keys]`` whose last is ``n_keys`` (share j is ``keys[ends[j-1]:ends[j]]``; an
    empty share is allowed). ``InvalidRequest`` otherwise, or with ``until_miss`` (one
    chain) as well."""
    if ends is None:
        return None
    if until_miss:
        raise InvalidRequest("probe takes until_miss (one chain) or chain_ends (several), not both")
    try:
        out = [operator.index(e) for e in ends]
    except TypeError:
        raise InvalidRequest("chain_ends must be a sequence of integers") from None
    if (out[-1:] or [0]) != [n_keys] or any(b < a for a, b in zip([0] + out, out)):
        raise InvalidRequest(f"chain_ends must rise from 0 to the number of keys ({n_keys}) and end on it, "
                             f"got {out[:8]}{'...' if len(out) > 8 else ''}")
    return out


@runtime_checkable
class KVStore(Protocol):
    """The store protocol. See the module docstring for the guarantees."""

    def put(self, key: bytes, value: Any, *, kind: str = "block", ttl_s: float | None = None,
            layout: Layout | None = None, tokens: int = 0) -> bool: ...

    def get(self, key: bytes, *, kind: str = "block") -> bytes: ...

    def get_entry(self, key: bytes, *, kind: str = "block") -> Entry: ...

    def delete(self, key: bytes, *, kind: str = "block") -> bool: ...

    def put_many(self, items: Sequence[PutItem]) -> list[bool]: ...

    def get_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bytes | None]: ...

    def lookup(self, keys: Sequence[bytes]) -> LookupResult: ...

    def lookup_many(self, chains: Sequence[Sequence[bytes]]) -> list[LookupResult]: ...

    def pin(self, key: bytes, *, kind: str = "block") -> bool: ...

    def unpin(self, key: bytes, *, kind: str = "block") -> bool: ...

    def stats(self) -> dict: ...

    def gc(self, *, dry_run: bool = False) -> dict: ...

    def check(self, fix: bool = False) -> list: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------- reads into caller buffers


@dataclass(frozen=True, slots=True)
class EntryInfo:
    """What ``get_many_into`` landed in a caller buffer: the header of a verified entry.

    ``nbytes`` is the payload length written at the start of the buffer. ``layout``
    and ``tokens`` are ``None`` when the read went through the ``get_many`` fallback
    of ``read_into`` (a plain batched get does not carry headers).
    """

    key: bytes
    kind: EntryKind
    nbytes: int
    layout: Layout | None = None
    tokens: int | None = None


@runtime_checkable
class ReadsInto(Protocol):
    """A store that reads verified payloads straight into caller buffers (module docstring)."""

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *,
                      kind: str = "block") -> list[EntryInfo | None]: ...


def writable_view(out: Any, what: str = "out") -> memoryview:
    """``out`` as a flat writable byte view; misuse (read-only, strided) raises ``InvalidRequest``."""
    try:
        mv = memoryview(out)
    except TypeError as exc:
        raise InvalidRequest(
            f"{what} must support the buffer protocol (a bytearray, a numpy array, "
            f"tensor.numpy()), got {type(out).__name__}"
        ) from exc
    if mv.readonly:
        raise InvalidRequest(f"{what} is read-only; pass a writable buffer")
    if not mv.c_contiguous:
        raise InvalidRequest(f"{what} is not C-contiguous; pass a contiguous buffer")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def read_into(store: Any, keys: Sequence[bytes], outs: Sequence[Any], *,
              kind: str = "block") -> list[EntryInfo | None]:
    """Batched read into caller buffers through any ``KVStore`` (see the module docstring).

    Uses ``store.get_many_into`` when the store has it; otherwise ``get_many`` and one
    copy per entry into ``outs[i]``.
    """
    if len(outs) != len(keys):
        raise InvalidRequest(f"read_into: {len(keys)} keys but {len(outs)} output buffers")
    if isinstance(store, ReadsInto):
        return store.get_many_into(keys, outs, kind=kind)
    k = EntryKind.parse(kind)
    views = [writable_view(o, f"outs[{i}]") for i, o in enumerate(outs)]
    datas = store.get_many(keys, kind=k.value)
    result: list[EntryInfo | None] = []
    for i, (key, data, mv) in enumerate(zip(keys, datas, views)):
        if data is None:
            result.append(None)
            continue
        n = len(data)
        if n > len(mv):
            raise InvalidRequest(
                f"outs[{i}] holds {len(mv)} bytes but the {k.value} entry {bytes(key).hex()} has {n}; "
                "size the buffers from the entry layout"
            )
        mv[:n] = memoryview(data).cast("B")
        result.append(EntryInfo(bytes(key), k, n))
    return result
