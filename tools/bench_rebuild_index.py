"""How long ``kvtool rebuild-index`` takes to rebuild a lost index, against a ``verify`` of the
same store in the same run (both read every fragment; rebuild also decodes and indexes).

Exact command (the figure in ``docs/benchmarks.md``; most of its time is the fill)::

    .venv/bin/python tools/bench_rebuild_index.py --entries 100000 --out results/bench_rebuild_index.json
    .venv/bin/python tools/bench_rebuild_index.py --entries 5000     # a short run, same shape

What it does: fills a fresh data directory (default layout, 6 local targets, EC 4+2, fsync
off) with ``--entries`` block entries of ``--value-bytes`` random bytes through ``put_many``
batches of ``--batch`` (each batch one pack file per target), closes it, deletes its index,
then times ``kvstore.maintenance.reindex.rebuild_index`` (what ``kvtool rebuild-index DATA_DIR`` runs
for such a directory), then opens the store and times ``check()`` (``kvtool verify``) as
the peer, and reads back a sample of entries to confirm the rebuild. Page cache warm for
both (the fill just wrote the files): the figures are the CPU cost of scanning, verifying
and decoding, not a cold disk's. Prints entries/s and the ratio rebuild / verify, and
writes them as JSON with ``--out``.

Exit status (``tools/cli_args.py``): 0 with the figures printed; 2 for a bad argument;
1 when the rebuilt store does not give back what was put.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tools.cli_args import check_output_file, integer, run_main

PROG = "bench_rebuild_index.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--entries", type=integer(1, 10_000_000), default=100_000, help="entries to store (100000)")
    p.add_argument("--value-bytes", type=integer(1, 1 << 24), default=1024, help="bytes per entry (1024)")
    p.add_argument("--batch", type=integer(1, 100_000), default=1000, help="entries per put_many (1000)")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed at the end)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)
    if args.out and (why := check_output_file(args.out)):
        p.error(why)
    return args


def _progress(phase: str, done: int, total: int) -> None:
    if done == total or done % 20000 == 0:
        print(f"{PROG}: {phase} {done}/{total}", file=sys.stderr, flush=True)


def main() -> int:
    args = parse_args()
    import kvstore
    from kvstore.config import load_config
    from kvstore.maintenance.reindex import rebuild_index

    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-rebuild-"))
    data = work / "data"
    try:
        shutil.rmtree(data, ignore_errors=True)
        sample: dict[bytes, bytes] = {}
        t0 = time.perf_counter()
        with kvstore.connect(str(data), fsync=False) as s:
            for start in range(0, args.entries, args.batch):
                n = min(args.batch, args.entries - start)
                items = [kvstore.PutItem(i.to_bytes(16, "big"), os.urandom(args.value_bytes))
                         for i in range(start, start + n)]
                s.put_many(items)
                sample[items[0].key] = items[0].value
                _progress("fill", start + n, args.entries)
        fill_s = time.perf_counter() - t0
        shutil.rmtree(data / "index")
        t0 = time.perf_counter()
        out = rebuild_index(load_config(None, env={}, data_dir=str(data)), _progress)
        rebuild_s = time.perf_counter() - t0
        with kvstore.connect(str(data)) as s:
            t0 = time.perf_counter()
            problems = s.check()
            verify_s = time.perf_counter() - t0
            wrong = sum(s.get(k) != v for k, v in sample.items())
        fig = {"entries": args.entries, "value_bytes": args.value_bytes, "batch": args.batch,
               "indexed": out["entries"], "fill_s": round(fill_s, 2), "rebuild_s": round(rebuild_s, 2),
               "rebuild_entries_per_s": round(out["entries"] / rebuild_s), "verify_s": round(verify_s, 2),
               "verify_entries_per_s": round(args.entries / verify_s),
               "rebuild_over_verify": round(rebuild_s / verify_s, 2), "problems_after": len(problems),
               "sample_wrong": wrong, "date": time.strftime("%Y-%m-%d", time.gmtime())}
        print(f"{'':24}{'seconds':>10}{'entries/s':>12}")
        print(f"{'rebuild-index':24}{rebuild_s:>10.2f}{fig['rebuild_entries_per_s']:>12}")
        print(f"{'verify (peer)':24}{verify_s:>10.2f}{fig['verify_entries_per_s']:>12}")
        print(f"rebuild / verify: {fig['rebuild_over_verify']}x; indexed {out['entries']} of {args.entries}; "
              f"problems after: {len(problems)}; sample wrong: {wrong}")
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(fig, indent=2) + "\n")
        return 0 if out["entries"] == args.entries and not problems and not wrong else 1
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    run_main(main, PROG)
