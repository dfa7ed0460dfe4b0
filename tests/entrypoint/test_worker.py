"""The worker's engine runner and the command lines, without a cluster: a request that fails
fails alone and leaves the engine clean (the batch-mates of a failed engine step are retried
alone, and only the one that fails alone gets the error); usage errors are one line and a
non-zero exit."""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch

from engine_plugin.kv_connector import ConnectorConfig, KVStoreConnector
from engine_plugin.reference import Engine, EngineConfig, ReferenceModel, SamplingParams, model_preset
from entrypoint.engine_runner import EngineRunner

ROOT = Path(__file__).resolve().parents[2]
GREEDY = SamplingParams(max_new_tokens=3)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model():
    return ReferenceModel(model_preset("tiny"))


@pytest.fixture
def runner(model):
    conn = KVStoreConnector(model.kv_layout(), ConnectorConfig(block_size=16))  # no store: tiers only
    r = EngineRunner(Engine(model, EngineConfig(block_size=16, num_blocks=8), connector=conn), conn)
    yield r
    r.stop()
    conn.close()


def _outcome(h, timeout: float = 60.0):
    """("done", tokens) or ("error", code, message) of one submitted request."""
    toks = []
    while True:
        try:
            ev = h.events.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError("no outcome within the timeout") from None
        if ev[0] == "token":
            toks.append(ev[1])
        elif ev[0] == "done":
            return "done", toks
        else:
            return ev if len(ev) == 3 else ("error", None, ev[1])  # (before: no status code)


def _cold(model, prompt):
    return Engine(model, EngineConfig(block_size=16, num_blocks=64)).generate(prompt, GREEDY).output


def _submit(runner, rid, prompt):
    return runner.submit(rid, prompt, GREEDY, tenant_salt=b"", images=[])


def test_a_prompt_too_big_for_the_pool_fails_alone(runner, model):
    kind, code, msg = _outcome(_submit(runner, "big", [1] * 500))
    assert kind == "error" and "needs 32 blocks" in msg
    prompt = list(range(1, 41))
    for i in range(3):  # every later request is served (before the fix: each failed the same way)
        assert _outcome(_submit(runner, f"ok-{i}", prompt)) == ("done", _cold(model, prompt))
    assert not runner.engine.waiting and not runner.engine.running
    assert not runner.engine.finished  # each taken once served (before: kept for ever)
    assert code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_failed_step_drops_its_requests_from_the_engine(runner, model, monkeypatch):
    real_step = runner.engine.step
    calls = []

    def step_failing_once():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected step failure")
        real_step()

    monkeypatch.setattr(runner.engine, "step", step_failing_once)
    kind, code, msg = _outcome(_submit(runner, "victim", list(range(1, 41))))
    assert kind == "error" and "injected step failure" in msg
    # The failed request is out of the engine (before: still running there, its blocks held).
    assert not runner.engine.waiting and not runner.engine.running and not any(runner.engine.pool.refcount)
    prompt = list(range(5, 50))
    assert _outcome(_submit(runner, "next", prompt)) == ("done", _cold(model, prompt))
    assert code == grpc.StatusCode.INTERNAL and runner.broken is None


def test_an_idle_runner_collects_the_saves_that_ended(model, tmp_path):
    """The last request's saves end after it was served and nothing else arrives: the idle runner
    still collects them, so its record (logits included) leaves the engine with its ``send_state``
    set (before: only the next request's step collected them; an idle worker kept them)."""
    import kvstore

    class HeldPuts:  # the store's puts wait until released (bounded)
        def __init__(self, inner):
            self.inner, self.go = inner, threading.Event()

        def put_many(self, items):
            self.go.wait(60)
            return self.inner.put_many(items)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    store = kvstore.connect(str(tmp_path / "store"))
    st = HeldPuts(store)
    conn = KVStoreConnector(model.kv_layout(), ConnectorConfig(block_size=16), st)
    r = EngineRunner(Engine(model, EngineConfig(block_size=16, num_blocks=64), connector=conn), conn)
    try:
        prompt = list(range(1, 41))  # two full blocks: saved to the store, held there
        h = _submit(r, "last", prompt)
        assert _outcome(h) == ("done", _cold(model, prompt))
        assert r.engine.has_pending_sends()  # its saves are still held
        st.go.set()
        assert conn.flush(timeout=60)
        deadline = time.monotonic() + 30.0
        while r.engine.has_pending_sends() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not r.engine.has_pending_sends()
        assert h.req.send_state.value == "sent"
    finally:
        st.go.set()
        r.stop()
        conn.close()
        store.close()


