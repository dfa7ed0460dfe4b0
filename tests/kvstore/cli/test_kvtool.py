"""kvtool against daemon URLs: the same answers as on a data directory, read-only inspect,
sharded sets with a shard down, tenants, timeouts and TLS failures in one line.

Every daemon listens on 127.0.0.1 (``make_daemon``); a "down" shard is a loopback port
nothing listens on. Waits are bounded (``--timeout``, subprocess timeouts).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

import kvstore
from kvstore import PutItem
from kvstore.cli.kvtool import main
from kvstore.proto import kvstore_pb2 as pb
from kvstore.errors import DeadlineExceeded

from tests.kvstore.daemons import ROOT, subprocess_env

TOK_A, TOK_B, TOK_OPS = "token-aaaaaaaa", "token-bbbbbbbb", "token-opsopsops"
DAEMON_ENV = ("KVSTORE_TOKEN", "KVSTORE_CA_FILE", "KVSTORE_CERT_FILE", "KVSTORE_KEY_FILE", "KVSTORE_DATA_DIR")


def K(i) -> bytes:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


@pytest.fixture
def run_tool(capsys, monkeypatch):
    """kvtool in-process, with no client settings from the environment: (code, stdout, stderr)."""
    for name in DAEMON_ENV:
        monkeypatch.delenv(name, raising=False)

    def run(*argv: object) -> tuple[int, str, str]:
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return run


@pytest.fixture
def tokens_file(tmp_path) -> str:
    p = tmp_path / "tokens.toml"
    p.write_text(f'admin_tenants = ["ops"]\n[tokens]\n"{TOK_A}" = "tenant-a"\n"{TOK_B}" = "tenant-b"\n'
                 f'"{TOK_OPS}" = "ops"\n')
    return str(p)


def dead_url() -> str:
    """A loopback URL nothing listens on (a shard that is down)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"grpc://127.0.0.1:{port}"


def away(data_dir: str, *names: str) -> list[tuple[Path, Path]]:
    moved = []
    for n in names:
        src = Path(data_dir) / "targets" / n
        dst = src.with_name(n + ".away")
        src.rename(dst)
        moved.append((src, dst))
    return moved


# A progress line of a maintenance pass (kvstore.cli.progress, not on a TTY): gc, verify and
# repair through a daemon print them as on a data directory (the daemon's ``Maintain``); through
# a set of daemons each phase is named after its shard (``grpc://H:P verify``).
PROGRESS_LINE = re.compile(r"kvtool: (grpcs?://\S+ )?[a-z_]+: (\d+/\d+ \(\d+%\)|nothing to do)$")


def one_line(err: str) -> str:
    """The one message line of ``err`` (returned with its newline), the last one written;
    before it only progress lines may come."""
    lines = err.splitlines()
    assert err.endswith("\n") and lines and "Traceback" not in err, err
    assert all(PROGRESS_LINE.match(line) for line in lines[:-1]) and not PROGRESS_LINE.match(lines[-1]), err
    return lines[-1] + "\n"


