"""Real etcd members for tests: the implementation lives in kvpool.tools.etcd_process (``kvpool local up
--ha`` uses it too)."""

from kvpool.tools.etcd_process import FAST_TIMINGS, EtcdCluster, EtcdClusterError, etcd_binary, free_port

__all__ = ["FAST_TIMINGS", "EtcdCluster", "EtcdClusterError", "etcd_binary", "free_port"]
