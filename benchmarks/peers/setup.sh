#!/usr/bin/env bash
# Prepares the side-by-side peer benchmark (benchmarks/peers/run.py), idempotently, on Debian 12:
#   * Debian packages: libibverbs1 (the Mooncake wheel links libibverbs even for the TCP transport)
#     and redis-server (the Redis peer; run.py starts its own instance, the Debian service is stopped);
#   * benchmarks/peers/.venv-mooncake: a virtual environment of its own (gitignored) holding
#     mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION and redis-py (with hiredis) -- neither goes into
#     the kvpool venv;
#   * locates the mooncake_master binary shipped inside the wheel and checks it runs.
# Prints what it did. Re-running it does nothing that is already done.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${PEERS_VENV:-$HERE/.venv-mooncake}"
MOONCAKE_PKG="mooncake-transfer-engine-non-cuda"
MOONCAKE_VERSION="${MOONCAKE_VERSION:-0.3.13.post1}"
REDIS_PY="redis[hiredis]==5.2.1"
PYTHON="${PYTHON:-python3}"
t0=$(date +%s)
say() { echo "peers/setup: $*"; }
# pip install, without the warnings this machine's pip.conf produces about absent local mirrors
pip_install() { "$VENV/bin/python" -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither" >&2); }

# --- Debian packages -------------------------------------------------------------------------------
need=()
dpkg-query -W -f='${Status}' libibverbs1 2>/dev/null | grep -q "install ok installed" || need+=(libibverbs1)
command -v redis-server >/dev/null || need+=(redis-server)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    say "not root; missing Debian packages: ${need[*]} (apt-get install ${need[*]})" >&2
    exit 1
  fi
  say "apt-get install ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  # Debian starts a redis-server service on 6379 when it can; the benchmark runs its own instance.
  if command -v systemctl >/dev/null && systemctl is-active --quiet redis-server 2>/dev/null; then
    systemctl stop redis-server || true
    systemctl disable redis-server >/dev/null 2>&1 || true
    say "stopped and disabled the Debian redis-server service (run.py starts its own)"
  fi
else
  say "Debian packages present: libibverbs1, redis-server ($(redis-server --version | awk '{print $3}'))"
fi

# --- the peers' venv -------------------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV ($("$PYTHON" --version 2>&1))"
  "$PYTHON" -m venv "$VENV"
  pip_install --upgrade pip
fi
installed="$("$VENV/bin/python" -m pip show "$MOONCAKE_PKG" 2>/dev/null | awk '/^Version:/{print $2}' || true)"
if [ "$installed" != "$MOONCAKE_VERSION" ]; then
  # Is the exact version on PyPI (for this Python)? If not, say so and take the newest available.
  tmp="$(mktemp -d)"
  if "$VENV/bin/python" -m pip download -q --no-deps -d "$tmp" "$MOONCAKE_PKG==$MOONCAKE_VERSION" \
       >/dev/null 2>&1; then
    spec="$MOONCAKE_PKG==$MOONCAKE_VERSION"
    say "$MOONCAKE_PKG==$MOONCAKE_VERSION is on PyPI; installing it"
    pip_install "$tmp"/*.whl
  else
    spec="$MOONCAKE_PKG"
    say "WARNING: $MOONCAKE_PKG==$MOONCAKE_VERSION is not on PyPI for $("$VENV/bin/python" --version);" \
        "installing the newest available version instead" >&2
    pip_install "$spec"
  fi
  rm -rf "$tmp"
else
  say "$MOONCAKE_PKG $installed already installed"
fi
if ! "$VENV/bin/python" -c "import redis, hiredis" 2>/dev/null; then
  say "installing $REDIS_PY"
  pip_install "$REDIS_PY"
else
  say "redis-py $("$VENV/bin/python" -c 'import redis; print(redis.__version__)') already installed"
fi

# --- mooncake_master ---------------------------------------------------------------------------------
pkgdir="$("$VENV/bin/python" -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))')"
master="$pkgdir/mooncake_master"
if [ ! -f "$master" ]; then
  say "ERROR: no mooncake_master in $pkgdir" >&2
  exit 1
fi
[ -x "$master" ] || chmod +x "$master"
# The binary loads the wheel's bundled libraries through its RPATH; check none is missing
# (gflags' --help exits non-zero, so it cannot serve as the check).
if ldd "$master" | grep -q 'not found'; then
  ldd "$master" | grep 'not found' >&2
  say "ERROR: $master is missing shared libraries" >&2
  exit 1
fi
help_text="$("$master" --help 2>&1 || true)"
grep -q -- '-rpc_port' <<<"$help_text" || { say "ERROR: $master does not run" >&2; exit 1; }
"$VENV/bin/python" -c "from mooncake.store import MooncakeDistributedStore" \
  || { say "ERROR: mooncake.store does not import (libibverbs1 missing?)" >&2; exit 1; }
version="$("$VENV/bin/python" -m pip show "$MOONCAKE_PKG" | awk '/^Version:/{print $2}')"
say "ready in $(( $(date +%s) - t0 )) s: venv $VENV, $MOONCAKE_PKG $version, mooncake_master $master," \
    "redis-server $(command -v redis-server)"
