"""A full filesystem under the daemon (``kvstore.embedded.diskroom``): puts over gRPC are refused with
``CapacityExceeded`` naming ENOSPC, gets go on, and ``delete`` and ``kvtool gc`` through the
daemon commit and free space (before, they failed as ``InternalError``, "a kvstore bug").
The filesystem is a 20 MiB tmpfs (``tests.kvstore.embedded.test_full_disk.small_fs``: root only)."""

from __future__ import annotations

import kvstore
from kvstore.cli.kvtool import main as kvtool
from tests.kvstore.conftest import value_for
from tests.kvstore.embedded.test_full_disk import STORE, VALUE, fill, free_bytes, small_fs  # noqa: F401 - a fixture


def test_the_daemon_on_a_full_filesystem_deletes_and_gcs(make_daemon, small_fs, capsys):  # noqa: F811
    d = make_daemon(data_dir=str(small_fs / "d"), **STORE)
    s = kvstore.connect(d.address)
    try:
        keys, err = fill(s, 3)
        assert "ENOSPC" in str(err) or "No space left on device" in str(err)
        assert all(s.get(k) == value_for(k, VALUE) for k in keys[:10])
        assert [s.delete(k) for k in keys[:80]] == [True] * 80
        before = free_bytes(small_fs)
        assert kvtool([d.address, "gc"]) == 0
        assert free_bytes(small_fs) > before
        assert s.put(b"\xfd" * 16, b"after") and s.get(b"\xfd" * 16) == b"after"
        assert d.store.check() == []
    finally:
        s.close()
    capsys.readouterr()