# ----------------------------------------------------------------------------- A: inspect --key
def test_inspect_key_on_a_daemon_is_read_only_and_as_on_the_data_directory(make_daemon, run_tool) -> None:
    from kvstore.api import EntryKind
    from kvstore import index_view

    d = make_daemon()
    keys = [K(i) for i in range(6)]
    with kvstore.connect(d.address) as s:
        assert all(s.put_many([PutItem(k, b"v%d" % i * 500, tokens=3) for i, k in enumerate(keys)]))
        s.put(K("ttl"), b"short-lived" * 100, ttl_s=0.05)
    time.sleep(0.1)  # its TTL passes; no background GC (gc_interval_s=0) removes it
    before = dict(d.store.counters)
    for key, kind in [(k, "block") for k in keys] + [(K("ttl"), "block"), (keys[0], "swa")]:
        code, out, _ = run_tool("inspect", d.address, "--key", key.hex(), "--kind", kind, "--json")
        # what kvtool prints for a data directory: index_view's record of the same store
        local = json.loads(json.dumps(index_view.entry_view(d.store, key, EntryKind.parse(kind))))
        assert (code, json.loads(out)) == (1 if local["state"] == "absent" else 0, local), key.hex()
    code, text, _ = run_tool("inspect", d.address, "--key", K("ttl").hex())
    assert code == 0 and "live (expired, awaiting gc)" in text.splitlines()[0]  # not "absent"
    # nothing was read, refreshed or counted: no get, no bytes out, no pending access time
    assert dict(d.store.counters) == before and not d.store.access.pending()
    reg = d.metrics.registry
    assert reg.get_sample_value("kvstore_requests_total", {"method": "Inspect", "code": "OK"}) == 9
    assert reg.get_sample_value("kvstore_bytes_out_total") == 0
    # One target away: degraded (not plain "live"); three away and a verify: lost (not "absent").
    away(str(d.store.data_dir), "t1")
    code, text, _ = run_tool("inspect", d.address, "--key", keys[1].hex())
    assert code == 0 and text.startswith(f"block {keys[1].hex()}: live (degraded: fragments on down targets t1)")
    away(str(d.store.data_dir), "t2", "t3")
    assert run_tool("verify", d.address)[0] == 1
    code, out, _ = run_tool("inspect", d.address, "--key", keys[2].hex(), "--json")
    lost = json.loads(out)
    assert code == 1 and lost["state"] == "lost"  # no value to read: a problem (before: 0, as if healthy)
    code_text, lost_text, _ = run_tool("inspect", d.address, "--key", keys[2].hex())
    data_dir = str(d.store.data_dir)
    d.stop()
    code, out, _ = run_tool("inspect", data_dir, "--key", keys[2].hex(), "--json")
    assert (code, json.loads(out)) == (1, lost)  # the data directory's answer, exit code included
    assert run_tool("inspect", data_dir, "--key", keys[2].hex())[:2] == (code_text, lost_text)


def test_inspect_key_per_tenant_namespace(make_daemon, run_tool, tokens_file, monkeypatch, tmp_path) -> None:
    d = make_daemon(tokens_file=tokens_file)
    with kvstore.connect(d.address, token=TOK_A) as a:
        a.put(K("mine"), b"tenant a's" * 100, kind="swa")
    stored = d.tokens.tenants_by_token[TOK_A.encode()].store_key(K("mine"))
    monkeypatch.setenv("KVSTORE_TOKEN", TOK_A)
    code, out, _ = run_tool("inspect", d.address, "--key", K("mine").hex(), "--kind", "swa", "--json")
    view = json.loads(out)
    assert code == 0 and view["state"] == "live" and view["key"] == K("mine").hex()  # named as sent
    # Not an admin: nothing of where the fragments are or of the targets' health (their names
    # may spell URLs with credentials); the text form too.
    assert "targets" not in view and "degraded" not in view and view["plain_bytes"] == 1000
    code, out, _ = run_tool("inspect", d.address, "--key", K("mine").hex(), "--kind", "swa")
    assert code == 0 and "fragments" not in out and ": live" in out
    code, out, _ = run_tool("inspect", d.address, "--chain", f"{K('x').hex()},{K('mine').hex()}", "--json")
    assert code == 0 and [p["swa"] for p in json.loads(out)["positions"]] == ["absent", "live"]
    monkeypatch.setenv("KVSTORE_TOKEN", TOK_B)  # another tenant: A's entry does not exist for it
    code, out, _ = run_tool("inspect", d.address, "--key", K("mine").hex(), "--kind", "swa", "--json")
    assert code == 1 and json.loads(out)["state"] == "absent"
    code, out, err = run_tool("inspect", d.address)  # the summary is the whole store's: admins only
    assert code == 2 and out == ""
    assert one_line(err).startswith("kvtool: error: inspect needs an admin tenant's token")
    # The admin names index keys, as kvtool on the data directory and verify do.
    tok = tmp_path / "ops.token"
    tok.write_text(TOK_OPS + "\n")
    code, out, _ = run_tool("inspect", d.address, "--key", stored.hex(), "--kind", "swa", "--json",
                            "--token-file", tok)  # the flag wins over KVSTORE_TOKEN
    assert code == 0 and json.loads(out)["state"] == "live" and json.loads(out)["key"] == stored.hex()
    assert len(json.loads(out)["targets"]) == 6  # an admin sees the placement
    assert run_tool("inspect", d.address, "--token-file", tok)[0] == 0


