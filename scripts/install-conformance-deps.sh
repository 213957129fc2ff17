#!/usr/bin/env bash
# Installs what tests/conformance needs into a venv (default .venv), idempotently:
#   torch 2.13.0 (the CPU wheel: pip's find-links on these machines; a plain `torch` would pull CUDA),
#   sglang 0.5.23 WITHOUT its dependencies (it pins torch 2.14.1 and ~70 GPU packages; the tests import only
#   its storage interface through a light-package shim, see tests/conformance/sglang_shim.py),
#   transformers 5.24.0 (the tiny random Llama of the end-to-end model check; its cache API is moving,
#   so it is pinned),
#   vllm 0.33.0 and lmcache 0.5.6 WITHOUT their dependencies (both pin CUDA torch builds; 336 MB and 18 MB
#   wheels), then only the CPU packages that the modules the tests import need (VLLM_IMPORT_DEPS: what
#   vllm/distributed/kv_transfer/kv_connector/v1/base.py, v1/request.py and v1/core pull in;
#   LMCACHE_IMPORT_DEPS: lmcache's storage_backend connector and LocalCPUBackend, numba for its CPU ops).
# Usage: scripts/install-conformance-deps.sh [VENV]     Prints how long it took.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-.venv}"
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "install-conformance-deps: no python at $PY (make venv first)" >&2; exit 1; }

TORCH=2.13.0
SGLANG=0.5.23
TRANSFORMERS=5.24.0
VLLM=0.33.0
LMCACHE=0.5.6
VLLM_IMPORT_DEPS=(psutil==7.2.2 pyzmq==27.3.0 cbor2==6.3.0 aiohttp==3.14.5 openai-harmony==0.0.8 openai==3.57.0
  pillow==13.0.0 pybase64==1.5.1 cachetools==8.0.2 msgspec==0.23.0 cloudpickle==3.1.3 py-cpuinfo==9.0.0
  xgrammar==0.2.9 fastapi==0.165.0 partial-json-parser==0.2.1.1.post7 llguidance==1.9.1 urllib3==2.8.0
  requests==2.34.2)
LMCACHE_IMPORT_DEPS=(numba==0.68.1 aiofile==3.12.3 cryptography==50.0.2)
# sglang's KV-event classes (tests/conformance/test_sglang_kv_events.py) import its utils, which need orjson
SGLANG_EVENTS_DEPS=(orjson==3.13.0)
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
have vllm "$VLLM" || pip_install --no-deps "vllm==$VLLM"
have lmcache "$LMCACHE" || pip_install --no-deps "lmcache==$LMCACHE"
# torch and transformers are named again so that the resolver keeps the pinned CPU builds.
"$PY" -c "import psutil, zmq, cbor2, openai_harmony, xgrammar, llguidance, numba, aiofile, orjson, urllib3, requests" 2>/dev/null \
  || pip_install "torch==$TORCH" "transformers==$TRANSFORMERS" "${VLLM_IMPORT_DEPS[@]}" "${LMCACHE_IMPORT_DEPS[@]}" "${SGLANG_EVENTS_DEPS[@]}"
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
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, SupportsHMA  # noqa: F401
from vllm.v1.request import Request  # noqa: F401
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector  # noqa: F401
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: F401
print(f"install-conformance-deps: torch {torch.__version__}, transformers {transformers.__version__}, "
      "sglang, vllm and lmcache interfaces OK")
PYEOF
echo "install-conformance-deps: done in $(( $(date +%s) - start )) s"
