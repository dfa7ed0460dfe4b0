"""The daemon's maintenance and inspection calls: ``Stats``, ``Gc``, ``Check``, ``Repair``,
``Maintain`` (those three with progress, and ``rebuild-index``: ``kvstore.maintenance.reindex``, which
only it runs, in the same one-pass slot), ``Inspect`` and ``ExportIndex`` (the index rows of
``kvtool inspect --parquet``, streamed: ``_export_index``).

``AdminCalls`` holds their handlers, each ``(request, tenant) -> reply``; the daemon
(``kvstore.server.service``) builds one over its parts and routes the calls to it. The
per-call steps around a handler (authentication, the admin check of the calls that need
one, parsing, admission, error mapping) are the dispatcher's (``kvstore.server.dispatch``),
as for every call. Who may call what is in ``kvstore.server``'s contract (point 5) and in
``AdminCalls.inspect``.

One pass at a time (``PassSlot``): a gc, check or repair pass, asked by ``Maintain`` or by
the unary calls (whose handler runs the pass to its end even after its client gave up),
takes the daemon's one slot or is refused BUSY, so retries after client timeouts cannot
stack passes up. The daemon's background GC skips a round while the slot is taken; it reads
``PassSlot.running`` and never takes the slot itself, so its look never makes a call BUSY.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from kvstore import index_view
from kvstore.api import EntryKind
from kvstore.auth import Tenant, TokenTable, require_admin
from kvstore.errors import InvalidRequest
from kvstore.keys import check_keys
from kvstore.proto import kvstore_pb2 as pb
from kvstore.server.admission import Limiter
from kvstore.server.checks import BatchLimit
from kvstore.server.config import ServerConfig
from kvstore.server.metrics import DaemonMetrics
from kvstore.errors import ServerBusy
from kvstore.wire import kind_or_default


PROGRESS_EVERY_S = 0.5  # Maintain: at most one update a phase this often, besides its first and last step
RESULT_PIECE_BYTES = 1 << 20  # Maintain: a check's problems in messages of about this size (or half the limit)
HEARTBEAT_S = 1.0  # Maintain: an empty update after this long without one (how a client gone is noticed)
EXPORT_BATCH_ROWS = 4096  # ExportIndex: index rows per record batch (then split to fit half of max_message_bytes)

log = logging.getLogger(__name__)


class PassStopped(Exception):
    """A ``Maintain`` pass stopped at a progress step because its client went away."""


class PassSlot:
    """The daemon's one maintenance slot (module docstring). ``semaphore`` is the slot itself;
    ``running`` is what background GC reads."""

    def __init__(self) -> None:
        self.semaphore = threading.Semaphore(1)
        self._running = threading.Event()  # set while a pass holds the slot

    @property
    def running(self) -> bool:
        return self._running.is_set()

    def take(self) -> None:
        """Take the slot or raise ``ServerBusy``; the flag is set while it is held."""
        if not self.semaphore.acquire(blocking=False):
            raise ServerBusy("a gc, check or repair pass is still running on this daemon (one runs at a time; "
                             "one whose client left stops at its next step, or runs to its end if unary); "
                             "retry shortly")
        self._running.set()

    def give(self) -> None:
        """Give back the slot ``take`` took. The flag is cleared first: once the slot is free
        another call may take it and set the flag, which a later clear must not undo."""
        self._running.clear()
        self.semaphore.release()

    @contextmanager
    def held(self) -> Iterator[None]:
        """The slot for a unary pass, given back when it ends."""
        self.take()
        try:
            yield
        finally:
            self.give()


class AdminCalls:
    """``Stats``, ``Gc``, ``Check``, ``Repair``, ``Maintain``, ``Inspect``, ``ExportIndex``
    (module docstring), over the daemon's store. ``address`` is the daemon's URL, as ``Stats``
    reports it."""

    def __init__(self, cfg: ServerConfig, store: Any, tokens: TokenTable, limiter: Limiter,
                 metrics: DaemonMetrics, batch: BatchLimit, passes: PassSlot, address: str) -> None:
        self.cfg = cfg
        self.store = store
        self.tokens = tokens
        self.limiter = limiter
        self.metrics = metrics
        self.batch = batch
        self.passes = passes
        self.address = address

    def stats(self, r: pb.StatsRequest, tenant: Tenant) -> pb.JsonReply:
        s = dict(self.store.stats())
        s["daemon"] = {"address": self.address, "tls": self.cfg.tls, "auth": self.tokens.enabled,
                       "in_flight": self.limiter.in_flight, "gc_interval_s": self.cfg.gc_interval_s}
        return pb.JsonReply(json=json.dumps(s, default=str))

    def gc(self, r: pb.GcRequest, tenant: Tenant) -> pb.JsonReply:
        with self.passes.held():
            return pb.JsonReply(json=self._gc_json(r.dry_run))

    def check(self, r: pb.CheckRequest, tenant: Tenant) -> pb.CheckReply:
        with self.passes.held():
            return pb.CheckReply(problems=self._problems(r.fix))

    def repair(self, r: pb.RepairRequest, tenant: Tenant) -> pb.JsonReply:
        with self.passes.held():
            return pb.JsonReply(json=self._repair_json())

    def _gc_json(self, dry_run: bool, progress: Callable | None = None) -> str:
        out = self.store.gc(dry_run=dry_run, progress=progress)
        if not dry_run:
            self.metrics.gc_done(out)
        return json.dumps(out, default=str)

    def _problems(self, fix: bool, progress: Callable | None = None) -> list[pb.Problem]:
        return [pb.Problem(**p.as_dict()) for p in self.store.check(fix=fix, progress=progress)]

    def _repair_json(self, progress: Callable | None = None) -> str:
        return json.dumps(self.store.repair(progress=progress), default=str)

    def maintain(self, r: pb.MaintainRequest, tenant: Tenant) -> Iterator[bytes]:
        """``Maintain`` (kvstore.proto): the pass runs on a thread of its own, its progress
        calls queued; this generator sends them (each phase's first and last step, else at
        most one every ``PROGRESS_EVERY_S``), then the result as the final update. An error
        of the pass is raised here, so the call ends with its status as the unary form would.

        A call its client gave up on (cancelled, past its deadline) stops its pass at the next
        progress step (``PassStopped``; every step is between index transactions, where a
        pass may stop as a crash would stop it): gRPC closes this generator once a message
        cannot be sent, so with nothing to report it sends an empty update every
        ``HEARTBEAT_S``, so a client's retries after timeouts cannot stack up passes on the daemon."""
        ops: dict[str, Callable[[Callable], pb.MaintainUpdate]] = {
            "gc": lambda p: pb.MaintainUpdate(json=self._gc_json(r.dry_run, p)),
            "check": lambda p: pb.MaintainUpdate(problems=self._problems(r.fix, p)),
            "repair": lambda p: pb.MaintainUpdate(json=self._repair_json(p)),
            "rebuild-index": lambda p: pb.MaintainUpdate(json=json.dumps(self.store.rebuild_index(progress=p))),
        }
        run = ops.get(r.op)
        if run is None:
            raise InvalidRequest(f"Maintain op must be one of {', '.join(sorted(ops))}, got {r.op!r}")
        # One pass at a time, held until its thread ends, not the call: a pass whose client left
        # runs on to its next step, and retries must not stack up passes meanwhile.
        self.passes.take()
        updates: queue.SimpleQueue = queue.SimpleQueue()
        result: Future = Future()
        stop = threading.Event()

        def report(phase: str, done: int, total: int) -> None:
            if stop.is_set():
                raise PassStopped(f"Maintain {r.op}: its client went away; the pass stopped")
            updates.put((str(phase), done, total))

        def work() -> None:
            try:
                result.set_result(run(report))
            except PassStopped as exc:
                log.info("%s", exc)
                result.set_exception(exc)
            except BaseException as exc:  # re-raised by the sender below
                result.set_exception(exc)
            finally:
                self.passes.give()
                updates.put(None)

        try:
            threading.Thread(target=work, name=f"kvstore-maintain-{r.op}", daemon=True).start()
        except BaseException:
            self.passes.give()
            raise
        sent: dict[str, float] = {}
        try:
            while True:
                try:
                    u = updates.get(timeout=HEARTBEAT_S)
                except queue.Empty:
                    yield pb.MaintainUpdate().SerializeToString()  # a client gone is found here
                    continue
                if u is None:
                    break
                phase, done, total = u
                now = time.monotonic()
                if phase not in sent or done >= total or now - sent[phase] >= PROGRESS_EVERY_S:
                    sent[phase] = now
                    yield pb.MaintainUpdate(phase=phase, done=max(0, int(done)),
                                            total=max(0, int(total))).SerializeToString()
        finally:
            stop.set()  # closed early (the client gone): the pass stops at its next step
        yield from _result_pieces(result.result(), min(RESULT_PIECE_BYTES, self.cfg.max_message_bytes // 2))

    def inspect(self, r: pb.InspectRequest, tenant: Tenant) -> pb.JsonReply:
        """``kvtool inspect`` against this daemon (kvstore.proto's ``Inspect``): the views
        ``kvstore.index_view`` computes on a data directory, from this daemon's store.

        Read-only: index read transactions only (no fragment read, no access-time refresh,
        no store counter); the request metrics are the only trace. Who sees what:

        =====================  ===================================  =========================
        request                admin tenant                         any other tenant
        =====================  ===================================  =========================
        no keys (the summary)  the whole store                      PERMISSION_DENIED
        keys (entry or chain)  index keys, as Check and kvtool      its own keys, mapped into
                               on the data directory name them      its namespace
        =====================  ===================================  =========================

        A tenant's own keys are mapped as ``Get`` maps them, so another tenant's entries
        are "absent" to it. Each view names the key as it was sent. A tenant that is not an
        admin does not see where its fragments are or whether targets are up
        (``index_view.PLACEMENT_FIELDS``: target names may spell bucket and mount paths,
        and a daemon may refuse direct reads), and its call asks no target anything.
        """
        if not r.keys and not r.chain:
            require_admin(tenant, "Inspect of the store summary")
            return pb.JsonReply(json=json.dumps(index_view.summarize(self.store), default=str))
        self.batch(len(r.keys), "inspect")
        sent = check_keys(r.keys)  # validated before any is mapped
        stored = sent if tenant.admin else [tenant.store_key(k) for k in sent]
        if r.chain:
            views = index_view.chain_view(self.store, stored)
        else:
            views = index_view.entry_views(self.store, stored, EntryKind.parse(kind_or_default(r.kind)),
                                           placement=tenant.admin)
        for view, key in zip(views, sent):
            view["key"] = key.hex()
        return pb.JsonReply(json=json.dumps({"positions" if r.chain else "entries": views}, default=str))

    def export_index(self, r: pb.ExportIndexRequest, tenant: Tenant) -> Iterator[bytes]:
        """``ExportIndex`` (kvstore.proto; admin tenants only, checked before this runs): every
        index row, built by ``index_view.iter_batches`` (the code of the local export, so the
        columns are the same), as ``ExportChunk`` messages of at most about half of
        ``max_message_bytes`` (``index_view.ipc_pieces``), then a final one with the total.

        Read-only as ``inspect``: short index read transactions (``index_view.iter_rows``:
        none is held while a chunk waits for the client, so the rows are not one snapshot, as
        in the local export), no fragment read, no access time, no store counter. A client that
        stops reading is cut after ``stream_send_s`` (``Dispatcher._send_bound``), which closes
        this generator."""
        limit = max(1, self.cfg.max_message_bytes // 2)
        total = 0
        for batch in index_view.iter_batches(self.store, EXPORT_BATCH_ROWS):
            for data, rows in index_view.ipc_pieces(batch, limit):
                yield pb.ExportChunk(arrow_ipc=data, rows=rows).SerializeToString()
                total += rows
        yield pb.ExportChunk(rows=total, final=True).SerializeToString()


def _result_pieces(final: pb.MaintainUpdate, limit: int) -> Iterator[bytes]:
    """``Maintain``'s result as messages of at most about ``limit`` bytes, the last one
    ``final``: a check's problems spread over as many as they need, so a verify that finds
    more problems than one message holds (a large store with a target down) still answers."""
    problems = list(final.problems)
    del final.problems[:]
    piece: list[pb.Problem] = []
    size = 0
    for p in problems:
        n = p.ByteSize() + 16  # the field's tag and length
        if piece and size + n > limit:
            yield pb.MaintainUpdate(problems=piece).SerializeToString()
            piece, size = [], 0
        piece.append(p)
        size += n
    final.problems.extend(piece)
    final.final = True
    yield final.SerializeToString()