def test_delete_takes_the_keys_inspect_names(make_daemon, run_tool, tokens_file, monkeypatch, tmp_path) -> None:
    """An admin's ``inspect --key`` names index keys; its ``delete --key`` of the same key said
    "no block entry" (the daemon mapped it into the admin's own namespace), so an entry verify
    or inspect showed could not be deleted through the daemon. A tenant deletes its own keys,
    and only those; on a sharded set every shard is asked (an index key names no owner)."""
    d, other = make_daemon("one", tokens_file=tokens_file), make_daemon("two", tokens_file=tokens_file)
    url = f"{d.address},{other.address}"
    with kvstore.connect(url, token=TOK_A) as a:
        a.put_many([PutItem(K(f"d{i}"), b"a" * 300) for i in range(16)])
        owners = [a.urls[a.owner(K(f"d{i}"))] for i in range(16)]
    assert len(set(owners)) == 2  # both shards hold some
    by_url = {x.address: x.tokens.tenants_by_token[TOK_A.encode()] for x in (d, other)}  # each its own secret
    stored = [by_url[owners[i]].store_key(K(f"d{i}")) for i in range(16)]
    tok = tmp_path / "ops.token"
    tok.write_text(TOK_OPS + "\n")
    on_d, on_other = owners.index(d.address), owners.index(other.address)
    keys = [stored[on_d].hex(), stored[on_other].hex()]
    # one daemon: the key it holds is deleted, the other is absent there; then the set: every
    # shard asked, so the key on the other shard is found and deleted, the first is gone
    for u, want in ((d.address, [True, False]), (url, [False, True])):
        code, out, err = run_tool("delete", u, "--key", keys[0], "--key", keys[1], "--json", "--token-file", tok)
        assert code == 1 and json.loads(out)["deleted"] == dict(zip(keys, want)), (out, err)
    gone = {on_d, on_other}
    monkeypatch.setenv("KVSTORE_TOKEN", TOK_B)  # another tenant: neither A's keys nor its index keys
    left = [i for i in range(16) if i not in gone]
    code, out, _ = run_tool("delete", url, "--key", K(f"d{left[0]}").hex(), "--key", stored[left[1]].hex(), "--json")
    assert code == 1 and set(json.loads(out)["deleted"].values()) == {False}
    monkeypatch.setenv("KVSTORE_TOKEN", TOK_A)  # the tenant itself: its own keys
    code, out, _ = run_tool("delete", url, "--key", K(f"d{left[0]}").hex(), "--json")
    assert code == 0 and json.loads(out)["deleted"] == {K(f"d{left[0]}").hex(): True}
    gone.add(left[0])
    with kvstore.connect(url, token=TOK_A) as a:
        assert [v is None for v in a.get_many([K(f"d{i}") for i in range(16)])] == [i in gone for i in range(16)]


def test_inspect_rpc_refuses_bad_requests_and_stays_read_only(make_daemon) -> None:
    d = make_daemon(max_batch_items=4)
    with kvstore.connect(d.address) as s:
        s.put(K(1), b"x" * 100)
    with grpc.insecure_channel(d.address.split("://")[1]) as ch:
        call = ch.unary_unary("/kvstore.v1.KVStore/Inspect")
        for req in (pb.InspectRequest(keys=[b"short"]), pb.InspectRequest(keys=[K(1)], kind="bogus"),
                    pb.InspectRequest(keys=[K(i) for i in range(5)])):
            with pytest.raises(grpc.RpcError) as ei:
                call(req.SerializeToString(), timeout=10)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as ei:
            call(b"\x0a\x10" + K(1)[:5], timeout=10)  # truncated
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with kvstore.connect(d.address, max_batch_items=4) as s:
        keys = [K(i) for i in range(10)]  # more than max_batch_items: sent in pieces, answered in order
        assert [v["state"] for v in s.inspect_entries(keys)] == ["absent", "live"] + ["absent"] * 8
        assert [r["position"] for r in s.inspect_chain(keys)] == list(range(10))
    assert d.store.check() == []


