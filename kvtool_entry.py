"""Console-script entry of ``kvtool`` (``[project.scripts]`` in pyproject.toml).

Contract: importing this module loads nothing but the standard library. The console script
runs ``from kvtool_entry import main`` and then ``main()``, so the import of ``kvstore``
(lmdb, numpy, pyeclib: most of a short run's time) happens inside ``main``'s ``try``: a
Ctrl-C (SIGINT) there is one line, ``kvtool: interrupted``, on stderr and exit status 130, as
during the run itself (``kvstore.cli.kvtool.main``), never a traceback. The entry cannot live
in ``kvstore.cli.kvtool``: importing it imports the ``kvstore`` package first, before any
function of it runs.
"""

from __future__ import annotations

import sys
from typing import Sequence

EXIT_INTERRUPTED = 130  # as ``kvstore.cli.kvtool.EXIT_INTERRUPTED`` (128 + SIGINT), kept here to import nothing


def main(argv: Sequence[str] | None = None) -> int:
    """Import kvtool and run it (``kvstore.cli.kvtool.main``); returns the exit code."""
    try:
        from kvstore.cli.kvtool import main as run
    except KeyboardInterrupt:
        print("kvtool: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
