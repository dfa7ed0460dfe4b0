"""The ``kvtool`` subcommands: one registry, one ``Command`` record each.

``kvstore.cli.kvtool`` builds its argument parser from ``COMMANDS`` and calls
``Command.run(store, args, progress)`` with an open store. Every run returns
an ``Outcome``: the exit code, a JSON-able ``data`` dict (printed with
``--json``) and the human ``text``. Runs use only the public store API
(``stats``, ``gc``, ``check``, ``repair``, ``delete``), except
``inspect`` (below).

``inspect`` shows the same records, in the same JSON, for a data directory and for a
daemon: on a data directory it reads the index through ``kvstore.index_view``; on a
daemon it calls the read-only ``Inspect`` RPC, which runs that same code there
(``inspect_summary`` / ``inspect_entries`` / ``inspect_chain`` of ``RemoteStore`` and
``ShardedStore``). Neither reads a fragment, refreshes an access time or moves a counter.
``inspect --parquet FILE`` exports the whole index, in the same columns from either: on a
data directory from ``index_view.iter_batches``, on a daemon from its admin-only
``ExportIndex`` (which runs that code there: ``export_index_batches``); kvtool writes FILE
(``index_view.publish_parquet``: atomic, a regular file only). A sharded set's file holds
every shard's rows, targets named ``URL/target``; a shard that does not answer is named as
below (JSON ``unanswered``), the others' rows written. With ``--key`` or ``--chain`` it is a
usage error.

``delete`` names keys as ``inspect`` does (index keys; through a daemon, an admin's are index
keys and any other tenant's its own: ``RemoteStore.delete_index_keys``), so it deletes what
``inspect`` and ``verify`` show. ``delete --json`` is one shape for any number of keys:
``{"kind": KIND, "deleted": {KEY_HEX: true|false|null, ...}}`` (a key given twice is deleted
once; ``null``: unknown, a shard did not answer, below).

Against several daemons (``grpc://A,grpc://B``) a shard that does not answer leaves the
others' results standing (``kvstore.client.sharded``): the command prints them, names each such
shard in one line on stderr (``Outcome.errors``) and exits 1. What only that shard could
say is never guessed: a record carries ``unanswered`` (``{shard URL: its error}``), and
``inspect --key``/``--chain`` shows a key no answering shard holds as ``unknown``, not
``absent`` (a chain's ``hit_blocks``/``swa_at`` then ``null``, with ``hit_blocks_at_least``/
``swa_at_at_least``: what the answers prove); ``delete`` asks every shard (an index key names
no owner the client can compute), deletes where a shard held the key, and a key no answering
shard held is ``null`` in ``deleted``. Only when no shard answers at all is it the store's
error (exit 2).

``migrate`` works on a data directory without opening a store (``Command.on_data_dir``): every
open refuses a directory of an older format version, which is what it takes to this one
(``kvstore.maintenance.migrate``). Through a daemon it is a usage error.

``gc`` that cannot get under the capacity (everything left pinned) still prints the pass's
counts (its other steps ran) and exits 1, the reason in one stderr line; through a daemon
too (the counts cross the wire with the error: ``wire.MD_GC_RESULT``), and on a sharded set
each full shard's counts are summed with the others'.

Exit codes (``ExitCode``): 0 healthy / done; 1 problems found (verify saw a
missing, corrupt or lost fragment, a down target or an orphan; repair left
something unfixed; ``inspect --key`` or ``delete`` found no such entry; a shard
did not answer); 2 usage error (raised by the caller: bad flags, not a store, a
store error).
"""

from __future__ import annotations

import argparse
import inspect as pyinspect
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable

