"""``kvstore.embedded.openfiles.OpenFiles``: kept read descriptors of pack files.

Each test holds the cache to one of its invariants: a kept descriptor is reused, the bound
holds, a descriptor in use is never closed under its reader, a deleted file's descriptor is
given back (``forget``, the sweep), ``close`` leaves nothing open, and concurrent readers get
the right bytes.
"""

from __future__ import annotations

import os
import threading

import pytest

from kvstore.embedded import openfiles
from kvstore.embedded.openfiles import OpenFiles


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@pytest.fixture
def files(tmp_path):
    """Ten small files, each filled with its own byte."""
    paths = []
    for i in range(10):
        p = tmp_path / f"{i}.pack"
        p.write_bytes(bytes([i]) * 4096)
        paths.append(str(p))
    return paths


@pytest.fixture
def opens(monkeypatch):
    """How many times ``os.open`` ran."""
    n = {"opens": 0}
    real = os.open

    def counting(*a, **kw):
        n["opens"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(openfiles.os, "open", counting)
    return n


def _read(of: OpenFiles, path: str, n: int = 16, offset: int = 100) -> bytes:
    (h,) = of.hold([path])
    try:
        return os.pread(h.fd, n, offset)
    finally:
        of.release([h])


def test_a_kept_descriptor_is_reused(files, opens):
    of = OpenFiles(4)
    for _ in range(5):
        assert _read(of, files[0]) == b"\0" * 16
        assert _read(of, files[1]) == b"\1" * 16
    held = of.hold(files[:2])
    of.release(held)
    assert opens["opens"] == 2 and len(of) == 2
    of.close()


def test_the_bound_holds_and_evicts_the_least_recently_used(files, opens):
    of = OpenFiles(3)
    for p in files[:3]:
        _read(of, p)
    first = of.hold([files[0]])[0]
    of.release([first])  # files[0] is now the most recently used
    evicted = of.hold([files[1]])[0]
    of.release([evicted])
    _read(of, files[2])
    fd1 = evicted.fd
    _read(of, files[3])  # over the bound: files[0] was the least recently used
    assert len(of) == 3
    _read(of, files[1])
    _read(of, files[2])
    assert opens["opens"] == 4  # 1 and 2 still kept
    _read(of, files[0])
    assert opens["opens"] == 5 and len(of) == 3
    assert _is_open(fd1)
    for p in files[4:]:
        _read(of, p)
    assert len(of) == 3
    of.close()


def test_an_evicted_descriptor_in_use_closes_only_when_released(files):
    of = OpenFiles(1)
    (a,) = of.hold([files[0]])
    fd = a.fd
    assert _read(of, files[1]) == b"\1" * 16  # evicts files[0], which a reader still holds
    assert _is_open(fd) and os.pread(fd, 4, 0) == b"\0" * 4
    of.release([a])
    assert a.fd == -1 and not _is_open(fd)
    of.close()


def test_a_deleted_file_reads_through_its_kept_descriptor_until_forgotten(files, opens):
    of = OpenFiles(4)
    assert _read(of, files[5]) == b"\5" * 16
    os.unlink(files[5])
    assert _read(of, files[5]) == b"\5" * 16  # the same bytes: a pack's bytes never change
    (h,) = of.hold([files[5]])
    of.forget(files[5])  # the deleter's hook: closed once the reader releases it
    assert _is_open(h.fd)
    fd = h.fd
    of.release([h])
    assert not _is_open(fd) and len(of) == 0
    with pytest.raises(FileNotFoundError):
        _read(of, files[5])
    assert len(of) == 0
    of.close()


def _kept_then_unlinked(of, path) -> int:
    """Read ``path`` through ``of`` (its descriptor kept), then unlink it: the kept descriptor."""
    _read(of, path)
    (h,) = of.hold([path])
    of.release([h])
    os.unlink(path)
    return h.fd


def test_the_sweep_gives_back_descriptors_of_deleted_files(files, monkeypatch):
    monkeypatch.setattr(openfiles, "SWEEP_EVERY", 2)
    of = OpenFiles(8)
    fd = _kept_then_unlinked(of, files[0])
    _read(of, files[1])  # the second open: a sweep
    assert files[0] not in of._kept and not _is_open(fd)
    assert len(of) == 1
    of.close()


def test_a_failed_open_holds_nothing(files):
    of = OpenFiles(4)
    _read(of, files[0])
    with pytest.raises(FileNotFoundError):
        of.hold([files[0], files[0] + ".gone"])
    (h,) = of.hold([files[0]])
    assert h.refs == 1  # the first hold was given back
    of.release([h])
    of.close()


def test_close_leaves_nothing_open(files):
    before = _open_fds()
    of = OpenFiles(4)
    for p in files[:6]:
        _read(of, p)
    (held,) = of.hold([files[5]])
    assert _open_fds() == before + 4
    of.close()
    assert _open_fds() == before + 1  # the one still held
    of.release([held])
    assert _open_fds() == before
    assert _read(of, files[7]) == b"\7" * 16  # still readable after close, but nothing is kept
    assert len(of) == 0 and _open_fds() == before


def test_an_owner_dropped_unclosed_gives_its_descriptors_back(files):
    before = _open_fds()
    of = OpenFiles(4)
    for p in files[:4]:
        _read(of, p)
    assert _open_fds() == before + 4
    del of
    assert _open_fds() == before


def test_concurrent_readers_get_their_own_bytes(files):
    before = _open_fds()
    of = OpenFiles(3)  # smaller than the working set: evictions race the reads
    wrong: list[tuple[int, bytes]] = []

    def reader(seed: int) -> None:
        for j in range(400):
            i = (seed * 7 + j) % len(files)
            held = of.hold([files[i], files[(i + 1) % len(files)]])
            try:
                got = os.pread(held[0].fd, 8, 64 * (j % 60)), os.pread(held[1].fd, 8, 0)
            finally:
                of.release(held)
            if got != (bytes([i]) * 8, bytes([(i + 1) % len(files)]) * 8):
                wrong.append((i, got[0]))

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert len(of) <= 3 and all(h.refs == 0 for h in of._kept.values())
    of.close()
    assert _open_fds() == before


def test_capacity_is_checked():
    with pytest.raises(ValueError, match="at least 1"):
        OpenFiles(0)


def test_a_direct_reader_keeps_pack_descriptors_and_closes_them(tmp_path):
    """A client that mounts the targets (``kvstore.client.direct_reads.DirectReader``) reads
    packs through kept descriptors too, and gives them back on ``close``."""
    import kvstore
    from kvstore.client.direct_reads import DirectReader, Located
    from kvstore.api import EntryKind
    from kvstore.embedded.index import ekey
    from kvstore.proto import kvstore_pb2 as pb

    s = kvstore.connect(str(tmp_path / "s"), fsync=False)
    vals = {os.urandom(16): os.urandom(30000) for _ in range(6)}
    s.put_many([kvstore.PutItem(k, v) for k, v in vals.items()])
    eks = [ekey(EntryKind.BLOCK.code, k) for k in vals]
    locs = [Located(ek, m) for ek, m in zip(eks, s.locate(eks))]
    d = pb.DescribeReply(direct_reads=True, ec_type=s.config.ec_type, ec_k=s.config.ec_k, ec_m=s.config.ec_m,
                         data_dir=str(tmp_path / "s"), max_value_bytes=s.config.max_value_bytes,
                         targets=[pb.TargetInfo(name=n, url=f"file://{t.root}") for n, t in s.targets.items()])
    s.close()
    before = _open_fds()
    r = DirectReader(d, workers=2)
    try:
        for _ in range(2):
            got = r.read_many(locs, [None] * len(locs))
            assert [bytes(p) for _, p in got] == list(vals.values())
        assert 0 < len(r.reader.files) <= len(d.targets)
        assert r.counters["direct_reads"] == 2 * len(vals) and r.counters["fallbacks"] == 0
    finally:
        r.close()
    assert len(r.reader.files) == 0 and _open_fds() == before


def test_the_sweep_also_runs_on_time_while_reads_go_on(files, monkeypatch):
    of = OpenFiles(8)
    fd = _kept_then_unlinked(of, files[0])
    now = [openfiles.time.monotonic()]
    monkeypatch.setattr(openfiles.time, "monotonic", lambda: now[0])
    _read(of, files[1])
    assert files[0] in of._kept  # not due yet
    now[0] += openfiles.SWEEP_S + 1
    _read(of, files[1])  # no open, but a sweep is due
    assert files[0] not in of._kept and not _is_open(fd)
    of.close()


def test_a_store_out_of_descriptors_does_not_mark_a_healthy_entry_lost(tmp_path, monkeypatch):
    """EMFILE is this process's own limit, not a fact about the entry's fragments: a get that
    cannot open them is refused as unavailable for now, and the entry is not moved to ``lost``
    (which would hide it from every later get and lookup, in every process, until a repair)."""
    import errno

    import kvstore
    from kvstore.embedded.index import ekey

    s = kvstore.connect(str(tmp_path / "s"), fsync=False, compression="none")
    try:
        key, val = os.urandom(16), os.urandom(20_000)
        assert s.put(key, val)
        real_open = os.open
        roots = tuple(t.root for t in s.targets.values())

        def no_fds(path, flags, *a, **kw):
            if str(path).startswith(roots):
                raise OSError(errno.EMFILE, "Too many open files", str(path))
            return real_open(path, flags, *a, **kw)

        monkeypatch.setattr(os, "open", no_fds)
        with pytest.raises(kvstore.StoreUnavailable, match="out of descriptors"):
            s.get(key)
        monkeypatch.setattr(os, "open", real_open)
        with s.index.env.begin() as txn:
            assert s.index.get_lost(txn, ekey(1, key)) is None
        assert s.get(key) == val
    finally:
        s.close()
