"""Mooncake Store peer for tools/bench_remote.py; runs inside Mooncake's own venv.

    /tmp/mcvenv/bin/python tools/mooncake_peer.py storage METADATA_URL MASTER SECONDS
    /tmp/mcvenv/bin/python tools/mooncake_peer.py bench METADATA_URL MASTER SIZES N BATCH

``storage`` mounts a 2 GiB segment and stays up (the storage process);
``bench`` mounts none (every byte goes over TCP to the storage process) and
prints one JSON line of MiB/s for put/get, single and batched, per size.
Only the standard library and ``mooncake`` are imported here.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    from mooncake.store import MooncakeDistributedStore

    role, meta, master = sys.argv[1], sys.argv[2], sys.argv[3]
    s = MooncakeDistributedStore()
    if role == "storage":
        rc = s.setup("127.0.0.1:17811", meta, 2 << 30, 64 << 20, "tcp", "", master)
        print(json.dumps({"setup": rc}), flush=True)
        time.sleep(float(sys.argv[4]))
        return 0
    sizes = [int(x) for x in sys.argv[4].split(",")]
    n, batch = int(sys.argv[5]), int(sys.argv[6])
    rc = s.setup("127.0.0.1:17812", meta, 0, 512 << 20, "tcp", "", master)
    out: dict = {"setup": rc}
    for size in sizes:
        v = os.urandom(size)
        r: dict = {}
        keys = [f"s{size}-{i}" for i in range(n)]
        t = time.perf_counter()
        for k in keys:
            assert s.put(k, v) == 0
        r["put"] = n * size / (time.perf_counter() - t) / 2**20
        t = time.perf_counter()
        for k in keys:
            assert s.get(k) == v
        r["get"] = n * size / (time.perf_counter() - t) / 2**20
        keys = [f"b{size}-{i}" for i in range(n)]
        t = time.perf_counter()
        for i in range(0, n, batch):
            assert all(x == 0 for x in s.put_batch(keys[i:i + batch], [v] * len(keys[i:i + batch])) or [0])
        r["put_batch"] = n * size / (time.perf_counter() - t) / 2**20
        t = time.perf_counter()
        for i in range(0, n, batch):
            got = s.get_batch(keys[i:i + batch])
            assert all(g == v for g in got)
        r["get_batch"] = n * size / (time.perf_counter() - t) / 2**20
        out[str(size)] = r
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
