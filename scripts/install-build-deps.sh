#!/usr/bin/env bash
# Installs what building kvpool needs before its venv is made, idempotently, on Debian 12 (as root): a C
# compiler and Python's headers (kvpool.transfer._lanes, the compiled TCP lanes), xxHash's header
# (kvpool.master._index, the master's batched lookup) and Python's venv module. Run by `make venv` (so by
# `make demo` and `make test`) and by .ci/run: without these the extensions are silently not built, the
# slower Python fallbacks run and their tests skip. Without root it only reports what is missing.
set -euo pipefail

need=()
command -v gcc >/dev/null || need+=(gcc libc6-dev)
[ -f /usr/include/xxhash.h ] || need+=(libxxhash-dev)
[ -f /usr/include/infiniband/verbs.h ] || need+=(libibverbs-dev)
python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(sysconfig.get_path("include") + "/Python.h"))' \
  || need+=(python3-dev)
python3 -c 'import ensurepip, venv' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "install-build-deps: not root; missing Debian packages: ${need[*]} (the compiled modules will not be built)" >&2
  fi
fi
