"""Read-only views of an embedded store's index, for ``kvtool inspect``.

Two callers, one code path, so a data directory and a daemon print the same JSON:
``kvstore.cli.commands`` on a data directory (an ``EmbeddedStore`` opened by kvtool),
and the daemon's ``Inspect`` RPC (``kvstore.server.admin_rpc``) on its own store, which
``kvtool inspect grpc://...`` calls. The Parquet export likewise: ``iter_batches`` builds its
rows (columns: ``parquet_schema``) on a data directory, or in the daemon's ``ExportIndex``
(sent as ``ipc_pieces``, read back by the client with ``read_ipc``: ``kvstore.client.admin``),
and ``publish_parquet`` writes the file on kvtool's machine in both cases. Guarantees:

* Nothing here writes to the store: every view runs in LMDB *read* transactions,
  so it sees a consistent snapshot and never blocks a writer. No access time is
  refreshed (LRU order is unchanged) and no store counter moves. The one file
  written is the Parquet export, published atomically (see ``publish_parquet``);
  it replaces only a regular file, never a symlink, FIFO, device or socket.
* Nothing here reads fragment files (``kvtool verify`` does that): "degraded"
  means *placed on a target that is down now*, judged from the index alone.
* Namespaces are not stored (keys are opaque 16-byte prefix hashes), so the
  summary is by entry kind. Keys are the index's own (a daemon maps a tenant's
  keys into its namespace before calling here).

Record states (``EntryState``): ``live`` (in ``entries``; ``expired`` says
whether its TTL already passed and GC has not removed it yet, ``degraded``
whether a fragment sits on a target that is down), ``lost`` (in ``lost``: fewer
than k good fragments were seen; ``repair`` may restore it) and ``absent``. ``unknown``
is never computed here: ``kvstore.cli.commands`` shows it for a key of a sharded set that
no shard that answered holds while another shard did not answer (it may hold it).
"""

from __future__ import annotations

import contextlib
import enum
import os
import secrets
import stat
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from kvstore.api import EntryKind
from kvstore.errors import InternalError, InvalidRequest
from kvstore.embedded.fastread import frag_loc
from kvstore.embedded.index import Meta, ekey

if TYPE_CHECKING:
    import pyarrow as pa

    from kvstore.embedded.store import EmbeddedStore

PARQUET_BATCH_ROWS = 65536


class EntryState(enum.Enum):
    LIVE = "live"
    LOST = "lost"
    ABSENT = "absent"
    UNKNOWN = "unknown"  # a sharded set's shard did not answer (kvstore.cli.commands), never local


# index sub-database -> the state of the records it holds
STATE_OF_DB: dict[str, EntryState] = {"entries": EntryState.LIVE, "lost": EntryState.LOST}


@dataclass(frozen=True, slots=True)
class IndexRow:
    """One index record with the state its sub-database implies."""

    key: bytes
    kind: EntryKind
    state: EntryState
    meta: Meta


def iso(ns: int) -> str | None:
    """ISO-8601 UTC for an index time in ns (0 means none)."""
    if not ns:
        return None
    return datetime.fromtimestamp(ns / 1e9, tz=timezone.utc).isoformat(timespec="seconds")


ROWS_PER_TXN = 4096  # iter_rows: records read per read transaction


def iter_rows(store: "EmbeddedStore", rows_per_txn: int = ROWS_PER_TXN) -> Iterator[IndexRow]:
    """Every live and lost record (keys in LMDB order), read ``rows_per_txn`` at a time, each
    lot in a read transaction of its own that is closed before its rows are yielded. A slow
    consumer (a daemon's ``ExportIndex`` streaming to a slow client, a Parquet writer) so
    never holds one open, which would keep LMDB from reusing any page freed meanwhile: the
    map of a busy store would grow for as long as the walk lasted. The rows are therefore not
    one snapshot: each is a record as it was, but one put or removed during the walk may be
    there or not, and one marked lost during it may show in both states or in neither."""
    if rows_per_txn < 1:
        raise ValueError(f"iter_rows: rows_per_txn must be at least 1, got {rows_per_txn}")
    idx = store.index
    for db, state in STATE_OF_DB.items():
        after = None
        while True:
            with idx.env.begin() as txn:
                lot = []
                for ek, raw in idx.iter_db(txn, db, after):
                    lot.append((bytes(ek), idx.unpack(txn, raw)))
                    if len(lot) >= rows_per_txn:
                        break
            for ek, meta in lot:
                yield IndexRow(ek[1:], EntryKind.from_code(ek[0]), state, meta)
            if len(lot) < rows_per_txn:
                break
            after = lot[-1][0]


