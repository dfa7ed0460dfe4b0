"""Segments (``kvstore.embedded.segments``): puts append to one open file per target, a pack that
grows. What must hold: single puts and batches share the process's segment and read back; a
segment is sealed past ``segment_bytes``, on a failed append (the put then goes fragment by
fragment) and at close; a sealed segment in which nothing was indexed is removed; a segment GC
or an orphan sweep removed while it was still appended to is never indexed into (the put writes
again, into a new one); what no record names is counted dead once the segment is retired;
a purged entry's blocks are given back at once; concurrent puts share flushes and all read
back; ``rebuild-index`` reads segments with a torn tail; a new process appends to a new segment."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

import kvstore
from kvstore import PutItem
from kvstore.embedded import segments as S
from kvstore.embedded.index import ekey
from kvstore.embedded.targets import pack_path, parse_pack_path

from tests.fragments import fragment_refs
from tests.kvstore.conftest import assert_clean, value_for


def _segment_files(store) -> dict[bytes, list[Path]]:
    out: dict[bytes, list[Path]] = {}
    for t in store.targets.values():
        for p in Path(t.root).rglob("*.pack"):
            out.setdefault(parse_pack_path(str(p.relative_to(t.root))), []).append(p)
    return out


def _meta(store, key):
    with store.index.env.begin() as txn:
        return store.index.get_meta(txn, ekey(1, key))


def held(path) -> list[str]:
    """This process's descriptors open on files under ``path``."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(str(path)):
                out.append(fd)
        except OSError:  # the listing's own descriptor, closed meanwhile
            pass
    return out


def test_single_puts_and_batches_append_to_one_segment_and_read_back(data_dir, keys):
    with kvstore.connect(str(data_dir), fsync=False) as s:
        for k in keys[:10]:
            assert s.put(k, value_for(k, 9000))
        assert s.put_many([PutItem(k, value_for(k, 9000)) for k in keys[10:30]]) == [True] * 20
        files = _segment_files(s)
        assert len(files) == 1 and len(next(iter(files.values()))) == 6  # one segment, a file per target
        gen = next(iter(files))
        for k in keys[:30]:
            m = _meta(s, k)
            assert m.gen == gen and m.aligned and all(o % S.ALIGN == 0 for o in m.offsets)
            assert len(set(m.targets)) == 6
        assert s.get_many(keys[:30]) == [value_for(k, 9000) for k in keys[:30]]
        assert s.stats()["counters"]["segments_started"] == 1
        assert_clean(s)


def test_a_segment_is_sealed_past_segment_bytes_and_at_close_and_a_new_process_starts_its_own(data_dir, keys):
    with kvstore.connect(str(data_dir), fsync=False, segment_bytes=20_000, compression="none") as s:
        for k in keys[:12]:
            assert s.put(k, os.urandom(16_000))  # 4 KiB fragments: a segment file passes 20 kB on its fifth
        gens = {_meta(s, k).gen for k in keys[:12]}
        assert len(gens) >= 3 and s.stats()["counters"]["segments_started"] == len(gens)
    with kvstore.connect(str(data_dir), fsync=False) as s:
        assert s.put(keys[20], b"later")
        assert _meta(s, keys[20]).gen not in gens  # never appended to another process's (or a closed) one
        assert s.get(keys[20]) == b"later" and all(s.get(k) is not None for k in keys[:12])
        assert_clean(s)


@pytest.mark.parametrize("failures", [1, 2], ids=["then-a-new-segment", "then-fragment-files"])
def test_a_failing_append_seals_the_segment_and_an_unindexed_sealed_one_is_removed(data_dir, keys, monkeypatch,
                                                                                  failures):
    """A failed append seals its segment; the put appends once more to a new one, and if that
    fails too it is written fragment by fragment. Sealed segments in which nothing was indexed
    are removed; everything reads back."""
    with kvstore.connect(str(data_dir), fsync=False) as s:
        real = S._pwrite_all
        calls = {"n": 0, "failed": 0}

        def failing(fd, parts, offset):
            calls["n"] += 1
            if calls["n"] % 3 == 0 and calls["failed"] < failures:  # the third fragment of a try
                calls["failed"] += 1
                raise OSError(5, "Input/output error (injected)")
            return real(fd, parts, offset)

        monkeypatch.setattr(S, "_pwrite_all", failing)
        assert s.put(keys[0], value_for(keys[0]))
        m = _meta(s, keys[0])
        assert s.stats()["counters"]["segment_write_failures"] == failures
        if failures == 1:
            assert m.aligned and s.stats()["counters"]["segments_started"] == 2
            assert list(_segment_files(s)) == [m.gen]  # the failed one held nothing indexed: removed
        else:
            assert m.offsets == () and not m.aligned  # written as one file per fragment instead
            assert _segment_files(s) == {}
        assert s.put(keys[1], value_for(keys[1]))  # the next put appends again
        assert _meta(s, keys[1]).aligned
        assert s.get_many(keys[:2]) == [value_for(k) for k in keys[:2]]
        assert_clean(s)


