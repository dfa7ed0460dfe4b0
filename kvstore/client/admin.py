"""``Admin``: the admin calls of ``kvstore.client.remote.RemoteStore`` on one daemon:
maintenance (``stats``, ``gc``, ``check``, ``repair``, ``rebuild_index``), ``kvtool``'s
read-only ``inspect_*`` views and the index export (``export_index_batches``).

Maintenance calls wait up to ``maintenance_timeout_s`` (then ``DeadlineExceeded``). ``check``
and ``rebuild_index`` always go through the streaming ``Maintain`` (a large store's problems
come in as many messages as they need); ``gc`` and ``repair`` do when given ``progress(phase,
done, total)``, as the embedded store's take it, and call it with the daemon's progress, and
are one unary call otherwise. The index export (a whole-index scan too) has the same deadline
for its whole stream.

Both streams end with a message marked ``final``, and the client reads on past it to the
stream's end, the daemon's OK status, which the daemon sends only after its handler has
finished and counted the call. A client that cancelled at the final message instead could
close that handler before it finished: the daemon would then count a complete call as
CANCELLED in ``kvstore_requests_total``, or count it only after the client had returned.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable, Iterator

from kvstore import index_view
from kvstore.client.transport import Transport
from kvstore.errors import InternalError
from kvstore.maintenance.problems import Problem, ProblemKind
from kvstore.proto import kvstore_pb2 as pb

if TYPE_CHECKING:
    import pyarrow as pa


def _no_progress(phase: str, done: int, total: int) -> None:
    pass


class Admin:
    """Maintenance, inspect and the index export over ``rpc`` (module docstring)."""

    def __init__(self, rpc: Transport):
        self._rpc = rpc

    # ------------------------------------------------------------------ maintenance
    def stats(self) -> dict:
        return json.loads(self._rpc.call("Stats", pb.StatsRequest()).json)

    def gc(self, *, dry_run: bool = False, progress: Callable | None = None) -> dict:
        """The daemon's GC pass; waits up to ``maintenance_timeout_s`` (then ``DeadlineExceeded``)."""
        r = self._maintain(pb.MaintainRequest(op="gc", dry_run=dry_run), progress)
        if r is not None:
            return json.loads(r.json)
        return json.loads(self._rpc.call("Gc", pb.GcRequest(dry_run=dry_run),
                                         timeout_s=self._rpc.options.maintenance_timeout_s).json)

    def check(self, fix: bool = False, *, progress: Callable | None = None) -> list:
        """The daemon's consistency check; waits up to ``maintenance_timeout_s``. Through the
        streaming ``Maintain`` with or without ``progress`` (module docstring)."""
        r = self._maintain(pb.MaintainRequest(op="check", fix=fix), progress or _no_progress)
        return [Problem(ProblemKind(p.kind), p.key, p.entry_kind, p.target, p.detail, p.fixed) for p in r.problems]

    def repair(self, *, progress: Callable | None = None) -> dict:
        """The daemon's repair pass; waits up to ``maintenance_timeout_s``."""
        r = self._maintain(pb.MaintainRequest(op="repair"), progress)
        if r is not None:
            return json.loads(r.json)
        return json.loads(self._rpc.call("Repair", pb.RepairRequest(),
                                         timeout_s=self._rpc.options.maintenance_timeout_s).json)

    def rebuild_index(self, *, progress: Callable | None = None) -> dict:
        """The daemon's ``rebuild_index`` (``kvstore.maintenance.reindex.reindex_store``: entries on its targets
        that its index does not know are indexed), through ``Maintain`` only; waits up to
        ``maintenance_timeout_s``."""
        return json.loads(self._maintain(pb.MaintainRequest(op="rebuild-index"), progress or _no_progress).json)

    def _maintain(self, req: pb.MaintainRequest, progress: Callable | None) -> pb.MaintainUpdate | None:
        """``Maintain``: ``progress`` called with each update, the final one (the result)
        returned; ``None`` without ``progress`` (the caller then makes the unary call)."""
        if progress is None:
            return None
        rpc = self._rpc
        rpc.check_open()
        timeout = rpc.options.maintenance_timeout_s
        problems: list[pb.Problem] = []  # a check's come in pieces, the last in the final update
        result: pb.MaintainUpdate | None = None
        # named as the unary call is (Gc, Check, Repair)
        with rpc.typed_errors(f"{req.op.capitalize()} on {rpc.url}", timeout):
            for u in rpc.stub.Maintain(req, timeout=timeout, metadata=rpc.md or None):
                if result is not None:
                    raise InternalError("Maintain sent an update after its result (a kvstore bug)")
                problems.extend(u.problems)
                if u.final:
                    del u.problems[:]
                    u.problems.extend(problems)
                    result = u  # read on to the stream's end (module docstring)
                elif u.phase:
                    progress(u.phase, u.done, u.total)
        if result is not None:
            return result
        raise InternalError("Maintain ended without its result (a kvstore bug)")

    # ------------------------------------------------------------------ inspect (read-only, kvtool)
    def inspect_summary(self) -> dict:
        """The store summary ``kvtool inspect`` shows (``kvstore.index_view.summarize``,
        computed by the daemon). Needs an admin tenant (``PermissionDenied`` otherwise)."""
        return json.loads(self._rpc.call("Inspect", pb.InspectRequest()).json)

    def inspect_entries(self, keys: list[bytes], kind: str) -> list[dict]:
        """Per validated key, in order, its index view (``index_view.entry_view``: state live/lost/absent,
        sizes, times, fragments). Read-only: nothing is read or refreshed. An admin tenant
        names index keys; any other tenant its own keys (kvstore.proto's ``Inspect``). ``kind``
        is a kind's checked name (``EntryKind.value``)."""
        out: list[dict] = []
        for _, got in self._rpc.each_piece(len(keys), lambda p: self._inspect_piece(
                pb.InspectRequest(keys=keys[p], kind=kind), "entries", p.stop - p.start)):
            out.extend(got)
        return out

    def inspect_chain(self, keys: list[bytes]) -> list[dict]:
        """Per position of a validated prefix chain, the state of its block and of its SWA entry
        (``index_view.chain_view``); read-only, keys as for ``inspect_entries``."""
        out: list[dict] = []
        for p, got in self._rpc.each_piece(len(keys), lambda p: self._inspect_piece(
                pb.InspectRequest(keys=keys[p], chain=True), "positions", p.stop - p.start)):
            for row in got:
                row["position"] += p.start  # each piece numbers its own positions from 0
            out.extend(got)
        return out

    def _inspect_piece(self, req: pb.InspectRequest, field: str, n: int) -> list[dict]:
        return self._rpc.check_count("Inspect", json.loads(self._rpc.call("Inspect", req).json)[field], n)

    def export_index_batches(self) -> Iterator["pa.RecordBatch"]:
        """Every index record of the daemon (live and lost), as record batches of
        ``index_view.parquet_schema``: what ``kvtool inspect --parquet`` writes
        (``index_view.publish_parquet``), computed there by the code of the local export
        (kvstore.proto's ``ExportIndex``). Needs an admin tenant (``PermissionDenied``).

        A generator: the call starts at the first batch taken and its deadline,
        ``maintenance_timeout_s``, covers the whole stream. Errors are typed as ``Transport.call``'s;
        a stream that ends without its final message, or whose row counts disagree, is
        ``InternalError`` (batches taken before an error were the daemon's rows)."""
        rpc = self._rpc
        rpc.check_open()
        timeout = rpc.options.maintenance_timeout_s
        sent = 0
        call = None
        try:
            with rpc.typed_errors(f"ExportIndex on {rpc.url}", timeout):
                call = rpc.stub.ExportIndex(pb.ExportIndexRequest(), timeout=timeout, metadata=rpc.md or None)
                final = False
                for chunk in call:
                    if final:
                        raise InternalError(f"ExportIndex on {rpc.url} sent a message after its final one "
                                            "(a kvstore bug)")
                    if chunk.final:
                        if chunk.rows != sent:
                            raise InternalError(f"ExportIndex on {rpc.url} sent {sent} rows and says {chunk.rows} "
                                                "(a kvstore bug)")
                        final = True  # read on to the stream's end (module docstring)
                    elif chunk.arrow_ipc:
                        yield from index_view.read_ipc(chunk.arrow_ipc, chunk.rows)
                        sent += chunk.rows
            if final:
                return
        finally:
            if call is not None:
                call.cancel()  # a no-op once the stream ended; else (the caller stopped taking) ends it
        raise InternalError(f"ExportIndex on {rpc.url} ended without its final message after {sent} rows "
                            "(a kvstore bug)")
