"""The command lines in ``tools/`` refuse bad arguments and bad input in one line, before any work.

The contract (``tools/cli_args.py``): ``--help`` works; a bad argument or bad input gives ONE
line ``TOOL: error: ...`` on stderr and exit status 2, checked before anything starts; never a
traceback; a benchmark left with nothing to compare against is refused the same way. Every
case runs the tool as a subprocess, as a user would, with a timeout: a regression to "runs
anyway" or "hangs" fails the case instead of hanging the suite. The cases are fast because the
checks come before any work; the few that run something (load_store's throughput, a client
process that dies, soak's progress lines) use the tools' smallest settings.
"""

from __future__ import annotations

import gzip
import importlib.metadata
import importlib.util
import json
import os
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"

# the tool's name in its error line, where it is not the script's file name
PROG = {"demo": "tools/demo.py", "bench_remote": "bench_store.py --remote / bench_remote.py"}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env.update(extra)
    return env


def run_tool(tool: str, args: list[str], timeout: float = 60, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / f"{tool}.py"), *args], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def error_lines(r: subprocess.CompletedProcess) -> list[str]:
    return [ln for ln in r.stderr.splitlines() if "error:" in ln]


def assert_one_error(r: subprocess.CompletedProcess, tool: str, code: int = 2) -> str:
    """Exit ``code``, no traceback, exactly one ``TOOL: error: ...`` line on stderr; returns it."""
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == code, (r.returncode, r.stdout[-1500:], r.stderr[-1500:])
    errs = error_lines(r)
    assert len(errs) == 1, r.stderr[-3000:]
    assert errs[0].startswith(f"{PROG.get(tool, tool + '.py')}") and ": error: " in errs[0], errs[0]
    return errs[0]


