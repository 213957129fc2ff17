"""``kvpool bench failover``: kill the leader master under load and measure what the clients see.

Prints the time until a new leader serves, the time until the first successful client read after the
kill, the fraction of objects acknowledged more than 1 s before the kill that are readable afterwards
with correct bytes, and the number of wrong reads during the whole run (must be 0).

Recovery over time: from the moment a new leader serves, a fixed random sample of those objects (up to
``RECOVERY_SAMPLE``) is read every ``RECOVERY_POLL_S`` and the readable share recorded as
``recovered_over_time`` ([seconds after the kill, fraction], ...). ``seconds_to_full_index`` is the first
sample at which every sampled object reads back and the leader's object count is back to the count before
the kill.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from kvpool.common.clock import Deadline
from kvpool.proto import master_pb2 as pb
from kvpool.proto import master_pb2_grpc as pb_grpc
from kvpool.tools.argtypes import positive_float, positive_int


@dataclass
class FailoverResult:
    fault: str
    seconds_to_new_leader: float
    seconds_to_first_read: float
    recovered_fraction: float
    objects_checked: int
    wrong_reads: int
    reads_during_run: int
    failed_calls: int
    old_leader: str
    new_leader: str
    notes: list[str] = field(default_factory=list)
    recovered_over_time: list[list[float]] = field(default_factory=list)
    """[seconds after the kill, readable share of the sample], from the new leader's first moment on."""
    seconds_to_full_index: float = math.nan
    """First sample with every sampled object readable and the object count back (nan: not within the timeout)."""
    recovered_at_first_read: float = math.nan
    """The readable share of the sample at the first sample after the new leader was found."""


RECOVERY_SAMPLE = 4096
RECOVERY_POLL_S = 0.1


