"""A SIGKILLed store stops being used within a second, long before its heartbeat TTL (docs/reliability.md).

Real master, two real stores, one client running a put/get loop; one store is SIGKILLed mid-loop. The
client reports the refused connections, the master probes the store, fails, and suspects it: from then
on every put is placed on the survivor and every read of an object of the dead store is a clean miss.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvpool.client import ClientConfig, PoolClient
from kvpool.client.master_client import MasterClient
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.tools.local_cluster import LocalCluster
from kvpool.tools.workload import expected_value
from tests.support.cluster import wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

VALUE = 8 << 10
STORE_TTL_S = 30.0  # far longer than the test: expiry cannot be what takes the dead store out
CLEAN_AFTER_S = 1.0


@dataclass
class Op:
    started: float  # monotonic
    kind: str  # "put" | "get"
    key: str
    code: int


def _homes(master: MasterClient, keys: list[str]) -> dict[str, str]:
    """Each readable key's data-plane endpoint, without a lease (an admin view)."""
    response = master.call(
        frames.Op.BATCH_GET_REPLICAS, pb.BatchGetReplicasRequest(keys=keys, no_lease=True), Deadline(10.0)
    )
    return {k: r.replicas[0].tcp_endpoint for k, r in zip(keys, response.results, strict=True) if r.code == 0}


def _loop(client: PoolClient, seeded: list[str], stop: threading.Event, ops: list[Op]) -> None:
    buffer = bytearray(VALUE)
    n = 0
    while not stop.is_set():
        key = f"loop-{n}"
        started = time.monotonic()
        ops.append(Op(started, "put", key, client.put(key, expected_value(key, VALUE))))
        read = seeded[n % len(seeded)]
        started = time.monotonic()
        code = client.get_into(read, buffer)
        if code == VALUE and bytes(buffer) != expected_value(read, VALUE):
            code = int(ErrorCode.CHECKSUM_MISMATCH)  # wrong bytes: never acceptable
        ops.append(Op(started, "get", read, code))
        n += 1


