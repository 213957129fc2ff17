"""``kvpool demo``: a local cluster, an agent workload over 4 simulated prefill instances, and the
figures that matter: the pool's hit rate against what per-instance private caches of the same total
size would get, the bytes moved and the speed.

The workload: multi-turn sessions that resend a growing prefix (each turn appends the user's message
and the model's answer to the conversation) on top of a system prompt shared by every session.
Requests are routed to a random instance, as a load balancer without prefix affinity does. Each
64-token page is one object keyed by SGLang's page hash; its value is a deterministic function of the
key, so every byte read back is checked.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvpool.common.keys import page_keys
from kvpool.tools.argtypes import non_negative_int, positive_int, size, size_bytes

PAGE_TOKENS = 64


@dataclass
class DemoResult:
    requests: int
    pages_looked_up: int
    pool_hit_rate: float
    private_hit_rate: float
    bytes_moved: int
    seconds_transferring: float
    wrong_reads: int

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.seconds_transferring / 1e9 if self.seconds_transferring else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--master", default="", help="use this running cluster instead of starting one")
    parser.add_argument("--stores", type=positive_int, default=2, help="stores of the local cluster (default 2)")
    parser.add_argument("--store-size", type=size, default="256MiB", help="segment size of each store (default 256MiB)")
    parser.add_argument("--instances", type=positive_int, default=4, help="simulated prefill instances (default 4)")
    parser.add_argument("--sessions", type=positive_int, default=24, help="agent sessions (default 24)")
    parser.add_argument("--turns", type=positive_int, default=8, help="turns per session (default 8)")
    parser.add_argument("--system-tokens", type=non_negative_int, default=4096, help="shared system prompt length")
    parser.add_argument("--turn-tokens", type=positive_int, default=768, help="tokens each turn adds")
    parser.add_argument(
        "--page-bytes", type=size_bytes, default="64KiB", help="bytes of one 64-token KV page (default 64KiB)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def page_value(key: str, size: int) -> bytes:
    """Deterministic content for a page, so a wrong read is always detected."""
    seed = int(key[:16], 16)
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def generate_requests(args: argparse.Namespace) -> list[list[int]]:
    """Token sequences of every request, sessions interleaved the way concurrent agents arrive."""
    rng = random.Random(args.seed)
    system = [rng.randrange(50_000) for _ in range(args.system_tokens)]
    sessions = [list(system) for _ in range(args.sessions)]
    order = [s for s in range(args.sessions) for _ in range(args.turns)]
    rng.shuffle(order)
    requests = []
    for s in order:
        sessions[s] += [rng.randrange(50_000) for _ in range(args.turn_tokens)]
        requests.append(list(sessions[s]))
    return requests


class PrivateCaches:
    """N per-instance LRU caches of pages (what each prefill node keeps on its own)."""

    def __init__(self, instances: int, pages_each: int) -> None:
        self.caches: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(instances)]
        self.pages_each = pages_each

    def lookup_and_insert(self, instance: int, keys: list[str]) -> int:
        cache = self.caches[instance]
        hit = 0
        for key in keys:
            if key not in cache:
                break
            hit += 1
        for key in keys:
            cache[key] = None
            cache.move_to_end(key)
        while len(cache) > self.pages_each:
            cache.popitem(last=False)
        return hit


def run_workload(client: object, args: argparse.Namespace, capacity_bytes: int) -> DemoResult:
    from kvpool.client import PoolClient

    assert isinstance(client, PoolClient)
    page_bytes: int = args.page_bytes
    rng = random.Random(args.seed + 1)
    requests = generate_requests(args)
    private = PrivateCaches(args.instances, max(1, capacity_bytes // page_bytes // args.instances))
    looked = pool_hits = private_hits = moved = wrong = 0
    busy = 0.0
    for n, tokens in enumerate(requests):
        keys = page_keys(tokens[: len(tokens) // PAGE_TOKENS * PAGE_TOKENS], PAGE_TOKENS)
        instance = rng.randrange(args.instances)
        looked += len(keys)
        private_hits += private.lookup_and_insert(instance, keys)
        started = time.perf_counter()
        hit = client.prefix_length(keys)
        if hit:
            buffers = [bytearray(page_bytes) for _ in range(hit)]
            codes = client.batch_get_into(keys[:hit], buffers)
            for key, code, buf in zip(keys[:hit], codes, buffers, strict=True):
                if code == page_bytes:
                    moved += code
                    wrong += buf != page_value(key, page_bytes)
                else:
                    hit = min(hit, keys.index(key))  # a failed read is a miss from there on
                    break
        busy += time.perf_counter() - started
        missing = keys[hit:]
        values = [page_value(k, page_bytes) for k in missing]  # "prefill" computes these pages
        started = time.perf_counter()
        codes = client.batch_put_from(missing, values)
        busy += time.perf_counter() - started
        moved += sum(page_bytes for c in codes if c == 0)
        pool_hits += hit
        if not args.json and (n + 1) % max(1, len(requests) // 10) == 0:
            print(
                f"  {n + 1}/{len(requests)} requests, pool hit rate so far {pool_hits / looked:.1%}",
                file=sys.stderr,
            )
    return DemoResult(
        len(requests), looked, pool_hits / max(1, looked), private_hits / max(1, looked), moved, busy, wrong
    )


def run(args: argparse.Namespace) -> int:
    from kvpool.client import ClientConfig, PoolClient
    from kvpool.tools.local_cluster import LocalCluster

    cluster = None
    if args.master:
        master = args.master
    else:
        print(f"starting a local cluster: 1 master, {args.stores} stores of {args.store_size}", file=sys.stderr)
        cluster = LocalCluster(stores=args.stores, store_size=args.store_size).start()
        master = cluster.master
    try:
        with PoolClient(config=ClientConfig(master=master)) as client:
            capacity = int(client.stats().capacity)
            result = run_workload(client, args, capacity)
    finally:
        if cluster is not None:
            cluster.stop()
    doc = {
        "requests": result.requests,
        "pages": result.pages_looked_up,
        "pool_hit_rate": result.pool_hit_rate,
        "private_hit_rate": result.private_hit_rate,
        "gb_moved": result.bytes_moved / 1e9,
        "gbps": result.gbps,
        "wrong_reads": result.wrong_reads,
        "instances": args.instances,
    }
    if args.json:
        print(json.dumps(doc))
    else:
        print(
            f"\nkvpool demo: {result.requests} requests over {args.instances} prefill instances "
            f"(random routing), {result.pages_looked_up} pages looked up"
        )
        print(f"  pool hit rate                          {result.pool_hit_rate:6.1%}")
        print(f"  private per-instance caches (same size) {result.private_hit_rate:6.1%}")
        print(f"  moved {result.bytes_moved / 1e9:.2f} GB at {result.gbps:.2f} GB/s; wrong reads: {result.wrong_reads}")
    return 0 if result.wrong_reads == 0 else 1
