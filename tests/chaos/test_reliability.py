"""Faults under a checked load, with real processes: a store SIGKILLed, a writer SIGKILLed between PutStart
and PutEnd, a slow store (a delaying proxy), one etcd member of three lost.

For every fault: no wrong bytes (values are a function of their keys, so every read is checked), no
call past its timeout (+ SLACK_S, and + the documented PutEnd grace for puts), and the figure of what
was lost is printed on a ``RELIABILITY {json}`` line (docs/reliability.md collects them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvpool.client import ClientConfig, PoolClient
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.tools.bench_failover import wait_for_leader
from kvpool.tools.local_cluster import LocalCluster
from kvpool.tools.workload import BackgroundLoad, MixedWorkload, WorkloadResult, expected_value
from kvpool.transfer.base import TransferBatch, TransferRequest
from kvpool.transfer.registry import TransportSet
from kvpool.transfer.tcp import TcpTransport
from tests.support.cluster import FAST_MASTER, client, wait_for
from tests.support.faults import DelayProxy, free_port

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

TIMEOUT_S = 1.0
SLACK_S = 0.5  # scheduling noise on a loaded 2-core machine; a real overrun is a whole timeout
VALUE = 16 << 10


def report(fault: str, **figures: Any) -> None:
    print(f"\nRELIABILITY {json.dumps({'fault': fault, **figures}, sort_keys=True)}")


def load_figures(result: WorkloadResult) -> dict[str, Any]:
    hist = result.histogram()
    return {
        "ops": result.ops,
        "errors": result.errors,
        "wrong_reads": result.wrong_reads,
        "reads_checked": result.reads_checked,
        "load_lost": result.lost,
        "overruns": result.overruns,
        "worst_overrun_s": round(result.worst_overrun_s, 3),
        "p99_ms": round(hist.percentile(99) / 1e3, 1),
    }


def assert_load_ok(result: WorkloadResult) -> None:
    assert result.wrong_reads == 0, f"{result.wrong_reads} wrong reads"
    worst = result.worst_overrun_s
    assert result.overruns == 0, f"{result.overruns} calls past their deadline (worst {worst:.3f} s)"
    assert result.ops > 0


def fast_client(master: str) -> PoolClient:
    return client(master, timeout_s=TIMEOUT_S, breaker_backoff_s=0.1, breaker_max_backoff_s=0.5)


def seed(c: PoolClient, count: int, prefix: str = "seed") -> list[str]:
    """Write ``count`` objects (retrying failed batches until a deadline); the acknowledged keys."""
    writer = MixedWorkload(c, prefix, value_bytes=VALUE, timeout_s=5.0)
    deadline = Deadline(30.0)
    while len(writer.live) < count and not deadline.expired():
        writer.put(min(16, count - len(writer.live)))
    assert len(writer.live) >= count, f"only {len(writer.live)} of {count} seed objects written"
    return list(writer.live)


def placement(c: PoolClient, keys: list[str]) -> dict[str, str]:
    """key -> the tcp endpoint of its (single) replica, from the master (no lease taken)."""
    resp = c._master.call(
        frames.Op.BATCH_GET_REPLICAS, pb.BatchGetReplicasRequest(keys=keys, no_lease=True), Deadline(5.0)
    )
    return {k: r.replicas[0].tcp_endpoint for k, r in zip(keys, resp.results, strict=True) if r.replicas}


def check_all(c: PoolClient, keys: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(readable with the right bytes, missing, WRONG) among ``keys``."""
    good, missing, wrong = [], [], []
    for start in range(0, len(keys), 32):
        chunk = keys[start : start + 32]
        for key, value in zip(chunk, c.batch_get(chunk, timeout=5.0), strict=True):
            if value is None:
                missing.append(key)
            elif value == expected_value(key, VALUE):
                good.append(key)
            else:
                wrong.append(key)
    return good, missing, wrong


