"""The store's side of warm standbys (decision 0070): feed every standby master this store's inventory.

Each standby gets the segment's whole inventory once (StandbySync), then, every ``interval_s``, the
entries committed and forgotten since, in the order the inventory made them (StandbyDelta). The journal of
changes is filled by the inventory's listener (an append under its lock) and trimmed once every standby
has them; if a standby falls too far behind, the journal is dropped and the standbys sync again.

The feed runs on its own thread, off the data plane and the heartbeat: a put never waits for it, and no
etcd write is made for it. Standbys are the masters registered under ``/kvpool/<cluster>/masters/``
other than the published leader.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from kvpool.common import tls
from kvpool.common.auth import grpc_metadata, load_token
from kvpool.common.errors import ErrorCode, KvPoolError, as_code
from kvpool.common.etcd import EtcdClient, cluster_prefix
from kvpool.common.leader_watch import leader_key, parse_leader, parse_master_address
from kvpool.common.log import get_logger
from kvpool.proto import master_pb2 as pb
from kvpool.proto import master_pb2_grpc as pb_grpc
from kvpool.store.inventory import Inventory, InventoryEntry

log = get_logger(__name__)

JOURNAL_LIMIT = 2_000_000
"""Most changes kept for a lagging standby before it is made to sync again from a snapshot."""
DELTA_BATCH = 50_000
"""Most changes in one StandbyDelta call."""


@dataclass
class _Standby:
    endpoint: str
    channel: grpc.Channel
    epoch: str = ""  # empty: not synced
    position: int = 0  # the journal position of the next change it needs


class StandbyFeed:
    """Feeds one segment's inventory to every standby master; ``start()`` runs it on a daemon thread."""

    def __init__(
        self,
        master: str,
        cluster: str,
        inventory: Inventory,
        store_id: str,
        segment_id: int,
        segment_request: Callable[[], pb.MountSegmentRequest],
        *,
        token_file: str = "",
        tls_ca: str = "",
        interval_s: float = 0.5,
    ) -> None:
        kind, endpoints = parse_master_address(master)
        if kind != "etcd":
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "the standby feed needs an etcd:// master address")
        assert isinstance(endpoints, list)
        self._etcd = EtcdClient(endpoints, timeout=2.0)
        self._cluster = cluster
        self._inventory = inventory
        self._store_id = store_id
        self._segment_id = segment_id
        self._segment_request = segment_request
        self._metadata = grpc_metadata(load_token(token_file))
        self._tls_ca = tls_ca
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._journal: list[tuple[InventoryEntry, bool]] = []
        self._base = 0  # the journal position of self._journal[0]
        self._standbys: dict[str, _Standby] = {}
        # The last batch serialized, (journal position, changes, bytes): the standbys usually stand at the
        # same position, and encoding is the feed's main cost on the store (it shares the data plane's
        # interpreter), so each change is encoded once, not once per standby.
        self._encoded: tuple[int, int, bytes] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="standby-feed", daemon=True)
        self.synced = 0
        """Full syncs sent (for tests and metrics)."""
        self.changes_sent = 0
        # Stores with several shard groups feed one standby set per group from one inventory: chain.
        self._chained = inventory.listener
        inventory.listener = self._record

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        self._inventory.listener = self._chained
        for standby in self._standbys.values():
            standby.channel.close()
        self._standbys.clear()
        self._etcd.close()

    # ---- the journal (called by the inventory, under its lock) ---------------------------------------------

    def _record(self, entry: InventoryEntry, removed: bool) -> None:
        if self._chained is not None:
            self._chained(entry, removed)
        if entry.segment_id != self._segment_id:
            return  # only the DRAM segment is fed; the SSD tier re-mounts as before
        with self._lock:
            self._journal.append((entry, removed))
            if len(self._journal) > JOURNAL_LIMIT:
                self._base += len(self._journal)
                self._journal = []  # every standby is now behind the journal: they sync again

    def _end(self) -> int:
        with self._lock:
            return self._base + len(self._journal)

    def _changes_from(self, position: int) -> list[tuple[InventoryEntry, bool]] | None:
        """Up to DELTA_BATCH changes from ``position``; None if they were dropped."""
        with self._lock:
            if position < self._base:
                return None
            start = position - self._base
            return self._journal[start : start + DELTA_BATCH]

    def _trim(self) -> None:
        with self._lock:
            synced = [s.position for s in self._standbys.values() if s.epoch]
            upto = min(synced) if synced else self._base + len(self._journal)
            if upto > self._base:
                del self._journal[: upto - self._base]
                self._base = upto

    # ---- the loop ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._refresh_standbys()
            except KvPoolError as exc:
                log.debug("standby feed: cannot list the masters: %s", exc)
                continue
            for standby in list(self._standbys.values()):
                if self._stop.is_set():
                    return
                self._feed(standby)
            self._trim()

    def _refresh_standbys(self) -> None:
        prefix = cluster_prefix(self._cluster)
        leader = parse_leader(self._etcd.get(leader_key(self._cluster)))
        leader_grpc = leader.address("grpc") if leader else None
        endpoints: set[str] = set()
        for kv in self._etcd.get_prefix(prefix + "masters/"):
            try:
                grpc_endpoint = json.loads(kv.value).get("grpc", "")
            except (ValueError, AttributeError):
                continue
            if isinstance(grpc_endpoint, str) and grpc_endpoint and grpc_endpoint != leader_grpc:
                endpoints.add(grpc_endpoint)
        for gone in set(self._standbys) - endpoints:
            self._standbys.pop(gone).channel.close()
        for endpoint in endpoints - set(self._standbys):
            self._standbys[endpoint] = _Standby(endpoint, tls.channel(endpoint, self._tls_ca, options=_OPTIONS))

    def _feed(self, standby: _Standby) -> None:
        try:
            if not standby.epoch:
                self._sync(standby)
            else:
                self._send_changes(standby)
        except grpc.RpcError as exc:
            log.debug("standby feed to %s: %s", standby.endpoint, exc.code().name)
            standby.epoch = ""
        except Exception:  # a bug must not end the feed for every standby: this one syncs again
            log.exception("standby feed to %s failed", standby.endpoint)
            standby.epoch = ""

    def _sync(self, standby: _Standby) -> None:
        # A cheap question first: an empty delta for no epoch is answered NEED_REMOUNT only by a follower,
        # so a master that cannot take the feed (leading, warming up) never costs a snapshot.
        probe = pb.StandbyDeltaRequest(store_id=self._store_id, segment_id=self._segment_id)
        if as_code(self._call(standby, "StandbyDelta", probe, timeout=5.0).status.code) != ErrorCode.NEED_REMOUNT:
            return
        position = self._end()  # before the snapshot: every change before it is in the snapshot
        request = self._segment_request()
        response = self._call(standby, "StandbySync", request, timeout=60.0)
        if as_code(response.status.code) == ErrorCode.OK:
            standby.epoch, standby.position = response.epoch, position
            self.synced += 1
            log.info("standby feed: %s synced with %d objects", standby.endpoint, len(request.inventory))

    def _send_changes(self, standby: _Standby) -> None:
        first = True
        while not self._stop.is_set():
            changes = self._changes_from(standby.position)
            if changes is None:
                standby.epoch = ""  # too far behind: sync again next round
                return
            if not changes and not first:
                return
            # Even with no change, one (empty) delta per round: it keeps this store alive in the standby's
            # view, so that a new leader does not expire it at once for lack of news.
            first = False
            # Serialized protobuf messages concatenate as a merge: the shared changes, then this epoch.
            request = self._encode(standby.position, changes) + _epoch_only(standby.epoch)
            response = self._call_raw(standby, _DELTA_METHOD, request, timeout=30.0)
            if as_code(response.status.code) != ErrorCode.OK:
                standby.epoch = ""  # reset, restarted or now leading: sync again if it is still a standby
                return
            standby.position += len(changes)
            self.changes_sent += len(changes)

    def _encode(self, position: int, changes: list[tuple[InventoryEntry, bool]]) -> bytes:
        """A serialized StandbyDeltaRequest of ``changes`` (the journal from ``position``) without the
        epoch, reused from the last call when it is the same batch."""
        cached = self._encoded
        if cached is not None and cached[0] == position and cached[1] == len(changes):
            return cached[2]
        request = pb.StandbyDeltaRequest(
            store_id=self._store_id,
            segment_id=self._segment_id,
            changes=[_entry(e) for e, _ in changes],
            removed=[flag for _, flag in changes],
        )
        encoded = request.SerializeToString()
        self._encoded = (position, len(changes), encoded)
        return encoded

    def _call_raw(self, standby: _Standby, method: str, request: bytes, timeout: float) -> pb.StandbyFeedResponse:
        call = standby.channel.unary_unary(method, response_deserializer=pb.StandbyFeedResponse.FromString)
        response: pb.StandbyFeedResponse = call(request, timeout=timeout, metadata=self._metadata)
        return response

    def _call(self, standby: _Standby, method: str, request: Any, timeout: float) -> Any:
        stub = pb_grpc.MasterServiceStub(standby.channel)  # type: ignore[no-untyped-call]
        return getattr(stub, method)(request, timeout=timeout, metadata=self._metadata)


_OPTIONS = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]


_DELTA_METHOD = "/kvpool.v1.MasterService/StandbyDelta"


def _epoch_only(epoch: str) -> bytes:
    return pb.StandbyDeltaRequest(epoch=epoch).SerializeToString()


def _entry(e: InventoryEntry) -> pb.InventoryEntry:
    return pb.InventoryEntry(key=e.key.decode(), offset=e.offset, length=e.length, checksum=e.checksum)
