"""Avoided workers (``entrypoint.health``): strikes counted per registration, cleared by progress,
and picks that leave a worker with ``avoid_after`` strikes in a row out for ``avoid_for_s`` (a fake
clock in the unit tests; fake workers of ``test_service`` in process for the rest)."""

from __future__ import annotations

import json
import threading
import time

import grpc
import pytest

from entrypoint.dispatch import Abort
from entrypoint.health import Outcome, StrikePolicy, Strikes
from entrypoint.instances import Instance
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from tests.entrypoint.test_service import FIRST_TOKEN, FakeWorker, _serve_fake, stack  # noqa: F401 - fixture


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _inst(worker_id: str) -> Instance:
    return Instance(worker_id, "prefill", "127.0.0.1:9", channel=None, stub=None)


def _strikes(clock: Clock, after: int = 3, for_s: float = 30.0) -> Strikes:
    return Strikes(StrikePolicy(after, for_s, clock), threading.Lock())


def test_strikes_in_a_row_avoid_a_worker_for_a_while_and_progress_clears_them():
    clock = Clock()
    s = _strikes(clock)
    bad, good = _inst("bad"), _inst("good")
    live = [bad, good]
    for _ in range(2):
        s.record(bad, Outcome.FAILED_HERE)
    assert s.tiers(live, set())[0] == live  # 2 < avoid_after: not yet
    s.record(bad, Outcome.PROGRESS)  # one success clears the count
    for _ in range(2):
        s.record(bad, Outcome.FAILED_HERE)
    assert s.tiers(live, set())[0] == live
    s.record(bad, Outcome.FAILED_HERE)  # the third in a row
    assert s.tiers(live, set())[0] == [good]
    assert s.tiers([bad], set())[0] == [bad]  # never an empty pick: alone, it is picked all the same
    clock.t += 30.0  # the cooldown is over: picked as any other
    assert s.tiers(live, set())[0] == live
    s.record(bad, Outcome.FAILED_HERE)  # one more strike avoids it again at once
    assert s.tiers(live, set())[0] == [good]
    s.record(bad, Outcome.PROGRESS)
    assert s.tiers(live, set())[0] == live and (bad.strikes, bad.avoid_until) == (0, 0.0)


def test_a_worker_that_failed_this_request_is_left_out_before_an_avoided_one():
    clock = Clock()
    s = _strikes(clock, after=1)
    a, b, c = _inst("a"), _inst("b"), _inst("c")
    s.record(a, Outcome.FAILED_HERE)  # avoided
    assert s.tiers([a, b, c], {"b"})[0] == [c]
    assert s.tiers([a, b], {"b"})[0] == [a]  # b failed this very request: a, though avoided
    assert s.tiers([a, b], {"a", "b"})[0] == [a, b]


def test_tiers_widen_from_the_preferred_workers_to_all_live_ones_none_empty_or_repeated():
    clock = Clock()
    s = _strikes(clock, after=1)
    a, b, c = _inst("a"), _inst("b"), _inst("c")
    s.record(a, Outcome.FAILED_HERE)  # avoided
    assert s.tiers([a, b, c], {"b"}) == [[c], [a, c], [a, b, c]]
    assert s.tiers([a, b], {"b"}) == [[a], [a, b]]
    assert s.tiers([a, c], set()) == [[c], [a, c]]
    assert s.tiers([b, c], set()) == [[b, c]]
    assert s.tiers([a, b], {"a", "b"}) == [[a, b]]
    assert s.tiers([], set()) == []


# ----------------------------------------------------------------------------- in process


class FailsEveryPrefill(FakeWorker):
    """Answers Status (up, idle), fails every Prefill INTERNAL at once."""

    def Prefill(self, request, context):
        self._record("Prefill", context)
        context.abort(grpc.StatusCode.INTERNAL, "engine step failed")


def _prefill_calls(fake) -> int:
    return sum(1 for m, _ in fake.calls if m == "Prefill")


