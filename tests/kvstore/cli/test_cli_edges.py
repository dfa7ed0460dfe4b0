"""kvtool at its edges: what it writes to, what it reads, and flags that do not combine.

Each test pins one contract of ``kvstore.cli.kvtool``: an error is one line on
stderr (never a traceback) and exits 2; exit 1 is kept for "problems found".
Special files are made in ``tmp_path`` (a FIFO, a symlink); no test writes to a
real device node except ``/dev/full``, and only once it is checked to be one.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore
from tests.kvstore.cli.conftest import populate

REPO = Path(__file__).resolve().parents[3]
KVTOOL = [sys.executable, "-m", "kvstore.cli.kvtool"]


def _one_error_line(err: str) -> str:
    """The one ``kvtool: error:`` line of ``err``, the last one written; before it only
    progress lines (``kvtool: PHASE: n/m (p%)``, which a pass prints on stderr) may come."""
    lines = err.strip().splitlines()
    assert lines and "Traceback" not in err, err
    assert lines[-1].startswith("kvtool: error:") and all(
        line.startswith("kvtool: ") and line.endswith("%)") for line in lines[:-1]), err
    return lines[-1]


@pytest.fixture
def small_dir(tmp_path: Path) -> Path:
    return populate(tmp_path / "data", n_blocks=2).path


# ----------------------------------------------------------------------------- inspect --parquet DEST
def test_parquet_refuses_a_fifo_or_symlink_and_leaves_it(small_dir, run_tool, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.parquet"
    real = tmp_path / "real.parquet"
    link.symlink_to(real)  # dangling: the export must not create real.parquet either
    before = sorted(p.name for p in tmp_path.iterdir())
    for dest, kind in ((fifo, "FIFO"), (link, "symbolic link")):
        code, out, err = run_tool("inspect", small_dir, "--parquet", dest)
        line = _one_error_line(err)
        assert code == 2 and out == "" and kind in line and str(dest) in line
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and stat.S_ISLNK(os.lstat(link).st_mode)
    assert not real.exists() and sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary left


def test_parquet_replaces_an_existing_regular_file(small_dir, run_tool, tmp_path):
    dest = tmp_path / "index.parquet"
    dest.write_bytes(b"old")
    code, out, err = run_tool("inspect", small_dir, "--parquet", dest)
    assert code == 0 and err == "" and "wrote" in out
    assert dest.read_bytes()[:4] == b"PAR1" and stat.S_ISREG(os.lstat(dest).st_mode)


@pytest.mark.parametrize("flag", ["--key", "--chain"])
def test_parquet_with_key_or_chain_is_a_usage_error(small_dir, run_tool, tmp_path, flag):
    dest = tmp_path / "k.parquet"
    code, out, err = run_tool("inspect", small_dir, flag, "01" * 16, "--parquet", dest)
    assert code == 2 and out == "" and "--parquet" in err and flag in err and "Traceback" not in err
    assert not dest.exists()


@pytest.mark.parametrize("chain", ["", ",", " , "])
def test_an_empty_chain_is_a_usage_error(small_dir, run_tool, chain):
    """As an empty --key is (not "chain of 0" with exit status 0)."""
    code, out, err = run_tool("inspect", small_dir, "--chain", chain)
    assert code == 2 and out == "" and "names no key" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- unreadable inputs
def test_config_file_that_is_not_utf8_is_one_line(small_dir, run_tool, tmp_path):
    bad = tmp_path / "bin.toml"
    bad.write_bytes(b"\xff\xfe")
    code, out, err = run_tool("stats", small_dir, "--config", bad)
    assert code == 2 and out == "" and "cannot read config file" in _one_error_line(err)


@pytest.mark.parametrize("marker", ['{"format_version": 1e400}', "[" * 100000 + "]" * 100000],
                         ids=["overflow", "deep-nesting"])
def test_marker_that_breaks_the_json_reader_is_one_line(tmp_path, run_tool, marker):
    d = tmp_path / "data"
    kvstore.connect(str(d)).close()
    (d / "kvstore.json").write_text(marker)
    code, out, err = run_tool("stats", d)
    line = _one_error_line(err)
    assert code == 2 and out == "" and "kvstore.json is unreadable" in line and len(line) < 500


# ----------------------------------------------------------------------------- stdout cannot be written
class _FullStdout(io.StringIO):
    def write(self, s: str) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_stdout_write_failure_in_process_is_one_line_exit_2(small_dir, capsys, monkeypatch):
    from kvstore.cli.kvtool import main

    monkeypatch.setattr(sys, "stdout", _FullStdout())
    code = main(["verify", str(small_dir)])
    err = capsys.readouterr().err
    assert code == 2 and _one_error_line(err) == f"kvtool: error: cannot write the result: {os.strerror(errno.ENOSPC)}"


def _kvtool_sub(argv: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(KVTOOL + argv, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env, timeout=60, **kw)


def test_closed_stdout_is_one_line_exit_2(small_dir):
    # what `kvtool stats DIR >&-` gives: the child starts with fd 1 closed, so sys.stdout is None
    r = _kvtool_sub(["stats", str(small_dir), "--json"], stdout=subprocess.DEVNULL,
                    preexec_fn=lambda: os.close(1))
    assert r.returncode == 2 and _one_error_line(r.stderr).startswith("kvtool: error: cannot write the result:")


def test_full_disk_stdout_is_one_line_exit_2(small_dir):
    try:
        is_dev_full = stat.S_ISCHR(os.stat("/dev/full").st_mode)
    except OSError:
        is_dev_full = False
    if not is_dev_full:
        pytest.skip("/dev/full is not a character device here")
    with open("/dev/full", "w") as full:
        r = _kvtool_sub(["verify", str(small_dir)], stdout=full)
    line = _one_error_line(r.stderr)
    assert r.returncode == 2 and line == f"kvtool: error: cannot write the result: {os.strerror(errno.ENOSPC)}"


def test_gc_that_could_not_delete_an_orphan_says_so_and_exits_1():
    """``orphans_kept`` (an orphan the sweep could not delete: a read-only target) is named in
    gc's line and is a problem found (exit 1), not a clean pass."""
    import argparse

    from kvstore.cli.commands import ExitCode, run_gc

    class Store:
        def gc(self, dry_run=False, progress=None):
            return {"expired": 0, "evicted": 0, "purged": 0, "orphans": 2, "orphans_kept": 1,
                    "reclaimed_bytes": 10, "used_bytes": 0}

    out = run_gc(Store(), argparse.Namespace(dry_run=False), lambda *a: None)
    assert out.code == ExitCode.PROBLEMS and "orphans 2 (1 kept: could not delete" in out.text
    clean = run_gc(type("S", (), {"gc": lambda self, dry_run=False, progress=None: {"orphans": 0}})(),
                   argparse.Namespace(dry_run=False), lambda *a: None)
    assert clean.code == ExitCode.OK and "kept" not in clean.text


