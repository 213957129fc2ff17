"""The only module that reads environment variables.

Every variable kvpool understands is declared here once, with its type and meaning, so that
``kvpool --help-env`` and the docs can list them and no module grows its own ``os.environ`` reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T", str, int, float, bool)


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    default: T
    doc: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        if raw is None or raw == "":
            return self.default
        kind = type(self.default)
        if kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")  # type: ignore[return-value,unused-ignore]
        try:
            return kind(raw)  # type: ignore[return-value,unused-ignore]
        except ValueError as exc:
            raise ValueError(f"environment variable {self.name}={raw!r} is not a valid {kind.__name__}") from exc

    def is_set(self) -> bool:
        return bool(os.environ.get(self.name))


KVPOOL_MASTER = EnvVar("KVPOOL_MASTER", "", "Master address: host:port or etcd://h1:p1,h2:p2 (clients, stores, admin).")
KVPOOL_CLUSTER = EnvVar(
    "KVPOOL_CLUSTER", "kvpool", "Cluster name: the etcd key prefix and the shared-memory file prefix."
)
KVPOOL_TOKEN = EnvVar("KVPOOL_TOKEN", "", "The cluster token itself (prefer KVPOOL_TOKEN_FILE).")
KVPOOL_TOKEN_FILE = EnvVar("KVPOOL_TOKEN_FILE", "", "A file holding the cluster token.")
KVPOOL_LOG_LEVEL = EnvVar("KVPOOL_LOG_LEVEL", "INFO", "Log level of every kvpool process.")
KVPOOL_LOG_JSON = EnvVar("KVPOOL_LOG_JSON", False, "Write structured (JSON) log lines.")
KVPOOL_FAILPOINTS = EnvVar(
    "KVPOOL_FAILPOINTS",
    "",
    "Failpoints to enable, name=sleep:S|exit|raise,... (tests only; kvpool.common.failpoints).",
)
KVPOOL_FUZZ_EXAMPLES = EnvVar(
    "KVPOOL_FUZZ_EXAMPLES",
    0,
    "Examples per fuzz test (0 = the few-second CI default; raise it for a long fuzzing run).",
)
KVPOOL_TEST_RDMA_DEVICE = EnvVar(
    "KVPOOL_TEST_RDMA_DEVICE", "", "Run the opt-in RDMA test on this device (e.g. mlx5_0)."
)
KVPOOL_NODE = EnvVar("KVPOOL_NODE", "", "This machine's node name (default: the hostname).")
KVPOOL_DISABLE_SHM = EnvVar("KVPOOL_DISABLE_SHM", False, "Never use the same-node shared-memory path.")
# RDMA (docs/rdma.md)
KVPOOL_VERBS = EnvVar(
    "KVPOOL_VERBS",
    "",
    "Verbs provider: empty = the compiled layer where it is built and finds a device, else pyverbs; native = the "
    "compiled layer (kvpool.transfer._verbs); pyverbs; fake = the cross-process FAKE NIC for tests (in every process).",
)
KVPOOL_NATIVE_VERBS = EnvVar(
    "KVPOOL_NATIVE_VERBS",
    True,
    "Post RDMA work requests through the compiled verbs layer (kvpool.transfer._verbs) where it is built; "
    "0 = the Python path (pyverbs, or the FAKE NIC's Python posting).",
)
KVPOOL_FAKE_VERBS_DIR = EnvVar(
    "KVPOOL_FAKE_VERBS_DIR", "", "State directory of the FAKE NIC (default /dev/shm/kvpool-fake-verbs-UID)."
)
KVPOOL_RDMA_DEVICE = EnvVar("KVPOOL_RDMA_DEVICE", "", "Store RDMA devices: auto, off, or NAME[,NAME...].")
KVPOOL_TEST_CUDA = EnvVar(
    "KVPOOL_TEST_CUDA", False, "Run the opt-in GPU-memory RDMA test (with KVPOOL_TEST_RDMA_DEVICE)."
)
KVPOOL_FAKE_VERBS_DEVICES = EnvVar(
    "KVPOOL_FAKE_VERBS_DEVICES",
    "",
    "Devices of the FAKE NIC, NAME[:NUMA_NODE][,...] (default fake_mlx5_0): several NICs in tests.",
)

# The running local cluster (`kvpool local up`), found by tools when no master is given (common/local_context.py).
KVPOOL_LOCAL_CONTEXT = EnvVar(
    "KVPOOL_LOCAL_CONTEXT",
    "",
    "File where `kvpool local up` records the running local cluster, which clients and tools use when no "
    "master is given (default: kvpool-local-<uid>.json in XDG_RUNTIME_DIR or the temp dir).",
)
XDG_RUNTIME_DIR = EnvVar("XDG_RUNTIME_DIR", "", "Per-user runtime directory: where local-cluster state lives.")

ALL: list[EnvVar[Any]] = [
    KVPOOL_MASTER,
    KVPOOL_CLUSTER,
    KVPOOL_TOKEN,
    KVPOOL_TOKEN_FILE,
    KVPOOL_LOG_LEVEL,
    KVPOOL_LOG_JSON,
    KVPOOL_FAILPOINTS,
    KVPOOL_FUZZ_EXAMPLES,
    KVPOOL_TEST_RDMA_DEVICE,
    KVPOOL_NODE,
    KVPOOL_DISABLE_SHM,
    KVPOOL_LOCAL_CONTEXT,
    XDG_RUNTIME_DIR,
    KVPOOL_VERBS,
    KVPOOL_FAKE_VERBS_DIR,
    KVPOOL_RDMA_DEVICE,
    KVPOOL_FAKE_VERBS_DEVICES,
    KVPOOL_TEST_CUDA,
    KVPOOL_NATIVE_VERBS,
]


def node_name() -> str:
    """The node name stores and clients report; same-node detection compares these."""
    import socket

    return KVPOOL_NODE.get() or socket.gethostname()
