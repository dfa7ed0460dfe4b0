"""Storage targets: where fragment files live, reached through fsspec URLs.

A target is one directory-like root (a local disk, an S3 bucket prefix, a
mounted distributed file system). The store calls exactly four operations:

* ``write(rel, data)``: atomic publish (``data`` is bytes or a list of byte
  strings written back to back: a pack). Local roots write ``.tmp.*`` beside
  the final name, fsync the file, rename it into place, then fsync the
  directory (rename is atomic on POSIX; the directory fsync makes the new name
  durable). Object stores (s3, gcs, memory) publish a whole object in one
  call, which is already atomic.
* ``read(rel) -> bytes`` (``read_into(rel, buf, offset)`` for a range),
  ``delete(rel) -> bool`` (True when this call removed the file, False when it was not
  there; GC counts only what it removed), ``walk() -> (rel, size, mtime)``.

Two kinds of file, both named from the entry's record (``kvstore.embedded.index.Meta``):
a *fragment file* (one put's fragment ``i``: ``fragment_path``) and a *pack file*
(``pack_path(gen)``: the fragments a batched put placed on this target, back to
back, so a batch publishes one file per target instead of one per fragment).

How written files are made durable (fsync, syncfs): ``kvstore.embedded.durability``.

Implementations are chosen by URL scheme through ``TARGET_TYPES`` (a registry, as
fsspec's own). A missing root is *never* recreated by a write: a vanished disk must look
vanished (``TargetUnavailable``), not silently become an empty directory. Only
``create_root`` (called when a data directory is first made) creates it.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import secrets
import sys
import threading
import time
from concurrent.futures import Future
from typing import Callable, Iterator

import fsspec

from kvstore.api import EntryKind
from kvstore.config import TargetSpec, localhost_file_url, split_userinfo
from kvstore.embedded.durability import fsync_dir
from kvstore.errors import InvalidRequest
from kvstore.executors import DaemonExecutor
from kvstore.keys import KEY_LEN


class TargetUnavailable(OSError):
    """The target's root is gone or refuses I/O (internal to the store; never returned to callers)."""


class TargetUnreachable(TargetUnavailable):
    """A remote target could not be *asked*: connection refused or timed out, access denied
    (a wrong credential), the service failing or throttling. Nothing is known about its
    data, so this is never a reason to call a fragment missing or an entry lost: a read
    short of k fragments because of it is ``StoreUnavailable`` (``kvstore.embedded.fragment_reads``), and
    ``check``/``verify`` report the target down without marking entries lost
    (``kvstore.maintenance.check``). A missing object or bucket is ``FileNotFoundError`` instead:
    that is an answer."""


# Errors of the client libraries under fsspec (which are not OSErrors, or are OSErrors that
# say nothing about the data): raised through ``Target`` as ``TargetUnreachable``.
_CLIENT_MODULES = frozenset({"botocore", "aiobotocore", "boto3", "aiohttp", "urllib3", "requests", "google",
                             "gcsfs", "s3fs", "asyncio"})
# OSErrors of an object store's answer that mean "the service could not answer now" (s3fs maps
# a 5xx to EREMOTEIO, throttling to EBUSY/EAGAIN) rather than anything about the object.
_SERVICE_ERRNOS = frozenset({errno.EREMOTEIO, errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNREFUSED,
                             errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH})


