"""The entrypoint's configuration: one frozen record, checked when it is made.

``EntrypointConfig`` is built by ``entrypoint.__main__`` from its flags (or by a caller of
``entrypoint.server.serve``) and read by every part of the entrypoint: the service
(``entrypoint.server``), the request path (``entrypoint.generate``) and the dispatch of its
hops (``entrypoint.dispatch``). A value that could never work (a negative bound, an unknown
policy, two tenants with one salt) raises ``kvstore.InvalidRequest`` naming the field, before
anything is started.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import kvstore
from entrypoint.auth import check_secret
from entrypoint.client_tokens import ClientAuth
from entrypoint.tls import ChannelTLS
from kvstore.keys import Namespace
from lb.registry import KINDS


@dataclass(frozen=True, slots=True)
class EntrypointConfig:
    """Every setting of one entrypoint (``__post_init__`` checks them)."""

    namespace: Namespace
    block_size: int = 16
    tenants: dict[str, bytes] = field(default_factory=lambda: {"default": b""})
    prefill_policy: str = "kvstack"
    decode_policy: str = "kvstack"
    ve_policy: str = "kvstack"
    max_attempts: int = 3
    max_inflight: int = 64
    # Bound on a unary worker call (Encode, Prefill: a long cold prefill on a CPU takes minutes), and on
    # a Decode stream's wait for its next event (its first included), not on the stream's length
    # (entrypoint.generate, "Deadlines"). A worker that misses it is marked down and the hop fails over.
    worker_timeout_s: float = 3600.0
    default_max_new_tokens: int = 16
    kv_bytes_per_token: float = 0.0  # the served model's global KV per token (0: the LB cost model's own)
    # Bound on prompt + max_new_tokens of one request (0: none). A request over it could never be
    # decoded (no pool holds it), so it is refused before its prefill, not after.
    max_model_len: int = 0
    # Shared secret of the membership calls and of every call to a worker ("": none; see
    # entrypoint.auth). Not in repr: logs.
    worker_secret: str = field(default="", repr=False)
    # Client bearer token -> tenant ({}: the request's tenant field is trusted; entrypoint.client_tokens).
    # Not in repr: logs.
    client_tokens: dict[str, str] = field(default_factory=dict, repr=False)
    # (low, high) s: a retry after INTERNAL/UNKNOWN waits a time drawn uniformly from it (at most the
    # client's remaining time), so the requests of one failed engine step do not share a step again.
    retry_backoff_s: tuple[float, float] = (0.02, 0.1)
    # How the entrypoint dials its workers (entrypoint.tls, hop 2): None: each worker's registered
    # address decides (grpcs:// with the system roots); set: TLS with these files, and a worker
    # that registers a plaintext address is refused.
    worker_tls: ChannelTLS | None = None
    # A worker whose last avoid_after calls all ended without progress (INTERNAL/UNKNOWN, a missed
    # worker_timeout_s, or the client's deadline passing with neither a reply nor a token from it) is left out
    # of the picks for avoid_for_s s while another worker of its role is up; the strikes never mark it down
    # (entrypoint.health; entrypoint.generate, "Avoided workers").
    avoid_after: int = 3
    avoid_for_s: float = 30.0

    def __post_init__(self) -> None:
        """Checked here, before anything is started (``InvalidRequest`` naming the field)."""
        for name, low in (("block_size", 1), ("max_attempts", 1), ("max_inflight", 1),
                          ("default_max_new_tokens", 1), ("max_model_len", 0), ("avoid_after", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise kvstore.InvalidRequest(f"EntrypointConfig.{name} must be an int >= {low}, got {v!r}")
        if not (math.isfinite(self.worker_timeout_s) and self.worker_timeout_s > 0):
            raise kvstore.InvalidRequest(f"worker_timeout_s must be a finite number > 0, got {self.worker_timeout_s!r}")
        if not (math.isfinite(self.avoid_for_s) and self.avoid_for_s >= 0):
            raise kvstore.InvalidRequest(f"avoid_for_s must be a finite number >= 0, got {self.avoid_for_s!r}")
        b = self.retry_backoff_s
        if not (isinstance(b, tuple) and len(b) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                              and math.isfinite(x) for x in b) and 0 <= b[0] <= b[1]):
            raise kvstore.InvalidRequest(f"retry_backoff_s must be a tuple (low, high) of finite numbers of seconds "
                                         f"with 0 <= low <= high, got {b!r}")
        if not (math.isfinite(self.kv_bytes_per_token) and self.kv_bytes_per_token >= 0):
            raise kvstore.InvalidRequest(f"kv_bytes_per_token must be a finite number >= 0, "
                                         f"got {self.kv_bytes_per_token!r}")
        if not isinstance(self.worker_secret, str):
            raise kvstore.InvalidRequest(f"worker_secret must be a str, got {type(self.worker_secret).__name__}")
        if self.worker_secret:
            check_secret(self.worker_secret, "EntrypointConfig.worker_secret")
        if self.worker_tls is not None and not isinstance(self.worker_tls, ChannelTLS):
            raise kvstore.InvalidRequest(f"worker_tls must be an entrypoint.tls.ChannelTLS or None, "
                                         f"got {type(self.worker_tls).__name__}")
        # Tenants are isolated only by their salt (it enters every block key): an empty salt
        # shares every key with ``default``, and two tenants with one salt share each other's.
        seen: dict[bytes, str] = {}
        for tenant, salt in self.tenants.items():
            if not isinstance(salt, bytes):
                raise kvstore.InvalidRequest(f"tenant {tenant!r}: its salt must be bytes, got {type(salt).__name__}")
            if not salt and tenant != "default":
                raise kvstore.InvalidRequest(f"tenant {tenant!r} has an empty salt: it would share every KV key "
                                             "with tenant 'default'; give it a distinct non-empty salt")
            if salt in seen:
                raise kvstore.InvalidRequest(f"tenants {seen[salt]!r} and {tenant!r} have the same salt: they would "
                                             "share every KV key; give each a distinct salt")
            seen[salt] = tenant
        ClientAuth(self.client_tokens).check_tenants(self.tenants)
        for kind, name in (("prefill", self.prefill_policy), ("decode", self.decode_policy), ("ve", self.ve_policy)):
            if name not in KINDS[kind]:
                raise kvstore.InvalidRequest(f"unknown {kind} policy {name!r}; known: {', '.join(sorted(KINDS[kind]))}")
