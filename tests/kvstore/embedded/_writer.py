"""Child process for the crash and multi-process tests (not a test module).

usage: python -m tests.kvstore.embedded._writer DATA_DIR MODE SEED
MODE "put": put entries forever, printing "ACK <key hex>" after each put returns.
MODE "mixed": put/get/lookup for a bounded number of operations, verifying every read.
"""

from __future__ import annotations

import sys

import numpy as np

import kvstore
from kvstore import NotFound, PutItem


def value(key: bytes) -> bytes:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return rng.integers(0, 8, 3000 + key[0] * 40, dtype=np.uint8).tobytes()


def main() -> int:
    data_dir, mode, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rng = np.random.default_rng(seed)
    if mode == "put":
        s = kvstore.connect(data_dir)  # default durability: fsync on
        print("READY", flush=True)
        while True:
            keys = [rng.bytes(16) for _ in range(int(rng.integers(1, 4)))]
            s.put_many([PutItem(k, value(k)) for k in keys])
            for k in keys:
                print("ACK", k.hex(), flush=True)
    s = kvstore.connect(data_dir, fsync=False, delete_grace_s=5)
    mine: list[bytes] = []
    bad = 0
    for _ in range(300):
        op = rng.integers(0, 3)
        if op == 0 or not mine:
            new = [rng.bytes(16) for _ in range(int(rng.integers(1, 4)))]  # 2 or 3: a batch in packs
            s.put_many([PutItem(k, value(k)) for k in new])
            mine.extend(new)
        elif op == 1:
            k = mine[int(rng.integers(0, len(mine)))]
            try:
                bad += s.get(k) != value(k)
            except NotFound:
                pass  # evicted by the capacity GC: allowed; wrong bytes are not
        else:
            s.lookup(mine[-5:])
    s.close()
    print("BAD", bad, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