def test_a_worker_that_fails_every_call_here_is_avoided_after_a_few_not_tried_first_for_ever(stack):
    """``bad`` is registered first and looks idle, so every request tried it first. Before: each of
    the 8 requests paid a failed Prefill there and a backoff (8 failed calls, for ever); now, after
    ``avoid_after`` (3) in a row it is left out, and the later requests go to ``good`` at once. It
    is never marked down (it answers Status)."""
    svc, ch, fakes, _ = stack(retry_backoff_s=(0.0, 0.0))  # avoid_after 3, avoid_for_s 30: the defaults
    opened: list = []
    try:
        bad = FailsEveryPrefill("bad-p", "prefill")
        svc.registry.add(bad.worker_id, "prefill", _serve_fake(bad, opened))
        svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
        svc.registry.add(fakes["decode"][0].worker_id, "decode", fakes["decode"][1])
        stub = pbg.EntrypointStub(ch)
        for i in range(8):  # distinct prompts: no prefix affinity to the one that served
            req = pb.GenerateRequest(token_ids=[100 + i] * 40, sampling=pb.Sampling(max_new_tokens=3))
            events = list(stub.Generate(req, timeout=30))
            assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2]
            worker = next(json.loads(e.detail)["worker"] for e in events
                          if e.kind == "hop" and json.loads(e.detail)["hop"] == "prefill")
            assert worker == fakes["prefill"][0].worker_id
        assert _prefill_calls(bad) == 3
        assert {i.worker_id for i in svc.registry.ready("prefill")} == {bad.worker_id, fakes["prefill"][0].worker_id}
    finally:
        for close in opened:
            close(None)


def test_a_poison_request_takes_no_worker_down_and_avoids_none(stack):
    """A request every prefill worker fails INTERNAL: it fails after max_attempts with the worker's own
    status, having cost each worker one strike; the next request is served by the first one."""
    svc, ch, fakes, _ = stack(retry_backoff_s=(0.0, 0.0), max_attempts=2)
    opened: list = []
    try:
        class PoisonAware(FakeWorker):
            def Prefill(self, request, context):
                if request.token_ids[0] == 666:
                    context.abort(grpc.StatusCode.INTERNAL, "engine step failed")
                return super().Prefill(request, context)

        workers = [PoisonAware(f"p-{i}", "prefill") for i in range(2)]
        for w in workers:
            svc.registry.add(w.worker_id, "prefill", _serve_fake(w, opened))
        svc.registry.add(fakes["decode"][0].worker_id, "decode", fakes["decode"][1])
        stub = pbg.EntrypointStub(ch)
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(pb.GenerateRequest(token_ids=[666] * 40, sampling=pb.Sampling(max_new_tokens=3)),
                               timeout=30))
        assert ei.value.code() == grpc.StatusCode.INTERNAL
        assert [i.strikes for i in svc.registry.instances("prefill")] == [1, 1]
        assert not any(svc.strikes.avoided(i) for i in svc.registry.instances("prefill"))
        events = list(stub.Generate(pb.GenerateRequest(token_ids=[1] * 40, sampling=pb.Sampling(max_new_tokens=3)),
                                    timeout=30))
        assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2]
        assert len(svc.registry.ready("prefill")) == 2
    finally:
        for close in opened:
            close(None)


class Hung(FakeWorker):
    """Answers Status (up, idle); its Prefill, or its Decode stream, sends nothing until cancelled."""

    def _hang(self, method: str, context) -> None:
        self._record(method, context)
        while context.is_active():
            time.sleep(0.01)

    def Prefill(self, request, context):
        self._hang("Prefill", context)
        return pb.PrefillReply(first_token=FIRST_TOKEN, stats="{}")

    def Decode(self, request, context):
        self._hang("Decode", context)
        return iter(())


def _wait_avoided(svc, worker_id: str) -> None:
    """Until the entrypoint has counted the strikes of the calls the clients gave up on (it may see
    a call's end a moment after its client did)."""
    inst = next(i for i in svc.registry.instances() if i.worker_id == worker_id)
    deadline = time.monotonic() + 10
    while not svc.strikes.avoided(inst) and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_hung_engine_whose_status_answers_is_avoided_when_clients_deadlines_end_first(stack, role):
    """The ``role`` worker registered first hangs; its Status answers, so it stays up and looks idle.
    Every client gives 1.5 s (far under worker_timeout_s). Before: each call ran out of the client's
    deadline, was the client's, took nothing down, and every request went on to the hung worker for
    ever; now, after 3 such calls in a row it is avoided, and the next requests are served by the
    other worker. It is not marked down."""
    svc, ch, fakes, _ = stack()
    opened: list = []
    try:
        hung = Hung(f"hung-{role}", role)
        svc.registry.add(hung.worker_id, role, _serve_fake(hung, opened))
        for r in ("prefill", "decode"):
            svc.registry.add(fakes[r][0].worker_id, r, fakes[r][1])
        stub = pbg.EntrypointStub(ch)

        def generate(i: int):
            req = pb.GenerateRequest(token_ids=[100 + i] * 40, sampling=pb.Sampling(max_new_tokens=3))
            return list(stub.Generate(req, timeout=1.5))

        for i in range(3):
            with pytest.raises(grpc.RpcError) as ei:
                generate(i)
            assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        _wait_avoided(svc, hung.worker_id)
        for i in range(3, 6):
            events = generate(i)
            assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2]
        assert sum(1 for m, _ in hung.calls if m == role.capitalize()) == 3
        assert hung.worker_id in {i.worker_id for i in svc.registry.ready(role)}  # avoided, not down
    finally:
        for close in opened:
            close(None)


