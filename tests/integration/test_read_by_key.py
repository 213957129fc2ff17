"""Speculative reads by key (decision 0031): a first read asks the only store for the object while the master
lookup is under way; the bytes count only once the master's answer confirms them. These tests try to make
a read return wrong bytes through that path: every one must fail to."""

from __future__ import annotations

import os
import re
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvpool.client import PoolClient
from kvpool.client.read_by_key import Answer, SpeculativeReads
from kvpool.common.clock import SYSTEM_CLOCK, Deadline
from kvpool.common.errors import ErrorCode
from kvpool.proto.frames import HEADER, HEADER_SIZE, MAGIC, READ_KEY_META, READ_KEY_REQUEST, Op
from kvpool.tools.local_cluster import LocalCluster
from kvpool.transfer.base import Replica
from tests.support.cluster import FAST_MASTER, client
from tests.support.handshake import closed_by_peer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def one_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    cluster = LocalCluster(
        stores=1, store_size="32MiB", base_dir=tmp_path_factory.mktemp("rbk"), master_args=FAST_MASTER
    ).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _speculating(pool: PoolClient, seed_key: str) -> None:
    """Make ``pool`` learn where objects live (one ordinary first read), so later first reads speculate."""
    assert pool.get(seed_key) is not None
    assert pool._speculation.target() is not None


def _read_key(endpoint: str, key: bytes, max_length: int) -> tuple[int, bytes]:
    """A raw READ_KEY on a fresh connection: (status, payload)."""
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        payload = READ_KEY_REQUEST.pack(max_length) + key
        sock.sendall(HEADER.pack(MAGIC, Op.READ_KEY, 0, 0, 7, len(payload)) + payload)
        head = sock.recv(HEADER_SIZE, socket.MSG_WAITALL)
        _magic, op, _flags, status, req_id, length = HEADER.unpack(head)
        assert (op, req_id) == (Op.READ_KEY, 7)
        body = sock.recv(length, socket.MSG_WAITALL) if length else b""
        return status, body


def test_first_reads_are_served_by_key_and_confirmed(one_store: LocalCluster) -> None:
    values = {f"fr-{i}": os.urandom(1000 + 4099 * i) for i in range(6)}
    values["fr-5"] = os.urandom(300 << 10)  # over speculative_read_bytes: read the ordinary way
    with client(one_store.master) as writer:
        assert writer.batch_put(list(values), list(values.values())) == [0] * len(values)
    with client(one_store.master) as pool:
        _speculating(pool, "fr-0")
        buf = bytearray(64 << 10)
        assert pool.get_into("fr-1", buf) == len(values["fr-1"])
        assert bytes(buf[: len(values["fr-1"])]) == values["fr-1"]
        assert pool.get("fr-2") == values["fr-2"]
        assert pool.batch_get(["fr-3"]) == [values["fr-3"]]
        assert pool.get("fr-missing") is None
        assert pool.get("fr-5") == values["fr-5"]
        big = bytearray(512 << 10)
        assert pool.get_into("fr-4", big) == len(values["fr-4"])  # a large buffer asks for at most the limit
        metrics = pool.metrics()
        assert metrics["speculative_reads"] == 4, metrics
        assert metrics["speculative_reads_discarded"] == 2, metrics  # the miss and the object over the limit
        assert (metrics["gets"], metrics["get_misses"]) == (6, 1), metrics
    body = urllib.request.urlopen(f"http://{one_store.stores[0].endpoints['metrics']}/metrics", timeout=5).read()
    served = re.search(rb"^kvpool_store_reads_by_key_total (\S+)$", body, re.M)
    assert served is not None
    assert float(served.group(1)) >= 4


def test_a_batch_of_first_reads_is_read_by_key_and_each_key_confirmed_on_its_own(one_store: LocalCluster) -> None:
    """One key of the batch was just removed (the store may still hold it), one never existed: those two
    read as misses through the ordinary path, the others are served by key, each with its own bytes."""
    values = {f"bt-{i}": os.urandom(20_000 + 7 * i) for i in range(8)}
    with client(one_store.master) as writer:
        assert writer.batch_put([*values, "seed-b"], [*values.values(), b"b"]) == [0] * 9
        assert writer.remove("bt-3", force=True) == 0
    keys = [*values, "bt-missing"]
    with client(one_store.master, speculative_batches=True) as pool:
        _speculating(pool, "seed-b")
        buffers = [bytearray(64 << 10) for _ in keys]
        codes = pool.batch_get_into(keys, buffers)
        for i, key in enumerate(keys):
            if key in ("bt-3", "bt-missing"):
                assert codes[i] == ErrorCode.OBJECT_NOT_FOUND, key
            else:
                assert codes[i] == len(values[key]), key
                assert bytes(buffers[i][: codes[i]]) == values[key], key
        assert pool.metrics()["speculative_reads"] == 7
        assert pool.metrics()["speculative_reads_discarded"] == 2


