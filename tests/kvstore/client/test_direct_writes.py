"""Direct writes (kvstore.client.direct_writes): the client writes pack files itself, the daemon indexes them.

The behaviour suite (test_behaviour.py) runs every protocol call with direct writes on;
these tests pin what is particular to them: the bytes land in the daemon's targets as
its own batches do, keys are the tenant's stored keys, a failing pack or a refusing
daemon falls back to PutStream, Commit checks what it indexes (all or nothing), and a
batch that is never committed leaves only orphans that GC sweeps.
"""

from __future__ import annotations

import hashlib
import os
import time

import pytest

import kvstore
from kvstore import InvalidRequest, PutItem, StoreUnavailable
from kvstore.embedded.index import ekey
from kvstore.embedded.packs import WrittenEntry
from kvstore.proto import kvstore_pb2 as pb
from kvstore.errors import PermissionDenied
from kvstore.embedded.targets import pack_path
from tests.fragments import fragment_refs

from tests.kvstore.server.test_security import TOK_A, TOK_B, tokens_file  # noqa: F401 - a fixture


def K(i) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def pack_files(d) -> list[str]:
    return sorted(rel for t in d.store.targets.values() for rel, _s, _m in t.walk() if rel.endswith(".pack"))


def test_a_batch_is_written_here_and_indexed_by_the_daemon(make_daemon) -> None:
    d = make_daemon(allow_direct_writes=True)
    s = kvstore.connect(d.address, direct_writes="on")
    vals = {K(i): os.urandom(100_000 + i) for i in range(5)}
    assert s.put_many([PutItem(k, v, ttl_s=3600, tokens=7) for k, v in vals.items()]) == [True] * 5
    assert s.put(K("single"), b"one") is True  # a put is a batch of one
    st = s.direct_write_stats()
    assert st["active"] and st["counters"]["direct_writes"] == 6 and st["counters"]["commits"] == 2, st
    assert d.store.counters["puts"] == 6  # indexed by the daemon's store, nothing through PutStream
    refs = fragment_refs(d.store, K(0))
    assert all(r.packed for r in refs) and len({r.target for r in refs}) == 6
    assert len(pack_files(d)) == 12  # two batches, one pack per target each
    with kvstore.connect(d.address) as plain:  # the daemon's own read path verifies every fragment
        assert plain.get_many(list(vals)) == list(vals.values()) and plain.get(K("single")) == b"one"
        e = plain.get_entry(K(3))
        assert e.tokens == 7
    m = d.store.locate([ekey(1, K(0))])[0]
    assert 3500e9 < m.expires_ns - m.created_ns <= 3600e9  # the TTL applied on the daemon's clock
    assert s.check() == []
    s.close()


def test_a_re_put_is_false_and_its_unused_pack_is_removed(make_daemon) -> None:
    d = make_daemon(allow_direct_writes=True)
    s = kvstore.connect(d.address, direct_writes="on")
    items = [PutItem(K(i), b"v%d" % i) for i in range(4)]
    assert s.put_many(items) == [True] * 4
    before = pack_files(d)
    assert s.put_many(items + [items[0]]) == [False] * 5  # live keys, and a repeat inside the batch
    assert pack_files(d) == before  # the second batch's packs went: none of its entries was indexed
    assert d.store.counters["puts_deduplicated"] == 4
    assert s.put_many([items[1], PutItem(K("new"), b"n")]) == [False, True]
    assert s.get(K("new")) == b"n" and s.check() == []
    loser = d.store.locate([ekey(1, K(1))])[0]  # the same size as its copy in the new pack
    assert d.store.stats()["pack_dead_bytes"] == 6 * loser.frag_len  # that copy is dead from the start
    s.close()


