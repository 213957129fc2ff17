"""High availability: this master as one of several replicas elected through etcd.

The coordinator wires a :class:`~kvpool.master.leader.LeaderElector` into the master's :class:`Role`:

* a **follower** answers NOT_LEADER (with the leader's address) to everything but cluster info and
  stats, and keeps an empty index;
* a freshly elected leader **warms up** for one lease TTL (so a deposed leader has surely stopped):
  during it, it accepts only store membership calls, so the stores re-mount with their inventories and
  the index and allocators are rebuilt before the first data call is served (the cache survives a
  failover — Mooncake's default HA starts cold);
* a **deposed** leader forgets its index at once (a later leadership rebuilds it from the stores).

Each master also registers itself under ``/kvpool/<cluster>/masters/<id>`` (bound to its own lease, with
its state: leader, warming_up or standby) so that tools and the leader list every live master, and the
cluster config is kept as a durable intent in etcd. A master frozen past that lease (SIGSTOP) loses the
key; when it runs again it registers afresh under a new lease, so it is listed again as a standby.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import uuid
from typing import Any

from kvpool.common.coordinator import Coordinator, LeaseHandle
from kvpool.common.errors import KvPoolError
from kvpool.common.etcd import EtcdClient, KeyValue, cluster_prefix
from kvpool.common.groups import group_scope, read_group_count, record_group_count
from kvpool.common.leader_watch import LeaderWatch
from kvpool.common.log import get_logger
from kvpool.master.config import MasterConfig
from kvpool.master.intents import IntentStore
from kvpool.master.leader import ElectorState, LeaderElector
from kvpool.master.service import MasterServer

log = get_logger(__name__)

_MEMBER_STATES = {ElectorState.LEADER: "leader", ElectorState.WARMING_UP: "warming_up"}
"""What a master's registration says it is; any other elector state lists it as a "standby"."""


