"""``kvpool bench prefetch``: how much of a prefix fetch hides behind compute, and what the engine's
thread pays for it.

It starts a local cluster (or uses ``--master``), writes a long shared prefix (``--pages`` pages of a k and
a v object each), then, per run: issues ``EngineClient.prefetch`` for the whole prefix, simulates the
engine's compute for ``--compute-ms`` (a sleep - compute on an accelerator leaves the CPU idle - or
``--compute busy``: hashing that keeps one core busy and releases the GIL) while polling
``completed_pages()`` every ``--poll-ms`` as a scheduler loop would, and then calls ``wait()``.

* ``hidden_fraction`` = 1 - (time blocked in ``wait()``) / (the prefetch's own duration): the share of the
  transfer that overlapped compute. Target >= 0.9 when compute is longer than the transfer.
* ``caller_p99_ms``: p99 of the time one engine-thread call takes (``prefetch()`` and the polls) - the
  latency the pool adds to the engine's thread. Target < 1 ms.

Figures are medians over ``--runs`` runs (p99 over all calls of all runs).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvpool.common.errors import ErrorCode, KvPoolError, batch_failure
from kvpool.tools.argtypes import non_negative_float, positive_float, positive_int, size, size_bytes

TARGET_HIDDEN = 0.9
TARGET_CALLER_P99_MS = 1.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", default="", help="use this running cluster instead of starting one")
    parser.add_argument("--pages", type=positive_int, default=128, help="pages in the shared prefix (default 128)")
    parser.add_argument(
        "--object-size",
        type=size_bytes,
        default="128KiB",
        help="bytes of one page object; a page is a k and a v object (default 128KiB)",
    )
    parser.add_argument(
        "--compute-ms",
        type=non_negative_float,
        default=0.0,
        help="simulated compute per run (default: 2x the measured transfer time)",
    )
    parser.add_argument(
        "--compute",
        choices=("sleep", "busy"),
        default="sleep",
        help="sleep (accelerator-like: CPU idle) or busy (one core hashing, GIL released)",
    )
    parser.add_argument("--poll-ms", type=positive_float, default=1.0, help="scheduler poll interval (default 1 ms)")
    parser.add_argument("--runs", type=positive_int, default=7, help="runs; medians are reported (default 7)")
    parser.add_argument("--io-threads", type=positive_int, default=2, help="EngineClient I/O threads (default 2)")
    parser.add_argument("--store-size", type=size, default="256MiB", help="segment size of each benchmark store")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass
class Result:
    hidden_fraction: float
    caller_p99_ms: float
    fetch_ms: float
    compute_ms: float
    wait_ms: float
    fetch_alone_ms: float
    caller_p50_ms: float
    caller_max_ms: float
    caller_calls: int
    lookup_ms: float
    pages: int
    bytes: int
    fetch_alone_gbps: float
    compute: str
    runs: int
    pages_fetched: int
    target_hidden_fraction: float = TARGET_HIDDEN
    target_caller_p99_ms: float = TARGET_CALLER_P99_MS
    meets_targets: bool = False


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Compute:
    """The engine's forward pass, simulated."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._block = os.urandom(256 * 1024)

    def step(self, seconds: float) -> None:
        if self.mode == "sleep":
            time.sleep(seconds)
            return
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            # One core busy, the GIL released (hashlib drops it for large inputs) - like a CPU kernel.
            # Not BLAS: it would take every core of a small machine, stores and I/O threads included.
            hashlib.sha256(self._block).digest()


def _seed_prefix(pool: Any, engine: Any, pages: int, object_size: int) -> tuple[list[str], list[bytes]]:
    keys = engine.page_keys(list(range(pages * engine.page_size)))
    values = [os.urandom(object_size) for _ in range(pages * engine.objects_per_page)]
    objects = engine.object_keys(keys)
    step = 32
    for lo in range(0, len(objects), step):
        codes = pool.batch_put_from(objects[lo : lo + step], values[lo : lo + step], timeout=30)
        if any(c != 0 for c in codes):
            raise batch_failure("writing the shared prefix failed", codes)
    return keys, values


def _fetch_alone(engine: Any, keys: list[str], dests: list[bytearray], runs: int) -> list[float]:
    """The transfer with nothing to hide behind (the engine waits at once)."""
    times = []
    for _ in range(runs):
        handle = engine.prefetch(keys, dests, deadline_s=30, policy="wait_complete", hit_pages=len(keys))
        if handle.wait(timeout=60) != len(keys):
            raise KvPoolError(ErrorCode.TIMEOUT, f"prefetch fetched {handle.completed_pages()} of {len(keys)} pages")
        times.append(handle.finished_at - handle.issued_at)
    return times