def test_a_repeated_key_over_the_size_limit_refuses_the_batch(make_daemon) -> None:
    """A repeat of a key inside a batch stores nothing but is checked like any item, as the
    embedded store does. Before, direct writes skipped the repeat unchecked, so a batch whose
    repeat was over max_value_bytes was stored instead of refused."""
    d = make_daemon(allow_direct_writes=True, max_value_bytes=65536)
    s = kvstore.connect(d.address, direct_writes="on")
    with pytest.raises(InvalidRequest, match="over max_value_bytes=65536"):
        s.put_many([PutItem(K(1), b"small"), PutItem(K(1), b"x" * 65537)])
    assert s.get_many([K(1)]) == [None] and pack_files(d) == []  # nothing stored, nothing left behind
    with pytest.raises(InvalidRequest, match="ttl_s"):
        s.put_many([PutItem(K(1), b"small"), PutItem(K(1), b"x", ttl_s=-1)])
    assert s.put_many([PutItem(K(1), b"small"), PutItem(K(1), b"x" * 65536)]) == [True, False]
    assert s.direct_write_stats()["counters"]["direct_writes"] == 1
    s.close()


def test_tenants_keys_are_their_stored_keys(make_daemon, tokens_file) -> None:  # noqa: F811
    d = make_daemon(allow_direct_writes=True, tokens_file=tokens_file)
    a = kvstore.connect(d.address, token=TOK_A, direct_writes="on")
    b = kvstore.connect(d.address, token=TOK_B, direct_writes="on")
    prompt = [K(f"prompt{i}") for i in range(4)]
    assert a.put_many([PutItem(k, b"A%d" % i) for i, k in enumerate(prompt)]) == [True] * 4
    assert a.direct_write_stats()["counters"]["direct_writes"] == 4
    with kvstore.connect(d.address, token=TOK_A) as a_plain:  # read through the daemon: headers name its keys
        assert a_plain.get_many(prompt) == [b"A%d" % i for i in range(4)]
        assert a_plain.lookup(prompt).hit_blocks == 4
    assert b.lookup(prompt).hit_blocks == 0 and b.get_many(prompt) == [None] * 4
    assert b.put_many([PutItem(k, b"B") for k in prompt]) == [True] * 4  # B's own entries, not a dedup
    assert a.get(prompt[0]) == b"A0" and b.get(prompt[0]) == b"B"
    with pytest.raises(kvstore.NotFound):  # neither is stored under the client's key
        d.store.get(prompt[0])
    for c in (a, b):
        c.close()


def test_a_direct_writer_cannot_declare_its_way_under_the_quota(make_daemon, tokens_file) -> None:  # noqa: F811
    """Commit charges the tenant at least each entry's stored bytes (bound to the fragments the
    daemon checks), not the plain size the writer declares. Before, a writer declaring
    plain_len=0 stored 1 MB under a 100 KB quota, charged 0; and Commit indexed an entry too
    large for any Get within max_message_bytes (a put through gRPC is refused)."""
    import kvstore.client.direct_writes as dw
    from kvstore import CapacityExceeded

    d = make_daemon(allow_direct_writes=True, tokens_file=tokens_file, tenant_quota_bytes=100_000)
    b = kvstore.connect(d.address, token=TOK_B, direct_writes="on")
    writer = next(v for v in vars(b).values() if isinstance(v, dw.DirectWrites))
    real = writer._call

    def lying(method, req):  # the only change: declare plain_len = 0
        if method == "Commit":
            for e in req.entries:
                e.plain_len = 0
        return real(method, req)

    writer._call = lying
    with pytest.raises(Exception, match="inconsistent sizes"):  # 30 KB of entry cannot hold 0 bytes of payload
        b.put(K("q"), os.urandom(30_000))
    assert b.lookup([K("q")]).hit_blocks == 0 and d.quota.used("tenant-b") == 0
    for i in range(20):  # compressible: the lie passes the size checks, and is charged the entry bytes
        assert b.put(K(f"q{i}"), b"x" * 30_000)
    with d.store.index.env.begin() as txn:
        entry_bytes = sum(d.store.index.unpack(txn, raw).entry_len for _, raw in d.store.index.iter_db(txn, "entries"))
    assert d.quota.used("tenant-b") == entry_bytes > 20 * 62
    with pytest.raises(CapacityExceeded):  # and the honest client is held to the quota as before
        b_plain = kvstore.connect(d.address, token=TOK_B)
        b_plain.put(K("honest"), os.urandom(150_000))
    b_plain.close()
    b.close()
    d2 = make_daemon(allow_direct_writes=True, max_message_bytes=64 * 1024)
    with kvstore.connect(d2.address, direct_writes="on") as c:
        with pytest.raises(kvstore.errors.KVStoreError):
            c.put(K("big"), os.urandom(200_000))
        assert c.lookup([K("big")]).hit_blocks == 0  # not indexed: no Get could ever return it


