"""Benchmarks, load generators and maintenance scripts around the project's packages.

Each module is a command line, run from the repository root either as a script
(``python tools/bench_store.py ...``) or as a module (``python -m tools.bench_store ...``);
both need the project installed (``pip install -e .``, which exposes this package too) or
the repository root on ``PYTHONPATH``. The tools import each other as ``tools.NAME`` and the
project's packages directly; nothing in the packages imports the tools. Their shared
command-line contract is stated in ``tools/cli_args.py``.
"""
