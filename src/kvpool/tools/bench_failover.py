"""``kvpool bench failover``: kill the leader master under load and measure what the clients see.

Prints the time until a new leader serves, the time until the first successful client read after the
kill, the fraction of objects acknowledged more than 1 s before the kill that are readable afterwards
with correct bytes, and the number of wrong reads during the whole run (must be 0). ``--objects N`` (above
400) measures recovery over time at scale; ``--compare-puts N`` instead compares puts into a cluster with 2
warm standbys and one without.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
        self.read_ok_times: list[float] = []
        self.wrong_reads = 0
        self.reads = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def write(self, count: int, prefix: str) -> int:
        """Write ``count`` new objects; returns how many were acknowledged."""
        keys = [f"{prefix}-{i}" for i in range(count)]
        acked = 0
        for start in range(0, count, 32):
            chunk = keys[start : start + 32]
            values = [os.urandom(self.value_bytes) for _ in chunk]
            codes = self.client.batch_put_from(chunk, values)
            now = time.monotonic()
            with self._lock:
                for key, value, code in zip(chunk, values, codes, strict=True):
                    if code == 0:
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
                keys = rng.sample(sorted(self.acked), min(8, len(self.acked)))
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
        good = wrong = 0
        for start in range(0, len(keys), 64):
            chunk = keys[start : start + 64]
            for key, value in zip(chunk, self.client.batch_get(chunk, timeout=5.0), strict=True):
                if value is None:
                    continue
                if hashlib.sha256(value).digest() == self.acked[key][1]:
                    good += 1
                else:
                    wrong += 1
        return len(keys), good, wrong

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
        workload.write(objects, "base")
        time.sleep(settle_s)  # the acceptance counts objects acknowledged more than 1 s before the fault
        workload.start()
        time.sleep(0.5)
        victim = next(m for m in cluster.masters if m.address == old)
        t0 = time.monotonic()
        if fault == "sigkill":
            cluster.kill(victim)
        elif fault == "sigstop":
            cluster.signal(victim, signal.SIGSTOP)
        new = wait_for_leader(endpoints, timeout, exclude=old)
        t_leader = time.monotonic() - t0
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
            workload.wrong_reads + wrong,
            workload.reads,
            workload.failed,
            old,
            new,
            notes,
        )
    finally:
        workload.stop()
        workload.close()


@dataclass
class RecoveryResult:
    """One failover at scale: what a prober reading random objects saw over time after the kill."""

    objects: int
    puts_per_s: float
    seconds_standbys_warm: float
    seconds_to_new_leader: float
    seconds_to_first_read: float
    recovered_fraction: float
    seconds_to_full_index: float
    recovered_over_time: list[list[float]]
    wrong_reads: int
    old_leader: str
    new_leader: str
    leader_changed_while_writing: bool = False
    """The first leader lost its lease while the objects were written (a loaded machine): the failover
    measured is then that of its successor, whose standbys had to catch up afresh."""


FULL_INDEX_FRACTION = 0.999
"""A sample this readable counts as the full index: one read in 1,000 may time out on a loaded machine (a
miss), which would otherwise hold the figure back by a whole probe."""


def _value_of(key: str, size: int) -> bytes:
    """The bytes written under ``key``: derived from it, so that nothing per object is kept to check it."""
    block = hashlib.blake2b(key.encode(), digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


class Prober:
    """Writes ``objects`` small values, then reads random samples of them and checks every byte.

    Its client keeps no read leases, so every probe asks the master: a cached lease would hide a cold
    index."""

    def __init__(self, master: str, cluster: str, value_bytes: int) -> None:
        from kvpool.client import ClientConfig, PoolClient

        config = ClientConfig(
            master=master,
            use_shm=False,
            timeout_s=2.0,
            cluster=cluster,
            breaker_backoff_s=0.1,
            breaker_max_backoff_s=0.5,
            lease_cache_entries=0,
        )
        self.client = PoolClient(config=config)
        self.value_bytes = value_bytes
        self.keys: list[str] = []
        self.wrong = 0
        self._rng = random.Random(7)

    def write(self, objects: int, batch: int = 256) -> None:
        for start in range(0, objects, batch):
            keys = [f"obj-{i}" for i in range(start, min(objects, start + batch))]
            codes = self.client.batch_put_from(keys, [_value_of(k, self.value_bytes) for k in keys])
            self.keys.extend(k for k, code in zip(keys, codes, strict=True) if code == 0)

    def probe(self, sample: int) -> tuple[float, float | None]:
        """The fraction of ``sample`` random objects that read back with the right bytes, and the
        ``time.monotonic()`` at which the first of its reads that got any right bytes returned (None: none).
        A probe spans several calls: one begun before the new leader served mixes its misses with its hits,
        so the time of its first good read is kept apart from its start."""
        keys = self._rng.sample(self.keys, min(sample, len(self.keys)))
        good = 0
        first_good: float | None = None
        for start in range(0, len(keys), 256):
            chunk = keys[start : start + 256]
            for key, value in zip(chunk, self.client.batch_get(chunk, timeout=2.0), strict=True):
                if value is None:
                    continue
                if value == _value_of(key, self.value_bytes):
                    good += 1
                    if first_good is None:
                        first_good = time.monotonic()
                else:
                    self.wrong += 1
        return (good / len(keys) if keys else 0.0), first_good

    def close(self) -> None:
        self.client.close()


def _objects_of(endpoint: str) -> int:
    try:
        with grpc.insecure_channel(endpoint) as channel:
            stub = pb_grpc.MasterServiceStub(channel)  # type: ignore[no-untyped-call]
            return int(stub.GetStats(pb.StatsRequest(), timeout=5.0).objects)
    except grpc.RpcError:
        return -1


def wait_for_warm_standbys(endpoints: list[str], leader: str, objects: int, timeout: float) -> float:
    """Seconds until every standby's index has caught up: it holds ``objects`` objects, or its count has
    not changed for 2 s (nan if neither happened in time): the counts may differ for a while, e.g. a
    revoked put whose bytes landed stays in its store's inventory until the master frees its range."""
    started = time.monotonic()
    deadline = Deadline(timeout)
    standbys = [e for e in endpoints if e != leader]
    last: list[int] = []
    stable_since = started
    while not deadline.expired():
        counts = [_objects_of(e) for e in standbys]
        now = time.monotonic()
        if all(c >= objects for c in counts):
            return now - started
        if counts != last:
            last, stable_since = counts, now
        elif now - stable_since >= 2.0 and all(c >= 0 for c in counts):
            return stable_since - started
        time.sleep(0.2)
    return float("nan")