from kvstore import index_view
from kvstore.api import EntryKind, KVStore
from kvstore.cli.conventions import ExitCode, non_negative_int, one_line, output_file, parse_chain, parse_key
from kvstore.embedded.index import Index
from kvstore.errors import CapacityExceeded, InvalidRequest, KVStoreError

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True, slots=True)
class Outcome:
    """A command's result: exit code, ``--json`` document, text, and ``errors``: one line
    each (without the ``kvtool: error:`` prefix) that kvtool prints on stderr after the
    result, e.g. a shard that did not answer."""

    code: ExitCode
    data: dict
    text: str
    errors: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    # Called with the open store. None for a command that works on a data directory the store
    # would refuse to open (``on_data_dir``).
    run: Callable[[KVStore, argparse.Namespace, Progress], Outcome] | None
    # For a data directory that every open refuses for its index (``CorruptData``): called with
    # (data directory, --config file, progress) to make it openable; what it returns is handed to
    # ``run`` as ``args.recovered`` (kvtool then opens the store as usual). None: the refusal stands.
    recover: Callable[[str, str | None, Progress], dict] | None = None
    description: str = ""  # the command's --help text, when longer than ``help`` (the list's line)
    # For a command with no ``run``: called with (data directory path, args, progress) instead of
    # opening a store; a daemon URL is a usage error.
    on_data_dir: Callable[[str, argparse.Namespace, Progress], Outcome] | None = None


# ----------------------------------------------------------------------------- helpers
def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _is_embedded(store: KVStore) -> bool:
    return isinstance(getattr(store, "index", None), Index)


def _call_with_progress(fn: Callable[..., Any], progress: Progress, **kwargs: Any) -> Any:
    """Pass ``progress=`` only to implementations that take it (a remote store may not)."""
    if "progress" in pyinspect.signature(fn).parameters:
        kwargs["progress"] = progress
    return fn(**kwargs)


def _problem_dict(p: Any) -> dict:
    return p.as_dict() if hasattr(p, "as_dict") else dict(p)


def _shard_of(store: KVStore, target: str) -> str | None:
    """The shard URL a sharded result's target (``URL`` or ``URL/t3,URL/t5``) names, else None."""
    for url in getattr(store, "urls", ()):
        if target == url or target.startswith(url + "/"):
            return url
    return None


def _with_down_shards(store: KVStore, outcome: Outcome, down: dict[str, str]) -> Outcome:
    """``outcome`` with one stderr line per shard that did not answer (url -> its error) and
    exit code at least 1: what the other shards did is printed, the gap is named."""
    if not down:
        return outcome
    n = len(getattr(store, "urls", ())) or len(down)
    lines = tuple(f"shard {url} did not answer ({one_line(err)}); the results are from the other "
                  f"{n - len(down)} of {n} shards" for url, err in down.items())
    return Outcome(max(outcome.code, ExitCode.PROBLEMS), outcome.data, outcome.text, outcome.errors + lines)


def _down_in(data: dict) -> dict[str, str]:
    """``{url: error}`` of the shards a sharded result marks ``{"error": ...}`` under ``shards``."""
    shards = data.get("shards")
    if not isinstance(shards, dict):
        return {}
    return {u: d["error"] for u, d in shards.items() if isinstance(d, dict) and "error" in d}


def _silent(unanswered: dict) -> str:
    """The shards that did not answer, for a line of text."""
    return ", ".join(unanswered) or "?"


def _kind_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kind", default=EntryKind.BLOCK.value, choices=[k.value for k in EntryKind],
                   help="entry kind (default: block)")


# ----------------------------------------------------------------------------- inspect
def _configure_inspect(p: argparse.ArgumentParser) -> None:
    # One view per run: --parquet exports the whole index, so with --key or --chain it is a
    # usage error (exit 2) rather than an export that silently drops the key the admin named.
    g = p.add_mutually_exclusive_group()
    g.add_argument("--key", type=parse_key, metavar="HEX", help="show one entry (with --kind)")
    g.add_argument("--chain", type=parse_chain, metavar="HEX,HEX,...",
                   help="show which blocks and SWA snapshots of a prefix chain are present; "
                        "@FILE reads the keys from FILE (comma, space or newline separated)")
    g.add_argument("--parquet", metavar="FILE", type=output_file,
                   help="export the whole index to a Parquet file (pyarrow; not with --key or --chain), "
                        "from a data directory or a daemon (an admin tenant's token), written here; "
                        "FILE, if it exists, must be a regular file and is replaced only once the export "
                        "is complete")
    _kind_arg(p)  # after the group, so the usage line shows [--key | --chain | --parquet]


