"""``kvpool bench metadata --groups 1,2,4 --clients C``: the master's hot path split over shard groups.

For each G: etcd, one master per group (each with a metadata-only segment mounted: no store, no data
moves), N keys indexed through the client's group router, then C client processes calling batch-exists
(``--batch`` keys a call, keys spread over every group) for ``--seconds``. Reported per G (medians of
``--runs``): aggregate keys/s, the master CPU-seconds per million keys (from ``/proc/<pid>/stat`` of every
master of the run, less each master's idle rate measured for 1 s before the load: total, and per group for
the keys that group served) and the CPU per key relative to
G=1. On a machine with fewer cores than masters + clients the keys/s cannot scale; the CPU per key says
whether it would (a group does no work for another). ``routing_us_per_call`` is what the client's split
and merge cost per call, measured without sockets.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from typing import Any

from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.groups import group_of
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb

FILL_KEYS = 20_000
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def parse_groups(text: str) -> list[int]:
    try:
        groups = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--groups takes counts like 1,2,4, not {text!r}") from None
    if not groups or any(g < 1 or g > 64 for g in groups):
        raise argparse.ArgumentTypeError(f"--groups takes counts in 1..64, not {text!r}")
    return groups


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc/<pid>/stat (fields 14 and 15)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _client_worker(
    master: str, cluster: str, keys: list[str], batch: int, seconds: float, ready: Any, go: Any, out: Any
) -> None:
    from kvpool.client.config import ClientConfig
    from kvpool.client.group_router import connect_master

    link = connect_master(ClientConfig(master=master, cluster=cluster))
    requests = [pb.BatchExistsRequest(keys=keys[i : i + batch]) for i in range(0, len(keys) - batch, batch)]
    link.call(frames.Op.BATCH_EXISTS, requests[0], Deadline(30.0))  # connected to every group before the clock
    ready.put(os.getpid())
    go.wait()
    done = 0
    started = time.perf_counter()
    deadline = started + seconds
    i = 0
    while time.perf_counter() < deadline:
        link.call(frames.Op.BATCH_EXISTS, requests[i % len(requests)], Deadline(10.0))
        done += batch
        i += 1
    out.put((done, time.perf_counter() - started))
    link.close()


def _start_cluster(groups: int) -> Any:
    from kvpool.tools.bench_failover import wait_for_leader
    from kvpool.tools.bench_metadata import mount_fake_segment
    from kvpool.tools.local_cluster import LocalCluster

    cluster = LocalCluster(
        stores=0,
        ha=True,
        masters=1,
        groups=groups,
        master_args=("--eviction-high-watermark", "1.0", "--eviction-target", "1.0", "--store-ttl-s", "24h"),
    ).start()
    try:
        for master in cluster.masters:
            if not wait_for_leader([master.address], 60.0):
                raise KvPoolError(ErrorCode.TIMEOUT, f"group {master.group}'s master did not become leader")
            mount_fake_segment(master.address, 8 << 30)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _fill(cluster: Any, keys: list[str]) -> None:
    from kvpool.client.config import ClientConfig
    from kvpool.client.group_router import connect_master
    from kvpool.tools.bench_metadata import fill

    link = connect_master(ClientConfig(master=cluster.master, cluster=cluster.cluster))
    try:
        fill(link, keys)
    finally:
        link.close()


def measure(cluster: Any, groups: int, keys: list[str], clients: int, batch: int, seconds: float) -> dict[str, Any]:
    """One run: C client processes, started together once all are connected, for ``seconds``; keys/s and
    the masters' CPU over exactly that window."""
    context = multiprocessing.get_context("spawn")
    ready, out, go = context.Queue(), context.Queue(), context.Event()
    workers = [
        context.Process(
            target=_client_worker, args=(cluster.master, cluster.cluster, keys, batch, seconds, ready, go, out)
        )
        for _ in range(clients)
    ]
    pids = {m.group: m.pid for m in cluster.masters}
    for worker in workers:
        worker.start()
    for _ in workers:
        ready.get(timeout=120)
    idle_from = {g: _cpu_seconds(pid) for g, pid in pids.items()}
    time.sleep(1.0)  # the masters' own background work (elections, maintenance), subtracted below
    idle_rate = {g: _cpu_seconds(pid) - idle_from[g] for g, pid in pids.items()}
    before = {g: _cpu_seconds(pid) for g, pid in pids.items()}
    window = time.perf_counter()
    go.set()
    results = [out.get(timeout=seconds + 120) for _ in workers]
    window = time.perf_counter() - window
    after = {g: _cpu_seconds(pid) for g, pid in pids.items()}
    for worker in workers:
        worker.join(timeout=30)
    done = sum(n for n, _ in results)
    share = [sum(1 for k in keys if group_of(k, groups) == g) / len(keys) for g in range(groups)]
    cpu = {g: max(0.0, after[g] - before[g] - idle_rate[g] * window) for g in pids}
    return {
        "idle_cpu_fraction": sum(idle_rate.values()),
        "keys_per_s": sum(n / elapsed for n, elapsed in results),
        "master_cpu_s_per_million_keys": sum(cpu.values()) / done * 1e6,
        "per_group_cpu_s_per_million_keys": [cpu[g] / max(1.0, done * share[g]) * 1e6 for g in range(groups)],
    }


