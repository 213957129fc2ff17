"""A free notification names the object it freed: a late one never makes the store forget a newer object that
the master put into the reused range (decision 0071). Real parts, no sockets: the leader's MasterState, the
FreedRange message through its wire encoding, the store's Inventory, a standby's StandbyIndex fed from that
inventory, and a new leader rebuilt from it."""

from __future__ import annotations

from master_scenario import OK, Cluster, MiB, checksum_of

from kvpool.master.segments import StoreEntry
from kvpool.master.standby import StandbyIndex
from kvpool.master.types import InventoryItem
from kvpool.proto import master_pb2 as pb
from kvpool.store.inventory import Inventory, InventoryEntry

SEGMENT = 1
SIZE = 1000


class Store:
    """The store's inventory of segment 1, with the journal a standby feed would send (store/standby_feed.py)."""

    def __init__(self) -> None:
        self.inventory = Inventory()
        self.journal: list[tuple[InventoryEntry, bool]] = []
        self.inventory.listener = lambda entry, removed: self.journal.append((entry, removed))

    def write(self, key: str, offset: int) -> None:
        kb = key.encode()
        self.inventory.begin_write(SEGMENT, offset, SIZE, kb, checksum_of(key))
        self.inventory.record_part(SEGMENT, offset, SIZE, kb, checksum_of(key), 0, SIZE)
        assert self.inventory.holds(SEGMENT, offset, SIZE, kb, checksum_of(key))  # committed (maybe already)

    def apply_heartbeat(self, response: pb.HeartbeatResponse) -> None:
        """What the store's heartbeat loop does with the ranges the master freed (store/service.py)."""
        for freed in pb.HeartbeatResponse.FromString(response.SerializeToString()).freed:
            self.inventory.drop(freed.segment_id, freed.offset, freed.key.encode())

    def items(self) -> list[InventoryItem]:
        return [_item(e) for e in self.inventory.entries(SEGMENT)]

    def keys(self) -> list[bytes]:
        return [e.key for e in self.inventory.entries(SEGMENT)]


def _item(entry: InventoryEntry) -> InventoryItem:
    return InventoryItem(entry.key.decode(), entry.offset, entry.length, entry.checksum)


def heartbeat_response(leader: Cluster) -> pb.HeartbeatResponse:
    """The leader's answer to the store's next heartbeat, encoded as master/service.py encodes it."""
    result = leader.state.heartbeat("store1", [SEGMENT], 0)
    assert result.code == OK
    return pb.HeartbeatResponse(
        freed=[pb.FreedRange(segment_id=s, offset=o, seq=q, key=k) for s, o, q, k in result.freed]
    )


def put(leader: Cluster, store: Store, key: str) -> int:
    [started] = leader.start(key, size=SIZE)
    assert started.code == OK
    offset = started.replicas[0].offset
    store.write(key, offset)
    assert leader.end(key) == [OK]
    return offset


def test_a_late_free_of_a_reused_range_keeps_the_new_object_through_a_failover() -> None:
    leader = Cluster(segments={SEGMENT: MiB})
    store = Store()
    standby = Cluster()
    follower = [True]
    feed = StandbyIndex(standby.state, lambda: follower[0])

    offset_a = put(leader, store, "a")
    sync = feed.sync(standby.spec(SEGMENT, MiB), store.items())
    assert sync.code == OK
    fed = len(store.journal)

    # The leader frees "a"'s range and hands it to "b" before the store heard of the free.
    assert leader.remove("a") == [OK]
    assert put(leader, store, "b") == offset_a
    assert store.keys() == [b"b"]  # b's write itself replaced a's entry
    store.apply_heartbeat(heartbeat_response(leader))  # the late news: "a" at that offset is freed
    assert store.keys() == [b"b"]

    # Warm failover: the standby applied the feed, then is elected and the store re-mounts (the reconcile).
    changes = [(_item(e), removed) for e, removed in store.journal[fed:]]
    assert feed.delta("store1", SEGMENT, sync.epoch, changes).code == OK
    follower[0] = False
    assert standby.present(["a", "b"]) == ["b"]  # readable from the warm index at once
    assert feed.mount(standby.spec(SEGMENT, MiB), store.items(), remount=True).code == OK
    assert standby.present(["a", "b"]) == ["b"]
    standby.check()

    # Cold failover: a new leader rebuilt from the store's inventory alone.
    cold = Cluster()
    assert cold.mount(SEGMENT, MiB, store.items(), remount=True).code == OK
    assert cold.present(["a", "b"]) == ["b"]
    cold.check()


def test_a_free_still_forgets_the_object_it_names() -> None:
    leader = Cluster(segments={SEGMENT: MiB})
    store = Store()
    put(leader, store, "a")
    put(leader, store, "c")
    assert leader.remove("a") == [OK]
    store.apply_heartbeat(heartbeat_response(leader))
    assert store.keys() == [b"c"]
    assert store.journal[-1][1]  # the standbys are told that "a" is gone


def test_a_late_free_of_the_same_key_keeps_its_re_put_through_a_failover() -> None:
    """The same key removed and put again at once (decision 0082): the late free names that key too, so the
    re-put must not be where the store still holds the freed copy, or the free makes the store forget it."""
    leader = Cluster(segments={SEGMENT: MiB})
    store = Store()
    put(leader, store, "a")
    assert leader.remove("a") == [OK]
    put(leader, store, "a")  # before the store heard of the free
    store.apply_heartbeat(heartbeat_response(leader))  # the late news: "a"'s first copy is freed
    assert store.keys() == [b"a"]
    assert leader.present(["a"]) == ["a"]

    cold = Cluster()  # a new leader rebuilt from the store's inventory alone
    assert cold.mount(SEGMENT, MiB, store.items(), remount=True).code == OK
    assert cold.present(["a"]) == ["a"]
    cold.check()


def test_a_re_put_of_the_same_key_reuses_its_range_once_the_store_applied_the_free() -> None:
    leader = Cluster(segments={SEGMENT: MiB})
    store = Store()
    offset = put(leader, store, "a")
    assert leader.remove("a") == [OK]
    response = heartbeat_response(leader)
    store.apply_heartbeat(response)
    acked = max(f.seq for f in response.freed)
    assert leader.state.heartbeat("store1", [SEGMENT], acked).freed == []  # the store acknowledged the free
    assert put(leader, store, "a") == offset  # nothing pending there any more: the range is reused
    assert store.keys() == [b"a"]


def test_a_free_stops_being_pending_when_acknowledged_or_dropped_from_a_full_queue() -> None:
    entry = StoreEntry("store1", now=0.0, seq_base=0, limit=2)
    entry.note_freed(SEGMENT, 0, "a")
    entry.note_freed(SEGMENT, 0, "a")  # freed twice there (a re-put elsewhere in between): counted twice
    assert entry.free_pending(SEGMENT, 0, "a")
    assert not entry.free_pending(SEGMENT, 0, "b")
    assert not entry.free_pending(SEGMENT, 64, "a")
    entry.note_freed(SEGMENT, 64, "b")  # the queue is full: the oldest notification is dropped
    assert entry.dropped == 1
    assert entry.free_pending(SEGMENT, 0, "a")  # one notification of "a" at 0 is still queued
    [(_, _, seq, _), _] = entry.take(0, 10)
    entry.take(seq, 10)  # the store acknowledged it
    assert not entry.free_pending(SEGMENT, 0, "a")
    assert entry.free_pending(SEGMENT, 64, "b")