def test_a_store_answers_read_key_only_with_whole_committed_objects(one_store: LocalCluster) -> None:
    value = os.urandom(5000)
    endpoint = one_store.stores[0].address
    with client(one_store.master) as pool:
        assert pool.put("whole", value) == 0
    status, body = _read_key(endpoint, b"whole", 1 << 20)
    assert status == ErrorCode.OK
    segment_id, offset, length, checksum = READ_KEY_META.unpack_from(body)
    assert (length, body[READ_KEY_META.size :]) == (5000, value)
    assert _read_key(endpoint, b"whole", 4999) == (ErrorCode.BUFFER_TOO_SMALL, b"")
    assert _read_key(endpoint, b"never-written", 1 << 20) == (ErrorCode.OBJECT_NOT_FOUND, b"")
    assert _read_key(endpoint, b"whol", 1 << 20) == (ErrorCode.OBJECT_NOT_FOUND, b"")


def test_a_malformed_read_key_closes_only_its_connection(one_store: LocalCluster) -> None:
    host, _, port = one_store.stores[0].address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(HEADER.pack(MAGIC, Op.READ_KEY, 0, 0, 1, 4) + b"abcd")  # shorter than its fixed part
        _magic, op, _flags, status, _rid, _len = HEADER.unpack(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        assert (op, status) == (Op.READ_KEY, ErrorCode.BAD_FRAME)
        assert sock.recv(1) == b""
    assert _read_key(one_store.stores[0].address, b"nothing", 10) == (ErrorCode.OBJECT_NOT_FOUND, b"")


def test_a_removed_key_whose_range_was_reused_is_never_read_as_the_old_object(one_store: LocalCluster) -> None:
    """Another client removes the key (the store keeps its stale copy until its next heartbeat hears of the
    free) and puts a new object of the same size: the reader's first reads return a miss while only the
    stale copy is there, then the new bytes, never the old ones, and never a mix."""
    endpoint = one_store.stores[0].address
    stale_rounds = 0
    with client(one_store.master) as writer, client(one_store.master, lease_cache_entries=0) as reader:
        assert writer.put("seed-r", b"x") == 0
        _speculating(reader, "seed-r")
        for round_ in range(20):
            old, new = os.urandom(30_000), os.urandom(30_000)
            assert writer.put("reused", old) == 0
            assert reader.get("reused") == old
            assert writer.remove("reused", force=True) == 0
            status, body = _read_key(endpoint, b"reused", 1 << 20)
            stale = status == ErrorCode.OK and body[READ_KEY_META.size :] == old
            discarded = reader.metrics()["speculative_reads_discarded"]
            assert reader.get("reused") is None, f"round {round_}: a removed key was read"
            if stale:  # the store offered its stale copy: the reader had it in hand and threw it away
                stale_rounds += 1
                assert reader.metrics()["speculative_reads_discarded"] == discarded + 1
            assert writer.put("reused", new) == 0
            got = reader.get("reused")
            assert got == new, f"round {round_}: {'old bytes' if got == old else 'other bytes'}"
            assert writer.remove("reused", force=True) == 0
        assert reader.metrics()["speculative_reads"] >= 20
    assert stale_rounds > 0, "the store never still held a removed object: the stale case went untested"


def test_concurrent_rewrites_never_give_wrong_bytes(one_store: LocalCluster) -> None:
    """A writer keeps replacing a handful of keys (remove then put, values tagged with their key); readers
    with no lease cache first-read them all the while: every value read is one that was written under its
    key, whole."""
    keys = [f"churn-{i}" for i in range(4)]
    stop = threading.Event()
    written: dict[str, set[bytes]] = {k: set() for k in keys}
    lock = threading.Lock()

    def tagged(key: str) -> bytes:
        return key.encode().ljust(16, b"\0") + os.urandom(20_000)

    def churn() -> None:
        with client(one_store.master) as writer:
            while not stop.is_set():
                for key in keys:
                    value = tagged(key)
                    with lock:
                        written[key].add(value)
                    writer.remove(key, force=True)
                    writer.put(key, value)

    with client(one_store.master) as seed:
        assert seed.put("seed-c", b"z") == 0
        for key in keys:
            value = tagged(key)
            written[key].add(value)
            assert seed.put(key, value) == 0
    thread = threading.Thread(target=churn)
    thread.start()
    try:
        with client(one_store.master, lease_cache_entries=0) as reader:
            _speculating(reader, "seed-c")
            checked = 0
            for _ in range(150):
                for key in keys:
                    got = reader.get(key)
                    if got is not None:
                        with lock:
                            assert got in written[key], f"{key}: bytes never written under it"
                        checked += 1
            assert checked > 0
            assert reader.metrics()["speculative_reads"] > 0
    finally:
        stop.set()
        thread.join()


def _replica(segment_id: int, offset: int, length: int) -> Replica:
    return Replica(segment_id, "n", "127.0.0.1:1", "", offset, length, 1 << 62, b"", 0)


class _Answer:
    def __init__(self, code: int, size: int, checksum: int, lease_expiry_ms: int, replicas: tuple[Replica, ...]):
        self.code, self.size, self.checksum = code, size, checksum
        self.lease_expiry_ms, self.replicas = lease_expiry_ms, replicas


def test_only_an_answer_naming_the_same_object_under_a_live_lease_confirms() -> None:
    """The confirmation rule itself, field by field: a stale copy elsewhere, another checksum or size, a
    master miss, an ended lease or an SSD replica each refute the store's bytes."""
    reads = SpeculativeReads(1 << 20, SYSTEM_CLOCK)
    got = Answer(3, 4096, 100, 77)
    live = SYSTEM_CLOCK.wall_ms() + 10_000
    same = (_replica(3, 4096, 100),)
    assert reads._confirms(got, _Answer(0, 100, 77, live, same))
    assert reads._confirms(got, _Answer(0, 100, 77, live, (_replica(9, 0, 100), *same)))
    refuted = [
        _Answer(int(ErrorCode.OBJECT_NOT_FOUND), 0, 0, 0, ()),
        _Answer(0, 100, 78, live, same),
        _Answer(0, 101, 77, live, (_replica(3, 4096, 101),)),
        _Answer(0, 100, 77, live, (_replica(3, 8192, 100),)),
        _Answer(0, 100, 77, live, (_replica(4, 4096, 100),)),
        _Answer(0, 100, 77, SYSTEM_CLOCK.wall_ms() - 1, same),
        _Answer(0, 100, 77, live, (Replica(3, "n", "e", "", 4096, 100, live, b"", 1),)),
    ]
    for answer in refuted:
        assert not reads._confirms(got, answer), answer.__dict__


def test_bytes_that_do_not_hash_to_the_confirmed_checksum_are_discarded(one_store: LocalCluster) -> None:
    """A store answer whose metadata matches but whose bytes were torn (here: altered after landing, as a
    write over the range mid-send would) is discarded, and the ordinary read returns the right bytes."""
    value = os.urandom(9000)
    with client(one_store.master) as pool:
        assert pool.put("torn", value) == 0
        assert pool.put("seed-t", b"y") == 0
        _speculating(pool, "seed-t")
        reads = pool._speculation
        original = reads._receive

        def tear(sent, views, deadline):  # type: ignore[no-untyped-def]
            got = original(sent, views, deadline)
            if got[0] is not None:
                views[0][0] ^= 0xFF
            return got

        reads._receive = tear  # type: ignore[method-assign]
        assert pool.get("torn") == value
        assert (reads.discarded, reads.confirmed) == (1, 0)


def test_an_unreachable_expected_store_costs_nothing_but_the_attempt() -> None:
    reads = SpeculativeReads(1 << 20, SYSTEM_CLOCK)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    reads.learn([Replica(1, "n", f"127.0.0.1:{port}", "", 0, 10, 0, b"", 0)])
    assert reads.send(["k"], [100], Deadline(1.0)) is None
    assert reads.target() is None  # cooling down: the next reads do not try again at once


def test_read_key_needs_the_token_where_the_cluster_requires_one(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path
) -> None:
    """READ_KEY before the HELLO challenge-response is refused and the connection closed, as any op; a
    client holding the token speculates as usual."""
    token = tmp_path / "token"
    token.write_bytes(b"read-by-key-token\n")
    token.chmod(0o600)
    cluster = make_cluster(stores=1, store_size="32MiB", token_file=str(token))
    endpoint = cluster.stores[0].address
    with client(cluster.master, token_file=str(token)) as pool:
        assert pool.batch_put(["secret-0", "secret-1"], [b"s" * 3000, b"t" * 3000]) == [0, 0]
        _speculating(pool, "secret-0")
        assert pool.get("secret-1") == b"t" * 3000
        assert pool.metrics()["speculative_reads"] == 1
    host, _, port = endpoint.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        payload = READ_KEY_REQUEST.pack(1 << 20) + b"secret-1"
        sock.sendall(HEADER.pack(MAGIC, Op.READ_KEY, 0, 0, 3, len(payload)) + payload)
        _magic, op, _flags, status, _rid, length = HEADER.unpack(sock.recv(HEADER_SIZE, socket.MSG_WAITALL))
        assert (op, status, length) == (Op.HELLO, ErrorCode.AUTH_FAILED, 0)
        assert closed_by_peer(sock)
