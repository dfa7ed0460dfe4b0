"""Start and stop a whole serving stack on loopback: the store, the entrypoint, workers.

The walkthrough's launcher of local processes (the end-to-end tests start their stacks with
it too); ``Cluster.client()`` hands back an ``entrypoint.client.Client`` of the stack. Every
process runs in its own session so that ``stop`` (also called on error, at
interpreter exit, and by the walkthrough's Ctrl-C handler) can take down the
process and anything it started; nothing outlives the ``Cluster``.

Each child prints ``READY <json>`` as its first stdout line once it listens;
``start`` waits for that line (bounded by ``start_timeout_s``), so a child that
fails to start is reported with the tail of its log instead of hanging.

Worker secret: each ``Cluster`` makes a random one (``secrets.token_urlsafe``)
unless given one, and hands it to the entrypoint and to every worker it starts
in their environment (``KVSTACK_WORKER_SECRET``, never on a command line, where
``ps`` would show it); the kvstore daemon does not get it. A test that calls
``Register``/``Deregister`` or a worker itself sends ``worker_metadata()``.

Client tokens (``entrypoint.client_tokens``): ``client_tokens={token: tenant}`` writes
them to ``client-tokens.toml`` in the work directory (0600) and starts the
entrypoint with ``--client-tokens`` on it; every tenant they name must be
configured (``entrypoint_args=("--tenant", "NAME=SALT", ...)``). ``client(token)``
then sends one, and ``wait_for_workers`` lists the workers with the worker
secret (or, without one, the first client token), since ``ListWorkers`` is
closed to anonymous callers there.

TLS (``entrypoint.tls``): ``tls=ClusterTLS(ca, cert, key)`` starts every server
(the entrypoint and each worker) with ``--tls-cert cert --tls-key key`` (one
certificate for 127.0.0.1) and every caller with ``ca``: the workers register
with ``--entrypoint-ca``, the entrypoint dials them with ``--worker-ca``, and
``client()`` verifies with ``ca_file``. With ``client_cert``/``client_key``
every hop is mutual TLS (``--tls-client-ca ca`` on each server, that
certificate on each caller). The kvstore daemon stays plaintext on loopback.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from entrypoint import auth
from entrypoint.client import Client
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from entrypoint.tls import ChannelTLS, open_channel
from kvstore.errors import StoreUnavailable


def _ready_json(line: str) -> dict | None:
    """``READY <json>``: the workers' and the entrypoint's first line."""
    return json.loads(line[len("READY "):]) if line.startswith("READY ") else None


def _ready_kvstore(line: str) -> dict | None:
    """``kvstore serving grpc://HOST:PORT ...``: the daemon's first line."""
    m = re.match(r"kvstore serving grpc://(\S+)", line)
    return {"address": m.group(1)} if m else None