def _is_unreachable(exc: BaseException) -> bool:
    """Does ``exc``, raised by an fsspec backend, mean the target could not be asked?"""
    if isinstance(exc, (FileNotFoundError, TargetUnavailable, InvalidRequest)):
        return False  # an answer ("not there"), or already classified
    if isinstance(exc, (PermissionError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, OSError) and exc.errno in _SERVICE_ERRNOS:
        return True
    return type(exc).__module__.split(".", 1)[0] in _CLIENT_MODULES


# After a target could not be asked, it is not asked again for this long, or twice what the
# failed call took (up to the max: a probe of a hung endpoint costs its whole client timeout, so
# a fixed short pause would have nearly every get pay it again): each operation fails at once
# with ``TargetUnreachable``.
UNREACHABLE_COOLDOWN_S, UNREACHABLE_COOLDOWN_MAX_S = 5.0, 300.0


def _asking(method):
    """Wrap a ``Target`` operation: a backend error that means "could not ask" becomes
    ``TargetUnreachable`` naming the target (the original chained), and the target is not
    asked again for ``UNREACHABLE_COOLDOWN_S``; other errors pass unchanged."""
    @functools.wraps(method)
    def call(self: "Target", *args, **kwargs):
        shown = self.spec.shown_url
        where = self.name if self.name == shown else f"{self.name} ({shown})"
        since = (started := time.monotonic()) - self._unreachable_at
        if since < max(UNREACHABLE_COOLDOWN_S, self._unreachable_for):
            raise TargetUnreachable(errno.EHOSTUNREACH, f"target {where} not asked: it could not be reached "
                                    f"{since:.1f} s ago ({self._unreachable_why})")
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            if not _is_unreachable(exc):
                raise
            now = self._unreachable_at = time.monotonic()
            self._unreachable_for = min(UNREACHABLE_COOLDOWN_MAX_S, 2 * (now - started))
            self._unreachable_why = f"{type(exc).__name__}: {exc}"
            raise TargetUnreachable(errno.EHOSTUNREACH, f"target {where} could not be reached: "
                                    f"{self._unreachable_why}") from exc
    return call


# Reads of one target started and still running past their get's ``read_timeout_s`` (a frozen
# endpoint holds each for the client's whole timeout): with this many, the target is not asked
# for more until one returns (``Target.stalled``): parity is read at once instead.
STALLED_READS_LIMIT = 2


# Client settings for remote targets, so that an endpoint that refuses or never answers costs a
# bounded time (by default botocore waits 60 s per read, up to 5 attempts, inside s3fs's own 5
# tries: about 300 s for an endpoint that accepts and never answers): connect within 5 s, no
# byte for TARGET_TIMEOUT_S fails a read, 3 attempts in all, s3fs adding none. Passed to fsspec
# per URL scheme; with the breaker above, an outage costs one client timeout per target and interval.
TARGET_TIMEOUT_S = 10.0
_S3_CLIENT = {"config_kwargs": {"connect_timeout": 5, "read_timeout": TARGET_TIMEOUT_S,
                                "retries": {"max_attempts": 3, "mode": "standard"}}}
_FS_RETRIES = {"s3": 1, "s3a": 1}  # s3fs's own tries per call (its class attribute ``retries``; 5 by default)
CLIENT_OPTIONS: dict[str, dict] = {"s3": _S3_CLIENT, "s3a": _S3_CLIENT}

# A target URL's ``user:password@`` (``kvstore.config.split_userinfo``), per scheme: handed
# to the filesystem as these options (s3fs reads no credentials from a URL: they made
# "KEY:SECRET@bucket" a bucket name), or dropped where a scheme has no use for them. Other
# schemes (sftp, ftp, smb, ...) get the URL as written: their fsspec filesystems read it.
_URL_CREDENTIALS: dict[str, Callable[[str, str], dict]] = {
    "s3": lambda user, password: {"key": user, "secret": password},
    "s3a": lambda user, password: {"key": user, "secret": password},
}
_NO_CREDENTIALS = frozenset({"", "file", "local", "memory"})


def _fsspec_args(url: str, scheme: str) -> tuple[str, dict]:
    """The URL and options ``fsspec.core.url_to_fs`` gets for a target URL (see above)."""
    opts = dict(CLIENT_OPTIONS.get(scheme, {}))
    bare, user, password = split_userinfo(url)
    if user is None:
        return url, opts
    if scheme in _URL_CREDENTIALS:
        return bare, {**opts, **_URL_CREDENTIALS[scheme](user, password or "")}
    return (bare if scheme in _NO_CREDENTIALS else url), opts


def fragment_path(kind_code: int, key: bytes, gen: bytes, index: int) -> str:
    """``<kind>/<key[0]>/<key hex>.<gen hex>.<index>``: unique per (entry, generation, fragment)."""
    return f"{fragment_prefix(kind_code, key, gen)}{index}"


def fragment_prefix(kind_code: int, key: bytes, gen: bytes) -> str:
    """``fragment_path`` without the index (a reader appends each fragment's index)."""
    hx = key.hex()
    return f"{kind_code}/{hx[:2]}/{hx}.{gen.hex()}."


def parse_fragment_path(rel: str) -> tuple[int, bytes, bytes, int] | None:
    """Inverse of ``fragment_path``; ``None`` for any other name, one spelled another way
    included (kind, key or generation length, fan-out directory, hex case): the sweep deletes
    only what a store writes (not ``1/zz/abcd.ef.2``, nor anything under ``300/``)."""
    parts = rel.replace("\\", "/").split("/")
    name = parts[-1].split(".")
    try:
        kind, key, gen, i = int(parts[0]), bytes.fromhex(name[0]), bytes.fromhex(name[1]), int(name[2])
    except (ValueError, IndexError):
        return None
    ours = (kind in EntryKind.codes() and len(key) == KEY_LEN and len(gen) == 8 and 0 <= i < 256
            and fragment_path(kind, key, gen, i) == "/".join(parts))
    return (kind, key, gen, i) if ours else None


def pack_path(gen: bytes) -> str:
    """``p/<gen[0]>/<gen hex>.pack``: the pack file of batch ``gen`` (one per target it used)."""
    hx = gen.hex()
    return f"p/{hx[:2]}/{hx}.pack"


def parse_pack_path(rel: str) -> bytes | None:
    """Inverse of ``pack_path``: the batch generation, or ``None``."""
    parts = rel.replace("\\", "/").split("/")
    if len(parts) != 3 or parts[0] != "p" or not parts[2].endswith(".pack"):
        return None
    try:
        gen = bytes.fromhex(parts[2][: -len(".pack")])
    except ValueError:
        return None
    return gen if len(gen) == 8 and parts[1] == gen.hex()[:2] else None


def _joined(data: bytes | list) -> bytes:
    return data if isinstance(data, (bytes, bytearray, memoryview)) else b"".join(data)


def _safe_rel(rel: str) -> str:
    if rel.startswith("/") or ".." in rel.split("/"):
        raise InvalidRequest(f"refusing a path outside the target root: {rel!r}")
    return rel


class Target:
    """Base: one fsspec root. Subclasses override the four operations when they can do better."""

    atomic_put = False
    local = False  # reads are worth fanning out over threads unless the target is local
    # How much older a file's mtime may look than it is (S3's LastModified is whole seconds):
    # the orphan sweep adds it to the grace (``kvstore.maintenance.orphans``).
    mtime_resolution_s = 1.0
    # ``_asking``'s breaker: when it last could not be asked, why, for how long not to ask again
    _unreachable_at, _unreachable_why, _unreachable_for = -math.inf, "", 0.0
    _stalled, _stalled_lock = 0, threading.Lock()  # reads past their caller's timeout, running; one lock for all
    _writes_stalled = 0  # writes past ``write_timeout_s``, running (under ``_stalled_lock`` too)

    def __init__(self, spec: TargetSpec):
        self.spec = spec
        self.name = spec.name
        self.domain = spec.domain
        scheme = spec.url.split("://", 1)[0] if "://" in spec.url else ""
        url, opts = _fsspec_args(spec.url, scheme)
        url = localhost_file_url(url)
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **opts)
        except (ImportError, ValueError) as exc:
            raise InvalidRequest(
                f"cannot open target {spec.shown_url!r}: {exc} (an s3:// target needs `pip install kvstack[s3]`)"
            ) from exc
        self.root = self.root.rstrip("/")
        if scheme in _FS_RETRIES and hasattr(self.fs, "retries"):
            self.fs.retries = _FS_RETRIES[scheme]  # this instance is ours: fsspec caches it by our options

    def stalled(self) -> str:
        """Why this target is not to be asked for more reads now ("": ask it): it holds
        ``STALLED_READS_LIMIT`` reads that ran past their caller's timeout and still run."""
        n = self._stalled
        return f"target {self.name} not asked: {n} reads of it still run past read_timeout_s" if (
            n >= STALLED_READS_LIMIT) else ""

    def read_stalled(self, fut: Future) -> None:
        """Count ``fut`` (a read of this target past its caller's timeout) until it ends."""
        self._count_until_done("_stalled", fut)

    def _count_until_done(self, counter: str, fut: Future) -> None:
        """Add one to the counter attribute ``counter`` now and take it off when ``fut`` ends."""
        def bump(delta: int) -> None:
            with self._stalled_lock:
                setattr(self, counter, getattr(self, counter) + delta)

        bump(1)
        fut.add_done_callback(lambda _fut: bump(-1))

    def writes_stalled(self) -> str:
        """Why this target is not to be asked for more writes now ("": ask it): a write of it ran
        past ``write_timeout_s`` and still runs (a hung mount or endpoint would hold every new
        write for the whole timeout too; ``FragmentWriter.run_writes``)."""
        n = self._writes_stalled
        return f"target {self.name} not asked: {n} writes of it still run past write_timeout_s" if n else ""

    def write_stalled(self, fut: Future) -> None:
        """Count ``fut`` (a write of this target past its caller's timeout) until it ends."""
        self._count_until_done("_writes_stalled", fut)

    def location(self) -> tuple:
        """Where this target's files live, as comparable as its filesystem allows: two targets
        of one store at the same location would write each other's pack files over."""
        opts = getattr(self.fs, "storage_options", {}) or {}
        endpoint = opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url")
        return type(self.fs).__name__, endpoint, self.root.rstrip("/")

    def _p(self, rel: str) -> str:
        return f"{self.root}/{_safe_rel(rel)}"

    @_asking
    def create_root(self) -> None:
        self.fs.makedirs(self.root, exist_ok=True)

    def is_up(self) -> bool:
        return self.state()[0] == "up"

    def state(self) -> tuple[str, str]:
        """("up", ""), ("missing", why): the root is not there (an answer: its entries may be
        lost), or ("unreachable", why): the target could not be asked (``TargetUnreachable``:
        nothing is known about its data)."""
        try:
            return ("up", "") if self._root_exists() else ("missing", "target root missing")
        except TargetUnreachable as exc:
            return "unreachable", str(exc)
        except OSError as exc:
            return "missing", f"target root unreadable: {exc}"

    @_asking
    def _root_exists(self) -> bool:
        return bool(self.fs.isdir(self.root)) or self.fs.exists(self.root)

    def _check_up(self) -> None:
        """``TargetUnreachable`` or ``TargetUnavailable`` (root missing) unless ``state`` is up."""
        state, why = self.state()
        if state != "up":
            cls = TargetUnreachable if state == "unreachable" else TargetUnavailable
            raise cls(errno.EHOSTUNREACH if state == "unreachable" else errno.ENOENT, f"target {self.name}: {why}",
                      self.root)

    @_asking
    def write(self, rel: str, data: bytes | list, *, fsync: bool) -> None:
        path = self._p(rel)
        self._check_up()
        if self.atomic_put:
            self.fs.pipe_file(path, _joined(data))
            return
        tmp = f"{path.rsplit('/', 1)[0]}/.tmp.{secrets.token_hex(6)}.{path.rsplit('/', 1)[1]}"
        self.fs.pipe_file(tmp, _joined(data))
        self.fs.mv(tmp, path)

    @_asking
    def read(self, rel: str) -> bytes:
        return self.fs.cat_file(self._p(rel))

    @_asking
    def read_into(self, rel: str, buf: memoryview, offset: int = 0) -> int:
        """Read up to ``len(buf)`` bytes of the file from ``offset`` into ``buf``; returns the count."""
        data = self.fs.cat_file(self._p(rel), start=offset, end=offset + len(buf))
        n = min(len(data), len(buf))
        buf[:n] = data[:n]
        return n

    @_asking
    def punch(self, rel: str, offset: int, length: int) -> bool:
        """Give back the space of ``length`` bytes at ``offset`` of file ``rel`` (a dead entry's
        share of a segment or pack) without changing the file's size or any other byte: True
        when the filesystem did. Here: never (object stores cannot; the bytes wait for
        compaction or for the file to go)."""
        return False

    def delete(self, rel: str) -> bool:
        """Remove ``rel``: True when this call removed it, False when it was not there (GC counts
        only the bytes it freed). ``TargetUnavailable`` (or ``TargetUnreachable``) instead of
        False when the root is gone or cannot be asked: it may hold the file when it is back."""
        try:
            self.fs.rm_file(self._p(rel))
            return True
        except FileNotFoundError:
            self._check_up()
            return False

    @_asking
    def stat(self, rel: str) -> tuple[int, float]:
        """(size, mtime) of one file; ``FileNotFoundError`` when it is not there."""
        return _size_mtime(self.fs.info(self._p(rel)))

    def walk(self) -> Iterator[tuple[str, int, float]]:
        """Every file under the root as (relative path, size, mtime); temporaries included.
        The listing is taken whole first (``_find``), so its errors are classified too."""
        self._check_up()
        for path, info in self._find().items():
            yield (path[len(self.root):].lstrip("/"), *_size_mtime(info))

    @_asking
    def _find(self) -> dict:
        return self.fs.find(self.root, detail=True)