def test_repair_that_kept_an_orphan_exits_1():
    """``repair`` with an orphan it could not delete says so and exits 1, as gc and verify do."""
    import argparse

    from kvstore.cli.commands import ExitCode, run_repair

    class Store:
        def repair(self, progress=None):
            return {"rebuilt_fragments": 0, "restored_entries": 0, "orphans_removed": 1, "orphans_kept": 1,
                    "unfixed": 0, "still_lost": 0}

    out = run_repair(Store(), argparse.Namespace(), lambda *a: None)
    assert out.code == ExitCode.PROBLEMS and "removed 1 orphans (1 kept: could not delete" in out.text


def test_parquet_path_with_a_trailing_slash_is_refused(tmp_path):
    """``--parquet reg/`` overwrote the regular file ``reg`` (Path drops the slash); it names a
    directory, so it is refused and the file is left alone."""
    import kvstore
    from kvstore.index_view import export_parquet
    from kvstore.errors import InvalidRequest

    reg = tmp_path / "reg"
    reg.write_bytes(b"keep")
    with kvstore.connect(str(tmp_path / "d"), fsync=False) as s:
        for dest in (f"{reg}/", f"{tmp_path}/new.parquet/"):
            with pytest.raises(InvalidRequest, match="names a directory"):
                export_parquet(s, dest)
    assert reg.read_bytes() == b"keep" and not (tmp_path / "new.parquet").exists()


@pytest.mark.parametrize("cmd", ["verify", "gc", "repair"])
def test_ctrl_c_is_one_line_exit_130(small_dir, run_tool, monkeypatch, cmd):
    """KeyboardInterrupt in a pass: ``kvtool: interrupted``, exit 130, no traceback, the store
    closed. Before: the KeyboardInterrupt traceback."""
    from kvstore.embedded.store import EmbeddedStore

    closed = []
    real_close = EmbeddedStore.close

    def interrupted(self, *a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(EmbeddedStore, {"verify": "check"}.get(cmd, cmd), interrupted)
    monkeypatch.setattr(EmbeddedStore, "close", lambda self, **kw: (closed.append(1), real_close(self, **kw)))
    try:
        code, out, err = run_tool(cmd, small_dir, "--json")
    except KeyboardInterrupt:  # not re-raised: pytest would take it for the user's Ctrl-C and stop
        pytest.fail("KeyboardInterrupt escaped kvtool's main")
    assert (code, out, err) == (130, "", "kvtool: interrupted\n") and closed


def test_sigint_in_a_subprocess_is_one_line_exit_130(small_dir):
    """A real Ctrl-C (SIGINT) while verify runs: one line, exit 130."""
    import signal

    script = ("import sys, time\n"
              "from kvstore.embedded.store import EmbeddedStore\n"
              "def check(self, *a, **kw):\n"
              "    sys.stderr.write('ready\\n'); sys.stderr.flush(); time.sleep(30)\n"
              "EmbeddedStore.check = check\n"
              "from kvstore.cli.kvtool import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.Popen([sys.executable, "-c", script, "verify", str(small_dir)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        assert p.stderr.readline() == "ready\n"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert (p.returncode, out, err) == (130, "", "kvtool: interrupted\n")


_INTERRUPTED_IMPORT = """
import sys, tomllib
class CtrlC:  # a Ctrl-C that lands while kvstore is being imported, every time
    def find_spec(self, name, path=None, target=None):
        if name == "kvstore":
            raise KeyboardInterrupt
sys.meta_path.insert(0, CtrlC())
with open("pyproject.toml", "rb") as f:
    module, func = tomllib.load(f)["project"]["scripts"]["kvtool"].split(":")
sys.argv = ["kvtool", "--help"]
sys.exit(getattr(__import__(module, fromlist=[func]), func)())  # what the console script does
"""


def test_ctrl_c_while_the_console_script_imports_kvstore_is_one_line_exit_130():
    """The console script imported ``kvstore.cli.kvtool`` (and so all of ``kvstore``) before
    ``main``'s ``try``: a Ctrl-C during that import, most of a short run's time, printed a
    traceback. The entry (pyproject's ``[project.scripts]``) now imports kvstore inside it."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT], cwd=root, env=env, capture_output=True,
                       text=True, timeout=60)
    assert (p.returncode, p.stderr, p.stdout) == (130, "kvtool: interrupted\n", "")