def test_a_daemon_that_does_not_allow_them_gets_puts_over_grpc(make_daemon) -> None:
    d = make_daemon()  # allow_direct_writes defaults to false
    with kvstore.connect(d.address, direct_writes="on") as s:
        assert s.put_many([PutItem(K(i), b"x") for i in range(3)]) == [True] * 3
        st = s.direct_write_stats()
        assert not st["active"] and "allow_direct_writes" in st["reason"], st
        assert s.get(K(1)) == b"x"
    with kvstore.connect(d.address) as s:  # Commit itself is refused
        with pytest.raises(PermissionDenied):
            s._rpc.call("Commit", pb.CommitRequest())


def test_a_failing_pack_goes_through_the_daemon(make_daemon, monkeypatch) -> None:
    d = make_daemon(allow_direct_writes=True)
    s = kvstore.connect(d.address, direct_writes="on")
    assert s.put(K("warm"), b"w")  # Describe done, the writer open
    w = s._direct_w.writer()
    victim = w.targets["t2"]

    def broken(rel, data, *, fsync):
        raise OSError(5, "I/O error (injected)")

    monkeypatch.setattr(victim, "write", broken)
    vals = {K(i): os.urandom(50_000) for i in range(6)}
    assert s.put_many([PutItem(k, v) for k, v in vals.items()]) == [True] * 6
    assert s._direct_w.stats()["counters"]["fallbacks"] == 6
    assert s.get_many(list(vals)) == list(vals.values())
    assert s.check() == []  # the failed pack's other files were removed, not left as orphans
    assert len(pack_files(d)) == 6 + 6  # the warm-up's packs and the daemon's own batch
    s.close()


def test_a_pack_the_daemon_rejects_goes_through_the_daemon(make_daemon, monkeypatch) -> None:
    d = make_daemon(allow_direct_writes=True)
    s = kvstore.connect(d.address, direct_writes="on")
    assert s.put(K("warm"), b"w")
    victim = s._direct_w.writer().targets["t3"]
    write = victim.write

    def short_write(rel, data, *, fsync):  # a target that silently keeps only part of a write
        write(rel, b"".join(data)[:100], fsync=fsync)

    monkeypatch.setattr(victim, "write", short_write)
    vals = {K(i): os.urandom(20_000) for i in range(3)}
    assert s.put_many([PutItem(k, v) for k, v in vals.items()]) == [True] * 3
    c = s.direct_write_stats()["counters"]
    assert c["rejected_packs"] == 1 and c["fallbacks"] == 3 and c["direct_writes"] == 1, c
    assert d.store.counters["rejected_packs"] == 1  # the daemon's count (and metric) of them
    assert s.get_many(list(vals)) == list(vals.values())
    assert s.check() == []  # the rejected pack was removed from every target
    s.close()


def test_a_batch_never_committed_leaves_only_orphans(make_daemon, monkeypatch) -> None:
    d = make_daemon(allow_direct_writes=True, orphan_grace_s=0.5)
    s = kvstore.connect(d.address, direct_writes="on")
    assert s.put(K("warm"), b"w")

    def lost(method, req, *a, **kw):  # the client dies (or the daemon goes) before the commit lands
        raise StoreUnavailable(f"{method}: connection lost (injected)")

    monkeypatch.setattr(s._direct_w, "_call", lost)
    with pytest.raises(StoreUnavailable):
        s.put_many([PutItem(K(i), b"v") for i in range(3)])
    assert len(pack_files(d)) == 12  # left in place: the commit may have happened
    assert s.lookup([K(0)]).hit_blocks == 0
    time.sleep(0.6)
    kinds = {p.kind.value for p in s.check()}
    assert kinds == {"orphan_fragment"}, kinds
    assert s.gc()["orphans"] == 6 and len(pack_files(d)) == 6 and s.check() == []
    s.close()


