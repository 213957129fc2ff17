"""The foundation end to end: a master and stores as real processes, a client over real sockets."""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from typing import Any

import pytest

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.proto import frames
from kvpool.tools.local_cluster import LocalCluster
from tests.support.cluster import FAST_MASTER, client, wait_for

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("size", [1, 100, 4096, 65_537, 1 << 20, (4 << 20) + 3])
@pytest.mark.usefixtures("data_path")
def test_round_trip_of_many_sizes(cluster: LocalCluster, size: int) -> None:
    value = os.urandom(size)
    with client(cluster.master) as pool:
        assert pool.put(f"k-{size}", value) == 0
        assert pool.get(f"k-{size}") == value
        buf = bytearray(size + 10)
        assert pool.get_into(f"k-{size}", buf) == size
        assert bytes(buf[:size]) == value


def test_empty_values_are_rejected_with_a_clear_code(cluster: LocalCluster) -> None:
    with client(cluster.master) as pool:
        assert pool.put("empty", b"") == ErrorCode.INVALID_ARGUMENT
        assert pool.get("empty") is None
        assert pool.batch_exists(["empty"]) == [0]


def test_a_key_that_is_not_utf8_gets_a_code_from_every_call(cluster: LocalCluster) -> None:
    """A lone surrogate (what ``os.fsdecode`` makes of undecodable bytes) cannot be encoded into a request:
    it is answered like any other malformed key, and the valid keys of the same batch are served."""
    bad = "page-\udcff"
    with client(cluster.master) as pool:
        assert pool.put(bad, b"x") == ErrorCode.INVALID_KEY
        assert pool.batch_put(["fine", bad], [b"v", b"w"]) == [0, ErrorCode.INVALID_KEY]
        assert pool.batch_exists(["fine", bad]) == [1, 0]
        assert pool.prefix_length(["fine", bad, "fine"]) == 1
        assert pool.get(bad) is None
        out = bytearray(1)
        assert pool.batch_get_into([bad, "fine"], [bytearray(1), out]) == [ErrorCode.OBJECT_NOT_FOUND, 1]
        assert out == b"v"
        assert pool.batch_remove([bad]) == [ErrorCode.OBJECT_NOT_FOUND]
        assert pool.remove_all(prefix=bad) == ErrorCode.INVALID_KEY
        assert pool.get("fine") == b"v"  # nothing was removed


def test_timeouts_none_finite_infinite_and_nan(cluster: LocalCluster) -> None:
    with client(cluster.master) as pool:
        assert pool.put("t-inf", b"x", timeout=math.inf) == 0  # no deadline at all
        assert pool.get("t-inf", timeout=math.inf) == b"x"
        assert pool.put("t-past", b"x", timeout=-1) == ErrorCode.TIMEOUT  # already passed
        with pytest.raises(KvPoolError, match="NaN") as refused:
            pool.get("t-inf", timeout=math.nan)
        assert refused.value.code == ErrorCode.INVALID_ARGUMENT


def test_values_are_immutable_and_a_second_put_is_a_noop(cluster: LocalCluster) -> None:
    with client(cluster.master) as pool:
        assert pool.put("imm", b"first") == 0
        assert pool.put("imm", b"second value") == 0  # OBJECT_ALREADY_EXISTS maps to success
        assert pool.get("imm") == b"first"


@pytest.mark.usefixtures("data_path")
def test_batches_with_mixed_hits_and_misses(cluster: LocalCluster) -> None:
    keys = [f"mix-{i}" for i in range(64)]
    values = [os.urandom(1000 + i) for i in range(64)]
    with client(cluster.master) as pool:
        assert pool.batch_put_from(keys[::2], values[::2]) == [0] * 32
        assert pool.batch_exists(keys[:4]) == [1, 0, 1, 0]
        assert pool.prefix_length(keys) == 1
        buffers = [bytearray(2000) for _ in keys]
        codes = pool.batch_get_into(keys, buffers)
        for i, code in enumerate(codes):
            if i % 2 == 0:
                assert code == len(values[i])
                assert bytes(buffers[i][:code]) == values[i]
            else:
                assert code == ErrorCode.OBJECT_NOT_FOUND
        small = [bytearray(10) for _ in keys[:2]]
        assert pool.batch_get_into(keys[:2], small) == [
            ErrorCode.BUFFER_TOO_SMALL,
            ErrorCode.OBJECT_NOT_FOUND,
        ]


def test_remove_and_leases(cluster: LocalCluster) -> None:
    with client(cluster.master) as pool:
        assert pool.put("rm", b"x" * 100) == 0
        assert pool.get("rm") == b"x" * 100  # grants a read lease
        assert pool.remove("rm") == ErrorCode.OBJECT_HAS_LEASE
        assert pool.remove("rm", force=True) == 0
        assert pool.get("rm") is None
        assert pool.remove("rm") == ErrorCode.OBJECT_NOT_FOUND


