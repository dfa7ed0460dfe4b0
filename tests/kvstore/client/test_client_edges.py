"""Edges where the remote and sharded clients must behave exactly as the embedded store:
bytes-like keys, a bad value in a batch that spans pieces or shards, too-small buffers in
``get_many_into``, ``close`` racing calls in flight, and an unknown kind in an empty batch.

Each test compares with an embedded store, or with what ``kvstore.api`` promises of every
store: one typed error (a ``kvstore.errors`` class), raised before anything is changed.
"""

from __future__ import annotations

import hashlib
import threading
import time

import grpc
import pytest

import kvstore
from kvstore import InvalidRequest, PutItem
from kvstore.errors import StoreClosed
from kvstore.client.remote import RemoteStore


def K(i: int | str) -> bytes:
    return hashlib.blake2b(f"edge-{i}".encode(), digest_size=16).digest()


def embedded(tmp_path, **over):
    return kvstore.connect(str(tmp_path / "emb"), fsync=False, **over)


def raised(fn) -> tuple[type, str]:
    """(class, message) of what ``fn()`` raises; fails when it returns."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test compares the class itself
        return type(exc), str(exc)
    pytest.fail(f"{fn} raised nothing")


def calls_of(store: RemoteStore) -> list[str]:
    """The unary calls ``store`` makes from now on, by method name."""
    seen: list[str] = []
    inner = store._rpc.call

    def spy(method, *a, **kw):
        seen.append(method)
        return inner(method, *a, **kw)

    store._rpc.call = spy
    return seen


@pytest.fixture(params=["remote", "remote_direct", "sharded"])
def client(request, make_daemon):
    """A remote client (also with direct reads and writes) or a 3-shard client, each daemon
    with ``max_value_bytes=1000``; the client sends batches in pieces of at most 3 items."""
    if request.param == "sharded":
        s = kvstore.connect(",".join(make_daemon(max_value_bytes=1000).address for _ in range(3)),
                            max_batch_items=3)
    elif request.param == "remote_direct":
        s = kvstore.connect(make_daemon(max_value_bytes=1000, allow_direct_writes=True).address,
                            direct_reads="on", direct_writes="on", max_batch_items=3)
    else:
        s = kvstore.connect(make_daemon(max_value_bytes=1000).address, max_batch_items=3)
    yield s
    s.close()


# ----------------------------------------------------------------------------- defect 1: bytes-like keys
def test_sharded_batches_take_bytes_like_keys(make_daemon) -> None:
    """Before: ``put_many`` raised ``TypeError`` (memoryview + bytes while placing the key)."""
    with kvstore.connect(",".join(make_daemon().address for _ in range(3))) as s:
        keys = [K(i) for i in range(6)]
        like = [memoryview(k) if i % 2 else bytearray(k) for i, k in enumerate(keys)]
        assert s.put_many([PutItem(k, b"v%d" % i) for i, k in enumerate(like)]) == [True] * 6
        assert s.put_many([PutItem(memoryview(keys[0]), b"again")]) == [False]
        assert s.get_many(like) == [b"v%d" % i for i in range(6)]
        outs = [bytearray(4) for _ in keys]
        assert [i.nbytes for i in s.get_many_into(like, outs)] == [2] * 6
        assert [s.owner(k) for k in like] == [s.owner(k) for k in keys]
        assert s.lookup(like).hit_blocks == 6
        assert s.delete_many(like) == [True] * 6


# ----------------------------------------------------------------------------- defect 2: a bad value in a batch
def test_oversized_value_in_a_spanning_batch_stores_nothing(client, tmp_path) -> None:
    """Before: the pieces (or shards) before the bad value's were stored, then it raised."""
    items = [PutItem(K(f"big{i}"), b"x" * 10) for i in range(8)]
    items[6] = PutItem(K("big6"), b"x" * 2000)  # in the third piece (3 items each), on some shard
    with embedded(tmp_path, max_value_bytes=1000) as emb:
        want = raised(lambda: emb.put_many(items))
    assert want[0] is InvalidRequest
    assert raised(lambda: client.put_many(items)) == want
    assert client.get_many([it.key for it in items]) == [None] * 8  # nothing stored anywhere
    if hasattr(client, "shards"):
        assert len({client.owner(it.key) for it in items}) > 1  # the batch did span shards


def test_value_limit_asked_once_and_only_for_spanning_batches(make_daemon) -> None:
    d = make_daemon(max_value_bytes=1000)
    with kvstore.connect(d.address, max_batch_items=3) as s:
        seen = calls_of(s)
        with pytest.raises(InvalidRequest, match="max_value_bytes=1000"):
            s.put(K("one"), b"x" * 2000)  # the daemon refuses it: no extra call
        with pytest.raises(InvalidRequest, match="max_value_bytes=1000"):
            s.put_many([PutItem(K("a"), b"a"), PutItem(K("b"), b"x" * 2000)])  # one piece: all or nothing there
        assert s.get_many([K("a")]) == [None]
        assert "Describe" not in seen
        bad = [PutItem(K(f"p{i}"), b"x" * (2000 if i == 4 else 1)) for i in range(5)]
        for _ in range(2):
            with pytest.raises(InvalidRequest, match="max_value_bytes=1000"):
                s.put_many(bad)
        assert seen.count("Describe") == 1  # asked once, kept
        assert s.put_many([PutItem(K(f"ok{i}"), b"y") for i in range(7)]) == [True] * 7


