#!/usr/bin/env python3
"""A/B of speculative reads by key (decision 0031) in one process: one cluster (one store, shared memory
off), one reading client with speculation on and off in turn (the order alternating every round), a
second client writing fresh keys off the clock before each round and removing them after.

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/peers/ab_read_by_key.py [--rounds 4]

Prints, per workload (value size x keys per call), the p50 of one call with speculation on and off (the
median over the rounds of each round's p50), off/on, and the rounds' samples.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from kvpool.client import PoolClient
from kvpool.client.config import ClientConfig
from kvpool.tools.local_cluster import LocalCluster

KiB, MiB = 1 << 10, 1 << 20
# (value size, keys per call, calls per round)
WORKLOADS = ((64 * KiB, 1, 300), (64 * KiB, 128, 8), (1 * MiB, 1, 100))


class Bench:
    def __init__(self, master: str) -> None:
        self.writer = PoolClient(config=ClientConfig(master=master, use_shm=False))
        # every workload speculates when on, whatever the defaults (1 MiB objects, batches)
        reader = ClientConfig(master=master, use_shm=False, speculative_read_bytes=MiB, speculative_batches=True)
        self.reader = PoolClient(config=reader)
        self.on_bytes = self.reader._speculation.max_bytes
        self.seq = 0
        self.written: list[list[str]] = []
        assert self.writer.put("ab-seed", b"x") == 0
        assert self.reader.get("ab-seed") == b"x"  # the reader learns where objects live

    def round(self, speculate: bool, size: int, batch: int, calls: int) -> float:
        """One round of ``calls`` first reads of ``batch`` fresh keys each: the p50 of a call, seconds."""
        self.reader._speculation.max_bytes = self.on_bytes if speculate else 0
        value = os.urandom(size)
        buffers = [bytearray(size) for _ in range(batch)]
        names = []
        for _ in range(calls):
            self.seq += 1
            names.append([f"ab/{self.seq}/{j}" for j in range(batch)])
        for keys in names:
            assert self.writer.batch_put(keys, [value] * batch) == [0] * batch
        latencies = []
        for keys in names:
            started = time.perf_counter()
            if batch == 1:
                codes = [self.reader.get_into(keys[0], buffers[0])]
            else:
                codes = self.reader.batch_get_into(keys, buffers)
            latencies.append(time.perf_counter() - started)
            assert codes == [size] * batch, codes[:4]
        self.written += names
        return statistics.median(latencies)

    def remove_all(self) -> None:
        """Removed only between workloads: a range freed and written again before the store's next heartbeat
        loses its inventory entry when that heartbeat's free arrives (decision 0031), and the reads by key
        of a workload that removed and rewrote between rounds would measure that race, not the reads."""
        for keys in self.written:
            self.writer.batch_remove(keys, force=True)  # the reader's leases must not keep them
        self.written = []

    def close(self) -> None:
        self.reader._speculation.max_bytes = self.on_bytes
        self.writer.close()
        self.reader.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4, help="an even number gives each side the first turn as often")
    args = parser.parse_args()
    cluster = LocalCluster(stores=1, store_size="2GiB", base_dir=tempfile.mkdtemp(prefix="kvpool-ab-rbk-")).start()
    try:
        bench = Bench(cluster.master)
        try:
            print(f"load average {os.getloadavg()[0]:.1f}; p50 of a call, us (median of {args.rounds} rounds)")
            for size, batch, calls in WORKLOADS:
                samples: dict[bool, list[float]] = {True: [], False: []}
                for r in range(args.rounds):
                    for speculate in (True, False) if r % 2 == 0 else (False, True):
                        samples[speculate].append(bench.round(speculate, size, batch, calls))
                bench.remove_all()
                on, off = statistics.median(samples[True]), statistics.median(samples[False])
                print(
                    f"{size // KiB:5d} KiB x{batch:<4d} on {on * 1e6:8.0f}  off {off * 1e6:8.0f}"
                    f"  off/on {off / on:.2f}x"
                    f"  on {[round(x * 1e6) for x in samples[True]]} off {[round(x * 1e6) for x in samples[False]]}",
                    flush=True,
                )
            metrics = bench.reader.metrics()
            kept, discarded = metrics["speculative_reads"], metrics["speculative_reads_discarded"]
            print(f"speculative reads {kept}, discarded {discarded}")
        finally:
            bench.close()
    finally:
        cluster.stop()
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