def test_commit_checks_everything_before_indexing_anything(make_daemon, tmp_path) -> None:
    d = make_daemon(allow_direct_writes=True)
    s = kvstore.connect(d.address, direct_writes="on")
    assert s.put_many([PutItem(K(i), b"x" * 1000) for i in range(2)]) == [True] * 2
    st = d.store
    good = st.locate([ekey(1, K(0))])[0]

    def copy_pack(age_s: float = 0.0) -> bytes:
        """A new pack holding a copy of K(0)'s fragments, written ``age_s`` ago."""
        g = os.urandom(8)
        for name, off in zip(good.targets, good.offsets):
            st.targets[name].write(pack_path(g), st.targets[name].read(pack_path(good.gen))[off:off + good.frag_len],
                                   fsync=False)
            if age_s:
                os.utime(os.path.join(st.targets[name].root, pack_path(g)), (time.time() - age_s,) * 2)
        return g

    gen = copy_pack()

    def entry(key=K("new"), **over):
        f = dict(ek=ekey(1, key), k=good.k, m=good.m, tokens=0, plain_len=good.plain_len,
                 entry_len=good.entry_len, frag_len=good.frag_len, gen=gen, targets=good.targets,
                 offsets=(0,) * 6)
        f.update(over)
        return WrittenEntry(**f)

    invalid = {  # what only a wrong or malicious writer sends: all or nothing
        "erasure code": entry(k=3, m=3),
        "distinct targets": entry(targets=("t0",) * 6),
        "distinct targets ": entry(targets=(*good.targets[:5], "t99")),
        "pack offsets": entry(offsets=(0,) * 5),
        "inconsistent sizes": entry(frag_len=10),
        # sizes a quota charges must follow from the checked fragments (fragments far larger than
        # the entry they hold): before, a megabyte of fragments could be declared a 1-byte entry
        "inconsistent sizes ": entry(entry_len=1, plain_len=0, frag_len=good.frag_len + 1000),
    }
    for why, e in invalid.items():
        with pytest.raises(InvalidRequest, match=why.strip()):
            st.commit_written([entry(K("fine")), e])  # the fine one is not indexed either
    assert st.locate([ekey(1, K("fine")), ekey(1, K("new"))]) == [None, None]
    # What storage faults (or another writer) cause is found per pack, and rejects the whole
    # commit: nothing indexed, as put_many (before, the others were indexed: part of a batch
    # stored while the rest could then be refused through the daemon).
    missing, stale = os.urandom(8), copy_pack(age_s=3600)  # stale: the orphan sweep may be deleting it
    fine, longer = copy_pack(), copy_pack()
    for name in good.targets:  # bytes no record names: kept alive, counted and charged nowhere
        with open(os.path.join(st.targets[name].root, pack_path(longer)), "ab") as f:
            f.write(b"\0" * 50_000)
    short = entry(K("short"), offsets=(10,) * 6)  # fragments not from pack gen's start (and past its end)
    r = st.commit_written([entry(K("fine"), gen=fine), entry(K("lost"), gen=missing), short,
                           entry(K("late"), gen=stale), entry(K("long"), gen=longer), entry(K("taken"), gen=good.gen)])
    assert r.created == [False] * 6 and set(r.rejected) == {fine, missing, gen, stale, longer, good.gen}
    assert "cannot be checked" in r.rejected[missing] and "end to end from its start" in r.rejected[gen]
    assert "orphan_grace_s" in r.rejected[stale] and "bytes; its entries make" in r.rejected[longer]
    assert "already holds indexed entries" in r.rejected[good.gen]
    assert "another pack of this commit was rejected" in r.rejected[fine]
    assert st.locate([ekey(1, K(n)) for n in ("fine", "lost", "short", "late", "long", "taken")]) == [None] * 6
    assert st.commit_written([entry(K("fine"), gen=fine)]).created == [True]  # alone, it is fine
    gen = copy_pack()
    assert st.commit_written([entry(K(0))]).created == [False]  # K(0) is live: not again
    gen = copy_pack()
    r = st.commit_written([entry(K(0)), entry()])  # two records on one range: its bytes counted twice
    assert r.created == [False, False] and "end to end from its start" in r.rejected[gen]
    assert st.commit_written([entry()]).created == [True]
    # The record is the daemon's truth; the read checks the fragments against it: these name K(0).
    with pytest.raises(kvstore.Unrecoverable):
        st.get(K("new"))
    assert st.get(K(0)) == b"x" * 1000
    view = s._rpc.call("Describe", pb.DescribeRequest()).writer_view
    with pytest.raises(InvalidRequest, match=f"written entry {K('w').hex()}: needs 6"):  # over the wire
        s._rpc.call("Commit", pb.CommitRequest(view=view, entries=[pb.WrittenEntry(  # too, nothing indexed; the
            key=K("w"), k=4, m=2, gen=b"12345678", targets=["t0"] * 6, offsets=[0] * 6, entry_len=1,  # key as sent
            frag_len=100)]))
    s.close()


