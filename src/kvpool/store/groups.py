"""A store in a cluster of several shard groups (decision 0080): one segment per group, one data plane.

The store's DRAM is split into G equal segments; segment g is mounted to group g's master (found under
group g's etcd scope), heartbeats there, re-mounts there with its inventory after a failover and feeds
group g's standbys. Each group allocates only in its own segment, so no group ever waits for another.
All the segments are served by the group-0 server's one data plane (one port, one token; every grant
names its segment and is checked with that segment's secret) and by its RDMA responders (each registers
every group's segment, so RDMA_CONNECT admits grants of any group), and share one inventory.

With ``--ssd-dir`` each group gets its own share of the SSD tier: ``--ssd-size / G`` in the sub-directory
``group-<g>`` (its own data file, journal and directory lock), mounted to group g as its tier=1 segment and
run by group g's tier worker, so no SSD write, read or re-adoption of one group takes a lock of another's
(decision 0081). A restarted store re-adopts each share with its group.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import threading
import time
from pathlib import Path

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.groups import check_group_count, read_group_count
from kvpool.common.log import get_logger
from kvpool.store.config import StoreConfig
from kvpool.store.service import StoreServer, _first_mount, ready_info

log = get_logger(__name__)

_SEGMENT_ALIGN = 2 << 20
"""Each group's segment is a multiple of this (a 2 MiB hugepage; also a 4 KiB page)."""
_ETCD_WAIT_S = 30.0


def store_groups(config: StoreConfig) -> int:
    """The group count this store splits its segment by: ``--groups``, else etcd's record (1 for a
    host:port master). Waits for etcd (up to 30 s): guessing 1 would leave the store unmounted."""
    if config.groups:
        return check_group_count(config.groups)
    if not config.master.startswith("etcd://"):
        return 1
    from kvpool.common.etcd import EtcdClient
    from kvpool.common.leader_watch import parse_master_address

    _kind, endpoints = parse_master_address(config.master)
    assert isinstance(endpoints, list)
    deadline = time.monotonic() + _ETCD_WAIT_S
    while True:
        try:
            with EtcdClient(endpoints, timeout=2.0) as etcd:
                return read_group_count(etcd, config.cluster, timeout=2.0)
        except KvPoolError as exc:
            if time.monotonic() > deadline:
                raise KvPoolError(ErrorCode.ETCD_ERROR, f"cannot read the cluster's group count: {exc}") from exc
            time.sleep(1.0)


def group_segment_size(size: int, groups: int, option: str = "--size") -> int:
    each = size // groups // _SEGMENT_ALIGN * _SEGMENT_ALIGN
    if each <= 0:
        raise KvPoolError(
            ErrorCode.INVALID_ARGUMENT, f"{option} {size} is too small for {groups} shard groups of 2 MiB or more"
        )
    return each


def group_ssd_dir(ssd_dir: str, group: int) -> str:
    """Group ``group``'s share of the SSD tier directory (decision 0081)."""
    return str(Path(ssd_dir) / f"group-{group}")


def group_configs(config: StoreConfig, groups: int) -> list[StoreConfig]:
    """Each group's part of the store: an equal share of the DRAM and of the SSD tier."""
    part = dataclasses.replace(config, size=group_segment_size(config.size, groups))
    if not config.ssd_dir:
        return [part] * groups
    ssd_size = group_segment_size(config.ssd_size, groups, "--ssd-size")
    return [
        dataclasses.replace(part, ssd_dir=group_ssd_dir(config.ssd_dir, g), ssd_size=ssd_size) for g in range(groups)
    ]


def serve_groups(config: StoreConfig, groups: int, ready_file: str = "") -> int:
    """``kvpool store`` in a cluster of ``groups`` shard groups: serve until SIGTERM/SIGINT."""
    parts = group_configs(config, groups)
    primary = StoreServer(parts[0], group=0, groups=groups)
    primary.start()
    servers = [primary] + [StoreServer(parts[g], group=g, groups=groups, primary=primary) for g in range(1, groups)]
    for server in servers[1:]:
        server.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    for server in servers:
        _first_mount(server)
    if ready_file:
        info = ready_info(primary)
        info["shm_paths"] = [s.segment.path for s in servers if s.segment is not None]
        info["groups"] = groups
        Path(ready_file).write_text(json.dumps(info))
    threads = [threading.Thread(target=s.run, name=f"store-group-{s.group}", daemon=True) for s in servers]
    for thread in threads:
        thread.start()
    while not stop.wait(0.5):
        pass
    log.info("store stopping: unmounting from %d shard groups", groups)
    for server, thread in reversed(list(zip(servers, threads, strict=True))):  # the data plane's owner last
        server.stop()
        thread.join(timeout=30.0)
    return 0
