"""How fsync=True makes a put durable (StoreConfig.sync_mode, kvstore.embedded.durability.sync_plan).

"file": each file and its directory fsynced; "fs": the put's files written without fsync,
then one syncfs per filesystem, before the index commit; "auto" picks "fs" only for local
ext4/xfs/btrfs targets. These tests count the calls each mode makes and check that a
failing syncfs fails the put and leaves nothing behind.
"""

from __future__ import annotations

import os
import sys

import pytest

import kvstore
from kvstore import InvalidRequest, PutItem, StoreUnavailable
from kvstore.embedded import durability as D
from kvstore.embedded import segments as S
from kvstore.embedded import targets as T
from kvstore.config import TargetSpec
from kvstore.embedded.store import EmbeddedStore

linux_only = pytest.mark.skipif(D._SYNCFS is None, reason="syncfs is Linux-only")


def K(i) -> bytes:
    import hashlib

    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


@pytest.fixture
def calls(monkeypatch):
    """Counts syncfs calls and per-file fsyncs of the store's writes."""
    seen = {"syncfs": [], "fsync_writes": 0, "plain_writes": 0}
    monkeypatch.setattr(D, "syncfs_fd", lambda fd, path: seen["syncfs"].append(path))  # every store syncfs
    orig = T.LocalTarget.write

    def write(self, rel, data, *, fsync):
        seen["fsync_writes" if fsync else "plain_writes"] += 1
        return orig(self, rel, data, fsync=fsync)

    monkeypatch.setattr(T.LocalTarget, "write", write)
    return seen


def files(st: EmbeddedStore) -> list[str]:
    return [rel for t in st.targets.values() for rel, _s, _m in t.walk()]


@linux_only
def test_fs_mode_syncs_each_filesystem_once_per_put_and_per_pack(tmp_path, calls) -> None:
    st = kvstore.connect(str(tmp_path / "d"), fsync=True, sync_mode="fs", segments=False)
    assert st.stats()["durable_writes"] == "syncfs per filesystem"
    assert st.put(K(1), os.urandom(50_000))
    assert len(calls["syncfs"]) == 1 and calls["fsync_writes"] == 0 and calls["plain_writes"] == 6
    assert st.put_many([PutItem(K(i), os.urandom(50_000)) for i in range(2, 6)]) == [True] * 4
    assert len(calls["syncfs"]) == 2  # one pack per target, one syncfs for all of them
    assert st.get(K(3)) and st.check() == []
    st.close()


@linux_only
def test_segments_fs_mode_syncs_each_filesystem_once_per_put(tmp_path, calls) -> None:
    """Appends to segment files: no file is written whole, and a put (single or batch) is made
    durable by one syncfs for the filesystem all six targets share."""
    st = kvstore.connect(str(tmp_path / "d"), fsync=True, sync_mode="fs")
    assert st.put(K(1), os.urandom(50_000))
    assert len(calls["syncfs"]) == 1 and calls["fsync_writes"] == calls["plain_writes"] == 0
    assert st.put_many([PutItem(K(i), os.urandom(50_000)) for i in range(2, 6)]) == [True] * 4
    assert len(calls["syncfs"]) == 2
    assert len({rel for rel in files(st) if rel.endswith(".pack")}) == 1  # one segment, on every target
    assert st.get(K(3)) and st.check() == []
    st.close()


