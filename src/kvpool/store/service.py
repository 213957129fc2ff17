"""The store process: one shared-memory segment, its data plane, and its link to the master.

The store is the source of truth for what it holds: its inventory of fully written objects goes to the
master with every (re)mount, so a restarted or newly elected master rebuilds its index and allocators
from the stores instead of starting cold. Heartbeats carry the master's free notifications back, so
the inventory forgets ranges the master evicted or removed.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import grpc
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kvpool.common import envs, tls
from kvpool.common.auth import TokenChecker, grpc_error_code, grpc_metadata, load_token
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.grants import new_secret
from kvpool.common.groups import group_scope
from kvpool.common.httpserver import MetricsServer
from kvpool.common.log import get_logger
from kvpool.proto import master_pb2 as pb
from kvpool.proto import master_pb2_grpc as pb_grpc
from kvpool.store.config import StoreConfig
from kvpool.store.dataplane import DataPlaneServer
from kvpool.store.inventory import Inventory
from kvpool.store.limits import ClientLimits
from kvpool.store.mover import Mover
from kvpool.store.segment import ShmSegment
from kvpool.store.standby_feed import StandbyFeed
from kvpool.store.tiering import StoreTier
from kvpool.transfer.factory import make_responder
from kvpool.transfer.rdma_rails import Responder
from kvpool.transfer.tcp import TcpTransport

log = get_logger(__name__)


class MasterLink:
    """gRPC to the current master: mount, heartbeat, unmount. Re-resolves the leader on failure."""

    def __init__(self, master: str, cluster: str, token_file: str, tls_ca: str = "") -> None:
        self._master = master
        self._tls_ca = tls_ca
        self._cluster = cluster
        self._metadata = grpc_metadata(load_token(token_file))
        self._channel: grpc.Channel | None = None
        self._endpoint = ""
        self._resolve = _resolver(master, cluster)
        self._max_view = 0

    def _stub(self) -> pb_grpc.MasterServiceStub:
        if self._channel is not None and self._leader_moved():
            self.reset()  # a new leader is published: go there now, not after a timeout at the old one
        if self._channel is None:
            self._endpoint = self._resolve(2.0)
            self._channel = tls.channel(
                self._endpoint,
                self._tls_ca,
                options=[
                    ("grpc.max_send_message_length", 1 << 30),
                    ("grpc.max_receive_message_length", 1 << 30),
                ],
            )
        return pb_grpc.MasterServiceStub(self._channel)  # type: ignore[no-untyped-call]

    def _leader_moved(self) -> bool:
        try:
            return bool(self._resolve(0.0) != self._endpoint)
        except KvPoolError:
            return False

    def reset(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel = None

    def call(self, method: str, request: Any, timeout: float) -> Any:
        try:
            response = getattr(self._stub(), method)(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as exc:
            self.reset()
            raise KvPoolError(grpc_error_code(exc), f"{method} to {self._endpoint}: {exc.code().name}") from exc
        except KvPoolError:
            self.reset()
            raise
        code = as_code(response.status.code)
        if response.status.view < self._max_view:
            # A deposed leader answered (it was frozen past its lease): act on nothing it says.
            self.reset()
            raise KvPoolError(
                ErrorCode.STALE_VIEW,
                f"{self._endpoint} answered with view {response.status.view} < {self._max_view}",
            )
        self._max_view = response.status.view
        if code in (ErrorCode.NOT_LEADER, ErrorCode.LEADER_WARMING_UP):
            self.reset()
        return response


def _resolver(master: str, cluster: str) -> Any:
    if master.startswith("etcd://"):
        from kvpool.common.leader_watch import etcd_resolver

        return etcd_resolver(master, cluster)
    return lambda wait_s=0.0: master


class _MountBackoff:
    """A store whose master cannot be reached says which address and why, suggests --master, and tries
    again after 1, 2, 4 ... 30 s instead of at every heartbeat."""

    FIRST_S = 1.0
    LONGEST_S = 30.0

    def __init__(self) -> None:
        self._wait = 0.0
        self._next_at = 0.0

    def due(self) -> bool:
        return time.monotonic() >= self._next_at

    def reset(self) -> None:
        self._wait = 0.0
        self._next_at = 0.0

    def failed(self, master: str, exc: KvPoolError) -> None:
        self._wait = min(self.LONGEST_S, self._wait * 2 or self.FIRST_S)
        self._next_at = time.monotonic() + self._wait
        log.warning(
            "mount failed: master %s %s (%s); check --master (or KVPOOL_MASTER); trying again in %.0f s",
            master,
            _why_unreachable(master),
            exc,
            self._wait,
        )


def _why_unreachable(master: str) -> str:
    """Whether the master's host name resolves, in words (the usual typo is the address itself)."""
    if master.startswith("etcd://"):
        return "(no serving leader found through etcd)"
    host, _, port = master.rpartition(":")
    try:
        socket.getaddrinfo(host.strip("[]"), int(port) if port.isdigit() else None)
    except (OSError, ValueError):
        return f"cannot be resolved (unknown host {host!r})"
    return "does not answer (refused or unreachable)"


