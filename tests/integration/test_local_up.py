"""`kvpool local up` starts fresh (or says what it kept), returns once the cluster serves, and becomes the
default cluster of kvpool-admin and PoolClient.from_env() (common/local_context.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.client import PoolClient
from kvpool.common import local_context
from kvpool.common.errors import ErrorCode
from kvpool.tools.local_cluster import LocalCluster
from tests.support.cluster import client

pytestmark = pytest.mark.integration

FAST_HA = ("--ha", "--master-arg=--leader-ttl-s=1")


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, str]]:
    """No KVPOOL_MASTER; a context file of this test's own."""
    context = str(tmp_path / "context.json")
    monkeypatch.setenv("KVPOOL_LOCAL_CONTEXT", context)
    monkeypatch.delenv("KVPOOL_MASTER", raising=False)
    monkeypatch.delenv("KVPOOL_TOKEN_FILE", raising=False)
    child = {k: v for k, v in os.environ.items() if k != "KVPOOL_MASTER"}
    yield child
    base = tmp_path / "cluster"
    if (base / "cluster.json").exists():
        _run("kvpool.tools.cli", "local", "down", "--dir", str(base), env=child)


def _run(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def _up(base: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    args = ("local", "up", "--stores", "1", "--size", "32MiB", "--dir", str(base), *extra)
    up = _run("kvpool.tools.cli", *args, env=env)
    assert up.returncode == 0, up.stderr
    return up


def _nodes(env: dict[str, str]) -> list[dict[str, object]]:
    nodes = _run("kvpool.tools.admin", "nodes", "--json", env=env)
    assert nodes.returncode == 0, nodes.stderr
    assert "using the local cluster at" in nodes.stderr  # said in one line
    doc: list[dict[str, object]] = json.loads(nodes.stdout)["nodes"]
    return doc


def test_up_after_a_drain_and_down_is_fresh_and_serves_at_once(tmp_path: Path, env: dict[str, str]) -> None:
    base = tmp_path / "cluster"
    _up(base, env, *FAST_HA)
    node = str(_nodes(env)[0]["node"])
    drain = _run("kvpool.tools.admin", "drain", node, "--wait", "--timeout", "60", env=env)
    assert drain.returncode == 0, drain.stderr
    assert {n["status"] for n in _nodes(env)} == {"DRAINED"}
    assert _run("kvpool.tools.cli", "local", "down", "--dir", str(base), env=env).returncode == 0
    assert local_context.current() is None  # `down` removed the record

    _up(base, env, *FAST_HA)
    # Straight after `up` returns: the default client finds the cluster and a put succeeds.
    with PoolClient.from_env() as pool:
        assert pool.put("right-after-up", b"value") == 0
        assert pool.get("right-after-up") == b"value"
    assert {n["status"] for n in _nodes(env)} == {"OK"}
    status = _run("kvpool.tools.admin", "status", env=env)
    assert status.returncode == 0, status.stderr


def test_keep_state_keeps_the_drain_and_says_so(tmp_path: Path, env: dict[str, str]) -> None:
    base = tmp_path / "cluster"
    _up(base, env, *FAST_HA)
    node = str(_nodes(env)[0]["node"])
    assert _run("kvpool.tools.admin", "drain", node, "--wait", "--timeout", "60", env=env).returncode == 0
    assert _run("kvpool.tools.cli", "local", "down", "--dir", str(base), env=env).returncode == 0
    # The drained store cannot take the probe put, so `up` would wait for ever: --stores 0, then look.
    up = _run("kvpool.tools.cli", "local", "up", "--stores", "0", "--dir", str(base), "--keep-state", *FAST_HA, env=env)
    assert up.returncode == 0, up.stderr
    assert f"drained nodes: {node}" in up.stdout
    assert "--stores 0" in up.stderr  # warned: nothing can be stored


def test_no_local_cluster_no_fallback(env: dict[str, str]) -> None:
    assert local_context.current() is None
    status = _run("kvpool.tools.admin", "status", env=env)
    assert status.returncode == 2
    assert "kvpool local up" in status.stderr


def test_a_call_that_meets_a_warming_up_leader_waits_for_it(make_cluster: Callable[..., LocalCluster]) -> None:
    """A new HA leader serves one lease TTL after it wins; a put in that window waits (within its deadline)
    instead of failing with LEADER_WARMING_UP; a deadline shorter than the warm-up still fails fast."""
    cluster = make_cluster(ha=True, stores=1, store_size="32MiB", master_args=("--leader-ttl-s", "3"))
    with client(cluster.master) as pool:
        started = time.monotonic()
        code = pool.put("impatient", b"v", timeout=0.3)
        assert code in (ErrorCode.LEADER_WARMING_UP, 0), ErrorCode(code)
        assert time.monotonic() - started < 2.0
        # A warming leader is no outage: the same client's next call is not failed fast by its breaker.
        assert pool.put("during-warm-up", b"v", timeout=30.0) == 0
        assert pool.get("during-warm-up") == b"v"


def _readme_python_example() -> str:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    start = readme.index("```python\nfrom kvpool.client import PoolClient")
    return readme[start + len("```python\n") : readme.index("```", start + 10)]


def test_the_readme_client_example_runs_as_written_against_local_up(tmp_path: Path, env: dict[str, str]) -> None:
    _up(tmp_path / "cluster", env)
    run = subprocess.run(
        [sys.executable, "-c", _readme_python_example()], capture_output=True, text=True, env=env, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert "b'...KV bytes...' [0, 0, 0, 0, 0, 0, 0, 0] 8 [512, 512, 512, 512, 512, 512, 512, 512]" in run.stdout
    assert "using the local cluster at" in run.stderr  # the fallback said so, in one line


def test_benchmarks_use_the_local_cluster_with_master_local(tmp_path: Path, env: dict[str, str]) -> None:
    _up(tmp_path / "cluster", env)
    bench = _run(
        "kvpool.tools.cli", "bench", "batch", "--master", "local", "--keys", "300", "--runs", "1", "--json", env=env
    )
    assert bench.returncode == 0, bench.stderr
    assert "using the local cluster at" in bench.stderr
    assert json.loads(bench.stdout)["keys"] == 300
