"""The streaming batch RPCs (GetStream, PutStream) and the hand encoders behind them.

The behaviour suite (test_behaviour.py) already runs every batch call of the remote and
sharded stores through the streams; these tests pin what is particular to them: the
encoders equal protobuf's own, chunking keeps order, and the size and count limits of a PutStream fail loudly and store nothing.
"""

from __future__ import annotations

import hashlib
import os

import grpc
import pytest

import kvstore
from kvstore import InvalidRequest, Layout, PutItem
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.data_rpc import GET_STREAM_CHUNK_BYTES, GET_STREAM_WINDOW
from kvstore.errors import RequestTooLarge
from kvstore.wire import MD_STREAM_ITEMS, encode_get_chunk, encode_get_reply, encode_item, fitting_runs, put_parts


def K(i: int | str) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


VALUES = [b"", b"x", os.urandom(300), os.urandom(200_000)]
LAYOUTS = [Layout("uint8", (7,)), Layout("float16", (2, 0, 3)), Layout("int32", ())]


@pytest.mark.parametrize("ttl", [None, 0.5, 1e9])
@pytest.mark.parametrize("tokens", [0, 1, 2**31])
def test_put_encoding_is_protobufs(ttl, tokens) -> None:
    for v in VALUES:
        for lay in LAYOUTS:
            head, tail = put_parts(K(1), len(v), "swa", ttl, lay, tokens)
            want = pb.PutRequest(key=K(1), value=v, kind="swa", tokens=tokens,
                                 layout=pb.Layout(dtype=lay.dtype, shape=lay.shape))
            if ttl is not None:
                want.ttl_s = ttl
            assert head + v + tail == want.SerializeToString()
            reply = pb.GetReply(value=v, tokens=tokens, kind="block", layout=pb.Layout(dtype=lay.dtype, shape=lay.shape))
            assert encode_get_reply(v, lay, tokens, "block") == reply.SerializeToString()


@pytest.mark.parametrize("index", [0, 1, 127, 128, 4095])
def test_get_chunk_encoding_is_protobufs(index) -> None:
    for vals in ([], [None], [b""], VALUES + [None]):
        want = pb.GetChunk(index=index, values=[pb.MaybeValue(found=False) if v is None else
                                                pb.MaybeValue(found=True, value=v) for v in vals])
        assert encode_get_chunk(index, vals) == want.SerializeToString()


def test_fitting_runs_split_puts_in_order_into_messages_that_fit() -> None:
    """What a direct-write piece that falls back to gRPC is sent as (kvstore.client.remote._send_fitting)."""
    encs = [encode_item(PutItem(K(i), b"x" * n)) for i, n in enumerate((100, 100, 300, 50, 1000, 10))]
    sizes = [e.nbytes for e in encs]
    assert fitting_runs([], 500) == []
    assert fitting_runs(encs, sum(sizes)) == [slice(0, 6)]  # all fit: one message, as before
    limit = sum(sizes[:3])  # the first three exactly fit
    assert sizes[4] > limit
    runs = fitting_runs(encs, limit)
    assert runs == [slice(0, 3), slice(3, 4), slice(4, 5), slice(5, 6)]  # the item over the limit alone
    assert fitting_runs(encs, limit - 1) == [slice(0, 2), slice(2, 4), slice(4, 5), slice(5, 6)]


