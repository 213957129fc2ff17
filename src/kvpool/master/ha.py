"""High availability: this master as one of several replicas elected through etcd.

The coordinator wires a :class:`~kvpool.master.leader.LeaderElector` into the master's :class:`Role`:

* a **follower** answers NOT_LEADER (with the leader's address) to everything but cluster info and
  stats, and keeps an empty index;
* a freshly elected leader **warms up** for one lease TTL (so a deposed leader has surely stopped):
  during it, it accepts only store membership calls, so the stores re-mount with their inventories and
  the index and allocators are rebuilt before the first data call is served (the cache survives a
  failover — Mooncake's default HA starts cold);
* a **deposed** leader forgets its index at once (a later leadership rebuilds it from the stores).

Each master also registers itself under ``/kvpool/<cluster>/masters/<id>`` (bound to its own lease) so
the leader can list its followers, and the cluster config is kept as a durable intent in etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from typing import Any

from kvpool.common.coordinator import Coordinator, LeaseHandle
from kvpool.common.errors import KvPoolError
from kvpool.common.etcd import EtcdClient, cluster_prefix
from kvpool.common.leader_watch import LeaderWatch
from kvpool.common.log import get_logger
from kvpool.master.config import MasterConfig
from kvpool.master.intents import IntentStore
from kvpool.master.leader import LeaderElector
from kvpool.master.service import MasterServer

log = get_logger(__name__)


class HaCoordinator:
    """Runs the election for one master replica and keeps its Role current.

    ``coordinator`` replaces the etcd client built from ``config.etcd`` (tests pass an in-memory fake).
    """

    def __init__(self, config: MasterConfig, server: MasterServer, coordinator: Coordinator | None = None) -> None:
        self.config = config
        self.server = server
        self.id = uuid.uuid4().hex[:12]
        self.etcd: Coordinator = coordinator or EtcdClient(config.etcd, timeout=max(2.0, config.leader_ttl_s))
        self.intents = IntentStore(self.etcd, config.cluster)
        self._members_prefix = cluster_prefix(config.cluster) + "masters/"
        self._elector: LeaderElector | None = None
        self._watch: LeaderWatch | None = None
        self._member_lease: LeaseHandle | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh_loop, name="ha-refresh", daemon=True)

    async def start(self) -> None:
        info = {"id": self.id, **self.server.endpoints}
        self._elector = LeaderElector(
            self.etcd,
            self.config.cluster,
            info,
            ttl_s=self.config.leader_ttl_s,
            on_elected=self._on_elected,
            on_deposed=self._on_deposed,
            name=self.id,
        )
        self.server.role.elector = self._elector
        self.server.handlers.drains.attach_intents(self.intents)  # drain jobs are durable intents
        self.server.reset_state()
        self._watch = LeaderWatch(self.etcd, self.config.cluster)
        await asyncio.get_running_loop().run_in_executor(None, self._register)
        self._elector.start()
        self._thread.start()

    def _register(self) -> None:
        import json

        self._member_lease = self.etcd.keep_lease(max(self.config.leader_ttl_s, 2.0), name="member")
        lease = self._member_lease.start()
        self.etcd.put(self._members_prefix + self.id, json.dumps(self.server.endpoints), lease=lease)

    def _on_elected(self, view: int) -> None:
        log.info(
            "elected leader with view %d (%d objects rebuilt from the stores during warm-up)",
            view,
            self.server.state.stats().objects,
        )
        self.server.role.leader = ""
        threading.Thread(target=self._record_cluster_config, daemon=True).start()
        # Unfinished drains carry on: their segments turn DRAINING as the stores re-mount.
        threading.Thread(target=self.server.handlers.drains.resume, name="drain-resume", daemon=True).start()

    def _on_deposed(self) -> None:
        log.warning("lost the leadership: this master stops serving and forgets its index")
        self.server.reset_state()

    def _record_cluster_config(self) -> None:
        """The cluster config is a durable intent: the first leader writes it, later ones check it."""
        doc = {
            "num_shards": self.config.num_shards,
            "lease_ttl_s": self.config.lease_ttl_s,
            "store_ttl_s": self.config.store_ttl_s,
            "placement": self.config.placement,
        }
        try:
            existing = self.intents.get("config", "cluster")
            if existing is None:
                self.intents.create("config", "cluster", doc)
            elif existing.doc != doc:
                log.warning("this master's config %s differs from the cluster's recorded config %s", doc, existing.doc)
        except (KvPoolError, AttributeError) as exc:
            log.warning("cannot record the cluster config in etcd: %s", exc)

    def _refresh_loop(self) -> None:
        """Keep the leader's address (for NOT_LEADER redirects) and the follower list current."""
        import json

        while not self._stop.wait(0.5):
            with contextlib.suppress(KvPoolError):
                leader = self._watch.get() if self._watch else None
                mine = self.server.endpoints.get("grpc", "")
                self.server.role.leader = (leader.address("grpc") or "") if leader else ""
                members = self.etcd.get_prefix(self._members_prefix)
                endpoints = [json.loads(kv.value).get("grpc", "") for kv in members]
                self.server.role.followers = sorted(e for e in endpoints if e and e != mine)

    async def stop(self) -> None:
        """Resign (a clean, instant handover), then release everything."""
        self._stop.set()
        loop = asyncio.get_running_loop()
        if self._elector is not None:
            await loop.run_in_executor(None, self._elector.stop)
        if self._member_lease is not None:
            await loop.run_in_executor(None, self._member_lease.stop)
        if self._watch is not None:
            self._watch.close()
        self.etcd.close()


def leader_summary(etcd_endpoints: str, cluster: str) -> dict[str, Any]:
    """For tools: the current leader and the registered masters, read from etcd."""
    import json

    with EtcdClient(etcd_endpoints) as etcd:
        from kvpool.common.leader_watch import leader_key, parse_leader

        leader = parse_leader(etcd.get(leader_key(cluster)))
        members = [json.loads(kv.value) for kv in etcd.get_prefix(cluster_prefix(cluster) + "masters/")]
    grpc_leader = leader.address("grpc") if leader else None
    return {
        "leader": grpc_leader,
        "view": leader.view if leader else 0,
        "followers": sorted(m.get("grpc", "") for m in members if m.get("grpc") != grpc_leader),
    }