@pytest.mark.usefixtures("data_path")
def test_two_clients_racing_on_one_key_never_see_a_torn_value(cluster: LocalCluster) -> None:
    size = 2 << 20
    candidates = {bytes([i]) * size for i in range(2)}
    errors: list[str] = []
    seen: list[bytes] = []

    def writer(fill: int) -> None:
        with client(cluster.master) as pool:
            for round_ in range(10):
                code = pool.put(f"race-{round_}", bytes([fill]) * size)
                if code != 0:
                    errors.append(f"put {code}")

    def reader() -> None:
        with client(cluster.master) as pool:
            deadline = time.monotonic() + 10
            done = 0
            while done < 10 and time.monotonic() < deadline:
                value = pool.get(f"race-{done}")
                if value is not None:
                    seen.append(value)
                    done += 1

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert len(seen) == 10
    assert all(v in candidates for v in seen), "a reader saw a torn or mixed value"
    with client(cluster.master) as pool:
        final = [pool.get(f"race-{i}") for i in range(10)]
    assert all(v in candidates for v in final)


@pytest.mark.usefixtures("data_path")
def test_killed_store_objects_become_misses_and_no_call_hangs(make_cluster: object) -> None:
    cluster = make_cluster(stores=2, store_size="32MiB")  # type: ignore[operator]
    with client(cluster.master, timeout_s=2.0) as pool:
        keys = [f"dead-{i}" for i in range(40)]
        assert pool.batch_put_from(keys, [os.urandom(4096) for _ in keys]) == [0] * 40
        victim = cluster.stores[0]
        cluster.kill(victim)
        # Until the master expires the store, reads of its objects fail fast (connection refused) ...
        started = time.monotonic()
        codes = pool.batch_get_into(keys, [bytearray(4096) for _ in keys])
        assert time.monotonic() - started < 2.5
        assert all(c == 4096 or c < 0 for c in codes)
        # ... and after the expiry (2 s here) they are plain misses; the survivor's objects stay readable.
        wait_for(lambda: len(pool.stats().segments) == 1, 15, "the master to expire the killed store")
        present = pool.batch_exists(keys)
        assert 0 < sum(present) < len(keys)
        alive = [k for k, p in zip(keys, present, strict=True) if p]
        assert all(c == 4096 for c in pool.batch_get_into(alive, [bytearray(4096) for _ in alive]))


def test_eviction_under_memory_pressure_keeps_recent_objects(make_cluster: object) -> None:
    cluster = make_cluster(stores=1, store_size="16MiB")  # type: ignore[operator]
    value = os.urandom(256 << 10)
    with client(cluster.master) as pool:
        keys = [f"ev-{i}" for i in range(200)]  # 50 MiB through a 16 MiB pool
        for key in keys:
            assert pool.put(key, value) == 0, key
        stats = pool.stats()
        assert stats.evictions > 0
        assert stats.used <= stats.capacity
        assert pool.get(keys[-1]) == value  # the newest survive
        assert pool.batch_exists(keys[:10]) == [0] * 10  # the oldest went first


def test_master_rpc_port_survives_garbage(cluster: LocalCluster) -> None:
    with client(cluster.master) as pool:
        assert pool.put("before", b"1") == 0
        host, port = pool._master.info.rpc_endpoint.rsplit(":", 1)  # type: ignore[union-attr]
    for payload in (
        os.urandom(64),
        frames.pack_header(999, 1, 0),
        frames.pack_header(frames.Op.BATCH_EXISTS, 1, 5) + b"\xff" * 5,
        b"KVP1" + b"\x00" * 10,
    ):
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(4096):
                pass  # the master answers or closes; it must not hang or die
    with client(cluster.master) as pool:
        assert pool.get("before") == b"1"


def test_local_cluster_stop_leaves_no_process(tmp_path: object) -> None:
    cluster = LocalCluster(stores=1, store_size="16MiB", base_dir=tmp_path).start()  # type: ignore[arg-type]
    pids = [p.pid for p in cluster.processes]
    cluster.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_read_under_a_live_lease_skips_the_master(cluster: LocalCluster) -> None:
    """The second get of a key, within its lease, makes no master call (the master's hit count stays)."""
    value = os.urandom(70_000)
    with client(cluster.master) as pool, client(cluster.master, lease_cache_entries=0) as uncached:
        assert pool.put("leased", value) == 0
        assert pool.get("leased") == value
        hits = pool.stats().hits
        for _ in range(5):
            assert pool.get("leased") == value
        assert pool.stats().hits == hits
        assert pool.metrics()["lease_cache_hits"] == 5
        for _ in range(3):
            assert uncached.get("leased") == value
        assert pool.stats().hits == hits + 3  # the same reads without the cache each ask the master
        # this client's own removal forgets the lease at once
        assert pool.remove("leased", force=True) == 0
        assert pool.get("leased") is None