def targets_up(store: "EmbeddedStore") -> set[str]:
    return {name for name, t in store.targets.items() if t.is_up()}


@dataclass(slots=True)
class KindSummary:
    """Totals for one entry kind (mutable while being summed)."""

    entries: int = 0  # live records (expired ones included until GC removes them)
    lost: int = 0
    expired: int = 0
    degraded: int = 0  # live records with a fragment on a down or unknown target
    pinned: int = 0
    tokens: int = 0
    plain_bytes: int = 0
    stored_bytes: int = 0
    oldest_created_ns: int = 0
    newest_created_ns: int = 0
    oldest_access_ns: int = 0
    newest_access_ns: int = 0

    def add(self, row: IndexRow, now_ns: int, up: set[str]) -> None:
        m = row.meta
        self.stored_bytes += m.stored_bytes
        if row.state is EntryState.LOST:
            self.lost += 1
            return
        self.entries += 1
        self.expired += m.expired(now_ns)
        self.degraded += any(t not in up for t in m.targets)
        self.pinned += m.pinned
        self.tokens += m.tokens
        self.plain_bytes += m.plain_len
        for name, val, pick in (("oldest_created_ns", m.created_ns, min), ("newest_created_ns", m.created_ns, max),
                                ("oldest_access_ns", m.access_ns, min), ("newest_access_ns", m.access_ns, max)):
            cur = getattr(self, name)
            setattr(self, name, val if not cur else pick(cur, val))

    def as_dict(self) -> dict:
        out = {k: getattr(self, k) for k in self.__slots__ if not k.endswith("_ns")}
        for k in ("oldest_created_ns", "newest_created_ns", "oldest_access_ns", "newest_access_ns"):
            out[k.removesuffix("_ns")] = iso(getattr(self, k))
        return out