def test_a_killed_store_is_out_of_service_within_a_second(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(stores=2, store_size="32MiB", master_args=("--store-ttl-s", str(STORE_TTL_S)))
    config = ClientConfig(master=cluster.master, use_shm=False, timeout_s=2.0, breaker_backoff_s=0.05)
    client = PoolClient(config=config)
    admin = MasterClient(cluster.master)
    stop = threading.Event()
    ops: list[Op] = []
    loop = threading.Thread(target=_loop, args=(client, [], stop, ops))
    try:
        seeded = [f"seed-{i}" for i in range(40)]
        assert client.batch_put_from(seeded, [expected_value(k, VALUE) for k in seeded]) == [0] * len(seeded)
        homes = _homes(admin, seeded)
        victim, survivor = cluster.stores
        victim_endpoint = victim.endpoints["tcp"]
        on_victim = {k for k in seeded if homes[k] == victim_endpoint}
        assert on_victim
        assert len(on_victim) < len(seeded), "every seeded object landed on one store"
        loop = threading.Thread(target=_loop, args=(client, seeded, stop, ops), daemon=True)
        loop.start()
        wait_for(lambda: len(ops) >= 40, 30.0, "the loop to get going")
        killed_at = time.monotonic()
        cluster.kill(victim)
        wait_for(lambda: ops[-1].started > killed_at + CLEAN_AFTER_S + 1.5, 30.0, "the loop to run past the kill")
        stop.set()
        loop.join(30.0)
        after = [op for op in ops if op.started >= killed_at]
        failed = [op for op in after if op.code < 0 and op.code != ErrorCode.OBJECT_NOT_FOUND]
        last_failure = max((op.started - killed_at for op in failed), default=0.0)
        print(
            f"\nstore SIGKILL: {len(after)} calls after the kill, {len(failed)} failed "
            f"({sorted({ErrorCode(op.code).name for op in failed})}), the last one "
            f"{last_failure:.3f} s after the kill; store TTL {STORE_TTL_S:.0f} s"
        )
        late = [op for op in after if op.started >= killed_at + CLEAN_AFTER_S]
        late_puts = [op for op in late if op.kind == "put"]
        late_gets = [op for op in late if op.kind == "get"]
        assert late_puts
        assert late_gets
        assert [op for op in late_puts if op.code != 0] == [], "a put after the suspicion failed"
        assert set(_homes(admin, [op.key for op in late_puts]).values()) == {survivor.endpoints["tcp"]}
        for op in late_gets:
            if op.key in on_victim:
                assert op.code == ErrorCode.OBJECT_NOT_FOUND, f"{op.key} of the dead store: {op.code}"
            else:
                assert op.code == VALUE, f"{op.key} of the survivor: {op.code}"
        assert [op for op in ops if op.code == ErrorCode.CHECKSUM_MISMATCH] == []
        # Still well within the TTL: the master did not expire the store, it suspects it.
        assert len(client.stats().segments) == 2
    finally:
        stop.set()
        if loop.is_alive():
            loop.join(30.0)
        client.close()
        admin.close()


def _metric(endpoint: str, name: str) -> float:
    body = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def _report(master: MasterClient, client_id: str, endpoint: str) -> list[str]:
    request = pb.ReportStoreFailuresRequest(client_id=client_id, tcp_endpoints=[endpoint])
    return list(master.call(frames.Op.REPORT_STORE_FAILURES, request, Deadline(5.0)).suspected)


def test_false_reports_and_a_heartbeat(make_cluster: Callable[..., LocalCluster]) -> None:
    """A lone false report is refuted by the master's probe; two clients agreeing suspect even a healthy
    store, and its next heartbeat lifts that at once."""
    cluster = make_cluster(
        stores=2, store_size="32MiB", master_args=("--store-ttl-s", str(STORE_TTL_S), "--store-report-agreement", "2")
    )
    client = PoolClient(config=ClientConfig(master=cluster.master, use_shm=False, timeout_s=5.0))
    master = MasterClient(cluster.master)
    metrics = cluster.masters[0].endpoints["metrics"]
    try:
        seeded = [f"seed-{i}" for i in range(40)]
        assert client.batch_put_from(seeded, [expected_value(k, VALUE) for k in seeded]) == [0] * len(seeded)
        healthy = cluster.stores[0].endpoints["tcp"]
        on_healthy = [k for k, home in _homes(master, seeded).items() if home == healthy]
        assert on_healthy
        assert _report(master, "liar", healthy) == []
        wait_for(
            lambda: _metric(metrics, 'kvpool_master_store_probes_total{result="reachable"}') >= 1,
            10.0,
            "the master's probe of the reported store",
        )
        assert _metric(metrics, "kvpool_master_suspected_stores") == 0
        assert client.batch_exists(seeded) == [1] * len(seeded)
        # Two clients agree: suspected at once (no probe asked), lookups of its objects miss ... (a heartbeat
        # landing between the reports and the lookup lifts it first: then agree again, a few times at most)
        for _attempt in range(3):
            _report(master, "client-a", healthy)
            assert _report(master, "client-b", healthy) == [healthy]
            suspected_at = time.monotonic()
            exists = client.batch_exists(on_healthy)
            if 0 in exists:
                break
        # ... until its next heartbeat (1 s period), which lifts the suspicion.
        wait_for(lambda: client.batch_exists(on_healthy) == [1] * len(on_healthy), 5.0, "the heartbeat to lift it")
        lifted_after = time.monotonic() - suspected_at
        print(f"\nagreed suspicion of a healthy store lifted by its heartbeat after {lifted_after:.2f} s")
        assert exists == [0] * len(on_healthy), "lookups of a suspected store's objects must miss"
        for key in on_healthy:
            assert client.get(key) == expected_value(key, VALUE)
    finally:
        client.close()
        master.close()
