"""StoreConfig: every knob of a store process, with the doc that ``kvpool store --help`` shows."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.common import envs
from kvpool.common.config import check_ports, option
from kvpool.common.units import parse_duration, parse_size


@dataclass
class StoreConfig:
    master: str = option("", "Master address: host:port or etcd://h1:p1,h2:p2.", env=envs.KVPOOL_MASTER)
    size: int = option(1 << 30, "Bytes of DRAM this store contributes (its segment), e.g. 4GiB.", parse=parse_size)
    host: str = option("127.0.0.1", "Address the data plane listens on.")
    port: int = option(0, "Data-plane TCP port. 0 = any free port.")
    metrics_port: int = option(0, "Port of the HTTP /metrics and /health endpoint. 0 = any free port, -1 = off.")
    advertise: str = option("", "Host name clients use to reach this store (default: --host).")
    node: str = option(
        "",
        "Node name (default: KVPOOL_NODE or the hostname); same-node clients use shared memory.",
        env=envs.KVPOOL_NODE,
    )
    cluster: str = option("kvpool", "Cluster name (prefix of the shared-memory file).", env=envs.KVPOOL_CLUSTER)
    shm_dir: str = option("/dev/shm", "Directory of the segment file (tmpfs, or a hugetlbfs mount).")
    numa_node: int = option(-1, "Bind this store's CPUs and segment memory to this NUMA node (-1 = no binding).")
    hugepages: str = option(
        "",
        "Back the segment with hugepages: 2M or 1G (fails if unavailable; no fallback).",
        choices=("", "2M", "1G"),
    )
    ssd_dir: str = option("", "Directory of the SSD tier (empty = no SSD tier).")
    ssd_size: int = option(0, "Bytes of the SSD tier.", parse=parse_size)
    groups: int = option(
        0,
        "Shard groups of the cluster (decision 0080): the segment is split into this many equal parts, part g"
        " mounted to group g's master. 0 = the count recorded in etcd (1 for a host:port master).",
    )
    heartbeat_interval_s: float = option(1.0, "Heartbeat period to the master.", parse=parse_duration)
    standby_feed_interval_s: float = option(
        0.5,
        "Period of the inventory feed to warm standby masters (etcd:// masters only; 0 = off; decision 0070).",
        parse=parse_duration,
    )
    max_connections: int = option(1024, "Most concurrent data-plane connections.")
    token_file: str = option("", "File holding the cluster token.", env=envs.KVPOOL_TOKEN_FILE)
    tls_ca: str = option("", "PEM CA (or the master's self-signed certificate): reach the master's gRPC over TLS.")
    max_connections_per_client: int = option(
        256,
        "Most data-plane connections from one client address (0 = no limit); more get TOO_MANY_CONNECTIONS.",
    )
    max_inflight_bytes_per_client: int = option(
        256 << 20,
        "Most payload bytes being read or written for one "
        "client address at once (0 = no limit); a request "
        "over it gets TOO_MANY_BYTES_IN_FLIGHT.",
        parse=parse_size,
    )
    spin_us: int = option(
        50,
        "After answering a request, poll the connection this many microseconds for the next one before "
        "sleeping (after a READ of up to 256 KiB, 1 us more per KiB, up to 4x): back-to-back small "
        "requests then skip the thread wake-up. 0 always sleeps.",
    )
    read_sendfile: bool = option(
        False,
        "Send READ parts of 128 KiB and more from the segment file with sendfile instead of copying them: "
        "less store CPU, but slower end-to-end on some hosts (docs/decisions/0017); measure before enabling.",
    )
    read_by_key: bool = option(
        True,
        "Answer a client's speculative read by key (READ_KEY, decision 0031) with the committed object held "
        "under the key: a first read in one round trip. Off: every such read goes through the master first.",
    )

    rdma_device: str = option(
        "auto",
        "RDMA devices to serve one-sided READ/WRITE on: auto (every device found), off, or NAME[,NAME...]. "
        "Without a usable device clients use TCP (one log line).",
        env=envs.KVPOOL_RDMA_DEVICE,
    )
    rdma_gid_index: int = option(0, "GID index of the RDMA port (RoCE v2: the IPv4-mapped GID, often 3).")

    def __post_init__(self) -> None:
        if self.size < 1 << 20:
            raise ValueError(f"--size must be at least 1 MiB, got {self.size}")
        if self.numa_node < -1:
            raise ValueError("--numa-node must be >= 0 (or -1 for no binding)")
        if self.max_connections_per_client < 0 or self.max_inflight_bytes_per_client < 0:
            raise ValueError("per-client limits must be >= 0 (0 = no limit)")
        if self.spin_us < 0:
            raise ValueError("--spin-us must be >= 0")
        check_ports(port=self.port)
        check_ports(metrics_port=self.metrics_port, off=-1)