def summarize(store: "EmbeddedStore") -> dict:
    """Totals by kind and overall, capacity, age range, degraded and lost counts."""
    now = store.now_ns()
    up = targets_up(store)
    kinds: dict[str, KindSummary] = {k.value: KindSummary() for k in EntryKind}
    for row in iter_rows(store):
        kinds[row.kind.value].add(row, now, up)
    total = KindSummary()
    for s in kinds.values():
        for name in ("entries", "lost", "expired", "degraded", "pinned", "tokens", "plain_bytes", "stored_bytes"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        for name, pick in (("oldest_created_ns", min), ("newest_created_ns", max),
                           ("oldest_access_ns", min), ("newest_access_ns", max)):
            vals = [v for v in (getattr(total, name), getattr(s, name)) if v]
            setattr(total, name, pick(vals) if vals else 0)
    cap = store.config.capacity_bytes
    used = store.used_bytes()
    with store.index.env.begin() as txn:
        dead = store.index.counter(txn, "pack_dead_bytes")
    return {
        "data_dir": str(store.data_dir),
        "erasure_code": f"{store.config.ec_type} {store.config.ec_k}+{store.config.ec_m}",  # as stats says it
        "by_kind": {k: s.as_dict() for k, s in kinds.items()},
        "total": total.as_dict(),
        "used_bytes": used,
        "pack_dead_bytes": dead,
        "capacity_bytes": cap,
        "capacity_used": (used / cap) if cap else None,
        "targets": [{"name": n, "up": n in up} for n in store.targets],
        "namespace_note": "keys are opaque prefix hashes; the index stores no namespace, so totals are by kind",
    }


def row_dict(row: IndexRow, now_ns: int, up: set[str]) -> dict:
    m = row.meta
    return {
        "key": row.key.hex(), "kind": row.kind.value, "state": row.state.value,
        "expired": m.expired(now_ns),
        # as KindSummary counts it: a live record with a fragment on a down (or unknown) target
        "degraded": row.state is EntryState.LIVE and any(t not in up for t in m.targets),
        "tokens": m.tokens, "plain_bytes": m.plain_len, "entry_bytes": m.entry_len,
        "fragment_bytes": m.frag_len, "stored_bytes": m.stored_bytes, "ec": f"{m.k}+{m.m}",
        "created": iso(m.created_ns), "last_access": iso(m.access_ns), "expires": iso(m.expires_ns),
        "pinned": m.pinned,
        "targets": [{"fragment": i, "target": t, "up": t in up, "file": rel, "offset": off}
                    for i, (t, (rel, off)) in enumerate(zip(m.targets, _locations(row)))],
    }


def _locations(row: IndexRow) -> list[tuple[str, int | None]]:
    """Per fragment: its file under the target root, and its offset there (``None``: the whole
    file; else a batch's pack file)."""
    ek = ekey(row.kind.code, row.key)
    return [frag_loc(ek, row.meta, i) for i in range(len(row.meta.targets))]


def find(store: "EmbeddedStore", key: bytes, kind: EntryKind) -> IndexRow | None:
    """The live or lost record of ``(kind, key)``, or ``None``."""
    idx = store.index
    ek = ekey(kind.code, key)
    with idx.env.begin() as txn:
        for db, state in STATE_OF_DB.items():
            raw = txn.get(ek, db=idx.db[db])
            if raw is not None:
                return IndexRow(key, kind, state, idx.unpack(txn, raw))
    return None


def absent_dict(key: bytes, kind: EntryKind) -> dict:
    """The view of a key with no record of ``kind``."""
    return {"key": key.hex(), "kind": kind.value, "state": EntryState.ABSENT.value}


def entry_view(store: "EmbeddedStore", key: bytes, kind: EntryKind) -> dict:
    """One record's view (``row_dict``), or ``absent_dict``."""
    return entry_views(store, [key], kind)[0]


# What a tenant that is not an admin does not see of its own entries through the daemon's
# Inspect: where the fragments are (target names, which may spell URLs, and file names) and
# whether its targets are up. They describe the deployment, not the tenant's data.
PLACEMENT_FIELDS = ("targets", "degraded")


def entry_views(store: "EmbeddedStore", keys: Sequence[bytes], kind: EntryKind, *,
                placement: bool = True) -> list[dict]:
    """``entry_view`` of each key, in order: one clock reading and one look at the targets;
    ``placement=False`` leaves out ``PLACEMENT_FIELDS`` (and asks no target anything)."""
    now = store.now_ns()
    up = targets_up(store) if placement else set()
    out = []
    for key in keys:
        row = find(store, key, kind)
        view = absent_dict(key, kind) if row is None else row_dict(row, now, up)
        if not placement:
            for field in PLACEMENT_FIELDS:
                view.pop(field, None)
        out.append(view)
    return out


def chain_view(store: "EmbeddedStore", chain: Sequence[bytes]) -> list[dict]:
    """Per position of the chain: the state of its block and of its SWA snapshot."""
    now = store.now_ns()
    out = []
    for i, key in enumerate(chain):
        pos = {"position": i, "key": key.hex()}
        for kind in EntryKind:
            row = find(store, key, kind)
            state = EntryState.ABSENT.value if row is None else row.state.value
            if row is not None and row.state is EntryState.LIVE and row.meta.expired(now):
                state = "expired"
            pos[kind.value] = state
        out.append(pos)
    return out


def export_parquet(store: "EmbeddedStore", path: str, batch_rows: int = PARQUET_BATCH_ROWS) -> int:
    """Write the whole index (live and lost) to a Parquet file; returns the row count.

    The rows of ``iter_batches`` (columns: ``parquet_schema``), written and published by
    ``publish_parquet`` (its path checks, atomic publication and errors). Written in row
    groups of ``batch_rows``, so memory stays bounded.
    """
    return publish_parquet(path, iter_batches(store, batch_rows))


def publish_parquet(path: str, batches: Iterable["pa.RecordBatch"]) -> int:
    """Write ``batches`` (of ``parquet_schema``; each one row group) to the Parquet file
    ``path``; returns the row count. The one writer of an index export: a data directory's
    (``export_parquet``) and a daemon's (``RemoteStore.export_index_batches``, rows computed
    there by ``iter_batches``), so both files are the same. ``batches`` is iterated only once
    ``path`` passed its checks; an error it raises (a daemon's, a store's) removes the
    temporary as a failed write does and is raised as it is.

    Atomic publish: the rows go to a temporary file beside ``path`` (the same
    directory, so the rename never crosses a filesystem), which is fsynced and
    then renamed over ``path`` only once complete. On any failure the temporary
    is removed and an earlier file at ``path`` is left exactly as it was.

    Only a new path or an existing regular file is replaced: the rename would put
    a regular file in place of a symlink (not its target), a FIFO or a device node
    (``/dev/null`` as root), so those are refused, checked with ``lstat`` before
    writing and again just before the rename.

    Raises ``InvalidRequest`` for an empty ``path``, one that names a directory
    or an existing file that is not a regular file, and ``OSError`` (naming
    ``path``) when the file cannot be written (e.g. "File too large", a full disk).
    """
    if not path:
        raise InvalidRequest("the Parquet export needs a file name; give --parquet FILE")
    if path.endswith(("/", os.sep)):  # Path() would drop the slash and name the file before it
        raise InvalidRequest(f"--parquet {path!r} names a directory; give a file name")
    dest = Path(path)
    _refuse_special(dest, path)
    tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(6)}.tmp")
    try:
        # O_EXCL: never clobber someone else's file; mode 0o666 & ~umask, as a plain create would give.
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    except OSError as exc:
        raise OSError(f"cannot write Parquet file {path}: {exc.strerror or exc}") from exc
    try:
        n = _write_batches(str(tmp), batches)
        with open(tmp, "rb") as f:  # durable before it is published: a crash never leaves a torn FILE
            os.fsync(f.fileno())
        _refuse_special(dest, path)  # again: the export may take long, and DEST may have been replaced meanwhile
        os.replace(tmp, dest)
    except BaseException as exc:
        close = getattr(batches, "close", None)
        if close is not None:  # a generator: ends its store's transaction or its daemon's call now
            close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise OSError(f"cannot write Parquet file {path} ({exc}); "
                          f"any earlier {dest.name} is left unchanged") from exc
        raise
    _fsync_dir(dest.parent)
    return n


