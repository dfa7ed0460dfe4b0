"""A guided tour of the kvstore in a few seconds: prompt -> block keys -> put -> lookup -> get.

Run from the repository root::

    python -m tools.demo                       # on a fresh temporary data directory
    python tools/demo.py --data-dir ./demo-data  # keep the store for `kvtool inspect ./demo-data`

What it does, in order (each step prints one short section):
  1. Builds a synthetic coding-agent prompt (system prompt, tool schemas, a few
     source files, a user request) and "tokenizes" it deterministically.
  2. Hashes its full 256-token blocks with ``kvstore.keys.BlockHasher``.
  3. Stores one block entry per block: a float16 array ``[layers=4, tokens=256,
     dim=112]`` (~896 B per token, close to V4.1 Flash's 890 B of global KV per
     token) with its ``Layout``, plus one SWA snapshot at the last block
     boundary (``[40 layers, 128 tokens, 528 B]``, ~2.6 MiB, FP8 bytes).
  4. Builds the follow-up turn (turn 1 + model reply + new user message) and
     asks ``lookup`` for the longest cached prefix: hit blocks and ``swa_at``.
  5. Loads the hit blocks and the snapshot with ``get_many``/``get_entry`` and
     checks every array is bit-identical to what was stored.
  6. Shows that another tenant (another salt) shares nothing, then prints
     ``stats()`` and a summary.

Exit code 0 when every check passed, 1 otherwise (a store error on the way is one
line, ``tools/demo.py: error: ...``); 2 for a bad argument, such as a ``--data-dir``
that is an existing file or a store the demo can not use, refused in one line.
Nothing is written outside the data directory; a temporary one is removed at the end.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import zlib
from pathlib import Path
from typing import Sequence

import numpy as np

import kvstore
from kvstore.api import Layout, PutItem
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.keys import BlockHasher, Namespace

BLOCK = 256  # tokens per block (the engines' prefix-cache page size)
LAYERS, DIM = 4, 112  # block payload [LAYERS, BLOCK, DIM] float16: 896 B per token
SWA_SHAPE = (40, 128, 528)  # layers x window x bytes per token (FP8 sliding window)
VOCAB = 129_280

SYSTEM = ("You are a coding agent. Work in small verified steps. Use the tools to read files, run tests "
          "and edit code. Never invent file contents. Explain what you changed and why. ")
TOOLS = ('{"name": "read_file", "parameters": {"path": "string"}} '
         '{"name": "run_tests", "parameters": {"target": "string", "timeout_s": "integer"}} '
         '{"name": "apply_patch", "parameters": {"diff": "string"}} ')


def synthetic_file(name: str, n_funcs: int) -> str:
    body = [f"# file {name}"]
    for i in range(n_funcs):
        body.append(f"def {name}_step_{i}(state, batch_{i}): result = state.update(batch_{i} * {i}) "
                    f"if result is None: raise ValueError('step {i} of {name} failed') return result")
    return " ".join(body)


def tokenize(text: str) -> list[int]:
    """A stand-in tokenizer: one stable id per whitespace word (crc32, never Python's hash)."""
    return [zlib.crc32(w.encode()) % VOCAB for w in text.split()]


def prompt_turn1() -> str:
    files = " ".join(synthetic_file(n, 40) for n in ("scheduler", "kv_manager", "router"))
    return SYSTEM * 4 + TOOLS * 6 + files + " USER: the router drops requests under load; find out why."


def prompt_turn2(turn1: str) -> str:
    reply = ("ASSISTANT: I read router.py. The queue length check uses the wrong bound. "
             "I will patch it and run the tests. ") * 25
    return turn1 + " " + reply + " USER: good, now also add a regression test for it."


def block_array(key: bytes) -> np.ndarray:
    """A deterministic KV-like block: random-normal fp16 seeded by the key."""
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.standard_normal((LAYERS, BLOCK, DIM), dtype=np.float32).astype(np.float16)


def swa_array(key: bytes) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(key[8:], "little"))
    return rng.integers(0, 256, size=SWA_SHAPE, dtype=np.uint8)


def mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def run(data_dir: str) -> bool:
    ok = True
    ns = Namespace(model_id="deepseek-v4.1-flash", kv_layout="global-demo", dtype="float16", rank=0)
    hasher = BlockHasher(ns, block_size=BLOCK, tenant_salt=b"tenant-a")
    t0 = time.perf_counter()

    t1_tokens = tokenize(prompt_turn1())
    keys = hasher.hash_blocks(t1_tokens)
    print(f"[1] turn 1: {len(t1_tokens)} tokens -> {len(keys)} full blocks of {BLOCK} "
          f"(tail of {len(t1_tokens) % BLOCK} tokens not hashed); namespace {ns.label()}")
    print(f"    first keys: {keys[0].hex()} {keys[1].hex()} ...")

    with kvstore.connect(data_dir) as store:
        t = time.perf_counter()
        items = [PutItem(k, block_array(k), kind="block", layout=Layout("float16", (LAYERS, BLOCK, DIM)),
                         tokens=BLOCK) for k in keys]
        new = store.put_many(items)
        snap_key = keys[-1]
        store.put(snap_key, swa_array(snap_key), kind="swa", layout=Layout("float8_e4m3fn", SWA_SHAPE),
                  tokens=len(keys) * BLOCK)
        dt = time.perf_counter() - t
        stored = sum(a.value.nbytes for a in items) + int(np.prod(SWA_SHAPE))
        print(f"[2] put {sum(new)} block entries ({mib(items[0].value.nbytes)} each) + 1 SWA snapshot "
              f"({mib(np.prod(SWA_SHAPE))}) after block {len(keys)} (swa_at counts blocks): {mib(stored)} in {dt * 1e3:.0f} ms")
        again = store.put_many(items[:2])
        print(f"    re-put of 2 live blocks stores nothing: {again}")

        t2_tokens = tokenize(prompt_turn2(prompt_turn1()))
        chain = hasher.hash_blocks(t2_tokens)
        t = time.perf_counter()
        res = store.lookup(chain)
        dt = time.perf_counter() - t
        print(f"[3] turn 2: {len(t2_tokens)} tokens -> chain of {len(chain)} blocks; lookup in {dt * 1e6:.0f} us:")
        print(f"    hit_blocks={res.hit_blocks} swa_at={res.swa_at} (snapshot at the hit boundary: "
              f"{res.swa_at_boundary}); reuse {res.hit_blocks * BLOCK} tokens, prefill "
              f"{len(t2_tokens) - res.hit_blocks * BLOCK}")
        if res.hit_blocks != len(keys) or res.swa_at != len(keys):
            print(f"    FAIL: expected hit_blocks={len(keys)} swa_at={len(keys)}")
            ok = False

        t = time.perf_counter()
        got = store.get_many(chain[: res.hit_blocks])
        snap = store.get_entry(chain[res.swa_at - 1], kind="swa") if res.swa_at else None
        dt = time.perf_counter() - t
        bad = [i for i, (k, b) in enumerate(zip(chain, got))
               if b is None or not np.array_equal(np.frombuffer(b, np.float16).reshape(LAYERS, BLOCK, DIM),
                                                  block_array(k))]
        snap_ok = snap is not None and snap.layout.shape == SWA_SHAPE and np.array_equal(
            snap.array(), swa_array(snap_key))
        print(f"[4] loaded {len(got)} blocks + snapshot in {dt * 1e3:.0f} ms: blocks "
              f"{'all bit-identical' if not bad else f'MISMATCH at {bad}'}, snapshot "
              f"{'bit-identical' if snap_ok else 'MISMATCH'} (layout {snap.layout.dtype if snap else '-'}"
              f"{list(snap.layout.shape) if snap else ''}, tokens {snap.tokens if snap else '-'})")
        ok = ok and not bad and snap_ok

        other = BlockHasher(ns, block_size=BLOCK, tenant_salt=b"tenant-b").hash_blocks(t2_tokens)
        miss = store.lookup(other)
        print(f"[5] same prompt, tenant-b: hit_blocks={miss.hit_blocks} (tenants never share keys)")
        ok = ok and miss.hit_blocks == 0

        s = store.stats()
        kinds = ", ".join(f"{k}: {v['entries']} entries, {mib(v['plain_bytes'])} plain, "
                          f"{mib(v['stored_bytes'])} stored" for k, v in s["by_kind"].items())
        print(f"[6] stats: {kinds}; erasure code {s['erasure_code']} over {len(s['targets'])} targets; "
              f"used {mib(s['used_bytes'])}")
        print(f"    {s['failure_domain_note']}")
        problems = store.check()
        print(f"    check(): {len(problems)} problems")
        ok = ok and not problems
    print(f"{'OK' if ok else 'FAILED'}: demo finished in {time.perf_counter() - t0:.1f} s")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/demo.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", help="use (or create) this data directory and keep it; "
                                       "default: a fresh temporary one, removed at the end")
    args = ap.parse_args(argv)
    if args.data_dir and Path(args.data_dir).exists() and not Path(args.data_dir).is_dir():
        ap.error(f"--data-dir {args.data_dir} exists and is not a directory")
    try:
        if args.data_dir:
            ok = run(args.data_dir)
            print(f"store kept at {args.data_dir}; try: kvtool inspect {args.data_dir}")
            return 0 if ok else 1
        with tempfile.TemporaryDirectory(prefix="kvstack-demo-") as tmp:
            return 0 if run(str(Path(tmp) / "data")) else 1
    except InvalidRequest as exc:  # the data directory (or the environment) is not one the demo can use
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    except KVStoreError as exc:
        ap.exit(1, f"{ap.prog}: error: {type(exc).__name__}: {exc}\n")


if __name__ == "__main__":
    from tools.cli_args import run_main

    run_main(main, "tools/demo.py")
