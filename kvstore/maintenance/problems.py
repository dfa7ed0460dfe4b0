"""What a consistency check reports, and the progress callback every maintenance pass takes.

``Problem`` is one finding of ``kvstore.maintenance.check`` (and of the orphan sweep,
``kvstore.maintenance.orphans``); the remote clients rebuild the same records from the
daemon's answers (``kvstore.client.admin``, ``kvstore.client.sharded``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

Progress = Callable[[str, int, int], None]  # (phase, done, total)


class ProblemKind(enum.Enum):
    MISSING_FRAGMENT = "missing_fragment"
    CORRUPT_FRAGMENT = "corrupt_fragment"
    LOST_ENTRY = "lost_entry"  # fewer than k good fragments
    ORPHAN_FRAGMENT = "orphan_fragment"  # a file no index record names
    TARGET_DOWN = "target_down"


@dataclass(frozen=True, slots=True)
class Problem:
    kind: ProblemKind
    key: str = ""  # entry key hex ("" for target-level problems)
    entry_kind: str = ""
    target: str = ""
    detail: str = ""
    fixed: bool = False

    def as_dict(self) -> dict:
        return {"kind": self.kind.value, "key": self.key, "entry_kind": self.entry_kind,
                "target": self.target, "detail": self.detail, "fixed": self.fixed}


def no_progress(phase: str, done: int, total: int) -> None:
    pass