class StoreServer:
    """A running store. ``start()`` creates the segment and serves; ``run()`` also heartbeats until stopped."""

    def __init__(
        self, config: StoreConfig, *, group: int = 0, groups: int = 1, primary: StoreServer | None = None
    ) -> None:
        if not config.master:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "a store needs --master (or KVPOOL_MASTER)")
        self.config = config
        self.group = group
        self.groups = groups
        self._scope = group_scope(config.cluster, group, groups)
        """The etcd scope of the shard group this segment is mounted to (decision 0080)."""
        self._primary = primary
        """With several groups: the group-0 server whose data plane serves this group's segment too."""
        self.members: list[StoreServer] = []
        """The other groups' servers sharing this one's data plane (on the group-0 server)."""
        self.store_id: str = primary.store_id if primary is not None else uuid.uuid4().hex[:16]
        self.node = config.node or envs.node_name()
        self.inventory: Inventory = primary.inventory if primary is not None else Inventory()
        self.segment: ShmSegment | None = None
        self.dataplane: DataPlaneServer | None = None
        self.rdma: Responder | None = None
        """One-sided RDMA to the segment (docs/rdma.md); None when no device serves it."""
        self.tier: StoreTier | None = None
        self.mover: Mover | None = None
        """Runs the drain/rebalance copies the master hands this store (store/mover.py)."""
        """The SSD tier (--ssd-dir), mounted as a second segment with tier=1 (docs/ssd-tier.md)."""
        self._secret = new_secret()
        self._link = MasterLink(config.master, self._scope, config.token_file, config.tls_ca)
        self._freed_ack = 0
        self._mounted = False
        self._mount_backoff = _MountBackoff()
        self._mover_transport: TcpTransport | None = None
        self._standby_feed: StandbyFeed | None = None
        self._stop = threading.Event()
        self._metrics: MetricsServer | None = None
        self.registry = CollectorRegistry()
        self.registry.register(_StoreCollector(self))

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        if self._primary is not None:
            self._start_member(self._primary)
            return
        cfg = self.config
        if cfg.numa_node >= 0:
            from kvpool.store.numa import bind_current_process

            bind_current_process(cfg.numa_node)
        name = f"kvpool-{cfg.cluster}-{self.store_id}" + (f"-g{self.group}" if self.groups > 1 else "")
        self.segment = ShmSegment.create(cfg.shm_dir, name, cfg.size, hugepages=cfg.hugepages)
        if cfg.numa_node >= 0:
            from kvpool.store.numa import bind_memory

            bind_memory(self.segment, cfg.numa_node)
        self.segment.prefault()
        self.rdma = make_responder(
            cfg.rdma_device,
            {self.segment.id: self.segment},
            {self.segment.id: self._secret},
            gid_index=cfg.rdma_gid_index,
        )
        self.dataplane = DataPlaneServer(
            cfg.host,
            cfg.port,
            {self.segment.id: self.segment},
            {self.segment.id: self._secret},
            self.inventory,
            max_connections=cfg.max_connections,
            store_info=self.info,
            auth=TokenChecker.from_file(cfg.token_file),
            limits=ClientLimits(cfg.max_connections_per_client, cfg.max_inflight_bytes_per_client),
            spin_us=cfg.spin_us,
            read_sendfile=cfg.read_sendfile,
            rdma=self.rdma,
        )
        self.dataplane.read_by_key.enabled = cfg.read_by_key
        self.registry.register(self.dataplane.auth.collector("store"))
        self._open_tier()
        self.dataplane.start()
        if cfg.metrics_port >= 0:
            self._metrics = MetricsServer(cfg.host, cfg.metrics_port, self.registry, self._health).start()
        log.info(
            "store %s on node %s: segment %d (%d bytes) at %s, data plane %s, metrics %s",
            self.store_id,
            self.node,
            self.segment.id,
            self.segment.size,
            self.segment.path,
            self.tcp_endpoint,
            self.metrics_endpoint or "off",
        )

    def _start_member(self, primary: StoreServer) -> None:
        """Another group's part of this store: its own segment, served by the group-0 server's data plane."""
        cfg = self.config
        assert primary.dataplane is not None
        name = f"kvpool-{cfg.cluster}-{self.store_id}-g{self.group}"
        self.segment = ShmSegment.create(cfg.shm_dir, name, cfg.size, hugepages=cfg.hugepages)
        self.segment.prefault()
        self.dataplane = primary.dataplane
        self.dataplane.add_segment(self.segment, self._secret)
        if primary.rdma is not None:  # the primary's responders register it: RDMA_CONNECT admits any group's grant
            primary.rdma.add_segment(self.segment.id, self.segment, self._secret)
        self._open_tier()
        primary.members.append(self)
        log.info(
            "store %s: segment %d (%d bytes) for shard group %d", self.store_id, self.segment.id, cfg.size, self.group
        )

    def _open_tier(self) -> None:
        """The SSD tier (--ssd-dir; with several groups this group's share of it), served by the data plane."""
        if not self.config.ssd_dir:
            return
        assert self.dataplane is not None
        self.tier = StoreTier.open(self.config.ssd_dir, self.config.ssd_size)
        self.dataplane.add_tier(self.tier.segment_id, self.tier.ssd, self.tier.secret)

    @property
    def tcp_endpoint(self) -> str:
        assert self.dataplane is not None
        return f"{self.config.advertise or self.config.host}:{self.dataplane.port}"

    @property
    def metrics_endpoint(self) -> str:
        return f"{self.config.advertise or self.config.host}:{self._metrics.port}" if self._metrics else ""

    def info(self) -> dict[str, Any]:
        """What a client asking STORE_INFO learns (same-node clients map the segment from this)."""
        assert self.segment is not None
        return {
            "store_id": self.store_id,
            "node": self.node,
            "pid": os.getpid(),
            "segments": [
                {"id": seg.id, "size": seg.size, "shm_path": seg.path}
                for seg in [self.segment, *(m.segment for m in self.members)]
                if seg is not None
            ],
            **({"rdma": self.rdma.advertisement()} if self.rdma is not None else {}),
        }

    def _segment_info(self) -> pb.SegmentInfo:
        assert self.segment is not None
        return pb.SegmentInfo(
            id=self.segment.id,
            node=self.node,
            store_id=self.store_id,
            size=self.segment.size,
            tcp_endpoint=self.tcp_endpoint,
            shm_path=self.segment.path,
            status=pb.SEGMENT_OK,
            numa_node=self.config.numa_node,
        )

    def _mount_request(self, remount: bool) -> pb.MountSegmentRequest:
        assert self.segment is not None
        entries = [
            pb.InventoryEntry(key=_text(e.key), offset=e.offset, length=e.length, checksum=e.checksum)
            for e in self.inventory.entries(self.segment.id)
        ]
        return pb.MountSegmentRequest(
            segment=self._segment_info(), secret=self._secret, inventory=entries, remount=remount
        )

    def mount(self, remount: bool) -> bool:
        """Mount (or re-mount with the inventory); False when the master is unreachable."""
        assert self.segment is not None
        if self.mover is not None:
            self.mover.fence()  # before the inventory snapshot: a copy planned by the old master is not kept
        request = self._mount_request(remount)
        try:
            response = self._link.call("RemountSegment" if remount else "MountSegment", request, timeout=30.0)
        except KvPoolError as exc:
            self._mount_backoff.failed(self.config.master, exc)
            return False
        self._mount_backoff.reset()
        code = as_code(response.status.code)
        if code != ErrorCode.OK:
            log.warning("mount refused: %s %s", code.name, response.status.message)
            return False
        if self.tier is not None and not self.tier.mount(self._link, self._segment_info(), remount):
            return False  # the next heartbeat mounts both again
        self._mounted = True
        # A (re)mount starts a fresh free-notification stream on the master.
        self._freed_ack = 0
        log.info(
            "mounted with the master (%s): %d objects adopted, %d rejected",
            "remount" if remount else "first mount",
            response.adopted,
            response.rejected,
        )
        return True

    def heartbeat(self) -> None:
        """One heartbeat: apply the master's free notifications; re-mount when it does not know us."""
        assert self.segment is not None
        if not self._mounted:
            if self._mount_backoff.due():
                self.mount(remount=len(self.inventory) > 0)
            return
        segment_ids = [self.segment.id] + ([self.tier.segment_id] if self.tier is not None else [])
        request = pb.HeartbeatRequest(store_id=self.store_id, segment_ids=segment_ids, freed_ack=self._freed_ack)
        try:
            response = self._link.call("Heartbeat", request, timeout=2.0)
        except KvPoolError as exc:
            log.debug("heartbeat failed: %s", exc)
            return
        code = as_code(response.status.code)
        if code == ErrorCode.NEED_REMOUNT:
            log.info("the master does not know this store (restart or failover): re-mounting")
            self._mounted = False
            self.mount(remount=True)
            return
        for freed in response.freed:
            self.inventory.drop(freed.segment_id, freed.offset, freed.key.encode())
            self._freed_ack = max(self._freed_ack, freed.seq)
        if response.moves_pending and self.mover is not None:
            self.mover.wake()

    def run(self) -> None:
        """Heartbeat until ``stop()``; then unmount and release the segment."""
        if not self._mounted and self._mount_backoff.due():
            self.mount(remount=False)
        if self.tier is not None and self.segment is not None:
            # Its own link: SSD task polls never queue behind a heartbeat (or the reverse).
            link = MasterLink(self.config.master, self._scope, self.config.token_file, self.config.tls_ca)
            self.tier.start_worker(link, self.store_id, self.segment, self.inventory)
        if self.segment is not None:
            # Drain/rebalance copies into this store; its own link, like the tier worker.
            # Store-to-store copies open data-plane connections too: they present the cluster token.
            self._mover_transport = TcpTransport(token=load_token(self.config.token_file))
            self.mover = Mover(
                MasterLink(self.config.master, self._scope, self.config.token_file, self.config.tls_ca),
                self.store_id,
                self.segment,
                self._secret,
                self.inventory,
                transport=self._mover_transport,
            )
            self.mover.start()
        self._start_standby_feed()
        while not self._stop.wait(self.config.heartbeat_interval_s):
            self.heartbeat()
        self.shutdown()

    def _start_standby_feed(self) -> None:
        """Warm standbys (decision 0070): with an etcd:// master, feed the standby masters our inventory."""
        cfg = self.config
        if self.segment is None or cfg.standby_feed_interval_s <= 0 or not cfg.master.startswith("etcd://"):
            return
        self._standby_feed = StandbyFeed(
            cfg.master,
            self._scope,
            self.inventory,
            self.store_id,
            self.segment.id,
            lambda: self._mount_request(remount=True),
            token_file=cfg.token_file,
            tls_ca=cfg.tls_ca,
            interval_s=cfg.standby_feed_interval_s,
        )
        self._standby_feed.start()

    def stop(self) -> None:
        self._stop.set()

    def shutdown(self, unmount: bool = True) -> None:
        if self._standby_feed is not None:
            self._standby_feed.stop()
        if self.mover is not None:
            self.mover.stop()  # before the segment is unmapped: no copy is writing into it any more
        if self._mover_transport is not None:
            self._mover_transport.close()
        if self.tier is not None:
            if self.tier.worker is not None:
                self.tier.worker.stop()
            if unmount and self._mounted:
                self.tier.unmount(self._link, self.store_id)
        if unmount and self._mounted and self.segment is not None:
            try:
                self._link.call(
                    "UnmountSegment",
                    pb.UnmountSegmentRequest(segment_id=self.segment.id, store_id=self.store_id),
                    timeout=2.0,
                )
            except KvPoolError as exc:
                log.warning("unmount failed (the master will expire this store): %s", exc)
        if self._primary is not None:  # another group's part: the group-0 server owns the data plane
            if self.dataplane is not None and self.segment is not None:
                self.dataplane.remove_segment(self.segment.id)
        elif self.dataplane is not None:
            self.dataplane.stop()
        if self._metrics is not None:
            self._metrics.stop()
        if self.rdma is not None:
            self.rdma.close()  # after the data plane, before the unmap: its MRs pin the segment's pages
        if self.segment is not None:
            self.segment.close()
        if self._primary is None:  # the data plane serves every group's tier until it stops
            for tier in [self.tier, *(m.tier for m in self.members)]:
                if tier is not None:
                    tier.close()  # after the data plane: no SSD read is in flight any more
        self._link.reset()

    def _health(self) -> tuple[bool, dict[str, Any]]:
        mounted = self.all_mounted()
        body: dict[str, Any] = {
            "store_id": self.store_id,
            "node": self.node,
            "mounted": mounted,
            "objects": len(self.inventory),
        }
        if self.groups > 1:  # ready only when every group can allocate here; say which group is missing
            body["groups"] = [server._group_health() for server in [self, *self.members]]
        return mounted, body

    def all_mounted(self) -> bool:
        """Mounted with every group's master (with one group: with the master)."""
        return self._mounted and all(m._mounted for m in self.members)

    def _group_health(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "mounted": self._mounted,
            "segment_id": self.segment.id if self.segment is not None else 0,
            **({"ssd_segment_id": self.tier.segment_id} if self.tier is not None else {}),
        }