def measure_recovery(
    cluster: Any,
    objects: int,
    value_bytes: int = 512,
    sample: int = 1000,
    timeout: float = 120.0,
    warm_timeout: float = 300.0,
    warm: bool = True,
    full_fraction: float = FULL_INDEX_FRACTION,
) -> RecoveryResult:
    """Write ``objects``, SIGKILL the leader, then probe random samples until all of a sample reads back.

    ``seconds_to_first_read`` is when the first read with the right bytes returned; ``recovered_fraction``
    is the fraction readable in the first probe begun at or after that moment (what the new leader
    serves once it serves: a probe begun earlier also counts the misses of its calls made before that);
    ``seconds_to_full_index`` is when a probe first began that read back right to ``full_fraction`` (nan:
    never; see FULL_INDEX_FRACTION). The new leader serves from the first of: a master's GetStats says
    "leader", or a read returned right bytes."""
    endpoints = [m.address for m in cluster.masters]
    old = wait_for_leader(endpoints, timeout)
    prober = Prober(cluster.master, cluster.cluster, value_bytes)
    try:
        write_started = time.monotonic()
        prober.write(objects)
        puts_per_s = len(prober.keys) / (time.monotonic() - write_started)
        # On a loaded machine the leader can lose its lease while the objects are written: the master to
        # kill is the one leading now, and its standbys are the ones that must be warm.
        writing_leader, old = old, wait_for_leader(endpoints, timeout)
        written = _objects_of(old)
        standbys_warm = wait_for_warm_standbys(endpoints, old, written, warm_timeout) if warm else float("nan")
        time.sleep(1.0)  # every object is acknowledged more than 1 s before the kill
        if wait_for_leader(endpoints, timeout) != old:
            raise RuntimeError("the leader changed while the standbys caught up: the machine is too loaded")
        leader_at: list[float] = []
        watcher = threading.Thread(
            target=lambda: leader_at.append(time.monotonic() if wait_for_leader(endpoints, timeout, old) else 0.0),
            daemon=True,
        )
        t0 = time.monotonic()
        cluster.kill(next(m for m in cluster.masters if m.address == old))
        watcher.start()
        over_time: list[list[float]] = []
        first_read = recovered = full = float("nan")
        deadline = Deadline(timeout)
        while not deadline.expired():
            probe_start = time.monotonic() - t0
            fraction, first_good = prober.probe(sample)
            over_time.append([round(probe_start, 3), round(fraction, 4)])
            if first_read == first_read and recovered != recovered:
                recovered = fraction  # the first probe begun after the first good read
            elif first_good is not None and first_read != first_read:
                first_read = first_good - t0
            if fraction >= full_fraction and full != full:
                full = max(probe_start, first_read) if first_read == first_read else probe_start
            if full == full and recovered == recovered:
                break
            time.sleep(0.1)
        watcher.join(timeout)
        t_leader = (leader_at[0] - t0) if leader_at and leader_at[0] else float("nan")
        # A good read proves a serving leader; the GetStats poller can notice it later on a loaded machine.
        t_leader = min(t_leader, first_read) if t_leader == t_leader else first_read
        new = serving_leader(endpoints, old)
        return RecoveryResult(
            objects=len(prober.keys),
            puts_per_s=puts_per_s,
            seconds_standbys_warm=standbys_warm,
            seconds_to_new_leader=t_leader,
            seconds_to_first_read=first_read,
            recovered_fraction=recovered,
            seconds_to_full_index=full,
            recovered_over_time=over_time,
            wrong_reads=prober.wrong,
            old_leader=old,
            new_leader=new,
            leader_changed_while_writing=writing_leader != old,
        )
    finally:
        prober.close()