def _size_mtime(info: dict) -> tuple[int, float]:
    """Size and modification time from an fsspec ``info`` dict (each backend names them its way)."""
    mtime = info.get("mtime") or info.get("LastModified") or info.get("created") or 0.0
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    return int(info.get("size") or 0), float(mtime)


class ObjectTarget(Target):
    """S3, GCS, memory: a put replaces a whole object atomically."""

    atomic_put = True

    @_asking
    def write(self, rel: str, data: bytes | list, *, fsync: bool) -> None:
        """One PUT of the whole object (atomic). The bucket is asked about only when the PUT
        fails for want of it (``TargetUnavailable`` then, as ``Target.write`` says before
        writing): asking first would cost every write a bucket listing."""
        try:
            self.fs.pipe_file(self._p(rel), _joined(data))
        except FileNotFoundError:  # no such bucket (s3fs: NoSuchBucket), or a prefix it refuses
            self._check_up()
            raise

    @_asking
    def _root_exists(self) -> bool:
        where = self.root.split("/", 1)[0] if self.spec.url.startswith(("s3", "gs")) else self.root
        try:
            # Asked of the store, not of fsspec's listing cache: a bucket deleted since a walk
            # or listing would still answer from the cache, and stats show a gone target up.
            self.fs.invalidate_cache(where)
            self.fs.ls(where)
            return True
        except FileNotFoundError:  # no such bucket
            return self.spec.url.startswith("memory")

    @_asking
    def delete(self, rel: str) -> bool:
        """As ``Target.delete``. An object store's delete succeeds whether or not the object was
        there (S3's DeleteObject), so the object is asked for first, past fsspec's listing cache.
        Two deletes of one object at once may both see it and both say True: the store's callers
        count a purge once by its index record (``maintenance._purge_grave``)."""
        path = self._p(rel)
        self.fs.invalidate_cache(path)
        try:
            there = self.fs.info(path).get("type") == "file"
        except FileNotFoundError:
            there = False
        if not there:
            self._check_up()
            return False
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:  # removed since it was asked for (a backend that says so) ...
            self._check_up()  # ... or its bucket gone since (s3fs: NoSuchBucket), which is no answer
            return False
        return True

    @_asking
    def create_root(self) -> None:
        try:
            self.fs.makedirs(self.root, exist_ok=True)
        except OSError as exc:
            if _is_unreachable(exc):
                raise
            # an object store has no directories; a bucket that exists already is fine