def test_one_short_client_deadline_on_a_slow_worker_costs_one_strike_and_progress_clears_it(stack):
    """A slow but healthy decode worker: one client whose deadline ends before the first token costs
    it one strike (not down, not avoided); a stream that then sends a token clears it."""
    svc, ch, fakes, _ = stack()
    opened: list = []
    try:
        class SlowFirstToken(FakeWorker):
            def Decode(self, request, context):
                time.sleep(0.8)
                yield from super().Decode(request, context)

        slow = SlowFirstToken("slow-d", "decode")
        svc.registry.add(slow.worker_id, "decode", _serve_fake(slow, opened))
        svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
        stub = pbg.EntrypointStub(ch)
        req = pb.GenerateRequest(token_ids=[1] * 40, sampling=pb.Sampling(max_new_tokens=3))
        with pytest.raises(grpc.RpcError) as ei:
            list(stub.Generate(req, timeout=0.4))
        assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        inst = svc.registry.instances("decode")[0]
        deadline = time.monotonic() + 10
        while inst.strikes == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert inst.strikes == 1 and not svc.strikes.avoided(inst) and inst.healthy
        events = list(stub.Generate(req, timeout=30))
        assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2]
        assert inst.strikes == 0
    finally:
        for close in opened:
            close(None)


class FullDecode(FakeWorker):
    """A decode worker whose Status says its KV is full: the Decode LB admits nothing there."""

    def Status(self, request, context):
        return pb.WorkerStatus(worker_id=self.worker_id, role=self.role, kv_capacity_bytes=1 << 30,
                               kv_used_bytes=1 << 30)


class FailsFirstDecode(FakeWorker):
    """Its first Decode fails INTERNAL; the next ones are served."""

    def Decode(self, request, context):
        if not any(m == "Decode" for m, _ in self.calls):
            self._record("Decode", context)
            context.abort(grpc.StatusCode.INTERNAL, "an engine step failed")
        yield from super().Decode(request, context)