def test_an_engine_that_cannot_drop_its_requests_reports_the_worker_down(runner, monkeypatch):
    def step_fails():
        raise RuntimeError("injected step failure")

    def abort_fails(rid):
        raise RuntimeError("injected: the pool is inconsistent")

    monkeypatch.setattr(runner.engine, "step", step_fails)
    monkeypatch.setattr(runner.engine, "abort_request", abort_fails)
    assert _outcome(_submit(runner, "a", [1, 2, 3]))[0] == "error"
    assert runner.broken and "inconsistent" in runner.broken
    kind, code, msg = _outcome(_submit(runner, "b", [1, 2, 3]), timeout=5)
    assert kind == "error" and code == grpc.StatusCode.UNAVAILABLE and "down" in msg


POISON = 99  # a prompt token (in the tiny vocabulary) that the engine steps below fail on


def _poison_steps(runner, monkeypatch, before=None):
    """Make every engine step that holds a request with ``POISON`` in its prompt raise (after the
    step ran: the step's work is left half-done, as a real failure may leave it). ``before``
    runs at the start of each step. Returns the list of (request ids of the step, failed)."""
    eng, real_step, steps = runner.engine, runner.engine.step, []

    def step():
        if before is not None:
            before()
        ids = sorted(r.request_id for r in [*eng.waiting, *eng.running])
        real_step()
        poisoned = any(POISON in r.prompt_token_ids for r in eng.running)
        steps.append((ids, poisoned))
        if poisoned:
            raise RuntimeError("injected: poisoned")
    monkeypatch.setattr(eng, "step", step)
    return steps


def _engine_is_clean(eng):
    return not eng.waiting and not eng.running and not any(eng.pool.refcount) and not eng.finished


def test_the_batch_mate_of_a_poison_request_is_served_and_only_the_poison_fails(runner, model, monkeypatch,
                                                                                 caplog):
    """One worker; a poison request and a good one are batched in one engine step, which raises.
    Before: both failed INTERNAL (the entrypoint retried both on this same worker, where they
    tended to share a step again, and the good one failed every attempt). Now the step's requests
    are retried each alone first: only the one that fails alone gets the error."""
    steps = _poison_steps(runner, monkeypatch)
    gate, real_admit = threading.Event(), runner._admit
    monkeypatch.setattr(runner, "_admit", lambda: (gate.wait(), real_admit()))  # both queued first
    good_prompt = list(range(1, 41))
    poison = _submit(runner, "poison", [POISON, 2, 3, 4] * 10)
    good = _submit(runner, "good", good_prompt)
    gate.set()
    with caplog.at_level(logging.WARNING, logger="entrypoint.engine_runner"):
        kind, code, msg = _outcome(poison)
        assert _outcome(good) == ("done", _cold(model, good_prompt)), steps
    assert kind == "error" and code == grpc.StatusCode.INTERNAL and "poisoned" in msg
    assert steps[0] == (["good", "poison"], True), steps  # they did share the failed step
    assert all(ids == ["poison"] for ids, failed in steps if failed and ids != steps[0][0]), steps
    assert len([s for s in steps if s[1]]) == 2, steps  # the shared step and the poison's own: no loop
    assert any("alone" in r.getMessage() for r in caplog.records), caplog.text
    assert _engine_is_clean(runner.engine) and runner.broken is None
    prompt = list(range(5, 50))  # and the engine serves the next request as before
    assert _outcome(_submit(runner, "next", prompt)) == ("done", _cold(model, prompt))


