#!/usr/bin/env bash
# Install the system packages the tests and benchmarks need (idempotent).
#
#   bash tools/install_peers.sh            # as root (or with sudo available)
#   bash tools/install_peers.sh --mooncake # also the Mooncake Store peer (tools/bench_remote.py)
#
# * redis-server (Debian package) for the Redis peer; the bench starts its own
#   instance on a loopback port and stops it afterwards.
# * chromium (Debian package) to render the walkthrough report in the tests.
# * redis-py + hiredis and py-lmdb into the active or the project venv (.venv),
#   if one exists (else the `bench` extra brings them).
# * --mooncake: the Debian libraries Mooncake's wheel links against (libibverbs1,
#   librdmacm1, libnuma1), unshare and ip (it runs in a loopback-only network namespace) and its own venv (Mooncake pins its own deps, so not the
#   project's .venv) at $KVSTACK_MOONCAKE_VENV, default <repo>/.bench/mooncake-venv,
#   with `pip install mooncake-transfer-engine-non-cuda`. tools/bench_remote.py looks
#   for it at the same place.
# Safe to run again: every step checks first and does nothing if satisfied.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mooncake=0
for arg in "$@"; do
    case "$arg" in
        --mooncake) mooncake=1 ;;
        -h|--help) sed -n '2,18p' "${BASH_SOURCE[0]}"; exit 0 ;;
        *) echo "unknown option $arg (known: --mooncake)" >&2; exit 2 ;;
    esac
done

# Debian packages: command -> package. redis-server is a benchmark peer; chromium renders
# the walkthrough's HTML report in tests/entrypoint/walkthrough (headless, offline).
declare -A DEB=([redis-server]=redis-server [chromium]=chromium)
missing=()
for cmd in "${!DEB[@]}"; do
    if command -v "$cmd" >/dev/null 2>&1; then echo "$cmd: present"; else missing+=("${DEB[$cmd]}"); fi
done
if [ "$mooncake" -eq 1 ]; then
    # Shared libraries, not commands: ask dpkg.
    for lib in libibverbs1 librdmacm1 libnuma1; do
        if dpkg -s "$lib" 2>/dev/null | grep -q "^Status: install ok installed"; then echo "$lib: present"
        else missing+=("$lib"); fi
    done
    # bench_remote runs Mooncake in a loopback-only network namespace (unshare, ip).
    declare -A NETNS=([unshare]=util-linux [ip]=iproute2)
    for cmd in "${!NETNS[@]}"; do
        if command -v "$cmd" >/dev/null 2>&1; then echo "$cmd: present"; else missing+=("${NETNS[$cmd]}"); fi
    done
fi
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

# Mooncake Store peer: its own venv (see the header).
if [ "$mooncake" -eq 1 ]; then
    mc="${KVSTACK_MOONCAKE_VENV:-${here}/.bench/mooncake-venv}"
    if [ -x "$mc/bin/python" ] && "$mc/bin/python" -c "import mooncake.store" 2>/dev/null \
            && [ -x "$mc/bin/mooncake_master" ]; then
        echo "mooncake: present in $mc"
    else
        base="$(command -v python3)"
        "$base" -m venv "$mc"
        "$mc/bin/python" -m pip install -q mooncake-transfer-engine-non-cuda
        "$mc/bin/python" -c "import mooncake.store" && [ -x "$mc/bin/mooncake_master" ] \
            || { echo "mooncake: installed into $mc but import mooncake.store or mooncake_master failed" >&2; exit 1; }
        echo "mooncake: installed into $mc"
    fi
fi