def test_two_commits_of_one_new_generation_index_only_the_first(make_daemon, monkeypatch) -> None:
    """Two Commits naming one new generation (a writer copying a name it saw on the shared
    mount) both passed the "already taken" check, a read before the index transaction, and
    both were indexed: the second's records named the first's pack. The generation is checked
    again inside the transaction, so the commit that takes the lock second is rejected whole."""
    d = make_daemon(allow_direct_writes=True)
    s = kvstore.connect(d.address, direct_writes="on")
    assert s.put_many([PutItem(K(0), b"x" * 1000)]) == [True]
    st = d.store
    good = st.locate([ekey(1, K(0))])[0]
    gen = os.urandom(8)
    for name, off in zip(good.targets, good.offsets):
        st.targets[name].write(pack_path(gen), st.targets[name].read(pack_path(good.gen))[off:off + good.frag_len],
                               fsync=False)

    def entry(key: bytes) -> WrittenEntry:
        return WrittenEntry(ek=ekey(1, key), k=good.k, m=good.m, tokens=0, plain_len=good.plain_len,
                            entry_len=good.entry_len, frag_len=good.frag_len, gen=gen, targets=good.targets,
                            offsets=(0,) * 6)

    t0 = st.targets[good.targets[0]]
    real_stat = type(t0).stat
    first = {}

    def stat(self, rel):  # the second commit has read the index; the first commits in between
        if self is t0 and not first:
            first["r"] = None
            first["r"] = st.commit_written([entry(K("first"))])
        return real_stat(self, rel)

    monkeypatch.setattr(type(t0), "stat", stat)
    second = st.commit_written([entry(K("second"))])
    monkeypatch.undo()
    assert first["r"].created == [True] and not first["r"].rejected
    assert second.created == [False] and "already hold indexed entries" in second.rejected[gen]
    assert st.locate([ekey(1, K("second"))]) == [None]
    s.close()


def test_a_commit_that_waited_too_long_for_the_index_rejects_its_packs(make_daemon, tmp_path, monkeypatch) -> None:
    """A Commit whose index transaction got LMDB's write lock over half the orphan grace after
    its packs were written must not index them (GC may be sweeping them). Before, that was a
    StoreUnavailable for the whole put; now every pack is rejected, so the client puts the
    entries through the daemon and removes its packs, as for any rejected pack."""
    import time as _time

    from kvstore.config import load_config
    from kvstore.embedded.store import EmbeddedStore
    from tests.kvstore.conftest import FakeClock

    clock = FakeClock(_time.time())
    st = EmbeddedStore(load_config(None, env={}, data_dir=str(tmp_path / "d"), fsync=False, orphan_grace_s=60),
                       clock=clock)
    d = make_daemon(store=st, allow_direct_writes=True)
    s = kvstore.connect(d.address, direct_writes="on")
    real = st.index.env

    class SlowLock:  # the next write transaction starts 100 s later (another process held the lock)
        armed = True

        def begin(self, write=False, **kw):
            if write and SlowLock.armed:
                SlowLock.armed = False
                clock.advance(100)
            return real.begin(write=write, **kw)

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(st.index, "env", SlowLock())
    vals = {K(i): os.urandom(5000) for i in range(4)}
    assert s.put_many([PutItem(k, v) for k, v in vals.items()]) == [True] * 4
    counters = s.direct_write_stats()["counters"]
    assert counters["rejected_packs"] == 1 and counters["fallbacks"] == 4 and counters.get("direct_writes", 0) == 0
    assert s.get_many(list(vals)) == list(vals.values())
    assert len(set(pack_files(d))) == 1  # the client's pack went: only the daemon's own (the fallback) remains
    monkeypatch.undo()
    assert s.check() == []
    s.close()