def test_two_poison_requests_batched_together_each_fail_alone_once(runner, model, monkeypatch):
    """Every retry alone fails: each request gets INTERNAL after its one turn (3 failed steps in
    all, no retry loop), and the engine is clean and serves the next request."""
    steps = _poison_steps(runner, monkeypatch)
    gate, real_admit = threading.Event(), runner._admit
    monkeypatch.setattr(runner, "_admit", lambda: (gate.wait(), real_admit()))
    a, b = _submit(runner, "a", [POISON] * 20), _submit(runner, "b", [POISON, 1] * 10)
    gate.set()
    assert [_outcome(h)[:2] for h in (a, b)] == [("error", grpc.StatusCode.INTERNAL)] * 2, steps
    assert [ids for ids, failed in steps if failed] == [["a", "b"], ["a"], ["b"]], steps
    assert _engine_is_clean(runner.engine) and runner.broken is None
    prompt = list(range(5, 50))
    assert _outcome(_submit(runner, "next", prompt)) == ("done", _cold(model, prompt))


def test_a_stream_whose_step_failed_midway_resumes_at_its_next_token(runner, model, monkeypatch):
    """A good request that has already streamed tokens shares a step with a poison request that
    arrived later: its retry alone continues at its next output index (no token sent twice, none
    lost, the same tokens as a run alone), and it rejoins the batch after its turn."""
    sampling = SamplingParams(max_new_tokens=30)
    holding = threading.Event()
    poison_queued = threading.Event()

    def before():  # hold the runner once the stream has sent a few tokens, until the poison is queued
        h = handles.get("stream")
        if h is not None and not poison_queued.is_set() and h.events.qsize() >= 3:
            holding.set()
            poison_queued.wait(30)
    handles: dict = {}
    steps = _poison_steps(runner, monkeypatch, before)
    prompt = list(range(1, 21))
    handles["stream"] = runner.submit("stream", prompt, sampling, tenant_salt=b"", images=[])
    assert holding.wait(60), steps
    poison = _submit(runner, "poison", [POISON] * 20)
    poison_queued.set()
    events = []
    while not events or events[-1][0] == "token":
        events.append(handles["stream"].events.get(timeout=60))
    assert _outcome(poison)[:2] == ("error", grpc.StatusCode.INTERNAL), steps
    assert events[-1][0] == "done", events
    cold = Engine(model, EngineConfig(block_size=16, num_blocks=64)).generate(prompt, sampling).output
    assert [e[1:] for e in events[:-1]] == [(t, i) for i, t in enumerate(cold)], steps
    assert sum(1 for _, failed in steps if failed) == 2, steps
    assert _engine_is_clean(runner.engine) and runner.broken is None


# ----------------------------------------------------------------------------- cancelled requests


@pytest.fixture
def roomy_runner(model):
    conn = KVStoreConnector(model.kv_layout(), ConnectorConfig(block_size=16))
    r = EngineRunner(Engine(model, EngineConfig(block_size=16, num_blocks=64), connector=conn), conn)
    yield r
    r.stop()
    conn.close()


@pytest.fixture
def decode_worker(roomy_runner):
    """A decode ``WorkerService`` over ``roomy_runner``, served on loopback; yields its stub."""
    from entrypoint.proto import serving_pb2 as pb
    from entrypoint.proto import serving_pb2_grpc as pbg
    from entrypoint.rpc import make_server
    from entrypoint.worker import WorkerConfig, WorkerService

    svc = WorkerService(WorkerConfig(role="decode"), roomy_runner, None)
    server, port = make_server(futures.ThreadPoolExecutor(max_workers=4),
                               [(svc, pb.DESCRIPTOR.services_by_name["Worker"])], "127.0.0.1", 0)
    server.start()
    ch = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield pbg.WorkerStub(ch)
    ch.close()
    server.stop(grace=0).wait()


