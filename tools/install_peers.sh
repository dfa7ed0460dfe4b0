#!/usr/bin/env bash
# Install the system packages the tests and benchmarks need (idempotent).
#
#   bash tools/install_peers.sh            # as root (or with sudo available)
#
# * redis-server (Debian package) for the Redis peer; the bench starts its own
#   instance on a loopback port and stops it afterwards.
# * chromium (Debian package) to render the walkthrough report in the tests.
# * redis-py + hiredis and py-lmdb into the active or the project venv (.venv),
#   if one exists (else the `bench` extra brings them).
# Safe to run again: every step checks first and does nothing if satisfied.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Debian packages: command -> package. redis-server is a benchmark peer; chromium renders
# the walkthrough's HTML report in tests/walkthrough (headless, offline).
declare -A DEB=([redis-server]=redis-server [chromium]=chromium)
missing=()
for cmd in "${!DEB[@]}"; do
    if command -v "$cmd" >/dev/null 2>&1; then echo "$cmd: present"; else missing+=("${DEB[$cmd]}"); fi
done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
            echo "missing ${missing[*]} and not root (no sudo): install with apt-get install ${missing[*]}" >&2
            exit 1
        fi
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    # --no-install-recommends: no services are enabled by us; the tests start what they need.
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    echo "installed: ${missing[*]}"
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
