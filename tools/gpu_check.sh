#!/usr/bin/env bash
# GPU check for the engine plugin: CUDA correctness tests + H2D transfer benchmark (< 8 min).
#
# Exact command (from the repository root; results land in $OUT, default ./gpu_check_out):
#     OUT=gpu_check_out bash tools/gpu_check.sh
#
# Steps, each with its own timeout so the whole script stays under 8 minutes:
#   1. environment: nvidia-smi, torch + CUDA versions                         (~5 s)
#   2. pytest -m gpu tests/engine_plugin (store hit on CUDA == cold, pinned staging reuse) (<= 180 s)
#   3. H2D micro-benchmark: pinned vs pageable GB/s (non_blocking), and the overlap of a
#      side-stream copy with compute on the default stream                    (<= 120 s)
#   4. bench_engine.py on CUDA, one 4k size: TTFT cold vs hit per tier, plugin load GB/s (<= 150 s)
# Exit status: non-zero if any step failed; the JSON files say which numbers were measured.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
status=0

echo "== 1. environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/nvidia_smi.txt" || true
"$PY" -c 'import torch,sys; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available()); sys.exit(0 if torch.cuda.is_available() else 3)' \
  || { echo "CUDA not available: nothing to check"; exit 3; }

echo "== 2. CUDA correctness tests"
timeout 180 "$PY" -m pytest tests/engine_plugin/test_gpu.py -m gpu -o addopts="" -q -rs \
  --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 3. H2D benchmark (pinned vs pageable, overlap with compute)"
timeout 120 "$PY" - "$OUT/h2d.json" <<'PYEOF' 2>&1 | tee "$OUT/h2d.txt"
import json, sys, time
import torch

dev = torch.device("cuda")
res = {"device": torch.cuda.get_device_name(dev)}


def timed(fn, reps=5):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[len(ts) // 2]


for mib in (4, 64, 512):
    n = mib << 20
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True).fill_(1)
    pageable = torch.empty(n, dtype=torch.uint8).fill_(1)
    tp = timed(lambda: dst.copy_(pinned, non_blocking=True))
    tq = timed(lambda: dst.copy_(pageable, non_blocking=True))
    back = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    td = timed(lambda: back.copy_(dst, non_blocking=True))
    res[f"{mib}MiB"] = {"h2d_pinned_GBps": n / tp / 1e9, "h2d_pageable_GBps": n / tq / 1e9,
                        "d2h_pinned_GBps": n / td / 1e9, "pinned_over_pageable": tq / tp}

# overlap: a side-stream copy of 512 MiB vs matmuls on the default stream
n = 512 << 20
src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
dst = torch.empty(n, dtype=torch.uint8, device=dev)
a = torch.randn(8192, 8192, device=dev)
side = torch.cuda.Stream()


def compute():
    for _ in range(8):
        a @ a


def copy():
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)


def both():
    copy(); compute()


tc, tx, tb = timed(compute), timed(copy), timed(both)
res["overlap"] = {"compute_s": tc, "copy_s": tx, "both_s": tb,
                  "hidden_share_of_shorter": (tc + tx - tb) / min(tc, tx)}
print(json.dumps(res, indent=2))
json.dump(res, open(sys.argv[1], "w"), indent=2)
PYEOF
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== 4. reference engine on CUDA (TTFT per tier, plugin load throughput)"
timeout 150 "$PY" tools/bench_engine.py --device cuda --sizes 4096 --reps 2 --agree-n 0 \
  --out "$OUT/bench_engine_cuda.json" 2>&1 | tee "$OUT/bench_engine_cuda.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== done (status $status); results in $OUT"
exit $status