def test_a_batch_is_all_or_nothing_and_a_refused_commit_leaves_no_packs(make_daemon, tokens_file) -> None:  # noqa: F811
    """Direct writes committed the chunks written here and sent only the failed one through the
    daemon, so when that was refused (here: over the quota) part of the batch stayed stored.
    And a Commit refused by the quota left its packs behind, unaccounted, until GC. Now a
    chunk that fails here sends the whole batch through the daemon, and a refused Commit
    removes its packs."""
    import kvstore.client.direct_writes as dw
    from kvstore import CapacityExceeded

    d = make_daemon(allow_direct_writes=True, tokens_file=tokens_file, tenant_quota_bytes=1_000_000,
                    pack_bytes=65536)
    a = kvstore.connect(d.address, token=TOK_A, direct_writes="on")
    assert a.put(K("warm"), b"w")
    w = next(v for v in vars(a).values() if isinstance(v, dw.DirectWrites))._current
    t = next(iter(w.targets.values()))
    real, calls = t.write, []

    def second_fails(rel, parts, **kw):  # one pack write of the batch fails here (EIO on a mount)
        calls.append(rel)
        if len(calls) == 2:
            raise OSError(5, "EIO")
        return real(rel, parts, **kw)

    t.write = second_fails
    with pytest.raises(CapacityExceeded):  # 1.2 MB over a 1 MB quota: the whole batch, through the daemon
        a.put_many([PutItem(K(i), os.urandom(600_000)) for i in range(2)])
    t.write = real
    assert a.get_many([K(0), K(1)]) == [None, None]  # nothing of it stored
    before = pack_files(d)
    with pytest.raises(CapacityExceeded):  # refused by the Commit itself
        a.put_many([PutItem(K(10 + i), os.urandom(300_000)) for i in range(4)])
    assert pack_files(d) == before  # its packs went with the refusal
    a.close()


def test_a_record_whose_tokens_are_not_the_entrys_is_never_read(make_daemon) -> None:
    """Commit indexes the writer's record; the fast read paths refused one whose token count
    is not the entry header's, the gRPC read path returned the header's while Locate and
    Inspect showed the record's. Every path now refuses it: it costs its writer the entry."""
    import kvstore.client.direct_writes as dw

    d = make_daemon(allow_direct_writes=True)
    s = kvstore.connect(d.address, direct_writes="on")
    writer = next(v for v in vars(s).values() if isinstance(v, dw.DirectWrites))
    real = writer._call

    def forged(method, req):
        if method == "Commit":
            for e in req.entries:
                e.tokens = 12345
        return real(method, req)

    writer._call = forged
    assert s.put(K("t"), b"v" * 5000, tokens=3)
    with kvstore.connect(d.address) as plain:
        with pytest.raises(kvstore.Unrecoverable):
            plain.get(K("t"))
        assert plain.put(K("t"), b"v" * 5000, tokens=3)  # lost: a re-put stores it right
        assert plain.get_entry(K("t")).tokens == 3
    s.close()


def test_direct_writes_take_what_a_put_over_grpc_takes(make_daemon) -> None:
    """The same values, the same results with direct writes on or off (a value within 4,096
    bytes of max_message_bytes was refused by Commit though a Put stores it, and a batch holding
    one was stored up to its piece). Commit takes what a Put could carry; an entry it refuses
    goes through gRPC; a value no message can carry is refused before anything is stored."""
    from kvstore.server.direct_rpc import PUT_FIELDS_BYTES
    from kvstore.errors import RequestTooLarge

    limit = 300_000
    d = make_daemon(allow_direct_writes=True, max_message_bytes=limit, max_batch_items=4)
    for mode in ("off", "on"):
        with kvstore.connect(d.address, direct_writes=mode, max_message_bytes=limit) as s:
            near = {K(f"{mode}{n}"): os.urandom(n) for n in (limit - PUT_FIELDS_BYTES, limit - 200)}
            for k, v in near.items():
                assert s.put(k, v) is True, (mode, len(v))
            vals = {K(f"{mode}-b{n}"): os.urandom(n) for n in (10, 20, 30, 40, 50, 60, 70, 80, limit - 2000)}
            assert s.put_many([PutItem(k, v) for k, v in vals.items()]) == [True] * 9, mode
            assert s.get_many([*near, *vals]) == [*near.values(), *vals.values()], mode
            over = {K(f"{mode}-o{n}"): os.urandom(n) for n in (10, 20, 30, 40, 50, 60, 70, 80, limit + 10)}
            with pytest.raises(RequestTooLarge):
                s.put_many([PutItem(k, v) for k, v in over.items()])
            assert s.get_many(list(over)) == [None] * 9, mode  # nothing of it stored
            if mode == "on":
                st = s.direct_write_stats()["counters"]
                assert st["direct_writes"] >= 9 and st["fallbacks"] >= 1, st


