#!/usr/bin/env python3
"""CPU per page of a HiCache batch (128 pages of 64 KiB) in each of kvpool's processes: client, store and
master, for the batched put, the re-read and the first read.

    PYTHONPATH=<src> .venv/bin/python benchmarks/peers/cpu_per_page.py [--calls 40] [--runs 3] [--json]

A LocalCluster (one master, one store, from the kvpool this script imports) and a TCP-only client in this
process. Per workload and run, ``--calls`` batched calls are timed and the CPU time (user + system, from
/proc) of each process is read around them; the figures are medians over the runs. CPU per call moves
less with the machine's background load than the wall time does, so two sources are compared by running
this once with each (alternating, several times) and comparing the CPU columns.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PAGE = 64 << 10
PAGES = 128
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def measure(client: Any, pids: dict[str, int], calls: int, run: int) -> dict[str, dict[str, float]]:
    """One run of the three workloads: per workload, wall p50 (ms), GB/s and CPU ms per call per process."""
    src, dst = mmap.mmap(-1, PAGE * PAGES), mmap.mmap(-1, PAGE * PAGES)
    src[:] = os.urandom(PAGE) * PAGES
    src_view, dst_view = memoryview(src), memoryview(dst)
    client.register_buffer(src_view)
    client.register_buffer(dst_view)
    sources = [src_view[i * PAGE : (i + 1) * PAGE] for i in range(PAGES)]
    dests = [dst_view[i * PAGE : (i + 1) * PAGE] for i in range(PAGES)]

    def batch(tag: str, n: int) -> list[str]:
        return [f"cpu/{run}/{tag}/{n}/{j}" for j in range(PAGES)]

    reread = batch("reread", 0)
    if client.batch_put_from(reread, sources) != [0] * PAGES or client.batch_get_into(reread, dests) != [PAGE] * PAGES:
        raise RuntimeError("the re-read batch could not be written and read")
    if dst_view[:] != src_view[:]:
        raise RuntimeError("the re-read batch came back with other bytes")
    out: dict[str, dict[str, float]] = {}
    workloads: dict[str, tuple[Callable[[list[str]], list[int]], list[int], bool]] = {
        "put": (lambda keys: client.batch_put_from(keys, sources), [0] * PAGES, False),
        "get (re-read)": (lambda keys: client.batch_get_into(reread, dests), [PAGE] * PAGES, False),
        "first get": (lambda keys: client.batch_get_into(keys, dests), [PAGE] * PAGES, True),
    }
    for name, (call, expected, written_first) in workloads.items():
        key_sets = [batch(name.split()[0], n) for n in range(calls)]
        if written_first:
            for keys in key_sets:
                if client.batch_put_from(keys, sources) != [0] * PAGES:
                    raise RuntimeError("writing the first-read batches failed")
        before = {role: cpu_seconds(pid) for role, pid in pids.items()}
        latencies = []
        for keys in key_sets:
            started = time.perf_counter()
            codes = call(keys)
            latencies.append(time.perf_counter() - started)
            if codes != expected:
                raise RuntimeError(f"{name}: {codes[:4]}...")
        after = {role: cpu_seconds(pid) for role, pid in pids.items()}
        for keys in key_sets:
            client.batch_remove(keys, force=True)
        row = {f"cpu_ms_{role}": (after[role] - before[role]) / calls * 1e3 for role in pids}
        row["cpu_ms_total"] = sum(row.values())
        row["p50_ms"] = statistics.median(latencies) * 1e3
        row["gbps"] = PAGE * PAGES * calls / sum(latencies) / 1e9
        out[name] = row
    client.batch_remove(reread, force=True)
    client.unregister_buffer(src_view)
    client.unregister_buffer(dst_view)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--calls", type=int, default=40, help="timed batched calls per workload per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.runs < 1:
        parser.error("--calls and --runs must be >= 1")
    from kvpool.client.config import ClientConfig
    from kvpool.client.pool_client import PoolClient
    from kvpool.tools.local_cluster import LocalCluster

    base_dir = Path(tempfile.mkdtemp(prefix="kvpool-cpu-page-"))
    rows: list[dict[str, dict[str, float]]] = []
    with LocalCluster(stores=1, store_size="1GiB", base_dir=base_dir) as cluster:
        pids = {"client": os.getpid(), "store": cluster.stores[0].pid, "master": cluster.masters[0].pid}
        client = PoolClient(config=ClientConfig(master=cluster.master, use_shm=False))
        try:
            measure(client, pids, max(2, args.calls // 8), -1)  # untimed: connections and pages warmed
            rows = [measure(client, pids, args.calls, run) for run in range(args.runs)]
        finally:
            client.close()
    medians = {
        name: {field: statistics.median(row[name][field] for row in rows) for field in rows[0][name]}
        for name in rows[0]
    }
    result = {"load_average": os.getloadavg()[0], "runs": args.runs, "calls": args.calls, "workloads": medians}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"load average {result['load_average']:.2f}; medians of {args.runs} runs of {args.calls} calls")
    print(f"{'workload':<15} {'p50 ms':>7} {'GB/s':>6}  CPU ms per call: client / store / master / total (us per page)")
    for name, row in medians.items():
        print(
            f"{name:<15} {row['p50_ms']:7.2f} {row['gbps']:6.2f}  {row['cpu_ms_client']:5.2f} / "
            f"{row['cpu_ms_store']:5.2f} / {row['cpu_ms_master']:5.2f} / {row['cpu_ms_total']:5.2f} "
            f"({row['cpu_ms_total'] * 1e3 / PAGES:.0f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