def routing_cost_us(groups: int, keys: list[str], batch: int, calls: int = 2000) -> float:
    """The client's split and merge per batch-exists call (no sockets): microseconds per call."""
    from kvpool.client.group_router import merge_response, split_request
    from kvpool.common.errors import ErrorCode
    from kvpool.common.groups import split_by_group

    request = pb.BatchExistsRequest(keys=keys[:batch])
    started = time.perf_counter()
    for _ in range(calls):
        if groups == 1:
            continue  # one group: the MasterClient is called directly, nothing to split
        positions = split_by_group(request.keys, groups)
        parts = []
        for group_positions in positions:
            part = split_request(frames.Op.BATCH_EXISTS, request, group_positions)
            answer = pb.BatchExistsResponse(exists=[True] * len(part.keys))
            parts.append((group_positions, answer, ErrorCode.OK))
        merge_response(frames.Op.BATCH_EXISTS, batch, parts)
    return (time.perf_counter() - started) / calls * 1e6


def run_groups(args: argparse.Namespace) -> dict[str, Any]:
    from kvpool.tools.bench_metadata import hicache_key

    keys = [hicache_key(i) for i in range(FILL_KEYS)]
    rows = []
    for groups in args.groups:
        cluster = _start_cluster(groups)
        try:
            _fill(cluster, keys)
            runs = [measure(cluster, groups, keys, args.clients, args.batch, args.seconds) for _ in range(args.runs)]
        finally:
            cluster.stop()
        row = {
            "groups": groups,
            "clients": args.clients,
            "batch": args.batch,
            "keys_per_s": statistics.median(r["keys_per_s"] for r in runs),
            "master_cpu_s_per_million_keys": statistics.median(r["master_cpu_s_per_million_keys"] for r in runs),
            "per_group_cpu_s_per_million_keys": [
                statistics.median(r["per_group_cpu_s_per_million_keys"][g] for r in runs) for g in range(groups)
            ],
            "routing_us_per_call": statistics.median(routing_cost_us(groups, keys, args.batch) for _ in range(3)),
        }
        rows.append(row)
        print(
            f"  G={groups}: {row['keys_per_s']:,.0f} keys/s, master CPU {row['master_cpu_s_per_million_keys']:.2f} "
            f"s per million keys, routing {row['routing_us_per_call']:.1f} us/call",
            file=sys.stderr,
        )
    base = next((r for r in rows if r["groups"] == 1), rows[0])
    for row in rows:
        row["cpu_per_key_vs_g1"] = row["master_cpu_s_per_million_keys"] / base["master_cpu_s_per_million_keys"]
    return {"cores": os.cpu_count(), "rows": rows}
