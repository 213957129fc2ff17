"""Shared fixtures: real local clusters (tests/support/cluster.py) and real etcd (tests/support/etcd_fixtures.py)."""

import os
import tempfile

pytest_plugins = ["tests.support.cluster", "tests.support.etcd_fixtures"]

# The suite never reads or replaces the user's running `kvpool local up` cluster (common/local_context.py):
# every test process and the processes it starts record theirs in a file of their own.
os.environ["KVPOOL_LOCAL_CONTEXT"] = os.path.join(tempfile.gettempdir(), f"kvpool-test-context-{os.getpid()}.json")
