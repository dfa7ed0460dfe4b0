"""The admin surface of ``kvstore.remote.RemoteStore``: maintenance (``stats``, ``gc``,
``check``, ``repair``), ``kvtool``'s read-only ``inspect_*`` views and its ``delete_index_keys``.

``RemoteAdmin`` is a base of ``RemoteStore`` (kept apart so each file has one job): it uses
the store's ``_call``, ``_many``, ``_each_piece``, ``_check_count`` and ``options``.
Maintenance calls wait up to ``maintenance_timeout_s`` (then ``DeadlineExceeded``).
"""

from __future__ import annotations

import json
from typing import Sequence

from kvstore.api import EntryKind
from kvstore.keys import check_keys
from kvstore.maintenance import Problem, ProblemKind
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.wire import MD_INDEX_KEYS


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

    def gc(self, *, dry_run: bool = False) -> dict:
        """The daemon's GC pass; waits up to ``maintenance_timeout_s`` (then ``DeadlineExceeded``)."""
        return json.loads(self._call("Gc", pb.GcRequest(dry_run=dry_run),
                                     timeout_s=self.options.maintenance_timeout_s).json)

    def check(self, fix: bool = False) -> list:
        """The daemon's consistency check; waits up to ``maintenance_timeout_s``."""
        r = self._call("Check", pb.CheckRequest(fix=fix), timeout_s=self.options.maintenance_timeout_s)
        return [Problem(ProblemKind(p.kind), p.key, p.entry_kind, p.target, p.detail, p.fixed) for p in r.problems]

    def repair(self) -> dict:
        """The daemon's repair pass; waits up to ``maintenance_timeout_s``."""
        return json.loads(self._call("Repair", pb.RepairRequest(), timeout_s=self.options.maintenance_timeout_s).json)

    # ------------------------------------------------------------------ inspect (read-only, kvtool)
    def inspect_summary(self) -> dict:
        """The store summary ``kvtool inspect`` shows (``kvstore.cli.index_view.summarize``,
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