def test_a_segment_gc_removed_while_appended_to_is_not_indexed_into(data_dir, keys, clock):
    """All of the active segment's records deleted and purged: GC removes its files, though this
    process still holds them open. The next put must not index into the unlinked files (its
    flush finds them unlinked): it writes again, into a new segment, and reads back after the
    store is reopened."""
    with kvstore.connect(str(data_dir), fsync=False, clock=clock, delete_grace_s=0, orphan_grace_s=0) as s:
        assert s.put(keys[0], value_for(keys[0]))
        gen = _meta(s, keys[0]).gen
        assert s.delete(keys[0])
        s.gc()
        assert gen not in _segment_files(s)  # removed with its last record
        assert s.put(keys[1], value_for(keys[1]))
        assert _meta(s, keys[1]).gen != gen
        assert s.stats()["counters"]["segments_started"] == 2
    with kvstore.connect(str(data_dir), fsync=False) as s:
        assert s.get(keys[1]) == value_for(keys[1])
        assert_clean(s)


def test_a_segment_gc_removes_between_a_puts_flush_and_its_commit_is_not_indexed_into(data_dir, keys, clock,
                                                                                       monkeypatch):
    """The same removal after the put's appends were flushed and checked, before its index
    transaction: the transaction finds the segment's pack record gone (GC removed the files with
    it), indexes nothing, and the put writes again into a new segment."""
    with kvstore.connect(str(data_dir), fsync=False, clock=clock, delete_grace_s=0, orphan_grace_s=0) as s:
        assert s.put(keys[0], value_for(keys[0]))
        gen = _meta(s, keys[0]).gen
        writer = s.fragments.writer
        real = writer.append_entries
        raced = []

        def then_gc(entries, since):
            real(entries, since)
            if not raced:  # the first try only
                raced.append(True)
                assert s.delete(keys[0])
                s.gc()
                assert gen not in _segment_files(s)

        monkeypatch.setattr(writer, "append_entries", then_gc)
        assert s.put(keys[1], value_for(keys[1]))
        assert raced and _meta(s, keys[1]).gen not in (gen, None)
        assert s.get(keys[1]) == value_for(keys[1])
        assert_clean(s)


def test_an_idle_unindexed_segment_taken_by_an_orphan_sweep_is_not_indexed_into(data_dir, keys, clock, monkeypatch):
    """A segment whose first put lost its only race holds nothing indexed; idle past the orphan
    grace, a sweep removes it. The next put appends to the unlinked
    files: its index commit sees the sweep and the put writes again into a new segment."""
    with kvstore.connect(str(data_dir), fsync=False, orphan_grace_s=0) as s:
        seg = s.fragments.writer.segments.acquire(0)  # as a put whose entries were not indexed leaves it
        s.fragments.writer.segments.append(seg, {"t0": [[b"x" * 100]]})
        s.fragments.writer.segments.release(seg, indexed=False)
        assert s.gc()["orphans"] == 1  # a sweep (in this process or another) takes it
        assert not Path(s.targets["t0"].root, pack_path(seg.gen)).exists()
        assert s.put(keys[0], value_for(keys[0]))
        assert _meta(s, keys[0]).gen != seg.gen
        assert s.get(keys[0]) == value_for(keys[0])
        assert_clean(s)


