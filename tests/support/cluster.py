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
