"""``RemoteStore``: the ``KVStore`` protocol over gRPC, talking to one ``kvstore serve`` daemon.

``kvstore.connect("grpc://127.0.0.1:7070")`` returns one (``grpcs://`` for TLS);
a comma-separated list of URLs returns a ``kvstore.client.sharded.ShardedStore``
(``kvstore.client.connect.open_grpc`` decides).

How it is built: one ``kvstore.client.transport.Transport`` (the channel, the stub, each
call's deadline and token, error mapping, batches in pieces) that every part makes its
calls through, handed to each explicitly: ``kvstore.client.puts`` (``put``, ``put_many``),
``kvstore.client.lookups`` (``lookup``, ``lookup_many``, ``probe``), ``kvstore.client.admin``
(maintenance, inspect, the index export) and the direct paths. Reads, deletes and pins are
here. TLS and options: ``kvstore.client.options`` (the URL scheme decides TLS).

Guarantees (same as the embedded store, see ``kvstore.api``):
  * Every method has the embedded store's semantics and raises the same
    ``kvstore.errors`` classes: the daemon sends the error's ``code`` in the
    trailing metadata and ``kvstore.wire.error_from_rpc`` rebuilds it.
  * Misuse that the embedded store rejects before touching data (a key that
    is not 16 bytes, an unknown kind, a value that is not bytes-like) is
    rejected here too, before anything is sent.
  * A daemon that is down, restarting or too slow (``timeout_s``) raises
    ``StoreUnavailable``; the channel reconnects by itself (gRPC's backoff, capped
    at 1 s here), so a call made more than about a second after the daemon is back
    succeeds. One made sooner may still raise ``StoreUnavailable`` ("Connection
    refused": the channel waits out its backoff and fails fast meanwhile, rather than
    delay every call to a daemon that is really down); retry it after a short wait.
  * Oversized messages raise ``RequestTooLarge`` (an ``InvalidRequest``)
    naming the limit, never a silent failure: both ends use
    ``max_message_bytes``.

Batches travel as streams (``GetStream``, ``PutStream``; see kvstore.proto):
one message per value, so a batch is never one multi-MiB message, and values
are hand-encoded (``kvstore.wire``: one copy, not protobuf's two). A ``put_many``
(or one of its pieces, below) whose encoded items add up to more than
``max_message_bytes`` (with direct writes: any one item) raises ``RequestTooLarge``
before anything is sent. With direct writes a piece that goes through gRPC after all
is sent in messages that fit.

Direct reads (``kvstore.client.direct_reads``; opt-in, ``direct_reads="on"`` or ``"auto"``): ``get``,
``get_entry``, ``get_many`` and ``get_many_into`` ask the daemon where an entry's
fragments are (``Locate``) and read and verify them from the shared targets in this
process; a key whose direct read fails in any way is read through the daemon as
without the option, so results and errors are the same. Requires read access to the
targets' files (see the security note there).

Direct writes (``kvstore.client.direct_writes``; opt-in, ``direct_writes="on"`` or ``"auto"``, and
the daemon's ``allow_direct_writes``): ``put`` and ``put_many`` encode and write pack files
into the shared targets in this process and ask the daemon only to index them (``Commit``);
the results and errors are those of a put over gRPC. Requires write access to the targets.

Batches larger than ``max_batch_items`` (the daemon's per-call limit, 4096 by
default) are validated whole, then sent as consecutive pieces of at most that
many items, results concatenated in order, as ``lookup`` and ``probe`` do for
long chains. Such a batch is not one unit on the daemon: see ``put_many``. The
daemon's own limit is learned, not configured twice: a daemon refuses a batch over
its ``max_batch_items`` with ``BatchTooLarge`` carrying that limit, before any store
work, and the client lowers its piece size to it for good and resends
(``kvstore.client.transport``): the first over-limit batch costs one refused call,
every later one none. ``max_batch_items`` given to ``connect`` stays an upper bound.
``lookup_many`` counts chains and keys in all chains against the limit, as the daemon does.

Bad input stores nothing, also across pieces: a ``put_many`` that spans more than one
piece (or, through ``ShardedStore``, more than one daemon) checks every value against the
daemon's ``max_value_bytes`` before the first piece is sent, raising the embedded store's
``InvalidRequest`` (``kvstore.client.puts``). ``get_many_into`` likewise checks every
buffer (writable, contiguous, large enough) first.

Closing: a call racing ``close`` on another thread, and any call after it, raises
``StoreClosed``, never gRPC's own errors nor those of the direct paths' stopped workers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from kvstore.api import (Entry, EntryInfo, EntryKind, Layout, LookupResult, PutItem, check_chain_ends,
                         check_put_items, writable_view)
from kvstore.client.admin import Admin
from kvstore.client.direct_reads import DirectReads, StagedInto, check_into_sizes, copy_into
from kvstore.client.direct_writes import DirectWrites
from kvstore.client.lookups import Lookups
from kvstore.client.options import ClientOptions
from kvstore.client.puts import Puts
from kvstore.client.transport import Transport
from kvstore.errors import InvalidRequest
from kvstore.keys import check_key, check_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import MD_INDEX_KEYS, EncodedPut, encode_item, layout_from_pb

if TYPE_CHECKING:
    import pyarrow as pa

# The single-key and batch calls of each key operation: ``change_checked``, ``change_many_checked``.
KEY_CALLS: dict[str, tuple[str, str]] = {"delete": ("Delete", "DeleteMany"), "pin": ("Pin", "PinMany"),
                                         "unpin": ("Unpin", "UnpinMany")}


class RemoteStore:
    """``kvstore.api.KVStore`` over gRPC to the daemon at ``url``. Thread-safe (one channel, shared).

    ``url``'s scheme decides TLS (module docstring): ``InvalidRequest`` before any channel
    is opened for TLS options with a ``grpc://`` URL (unless ``options.grpcs_in_set``).

    Typed entry points: each public method checks its arguments once (the boundary: the
    errors of the embedded store, in its order) and hands them on checked and typed (keys
    ``bytes``, kinds ``EntryKind``, puts encoded as ``kvstore.wire.EncodedPut``) to a
    ``*_checked`` method, or to ``stage_into``/``finish_into``. ``ShardedStore``, which checks
    a call at its own boundary, calls those for its shards, so nothing is checked or encoded
    twice. They are not part of the ``KVStore`` protocol and do not check their arguments:
    for callers inside ``kvstore.client`` only.
    """

    def __init__(self, url: str, options: ClientOptions | None = None):
        self.url = url
        self.options = o = options or ClientOptions()
        self._rpc = Transport(url, o)
        self.address = self._rpc.address
        # Direct reads (kvstore.client.direct_reads): None when off; the daemon is first asked on the first read.
        self._direct = DirectReads(o.direct_reads, self._rpc.call, url) if o.direct_reads != "off" else None
        # Direct writes (kvstore.client.direct_writes): None when off; the daemon is first asked on the first put.
        self._direct_w = (DirectWrites(o.direct_writes, self._rpc.call, url, max_items=o.max_batch_items)
                          if o.direct_writes != "off" else None)
        self._puts = Puts(self._rpc, self._direct_w)
        self._lookups = Lookups(self._rpc)
        self._admin = Admin(self._rpc)

    # ------------------------------------------------------------------ writes
    def put(self, key: bytes, value: Any, *, kind: str = "block", ttl_s: float | None = None,
            layout: Layout | None = None, tokens: int = 0) -> bool:
        self._rpc.check_open()  # first, as the embedded store, whatever the item
        return self._puts.put(encode_item(PutItem(key, value, kind, ttl_s, layout, tokens)))

    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        """``kvstore.api``'s batched put (``kvstore.client.puts.Puts.put_many``: in pieces, not one
        unit). Every item is validated and encoded before anything is sent."""
        self._rpc.check_open()
        items = check_put_items(items)
        return self._puts.put_many([encode_item(it) for it in items])

    def put_checked(self, enc: EncodedPut) -> bool:
        """``put`` of an item validated and encoded by ``kvstore.wire.encode_item`` (a typed entry
        point: class docstring)."""
        self._rpc.check_open()
        return self._puts.put(enc)

    def put_many_checked(self, encs: list[EncodedPut]) -> list[bool]:
        """``put_many`` of items validated and encoded by ``kvstore.wire.encode_item`` (a typed
        entry point: class docstring)."""
        self._rpc.check_open()
        return self._puts.put_many(encs)

    def check_puts(self, encs: list[EncodedPut], pieces: list[slice] | None = None, *,
                   spans: bool = False) -> None:
        """What ``put_many`` checks of a validated batch before sending any (``Puts.check_puts``)."""
        self._puts.check_puts(encs, pieces, spans=spans)

    def daemon_max_value_bytes(self) -> int | None:
        """The daemon's ``max_value_bytes`` (``Puts.daemon_max_value_bytes``: asked once)."""
        return self._puts.daemon_max_value_bytes()

    # ------------------------------------------------------------------ reads
    def get_entry(self, key: bytes, *, kind: str = "block") -> Entry:
        self._rpc.check_open()
        k = EntryKind.parse(kind)  # the kind first, as the embedded store
        return self.get_entry_checked(check_key(key), k)

    def get_entry_checked(self, key: bytes, k: EntryKind) -> Entry:
        """``get_entry`` of a checked key and kind (a typed entry point: class docstring)."""
        self._rpc.check_open()
        if self._direct is not None:
            e = self._rpc.guarded(self._direct.get_entry, key, k)  # NotFound from Locate; None: through the daemon
            if e is not None:
                return e
        r = self._rpc.call("Get", pb.KeyRequest(key=key, kind=k.value))
        return Entry(key, k, layout_from_pb(r.layout), int(r.tokens), r.value)

    def get(self, key: bytes, *, kind: str = "block") -> bytes:
        return self.get_entry(key, kind=kind).data

    def get_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bytes | None]:
        self._rpc.check_open()
        k = EntryKind.parse(kind)  # first, as the embedded store: an empty batch too
        return self.get_many_checked(check_keys(keys), k)

    def get_many_checked(self, keys: list[bytes], k: EntryKind) -> list[bytes | None]:
        """``get_many`` of checked keys and kind (a typed entry point: class docstring)."""
        self._rpc.check_open()
        if not keys:
            return []
        out: list[bytes | None] = []
        for _, got in self._rpc.each_piece(len(keys), lambda p: self._get_piece(keys[p], k)):  # in pieces, in order
            out.extend(got)
        return out

    def _get_piece(self, keys: list[bytes], k: EntryKind) -> list[bytes | None]:
        """One piece of ``get_many`` (at most ``max_batch_items`` keys): direct reads, else gRPC."""
        if self._direct is not None:
            got = self._rpc.guarded(self._direct.get_many, keys, k, self._rpc.get_stream)
            if got is not None:
                return got
        return self._rpc.get_stream(keys, k)

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *,
                      kind: str = "block") -> list[EntryInfo | None]:
        """``kvstore.api``'s batched read into caller buffers. With direct reads the payloads
        are decoded straight into ``outs``; otherwise, and for keys read through the daemon,
        ``get_many`` plus one copy (``EntryInfo.layout``/``tokens`` are then ``None``).

        As the embedded store, nothing is written into any buffer for a batch that raises
        ``InvalidRequest``: the kind, every key and every buffer (writable, contiguous) are
        checked before any call, then (``stage_into``) every key is located or read, in
        pieces of at most ``max_batch_items``, and every buffer's size checked against it
        before the first byte is written (``finish_into``). The errors name ``outs[i]`` as
        the embedded store does."""
        self._rpc.check_open()
        keys = check_keys(keys)
        if len(outs) != len(keys):
            raise InvalidRequest(f"get_many_into: {len(keys)} keys but {len(outs)} output buffers")
        k = EntryKind.parse(kind)
        views = [writable_view(o, f"outs[{i}]") for i, o in enumerate(outs)]
        if not keys:
            return []
        staged = self.stage_into(keys, k)
        check_into_sizes(keys, [n for st in staged for n in st.sizes], views, k)
        return self.finish_into(staged, keys, views, k)

    def stage_into(self, keys: list[bytes], k: EntryKind) -> list[StagedInto]:
        """The first half of ``get_many_into`` (validated ``keys``), nothing written yet: per
        piece, in order, its keys located (direct reads) or read through the daemon, each
        ``StagedInto.sizes`` the plain size to check the buffers against."""
        return [got for _, got in self._rpc.each_piece(len(keys), lambda p: self._stage_piece(keys[p], k))]

    def _stage_piece(self, keys: list[bytes], k: EntryKind) -> StagedInto:
        if self._direct is not None:
            st = self._rpc.guarded(self._direct.stage_into, keys, k, self._rpc.get_stream)
            if st is not None:
                return st
        datas = self._rpc.get_stream(keys, k)
        return StagedInto([None if d is None else len(d) for d in datas], dict(enumerate(datas)))

    def finish_into(self, staged: list[StagedInto], keys: list[bytes], views: list[memoryview], k: EntryKind,
                    labels: Sequence[int] | None = None) -> list[EntryInfo | None]:
        """The second half of ``get_many_into``, once the caller checked every buffer against
        ``stage_into``'s sizes: read (direct) or copy each staged piece into ``views``.
        ``labels[i]`` is how the caller numbers ``views[i]`` (default ``i``), for the error of
        an entry re-put larger meanwhile, which is checked again before its piece is written."""
        labels = range(len(keys)) if labels is None else labels
        out: list[EntryInfo | None] = []
        at = 0
        for st in staged:
            p = slice(at, at + len(st.sizes))
            at = p.stop
            if st.reader is not None:
                self._rpc.check_open()
                out.extend(self._rpc.guarded(self._direct.finish_into, st, keys[p], views[p], k,
                                             self._rpc.get_stream, labels[p]))
                continue
            done = copy_into(keys[p], list(st.fetched.values()), views[p], k, list(st.fetched), labels[p])
            out.extend(done[i] for i in range(len(st.sizes)))
        return out

    def direct_write_stats(self) -> dict:
        """This client's direct writes: mode, active (or why not), counters (``kvstore.client.direct_writes``)."""
        if self._direct_w is None:
            return {"mode": "off", "active": False, "reason": "direct_writes='off'", "counters": {}}
        return self._direct_w.stats()

    def direct_stats(self) -> dict:
        """This client's direct reads: mode, active (or why not), counters (``kvstore.client.direct_reads``)."""
        if self._direct is None:
            return {"mode": "off", "active": False, "reason": "direct_reads='off'", "counters": {}}
        return self._direct.stats()

    # ------------------------------------------------------------------ delete, pin
    def _one(self, op: str, key: bytes, kind: str) -> bool:
        self._rpc.check_open()
        k = EntryKind.parse(kind)  # the kind first, as the embedded store
        return self.change_checked(op, check_key(key), k)

    def change_checked(self, op: str, key: bytes, k: EntryKind) -> bool:
        """``delete``, ``pin`` or ``unpin`` (``op``, a key of ``KEY_CALLS``) of a checked key and
        kind (a typed entry point: class docstring)."""
        self._rpc.check_open()
        return self._rpc.call(KEY_CALLS[op][0], pb.KeyRequest(key=key, kind=k.value)).ok

    def _many(self, op: str, keys: Sequence[bytes], kind: str, md: tuple[tuple[str, str], ...] = ()) -> list[bool]:
        self._rpc.check_open()
        k = EntryKind.parse(kind)
        return self.change_many_checked(op, [check_key(x) for x in keys], k, md)

    def change_many_checked(self, op: str, keys: list[bytes], k: EntryKind,
                            md: tuple[tuple[str, str], ...] = ()) -> list[bool]:
        """``delete_many``, ``pin_many`` or ``unpin_many`` (``op``, a key of ``KEY_CALLS``) of
        checked keys and kind (a typed entry point: class docstring): pieces of at most
        ``max_batch_items`` in order (a failure in a later piece leaves earlier ones done)."""
        self._rpc.check_open()
        method = KEY_CALLS[op][1]
        reqs = [pb.KeyRequest(key=x, kind=k.value) for x in keys]

        def send(p: slice) -> list[bool]:
            reply = self._rpc.call(method, pb.KeysRequest(keys=reqs[p]), md=md)
            return self._rpc.check_count(method, list(reply.ok), len(reqs[p]))

        out: list[bool] = []
        for _, got in self._rpc.each_piece(len(reqs), send):
            out.extend(got)
        return out

    def delete(self, key: bytes, *, kind: str = "block") -> bool:
        return self._one("delete", key, kind)

    def pin(self, key: bytes, *, kind: str = "block") -> bool:
        return self._one("pin", key, kind)

    def unpin(self, key: bytes, *, kind: str = "block") -> bool:
        return self._one("unpin", key, kind)

    def delete_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._many("delete", keys, kind)

    def pin_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._many("pin", keys, kind)

    def unpin_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._many("unpin", keys, kind)

    def delete_index_keys(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        """``kvtool delete``: ``delete_many`` of keys named as ``inspect_entries`` names them (an
        admin tenant: index keys, as ``check`` and kvtool on a data directory print them; any
        other tenant: its own keys), so it deletes what ``kvtool inspect`` shows."""
        return self._many("delete", keys, kind, md=((MD_INDEX_KEYS, "1"),))

    # ------------------------------------------------------------------ lookups (kvstore.client.lookups)
    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        self._rpc.check_open()
        return self._lookups.lookup(check_keys(keys))

    def lookup_many(self, chains: Sequence[Sequence[bytes]]) -> list[LookupResult]:
        self._rpc.check_open()
        return self._lookups.lookup_many([check_keys(c) for c in chains])  # every chain before any call

    def probe(self, keys: Sequence[bytes], *, until_miss: bool = False,
              chain_ends: Sequence[int] | None = None) -> tuple[bytes, bytes]:
        """``Lookups.probe``: per key, is it a live block, and a live SWA entry too."""
        keys = check_keys(keys)
        return self.probe_checked(keys, until_miss, check_chain_ends(chain_ends, len(keys), until_miss=until_miss))

    def probe_checked(self, keys: list[bytes], until_miss: bool, ends: list[int] | None) -> tuple[bytes, bytes]:
        """``probe`` of checked keys and chain ends (a typed entry point: class docstring)."""
        return self._lookups.probe(keys, until_miss, ends)

    # ------------------------------------------------------------------ admin (kvstore.client.admin)
    def stats(self) -> dict:
        return self._admin.stats()

    def gc(self, *, dry_run: bool = False, progress: Callable | None = None) -> dict:
        return self._admin.gc(dry_run=dry_run, progress=progress)

    def check(self, fix: bool = False, *, progress: Callable | None = None) -> list:
        return self._admin.check(fix, progress=progress)

    def repair(self, *, progress: Callable | None = None) -> dict:
        return self._admin.repair(progress=progress)

    def rebuild_index(self, *, progress: Callable | None = None) -> dict:
        return self._admin.rebuild_index(progress=progress)

    def inspect_summary(self) -> dict:
        return self._admin.inspect_summary()

    def inspect_entries(self, keys: Sequence[bytes], *, kind: str = "block") -> list[dict]:
        k = EntryKind.parse(kind)  # the kind first, as the embedded store
        return self.inspect_entries_checked(check_keys(keys), k)

    def inspect_entries_checked(self, keys: list[bytes], k: EntryKind) -> list[dict]:
        """``inspect_entries`` of checked keys and kind (a typed entry point: class docstring)."""
        return self._admin.inspect_entries(keys, k.value)

    def inspect_chain(self, keys: Sequence[bytes]) -> list[dict]:
        return self.inspect_chain_checked(check_keys(keys))

    def inspect_chain_checked(self, keys: list[bytes]) -> list[dict]:
        """``inspect_chain`` of checked keys (a typed entry point: class docstring)."""
        return self._admin.inspect_chain(keys)

    def export_index_batches(self) -> Iterator["pa.RecordBatch"]:
        return self._admin.export_index_batches()

    # ------------------------------------------------------------------ close
    def close(self) -> None:
        """Close the channel, then the direct paths' workers; once (a second ``close`` does nothing)."""
        if self._rpc.close():
            if self._direct is not None:
                self._direct.close()
            if self._direct_w is not None:
                self._direct_w.close()

    def __enter__(self) -> "RemoteStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
