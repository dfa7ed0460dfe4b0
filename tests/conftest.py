"""Settings for every test: the child processes the tests start import this checkout.

Many tests run a tool or a daemon the way a user does, as a subprocess (``python
tools/NAME.py``, ``python -m kvstore.server.cli``, ``python -c SCRIPT``). Such a child finds
the project's packages (``tools`` included) through the installed project; here the
repository root goes first on the ``PYTHONPATH`` the children inherit, so that they import
the same code as the test process, whatever is installed (an editable install of another
checkout, or none). The test process itself gets the root on ``sys.path`` from pytest
(``tests`` is a package under it).

Markers (declared in ``pyproject.toml``; ``tools/run_tests.sh`` runs the stages):
``slow`` (soaks and benchmark-sized runs) and ``gpu`` stay out of every default run;
``vllm`` (a real vLLM engine) runs as a stage of its own.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])

_path = os.environ.get("PYTHONPATH", "")
if _path.split(os.pathsep)[0] != ROOT:
    os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, _path]) if _path else ROOT
