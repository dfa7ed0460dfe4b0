"""``ShardedStore``: one ``KVStore`` over several daemons, keys spread by rendezvous hashing.

``kvstore.connect("grpc://h1:p1,grpc://h2:p2,grpc://h3:p3")`` returns one.

Placement: a key's owner is the shard that scores best for it by rendezvous hashing
(``kvstore.rendezvous``, the rule ``kvstore.embedded.placement`` uses for fragments), the name being the URL with its spelling made canonical
(``kvstore.client.options.shard_name``: host case, port zeros, IPv6 forms). Every client computes the same owner with no shared
state; adding a shard moves only the keys it now wins. A block entry and the
SWA entry at the same key share an owner (the kind is not hashed), so one
``Probe`` answers both for a key.

Lookup across shards (why it stays exact): a chain's keys usually live on
different shards, so no single daemon can compute the longest prefix. The
client groups the chain's positions by owner, sends one ``Probe`` per shard
in parallel ("is keys[i] a live block? a live SWA?"), then walks the answers
in chain order and stops at the first missing block; ``swa_at`` is the last
SWA at or before that point. One round trip (the slowest shard) per lookup;
``lookup_many`` batches every chain's keys into that same one round. Each shard
stops reading a chain at its own first miss in it (``until_miss`` for one chain,
``chain_ends`` for several): the chain's prefix ends at the earliest of those, so
a shard reads O(hit) keys of each chain.

Failure semantics: a batch spanning shards is sent to each shard in
parallel; every item is validated client-side first, so bad input stores
nothing anywhere (a ``put_many`` spanning shards checks each value against its
shard's ``max_value_bytes`` first, asked once per shard: ``RemoteStore.check_puts``;
``get_many_into`` checks every buffer against every shard's sizes before writing
any), but a shard that is *down* fails the call with
``StoreUnavailable`` while the other shards may already have stored their
part (a retry is safe: puts are idempotent). Each shard's part goes through
``RemoteStore``, which sends more than ``max_batch_items`` items in pieces
(not one unit on that daemon either). Keys may be any bytes-like objects, as for
one store; errors are those of one store, numbering items as the caller does, and a
call that ``close`` cuts off raises ``StoreClosed``.

Maintenance (``stats``, ``gc``, ``check``, ``repair``, ``inspect_summary``) runs on
every shard in parallel and waits for all of them. A shard that fails (down, refusing,
timed out) does not discard the others' results, since a gc or repair there already ran:
the sums cover the shards that answered, ``shards`` holds per URL that shard's own result
or ``{"error": message, "code": KVStoreError.code}``, and ``check`` reports the shard as
one ``TARGET_DOWN`` problem whose ``target`` is its URL. Only when no shard answers is
the (first) error raised. Target names are prefixed with their shard, ``URL/t3``.
The index export (``export_index_batches``, ``kvtool inspect --parquet``) asks the shards in
turn, a shard that fails named apart and the others' rows kept, as for maintenance.

Client options (``kvstore.client.options.ClientOptions``) apply to every shard, so
``direct_reads="on"``/``"auto"`` makes each shard's client read directly from
that daemon's targets (``kvstore.client.direct_reads``), each deciding "auto" for itself.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

from kvstore.api import Entry, EntryInfo, EntryKind, Layout, LookupResult, PutItem, check_put_items, writable_view
from kvstore.client.direct_reads import check_into_sizes
from kvstore.errors import CapacityExceeded, InvalidRequest, KVStoreError, StoreClosed
from kvstore import rendezvous
from kvstore.keys import check_key, check_keys
from kvstore.maintenance.problems import Problem, ProblemKind
from kvstore.client.options import ClientOptions, parse_address, shard_name
from kvstore.client.remote import RemoteStore
from kvstore.wire import check_value_sizes, encode_item

if TYPE_CHECKING:
    import pyarrow as pa


def _sum_into(acc: dict, d: dict) -> None:
    """Add numeric leaves of ``d`` into ``acc`` (recursively); a boolean leaf is true when it
    is on any shard; other values are left out."""
    for k, v in d.items():
        if isinstance(v, bool):
            acc[k] = bool(acc.get(k)) or v
        elif isinstance(v, (int, float)):
            acc[k] = acc.get(k, 0) + v
        elif isinstance(v, dict):
            _sum_into(acc.setdefault(k, {}), v)


def _capacity(caps: list[int]) -> int:
    """The capacity of shards together: their sum, or 0 (no limit) when any shard has none."""
    return sum(caps) if caps and all(caps) else 0


def _same(values: list[Any]) -> Any:
    """The value every shard reports, else the distinct values joined by " | "."""
    distinct = list(dict.fromkeys(str(v) for v in values if v is not None))
    return distinct[0] if len(distinct) == 1 else " | ".join(distinct) or None


def _merge_summaries(parts: list[dict]) -> dict:
    """``index_view.KindSummary.as_dict`` of several shards as one: counts summed, the
    ``oldest_*`` times the earliest and the ``newest_*`` the latest (ISO-8601 UTC strings of
    one format, so they order as text)."""
    out: dict[str, Any] = {}
    for d in parts:
        for k, v in d.items():
            if k.startswith(("oldest_", "newest_")):
                vals = [x for x in (out.get(k), v) if x]
                out[k] = (min if k.startswith("oldest_") else max)(vals) if vals else None
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


def _prefix_targets(batch: "pa.RecordBatch", url: str) -> "pa.RecordBatch":
    """An index export batch (``index_view.parquet_schema``) with every target named ``URL/target``."""
    import pyarrow as pa

    i = batch.schema.get_field_index("targets")
    field = batch.schema.field(i)
    named = pa.array([[f"{url}/{t}" for t in ts] for ts in batch.column(i).to_pylist()], type=field.type)
    cols = [named if j == i else c for j, c in enumerate(batch.columns)]
    return pa.RecordBatch.from_arrays(cols, schema=batch.schema)


class ShardedStore:
    """``kvstore.api.KVStore`` over N ``RemoteStore`` shards. Thread-safe.

    Each call's arguments are checked here, once, with one store's errors; each shard is then
    called through ``RemoteStore``'s typed entry points (its class docstring) with the keys,
    kinds and encoded puts already checked, never through its public methods."""

    def __init__(self, urls: Sequence[str], options: ClientOptions | None = None):
        tls = [parse_address(u)[1] for u in urls]  # every URL checked before any channel is opened
        names = [shard_name(u) for u in urls]
        if len(set(names)) != len(names) or not urls:
            raise InvalidRequest(f"shard URLs must be distinct daemons and non-empty, got {list(urls)}")
        if any(tls):  # TLS options are for the grpcs:// shards; grpc:// ones are plaintext (kvstore.client.options)
            options = replace(options or ClientOptions(), grpcs_in_set=True)
        self.urls = list(urls)
        self.shards: list[RemoteStore] = []
        try:
            for u in self.urls:
                self.shards.append(RemoteStore(u, options))
        except BaseException:
            for sh in self.shards:  # a shard that failed to open: close the channels already open
                sh.close()
            raise
        self._names = [n.encode() for n in names]
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(urls)), thread_name_prefix="kvstore-shard")
        self._closed = False

    # ------------------------------------------------------------------ placement
    def owner(self, key: bytes) -> int:
        """Index of the shard that owns ``key`` (rendezvous hashing; any 16-byte bytes-like key,
        else ``InvalidRequest``)."""
        return rendezvous.best(check_key(key), self._names)

    def shard_for(self, key: bytes) -> RemoteStore:
        """The shard of a single-key call; ``StoreClosed`` first after ``close``, as the embedded store."""
        return self._route(key)[0]

    def _route(self, key: bytes) -> tuple[RemoteStore, bytes]:
        """``shard_for`` and the key checked (``bytes``), for the shard's typed entry points
        (``RemoteStore``'s class docstring): ``StoreClosed`` first, then the key's ``InvalidRequest``."""
        self._check_open()
        key = check_key(key)
        return self.shards[rendezvous.best(key, self._names)], key

    def _check_open(self) -> None:
        """``StoreClosed`` after ``close`` (the batch and maintenance calls; a single-key call
        goes to its shard, closed too)."""
        if self._closed:
            raise StoreClosed("this store is closed; open a new one with kvstore.connect")

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the pool; ``StoreClosed`` when ``close`` (which stops the pool)
        raced this call."""
        try:
            return self._pool.submit(fn, *args)
        except RuntimeError as exc:  # "cannot schedule new futures after shutdown"
            if self._closed:
                raise StoreClosed("this store is closed; open a new one with kvstore.connect") from exc
            raise

    def _per_shard(self, positions: dict[int, list[int]],
                   fn: Callable[[RemoteStore, list[int]], Any]) -> dict[int, Any]:
        """Run ``fn(shard, positions)`` per shard in parallel; return {shard: its result}."""
        self._check_open()
        futs = {s: self._submit(fn, self.shards[s], pos) for s, pos in positions.items()}
        out: dict[int, Any] = {}
        first_exc: BaseException | None = None
        for s, f in futs.items():
            try:
                out[s] = f.result()
            except BaseException as exc:  # wait for every shard, then raise the first failure
                first_exc = first_exc or exc
        if first_exc is not None:
            raise first_exc
        return out

    def _scatter(self, positions: dict[int, list[int]], fn: Callable[[RemoteStore, list[int]], list]) -> dict[int, Any]:
        """``_per_shard`` with each shard's results (one per position) keyed by position."""
        out: dict[int, Any] = {}
        for s, got in self._per_shard(positions, fn).items():
            out.update(zip(positions[s], got))
        return out

    def _group(self, keys: Sequence[bytes]) -> dict[int, list[int]]:
        """{shard: positions of the keys it owns}; ``owner`` for a whole batch at once (a
        1,000-key chain: one score matrix and one argmax, not 3,000 Python-level compares)."""
        groups: dict[int, list[int]] = defaultdict(list)
        for i, s in enumerate(rendezvous.best_many(keys, self._names)):
            groups[s].append(i)
        return groups

    # ------------------------------------------------------------------ single-key calls
    # Each call is checked here once (the key first, as ``_route`` does, then the kind) and goes
    # to its shard's typed entry point (``RemoteStore``'s class docstring).
    def put(self, key: bytes, value: Any, *, kind: str = "block", ttl_s: float | None = None,
            layout: Layout | None = None, tokens: int = 0) -> bool:
        self._check_open()
        enc = encode_item(PutItem(key, value, kind, ttl_s, layout, tokens))  # the key first, as _route
        return self.shards[rendezvous.best(enc.item.key, self._names)].put_checked(enc)

    def get(self, key: bytes, *, kind: str = "block") -> bytes:
        return self.get_entry(key, kind=kind).data

    def get_entry(self, key: bytes, *, kind: str = "block") -> Entry:
        sh, key = self._route(key)
        return sh.get_entry_checked(key, EntryKind.parse(kind))

    def _change(self, op: str, key: bytes, kind: str) -> bool:
        sh, key = self._route(key)
        return sh.change_checked(op, key, EntryKind.parse(kind))

    def delete(self, key: bytes, *, kind: str = "block") -> bool:
        return self._change("delete", key, kind)

    def pin(self, key: bytes, *, kind: str = "block") -> bool:
        return self._change("pin", key, kind)

    def unpin(self, key: bytes, *, kind: str = "block") -> bool:
        return self._change("unpin", key, kind)

    # ------------------------------------------------------------------ batches
    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        """``kvstore.api``'s batched put, each item stored by its key's shard. Every item is
        validated, and for a batch spanning shards every value checked against its shard's
        ``max_value_bytes`` and every shard's pieces against ``max_message_bytes``
        (``RemoteStore.check_puts``), before any shard is sent anything."""
        self._check_open()
        items = check_put_items(items)
        encs = [encode_item(it) for it in items]  # validate everything before any shard stores anything
        groups = self._group([e.item.key for e in encs])  # bytes, whatever bytes-like the caller gave
        if len(groups) > 1:
            limits = self._per_shard(groups, lambda sh, pos: sh.daemon_max_value_bytes())
            shard_of = {i: s for s, pos in groups.items() for i in pos}
            for i, e in enumerate(encs):  # the first bad item in the caller's order, as one store
                check_value_sizes([e], limits[shard_of[i]])
            for s, pos in groups.items():
                self.shards[s].check_puts([encs[i] for i in pos], spans=True)
        try:
            got = self._scatter(groups, lambda sh, pos: sh.put_many_checked([encs[i] for i in pos]))
        except CapacityExceeded as exc:  # one shard's; what the others stored is not known here
            if len(groups) > 1:
                exc.created = None
            raise
        return [got[i] for i in range(len(items))]

    def get_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bytes | None]:
        self._check_open()
        k = EntryKind.parse(kind)  # first, as one store: an empty batch too
        keys = check_keys(keys)
        got = self._scatter(self._group(keys), lambda sh, pos: sh.get_many_checked([keys[i] for i in pos], k))
        return [got[i] for i in range(len(keys))]

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *,
                      kind: str = "block") -> list[EntryInfo | None]:
        """``kvstore.api``'s read into caller buffers, each key read by its shard. As one
        store, an ``InvalidRequest`` leaves every buffer unwritten and names ``outs[i]`` in
        the caller's numbering: the kind, keys and every buffer are checked first, then every
        shard locates or reads its keys (``RemoteStore.stage_into``), every buffer is checked
        against those sizes, and only then does each shard fill its buffers (``finish_into``)."""
        self._check_open()
        keys = check_keys(keys)
        if len(outs) != len(keys):
            raise InvalidRequest(f"get_many_into: {len(keys)} keys but {len(outs)} output buffers")
        k = EntryKind.parse(kind)
        views = [writable_view(o, f"outs[{i}]") for i, o in enumerate(outs)]
        groups = self._group(keys)
        staged = self._per_shard(groups, lambda sh, pos: sh.stage_into([keys[i] for i in pos], k))
        sizes: list[int | None] = [None] * len(keys)
        for s, pieces in staged.items():
            for i, n in zip(groups[s], [n for st in pieces for n in st.sizes]):
                sizes[i] = n
        check_into_sizes(keys, sizes, views, k)
        got = self._scatter(groups, lambda sh, pos: sh.finish_into(
            staged[self.shards.index(sh)], [keys[i] for i in pos], [views[i] for i in pos], k, pos))
        return [got[i] for i in range(len(keys))]

    def direct_write_stats(self) -> dict:
        """Per shard URL: that client's direct writes (``RemoteStore.direct_write_stats``)."""
        return {u: s.direct_write_stats() for u, s in zip(self.urls, self.shards)}

    def direct_stats(self) -> dict:
        """Per shard URL: that client's direct reads (``RemoteStore.direct_stats``)."""
        return {u: s.direct_stats() for u, s in zip(self.urls, self.shards)}

    def _by_key(self, op: str, keys: Sequence[bytes], kind: str) -> list[bool]:
        self._check_open()
        k = EntryKind.parse(kind)  # first, as one store: an empty batch too
        keys = check_keys(keys)
        got = self._scatter(self._group(keys),
                            lambda sh, pos: sh.change_many_checked(op, [keys[i] for i in pos], k))
        return [got[i] for i in range(len(keys))]

    def delete_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._by_key("delete", keys, kind)

    def pin_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._by_key("pin", keys, kind)

    def unpin_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._by_key("unpin", keys, kind)

    # ------------------------------------------------------------------ lookup
    def _probe_all(self, keys: list[bytes], ends: list[int]) -> tuple[bytes, bytes]:
        """``probe`` of the chains ``keys`` (chain j ends before index ``ends[j]``), each key
        asked of the shard that owns it (all shards at once).

        Each shard may stop a chain at its first key without a live block: ``until_miss`` for
        one chain, ``chain_ends`` (its share of each chain) for several; the keys it did not
        answer stay 0. That changes no walk: a chain's first miss is the earliest of the
        shards' first misses in it, and every key before it was answered by its shard. So
        each shard reads O(hit) of each chain, not its whole share.
        """
        block, swa = np.zeros(len(keys), np.uint8), np.zeros(len(keys), np.uint8)
        groups = self._group(keys)
        one = len(ends) == 1

        def ask(sh: RemoteStore, pos: list[int]) -> tuple[bytes, bytes]:
            share = [keys[i] for i in pos]
            if one:
                return sh.probe_checked(share, True, None)
            return sh.probe_checked(share, False, np.searchsorted(pos, ends).tolist())  # positions ascend

        got = self._per_shard(groups, ask)
        for s, (b, w) in got.items():
            pos = groups[s][:len(b)]
            block[pos], swa[pos] = np.frombuffer(b, np.uint8), np.frombuffer(w, np.uint8)
        return block.tobytes(), swa.tobytes()

    @staticmethod
    def _walk(block: bytes, swa: bytes) -> LookupResult:
        """The longest prefix of live blocks and the last SWA snapshot within it (what one
        store's ``lookup`` says), from per-key presence bytes."""
        hit = block.find(0)
        if hit < 0:
            hit = len(block)
        last = swa.rfind(1, 0, hit)
        return LookupResult(hit, last + 1 if last >= 0 else None)

    def lookup(self, keys: Sequence[bytes]) -> LookupResult:
        return self.lookup_many([keys])[0]

    def lookup_many(self, chains: Sequence[Sequence[bytes]]) -> list[LookupResult]:
        self._check_open()
        flat: list[bytes] = []
        bounds: list[tuple[int, int]] = []
        for c in chains:
            start = len(flat)
            flat.extend(check_keys(c))
            bounds.append((start, len(flat)))
        block, swa = self._probe_all(flat, [b for _, b in bounds])
        return [self._walk(block[a:b], swa[a:b]) for a, b in bounds]

    # ------------------------------------------------------------------ maintenance
    def _each(self, fn: Callable[[RemoteStore], Any]) -> tuple[dict[str, Any], dict[str, KVStoreError]]:
        """``fn(shard)`` on every shard in parallel; waits for all of them.

        Returns ``({url: result}, {url: error})``: a shard that fails with a ``KVStoreError``
        (down, refusing, timed out) is named in the second dict and the others' results are
        kept (a gc or repair there already ran). Raises the first shard's error when no shard
        answered: then nothing was done anywhere. Any other exception is a bug and is raised.
        """
        self._check_open()
        futs = [self._submit(fn, s) for s in self.shards]
        ok: dict[str, Any] = {}
        failed: dict[str, KVStoreError] = {}
        for url, f in zip(self.urls, futs):
            try:
                ok[url] = f.result()
            except KVStoreError as exc:
                failed[url] = exc
        if not ok:
            raise next(iter(failed.values()))
        return ok, failed

    def _shards(self, ok: dict[str, Any], failed: dict[str, KVStoreError]) -> dict[str, Any]:
        """The per-shard detail, in URL order: a shard's own result, or ``{"error", "code"}``."""
        return {u: ok[u] if u in ok else {"error": str(failed[u]), "code": failed[u].code} for u in self.urls}

    def stats(self) -> dict:
        """The shards' stats summed (entries, bytes, counters, ...), every shard's targets named
        ``URL/target``, and ``shards``: per URL its own stats or ``{"error", "code"}``. Shards
        that fail are left out of the sums and named under ``shards`` (all failing: raised)."""
        ok, failed = self._each(lambda s: s.stats())
        out: dict[str, Any] = {}
        for st in ok.values():
            _sum_into(out, {k: st.get(k, 0) for k in ("entries", "used_bytes", "pack_dead_bytes", "lost_entries",
                                                      "graveyard_entries", "by_kind", "counters")})
        out["capacity_bytes"] = _capacity([st.get("capacity_bytes", 0) for st in ok.values()])
        created = [(st.get("oldest_created_s"), st.get("newest_created_s")) for st in ok.values()]
        out["oldest_created_s"] = min((a for a, _ in created if a is not None), default=None)
        out["newest_created_s"] = max((b for _, b in created if b is not None), default=None)
        out["erasure_code"] = _same([st.get("erasure_code") for st in ok.values()])
        out["targets"] = [dict(t, name=f"{u}/{t.get('name', '')}") for u, st in ok.items()
                          for t in st.get("targets", ())]
        out["shards"] = self._shards(ok, failed)
        return out

    @staticmethod
    def _shard_progress(progress: Callable | None) -> Callable[[RemoteStore], Callable | None]:
        """Per shard, ``progress`` for its pass, each phase named ``URL phase``, the shards'
        calls (from their threads) one at a time; ``None`` for each without ``progress``."""
        lock = threading.Lock()

        def for_shard(s: RemoteStore) -> Callable | None:
            def report(phase: str, done: int, total: int) -> None:
                with lock:
                    progress(f"{s.url} {phase}", done, total)

            return None if progress is None else report

        return for_shard

    def _counted_pass(self, run: Callable[[RemoteStore], dict]) -> tuple[dict, dict[str, CapacityExceeded]]:
        """``run`` (a gc or repair pass) on every shard: (the counts summed, with ``shards`` as in
        ``stats``; ``{url: error}`` of the shards whose pass raised ``CapacityExceeded`` with its
        counts: gc that could not get under the capacity, repair that found the index map full).
        Those answered: their counts are summed too, for the caller to raise once every shard
        is done, as one store raises it. One without counts is a shard that failed."""
        def one(s: RemoteStore) -> tuple[dict, CapacityExceeded | None]:
            try:
                return run(s), None
            except CapacityExceeded as exc:
                if exc.result is None:  # no counts to sum: the shard failed (``_each``)
                    raise
                return exc.result, exc

        answers, failed = self._each(one)
        ok = {u: g for u, (g, _) in answers.items()}
        out: dict[str, Any] = {}
        for g in ok.values():
            _sum_into(out, g)
        out["shards"] = self._shards(ok, failed)
        return out, {u: exc for u, (_, exc) in answers.items() if exc is not None}

    @staticmethod
    def _raise_full(out: dict, full: dict[str, CapacityExceeded]) -> dict:
        if full:
            raise CapacityExceeded("; ".join(f"shard {u}: {exc}" for u, exc in full.items()), result=out)
        return out

    def gc(self, *, dry_run: bool = False, progress: Callable | None = None) -> dict:
        """Every shard's GC pass; the counts summed, ``dry_run`` as asked, ``shards`` as in ``stats``.
        A shard that could not get under its capacity (``CapacityExceeded`` with its pass's
        counts) answered: its counts are summed too, and once every shard is done that is
        raised, as one store raises it, with the summed counts as ``result``
        (``_counted_pass``). ``progress``: each shard's, as ``_shard_progress`` names it (for
        gc, check and repair)."""
        shard_progress = self._shard_progress(progress)
        out, full = self._counted_pass(lambda s: s.gc(dry_run=dry_run, progress=shard_progress(s)))
        out["dry_run"] = dry_run
        return self._raise_full(out, full)

    def check(self, fix: bool = False, *, progress: Callable | None = None) -> list:
        """Every shard's problems, each target named ``URL/target`` (each name of a list, e.g.
        a lost entry's ``URL/t3,URL/t5``). A shard that does not answer is one
        ``TARGET_DOWN`` problem whose ``target`` is its URL; no shard answering is raised."""
        shard_progress = self._shard_progress(progress)
        ok, failed = self._each(lambda s: s.check(fix=fix, progress=shard_progress(s)))
        out = []
        for url in self.urls:
            if url in failed:
                out.append(Problem(ProblemKind.TARGET_DOWN, target=url,
                                   detail=f"shard did not answer: {failed[url]}"))
                continue
            out += [replace(p, target=",".join(f"{url}/{t}" for t in p.target.split(",")) if p.target else url)
                    for p in ok[url]]
        return out

    def repair(self, *, progress: Callable | None = None) -> dict:
        """Every shard's repair; the counts summed, ``shards`` as in ``stats``; a shard whose
        index map was full answered, and is raised as ``gc`` raises (``_counted_pass``)."""
        shard_progress = self._shard_progress(progress)
        return self._raise_full(*self._counted_pass(lambda s: s.repair(progress=shard_progress(s))))

    def rebuild_index(self, *, progress: Callable | None = None) -> dict:
        """Every shard's ``rebuild_index`` (``kvstore.maintenance.reindex``); the counts summed, ``shards`` as in ``stats``."""
        shard_progress = self._shard_progress(progress)
        return self._raise_full(*self._counted_pass(lambda s: s.rebuild_index(progress=shard_progress(s))))

    # ------------------------------------------------------------------ inspect (read-only, kvtool)
    def inspect_summary(self) -> dict:
        """``RemoteStore.inspect_summary`` of every shard, merged into the same schema: counts
        summed per kind and in ``total``, creation and access ranges widened, targets named
        ``URL/target``, ``data_dir`` the URL list; plus ``shards`` as in ``stats``."""
        ok, failed = self._each(lambda s: s.inspect_summary())
        parts = list(ok.values())
        out = dict(parts[0])
        out["data_dir"] = ",".join(self.urls)
        out["erasure_code"] = _same([d.get("erasure_code") for d in parts])
        out["by_kind"] = {k: _merge_summaries([d["by_kind"].get(k, {}) for d in parts])
                          for k in dict.fromkeys(k for d in parts for k in d.get("by_kind", {}))}
        out["total"] = _merge_summaries([d.get("total", {}) for d in parts])
        for name in ("used_bytes", "pack_dead_bytes"):
            out[name] = sum(int(d.get(name) or 0) for d in parts)
        out["capacity_bytes"] = _capacity([d.get("capacity_bytes") or 0 for d in parts])
        out["capacity_used"] = out["used_bytes"] / out["capacity_bytes"] if out["capacity_bytes"] else None
        out["targets"] = [dict(t, name=f"{u}/{t['name']}") for u, d in ok.items() for t in d.get("targets", ())]
        out["shards"] = self._shards(ok, failed)
        return out

    def _ask_all(self, fn: Callable[[RemoteStore], list[dict]]) -> tuple[list[tuple[str, list[dict]]], dict]:
        """``fn`` on every shard: ([(url, its answer)] of those that answered, ``{url: error}``
        of those that did not). An admin's keys may live on any shard, so a row found nowhere
        while a shard is down is not known absent: each row then carries ``unanswered`` (the
        failed shards and their errors). No shard answering raises the first one's error."""
        ok, failed = self._each(fn)
        return list(ok.items()), {u: str(e) for u, e in failed.items()}

    def inspect_entries(self, keys: Sequence[bytes], *, kind: str = "block") -> list[dict]:
        """Per key, its view from the shard that holds it, with ``shard``: that URL (``None``
        when no shard has it), and ``unanswered`` when a shard did not answer (``_ask_all``).
        Every shard is asked: an admin names index keys, whose owner the client cannot compute
        (a tenant's keys are hashed into its namespace first)."""
        k = EntryKind.parse(kind)
        keys = check_keys(keys)
        answers, failed = self._ask_all(lambda s: s.inspect_entries_checked(keys, k))
        out = []
        for i in range(len(keys)):
            found = [(u, views[i]) for u, views in answers if views[i]["state"] != "absent"]
            url, view = found[0] if found else (None, answers[0][1][i])
            out.append(dict(view, shard=url, **({"unanswered": failed} if failed else {})))
        return out

    def inspect_chain(self, keys: Sequence[bytes]) -> list[dict]:
        """Per chain position, the state of its block and SWA entries on whichever shard
        holds them (every shard asked, ``unanswered`` as in ``inspect_entries``)."""
        keys = check_keys(keys)
        answers, failed = self._ask_all(lambda s: s.inspect_chain_checked(keys))
        out = []
        for i in range(len(keys)):
            row = dict(answers[0][1][i], **({"unanswered": failed} if failed else {}))
            for _, rows in answers:
                for kind in ("block", "swa"):
                    if rows[i].get(kind) not in (None, "absent"):
                        row[kind] = rows[i][kind]
            out.append(row)
        return out

    def export_index_batches(self, unanswered: dict[str, str] | None = None) -> Iterator["pa.RecordBatch"]:
        """``RemoteStore.export_index_batches`` of each shard in turn, in URL order: the rows of
        the shards concatenated, in the one schema, each record's targets named ``URL/target``
        (as ``inspect_summary`` and ``check`` name them), which says which shard holds it.

        A shard that fails (down, refusing, timed out) is put in ``unanswered`` (``{url: its
        error}``) and the next shard is asked: the others' rows still come. Rows it sent before
        failing were taken (its error says how many). No shard answering to its end raises the
        first one's error."""
        self._check_open()
        errors: dict[str, KVStoreError] = {}
        for url, shard in zip(self.urls, self.shards):
            n = 0
            try:
                for batch in shard.export_index_batches():
                    n += batch.num_rows
                    yield _prefix_targets(batch, url)
            except KVStoreError as exc:
                errors[url] = exc
                if unanswered is not None:
                    unanswered[url] = str(exc) + (f" (after {n} of its rows, which were kept)" if n else "")
        if len(errors) == len(self.urls):
            raise next(iter(errors.values()))

    def close(self) -> None:
        self._closed = True
        for s in self.shards:
            s.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "ShardedStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
