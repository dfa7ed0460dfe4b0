"""``ShardedStore``: one ``KVStore`` over several daemons, keys spread by rendezvous hashing.

``kvstore.connect("grpc://h1:p1,grpc://h2:p2,grpc://h3:p3")`` returns one.

Placement: a key's owner is the shard with the highest
``xxh3_64(key || shard URL)`` (rendezvous hashing, as ``kvstore.placement``
does for fragments). Every client computes the same owner with no shared
state; adding a shard moves only the keys it now wins. A block entry and the
SWA entry at the same key share an owner (the kind is not hashed), so one
``Probe`` answers both for a key.

Lookup across shards (why it stays exact): a chain's keys usually live on
different shards, so no single daemon can compute the longest prefix. The
client groups the chain's positions by owner, sends one ``Probe`` per shard
in parallel ("is keys[i] a live block? a live SWA?"), then walks the answers
in chain order and stops at the first missing block; ``swa_at`` is the last
SWA at or before that point. One round trip (the slowest shard) per lookup;
``lookup_many`` batches every chain's keys into that same one round. For one
chain each shard stops reading at its own first miss (``until_miss``): the
chain's prefix ends at the earliest of those, so a shard reads O(hit) keys.

Failure semantics: a batch spanning shards is sent to each shard in
parallel; every item is validated client-side first, so bad input stores
nothing anywhere, but a shard that is *down* fails the call with
``StoreUnavailable`` while the other shards may already have stored their
part (a retry is safe: puts are idempotent). Each shard's part goes through
``RemoteStore``, which sends more than ``max_batch_items`` items in pieces
(not one unit on that daemon either). The sum of ``stats`` and
``gc`` over shards is returned with the per-shard detail under ``shards``.

Client options (``kvstore.remote.ClientOptions``) apply to every shard, so
``direct_reads="on"``/``"auto"`` makes each shard's client read directly from
that daemon's targets (``kvstore.direct``), each deciding "auto" for itself.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from kvstore.api import Entry, EntryInfo, Layout, LookupResult, PutItem
from kvstore.errors import InvalidRequest
from kvstore.keys import check_key, check_keys
from kvstore.remote import ClientOptions, RemoteStore, normalize_item, parse_address


def _sum_into(acc: dict, d: dict) -> None:
    """Add numeric leaves of ``d`` into ``acc`` (recursively); other values are left out."""
    for k, v in d.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            acc[k] = acc.get(k, 0) + v
        elif isinstance(v, dict):
            _sum_into(acc.setdefault(k, {}), v)


class ShardedStore:
    """``kvstore.api.KVStore`` over N ``RemoteStore`` shards. Thread-safe."""

    def __init__(self, urls: Sequence[str], options: ClientOptions | None = None):
        if len(set(urls)) != len(urls) or not urls:
            raise InvalidRequest(f"shard URLs must be distinct and non-empty, got {list(urls)}")
        tls = [parse_address(u)[1] for u in urls]  # every URL checked before any channel is opened
        if any(tls):  # TLS options are for the grpcs:// shards; grpc:// ones are plaintext (kvstore.remote)
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
        self._names = [u.encode() for u in self.urls]
        self._pool = ThreadPoolExecutor(max_workers=max(2, 2 * len(urls)), thread_name_prefix="kvstore-shard")

    # ------------------------------------------------------------------ placement
    def owner(self, key: bytes) -> int:
        """Index of the shard that owns ``key`` (rendezvous hashing)."""
        best, best_i = -1, 0
        for i, n in enumerate(self._names):
            s = xxhash.xxh3_64_intdigest(key + n)
            if s > best:
                best, best_i = s, i
        return best_i

    def shard_for(self, key: bytes) -> RemoteStore:
        return self.shards[self.owner(check_key(key))]

    def _per_shard(self, positions: dict[int, list[int]],
                   fn: Callable[[RemoteStore, list[int]], Any]) -> dict[int, Any]:
        """Run ``fn(shard, positions)`` per shard in parallel; return {shard: its result}."""
        futs = {s: self._pool.submit(fn, self.shards[s], pos) for s, pos in positions.items()}
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
        h = xxhash.xxh3_64_intdigest
        scores = np.array([[h(k + n) for k in keys] for n in self._names], dtype=np.uint64)
        groups: dict[int, list[int]] = defaultdict(list)
        for i, s in enumerate(scores.argmax(axis=0).tolist() if len(keys) else []):
            groups[s].append(i)  # argmax keeps the first of equal scores, as ``owner`` does
        return groups

    # ------------------------------------------------------------------ single-key calls
    def put(self, key: bytes, value: Any, *, kind: str = "block", ttl_s: float | None = None,
            layout: Layout | None = None, tokens: int = 0) -> bool:
        return self.shard_for(key).put(key, value, kind=kind, ttl_s=ttl_s, layout=layout, tokens=tokens)

    def get(self, key: bytes, *, kind: str = "block") -> bytes:
        return self.shard_for(key).get(key, kind=kind)

    def get_entry(self, key: bytes, *, kind: str = "block") -> Entry:
        return self.shard_for(key).get_entry(key, kind=kind)

    def delete(self, key: bytes, *, kind: str = "block") -> bool:
        return self.shard_for(key).delete(key, kind=kind)

    def pin(self, key: bytes, *, kind: str = "block") -> bool:
        return self.shard_for(key).pin(key, kind=kind)

    def unpin(self, key: bytes, *, kind: str = "block") -> bool:
        return self.shard_for(key).unpin(key, kind=kind)

    # ------------------------------------------------------------------ batches
    def put_many(self, items: Sequence[PutItem]) -> list[bool]:
        for it in items:
            normalize_item(it)  # validate everything before any shard stores anything
        groups = self._group([it.key for it in items])
        got = self._scatter(groups, lambda sh, pos: sh.put_many([items[i] for i in pos]))
        return [got[i] for i in range(len(items))]

    def get_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bytes | None]:
        keys = check_keys(keys)
        got = self._scatter(self._group(keys), lambda sh, pos: sh.get_many([keys[i] for i in pos], kind=kind))
        return [got[i] for i in range(len(keys))]

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Any], *,
                      kind: str = "block") -> list[EntryInfo | None]:
        """``kvstore.api``'s read into caller buffers: each shard fills its keys' buffers."""
        if len(outs) != len(keys):
            raise InvalidRequest(f"get_many_into: {len(keys)} keys but {len(outs)} output buffers")
        keys = check_keys(keys)
        got = self._scatter(self._group(keys), lambda sh, pos: sh.get_many_into(
            [keys[i] for i in pos], [outs[i] for i in pos], kind=kind))
        return [got[i] for i in range(len(keys))]

    def direct_write_stats(self) -> dict:
        """Per shard URL: that client's direct writes (``RemoteStore.direct_write_stats``)."""
        return {u: s.direct_write_stats() for u, s in zip(self.urls, self.shards)}

    def direct_stats(self) -> dict:
        """Per shard URL: that client's direct reads (``RemoteStore.direct_stats``)."""
        return {u: s.direct_stats() for u, s in zip(self.urls, self.shards)}

    def _by_key(self, op: str, keys: Sequence[bytes], kind: str) -> list[bool]:
        keys = check_keys(keys)
        got = self._scatter(self._group(keys),
                            lambda sh, pos: getattr(sh, op)([keys[i] for i in pos], kind=kind))
        return [got[i] for i in range(len(keys))]

    def delete_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._by_key("delete_many", keys, kind)

    def pin_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._by_key("pin_many", keys, kind)

    def unpin_many(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        return self._by_key("unpin_many", keys, kind)

    # ------------------------------------------------------------------ lookup
    def _probe_all(self, keys: list[bytes], *, one_chain: bool = False) -> tuple[bytes, bytes]:
        """``probe`` of every key, each asked of the shard that owns it (all shards at once).

        ``one_chain`` (``keys`` is one chain): each shard may stop at its first key without a
        live block (``until_miss``); the keys it did not answer stay 0. That changes no walk:
        the chain's first miss is the earliest of the shards' first misses, and every key
        before it was answered by its shard. So each shard reads O(hit), not its whole share.
        """
        block, swa = np.zeros(len(keys), np.uint8), np.zeros(len(keys), np.uint8)
        groups = self._group(keys)
        got = self._per_shard(groups, lambda sh, pos: sh.probe([keys[i] for i in pos], until_miss=one_chain))
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
        flat: list[bytes] = []
        bounds: list[tuple[int, int]] = []
        for c in chains:
            start = len(flat)
            flat.extend(check_keys(c))
            bounds.append((start, len(flat)))
        block, swa = self._probe_all(flat, one_chain=len(chains) == 1)
        return [self._walk(block[a:b], swa[a:b]) for a, b in bounds]

    # ------------------------------------------------------------------ maintenance
    def _each(self, fn: Callable[[RemoteStore], Any]) -> list[Any]:
        return list(self._pool.map(fn, self.shards))

    def stats(self) -> dict:
        per = self._each(lambda s: s.stats())
        out: dict[str, Any] = {}
        for st in per:
            _sum_into(out, {k: st.get(k, 0) for k in ("entries", "used_bytes", "capacity_bytes", "lost_entries",
                                                      "graveyard_entries", "by_kind", "counters")})
        out["shards"] = dict(zip(self.urls, per))
        return out

    def gc(self, *, dry_run: bool = False) -> dict:
        per = self._each(lambda s: s.gc(dry_run=dry_run))
        out: dict[str, Any] = {}
        for g in per:
            _sum_into(out, g)
        out["shards"] = dict(zip(self.urls, per))
        return out

    def check(self, fix: bool = False) -> list:
        per = self._each(lambda s: s.check(fix=fix))
        return [replace(p, target=f"{url}/{p.target}" if p.target else url) for url, ps in zip(self.urls, per)
                for p in ps]

    def repair(self) -> dict:
        out: dict[str, Any] = {}
        for r in self._each(lambda s: s.repair()):
            _sum_into(out, r)
        return out

    def close(self) -> None:
        for s in self.shards:
            s.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> "ShardedStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
