"""Run one real vLLM engine over a list of prompts in a fresh process; write what it produced.

Who calls it: ``tests/engine_plugin/vllm`` and ``tools/bench_vllm.py``, each run in its own process
(``python -m tools.vllm_run SPEC.json OUT.json``), so that a second engine's hit comes
from the store, never from the first engine's own prefix cache.

SPEC (JSON): ``model`` (folder), ``block_size``, ``max_model_len``, ``prompts`` (a list of
``{"ids": [...], "cache_salt": str | null}``), ``max_tokens``, optional ``kv_transfer_config``
(vLLM's, as given on its command line), ``enable_prefix_caching`` (default true),
``rounds`` (default 1: the prompts again, with ``reset_prefix_cache`` between rounds so
that each round's hits come from the connector), ``one_by_one`` (time each prompt alone),
``reset_between_rounds`` (default true; false: a round's hits may come from vLLM's own
prefix cache), ``pause_dir`` (after each round but the last, write ``done.<round>`` there with that round's
outputs and wait for ``go.<round>``: a test changes the store between rounds), ``logprobs``.

OUT (JSON): per round, per prompt: ``tokens``, ``logprobs`` (the chosen token's, per
step), ``num_cached_tokens`` (vLLM's count of prompt tokens not computed: local and
external hits) and ``seconds`` (wall time of its ``generate`` call when ``one_by_one``).
"""

from __future__ import annotations

import json
import os
import sys
import time

ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
       "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
       "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false"}
"""The environment a CPU vLLM run needs here (``../shared/docs/VLLM.md``); callers merge it in."""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def engine_env(inproc: bool) -> dict[str, str]:
    """This process's environment with ``ENV`` (where unset) and the project on the path, for
    a ``python -m tools.vllm_run`` child. ``inproc``: vLLM's engine core in that process (faster
    to start; the scheduler and worker connectors are still two objects with two roles). Else
    vLLM's default layout: an engine core process, which keeps stepping while a finished
    request's end-of-output snapshot is copied out (an in-process core steps only while
    outputs are pending)."""
    env = dict(os.environ)
    for k, v in ENV.items():
        env.setdefault(k, v)
    if inproc:
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    else:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def connector_config(store_url: str, role: str = "kv_both", **extra) -> dict:
    """vLLM's ``kv_transfer_config`` for ``KvstackConnector`` (``extra``: its options)."""
    return {"kv_connector": "KvstackConnector", "kv_connector_module_path": "engine_plugin.vllm",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store_url": store_url, **extra}}


def read_stats(prefix: str | os.PathLike, role: str) -> dict[str, float]:
    """The counters the connectors of ``role`` (scheduler / worker) wrote to ``stats_file``
    ``prefix``, summed over processes."""
    import glob

    out: dict[str, float] = {}
    for f in glob.glob(f"{os.fspath(prefix)}.{role}.*.json"):
        with open(f, encoding="utf-8") as fh:
            for k, v in json.load(fh).items():
                out[k] = out.get(k, 0) + v
    return out


def _outputs(results) -> list[dict]:
    out = []
    for r in results:
        c = r.outputs[0]
        lps = [lp[tid].logprob if lp and tid in lp else None for tid, lp in zip(c.token_ids, c.logprobs or [])]
        out.append({"tokens": list(c.token_ids), "logprobs": lps, "num_cached_tokens": r.num_cached_tokens})
    return out


PAUSE_LIMIT_S = 600.0
RESET_LIMIT_S = 60.0


def _reset_prefix_cache(llm) -> None:
    """vLLM's prefix cache emptied, so that the next round's hits come from the connector. It
    refuses while blocks are held (a finished request whose end-of-output snapshot is still
    being copied out, until the engine core's next steps): retried, then an error, never a
    round that could hit the old cache."""
    deadline = time.monotonic() + RESET_LIMIT_S
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM refused to reset its prefix cache for {RESET_LIMIT_S:.0f} s")
        time.sleep(0.1)


def _pause(folder: str, rnd: int, outs: list[dict]) -> None:
    done = os.path.join(folder, f"done.{rnd}")
    with open(done + ".tmp", "w", encoding="utf-8") as f:
        json.dump(outs, f)
    os.replace(done + ".tmp", done)
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while not os.path.exists(os.path.join(folder, f"go.{rnd}")):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no go.{rnd} in {folder} within {PAUSE_LIMIT_S:.0f} s")
        time.sleep(0.05)


def run(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    kw = {}
    if spec.get("kv_transfer_config"):
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer_config"])
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], enforce_eager=True, block_size=spec["block_size"], dtype="bfloat16",
              max_model_len=spec["max_model_len"], max_num_batched_tokens=spec["max_model_len"],
              enable_prefix_caching=spec.get("enable_prefix_caching", True), seed=0, **kw)
    start_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, logprobs=spec.get("logprobs", 1),
                        ignore_eos=True)
    prompts = [{"prompt_token_ids": p["ids"], **({"cache_salt": p["cache_salt"]} if p.get("cache_salt") else {})}
               for p in spec["prompts"]]
    rounds = []
    for rnd in range(spec.get("rounds", 1)):
        if rnd and spec.get("reset_between_rounds", True):
            _reset_prefix_cache(llm)
        if spec.get("one_by_one"):
            outs = []
            for p in prompts:
                t = time.perf_counter()
                res = llm.generate([p], sp, use_tqdm=False)
                outs += [dict(o, seconds=time.perf_counter() - t) for o in _outputs(res)]
        else:
            outs = _outputs(llm.generate(prompts, sp, use_tqdm=False))
        rounds.append(outs)
        pause = spec.get("pause_dir")
        if pause and rnd < spec.get("rounds", 1) - 1:
            _pause(pause, rnd, outs)
    return {"rounds": rounds, "start_s": start_s}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        sys.stderr.write("usage: python -m tools.vllm_run SPEC.json OUT.json\n")
        return 2
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    with open(argv[0], encoding="utf-8") as f:
        spec = json.load(f)
    out = run(spec)
    with open(argv[1], "w", encoding="utf-8") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
