"""The command lines operators use: kvpool local up/status/down, kvpool-admin, kvpool demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.tools.etcd_process import etcd_binary

pytestmark = pytest.mark.integration


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        check=False,
    )


def _kvpool(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return _run("kvpool.tools.cli", *args, **kw)  # type: ignore[arg-type]


def _admin(*args: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return _run("kvpool.tools.admin", *args, **kw)  # type: ignore[arg-type]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize("ha", [False, True], ids=["single", "ha"])
def test_local_up_status_admin_down(tmp_path: Path, ha: bool) -> None:
    if ha and etcd_binary() is None and not os.environ.get("CI"):
        pytest.skip("etcd is not installed")
    base = str(tmp_path / "cluster")
    up = _kvpool(
        "local",
        "up",
        "--stores",
        "2",
        "--size",
        "32MiB",
        "--dir",
        base,
        "--json",
        *(["--ha", "--master-arg=--leader-ttl-s=1"] if ha else []),
    )
    assert up.returncode == 0, up.stderr
    try:
        master = json.loads(up.stdout)["master"]
        assert master.startswith("etcd://") == ha
        status = _kvpool("local", "status", "--dir", base, "--json")
        procs = json.loads(status.stdout)["processes"]
        roles = sorted(p["role"] for p in procs)
        assert roles == (
            ["etcd", "master", "master", "master", "store", "store"] if ha else ["master", "store", "store"]
        )
        assert all({"role", "pid", "address", "node"} <= p.keys() for p in procs)
        env = {"KVPOOL_MASTER": master}
        nodes = _admin("nodes", "--json", env=env)
        assert nodes.returncode == 0, nodes.stderr
        doc = json.loads(nodes.stdout)["nodes"]
        assert sum(n["segments"] for n in doc) == 2
        assert all({"node", "segments", "status", "capacity", "used", "objects"} <= n.keys() for n in doc)
        leader = _admin("leader", "--json", env=env)
        assert leader.returncode == 0, leader.stderr
        info = json.loads(leader.stdout)
        assert info["leader"] in {p["address"] for p in procs if p["role"] == "master"}
        if ha:
            assert info["view"] > 0
            assert len(info["followers"]) == 2
        summary = _admin("status", "--json", env=env)
        assert json.loads(summary.stdout)["stores"] == 2
    finally:
        down = _kvpool("local", "down", "--dir", base)
        assert down.returncode == 0, down.stderr
    assert not any(_alive(p["pid"]) for p in procs)


def test_admin_without_a_cluster_fails_clearly() -> None:
    result = _admin("status", env={"KVPOOL_MASTER": ""})
    assert result.returncode == 2
    assert "KVPOOL_MASTER" in result.stderr
    result = _admin("status", "--master", "127.0.0.1:1", "--timeout", "2")
    assert result.returncode == 2
    assert "UNAVAILABLE" in result.stderr


def test_demo_runs_and_reports_hit_rates(tmp_path: Path) -> None:
    result = _kvpool(
        "demo",
        "--json",
        "--sessions",
        "6",
        "--turns",
        "4",
        "--system-tokens",
        "1024",
        "--turn-tokens",
        "256",
        "--store-size",
        "32MiB",
        "--page-bytes",
        "16KiB",
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(result.stdout.strip().splitlines()[-1])
    assert doc["wrong_reads"] == 0
    assert doc["pool_hit_rate"] > doc["private_hit_rate"]
    assert doc["gb_moved"] > 0
