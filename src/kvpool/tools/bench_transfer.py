"""``kvpool bench transfer``: put and get GB/s of the pool over TCP, shared memory or RDMA (``--transport``),
against this machine's ceiling.

It starts its own local cluster (a master and one store process), measures the raw loopback TCP
ceiling between two Python processes with preallocated buffers in the same run, then times the
zero-copy forms (``batch_put_from`` / ``batch_get_into``) for 64 KiB, 1 MiB and 4 MiB values, one key
per call and batched. Each figure is the median of ``--runs`` runs; these machines are noisy. Every value
read back is compared byte for byte with what was written (outside the timed calls), and the JSON says how
many payload bytes each transport moved (``bytes_by_transport``, from the client's counters); with
``--transport rdma`` it adds ``post_us_per_wr`` (docs/rdma.md). ``KVPOOL_VERBS=fake`` runs RDMA through the
FAKE NIC where there is no device.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass

from kvpool.common.errors import batch_failure
from kvpool.tools.argtypes import positive_float, positive_int, size, sizes_bytes
from kvpool.transfer.rdma_client import RdmaTransport
from kvpool.transfer.rdma_rails import RailsTransport

SIZES = (64 << 10, 1 << 20, 4 << 20)
TRANSPORTS = ("tcp", "shm", "rdma")
BATCH_BYTES = 32 << 20  # a batched call moves about this much


@dataclass
class Row:
    op: str
    size: int
    batch: int
    gbps: float
    p50_us: float
    p99_us: float
    ratio_to_ceiling: float = 0.0
    transport: str = "tcp"
    post_us_per_wr: float | None = None
    """rdma: posting CPU per work request posted while this row was measured (its puts, gets and read-backs)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", default="", help="measure this cluster (`local`: the `kvpool local up` one)")
    parser.add_argument(
        "--sizes", type=sizes_bytes, default="64KiB,1MiB,4MiB", help="value sizes (default 64KiB,1MiB,4MiB)"
    )
    parser.add_argument("--seconds", type=positive_float, default=1.0, help="seconds per measurement (default 1)")
    parser.add_argument(
        "--runs", type=positive_int, default=3, help="runs per figure; the median is reported (default 3)"
    )
    parser.add_argument("--store-size", type=size, default="768MiB", help="segment size of the benchmark's store")
    parser.add_argument("--connections", type=positive_int, default=4, help="TCP connections per store")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="tcp",
        help="data path to measure: tcp, shm (same node) or rdma (KVPOOL_VERBS=fake without a device)",
    )


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _measure(client: object, op: str, size: int, batch: int, seconds: float) -> Row:
    """Repeat one call shape for ``seconds``; GB/s over the calls, latency per call."""
    from kvpool.client import PoolClient

    assert isinstance(client, PoolClient)
    from kvpool.tools.ceiling import prefaulted

    # One page-aligned mapping, as the ceiling's buffer is (ceiling.prefaulted says why it matters).
    region = prefaulted(size * batch)
    buffers = [region[i * size : (i + 1) * size] for i in range(batch)]
    region[:] = os.urandom(len(region))
    check_region = prefaulted(size * batch)
    checks = [check_region[i * size : (i + 1) * size] for i in range(batch)]
    latencies: list[float] = []
    moved = 0
    busy = 0.0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline or not latencies:
        keys = [f"bench-{uuid.uuid4().hex}" for _ in range(batch)]
        started = time.perf_counter()
        codes = client.batch_put_from(keys, buffers)
        put_time = time.perf_counter() - started
        if any(c != 0 for c in codes):
            raise batch_failure("put failed", codes)
        if op == "get":
            started = time.perf_counter()
            codes = client.batch_get_into(keys, buffers)
            elapsed = time.perf_counter() - started
            if any(c != size for c in codes):
                raise batch_failure("get failed", [c for c in codes if c != size])
        else:
            elapsed = put_time
        latencies.append(elapsed)
        busy += elapsed
        moved += size * batch
        _verify(client, keys, buffers, checks)
        client.batch_remove(keys, force=True)
    return Row(
        op,
        size,
        batch,
        moved / busy / 1e9,
        _percentile(latencies, 0.5) * 1e6,
        _percentile(latencies, 0.99) * 1e6,
    )


def _verify(client: object, keys: list[str], sources: list[memoryview], checks: list[memoryview]) -> None:
    """Read every value back (untimed) and compare it byte for byte with what was written."""
    from kvpool.client import PoolClient

    assert isinstance(client, PoolClient)
    codes = client.batch_get_into(keys, checks)
    bad = [k for k, c, src, got in zip(keys, codes, sources, checks, strict=True) if c != len(src) or got != src]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(keys)} values read back wrong, e.g. {bad[0]}")


def _posting(transport: object) -> tuple[float, int, float] | None:
    """(posting CPU seconds, work requests posted, fake NIC seconds) of an RDMA transport so far; None otherwise."""
    if isinstance(transport, RailsTransport):
        rails = list(transport.rails)
    elif isinstance(transport, RdmaTransport):
        rails = [transport]
    else:
        return None
    totals = [rail.posting_totals() for rail in rails]
    fabrics = {id(f): f for f in (rail.nic_fabric() for rail in rails) if f is not None}
    nic = sum(float(getattr(f, "nic_seconds", 0.0)) for f in fabrics.values())
    return sum(s for s, _ in totals), sum(n for _, n in totals), nic


