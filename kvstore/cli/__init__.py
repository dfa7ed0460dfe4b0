"""Command-line tools of kvstack.

``kvstore.cli.kvtool`` is the operator's tool (console script ``kvtool``):
inspect, gc, verify, repair, stats and delete over a data directory or a
daemon URL. The package holds no library code that the store itself calls;
``kvtool`` and ``commands`` may print (the library never does).

Modules: ``kvtool`` (argument parsing, opening the store, exit codes),
``commands`` (the subcommand registry), ``index_view`` (read-only views of an
embedded store's index for ``inspect``; the daemon's ``Inspect`` RPC runs it
too, so it never prints), ``progress`` (the stderr progress bar).
"""
