"""A full filesystem (``kvstore.embedded.diskroom``): puts are refused with ``CapacityExceeded`` naming
ENOSPC, reads go on, ``delete``, ``gc`` and ``kvtool gc`` commit and free space, and the store
takes puts again by itself once there is room.

The data directory sits on a 20 MiB tmpfs (needs root to mount; skipped otherwise, saying why).
Before the index kept a spare file, the first index write on the full filesystem failed with
LMDB's "No space left on device" (through the daemon: ``InternalError``), ``gc`` at its first
step: nothing could free space.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import kvstore
from kvstore import CapacityExceeded
from kvstore.cli.kvtool import main as kvtool
from kvstore.embedded.diskroom import RESERVE_NAME

from tests.kvstore.conftest import value_for

VALUE = 16 * 1024
STORE = {"lmdb_map_size": 8 << 20, "index_reserve_bytes": 1 << 20, "orphan_grace_s": 0, "delete_grace_s": 0}


@pytest.fixture
def small_fs(tmp_path) -> Path:
    """A 20 MiB tmpfs at a fresh directory, unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "fs"
    mnt.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=30)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(store, tag: int) -> tuple[list[bytes], CapacityExceeded]:
    """Put ``VALUE``-byte entries until the filesystem refuses one: the keys stored, the error."""
    keys = []
    for i in range(4000):
        k = tag.to_bytes(2, "big") + i.to_bytes(14, "big")
        try:
            assert store.put(k, value_for(k, VALUE))
        except CapacityExceeded as exc:
            return keys, exc
        keys.append(k)
    raise AssertionError("the filesystem never filled up")


def test_a_full_filesystem_is_typed_and_gc_delete_and_kvtool_free_it(small_fs, monkeypatch, capsys):
    data = small_fs / "d"
    with kvstore.connect(str(data), **STORE) as s:
        keys, err = fill(s, 1)
        assert "No space left on device" in str(err) or "ENOSPC" in str(err)
        assert len(keys) > 50 and free_bytes(small_fs) < VALUE * 6
        assert all(s.get(k) == value_for(k, VALUE) for k in keys[:20])  # reads go on
        assert [s.delete(k) for k in keys[:80]] == [True] * 80
        before = free_bytes(small_fs)
        out = s.gc()
        freed = free_bytes(small_fs) - before
        figures = [f"full disk, in process: gc freed {freed} bytes ({out['purged']} entries purged, "
                   f"reclaimed_bytes {out['reclaimed_bytes']})"]
        assert out["purged"] == 80 and freed > 0
        assert s.put(b"\xff" * 16, b"after")  # room again (twice the spare file): puts go on, it back first
        assert (data / "index" / RESERVE_NAME).exists()
        more, err = fill(s, 2)  # full again, for the admin's tool
        assert "ENOSPC" in str(err) or "No space left on device" in str(err)
    monkeypatch.setenv("KVSTORE_INDEX_RESERVE_BYTES", str(STORE["index_reserve_bytes"]))
    monkeypatch.setenv("KVSTORE_DELETE_GRACE_S", "0")
    assert kvtool([str(data), "delete", *[a for k in more[:80] for a in ("--key", k.hex())]]) == 0
    before = free_bytes(small_fs)
    assert kvtool([str(data), "gc", "--json"]) == 0
    figures.append(f"full disk, kvtool gc: freed {free_bytes(small_fs) - before} bytes")
    assert free_bytes(small_fs) > before
    capsys.readouterr()
    with capsys.disabled():
        print("\n" + "\n".join(figures))
    with kvstore.connect(str(data), **STORE) as s:
        assert s.put(b"\xfe" * 16, b"recovered") and s.get(b"\xfe" * 16) == b"recovered"
        assert all(s.get(k) == value_for(k, VALUE) for k in keys[80:90] + more[80:90])
        s.gc()
        assert s.check() == []


def test_a_full_index_filesystem_with_targets_elsewhere(small_fs, tmp_path):
    """The index's filesystem fills up while the targets have room: a put's index commit finds
    no room (its fragments removed, ``CapacityExceeded``), a delete releases the spare file and
    commits, puts are refused while it cannot be made again, and go on once there is room."""
    roots = ",".join(f"file://{tmp_path}/t{i}" for i in range(6))
    data = small_fs / "d"
    with kvstore.connect(str(data), targets=roots, **STORE) as s:
        keys = [i.to_bytes(16, "big") for i in range(40)]
        assert all(s.put(k, value_for(k, 3000)) for k in keys)
        filler = small_fs / "filler"
        with open(filler, "wb") as f:  # everything but a few pages: the index cannot grow
            os.posix_fallocate(f.fileno(), 0, max(free_bytes(small_fs) - 8192, 4096))
        with pytest.raises(CapacityExceeded, match="indexing 1 entries: no space left .* index .ENOSPC"):
            for i in range(40, 4000):
                k = i.to_bytes(16, "big")
                assert s.put(k, value_for(k, 3000))
        assert all(s.get(k) == value_for(k, 3000) for k in keys)  # reads go on
        # Deletes commit; the first that finds no room in the index is given the spare file's
        # (which one that is depends on the pages LMDB has free: bounded by the entries stored).
        deleted = 0
        while (data / "index" / RESERVE_NAME).exists():
            assert deleted < len(keys) - 10, "no delete ever needed the spare file's room"
            assert s.delete(keys[deleted])
            deleted += 1
        assert deleted >= 1
        with pytest.raises(CapacityExceeded, match="ENOSPC"):
            s.put(b"\xfc" * 16, b"refused: the spare file cannot be made again")
        filler.unlink()
        assert s.put(b"\xfc" * 16, b"room again") and s.get(b"\xfc" * 16) == b"room again"
        assert (data / "index" / RESERVE_NAME).exists()
        s.gc()
        assert s.check() == []  # the refused puts left no files behind
