"""Fault-injecting storage targets: ``faulty://NAME/abs/inner/dir`` wraps a local directory.

Who uses it: chaos tests (``tests/kvstore/chaos``) and the soak (``tools/soak.py``).
Nothing in the store imports it; ``kvstore.embedded.targets`` only registers the
scheme with fsspec (lazily, by import path), so a store or a daemon opened
with ``--targets faulty://s0t0/tmp/x/t0,...`` goes through the generic
``kvstore.embedded.targets.Target`` (tmp + rename publish, remote-style parallel reads).

What it injects, per operation, from a seeded RNG (``FaultPlan``)::

    kind           ops          effect
    latency        all          sleep latency_s with probability latency_p
    read_error     read         OSError(EIO)                   (transient)
    corrupt_read   read         one flipped bit, silently       (transient)
    write_error    write        OSError(EIO)
    enospc         write        OSError(ENOSPC); also every write that would push
                                the bytes under the root past capacity_bytes
    short_write    write        only a prefix reaches the file, silently
    down           all          the root looks gone (ENOENT, is_up False) until up()
    unreachable    all          access denied (PermissionError): the target cannot be asked,
                                as with a wrong credential or an endpoint that refuses

Control: ``control(NAME)`` returns the ``FaultControl`` that every filesystem
opened on ``faulty://NAME/...`` consults on each call; a test flips it at run
time (``set(read_error_p=1)``, ``down()``, ``up()``) or gives it a schedule of
plans keyed by operation count. Across processes (a daemon started by the
soak) the control follows the file ``$KVSTORE_FAULTS_DIR/NAME.json``
(``write_plan`` writes it atomically; polled at most every 50 ms) and
publishes its counters to ``NAME.counts.json`` (at most every 0.5 s).

Guarantees: with an all-zero plan the wrapper is a plain local directory;
faults are drawn from ``random.Random(seed)``, so one thread's sequence of
operations sees the same faults on every run.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Sequence

from fsspec.spec import AbstractFileSystem

log = logging.getLogger(__name__)

SCHEME = "faulty"
ENV_DIR = "KVSTORE_FAULTS_DIR"
_POLL_S = 0.05
_PUBLISH_S = 0.5


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """What to inject; probabilities in [0, 1], times in seconds, sizes in bytes."""

    latency_s: float = 0.0
    latency_p: float = 0.0
    read_error_p: float = 0.0
    corrupt_read_p: float = 0.0
    write_error_p: float = 0.0
    enospc_p: float = 0.0
    capacity_bytes: int = 0  # 0: unbounded
    short_write_p: float = 0.0
    down: bool = False
    unreachable: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if f.name.endswith("_p") and not 0.0 <= getattr(self, f.name) <= 1.0:
                raise ValueError(f"FaultPlan.{f.name} must be in [0, 1], got {getattr(self, f.name)}")
        if self.latency_s < 0 or self.capacity_bytes < 0:
            raise ValueError("FaultPlan.latency_s and capacity_bytes must be >= 0")

    @property
    def calm(self) -> bool:
        return self == FaultPlan(seed=self.seed)


class FaultControl:
    """The live fault state of one ``faulty://NAME`` root. Thread-safe.

    Invariant: ``counts[kind]`` is the number of faults of that kind injected
    so far (``down`` counts refused operations), ``ops`` the operations seen.
    """

    def __init__(self, name: str, plan: FaultPlan | None = None, *, state_dir: str | None = None):
        self.name = name
        self._lock = threading.Lock()
        self.plan = plan or FaultPlan()
        self._rng = random.Random(self.plan.seed)
        self.counts: Counter[str] = Counter()
        self.ops = 0
        self._schedule: list[tuple[int, FaultPlan]] = []
        self._used: int | None = None  # bytes under the root; computed when a capacity is first set
        self.root = ""
        self._state_dir = state_dir if state_dir is not None else os.environ.get(ENV_DIR, "")
        self._state_mtime = 0.0
        self._next_poll = 0.0
        self._next_publish = 0.0
        self._published: dict[str, int] = {}

    # ---------------------------------------------------------------- run-time switches (tests)
    def set(self, plan: FaultPlan | None = None, **changes: Any) -> "FaultControl":
        """Replace the plan (or change some fields). A new seed restarts the RNG."""
        with self._lock:
            new = replace(plan or self.plan, **changes)
            if new.seed != self.plan.seed:
                self._rng = random.Random(new.seed)
            if new.capacity_bytes != self.plan.capacity_bytes:
                self._used = None
            self.plan = new
        return self

    def calm(self) -> "FaultControl":
        return self.set(FaultPlan(seed=self.plan.seed))

    def down(self) -> "FaultControl":
        return self.set(down=True)

    def up(self) -> "FaultControl":
        return self.set(down=False)

    def schedule(self, steps: Sequence[tuple[int, FaultPlan]]) -> "FaultControl":
        """Switch to ``plan`` once ``ops`` reaches ``at_op``, for each ``(at_op, plan)``."""
        with self._lock:
            self._schedule = sorted(steps, key=lambda s: s[0])
        return self

    # ---------------------------------------------------------------- decisions (the filesystem)
    def _poll_file(self) -> None:
        if not self._state_dir:
            return
        now = time.monotonic()
        if now >= self._next_poll:
            self._next_poll = now + _POLL_S
            path = os.path.join(self._state_dir, f"{self.name}.json")
            try:
                mtime = os.stat(path).st_mtime_ns
                if mtime != self._state_mtime:
                    with open(path) as fh:
                        doc = json.load(fh)
                    self._state_mtime = mtime
                    self.set(FaultPlan(**doc))
            except FileNotFoundError:
                pass
            except (OSError, ValueError, TypeError) as exc:
                log.warning("fault plan %s unreadable: %s", path, exc)
        if now >= self._next_publish:
            self._next_publish = now + _PUBLISH_S
            snap = dict(self.counts)
            if snap != self._published:
                self._published = snap
                _atomic_json(os.path.join(self._state_dir, f"{self.name}.counts.json"), snap)

    def step(self, op: str) -> FaultPlan:
        """Count one operation, apply the schedule, inject latency; the plan that applies."""
        self._poll_file()
        with self._lock:
            self.ops += 1
            while self._schedule and self._schedule[0][0] <= self.ops:
                _, nxt = self._schedule.pop(0)
                if nxt.seed != self.plan.seed:
                    self._rng = random.Random(nxt.seed)
                self.plan = nxt
                self._used = None
            plan = self.plan
            delay = plan.latency_s if plan.latency_p and self._rng.random() < plan.latency_p else 0.0
            if delay:
                self.counts["latency"] += 1
            if plan.down:
                self.counts["down"] += 1
            elif plan.unreachable:
                self.counts["unreachable"] += 1
        if delay:
            time.sleep(delay)
        if plan.down:
            raise FileNotFoundError(errno.ENOENT, f"faulty target {self.name} is down (injected)")
        if plan.unreachable:
            raise PermissionError(errno.EACCES, f"faulty target {self.name}: access denied (injected)")
        return plan

    def draw(self, kind: str, p: float) -> bool:
        """True (and counted) with probability ``p``."""
        if p <= 0:
            return False
        with self._lock:
            hit = self._rng.random() < p
            if hit:
                self.counts[kind] += 1
        return hit

    def randrange(self, n: int) -> int:
        with self._lock:
            return self._rng.randrange(max(n, 1))

    def reserve(self, nbytes: int, cap: int) -> bool:
        """Account ``nbytes`` more under the root; False (counted as enospc) if over ``cap``."""
        with self._lock:
            if self._used is None:
                self._used = _du(self.root)
            if cap and self._used + nbytes > cap:
                self.counts["enospc"] += 1
                return False
            self._used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            if self._used is not None:
                self._used = max(0, self._used - nbytes)


_CONTROLS: dict[str, FaultControl] = {}
_CONTROLS_LOCK = threading.Lock()


def control(name: str, plan: FaultPlan | None = None) -> FaultControl:
    """The control of ``faulty://NAME``, created on first use; ``plan`` resets it."""
    with _CONTROLS_LOCK:
        c = _CONTROLS.get(name)
        if c is None or plan is not None:
            old = c
            c = _CONTROLS[name] = FaultControl(name, plan)
            if old is not None:
                c.root = old.root
        return c


