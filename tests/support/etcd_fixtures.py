"""pytest fixtures that give a test its own real etcd: ``etcd1`` (one member) and ``etcd3`` (three).

Each test gets fresh members on free ports with data under its ``tmp_path``, so tests may kill, freeze or
restart members freely and run in parallel (pytest-xdist). Without the ``etcd`` binary the tests are
skipped, unless the environment variable ``CI`` is set: there a missing binary is a failure.

``tests/conftest.py`` registers this module through ``pytest_plugins``, so every test can ask for them.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.etcd_cluster import EtcdCluster, etcd_binary

__all__ = ["etcd1", "etcd3", "require_etcd"]


def require_etcd() -> None:
    """Skip the calling test when etcd is missing (fail instead when ``CI`` is set)."""
    if etcd_binary() is not None:
        return
    reason = "the etcd binary is not installed (Debian: apt-get install -y etcd-server etcd-client)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI is set, so etcd tests must not be skipped", pytrace=False)
    pytest.skip(reason)


def _cluster(size: int, base: Path) -> Iterator[EtcdCluster]:
    require_etcd()
    cluster = EtcdCluster(size, base)
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture
def etcd1(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A fresh single-member etcd for this test."""
    yield from _cluster(1, tmp_path / "etcd1")


@pytest.fixture
def etcd3(tmp_path: Path) -> Iterator[EtcdCluster]:
    """A fresh three-member etcd cluster for this test (fast raft timings)."""
    yield from _cluster(3, tmp_path / "etcd3")