# ----------------------------------------------------------------------------- B: inspect summary
def test_inspect_summary_on_a_daemon_is_the_data_directory_schema(make_daemon, run_tool) -> None:
    d = make_daemon()
    with kvstore.connect(d.address) as s:
        s.put_many([PutItem(K(i), b"s" * 300, kind="swa" if i % 3 == 0 else "block") for i in range(9)])
    code, out, _ = run_tool("inspect", d.address, "--json")
    remote = json.loads(out)
    code_t, remote_text, _ = run_tool("inspect", d.address)
    assert code == code_t == 0
    assert remote["by_kind"]["swa"]["entries"] == 3 and remote["total"]["entries"] == 9
    assert {t["name"] for t in remote["targets"]} == {f"t{i}" for i in range(6)} and "lost" in remote["total"]
    data_dir = str(d.store.data_dir)
    d.stop()
    code, out, _ = run_tool("inspect", data_dir, "--json")
    assert code == 0 and json.loads(out) == remote
    assert run_tool("inspect", data_dir)[1] == remote_text


# ----------------------------------------------------------------------------- C, D: sharded sets
def _two_shards(make_daemon, n: int = 12) -> tuple[list, list[bytes]]:
    a, b = make_daemon("a"), make_daemon("b")
    keys = [K(f"sh{i}") for i in range(n)]
    with kvstore.connect(f"{a.address},{b.address}") as s:
        assert all(s.put_many([PutItem(k, b"v" * 2000) for k in keys]))
        s.put(keys[0], b"w" * 500, kind="swa")
    return [a, b], keys


def test_sharded_maintenance_with_a_shard_down_keeps_the_others_results(make_daemon, run_tool) -> None:
    (a, b), keys = _two_shards(make_daemon)
    down = dead_url()
    url = f"{a.address},{b.address},{down}"
    entries = a.store.stats()["entries"] + b.store.stats()["entries"]
    for argv in (("gc", "--dry-run"), ("gc",), ("repair",), ("stats",), ("inspect",)):
        code, out, err = run_tool(*argv, url, "--json", "--timeout", "20")
        d = json.loads(out)  # what A and B did is printed
        assert code == 1, (argv, err)
        assert one_line(err).startswith(f"kvtool: error: {argv[0]}: shard {down} did not answer")
        assert "from the other 2 of 3 shards" in err
        assert set(d["shards"][down]) == {"error", "code"} and "error" not in d["shards"][a.address]
    assert d["total"]["entries"] == entries  # the inspect summary, of A and B
    code, out, err = run_tool("verify", url, "--json", "--timeout", "20")
    d = json.loads(out)
    assert code == 1 and one_line(err).startswith(f"kvtool: error: verify: shard {down} did not answer")
    assert [(p["kind"], p["target"]) for p in d["problems"]] == [("target_down", down)]
    assert d["checked_entries"] == entries
    code, out, err = run_tool("gc", url, "--timeout", "20")  # text: the sums, then the line on stderr
    assert code == 1 and out.startswith("gc: expired 0") and "did not answer" in one_line(err)  # after progress
    # inspect --key / --chain: the answering shards' views, the down one named (before: nothing, exit 2)
    code, out, err = run_tool("inspect", url, "--key", keys[0].hex(), "--json", "--timeout", "20")
    d = json.loads(out)
    assert code == 1 and d["state"] == "live" and d["shard"] in (a.address, b.address), (code, err)
    assert one_line(err).startswith(f"kvtool: error: inspect: shard {down} did not answer") and down in d["unanswered"]
    code, out, err = run_tool("inspect", url, "--chain", ",".join(k.hex() for k in keys[:3]), "--timeout", "20")
    assert code == 1 and out.startswith("chain of 3: hit_blocks=3 swa_at=1"), (code, out, err)
    assert one_line(err).startswith(f"kvtool: error: inspect: shard {down} did not answer")
    with pytest.raises(kvstore.StoreUnavailable):  # no shard answering is an error, not an empty result
        with kvstore.connect(f"{dead_url()},{down}", timeout_s=10) as s:
            s.gc()