def _summary_text(d: dict) -> str:
    lines = [f"store {d['data_dir']}  ec {d['erasure_code']}  used {fmt_bytes(d['used_bytes'])}"
             + (f" of {fmt_bytes(d['capacity_bytes'])} ({d['capacity_used']:.0%})" if d["capacity_bytes"] else
                " (no capacity limit)")
             + (f", {fmt_bytes(d['pack_dead_bytes'])} dead in packs until GC compacts them"
                if d.get("pack_dead_bytes") else "")]
    head = f"{'kind':<6} {'entries':>8} {'lost':>5} {'degraded':>8} {'expired':>7} {'pinned':>6} " \
           f"{'plain':>10} {'stored':>10}  created (oldest .. newest)"
    lines.append(head)
    for name, s in list(d["by_kind"].items()) + [("total", d["total"])]:
        lines.append(f"{name:<6} {s['entries']:>8} {s['lost']:>5} {s['degraded']:>8} {s['expired']:>7} "
                     f"{s['pinned']:>6} {fmt_bytes(s['plain_bytes']):>10} {fmt_bytes(s['stored_bytes']):>10}  "
                     f"{s['oldest_created'] or '-'} .. {s['newest_created'] or '-'}")
    down = [t["name"] for t in d["targets"] if not t["up"]]
    lines.append(f"targets: {len(d['targets'])}, down: {', '.join(down) if down else 'none'}")
    return "\n".join(lines)


def _known(view: dict, field: str = "state") -> dict:
    """``view`` with ``field`` "unknown" instead of "absent" when a shard did not answer
    (``unanswered``): no shard that answered holds the record, and the silent one may."""
    if view.get(field) == index_view.EntryState.ABSENT.value and view.get("unanswered"):
        return dict(view, **{field: index_view.EntryState.UNKNOWN.value})
    return view


def _known_position(row: dict) -> dict:
    """A chain row with ``_known`` applied to its block and SWA, only when neither was found: a
    key's block and SWA entries live on the same shard (``kvstore.client.sharded``), so one found on a
    shard that answered makes the other's ``absent`` definite."""
    absent = index_view.EntryState.ABSENT.value
    if row.get("block") == absent and row.get("swa") == absent:
        return _known(_known(row, "block"), "swa")
    return row


def _entry_text(d: dict) -> str:
    if d["state"] == index_view.EntryState.ABSENT.value:
        return f"{d['kind']} {d['key']}: absent"
    if d["state"] == index_view.EntryState.UNKNOWN.value:
        return f"{d['kind']} {d['key']}: unknown (shard {_silent(d.get('unanswered', {}))} did not answer)"
    notes = ["expired, awaiting gc"] if d.get("expired") else []
    if d.get("degraded"):
        down = [t["target"] for t in d.get("targets", ()) if not t["up"]]
        notes.append(f"degraded: fragments on down targets {', '.join(down)}")
    lines = [f"{d['kind']} {d['key']}: {d['state']}" + (f" ({'; '.join(notes)})" if notes else "")]
    if d.get("shard"):
        lines.append(f"  {'shard':<15} {d['shard']}")
    for name in ("tokens", "plain_bytes", "entry_bytes", "fragment_bytes", "stored_bytes", "ec", "created",
                 "last_access", "expires", "pinned"):
        lines.append(f"  {name:<15} {d.get(name)}")
    if "targets" in d:
        lines.append("  fragments       " + "  ".join(
            f"{t['fragment']}@{t['target']}{'' if t.get('offset') is None else ':pack+' + str(t['offset'])}"
            f"{'' if t['up'] else '(down)'}" for t in d["targets"]))
    return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class IndexViews:
    """Where ``inspect`` gets its records: the index of a data directory (``index_view``
    directly) or a daemon (its read-only ``Inspect`` RPC, which runs ``index_view`` there).
    Both give the same dicts, so the output is the same."""

    summary: Callable[[], dict]
    entries: Callable[[list[bytes], EntryKind], list[dict]]
    chain: Callable[[list[bytes]], list[dict]]

    @classmethod
    def of(cls, store: KVStore) -> "IndexViews":
        if _is_embedded(store):
            return cls(lambda: index_view.summarize(store),
                       lambda keys, kind: index_view.entry_views(store, keys, kind),
                       lambda chain: index_view.chain_view(store, chain))
        if hasattr(store, "inspect_summary"):
            return cls(store.inspect_summary, lambda keys, kind: store.inspect_entries(keys, kind=kind.value),
                       store.inspect_chain)
        raise InvalidRequest(f"inspect needs a data directory or a daemon URL; {type(store).__name__} has no "
                             "index views")