@dataclass
class PutRound:
    """One round of puts into one cluster: keys/s and the latency of each call."""

    warm_standbys: int
    keys_per_s: float
    batch_p50_ms: float
    batch_p99_ms: float
    single_p50_ms: float
    single_p99_ms: float


class PutArm:
    """One cluster of an A/B put comparison (3 masters, 2 stores), and a client writing into it."""

    def __init__(self, cluster: Any, warm: bool, value_bytes: int) -> None:
        from kvpool.client import ClientConfig, PoolClient

        self.cluster = cluster
        self.warm = warm
        self.value_bytes = value_bytes
        self.client = PoolClient(
            config=ClientConfig(master=cluster.master, use_shm=False, timeout_s=10.0, cluster=cluster.cluster)
        )
        self.written = 0

    def round(self, objects: int, singles: int, batch: int = 32) -> PutRound:
        """``objects`` new keys in batches of ``batch``, then ``singles`` single-key puts."""
        keys = [f"ab-{i}" for i in range(self.written, self.written + objects + singles)]
        self.written += len(keys)
        values = {k: _value_of(k, self.value_bytes) for k in keys}  # made before the clock starts
        batch_ms: list[float] = []
        started = time.perf_counter()
        for start in range(0, objects, batch):
            chunk = keys[start : min(objects, start + batch)]
            t = time.perf_counter()
            codes = self.client.batch_put_from(chunk, [values[k] for k in chunk])
            batch_ms.append((time.perf_counter() - t) * 1000)
            if any(codes):
                raise RuntimeError(f"puts failed: {sorted(set(codes))}")
        single_ms: list[float] = []
        for key in keys[objects:]:
            t = time.perf_counter()
            if self.client.put(key, values[key]) != 0:
                raise RuntimeError(f"put of {key} failed")
            single_ms.append((time.perf_counter() - t) * 1000)
        elapsed = time.perf_counter() - started
        return PutRound(
            warm_standbys=len(self.cluster.masters) - 1 if self.warm else 0,
            keys_per_s=len(keys) / elapsed,
            batch_p50_ms=_percentile(batch_ms, 0.5),
            batch_p99_ms=_percentile(batch_ms, 0.99),
            single_p50_ms=_percentile(single_ms, 0.5),
            single_p99_ms=_percentile(single_ms, 0.99),
        )

    def settle(self, timeout: float = 120.0) -> None:
        """Wait until the standbys hold what the leader holds, so a round never pays for the last one's feed."""
        if self.warm:
            endpoints = [m.address for m in self.cluster.masters]
            leader = wait_for_leader(endpoints, timeout)
            wait_for_warm_standbys(endpoints, leader, _objects_of(leader), timeout)

    def close(self) -> None:
        self.client.close()


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_compare_puts(args: argparse.Namespace) -> int:
    """Puts with 0 and with 2 warm standbys: two clusters up at once, rounds alternating between them
    (the cold one first in every other pair), medians over the rounds of each."""
    from contextlib import ExitStack

    from kvpool.tools.local_cluster import LocalCluster

    per_round = args.compare_puts
    singles = max(1, per_round // 50)
    size = _scale_size((per_round + singles) * args.runs, args.value_bytes, 2)
    rounds: list[PutRound] = []
    with ExitStack() as stack:
        arms = []
        for warm in (True, False):
            store_args = () if warm else ("--standby-feed-interval-s", "0")
            cluster = stack.enter_context(LocalCluster(stores=2, store_size=size, ha=True, store_args=store_args))
            wait_for_leader([m.address for m in cluster.masters], 60.0)
            arm = PutArm(cluster, warm, args.value_bytes)
            stack.callback(arm.close)
            arm.round(min(per_round, 2048), 10)  # warm-up: connections, leases of the first segments
            arm.settle()
            arms.append(arm)
        for i in range(args.runs):
            for arm in arms if i % 2 == 0 else arms[::-1]:
                rounds.append(arm.round(per_round, singles))
                arm.settle()
                print(f"round {i + 1}: {json.dumps(asdict(rounds[-1]))}", file=sys.stderr)
    doc: dict[str, Any] = {"objects_per_round": per_round, "single_puts_per_round": singles, "runs": args.runs}
    for warm in (True, False):
        mine = [r for r in rounds if (r.warm_standbys > 0) == warm]
        doc["warm" if warm else "cold"] = {
            name: _median([getattr(r, name) for r in mine])
            for name in ("keys_per_s", "batch_p50_ms", "batch_p99_ms", "single_p50_ms", "single_p99_ms")
        }
    doc["keys_per_s_warm_over_cold"] = doc["warm"]["keys_per_s"] / doc["cold"]["keys_per_s"]
    doc["rounds"] = [asdict(r) for r in rounds]
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"{per_round} puts of {args.value_bytes} B per round, {args.runs} rounds each, medians:")
        for arm_name in ("warm", "cold"):
            print(f"  {arm_name:5s} " + "  ".join(f"{k} {v:.2f}" for k, v in doc[arm_name].items()))
        print(f"  keys/s warm / cold: {doc['keys_per_s_warm_over_cold']:.3f}")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--runs", type=positive_int, default=3, help="failovers to measure (default 3); medians printed"
    )
    parser.add_argument("--leader-ttl-s", type=positive_float, default=3.0, help="leader lease TTL (default: 3 s)")
    parser.add_argument("--objects", type=positive_int, default=400, help="objects written before each failover (400)")
    parser.add_argument(
        "--value-bytes",
        type=positive_int,
        default=512,
        help="bytes per object when --objects is above 400 (the scale measurement; default 512)",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="turn the stores' feed to the standby masters off: the new leader starts cold (the baseline)",
    )
    parser.add_argument(
        "--compare-puts",
        type=positive_int,
        default=0,
        metavar="N",
        help="instead of a failover: N puts per round into a cluster with 2 warm standbys and one without "
        "(the stores' feed off), --runs rounds each, alternating; medians of keys/s and latency",
    )
    parser.add_argument("--json", action="store_true")