# ----------------------------------------------------------------------------- inputs
def _line(ts=0, n=1024, out=4, ids=(1, 2)) -> dict:
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": list(ids)}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Small traces, good and bad, and other paths the cases refer to by name ({T}, {gz}, ...)."""
    d = tmp_path_factory.mktemp("inputs")
    good = "\n".join(json.dumps(_line(ts=100 * i, ids=(i % 3, 10 + i))) for i in range(20)) + "\n"
    (d / "t.jsonl").write_text(good)
    (d / "t.jsonl.gz").write_bytes(gzip.compress(good.encode()))
    (d / "latin1.jsonl").write_bytes(json.dumps(_line()).encode() + b"\n{\"caf\xe9\": 1}\n")
    (d / "empty.jsonl").write_text("\n\n")
    bad = {"nested": _line(ids=([1, 2], [3])), "floatids": _line(ids=(1.5, 2))}
    for name, doc in bad.items():
        (d / f"{name}.jsonl").write_text(json.dumps(_line()) + "\n" + json.dumps(doc) + "\n")
    (d / "nan.jsonl").write_text('{"timestamp": NaN, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]}\n')
    (d / "strids.jsonl").write_text('{"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": "abc"}\n')
    (d / "boollen.jsonl").write_text('{"timestamp": 0, "input_length": true, "output_length": 4, "hash_ids": [1]}\n')
    (d / "deep.jsonl").write_text(json.dumps(_line()) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n")
    (d / "dupkey.jsonl").write_text(json.dumps(_line()) + '\n{"timestamp": 0, "input_length": 1024, "input_length": 9, '
                                    '"output_length": 4, "hash_ids": [1, 2]}\n')
    (d / "nofield.jsonl").write_text(json.dumps(_line()) + "\n" + json.dumps({"timestamp": 0, "input_length": 1024,
                                                                                "hash_ids": [1, 2]}) + "\n")
    (d / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + good.encode())
    (d / "long.jsonl").write_text("".join(json.dumps(_line(ts=i * 1000, n=n, ids=range(-(-n // 512)))) + "\n"
                                          for i, n in enumerate((40_000, 1024, 50_000))))
    (d / "cost.json").write_text('{"format": 1, "prefill": ')
    (d / "file").write_text("not a directory\n")
    out = d / "out"
    out.mkdir()
    return {"T": str(d / "t.jsonl"), "gz": str(d / "t.jsonl.gz"), "latin1": str(d / "latin1.jsonl"),
            "empty": str(d / "empty.jsonl"), "nested": str(d / "nested.jsonl"),
            "floatids": str(d / "floatids.jsonl"), "nan": str(d / "nan.jsonl"), "strids": str(d / "strids.jsonl"),
            "boollen": str(d / "boollen.jsonl"), "cost": str(d / "cost.json"), "file": str(d / "file"),
            "deep": str(d / "deep.jsonl"), "dupkey": str(d / "dupkey.jsonl"), "nofield": str(d / "nofield.jsonl"),
            "bom": str(d / "bom.jsonl"), "long": str(d / "long.jsonl"),
            "dir": str(d), "missing": str(d / "missing.jsonl"), "out": str(out)}


@pytest.fixture(scope="module")
def refused_port():
    """A loopback port bound but never listening: a connection to it is refused at once."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


# ----------------------------------------------------------------------------- refused up front
# (tool, arguments); {name} is a path from the `files` fixture. Where an old version of a tool
# would have started working, the arguments bound that work (small sizes, short durations,
# an --out under the test's directory), so the case fails quickly instead of running long.
_STORE = ["--no-install", "--work-dir", "{dir}", "--out", "{out}/bench_store.json"]
_REMOTE = ["--no-peers", "--chain", "10", "--lookup-reps", "2", "--out", "{out}/remote.json"]
_ENGINE = ["--agree-n", "0", "--out", "{out}/engine.json"]
_SOAK = ["--duration", "2", "--out", "{out}/soak.json"]
REFUSED = [
    # 1. load_store: every argument a client process would die on
    ("load_store", ["--key-space", "0"]),
    ("load_store", ["--chain-len", "0"]),
    ("load_store", ["--value-bytes", "-5"]),
    ("load_store", ["--daemons", "0"]),
    ("load_store", ["--url", "notaurl"]),
    ("load_store", ["--put", "0.8", "--get", "0.5"]),
    ("load_store", ["--seconds", "0"]),  # 2.
    ("load_store", ["--seconds", "nan"]),
    ("load_store", ["--procs", "0"]),  # 6.
    ("load_store", ["--out", "{dir}"]),
    # 3. replay_trace: bad input files
    ("replay_trace", ["--trace", "{missing}"]),
    ("replay_trace", ["--trace", "{dir}"]),
    ("replay_trace", ["--trace", "{gz}"]),
    ("replay_trace", ["--trace", "{latin1}"]),
    ("replay_trace", ["--trace", "{nested}"]),
    ("replay_trace", ["--trace", "{empty}"]),
    ("replay_trace", ["--trace", "{T}", "--cost-model", "{cost}"]),
    ("replay_trace", ["--trace", "{T}", "--cost-model", "{missing}"]),
    # 4. parse_trace through the tool: values no trace can mean
    ("replay_trace", ["--trace", "{nan}"]),
    ("replay_trace", ["--trace", "{strids}"]),
    ("replay_trace", ["--trace", "{floatids}"]),
    ("replay_trace", ["--trace", "{boollen}"]),
    ("replay_trace", ["--trace", "{deep}"]),  # a RecursionError traceback before
    ("replay_trace", ["--trace", "{dupkey}"]),  # json kept the last value before
    # 3. replay_trace: bad options
    ("replay_trace", ["--trace", "{T}", "--speedup", "0"]),
    ("replay_trace", ["--trace", "{T}", "--speedup", "-1"]),
    ("replay_trace", ["--trace", "{T}", "--speedup", "nan"]),
    ("replay_trace", ["--trace", "{T}", "--prefill-instances", "0"]),
    ("replay_trace", ["--trace", "{T}", "--store-capacity-blocks", "-5"]),
    ("replay_trace", ["--trace", "{T}", "--device-capacity-blocks", "-1"]),
    ("replay_trace", ["--trace", "{T}", "--noise", "-1"]),
    ("replay_trace", ["--trace", "{T}", "--store-gbps", "0"]),
    ("replay_trace", ["--trace", "{T}", "--max-wall-s", "0"]),
    ("replay_trace", ["--trace", "{T}", "--ttft-slo-ms", "-5"]),
    ("replay_trace", ["--trace", "{T}", "--out", "{file}"]),  # 5.
    ("replay_trace", ["--trace", "{T}", "--policies", ""]),  # 6.
    ("replay_trace", ["--trace", "{T}", "--policies", "kvstack"]),
    # 3., 6., 7. bench_lb
    ("bench_lb", ["--trace", "{T}", "--out", "{out}/lb.json", "--skip-eplb", "--skip-replay"]),
    ("bench_lb", ["--trace", "{missing}", "--out", "{out}/lb.json", "--skip-eplb"]),
    ("bench_lb", ["--trace", "{missing}", "--out", "{out}/lb.json", "--skip-replay"]),
    ("bench_lb", ["--trace", "{nested}", "--out", "{out}/lb.json", "--skip-eplb"]),
    ("bench_lb", ["--trace", "{deep}", "--out", "{out}/lb.json", "--skip-eplb"]),
    ("bench_lb", ["--trace", "{dupkey}", "--out", "{out}/lb.json", "--skip-eplb"]),
    ("bench_lb", ["--trace", "{T}", "--out", "{out}/lb.json", "--skip-eplb", "--ttft-slo-ms", "0"]),
    ("bench_lb", ["--trace", "{T}", "--out", "{out}/lb.json", "--skip-eplb", "--store-capacity-blocks", "-5"]),
    ("bench_lb", ["--trace", "{T}", "--out", "{dir}", "--skip-eplb"]),
    ("bench_lb", ["--trace", "{T}", "--out", "{out}/lb.json", "--skip-eplb", "--shapes", "nope"]),
    ("bench_lb", ["--trace", "{T}", "--out", "{out}/lb.json", "--skip-eplb", "--conditions", "exact,nope"]),
    ("gen_trace", ["--shape", "nope", "--out", "{out}/g.jsonl"]),
    ("gen_trace", ["--shape", "chat"]),
    # 6., 8. bench_store
    ("bench_store", ["--quick", "--systems", "kvstore", *_STORE]),
    ("bench_store", ["--quick", "--systems", "", *_STORE]),
    ("bench_store", ["--quick", "--systems", "bogus", *_STORE]),
    ("bench_store", ["--quick", "--sizes", "0", *_STORE]),
    ("bench_store", ["--quick", "--sizes", "-5", *_STORE]),
    ("bench_store", ["--quick", "--sizes", "abc", *_STORE]),
    ("bench_store", ["--quick", "--lookup-sizes", "abc", *_STORE]),
    ("bench_store", ["--quick", "--batch", "0", *_STORE]),
    ("bench_store", ["--quick", "--reps", "-1", *_STORE]),
    ("bench_store", ["--quick", "--reps", "0", "--sizes", "128K", "--mib-per-rep", "0.5", "--no-lookup", "--no-ec",
                     *_STORE]),
    ("bench_store", ["--quick", "--mib-per-rep", "0", "--sizes", "128K", "--reps", "1", "--no-lookup", "--no-ec",
                     *_STORE]),
    ("bench_store", ["--quick", "--no-install", "--work-dir", "{file}", "--out", "{out}/bs.json"]),
    # 6., 9. soak
    ("soak", ["--k", "0", *_SOAK]),
    ("soak", ["--m", "0", *_SOAK]),
    ("soak", ["--shards", "0", *_SOAK]),
    ("soak", ["--clients", "0", *_SOAK]),
    ("soak", ["--duration", "-1", "--out", "{out}/soak.json"]),
    # 10. bench_engine (the first checks answer before torch is imported)
    ("bench_engine", ["--sizes", "abc", *_ENGINE]),
    ("bench_engine", ["--sizes", "0", *_ENGINE]),
    ("bench_engine", ["--sizes", "-512", *_ENGINE]),
    ("bench_engine", ["--sizes", "64", "--block-size", "0", *_ENGINE]),
    ("bench_engine", ["--sizes", "64", "--reps", "0", *_ENGINE]),
    ("bench_engine", ["--sizes", "64", "--chunk", "0", *_ENGINE]),
    ("bench_engine", ["--sizes", "64", "--preset", "nope", *_ENGINE]),
    ("bench_engine", ["--sizes", "64", "--device", "cuda", *_ENGINE]),
    # 6., 11. bench_remote
    ("bench_remote", ["--n", "0", *_REMOTE]),
    ("bench_remote", ["--sizes", "0", "--n", "4", "--repeat", "1", *_REMOTE]),
    ("bench_remote", ["--batch", "0", "--n", "4", "--repeat", "1", *_REMOTE]),
    ("bench_remote", ["--repeat", "0", "--n", "4", *_REMOTE]),
    # 12. demo
    ("demo", ["--data-dir", "{file}"]),
    # 13. mooncake_peer, in a Python without mooncake
    ("mooncake_peer", ["storage", "http://127.0.0.1:9/metadata", "127.0.0.1:9", "1"]),
    # 14. bench_rebuild_index
    ("bench_rebuild_index", ["--entries", "0"]),
    # 15. bench_vllm: refused before any engine starts
    ("bench_vllm", ["--prompts", "0"]),
    ("bench_vllm", ["--block-size", "48"]),
    ("bench_vllm", ["--tokens", "200"]),
    ("bench_vllm", ["--engine-limit-s", "nan"]),
    ("bench_vllm", ["--out", "{dir}"]),
    ("bench_rebuild_index", ["--batch", "abc"]),
    ("bench_rebuild_index", ["--entries", "10", "--out", "{file}/x.json"]),
]
# cases that are not bad input on this machine (they would start real work): skipped, never run
NOT_HERE = {
    ("bench_engine", "cuda"): None if "+cpu" in importlib.metadata.version("torch") else "torch here may have CUDA",
    ("mooncake_peer", "storage"): "mooncake is installed here" if importlib.util.find_spec("mooncake") else None,
}
HELP = ["load_store", "replay_trace", "bench_lb", "bench_store", "bench_remote", "soak", "bench_engine", "demo",
        "mooncake_peer", "bench_rebuild_index", "gen_trace", "bench_vllm"]
REFUSED_NAMES = [f"{t}:{' '.join(a or repr(a) for a in args)}" for t, args in REFUSED]
# every quick run of this file by name: the refused cases, --help, and a few with their own checks
QUICK: dict[str, tuple[str, list[str]]] = {
    **dict(zip(REFUSED_NAMES, REFUSED)),
    **{f"help:{t}": (t, ["--help"]) for t in HELP},
    "unreachable_url": ("load_store", ["--url", "grpc://127.0.0.1:{port}", "--procs", "1", "--seconds", "1"]),
    "find_load": ("replay_trace", ["--trace", "{T}", "--find-load", "--ttft-slo-ms", "0.001", "--find-load-iters",
                                   "2", "--prefill-instances", "1", "--quiet"]),
    "replay_out_file": ("replay_trace", ["--trace", "{T}", "--policies", "mooncake,kvstack", "--out", "{file}"]),
    "bench_lb_empty": ("bench_lb", ["--trace", "{empty}", "--out", "{out}/lb.json", "--skip-eplb"]),
    "nofield": ("replay_trace", ["--trace", "{nofield}"]),
    "bom_replay": ("replay_trace", ["--trace", "{bom}", "--policies", "round_robin", "--quiet"]),
    "bom_bench": ("bench_lb", ["--trace", "{bom}", "--out", "{out}/bom.json", "--skip-eplb",
                               "--store-capacity-blocks", "100", "--shapes", "", "--conditions", "exact"]),
    "long": ("replay_trace", ["--trace", "{long}", "--policies", "round_robin,kvstack", "--quiet"]),
}


def _skip_reason(tool: str, args: list[str]) -> str | None:
    return next((why for (t, a), why in NOT_HERE.items() if t == tool and a in args), None)


@pytest.fixture(scope="module")
def quick(files, refused_port) -> dict[str, Future]:
    """Every run of QUICK started at once on a few threads (each is mostly interpreter start and
    imports); each test waits for its own. Name -> future of (CompletedProcess, seconds)."""
    paths = {**files, "port": str(refused_port)}

    def timed(tool: str, args: list[str]):
        t0 = time.monotonic()
        return run_tool(tool, [a.format(**paths) for a in args], timeout=30), time.monotonic() - t0

    with ThreadPoolExecutor(max_workers=4) as pool:
        yield {name: pool.submit(timed, tool, args) for name, (tool, args) in QUICK.items()
               if not _skip_reason(tool, args)}


def quick_run(quick: dict[str, Future], name: str) -> subprocess.CompletedProcess:
    tool, args = QUICK[name]
    if why := _skip_reason(tool, args):
        pytest.skip(why)
    return quick[name].result()[0]


@pytest.mark.parametrize("tool", HELP)
def test_help_works(tool, quick):
    r = quick_run(quick, f"help:{tool}")
    assert r.returncode == 0 and "usage:" in r.stdout and not r.stderr.strip(), r.stderr[-2000:]


@pytest.mark.parametrize("name", REFUSED_NAMES)
def test_refused_in_one_line_before_any_work(name, quick):
    r = quick_run(quick, name)
    assert_one_error(r, QUICK[name][0])
    # before any work: no daemon, no model, no simulation (the slowest check imports torch, ~3 s alone)
    assert quick[name].result()[1] < 25


def test_load_store_refuses_an_unreachable_url(quick):
    assert "unreachable" in assert_one_error(quick_run(quick, "unreachable_url"), "load_store")


def test_replay_find_load_without_a_passing_load_says_so(quick):
    """No load meets the SLO: one line that says so and what to change, exit status 1 (documented)."""
    line = assert_one_error(quick_run(quick, "find_load"), "replay_trace", code=1)
    assert "--find-load" in line and "--ttft-slo-ms" in line


def test_replay_out_existing_file_is_refused_before_simulating(quick):
    r = quick_run(quick, "replay_out_file")
    assert "is not a directory" in assert_one_error(r, "replay_trace")
    assert "requests, speedup" not in r.stdout  # no table: nothing was simulated


def test_trace_errors_name_the_file_the_line_and_the_missing_field(quick, files):
    line = assert_one_error(quick_run(quick, "nofield"), "replay_trace")
    assert f"trace {files['nofield']} line 2 " in line and 'missing field "output_length"' in line, line
    for name in ("deep", "dupkey"):
        line = assert_one_error(quick_run(quick, f"replay_trace:--trace {{{name}}}"), "replay_trace")
        assert f"trace {files[name]} line 2 " in line, line


def test_a_byte_order_mark_on_line_1_is_accepted_by_both_tools(quick):
    r = quick_run(quick, "bom_replay")
    assert r.returncode == 0 and "round_rob" in r.stdout, r.stderr[-2000:]
    r = quick_run(quick, "bom_bench")
    assert r.returncode == 0 and "wrote" in r.stdout, r.stderr[-2000:]


def test_prompts_beyond_the_cost_models_fitted_range_warn_once_per_run(quick):
    r = quick_run(quick, "long")
    assert r.returncode == 0, r.stderr[-2000:]
    warned = [ln for ln in r.stderr.splitlines() if "longer than the largest" in ln]
    assert len(warned) == 1 and warned[0].startswith("2 of 3 requests"), r.stderr[-2000:]


def test_bench_lb_empty_trace_is_one_line_before_deriving_anything(quick):
    r = quick_run(quick, "bench_lb_empty")
    assert "holds no requests" in assert_one_error(r, "bench_lb")
    assert "Mean of empty slice" not in r.stderr and "replay_trace" not in r.stderr and "TTFT SLO" not in r.stdout


# ----------------------------------------------------------------------------- load_store at work
def test_load_store_throughput_is_over_the_measured_wall_time(tmp_path):
    """A run capped by --max-ops ends long before --seconds: rates are over wall_s, not --seconds."""
    out = tmp_path / "load.json"
    r = run_tool("load_store", ["--daemons", "1", "--procs", "1", "--seconds", "30", "--max-ops", "200",
                                "--value-bytes", "1024", "--key-space", "100", "--fsync", "false", "--out", str(out)],
                 timeout=60, TMPDIR=str(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    rep = json.loads(out.read_text())
    assert rep["ops"] == 200 and 0 < rep["wall_s"] < 30
    assert rep["ops_per_s"] == pytest.approx(rep["ops"] / rep["wall_s"], rel=0.05)
    assert not list(tmp_path.glob("kvload-*"))


def test_load_store_stops_at_once_when_a_client_process_dies(tmp_path):
    """A client that can not even connect (mutual TLS half configured in its environment) fails at
    once: the run stops, the daemon and the kvload-* directory are gone, and one line says why."""
    t0 = time.monotonic()
    r = run_tool("load_store", ["--daemons", "1", "--procs", "2", "--seconds", "30", "--value-bytes", "1024",
                                "--fsync", "false"], timeout=30, TMPDIR=str(tmp_path),
                 KVSTORE_CERT_FILE=str(tmp_path / "client.pem"))
    line = assert_one_error(r, "load_store", code=1)
    assert "client process" in line and "cert_file" in line
    assert time.monotonic() - t0 < 20
    assert not list(tmp_path.glob("kvload-*"))


# ----------------------------------------------------------------------------- soak at work
def test_soak_prints_progress_lines(tmp_path):
    """A short soak (one shard, one client) reports progress on stderr while it runs."""
    r = run_tool("soak", ["--duration", "3", "--shards", "1", "--clients", "1", "--targets", "3", "--k", "1",
                          "--m", "1", "--out", str(tmp_path / "soak.json")], timeout=90, TMPDIR=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if re.match(r"soak: \d+ s of 3 s.*: \d+ ops, ", ln)]
    assert len(lines) >= 2, r.stderr[-3000:]
    assert "error:" not in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- --out that really can not be written
def _proc_refuses_files() -> bool:
    try:
        with open("/proc/kvstack-probe", "w"):
            pass
    except OSError:
        return True
    return False


needs_proc = pytest.mark.skipif(not (sys.platform.startswith("linux") and _proc_refuses_files()),
                                reason="needs Linux /proc, which refuses new files even for root")


@needs_proc
def test_output_checks_try_for_real_even_as_root():
    """os.access says yes to root for anything: the checks create (and remove) a file instead."""
    from tools.cli_args import check_existing_dir, check_output_dir, check_output_file

    for msg in (check_output_file("/proc/kvstack-test.json"), check_output_file("/proc/kvstack-new/x.json"),
                check_output_dir("/proc/kvstack-test-dir"), check_output_dir("/proc"),
                check_existing_dir("/proc", "--work-dir"), check_output_file("/proc/version")):
        assert msg is not None and "not writable (" in msg and "\n" not in msg, msg


def test_output_checks_leave_nothing_behind(tmp_path):
    from tools.cli_args import check_existing_dir, check_output_dir, check_output_file

    (tmp_path / "old.json").write_text("kept")
    assert check_output_file(tmp_path / "new" / "x.json") is None
    assert check_output_file(tmp_path / "old.json") is None
    assert check_output_dir(tmp_path / "d") is None and check_output_dir(tmp_path) is None
    assert check_existing_dir(tmp_path, "--work-dir") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]
    assert (tmp_path / "old.json").read_text() == "kept"


@needs_proc
@pytest.mark.parametrize("tool, args", [
    ("replay_trace", ["--trace", "{T}", "--policies", "round_robin", "--quiet", "--out", "/proc/kvstack-test-dir"]),
    ("bench_lb", ["--trace", "{T}", "--out", "/proc/kvstack-test.json", "--skip-eplb"]),
    ("bench_store", ["--quick", "--no-install", "--out", "/proc/kvstack-test.json"]),
    ("load_store", ["--procs", "1", "--seconds", "1", "--out", "/proc/kvstack-test.json"]),
])
def test_an_out_under_proc_is_refused_before_any_work(tool, args, files):
    t0 = time.monotonic()
    r = run_tool(tool, [a.format(**files) for a in args], timeout=30)
    line = assert_one_error(r, tool)
    assert "/proc/kvstack-test" in line and "not writable (" in line, line
    assert time.monotonic() - t0 < 25


def test_mooncake_runs_only_where_its_listeners_stay_on_loopback(monkeypatch, tmp_path):
    """Mooncake's servers listen on 0.0.0.0 whatever their flags say, so bench_remote runs it in
    a network namespace holding only loopback; where none can be made it is skipped, saying why,
    never run in the open."""
    from tools import bench_peers

    (tmp_path / "bin").mkdir()
    for name in ("python", "mooncake_master"):
        (tmp_path / "bin" / name).write_text("")
    monkeypatch.setattr(bench_peers.shutil, "which", lambda tool: None)
    started = []
    monkeypatch.setattr(bench_peers.subprocess, "Popen", lambda *a, **kw: started.append(a))
    with pytest.raises(bench_peers.PeerUnavailable, match="unshare") as err:
        bench_peers.start_mooncake(str(tmp_path / "bin" / "python"), str(tmp_path))
    assert "loopback" in str(err.value) and started == []
