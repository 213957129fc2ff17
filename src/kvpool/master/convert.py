"""proto <-> master-state dataclasses, in one place (the state never sees protobuf)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvpool.master import state as st
from kvpool.proto import master_pb2 as pb


def segment_spec(seg: pb.SegmentInfo, secret: bytes) -> st.SegmentSpec:
    return st.SegmentSpec(
        id=seg.id,
        node=seg.node,
        store_id=seg.store_id,
        size=seg.size,
        tcp_endpoint=seg.tcp_endpoint,
        shm_path=seg.shm_path,
        secret=secret,
        rdma_desc=seg.rdma_desc,
        numa_node=seg.numa_node,
        tier=seg.tier,
    )


def inventory(entries: Sequence[pb.InventoryEntry]) -> list[st.InventoryItem]:
    return [st.InventoryItem(e.key, e.offset, e.length, e.checksum, e.tier) for e in entries]


def put_options(cfg: pb.PutConfig) -> st.PutOptions:
    return st.PutOptions(
        replica_num=cfg.replica_num,
        hard_pin=cfg.hard_pin,
        soft_pin_ttl_s=cfg.soft_pin_ttl_ms / 1000.0,
        preferred_segments=tuple(int(s) for s in cfg.preferred_segments if s.isdigit()),
        preferred_node=cfg.preferred_node,
        writer_node=cfg.writer_node,
    )


def _set_replica(d: Any, r: st.ReplicaGrant) -> None:
    """Copy a grant into a ReplicaDescriptor, field by field: ~20 % cheaper per key than building the
    message from keyword arguments (a dict per replica)."""
    d.segment_id = r.segment_id
    d.node = r.node
    d.tcp_endpoint = r.tcp_endpoint
    d.shm_path = r.shm_path
    d.offset = r.offset
    d.length = r.length
    d.expiry_ms = r.expiry_ms
    d.mac = r.mac
    d.tier = r.tier


def replica(r: st.ReplicaGrant) -> pb.ReplicaDescriptor:
    d = pb.ReplicaDescriptor()
    _set_replica(d, r)
    return d


def fill_replicas(out: Any, replicas: Sequence[st.ReplicaGrant]) -> None:
    """Append replica descriptors in place (``repeated.add``: no intermediate message to copy)."""
    for r in replicas:
        _set_replica(out.add(), r)


def fill_put_start_results(out: Any, results: Sequence[st.PutStartResult]) -> None:
    for r in results:
        item = out.add()
        item.code = int(r.code)
        fill_replicas(item.replicas, r.replicas)


def fill_get_results(out: Any, results: Sequence[st.GetResult]) -> None:
    for r in results:
        item = out.add()
        item.code = int(r.code)
        item.size = r.size
        item.checksum = r.checksum
        item.lease_expiry_ms = r.lease_expiry_ms
        fill_replicas(item.replicas, r.replicas)