def write_plan(state_dir: str, name: str, plan: FaultPlan) -> None:
    """Set the plan of ``faulty://NAME`` in other processes (they poll ``state_dir``)."""
    _atomic_json(os.path.join(state_dir, f"{name}.json"), dataclasses.asdict(plan))


def read_counts(state_dir: str, name: str) -> dict[str, int]:
    try:
        with open(os.path.join(state_dir, f"{name}.counts.json")) as fh:
            return {k: int(v) for k, v in json.load(fh).items()}
    except (OSError, ValueError):
        return {}


def faulty_url(name: str, inner_dir: str) -> str:
    return f"{SCHEME}://{name}{os.path.abspath(inner_dir)}"


def _atomic_json(path: str, doc: Any) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with open(tmp, "w") as fh:
        json.dump(doc, fh)
    os.replace(tmp, path)


def _du(root: str) -> int:
    total = 0
    for d, _dirs, files in os.walk(root):
        for f in files:
            try:
                total += os.stat(os.path.join(d, f)).st_size
            except FileNotFoundError:
                pass
    return total


class FaultyFileSystem(AbstractFileSystem):
    """The fsspec side: the operations ``kvstore.embedded.targets.Target`` calls, with faults."""

    protocol = SCHEME
    cachable = False

    def __init__(self, control_name: str = "", **kwargs: Any):
        super().__init__(**kwargs)
        self.control = control(control_name)

    @classmethod
    def _strip_protocol(cls, path: str) -> str:
        if path.startswith(f"{SCHEME}://"):
            rest = path[len(SCHEME) + 3:]
            path = "/" + rest.partition("/")[2]
        return path.rstrip("/") or "/"

    @staticmethod
    def _get_kwargs_from_urls(path: str) -> dict:
        if path.startswith(f"{SCHEME}://"):
            name = path[len(SCHEME) + 3:].partition("/")[0]
            root = FaultyFileSystem._strip_protocol(path)
            c = control(name)
            if not c.root:
                c.root = root
            return {"control_name": name}
        return {}

    # ---------------------------------------------------------------- metadata
    def isdir(self, path: str) -> bool:
        self._refuse_if_unreachable()
        return not self.control.plan.down and os.path.isdir(self._strip_protocol(path))

    def exists(self, path: str, **kwargs: Any) -> bool:
        self._refuse_if_unreachable()
        return not self.control.plan.down and os.path.exists(self._strip_protocol(path))

    def _refuse_if_unreachable(self) -> None:
        if self.control.plan.unreachable:
            self.control.draw("unreachable", 1.0)  # counted
            raise PermissionError(errno.EACCES, f"faulty target {self.control.name}: access denied (injected)")

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self.control.step("mkdir")
        os.makedirs(self._strip_protocol(path), exist_ok=exist_ok)

    def info(self, path: str, **kwargs: Any) -> dict:
        self.control.step("info")
        p = self._strip_protocol(path)
        st = os.stat(p)
        return {"name": p, "size": st.st_size, "type": "directory" if os.path.isdir(p) else "file",
                "mtime": st.st_mtime}

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> list:
        self.control.step("ls")
        p = self._strip_protocol(path)
        names = [os.path.join(p, n) for n in sorted(os.listdir(p))]
        return [self.info(n) for n in names] if detail else names

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False,
             detail: bool = False, **kwargs: Any) -> Any:
        self.control.step("walk")
        root = self._strip_protocol(path)
        out: dict[str, dict] = {}
        for d, _dirs, files in os.walk(root):
            for f in files:
                p = os.path.join(d, f)
                try:
                    st = os.stat(p)
                except FileNotFoundError:
                    continue
                out[p] = {"name": p, "size": st.st_size, "type": "file", "mtime": st.st_mtime}
        return out if detail else sorted(out)

    # ---------------------------------------------------------------- data
    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        c = self.control
        plan = c.step("read")
        if c.draw("read_error", plan.read_error_p):
            raise OSError(errno.EIO, f"injected read error on {c.name}")
        with open(self._strip_protocol(path), "rb") as fh:
            if start:
                fh.seek(start)
            data = fh.read() if end is None else fh.read(max(0, end - (start or 0)))
        if data and c.draw("corrupt_read", plan.corrupt_read_p):
            i = c.randrange(len(data) * 8)
            buf = bytearray(data)
            buf[i // 8] ^= 1 << (i % 8)
            data = bytes(buf)
        return data

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        c = self.control
        plan = c.step("write")
        if c.draw("write_error", plan.write_error_p):
            raise OSError(errno.EIO, f"injected write error on {c.name}")
        if c.draw("enospc", plan.enospc_p) or not c.reserve(len(value), plan.capacity_bytes):
            raise OSError(errno.ENOSPC, f"No space left on device (injected on {c.name})")
        if c.draw("short_write", plan.short_write_p):
            value = bytes(value)[: c.randrange(len(value))]
        p = self._strip_protocol(path)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as fh:
            fh.write(value)

    def mv(self, path1: str, path2: str, recursive: bool = False, maxdepth: int | None = None,
           **kwargs: Any) -> None:
        self.control.step("rename")
        os.rename(self._strip_protocol(path1), self._strip_protocol(path2))

    def rm_file(self, path: str) -> None:
        self.control.step("delete")
        p = self._strip_protocol(path)
        size = os.stat(p).st_size
        os.unlink(p)
        self.control.release(size)

    def _rm(self, path: str) -> None:
        self.rm_file(path)