def test_what_no_record_names_is_counted_dead_when_the_segment_is_retired(data_dir, keys, monkeypatch):
    with kvstore.connect(str(data_dir), fsync=False, compression="none") as s:
        assert s.put(keys[0], os.urandom(8000))
        gen = _meta(s, keys[0]).gen
        with pytest.raises(kvstore.InvalidRequest):  # a bad item late in a batch: earlier chunks appended
            s.put_many([PutItem(k, os.urandom(8000)) for k in keys[1:4]] + [PutItem(keys[4], "not bytes")])
        with s.index.env.begin() as txn:
            before = s.index.pack_info(txn, gen)
    with kvstore.connect(str(data_dir), fsync=False) as s:
        with s.index.env.begin() as txn:
            refs, nbytes, dead = s.index.pack_info(txn, gen)
        assert refs == 1 and dead == nbytes - before[1] + before[2]
        assert s.get(keys[0]) is not None and s.get_many(keys[1:5]) == [None] * 4
        assert_clean(s)


def test_a_purged_entrys_blocks_are_given_back_at_once(data_dir, keys, clock):
    with kvstore.connect(str(data_dir), fsync=False, clock=clock, delete_grace_s=0, compression="none",
                         pack_compact_ratio=1.0) as s:
        assert s.put_many([PutItem(k, os.urandom(64_000)) for k in keys[:8]]) == [True] * 8
        files = next(iter(_segment_files(s).values()))
        used = sum(os.stat(p).st_blocks for p in files)
        for k in keys[:6]:
            assert s.delete(k)
        assert s.gc()["purged"] == 6
        freed = used - sum(os.stat(p).st_blocks for p in files)
        assert freed * 512 >= 6 * 64_000 * 6 // 4  # 512-byte st_blocks: at least the six entries' fragments
        assert s.get_many(keys[6:8]) == [s.get(k) for k in keys[6:8]] and None not in s.get_many(keys[6:8])
        assert_clean(s)


def test_concurrent_puts_share_flushes_and_all_read_back(data_dir, keys):
    with kvstore.connect(str(data_dir), fsync=True) as s:
        errors = []

        def worker(i):
            try:
                for k in keys[i * 10:(i + 1) * 10]:
                    assert s.put(k, value_for(k, 5000))
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors
        c = s.stats()["counters"]
        assert c["segments_started"] == 1 and 0 < c["segment_syncs"] <= 40
        assert s.get_many(keys[:40]) == [value_for(k, 5000) for k in keys[:40]]
        assert_clean(s)


def test_rebuild_index_reads_segments_with_a_torn_tail(data_dir, keys, capsys):
    from kvstore.cli.kvtool import main as kvtool

    with kvstore.connect(str(data_dir), fsync=False) as s:
        assert s.put_many([PutItem(k, value_for(k, 7000)) for k in keys[:10]]) == [True] * 10
        assert s.put(keys[10], value_for(keys[10], 7000))
        files = next(iter(_segment_files(s).values()))
    for p in files:  # an append in flight at a crash: part of a frame past the last indexed one
        with open(p, "ab") as fh:
            fh.write(b"\0" * 100 + files[0].read_bytes()[:60])
    (data_dir / "index" / "data.mdb").write_bytes(b"\0" * 4096)  # the index damaged
    with pytest.raises(kvstore.CorruptData, match="rebuild-index"):
        kvstore.connect(str(data_dir), fsync=False)
    assert kvtool([str(data_dir), "rebuild-index"]) == 0
    assert "11 entries" in capsys.readouterr().out
    with kvstore.connect(str(data_dir), fsync=False) as s:
        assert s.get_many(keys[:11]) == [value_for(k, 7000) for k in keys[:11]]
        assert s.put(keys[11], b"after")  # into a new segment
        assert_clean(s)


def test_fragment_refs_cover_segments(data_dir, keys):
    """The fault tests' helper finds an appended entry's fragments inside its segment."""
    with kvstore.connect(str(data_dir), fsync=False) as s:
        assert s.put(keys[0], value_for(keys[0]))
        refs = fragment_refs(s, keys[0])
        assert len(refs) == 6 and all(r.packed and r.offset % S.ALIGN == 0 for r in refs)


