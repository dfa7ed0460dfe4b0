"""Security checks: path traversal, tokens never logged, TLS misconfiguration, tenant quotas."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvstore
from kvstore.server.quota import PRUNE_EVERY_S
from kvstore import CapacityExceeded, InvalidRequest, PutItem
from kvstore.config import TargetSpec
from kvstore.keys import BlockHasher, Namespace, check_key
from kvstore.server import Daemon, load_server_config
from kvstore.api import EntryKind
from kvstore.embedded.targets import _safe_rel, fragment_path, open_target, parse_fragment_path

from tests.kvstore.chaos.conftest import K, V

ROOT = Path(__file__).resolve().parents[3]
TOK_A, TOK_B, TOK_OPS = "tok-AAAA-secret-1", "tok-BBBB-secret-2", "tok-OPS-secret-3"
WRONG = "tok-WRONG-never-valid"


# ----------------------------------------------------------------------------- path traversal
@pytest.mark.parametrize("rel", ["../x", "a/../../b", "/etc/passwd", "1/ab/../../../x", "..", "a/.."])
def test_safe_rel_refuses_escapes(rel):
    with pytest.raises(InvalidRequest):
        _safe_rel(rel)


@settings(max_examples=200, deadline=None)
@given(kind=st.integers(0, 255), key=st.binary(min_size=16, max_size=16), gen=st.binary(min_size=8, max_size=8),
       index=st.integers(0, 255))
def test_fragment_paths_are_hex_and_stay_under_the_root(kind, key, gen, index):
    rel = fragment_path(kind, key, gen, index)
    assert set(rel) <= set("0123456789abcdef./") and ".." not in rel.split("/")
    root = "/srv/kv/t0"
    assert os.path.normpath(os.path.join(root, _safe_rel(rel))).startswith(root + "/")
    # the inverse for the kinds a store writes; any other kind is not a name of ours (never swept)
    assert parse_fragment_path(rel) == ((kind, key, gen, index) if kind in EntryKind.codes() else None)


@pytest.mark.parametrize("key", [b"../../etc/passwd/", b"/" * 15, b"..", b"a" * 17, "0123456789abcdef"])
def test_keys_are_exactly_16_bytes(key):
    with pytest.raises(InvalidRequest):
        check_key(key)


def test_a_path_shaped_key_is_stored_as_hex_under_the_root(tmp_path):
    key = b"../../etc/passwd"  # exactly 16 bytes: a valid key, and only ever a hex name
    s = kvstore.connect(str(tmp_path / "s"), fsync=False, segments=False)  # where keys name files
    assert s.put(key, b"v") and s.get(key) == b"v"
    s.close()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and all(str(p).startswith(str(tmp_path / "s") + os.sep) for p in files)
    assert any(key.hex() in p.name for p in files)


def test_namespaces_cannot_reach_paths():
    h = BlockHasher(Namespace("../../etc", "../x", "/root", 0), block_size=4, tenant_salt=b"../")
    for k in h.hash_blocks(list(range(40))):
        assert len(k) == 16 and ".." not in fragment_path(1, k, b"\0" * 8, 0)


def test_a_crafted_target_url_is_normalised_and_writes_stay_inside(tmp_path):
    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    t = open_target(TargetSpec(f"file://{tmp_path}/a/b/../b/./"))
    assert t.root == str(inner)
    t.write(fragment_path(1, K(1), b"g" * 8, 0), b"data", fsync=False)
    for bad in ("../../escape", "/tmp/escape", "1/../../../escape"):
        with pytest.raises(InvalidRequest):
            t.write(bad, b"x", fsync=False)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and all(str(p).startswith(str(inner) + os.sep) for p in files)


def test_gc_does_not_follow_symlinks_out_of_a_target(tmp_path):
    s = kvstore.connect(str(tmp_path / "s"), fsync=False, orphan_grace_s=0, ec_k=1, ec_m=0)
    outside = tmp_path / "outside" / "1" / "ab"
    outside.mkdir(parents=True)
    victim = outside / f"{'ab' * 16}.{'00' * 8}.0"  # looks like an orphan fragment
    victim.write_bytes(b"precious")
    old = time.time() - 3600
    os.utime(victim, (old, old))
    root = Path(s.targets["t0"].root)
    (root / "evil").symlink_to(tmp_path / "outside", target_is_directory=True)
    s.gc()
    s.check(fix=True)
    assert victim.read_bytes() == b"precious"
    s.close()


# ----------------------------------------------------------------------------- tokens never logged
@pytest.fixture
def tokens_file(tmp_path):
    p = tmp_path / "tokens.toml"
    p.write_text(f'admin_tenants = ["ops"]\n[tokens]\n"{TOK_A}" = "tenant-a"\n"{TOK_B}" = "tenant-b"\n'
                 f'"{TOK_OPS}" = "ops"\n')
    return str(p)


def _daemon(tmp_path, name="d", **over):
    over.setdefault("port", 0)
    over.setdefault("gc_interval_s", 0)
    over.setdefault("fsync", False)
    over.setdefault("data_dir", str(tmp_path / name))
    scfg, stcfg = load_server_config(None, env={}, **over)
    return Daemon(scfg, stcfg).start()


def _exercise(address: str) -> list[str]:
    details = []
    for tok in (TOK_A, WRONG, TOK_OPS, ""):
        with kvstore.connect(address, token=tok) as s:
            for fn in (lambda: s.put(K(1), b"v"), lambda: s.get(K(1)), lambda: s.stats()):
                try:
                    fn()
                except kvstore.KVStoreError as exc:
                    details.append(str(exc))
    host = address.split("://")[1]
    with grpc.insecure_channel(host) as ch:
        for md in ((("authorization", f"Bearer {WRONG}"),), (("authorization", WRONG),)):
            try:
                ch.unary_unary("/kvstore.v1.KVStore/Get")(b"\xff\xff", metadata=md, timeout=5)
            except grpc.RpcError as err:
                details.append(err.details() or "")
    return details


def test_tokens_never_appear_in_logs_or_errors(tmp_path, tokens_file, caplog):
    caplog.set_level(logging.DEBUG)
    d = _daemon(tmp_path, tokens_file=tokens_file)
    try:
        details = _exercise(d.address)
    finally:
        d.stop(grace_s=1)
    assert any("unknown bearer token" in x for x in details) and any("admin" in x for x in details)
    text = caplog.text + "\n".join(details)
    for tok in (TOK_A, TOK_B, TOK_OPS, WRONG):
        assert tok not in text


def test_tokens_never_appear_in_the_daemon_process_output(tmp_path, tokens_file):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    p = subprocess.Popen([sys.executable, "-m", "kvstore.server.cli", "serve", "--port", "0", "--data-dir",
                          str(tmp_path / "d"), "--tokens-file", tokens_file, "--log-level", "DEBUG",
                          "--gc-interval-s", "0"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        _exercise(line.split()[2])
    finally:
        p.terminate()
        out, err = p.communicate(timeout=30)
    for tok in (TOK_A, TOK_B, TOK_OPS, WRONG):
        assert tok not in line + out + err


# ----------------------------------------------------------------------------- TLS misconfiguration
def test_tls_misconfiguration_is_refused_with_a_clear_message(tmp_path, certs):
    missing = str(tmp_path / "nope.pem")
    notpem = tmp_path / "junk.pem"
    notpem.write_text("hello")
    cases = {
        "cert without key": (dict(tls_cert=certs["server"]), "needs both tls_cert and tls_key"),
        "key without cert": (dict(tls_key=certs["server_key"]), "needs both tls_cert and tls_key"),
        "client CA without cert": (dict(tls_client_ca=certs["ca"]), "needs tls_cert and tls_key"),
        "missing cert file": (dict(tls_cert=missing, tls_key=certs["server_key"]), "cannot read tls_cert file"),
        "missing key file": (dict(tls_cert=certs["server"], tls_key=missing), "cannot read tls_key file"),
        "key is not PEM": (dict(tls_cert=certs["server"], tls_key=str(notpem)), "not a PEM private key"),
        "cert is a key": (dict(tls_cert=certs["server_key"], tls_key=certs["server_key"]), "not a PEM certificate"),
        "missing CA file": (dict(tls_cert=certs["server"], tls_key=certs["server_key"], tls_client_ca=missing),
                            "cannot read tls_client_ca file"),
    }
    for name, (over, msg) in cases.items():
        data_dir = tmp_path / name.replace(" ", "_")
        with pytest.raises(InvalidRequest, match=msg):
            _daemon(tmp_path, data_dir=str(data_dir), **over)
        assert not data_dir.exists(), f"{name}: the store was opened before the TLS check"


def test_cli_refuses_tls_misconfiguration_at_start(tmp_path, certs):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    r = subprocess.run([sys.executable, "-m", "kvstore.server.cli", "serve", "--port", "0", "--data-dir",
                        str(tmp_path / "d"), "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key",
                        certs["server_key"]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "cannot read tls_cert file" in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- tenant quotas
def test_a_tenant_cannot_exhaust_another_tenants_capacity(tmp_path, tokens_file):
    d = _daemon(tmp_path, tokens_file=tokens_file, tenant_quota_bytes=30_000, delete_grace_s=0)
    a = kvstore.connect(d.address, token=TOK_A)
    b = kvstore.connect(d.address, token=TOK_B)
    try:
        stored = 0
        with pytest.raises(CapacityExceeded, match="tenant quota"):
            for i in range(100):
                a.put(K(i), V(i, 4000))
                stored += 1
        assert stored == 7  # 7 * 4000 <= 30000 < 8 * 4000
        assert a.put(K(0), V(0, 4000)) is False  # a re-put of a live entry costs nothing
        with pytest.raises(CapacityExceeded):  # a batch over quota stores nothing
            a.put_many([PutItem(K(200), b"x" * 1000), PutItem(K(201), b"y" * 3000)])
        assert a.lookup([K(200)]).hit_blocks == 0
        for i in range(7):  # tenant B keeps its whole quota
            assert b.put(K(i), V(i, 4000))
        assert a.delete(K(0))  # room comes back
        assert a.put(K(50), V(50, 4000))
        assert a.put(K(51), b"t" * 1000, ttl_s=0.3)
    finally:
        a.close()
        b.close()
        d.stop(grace_s=1)
    # the accounting persists: after a restart tenant A is still full
    d = _daemon(tmp_path, tokens_file=tokens_file, tenant_quota_bytes=30_000)
    try:
        with kvstore.connect(d.address, token=TOK_A) as a:
            with pytest.raises(CapacityExceeded):
                a.put(K(60), V(60, 4000))
            # The TTL entry expired: the quota is recomputed from live entries, at the next
            # prune (at most one per PRUNE_EVERY_S per tenant; the refusal above pruned).
            time.sleep(PRUNE_EVERY_S + 0.2)
            assert a.put(K(61), b"z" * 1000)
            assert [a.get(K(i)) for i in range(1, 7)] == [V(i, 4000) for i in range(1, 7)]
        assert d.store.check() == []
    finally:
        d.stop(grace_s=1)


def test_refused_puts_of_a_full_tenant_do_not_rescan_its_rows_each_time(tmp_path, tokens_file, monkeypatch):
    """Every put refused as over quota re-read all the tenant's rows under the daemon-wide
    quota lock (0.35 s per refusal at 40k rows, other tenants' puts waiting seconds); now
    at most one prune per PRUNE_EVERY_S per tenant."""
    d = _daemon(tmp_path, tokens_file=tokens_file, tenant_quota_bytes=10_000)
    calls = []
    real = d.quota.prune
    monkeypatch.setattr(d.quota, "prune", lambda tenant: calls.append(tenant) or real(tenant))
    try:
        with kvstore.connect(d.address, token=TOK_A) as a, kvstore.connect(d.address, token=TOK_B) as b:
            assert a.put(K(1), V(1, 9000))
            for i in range(20):
                with pytest.raises(CapacityExceeded):
                    a.put(K(100 + i), V(i, 4000))
            assert len(calls) == 1
            assert b.put(K(1), V(1, 4000))  # the other tenant is unaffected
    finally:
        d.stop(grace_s=1)
