"""Direct writes whose ``Describe`` went out of date (kvstore.client.direct_writes, kvstore.server.direct_rpc).

A writer keys fragment headers by the tenant secret its ``Describe`` gave it; a daemon restarted
since on a fresh data directory (a new server secret), with the token mapped to another tenant,
or with another erasure code, indexed such entries under its own keys anyway: the put was
acknowledged and every read found the fragments "belong to another entry" and marked it lost. Or,
after a code change, every later put raised ``InvalidRequest`` forever. Now every Commit carries
the ``writer_view`` of its Describe; the daemon refuses a stale one (nothing indexed) and the
client describes again and rewrites the batch.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest

import kvstore
from kvstore import PutItem
from kvstore.proto import kvstore_pb2 as pb
from kvstore.errors import PermissionDenied, StaleDescribe

from tests.kvstore.daemons import wait_until
from tests.kvstore.server.test_security import TOK_A, TOK_OPS, tokens_file  # noqa: F401 - a fixture


def K(i) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def _answers(s) -> bool:
    """One cheap call gets through (the channel reconnected after a restart)."""
    try:
        s.lookup([K("ping")])
        return True
    except kvstore.StoreUnavailable:
        return False


@pytest.mark.parametrize("change", ["wipe", "retoken", "ec"])
def test_a_put_after_the_daemon_changed_under_the_writer_reads_back(make_daemon, tokens_file, tmp_path,  # noqa: F811
                                                                     change) -> None:
    data = tmp_path / "store"
    conf = dict(allow_direct_writes=True, tokens_file=tokens_file, ec_k=2, ec_m=1, data_dir=str(data))
    d = make_daemon(**conf)
    c = kvstore.connect(d.address, token=TOK_A, direct_writes="on", timeout_s=10)
    assert c.put(K("before"), b"b" * 2000) is True  # described: this writer keeps the old view
    d.stop(grace_s=1)
    if change in ("wipe", "ec"):  # the operator resets the cache (a new tenant.secret), or changes the code too
        shutil.rmtree(data)
        data.mkdir()
    if change == "ec":
        conf.update(ec_k=3, ec_m=1)
    if change == "retoken":  # the same token now names another tenant (another secret)
        other = tmp_path / "tokens2.toml"
        other.write_text(f'admin_tenants = ["ops"]\n[tokens]\n"{TOK_A}" = "tenant-c"\n"{TOK_OPS}" = "ops"\n')
        conf["tokens_file"] = str(other)
    d = make_daemon(port=d.port, **conf)
    assert wait_until(lambda: _answers(c), timeout=30)
    vals = {K(f"after{i}"): os.urandom(3000 + i) for i in range(5)}
    assert c.put_many([PutItem(k, v) for k, v in vals.items()]) == [True] * 5  # was InvalidRequest after "ec"
    with kvstore.connect(d.address, token=TOK_A) as fresh:  # was None for each: the entries marked lost
        assert fresh.get_many(list(vals)) == list(vals.values())
    assert c.put(K("again"), b"x") is True and c.get(K("again")) == b"x"
    st = c.direct_write_stats()
    assert st["active"] and st["counters"]["direct_writes"] == 7 and st["counters"]["fallbacks"] == 0, st
    with kvstore.connect(d.address, token=TOK_OPS) as ops:
        assert ops.check() == []  # the stale batch's packs were removed, nothing lost
    c.close()


def test_a_commit_with_a_stale_or_missing_view_indexes_nothing(make_daemon) -> None:
    """The daemon side: a view that is not the current one is ``StaleDescribe``; none at all (a
    client older than the field) is PERMISSION_DENIED, on which such a client puts through
    PutStream. Either way before any entry is looked at."""
    d = make_daemon(allow_direct_writes=True)
    with kvstore.connect(d.address) as s:
        view = s._rpc.call("Describe", pb.DescribeRequest()).writer_view
        assert len(view) == 16
        entry = pb.WrittenEntry(key=K("w"), k=4, m=2, gen=b"12345678", targets=[f"t{i}" for i in range(6)],
                                offsets=[0] * 6, entry_len=1, frag_len=100)
        with pytest.raises(StaleDescribe, match="Describe again"):
            s._rpc.call("Commit", pb.CommitRequest(entries=[entry], view=bytes(16)))
        with pytest.raises(PermissionDenied, match="writer_view"):
            s._rpc.call("Commit", pb.CommitRequest(entries=[entry]))
        assert s.lookup([K("w")]).hit_blocks == 0


def test_a_commit_refused_for_its_missing_view_puts_through_the_daemon(make_daemon, monkeypatch) -> None:
    """A Commit the daemon refuses (PERMISSION_DENIED: here it carries no ``writer_view``):
    direct writes turn off for this client, the packs are removed, the batch goes through the daemon."""
    d = make_daemon(allow_direct_writes=True)
    s = kvstore.connect(d.address, direct_writes="on")
    real = s._direct_w._call

    def no_view(method, req):
        if method == "Commit":
            req.ClearField("view")
        return real(method, req)

    monkeypatch.setattr(s._direct_w, "_call", no_view)
    vals = {K(i): os.urandom(2000) for i in range(3)}
    assert s.put_many([PutItem(k, v) for k, v in vals.items()]) == [True] * 3
    assert s.get_many(list(vals)) == list(vals.values())
    st = s.direct_write_stats()
    assert not st["active"] and "writer_view" in st["reason"], st
    assert s.check() == []  # its packs removed
    s.close()


def test_stale_twice_puts_the_batch_through_the_daemon(make_daemon, monkeypatch) -> None:
    """Described again and still refused as stale (a daemon changing under the client twice):
    the batch goes through PutStream, never reported created without being readable."""
    d = make_daemon(allow_direct_writes=True)
    s = kvstore.connect(d.address, direct_writes="on")
    assert s.put(K("warm"), b"w")
    real = s._direct_w._call
    calls: list[str] = []

    def stale(method, req):
        calls.append(method)
        if method == "Commit":
            req.view = bytes(16)
        return real(method, req)

    monkeypatch.setattr(s._direct_w, "_call", stale)
    vals = {K(i): os.urandom(2000) for i in range(4)}
    assert s.put_many([PutItem(k, v) for k, v in vals.items()]) == [True] * 4
    assert calls == ["Commit", "Describe", "Commit"]  # described again once, then the daemon's own put
    assert s.get_many(list(vals)) == list(vals.values())
    assert s.direct_write_stats()["counters"]["fallbacks"] == 4
    assert s.check() == []  # both attempts' packs removed
    # Stale right after a fresh Describe: the views keep differing, so direct writes turn off
    # (else every later batch pays two Describes and two discarded pack writes)
    st = s.direct_write_stats()
    assert not st["active"] and "stale" in st["reason"], st
    calls.clear()
    assert s.put_many([PutItem(K("after"), b"a")]) == [True]
    assert "Describe" not in calls and "Commit" not in calls, calls
    assert s.get(K("after")) == b"a"
    s.close()