def _decode_request(rid, prompt, max_new):
    from entrypoint.proto import serving_pb2 as pb

    return pb.DecodeRequest(request_id=rid, token_ids=prompt, sampling=pb.Sampling(max_new_tokens=max_new))


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_a_decode_whose_caller_went_away_leaves_the_engine(roomy_runner, decode_worker, model, monkeypatch, how):
    """The caller of a long Decode cancels it (or its deadline passes) after its first tokens:
    the request leaves the engine at once, its blocks freed, and the next request is served.
    Before: the runner decoded it to max_new_tokens (here about 20 s), holding its blocks."""
    eng, real_step = roomy_runner.engine, roomy_runner.engine.step

    def slow_step():  # about 20 ms a token: the whole stream would take 20 s or more
        time.sleep(0.02)
        real_step()
    monkeypatch.setattr(eng, "step", slow_step)
    prompt = list(range(1, 21))
    call = decode_worker.Decode(_decode_request("long", prompt, 1000), timeout=120 if how == "cancel" else 1.5)
    got = [next(call) for _ in range(3)]
    assert [e.index for e in got] == [0, 1, 2]
    if how == "cancel":
        call.cancel()
    with pytest.raises(grpc.RpcError) as ei:
        for _ in call:
            pass
    assert ei.value.code() == (grpc.StatusCode.CANCELLED if how == "cancel" else grpc.StatusCode.DEADLINE_EXCEEDED)
    deadline = time.monotonic() + 10
    while not (_engine_is_clean(eng) and roomy_runner.cancelled) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _engine_is_clean(eng), [len(r.output) for r in eng.running]
    assert roomy_runner.cancelled == 1 and not roomy_runner._live
    events = list(decode_worker.Decode(_decode_request("next", prompt, 4), timeout=60))
    cold = Engine(model, EngineConfig(block_size=16, num_blocks=64)).generate(prompt, SamplingParams(max_new_tokens=4))
    assert [e.token_id for e in events[:-1]] == cold.output and events[-1].stats
    assert roomy_runner.cancelled == 1  # the request that ended is not cancelled when its RPC ends
    assert _engine_is_clean(eng) and not roomy_runner._live


@pytest.mark.parametrize("when", ["waiting for its turn alone", "set aside after its turn alone"])
def test_a_cancelled_request_is_not_retried_alone_nor_rejoins(runner, model, monkeypatch, when):
    """A good request shares a failed step with a poison one, and its caller goes away while it
    waits for its turn alone, or after that turn while set aside: it never enters the engine
    again (before: it took a turn alone, a full re-prefill, while new requests waited, then
    rejoined the batch and decoded to the end). The poison request still fails alone."""
    handles: dict = {}

    def before():
        ids = sorted(r.request_id for r in [*runner.engine.waiting, *runner.engine.running])
        if not handles.get("cancelled") and (ids == ["good", "poison"] if when.startswith("waiting")
                                             else ids == ["poison"]):
            handles["cancelled"] = True
            runner.cancel(handles["good"])
    steps = _poison_steps(runner, monkeypatch, before)
    gate, real_admit = threading.Event(), runner._admit
    monkeypatch.setattr(runner, "_admit", lambda: (gate.wait(), real_admit()))
    handles["good"] = runner.submit("good", list(range(1, 21)), SamplingParams(max_new_tokens=40), tenant_salt=b"",
                                    images=[])
    poison = _submit(runner, "poison", [POISON] * 20)
    gate.set()
    assert _outcome(poison)[:2] == ("error", grpc.StatusCode.INTERNAL), steps
    prompt = list(range(5, 50))
    assert _outcome(_submit(runner, "next", prompt)) == ("done", _cold(model, prompt)), steps
    turns = [ids for ids, _ in steps[1:] if "good" in ids]
    assert turns == ([] if when.startswith("waiting") else [["good"]]), steps
    left = [handles["good"].events.get_nowait()[0] for _ in range(handles["good"].events.qsize())]
    assert "done" not in left and "error" not in left, left
    assert runner.cancelled == 1 and not runner._live and not runner._retry and not runner._passed
    assert _engine_is_clean(runner.engine) and runner.broken is None


# ----------------------------------------------------------------------------- command lines


def _run(args, cwd, timeout=120):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def _one_line_error(res, prog, *needles, code=2):
    err = res.stderr.strip()
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and len(err.splitlines()) == 1, res.stderr
    assert err.startswith(f"{prog}: error: ") and all(n in err for n in needles), err