class LocalTarget(Target):
    """A local or mounted directory: os calls for real fsync and atomic rename."""

    local = True
    mtime_resolution_s = 0.0  # nanosecond mtimes

    def __init__(self, spec: TargetSpec):
        super().__init__(spec)
        self.root = os.path.abspath(self.root)

    def location(self) -> tuple:
        return "local", None, os.path.realpath(self.root)  # symlinks and `..` resolved

    def _p(self, rel: str) -> str:
        return os.path.join(self.root, _safe_rel(rel))

    def create_root(self) -> None:
        os.makedirs(self.root, exist_ok=True)

    def is_up(self) -> bool:
        return os.path.isdir(self.root)

    def write(self, rel: str, data: bytes | list, *, fsync: bool) -> None:
        path = self._p(rel)
        d = os.path.dirname(path)
        tmp = os.path.join(d, f".tmp.{secrets.token_hex(6)}.{os.path.basename(path)}")
        fd = self._create(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, fsync=fsync)
        try:
            _write_all(fd, data)
            if fsync:
                os.fsync(fd)  # data durable before the name points at it
        except BaseException:
            os.close(fd)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        os.close(fd)
        os.rename(tmp, path)  # atomic publish: readers see the old state or the whole fragment
        if fsync:
            fsync_dir(d)  # the rename itself durable before the index commits

    def create_for_append(self, rel: str, *, fsync: bool) -> int:
        """A new file at ``rel`` (``FileExistsError`` if there is one), opened for positioned
        writes, its directory made if missing (``kvstore.embedded.segments``); with ``fsync``, its
        name made durable now, as a rename is: a record may name it once its bytes are synced."""
        path = self._p(rel)
        d = os.path.dirname(path)
        fd = self._create(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, fsync=fsync)
        if fsync:
            try:
                fsync_dir(d)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _create(self, path: str, flags: int, *, fsync: bool) -> int:
        """``os.open`` of a new file at ``path`` under the root, its fan-out directory made when
        missing (with ``fsync``: made durable, ``_make_dirs``); ``TargetUnavailable`` when the
        root itself is gone."""
        try:
            return os.open(path, flags, 0o644)
        except FileNotFoundError:  # a fan-out directory not made yet, or the whole target gone
            if not os.path.isdir(self.root):
                raise TargetUnavailable(errno.ENOENT, f"target {self.name} root is missing", self.root) from None
            self._make_dirs(os.path.dirname(path), fsync=fsync)
            return os.open(path, flags, 0o644)

    def _make_dirs(self, d: str, *, fsync: bool) -> None:
        """Create ``d`` (and missing parents below the root); with ``fsync``, make each new
        directory entry durable by syncing its parent, as a file's rename is made durable."""
        missing = []
        p = d
        while not os.path.isdir(p) and p != self.root:
            missing.append(p)
            p = os.path.dirname(p)
        os.makedirs(d, exist_ok=True)
        if fsync:
            for created in reversed(missing):
                fsync_dir(os.path.dirname(created))

    def read(self, rel: str) -> bytes:
        with open(self._p(rel), "rb", buffering=0) as fh:
            return fh.read()

    def read_into(self, rel: str, buf: memoryview, offset: int = 0) -> int:
        fd = os.open(self._p(rel), os.O_RDONLY)
        try:
            n = 0
            while n < len(buf):
                got = os.preadv(fd, [buf[n:]], offset + n)
                if not got:
                    break
                n += got
            return n
        finally:
            os.close(fd)

    def stat(self, rel: str) -> tuple[int, float]:
        st = os.stat(self._p(rel))
        return st.st_size, st.st_mtime

    def punch(self, rel: str, offset: int, length: int) -> bool:
        """``fallocate(PUNCH_HOLE | KEEP_SIZE)``: the whole blocks inside the range are freed, and
        read as zeros from then on (a partial block at either end is zeroed, its space kept).
        False where the filesystem or platform cannot, or the file is gone."""
        if _FALLOCATE is None or length <= 0:
            return False
        try:
            fd = os.open(self._p(rel), os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            return _FALLOCATE(fd, _PUNCH_HOLE | _KEEP_SIZE, offset, length) == 0
        finally:
            os.close(fd)

    def delete(self, rel: str) -> bool:
        try:
            os.unlink(self._p(rel))
            return True
        except FileNotFoundError:  # gone already; but a root away may hold it when it is back
            if not os.path.isdir(self.root):
                raise TargetUnavailable(errno.ENOENT, f"target {self.name} root is missing", self.root) from None
            return False

    def walk(self) -> Iterator[tuple[str, int, float]]:
        if not os.path.isdir(self.root):
            raise TargetUnavailable(errno.ENOENT, f"target {self.name} root is missing", self.root)
        for dirpath, _dirs, files in os.walk(self.root, onerror=_unlisted):
            for f in files:
                p = os.path.join(dirpath, f)
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                yield os.path.relpath(p, self.root), st.st_size, st.st_mtime


def _libc_fallocate():
    import ctypes
    import ctypes.util

    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64], ctypes.c_int
    return fn


