"""``kvstack walkthrough``: the whole stack on one laptop, hop by hop.

What it does, in order:
  1. starts, on loopback and a fresh data directory, the kvstore daemon, one
     vision-encoder, one prefill and two decode workers (the reference engine
     with the plugin) and the entrypoint (``entrypoint.walkthrough.launcher``);
  2. plays turn 1 (system prompt, tool definitions, the task) and turn 2 (tool
     call, tool result, a screenshot as an image segment);
  3. runs turn 3 cold (a tenant with its own salt, so nothing is cached for it),
     then in three variants, each compared with the cold run token by token:
     - cache hit: the prefix comes from the engine's tiers and the store, the
       SWA snapshot is present, only the new message is prefilled;
     - SWA miss: a fresh prefill engine, and the SWA snapshots deleted with
       ``kvtool delete --kind swa``: the plugin replays the bounded span;
     - engine failover: the decode worker picked to stream the rest is killed
       with SIGKILL after the first token (``FailoverKiller``); the entrypoint
       re-dispatches and the stream completes: the summary's ``re-streamed`` (the
       ``restreamed`` figure in results.json) counts the tokens sent after the
       failover. ``--max-new-tokens`` >= ``MIN_NEW_TOKENS`` leaves at least 7;
  4. prints a per-hop timeline and writes a self-contained HTML report.

Everything it started is stopped when it ends, on Ctrl-C and on error.
The first SIGINT (Ctrl-C) or SIGTERM interrupts the run; from then on, and
while the stack is being stopped, further ones are only noted (``_Signals``),
so a second Ctrl-C never cuts the stop short: the run ends with the one line
``interrupted: stopping everything`` and exit code 130 (also when the signal
came while a finished run was stopping).
Exit code 0 when every variant produced the cold run's tokens, 1 otherwise,
2 on a usage or start-up error. Usage errors (a bad flag value, an unknown
model, an ``--out`` where no directory can be made) are one line on stderr,
found before anything is started. Among them: a ``--num-blocks`` whose pool
(``--num-blocks`` x ``--block-size`` tokens, of which the decode policy admits
``DECODE_ADMITS_PCT`` %) can not hold turn 3 (its prompt plus
``--max-new-tokens``; ``request_sizes``); the message names the least that does.
And a ``--block-size`` over turn 2's prompt, which turn 3 shares: only whole
blocks are cached, so none would be and the cache hit would show nothing; the
message names the largest that works.

Each run gets its own directory under ``--out``, ``run-YYYYmmdd-HHMMSS``, made
exclusively (``make_run_dir``): two walkthroughs started in the same second
in the same ``--out`` get ``...-HHMMSS`` and ``...-HHMMSS-2``, never one
shared store and log set.
"""

from __future__ import annotations

import argparse
import atexit
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from entrypoint._cli import OneLineParser, fail
from entrypoint.proto import serving_pb2 as pb
from entrypoint.vision import VisionEncoder
from entrypoint.walkthrough.conversation import Conversation, RequestSizes, build
from entrypoint.walkthrough.launcher import Cluster
from entrypoint.walkthrough.report import VariantResult, hop_line, render_html
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.keys import BlockHasher, ImageSpan

COLD_TENANT = "cold"
# The share of a decode worker's pool its decode policy admits (lb.decode.KVStackDecodePolicy's
# memory_headroom; the entrypoint's default policy): a longer request is refused at the decode hop.
DECODE_ADMITS_PCT = 95
# The failover variant kills the decode worker once KILL_AFTER_TOKENS tokens arrived and the worker that
# streams the rest is known (its decode_start hop, right after token 0, which the prefill makes). Not later:
# a decode worker streams tokens faster than the client takes them, and a kill at the second token came
# after the last one of a short answer. MIN_NEW_TOKENS leaves tokens to re-stream after the failover.
KILL_AFTER_TOKENS = 1
MIN_NEW_TOKENS = 8
PROG = "kvstack walkthrough"
MAX_RUN_DIRS_PER_SECOND = 1000  # bound on the suffix search of make_run_dir