class HaCoordinator:
    """Runs the election for one master replica and keeps its Role current.

    ``coordinator`` replaces the etcd client built from ``config.etcd`` (tests pass an in-memory fake).
    """

    def __init__(self, config: MasterConfig, server: MasterServer, coordinator: Coordinator | None = None) -> None:
        self.config = config
        self.server = server
        self.id = uuid.uuid4().hex[:12]
        self.etcd: Coordinator = coordinator or EtcdClient(config.etcd, timeout=max(2.0, config.leader_ttl_s))
        self.scope = group_scope(config.cluster, config.group, config.groups)
        """Where this master's group keeps its election, registrations and intents in etcd (decision 0080)."""
        self.intents = IntentStore(self.etcd, self.scope)
        self._members_prefix = cluster_prefix(self.scope) + "masters/"
        self._elector: LeaderElector | None = None
        self._watch: LeaderWatch | None = None
        self._member_lease: LeaseHandle | None = None
        self._registered_state = ""
        self._member_lock = threading.Lock()  # stop() and the refresh thread's re-registration
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._refresh_loop, name="ha-refresh", daemon=True)

    async def start(self) -> None:
        info = {"id": self.id, **self.server.endpoints}
        self._elector = LeaderElector(
            self.etcd,
            self.scope,
            info,
            ttl_s=self.config.leader_ttl_s,
            on_elected=self._on_elected,
            on_deposed=self._on_deposed,
            name=self.id,
        )
        self.server.role.elector = self._elector
        self.server.handlers.drains.attach_intents(self.intents)  # drain jobs are durable intents
        self.server.reset_state()
        self._watch = LeaderWatch(self.etcd, self.scope)
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, record_group_count, self.etcd, self.config.cluster, self.config.groups)
        await loop.run_in_executor(None, self._register)
        self._elector.start()
        self._thread.start()

    def _register(self) -> None:
        """Register under a fresh member lease (at start, and again once a frozen process lost it)."""
        if self._member_lease is not None:
            self._member_lease.stop(revoke=not self._member_lease.lost)
        self._member_lease = self.etcd.keep_lease(max(self.config.leader_ttl_s, 2.0), name="member")
        lease = self._member_lease.start()
        self._put_member(self._member_state(), lease)

    def _member_state(self) -> str:
        state = self._elector.state if self._elector is not None else ElectorState.IDLE
        return _MEMBER_STATES.get(state, "standby")

    def _put_member(self, state: str, lease: int) -> None:
        doc = {**self.server.endpoints, "id": self.id, "state": state, "group": self.config.group}
        self.etcd.put(self._members_prefix + self.id, json.dumps(doc), lease=lease)
        self._registered_state = state

    def _keep_registered(self, members: list[KeyValue]) -> None:
        """Re-register when the member key is gone (its lease expired while this process was frozen)
        and rewrite it when this master's state changed."""
        with self._member_lock:
            if self._stop.is_set():
                return
            lease = self._member_lease
            mine = any(kv.key == self._members_prefix + self.id for kv in members)
            if lease is None or lease.lost or not mine:
                log.info("re-registering this master under a new member lease")
                self._register()
                return
            state = self._member_state()
            if state != self._registered_state:
                self._put_member(state, lease.lease_id)

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
        """Keep the leader's address (for NOT_LEADER redirects), the follower list and this master's own
        registration current."""
        while not self._stop.wait(0.5):
            with contextlib.suppress(KvPoolError):
                leader = self._watch.get() if self._watch else None
                mine = self.server.endpoints.get("grpc", "")
                self.server.role.leader = (leader.address("grpc") or "") if leader else ""
                members = self.etcd.get_prefix(self._members_prefix)
                self._keep_registered(members)
                docs = [_member_doc(kv) for kv in members]
                endpoints = [d.get("grpc", "") for d in docs]
                self.server.role.followers = sorted(e for e in endpoints if e and e != mine)
                self.server.role.members = sorted(
                    (d.get("grpc", ""), str(d.get("state", "standby"))) for d in docs if d.get("grpc")
                )

    async def stop(self) -> None:
        """Resign (a clean, instant handover), then release everything."""
        self._stop.set()
        loop = asyncio.get_running_loop()
        if self._elector is not None:
            await loop.run_in_executor(None, self._elector.stop)
        await loop.run_in_executor(None, self._stop_member_lease)
        if self._watch is not None:
            self._watch.close()
        self.etcd.close()

    def _stop_member_lease(self) -> None:
        with self._member_lock:
            if self._member_lease is not None:
                self._member_lease.stop()


def _member_doc(kv: KeyValue) -> dict[str, Any]:
    try:
        doc = json.loads(kv.value)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def leader_summary(etcd_endpoints: str, cluster: str) -> dict[str, Any]:
    """For tools: the current leader, the registered masters with their states, and the followers, from etcd.

    ``masters`` lists every live master as ``{"grpc": address, "state": "leader"|"warming_up"|"standby"}``.
    A cluster of several shard groups answers ``{"groups": [{"group": g, "leader": ..., "view": ...,
    "followers": [...], "masters": [...]}, ...]}`` (decision 0080).
    """
    with EtcdClient(etcd_endpoints) as etcd:
        groups = read_group_count(etcd, cluster)
        summaries = [_group_summary(etcd, group_scope(cluster, g, groups)) for g in range(groups)]
    if groups == 1:
        return summaries[0]
    return {"groups": [{"group": g, **summary} for g, summary in enumerate(summaries)]}


def _group_summary(etcd: EtcdClient, scope: str) -> dict[str, Any]:
    from kvpool.common.leader_watch import leader_key, parse_leader

    leader = parse_leader(etcd.get(leader_key(scope)))
    members = [_member_doc(kv) for kv in etcd.get_prefix(cluster_prefix(scope) + "masters/")]
    grpc_leader = leader.address("grpc") if leader else None
    masters = sorted(
        ({"grpc": str(m["grpc"]), "state": str(m.get("state", "standby"))} for m in members if m.get("grpc")),
        key=lambda m: m["grpc"],
    )
    return {
        "leader": grpc_leader,
        "view": leader.view if leader else 0,
        "followers": [m["grpc"] for m in masters if m["grpc"] != grpc_leader],
        "masters": masters,
    }