def test_a_failed_flush_fails_every_write_it_covered_also_for_those_waiting_on_it():
    """The kernel reports a writeback error once: a caller whose writes a failed flush covered
    must fail too, not flush again and be told they are durable."""
    calls = []

    def flush():
        calls.append(1)
        if len(calls) == 1:
            raise OSError(5, "Input/output error (injected)")

    fl = S._Flusher(flush)
    sa, sb = fl.begin(), fl.begin()
    a, b = fl.written(), fl.written()
    with pytest.raises(OSError):
        fl.flush(a, sa)
    with pytest.raises(OSError, match="a flush covering this write failed"):
        fl.flush(b, sb)  # covered by the failed flush: no second flush
    assert len(calls) == 1
    sc = fl.begin()
    c = fl.written()
    assert fl.flush(c, sc) and len(calls) == 2  # a write after it flushes as usual
    assert not fl.flush(c, sc)  # and is not flushed twice


def test_a_failed_flush_fails_a_write_that_started_before_it_failed_though_counted_after_it_began():
    """A write finished while a flush ran but took its ticket after the flush had started: the
    failed writeback may have taken its pages (and the kernel reports that once), so it fails
    too, rather than flushing again over lost pages and being told it is durable."""
    calls = []

    def flush():
        calls.append(1)
        if len(calls) == 1:
            sb = fl.begin()  # put B starts writing while A's flush runs,
            box.append((sb, fl.written()))  # and finishes before that flush reports its error
            raise OSError(5, "Input/output error (injected)")

    box: list[tuple[int, int]] = []
    fl = S._Flusher(flush)
    sa = fl.begin()
    a = fl.written()
    with pytest.raises(OSError, match="injected"):
        fl.flush(a, sa)
    (sb, b), = box
    assert b > a  # not covered by the failed flush's count of finished writes
    with pytest.raises(OSError, match="a flush covering this write failed"):
        fl.flush(b, sb)
    assert len(calls) == 1


def test_a_segment_gc_removes_is_not_held_open_by_the_reader(data_dir, keys, clock):
    """The reader keeps pack descriptors open (``kvstore.embedded.openfiles``); GC removing a
    segment with its last record closes the reader's descriptor at once, and the writer's goes
    when its next put finds the file removed, so the space comes back."""

    with kvstore.connect(str(data_dir), fsync=False, clock=clock, delete_grace_s=0) as s:
        assert s.put(keys[0], value_for(keys[0]))
        assert s.get(keys[0]) == value_for(keys[0])  # its descriptors kept
        m = _meta(s, keys[0])
        path = Path(s.targets[m.targets[0]].root, pack_path(m.gen))
        assert len(held(path)) == 2  # the writer's and the reader's
        assert s.delete(keys[0])
        s.gc()
        assert not path.exists() and len(held(path)) == 1  # the reader's closed
        assert s.put(keys[1], value_for(keys[1]))
        assert held(path) == [] and s.get(keys[1]) == value_for(keys[1])


def test_a_segment_that_fills_up_is_retired_by_its_last_put(data_dir, keys, clock):
    """A segment past ``segment_bytes`` is sealed when its last put releases it (or when the
    next put finds it full) and retired then: its descriptors close, so a rolled-over segment
    GC removes gives its space back, and what no record names in it is counted dead."""
    with kvstore.connect(str(data_dir), fsync=False, segment_bytes=20_000, compression="none", clock=clock,
                         delete_grace_s=0) as s:
        retired = []
        segs = s.fragments.writer.segments
        real = segs._retire
        segs._retire = lambda seg: (retired.append(seg.gen), real(seg))[1]
        for k in keys[:12]:
            assert s.put(k, os.urandom(16_000))
        gens = {_meta(s, k).gen for k in keys[:12]}
        assert len(gens) >= 3 and set(retired) == gens  # each full at its put's release
        assert held(data_dir / "targets") == []  # the reader keeps none yet: nothing was read
        first = [k for k in keys[:12] if _meta(s, k).gen == _meta(s, keys[0]).gen]
        path = Path(s.targets[_meta(s, keys[0]).targets[0]].root, pack_path(_meta(s, keys[0]).gen))
        for k in first:
            assert s.delete(k)
        s.gc()
        assert not path.exists() and held(path) == []