def run_inspect(store: KVStore, args: argparse.Namespace, progress: Progress) -> Outcome:
    if args.parquet is not None:
        if args.key is not None or args.chain is not None:  # the parser refuses it; a built Namespace may not
            raise InvalidRequest("--parquet exports the whole index; it does not combine with --key or --chain")
        return _export_parquet(store, args.parquet)
    views = IndexViews.of(store)
    if args.key is not None:
        d = _known(views.entries([args.key], EntryKind.parse(args.kind))[0])
        missing = (index_view.EntryState.ABSENT.value, index_view.EntryState.UNKNOWN.value,
                   index_view.EntryState.LOST.value)  # lost too: no value to read
        code = ExitCode.PROBLEMS if d["state"] in missing else ExitCode.OK
        return _with_down_shards(store, Outcome(code, d, _entry_text(d)), d.get("unanswered", {}))
    if args.chain is not None:
        rows = [_known_position(r) for r in views.chain(args.chain)]
        return _with_down_shards(store, _chain_outcome(args.chain, rows), rows[0].get("unanswered", {}) if rows else {})
    d = views.summary()
    # Lost entries or a target down are problems, as verify says: a store with every target
    # gone and every entry lost is not healthy.
    bad = d["total"]["lost"] or any(not t["up"] for t in d["targets"])
    return _with_down_shards(store, Outcome(ExitCode.PROBLEMS if bad else ExitCode.OK, d, _summary_text(d)),
                             _down_in(d))


def _export_parquet(store: KVStore, path: str) -> Outcome:
    """``inspect --parquet``: the index of a data directory or of a daemon (its ``ExportIndex``)
    written to ``path``; a sharded set's shards that did not answer under ``unanswered``, exit 1."""
    down: dict[str, str] = {}  # shard URL -> its error
    if _is_embedded(store):
        n = index_view.export_parquet(store, path)
    elif getattr(store, "shards", None):
        n = index_view.publish_parquet(path, store.export_index_batches(down))
    elif hasattr(store, "export_index_batches"):
        n = index_view.publish_parquet(path, store.export_index_batches())
    else:
        raise InvalidRequest(f"--parquet needs a data directory or a daemon URL; {type(store).__name__} has no "
                             "index export")
    d: dict[str, Any] = {"parquet": path, "rows": n}
    if down:
        d["unanswered"] = down
    return _with_down_shards(store, Outcome(ExitCode.OK, d, f"wrote {n} index rows to {path}"), down)


def _chain_outcome(chain: list[bytes], rows: list[dict]) -> Outcome:
    """The chain's rows, with what ``lookup`` answers computed from them (the longest prefix of
    live blocks, the last live SWA within it), so inspecting asks nothing else of the store.

    A row "unknown" (its shard did not answer, ``_known``) where the walk needs it makes the
    answer unknown, never a guess: the walk stopping at an unknown block leaves ``hit_blocks``
    ``None`` with ``hit_blocks_at_least`` (the live blocks before it), and an unknown SWA
    within the prefix (or an unknown prefix end) leaves ``swa_at`` ``None`` with
    ``swa_at_at_least`` (the last live SWA before it, or ``None``)."""
    live, unknown = index_view.EntryState.LIVE.value, index_view.EntryState.UNKNOWN.value
    hit = next((i for i, r in enumerate(rows) if r["block"] != live), len(rows))
    hit_known = hit == len(rows) or rows[hit]["block"] != unknown
    swa_unknown = next((i for i, r in enumerate(rows[:hit]) if r["swa"] == unknown), None)
    swa_end = hit if swa_unknown is None else swa_unknown
    swa = [i + 1 for i, r in enumerate(rows[:swa_end]) if r["swa"] == live]
    last_swa = swa[-1] if swa else None
    data: dict[str, Any] = {"length": len(chain), "hit_blocks": hit, "swa_at": last_swa, "positions": rows}
    hit_text, swa_text = str(hit), str(last_swa)
    if not hit_known:
        data.update(hit_blocks=None, hit_blocks_at_least=hit)
        hit_text = f"unknown (at least {hit}: shard {_silent(rows[hit].get('unanswered', {}))} did not answer)"
    if not hit_known or swa_unknown is not None:
        data.update(swa_at=None, swa_at_at_least=last_swa)
        swa_text = "unknown" + (f" (at least {last_swa})" if last_swa is not None else "")
    lines = [f"chain of {len(chain)}: hit_blocks={hit_text} swa_at={swa_text}",
             f"{'pos':>4}  {'key':<32}  {'block':<7} swa"]
    lines += [f"{r['position']:>4}  {r['key']}  {r['block']:<7} {r['swa']}" for r in rows]
    return Outcome(ExitCode.OK, data, "\n".join(lines))


