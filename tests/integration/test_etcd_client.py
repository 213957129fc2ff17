"""kvpool.common.etcd against real etcd members: KV, transactions, leases, watches and member failures.

Every test gets its own etcd (fixtures ``etcd1`` / ``etcd3``) and waits on conditions with deadlines.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

import kvpool.common.etcd as etcd_mod
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.etcd import EtcdClient, EventType, KeyValue, LeaseKeeper, WatchEvent
from kvpool.master.intents import IntentStore
from tests.support.etcd_cluster import EtcdCluster, free_port
from tests.support.wait import wait_for

pytestmark = [pytest.mark.etcd, pytest.mark.integration]


class EventLog:
    """Collects watch events from the watcher thread."""

    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self._lock = threading.Lock()

    def __call__(self, event: WatchEvent) -> None:
        with self._lock:
            self.events.append(event)

    def snapshot(self) -> list[WatchEvent]:
        with self._lock:
            return list(self.events)

    def keys(self, *, real_only: bool = True) -> list[tuple[str, str]]:
        return [(e.type.value, e.kv.key) for e in self.snapshot() if not (real_only and e.synthetic)]


@pytest.fixture
def client1(etcd1: EtcdCluster) -> Any:
    with EtcdClient(etcd1.endpoints, timeout=3.0) as c:
        yield c


# ---- KV and transactions -----------------------------------------------------------------------------------


def test_kv_roundtrip(client1: EtcdClient) -> None:
    assert client1.get("/t/missing") is None
    rev1 = client1.put("/t/a", b"1")
    rev2 = client1.put("/t/b", "two")
    assert rev2 > rev1
    kv = client1.get("/t/a")
    assert kv is not None
    assert (kv.key, kv.value, kv.create_revision, kv.mod_revision, kv.version, kv.lease) == (
        "/t/a", b"1", rev1, rev1, 1, 0,
    )  # fmt: skip
    assert [k.key for k in client1.get_prefix("/t/")] == ["/t/a", "/t/b"]
    kvs, revision = client1.read("/t/", prefix=True)
    assert revision >= rev2
    assert len(kvs) == 2
    assert client1.delete("/t/a") is True
    assert client1.delete("/t/a") is False
    assert client1.get("/t/a") is None
    client1.put("/t/c/1", "x")
    client1.put("/t/c/2", "y")
    assert client1.delete("/t/c/", prefix=True) is True
    assert [k.key for k in client1.get_prefix("/t/")] == ["/t/b"]


def test_get_prefix_pages_at_one_revision(client1: EtcdClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(etcd_mod, "_PAGE_SIZE", 7)
    for i in range(30):
        client1.put(f"/p/{i:03d}", str(i))
    client1.put("/q", "outside the prefix")
    kvs = client1.get_prefix("/p/")
    assert [kv.key for kv in kvs] == [f"/p/{i:03d}" for i in range(30)]


def test_transactions(client1: EtcdClient) -> None:
    created, rev, existing = client1.create_if_absent("/x/k", "first")
    assert created
    assert existing is None
    again, rev2, existing = client1.create_if_absent("/x/k", "second")
    assert not again
    assert rev2 >= rev
    assert existing is not None
    assert existing.value == b"first"
    assert existing.create_revision == rev

    assert client1.compare_and_put("/x/k", rev, "v2") is True
    assert client1.compare_and_put("/x/k", rev, "v3") is False  # stale expected revision
    kv = client1.get("/x/k")
    assert kv is not None
    assert kv.value == b"v2"
    ok, rev3, current = client1.put_if_mod_revision("/x/k", kv.mod_revision, "v3")
    assert ok
    assert rev3 > kv.mod_revision
    assert current is None
    ok, _, current = client1.put_if_mod_revision("/x/k", kv.mod_revision, "v4")
    assert not ok
    assert current is not None
    assert current.value == b"v3"
    assert client1.compare_and_put("/x/new", 0, "absent ok") is True  # 0 = must be absent

    assert client1.delete_if("/x/k", rev + 1000) is False
    assert client1.delete_if("/x/k", rev) is True  # same incarnation, although modified since
    assert client1.get("/x/k") is None
    client1.put("/x/m", "1")
    m = client1.get("/x/m")
    assert m is not None
    client1.put("/x/m", "2")
    assert client1.delete_if_mod_revision("/x/m", m.mod_revision) is False
    assert client1.delete_if_mod_revision("/x/m", m.mod_revision + 1) is True


def test_intent_store(client1: EtcdClient) -> None:
    intents = IntentStore(client1, "c1")
    assert intents.get("drain", "seg-1") is None
    rev = intents.create("drain", "seg-1", {"segment": 1, "state": "pending"})
    assert rev is not None
    assert intents.create("drain", "seg-1", {"segment": 1}) is None
    got = intents.get("drain", "seg-1")
    assert got is not None
    assert got.doc == {"segment": 1, "state": "pending"}
    assert got.revision == rev
    assert intents.update("drain", "seg-1", {"segment": 1, "state": "running"}, rev + 100) is None
    rev2 = intents.update("drain", "seg-1", {"segment": 1, "state": "running"}, rev)
    assert rev2 is not None
    assert rev2 > rev
    intents.put("drain", "seg-2", {"segment": 2})
    intents.put("config", "cluster", {"replicas": 2})
    assert [(i.name, i.doc["segment"]) for i in intents.list("drain")] == [("seg-1", 1), ("seg-2", 2)]
    assert client1.get("/kvpool/c1/intents/config/cluster") is not None
    assert intents.delete("drain", "seg-1", expected_revision=rev) is False
    assert intents.delete("drain", "seg-1", expected_revision=rev2) is True
    assert [i.name for i in intents.list("drain")] == ["seg-2"]
    with pytest.raises(KvPoolError):
        intents.put("bad/kind", "x", {})


# ---- leases ------------------------------------------------------------------------------------------------


def test_lease_expiry_and_revoke(client1: EtcdClient) -> None:
    lease = client1.lease_grant(1)
    client1.put("/l/a", "1", lease=lease)
    assert client1.lease_keepalive_once(lease) >= 1
    took = wait_for(lambda: client1.get("/l/a") is None, 5.0, "the leased key to expire")
    print(f"lease of 1 s expired after {took:.2f}s without renewal")
    assert client1.lease_keepalive_once(lease) == 0  # gone
    assert client1.lease_time_to_live(lease) == -1
    client1.lease_revoke(lease)  # revoking an expired lease is not an error

    lease2 = client1.lease_grant(30)
    client1.put("/l/b", "1", lease=lease2)
    client1.lease_revoke(lease2)
    assert client1.get("/l/b") is None


def test_lease_keeper_renews_then_reports_revocation(client1: EtcdClient) -> None:
    lost = threading.Event()
    keeper = LeaseKeeper(client1, 1, on_lost=lost.set)
    lease = keeper.start()
    try:
        client1.put("/l/kept", "1", lease=lease)
        # Three TTLs later the key must still be there: the keeper renewed it.
        assert not lost.wait(3.0)
        assert client1.get("/l/kept") is not None
        client1.lease_revoke(lease)
        took = wait_for(lost.is_set, 3.0, "on_lost after an external revoke")
        print(f"keeper noticed the revocation after {took:.2f}s")
        assert keeper.lost
    finally:
        keeper.stop()


def test_lease_keeper_reports_loss_when_etcd_is_gone(etcd1: EtcdCluster) -> None:
    with EtcdClient(etcd1.endpoints, timeout=1.0) as client:
        lost = threading.Event()
        keeper = LeaseKeeper(client, 1, on_lost=lost.set)
        keeper.start()
        try:
            etcd1.kill(0)
            killed = time.monotonic()
            took = wait_for(lost.is_set, 3.0, "on_lost with etcd down")
            print(f"keeper reported the loss {took:.2f}s after etcd died (ttl 1 s)")
            assert time.monotonic() - killed <= keeper.ttl + 0.5
        finally:
            keeper.stop()


# ---- watches -----------------------------------------------------------------------------------------------


def test_watch_prefix_events_in_order(client1: EtcdClient) -> None:
    start = client1.put("/w/seed", "0")
    log = EventLog()
    watcher = client1.watch("/w/", start + 1, log, prefix=True)
    try:
        client1.put("/w/a", "1")
        client1.put("/other", "ignored")
        client1.put("/w/a", "2")
        client1.delete("/w/a")
        wait_for(lambda: len(log.snapshot()) == 3, 5.0, "three events")
        events = log.snapshot()
        assert [(e.type, e.kv.key, e.kv.value) for e in events] == [
            (EventType.PUT, "/w/a", b"1"),
            (EventType.PUT, "/w/a", b"2"),
            (EventType.DELETE, "/w/a", b""),
        ]
        revisions = [e.revision for e in events]
        assert revisions == sorted(revisions)
        assert watcher.revision == revisions[-1]
    finally:
        watcher.stop()


def test_watch_without_start_revision_delivers_current_state(client1: EtcdClient) -> None:
    client1.put("/s/a", "1")
    log = EventLog()
    watcher = client1.watch("/s/a", None, log)
    try:
        wait_for(lambda: len(log.snapshot()) == 1, 5.0, "the initial state")
        first = log.snapshot()[0]
        assert first.synthetic
        assert first.type is EventType.PUT
        assert first.kv.value == b"1"
        client1.delete("/s/a")
        wait_for(lambda: len(log.snapshot()) == 2, 5.0, "the delete")
        assert log.snapshot()[1].type is EventType.DELETE
        assert not log.snapshot()[1].synthetic
    finally:
        watcher.stop()
    log2 = EventLog()
    absent = client1.watch("/s/a", None, log2)
    try:
        wait_for(lambda: len(log2.snapshot()) == 1, 5.0, "the synthetic delete of an absent key")
        assert log2.snapshot()[0].type is EventType.DELETE
        assert log2.snapshot()[0].synthetic
    finally:
        absent.stop()


def test_watch_from_a_compacted_revision_resyncs(client1: EtcdClient) -> None:
    first = client1.put("/c/k", "v1")
    client1.put("/c/k", "v2")
    last = client1.put("/c/k", "v3")
    client1.compact(last)
    log = EventLog()
    watcher = client1.watch("/c/k", first, log)  # the history from `first` is gone
    try:
        wait_for(lambda: len(log.snapshot()) == 1, 5.0, "the resync event")
        resync = log.snapshot()[0]
        assert resync.synthetic
        assert resync.kv.value == b"v3"
        assert watcher.resyncs == 1
        client1.put("/c/k", "v4")
        wait_for(lambda: len(log.snapshot()) == 2, 5.0, "the event after the resync")
        assert log.snapshot()[1].kv.value == b"v4"
        assert not log.snapshot()[1].synthetic
    finally:
        watcher.stop()


def test_watch_resumes_after_its_member_is_killed(etcd3: EtcdCluster) -> None:
    with EtcdClient(etcd3.endpoints, timeout=3.0) as client:
        log = EventLog()
        start = client.put("/r/seed", "0")
        watcher = client.watch("/r/", start + 1, log, prefix=True)
        assert watcher.wait_started(5.0)
        for i in range(5):
            client.put(f"/r/{i}", str(i))
        wait_for(lambda: len(log.snapshot()) == 5, 5.0, "events before the kill")
        victim = etcd3.endpoints.index(watcher.endpoint)
        etcd3.kill(victim)
        t0 = time.monotonic()
        for i in range(5, 10):
            client.put(f"/r/{i}", str(i))
        took = wait_for(lambda: len(log.snapshot()) == 10, 10.0, "events after the kill")
        print(f"watch resumed on another member {took:.2f}s after its member was killed")
        assert [e.kv.key for e in log.snapshot()] == [f"/r/{i}" for i in range(10)]  # no gap, no repeat
        assert watcher.endpoint != etcd3.endpoints[victim]
        assert watcher.streams >= 2
        assert time.monotonic() - t0 < 10
        watcher.stop()


# ---- member failures ---------------------------------------------------------------------------------------


def _timed_calls(client: EtcdClient, n: int, budget: float) -> list[tuple[float, bool]]:
    """n mixed calls; each must return (value or KvPoolError) within its budget."""
    out: list[tuple[float, bool]] = []
    codes: set[ErrorCode] = set()
    for i in range(n):
        t0 = time.monotonic()
        try:
            if i % 3 == 0:
                client.put(f"/f/{i}", "v")
            elif i % 3 == 1:
                client.get(f"/f/{i - 1}")
            else:
                client.create_if_absent(f"/f/c{i}", "v")
            ok = True
        except KvPoolError as e:
            ok = False
            codes.add(e.code)
        took = time.monotonic() - t0
        assert took <= budget + 0.3, f"call {i} took {took:.2f}s > deadline {budget}s"
        out.append((took, ok))
    assert codes <= {ErrorCode.ETCD_ERROR}
    return out


def test_frozen_member_never_hangs_a_call(etcd3: EtcdCluster) -> None:
    with EtcdClient(etcd3.endpoints, timeout=2.0, watch_liveness=1.5) as client:
        log = EventLog()
        watcher = client.watch("/f/", client.put("/seed", "0") + 1, log, prefix=True)
        assert watcher.wait_started(5.0)
        # Freeze the member this client is talking to (where its watch stream lives).
        frozen = etcd3.endpoints.index(watcher.endpoint)
        etcd3.stop(frozen)
        try:
            results = _timed_calls(client, 15, client.timeout)
            slow = [round(t, 2) for t, _ in results if t > 0.3]
            print(f"frozen member {frozen}: {sum(ok for _, ok in results)}/15 calls ok, slow ones {slow}")
            assert all(ok for _, ok in results)
            assert len(slow) <= 2  # the frozen member costs one attempt, then it is avoided
            took = wait_for(lambda: len(log.snapshot()) >= 5, 6.0, "watch events from another member")
            print(f"watch moved off the frozen member; events flowing {took:.2f}s after the calls")
        finally:
            etcd3.cont(frozen)
        # Now freeze the raft leader: calls ride out the election within their deadline.
        leader = etcd3.leader_index()
        etcd3.stop(leader)
        try:
            results = _timed_calls(client, 15, client.timeout)
            print(f"frozen raft leader: {sum(ok for _, ok in results)}/15 calls ok")
            assert sum(ok for _, ok in results) >= 12
        finally:
            etcd3.cont(leader)
        watcher.stop()


def test_failover_between_members(etcd3: EtcdCluster) -> None:
    etcd3.kill(0)  # dead before the client even starts: it must still work
    with EtcdClient(etcd3.endpoints, timeout=2.0) as client:
        results = _timed_calls(client, 9, client.timeout)
        assert all(ok for _, ok in results)
        etcd3.kill(1)  # no quorum left: calls fail, but within their deadline
        t0 = time.monotonic()
        with pytest.raises(KvPoolError) as info:
            client.put("/f/noquorum", "v")
        assert info.value.code is ErrorCode.ETCD_ERROR
        assert time.monotonic() - t0 <= client.timeout + 0.3
        etcd3.restart(1)
        took = wait_for(lambda: _put_ok(client), 10.0, "writes after a member came back")
        print(f"writes resumed {took:.2f}s after the restart")


def _put_ok(client: EtcdClient) -> bool:
    try:
        client.put("/f/back", "v", timeout=1.0)
        return True
    except KvPoolError:
        return False


def test_unreachable_etcd_fails_within_the_deadline() -> None:
    with EtcdClient([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], timeout=0.5) as client:
        for call in (lambda: client.get("/k"), lambda: client.lease_grant(5), lambda: client.put("/k", "v")):
            t0 = time.monotonic()
            with pytest.raises(KvPoolError) as info:
                call()
            assert info.value.code is ErrorCode.ETCD_ERROR
            assert time.monotonic() - t0 < 0.5 + 0.3


def test_closed_client_refuses_calls(client1: EtcdClient) -> None:
    client1.close()
    with pytest.raises(KvPoolError):
        client1.get("/k")


def test_keyvalue_is_a_plain_value() -> None:
    kv = KeyValue("/k", b"v", 1, 2, 1, 0)
    assert kv == KeyValue("/k", b"v", 1, 2, 1, 0)
