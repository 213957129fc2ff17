"""``kvpool bench batch``: one call of 100,000 keys (4 KiB each by default), put and read back.

The client splits a batch larger than the master's ``max_batch`` (client/batching.py). This measures the
one-call put (``batch_put_from``) and read (``batch_get_into``) of ``--keys`` keys, against the same keys
sent the way a caller had to before: one ``max_batch`` chunk after another, by hand, in the same run.
Every run uses fresh keys and removes them after; every read is checked byte for byte. Medians of
``--runs`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from kvpool.common.errors import batch_failure
from kvpool.tools.argtypes import positive_int, size, size_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keys", type=positive_int, default=100_000, help="keys in the one call (100,000)")
    parser.add_argument("--value-size", type=size_bytes, default="4KiB", help="bytes per value (4KiB)")
    parser.add_argument("--runs", type=positive_int, default=3, help="runs; medians are reported (3)")
    parser.add_argument("--store-size", type=size, default="1GiB", help="segment of the store it starts (1GiB)")
    parser.add_argument(
        "--master", default="", help="use this running cluster (`local`: the one `kvpool local up` started)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _timed(call: Callable[[], list[int]], expect: Callable[[list[int]], bool], what: str) -> float:
    started = time.perf_counter()
    codes = call()
    elapsed = time.perf_counter() - started
    if not expect(codes):
        raise batch_failure(what, codes)
    return elapsed


def _by_hand(call: Callable[..., list[int]], keys: Sequence[str], bufs: Sequence[Any], chunk: int) -> list[int]:
    """``chunk`` keys a call, one call after another (all keys in one call when ``chunk`` covers them):
    with max_batch, what a caller did before the client split batches."""
    codes: list[int] = []
    for lo in range(0, len(keys), chunk):
        codes += call(keys[lo : lo + chunk], bufs[lo : lo + chunk], timeout=600.0)
    return codes


def _one_run(pool: Any, n: int, value_size: int) -> dict[str, float]:
    values = [os.urandom(min(16, value_size)) + bytes(max(0, value_size - 16)) for _ in range(n)]
    times = _pass(pool, values, value_size, by_hand=False)
    times.update(_pass(pool, values, value_size, by_hand=True))
    return times


def _pass(pool: Any, values: list[bytes], value_size: int, by_hand: bool) -> dict[str, float]:
    """Put ``values`` under fresh keys and read them back (one call each, or max_batch chunks by hand);
    check every byte; remove them."""
    n = len(values)
    keys = [f"bench-batch-{uuid.uuid4().hex[:8]}-{i}" for i in range(n)]
    out = [bytearray(value_size) for _ in range(n)]
    chunk = pool.batch_limits()[0] if by_hand else n
    mode = "by_hand" if by_hand else "one_call"
    times = {
        f"put_{mode}": _timed(
            lambda: _by_hand(pool.batch_put_from, keys, values, chunk), lambda c: c == [0] * n, "put"
        ),
        f"get_{mode}": _timed(
            lambda: _by_hand(pool.batch_get_into, keys, out, chunk), lambda c: c == [value_size] * n, "get"
        ),
    }
    if any(bytes(o) != v for o, v in zip(out, values, strict=True)):
        raise SystemExit("bench batch: a value read back differs from the one written")
    pool.batch_remove(keys, force=True, timeout=600.0)
    return times


def measure(master: str, n: int, value_size: int, runs: int) -> dict[str, Any]:
    from kvpool.client import ClientConfig, PoolClient

    config = ClientConfig(master=master, use_shm=False, timeout_s=600.0)
    with PoolClient(config=config) as pool:
        results = [_one_run(pool, n, value_size) for _ in range(runs)]
        max_batch = pool.batch_limits()[0]
    medians = {name: statistics.median(r[name] for r in results) for name in results[0]}
    gbytes = n * value_size / 1e9
    doc: dict[str, Any] = {"keys": n, "value_size": value_size, "runs": runs, "max_batch": max_batch}
    for op in ("put", "get"):
        one, hand = medians[f"{op}_one_call"], medians[f"{op}_by_hand"]
        doc[op] = {
            "one_call_s": one,
            "by_hand_s": hand,
            "one_call_keys_per_s": n / one,
            "one_call_gbps": gbytes / one,
            "ratio_to_by_hand": hand / one,
        }
    return doc


def run(args: argparse.Namespace) -> int:
    from kvpool.common import local_context
    from kvpool.tools.local_cluster import LocalCluster

    master = local_context.resolve(args.master)
    cluster = None
    if not master:
        cluster = LocalCluster(stores=1, store_size=str(args.store_size)).start()
        master = cluster.master
    try:
        doc = measure(master, args.keys, args.value_size, args.runs)
    finally:
        if cluster is not None:
            cluster.stop()
    if args.json:
        print(json.dumps(doc))
        return 0
    print(f"{doc['keys']:,} keys of {doc['value_size']:,} B in one call (master max_batch {doc['max_batch']:,}),")
    print(f"medians of {doc['runs']} runs; 'by hand' = the same keys as max_batch chunks, one after another")
    for op in ("put", "get"):
        r = doc[op]
        print(
            f"  {op}: {r['one_call_s']:.2f} s ({r['one_call_keys_per_s']:,.0f} keys/s, {r['one_call_gbps']:.2f} GB/s); "
            f"by hand {r['by_hand_s']:.2f} s: x{r['ratio_to_by_hand']:.2f}"
        )
    return 0
