"""Shared fixtures: real local clusters (tests/support/cluster.py) and real etcd (tests/support/etcd_fixtures.py)."""

pytest_plugins = ["tests.support.cluster", "tests.support.etcd_fixtures"]