def test_a_key_put_again_into_the_active_segment_goes_to_a_new_one(data_dir, keys, clock):
    """A record names its segment's generation, and two records of one key must never name the
    same one (compaction and the pack's member records tell records apart by it): a key deleted
    and put again while its segment is active starts a new segment. The old record's purge then
    leaves the new one's member record, and compaction still moves it."""
    with kvstore.connect(str(data_dir), fsync=False, clock=clock, delete_grace_s=0, orphan_grace_s=0,
                         compression="none") as s:
        assert s.put(keys[0], b"v1" * 3000)
        assert s.put(keys[1], b"other" * 1000)
        g = _meta(s, keys[0]).gen
        assert s.delete(keys[0])
        assert s.put(keys[0], b"v2" * 3000)
        g2 = _meta(s, keys[0]).gen
        assert g2 != g
        s.gc()  # purges the old record of keys[0]
        with s.index.env.begin() as txn:
            assert ekey(1, keys[0]) in s.index.pack_members(txn, g2)
            assert ekey(1, keys[0]) not in s.index.pack_members(txn, g)
        moved = s.fragments.rewrite([(ekey(1, keys[0]), _meta(s, keys[0]))])
        assert moved and _meta(s, keys[0]).gen != g2 and s.get(keys[0]) == b"v2" * 3000
        assert_clean(s)


def test_compaction_racing_a_delete_and_put_again_keeps_the_new_value(data_dir, keys, clock):
    """Compaction copies a record, then replaces it only if it did not change meanwhile (same
    generation). A key deleted and put again while the copy runs lands in another segment, so
    the acknowledged new value stays."""
    with kvstore.connect(str(data_dir), fsync=False, clock=clock, delete_grace_s=30, orphan_grace_s=0,
                         compression="none") as s:
        k = keys[0]
        assert s.put(k, b"A" * 20_000)
        assert s.put(keys[1], b"B" * 20_000)
        reader = s.fragments.reader
        real = reader.read_verified
        done = []

        def racing(ek, m, *args):
            out = real(ek, m, *args)
            if not done and ek == ekey(1, k):
                done.append(1)
                assert s.delete(k)
                assert s.put(k, b"C" * 20_000)  # acknowledged
            return out

        reader.read_verified = racing
        s.fragments.rewrite([(ekey(1, k), _meta(s, k))])
        reader.read_verified = real
        assert done and s.get(k) == b"C" * 20_000


def test_a_write_that_finished_during_a_failed_flush_is_not_reported_durable(data_dir, monkeypatch):
    """Put B's bytes are written while put A's ``fdatasync`` runs and fails: the kernel dropped
    B's pages with A's and reports the error once, so B's own flush would succeed over nothing.
    B fails instead (modelled with an ``fdatasync`` that behaves as Linux's)."""
    with kvstore.connect(str(data_dir), fsync=False) as s:
        segs = S.Segments(s.targets, segment_bytes=1 << 30, sync_mode=lambda: "file", count=lambda *a, **k: None)
        seg = segs.acquire(0)
        dirty: set[bytes] = set()
        lost: set[bytes] = set()
        fails = {"left": 1}
        b_written, go_on = threading.Event(), threading.Event()

        def fdatasync(fd):
            if fails["left"]:
                fails["left"] -= 1
                lost.update(dirty)  # writeback failed: the pages are clean again, their data gone
                dirty.clear()
                raise OSError(5, "Input/output error (injected)")
            dirty.clear()

        real_pwrite = S._pwrite_all

        def pwrite(fd, parts, off):
            real_pwrite(fd, parts, off)
            tag = bytes(parts[0])[:1]
            dirty.add(tag)
            if tag == b"b":  # B's bytes written, its ticket not taken yet
                b_written.set()
                go_on.wait(10)

        monkeypatch.setattr(os, "fdatasync", fdatasync)
        monkeypatch.setattr(S, "_pwrite_all", pwrite)
        app_a = segs.append(seg, {"t0": [[b"a" * 100]]})
        out = {}

        def put_b():
            app_b = segs.append(seg, {"t0": [[b"b" * 100]]})
            try:
                segs.make_durable(seg, app_b)
                out["b"] = "durable"
            except OSError as exc:
                out["b"] = exc

        tb = threading.Thread(target=put_b)
        tb.start()
        assert b_written.wait(10)
        with pytest.raises(OSError, match="injected"):
            segs.make_durable(seg, app_a)  # A's flush fails, taking B's pages with it
        go_on.set()
        tb.join(10)
        assert b"b" in lost and isinstance(out["b"], OSError)
        segs.release(seg, indexed=False)
        segs.close()


