"""Settings for every test: what child processes import, and which folders a run collects.

Many tests run a tool or a daemon the way a user does, as a subprocess (``python
tools/NAME.py``, ``python -m kvstore.server.cli``, ``python -c SCRIPT``). Such a child finds
the project's packages (``tools`` included) through the installed project; here the
repository root goes first on the ``PYTHONPATH`` the children inherit, so that they import
the same code as the test process, whatever is installed (an editable install of another
checkout, or none). The test process itself gets the root on ``sys.path`` from pytest
(``tests`` is a package under it).

Markers (declared in ``pyproject.toml``; ``tools/run_tests.sh`` runs the stages): ``slow``
(soaks, benchmark-sized runs, a subprocess per case), ``vllm`` (a real vLLM engine, every test
under ``tests/engine_plugin/vllm``) and ``e2e`` (the whole serving stack in processes, the walkthrough among them) stay out of the default run
and run as the test command's second stage; ``gpu`` runs from ``tools/gpu_check.sh``. A run whose
``-m`` expression leaves ``vllm`` out does not even import that folder: importing vLLM takes
seconds, and it need not be installed for the default run.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_TESTS = ROOT / "tests" / "engine_plugin" / "vllm"

_path = os.environ.get("PYTHONPATH", "")
if _path.split(os.pathsep)[0] != str(ROOT):
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), _path]) if _path else str(ROOT)


def _selects(marker: str, markexpr: str) -> bool:
    """Whether ``-m markexpr`` keeps a test that carries ``marker`` and no other marker."""
    if not markexpr:
        return True
    try:
        from _pytest.mark.expression import Expression
    except ImportError:  # pytest moved it: collect as usual (deselection still applies)
        return True
    return Expression.compile(markexpr).evaluate(lambda name, **_: name == marker)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path == VLLM_TESTS and not _selects("vllm", config.getoption("markexpr")):
        return True
    return None