def test_a_hot_object_keeps_its_cached_lease_past_the_lease_ttl(make_cluster: Any) -> None:
    """A key read again and again renews its lease in the background: no read after the first asks the
    master, and the renewals reach the master as leased reads (its LRU sees the object). Without renewal
    the entry ends with its lease and a read asks the master again."""
    cluster = make_cluster(stores=1, store_size="16MiB", master_args=FAST_MASTER + ("--lease-ttl-s", "4"))
    value = os.urandom(70_000)
    with client(cluster.master) as renewing, client(cluster.master, lease_renewal=False) as plain:
        assert renewing.put("hot", value) == 0
        hits_before = renewing.stats().hits
        reads = 0
        end = time.monotonic() + 4.5  # longer than a lease: an entry without renewal ends within 3 s
        while time.monotonic() < end:
            assert renewing.get("hot") == value
            assert plain.get("hot") == value
            reads += 1
            time.sleep(0.02)  # a read every 20 ms: a hot object, not a busy loop
        hot, cold = renewing.metrics(), plain.metrics()
        assert hot["lease_cache_hits"] == reads - 1
        assert hot["lease_renewals"] >= 1
        assert cold["lease_renewals"] == 0
        assert cold["lease_cache_hits"] <= reads - 2  # its entry ended at least once
        master_reads = hot["lease_renewals"] + (reads - hot["lease_cache_hits"]) + (reads - cold["lease_cache_hits"])
        assert renewing.stats().hits - hits_before == master_reads


def _wait_past(deadline: float) -> None:
    """Wait until the monotonic clock passes ``deadline`` (a lease that must have ended by then)."""
    wait_for(lambda: time.monotonic() > deadline, timeout=30, what="the lease to end", interval=0.02)


def test_a_read_after_the_lease_ended_is_revalidated_by_the_store_even_with_the_master_down(
    make_cluster: Any,
) -> None:
    """Decision 0014: the client keeps where an object was after its lease ends and reads it from there;
    the store serves it because it still holds exactly that object. No master is needed for it: here the
    master is stopped before the re-reads. A client without it has to ask the master, and fails."""
    cluster = make_cluster(stores=1, store_size="16MiB", master_args=FAST_MASTER + ("--lease-ttl-s", "2"))
    value = os.urandom(70_000)
    with client(cluster.master) as hinted, client(cluster.master, revalidate_reads=False) as plain:
        assert hinted.put("k", value) == 0
        assert hinted.get("k") == value
        assert plain.get("k") == value
        _wait_past(time.monotonic() + 2.0)  # both leases were granted before now: ended by then
        cluster.terminate(cluster.masters[0])
        for _ in range(3):
            assert hinted.get("k") == value
        assert plain.get("k") is None  # its cached lease ended, and the master is gone
        m = hinted.metrics()
        assert (m["revalidated_reads"], m["revalidations_refused"], m["lease_renewals"]) == (3, 0, 0)
        assert plain.metrics()["revalidated_reads"] == 0


def test_a_hint_whose_range_was_reused_is_refused_by_the_store_and_asked_again(make_cluster: Any) -> None:
    """After the reader's lease ended, the object is force-removed and its range reused by another: the
    store no longer holds it, refuses the revalidated read before sending a byte, and the reader asks the
    master, which says it is gone. A revalidated read also renews the lease, as a leased read the
    master's LRU sees."""
    cluster = make_cluster(stores=1, store_size="8MiB", master_args=FAST_MASTER + ("--lease-ttl-s", "3"))
    old = os.urandom(1 << 20)
    with client(cluster.master) as reader, client(cluster.master) as writer:
        assert reader.put("victim", old) == 0
        assert reader.put("kept", old) == 0  # next to it: the victim's range becomes an exact-fit hole
        assert reader.batch_get(["victim", "kept"]) == [old, old]
        _wait_past(time.monotonic() + 3.0)
        hits = reader.stats().hits
        assert reader.get("kept") == old  # revalidated; its renewal reaches the master in the background
        wait_for(lambda: reader.metrics()["lease_renewals"] == 1, timeout=10, what="the renewal")
        assert reader.stats().hits == hits + 1
        assert reader.get("kept") == old  # a plain cache hit again
        assert writer.remove("victim", force=True) == 0
        assert writer.put("reuses-the-range", os.urandom(1 << 20)) == 0  # best fit: the victim's hole
        assert reader.get("victim") is None
        m = reader.metrics()
        assert (m["revalidated_reads"], m["revalidations_refused"]) == (1, 1)
        assert m["checksum_mismatches"] == 0  # refused by the store: the reused range was never sent


def test_a_cached_lease_on_a_reused_range_never_returns_the_new_bytes(make_cluster: Any) -> None:
    """Another client force-removes everything and fills the segment with other objects: a read through the
    stale cached descriptor fails its checksum, is resolved again at the master, and is a clean miss."""
    cluster = make_cluster(stores=1, store_size="8MiB")
    old = os.urandom(1 << 20)
    with client(cluster.master) as reader, client(cluster.master) as writer:
        assert reader.put("victim", old) == 0
        assert reader.get("victim") == old  # leased and cached
        assert writer.remove_all(force=True) == 1
        fillers = [os.urandom(768 << 10) for _ in range(9)]
        assert writer.batch_put_from([f"fill-{i}" for i in range(9)], fillers) == [0] * 9
        assert reader.get("victim") is None
        assert reader.metrics()["checksum_mismatches"] >= 1  # the stale range was really read, and refused