@pytest.mark.parametrize("why", ["avoided", "failed_here"])
def test_a_left_out_decode_worker_is_picked_when_the_preferred_one_has_no_room(stack, why):
    """Two decode workers: ``full-d``'s KV is full; the other is idle but avoided (3 strikes), or
    has just failed this request with INTERNAL. Before: the pick offered the LB the preferred
    worker alone (``full-d``), the LB refused it, and the request failed RESOURCE_EXHAUSTED while
    the other could serve it. Now the LB chooses again among all the workers up: served there."""
    svc, ch, fakes, _ = stack(max_attempts=3)
    opened: list = []
    try:
        svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
        other = FailsFirstDecode("other-d", "decode") if why == "failed_here" else FakeWorker("other-d", "decode")
        inst = svc.registry.add(other.worker_id, "decode", _serve_fake(other, opened))
        full = FullDecode("full-d", "decode")
        svc.registry.add(full.worker_id, "decode", _serve_fake(full, opened))
        if why == "avoided":
            for _ in range(3):
                svc.strikes.record(inst, Outcome.NO_PROGRESS)
            assert svc.strikes.avoided(inst)
        req = pb.GenerateRequest(token_ids=[1, 2, 3, 4], sampling=pb.Sampling(max_new_tokens=4))
        events = list(pbg.EntrypointStub(ch).Generate(req, timeout=30))
        assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2, 3]
        starts = [json.loads(e.detail)["worker"] for e in events
                  if e.kind == "hop" and json.loads(e.detail)["hop"] == "decode_start"]
        assert starts == ["other-d"] * (2 if why == "failed_here" else 1)
        assert not any(m == "Decode" for m, _ in full.calls)
    finally:
        for close in opened:
            close(None)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_hung_engine_that_misses_worker_timeout_is_avoided_though_the_heartbeat_brings_it_back(stack, role):
    """The ``role`` worker registered first hangs (its Status answers); clients set no deadline, so each
    call on it misses worker_timeout_s (1 s): it is marked down and the hop fails over to the other
    worker; a heartbeat (``poll_once``) brings it back before each request. Before: that path recorded
    no strike, so it was never avoided and every request paid worker_timeout_s there first (6 calls in
    6 requests); now, after 3 it is avoided and the next requests go straight to the other worker."""
    svc, ch, fakes, _ = stack(worker_timeout_s=1.0, max_attempts=3)
    opened: list = []
    try:
        hung = Hung(f"hung-{role}", role)
        svc.registry.add(hung.worker_id, role, _serve_fake(hung, opened))
        for r in ("prefill", "decode"):
            svc.registry.add(fakes[r][0].worker_id, r, fakes[r][1])
        stub = pbg.EntrypointStub(ch)
        inst = svc.registry.instances(role)[0]
        for i in range(6):
            svc.registry.poll_once()  # a heartbeat: the hung worker answers Status, so it is up again
            assert inst.healthy
            req = pb.GenerateRequest(token_ids=[100 + i] * 40, sampling=pb.Sampling(max_new_tokens=3))
            events = list(stub.Generate(req, timeout=60))
            assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN, 1, 2]
        assert sum(1 for m, _ in hung.calls if m == role.capitalize()) == 3
        assert inst is svc.registry.instances(role)[0] and inst.strikes == 3 and svc.strikes.avoided(inst)
    finally:
        for close in opened:
            close(None)


def test_a_decode_engine_that_stalls_a_few_tokens_in_is_avoided_though_the_heartbeat_brings_it_back(stack):
    """The decode worker registered first sends 2 tokens of every stream, then nothing (its Status
    answers); worker_timeout_s 0.5 s, avoid_after 1. The first request's stream stalls there: it is
    cancelled, the worker marked down, and the stream resumes on the other worker after the tokens
    sent; a heartbeat (``poll_once``) brings the staller back. Before: a stall after tokens counted no
    strike, so the second request went to it again (and stalled there too); now it is avoided."""
    from tests.entrypoint.test_deadlines import StallingDecode

    svc, ch, fakes, _ = stack(worker_timeout_s=0.5, max_attempts=3, avoid_after=1)
    opened: list = []
    try:
        stuck = StallingDecode("stuck-d", "decode", 0.0, stall_at=3)  # sends indices 1 and 2, then stalls
        svc.registry.add(stuck.worker_id, "decode", _serve_fake(stuck, opened))
        for r in ("prefill", "decode"):
            svc.registry.add(fakes[r][0].worker_id, r, fakes[r][1])
        stub = pbg.EntrypointStub(ch)
        inst = svc.registry.instances("decode")[0]
        starts = []
        for i in range(2):
            svc.registry.poll_once()  # a heartbeat: the staller answers Status, so it is up again
            assert inst.healthy
            req = pb.GenerateRequest(token_ids=[100 + i] * 40, sampling=pb.Sampling(max_new_tokens=8))
            events = list(stub.Generate(req, timeout=60))
            assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN] + list(range(1, 8))
            starts.append([json.loads(e.detail)["worker"] for e in events
                           if e.kind == "hop" and json.loads(e.detail)["hop"] == "decode_start"])
        assert starts == [[stuck.worker_id, "fake-decode"], ["fake-decode"]]
        assert sum(1 for m, _ in stuck.calls if m == "Decode") == 1
        assert inst is svc.registry.instances("decode")[0] and inst.strikes == 1 and svc.strikes.avoided(inst)
    finally:
        for close in opened:
            close(None)


