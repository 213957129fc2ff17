"""Real local clusters for integration tests: processes on loopback, cleaned up whatever happens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.client import ClientConfig, PoolClient
from kvpool.tools.local_cluster import LocalCluster
from tests.support.wait import wait_for

__all__ = ["FAST_MASTER", "client", "cluster", "make_cluster", "wait_for"]  # wait_for: tests/support/wait.py

# Short timings so expiry and reclaim tests finish in seconds.
FAST_MASTER = ("--store-ttl-s", "2", "--eviction-interval-s", "0.02")


def client(master: str, **overrides: object) -> PoolClient:
    defaults: dict[str, object] = {"master": master, "timeout_s": 5.0, "use_shm": False}
    defaults.update(overrides)
    return PoolClient(config=ClientConfig(**defaults))  # type: ignore[arg-type]


@pytest.fixture
def make_cluster(tmp_path: Path) -> Iterator[Callable[..., LocalCluster]]:
    """``make_cluster(stores=2, store_size="64MiB", master_args=..., ...)`` -> a started LocalCluster."""
    started: list[LocalCluster] = []

    def make(**kwargs: object) -> LocalCluster:
        kwargs.setdefault("base_dir", tmp_path / f"cluster{len(started)}")
        kwargs.setdefault("master_args", FAST_MASTER)
        cluster = LocalCluster(**kwargs)  # type: ignore[arg-type]
        started.append(cluster)
        return cluster.start()

    try:
        yield make
    finally:
        for cluster in started:
            cluster.stop()


@pytest.fixture
def cluster(make_cluster: Callable[..., LocalCluster]) -> LocalCluster:
    return make_cluster(stores=2, store_size="64MiB")


# ---- the data path a byte-moving test runs over (docs/rdma.md): one-line opt-in per test
DATA_PATHS = ("tcp", "rdma")


@pytest.fixture(params=DATA_PATHS)
def data_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[str]:
    """Run the test over TCP and over one-sided RDMA through the cross-process FAKE NIC.

    Use it as ``@pytest.mark.usefixtures("data_path")`` (before the cluster fixtures, so that the stores it
    starts inherit the environment). The "rdma" run sets ``KVPOOL_VERBS=fake`` for this process and the
    stores, and fails unless the fake NIC of this process really moved bytes.
    """
    from kvpool.transfer.verbs_fake_ipc import IpcFakeFabric

    if request.param == "rdma":
        monkeypatch.setenv("KVPOOL_VERBS", "fake")
        monkeypatch.setenv("KVPOOL_FAKE_VERBS_DIR", str(tmp_path / "fake-nic"))
    else:
        monkeypatch.delenv("KVPOOL_VERBS", raising=False)
    from kvpool.transfer.verbs_native import native_fake_default, native_fake_work_requests

    before = IpcFakeFabric.total_bytes_moved
    native_before = native_fake_work_requests()
    yield request.param
    if request.param == "rdma":
        assert IpcFakeFabric.total_bytes_moved > before, "the rdma run moved no byte over the fake NIC"
        if native_fake_default():  # where built, the work requests went through the compiled verbs layer
            assert native_fake_work_requests() > native_before, "the rdma run did not post through _verbs"