class _StoreCollector(Collector):
    def __init__(self, store: StoreServer) -> None:
        self._store = store

    def collect(self) -> Any:
        store = self._store
        yield GaugeMetricFamily("kvpool_store_objects", "Objects in this store's inventory", value=len(store.inventory))
        yield GaugeMetricFamily(
            "kvpool_store_mounted", "1 when mounted with a master (every group's)", value=int(store.all_mounted())
        )
        tiers = [t for t in [store.tier, *(m.tier for m in store.members)] if t is not None]
        if tiers:
            for name, value in _tier_totals(tiers).items():
                doc = f"SSD tier: {name.replace('_', ' ')}"
                family = CounterMetricFamily if name in StoreTier.COUNTERS else GaugeMetricFamily
                yield family(f"kvpool_store_{name}", doc, value=value)
        if store.dataplane is None:
            return
        s = store.dataplane.statistics()
        yield GaugeMetricFamily("kvpool_store_connections", "Open data-plane connections", value=s.connections)
        yield CounterMetricFamily("kvpool_store_bytes_read", "Bytes served to readers", value=s.bytes_read)
        yield CounterMetricFamily("kvpool_store_bytes_written", "Bytes written by clients", value=s.bytes_written)
        yield CounterMetricFamily("kvpool_store_requests", "Data-plane requests", value=s.requests)
        yield CounterMetricFamily(
            "kvpool_store_reads_revalidated",
            "Reads served on an ended grant because this store still holds the object (decision 0014)",
            value=s.reads_revalidated,
        )
        yield CounterMetricFamily(
            "kvpool_store_bytes_read_from_pages",
            "Bytes served by sendfile from the segment's pages (--read-sendfile; decision 0017)",
            value=s.bytes_read_from_pages,
        )
        yield CounterMetricFamily(
            "kvpool_store_connections_rejected",
            "Connections refused (total or per-client limit)",
            value=s.connections_rejected,
        )
        by_key = store.dataplane.read_by_key.statistics()
        yield CounterMetricFamily(
            "kvpool_store_reads_by_key",
            "Objects sent for a speculative read by key (decision 0031)",
            value=by_key.served,
        )
        yield CounterMetricFamily(
            "kvpool_store_reads_by_key_not_held",
            "Speculative reads by key answered with nothing (no such object here, or larger than asked)",
            value=by_key.not_held,
        )
        yield from _rdma_metrics(store.rdma)
        errors = CounterMetricFamily("kvpool_store_errors", "Data-plane error replies by code", labels=["code"])
        for code, n in sorted(s.errors.items()):
            errors.add_metric([code], n)
        yield errors


