"""Process-wide allocator tuning for the store's large buffers (glibc only).

Why: every put and get allocates buffers of 128 KiB and more (erasure-coded
fragments, fragment reads, assembled payloads). By default glibc serves those
with a fresh ``mmap`` each (``M_MMAP_THRESHOLD``, which starts at 128 KiB) and
hands freed heap tops back to the kernel (``M_TRIM_THRESHOLD``), so each buffer
is page-faulted in again, page by page; an erasure-coded encode of a large entry
through ``kvstore.embedded.codec`` then spends most of its time in page faults.

What: ``mallopt(M_MMAP_THRESHOLD, 32 MiB)`` and ``mallopt(M_TRIM_THRESHOLD,
256 MiB)``. The cost: the process keeps up to 256 MiB of freed heap for reuse
instead of returning it at once.

When: once per process, when a store opens with ``StoreConfig.tune_malloc``
(the default; the daemon included), and when a remote client starts reading or
writing fragments itself (``kvstore.client.direct_reads``, ``kvstore.client.direct_writes``); a client
that only talks gRPC leaves the allocator alone. Never when the environment already sets
glibc's malloc tunables (``GLIBC_TUNABLES`` naming ``glibc.malloc.``,
``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``): the operator's choice
wins. On another C library nothing happens. ``tune_malloc`` says which case it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's own upper bound for the dynamic threshold (64-bit)
TRIM_THRESHOLD = 256 * 1024 * 1024

_lock = threading.Lock()
_state: str | None = None


def _operator_set() -> bool:
    env = os.environ
    return ("glibc.malloc." in env.get("GLIBC_TUNABLES", "")
            or "MALLOC_MMAP_THRESHOLD_" in env or "MALLOC_TRIM_THRESHOLD_" in env)


def tune_malloc() -> str:
    """Apply the tuning once; returns ``"applied"``, ``"environment"`` (left to the
    operator's settings), ``"unsupported"`` (not glibc) or ``"failed"``."""
    global _state
    with _lock:
        if _state is not None:
            return _state
        if _operator_set():
            _state = "environment"
        else:
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                libc.gnu_get_libc_version  # glibc only: others have no such symbol
                mallopt = libc.mallopt
            except (OSError, AttributeError):
                _state = "unsupported"
            else:
                mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
                ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
                _state = "applied" if ok else "failed"
        level = logging.WARNING if _state == "failed" else logging.INFO
        log.log(level, "malloc tuning for large buffers: %s (StoreConfig.tune_malloc; see kvstore.embedded.tuning)", _state)
        return _state
