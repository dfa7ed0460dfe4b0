"""The entrypoint's instance registry: who is up, what they hold, how loaded they are.

Workers join (``Register`` RPC, or ``add`` by whoever started them) and leave
(``Deregister``, or by missing heartbeats) at run time; the load balancers see
the registry's current snapshot on every decision, so nothing restarts.

Heartbeat: a thread calls every instance's ``Status`` each ``heartbeat_s``;
``miss_limit`` misses in a row mark it down, and a success marks it up again.
A dispatch failure (``mark_down``) takes effect at once, on the registration that
failed only (not on one that replaced it under the same id since).

Worker secret (``entrypoint.auth``): every channel ``add`` opens sends it on
every call (``Status`` here, and ``Prefill``/``Decode``/``Encode`` from the
entrypoint's dispatch through ``Instance.stub``), after the call's own
metadata. A worker that refuses the first ``Status`` as UNAUTHENTICATED (it
has a secret the entrypoint lacks, or another one) is not added: ``add`` raises
``InvalidRequest``, so its ``Register`` fails and says why.

TLS (``entrypoint.tls``, hop 2): a worker's registered address decides how ``add``
dials it: ``grpcs://HOST:PORT`` over TLS, verified with ``worker_tls`` (``--worker-ca``;
without it, the system roots), else plaintext. With ``worker_tls`` set (any of
``--worker-ca``, ``--worker-cert``/``--worker-key``), a plaintext
address is refused (``InvalidRequest``), so the secret never crosses to a worker in
clear; and a ``grpcs://`` worker whose first ``Status`` fails UNAVAILABLE (its
certificate not signed by that CA, or it requires a client certificate the entrypoint
lacks) is not added: its ``Register`` fails and says what to check.

KV compatibility: a prefill or decode worker declares, in ``Register``, the
namespace and block size its KV keys are hashed with; ``check_kv_compat``
refuses (``IncompatibleWorker``; FAILED_PRECONDITION on the wire) one whose
are not the entrypoint's, or that declares none: the entrypoint's prefix
lookups and routing would assume keys that worker never reads or writes. A VE
worker holds no KV and declares none: ``add`` refuses (``InvalidRequest``;
INVALID_ARGUMENT) a VE worker that declares a namespace or a block size, most
likely a KV worker started with the wrong role, rather than list KV it lacks.

Roles: a worker id keeps its role while it is up. ``add`` refuses
(``IncompatibleWorker``) a worker whose id is registered, and healthy, under
another role (the entrypoint would send a prefill engine ``Encode`` calls, or
count a decode stream against a VE worker): deregister it first, or use a new
id. A worker that is down may be replaced under any role, since crashed
workers never deregister; ``add`` asks the registered one for its ``Status``
first, and one that fails to answer as its role (dead, or the same process
restarted under the other role at its address) is down at once, not after
``miss_limit`` heartbeats. And a worker
whose ``Status`` reports another role than it registered with is refused by
``add`` (``IncompatibleWorker``) and, found by the heartbeat, marked down until
it answers as its role again.

The prefix view per prefill/decode instance is approximate, as in SGLang's
router: the block hashes the entrypoint routed there recently (an LRU bounded
in blocks), standing for that engine's device prefix cache.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import grpc

from entrypoint import auth
from entrypoint.proto import serving_pb2 as pb
from entrypoint.proto import serving_pb2_grpc as pbg
from entrypoint.tls import ChannelTLS, open_channel, split_address
from kvstore.errors import InvalidRequest, KVStoreError
from kvstore.keys import Namespace

log = logging.getLogger(__name__)


KV_ROLES = ("prefill", "decode")  # the roles whose KV keys must be the entrypoint's
_WRONG_ROLE = grpc.StatusCode.FAILED_PRECONDITION  # what _poll returns for a worker that answers as another role
_OTHER_WORKER = grpc.StatusCode.ABORTED  # what _poll returns when another worker answers at the address


class IncompatibleWorker(KVStoreError):
    """A worker whose KV namespace or block size is not the entrypoint's (``check_kv_compat``), or
    whose role is not the one of its id (``Registry.add``; module docstring, Roles)."""


def kv_namespace_pb(ns: Namespace) -> pb.KVNamespace:
    """``ns`` as sent in ``WorkerInfo.kv_namespace``."""
    return pb.KVNamespace(model_id=ns.model_id, kv_layout=ns.kv_layout, dtype=ns.dtype, rank=ns.rank)


def check_kv_compat(info: pb.WorkerInfo, namespace: Namespace, block_size: int) -> None:
    """Refuse (``IncompatibleWorker``) a prefill/decode ``info`` that declares no KV namespace or
    block size, or others than ``namespace`` and ``block_size``; a VE worker passes. A declared
    namespace without a model id is ``InvalidRequest`` (``Namespace``'s own check)."""
    if info.role not in KV_ROLES:
        return
    who, ours = f"{info.role} worker {info.worker_id!r}", f"{namespace.label()} with {block_size}-token blocks"
    if not info.HasField("kv_namespace") or info.block_size == 0:
        raise IncompatibleWorker(f"{who} declares no KV namespace or block size (the entrypoint serves {ours}): "
                                 "upgrade the worker, which sends both when it registers")
    d = info.kv_namespace
    theirs = Namespace(d.model_id, d.kv_layout, d.dtype, d.rank)
    if theirs != namespace or info.block_size != block_size:
        raise IncompatibleWorker(f"{who} hashes its KV as {theirs.label()} with {info.block_size}-token blocks, "
                                 f"the entrypoint as {ours}: the entrypoint's prefix lookups would not be that "
                                 "worker's keys; start it with the entrypoint's --model and --block-size")


@dataclass(frozen=True, slots=True)
class OpenDecode:
    """A decode stream this entrypoint has open on an instance (``Instance.decodes``).

    ``kv_bytes``: the KV the Decode LB counted for it when it was picked (context + max_new_tokens,
    at the LB's bytes per token). ``started_at``: ``time.monotonic()`` when its first event arrived
    (the worker had admitted it and allocated its KV by then); ``None`` before. A ``Status`` asked
    after ``started_at`` counts the stream's KV in its ``kv_used_bytes``; until one has, the pick
    counts ``kv_bytes`` on top of it (``entrypoint.dispatch.Dispatch.decode_snapshot``)."""

    context_tokens: int
    kv_bytes: float
    started_at: float | None = None


@dataclass(slots=True)
class Instance:
    worker_id: str
    role: str
    address: str
    channel: grpc.Channel
    stub: pbg.WorkerStub
    healthy: bool = True
    misses: int = 0
    last_seen: float = 0.0
    status: pb.WorkerStatus | None = None
    prefix: OrderedDict = field(default_factory=OrderedDict)  # block hash -> None, LRU order
    inflight: dict = field(default_factory=dict)  # prefill: slot -> (suffix tokens, cached tokens), as encodes
    kv_namespace: pb.KVNamespace | None = None  # prefill/decode: as declared in Register (checked there)
    block_size: int = 0
    encodes: int = 0  # VE: Encode calls this entrypoint has in flight there (under the entrypoint's lock)
    decodes: dict = field(default_factory=dict)  # decode: slot -> OpenDecode, a stream open there
    # When the Status call that answered ``status`` was sent (time.monotonic()). Written after ``status``:
    # a reader between the two sees the new figures with the older time, and counts more KV, never less.
    status_asked_at: float = 0.0
    closed: bool = False  # set before its channel is closed (replaced by add, taken out by remove)
    strikes: int = 0  # calls in a row that ended without progress (entrypoint.health; the entrypoint's lock)
    avoid_until: float = 0.0  # picks leave it out until then (entrypoint.health's clock), 0: not avoided
    # The worker id its first Status answered with ("": none said): another id at its address later is
    # another process there (a worker restarted under a new id), not this one back up.
    answered_as: str = ""

    def holds(self, h: bytes) -> bool:
        return h in self.prefix


class Registry:
    """Thread-safe registry of workers by role. See the module docstring."""

    def __init__(self, *, heartbeat_s: float = 0.5, miss_limit: int = 3, rpc_timeout_s: float = 1.0,
                 prefix_capacity_blocks: int = 4096, worker_secret: str = "", worker_tls: ChannelTLS | None = None):
        self.heartbeat_s, self.miss_limit, self.rpc_timeout_s = heartbeat_s, miss_limit, rpc_timeout_s
        self.worker_tls = worker_tls  # None: the address decides; set: TLS required (module docstring)
        self._send_secret = auth.client_interceptor(worker_secret)  # None: no secret (the secret is not kept here)
        self.prefix_capacity = prefix_capacity_blocks
        self._lock = threading.Lock()
        self._by_id: dict[str, Instance] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ membership
    def add(self, worker_id: str, role: str, address: str, *, kv_namespace: pb.KVNamespace | None = None,
            block_size: int = 0) -> Instance:
        """Add (or replace) a worker, after one ``Status`` poll. ``kv_namespace``/``block_size``: what
        it declared (``check_kv_compat`` is the caller's: ``Register``), kept for ``ListWorkers``."""
        if not worker_id or not address or role not in ("ve", "prefill", "decode"):
            raise InvalidRequest(f"a worker needs an id, an address and a role in ve/prefill/decode; got "
                                 f"{worker_id!r} {role!r} {address!r}")
        if role not in KV_ROLES and (kv_namespace is not None or block_size):
            raise InvalidRequest(f"{role} worker {worker_id!r} declares a KV namespace or block size, but a {role} "
                                 "worker holds no KV: start it with its own role (prefill or decode?), or send none")
        with self._lock:
            old = self._by_id.get(worker_id)
        if old is not None and old.healthy and old.role != role and self._poll(old) is not None:
            # It no longer answers as its role (it crashed, or this is it restarted as another role
            # at its address): down now, not after ``miss_limit`` heartbeats, so the restart joins.
            self.mark_down(old, f"it no longer answers as a {old.role} worker; {worker_id} re-registers as {role}")
        self._check_role(worker_id, role)  # before the poll: a refused worker is not called
        ch, secure = self._open(worker_id, address)
        if self._send_secret is not None:
            ch = grpc.intercept_channel(ch, self._send_secret)
        inst = Instance(worker_id, role, address, ch, pbg.WorkerStub(ch), last_seen=time.monotonic(),
                        kv_namespace=kv_namespace, block_size=block_size)
        # The LBs need its load and memory figures before its first request. One that would
        # refuse every call is not added, and leaves the worker registered under its id in place.
        polled = self._poll(inst)
        if polled == grpc.StatusCode.UNAUTHENTICATED:
            ch.close()
            raise InvalidRequest(f"worker {worker_id} at {address} refused the entrypoint's Status call as "
                                 f"UNAUTHENTICATED: the worker has a worker secret and the entrypoint has none, or "
                                 f"another one; give both the same ({auth.SECRET_ENV} or --worker-secret-file)")
        if polled == grpc.StatusCode.UNAVAILABLE and secure:
            ch.close()
            raise InvalidRequest(f"worker {worker_id} at {address} did not answer the entrypoint's Status over TLS: "
                                 "its certificate must be signed by the entrypoint's --worker-ca, and if it has "
                                 "--tls-client-ca the entrypoint needs --worker-cert and --worker-key signed by "
                                 "that CA")
        if polled == _WRONG_ROLE:
            ch.close()
            raise IncompatibleWorker(f"worker {worker_id} at {address} registers as {role} but its Status says "
                                     f"{inst.status.role}: register it with the role it serves")

        with self._lock:
            try:
                self._check_role(worker_id, role, locked=True)  # again: another Register may have won the race
            except IncompatibleWorker:
                ch.close()
                raise
            old = self._by_id.pop(worker_id, None)
            self._by_id[worker_id] = inst
        if old is not None:
            old.closed = True
            old.channel.close()
        log.info("worker %s (%s) joined at %s", worker_id, role, address)
        return inst

    def _open(self, worker_id: str, address: str) -> tuple[grpc.Channel, bool]:
        """A channel to a worker at ``address`` and whether it is TLS (module docstring, TLS)."""
        _, secure = split_address(address)
        if self.worker_tls is not None and not secure:
            raise InvalidRequest(f"worker {worker_id} registers the plaintext address {address!r}, but this entrypoint "
                                 f"calls workers over TLS only ({self.worker_tls.given_names() or 'worker_tls'}): "
                                 "start the worker with --tls-cert and --tls-key")
        return open_channel(address, self.worker_tls if secure else None), secure

    def _check_role(self, worker_id: str, role: str, *, locked: bool = False) -> None:
        """``IncompatibleWorker`` when ``worker_id`` is registered, and healthy, under another role
        (module docstring, Roles). ``locked``: the caller holds ``_lock``."""
        if not locked:
            with self._lock:
                return self._check_role(worker_id, role, locked=True)
        old = self._by_id.get(worker_id)
        if old is not None and old.healthy and old.role != role:
            raise IncompatibleWorker(f"worker {worker_id!r} is registered as a {old.role} worker and is up; it cannot "
                                     f"re-register as {role}: deregister it first, or give the {role} worker a new id")

    def remove(self, worker_id: str) -> bool:
        with self._lock:
            inst = self._by_id.pop(worker_id, None)
        if inst is not None:
            inst.closed = True
            inst.channel.close()
            log.info("worker %s left", worker_id)
        return inst is not None

    def instances(self, role: str | None = None) -> list[Instance]:
        with self._lock:
            return [i for i in self._by_id.values() if role is None or i.role == role]

    def ready(self, role: str | None = None) -> list[Instance]:
        """Healthy instances that have answered a heartbeat (their figures are known)."""
        return [i for i in self.instances(role) if i.healthy and i.status is not None]

    def mark_down(self, inst: Instance | str, reason: str) -> None:
        """Mark ``inst`` down at once (a dispatch failure on it). Given an ``Instance``, only that
        registration: if its id was registered again since (``add`` replaced it and closed its
        channel, which is what failed the call), the new registration is left alone. Given an id,
        whichever instance is registered under it now."""
        worker_id = inst if isinstance(inst, str) else inst.worker_id
        with self._lock:
            cur = self._by_id.get(worker_id)
            if cur is None or (not isinstance(inst, str) and cur is not inst):
                return  # gone, or replaced: the failure was the old registration's
            if cur.healthy:
                cur.healthy = False
                cur.misses = self.miss_limit
                log.warning("worker %s marked down: %s", worker_id, reason)

    # ------------------------------------------------------------------ per-instance views
    def routed(self, worker_id: str, hashes: list[bytes]) -> None:
        """Record that these blocks now live (approximately) in that instance's device cache."""
        with self._lock:
            inst = self._by_id.get(worker_id)
            if inst is None:
                return
            for h in hashes:
                inst.prefix[h] = None
                inst.prefix.move_to_end(h)
            while len(inst.prefix) > self.prefix_capacity:
                inst.prefix.popitem(last=False)

    # ------------------------------------------------------------------ heartbeat
    def _poll(self, inst: Instance) -> grpc.StatusCode | None:
        """One heartbeat of ``inst``; the status code of a failed one (``None``: it answered;
        ``_WRONG_ROLE``: it answered as another role, and is down; ``_OTHER_WORKER``: a worker
        other than the one its first Status named answered at its address (one restarted there
        under a new id), and it is down: an engine is never in rotation twice, under its old id
        and its new one)."""
        asked = time.monotonic()
        try:
            st = inst.stub.Status(pb.StatusRequest(), timeout=self.rpc_timeout_s)
        except grpc.RpcError as exc:
            with self._lock:
                inst.misses += 1
                if inst.healthy and inst.misses >= self.miss_limit:
                    inst.healthy = False
                    log.warning("worker %s missed %d heartbeats (%s): down", inst.worker_id,
                                inst.misses, exc.code())
            return exc.code()
        if st.role and st.role != inst.role:  # an empty role: a worker that does not say
            with self._lock:
                inst.status, inst.misses = st, self.miss_limit
                if inst.healthy:
                    inst.healthy = False
                    log.warning("worker %s registered as %s answers as %s: down", inst.worker_id, inst.role, st.role)
            return _WRONG_ROLE
        if st.worker_id and inst.answered_as and st.worker_id != inst.answered_as:
            with self._lock:
                inst.misses = self.miss_limit
                if inst.healthy:
                    inst.healthy = False
                    log.warning("worker %s at %s: worker %s answers there now: down", inst.worker_id,
                                inst.address, st.worker_id)
            return _OTHER_WORKER
        with self._lock:
            inst.answered_as = inst.answered_as or st.worker_id
            inst.status, inst.misses, inst.last_seen = st, 0, time.monotonic()
            inst.status_asked_at = asked  # after status (see Instance.status_asked_at)
            if not inst.healthy:
                log.info("worker %s answers again: up", inst.worker_id)
            inst.healthy = True
        return None

    def poll_once(self) -> None:
        for inst in self.instances():
            self._poll(inst)

    def start(self) -> None:
        def run() -> None:
            while not self._stop.wait(self.heartbeat_s):
                self.poll_once()

        self._thread = threading.Thread(target=run, name="heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        for inst in self.instances():
            inst.channel.close()