def test_segments_file_mode_fdatasyncs_each_file_a_put_appended_to(tmp_path, calls, monkeypatch) -> None:
    """In "file" mode a segment file's name is made durable when it is created (its directory
    fsynced), and each put's appends by one fdatasync per file it appended to."""
    seen = {"fdatasync": 0, "dirs": 0}
    orig_fdatasync, orig_dir = os.fdatasync, T.fsync_dir

    def fdatasync(fd):
        seen["fdatasync"] += 1
        return orig_fdatasync(fd)

    def fsync_dir(d):
        seen["dirs"] += 1
        return orig_dir(d)

    monkeypatch.setattr(S.os, "fdatasync", fdatasync)
    monkeypatch.setattr(T, "fsync_dir", fsync_dir)
    st = kvstore.connect(str(tmp_path / "d"), fsync=True, sync_mode="file")
    assert st.put(K(1), b"x" * 1000)
    assert seen == {"fdatasync": 6, "dirs": 6 * 3}  # per target: p/ and p/<xx>/ made, then the file's name
    assert st.put(K(2), b"y" * 1000) and seen["fdatasync"] == 12 and seen["dirs"] == 18  # files open: no new name
    assert calls["syncfs"] == [] and calls["fsync_writes"] == calls["plain_writes"] == 0
    assert st.get(K(1)) == b"x" * 1000 and st.check() == []
    st.close()


def test_file_mode_fsyncs_every_file(tmp_path, calls) -> None:
    st = kvstore.connect(str(tmp_path / "d"), fsync=True, sync_mode="file", segments=False)
    assert st.stats()["durable_writes"] == "fsync per file"
    assert st.put(K(1), b"x" * 1000) and st.put_many([PutItem(K(2), b"y"), PutItem(K(3), b"z")]) == [True, True]
    assert calls["syncfs"] == [] and calls["fsync_writes"] == 12 and calls["plain_writes"] == 0
    st.close()
    st = kvstore.connect(str(tmp_path / "e"), fsync=False, sync_mode="fs")  # fsync off: neither
    assert st.put(K(1), b"x") and calls["syncfs"] == [] and st.stats()["durable_writes"] == "off"
    st.close()


@linux_only
@pytest.mark.parametrize("segments", [True, False])
def test_a_failing_syncfs_fails_the_put_and_leaves_nothing(tmp_path, monkeypatch, segments) -> None:
    st = kvstore.connect(str(tmp_path / "d"), fsync=True, sync_mode="fs", segments=segments)

    def broken(path):
        raise OSError(5, "Input/output error (injected)", path)

    monkeypatch.setattr(D, "syncfs_fd", lambda fd, path: broken(path))  # a segment's flush fails: files then
    with pytest.raises(StoreUnavailable, match="durable"):
        st.put(K(1), b"x" * 1000)
    with pytest.raises(StoreUnavailable):  # a batch: its packs fail, then fragment by fragment
        st.put_many([PutItem(K(2), b"a"), PutItem(K(3), b"b")])
    assert st.lookup([K(1)]).hit_blocks == 0 and st.stats()["entries"] == 0
    assert [f for f in files(st) if not f.endswith("kvstore.json")] == []  # nothing half-written stays
    st.close()


def test_auto_picks_syncfs_only_for_local_block_filesystems(tmp_path, monkeypatch) -> None:
    spec = TargetSpec(f"file://{tmp_path}", "d", "a")
    t = T.open_target(spec)
    for kind, want in (("ext4", "fs"), ("xfs", "fs"), ("nfs4", "file"), ("fuse.3fs", "file"), ("tmpfs", "file")):
        monkeypatch.setattr(D, "fs_type", lambda path, kind=kind: kind)
        mode, why = D.sync_plan("auto", [t])
        assert mode == (want if D._SYNCFS is not None else "file"), (kind, why)
    assert D.sync_plan("file", [t])[0] == "file"
    mem = T.open_target(TargetSpec("memory://kvdur/x", "d", "m"))
    assert D.sync_plan("auto", [t, mem])[0] == "file"  # an object store: per-object semantics
    with pytest.raises(InvalidRequest, match="sync_mode"):
        D.sync_plan("fs", [t, mem])
    with pytest.raises(InvalidRequest, match="sync_mode"):
        kvstore.connect(str(tmp_path / "s"), sync_mode="sometimes")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/mountinfo")
def test_fs_type_reads_the_mount_table() -> None:
    assert D.fs_type("/") != ""  # whatever the root filesystem is, it is named
    assert D.fs_type("/proc/self") == "proc"