@pytest.mark.parametrize("route", ["Commit refuses an entry", "a pack fails", "direct writes turned off"])
def test_a_piece_that_falls_back_to_grpc_is_sent_in_messages_that_fit(make_daemon, monkeypatch, route) -> None:
    """With direct writes ``check_puts`` bounds each item by max_message_bytes, not each piece (a
    piece written directly may be any size). A piece that went through gRPC after all (Commit
    refused an entry, a pack failed, direct writes turned off) was sent whole and refused as over
    max_message_bytes after the earlier pieces were committed: part of the batch stored, the call
    failed. Such a piece now goes through gRPC in messages that fit: all of it stored."""
    from kvstore.server.direct_rpc import PUT_FIELDS_BYTES

    limit = 300_000
    d = make_daemon(allow_direct_writes=True, max_message_bytes=limit, max_batch_items=4)
    s = kvstore.connect(d.address, direct_writes="on", max_message_bytes=limit, max_batch_items=4)
    assert s.put(K("warm"), b"w")  # Describe done, the writer open
    w = s._direct_w.writer()
    if route == "a pack fails":  # the first piece's pack is written; the second piece's fails
        t = w.targets["t2"]
        real_write, writes = t.write, []

        def second_fails(rel, parts, **kw):
            writes.append(rel)
            if len(writes) > 1:
                raise OSError(5, "I/O error (injected)")
            return real_write(rel, parts, **kw)

        monkeypatch.setattr(t, "write", second_fails)
    elif route == "direct writes turned off":  # the daemon stops allowing them: every later piece over gRPC
        real_call = s._direct_w._call

        def refused(method, req):
            if method == "Commit":
                raise PermissionDenied("allow_direct_writes = false (injected)")
            return real_call(method, req)

        monkeypatch.setattr(s._direct_w, "_call", refused)
    big = limit - PUT_FIELDS_BYTES + 56 if route == "Commit refuses an entry" else 200_000
    sizes = (10, 20, 30, 40, big, 200_000, 50)  # pieces of 4 and 3 items; the second is over the limit in total
    vals = {K(f"v{i}"): os.urandom(n) for i, n in enumerate(sizes)}
    assert s.put_many([PutItem(k, v) for k, v in vals.items()]) == [True] * len(vals), route
    assert s.get_many(list(vals)) == list(vals.values()), route
    assert s._direct_w.stats()["counters"]["fallbacks"] >= (3 if route != "direct writes turned off" else 0)
    assert s.check() == []  # no pack of the fallen-back piece left behind
    s.close()