# ----------------------------------------------------------------------------- gc
def _configure_gc(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="report what would be removed; change nothing")


def _evicted_bytes(d: dict) -> str:
    """`` (N B)`` after the evicted count, when any bytes were evicted."""
    n = d.get("evicted_bytes")
    return f" ({fmt_bytes(n)})" if n else ""


def run_gc(store: KVStore, args: argparse.Namespace, progress: Progress) -> Outcome:
    """The pass's counts; exit 1 when orphans were kept or the store could not get under its
    capacity (``CapacityExceeded``: its ``result`` is printed, the reason is the stderr line;
    without a ``result``, a refusal before the pass ran, the error is raised for kvtool to print)."""
    full: CapacityExceeded | None = None
    try:
        d = _call_with_progress(store.gc, progress, dry_run=args.dry_run)
    except CapacityExceeded as exc:
        if exc.result is None:
            raise
        full, d = exc, dict(exc.result)
    d.setdefault("dry_run", args.dry_run)
    verb = "would reclaim" if args.dry_run else "reclaimed"
    text = (f"gc{' (dry run)' if args.dry_run else ''}: expired {d.get('expired', 0)}, evicted "
            f"{d.get('evicted', 0)}{_evicted_bytes(d)}, purged {d.get('purged', 0)} deleted, "
            f"compacted {d.get('compacted_packs', 0)} packs ({d.get('moved_entries', 0)} entries moved), "
            f"orphans {d.get('orphans', 0)}{_kept(d)}; "
            f"{verb} {fmt_bytes(d.get('reclaimed_bytes', 0))} ({d.get('reclaimed_bytes', 0)} bytes)"
            + (f", {fmt_bytes(d['punched_bytes'])} freed inside segments" if d.get("punched_bytes") else "")
            + f"; used {fmt_bytes(d.get('used_bytes'))}"
            + (f"; {d['targets_not_swept']} targets down, not swept for orphans" if d.get("targets_not_swept")
               else ""))
    # A target down is a problem, as verify says: its orphans were not swept, so "orphans 0" is not all.
    code = (ExitCode.PROBLEMS if d.get("orphans_kept") or d.get("targets_not_swept") or full is not None
            else ExitCode.OK)
    errors = (one_line(full),) if full is not None else ()
    return _with_down_shards(store, Outcome(code, d, text, errors), _down_in(d))


def _kept(d: dict) -> str:
    """`` (N kept: could not delete)`` after the orphans swept, when some could not be (exit 1)."""
    n = d.get("orphans_kept")
    return f" ({n} kept: could not delete, see the log)" if n else ""


# ----------------------------------------------------------------------------- verify / repair
def _configure_none(p: argparse.ArgumentParser) -> None:
    pass


def _configure_verify(p: argparse.ArgumentParser) -> None:
    p.add_argument("--limit", type=non_negative_int, default=50, metavar="N",
                   help="list at most N problems in text output (default 50; --json lists all)")


def _entries_known(store: KVStore) -> int:
    s = store.stats()
    return int(s.get("entries", 0)) + int(s.get("lost_entries", 0))


