#!/usr/bin/env python3
"""The plain ``get()`` (a new ``bytes`` per value) against ``get_into`` (the caller's registered buffer), both
first reads, in one process: issue 27's ``get()`` >= 0.8x ``get_into`` line without the peers around it.

    PYTHONPATH=<src> .venv/bin/python benchmarks/peers/get_bytes_vs_into.py [--rounds 8] [--keys 24]

A LocalCluster of one master and one store, a TCP-only client. Every round writes ``--keys`` fresh values
per size and mode (off the clock), reads each once, removes them; the two modes alternate which goes first.
Prints each mode's median GB/s, its samples and the ratio.
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SIZES = (1 << 20, 4 << 20)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=8, help="an even number gives each mode the first turn as often")
    parser.add_argument("--keys", type=int, default=24, help="first reads per size, mode and round")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.keys < 1:
        parser.error("--rounds and --keys must be >= 1")
    from kvpool.client.config import ClientConfig
    from kvpool.client.pool_client import PoolClient
    from kvpool.tools.local_cluster import LocalCluster

    samples: dict[tuple[int, str], list[float]] = {}
    base_dir = Path(tempfile.mkdtemp(prefix="kvpool-get-bytes-"))
    with LocalCluster(stores=1, store_size="1GiB", base_dir=base_dir) as cluster:
        client = PoolClient(config=ClientConfig(master=cluster.master, use_shm=False))
        source, landing = mmap.mmap(-1, max(SIZES)), mmap.mmap(-1, max(SIZES))
        source[:] = os.urandom(max(SIZES))
        source_view, landing_view = memoryview(source), memoryview(landing)
        client.register_buffer(source_view)
        client.register_buffer(landing_view)
        seq = 0
        try:
            for rnd in range(args.rounds):
                for size in SIZES:
                    for mode in ("get", "get_into") if rnd % 2 == 0 else ("get_into", "get"):
                        seq += 1
                        keys = [f"gb/{seq}/{i}" for i in range(args.keys)]
                        if client.batch_put_from(keys, [source_view[:size]] * len(keys)) != [0] * len(keys):
                            raise RuntimeError("writing the values failed")
                        started = time.perf_counter()
                        for key in keys:
                            if mode == "get":
                                value = client.get(key)
                                got = -1 if value is None else len(value)
                            else:
                                got = client.get_into(key, landing_view[:size])
                            if got != size:
                                raise RuntimeError(f"{mode} of {key}: {got}")
                        elapsed = time.perf_counter() - started
                        samples.setdefault((size, mode), []).append(size * len(keys) / elapsed / 1e9)
                        client.batch_remove(keys, force=True)
        finally:
            client.close()
    print(f"load average {os.getloadavg()[0]:.2f}; {args.rounds} rounds of {args.keys} first reads; GB/s")
    for size in SIZES:
        plain, into = samples[(size, "get")], samples[(size, "get_into")]
        ratio = statistics.median(plain) / statistics.median(into)
        print(
            f"{size >> 20} MiB: get() {statistics.median(plain):.3f} {[round(x, 3) for x in plain]}  "
            f"get_into {statistics.median(into):.3f} {[round(x, 3) for x in into]}  get()/get_into {ratio:.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