# ---------------------------------------------------------------------- a store SIGKILLed
@pytest.mark.usefixtures("data_path")
def test_store_sigkill_during_reads_and_writes(make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(stores=2, store_size="64MiB", master_args=FAST_MASTER)  # stores expire after 2 s
    c = fast_client(cluster.master)
    try:
        keys = seed(c, 200)
        where = placement(c, keys)
        victim = cluster.stores[0]
        on_victim = [k for k in keys if where.get(k) == victim.address]
        on_survivor = [k for k in keys if where.get(k) != victim.address]
        load = BackgroundLoad(c, "load", threads=3, value_bytes=VALUE, timeout_s=TIMEOUT_S, slack_s=SLACK_S).start()
        wait_for(lambda: load.ops >= 100, 30.0, "the load to get going")
        killed_at = time.monotonic()
        cluster.kill(victim)
        wait_for(lambda: len(c.stats().segments) == 1, 15.0, "the master to expire the killed store")
        expired_after = time.monotonic() - killed_at
        ops_at_expiry = load.ops
        wait_for(lambda: load.ops >= ops_at_expiry + 100, 30.0, "the load to go on after the expiry")
        result = load.stop()
        good, missing, wrong = check_all(c, keys)
        fresh = MixedWorkload(c, "after", value_bytes=VALUE, timeout_s=TIMEOUT_S).put(16)
        report(
            "store SIGKILL under load",
            seeded=len(keys),
            on_killed_store=len(on_victim),
            lost=len(missing),
            survivors_readable=f"{len(set(good) & set(on_survivor))}/{len(on_survivor)}",
            expired_after_s=round(expired_after, 2),
            puts_after_expiry=f"{len(fresh)}/16",
            **load_figures(result),
        )
        assert not wrong, f"wrong bytes for {wrong[:5]}"
        assert set(good) == set(on_survivor), "an object on the surviving store became unreadable"
        assert set(missing) == set(on_victim), "objects of the killed store should be clean misses"
        assert len(fresh) == 16, "puts must succeed once the dead store is expired"
        assert_load_ok(result)
    finally:
        c.close()


# ---------------------------------------------------------------------- a writer killed mid-put
WRITER = textwrap.dedent("""
    import sys
    from kvpool.client import ClientConfig, PoolClient
    from kvpool.tools.workload import expected_value
    master, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    keys = [f"abandoned-{i}" for i in range(n)]
    with PoolClient(config=ClientConfig(master=master, use_shm=False, timeout_s=5.0)) as c:
        c.batch_put_from(keys, [expected_value(k, size) for k in keys])
    print("put returned: the failpoint did not fire", flush=True)
""")


def _start_writer(master: str, n: int, tmp: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "KVPOOL_FAILPOINTS": "client.put.before_end=sleep:120"}
    script = tmp / "writer.py"
    script.write_text(WRITER)
    return subprocess.Popen(
        [sys.executable, str(script), master, str(n), str(VALUE)],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


def _wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float) -> None:
    """Read the child's stderr until ``needle`` (a failpoint announces itself there) or fail."""
    import selectors

    assert proc.stderr is not None
    deadline = Deadline(timeout)
    seen = []
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while not deadline.expired():
            if not sel.select(deadline.remaining()):
                break
            line = proc.stderr.readline()
            if not line:
                break
            seen.append(line)
            if needle in line:
                return
    raise AssertionError(f"{needle!r} not seen in {timeout} s; child said: {''.join(seen[-20:])}")


@pytest.fixture
def killable() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()


def test_writer_killed_between_put_start_and_put_end(
    make_cluster: Callable[..., LocalCluster], tmp_path: Path, killable: list[subprocess.Popen[str]]
) -> None:
    cluster = make_cluster(stores=2, store_size="64MiB", master_args=(*FAST_MASTER, "--put-timeout-s", "2"))
    c = fast_client(cluster.master)
    try:
        keys = seed(c, 100)
        before = c.stats()
        # Readers only, of the seeded keys: any miss or error would be the abandoned put's doing.
        load = BackgroundLoad(
            c, "readers", threads=2, value_bytes=VALUE, timeout_s=TIMEOUT_S, slack_s=SLACK_S, mix=(0, 1, 0, 0)
        )
        for w in load.workloads:
            w.live = list(keys)
        load.start()
        writer = _start_writer(cluster.master, 32, tmp_path)
        killable.append(writer)
        _wait_for_line(writer, "kvpool failpoint client.put.before_end hit", 30.0)
        held = c.stats().used - before.used
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait(10)
        killed_at = time.monotonic()
        wait_for(lambda: c.stats().used == before.used, 15.0, "the abandoned put's space to be reclaimed")
        reclaimed_after = time.monotonic() - killed_at
        after = c.stats()
        result = load.stop()
        abandoned = [f"abandoned-{i}" for i in range(32)]
        good, missing, wrong = check_all(c, abandoned)
        report(
            "writer SIGKILLed between PutStart and PutEnd",
            bytes_held=held,
            reclaimed_after_s=round(reclaimed_after, 2),
            reclaimed_puts=after.reclaimed_puts - before.reclaimed_puts,
            abandoned_keys_readable=len(good),
            **load_figures(result),
        )
        assert held >= 32 * VALUE, "the writer should have held its allocation at the failpoint"
        assert after.reclaimed_puts - before.reclaimed_puts == 32
        assert not wrong
        assert not good, "an abandoned put must never become visible"
        assert len(missing) == 32
        assert result.errors == {}, f"readers were affected: {result.errors}"
        assert_load_ok(result)
    finally:
        c.close()


# ---------------------------------------------------------------------- a slow store
def test_slow_store_behind_a_delaying_proxy(make_cluster: Callable[..., LocalCluster]) -> None:
    # The slow store listens on 127.0.0.2:P and tells the master it is at 127.0.0.3:P, where the proxy is.
    port = free_port("127.0.0.2")
    proxy = DelayProxy(("127.0.0.3", port), ("127.0.0.2", port), delay_s=0.0).start()
    try:
        cluster = make_cluster(stores=1, store_size="64MiB")
        cluster.add_store(extra=("--host", "127.0.0.2", "--advertise", "127.0.0.3", "--port", str(port)))
        c = fast_client(cluster.master)
        try:
            keys = seed(c, 100)
            slow = [k for k, ep in placement(c, keys).items() if ep.startswith("127.0.0.3:")]
            phases: dict[str, dict[str, Any]] = {}
            # delay below the timeout: slow but correct; above it: deadline-bound failures; stalled: the same.
            schedule = (("delay 0.1 s", 0.1, False), ("delay 1.5 s", 1.5, False), ("stalled", 0, True))
            for name, delay, stall in schedule:
                proxy.delay_s, proxy.stall = delay, stall
                # Gets of the slow store's objects, puts to either store, no removes (checked after).
                load = BackgroundLoad(
                    c,
                    f"slow{len(phases)}",
                    threads=3,
                    value_bytes=VALUE,
                    timeout_s=TIMEOUT_S,
                    slack_s=SLACK_S,
                    mix=(0.3, 0.6, 0.1, 0.0),
                )
                for w in load.workloads:
                    w.live = list(slow)
                load.start()
                wait_for(lambda load=load: load.ops >= 30, 60.0, f"30 calls with the store {name}")  # type: ignore[misc]
                result = load.stop()
                phases[name] = load_figures(result)
                assert_load_ok(result)
            proxy.delay_s, proxy.stall = 0.0, False
            good, missing, wrong = check_all(c, slow)
            report("slow store (delaying proxy)", slow_objects=len(slow), readable_after=len(good), phases=phases)
            assert not wrong
            assert len(good) == len(slow), "every object must read back once the store is fast"
            # A 0.2 s round trip fits a 1 s deadline; calls queued behind others on a lane may not.
            fast = phases["delay 0.1 s"]
            assert fast["errors"].get("TIMEOUT", 0) <= 0.1 * fast["ops"], fast
        finally:
            c.close()
    finally:
        proxy.close()


# ---------------------------------------------------------------------- one etcd member of three lost
def test_one_etcd_member_of_three_killed(etcd3: Any, make_cluster: Callable[..., LocalCluster]) -> None:
    cluster = make_cluster(
        stores=2,
        store_size="64MiB",
        ha=True,
        master_args=("--store-ttl-s", "3"),
        etcd_endpoints=etcd3.endpoints,
    )
    masters = [m.address for m in cluster.masters]
    assert wait_for_leader(masters, 30.0), "no leader before the fault"
    c = fast_client(cluster.master)
    try:
        keys = seed(c, 100)
        load = BackgroundLoad(c, "etcd", threads=3, value_bytes=VALUE, timeout_s=TIMEOUT_S, slack_s=SLACK_S).start()
        wait_for(lambda: load.ops >= 100, 30.0, "the load to get going")
        # The raft leader: its loss costs an etcd election on top of the masters' clients failing over.
        # (test_failover.py freezes the first endpoint, the one every kvpool etcd client starts on.)
        victim = etcd3.leader_index()
        etcd3.kill(victim)
        ops_at_kill = load.ops
        # The masters keep their leases through the survivors; the load must go on.
        wait_for(lambda: load.ops >= ops_at_kill + 300, 60.0, "300 calls after the etcd member died")
        leader = wait_for_leader(masters, 15.0)
        result = load.stop()
        good, missing, wrong = check_all(c, keys)
        report(
            "one etcd member of three SIGKILLed (the raft leader)",
            killed_member=victim,
            kvpool_leader_after=bool(leader),
            seeded=len(keys),
            lost=len(missing),
            **load_figures(result),
        )
        assert leader, "no serving kvpool leader with 2 of 3 etcd members"
        assert not wrong
        assert not missing, "no object may be lost to an etcd member failure"
        assert_load_ok(result)
    finally:
        c.close()


# ---------------------------------------------------------------------- late bytes of a revoked put
class _Direct(TcpTransport):
    """Reaches the slow store at its real address instead of the advertised proxy (a second path)."""

    def __init__(self, proxied: str, real: str) -> None:
        super().__init__(connections_per_endpoint=1)
        self._map = (proxied, real)

    def _moved(self, requests: Sequence[TransferRequest]) -> list[TransferRequest]:
        proxied, real = self._map
        return [
            r._replace(replica=r.replica._replace(tcp_endpoint=r.replica.tcp_endpoint.replace(proxied, real)))
            for r in requests
        ]

    def submit(self, requests: Sequence[TransferRequest], deadline: Deadline) -> TransferBatch:
        return super().submit(self._moved(requests), deadline)

    def transfer(self, requests: Sequence[TransferRequest], deadline: Deadline) -> list[ErrorCode]:
        return super().transfer(self._moved(requests), deadline)


def test_late_bytes_of_a_revoked_put_never_overwrite_a_newer_object(
    make_cluster: Callable[..., LocalCluster],
) -> None:
    """A put times out behind a stalled link and is revoked; a new put is written straight to the store;
    then the stalled WRITE arrives, its grant still valid. Without the revoke quarantine the new put got
    the revoked range and those late bytes overwrote it (every read: CHECKSUM_MISMATCH)."""
    port = free_port("127.0.0.2")
    proxy = DelayProxy(("127.0.0.3", port), ("127.0.0.2", port)).start()
    try:
        cluster = make_cluster(stores=0, store_size="64MiB")
        cluster.add_store(extra=("--host", "127.0.0.2", "--advertise", "127.0.0.3", "--port", str(port)))
        slow = fast_client(cluster.master)
        direct = PoolClient(
            config=ClientConfig(master=cluster.master, use_shm=False, timeout_s=5.0),
            transports=TransportSet([_Direct(f"127.0.0.3:{port}", f"127.0.0.2:{port}")]),
        )
        try:
            proxy.stall = True
            assert slow.put("revoked", b"\xee" * VALUE) == ErrorCode.TIMEOUT  # then revoked by the client
            assert direct.put("newer", expected_value("newer", VALUE)) == 0
            connections = proxy.connections
            proxy.stall = False  # the revoked put's WRITE now reaches the store, its grant still valid
            # Delivered, answered and closed by the store: the late WRITE has been served (or refused).
            wait_for(lambda: proxy.pending == 0 and proxy.active == 0, 10.0, "the proxy to deliver the late bytes")
            value = direct.get("newer")
            report(
                "late WRITE of a revoked put",
                proxy_connections=connections,
                newer_object_intact=value == expected_value("newer", VALUE),
            )
            assert value == expected_value("newer", VALUE), "a revoked put's late bytes overwrote a newer object"
        finally:
            slow.close()
            direct.close()
    finally:
        proxy.close()