def _tier_totals(tiers: list[StoreTier]) -> dict[str, int]:
    """The SSD figures of every group's tier share summed (direct I/O: 1 only when every share uses it)."""
    totals: dict[str, int] = {}
    for tier in tiers:
        for name, value in tier.metrics().items():
            totals[name] = (
                min(totals.get(name, value), value) if name == "ssd_direct_io" else totals.get(name, 0) + value
            )
    return totals


def _rdma_metrics(rdma: Responder | None) -> Any:
    """RDMA in use: admitted queue pairs, and the windows (and bytes) granted over it (docs/rdma.md)."""
    if rdma is None:
        return
    yield GaugeMetricFamily("kvpool_store_rdma_connections", "RDMA queue pairs admitted", value=rdma.connections)
    if rdma.windows is not None:
        yield GaugeMetricFamily("kvpool_store_rdma_windows", "Memory windows live", value=rdma.windows.live())
        yield CounterMetricFamily(
            "kvpool_store_rdma_windows_bound", "Memory windows bound (one per grant)", value=rdma.windows.bound
        )
        yield CounterMetricFamily(
            "kvpool_store_rdma_bytes_granted",
            "Bytes made reachable by RDMA windows (the NIC moves them; the store CPU does not see them)",
            value=rdma.windows.bytes_bound,
        )