def _overlapped_run(
    engine: Any,
    keys: list[str],
    dests: list[bytearray],
    compute: _Compute,
    compute_s: float,
    poll_s: float,
    caller: list[float],
) -> tuple[float, float, int]:
    """One request: prefetch, compute while polling, wait. Returns (fetch s, wait s, pages)."""
    started = time.perf_counter()
    t0 = time.perf_counter()
    handle = engine.prefetch(keys, dests, deadline_s=30, policy="wait_complete", hit_pages=len(keys))
    caller.append(time.perf_counter() - t0)
    while (left := compute_s - (time.perf_counter() - started)) > 0:
        compute.step(min(poll_s, left))
        t0 = time.perf_counter()
        handle.completed_pages()
        handle.done()
        caller.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    pages = handle.wait(timeout=60)
    waited = time.perf_counter() - t0
    return handle.finished_at - handle.issued_at, waited, pages


def measure(master: str, args: argparse.Namespace) -> Result:
    from kvpool.client.engine import EngineClient
    from kvpool.client.pool_client import PoolClient
    from kvpool.common.keys import Namespace

    object_size: int = args.object_size
    pool = PoolClient(master)
    engine = EngineClient(
        pool,
        Namespace(model="bench-prefetch"),
        page_size=64,
        page_bytes=object_size,
        io_threads=args.io_threads,
    )
    try:
        keys, values = _seed_prefix(pool, engine, args.pages, object_size)
        dests = [bytearray(object_size) for _ in values]
        lookups = []
        for _ in range(args.runs):
            t0 = time.perf_counter()
            if engine.prefix_length(keys) != len(keys):
                raise KvPoolError(ErrorCode.OBJECT_NOT_FOUND, "the shared prefix is not all in the pool")
            lookups.append(time.perf_counter() - t0)
        _fetch_alone(engine, keys, dests, 1)  # warm-up: connections, staging buffers
        alone = statistics.median(_fetch_alone(engine, keys, dests, args.runs))
        if [bytes(d) for d in dests] != values:
            raise KvPoolError(ErrorCode.CHECKSUM_MISMATCH, "prefetched bytes differ from the written prefix")
        compute_s = args.compute_ms / 1000 if args.compute_ms > 0 else 2 * alone
        compute = _Compute(args.compute)
        caller: list[float] = []
        fetches, waits, hidden, pages = [], [], [], []
        for _ in range(args.runs):
            fetch_s, wait_s, n = _overlapped_run(engine, keys, dests, compute, compute_s, args.poll_ms / 1000, caller)
            fetches.append(fetch_s)
            waits.append(wait_s)
            pages.append(n)
            hidden.append(max(0.0, min(1.0, 1 - wait_s / fetch_s)) if fetch_s > 0 else 1.0)
    finally:
        engine.close()
        pool.close()
    total = len(values) * object_size
    result = Result(
        hidden_fraction=round(statistics.median(hidden), 4),
        caller_p99_ms=round(_percentile(caller, 0.99) * 1000, 4),
        fetch_ms=round(statistics.median(fetches) * 1000, 3),
        compute_ms=round(compute_s * 1000, 3),
        wait_ms=round(statistics.median(waits) * 1000, 3),
        fetch_alone_ms=round(alone * 1000, 3),
        caller_p50_ms=round(_percentile(caller, 0.5) * 1000, 4),
        caller_max_ms=round(max(caller) * 1000, 4),
        caller_calls=len(caller),
        lookup_ms=round(statistics.median(lookups) * 1000, 3),
        pages=len(keys),
        bytes=total,
        fetch_alone_gbps=round(total / alone / 1e9, 3),
        compute=args.compute,
        runs=args.runs,
        pages_fetched=min(pages),
    )
    result.meets_targets = result.hidden_fraction >= TARGET_HIDDEN and result.caller_p99_ms < TARGET_CALLER_P99_MS
    return result


def run(args: argparse.Namespace) -> int:
    from kvpool.common import local_context

    args.master = local_context.resolve(args.master)
    if args.master:
        result = measure(args.master, args)
    else:
        from kvpool.tools.local_cluster import LocalCluster

        with LocalCluster(stores=2, store_size=args.store_size) as cluster:
            result = measure(cluster.master, args)
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        print(
            f"prefix {result.pages} pages, {result.bytes / 2**20:.1f} MiB; transfer alone "
            f"{result.fetch_alone_ms:.1f} ms ({result.fetch_alone_gbps:.2f} GB/s); "
            f"lookup {result.lookup_ms:.2f} ms"
        )
        print(
            f"compute {result.compute_ms:.1f} ms ({result.compute}): transfer {result.fetch_ms:.1f} ms, "
            f"exposed wait {result.wait_ms:.2f} ms -> hidden fraction {result.hidden_fraction:.3f} "
            f"(target >= {TARGET_HIDDEN})"
        )
        print(
            f"engine-thread calls: p50 {result.caller_p50_ms:.4f} ms, p99 {result.caller_p99_ms:.4f} ms, "
            f"max {result.caller_max_ms:.3f} ms over {result.caller_calls} calls "
            f"(target p99 < {TARGET_CALLER_P99_MS} ms)"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvpool bench prefetch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