def test_value_limit_learned_from_a_refused_piece(make_daemon) -> None:
    """A client at the default piece size learns the daemon's lower ``max_batch_items`` from a
    refusal; the re-split batch then spans pieces and is checked whole before any is sent."""
    d = make_daemon(max_value_bytes=1000, max_batch_items=5)
    with kvstore.connect(d.address) as s:
        items = [PutItem(K(f"r{i}"), b"v") for i in range(8)]
        items[6] = PutItem(K("r6"), b"x" * 2000)
        with pytest.raises(InvalidRequest, match="value of 2000 bytes is over max_value_bytes=1000"):
            s.put_many(items)
        assert s.get_many([it.key for it in items]) == [None] * 8


class _Unimplemented(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNIMPLEMENTED

    def details(self):
        return "Method not found!"

    def trailing_metadata(self):
        return ()


# ----------------------------------------------------------------------------- defect 3: get_many_into buffers
@pytest.mark.parametrize("bad", [1, 7])
def test_get_many_into_too_small_buffer_writes_nothing(client, tmp_path, bad) -> None:
    """9 keys in pieces of 3 (and over 3 shards): a too-small buffer in the first or the last
    piece raises the embedded store's error, naming it as the caller does, with every buffer
    untouched; so does a read-only one, before any call."""
    keys = [K(f"into{i}") for i in range(9)]
    items = [PutItem(k, bytes([65 + i]) * 50) for i, k in enumerate(keys)]
    client.put_many(items)

    def outs():
        o = [bytearray(b"\xee" * 60) for _ in keys]
        o[bad] = bytearray(b"\xee" * 10)
        return o

    with embedded(tmp_path) as emb:
        emb.put_many(items)
        want = raised(lambda: emb.get_many_into(keys, outs()))
    assert want[0] is InvalidRequest and f"outs[{bad}] holds 10 bytes" in want[1]
    got = outs()
    assert raised(lambda: client.get_many_into(keys, got)) == want
    assert got == outs()  # not one byte written, in any buffer
    # A read-only buffer is refused (named as the caller numbers it) before any call.
    ro = outs()
    ro[bad] = bytes(60)
    with embedded(tmp_path) as emb:
        want = raised(lambda: emb.get_many_into(keys, ro))
    assert want == (InvalidRequest, f"outs[{bad}] is read-only; pass a writable buffer")
    assert raised(lambda: client.get_many_into(keys, ro)) == want
    assert ro[0] == bytearray(b"\xee" * 60)
    infos = client.get_many_into(keys + [K("absent")], [bytearray(50) for _ in keys] + [bytearray(1)])
    assert [i.nbytes for i in infos[:-1]] == [50] * 9 and infos[-1] is None


# ----------------------------------------------------------------------------- defect 4: close racing calls
@pytest.mark.parametrize("kind", ["remote", "remote_direct", "sharded"])
def test_close_racing_calls_raises_store_closed(make_daemon, kind) -> None:
    """8 threads calling one client, ``close`` a few ms in, 40 times (at most ~8 s): every
    call that fails fails with ``StoreClosed``, never with gRPC's or a stopped pool's error."""
    if kind == "sharded":
        url = ",".join(make_daemon().address for _ in range(2))
        opts = {}
    else:
        url = make_daemon().address
        opts = {"direct_reads": "on"} if kind == "remote_direct" else {}
    keys = [K(f"race{i}") for i in range(16)]
    with kvstore.connect(url, **opts) as s:
        s.put_many([PutItem(k, b"z" * 4096) for k in keys])
    seen: dict[str, int] = {}
    lock = threading.Lock()

    def work(c, t: int) -> None:
        ops = (lambda: c.get_many(keys), lambda: c.get_many_into(keys, [bytearray(4096) for _ in keys]),
               lambda: c.lookup(keys), lambda: c.put_many([PutItem(k, b"z") for k in keys]))
        for _ in range(300):
            try:
                ops[t % len(ops)]()
            except Exception as exc:  # noqa: BLE001 - every kind is recorded and checked below
                with lock:
                    name = type(exc).__name__ + ("" if isinstance(exc, StoreClosed) else f": {exc}")
                    seen[name] = seen.get(name, 0) + 1
                return

    deadline = time.monotonic() + 8
    for _ in range(40):
        c = kvstore.connect(url, **opts)
        threads = [threading.Thread(target=work, args=(c, t)) for t in range(8)]
        for t in threads:
            t.start()
        time.sleep(0.005)
        c.close()
        for t in threads:
            t.join(10)
        if time.monotonic() > deadline:
            break
    assert set(seen) <= {"StoreClosed"}, seen  # before: ValueError('Channel closed!'), StoreUnavailable


# ----------------------------------------------------------------------------- defect 5: kind of an empty batch
def test_unknown_kind_refused_in_an_empty_batch(client, tmp_path) -> None:
    """Before: ``[]`` came back (the kind was parsed only when there were keys)."""
    with embedded(tmp_path) as emb:
        want = raised(lambda: emb.get_many([], kind="bogus"))
        assert want[0] is InvalidRequest
        assert raised(lambda: emb.get_many_into([], [], kind="bogus")) == want
        assert raised(lambda: emb.delete(K(0), kind="bogus")) == want  # no delete_many there: the same kind check
    for name, call in (("get_many", lambda s: s.get_many([], kind="bogus")),
                       ("get_many_into", lambda s: s.get_many_into([], [], kind="bogus")),
                       ("delete_many", lambda s: s.delete_many([], kind="bogus")),
                       ("pin_many", lambda s: s.pin_many([], kind="bogus")),
                       ("unpin_many", lambda s: s.unpin_many([], kind="bogus"))):
        assert raised(lambda: call(client)) == want, name
