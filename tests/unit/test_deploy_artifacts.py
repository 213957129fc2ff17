"""Offline validation of the deployment artifacts: the Helm chart, the compose file, the Grafana dashboard.

Tools come from ``bash deploy/ci/install_tools.sh``: helm at .tools/bin/helm, kubernetes-validate,
yamllint and check-jsonschema in .venv/bin, Debian's docker-compose on PATH. A missing tool skips the
test, unless the environment variable CI is set: then it fails.
"""

from __future__ import annotations

import atexit
import base64
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "k8s" / "kvpool"
SGLANG_VALUES = CHART / "examples" / "sglang-pd-values.yaml"
PREFILL_MANIFEST = REPO / "k8s" / "examples" / "sglang-pd-prefill.yaml"
COMPOSE = REPO / "deploy" / "docker-compose.yml"
DOCKERFILE = REPO / "deploy" / "Dockerfile"
DASHBOARD = REPO / "k8s" / "grafana" / "kvpool-dashboard.json"
INSTALL = "bash deploy/ci/install_tools.sh"
K8S_VERSION = "1.31.0"
TIMEOUT = 60

# The metrics the services export; the dashboard may use nothing else.
METRICS = {
    "kvpool_master_requests_total",
    "kvpool_master_request_seconds",
    "kvpool_master_hits_total",
    "kvpool_master_misses_total",
    "kvpool_master_objects",
    "kvpool_master_evictions_total",
    "kvpool_segment_capacity_bytes",
    "kvpool_segment_used_bytes",
    "kvpool_master_is_leader",
    "kvpool_drain_objects_moved_total",
    "kvpool_drain_bytes_moved_total",
    "kvpool_store_bytes_read_total",
    "kvpool_store_bytes_written_total",
    "kvpool_store_connections",
    # the SSD tier (docs/ssd-tier.md)
    "kvpool_master_ssd_used_bytes",
    "kvpool_master_ssd_capacity_bytes",
    "kvpool_master_demotions_total",
    "kvpool_master_promotions_total",
    "kvpool_master_dram_dropped_total",
    "kvpool_master_puts_backpressured_total",
    "kvpool_master_burst_dropped_total",
    "kvpool_master_demote_pending_bytes",
    "kvpool_store_ssd_written_bytes_total",
    "kvpool_store_ssd_read_bytes_total",
}
HISTOGRAMS = {"kvpool_master_request_seconds"}

YAMLLINT_SOURCE = (
    "{extends: default, rules: {line-length: {max: 200}, document-start: disable, truthy: {check-keys: false}}}"
)
YAMLLINT_RENDERED = "{extends: relaxed, rules: {line-length: disable}}"


# ------------------------------------------------------------------------------------------------ tools
def _missing(what: str) -> NoReturn:
    msg = f"{what} is missing (install it with: {INSTALL})"
    if os.environ.get("CI"):
        pytest.fail(f"{msg}; CI is set, so a missing tool is a failure")
    pytest.skip(msg)


def _tool(name: str) -> str:
    if name == "helm":
        candidates = [REPO / ".tools" / "bin" / "helm"]
    else:
        candidates = [REPO / ".venv" / "bin" / name, Path(sys.executable).parent / name]
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which(name)
    if found:
        return found
    _missing(name)


def _yaml() -> Any:
    try:
        import yaml  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        _missing("PyYAML (installed with kubernetes-validate)")
    return yaml


