"""ClientConfig: the knobs of the in-engine client."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.common import envs
from kvpool.common.config import option
from kvpool.common.units import parse_duration, parse_size


@dataclass
class ClientConfig:
    master: str = option("", "Master address: host:port or etcd://h1:p1,h2:p2.", env=envs.KVPOOL_MASTER)
    timeout_s: float = option(5.0, "Default deadline of one call (lookups, puts, gets).", parse=parse_duration)
    connections_per_store: int = option(4, "TCP connections per store; large objects are striped over them.")
    stripe_bytes: int = option(
        2 << 20, "Objects larger than this are split over several connections.", parse=parse_size
    )
    replica_num: int = option(0, "Replicas per object (0 = the master's default).")
    spin_us: int = option(
        50,
        "Before blocking on the answer of a master call or of a single small read/write, poll for it this "
        "many microseconds (a read/write of up to 256 KiB adds 1 us per KiB, up to 4x): a thread that never "
        "sleeps skips the wake-up (tens of us on a VM), at the cost of that much CPU per call. 0 always "
        "blocks.",
    )
    lease_cache_entries: int = option(
        16384,
        "Objects whose read lease this client remembers: reading one again while its lease holds skips "
        "the master (one data round trip). 0 turns it off.",
    )
    lease_renewal: bool = option(
        True,
        "Renew in the background the lease of a cached object read again in the last third of its lease "
        "(one batched master call for the keys coming due together), so that a hot object stays one round "
        "trip and the master sees it as recently used.",
    )
    revalidate_reads: bool = option(
        True,
        "Keep the location of a cached object after its lease ends and read it from there (over TCP) if the "
        "store still holds exactly that object, renewing the lease in the background: a re-read stays one "
        "round trip. Needs lease_renewal.",
    )
    speculative_read_bytes: int = option(
        256 << 10,
        "A first read of a key this client holds no location of asks the store it expects to hold the object "
        "(the only store it has seen, over TCP) for it by key while the master lookup is under way, and "
        "counts the bytes once the master's answer confirms them: one round trip instead of two (decision "
        "0031). Objects up to this size; 0 turns it off.",
        parse=parse_size,
    )
    speculative_batches: bool = option(
        False,
        "Read a batch of first reads of small pages (up to 256 KiB each) by key too, one pipelined request a "
        "page on one connection, while the master answers (decision 0031: slower than the striped lanes in "
        "the measurements so far).",
    )
    native_lanes: bool = option(
        True,
        "Move large TCP reads and writes (parts of 128 KiB and more) with the compiled lane loop "
        "(kvpool.transfer._lanes) where it was built; False: the Python loop, as where it was not.",
    )
    use_shm: bool = option(True, "Map same-node segments and copy with memcpy instead of TCP.")
    use_rdma: bool = option(True, "Use RDMA (pyverbs) where a device exists; without one, TCP (logged once).")
    breaker_backoff_s: float = option(
        0.5,
        "After a failed master call, fail fast for this long (doubles up to "
        "breaker_max_backoff_s) before trying again.",
        parse=parse_duration,
    )
    breaker_max_backoff_s: float = option(5.0, "Longest fail-fast period of the circuit breaker.", parse=parse_duration)
    token_file: str = option("", "File holding the cluster token.", env=envs.KVPOOL_TOKEN_FILE)
    tls_ca: str = option("", "PEM CA (or the master's self-signed certificate): reach the master's gRPC over TLS.")
    cluster: str = option("kvpool", "Cluster name (etcd key prefix).", env=envs.KVPOOL_CLUSTER)
    groups: int = option(
        0,
        "Shard groups the cluster's keys are split over (decision 0080); 0 = the count recorded in etcd "
        "(1 for a host:port master). A master that counts otherwise refuses this client (GROUP_MISMATCH).",
    )

    def __post_init__(self) -> None:
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be > 0")
        if self.connections_per_store < 1:
            raise ValueError("connections_per_store must be >= 1")
        if self.speculative_read_bytes < 0:
            raise ValueError("speculative_read_bytes must be >= 0")
        if self.spin_us < 0 or self.lease_cache_entries < 0:
            raise ValueError("spin_us and lease_cache_entries must be >= 0")