def run_verify(store: KVStore, args: argparse.Namespace, progress: Progress) -> Outcome:
    checked = _entries_known(store)
    problems = [_problem_dict(p) for p in _call_with_progress(store.check, progress, fix=False)]
    counts = Counter(p["kind"] for p in problems)
    # "shard": the daemon of a sharded set that holds the entry (None for one store)
    lost = sorted({(p["entry_kind"], p["key"], _shard_of(store, p["target"]) or "")
                   for p in problems if p["kind"] == "lost_entry"})
    data = {"ok": not problems, "checked_entries": checked, "problems": problems, "counts": dict(counts),
            "lost": [{"kind": k, "key": key, "shard": shard or None} for k, key, shard in lost]}
    down = {p["target"]: p["detail"].removeprefix("shard did not answer: ") for p in problems
            if p["kind"] == "target_down" and p["target"] in getattr(store, "urls", ())}
    lines = [f"{p['kind']:<17} {p['entry_kind'] or '-':<5} {p['key'] or '-':<32} {p['target'] or '-':<10} "
             f"{p['detail']}" for p in problems[:args.limit]]
    if len(problems) > args.limit:
        lines.append(f"... and {len(problems) - args.limit} more (--limit N, or --json for all)")
    summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "no problems"
    lines.append(f"verify: {checked} entries checked: {summary}")
    if lost:
        lines.append(f"lost entries ({len(lost)}): bring their targets back, then run `kvtool repair`")
    return _with_down_shards(store, Outcome(ExitCode.PROBLEMS if problems else ExitCode.OK, data, "\n".join(lines)),
                             down)


def run_repair(store: KVStore, args: argparse.Namespace, progress: Progress) -> Outcome:
    """The pass's counts; exit 1 when damage remains. The index map full (``CapacityExceeded``
    with a ``result``: the counts, the pass having run to its end without rebuilding more) is
    those counts and the reason as one stderr line, exit 1, as for gc (``run_gc``)."""
    full: CapacityExceeded | None = None
    try:
        d = _call_with_progress(store.repair, progress)
    except CapacityExceeded as exc:
        if exc.result is None:
            raise
        full, d = exc, dict(exc.result)
    # A target down is a problem too (verify says so): repair answers as verify would after it.
    bad = sum(int(d.get(k, 0)) for k in ("unfixed", "still_lost", "orphans_kept", "targets_down"))
    text = (f"repair: rebuilt {d.get('rebuilt_fragments', 0)} fragments, restored {d.get('restored_entries', 0)} "
            f"entries, removed {d.get('orphans_removed', 0)} orphans{_kept(d)}; unfixed {d.get('unfixed', 0)}, "
            f"still lost {d.get('still_lost', 0)}"
            + (f"; {d['targets_down']} targets down (missing or unreachable), not repaired"
               if d.get("targets_down") else ""))
    for line in d.get("unfixed_detail") or ():
        text += f"\n  unfixed: {line}"  # each line says why: not rebuilt, or rebuilt but not recorded
    if bad:
        text += ("\nsome damage remains, or could not be looked for: bring missing targets back (or add spare "
                 "targets) and run repair again")
    errors = (one_line(full),) if full is not None else ()
    code = ExitCode.PROBLEMS if bad or full is not None else ExitCode.OK
    return _with_down_shards(store, Outcome(code, d, text, errors), _down_in(d))


# ----------------------------------------------------------------------------- rebuild-index
REBUILD_DESCRIPTION = (
    "Rebuild the index from the fragments on every target (kvstore/maintenance/reindex.py). On a data directory "
    "whose index is missing, emptied, truncated or damaged (every other command refuses it): a new index "
    "holds every entry whose fragments still decode, with its key, kind, tokens, layout and times; the "
    "damaged index is moved aside (index.damaged-TIME), never deleted. Stop every process using the "
    "directory first. On a store whose index opens (and through a daemon, with an admin token): entries "
    "found on the targets that the index does not know, older than orphan_grace_s, are added. Entries come "
    "back unpinned; one with a fragment missing is indexed degraded (run `kvtool repair`). Exit 1 when "
    "something could not be brought back or a target could not be scanned.")


def _recover_index(url: str, config_file: str | None, progress: Progress) -> dict:
    """``rebuild-index``'s ``recover``: a new index for a data directory that opens refuse."""
    from kvstore.config import load_config
    from kvstore.embedded.datadir import file_url_path
    from kvstore.maintenance.reindex import rebuild_index

    return rebuild_index(load_config(config_file, data_dir=file_url_path(url)), progress)