class Workload:
    """Background readers and a writer; every read is checked against what was written."""

    def __init__(self, master: str, value_bytes: int, cluster: str = "kvpool") -> None:
        from kvpool.client import ClientConfig, PoolClient

        self._config = ClientConfig(
            master=master,
            use_shm=False,
            timeout_s=2.0,
            cluster=cluster,
            breaker_backoff_s=0.1,
            breaker_max_backoff_s=0.5,
        )
        self.client = PoolClient(config=self._config)
        self.value_bytes = value_bytes
        self.acked: dict[str, tuple[float, bytes]] = {}  # key -> (ack time, sha256 of the value)
        self._acked_keys: list[str] = []  # the same keys in a list: readers sample it in O(1) per key
        self.read_ok_times: list[float] = []
        self.wrong_reads = 0
        self.reads = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def write(self, count: int, prefix: str, batch: int = 32) -> int:
        """Write ``count`` new objects, ``batch`` per call; returns how many were acknowledged."""
        keys = [f"{prefix}-{i}" for i in range(count)]
        acked = 0
        for start in range(0, count, batch):
            chunk = keys[start : start + batch]
            values = [os.urandom(self.value_bytes) for _ in chunk]
            codes = self.client.batch_put_from(chunk, values)
            now = time.monotonic()
            with self._lock:
                for key, value, code in zip(chunk, values, codes, strict=True):
                    if code == 0:
                        if key not in self.acked:
                            self._acked_keys.append(key)
                        self.acked[key] = (now, hashlib.sha256(value).digest())
                        acked += 1
                    else:
                        self.failed += 1
        return acked

    def write_until(self, count: int, prefix: str, timeout: float) -> int:
        """Keep writing batches of new objects until ``count`` are acknowledged (or the timeout)."""
        deadline = Deadline(timeout)
        acked = batch = 0
        while acked < count and not deadline.expired():
            acked += self.write(min(16, count - acked), f"{prefix}-{batch}")
            batch += 1
        return acked

    def _reader(self) -> None:
        rng = random.Random()
        while not self._stop.is_set():
            with self._lock:
                keys = rng.sample(self._acked_keys, min(8, len(self._acked_keys)))
            if not keys:
                time.sleep(0.01)
                continue
            for key, value in zip(keys, self.client.batch_get(keys), strict=True):
                if value is None:
                    with self._lock:
                        self.failed += 1
                    time.sleep(0.005)  # the pool is failing over: do not spin
                    continue
                with self._lock:
                    self.reads += 1
                    self.read_ok_times.append(time.monotonic())
                    if hashlib.sha256(value).digest() != self.acked[key][1]:
                        self.wrong_reads += 1

    def _writer(self) -> None:
        n = 0
        while not self._stop.is_set():
            self.write(8, f"live-{n}")
            n += 1
            time.sleep(0.02)

    def start(self) -> None:
        self._threads = [
            threading.Thread(target=self._reader, daemon=True),
            threading.Thread(target=self._writer, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(10)

    def verify(self, acked_before: float) -> tuple[int, int, int]:
        """(objects checked, readable with correct bytes, wrong) for objects acked before ``acked_before``."""
        keys = [k for k, (t, _) in self.acked.items() if t < acked_before]
        good, wrong = self.check(keys)
        return len(keys), good, wrong

    def check(self, keys: list[str]) -> tuple[int, int]:
        """(readable with correct bytes, wrong) among ``keys``, read in batches."""
        good = wrong = 0
        for start in range(0, len(keys), 512):
            chunk = keys[start : start + 512]
            for key, value in zip(chunk, self.client.batch_get(chunk, timeout=5.0), strict=True):
                if value is None:
                    continue
                if hashlib.sha256(value).digest() == self.acked[key][1]:
                    good += 1
                else:
                    wrong += 1
        return good, wrong

    def sample(self, acked_before: float, size: int) -> list[str]:
        """Up to ``size`` random keys among those acked before ``acked_before``."""
        with self._lock:  # the writer thread may be adding keys
            keys = [k for k, (t, _) in self.acked.items() if t < acked_before]
        return random.Random(0).sample(keys, min(size, len(keys)))

    def verify_until(self, acked_before: float, fraction: float, timeout: float) -> tuple[int, int, int]:
        """``verify`` again until ``fraction`` is readable (stores re-mount within a heartbeat or two)."""
        deadline = Deadline(timeout)
        while True:
            checked, good, wrong = self.verify(acked_before)
            if wrong or good >= fraction * checked or deadline.expired():
                return checked, good, wrong
            time.sleep(0.2)

    def close(self) -> None:
        self.client.close()


def serving_leader(endpoints: list[str], exclude: str = "") -> str:
    """The gRPC endpoint of a master that says it is the serving leader, or ''."""
    for endpoint in endpoints:
        if endpoint == exclude:
            continue
        try:
            with grpc.insecure_channel(endpoint) as channel:
                stub = pb_grpc.MasterServiceStub(channel)  # type: ignore[no-untyped-call]
                stats = stub.GetStats(pb.StatsRequest(), timeout=0.3)
        except grpc.RpcError:
            continue
        if stats.role == "leader":
            return endpoint
    return ""


def wait_for_leader(endpoints: list[str], timeout: float, exclude: str = "") -> str:
    deadline = Deadline(timeout)
    while not deadline.expired():
        leader = serving_leader(endpoints, exclude)
        if leader:
            return leader
        time.sleep(0.05)
    return ""


@dataclass
class Recovery:
    over_time: list[list[float]]
    seconds_to_full_index: float
    wrong: int


def track_recovery(workload: Workload, sample: list[str], t0: float, objects_before: int, timeout: float) -> Recovery:
    """Read ``sample`` every RECOVERY_POLL_S until all of it reads back and the leader counts at least
    ``objects_before`` objects, or ``timeout``; times are seconds after ``t0`` (the kill)."""
    deadline = Deadline(timeout)
    over_time: list[list[float]] = []
    wrong = 0
    while True:
        good, bad = workload.check(sample)
        now = time.monotonic() - t0
        wrong += bad
        fraction = good / len(sample) if sample else 1.0
        over_time.append([round(now, 3), round(fraction, 5)])
        if fraction >= 1.0 and _objects(workload) >= objects_before:
            return Recovery(over_time, now, wrong)
        if deadline.expired():
            return Recovery(over_time, math.nan, wrong)
        time.sleep(RECOVERY_POLL_S)


def _objects(workload: Workload) -> int:
    """The serving leader's object count (-1 while it cannot answer)."""
    try:
        return int(workload.client.stats(timeout=2.0).objects)
    except Exception:  # failing over: the next sample asks again
        return -1


def run_failover(
    cluster: Any,
    fault: str = "sigkill",
    objects: int = 400,
    value_bytes: int = 16 << 10,
    settle_s: float = 1.2,
    timeout: float = 30.0,
) -> FailoverResult:
    """Kill (or freeze) the leader of a running HA LocalCluster under load and measure."""
    endpoints = [m.address for m in cluster.masters]
    old = wait_for_leader(endpoints, timeout)
    workload = Workload(cluster.master, value_bytes, cluster.cluster)
    try:
        workload.write(objects, "base", batch=32 if objects <= 10_000 else 256)
        time.sleep(settle_s)  # the acceptance counts objects acknowledged more than 1 s before the fault
        workload.start()
        time.sleep(0.5)
        victim = next(m for m in cluster.masters if m.address == old)
        sample = workload.sample(time.monotonic() - 1.0, RECOVERY_SAMPLE)
        objects_before = _objects(workload)
        t0 = time.monotonic()
        if fault == "sigkill":
            cluster.kill(victim)
        elif fault == "sigstop":
            cluster.signal(victim, signal.SIGSTOP)
        new = wait_for_leader(endpoints, timeout, exclude=old)
        t_leader = time.monotonic() - t0
        recovery = track_recovery(workload, sample, t0, objects_before, timeout)
        deadline = Deadline(timeout)
        while not deadline.expired() and not any(t > t0 + t_leader for t in workload.read_ok_times):
            time.sleep(0.02)
        first_read = min((t for t in workload.read_ok_times if t > t0 + t_leader), default=float("nan")) - t0
        workload.stop()
        checked, good, wrong = workload.verify_until(t0 - 1.0, 0.99, timeout)
        notes = []
        if fault == "sigstop":
            cluster.signal(victim, signal.SIGCONT)
            notes.append("old leader resumed with SIGCONT")
        return FailoverResult(
            fault,
            t_leader,
            first_read,
            good / checked if checked else 0.0,
            checked,
            workload.wrong_reads + wrong + recovery.wrong,
            workload.reads,
            workload.failed,
            old,
            new,
            notes,
            recovery.over_time,
            recovery.seconds_to_full_index,
            recovery.over_time[0][1],
        )
    finally:
        workload.stop()
        workload.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runs", type=positive_int, default=3, help="failovers to measure (default 3); medians printed"
    )
    parser.add_argument("--leader-ttl-s", type=positive_float, default=3.0, help="leader lease TTL (default: 3 s)")
    parser.add_argument("--objects", type=positive_int, default=400, help="objects written before each failover (400)")
    parser.add_argument(
        "--value-bytes", type=positive_int, default=16 << 10, help="bytes per object (16 KiB; e.g. 512 at 1 M objects)"
    )
    parser.add_argument("--json", action="store_true")


def _full_index_order(results: list[FailoverResult]) -> list[float]:
    """Seconds to the full index, a run that never got there (nan) counted as the slowest."""
    return sorted(math.inf if math.isnan(r.seconds_to_full_index) else r.seconds_to_full_index for r in results)


def _median_run(results: list[FailoverResult]) -> FailoverResult:
    """The run with the median time to the full index (its curve is the one reported)."""
    ranked = sorted(results, key=lambda r: math.inf if math.isnan(r.seconds_to_full_index) else r.seconds_to_full_index)
    return ranked[len(ranked) // 2]


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def run(args: argparse.Namespace) -> int:
    import statistics

    from kvpool.tools.local_cluster import LocalCluster

    results = []
    # Each of the two stores could hold all the objects (64-byte allocation granularity), plus room for the
    # live writer: no eviction during the run. 64 MiB at least.
    per_store = args.objects * -(-args.value_bytes // 64) * 64
    store_mib = max(64, -(-per_store // (1 << 20)) + 32)
    for i in range(args.runs):
        with LocalCluster(
            stores=2, store_size=f"{store_mib}MiB", ha=True, master_args=("--leader-ttl-s", str(args.leader_ttl_s))
        ) as cluster:
            results.append(run_failover(cluster, objects=args.objects, value_bytes=args.value_bytes, timeout=120.0))
            print(f"run {i + 1}: {asdict(results[-1])}", file=sys.stderr)
    doc = {
        "leader_ttl_s": args.leader_ttl_s,
        "seconds_to_new_leader": statistics.median(r.seconds_to_new_leader for r in results),
        "seconds_to_first_read": statistics.median(r.seconds_to_first_read for r in results),
        "recovered_fraction": statistics.median(r.recovered_fraction for r in results),
        "recovered_at_first_read": statistics.median(r.recovered_at_first_read for r in results),
        "seconds_to_full_index": _finite_or_none(statistics.median(_full_index_order(results))),
        "recovered_over_time": _median_run(results).recovered_over_time,
        "wrong_reads": sum(r.wrong_reads for r in results),
        "runs": [asdict(r) for r in results],
    }
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"leader TTL {args.leader_ttl_s:.1f} s, medians of {args.runs} runs:")
        print(f"  new leader serving after     {doc['seconds_to_new_leader']:.2f} s")
        print(f"  first client read after      {doc['seconds_to_first_read']:.2f} s")
        print(f"  objects recovered            {doc['recovered_fraction']:.1%}")
        print(f"  sample readable at 1st look  {doc['recovered_at_first_read']:.1%}")
        full = doc["seconds_to_full_index"]
        print(f"  whole index back after       {'never' if full is None else f'{full:.2f} s'}")
        print(f"  wrong reads                  {doc['wrong_reads']}")
    return 0 if doc["wrong_reads"] == 0 else 1
