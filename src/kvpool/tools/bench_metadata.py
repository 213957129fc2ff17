"""Metadata benchmarks: the master's hot path and its memory per object.

``kvpool bench metadata``: single-key exists round trips per second over the lean framed protocol and
over gRPC (the two transports the master serves), batch-exists keys per second (1,000 keys a call),
prefix-length and get-replicas for a whole prompt in one round trip.

``kvpool bench master-memory --objects N``: indexes N objects with typical HiCache keys (64 hex chars
plus a rank suffix) in a real master process and prints its RSS per object, and the speed of lookups
at that size next to the speed at 10 k objects.

Neither needs a store: a segment is mounted through the control plane and only metadata moves.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from kvpool.common.clock import Deadline
from kvpool.common.errors import KvPoolError, as_code
from kvpool.common.grants import new_secret
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb
from kvpool.proto import master_pb2_grpc as pb_grpc
from kvpool.tools.argtypes import int_at_least, positive_float, positive_int

OBJECT_BYTES = 4096
BASELINE_OBJECTS = 10_000
"""master-memory measures lookups at this many objects first, then at --objects."""


def hicache_key(i: int) -> str:
    return hashlib.sha256(i.to_bytes(8, "little")).hexdigest() + "_0_k"


def mount_fake_segment(grpc_endpoint: str, size: int) -> None:
    """Mount a segment whose data plane nobody will use: enough for metadata-only benchmarks."""
    segment = pb.SegmentInfo(
        id=int.from_bytes(os.urandom(7), "little"),
        node="bench",
        store_id=uuid.uuid4().hex,
        size=size,
        tcp_endpoint="127.0.0.1:9",
        shm_path="",
        status=pb.SEGMENT_OK,
        numa_node=-1,
    )
    with grpc.insecure_channel(grpc_endpoint, options=[("grpc.max_send_message_length", 1 << 30)]) as channel:
        stub = pb_grpc.MasterServiceStub(channel)  # type: ignore[no-untyped-call]
        response = stub.MountSegment(pb.MountSegmentRequest(segment=segment, secret=new_secret()), timeout=30)
    if response.status.code != 0:
        raise KvPoolError(as_code(response.status.code), f"mount failed: {response.status.message}")


def fill(master: Any, keys: list[str], batch: int = 1000, progress: bool = False) -> None:
    """put_start + put_end for every key (metadata only)."""
    config = pb.PutConfig(replica_num=1)
    for start in range(0, len(keys), batch):
        chunk = keys[start : start + batch]
        master.call(
            frames.Op.BATCH_PUT_START,
            pb.BatchPutStartRequest(client_id="bench", keys=chunk, sizes=[OBJECT_BYTES] * len(chunk), config=config),
            Deadline(60),
        )
        master.call(
            frames.Op.BATCH_PUT_END,
            pb.BatchPutEndRequest(client_id="bench", keys=chunk, checksums=[0] * len(chunk)),
            Deadline(60),
        )
        if progress and (start // batch) % 50 == 0:
            print(f"  indexed {start + len(chunk):,}/{len(keys):,}", file=sys.stderr)


def _rate(seconds: float, fn: Callable[[], int]) -> tuple[float, float, float]:
    """(units per second, p50 us, p99 us per call) of ``fn`` (which returns units done) over ``seconds``."""
    latencies: list[float] = []
    units = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        units += fn()
        latencies.append(time.perf_counter() - started)
    latencies.sort()
    return (
        units / sum(latencies),
        latencies[len(latencies) // 2] * 1e6,
        latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] * 1e6,
    )


def measure_hot_path(grpc_endpoint: str, keys: list[str], seconds: float) -> list[dict[str, Any]]:
    from kvpool.client.master_client import MasterClient

    master = MasterClient(grpc_endpoint)
    rows: list[dict[str, Any]] = []

    def add(op: str, transport: str, batch: int, fn: Callable[[], int]) -> None:
        per_s, p50, p99 = _rate(seconds, fn)
        rows.append({"op": op, "transport": transport, "batch": batch, "per_s": per_s, "p50_us": p50, "p99_us": p99})
        print(
            f"  {op:<14} {transport:<6} batch {batch:<5} {per_s:>12,.0f}/s  p50 {p50:7.1f} us  p99 {p99:7.1f} us",
            file=sys.stderr,
        )

    one = pb.BatchExistsRequest(keys=[keys[0]])
    thousand = pb.BatchExistsRequest(keys=keys[:1000])
    prompt = pb.BatchExistsRequest(keys=keys[:512], prefix=True)  # a 32k-token prompt in 64-token pages
    get = pb.BatchGetReplicasRequest(keys=keys[:512])
    add("exists", "framed", 1, lambda: (master.call(frames.Op.BATCH_EXISTS, one, Deadline(5)), 1)[1])
    with grpc.insecure_channel(grpc_endpoint) as channel:
        stub = pb_grpc.MasterServiceStub(channel)  # type: ignore[no-untyped-call]
        add("exists", "grpc", 1, lambda: (stub.BatchExists(one, timeout=5), 1)[1])
        add("exists", "grpc", 1000, lambda: (stub.BatchExists(thousand, timeout=5), 1000)[1])
    add(
        "exists",
        "framed",
        1000,
        lambda: (master.call(frames.Op.BATCH_EXISTS, thousand, Deadline(5)), 1000)[1],
    )
    add(
        "prefix_length",
        "framed",
        512,
        lambda: (master.call(frames.Op.BATCH_EXISTS, prompt, Deadline(5)), 512)[1],
    )
    add(
        "get_replicas",
        "framed",
        512,
        lambda: (master.call(frames.Op.BATCH_GET_REPLICAS, get, Deadline(5)), 512)[1],
    )
    master.close()
    return rows


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=positive_float, default=1.0, help="seconds per figure (default 1)")
    parser.add_argument("--runs", type=positive_int, default=3, help="runs per figure; medians are reported")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    from kvpool.tools.bench_groups import parse_groups

    parser.add_argument(
        "--groups",
        type=parse_groups,
        default=None,
        help="shard-group counts to compare, e.g. 1,2,4 (decision 0080): keys/s and master CPU per key each",
    )
    parser.add_argument("--clients", type=positive_int, default=2, help="client processes with --groups (default 2)")
    parser.add_argument(
        "--batch", type=positive_int, default=512, help="keys per batch-exists call with --groups (a 32k prompt)"
    )


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--objects",
        type=int_at_least(2 * BASELINE_OBJECTS),
        default=1_000_000,
        help=f"objects to index (default 1,000,000; at least {2 * BASELINE_OBJECTS:,})",
    )
    parser.add_argument("--seconds", type=positive_float, default=1.0, help="seconds per lookup figure")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _start_master() -> Any:
    from kvpool.tools.local_cluster import LocalCluster

    # Eviction off (watermark 1.0) and no store expiry (the fake store never heartbeats): the benchmark
    # must keep every object it indexed.
    return LocalCluster(
        stores=0,
        master_args=(
            "--eviction-high-watermark",
            "1.0",
            "--eviction-target",
            "1.0",
            "--lease-ttl-s",
            "3600",
            "--store-ttl-s",
            "24h",
        ),
    ).start()


def _median_rows(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for i, row in enumerate(runs[0]):
        merged = dict(row)
        for field in ("per_s", "p50_us", "p99_us"):
            merged[field] = statistics.median(r[i][field] for r in runs)
        out.append(merged)
    return out


def run(args: argparse.Namespace) -> int:
    from kvpool.client.master_client import MasterClient

    if args.groups:
        from kvpool.tools.bench_groups import run_groups

        doc = run_groups(args)
        print(json.dumps(doc) if args.json else json.dumps(doc, indent=2))
        return 0

    cluster = _start_master()
    try:
        endpoint = cluster.master
        mount_fake_segment(endpoint, 64 << 30)
        keys = [hicache_key(i) for i in range(20_000)]
        master = MasterClient(endpoint)
        fill(master, keys)
        master.close()
        rows = _median_rows([measure_hot_path(endpoint, keys, args.seconds) for _ in range(args.runs)])
    finally:
        cluster.stop()
    framed = next(r for r in rows if r["transport"] == "framed" and r["batch"] == 1)["per_s"]
    grpc_rate = next(r for r in rows if r["transport"] == "grpc" and r["batch"] == 1)["per_s"]
    doc = {"rows": rows, "framed_vs_grpc_single": framed / grpc_rate}
    if args.json:
        print(json.dumps(doc))
    else:
        for r in rows:
            print(
                f"{r['op']:<14} {r['transport']:<6} batch {r['batch']:<5} {r['per_s']:>12,.0f}/s  "
                f"p50 {r['p50_us']:7.1f} us  p99 {r['p99_us']:7.1f} us"
            )
        print(f"single-key round trips: framed is {doc['framed_vs_grpc_single']:.1f}x gRPC")
    return 0


def run_memory(args: argparse.Namespace) -> int:
    from kvpool.client.master_client import MasterClient

    cluster = _start_master()
    try:
        endpoint = cluster.master
        pid = cluster.masters[0].pid
        mount_fake_segment(endpoint, max(1 << 30, args.objects * OBJECT_BYTES * 2))
        master = MasterClient(endpoint)
        small = [hicache_key(i) for i in range(BASELINE_OBJECTS)]
        fill(master, small)
        lookup_small = measure_hot_path(endpoint, small, args.seconds)
        rss_before = _rss(pid)
        started = time.perf_counter()
        for start in range(BASELINE_OBJECTS, args.objects, 100_000):
            fill(master, [hicache_key(i) for i in range(start, min(args.objects, start + 100_000))])
            print(f"  indexed {min(args.objects, start + 100_000):,}/{args.objects:,}", file=sys.stderr)
        fill_seconds = time.perf_counter() - started
        rss_after = _rss(pid)
        lookup_big = measure_hot_path(endpoint, small, args.seconds)
        objects = int(master.call(frames.Op.GET_STATS, pb.StatsRequest(), Deadline(30)).objects)
        master.close()
    finally:
        cluster.stop()
    per_object = (rss_after - rss_before) / max(1, objects - len(small))
    speed = {
        f"{r['op']}/{r['transport']}/{r['batch']}": (r["per_s"], b["per_s"])
        for r, b in zip(lookup_small, lookup_big, strict=True)
    }
    doc = {
        "objects": objects,
        "rss_bytes": rss_after,
        "rss_bytes_per_object": per_object,
        "index_seconds": fill_seconds,
        "lookups": {k: {"at_10k_per_s": a, "at_n_per_s": b, "ratio": b / a} for k, (a, b) in speed.items()},
    }
    if args.json:
        print(json.dumps(doc))
    else:
        print(
            f"{objects:,} objects: master RSS {rss_after / 2**20:.0f} MiB, {per_object:.0f} bytes per object "
            f"(target <= 400)"
        )
        for k, v in doc["lookups"].items():  # type: ignore[attr-defined]
            print(
                f"  {k:<28} {v['at_10k_per_s']:>12,.0f}/s at 10k  {v['at_n_per_s']:>12,.0f}/s at N ({v['ratio']:.2f}x)"
            )
    return 0