def run_rebuild_index(store: KVStore, args: argparse.Namespace, progress: Progress) -> Outcome:
    d = getattr(args, "recovered", None)
    if d is None:
        rebuild = getattr(store, "rebuild_index", None)
        if rebuild is None:
            raise InvalidRequest(f"{type(store).__name__} cannot rebuild its index")
        d = _call_with_progress(rebuild, progress)
    by_kind = ", ".join(f"{n} {k}" for k, n in sorted((d.get("by_kind") or {}).items())) or "none"
    if d.get("rebuilt"):
        head = (f"rebuild-index: a new index from the fragments: {d.get('entries', 0)} entries ({by_kind}) from "
                f"{d.get('generations', 0)} generations" + (f"; the damaged index is at {d['moved_aside']}"
                                                            if d.get("moved_aside") else ""))
    else:
        head = (f"rebuild-index: {d.get('entries', 0)} entries ({by_kind}) added to the index; "
                f"{d.get('already_indexed', 0)} generations already indexed, {d.get('skipped_young', 0)} younger "
                "than orphan_grace_s left to their writers")
    down = d.get("targets_down") or []
    text = (f"{head}\n  degraded {d.get('entries_degraded', 0)} (fragments missing: run `kvtool repair`), "
            f"not decodable {d.get('entries_undecodable', 0)}, bad fragments {d.get('fragments_bad', 0)}, "
            f"expired {d.get('entries_expired', 0)}, superseded {d.get('entries_superseded', 0)}"
            + (f"\n  targets not scanned: {', '.join(down)}" if down else "")
            + (f"\n  in {d['seconds']:.1f} s" if isinstance(d.get("seconds"), (int, float)) else ""))
    bad = d.get("entries_degraded") or d.get("entries_undecodable") or d.get("fragments_bad") or down
    return _with_down_shards(store, Outcome(ExitCode.PROBLEMS if bad else ExitCode.OK, d, text), _down_in(d))


# ----------------------------------------------------------------------------- migrate
MIGRATE_DESCRIPTION = (
    "Take a data directory of an older format version to this release's (kvstore/maintenance/migrate.py). "
    "Stop every process using the directory first (daemons, engines with an embedded store, other kvtool "
    "runs): migrate refuses while a process on this host has the index open, but cannot see one on another "
    "host without shared fcntl locks, nor one that is starting meanwhile. It checks that the index is the "
    "directory's own, then rewrites the format version in kvstore.json (atomically; every other field kept). "
    "No fragment is rewritten: a format version 2 directory's files are valid version 3 files (version 3 lets "
    "pack files grow by appends, which a version 2 release does not expect, so it refuses the migrated "
    "directory). Already this version: nothing to do, exit 0. Version 1, or a newer one than this release "
    "reads: refused, exit 2. Run again after a crash; a run that finds nothing to do changes nothing.")


def _configure_migrate(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="check and say what would change; change nothing")


def run_migrate(data_dir: str, args: argparse.Namespace, progress: Progress) -> Outcome:
    from kvstore.embedded.datadir import FORMAT_FILE
    from kvstore.maintenance.migrate import migrate

    r = migrate(data_dir, dry_run=args.dry_run)
    if not r.needed:
        text = f"migrate: {r.data_dir} is already format version {r.to_version}: nothing to do"
    elif r.dry_run:
        text = (f"migrate (dry run): {r.data_dir} would go from format version {r.from_version} to {r.to_version}: "
                f"its index checked and not open elsewhere; {FORMAT_FILE} would be rewritten, no fragment")
    else:
        text = (f"migrate: {r.data_dir} is now format version {r.to_version} (was {r.from_version}): "
                f"{FORMAT_FILE} rewritten, no fragment")
    return Outcome(ExitCode.OK, r.as_dict(), text)


# ----------------------------------------------------------------------------- stats / delete
def _flat(v: Any) -> str:
    return "  ".join(f"{k}={x}" for k, x in v.items()) if isinstance(v, dict) else str(v)


def _stats_text(d: dict) -> str:
    lines = []
    for k, v in d.items():
        if isinstance(v, dict):
            lines.append(f"{k}:")
            lines += [f"  {kk}: {_flat(vv)}" for kk, vv in v.items()]
        elif isinstance(v, list):
            lines.append(f"{k}:")
            lines += [f"  {_flat(item)}" for item in v]
        else:
            lines.append(f"{k}: {fmt_bytes(v) + f' ({v})' if k.endswith('_bytes') and v else v}")
    return "\n".join(lines)