def test_get_stream_keeps_order_across_windows_and_chunks(make_daemon) -> None:
    d = make_daemon()
    n = 3 * GET_STREAM_WINDOW + 1
    sizes = [0, 17, GET_STREAM_CHUNK_BYTES // 3, GET_STREAM_CHUNK_BYTES + 1]
    with kvstore.connect(d.address) as s:
        vals = {i: os.urandom(sizes[i % len(sizes)]) for i in range(n) if i % 5 != 3}  # every 5th-from-3 missing
        assert all(s.put_many([PutItem(K(i), v) for i, v in vals.items()]))
        keys = [K(i) for i in range(n)]
        assert s.get_many(keys) == [vals.get(i) for i in range(n)]
        assert s.get_many(keys[::-1]) == [vals.get(i) for i in reversed(range(n))]
        assert s.check() == []


def test_put_stream_over_the_size_limit_stores_nothing(make_daemon) -> None:
    d = make_daemon(max_message_bytes=1024 * 1024)
    items = [PutItem(K(i), os.urandom(400 * 1024)) for i in range(3)]  # each fits, together they do not
    with kvstore.connect(d.address) as s:  # the daemon's limit
        with pytest.raises(RequestTooLarge, match="max_message_bytes"):
            s.put_many(items)
        assert s.get_many([it.key for it in items]) == [None] * 3
    with kvstore.connect(d.address, max_message_bytes=512 * 1024) as s:  # the client's own, before sending
        with pytest.raises(RequestTooLarge, match="client's max_message_bytes"):
            s.put_many(items[:2])
        assert s.put_many(items[:1]) == [True]
        assert s.check() == []


def test_put_stream_bad_item_or_too_many_items_store_nothing(make_daemon) -> None:
    d = make_daemon(max_batch_items=8)
    ch = grpc.insecure_channel(d.address.split("://")[1])
    call = ch.stream_unary("/kvstore.v1.KVStore/PutStream")
    good = [pb.PutRequest(key=K(i), value=b"v").SerializeToString() for i in range(3)]
    for msgs in (good + [pb.PutRequest(key=K(9), value=b"v", kind="bogus").SerializeToString()],
                 good + [b"\xff\xff\xff"],
                 [pb.PutRequest(key=K(i), value=b"v").SerializeToString() for i in range(9)]):
        with pytest.raises(grpc.RpcError) as ei:
            call(iter(msgs), timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ch.close()
    with kvstore.connect(d.address) as s:
        assert s.stats()["entries"] == 0
        with pytest.raises(InvalidRequest, match="max_batch_items"):  # the daemon refuses 9 keys ...
            s._rpc.call("GetMany", pb.GetManyRequest(keys=[K(i) for i in range(9)]))
        assert s.get_many([K(i) for i in range(9)]) == [None] * 9  # ... the client learns its limit and splits
        assert s.put_many([PutItem(K(i), b"v") for i in range(8)]) == [True] * 8
        assert s.check() == []


def test_a_client_gone_mid_put_stream_is_not_logged_as_a_daemon_bug(make_daemon, caplog) -> None:
    """A client that cancels (or dies) while sending a PutStream: the daemon stores nothing of
    it and logs the call as cancelled; before, "PutStream failed" was logged as an ERROR with a
    traceback and counted INTERNAL, as if the daemon had a bug.

    The client declares its item count, as ``kvstore.client.remote`` does: gRPC's server sometimes
    sees a cancel landing mid-stream as the stream's end, and stored the items sent so far
    (CI caught it once in ~1,000 runs); the declared count tells the two apart."""
    import logging
    import threading
    import time

    d = make_daemon()
    ch = grpc.insecure_channel(d.address.split("://")[1])
    call = ch.stream_unary("/kvstore.v1.KVStore/PutStream")
    sent, release = threading.Event(), threading.Event()

    def msgs():
        yield pb.PutRequest(key=K(1), value=b"v").SerializeToString()
        sent.set()
        release.wait(10)  # the call is cancelled while the daemon waits for the next message

    caplog.set_level(logging.INFO, logger="kvstore")
    fut = call.future(msgs(), timeout=10, metadata=((MD_STREAM_ITEMS, "2"),))
    assert sent.wait(10)
    time.sleep(0.3)
    fut.cancel()
    release.set()
    ch.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and 'code="CANCELLED"' not in _metric_lines(d, "PutStream"):
        time.sleep(0.05)
    assert 'code="CANCELLED"' in _metric_lines(d, "PutStream")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [r.getMessage() for r in caplog.records]
    with kvstore.connect(d.address) as s:
        assert s.stats()["entries"] == 0


def test_a_put_stream_short_of_or_over_its_declared_count_stores_nothing(make_daemon) -> None:
    """The declared count (``MD_STREAM_ITEMS``) is held to: a stream that ends early is a client
    that went away (CANCELLED), one that sends more or declares nonsense is refused
    (INVALID_ARGUMENT), and a count over max_batch_items is refused before any item is read."""
    d = make_daemon(max_batch_items=8)
    ch = grpc.insecure_channel(d.address.split("://")[1])
    call = ch.stream_unary("/kvstore.v1.KVStore/PutStream")
    msgs = [pb.PutRequest(key=K(i), value=b"v").SerializeToString() for i in range(3)]
    for declared, code in (("4", grpc.StatusCode.CANCELLED), ("2", grpc.StatusCode.INVALID_ARGUMENT),
                           ("-1", grpc.StatusCode.INVALID_ARGUMENT), ("three", grpc.StatusCode.INVALID_ARGUMENT),
                           ("9", grpc.StatusCode.INVALID_ARGUMENT)):
        with pytest.raises(grpc.RpcError) as ei:
            call(iter(msgs), timeout=10, metadata=((MD_STREAM_ITEMS, declared),))
        assert ei.value.code() == code, declared
    assert 'code="CANCELLED"' in _metric_lines(d, "PutStream")
    assert call(iter(msgs), timeout=10, metadata=((MD_STREAM_ITEMS, "3"),)) is not None
    ch.close()
    with kvstore.connect(d.address) as s:
        assert s.stats()["entries"] == 3  # only the stream that matched its count
        assert s.put_many([PutItem(K(i), b"v") for i in range(3, 11)]) == [True] * 8  # the client declares


def _metric_lines(d, method: str) -> str:
    from prometheus_client import generate_latest

    return "\n".join(line for line in generate_latest(d.metrics.registry).decode().splitlines()
                     if f'method="{method}"' in line and "requests_total" in line)


def test_get_many_over_the_message_limit_stops_reading_before_it_holds_every_value(make_daemon) -> None:
    """A unary GetMany holds its values until the one reply is built: one key asked 100 times
    decoded every copy before gRPC refused the reply (hundreds of MiB for 3 MiB x 100). Now it
    reads a window at a time and stops once the reply is over max_message_bytes."""
    d = make_daemon(max_message_bytes=4 << 20)
    with kvstore.connect(d.address) as s:
        s.put(K(1), os.urandom(1 << 20))
        before = d.store.counters["bytes_out"]
        with pytest.raises(RequestTooLarge, match="GetMany reply"):
            s._rpc.call("GetMany", pb.GetManyRequest(keys=[K(1)] * 100))
        assert d.store.counters["bytes_out"] - before <= 16 << 20  # at most a few windows read, not 100 MiB
        assert s.get_many([K(1)] * 3) == [s.get(K(1))] * 3  # the stream form serves repeats as before


def test_idle_put_streams_hold_one_tenants_slots_for_a_bounded_time(make_daemon) -> None:
    """PutStreams that send nothing held a handler thread each, outside the limiter, for ever:
    a few of them stalled every tenant. Now a stream is admitted before it is received
    (beyond the tenant's limit: RESOURCE_EXHAUSTED at once) and cancelled when not wholly
    received within stream_receive_s, so the daemon keeps serving."""
    import threading
    import time

    d = make_daemon(workers=4, max_concurrent_requests=3, max_concurrent_per_tenant=2, stream_receive_s=1.0)
    ch = grpc.insecure_channel(d.address.split("://")[1])
    call = ch.stream_unary("/kvstore.v1.KVStore/PutStream")
    release = threading.Event()

    def nothing():
        release.wait(20)
        return
        yield  # noqa: unreachable - a generator that sends nothing

    futs = [call.future(nothing(), timeout=30) for _ in range(4)]
    try:
        t0 = time.monotonic()
        codes = []
        for f in futs:
            try:
                f.result(timeout=15)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())
        assert time.monotonic() - t0 < 10
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 2  # over the tenant's two slots
        assert codes.count(grpc.StatusCode.CANCELLED) == 2  # cut at stream_receive_s
        with kvstore.connect(d.address, timeout_s=5) as s:
            assert s.put(K(1), b"v") and s.get(K(1)) == b"v"
            assert s.stats()["entries"] == 1
    finally:
        release.set()
        ch.close()


def test_get_streams_nobody_reads_hold_the_daemon_for_a_bounded_time(make_daemon) -> None:
    """gRPC's server waits for each streamed message to be taken by the client, so a GetStream
    whose client stopped reading held a handler thread and an admission slot for ever: a few
    of them stalled every tenant. Now a stream that can send nothing for stream_send_s
    is cancelled, so the daemon keeps serving; a reader that keeps up is not."""
    import time

    from kvstore.errors import ServerBusy

    d = make_daemon(workers=4, max_concurrent_requests=3, max_concurrent_per_tenant=3, stream_send_s=1.0)
    vals = {K(i): os.urandom(4 << 20) for i in range(8)}
    with kvstore.connect(d.address, timeout_s=30) as s:
        s.put_many([PutItem(k, v) for k, v in vals.items()])
    # BDP probing off: with it, the client's receive window grows with the loopback's measured
    # bandwidth (up to 32 MiB seen here, the whole 128 MiB stream once on CI, which then ended
    # normally), so "stopped reading" would depend on timing. Off, the window stays at 64 KiB.
    ch = grpc.insecure_channel(d.address.split("://")[1], options=[("grpc.max_receive_message_length", 64 << 20),
                                                                   ("grpc.http2.bdp_probe", 0)])
    call = ch.unary_stream("/kvstore.v1.KVStore/GetStream")
    req = pb.GetManyRequest(keys=list(vals) * 4).SerializeToString()
    try:
        stalled = [call(req, timeout=60) for _ in range(3)]  # every admission slot; none reads
        for it in stalled:
            next(it)  # the stream started, then its reader stops
        t0 = time.monotonic()
        with kvstore.connect(d.address, timeout_s=20) as s:
            while True:  # refused at once while the streams hold the slots, served once they are cut
                try:
                    assert s.get(K(0)) == vals[K(0)]
                    break
                except ServerBusy:
                    assert time.monotonic() - t0 < 15
                    time.sleep(0.1)
            got = s.get_many(list(vals) * 4)  # a reader that keeps up reads everything
            assert got == list(vals.values()) * 4
        for it in stalled:
            with pytest.raises(grpc.RpcError) as err:
                for _ in it:
                    pass
            assert err.value.code() == grpc.StatusCode.CANCELLED
    finally:
        ch.close()