def test_sharded_results_keep_every_field(make_daemon, run_tool) -> None:
    (a, b), keys = _two_shards(make_daemon)
    url = f"{a.address},{b.address}"
    code, out, _ = run_tool("gc", url, "--dry-run", "--json")
    assert code == 0 and json.loads(out)["dry_run"] is True
    code, out, _ = run_tool("stats", url, "--json")
    st = json.loads(out)
    assert code == 0 and st["pack_dead_bytes"] == 0 and len(st["targets"]) == 12
    assert {t["name"] for t in st["targets"]} == {f"{u}/t{i}" for u in (a.address, b.address) for i in range(6)}
    assert st["entries"] == len(keys) + 1 and st["erasure_code"] == a.store.stats()["erasure_code"]
    code, out, _ = run_tool("inspect", url, "--key", keys[0].hex(), "--kind", "swa", "--json")
    view = json.loads(out)
    assert code == 0 and view["state"] == "live" and view["shard"] in (a.address, b.address)
    code, out, _ = run_tool("inspect", url, "--chain", ",".join(k.hex() for k in keys[:3]), "--json")
    assert code == 0 and json.loads(out)["hit_blocks"] == 3
    # Three targets of A away: A's entries are lost, and verify says on which shard, every
    # target of a lost entry prefixed with it (not only the first name of the list).
    a_keys = {k.hex() for k in keys if a.store.probe([k])[0] == b"\x01"}
    assert a_keys
    moved = away(str(a.store.data_dir), "t0", "t1", "t2")
    code, out, _ = run_tool("verify", url, "--json")
    d = json.loads(out)
    assert code == 1 and {x["key"] for x in d["lost"] if x["kind"] == "block"} == a_keys
    assert {x["shard"] for x in d["lost"]} == {a.address}
    for p in d["problems"]:
        assert all(t.startswith(a.address + "/") for t in p["target"].split(",")), p
    for src, dst in moved:
        dst.rename(src)
    assert run_tool("repair", url)[0] == 0 and run_tool("verify", url)[0] == 0


def test_verify_repair_and_gc_through_a_daemon_show_their_progress(make_daemon, run_tool) -> None:
    """A pass through a daemon prints its progress on stderr as on a data directory (before,
    nothing until the answer came back: the unary Gc/Check/Repair carry no progress), and
    answers as the unary call does (the Python API takes ``progress=`` as the embedded store)."""
    d = make_daemon()
    keys = [K(i) for i in range(40)]
    with kvstore.connect(d.address) as s:
        assert all(s.put_many([PutItem(k, os.urandom(3000)) for k in keys]))
        moved = away(str(d.store.data_dir), "t0", "t1", "t2")  # m+1 away: some entries lost
        code, out, err = run_tool("verify", d.address, "--json")
        lines = err.splitlines()
        assert code == 1 and lines and all(PROGRESS_LINE.match(line) for line in lines), err
        assert any(line.startswith("kvtool: verify: ") and line.endswith("(100%)") for line in lines), err
        seen: list[tuple[str, int, int]] = []
        got = s.check(progress=lambda *a: seen.append(a))
        assert sorted(map(repr, got)) == sorted(map(repr, s.check())) == sorted(
            map(repr, d.store.check())) and got
        assert seen[0][:2] == ("verify", 0) and seen[-1][0] == "orphans" and seen[-1][1] == seen[-1][2]
        for src, dst in moved:
            dst.rename(src)
        code, out, err = run_tool("repair", d.address)
        assert code == 0 and "kvtool: verify: " in err, err
        phases: set[str] = set()
        assert s.gc(dry_run=True, progress=lambda p, done, total: phases.add(p)) == s.gc(dry_run=True)
        assert {"expire", "evict", "purge", "orphans"} <= phases
        assert s.repair(progress=lambda *a: None)["targets_down"] == 0
        with pytest.raises(grpc.RpcError) as e:
            list(s._rpc.stub.Maintain(pb.MaintainRequest(op="scrub"), timeout=10))
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "Maintain op must be one of check, gc, rebuild-index, repair, got 'scrub'" in e.value.details()


def test_a_check_with_more_problems_than_one_message_holds(make_daemon, run_tool) -> None:
    """A check's problems come in as many messages as they need (40,000 problems made one
    6.7 MB reply, and a verify through a daemon with a 1 MiB message limit failed whole)."""
    d = make_daemon(max_message_bytes=64 * 1024)
    keys = [K(i) for i in range(800)]
    with kvstore.connect(d.address) as s:
        for i in range(0, len(keys), 200):
            assert all(s.put_many([PutItem(k, b"v" * 100) for k in keys[i:i + 200]]))
        away(str(d.store.data_dir), "t0")  # a fragment of every entry missing: 800 problems
        want = d.store.check()
        assert len(want) >= 800 and sum(len(repr(p)) for p in want) > 2 * 64 * 1024
        assert sorted(map(repr, s.check())) == sorted(map(repr, want))
        code, out, err = run_tool("verify", d.address, "--json")
        assert code == 1 and len(json.loads(out)["problems"]) == len(want), err