def run_stats(store: KVStore, args: argparse.Namespace, progress: Progress) -> Outcome:
    d = store.stats()
    # Lost entries or a target down are problems, as inspect and verify say: stats answers as
    # inspect does on the same store.
    bad = d.get("lost_entries", 0) or any(not t.get("up", True) for t in d.get("targets", ()))
    return _with_down_shards(store, Outcome(ExitCode.PROBLEMS if bad else ExitCode.OK, d, _stats_text(d)),
                             _down_in(d))


def _configure_delete(p: argparse.ArgumentParser) -> None:
    p.add_argument("--key", type=parse_key, metavar="HEX", action="append", required=True,
                   help="the entry's key (repeat for several)")
    _kind_arg(p)


def _delete_named(store: Any, keys: list[bytes], kind: str) -> list[bool]:
    """Delete ``keys`` named as ``inspect`` names them: index keys on a data directory; through
    a daemon, ``RemoteStore.delete_index_keys`` (an admin's keys are index keys, any other
    tenant's its own)."""
    remote = getattr(store, "delete_index_keys", None)
    return remote(keys, kind=kind) if remote is not None else [store.delete(k, kind=kind) for k in keys]


def run_delete(store: KVStore, args: argparse.Namespace, progress: Progress) -> Outcome:
    """JSON: ``{"kind": KIND, "deleted": {KEY_HEX: bool | None}}`` for one key or many, plus
    ``unanswered`` (``{shard URL: its error}``) when a shard of a sharded set did not answer.

    Keys are named as ``inspect`` names them (``_delete_named``). On a sharded set every shard
    is asked, as ``inspect`` asks them (an admin's index key names no owner the client can
    compute): a key is deleted where a shard held it; one no answering shard held is ``None``
    (unknown) while a shard did not answer. No shard answering raises the first one's error,
    as does a single store's failure (kvtool prints it, exit 2)."""
    kind = EntryKind.parse(args.kind).value
    keys = list(dict.fromkeys(args.key))  # a repeated key once
    shards: list[Any] = list(getattr(store, "shards", ()) or ())
    down: dict[str, str] = {}  # shard URL -> its error
    if not shards:
        found = _delete_named(store, keys, kind)
    else:
        answers, first = [], None
        for url, shard in zip(store.urls, shards):
            try:
                answers.append(_delete_named(shard, keys, kind))
            except KVStoreError as exc:
                first, down[url] = first or exc, str(exc)
        if not answers:
            raise first  # no shard answered: nothing was done anywhere
        found = [any(a[i] for a in answers) for i in range(len(keys))]
    done: dict[str, bool | None] = {k.hex(): True if ok else (None if down else False) for k, ok in zip(keys, found)}
    n = sum(1 for ok in done.values() if ok)
    d: dict[str, Any] = {"kind": kind, "deleted": done}
    text = "\n".join(f"deleted {kind} entry {k}" if ok else f"no {kind} entry {k}" if ok is False
                     else f"{kind} entry {k}: unknown (shard {_silent(down)} did not answer)" for k, ok in done.items())
    if n:
        text += "\n(fragments go at the next `kvtool gc` after delete_grace_s)"
    if down:
        d["unanswered"] = down
    return _with_down_shards(store, Outcome(ExitCode.OK if n == len(done) else ExitCode.PROBLEMS, d, text), down)


COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("inspect", "summary of the index by kind; one entry (--key), a chain (--chain), or --parquet",
            _configure_inspect, run_inspect),
    Command("gc", "expire TTLs, evict above capacity, purge deleted entries and orphan fragments",
            _configure_gc, run_gc),
    Command("verify", "read and checksum every fragment; list missing, corrupt and lost (exit 1 if any); "
            "an entry with fewer than k good fragments is marked lost until `repair`", _configure_verify, run_verify),
    Command("repair", "rebuild missing or corrupt fragments, restore lost entries that are readable again",
            _configure_none, run_repair),
    Command("rebuild-index", "rebuild a lost or damaged index from the fragments on the targets", _configure_none,
            run_rebuild_index, recover=_recover_index, description=REBUILD_DESCRIPTION),
    Command("stats", "store statistics", _configure_none, run_stats),
    Command("delete", "delete one entry (e.g. an SWA snapshot: --kind swa)", _configure_delete, run_delete),
    Command("migrate", "take a data directory of an older format version to this one (stop its processes first)",
            _configure_migrate, None, description=MIGRATE_DESCRIPTION, on_data_dir=run_migrate),
)}
