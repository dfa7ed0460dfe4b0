#!/usr/bin/env bash
# Install the peers that tools/bench_store.py compares against (idempotent).
#
#   bash tools/install_peers.sh            # as root (or with sudo available)
#
# * redis-server (Debian package) for the Redis peer; the bench starts its own
#   instance on a loopback port and stops it afterwards.
# * redis-py + hiredis and py-lmdb into the active or the project venv (.venv),
#   if one exists (else the `bench` extra brings them).
# Safe to run again: every step checks first and does nothing if satisfied.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if command -v redis-server >/dev/null 2>&1; then
    echo "redis-server: present ($(redis-server --version | head -1))"
else
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
            echo "redis-server missing and not root (no sudo): install it with apt-get install redis-server" >&2
            exit 1
        fi
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    # --no-install-recommends: redis-tools is enough; no service is enabled by us.
    $SUDO apt-get install -y -qq --no-install-recommends redis-server >/dev/null
    echo "redis-server: installed ($(redis-server --version | head -1))"
fi

# Python clients: only into a virtual environment (the project's .venv, or the active one);
# Debian's system python refuses pip (PEP 668), and CI installs them from the `dev` extra.
py=""
if [ -n "${VIRTUAL_ENV:-}" ] && [ -x "${VIRTUAL_ENV}/bin/python" ]; then py="${VIRTUAL_ENV}/bin/python"
elif [ -x "${here}/.venv/bin/python" ]; then py="${here}/.venv/bin/python"; fi
if [ -z "$py" ]; then
    echo "python clients: no virtual environment found; they come with: pip install -e '.[bench]'"
elif "$py" -c "import redis, hiredis, lmdb" 2>/dev/null; then
    echo "redis-py, hiredis, lmdb: present in $py"
else
    "$py" -m pip install -q "redis>=5" "hiredis>=2" "lmdb>=1.4"
    echo "redis-py, hiredis, lmdb: installed into $py"
fi