def test_a_pass_through_a_set_of_daemons_shows_each_shards_progress(make_daemon, run_tool) -> None:
    a, b = make_daemon("a"), make_daemon("b")
    url = f"{a.address},{b.address}"
    with kvstore.connect(url) as s:
        assert all(s.put_many([PutItem(K(i), os.urandom(2000)) for i in range(30)]))
        code, out, err = run_tool("verify", url)
        assert code == 0 and all(PROGRESS_LINE.match(line) for line in err.splitlines()), err
        for d in (a, b):
            assert f"kvtool: {d.address} verify: " in err and f"kvtool: {d.address} orphans: " in err, err
        phases: set[str] = set()
        assert s.gc(dry_run=True, progress=lambda p, done, total: phases.add(p))["dry_run"] is True
        assert {f"{d.address} purge" for d in (a, b)} <= phases
        assert s.repair(progress=lambda *x: None)["targets_down"] == 0


# ----------------------------------------------------------------------------- F: tenants
def test_verify_as_a_non_admin_names_the_command(make_daemon, run_tool, tokens_file, monkeypatch) -> None:
    d = make_daemon(tokens_file=tokens_file)
    monkeypatch.setenv("KVSTORE_TOKEN", TOK_A)
    for cmd in ("verify", "stats", "gc", "repair"):
        code, out, err = run_tool(cmd, d.address)
        assert code == 2 and out == ""
        assert one_line(err).startswith(f"kvtool: error: {cmd} needs an admin tenant's token: set KVSTORE_TOKEN")
    monkeypatch.setenv("KVSTORE_TOKEN", TOK_OPS)  # the variable keeps working
    assert run_tool("verify", d.address)[0] == 0
    monkeypatch.delenv("KVSTORE_TOKEN")
    code, _, err = run_tool("stats", d.address)
    assert code == 2 and "KVSTORE_TOKEN" in one_line(err)


# ----------------------------------------------------------------------------- I: timeouts
def test_a_hung_maintenance_call_times_out_in_one_line(make_daemon, run_tool) -> None:
    d = make_daemon()
    release = threading.Event()
    real_check = d.store.check

    def hung_check(*a, **kw):
        release.wait(30)  # accepted, then no answer (bounded: the test releases it)
        return real_check(*a, **kw)

    d.store.check = hung_check
    try:
        t0 = time.monotonic()
        code, out, err = run_tool("verify", d.address, "--timeout", "1.5")
        assert code == 2 and out == "" and time.monotonic() - t0 < 15
        assert "verify: Check on" in one_line(err) and "no answer from the kvstore daemon within 1.5 s" in err
        assert "--timeout SECONDS" in err
    finally:
        release.set()
    # That pass runs on until released (it never reaches a step where it could stop), and
    # Maintain runs one pass at a time: the next check waits for its slot to come back.
    for _ in range(100):
        if d.passes.semaphore.acquire(blocking=False):
            d.passes.semaphore.release()
            break
        time.sleep(0.05)
    release = threading.Event()
    try:
        with kvstore.connect(d.address, maintenance_timeout_s=1) as s:
            with pytest.raises(DeadlineExceeded, match="within 1 s"):
                s.check()
            assert s.stats()["entries"] == 0  # other calls keep their own deadline
    finally:
        release.set()
    with pytest.raises(kvstore.InvalidRequest, match="maintenance_timeout_s"):
        kvstore.connect(d.address, maintenance_timeout_s=0)
    assert run_tool("verify", d.address, "--timeout", "0")[0] == 2  # a usage error