_FALLOCATE = _libc_fallocate() if sys.platform.startswith("linux") else None
_KEEP_SIZE, _PUNCH_HOLE = 0x01, 0x02  # linux/falloc.h


def _unlisted(exc: OSError) -> None:
    """``os.walk``'s error hook: a directory that cannot be listed fails the walk (the target is
    reported, not taken for empty there); one removed meanwhile (GC pruning it) is just gone."""
    if not isinstance(exc, FileNotFoundError):
        raise exc


_IOV_MAX = 512  # well under the kernel's 1024 per writev


def _write_all(fd: int, data: bytes | list) -> None:
    """Write ``data`` (bytes, or byte strings back to back: one ``writev`` per slice) fully."""
    parts = [memoryview(data)] if isinstance(data, (bytes, bytearray, memoryview)) else [memoryview(p) for p in data]
    while parts:
        n = os.writev(fd, parts[:_IOV_MAX])
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts.pop(0)
        if n:
            parts[0] = parts[0][n:]


# URL scheme -> Target class. Anything else goes through the generic fsspec Target.
TARGET_TYPES: dict[str, type[Target]] = {
    "": LocalTarget,
    "file": LocalTarget,
    "local": LocalTarget,
    "s3": ObjectTarget,
    "s3a": ObjectTarget,
    "gs": ObjectTarget,
    "gcs": ObjectTarget,
    "memory": ObjectTarget,
}