@pytest.mark.slow  # one subprocess per case: the second stage of the test command
@pytest.mark.parametrize("args, needles", [
    (["--block-size", "0"], ["block_size", "got 0"]),
    (["--block-size", "-16"], ["block_size"]),
    (["--model", "nope"], ["unknown model preset 'nope'"]),
    (["--prefill-policy", "nope"], ["invalid choice: 'nope'", "'kvstack'", "'round_robin'"]),  # lists the choices
    (["--max-inflight", "0"], ["max_inflight"]),
    (["--heartbeat-s", "nan"], ["heartbeat_s"]),
    (["--port", "70000"], ["--port"]),
    (["--block-size", "x"], ["--block-size"]),
    (["--tenant", "a="], ["'a'", "empty salt"]),
    (["--tenant", "a=s", "--tenant", "b=s"], ["'a'", "'b'", "same salt"]),
    (["--tenant", "a=s1", "--tenant", "a=s2"], ["'a'", "given twice"]),
    (["--max-model-len", "-1"], ["max_model_len", "got -1"]),
    (["--host", "0.0.0.0"], ["0.0.0.0", "no worker secret", "KVSTACK_WORKER_SECRET"]),
    (["--worker-secret-file", "no-such-file"], ["cannot read --worker-secret-file no-such-file"]),
])
def test_entrypoint_usage_errors_are_one_line(tmp_path, args, needles):
    res = _run(["-m", "entrypoint", "--store", str(tmp_path / "store"), *args], tmp_path)
    _one_line_error(res, "python -m entrypoint", *needles)
    assert not (tmp_path / "store").exists()  # refused before anything was opened


def test_worker_with_an_unreachable_entrypoint_says_so_in_one_line(tmp_path):
    res = _run(["-m", "entrypoint.worker", "--role", "prefill", "--entrypoint", "127.0.0.1:1",
                "--store", str(tmp_path / "store")], tmp_path)
    _one_line_error(res, "python -m entrypoint.worker", "127.0.0.1:1", "unreachable", code=1)


@pytest.mark.slow  # one subprocess per case: the second stage of the test command
@pytest.mark.parametrize("args, needles", [
    (["--role", "prefill", "--block-size", "0"], ["block_size"]),
    (["--role", "decode", "--num-blocks", "0"], ["num_blocks"]),
    (["--role", "decode", "--step-timeout-s", "-1"], ["step_timeout_s", ">= 0"]),
    (["--role", "decode", "--step-timeout-s", "nan"], ["step_timeout_s", "finite"]),
    (["--role", "decode", "--step-timeout-s", "soon"], ["--step-timeout-s"]),
    (["--role", "prefill", "--model", "nope"], ["unknown model preset"]),
    (["--role", "nope"], ["--role"]),
    (["--role", "prefill", "--worker-secret-file", "no-such-file"], ["cannot read --worker-secret-file"]),
    # Beyond loopback, anyone could call it with any tenant's salt (before: it served them all).
    (["--role", "prefill", "--host", "0.0.0.0"], ["worker listens on 0.0.0.0", "no worker secret",
                                                  "KVSTACK_WORKER_SECRET"]),
])
def test_worker_usage_errors_are_one_line(tmp_path, args, needles):
    res = _run(["-m", "entrypoint.worker", "--store", str(tmp_path / "store"), *args], tmp_path)
    _one_line_error(res, "python -m entrypoint.worker", *needles)
    assert not (tmp_path / "store").exists()