# ----------------------------------------------------------------------------- H: gRPC's own log
def test_a_tls_failure_is_one_line_without_grpc_log_lines(make_daemon, certs) -> None:
    d = make_daemon(tls_cert=certs["server"], tls_key=certs["server_key"])
    env = subprocess_env(KVSTORE_CA_FILE=certs["other_ca"])  # not the CA that signed the daemon's cert
    env.pop("GRPC_VERBOSITY", None)
    env.pop("GRPC_TRACE", None)
    r = subprocess.run([sys.executable, "-m", "kvstore.cli.kvtool", "stats", d.address, "--timeout", "10"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.startswith("kvtool: error: stats: ") and "TLS handshake failed" in r.stderr
    assert r.stderr.count("\n") == 1, r.stderr  # gRPC's "Handshake failed" log line did not leak
    r = subprocess.run([sys.executable, "-m", "kvstore.cli.kvtool", "stats", d.address, "--ca-file", certs["ca"],
                        "--json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert r.returncode == 0 and json.loads(r.stdout)["entries"] == 0, r.stderr  # the flag wins over the variable


# ----------------------------------------------------------------------------- E: a shard down, key by key
def _one_up_one_down(make_daemon, stored: int = 3) -> tuple[str, str, list[bytes], list[bytes]]:
    """A set of a live daemon and a dead URL: (set URL, dead URL, keys the live shard owns, the
    first ``stored`` of them put there, keys the dead shard owns: in no store)."""
    a, down = make_daemon("a"), dead_url()
    url = f"{a.address},{down}"
    with kvstore.connect(url) as s:
        owners = {K(f"e{i}"): s.urls[s.owner(K(f"e{i}"))] for i in range(40)}
    up_keys = [k for k, u in owners.items() if u == a.address][:stored + 2]
    down_keys = [k for k, u in owners.items() if u == down][:3]
    assert len(up_keys) == stored + 2 and len(down_keys) == 3
    with kvstore.connect(a.address) as s:
        assert all(s.put_many([PutItem(k, b"e" * 800) for k in up_keys[:stored]]))
    return url, down, up_keys, down_keys


def test_sharded_delete_with_a_shard_down_deletes_and_reports_the_rest(make_daemon, run_tool) -> None:
    """Before: the first key of the down shard ended the run (exit 2, nothing printed), keys
    deleted before it went unreported and the healthy shard's keys after it were never tried.
    Every shard is asked (an admin's index key names no owner the client can compute), so a
    key no answering shard held is unknown (null), not absent, while a shard is down."""
    url, down, up_keys, down_keys = _one_up_one_down(make_daemon, stored=3)
    a_url = url.split(",")[0]
    # a down key first, the live shard's keys after it (two stored, one never stored), another down key
    order = [down_keys[0], up_keys[0], up_keys[1], up_keys[4], down_keys[1]]
    argv = [x for k in order for x in ("--key", k.hex())]
    code, out, err = run_tool("delete", url, *argv, "--json", "--timeout", "20")
    d = json.loads(out)
    assert code == 1, (out, err)
    assert d["kind"] == "block" and d["deleted"] == {down_keys[0].hex(): None, up_keys[0].hex(): True,
                                                     up_keys[1].hex(): True, up_keys[4].hex(): None,
                                                     down_keys[1].hex(): None}
    assert list(d["unanswered"]) == [down]
    assert one_line(err).startswith(f"kvtool: error: delete: shard {down} did not answer")
    with kvstore.connect(a_url) as s:  # really deleted on the shard that answered
        assert s.probe([up_keys[0], up_keys[1], up_keys[2]])[0] == b"\x00\x00\x01"
    code, out, err = run_tool("delete", url, "--key", down_keys[2].hex(), "--key", up_keys[2].hex(),
                              "--timeout", "20")
    assert code == 1 and one_line(err).startswith(f"kvtool: error: delete: shard {down} did not answer")
    assert out.splitlines()[:2] == [f"block entry {down_keys[2].hex()}: unknown (shard {down} did not answer)",
                                    f"deleted block entry {up_keys[2].hex()}"]
    assert "no block entry" not in out
    # no shard answering at all: nothing was done anywhere, the store's error (exit 2)
    code, out, err = run_tool("delete", f"{down},{dead_url()}", "--key", down_keys[0].hex(), "--json",
                              "--timeout", "20")
    assert code == 2 and out == "" and down in one_line(err)


def test_sharded_inspect_with_a_shard_down_says_unknown_not_absent(make_daemon, run_tool) -> None:
    """Before: a key no answering shard holds printed ``absent`` (JSON "absent") and a chain
    stopping at one claimed a definite ``hit_blocks``."""
    url, down, up_keys, down_keys = _one_up_one_down(make_daemon, stored=2)
    a_url = url.split(",")[0]
    code, out, err = run_tool("inspect", url, "--key", down_keys[0].hex(), "--json", "--timeout", "20")
    d = json.loads(out)
    assert code == 1 and d["state"] == "unknown" and d["shard"] is None and down in d["unanswered"]
    assert one_line(err).startswith(f"kvtool: error: inspect: shard {down} did not answer")
    code, out, _ = run_tool("inspect", url, "--key", down_keys[0].hex(), "--timeout", "20")
    assert code == 1 and out == f"block {down_keys[0].hex()}: unknown (shard {down} did not answer)\n"
    chain = [down_keys[0], up_keys[0]]
    code, out, _ = run_tool("inspect", url, "--chain", ",".join(k.hex() for k in chain), "--json", "--timeout", "20")
    d = json.loads(out)
    assert code == 1 and d["hit_blocks"] is None and d["hit_blocks_at_least"] == 0 and d["swa_at"] is None
    # the live block's shard answered, and a key's SWA lives with its block: that absence is known
    assert [(p["block"], p["swa"]) for p in d["positions"]] == [("unknown", "unknown"), ("live", "absent")]
    code, out, _ = run_tool("inspect", url, "--chain", ",".join(k.hex() for k in chain), "--timeout", "20")
    assert code == 1 and out.startswith(f"chain of 2: hit_blocks=unknown (at least 0: shard {down} did not answer)")
    assert out.splitlines()[2].split()[2:] == ["unknown", "unknown"]  # position 0, not "absent"
    chain = [up_keys[0], up_keys[1], down_keys[1]]
    code, out, _ = run_tool("inspect", url, "--chain", ",".join(k.hex() for k in chain), "--json", "--timeout", "20")
    d = json.loads(out)
    assert code == 1 and (d["hit_blocks"], d["hit_blocks_at_least"]) == (None, 2)
    # every shard answering: absent is absent, and the walk is definite
    code, out, _ = run_tool("inspect", a_url, "--chain", ",".join(k.hex() for k in chain), "--json")
    d = json.loads(out)
    assert code == 0 and d["hit_blocks"] == 2 and d["positions"][2]["block"] == "absent"
    assert "hit_blocks_at_least" not in d
    code, out, _ = run_tool("inspect", a_url, "--key", down_keys[0].hex(), "--json")
    assert code == 1 and json.loads(out)["state"] == "absent"


def test_gc_past_capacity_through_a_daemon_and_a_set_prints_the_counts(make_daemon, run_tool, tmp_path) -> None:
    """A daemon's gc that cannot get under its capacity (everything left pinned) sends the pass's
    counts with the error (``kvstore-gc-result``): kvtool prints them and exits 1, as on a data
    directory. Before: nothing on stdout, and on a sharded set that shard was reported as not
    answering, its counts dropped."""
    data = str(tmp_path / "full")
    with kvstore.connect(data, fsync=False) as s:  # filled before the capacity is set
        for i in range(5):
            s.put(bytes([i + 1]) * 16, os.urandom(20_000))
            assert s.pin(bytes([i + 1]) * 16)
        s.put(b"\xee" * 16, b"x" * 2000)
        assert s.delete(b"\xee" * 16)
    full = make_daemon("full", data_dir=data, capacity_bytes=50_000, delete_grace_s=0)
    other = make_daemon("other")
    with kvstore.connect(full.address) as s:
        with pytest.raises(kvstore.CapacityExceeded) as ei:
            s.gc(dry_run=True)
        assert ei.value.result["purged"] == 1 and ei.value.result["dry_run"] is True
    code, out, err = run_tool("gc", full.address, "--json")
    d = json.loads(out)
    assert code == 1 and d["purged"] == 1 and d["used_bytes"] > 50_000, err
    assert one_line(err).startswith("kvtool: error: gc: ") and "pinned" in err
    with kvstore.connect(other.address) as s:
        s.put(b"\xdd" * 16, b"y" * 2000)
        assert s.delete(b"\xdd" * 16)
    code, out, err = run_tool("gc", f"{full.address},{other.address}", "--json")
    d = json.loads(out)
    assert code == 1 and "pinned" in err and "did not answer" not in err, err
    assert set(d["shards"]) == {full.address, other.address}
    assert not any("error" in v for v in d["shards"].values())
