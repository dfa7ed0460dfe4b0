"""The read half of the fragment store: reading, verifying and decoding an entry's fragments.

``FragmentReader`` is built over what a read needs, passed explicitly: the config (read
knobs, erasure code type, value limit), the targets by name, the per-target pools
(``kvstore.embedded.targets.TargetPools``), a leaf executor for fanned-out reads, and two
callbacks: ``count(name, n)`` for the read counters and ``mark_lost(ek, meta)`` for an entry
found with fewer than k good fragments. The embedded store (``kvstore.embedded.fragments``)
passes its counters and its index's lost marking; the direct reader
(``kvstore.client.direct_reads``) its own counters and a ``mark_lost`` that only counts.

The read steps are in ``kvstore.embedded.store``'s docstring ("Read path"); the local fast
paths tried first are ``kvstore.embedded.fastread.LocalFastReads``, a part of the reader.

The reader owns the read descriptors it keeps open on local pack files
(``kvstore.embedded.openfiles.OpenFiles``: ``files``), used by the fast paths and by the
fragment reads of a get (``gather``); its owner calls ``close`` once no read is in flight
any more (a read still holding a descriptor closes it when it finishes). Reads that must see
the files as they are now (``check``, the orphan sweep: ``read_fragment`` called directly)
open every file afresh. A batched get on remote targets may first fetch whole spans of the
packs its records share (``prefetch``, ``kvstore.embedded.ranges``), which its fragment reads
are served from.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import threading
from concurrent.futures import Executor, Future, wait
from typing import Callable, Sequence

from kvstore.api import EntryKind
from kvstore.config import StoreConfig
from kvstore.embedded import codec
from kvstore.embedded.fastread import LocalFastReads, frag_loc, fresh_bytes
from kvstore.embedded.index import Meta
from kvstore.embedded.openfiles import DEFAULT_CAPACITY, OpenFiles
from kvstore.embedded.ranges import PackRanges, Span, plan
from kvstore.embedded.targets import LocalTarget, Target, TargetPools, TargetUnavailable, TargetUnreachable, pack_path
from kvstore.errors import CorruptData, IncompatibleFormat, StoreUnavailable, Unrecoverable

log = logging.getLogger("kvstore.embedded.store")

_SCRATCH_MAX = 16 * 1024 * 1024  # larger reads get a fresh buffer instead of a cached one

# A read that fails with one of these hit a limit of this process, not a fault of the fragment
# (nothing is known of it): like a target that could not be asked, it never makes an entry lost.
_OWN_LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def says_nothing_of_fragment(exc: BaseException) -> bool:
    """Whether a fragment read's failure leaves the fragment's state unknown (its target
    could not be asked, or this process is out of descriptors or memory)."""
    return isinstance(exc, TargetUnreachable) or (isinstance(exc, OSError) and exc.errno in _OWN_LIMITS)


def frame_matches(fh: codec.FragmentHeader, ek: bytes, meta: Meta, i: int) -> bool:
    """Is this fragment header the one the index record expects in slot ``i``?"""
    return (fh.index == i and fh.key == ek[1:] and fh.gen == meta.gen and fh.kind_code == ek[0]
            and fh.entry_len == meta.entry_len and fh.k == meta.k and fh.m == meta.m)



class FragmentReader:
    """The read path over ``targets`` (module docstring)."""

    def __init__(self, config: StoreConfig, targets: dict[str, Target], pools: TargetPools, pool: Executor, *,
                 count: Callable[..., None], mark_lost: Callable[[bytes, Meta], None],
                 open_files: int = DEFAULT_CAPACITY):
        self.config = config
        self.targets = targets
        self.pools = pools
        self._pool = pool
        self._count = count
        self._mark_lost = mark_lost
        self._tls = threading.local()
        self.files = OpenFiles(open_files)
        self.fast = LocalFastReads(config, targets, self._scratch, self.files)
        self.ranges = PackRanges()  # spans of remote packs fetched for batched gets in flight

    def prefetch(self, records: Sequence[tuple[bytes, Meta]]) -> list[tuple[Span, bytes]]:
        """For a batched get of ``records``: fetch each remote pack span worth it in one read
        (``kvstore.embedded.ranges.plan``), on its target's pool, and hold it for the get's
        fragment reads; what was fetched, for ``release``. A span that fails is skipped (its
        fragments are read one by one, as without it)."""
        spans = plan(records, self.targets)
        if not spans:
            return []

        def fetch(span: Span) -> bytes:
            buf = bytearray(span.end - span.start)
            n = self.targets[span.target].read_into(span.rel, memoryview(buf), span.start)
            return bytes(buf[:n])

        futs = [(s, self.pools.get(s.target).submit(fetch, s)) for s in spans]
        held: list[tuple[Span, bytes]] = []
        try:
            for span, fut in futs:
                try:
                    data = fut.result()
                except OSError as exc:
                    log.info("batched get: %s of %s on %s not fetched whole (%s); its fragments are read one by one",
                             f"[{span.start}, {span.end})", span.rel, span.target, exc)
                    continue
                self.ranges.add(span, data)
                held.append((span, data))
        except BaseException:  # no caller gets ``held`` to release: what was held goes now
            self.release(held)
            raise
        return held

    def release(self, held: Sequence[tuple[Span, bytes]]) -> None:
        """Drop what ``prefetch`` held for a get that has ended."""
        for span, data in held:
            self.ranges.remove(span, data)

    def close(self) -> None:
        """Close the kept pack descriptors (``files``); a read still in flight closes its own."""
        self.files.close()

    def forget_pack(self, target: str, gen: bytes) -> None:
        """Pack ``gen`` on ``target`` was deleted: its kept descriptor, if any, is closed now
        (``kvstore.embedded.openfiles``, invariant 3)."""
        t = self.targets.get(target)
        if type(t) is LocalTarget:
            self.files.forget(t.root + "/" + pack_path(gen))

    def _read_kept(self, path: str, buf: memoryview, offset: int) -> int:
        """``LocalTarget.read_into`` through a kept descriptor of the pack at ``path``."""
        (h,) = self.files.hold([path])
        try:
            n = 0
            while n < len(buf):
                got = os.preadv(h.fd, [buf[n:]], offset + n)
                if not got:
                    break
                n += got
            return n
        except OSError:
            self.files.discard(h)  # not kept after a failure: the next read opens the path again
            raise
        finally:
            self.files.release([h])

    def read_fragment(self, meta: Meta, ek: bytes, i: int, into: memoryview | None = None,
                      kept: bool = False) -> memoryview:
        """One verified fragment body (a view into ``into`` when given); raises OSError or CorruptData.
        ``kept``: a get's read: a pack fragment is taken from a span its batched get fetched
        (``prefetch``; the first try only) or, on a local target, read through a kept descriptor;
        without it every file is read afresh (what ``check`` must see)."""
        t = self.targets.get(meta.targets[i])
        if t is None:
            raise TargetUnavailable(2, f"target {meta.targets[i]} is not configured")
        rel, off = frag_loc(ek, meta, i)
        held = kept and off is not None  # a get's read: a span its batch fetched may hold it
        kept = held and type(t) is LocalTarget
        tries = 1 + self.config.fragment_read_retries
        for attempt in range(tries):
            try:
                if off is not None:  # exactly its bytes of the pack
                    buf = memoryview(bytearray(meta.frag_len)) if into is None else into[: meta.frag_len]
                    if held and not attempt and self.ranges.copy_into(meta.targets[i], rel, off, buf):
                        n = len(buf)  # from a span its batched get fetched (``prefetch``)
                    else:
                        n = self._read_kept(t.root + "/" + rel, buf, off) if kept else t.read_into(rel, buf, off)
                    raw: bytes | memoryview = buf[:n]
                elif into is None:
                    raw = t.read(rel)
                else:
                    # One byte more than expected, so that an over-long file is caught as corrupt.
                    raw = into[: t.read_into(rel, into)]
                try:
                    fh, body = codec.parse_fragment(raw, max_body=meta.frag_len)
                except IncompatibleFormat as exc:
                    # The index vouches for this entry's format: one fragment whose header claims
                    # another version is a damaged fragment (read parity), not a failed get.
                    raise CorruptData(f"fragment {i} on {meta.targets[i]}: {exc}") from exc
                break
            except (FileNotFoundError, TargetUnavailable):
                raise  # gone is not transient: read parity instead of retrying
            except (OSError, CorruptData) as exc:
                # An I/O error or a checksum mismatch may be transient (a flaky path, a bit
                # flipped in transit): retry a bounded number of times, then give up on it.
                if attempt + 1 >= tries:
                    raise
                self._count("read_retries")
                log.info("fragment %d of %s on %s: retrying after %s", i, ek[1:].hex(), meta.targets[i], exc)
        if not frame_matches(fh, ek, meta, i):
            raise CorruptData(f"fragment {i} on {meta.targets[i]} belongs to another entry or slot")
        return body

    def _scratch(self, nbytes: int) -> memoryview:
        """A per-thread reusable read buffer: warm pages instead of fresh allocations per get."""
        if nbytes > _SCRATCH_MAX:
            return memoryview(bytearray(nbytes))
        buf = getattr(self._tls, "buf", None)
        if buf is None or len(buf) < nbytes:
            buf = self._tls.buf = bytearray(max(nbytes, 1 << 20))
        return memoryview(buf)

    def parallel(self, meta: Meta) -> bool:
        mode = self.config.parallel_reads
        if mode == "auto":
            # Page-cache reads of local files are faster on one thread than fanned out
            # (measured: tools/bench_store.py); remote targets gain from parallel requests.
            return not all(self.targets[t].local for t in meta.targets[: meta.k] if t in self.targets)
        return mode == "always"

    def gather(self, meta: Meta, ek: bytes,
                scratch: memoryview | None = None) -> tuple[dict[int, memoryview], list[str], list[str]]:
        """At least k verified bodies if possible (data fragments first); failed target names;
        of those, the ones that could not be asked (``TargetUnreachable``: nothing is known of
        their fragments, so a shortfall they cause is not a loss).

        Fragment ``i`` is read into slot ``i`` of ``scratch`` (``frag_len + 1`` bytes
        each); the returned bodies are views into it, valid until the caller reuses it.

        With ``read_timeout_s`` > 0 a fragment not back in time is counted as failed and
        the next one is read instead, so one slow target does not stall a get while k
        others answer; if fewer than k arrive otherwise, the late reads are awaited after
        all (a slow target is not a lost one). Those late reads may still be writing into
        their slots, so the buffer is a fresh one, never the reused per-thread scratch. A
        target that already holds ``STALLED_READS_LIMIT`` such reads is not asked at all
        (``Target.stalled``; ``TargetUnreachable``): a frozen endpoint holds each read for
        its client's whole timeout. Reads run on their target's own pool (``TargetPools``),
        so a frozen target's stuck reads never delay another target's; one still queued at
        the timeout is cancelled, not left to start later and get stuck in turn (and read
        here after all if fewer than k arrive otherwise: a busy target is not a lost one).
        """
        slot = meta.frag_len + 1
        timeout = self.config.read_timeout_s
        if scratch is None:
            n_bytes = slot * len(meta.targets)
            scratch = memoryview(bytearray(n_bytes)) if timeout else self._scratch(n_bytes)
        good: dict[int, memoryview] = {}
        failed: list[str] = []
        unreachable: list[str] = []
        late: dict[int, Future] = {}
        queued: list[int] = []  # reads cancelled at the timeout before they started
        n = len(meta.targets)
        parallel = self.parallel(meta) or timeout > 0
        nxt = 0
        while len(good) < meta.k and nxt < n:
            want = list(range(nxt, min(n, nxt + meta.k - len(good))))
            nxt = want[-1] + 1
            views = {i: scratch[i * slot : (i + 1) * slot] for i in want}
            outs: list[tuple[int, memoryview | None, Exception | None]] = []
            if parallel and (len(want) > 1 or timeout):
                futs = {}
                for i in want:
                    t = self.targets.get(meta.targets[i])
                    why = t.stalled() if t is not None and timeout else ""
                    if why:  # its stuck reads hold all they may: parity instead
                        outs.append((i, None, TargetUnreachable(errno.EHOSTUNREACH, why)))
                    else:
                        futs[self.pools.get(meta.targets[i]).submit(
                            self.read_fragment, meta, ek, i, views[i], True)] = i
                done, slow = wait(futs, timeout=timeout or None) if futs else (set(), set())
                for f in slow:
                    self._count("read_timeouts")
                    outs.append((futs[f], None, TimeoutError(f"no answer within read_timeout_s={timeout}")))
                    if f.cancel():  # still queued behind its target's other reads: never started
                        queued.append(futs[f])
                        continue
                    late[futs[f]] = f
                    t = self.targets.get(meta.targets[futs[f]])
                    if t is not None:
                        t.read_stalled(f)
                for f in done:
                    try:
                        outs.append((futs[f], f.result(), None))
                    except (OSError, CorruptData) as exc:
                        outs.append((futs[f], None, exc))
            else:
                for i in want:
                    try:
                        outs.append((i, self.read_fragment(meta, ek, i, views[i], True), None))
                    except (OSError, CorruptData) as exc:
                        outs.append((i, None, exc))
            for i, body, exc in outs:
                if body is not None:
                    good[i] = body
                else:
                    log.warning("fragment %d of %s on %s unusable: %s", i, ek[1:].hex(), meta.targets[i], exc)
                    failed.append(meta.targets[i])
                    if says_nothing_of_fragment(exc):
                        unreachable.append(meta.targets[i])
        # Fewer than k in time: the late reads are awaited (bounded by the target itself), then
        # the cancelled ones read here: a slow or busy target is not a lost one.
        second = [(i, f.result) for i, f in late.items()] + [
            (i, functools.partial(self.read_fragment, meta, ek, i, scratch[i * slot:(i + 1) * slot], True))
            for i in queued]
        for i, fetch in second:
            if len(good) >= meta.k:
                break
            try:
                good[i] = fetch()
            except (OSError, CorruptData) as exc:
                if says_nothing_of_fragment(exc):
                    unreachable.append(meta.targets[i])
                continue
            failed.remove(meta.targets[i])
        return good, failed, unreachable

    def decode(self, meta: Meta, ek: bytes, good: dict[int, memoryview], failed: list[str],
                out: memoryview | None = None) -> tuple[codec.EntryHeader, bytes | memoryview]:
        """Decode and verify an entry from ``good`` bodies; with ``out`` (a flat writable
        view of at least ``meta.plain_len`` bytes) the plain bytes are written there and
        verified in place, and the returned payload is the view ``out[:plain_len]``."""
        code = codec.erasure_code(meta.k, meta.m, self.config.ec_type)
        # The record's plain size is the limit: a header claiming more (a forged direct-write
        # record: a small plain_len charged, a large decompression) is refused before decoding.
        limit = meta.plain_len
        try:
            pieces = code.data_pieces(good)
            try:
                if pieces is None:
                    raise CorruptData("not all data fragments at hand")
                if out is None:
                    h, plain = codec.decode_entry_pieces(pieces, max_plain=limit)
                else:
                    h = codec.decode_entry_pieces_into(pieces, out, max_plain=limit)
                    plain = out[: h.plain_len]
            except CorruptData:
                # Slow path: the erasure decoder (degraded reads, or a fast path that disagreed).
                # With ``out`` it rewrites the whole payload and verifies it again in place.
                buf = code.decode(good)[: meta.entry_len]
                if out is None:
                    h, plain = codec.decode_entry(buf, max_plain=limit)
                else:
                    h = codec.decode_entry_into(buf, out, max_plain=limit)
                    plain = out[: h.plain_len]
            if h.key != ek[1:] or h.kind.code != ek[0]:
                raise CorruptData("decoded entry names another key")
            if h.plain_len != meta.plain_len or h.tokens != meta.tokens:  # as the fast paths check
                raise CorruptData(f"decoded entry holds {h.plain_len} plain bytes and {h.tokens} tokens, its record "
                                  f"{meta.plain_len} and {meta.tokens}")
            return h, plain
        except CorruptData as exc:
            raise Unrecoverable(
                f"entry {ek[1:].hex()} failed verification after decoding ({exc})",
                key=ek[1:], failed_targets=tuple(failed),
            ) from exc

    def read_verified(self, ek: bytes, meta: Meta,
                       out: memoryview | None = None) -> tuple[codec.EntryHeader, bytes | memoryview]:
        roots = self.fast.local_roots(meta)
        if roots is not None and out is not None:
            got = self.fast.read_scatter(ek, meta, roots, out)
            if got is not None:
                return got
        elif roots is not None and meta.entry_len - meta.plain_len >= codec.ENTRY_HEADER_MIN:  # raw: a direct read
            fresh = fresh_bytes(meta.plain_len)
            if fresh is not None and (got := self.fast.read_scatter(ek, meta, roots, fresh[1])) is not None:
                return got[0], fresh[0]  # filled whole (``read_scatter``), so ``fresh_bytes``'s contract holds
        if roots is not None:
            got = self.fast.read_fast(ek, meta, roots, out)
            if got is not None:
                return got
        good, failed, unreachable = self.gather(meta, ek)
        if len(good) < meta.k:
            unknown = sorted(set(meta.targets) - set(self.targets))
            if unknown:  # a configuration that lacks targets is not a loss: nothing is marked
                raise StoreUnavailable(
                    f"entry {ek[1:].hex()} has fragments on targets {', '.join(unknown)}, which this store "
                    "was not opened with; open the data directory with the targets it was written to")
            if len(good) + len(unreachable) >= meta.k:  # readable, for all we know: not a loss either
                raise StoreUnavailable(
                    f"entry {ek[1:].hex()}: targets {', '.join(sorted(set(unreachable)))} could not be reached, or "
                    f"this process is out of descriptors or memory ({len(good)} of {meta.k} needed fragments read); "
                    "nothing is marked lost, retry when they answer")
            self._mark_lost(ek, meta)
            raise Unrecoverable(
                f"entry {ek[1:].hex()} ({EntryKind.from_code(ek[0]).value}) has {len(good)} good fragments, "
                f"needs {meta.k}; failed targets: {', '.join(failed) or 'none'}. "
                "Bring the targets back and run `kvtool repair`.",
                key=ek[1:], failed_targets=tuple(failed),
            )
        if failed:
            self._count("degraded_reads")
        try:
            return self.decode(meta, ek, good, failed, out)
        except Unrecoverable:
            self._mark_lost(ek, meta)
            raise