def _median(values: list[float]) -> float:
    import statistics

    known = [v for v in values if v == v]
    return statistics.median(known) if known else float("nan")


def _median_curve(curves: list[list[list[float]]], step: float = 0.5) -> list[list[float]]:
    """The median over runs of the recovered fraction, on a common grid of ``step`` seconds after the kill
    (each run's curve is held at its last probe before each grid point; 1.0 once a run is complete)."""
    if not curves:
        return []
    end = max(c[-1][0] for c in curves if c)
    grid: list[list[float]] = []
    t = 0.0
    while t <= end + step:
        at = []
        for curve in curves:
            before = [f for s, f in curve if s <= t]
            at.append(before[-1] if before else 0.0)
        grid.append([round(t, 2), round(_median(at), 4)])
        t += step
    return grid


def _scale_size(objects: int, value_bytes: int, stores: int) -> str:
    """Segment size per store: the objects with room to spare (allocations are 64-byte aligned)."""
    per_object = (value_bytes + 63) // 64 * 64
    need = objects * per_object * 2 // stores
    return f"{max(64, need >> 20)}MiB"


def run_scale(args: argparse.Namespace) -> int:
    from kvpool.tools.local_cluster import LocalCluster

    store_args = ("--standby-feed-interval-s", "0") if args.cold else ()
    results = []
    for i in range(args.runs):
        with LocalCluster(
            stores=2,
            store_size=_scale_size(args.objects, args.value_bytes, 2),
            ha=True,
            master_args=("--leader-ttl-s", str(args.leader_ttl_s)),
            store_args=store_args,
        ) as cluster:
            results.append(measure_recovery(cluster, args.objects, args.value_bytes, warm=not args.cold))
            print(f"run {i + 1}: {json.dumps(asdict(results[-1]))}", file=sys.stderr)
    doc = {
        "objects": args.objects,
        "value_bytes": args.value_bytes,
        "leader_ttl_s": args.leader_ttl_s,
        "warm_standbys": not args.cold,
        "puts_per_s": _median([r.puts_per_s for r in results]),
        "seconds_standbys_warm": _median([r.seconds_standbys_warm for r in results]),
        "seconds_to_new_leader": _median([r.seconds_to_new_leader for r in results]),
        "seconds_to_first_read": _median([r.seconds_to_first_read for r in results]),
        "first_read_after_new_leader_s": _median([r.seconds_to_first_read - r.seconds_to_new_leader for r in results]),
        "recovered_fraction": _median([r.recovered_fraction for r in results]),
        "seconds_to_full_index": _median([r.seconds_to_full_index for r in results]),
        "full_index_fraction": FULL_INDEX_FRACTION,
        "recovered_over_time": _median_curve([r.recovered_over_time for r in results]),
        "wrong_reads": sum(r.wrong_reads for r in results),
        "runs": [asdict(r) for r in results],
    }
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"{args.objects} objects of {args.value_bytes} B, leader TTL {args.leader_ttl_s:.1f} s, medians:")
        for name in (
            "puts_per_s",
            "seconds_standbys_warm",
            "seconds_to_new_leader",
            "seconds_to_first_read",
            "first_read_after_new_leader_s",
            "recovered_fraction",
            "seconds_to_full_index",
            "wrong_reads",
        ):
            print(f"  {name:32s} {doc[name]}")
    return 0 if doc["wrong_reads"] == 0 else 1


def run(args: argparse.Namespace) -> int:
    import statistics

    from kvpool.tools.local_cluster import LocalCluster

    if args.compare_puts:
        return run_compare_puts(args)
    if args.objects > 400 or args.cold:
        return run_scale(args)
    results = []
    for i in range(args.runs):
        with LocalCluster(
            stores=2, store_size="64MiB", ha=True, master_args=("--leader-ttl-s", str(args.leader_ttl_s))
        ) as cluster:
            results.append(run_failover(cluster, objects=args.objects))
            print(f"run {i + 1}: {asdict(results[-1])}", file=sys.stderr)
    doc = {
        "leader_ttl_s": args.leader_ttl_s,
        "seconds_to_new_leader": statistics.median(r.seconds_to_new_leader for r in results),
        "seconds_to_first_read": statistics.median(r.seconds_to_first_read for r in results),
        "recovered_fraction": statistics.median(r.recovered_fraction for r in results),
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
        print(f"  wrong reads                  {doc['wrong_reads']}")
    return 0 if doc["wrong_reads"] == 0 else 1
