"""``kvtool migrate`` (``kvstore.maintenance.migrate``): a version 2 data directory, refused by
every other command, taken to version 3 by rewriting its marker alone, only when no process
has its index open and the index is the directory's own; idempotent, ``--dry-run`` changes
nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore
from kvstore.embedded.datadir import DATA_FORMAT_VERSION
from tests.kvstore.cli.conftest import Populated, populate


def _as_version(path: Path, version: int) -> dict:
    """Rewrite the marker's ``format_version`` (a directory written by this code, as a release
    of ``version`` would have left it); returns the marker as it was."""
    marker = path / "kvstore.json"
    doc = json.loads(marker.read_text())
    assert doc["format_version"] == DATA_FORMAT_VERSION
    marker.write_text(json.dumps({**doc, "format_version": version}))
    return doc


def _raw(value: object) -> bytes:
    """A value read back as bytes (an array for an entry put with a layout)."""
    return value.tobytes() if hasattr(value, "tobytes") else bytes(value)


def _reads_back(p: Populated) -> None:
    with kvstore.connect(str(p.path)) as s:
        for key, raw in p.blocks.items():
            assert _raw(s.get(key)) == raw
        for key, raw in p.swa.items():
            assert _raw(s.get(key, kind="swa")) == raw
        assert s.check() == []


@pytest.fixture
def v2(tmp_path: Path) -> Populated:
    p = populate(tmp_path / "data")
    with kvstore.connect(str(p.path)) as s:  # single puts too: fragment files beside the batch's packs
        for key in p.chain[:2]:
            assert s.delete(key) and s.put(key, p.blocks[key], tokens=16)
    _as_version(p.path, 2)
    return p


def test_every_other_command_refuses_a_version_2_directory_naming_migrate(v2, run_tool):
    marker = (v2.path / "kvstore.json").read_bytes()
    for argv in (("verify",), ("stats",), ("inspect",), ("gc", "--dry-run"), ("rebuild-index",)):
        code, out, err = run_tool(*argv, v2.path)
        assert code == 2 and not out, (argv, out, err)
        assert f"run `kvtool migrate {v2.path}`" in err and err.count("\n") == 1, (argv, err)
    assert (v2.path / "kvstore.json").read_bytes() == marker


def test_migrate_takes_a_version_2_directory_to_3_and_every_entry_reads_back(v2, run_tool):
    before = json.loads((v2.path / "kvstore.json").read_text())
    fragments = sorted((f, f.stat().st_mtime_ns, f.stat().st_size)
                       for f in (v2.path / "targets").rglob("*") if f.is_file())
    code, out, err = run_tool("migrate", v2.path)
    assert code == 0 and "now format version 3 (was 2)" in out, (out, err)
    assert json.loads((v2.path / "kvstore.json").read_text()) == {**before, "format_version": 3}
    assert sorted((f, f.stat().st_mtime_ns, f.stat().st_size)
                  for f in (v2.path / "targets").rglob("*") if f.is_file()) == fragments  # no fragment touched
    assert not list(v2.path.glob(".kvstore.json.*"))  # no temporary marker left
    _reads_back(v2)
    code, out, err = run_tool("verify", v2.path)
    assert code == 0, (out, err)


def test_migrate_again_is_nothing_to_do(v2, run_tool):
    assert run_tool("migrate", v2.path)[0] == 0
    marker = (v2.path / "kvstore.json").read_bytes()
    code, out, err = run_tool("migrate", v2.path)
    assert code == 0 and "already format version 3: nothing to do" in out, (out, err)
    code, out, err = run_tool("migrate", "--json", v2.path)
    assert code == 0 and json.loads(out) == {"data_dir": str(v2.path.resolve()), "from_version": 3,
                                             "to_version": 3, "migrated": False, "needed": False, "dry_run": False}
    assert (v2.path / "kvstore.json").read_bytes() == marker


def test_dry_run_checks_and_changes_nothing(v2, run_tool):
    marker = (v2.path / "kvstore.json").read_bytes()
    code, out, err = run_tool("migrate", "--dry-run", v2.path)
    assert code == 0 and "would go from format version 2 to 3" in out, (out, err)
    code, out, err = run_tool("migrate", "--dry-run", "--json", v2.path)
    d = json.loads(out)
    assert code == 0 and d["dry_run"] and d["needed"] and not d["migrated"] and d["from_version"] == 2
    assert (v2.path / "kvstore.json").read_bytes() == marker
    assert run_tool("verify", v2.path)[0] == 2  # still refused


@pytest.mark.parametrize("version", [1, 4])
def test_a_version_it_does_not_take_is_refused(store_dir, run_tool, version):
    """Version 1 (no migration from it) and a newer one: exit 2, one line, the marker kept."""
    _as_version(store_dir.path, version)
    marker = (store_dir.path / "kvstore.json").read_bytes()
    for dry in ((), ("--dry-run",)):
        code, out, err = run_tool("migrate", *dry, store_dir.path)
        assert code == 2 and not out and f"format version {version}" in err and "takes only version 2" in err, err
        assert err.count("\n") == 1
    assert (store_dir.path / "kvstore.json").read_bytes() == marker


_HOLD = """
import lmdb, sys, time
env = lmdb.open(sys.argv[1], max_dbs=16)  # the index open, no transaction running: as an idle process
print("open", flush=True)
sys.stdin.read()
"""


def test_refused_while_another_process_has_the_index_open(v2, run_tool):
    """A process with the index open (an older kvstack's daemon, idle) is detected through
    LMDB's lock, named by its pid, and nothing is changed; once it is gone, migrate runs."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(v2.path / "index")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "open"
        marker = (v2.path / "kvstore.json").read_bytes()
        for dry in ((), ("--dry-run",)):
            code, out, err = run_tool("migrate", *dry, v2.path)
            assert code == 2 and not out, (out, err)
            assert f"process {holder.pid} has the index of" in err and "stop every process" in err, err
        assert (v2.path / "kvstore.json").read_bytes() == marker
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    code, out, err = run_tool("migrate", v2.path)
    assert code == 0, (out, err)
    _reads_back(v2)


def test_an_index_that_is_not_the_directorys_is_refused(v2, tmp_path, run_tool):
    """The identity check the store makes at open: another directory's index (copied over) or
    none at all refuses the migration, with the remedy, and the marker is kept."""
    other = populate(tmp_path / "other", n_blocks=2, seed=1)
    marker = (v2.path / "kvstore.json").read_bytes()
    shutil.rmtree(v2.path / "index")
    code, out, err = run_tool("migrate", v2.path)
    assert code == 2 and "index" in err and "missing" in err and "rebuild-index" in err, err
    shutil.copytree(other.path / "index", v2.path / "index")
    code, out, err = run_tool("migrate", v2.path)
    assert code == 2 and "is not the one data directory" in err, err
    assert (v2.path / "kvstore.json").read_bytes() == marker


def test_not_a_data_directory_or_a_daemon_is_a_usage_error(tmp_path, run_tool):
    code, out, err = run_tool("migrate", tmp_path / "nothing")
    assert code == 2 and "not a kvstore data directory" in err
    assert not (tmp_path / "nothing").exists()  # kvtool never creates a store
    code, out, err = run_tool("migrate", "grpc://127.0.0.1:1")
    assert code == 2 and "works on a data directory" in err, err


def test_a_store_open_in_this_process_is_named_not_called_damaged(v2):
    """In-process (a library caller with a store still open): LMDB refuses a second open of
    the index; migrate says to close the store, not that the index is damaged."""
    from kvstore.embedded.index import Index
    from kvstore.errors import StoreUnavailable
    from kvstore.maintenance.migrate import migrate

    marker = (v2.path / "kvstore.json").read_bytes()
    index = Index(str(v2.path / "index"), map_size=1 << 30, sync=False)
    try:
        with pytest.raises(StoreUnavailable, match="open in this process"):
            migrate(v2.path)
    finally:
        index.close()
    assert (v2.path / "kvstore.json").read_bytes() == marker
    assert migrate(v2.path).migrated
