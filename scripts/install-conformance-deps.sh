#!/usr/bin/env bash
# Installs what tests/conformance needs into a venv (default .venv), idempotently:
#   torch 2.13.0 (the CPU wheel: pip's find-links on these machines; a plain `torch` would pull CUDA),
#   sglang 0.5.23 WITHOUT its dependencies (it pins torch 2.14.1 and ~70 GPU packages; the tests import only
#   its storage interface through a light-package shim, see tests/conformance/sglang_shim.py),
#   transformers 5.24.0 (the tiny random Llama of the end-to-end model check; its cache API is moving,
#   so it is pinned).
# Usage: scripts/install-conformance-deps.sh [VENV]     Prints how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "install-conformance-deps: no python at $PY (make venv first)" >&2; exit 1; }

TORCH=2.13.0
SGLANG=0.5.23
TRANSFORMERS=5.24.0
start=$(date +%s)

have() {  # have DIST VERSION: is exactly that version installed in the venv?
  "$PY" - "$1" "$2" <<'PYEOF'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    ok = version(sys.argv[1]).split("+")[0] == sys.argv[2]
except PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
PYEOF
}

pip_install() {  # quiet; the resolver's complaints about sglang's ~70 unmet GPU pins are expected
  local log
  log=$(mktemp)
  if ! "$PY" -m pip install -q --disable-pip-version-check "$@" >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    return 1
  fi
  rm -f "$log"
}

# Fail early with a clear message when the CPU wheel is not where pip looks: a CUDA torch is GBs.
have torch "$TORCH" || pip_install "torch==$TORCH" --only-binary=:all:
have sglang "$SGLANG" || pip_install --no-deps "sglang==$SGLANG"
have transformers "$TRANSFORMERS" || pip_install "transformers==$TRANSFORMERS"
# numpy: torch warns without it and .numpy() needs it (kvpool depends on it anyway).
"$PY" -c "import numpy" 2>/dev/null || pip_install numpy

"$PY" - <<'PYEOF'
import importlib.util, sys, types
import torch, transformers
# The same light-package shim the tests use: import the storage interface without sglang/__init__.py.
spec = importlib.util.find_spec("sglang")
pkg = types.ModuleType("sglang"); pkg.__path__ = list(spec.submodule_search_locations); pkg.__spec__ = spec
sys.modules["sglang"] = pkg
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage  # noqa: F401
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: F401
print(f"install-conformance-deps: torch {torch.__version__}, transformers {transformers.__version__}, sglang interface OK")
PYEOF
echo "install-conformance-deps: done in $(( $(date +%s) - start )) s"