def test_a_segment_counts_as_indexed_from_its_first_commit_not_its_release(data_dir, keys, clock):
    """Put P1 commits the first record into a new segment; before P1 has released it, that
    record is deleted and purged, so GC removes the segment's files. Put P2, which appended to
    the segment before, must not be indexed into the removed files: the segment counts as
    indexed from P1's commit, so P2's commit requires its pack record, finds none, and P2
    writes again into a new segment."""
    with kvstore.connect(str(data_dir), fsync=False, clock=clock, delete_grace_s=30) as s:
        writer = s.fragments.writer
        real_append, real_discard = writer.append_entries, writer.discard_unindexed
        p2_flushed, p2_go = threading.Event(), threading.Event()
        p2: dict = {}

        def append(entries, since):
            real_append(entries, since)
            if threading.current_thread().name == "P2":
                p2_flushed.set()
                p2_go.wait(10)

        def discard(entries):  # P1, between its commit and its release
            if threading.current_thread() is threading.main_thread() and not p2:
                t = p2["t"] = threading.Thread(target=lambda: p2.__setitem__("ok", s.put(keys[1], b"P2" * 5000)),
                                               name="P2")
                t.start()
                assert p2_flushed.wait(10)
                assert s.delete(keys[0])
                clock.advance(31)
                s.gc(orphans=False)  # purges keys[0]: the segment's last record, so its files go
                p2_go.set()
                t.join(10)
            return real_discard(entries)

        writer.append_entries, writer.discard_unindexed = append, discard
        assert s.put(keys[0], b"P1" * 5000)
        writer.append_entries, writer.discard_unindexed = real_append, real_discard
        assert p2.get("ok") is True
        m = _meta(s, keys[1])
        assert Path(s.targets[m.targets[0]].root, pack_path(m.gen)).exists()
        assert s.get(keys[1]) == b"P2" * 5000


def test_segment_retired_after_rebuild_index_named_it_keeps_its_files(tmp_path, clock, monkeypatch):
    """A put whose every entry lost its race to another writer leaves its segment with no record
    of this process's. ``rebuild-index`` on the open store (or ``kvtool rebuild-index`` from
    another process) then indexes the entry it holds, so a record names that pack. Retiring the
    segment (here at close) keeps files a record names: the removal is decided in the index."""
    from dataclasses import replace

    d = str(tmp_path / "s")
    s = kvstore.connect(d, fsync=False, compression="none", clock=clock, orphan_grace_s=10, delete_grace_s=0)
    key, val = os.urandom(16), os.urandom(20_000)
    ek = ekey(1, key)
    writer = s.fragments.writer
    real = writer.write_entries

    def another_writer_wins(entries, **kw):
        real(entries, **kw)  # appended to this process's active segment
        (e,) = entries
        _ek, m = e.record()
        other = replace(m, gen=os.urandom(8), offsets=(), aligned=False)  # another process's record of the key
        with s.index.env.begin(write=True) as txn:
            s.index.insert_txn(txn, ek, other)

    monkeypatch.setattr(writer, "write_entries", another_writer_wins)
    assert s.put(key, val) is False  # lost its race: the segment holds it, no record names it
    monkeypatch.setattr(writer, "write_entries", real)
    assert s.delete(key)  # the winner's record is deleted later
    clock.advance(60)  # the segment's file is older than orphan_grace_s
    out = s.rebuild_index()
    assert out["entries"] == 1  # the entry in the segment is indexed again
    with s.index.env.begin() as txn:
        m = s.index.get_meta(txn, ek)
    assert m is not None
    s.close()  # seals and retires the active segment
    missing = [name for name, t in s.targets.items() if name in m.targets and not os.path.exists(
        os.path.join(t.root, "p", m.gen.hex()[:2], m.gen.hex() + ".pack"))]
    assert not missing, f"segment files a record names were deleted at retire on {missing}"
    with kvstore.connect(d, fsync=False, compression="none", clock=clock, orphan_grace_s=10) as s2:
        assert s2.get(key) == val