def test_a_fallen_back_piece_over_the_daemons_batch_limit_puts_each_item_once(make_daemon, monkeypatch) -> None:
    """A piece that falls back to gRPC is sent in messages that fit max_message_bytes. When the
    daemon's max_batch_items is lower than this client has learned yet, a later message was refused
    (BatchTooLarge) after an earlier one was stored, and the whole piece was re-sent in smaller
    pieces: the earlier items put twice, answered created=False though this call stored them.
    The refused message alone is now re-sent in pieces of the learned limit."""
    limit = 300_000
    d = make_daemon(allow_direct_writes=True, max_message_bytes=limit, max_batch_items=4)
    s = kvstore.connect(d.address, direct_writes="on", max_message_bytes=limit)  # max_batch_items: 4096
    assert s.put(K("warm"), b"w")
    def broken(rel, parts, **kw):  # every pack fails here: each piece goes through gRPC
        raise OSError(5, "I/O error (injected)")

    monkeypatch.setattr(s._direct_w.writer().targets["t2"], "write", broken)
    sizes = (299_000, 5_000, 10, 20, 30, 40)  # one piece of 6: messages of 1 item, then of 5 (over the daemon's 4)
    vals = {K(f"b{i}"): os.urandom(n) for i, n in enumerate(sizes)}
    assert s.put_many([PutItem(k, v) for k, v in vals.items()]) == [True] * len(vals)  # was [False, True, ...]
    assert s.get_many(list(vals)) == list(vals.values())
    assert s._rpc.batch_items == 4  # learned from the refusal
    assert s.check() == []
    s.close()


def test_commit_refuses_a_pack_whose_fragments_leave_a_gap(make_daemon, tokens_file) -> None:  # noqa: F811
    """A pack must hold its entries' fragments end to end from its start and nothing else: one
    whose single fragment sits 1 MiB in would make the daemon keep a megabyte per target that
    no record counts and no quota charges, for as long as the entry lives."""
    from kvstore.api import EntryKind
    from kvstore.keys import tenant_key

    d = make_daemon(allow_direct_writes=True, tokens_file=tokens_file, tenant_quota_bytes=100_000)
    with kvstore.connect(d.address, token=TOK_B) as b:
        desc = b._rpc.call("Describe", pb.DescribeRequest())
        gap, gen = 1 << 20, os.urandom(8)
        stored = tenant_key(K("gap"), bytes(desc.key_secret))
        enc = d.store.fragments.writer.encode(PutItem(stored, b"v" * 1000, EntryKind.BLOCK, None, None, 0), gen)
        m = enc.meta_base
        names = tuple(s.name for s in d.store.target_specs)[: len(enc.frames)]
        for name, frame in zip(names, enc.frames):
            d.store.targets[name].write(pack_path(gen), [b"\0" * gap, *frame], fsync=False)
        reply = b._rpc.call("Commit", pb.CommitRequest(view=desc.writer_view, entries=[pb.WrittenEntry(
            key=K("gap"), kind="block", k=m.k, m=m.m, tokens=0, plain_len=m.plain_len, entry_len=m.entry_len,
            frag_len=m.frag_len, gen=gen, targets=names, offsets=[gap] * len(names))]))
        assert list(reply.created) == [False] and list(reply.rejected_packs) == [gen]
        assert "end to end" in reply.reasons[0]
        assert b.get_many([K("gap")]) == [None] and d.quota.used("tenant-b") == 0


def test_a_commit_whose_eviction_finds_no_room_keeps_the_packs_of_what_it_indexed(make_daemon) -> None:
    """The daemon's eviction after a commit's index transaction may evict the commit's own last
    entries and raise ``CapacityExceeded`` (everything else is pinned). The first entries stay
    indexed, so the writer keeps their packs (``CapacityExceeded.created`` says which were): no
    record is left without its fragments, and the kept entry reads back."""
    d = make_daemon(allow_direct_writes=True, capacity_bytes=100_000, high_watermark=1.0, low_watermark=0.5,
                    delete_grace_s=0)
    with kvstore.connect(d.address) as plain:
        i = 0
        while d.store.used_bytes() < 74_000:  # pinned: room for one of the two entries below, not both
            assert plain.put(K(("pinned", i)), os.urandom(3_000)) and plain.pin(K(("pinned", i)))
            i += 1
    keys, vals = [K("a"), K("b")], [os.urandom(9_000), os.urandom(9_000)]
    with kvstore.connect(d.address, direct_writes="on") as s:
        with pytest.raises(kvstore.errors.CapacityExceeded) as ei:
            s.put_many([PutItem(k, v) for k, v in zip(keys, vals)])
        assert ei.value.created == [True, True] and s.direct_write_stats()["counters"]["direct_writes"] == 0
        live = [m is not None for m in d.store.locate([ekey(1, k) for k in keys])]
        assert live == [True, False]  # the put's last one evicted again
        assert s.get(keys[0]) == vals[0] and s.put(keys[0], b"again") is False