def _run(cmd: list[str], *, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT, check=False)


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, (
        f"{' '.join(proc.args)} -> rc={proc.returncode}\nstdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    )
    return proc.stdout


# ------------------------------------------------------------------------------------------------- helm
def _tmpdir(prefix: str) -> Path:
    """A private temporary directory, removed when the (worker) process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def _helm_env() -> dict[str, str]:
    """Private HELM_*_HOME dirs (one set per process, so pytest-xdist workers never share them)."""
    base = _tmpdir("kvpool-helm-")
    env = dict(os.environ)
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        (base / var).mkdir()
        env[var] = str(base / var)
    return env


def _values_file(values: dict[str, Any], tmp: Path) -> Path:
    path = tmp / "values.yaml"
    path.write_text(json.dumps(values))  # JSON is YAML
    return path


def _helm_template(args: list[str]) -> subprocess.CompletedProcess[str]:
    helm = _tool("helm")
    return _run(
        [
            helm,
            "template",
            "kvpool",
            str(CHART),
            "--namespace",
            "kvpool",
            "--kube-version",
            K8S_VERSION,
            *args,
        ],
        env=_helm_env(),
    )


# Rendering scenarios: name -> (values, extra values files).
SCENARIOS: dict[str, tuple[dict[str, Any], list[Path]]] = {
    "default": ({}, []),
    "external-etcd": (
        {
            "etcd": {
                "enabled": False,
                "endpoints": ["etcd-a.db.svc:2379", "etcd-b.db.svc:2379", "etcd-c.db.svc:2379"],
            }
        },
        [],
    ),
    "hugepages-rdma-numa": (
        {
            "clusterName": "gpu-pool",
            "store": {
                "numaNodes": [0, 1],
                "hugepages": "2M",
                "size": "8Gi",
                "rdma": {"enabled": True, "resourceName": "rdma/hca_shared_devices_a", "count": 1},
                "ssd": {"enabled": True, "size": "200Gi"},
                "nodeSelector": {"nvidia.com/gpu.present": "true"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            },
            "metrics": {"serviceMonitor": {"enabled": True}},
            "auth": {"token": "s3cret-token"},
        },
        [],
    ),
    "sglang-example": ({}, [SGLANG_VALUES]),
}


@functools.cache
def _render(name: str) -> str:
    values, files = SCENARIOS[name]
    tmp = _tmpdir("kvpool-values-")
    args: list[str] = []
    for f in files:
        args += ["-f", str(f)]
    if values:
        args += ["-f", str(_values_file(values, tmp))]
    return _ok(_helm_template(args))


def _docs(text: str) -> list[dict[str, Any]]:
    return [d for d in _yaml().safe_load_all(text) if d]


def _kinds(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def _one(docs: list[dict[str, Any]], kind: str, suffix: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"expected one {kind} named *{suffix}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def _pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def _arg(command: list[str], flag: str) -> str:
    assert flag in command, f"{flag} missing from {command}"
    return command[command.index(flag) + 1]


def _kube_validate(docs: list[dict[str, Any]], tmp_path: Path) -> None:
    path = tmp_path / "manifests.yaml"
    path.write_text(_yaml().safe_dump_all(docs, sort_keys=False))
    kv = _tool("kubernetes-validate")
    out = _ok(_run([kv, "--strict", "-k", K8S_VERSION, "--quiet", str(path)]))
    assert "ERROR" not in out, out


def _check_service_monitors(docs: list[dict[str, Any]]) -> None:
    """ServiceMonitors are CRDs kubernetes-validate cannot know: check their shape and their targets here."""
    services = _kinds(docs, "Service")
    monitors = _kinds(docs, "ServiceMonitor")
    assert monitors
    for sm in monitors:
        assert sm["apiVersion"] == "monitoring.coreos.com/v1"
        assert set(sm) == {"apiVersion", "kind", "metadata", "spec"}
        spec = sm["spec"]
        assert set(spec) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
        match = spec["selector"]["matchLabels"]
        targets = [s for s in services if match.items() <= s["metadata"]["labels"].items()]
        assert len(targets) == 1, f"{sm['metadata']['name']} selects {len(targets)} Services"
        port_names = {p["name"] for p in targets[0]["spec"]["ports"]}
        assert spec["endpoints"]
        for ep in spec["endpoints"]:
            assert ep["port"] in port_names, f"{sm['metadata']['name']}: no Service port {ep['port']}"
            assert ep["path"] == "/metrics"
            assert re.fullmatch(r"\d+(ms|s|m|h)", ep["interval"])


# ------------------------------------------------------------------------------------------------ chart
def test_helm_lint_strict() -> None:
    helm = _tool("helm")
    _ok(_run([helm, "lint", "--strict", str(CHART)], env=_helm_env()))
    _ok(_run([helm, "lint", "--strict", str(CHART), "-f", str(SGLANG_VALUES)], env=_helm_env()))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_rendered_chart_validates(scenario: str, tmp_path: Path) -> None:
    text = _render(scenario)
    docs = _docs(text)
    plain = [d for d in docs if d["kind"] != "ServiceMonitor"]
    _kube_validate(plain, tmp_path)
    if any(d["kind"] == "ServiceMonitor" for d in docs):
        _check_service_monitors(docs)
    rendered = tmp_path / "rendered.yaml"
    rendered.write_text(text)
    _ok(_run([_tool("yamllint"), "-s", "-d", YAMLLINT_RENDERED, str(rendered)]))
    # Every kvpool container reads the token from the Secret's file.
    secret_names = {s["metadata"]["name"] for s in _kinds(docs, "Secret")}
    kvpool_containers = 0
    for wl in docs:
        if wl["kind"] not in ("Deployment", "DaemonSet", "StatefulSet"):
            continue
        pod = _pod_spec(wl)
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in pod["containers"]:
            if c.get("command", [""])[0] != "kvpool":
                continue
            kvpool_containers += 1
            env = {e["name"]: e.get("value") for e in c["env"]}
            assert env["KVPOOL_TOKEN_FILE"] == "/etc/kvpool/token", c["name"]
            mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/kvpool")
            secret = volumes[mount["name"]]["secret"]
            assert secret["secretName"] in secret_names
            assert secret["items"][0]["path"] == "token"
    assert kvpool_containers >= 2


def test_default_render() -> None:
    docs = _docs(_render("default"))
    etcd = _one(docs, "StatefulSet", "-etcd")
    assert etcd["spec"]["replicas"] == 3
    assert etcd["spec"]["podManagementPolicy"] == "Parallel"
    etcd_args = etcd["spec"]["template"]["spec"]["containers"][0]["args"]
    initial = next(a for a in etcd_args if a.startswith("--initial-cluster="))
    assert len(initial.split("=", 1)[1].split(",")) == 3
    assert etcd["spec"]["template"]["spec"]["containers"][0]["image"].startswith("gcr.io/etcd-development/etcd:v3.5.")
    headless = _one(docs, "Service", "-etcd-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert {p["name"] for p in headless["spec"]["ports"]} == {"client", "peer"}

    master = _one(docs, "Deployment", "-master")
    assert master["spec"]["replicas"] == 3
    pod = _pod_spec(master)
    assert "podAntiAffinity" in pod["affinity"]
    c = pod["containers"][0]
    cmd = c["command"]
    assert cmd[:2] == ["kvpool", "master"]
    assert _arg(cmd, "--host") == "0.0.0.0"
    assert _arg(cmd, "--port") == "50051"
    assert _arg(cmd, "--metrics-port") == "9100"
    assert _arg(cmd, "--cluster") == "kvpool"
    assert _arg(cmd, "--advertise") == "$(POD_IP)"
    endpoints = _arg(cmd, "--etcd")
    assert endpoints == "kvpool-etcd.kvpool.svc.cluster.local:2379"  # the headless client Service
    client_svc = _one(docs, "Service", "-etcd")
    assert client_svc["spec"]["clusterIP"] == "None"
    assert not client_svc["spec"].get("publishNotReadyAddresses")
    pod_ip = next(e for e in c["env"] if e["name"] == "POD_IP")
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/health", "port": "metrics"}
    assert {"grpc": 50051, "metrics": 9100}.items() <= {p["name"]: p["containerPort"] for p in c["ports"]}.items()
    assert c["resources"]["requests"]
    svc = _one(docs, "Service", "-master")
    assert {"grpc": 50051, "metrics": 9100}.items() <= {p["name"]: p["port"] for p in svc["spec"]["ports"]}.items()
    pdbs = {d["metadata"]["name"]: d for d in _kinds(docs, "PodDisruptionBudget")}
    assert pdbs["kvpool-master"]["spec"]["maxUnavailable"] == 1

    store = _one(docs, "DaemonSet", "-store")
    pod = _pod_spec(store)
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    (c,) = pod["containers"]
    cmd = c["command"]
    assert cmd[:2] == ["kvpool", "store"]
    assert _arg(cmd, "--master") == "etcd://" + endpoints
    assert _arg(cmd, "--size") == "4GiB"
    assert _arg(cmd, "--port") == "50060"
    assert _arg(cmd, "--metrics-port") == "9101"
    assert _arg(cmd, "--node") == "$(NODE_NAME)"
    assert _arg(cmd, "--advertise") == "$(POD_IP)"
    assert "--numa-node" not in cmd
    assert "--hugepages" not in cmd
    assert "--ssd-dir" not in cmd
    assert _arg(cmd, "--rdma-device") == "off"  # no RDMA device requested: the store does not look for one
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 9101}
    dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["medium"] == "Memory"
    assert dshm["emptyDir"]["sizeLimit"] == "4352Mi"  # 4Gi segment + 256Mi headroom
    assert c["resources"]["requests"]["memory"] == "5Gi"  # segment + overhead
    assert not _kinds(docs, "ServiceMonitor")
    secret = _one(docs, "Secret", "-token")
    assert len(base64.b64decode(secret["data"]["token"])) == 48


def test_external_etcd_render() -> None:
    docs = _docs(_render("external-etcd"))
    assert not _kinds(docs, "StatefulSet")
    assert not [s for s in _kinds(docs, "Service") if "etcd" in s["metadata"]["name"]]
    eps = "etcd-a.db.svc:2379,etcd-b.db.svc:2379,etcd-c.db.svc:2379"
    master = _pod_spec(_one(docs, "Deployment", "-master"))["containers"][0]
    assert _arg(master["command"], "--etcd") == eps
    store = _pod_spec(_one(docs, "DaemonSet", "-store"))["containers"][0]
    assert _arg(store["command"], "--master") == f"etcd://{eps}"


def test_hugepages_rdma_numa_render() -> None:
    docs = _docs(_render("hugepages-rdma-numa"))
    pod = _pod_spec(_one(docs, "DaemonSet", "-store"))
    containers = pod["containers"]
    assert [c["name"] for c in containers] == ["store-numa0", "store-numa1"]
    ports = set()
    for i, c in enumerate(containers):
        cmd = c["command"]
        assert _arg(cmd, "--numa-node") == str(i)
        assert _arg(cmd, "--hugepages") == "2M"
        assert _arg(cmd, "--shm-dir") == "/dev/hugepages"
        assert _arg(cmd, "--cluster") == "gpu-pool"
        assert _arg(cmd, "--size") == "8GiB"
        assert _arg(cmd, "--ssd-dir") == "/ssd"
        assert _arg(cmd, "--ssd-size") == "200GiB"
        ports |= {_arg(cmd, "--port"), _arg(cmd, "--metrics-port")}
        limits = c["resources"]["limits"]
        assert limits["hugepages-2Mi"] == "8Gi"
        assert limits["rdma/hca_shared_devices_a"] == 1
        assert _arg(cmd, "--rdma-device") == "auto"
        assert _arg(cmd, "--rdma-gid-index") == "0"
        assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/dev/hugepages"]["name"] == "hugepages"
        assert mounts["/ssd"]["subPathExpr"] == f"$(NODE_NAME)/{c['name']}"
        assert c["readinessProbe"]["httpGet"]["port"] == 9101 + i
    assert ports == {"50060", "50061", "9101", "9102"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["hugepages"]["emptyDir"]["medium"] == "HugePages-2Mi"
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["ssd"]["hostPath"]["type"] == "DirectoryOrCreate"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    secret = _one(docs, "Secret", "-token")
    assert base64.b64decode(secret["data"]["token"]) == b"s3cret-token"
    assert {sm["metadata"]["name"] for sm in _kinds(docs, "ServiceMonitor")} == {
        "kvpool-master",
        "kvpool-store",
    }


def test_existing_secret_render() -> None:
    docs = _docs(_ok(_helm_template(["--set", "auth.existingSecret=my-token", "--set", "auth.secretKey=tok"])))
    assert not _kinds(docs, "Secret")
    for kind in ("Deployment", "DaemonSet"):
        vol = next(v for v in _pod_spec(_kinds(docs, kind)[0])["volumes"] if v["name"] == "token")
        assert vol["secret"]["secretName"] == "my-token"
        assert vol["secret"]["items"] == [{"key": "tok", "path": "token"}]


@pytest.mark.parametrize(
    ("args", "expect"),
    [
        (["--set", "master.replicas=three"], "master.replicas"),
        (["--set", "master.replica=3"], "replica"),
        (["--set", "store.hugepages=4M"], "store.hugepages"),
        (["--set", "store.size=4G"], "store.size"),
        (["--set", "store.numaNodes[0]=-1"], "store.numaNodes"),
        (["--set", "etcd.enabled=false"], "etcd.endpoints"),
        (["--set", "store.hugepages=1G", "--set", "store.size=1536Mi"], "huge page size"),
    ],
)
def test_schema_rejects_bad_values(args: list[str], expect: str) -> None:
    proc = _helm_template(args)
    assert proc.returncode != 0, f"helm template accepted {args}"
    assert expect in proc.stderr, proc.stderr


def test_chart_sources_lint() -> None:
    files = [CHART / "Chart.yaml", CHART / "values.yaml", SGLANG_VALUES, PREFILL_MANIFEST, COMPOSE]
    _ok(_run([_tool("yamllint"), "-s", "-d", YAMLLINT_SOURCE, *map(str, files)]))
    json.loads((CHART / "values.schema.json").read_text())


def test_sglang_prefill_example(tmp_path: Path) -> None:
    docs = _docs(PREFILL_MANIFEST.read_text())
    _kube_validate(docs, tmp_path)
    dep = _one(docs, "Deployment", "prefill")
    pod = _pod_spec(dep)
    c = pod["containers"][0]
    cmd = c["command"]
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    assert _arg(cmd, "--disaggregation-mode") == "prefill"
    assert "--enable-hierarchical-cache" in cmd
    assert _arg(cmd, "--page-size") == "64"
    assert _arg(cmd, "--hicache-mem-layout") == "page_first"
    assert _arg(cmd, "--hicache-storage-backend") == "dynamic"
    assert _arg(cmd, "--hicache-storage-prefetch-policy") == "timeout"
    extra = json.loads(_arg(cmd, "--hicache-storage-backend-extra-config"))
    assert extra["backend_name"] == "kvpool"
    assert extra["module_path"] == "kvpool.client.connectors.sglang"
    assert extra["class_name"] == "KvPoolHiCacheStorage"
    assert extra["interface_v1"] == 1
    assert extra["master"].startswith("etcd://")
    # The engine talks to the release the example values install (release "kvpool", namespace "sglang").
    values = _yaml().safe_load(SGLANG_VALUES.read_text())
    env = {e["name"]: e for e in c["env"]}
    assert env["KVPOOL_TOKEN_FILE"]["value"] == "/etc/kvpool/token"
    assert env["KVPOOL_CLUSTER"]["value"] == values["clusterName"]
    vol = next(v for v in pod["volumes"] if "secret" in v)
    mount = next(m for m in c["volumeMounts"] if m["name"] == vol["name"])
    assert mount["mountPath"] == "/etc/kvpool"
    assert vol["secret"]["items"][0]["path"] == "token"
    chart_docs = _docs(_render("sglang-example"))
    secret = _one(chart_docs, "Secret", "-token")
    assert vol["secret"]["secretName"] == secret["metadata"]["name"]
    store_cmd = _pod_spec(_one(chart_docs, "DaemonSet", "-store"))["containers"][0]["command"]
    chart_master = _arg(store_cmd, "--master").replace(".kvpool.svc.", ".sglang.svc.")
    assert extra["master"] == chart_master


def _parse_with_cli(argv: list[str]) -> None:
    """Parse a kvpool command line with the real CLI, and build the master/store config from it."""
    from kvpool.common import config as cfg
    from kvpool.tools.cli import build_parser

    argv = [re.sub(r"\$\((\w+)\)", lambda m: {"POD_IP": "10.1.2.3"}.get(m[1], "node-a"), a) for a in argv]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse reports the bad flag on stderr
        raise AssertionError(f"kvpool rejects {argv}") from exc
    if args.command == "master":
        from kvpool.master.config import MasterConfig

        cfg.from_args(MasterConfig, args)
    elif args.command == "store":
        from kvpool.store.config import StoreConfig

        cfg.from_args(StoreConfig, args)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_chart_commands_match_the_cli(scenario: str) -> None:
    commands = [
        c["command"]
        for wl in _docs(_render(scenario))
        if wl["kind"] in ("Deployment", "DaemonSet")
        for c in _pod_spec(wl)["containers"]
        if c["command"][0] == "kvpool"
    ]
    assert {c[1] for c in commands} == {"master", "store"}
    for command in commands:
        _parse_with_cli(command[1:])


def test_compose_commands_match_the_cli() -> None:
    for name, svc in _compose()["services"].items():
        if svc.get("image") == "kvpool:dev" and "entrypoint" not in svc:
            assert svc["command"][0] in ("master", "store", "demo", "bench"), name
            _parse_with_cli(svc["command"])


# ---------------------------------------------------------------------------------------------- compose
def _compose() -> dict[str, Any]:
    data: dict[str, Any] = _yaml().safe_load(COMPOSE.read_text())
    return data


def test_compose_config_valid(tmp_path: Path) -> None:
    compose = _tool("docker-compose")
    env = dict(os.environ, HOME=str(tmp_path))
    env.pop("KVPOOL_TOKEN", None)
    _ok(_run([compose, "-f", str(COMPOSE), "config", "-q"], env=env))
    _ok(_run([_tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)]))


def test_compose_structure() -> None:
    services: dict[str, Any] = _compose()["services"]
    names = set(services)
    assert {"etcd", "master-1", "master-2", "master-3", "store-1", "store-2", "demo"} <= names
    for name, svc in services.items():
        deps = svc.get("depends_on", [])
        for dep in deps if isinstance(deps, list) else list(deps):
            assert dep in names, f"{name} depends on unknown service {dep!r}"
            assert dep != name
        assert svc.get("network_mode") != "host"
    assert (
        "quay.io/coreos/etcd" in services["etcd"]["image"]
        or "gcr.io/etcd-development/etcd" in services["etcd"]["image"]
    )
    kvpool = {n: s for n, s in services.items() if s.get("image") == "kvpool:dev"}
    assert any("build" in s for s in kvpool.values())
    for name in ("master-1", "master-2", "master-3", "store-1", "store-2", "demo"):
        svc = kvpool[name]
        assert svc["environment"]["KVPOOL_TOKEN_FILE"] == "/etc/kvpool/token"
        assert any(v.startswith("token:/etc/kvpool") for v in svc["volumes"])
    for name in ("master-1", "master-2", "master-3"):
        cmd = services[name]["command"]
        assert cmd[0] == "master"
        assert _arg(cmd, "--etcd") == "etcd:2379"
        assert _arg(cmd, "--advertise") == name
        assert "/health" in " ".join(services[name]["healthcheck"]["test"])
    for name in ("store-1", "store-2"):
        cmd = services[name]["command"]
        assert cmd[0] == "store"
        assert _arg(cmd, "--master") == "etcd://etcd:2379"
        assert "/health" in " ".join(services[name]["healthcheck"]["test"])
        assert services[name]["shm_size"]
    assert _arg(services["demo"]["command"], "--master") == "etcd://etcd:2379"
    assert services["etcd"]["healthcheck"]["test"]


def test_dockerfile() -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert re.search(r"pip install \"?\.", text)
    assert 'ENTRYPOINT ["kvpool"]' in text
    assert "etcd" not in re.sub(r"#.*", "", text).lower()


def test_install_script_syntax() -> None:
    _ok(_run(["bash", "-n", str(REPO / "deploy" / "ci" / "install_tools.sh")]))


# -------------------------------------------------------------------------------------------- dashboard
_PROMQL_WORDS = {
    "sum",
    "max",
    "min",
    "avg",
    "count",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "clamp_min",
    "clamp_max",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "topk",
    "bottomk",
    "abs",
    "delta",
    "deriv",
    "sort",
    "sort_desc",
    "vector",
    "scalar",
    "offset",
    "bool",
}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))


def _metric_names(expr: str) -> set[str]:
    expr = re.sub(r"\$__\w+|\$\{?\w+\}?", " ", expr)  # Grafana variables
    expr = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", " ", expr)  # label lists
    expr = re.sub(r"\{[^}]*\}", " ", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", " ", expr)  # ranges
    expr = re.sub(r"(?<![\w:])\d+(\.\d+)?(e-?\d+)?", " ", expr)  # numbers
    return {w for w in re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr) if w not in _PROMQL_WORDS}


def test_metric_name_extraction() -> None:
    names = _metric_names('sum by (le, op) (rate(kvpool_master_request_seconds_bucket{op="put"}[$__rate_interval]))')
    assert names == {"kvpool_master_request_seconds_bucket"}
    assert _metric_names("up + 1e-9") == {"up"}


def test_grafana_dashboard() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"]
    assert dash["uid"]
    ds_vars = [v for v in dash["templating"]["list"] if v["type"] == "datasource"]
    assert ds_vars
    assert ds_vars[0]["query"] == "prometheus"
    ds_ref = f"${{{ds_vars[0]['name']}}}"
    allowed = METRICS | {h + s for h in HISTOGRAMS for s in ("_bucket", "_sum", "_count")}
    used: set[str] = set()
    ids = []
    for panel in _panels(dash["panels"]):
        ids.append(panel["id"])
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == ds_ref, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = _metric_names(target["expr"])
            assert names, f"{panel['title']}: no metric in {target['expr']!r}"
            assert names <= allowed, f"{panel['title']}: unknown metrics {names - allowed}"
            used |= {
                n.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count") if n not in METRICS else n
                for n in names
            }
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    assert used == METRICS, f"metrics without a panel: {METRICS - used}"