def test_worker_without_a_secret_serves_loopback_callers_and_warns_once(tmp_path):
    """Zero configuration stays as it was: a loopback worker answers any local caller; it says so
    once it serves (not before: a start-up error stays one line)."""
    from entrypoint.proto import serving_pb2 as pb
    from entrypoint.proto import serving_pb2_grpc as pbg
    from entrypoint.walkthrough.launcher import _ready_json

    err = tmp_path / "stderr"
    with open(err, "wb") as err_fh:
        p = subprocess.Popen([sys.executable, "-m", "entrypoint.worker", "--role", "ve", "--store",
                              str(tmp_path / "store")], cwd=tmp_path, stdout=subprocess.PIPE, stderr=err_fh,
                             text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    try:
        info = _ready_json(p.stdout.readline())
        assert info is not None, err.read_text()
        with grpc.insecure_channel(info["address"]) as ch:
            st = pbg.WorkerStub(ch).Status(pb.StatusRequest(), timeout=30)
        assert st.worker_id == info["worker_id"]
    finally:
        p.terminate()
        p.wait(timeout=30)
        p.stdout.close()
    warnings = [line for line in err.read_text().splitlines() if "no worker secret" in line]
    assert len(warnings) == 1 and "KVSTACK_WORKER_SECRET" in warnings[0], err.read_text()


# ----------------------------------------------------------------------------- VE cache trust


class _Ctx:
    """The part of a ``grpc.ServicerContext`` that ``Encode`` uses; ``abort`` raises."""

    def __init__(self, scope: str):
        self.md = (("kvstack-image-scope", scope),)

    def invocation_metadata(self):
        return self.md

    def abort(self, code, details):
        raise grpc.RpcError(code, details)


@pytest.fixture
def ve():
    from entrypoint.proto import serving_pb2 as pb
    from entrypoint.vision import VisionEncoder
    from entrypoint.worker import WorkerConfig, WorkerService

    cfg = model_preset("tiny")
    svc = WorkerService(WorkerConfig(role="ve"), None, VisionEncoder(cfg.vocab_size, seed=cfg.seed))

    def encode(scope, h, data, length=8):
        return svc.Encode(pb.EncodeRequest(image=pb.ImageSegment(image_hash=h, image_data=data, length=length)),
                          _Ctx(scope))
    return svc, encode


def test_ve_refuses_bytes_that_do_not_match_their_hash_and_caches_nothing(ve):
    from kvstore.keys import image_hash

    svc, encode = ve
    img1, img2 = b"one" * 100, b"two" * 100
    with pytest.raises(grpc.RpcError) as ei:
        encode("tenant-b", image_hash(img1), img2)  # B claims img1's hash for img2's bytes
    assert ei.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT and "does not match" in ei.value.args[1]
    assert svc.cache.keys() == []  # before: img2's tokens cached under H(img1)
    assert list(encode("tenant-a", image_hash(img1), img1).token_ids) == svc.encoder.encode(img1, 8)


def test_ve_hash_only_lookup_hits_only_for_a_scope_that_sent_the_bytes(ve):
    from kvstore.keys import image_hash

    svc, encode = ve
    img = b"secret" * 50
    h = image_hash(img)
    first = encode("tenant-a", h, img)
    assert not first.cache_hit
    with pytest.raises(grpc.RpcError) as ei:  # before: tenant B got A's image tokens from the hash alone
        encode("tenant-b", h, b"")
    assert ei.value.args[0] == grpc.StatusCode.INVALID_ARGUMENT
    again = encode("tenant-a", h, b"")  # A's own image by hash: served from the cache
    assert again.cache_hit and list(again.token_ids) == list(first.token_ids)
    # B with the bytes: a miss for B (a hit would tell B that another tenant sent them), encoded.
    b_first = encode("tenant-b", h, img)
    assert not b_first.cache_hit and list(b_first.token_ids) == list(first.token_ids)
    assert encode("tenant-b", h, b"").cache_hit  # ...and now B has proven it holds the image


@pytest.mark.parametrize("tenants, needle", [
    ({"default": b"", "a": b""}, "empty salt"),
    ({"default": b"", "a": b"s", "b": b"s"}, "same salt"),
    ({"default": b"x", "a": b"x"}, "same salt"),
])
def test_entrypoint_config_refuses_tenants_that_would_share_keys(tenants, needle):
    import kvstore
    from entrypoint.config import EntrypointConfig

    with pytest.raises(kvstore.InvalidRequest, match=needle):
        EntrypointConfig(namespace=model_preset("tiny").namespace(), tenants=tenants)
    EntrypointConfig(namespace=model_preset("tiny").namespace(), tenants={"default": b"", "a": b"1", "b": b"2"})