class LateStatsDecode(FakeWorker):
    """A decode worker that sends every token of a stream, then holds its final stats event until
    ``release`` is set (bounded), as the real worker does while it flushes its saves after the last
    token."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.release = threading.Event()

    def Decode(self, request, context):
        self._record("Decode", context)
        for i in range(len(request.generated), request.sampling.max_new_tokens):
            yield pb.DecodeEvent(token_id=i, index=i)
        self.release.wait(60)  # far past worker_timeout_s: the entrypoint gives up on it first
        yield pb.DecodeEvent(token_id=0, index=0, stats=json.dumps({"late": True}))


def test_a_decode_stream_that_stalls_after_its_last_token_is_served_and_not_struck(stack):
    """The decode worker sends every token, then nothing for worker_timeout_s (its stats event is late):
    the request is complete, so the client's stream ends as usual (its decode hop says the stats were
    lost), with no failover, and the worker is neither struck nor marked down. Before: STALLED, a
    strike, marked down, a failover hop, and (avoid_after 1) avoided for a request it had served."""
    svc, ch, fakes, _ = stack(worker_timeout_s=0.5, max_attempts=3, avoid_after=1)
    opened: list = []
    late = LateStatsDecode("late-d", "decode")
    try:
        svc.registry.add(late.worker_id, "decode", _serve_fake(late, opened))
        svc.registry.add(fakes["prefill"][0].worker_id, "prefill", fakes["prefill"][1])
        inst = svc.registry.instances("decode")[0]
        req = pb.GenerateRequest(token_ids=[100] * 40, sampling=pb.Sampling(max_new_tokens=8))
        events = list(pbg.EntrypointStub(ch).Generate(req, timeout=60))
        assert [e.token_id for e in events if e.kind == "token"] == [FIRST_TOKEN] + list(range(1, 8))
        hops = [json.loads(e.detail) for e in events if e.kind == "hop"]
        assert [h["hop"] for h in hops if h["hop"].startswith("decode") or h["hop"] == "failover"] == [
            "decode_start", "decode"]
        assert "stats_lost" in hops[-1] and events[-1].kind == "done"
        assert inst.strikes == 0 and inst.healthy and not svc.strikes.avoided(inst)
    finally:
        late.release.set()
        for close in opened:
            close(None)


class EndingContext:
    """The servicer context of a client whose call grpc ends at ``end(left_s)``, as it ends one that the
    client cancelled or whose deadline passed: from then it reads inactive with ``left_s`` of the deadline
    left by this server's reckoning (given, not read from a clock), and its callbacks (the worker call's
    cancel) run."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.left_s, self.active, self.callbacks = 100.0, True, []

    def time_remaining(self) -> float:
        return self.left_s

    def is_active(self) -> bool:
        return self.active

    def add_callback(self, callback) -> bool:
        with self._lock:
            if not self.active:
                return False
            self.callbacks.append(callback)
            return True

    def invocation_metadata(self):
        return ()

    def end(self, left_s: float) -> None:
        with self._lock:
            self.left_s, self.active = left_s, False
        for callback in self.callbacks:
            callback()


@pytest.mark.parametrize("role", ["prefill", "decode"])
@pytest.mark.parametrize("left_s, strikes", [(0.05, 1), (5.0, 0)])
def test_a_cancel_at_the_clients_deadline_is_a_strike_though_some_of_it_is_left_here(stack, role, left_s, strikes):
    """The ``role`` worker hangs; the client's call is cancelled while its worker call is in flight, with
    ``left_s`` of its deadline left by this server's reckoning. 50 ms left: the client's own grpc cancelled
    it at ITS deadline, which this server's (set when the headers arrived) lags; a strike, as for a call
    that ran out of the client's time without progress. Before: more than 10 ms left read as the client
    leaving, and the strike was missed. 5 s left: a client that left, no strike. Worker up either way."""
    svc, _, fakes, _ = stack()
    opened: list = []
    try:
        hung = Hung(f"hung-{role}", role)
        svc.registry.add(hung.worker_id, role, _serve_fake(hung, opened))
        other = "decode" if role == "prefill" else "prefill"
        svc.registry.add(fakes[other][0].worker_id, other, fakes[other][1])
        ctx, ended = EndingContext(), []
        req = pb.GenerateRequest(token_ids=[1] * 40, sampling=pb.Sampling(max_new_tokens=3))

        def run() -> None:
            try:
                list(svc.pipeline.run(req, ctx))
                ended.append("returned")
            except Abort as exc:
                ended.append(exc.code)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        deadline = time.monotonic() + 10
        while not any(m == role.capitalize() for m, _ in hung.calls) and time.monotonic() < deadline:
            time.sleep(0.01)
        ctx.end(left_s)
        t.join(timeout=30)
        assert ended == ([grpc.StatusCode.CANCELLED] if role == "prefill" else ["returned"])
        inst = svc.registry.instances(role)[0]
        assert (inst.strikes, inst.healthy) == (strikes, True)
    finally:
        for close in opened:
            close(None)