def _toml_str(text: str) -> str:
    """``text`` as a TOML basic string: a JSON string is one (non-ASCII kept as is, since TOML
    has no escapes for the surrogate pairs ``json`` would write)."""
    return json.dumps(text, ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class ClusterTLS:
    """PEM files of a TLS stack (module docstring): the CA, the servers' certificate and key,
    and optionally a client certificate and key (set: mutual TLS on every hop)."""

    ca: str
    cert: str
    key: str
    client_cert: str = ""
    client_key: str = ""

    def entrypoint_args(self) -> list[str]:
        args = ["--tls-cert", self.cert, "--tls-key", self.key, "--worker-ca", self.ca]
        if self.client_cert:
            args += ["--tls-client-ca", self.ca, "--worker-cert", self.client_cert, "--worker-key", self.client_key]
        return args

    def worker_args(self) -> list[str]:
        args = ["--tls-cert", self.cert, "--tls-key", self.key, "--entrypoint-ca", self.ca]
        if self.client_cert:
            args += ["--tls-client-ca", self.ca, "--entrypoint-cert", self.client_cert,
                     "--entrypoint-key", self.client_key]
        return args


@dataclass(slots=True)
class Proc:
    name: str
    popen: subprocess.Popen
    log_path: Path
    info: dict = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.info.get("address", "")


class Cluster:
    """A loopback stack. ``with Cluster(dir, decode=2) as c: c.client()...``."""

    def __init__(self, work_dir: str | Path, *, ve: int = 1, prefill: int = 1, decode: int = 2,
                 model: str = "tiny", block_size: int = 16, store: str = "daemon",
                 worker_args: tuple[str, ...] = (), entrypoint_args: tuple[str, ...] = (),
                 start_timeout_s: float = 120.0, worker_secret: str | None = None,
                 client_tokens: dict[str, str] | None = None, tls: ClusterTLS | None = None):
        self.work_dir = Path(work_dir)
        self.counts = {"ve": ve, "prefill": prefill, "decode": decode}
        self.model, self.block_size, self.store_mode = model, block_size, store
        self.worker_args = worker_args
        self.entrypoint_args = entrypoint_args
        self.start_timeout_s = start_timeout_s
        self.worker_secret = secrets.token_urlsafe(32) if worker_secret is None else worker_secret
        self.client_tokens = dict(client_tokens or {})  # token -> tenant; empty: the entrypoint has none
        self.tls = tls
        self.procs: dict[str, Proc] = {}
        self.store_url = ""
        self.entrypoint_address = ""
        self._lock = threading.Lock()
        self._stopped = False  # once stopped, never starts a process again (stop may race a start)

    # ------------------------------------------------------------------ processes
    def _spawn(self, name: str, args: list[str], parse: Callable[[str], dict | None] = None, *,
               with_secret: bool = True) -> Proc:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.work_dir / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop(auth.SECRET_ENV, None)  # the caller's own secret is not this stack's
        if with_secret and self.worker_secret:
            env[auth.SECRET_ENV] = self.worker_secret
        with self._lock:  # started and registered together, so that stop() sees every process
            if self._stopped:
                raise StoreUnavailable(f"the cluster was stopped; {name} is not started")
            popen = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                                     stderr=open(log_path, "wb"), text=True, start_new_session=True, env=env)
            proc = self.procs[name] = Proc(name, popen, log_path)
        deadline = time.monotonic() + self.start_timeout_s
        line_box: list[str] = []
        reader = threading.Thread(target=lambda: line_box.append(popen.stdout.readline()), daemon=True)
        reader.start()
        while reader.is_alive() and time.monotonic() < deadline and popen.poll() is None:
            reader.join(0.05)
        line = line_box[0] if line_box else ""
        info = (parse or _ready_json)(line)
        if info is None:
            tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
            self.stop()
            raise StoreUnavailable(f"{name} did not start (exit {popen.poll()}): {line.strip()}\n{tail}")
        proc.info = info
        # keep draining stdout so the child never blocks on a full pipe
        threading.Thread(target=lambda: [None for _ in popen.stdout], daemon=True).start()
        return proc

    def start(self) -> "Cluster":
        atexit.register(self.stop)
        data_dir = self.work_dir / "store"
        if self.store_mode == "daemon":
            p = self._spawn("kvstore", ["-m", "kvstore.server.cli", "serve", "--data-dir", str(data_dir),
                                        "--port", "0", "--log-level", "WARNING"], _ready_kvstore,
                            with_secret=False)
            self.store_url = f"grpc://{p.address}"
        else:
            self.store_url = str(data_dir)
        ep = self._spawn("entrypoint", ["-m", "entrypoint", "--store", self.store_url, "--model", self.model,
                                        "--block-size", str(self.block_size), "--heartbeat-s", "0.2",
                                        *self._client_tokens_args(), *(self.tls.entrypoint_args() if self.tls else ()),
                                        *self.entrypoint_args])
        self.entrypoint_address = ep.address
        for role, n in self.counts.items():
            for i in range(n):
                self.start_worker(role, f"{role}-{i}")
        self.wait_for_workers(sum(self.counts.values()))
        return self

    def _client_tokens_args(self) -> list[str]:
        """``--client-tokens FILE`` for the entrypoint, the file written here (none without tokens)."""
        if not self.client_tokens:
            return []
        self.work_dir.mkdir(parents=True, exist_ok=True)
        path = self.work_dir / "client-tokens.toml"
        body = "[tokens]\n" + "".join(f"{_toml_str(tok)} = {_toml_str(name)}\n"
                                      for tok, name in self.client_tokens.items())
        path.unlink(missing_ok=True)  # created afresh, so that its mode is 0600 whatever was there
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with open(fd, "w", encoding="utf-8") as fh:
            fh.write(body)
        return ["--client-tokens", str(path)]

    def list_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata that ``ListWorkers`` on this stack's entrypoint accepts: the worker secret,
        else a client token (with client tokens, it refuses a call that has neither)."""
        if self.worker_secret or not self.client_tokens:
            return self.worker_metadata()
        return (("authorization", f"Bearer {next(iter(self.client_tokens))}"),)

    def start_worker(self, role: str, worker_id: str) -> Proc:
        return self._spawn(worker_id, ["-m", "entrypoint.worker", "--role", role, "--id", worker_id,
                                       "--store", self.store_url, "--model", self.model,
                                       "--block-size", str(self.block_size),
                                       "--entrypoint", self.entrypoint_address,
                                       *(self.tls.worker_args() if self.tls else ()), *self.worker_args])

    def wait_for_workers(self, n: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        with open_channel(self.entrypoint_address, self.client_tls()) as ch:
            stub = pbg.EntrypointStub(ch)
            while time.monotonic() < deadline:
                if len(stub.ListWorkers(pb.Empty(), timeout=5, metadata=self.list_metadata()).workers) >= n:
                    return
                time.sleep(0.1)
        raise StoreUnavailable(f"only some of {n} workers registered within {timeout_s} s")

    def worker_metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata for ``Register``/``Deregister`` on this stack's entrypoint, and for any call
        to one of its workers."""
        return auth.metadata(self.worker_secret)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        p = self.procs[name]
        os.killpg(p.popen.pid, sig)
        p.popen.wait(timeout=30)

    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.procs.values()]

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            procs = list(self.procs.values())
        for p in procs:  # workers and the entrypoint first, the store last
            if p.popen.poll() is None:
                try:
                    os.killpg(p.popen.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.popen.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.popen.wait(timeout=10)

    # ------------------------------------------------------------------ client
    def client(self, token: str = "") -> "Client":
        """A client of this stack's entrypoint that sends ``token`` (a client token; none for ""),
        with this stack's CA and client certificate when it serves TLS."""
        t = self.client_tls()
        return Client(self.entrypoint_address, token=token, ca_file=t.ca_file, cert_file=t.cert_file,
                      key_file=t.key_file)

    def client_tls(self) -> ChannelTLS:
        """The files a caller of this stack's entrypoint needs (none without TLS)."""
        t = self.tls
        return ChannelTLS(t.ca, t.client_cert, t.client_key) if t else ChannelTLS()

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