def ready_info(store: StoreServer) -> dict[str, object]:
    """What ``--ready-file`` holds once the store serves: its endpoints, node, id and segment file."""
    return {
        "tcp": store.tcp_endpoint,
        "metrics": store.metrics_endpoint,
        "node": store.node,
        "store_id": store.store_id,
        "shm": store.segment.path if store.segment else "",
    }


def _first_mount(store: StoreServer) -> None:
    # Ready means mounted: a client that sees this store as ready can allocate on it. If the master is
    # not reachable yet, the heartbeat loop keeps trying after the first attempts.
    for _ in range(20):
        if (store._mount_backoff.due() and store.mount(remount=False)) or store._stop.wait(0.25):
            break


def serve(config: StoreConfig, ready_file: str = "") -> int:
    """``kvpool store``: serve until SIGTERM/SIGINT, then unmount cleanly."""
    from kvpool.store.groups import serve_groups, store_groups  # it builds StoreServers: imported here

    groups = store_groups(config)
    if groups > 1:
        return serve_groups(config, groups, ready_file)
    store = StoreServer(config)
    store.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: store.stop())
    _first_mount(store)
    if ready_file:
        Path(ready_file).write_text(json.dumps(ready_info(store)))
    store.run()
    return 0


def _text(key: str | bytes) -> str:
    return key.decode() if isinstance(key, bytes) else key
