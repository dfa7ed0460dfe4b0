"""Command-line tools of kvstack.

``kvstore.cli.kvtool`` is the operator's tool (console script ``kvtool``):
inspect, gc, verify, repair, stats and delete over a data directory or a
daemon URL. The package holds no library code that the store itself calls;
``kvtool`` and ``commands`` may print (the library never does).

Modules: ``kvtool`` (argument parsing, opening the store, exit codes),
``commands`` (the subcommand registry), ``conventions`` (what kvtool and
``kvstore serve`` do alike: exit codes, argument value types, log levels,
one-line errors), ``progress`` (the stderr progress bar). The read-only index
views ``inspect`` prints are ``kvstore.index_view``, which the daemon's
``Inspect`` RPC runs too.
"""
