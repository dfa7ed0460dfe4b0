"""The soak's own checks can fail: its final read-back (``tools.soak.verify``) counts an
acknowledged key lost or holding other bytes, and a deleted key still there; ``failures``
turns each of its counts, and a key found absent or unreadable during the run, into a failed
run. (The soak itself only ever meets a store that keeps its promises.)"""

from __future__ import annotations

import kvstore

from tools.daemon_util import start_daemon, stop_all
from tools.soak import key_for, value_for, verify
from tools.soak_report import failures


def test_verify_counts_a_lost_key_wrong_bytes_and_a_deleted_key_found(tmp_path):
    seed, client = 7, 0
    keys = [key_for(seed, client, i) for i in range(5)]
    d = start_daemon(tmp_path / "d", ["--fsync", "false"])  # the soak verifies through its daemons
    try:
        with kvstore.connect(d.url) as s:
            assert s.put_many([kvstore.PutItem(k, value_for(k)) for k in keys]) == [True] * 5
            assert s.delete(keys[1])  # lost behind the ledger's back
            assert s.delete(keys[2]) and s.put(keys[2], b"not its value")  # other bytes
        ledger = {"client": client, "live": [0, 1, 2], "deleted": [3], "uncertain": [4]}
        got = verify(d.url, seed, [ledger])
    finally:
        stop_all([d])
    assert (got["acked_checked"], got["acked_lost"], got["wrong_bytes"], got["deleted_but_found"]) == (2, 1, 1, 1)


def test_each_count_fails_the_run():
    clean = {"wrong_bytes": 0, "acked_lost": 0, "deleted_but_found": 0, "check_after_repair": {"orphan_fragment": 3},
             "client_counts": {"unavailable": 9}}
    assert failures(clean) == []
    for bad in ({"wrong_bytes": 1}, {"acked_lost": 1}, {"deleted_but_found": 1},
                {"check_after_repair": {"lost_entry": 1}},
                {"client_counts": {"acked_missing_during_run": 1}},
                {"client_counts": {"acked_unreadable_during_run": 1}}):
        assert len(failures({**clean, **bad})) == 1, bad
