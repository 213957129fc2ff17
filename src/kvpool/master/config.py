"""MasterConfig: every knob of the master, with the doc that ``kvpool master --help`` shows."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.common import envs
from kvpool.common.config import check_ports, option
from kvpool.common.units import parse_duration, parse_size
from kvpool.master.burst import BURST_POLICIES
from kvpool.master.eviction import EVICTION_POLICIES
from kvpool.master.placement import PLACEMENT_POLICIES


@dataclass
class MasterConfig:
    host: str = option("127.0.0.1", "Address to listen on.")
    port: int = option(50051, "gRPC port (control plane; the address clients and stores are given). 0 = any free port.")
    rpc_port: int = option(0, "Port of the lean framed protocol for the engine's hot calls. 0 = any free port.")
    spin_us: int = option(
        50,
        "After answering a framed call, poll the connections this many microseconds for the next request "
        "before the event loop sleeps, while callers are calling back to back: their next call then skips "
        "the loop's wake-up. 0 always sleeps.",
    )
    metrics_port: int = option(0, "Port of the HTTP /metrics and /health endpoint. 0 = any free port, -1 = off.")
    advertise: str = option("", "Host name other machines use to reach this master (default: --host).")
    cluster: str = option("kvpool", "Cluster name (etcd key prefix).", env=envs.KVPOOL_CLUSTER)
    etcd: str = option("", "etcd endpoints h1:p1,h2:p2 for high availability; empty = a single master, no etcd.")
    groups: int = option(
        1,
        "Shard groups of the cluster (decision 0080): each group elects its own leader and owns the keys that"
        " hash to it. Fixed when the cluster is created (recorded in etcd); more than 1 needs --etcd.",
    )
    group: int = option(0, "The shard group this master serves (0 .. --groups - 1).")
    leader_ttl_s: float = option(
        3.0,
        "Lease TTL of the leader key in etcd; a new leader also waits this long before serving.",
        parse=parse_duration,
    )
    num_shards: int = option(1024, "Metadata shards (each with its own lock).")
    lease_ttl_s: float = option(
        10.0, "Read lease granted by get-replicas; leased objects are never evicted.", parse=parse_duration
    )
    put_timeout_s: float = option(
        30.0, "An unfinished put older than this is reclaimed (its writer is gone).", parse=parse_duration
    )
    store_ttl_s: float = option(
        10.0, "A store silent for this long is expired and its replicas dropped.", parse=parse_duration
    )
    store_probe_timeout_s: float = option(
        0.25,
        "Connect deadline of the master's probe of a store's data plane after a client reported it"
        " unreachable (a failed probe makes the store suspected: docs/reliability.md).",
        parse=parse_duration,
    )
    store_report_agreement: int = option(
        0,
        "Distinct clients whose reports of a failed store connection suspect the store without the master's"
        " probe (0: only a failed probe suspects; clients cut off from a store by a partition of their own"
        " then cannot take it out of service for everyone: docs/decisions/0026-dead-store-suspicion.md).",
    )
    placement: str = option("free_ratio_first", "Placement policy.", choices=PLACEMENT_POLICIES.names())
    eviction: str = option("lru", "Eviction policy.", choices=EVICTION_POLICIES.names())
    default_replica_num: int = option(1, "Replicas per object when the client does not say.")
    eviction_high_watermark: float = option(0.90, "Start evicting when this fraction of the pool is used.")
    eviction_target: float = option(0.85, "Evict down to this fraction of the pool.")
    eviction_sample_factor: int = option(
        8,
        "Approximate LRU: scan this many candidates per object to evict (0 = scan every object); the carried "
        "pool (eviction_pool_size) keeps small evictions near the LRU order.",
    )
    eviction_interval_s: float = option(
        0.05, "How often the eviction thread checks the watermark.", parse=parse_duration
    )
    soft_pin_ttl_s: float = option(1800.0, "Default soft-pin TTL.", parse=parse_duration)
    allow_evict_soft_pinned: bool = option(True, "Evict soft-pinned objects as a last resort.")
    max_key_bytes: int = option(512, "Longest key accepted (UTF-8 bytes).")
    max_object_bytes: int = option(1 << 30, "Largest object accepted.", parse=parse_size)
    max_batch: int = option(8192, "Most keys in one batch call.")
    token_file: str = option(
        "", "File holding the cluster token (required on every call when set).", env=envs.KVPOOL_TOKEN_FILE
    )
    tls_cert: str = option("", "PEM certificate: serve gRPC over TLS only (with --tls-key).")
    tls_key: str = option("", "PEM private key of --tls-cert.")
    # SSD tier (docs/ssd-tier.md); these only matter once a store mounts an SSD tier.
    ssd_high_watermark: float = option(
        0.95,
        "Start dropping least recently used SSD replicas when this fraction of a store's SSD tier is used.",
    )
    ssd_eviction_target: float = option(0.90, "Drop SSD replicas down to this fraction of the SSD tier.")
    promote_after_hits: int = option(
        2, "Copy an SSD-only object back to DRAM after this many reads (0 = never promote)."
    )
    demote_max_pending: float = option(
        0.25,
        "Most DRAM (fraction of the pool) waiting to be demoted; past it victims wait in DRAM and puts that find "
        "DRAM full are held back (DEMOTION_BACKLOG) until demotions catch up.",
    )
    ssd_burst_policy: str = option(
        "backpressure",
        "What a put that finds DRAM full while demotions are in flight gets: backpressure (refused with "
        "DEMOTION_BACKLOG, the client retries until its deadline: nothing the SSD could hold is lost) or "
        "drop-coldest (stored at once; the coldest DRAM objects without an SSD copy are dropped, counted as "
        "burst_dropped).",
        choices=BURST_POLICIES.names(),
    )
    tier_task_timeout_s: float = option(
        30.0, "A demote/promote task not reported done after this long is abandoned.", parse=parse_duration
    )
    # KV events for routers (master/kv_events.py; needs kvpool[kv-events])
    kv_events: str = option(
        "",
        "Publish stored/removed pages as SGLang KV events (ZMQ PUB, medium EXTERNAL) on this endpoint, "
        "e.g. tcp://*:5557. Empty = off.",
    )
    kv_events_page_size: int = option(0, "block_size written into the BlockStored events (the engines' page size).")
    # Sampled eviction's carried pool and bounded urgent evictions (docs/decisions/0086-eviction-pool.md)
    eviction_pool_size: int = option(
        256,
        "Sampled eviction: carry up to this many of the best candidates not evicted from one eviction to the next "
        "(re-validated before use), so that small evictions pick near-LRU victims (0 = no pool).",
    )
    urgent_eviction_slack: int = option(
        32,
        "A put that finds the pool full evicts what it needs plus about this many objects more, never the whole "
        "way down to eviction_target (the background eviction does that).",
    )

    def __post_init__(self) -> None:
        if not 0 < self.eviction_target <= self.eviction_high_watermark <= 1.0:
            raise ValueError("need 0 < eviction_target <= eviction_high_watermark <= 1")
        if self.num_shards < 1:
            raise ValueError("num_shards must be >= 1")
        if self.spin_us < 0:
            raise ValueError("spin_us must be >= 0")
        if self.default_replica_num < 1:
            raise ValueError("default_replica_num must be >= 1")
        if self.lease_ttl_s <= 0 or self.put_timeout_s <= 0 or self.store_ttl_s <= 0:
            raise ValueError("lease_ttl_s, put_timeout_s and store_ttl_s must be > 0")
        if not 0 < self.ssd_eviction_target <= self.ssd_high_watermark <= 1.0:
            raise ValueError("need 0 < ssd_eviction_target <= ssd_high_watermark <= 1")
        check_ports(port=self.port, rpc_port=self.rpc_port)
        check_ports(metrics_port=self.metrics_port, off=-1)
        if self.promote_after_hits < 0 or not 0 <= self.demote_max_pending <= 1 or self.tier_task_timeout_s <= 0:
            raise ValueError("promote_after_hits >= 0, 0 <= demote_max_pending <= 1, tier_task_timeout_s > 0")
        if self.eviction_pool_size < 0 or self.urgent_eviction_slack < 0:
            raise ValueError("eviction_pool_size and urgent_eviction_slack must be >= 0")
