"""One behaviour suite, three implementations: embedded, remote (one daemon), sharded over 3 daemons,
plus the remote store reading from and writing into the daemon's targets itself (``kvstore.client.direct_reads``,
``kvstore.client.direct_writes``).

Every test is written against ``kvstore.api.KVStore`` only; the ``store``
fixture supplies the implementation. Mutating tests end with ``check() == []``.
With direct reads and writes every read and put of this suite is served directly
(nothing is damaged here): the fixture checks that none fell back to the daemon.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import kvstore
from kvstore import EntryKind, InvalidRequest, Layout, LookupResult, NotFound, PutItem
from kvstore.errors import StoreClosed


def K(i: int | str) -> bytes:
    import hashlib

    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


@pytest.fixture(params=["embedded", "remote", "remote_direct", "sharded3"])
def store(request, tmp_path, make_daemon):
    if request.param == "embedded":
        s = kvstore.connect(str(tmp_path / "emb"), fsync=False)
    elif request.param == "remote":
        s = kvstore.connect(make_daemon().address)
    elif request.param == "remote_direct":
        s = kvstore.connect(make_daemon(allow_direct_writes=True).address, direct_reads="on", direct_writes="on")
    else:
        s = kvstore.connect(",".join(make_daemon().address for _ in range(3)))
    yield s
    s.close()
    if request.param == "remote_direct":
        for st in (s.direct_stats(), s.direct_write_stats()):
            assert st["mode"] == "on" and st["counters"].get("fallbacks", 0) == 0, st


def test_put_get_dedup(store) -> None:
    assert store.put(K(1), b"one") is True
    assert store.put(K(1), b"other bytes") is False  # live (kind, key): no second copy
    assert store.get(K(1)) == b"one"
    assert store.get(K(1), kind="block") == b"one"
    assert store.check() == []


def test_kinds_are_separate_identities(store) -> None:
    assert store.put(K(2), b"block") and store.put(K(2), b"window", kind="swa")
    assert store.get(K(2)) == b"block" and store.get(K(2), kind="swa") == b"window"
    assert store.delete(K(2), kind="swa") and store.get(K(2)) == b"block"
    with pytest.raises(NotFound):
        store.get(K(2), kind=EntryKind.SWA)


def test_numpy_layout_and_tokens_round_trip(store) -> None:
    a = np.arange(24, dtype=np.float16).reshape(2, 3, 4)
    assert store.put(K(3), a, tokens=512)
    e = store.get_entry(K(3))
    assert e.layout == Layout("float16", (2, 3, 4)) and e.tokens == 512 and e.key == K(3)
    assert np.array_equal(e.array(), a)


def test_large_value(store) -> None:
    v = os.urandom(6 * 1024 * 1024 + 7)
    assert store.put(K(4), v)
    assert store.get(K(4)) == v


def test_delete(store) -> None:
    store.put(K(5), b"x")
    assert store.delete(K(5)) is True
    assert store.delete(K(5)) is False
    with pytest.raises(NotFound):
        store.get(K(5))
    with pytest.raises(KeyError):  # NotFound is a KeyError too
        store.get(K(5))
    assert store.put(K(5), b"y") is True and store.get(K(5)) == b"y"


def test_lookup_longest_prefix_and_swa(store) -> None:
    chain = [K(f"c{i}") for i in range(12)]
    assert store.lookup(chain) == LookupResult(0, None)
    store.put_many([PutItem(k, b"kv%d" % i) for i, k in enumerate(chain[:8])])
    assert store.lookup(chain) == LookupResult(8, None)
    store.put(chain[3], b"w3", kind="swa")
    store.put(chain[9], b"w9", kind="swa")  # beyond the hit: never reported
    r = store.lookup(chain)
    assert r == LookupResult(8, 4) and not r.swa_at_boundary
    store.put(chain[7], b"w7", kind="swa")
    assert store.lookup(chain).swa_at_boundary
    store.delete(chain[5])
    assert store.lookup(chain) == LookupResult(5, 4)
    assert store.lookup([]) == LookupResult(0, None)
    assert store.lookup_many([chain, chain[:2], [K("nope")]]) == [
        LookupResult(5, 4), LookupResult(2, None), LookupResult(0, None)]
    assert store.check() == []


def test_lookup_has_no_side_effect_and_ignores_lost_expired(store) -> None:
    store.put(K("t0"), b"a", ttl_s=0.3)
    store.put(K("t1"), b"b")
    assert store.lookup([K("t0"), K("t1")]).hit_blocks == 2
    time.sleep(0.45)
    assert store.lookup([K("t0"), K("t1")]).hit_blocks == 0
    with pytest.raises(NotFound):
        store.get(K("t0"))


def test_pin_unpin(store) -> None:
    assert store.pin(K(6)) is False
    store.put(K(6), b"p")
    assert store.pin(K(6)) is True and store.unpin(K(6)) is True
    assert store.unpin(K("absent")) is False


def test_get_many_and_put_many(store) -> None:
    items = [PutItem(K(f"m{i}"), bytes([i]) * (i + 1)) for i in range(20)]
    items.append(PutItem(K("m0"), b"dup in batch"))
    created = store.put_many(items)
    assert created == [True] * 20 + [False]
    assert store.put_many(items[:3]) == [False, False, False]
    got = store.get_many([K("m3"), K("missing"), K("m19")])
    assert got == [bytes([3]) * 4, None, bytes([19]) * 20]
    assert store.get_many([]) == [] and store.put_many([]) == []
    assert store.stats()["entries"] == 20


def test_read_into_caller_buffers(store) -> None:
    from kvstore.api import read_into

    keys = [K(f"ri{i}") for i in range(3)]
    vals = [os.urandom(1000 + i) for i in range(3)]
    assert store.put_many([PutItem(k, v) for k, v in zip(keys, vals)]) == [True] * 3
    outs = [bytearray(2000) for _ in range(4)]
    infos = read_into(store, keys + [K("ri-missing")], outs)
    assert [None if i is None else (i.key, i.nbytes) for i in infos] == [
        (k, len(v)) for k, v in zip(keys, vals)] + [None]
    assert all(bytes(outs[i][: len(v)]) == v for i, v in enumerate(vals))
    with pytest.raises(InvalidRequest):
        read_into(store, keys[:1], [bytearray(10)])  # too small for the entry
    assert store.check() == []


def test_errors_are_typed(store) -> None:
    with pytest.raises(InvalidRequest):
        store.put(b"short", b"x")
    with pytest.raises(InvalidRequest):
        store.get(b"\x00" * 17)
    with pytest.raises(InvalidRequest):
        store.put(K(7), b"x", kind="nonsense")
    with pytest.raises(InvalidRequest):
        store.put(K(7), "not bytes")
    with pytest.raises(InvalidRequest):
        store.put(K(7), b"x", ttl_s=-1)
    with pytest.raises(InvalidRequest):
        store.put(K(7), b"abc", layout=Layout("float32", (1,)))
    # Dims past int64 (the wire's) or not integers: refused alike; before, the embedded store
    # raised struct.error and the remote one stored shape (0, 0) (the varint wrapped).
    for shape in ((2**64, 0), (2**63, 0), (0, 1.5)):
        with pytest.raises(InvalidRequest, match="layout shape"):
            store.put(K(7), b"", layout=Layout("float32", shape))
    with pytest.raises(NotFound):
        store.get(K(7))
    with pytest.raises(InvalidRequest):
        store.put_many([PutItem(K(8), b"ok"), PutItem(b"bad", b"x")])
    assert store.get_many([K(8)]) == [None]  # the bad batch stored nothing
    # Items that are not PutItem (a (key, value) tuple): InvalidRequest naming PutItem, on every
    # store; the remote and sharded clients raised AttributeError before.
    with pytest.raises(InvalidRequest, match="PutItem"):
        store.put_many([PutItem(K(8), b"ok"), (K(9), b"x")])
    assert store.get_many([K(8), K(9)]) == [None, None]
    for bad in (None, PutItem(K(8), b"ok"), b"bytes"):  # not a list of items: the same, on every store
        with pytest.raises(InvalidRequest, match="list of kvstore.PutItem"):
            store.put_many(bad)
    assert store.put_many(PutItem(K(i), b"g") for i in (10, 11)) == [True, True]  # any iterable of them
    with pytest.raises(ValueError):  # InvalidRequest is a ValueError
        store.lookup([b"x"])


def test_gc_check_stats(store) -> None:
    for i in range(5):
        store.put(K(f"g{i}"), os.urandom(1000))
    store.delete(K("g0"))
    st = store.stats()
    assert st["entries"] == 4 and st["used_bytes"] > 0
    g = store.gc()
    assert {"expired", "evicted", "purged", "orphans", "reclaimed_bytes"} <= set(g)
    assert store.gc(dry_run=True)["expired"] == 0
    assert store.check() == [] and store.check(fix=True) == []


def test_put_fields_are_checked_alike(store) -> None:
    """``ttl_s`` and ``tokens`` are refused alike on every store, whether the key is new or
    live, alone or in a batch. Before, the remote and sharded clients sent tokens of 2**64 + 5
    (stored as 5) and ttl_s=True (a one-second TTL), and raised TypeError for ttl_s="5";
    the embedded store let a re-put of a live key through with tokens of 2**32."""
    import decimal

    assert store.put(K("live"), b"x")
    for key in (K("new"), K("live")):
        for bad in ({"ttl_s": True}, {"ttl_s": "5"}, {"ttl_s": [1]}, {"ttl_s": 1j}, {"ttl_s": decimal.Decimal(5)},
                    {"ttl_s": float("inf")}, {"tokens": 2**32}, {"tokens": 2**64 + 5}, {"tokens": True},
                    {"tokens": -1}, {"tokens": 1.0}):
            with pytest.raises(InvalidRequest):
                store.put(key, b"x", **bad)
            with pytest.raises(InvalidRequest):
                store.put_many([PutItem(K("other"), b"y"), PutItem(key, b"x", **bad)])
    assert store.get_many([K("new"), K("other")]) == [None, None]
    assert store.put(K("new"), b"x", ttl_s=2.5, tokens=2**32 - 1)
    assert store.get_entry(K("new")).tokens == 2**32 - 1


def test_closed_store_refuses(tmp_path, store) -> None:
    """Every call of a closed store raises ``StoreClosed``, empty batches included. Before,
    the sharded client raised RuntimeError from its batches, lookups and maintenance, and
    the remote and sharded clients answered empty batches as if open."""
    store.close()
    with pytest.raises(StoreClosed):
        store.get(K(1))
    for call in (lambda: store.get_many([K(1)]), lambda: store.get_many([]), lambda: store.put_many([]),
                 lambda: store.put_many([PutItem(K(1), b"x")]), lambda: store.lookup([K(1)]),
                 lambda: store.lookup([]), lambda: store.lookup_many([[K(1)], [K(2)]]), lambda: store.lookup_many([]),
                 store.stats, store.gc, store.check, lambda: store.delete(K(1)), lambda: store.pin(K(1))):
        with pytest.raises(StoreClosed):
            call()
    # Closed is said first, whatever else is wrong with the call (before, the clients checked
    # the key first and raised InvalidRequest for a bad one).
    bad = b"short"
    for call in (lambda: store.get(bad), lambda: store.get_entry(bad), lambda: store.put(bad, b"x"),
                 lambda: store.put(K(1), "not bytes"), lambda: store.delete(bad), lambda: store.pin(bad),
                 lambda: store.unpin(bad), lambda: store.lookup([bad]), lambda: store.lookup_many([[bad]]),
                 lambda: store.get_many([bad]), lambda: store.get_many_into([bad], [bytearray(1)])):
        with pytest.raises(StoreClosed):
            call()


@pytest.mark.parametrize("keys", [None, 5, b"k" * 16, "text"])
def test_a_batch_that_is_not_a_sequence_of_keys_is_invalid(store, keys) -> None:
    """Not a list of keys: ``InvalidRequest`` from every store (the embedded one raised
    TypeError for None or an int)."""
    for call in (lambda: store.get_many(keys), lambda: store.get_many_into(keys, []), lambda: store.lookup(keys)):
        with pytest.raises(InvalidRequest, match="sequence of 16-byte keys"):
            call()