def make_run_dir(out_dir: Path, now: time.struct_time | None = None) -> Path:
    """Create and return a new, empty run directory under ``out_dir`` (made if missing).

    Named ``run-%Y%m%d-%H%M%S`` (local time ``now``, default: the current time); if that
    exists (another walkthrough started in the same second), ``-2``, ``-3``, ... is added.
    ``mkdir`` without ``exist_ok`` is the claim, so two concurrent runs can never get the
    same directory. Raises ``OSError`` when ``out_dir`` can not hold directories, and
    ``InvalidRequest`` after ``MAX_RUN_DIRS_PER_SECOND`` names taken.
    """
    stamp = time.strftime("run-%Y%m%d-%H%M%S", now or time.localtime())
    out_dir.mkdir(parents=True, exist_ok=True)
    for i in range(1, MAX_RUN_DIRS_PER_SECOND + 1):
        candidate = out_dir / (stamp if i == 1 else f"{stamp}-{i}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return candidate
    raise InvalidRequest(f"{MAX_RUN_DIRS_PER_SECOND} run directories {stamp}* already exist in {out_dir}; "
                         "remove old runs or pick another --out")


def request_sizes(args: argparse.Namespace) -> RequestSizes:
    """The prompt lengths the walkthrough with ``args`` will send (``walkthrough`` builds its prompts
    with the same ``Conversation`` methods), for the checks in ``main``. ``args.model`` must be known."""
    from engine_plugin.reference.config import model_preset

    conv = build(args.context_tokens, model_preset(args.model).vocab_size)
    return conv.request_sizes(args.max_new_tokens)


def min_num_blocks(sizes: RequestSizes, block_size: int) -> int:
    """The fewest pool blocks of ``block_size`` whose admitted share (``DECODE_ADMITS_PCT``) holds the
    longest request. Strictly more than the share, so that no float rounding at the boundary refuses it."""
    return 100 * sizes.longest // (DECODE_ADMITS_PCT * block_size) + 1


class FailoverKiller:
    """``on_event`` of the failover variant: calls ``kill(worker)`` once, for the decode worker serving
    the stream (its ``decode_start`` hop), at the first event that finds ``KILL_AFTER_TOKENS`` tokens
    arrived and that worker known. ``killed``: whom; ``tokens``: the tokens that had arrived then."""

    def __init__(self, kill) -> None:
        self.kill = kill
        self.serving: list[str] = []
        self.killed: list[str] = []
        self.seen = 0  # tokens arrived
        self.tokens = 0

    def __call__(self, ev) -> None:
        if ev.kind == "hop":
            d = json.loads(ev.detail)
            if d["hop"] == "decode_start":
                self.serving.append(d["worker"])
        elif ev.kind == "token":
            self.seen += 1
        if self.seen >= KILL_AFTER_TOKENS and not self.killed and self.serving:
            self.tokens = self.seen
            _say(f"  -- SIGKILL {self.serving[-1]} mid-stream --")
            self.killed.append(self.serving[-1])
            self.kill(self.serving[-1])


def _say(msg: str) -> None:
    print(msg, flush=True)


HEARTBEAT_S = 15.0  # a line this often while a request shows no progress (a long CPU prefill)


def _run(client, name: str, prompt: list[int], images, max_new: int, *, tenant: str = "",
         on_event=None, heartbeat_s: float = HEARTBEAT_S) -> VariantResult:
    _say(f"\n== {name}: {len(prompt):,} prompt tokens")
    t0 = last = time.monotonic()
    done = threading.Event()

    def heartbeat() -> None:  # the full-size example prefills for minutes on a laptop CPU
        nonlocal last
        while not done.wait(min(1.0, heartbeat_s)):
            now = time.monotonic()
            if now - last >= heartbeat_s:
                _say(f"  {(now - t0) * 1e3:9.1f} ms  ... working (no event for {now - last:.0f} s; "
                     "a long prefill on CPU)")
                last = now

    def show(ev):
        nonlocal last
        last = time.monotonic()
        if ev.kind == "hop":
            _say(hop_line(dict(json.loads(ev.detail), t_ms=ev.t_ms)))
        elif ev.kind == "token" and ev.index == 0:
            _say(f"  {ev.t_ms:9.1f} ms  first token   ({ev.token_id})")
        if on_event is not None:
            on_event(ev)

    beat = threading.Thread(target=heartbeat, name="walkthrough-heartbeat", daemon=True)
    beat.start()
    try:
        toks, hops, summary = client.generate(prompt, max_new_tokens=max_new, images=images, tenant=tenant,
                                              on_event=show, timeout=None)
    finally:
        done.set()
        beat.join()
    _say(f"  {summary['total_ms']:9.1f} ms  done          {len(toks)} tokens, TTFT {summary['ttft_ms']:.1f} ms")
    return VariantResult(name, toks, hops, summary)


def _spliced(conv: Conversation, prompt: list[int], seg: pb.ImageSegment, vocab: int, seed: int) -> list[int]:
    toks = VisionEncoder(vocab, seed=seed).encode(seg.image_data, seg.length)
    out = list(prompt)
    out[seg.start:seg.start + seg.length] = toks
    return out


class _Signals:
    """SIGINT and SIGTERM during one walkthrough (module docstring).

    ``interrupting()``: the next one raises ``KeyboardInterrupt`` in the main thread, and switches
    both to ``deferring()`` first, so that a second one can not interrupt the handling of the first.
    ``deferring()``: each one is only appended to ``noted``. ``restore()``: the handlers from before.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.saved = {s: signal.getsignal(s) for s in self.SIGNALS}
        self.noted: list[int] = []

    def interrupting(self) -> None:
        for s in self.SIGNALS:
            signal.signal(s, self._interrupt)

    def deferring(self) -> None:
        for s in self.SIGNALS:
            signal.signal(s, self._note)

    def restore(self) -> None:
        for s, handler in self.saved.items():
            signal.signal(s, handler)

    def _interrupt(self, signum, _frame) -> None:
        self.deferring()
        self.noted.append(signum)
        raise KeyboardInterrupt

    def _note(self, signum, _frame) -> None:
        self.noted.append(signum)


def walkthrough(args: argparse.Namespace) -> int:
    """Run the walkthrough with checked ``args`` (``main`` checks them); returns the exit code."""
    from engine_plugin.reference.config import model_preset

    mcfg = model_preset(args.model)
    out_dir = Path(args.out).resolve()
    try:
        run_dir = make_run_dir(out_dir)
    except OSError as exc:
        return fail(PROG, f"cannot create a run directory in --out {args.out}: {exc}")
    conv = build(args.context_tokens, mcfg.vocab_size)
    _say(f"kvstack walkthrough: a coding agent's third turn, ~{args.context_tokens:,} tokens of context\n"
         f"work directory: {run_dir}")
    _say("starting the kvstore daemon, 1 vision encoder, 1 prefill and 2 decode workers, the entrypoint ...")
    cluster = Cluster(run_dir, ve=1, prefill=1, decode=2, model=args.model, block_size=args.block_size,
                      store="daemon", entrypoint_args=("--tenant", f"{COLD_TENANT}=walkthrough-cold-salt",
                                                       # what one engine's pool holds: a longer request is
                                                       # refused before its prefill
                                                       "--max-model-len", str(args.num_blocks * args.block_size)),
                      worker_args=("--num-blocks", str(args.num_blocks)))

    signals = _Signals()
    outcome: dict = {}

    def play() -> int:
        t0 = time.perf_counter()
        cluster.start()
        _say(f"stack up in {time.perf_counter() - t0:.1f} s: store {cluster.store_url}, "
             f"entrypoint {cluster.entrypoint_address}")
        client = cluster.client()
        n = args.max_new_tokens
        # Turn 1 and turn 2 fill the caches and the store.
        t1 = _run(client, "turn 1", conv.turn1, [], n)
        p2 = conv.turn2_prompt(t1.tokens)  # as request_sizes counts them, which main checked
        seg = pb.ImageSegment(image_hash=conv.screenshot.hash, image_data=conv.screenshot.data,
                              start=conv.screenshot_start(t1.tokens), length=conv.screenshot.length)
        t2 = _run(client, "turn 2", p2, [seg], n)
        p3 = conv.turn3_prompt(p2, t2.tokens)
        # Turn 3, cold, then the three variants.
        cold = _run(client, "turn 3, cold (no cache for this tenant)", p3, [seg], n, tenant=COLD_TENANT)
        cold.note = "A tenant with its own salt: none of its blocks are cached, every token is prefilled."
        hit = _run(client, "turn 3, cache hit", p3, [seg], n)
        hit.note = "The same request for the tenant who sent turns 1 and 2: the prefix comes from the tiers."
        # SWA miss: a fresh prefill engine (empty device and host tiers), snapshots deleted from the store.
        cluster.kill("prefill-0", signal.SIGKILL)
        cluster.start_worker("prefill", "prefill-0")
        cluster.wait_for_workers(4)
        spliced = _spliced(conv, p3, seg, mcfg.vocab_size, mcfg.seed)
        keys = BlockHasher(mcfg.namespace(), args.block_size, b"").hash_blocks(
            spliced, [ImageSpan(seg.image_hash, seg.start, seg.length)])
        cmd = [sys.executable, "-m", "kvstore.cli.kvtool", "delete", "--kind", "swa", cluster.store_url,
               *[a for k in keys for a in ("--key", k.hex())]]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        deleted = res.stdout.count("deleted swa entry")
        _say(f"\n$ kvtool delete --kind swa {cluster.store_url} --key ... ({len(keys)} keys): "
             f"{deleted} SWA snapshots deleted")
        miss = _run(client, "turn 3, SWA miss", p3, [seg], n)
        miss.note = (f"A fresh prefill engine and {deleted} SWA snapshots deleted with kvtool: the blocks come "
                     "from the store and the plugin replays the bounded span to rebuild the windows.")
        # Failover: kill the decode worker serving the stream, mid-stream.
        killer = FailoverKiller(lambda worker: cluster.kill(worker, signal.SIGKILL))
        fail = _run(client, "turn 3, engine failover", p3, [seg], n, on_event=killer)
        fail.note = (f"The decode worker {killer.killed[0] if killer.killed else '?'} was killed with SIGKILL "
                     f"mid-stream; {fail.figures()['restreamed']} tokens were streamed after the failover.")
        variants = [hit, miss, fail]
        for v in variants:
            v.cold_tokens = cold.tokens
        cold.cold_tokens = cold.tokens
        _say("\n== summary (turn 3)")
        ok = True
        for v in [cold, *variants]:
            f = v.figures()
            same = v is cold or v.matches_cold
            ok &= same
            _say(f"  {v.name:<36} TTFT {f['ttft_ms']:8.1f} ms ({f['ttft_ms'] / (cold.figures()['ttft_ms'] or 1):.2f}x cold)"
                 f"  prefilled {f['prefilled']:>7,}  loaded {f['loaded']:>7,}  replayed {f['replayed']:>5,}"
                 f"  tokens {'== cold' if same else '!= COLD'}"
                 + (f"  re-streamed {f['restreamed']}" if v is fail else ""))
        report = run_dir / "report.html"
        report.write_text(render_html(
            "kvstack walkthrough: a coding agent's third turn",
            f"Turn 3 has {len(p3):,} prompt tokens (model {args.model}, block size {args.block_size}); "
            "each variant is compared with the cold run of the same request.", cold, variants))
        (run_dir / "results.json").write_text(json.dumps(
            {v.name: {"tokens": v.tokens, "figures": v.figures(), "hops": v.hops, "summary": v.summary,
                      "matches_cold": v is cold or v.matches_cold} for v in [cold, *variants]}, indent=1))
        _say(f"\nreport: {report}")
        return 0 if ok else 1

    def play_here() -> None:
        try:
            outcome["code"] = play()
        except BaseException as exc:  # handed to the main thread below
            outcome["error"] = exc

    # The stack is driven from a worker thread; the main thread only waits for it. Ctrl-C and
    # SIGTERM raise KeyboardInterrupt in the main thread, and never inside gRPC's own calls
    # and locks (an interrupted stream left its channel unclosable, so the process hung at exit).
    # Once interrupted, and while stopping, SIGINT/SIGTERM are only noted (_Signals): a second
    # Ctrl-C must not cut the stop short (it ended the process with a traceback, children left).
    worker = threading.Thread(target=play_here, name="walkthrough", daemon=True)
    code = 2
    try:
        try:
            signals.interrupting()
            worker.start()
            while worker.is_alive():
                worker.join(0.2)
            if "error" in outcome:
                raise outcome["error"]
            code = outcome["code"]
        except KeyboardInterrupt:
            signals.deferring()
            _say("\ninterrupted: stopping everything")
            code = 130
        except KVStoreError as exc:
            _say(f"walkthrough failed: {exc}")
        except grpc.RpcError as exc:
            _say(f"walkthrough failed: the entrypoint answered {exc.code().name}: {exc.details()} "
                 f"(logs in {run_dir})")
    finally:
        signals.deferring()
        try:
            cluster.stop()  # its processes gone, a worker still inside a call gets an error and ends
            atexit.unregister(cluster.stop)  # stopped: nothing left for interpreter exit to do
            if worker.is_alive():
                worker.join(timeout=10)
        finally:
            signals.restore()
    if signals.noted and code != 130:  # a signal while a finished (or failed) run was stopping
        _say("\ninterrupted: stopping everything")
        code = 130
    return code


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="kvstack", description="kvstack: the KV cache service, end to end")
    sub = ap.add_subparsers(dest="command", required=True)
    w = sub.add_parser("walkthrough", help="run the coding-agent walkthrough through the whole stack")
    w.add_argument("--context-tokens", type=int, default=3000, help="turn 3 context size (full size: 100000)")
    w.add_argument("--max-new-tokens", type=int, default=24, help=f"tokens per reply (>= {MIN_NEW_TOKENS})")
    w.add_argument("--model", default="tiny", help="reference model preset")
    w.add_argument("--block-size", type=int, default=16)
    w.add_argument("--num-blocks", type=int, default=0, help="device pool blocks per engine (0: fit the context)")
    w.add_argument("--out", default="./kvstack-walkthrough", help="directory for the run's data, logs and report")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2), its one line already printed
        return int(exc.code or 0)
    # Every check before anything is started (no daemon, no directory for a bad flag).
    if args.context_tokens < 100:
        return fail(PROG, f"--context-tokens must be >= 100, got {args.context_tokens}")
    if args.max_new_tokens < MIN_NEW_TOKENS:
        return fail(PROG, f"--max-new-tokens must be >= {MIN_NEW_TOKENS} (the failover variant kills the decode "
                          f"worker after {KILL_AFTER_TOKENS} token and re-streams the rest), got {args.max_new_tokens}")
    if args.block_size < 1:
        return fail(PROG, f"--block-size must be >= 1, got {args.block_size}")
    if args.num_blocks < 0:
        return fail(PROG, f"--num-blocks must be >= 0 (0: fit the context), got {args.num_blocks}")
    from engine_plugin.reference.config import model_preset

    try:
        model_preset(args.model)
    except KVStoreError as exc:
        return fail(PROG, f"--model: {exc}")
    sizes = request_sizes(args)
    if args.block_size > sizes.turn2:  # only whole blocks are cached and shared
        return fail(PROG, f"--block-size {args.block_size} is larger than turn 2's prompt ({sizes.turn2} tokens), "
                          f"the prefix turn 3 shares: no block would be cached and the cache hit would show "
                          f"nothing; use --block-size <= {sizes.turn2}")
    least = min_num_blocks(sizes, args.block_size)
    if not args.num_blocks:
        args.num_blocks = max(least, 2 * (args.context_tokens + 4 * args.max_new_tokens) // args.block_size + 64)
    if args.num_blocks < least:
        return fail(PROG, f"--num-blocks {args.num_blocks} x --block-size {args.block_size} = "
                          f"{args.num_blocks * args.block_size} tokens can not hold turn 3 ({sizes.turn3} prompt + "
                          f"{sizes.max_new_tokens} new tokens = {sizes.longest}; the decode policy admits at most "
                          f"{DECODE_ADMITS_PCT}% of the pool): use --num-blocks >= {least} (0: fit the context)")
    return walkthrough(args)


if __name__ == "__main__":
    sys.exit(main())
