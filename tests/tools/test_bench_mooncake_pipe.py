"""The Mooncake peer of tools/bench_remote.py, driven over a pipe (tools/bench_peers.MooncakePeer
talking to tools/mooncake_peer.py's ``serve`` loop), without Mooncake: the loop runs here on a
dict-backed stand-in for its client, so what is tested is the protocol, the self-timing and
the failure handling. Mooncake itself runs only in the benchmark.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tools.bench_peers import MooncakePeer, Peer, PeerUnavailable, interleaved_rep

# A serve loop over a stand-in client with Mooncake's call shapes (status 0 is success; a
# missing key reads as empty bytes). argv[1]: "garble" makes get_batch answer other bytes.
# It imports tools.mooncake_peer from the repository on PYTHONPATH (tests/conftest.py).
FAKE_SERVE = """
import json, sys
from tools.mooncake_peer import serve

class Fake:
    def __init__(self):
        self.d = {}
    def put(self, k, v):
        self.d[k] = v
        return 0
    def get(self, k):
        return self.d.get(k, b"")
    def put_batch(self, ks, vs):
        self.d.update(zip(ks, vs))
        return [0] * len(ks)
    def get_batch(self, ks):
        return [b"other" if sys.argv[1] == "garble" else self.d.get(k, b"") for k in ks]

print("I0000 a library's log line on stdout", flush=True)
print(json.dumps({"setup": 0}), flush=True)
sys.exit(serve(Fake(), sys.stdin, sys.stdout))
"""


def _peer(tmp_path: Path, mode: str = "ok", timeout_s: float = 20.0) -> MooncakePeer:
    proc = subprocess.Popen([sys.executable, "-c", FAKE_SERVE, mode], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    work = tmp_path / "work"
    work.mkdir()
    peer = MooncakePeer(proc, str(work), timeout_s)
    assert peer.read_reply() == {"setup": 0}  # the log line before it was skipped
    return peer


def test_the_serve_loop_puts_and_gets_through_the_pipe_and_times_itself(tmp_path):
    peer = _peer(tmp_path)
    try:
        vals = [b"a" * 4096, b"b" * 4096]
        keys = [bytes([i]) * 16 for i in range(8)]
        for mode in ("single", "batch"):
            res = interleaved_rep({"mooncake": peer}, mode, keys, vals, batch=4)
            assert set(res["mooncake"]) == {"put", "get"} and len(res["mooncake"]["get"][1]) == 8
            assert isinstance(peer.last_s, float) and peer.last_s >= 0
        assert peer.get(b"\xff" * 16) is None  # never put: no value, not another one's
        assert sorted(p.name for p in Path(peer.dir).iterdir()) == ["0", "1"]  # each value sent once
    finally:
        peer.close()
    assert peer.proc.returncode == 0 and not Path(peer.dir).exists()


def test_a_value_the_other_side_did_not_put_fails_the_run(tmp_path):
    peer = _peer(tmp_path, "garble")
    try:
        with pytest.raises(RuntimeError, match="wrong bytes"):
            interleaved_rep({"mooncake": peer}, "batch", [bytes([i]) * 16 for i in range(4)], [b"v" * 64], batch=4)
    finally:
        peer.close()


def test_a_failed_step_is_an_error_naming_it(tmp_path):
    peer = _peer(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="mooncake bogus: unknown op"):
            peer._ask({"op": "bogus"})
    finally:
        peer.close()


def test_a_client_that_stops_answering_is_given_up_on_within_its_timeout(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)
    peer = MooncakePeer(proc, str(tmp_path), 0.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(PeerUnavailable, match="within 0.5 s"):
            peer.put(b"k" * 16, b"v")
    finally:
        peer.close()
    assert time.monotonic() - t0 < 4 and proc.returncode is not None  # stopped at once, not left running


def test_a_self_timed_peers_own_time_is_what_counts():
    """``Peer.last_s``: the time a peer in another process measured for its own call; the
    pipe to it (here a 20 ms sleep standing for it) is not charged to it."""

    class Remote(Peer):
        def __init__(self):
            self.d = {}

        def put(self, k, v):
            time.sleep(0.02)
            self.d[k], self.last_s = v, 0.001

        def get(self, k):
            time.sleep(0.02)
            self.last_s = 0.002
            return self.d[k]

    res = interleaved_rep({"r": Remote()}, "single", [bytes([i]) * 16 for i in range(5)], [b"x"], batch=1)
    assert res["r"]["put"][0] == pytest.approx(0.005) and res["r"]["get"][0] == pytest.approx(0.010)