def _post_us_between(before: tuple[float, int, float] | None, after: tuple[float, int, float] | None) -> float | None:
    if before is None or after is None or after[1] == before[1]:
        return None
    cpu = (after[0] - before[0]) - (after[2] - before[2])
    return max(0.0, cpu) / (after[1] - before[1]) * 1e6


def _median_row(rows: list[Row]) -> Row:
    best = sorted(rows, key=lambda r: r.gbps)[len(rows) // 2]
    return Row(
        best.op,
        best.size,
        best.batch,
        statistics.median(r.gbps for r in rows),
        statistics.median(r.p50_us for r in rows),
        statistics.median(r.p99_us for r in rows),
    )


def measure(
    master: str, sizes: list[int], seconds: float, runs: int, connections: int, transport: str = "tcp"
) -> dict[str, object]:
    from kvpool.client import ClientConfig, PoolClient
    from kvpool.tools.ceiling import measure_memcpy, measure_tcp_ceiling

    ceilings = {size: statistics.median(measure_tcp_ceiling(size, seconds) for _ in range(runs)) for size in sizes}
    memcpy = statistics.median(measure_memcpy(max(sizes)) for _ in range(runs))
    rows: list[Row] = []
    config = ClientConfig(
        master=master,
        use_shm=transport == "shm",
        use_rdma=transport == "rdma",
        connections_per_store=connections,
    )
    with PoolClient(config=config) as client:
        _measure(client, "get", 1 << 20, 8, 0.2)  # warm connections and the segment
        rdma_transport = client._transports.transport("rdma")  # noqa: SLF001 - the benchmark reads its posting cost
        for size in sizes:
            for batch in sorted({1, max(1, BATCH_BYTES // size)}):
                for op in ("put", "get"):
                    posting = _posting(rdma_transport)
                    row = _median_row([_measure(client, op, size, batch, seconds) for _ in range(runs)])
                    row.post_us_per_wr = _post_us_between(posting, _posting(rdma_transport))
                    row.ratio_to_ceiling = row.gbps / ceilings[size] if ceilings[size] else 0.0
                    row.transport = transport
                    rows.append(row)
                    print(
                        f"  {op} {size >> 10:>5} KiB x{batch:<4} {row.gbps:6.2f} GB/s  "
                        f"{row.ratio_to_ceiling:4.2f} x ceiling  p50 {row.p50_us:8.0f} us",
                        file=sys.stderr,
                    )
        counters = client.metrics()
        rdma = client._transports.transport("rdma")  # noqa: SLF001 - the benchmark reads the transport's figure
        post_us = rdma.post_us_per_wr() if isinstance(rdma, RdmaTransport | RailsTransport) else None
    by_transport = {name: counters.get(f"bytes_{name}", 0) for name in TRANSPORTS}
    total = sum(by_transport.values())
    if total and by_transport[transport] < 0.95 * total:
        share = by_transport[transport] / total
        print(f"  WARNING: only {share:.0%} of the bytes went over {transport}", file=sys.stderr)
    return {
        "transport": transport,
        "bytes_by_transport": by_transport,
        **({"post_us_per_wr": post_us} if transport == "rdma" else {}),
        "ceiling_tcp_gbps": max(ceilings.values()),
        "ceilings": {str(size): gbps for size, gbps in ceilings.items()},
        "memcpy_gbps": memcpy,
        "results": [asdict(r) for r in rows],
    }


def run(args: argparse.Namespace) -> int:
    from kvpool.common import local_context
    from kvpool.tools.local_cluster import LocalCluster

    sizes: list[int] = args.sizes
    cluster = None
    master = local_context.resolve(args.master)
    if not master:
        cluster = LocalCluster(stores=1, store_size=args.store_size).start()
        master = cluster.master
    try:
        doc = measure(master, sizes, args.seconds, args.runs, args.connections, args.transport)
    finally:
        if cluster is not None:
            cluster.stop()
    if args.json:
        print(json.dumps(doc))
    else:
        print(f"TCP ceiling {doc['ceiling_tcp_gbps']:.2f} GB/s, memcpy {doc['memcpy_gbps']:.2f} GB/s")
        print(f"transport {doc['transport']}, bytes by transport {doc['bytes_by_transport']}")
        if "post_us_per_wr" in doc:
            print(f"post_us_per_wr {doc['post_us_per_wr']}")
        print(f"{'op':<4} {'size':>9} {'batch':>5} {'GB/s':>7} {'x ceil':>7} {'p50 us':>9} {'p99 us':>9}")
        for r in doc["results"]:  # type: ignore[attr-defined]
            print(
                f"{r['op']:<4} {r['size']:>9} {r['batch']:>5} {r['gbps']:7.2f} {r['ratio_to_ceiling']:7.2f} "
                f"{r['p50_us']:9.0f} {r['p99_us']:9.0f}"
            )
    return 0