class TargetPools:
    """Per-target thread pools, a bulkhead: one pool per (target, op), ``workers`` threads each,
    started on demand, so that I/O stuck on one target cannot hold the threads the others'
    need. ``op`` "read" runs a read path's fragment reads, "write" its writes under
    ``write_timeout_s``. Shared by a store's fragment reader and writer; stopped with
    ``all()`` by whoever owns it."""

    def __init__(self, workers: int):
        self.workers = workers
        self._lock = threading.Lock()
        self._pools: dict[tuple[str, str], DaemonExecutor] = {}

    def get(self, name: str, op: str = "read") -> DaemonExecutor:
        pool = self._pools.get((name, op))
        if pool is None:
            with self._lock:
                pool = self._pools.get((name, op))
                if pool is None:
                    pool = self._pools[name, op] = DaemonExecutor(self.workers, f"kvstore-{op}-{name}")
        return pool

    def all(self) -> list[DaemonExecutor]:
        return list(self._pools.values())


def open_target(spec: TargetSpec) -> Target:
    scheme = spec.url.split("://", 1)[0] if "://" in spec.url else ""
    return TARGET_TYPES.get(scheme, Target)(spec)


# Fault-injecting wrapper for chaos tests and the soak (kvstore.embedded.faults): registered by
# import path, so fsspec imports it only when a ``faulty://`` target is opened. It goes
# through the generic ``Target`` (tmp + rename publish, remote-style parallel reads).
fsspec.register_implementation("faulty", "kvstore.embedded.faults.FaultyFileSystem", clobber=True)
