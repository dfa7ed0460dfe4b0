"""kvtool's options and output shapes that need no daemon: delete's JSON, a mistyped daemon
URL, the daemon flags and their environment in --help and the README."""

from __future__ import annotations

import json
import re
from pathlib import Path

import kvstore
from tests.kvstore.cli.conftest import populate

ROOT = Path(__file__).resolve().parents[3]
CLIENT_ENV = ("KVSTORE_TOKEN", "KVSTORE_CA_FILE", "KVSTORE_CERT_FILE", "KVSTORE_KEY_FILE")


def test_delete_json_has_one_shape_for_any_number_of_keys(store_dir, run_tool):
    a, b = list(store_dir.swa)[:2]
    code, out, _ = run_tool("delete", store_dir.path, "--key", a.hex(), "--kind", "swa", "--json")
    assert code == 0 and json.loads(out) == {"kind": "swa", "deleted": {a.hex(): True}}
    code, out, _ = run_tool("delete", store_dir.path, "--key", a.hex(), "--kind", "swa", "--json")
    assert code == 1 and json.loads(out) == {"kind": "swa", "deleted": {a.hex(): False}}
    code, out, _ = run_tool("delete", store_dir.path, "--key", a.hex(), "--key", b.hex(), "--kind", "swa", "--json")
    assert code == 1 and json.loads(out) == {"kind": "swa", "deleted": {a.hex(): False, b.hex(): True}}
    c = store_dir.chain[0]  # a key given twice is deleted once, and reported deleted
    code, out, _ = run_tool("delete", store_dir.path, "--key", c.hex(), "--key", c.hex(), "--json")
    assert code == 0 and json.loads(out) == {"kind": "block", "deleted": {c.hex(): True}}
    with kvstore.connect(str(store_dir.path)) as store:
        assert store.check() == []


def test_a_mistyped_daemon_url_says_how_to_write_it(run_tool, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url in ("grpc:/127.0.0.1:17071", "grpc:127.0.0.1:17071", "GRPCS:/127.0.0.1:1"):
        for cmd in ("verify", "stats", "inspect"):
            code, out, err = run_tool(cmd, url)
            assert code == 2 and out == "" and err.count("\n") == 1, (url, err)
            assert "://HOST:PORT" in err and "does not exist" not in err, err
    assert list(tmp_path.iterdir()) == []  # nothing created
    odd = tmp_path / "grpc:odd"  # a directory with such a name is still a directory
    odd.mkdir()
    code, _, err = run_tool("stats", "grpc:odd")
    assert code == 2 and "not a kvstore data directory" in err


def test_daemon_flags_are_refused_for_a_data_directory(store_dir, run_tool, tmp_path):
    tok = tmp_path / "token"
    tok.write_text("token-opsopsops\n")
    for flags in (("--timeout", "5"), ("--token-file", tok), ("--ca-file", tmp_path / "ca.pem")):
        code, out, err = run_tool("stats", store_dir.path, *flags)
        assert code == 2 and out == "" and err.count("\n") == 1, err
        assert f"{flags[0]}: daemon options" in err and "drop them" in err
    for bad in ("0", "-1", "nan", "inf", "soon"):
        code, out, err = run_tool("verify", "grpc://127.0.0.1:1", "--timeout", bad)
        assert code == 2 and out == "" and "--timeout" in err, bad
    empty = tmp_path / "empty-token"
    empty.write_text("\n")
    for path, words in ((empty, "is empty"), (tmp_path / "missing", "cannot read")):
        code, out, err = run_tool("stats", "grpc://127.0.0.1:1", "--token-file", path)
        assert code == 2 and out == "" and err.count("\n") == 1 and words in err, err


def test_help_and_readme_name_the_client_environment(run_tool):
    code, out, _ = run_tool("--help")
    assert code == 0
    for cmd in ("verify", "inspect"):
        assert run_tool(cmd, "--help")[1].count("KVSTORE_TOKEN") >= 1
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("### Admin: `kvtool`"):]
    section = section[:section.index("\n### ", 1)]
    for name in CLIENT_ENV + ("--timeout", "--token-file", "--ca-file", "GRPC_VERBOSITY"):
        assert name in out, name
        assert name in section, name
    assert re.search(r"admin tenant", out) and "delete --json" in section


def test_two_stores_before_and_after_the_command_are_refused(run_tool, tmp_path):
    """Before: ``kvtool A stats --data-dir B`` (and ``--data-dir A stats --data-dir B``) ran on B."""
    a, b = populate(tmp_path / "a", n_blocks=1).path, populate(tmp_path / "b", n_blocks=1).path
    for argv in ((a, "stats", "--data-dir", b), ("--data-dir", a, "stats", "--data-dir", b),
                 ("stats", "--data-dir", a, "--data-dir", b), ("--data-dir", a, b, "stats"),
                 ("stats", a, "--data-dir", b), (a, "stats", b)):
        code, out, err = run_tool(*argv, "--json")
        assert code == 2 and out == "" and "two stores given" in err and "Traceback" not in err, argv
        assert err.strip().splitlines()[-1].startswith("kvtool"), err
    for argv in ((a, "stats", "--data-dir", a), ("--data-dir", a, "stats", "--data-dir", a), (a, "stats", a)):
        code, out, _ = run_tool(*argv, "--json")  # the same store twice is one store
        assert code == 0 and json.loads(out)["data_dir"] == str(a), argv
