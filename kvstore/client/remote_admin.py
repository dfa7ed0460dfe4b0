"""The admin surface of ``kvstore.client.remote.RemoteStore``: maintenance (``stats``, ``gc``,
``check``, ``repair``), ``kvtool``'s read-only ``inspect_*`` views and index export
(``export_index_batches``), and its ``delete_index_keys``.

``RemoteAdmin`` is a base of ``RemoteStore`` (kept apart so each file has one job): it uses
the store's ``_call``, ``_typed``, ``_raise_if_closed``, ``_check_open``, ``_stub``, ``_md``,
``_many``, ``_each_piece``, ``_check_count``, ``url`` and ``options``. Maintenance calls wait
up to ``maintenance_timeout_s`` (then ``DeadlineExceeded``); given ``progress(phase, done,
total)``, as the embedded store's take it, they go through the streaming ``Maintain`` and call
it with the daemon's progress.
The index export (a whole-index scan too) has the same deadline for its whole stream.

Both streams end with a message marked ``final``, and the client reads on past it to the
stream's end, the daemon's OK status, which the daemon sends only after its handler has
finished and counted the call. A client that cancelled at the final message instead could
close that handler before it finished: the daemon then counted a complete call as CANCELLED in
``kvstore_requests_total``, or counted it only after the client had returned (a stress run of
the suite caught it).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import grpc

from kvstore.api import EntryKind
from kvstore.errors import InternalError, InvalidRequest
from kvstore.keys import check_keys
from kvstore.maintenance.problems import Problem, ProblemKind
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import MD_INDEX_KEYS

if TYPE_CHECKING:
    import pyarrow as pa


def _no_progress(phase: str, done: int, total: int) -> None:
    pass


class RemoteAdmin:
    """Maintenance, inspect and kvtool's delete over gRPC (module docstring)."""

    def delete_index_keys(self, keys: Sequence[bytes], *, kind: str = "block") -> list[bool]:
        """``kvtool delete``: ``delete_many`` of keys named as ``inspect_entries`` names them (an
        admin tenant: index keys, as ``check`` and kvtool on a data directory print them; any
        other tenant: its own keys), so it deletes what ``kvtool inspect`` shows."""
        return self._many("DeleteMany", keys, kind, md=((MD_INDEX_KEYS, "1"),))

    # ------------------------------------------------------------------ maintenance
    def stats(self) -> dict:
        return json.loads(self._call("Stats", pb.StatsRequest()).json)

    def gc(self, *, dry_run: bool = False, progress: Callable | None = None) -> dict:
        """The daemon's GC pass; waits up to ``maintenance_timeout_s`` (then ``DeadlineExceeded``)."""
        r = self._maintain(pb.MaintainRequest(op="gc", dry_run=dry_run), progress)
        if r is not None:
            return json.loads(r.json)
        return json.loads(self._call("Gc", pb.GcRequest(dry_run=dry_run),
                                     timeout_s=self.options.maintenance_timeout_s).json)

    def check(self, fix: bool = False, *, progress: Callable | None = None) -> list:
        """The daemon's consistency check; waits up to ``maintenance_timeout_s``. Through the
        streaming ``Maintain`` with or without ``progress``: there, problems come in as many
        messages as they need, where the unary ``Check`` (a daemon older than ``Maintain``)
        answers in one, which a large store's problems can overflow."""
        r = self._maintain(pb.MaintainRequest(op="check", fix=fix), progress or _no_progress)
        if r is None:
            r = self._call("Check", pb.CheckRequest(fix=fix), timeout_s=self.options.maintenance_timeout_s)
        return [Problem(ProblemKind(p.kind), p.key, p.entry_kind, p.target, p.detail, p.fixed) for p in r.problems]

    def repair(self, *, progress: Callable | None = None) -> dict:
        """The daemon's repair pass; waits up to ``maintenance_timeout_s``."""
        r = self._maintain(pb.MaintainRequest(op="repair"), progress)
        if r is not None:
            return json.loads(r.json)
        return json.loads(self._call("Repair", pb.RepairRequest(), timeout_s=self.options.maintenance_timeout_s).json)

    def rebuild_index(self, *, progress: Callable | None = None) -> dict:
        """The daemon's ``rebuild_index`` (``kvstore.maintenance.reindex.reindex_store``: entries on its targets
        that its index does not know are indexed), through ``Maintain`` only; waits up to
        ``maintenance_timeout_s``."""
        r = self._maintain(pb.MaintainRequest(op="rebuild-index"), progress or _no_progress)
        if r is None:
            raise InvalidRequest(f"the daemon at {self.url} predates Maintain: upgrade it to rebuild its index")
        return json.loads(r.json)

    def _maintain(self, req: pb.MaintainRequest, progress: Callable | None) -> pb.MaintainUpdate | None:
        """``Maintain``: ``progress`` called with each update, the final one (the result)
        returned; ``None`` without ``progress``, or from a daemon older than ``Maintain``
        (the caller then makes the unary call: the same result, no progress)."""
        if progress is None:
            return None
        self._check_open()
        timeout = self.options.maintenance_timeout_s
        problems: list[pb.Problem] = []  # a check's come in pieces, the last in the final update
        result: pb.MaintainUpdate | None = None
        try:
            for u in self._stub.Maintain(req, timeout=timeout, metadata=self._md):
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
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.UNIMPLEMENTED:
                return None
            # named as the unary call is (Gc, Check, Repair)
            raise self._typed(err, f"{req.op.capitalize()} on {self.url}", timeout) from err
        except ValueError as err:  # gRPC: "Cannot invoke RPC: Channel closed!" (close() raced this call)
            self._raise_if_closed(err)
            raise
        raise InternalError("Maintain ended without its result (a kvstore bug)")

    # ------------------------------------------------------------------ inspect (read-only, kvtool)
    def inspect_summary(self) -> dict:
        """The store summary ``kvtool inspect`` shows (``kvstore.index_view.summarize``,
        computed by the daemon). Needs an admin tenant (``PermissionDenied`` otherwise)."""
        return json.loads(self._call("Inspect", pb.InspectRequest()).json)

    def inspect_entries(self, keys: Sequence[bytes], *, kind: str = "block") -> list[dict]:
        """Per key, in order, its index view (``index_view.entry_view``: state live/lost/absent,
        sizes, times, fragments). Read-only: nothing is read or refreshed. An admin tenant
        names index keys; any other tenant its own keys (kvstore.proto's ``Inspect``)."""
        k = EntryKind.parse(kind).value
        keys = check_keys(keys)
        out: list[dict] = []
        for _, got in self._each_piece(len(keys), lambda p: self._inspect_piece(
                pb.InspectRequest(keys=keys[p], kind=k), "entries", p.stop - p.start)):
            out.extend(got)
        return out

    def inspect_chain(self, keys: Sequence[bytes]) -> list[dict]:
        """Per position of a prefix chain, the state of its block and of its SWA entry
        (``index_view.chain_view``); read-only, keys as for ``inspect_entries``."""
        keys = check_keys(keys)
        out: list[dict] = []
        for p, got in self._each_piece(len(keys), lambda p: self._inspect_piece(
                pb.InspectRequest(keys=keys[p], chain=True), "positions", p.stop - p.start)):
            for row in got:
                row["position"] += p.start  # each piece numbers its own positions from 0
            out.extend(got)
        return out

    def _inspect_piece(self, req: pb.InspectRequest, field: str, n: int) -> list[dict]:
        return self._check_count("Inspect", json.loads(self._call("Inspect", req).json)[field], n)

    def export_index_batches(self) -> Iterator["pa.RecordBatch"]:
        """Every index record of the daemon (live and lost), as record batches of
        ``index_view.parquet_schema``: what ``kvtool inspect --parquet`` writes
        (``index_view.publish_parquet``), computed there by the code of the local export
        (kvstore.proto's ``ExportIndex``). Needs an admin tenant (``PermissionDenied``).

        A generator: the call starts at the first batch taken and its deadline,
        ``maintenance_timeout_s``, covers the whole stream. Errors are typed as ``_call``'s;
        a stream that ends without its final message, or whose row counts disagree, is
        ``InternalError`` (batches taken before an error were the daemon's rows)."""
        from kvstore import index_view

        self._check_open()
        timeout = self.options.maintenance_timeout_s
        sent = 0
        call = None
        try:
            call = self._stub.ExportIndex(pb.ExportIndexRequest(), timeout=timeout, metadata=self._md)
            final = False
            for chunk in call:
                if final:
                    raise InternalError(f"ExportIndex on {self.url} sent a message after its final one (a kvstore bug)")
                if chunk.final:
                    if chunk.rows != sent:
                        raise InternalError(f"ExportIndex on {self.url} sent {sent} rows and says {chunk.rows} "
                                            "(a kvstore bug)")
                    final = True  # read on to the stream's end (module docstring)
                elif chunk.arrow_ipc:
                    yield from index_view.read_ipc(chunk.arrow_ipc, chunk.rows)
                    sent += chunk.rows
            if final:
                return
        except grpc.RpcError as err:
            if err.code() is grpc.StatusCode.UNIMPLEMENTED:
                raise InvalidRequest(f"the daemon at {self.url} predates ExportIndex (inspect --parquet through a "
                                     "daemon): upgrade it, or export on its data directory") from err
            raise self._typed(err, f"ExportIndex on {self.url}", timeout) from err
        except ValueError as err:  # gRPC: "Cannot invoke RPC: Channel closed!" (close() raced this call)
            self._raise_if_closed(err)
            raise
        finally:
            if call is not None:
                call.cancel()  # a no-op once the stream ended; else (the caller stopped taking) ends it
        raise InternalError(f"ExportIndex on {self.url} ended without its final message after {sent} rows "
                            "(a kvstore bug)")
