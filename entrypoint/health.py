"""Strikes: the workers a pick leaves out for a while though they are up, and why.

``entrypoint.dispatch`` and the decode step of ``entrypoint.generate`` call ``Strikes.record`` when a
worker call ends, and ``Strikes.tiers`` to order the live workers of a role before every pick.

Some outcomes take no worker down, yet a worker that has only those is worth leaving alone
(``entrypoint.generate``'s module docstring, "Avoided workers"):

  ``FAILED_HERE``  the call failed INTERNAL or UNKNOWN: retried elsewhere, the worker stays up.
                   A worker whose handler fails every call still answers ``Status`` and looks idle
                   in its load, so without strikes every new request tried it first and paid one
                   failed attempt and a backoff there.
  ``NO_PROGRESS``  the call ran out of the client's deadline with no progress from the worker (a
                   unary call with no reply; a decode stream that sent no token in that attempt),
                   whether it failed DEADLINE_EXCEEDED or grpc cancelled it at that deadline.
                   The deadline is the client's, so the worker is not marked down; but an engine
                   that hangs while its ``Status`` still answers gets only these when clients send
                   short deadlines, and without strikes it took every request for ever.
                   A call that misses ``worker_timeout_s`` with no progress (a unary call with no
                   reply; a decode stream cancelled by its stall watch before a token in that
                   attempt) is one too, besides marking the worker down: ``mark_down`` only sets
                   the registration's ``healthy`` flag, and the next heartbeat that its ``Status``
                   answers sets it back on the same ``Instance``, strikes kept: without the strike
                   such a hung engine would be back up within a heartbeat, never avoided, and every
                   new request would pay a full ``worker_timeout_s`` there first.
  ``STALLED``      a decode stream that sent tokens in that attempt, then no event for
                   ``worker_timeout_s``: its stall watch cancelled it, the worker is marked down and
                   the stream resumes elsewhere after the tokens sent. Its tokens do not clear the
                   strikes (a stream's progress is counted when it ends, and this one ended stalled).
                   Were such a stall to count nothing, an engine that hangs a few tokens into every
                   request would be back at the next heartbeat and take (and stall) every new one.

One such call says little (a healthy but slow worker, one client in a hurry), many in a row do.

Each is a strike on that registration (``Instance.strikes``); a call with ``PROGRESS`` (a unary
reply, a decode stream that sent a token and did not end stalled) sets the count back to 0. At ``avoid_after``
strikes in a row the worker is avoided for ``avoid_for_s``: a pick leaves it out while any
other worker of the role is up, not avoided, and admitted by the LB. When that time is over it is picked as any other;
its count is still ``avoid_after`` or more, so one more strike avoids it again at once (a broken
worker costs one request per ``avoid_for_s``), and one success clears it.

Invariants:
  1. A strike never marks a worker down, and avoidance never refuses a request: the pick offers the
     LB the preferred workers first (``tiers``) and, when it admits none of them (KV full, an SLO
     missed), the wider tiers, so with no other worker up, or none other with room, an avoided one
     (or one that failed this request) is picked all the same: a request is never refused
     RESOURCE_EXHAUSTED while an avoided worker is idle with room. So a single poison request (it
     fails wherever it goes) costs each worker it tried one strike, and nothing more.
  2. The other outcomes (a ``RETRYABLE`` status, which marks the worker down instead, but for a
     missed ``worker_timeout_s`` without progress and a decode stream stalled after tokens, above;
     a status that is the request's fault; the client going away) neither count nor reset: they
     say nothing of whether the worker serves.
  3. A worker registered again is a new ``Instance``: its count starts at 0. Marked down and back
     up by the heartbeat, it is the same ``Instance``: its count and avoidance stay.

``Instance.strikes``/``avoid_until`` are read and written under the lock given to ``Strikes``
(the service's one lock, which ``Dispatch`` shares).
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from entrypoint.instances import Instance

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    """How a worker call ended, as far as its worker's standing goes (module docstring)."""

    PROGRESS = "progress"  # a reply, or a decode token: clears the strikes
    FAILED_HERE = "failed here"  # INTERNAL/UNKNOWN: a strike
    # neither a reply nor a token in the client's time, or in worker_timeout_s: a strike
    NO_PROGRESS = "no progress by the client's deadline or worker_timeout_s"
    # a decode stream that sent tokens, then nothing for worker_timeout_s: a strike
    STALLED = "a decode stream stalled for worker_timeout_s after tokens"


@dataclass(frozen=True, slots=True)
class StrikePolicy:
    """``avoid_after`` strikes in a row avoid a worker for ``avoid_for_s`` (``clock``'s seconds)."""

    avoid_after: int
    avoid_for_s: float
    clock: Callable[[], float] = time.monotonic


class Strikes:
    """Counts strikes per registration and narrows picks (see the module docstring)."""

    def __init__(self, policy: StrikePolicy, lock: threading.Lock):
        self.policy, self._lock = policy, lock

    def record(self, inst: Instance, outcome: Outcome) -> None:
        """Count ``outcome`` of a call on ``inst`` that just ended."""
        p = self.policy
        with self._lock:
            if outcome is Outcome.PROGRESS:
                if inst.avoid_until:
                    log.info("worker %s serves again: no longer avoided", inst.worker_id)
                inst.strikes, inst.avoid_until = 0, 0.0
                return
            inst.strikes += 1
            if inst.strikes >= p.avoid_after:
                inst.avoid_until = p.clock() + p.avoid_for_s
                log.warning("worker %s avoided for %g s: %d calls in a row without progress (last: %s)",
                            inst.worker_id, p.avoid_for_s, inst.strikes, outcome.value)

    def avoided(self, inst: Instance) -> bool:
        """Whether picks leave ``inst`` out now, while another worker of its role is up."""
        with self._lock:
            return inst.avoid_until > self.policy.clock()

    def tiers(self, live: list[Instance], failed_here: set[str]) -> list[list[Instance]]:
        """The workers of ``live`` a pick offers the LB, tier by tier, each wider than the one before
        and none empty: those neither avoided nor among ``failed_here`` (the ids that failed this
        request with ``FAILED_HERE``); those not among ``failed_here``; all of ``live``. The LB chooses
        in the first tier where it admits one (``entrypoint.dispatch.Dispatch._choose``). A worker that
        failed this very request is left out before one avoided for its recent calls, as the retry rule
        says (``entrypoint.generate``, "INTERNAL and UNKNOWN"). Takes the lock: call it without it."""
        fresh = [i for i in live if i.worker_id not in failed_here]
        good = [i for i in fresh if not self.avoided(i)]
        out: list[list[Instance]] = []
        for tier in (good, fresh, live):
            if tier and (not out or len(tier) > len(out[-1])):
                out.append(tier)
        return out