# st_mode file type -> its name in the refusal (a regular file is the one type replaced)
_FILE_TYPES: tuple[tuple[Callable[[int], bool], str], ...] = (
    (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _refuse_special(dest: Path, path: str) -> None:
    """``InvalidRequest`` (naming ``path``, as the user spelt it) unless ``dest`` is absent or
    a regular file (``lstat``: a symlink is judged itself, not its target). A path that cannot
    be examined is left for the write to report."""
    try:
        mode = os.lstat(dest).st_mode
    except OSError:
        return
    if stat.S_ISDIR(mode):
        raise InvalidRequest(f"{path} is a directory; give --parquet a file name")
    if not stat.S_ISREG(mode):
        what = next((name for test, name in _FILE_TYPES if test(mode)), "not a regular file")
        raise InvalidRequest(f"{path} is {what}; --parquet replaces only a regular file: give a new path "
                             "or a regular file")


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every filesystem allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def parquet_schema() -> "pa.Schema":
    """The columns of an index export, local or through a daemon: key (hex), kind, state,
    tokens, plain/entry/fragment/stored bytes, k, m, created, last_access, expires (UTC
    timestamps, null when none), pinned, targets (target names, fragment i at position i)."""
    import pyarrow as pa

    ts = pa.timestamp("us", tz="UTC")  # microseconds: what datetime (and most readers) hold
    return pa.schema([
        ("key", pa.string()), ("kind", pa.string()), ("state", pa.string()), ("tokens", pa.int64()),
        ("plain_bytes", pa.int64()), ("entry_bytes", pa.int64()), ("fragment_bytes", pa.int64()),
        ("stored_bytes", pa.int64()), ("k", pa.int16()), ("m", pa.int16()), ("created", ts),
        ("last_access", ts), ("expires", ts), ("pinned", pa.bool_()), ("targets", pa.list_(pa.string())),
    ])


def iter_batches(store: "EmbeddedStore", batch_rows: int = PARQUET_BATCH_ROWS) -> Iterator["pa.RecordBatch"]:
    """Every live and lost record (``iter_rows``: short read transactions, none held while a
    batch waits to be taken) as record batches of ``parquet_schema``, ``batch_rows`` rows at most."""
    import pyarrow as pa

    schema = parquet_schema()
    cols: dict[str, list] = {f.name: [] for f in schema}

    def batch() -> "pa.RecordBatch":
        out = pa.record_batch([pa.array(v, type=schema.field(k).type) for k, v in cols.items()], schema=schema)
        for v in cols.values():
            v.clear()
        return out

    for row in iter_rows(store):
        m = row.meta
        for name, val in (("key", row.key.hex()), ("kind", row.kind.value), ("state", row.state.value),
                          ("tokens", m.tokens), ("plain_bytes", m.plain_len), ("entry_bytes", m.entry_len),
                          ("fragment_bytes", m.frag_len), ("stored_bytes", m.stored_bytes), ("k", m.k),
                          ("m", m.m), ("created", m.created_ns // 1000),
                          ("last_access", m.access_ns // 1000), ("expires", m.expires_ns // 1000 or None),
                          ("pinned", m.pinned),
                          ("targets", list(m.targets))):
            cols[name].append(val)
        if len(cols["key"]) >= batch_rows:
            yield batch()
    if cols["key"]:
        yield batch()


def _write_batches(path: str, batches: Iterable["pa.RecordBatch"]) -> int:
    """``publish_parquet``'s writer: ``batches`` into the (temporary) file ``path``, one row
    group each (an empty export is a file of the schema and no rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = parquet_schema()
    n = 0
    with pq.ParquetWriter(path, schema) as writer:
        for b in batches:
            if b.num_rows:
                writer.write_table(pa.Table.from_batches([b], schema=schema))
                n += b.num_rows
    return n


# ----------------------------------------------------------------------------- through a daemon
def ipc_pieces(batch: "pa.RecordBatch", limit: int) -> Iterator[tuple[bytes, int]]:
    """``batch`` as Arrow IPC streams (schema and one batch each) of at most about ``limit``
    bytes, with their row counts: split in halves until each fits (one row always goes).
    What the daemon's ``ExportIndex`` sends; ``read_ipc`` reads them."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as w:
        w.write_batch(batch)
    data = sink.getvalue().to_pybytes()
    if len(data) <= limit or batch.num_rows <= 1:
        yield data, batch.num_rows
        return
    half = batch.num_rows // 2
    yield from ipc_pieces(batch.slice(0, half), limit)
    yield from ipc_pieces(batch.slice(half), limit)


def read_ipc(data: bytes, rows: int) -> list["pa.RecordBatch"]:
    """The batches of one ``ipc_pieces`` stream; ``InternalError`` unless they are ``rows``
    rows of ``parquet_schema`` (a daemon of another version, or a kvstore bug)."""
    import pyarrow as pa

    try:
        reader = pa.ipc.open_stream(data)
        batches = list(reader)
    except (pa.ArrowInvalid, OSError) as exc:
        raise InternalError(f"ExportIndex sent a chunk that is not Arrow IPC ({exc})") from exc
    schema = parquet_schema()
    if not reader.schema.equals(schema):
        raise InternalError(f"ExportIndex sent columns {reader.schema.names} of other types than the export's "
                            f"{schema.names} (a daemon of another kvstore version?)")
    if sum(b.num_rows for b in batches) != rows:
        raise InternalError(f"ExportIndex sent a chunk of {sum(b.num_rows for b in batches)} rows that says "
                            f"{rows} (a kvstore bug)")
    return batches
