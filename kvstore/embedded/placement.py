"""Placement: which k+m targets hold an entry's fragments.

Rendezvous hashing on the entry key (``kvstore.rendezvous``): every target gets a
score for the key; fragments go to the best-scoring targets, so adding or removing a
target moves only the entries that scored it among their best.

Failure domains: fragments are spread round-robin over domains first (the best
target of each domain, domains ordered by their best score), so with at least
k+m domains no two fragments share one; with fewer, each domain holds as few
fragments as possible. The result is a list of distinct target names, fragment
``i`` going to element ``i``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Sequence

from kvstore.config import TargetSpec
from kvstore.errors import InvalidRequest
from kvstore.rendezvous import score


def place(key: bytes, targets: Sequence[TargetSpec], n: int,
          exclude: Iterable[str] = ()) -> list[str]:
    """Names of ``n`` distinct targets for ``key``, spread over failure domains."""
    excluded = set(exclude)
    live = [t for t in targets if t.name not in excluded]
    if len(live) < n:
        raise InvalidRequest(
            f"need {n} distinct targets, only {len(live)} available ({len(excluded)} excluded)"
        )
    by_domain: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for t in live:
        by_domain[t.domain].append((score(key, t.name.encode("utf-8")), t.name))
    queues = [sorted(v, reverse=True) for v in by_domain.values()]
    queues.sort(key=lambda q: q[0], reverse=True)
    out: list[str] = []
    while len(out) < n:
        for q in queues:
            if q and len(out) < n:
                out.append(q.pop(0)[1])
    return out


def by_spread(spares: Sequence[str], placed: Iterable[str], targets: Sequence[TargetSpec]) -> list[str]:
    """``spares`` (in ``place``'s order) reordered for a fragment to replace one of ``placed``'s
    siblings: those in domains holding the fewest of ``placed`` first, ties in their order. A
    failed target's replacement so keeps the fragments as spread over domains as ``place`` had
    them (the next spare in score order may sit in a domain that already holds one)."""
    dom = {t.name: t.domain for t in targets}
    held: dict[str, int] = defaultdict(int)
    for name in placed:
        held[dom.get(name, "?")] += 1
    return sorted(spares, key=lambda name: held[dom.get(name, "?")])  # stable: ties keep their order


def domains_used(names: Sequence[str], targets: Sequence[TargetSpec]) -> int:
    dom = {t.name: t.domain for t in targets}
    return len({dom.get(n, "?") for n in names})
