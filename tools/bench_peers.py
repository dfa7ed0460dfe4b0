"""The peers of ``tools/bench_store.py``: the same put/get over bytes on other systems.

Each class is one system behind the ``Peer`` interface (``put``, ``get``, ``put_many``,
``get_many``, ``close``), opened on a fresh directory per repetition. Durability is matched
to the store's (fsync before a put returns):

* ``RawFilePeer``: write to a temporary name, fsync, rename, fsync the directory (the same
  publish the store does per fragment; the limit for one copy); read is open + read.
* ``LMDBPeer``: py-lmdb with ``sync=True``; one write transaction per put or per batch.
* ``RedisPeer`` on a ``RedisServer``: a private ``redis-server`` on a loopback port with
  ``appendonly yes``, ``appendfsync always``, RDB snapshots and AOF rewrites off; redis-py
  (hiredis parser when installed); a batch put is one non-transactional pipeline of SETs, a
  batch get one MGET: the faster of the two forms for each on this machine (MSET is slower
  than a pipeline of SETs; a pipeline of GETs is slower than MGET).
* ``ECFloorPeer``: not a store but a bound: the least I/O any store that keeps an entry as
  k+m fragments on k+m targets behind a durable index can do (appends to open files, one
  syncfs, one durable LMDB commit; k preads back). kvstore / ec_floor says how far the store
  is from its own design's limit, beside how far it is from one plain copy (``raw_file``).
* ``FileFloorPeer``: the same kind of bound for the write path the store's design prescribes
  and takes for single puts: each of the k+m fragments a file of its own, written under a
  temporary name and renamed into place, one syncfs for them, one durable LMDB commit; a get
  opens and reads k of them. file_floor / raw_file is the most that layout can reach on
  this machine, whatever the code around it does.
* ``S3RawPeer`` on an ``S3Server`` (``bench_store.py --s3``): a private moto S3 server in a
  child process on a loopback port that counts the requests it answers; the peer is raw
  s3fs, one object per entry (one PUT per put, one GET per get; a batch one concurrent
  ``fs.pipe`` / ``fs.cat``).
* ``MooncakePeer`` (``tools/bench_remote.py``): the Mooncake Store, from its own venv and in a
  network namespace of its own (``start_mooncake``), driven step by step over a pipe; it
  times its own calls (``Peer.last_s``), so the pipe is not counted against it.

``interleaved_rep`` runs one repetition of several peers together, step by step; both
benchmarks (``tools/bench_store.py`` and ``tools/bench_remote.py``) time their systems with it.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstore.embedded.durability import fsync_dir, syncfs  # the store's own directory fsync and syncfs
from tools.daemon_util import stop_process


class Peer:
    """put/get over bytes; ``*_many`` default to loops (systems without a batch API)."""

    batch_api = False
    # A peer that runs its steps in another process sets this after each call to its own time
    # of that call; ``interleaved_rep`` then counts it instead of the wall time around the
    # call (which would charge the peer for the pipe to it). ``None``: wall time.
    last_s: float | None = None

    def put(self, key: bytes, val: bytes) -> None: ...
    def get(self, key: bytes) -> bytes: ...

    def put_many(self, kv: list[tuple[bytes, bytes]]) -> None:
        for k, v in kv:
            self.put(k, v)

    def get_many(self, keys: list[bytes]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def close(self) -> None: ...


def interleaved_rep(peers: dict[str, Peer], mode: str, keys: list[bytes], vals: list[bytes],
                    batch: int) -> dict[str, dict[str, tuple]]:
    """Every peer through one rep together: put all keys, then get them all back, one step (a
    key, or a batch of keys) at a time, each step run by every peer in turn, in an order that
    rotates from step to step. A change of the machine's state within the rep (a cloud disk's
    burst allowance running out, another tenant's load) so lands on every system alike, where
    systems run one after the other met different disks. Per peer and op: (seconds summed over
    its steps, per-op latencies; a peer's own ``last_s`` when it sets one). Every value read
    back is compared with what was put."""
    names = list(peers)
    out: dict[str, dict[str, tuple]] = {name: {} for name in names}
    step = 1 if mode == "single" else batch
    for op in ("put", "get"):
        secs = dict.fromkeys(names, 0.0)
        lats: dict[str, list[float]] = {name: [] for name in names}
        for n, i in enumerate(range(0, len(keys), step)):
            ks = keys[i:i + step]
            want = [vals[(i + j) % len(vals)] for j in range(len(ks))]
            first = n % len(names)
            for name in names[first:] + names[:first]:
                peer, t = peers[name], time.perf_counter()
                if op == "put":
                    peer.put(ks[0], want[0]) if mode == "single" else peer.put_many(list(zip(ks, want)))
                else:
                    got = [peer.get(ks[0])] if mode == "single" else peer.get_many(ks)
                own = getattr(peer, "last_s", None)
                dt = time.perf_counter() - t if own is None else own
                if op == "get" and (len(got) != len(want) or any(g != w for g, w in zip(got, want))):
                    raise RuntimeError(f"{name} ({type(peer).__name__}) returned wrong bytes")
                secs[name] += dt
                lats[name].extend([dt / len(ks)] * len(ks))
        for name in names:
            out[name][op] = (secs[name], lats[name])
    return out


class RawFilePeer(Peer):
    def __init__(self, d: str):
        self.d = d

    def put(self, key, val):
        path = os.path.join(self.d, key.hex())
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            mv = memoryview(val)
            while mv:
                mv = mv[os.write(fd, mv):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        fsync_dir(self.d)

    def get(self, key):
        with open(os.path.join(self.d, key.hex()), "rb", buffering=0) as fh:
            return fh.read()


class LMDBPeer(Peer):
    batch_api = True

    def __init__(self, d: str):
        import lmdb

        self.env = lmdb.open(d, map_size=8 * 2**30, sync=True, metasync=True, readahead=False)

    def put(self, key, val):
        with self.env.begin(write=True) as txn:
            txn.put(key, val)

    def get(self, key):
        with self.env.begin() as txn:
            return txn.get(key)

    def put_many(self, kv):
        with self.env.begin(write=True) as txn:
            for k, v in kv:
                txn.put(k, v)

    def get_many(self, keys):
        with self.env.begin() as txn:
            return [txn.get(k) for k in keys]

    def close(self):
        self.env.close()


class _FloorPeer(Peer):
    """A floor's put: every entry's bytes placed (``_record``: its index record), one
    ``syncfs`` for them all, then one durable LMDB commit of the records."""

    batch_api = True
    d: str

    def _record(self, key: bytes, val: bytes) -> bytes: ...

    def put_many(self, kv):
        recs = [(k, self._record(k, v)) for k, v in kv]
        syncfs(self.d)
        with self.env.begin(write=True) as txn:
            for k, rec in recs:
                txn.put(k, rec)

    def put(self, key, val):
        self.put_many([(key, val)])


class ECFloorPeer(_FloorPeer):
    """The I/O floor of a k+m fragment store with a durable index, at kvstore's durability.

    Put: one append of ``ceil(len / k)`` bytes to each of k+m files held open (the data shares,
    and the first share again standing in for each parity fragment), one ``syncfs`` for all of
    them, then one durable LMDB commit of the (offset, length) record. A batch appends every
    entry, then syncs and commits once. Get: one LMDB read, k ``preadv`` into one buffer.
    No file is created per put, nothing is encoded, checksummed or verified, and a crash may
    tear an append: a bound for the design, never a store to use.
    """

    _REC = struct.Struct("<QQ")  # offset in every file, entry length

    def __init__(self, d: str, k: int = 4, m: int = 2):
        import lmdb

        self.d, self.k = d, k
        self.fds = [os.open(os.path.join(d, f"t{i}"), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
                    for i in range(k + m)]
        self.end = 0  # every file has the same length: each put appends one share to each
        self.env = lmdb.open(os.path.join(d, "index"), map_size=2**30, sync=True, metasync=True)

    def _record(self, key: bytes, val: bytes) -> bytes:
        share = -(-len(val) // self.k)
        mv = memoryview(val)
        for i, fd in enumerate(self.fds):
            piece = mv[i * share:(i + 1) * share] if i < self.k else mv[:share]
            os.write(fd, piece if len(piece) == share else bytes(piece) + bytes(share - len(piece)))
        rec, self.end = self._REC.pack(self.end, len(val)), self.end + share
        return rec

    def get(self, key):
        with self.env.begin() as txn:
            off, n = self._REC.unpack(txn.get(key))
        share = -(-n // self.k)
        buf = bytearray(share * self.k)
        for i in range(self.k):
            os.preadv(self.fds[i], [memoryview(buf)[i * share:(i + 1) * share]], off)
        return bytes(memoryview(buf)[:n])

    def close(self):
        for fd in self.fds:
            os.close(fd)
        self.env.close()


class FileFloorPeer(_FloorPeer):
    """The I/O floor of one file per fragment (module docstring), at kvstore's durability.

    Put: per fragment (the data shares, the first share again standing in for each parity
    one), ``<target>/<key[0]>/<key>.<i>`` written under a temporary name and renamed (the
    fan-out directory made once, remembered); one ``syncfs``; one durable LMDB commit of the
    entry's length. A batch writes every entry's files, then syncs and commits once. Get: one
    LMDB read, then open, ``preadv`` and close of each of the k data files. Nothing encoded,
    checksummed or verified: a bound, never a store to use."""

    def __init__(self, d: str, k: int = 4, m: int = 2):
        import lmdb

        self.d, self.k, self.n = d, k, k + m
        self.made: set[str] = set()
        self.env = lmdb.open(os.path.join(d, "index"), map_size=2**30, sync=True, metasync=True)

    def _path(self, key: bytes, i: int) -> str:
        sub = os.path.join(self.d, f"t{i}", key[:1].hex())
        if sub not in self.made:
            os.makedirs(sub, exist_ok=True)
            self.made.add(sub)
        return os.path.join(sub, f"{key.hex()}.{i}")

    def _record(self, key: bytes, val: bytes) -> bytes:
        share = -(-len(val) // self.k)
        mv = memoryview(val)
        for i in range(self.n):
            piece = mv[i * share:(i + 1) * share] if i < self.k else mv[:share]
            path = self._path(key, i)
            fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                os.write(fd, piece)
            finally:
                os.close(fd)
            os.rename(path + ".tmp", path)
        return struct.pack("<Q", len(val))

    def get(self, key):
        with self.env.begin() as txn:
            (n,) = struct.unpack("<Q", txn.get(key))
        share = -(-n // self.k)
        buf = bytearray(share * self.k)
        for i in range(self.k):
            fd = os.open(self._path(key, i), os.O_RDONLY)
            try:
                os.preadv(fd, [memoryview(buf)[i * share:(i + 1) * share]], 0)
            finally:
                os.close(fd)
        return bytes(memoryview(buf)[:n])

    def close(self):
        self.env.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server on a loopback port, AOF fsync on every write (``aof=False``: no
    persistence at all, for puts compared at page-cache durability); stopped by ``close``."""

    def __init__(self, work: str, aof: bool = True):
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server not found (run: bash tools/install_peers.sh)")
        self.port = _free_port()
        import redis

        self.dir = tempfile.mkdtemp(prefix="redis-", dir=work)
        # A session of its own: a Ctrl-C on the terminal reaches the tool's process group, and
        # redis-server shuts down on SIGINT (its own handler, whatever it inherits) while the
        # tool's cleanup still talks to it; ``close`` stops it.
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir, "--save", "",
             "--appendonly", "yes" if aof else "no", "--appendfsync", "always", "--auto-aof-rewrite-percentage", "0",
             "--protected-mode", "yes", "--logfile", os.path.join(self.dir, "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            self.client = redis.Redis(host="127.0.0.1", port=self.port)
            for _ in range(100):
                try:
                    self.client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.05)
            else:
                raise RuntimeError("redis-server did not answer PING within 5 s")
            self.version = self.client.info("server")["redis_version"]
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        stop_process(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisPeer(Peer):
    batch_api = True
    server: RedisServer | None = None

    def __init__(self, d: str = "", server: RedisServer | None = None):
        self.r = (server or self.server).client
        self.r.flushall()

    def put(self, key, val):
        self.r.set(key, val)

    def get(self, key):
        return self.r.get(key)

    def put_many(self, kv):
        p = self.r.pipeline(transaction=False)
        for k, v in kv:
            p.set(k, v)
        p.execute()

    def get_many(self, keys):
        return self.r.mget(keys)  # one MGET: faster than a pipeline of GETs

    def close(self):
        self.r.flushall()


class PeerUnavailable(RuntimeError):
    """A peer that cannot run here; the message says why (the benchmark reports it as skipped)."""


# Run inside the network namespace (argv: the Mooncake python; the repository root on
# PYTHONPATH, which every process below inherits): loopback up, the master and one storage
# process started, then ``mooncake_peer.py serve`` on this process's own stdin and stdout, so
# the caller outside talks to it directly. The transfer engine wants a LAN address, which the
# namespace lacks: it is told loopback's.
_IN_NETNS = ("import os, subprocess, sys; subprocess.run(['ip', 'link', 'set', 'lo', 'up'], check=True); "
             "os.environ['MC_TCP_BIND_ADDRESS'] = '127.0.0.1'; "
             "from tools.bench_peers import serve_mooncake_here; "
             "sys.exit(serve_mooncake_here(sys.argv[1]))")


def serve_mooncake_here(python: str) -> int:
    """Mooncake's master and storage process, then the ``serve`` client on this process's
    stdin and stdout until they close; everything stopped after. A failure before the client
    runs is one ``{"skipped": ...}`` line on stdout. SIGTERM (``MooncakePeer.close`` giving up
    on the client) stops them too, not only this process."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    bindir = Path(python).parent
    master = bindir / "mooncake_master"
    peer = str(Path(__file__).resolve().parent / "mooncake_peer.py")
    rpc, http, metrics = _free_port(), _free_port(), _free_port()
    meta, addr = f"http://127.0.0.1:{http}/metadata", f"127.0.0.1:{rpc}"
    procs = []
    try:
        procs.append(subprocess.Popen([str(master), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
                                       "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}",
                                       "--http_metadata_server_host=127.0.0.1",
                                       # its metrics server listens on 0.0.0.0:9003 unless told
                                       "--metrics_host=127.0.0.1", f"--metrics_port={metrics}"],
                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.5)
        st = subprocess.Popen([python, peer, "storage", meta, addr, "3600"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(st)
        line = st.stdout.readline()
        if '"setup": 0' not in line:
            print(json.dumps({"skipped": f"Mooncake storage process failed to set up: {line.strip() or st.poll()}"}),
                  flush=True)
            return 1
        return subprocess.run([python, peer, "serve", meta, addr], stderr=subprocess.DEVNULL).returncode
    finally:
        for p in reversed(procs):
            stop_process(p)


def start_mooncake(python: str, work: str, timeout_s: float = 60.0) -> "MooncakePeer":
    """A ``MooncakePeer`` on a fresh Mooncake (master, one storage process with a 2 GiB segment,
    the ``serve`` client), all in a private network namespace holding only loopback: Mooncake's
    metadata server and transfer engine listen on 0.0.0.0 whatever their flags say, and nothing
    of a benchmark may listen beyond loopback. ``PeerUnavailable`` says why it cannot run."""
    if not python or not Path(python).exists():
        raise PeerUnavailable(f"no Mooncake venv at {python!r} (bash tools/install_peers.sh --mooncake)")
    if not (Path(python).parent / "mooncake_master").exists():
        raise PeerUnavailable(f"{Path(python).parent / 'mooncake_master'} missing")
    missing = [tool for tool in ("unshare", "ip") if shutil.which(tool) is None]
    if missing:
        raise PeerUnavailable(f"no {' or '.join(missing)} here to isolate Mooncake's 0.0.0.0 listeners on loopback")
    root = str(Path(__file__).resolve().parent.parent)
    # the project's python and the Mooncake venv's both import tools.* from the repository
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    log_path = Path(tempfile.mkdtemp(prefix="mooncake-", dir=work)) / "stderr.log"
    with open(log_path, "wb") as log:  # a file, not a pipe nobody reads: it never blocks the writer
        proc = subprocess.Popen(["unshare", "--net", "--map-root-user", "--", sys.executable, "-c", _IN_NETNS,
                                 python], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
    peer = MooncakePeer(proc, str(log_path.parent), timeout_s)
    try:
        first = peer.read_reply()
    except PeerUnavailable as exc:
        why = " ".join(log_path.read_text(errors="replace").strip().splitlines()[-2:])[-300:]
        peer.close()
        raise PeerUnavailable(f"Mooncake in a loopback-only network namespace did not start: {exc} {why}".strip())
    if first.get("setup") != 0:
        peer.close()
        raise PeerUnavailable(first.get("skipped") or f"Mooncake's bench client failed to set up: {first}")
    return peer


class MooncakePeer(Peer):
    """The Mooncake Store through ``mooncake_peer.py serve`` (its protocol there): each step
    one JSON line each way; values go over once, as files in ``work`` (this peer's own
    directory, removed by ``close``). Every answer is awaited for at most ``timeout_s``;
    lines that are not JSON objects (a library's log on stdout) are skipped. ``last_s`` is
    Mooncake's own time of the call."""

    batch_api = True

    def __init__(self, proc: subprocess.Popen, work: str, timeout_s: float):
        self.proc, self.timeout_s, self.dir = proc, timeout_s, work
        self._ids: dict[bytes, int] = {}
        self._vals: list[bytes] = []
        self._buf = b""
        self._stuck = False
        self._sel = selectors.DefaultSelector()
        self._sel.register(proc.stdout, selectors.EVENT_READ)

    def read_reply(self) -> dict:
        end = time.monotonic() + self.timeout_s
        while True:
            while b"\n" not in self._buf:
                if not self._sel.select(max(0.0, end - time.monotonic())):
                    self._stuck = True  # close() stops it at once: it would not exit when asked
                    raise PeerUnavailable(f"no answer from Mooncake's client within {self.timeout_s:g} s")
                chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise PeerUnavailable(f"Mooncake's client exited (status {self.proc.poll()})")
                self._buf += chunk
            line, _, self._buf = self._buf.partition(b"\n")
            if line.startswith(b"{"):
                return json.loads(line)

    def _ask(self, cmd: dict) -> dict:
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()
        reply = self.read_reply()
        if "error" in reply:
            raise RuntimeError(f"mooncake {cmd['op']}: {reply['error']}")
        self.last_s = reply.get("s")
        return reply

    def _id(self, val: bytes) -> int:
        i = self._ids.get(val)
        if i is None:
            i = self._ids[val] = len(self._vals)
            self._vals.append(val)
            path = os.path.join(self.dir, str(i))
            with open(path, "wb") as f:
                f.write(val)
            self._ask({"op": "value", "id": i, "path": path})
        return i

    def _put(self, op: str, kv: list[tuple[bytes, bytes]]) -> None:
        ids = [self._id(v) for _, v in kv]  # before the step: a new value's file is not timed
        self._ask({"op": op, "keys": [k.hex() for k, _ in kv], "vals": ids})

    def _get(self, op: str, keys: list[bytes]) -> list[bytes | None]:
        got = self._ask({"op": op, "keys": [k.hex() for k in keys]})["got"]
        return [self._vals[i] if i >= 0 else None for i in got]

    def put(self, key, val):
        self._put("put", [(key, val)])

    def get(self, key):
        return self._get("get", [key])[0]

    def put_many(self, kv):
        self._put("put_batch", kv)

    def get_many(self, keys):
        return self._get("get_batch", keys)

    def close(self):
        try:
            if self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()  # the client's loop ends; the namespace's processes are stopped
            if not self._stuck:
                self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            stop_process(self.proc)
            self._sel.close()
            shutil.rmtree(self.dir, ignore_errors=True)


# ----------------------------------------------------------------------------------- S3 (moto)
_S3_COUNTS_PATH = "/_bench/counts"  # the counting server's own path: GET the counts, DELETE to zero them


def serve_moto_here() -> int:
    """A moto S3 server on a free loopback port in this process, until SIGTERM. Its first line
    on stdout is the port. Every request is counted by (bucket, what: PUT, GET, GET range,
    LIST (any bucket-level GET), HEAD, DELETE, POST) before moto answers it; ``GET /_bench/counts`` returns the
    counts as JSON (``[[bucket, what, n], ...]``), ``DELETE /_bench/counts`` zeroes them."""
    import threading

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    moto_app = DomainDispatcherApplication(create_backend_app)
    counts: dict[tuple[str, str], int] = {}
    lock = threading.Lock()

    def app(environ, start_response):
        path, method = environ.get("PATH_INFO", "/"), environ["REQUEST_METHOD"]
        if path == _S3_COUNTS_PATH:
            with lock:
                body = json.dumps([[b, w, n] for (b, w), n in sorted(counts.items())]).encode()
                if method == "DELETE":
                    counts.clear()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        bucket, _, obj = path.lstrip("/").partition("/")
        if method == "GET" and not obj:
            what = "LIST"  # a bucket-level GET: a listing (or the bucket's location, versioning, ...)
        elif method == "GET":
            what = "GET range" if environ.get("HTTP_RANGE") else "GET"
        else:
            what = method
        with lock:
            counts[(bucket, what)] = counts.get((bucket, what), 0) + 1
        return moto_app(environ, start_response)

    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    print(server.server_address[1], flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()
    return 0


class S3Server:
    """A private moto S3 server in a child process on a loopback port (``serve_moto_here``),
    stopped by ``close``. ``counts(bucket_prefix)`` sums its request counts by kind for the
    buckets whose names start with the prefix; ``reset()`` drops every bucket and object and
    zeroes the counts. A child process, not a thread of the benchmark: the server's Python
    would otherwise take the benchmark's GIL and be counted against every system."""

    def __init__(self, timeout_s: float = 30.0):
        import urllib.request

        self._urlopen = urllib.request.urlopen
        self._Request = urllib.request.Request
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from tools.bench_peers import serve_moto_here; "
                                   "sys.exit(serve_moto_here())"],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
            start_new_session=True)  # its own session: a Ctrl-C does not stop it under the cleanup
        try:
            sel = selectors.DefaultSelector()
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            ready = sel.select(timeout_s)
            sel.close()
            line = self.proc.stdout.readline().strip() if ready else b""
            if not line.isdigit():
                raise RuntimeError(f"moto S3 server did not start within {timeout_s:g} s "
                                   f"(status {self.proc.poll()}; is moto[server] installed?)")
            self.endpoint = f"http://127.0.0.1:{int(line)}"
            import moto

            self.version = moto.__version__
        except BaseException:
            self.close()
            raise

    def _call(self, method: str, path: str) -> bytes:
        with self._urlopen(self._Request(self.endpoint + path, method=method), timeout=30) as r:
            return r.read()

    def counts(self, bucket_prefix: str = "") -> dict[str, int]:
        out: dict[str, int] = {}
        for bucket, what, n in json.loads(self._call("GET", _S3_COUNTS_PATH)):
            if bucket.startswith(bucket_prefix):
                out[what] = out.get(what, 0) + n
        return out

    def zero_counts(self) -> None:
        self._call("DELETE", _S3_COUNTS_PATH)

    def reset(self) -> None:
        self._call("POST", "/moto-api/reset")
        self.zero_counts()

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id="testing",
                     aws_secret_access_key="testing").create_bucket(Bucket=name)

    def filesystem(self):
        """A fresh s3fs filesystem on this server (no instance cache, no listing cache)."""
        import s3fs

        # max_concurrency=1: a whole-object ``cat_file`` is one GET; with more, s3fs asks the
        # object's size first (a HEAD per get) to split large objects into ranges.
        return s3fs.S3FileSystem(key="testing", secret="testing", endpoint_url=self.endpoint,
                                 client_kwargs={"region_name": "us-east-1"}, skip_instance_cache=True,
                                 use_listings_cache=False, max_concurrency=1)

    def close(self) -> None:
        stop_process(self.proc)


class S3RawPeer(Peer):
    """The strongest simple use of S3 through fsspec: one object per entry, named by the key,
    in one bucket; a put is one ``pipe_file`` (one PUT), a get one ``cat_file`` (one GET); a
    batch is ``fs.pipe({...})`` / ``fs.cat([...])``, which s3fs runs concurrently. No index,
    no erasure code, no checksum: the limit for one copy of each entry on the same server."""

    batch_api = True

    def __init__(self, server: S3Server, bucket: str):
        self.fs, self.bucket = server.filesystem(), bucket
        server.create_bucket(bucket)

    def _p(self, key: bytes) -> str:
        return f"{self.bucket}/{key.hex()}"

    def put(self, key, val):
        self.fs.pipe_file(self._p(key), val)

    def get(self, key):
        return self.fs.cat_file(self._p(key))

    def put_many(self, kv):
        self.fs.pipe({self._p(k): v for k, v in kv})

    def get_many(self, keys):
        paths = [self._p(k) for k in keys]
        got = self.fs.cat(paths)
        return [got[p] for p in paths]
