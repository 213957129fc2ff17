"""Prefill time of a tiny random Llama for a long shared prefix, with and without the pool.

Without the pool every request prefills prefix + suffix. With it, the prefix KV was written once (by any
engine); a request looks the prefix up, prefetches its pages, rebuilds the cache and prefills only the
suffix. Both paths run in this process against a local cluster (or ``--master``); the logits of the two
are compared. Needs torch + transformers (scripts/install-conformance-deps.sh).

Usage::

    python benchmarks/prefill_with_pool.py [--prefix 2048] [--suffix 64] [--layers 4] [--runs 5] [--json]

The model is tiny (hidden 128), so its prefill is cheap next to a real model's: the speedup here is a
floor - the transfer cost grows with the KV bytes, the recompute cost with parameters x tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "conformance"))  # the transformers adapter lives with its test
sys.path.insert(0, str(ROOT / "src"))

from kvpool.tools.argtypes import positive_int  # noqa: E402

PAGE = 64


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def measure(master: str, args: argparse.Namespace) -> dict[str, Any]:
    import tiny_llama as tl  # type: ignore[import-not-found]
    import torch

    from kvpool.client.engine import EngineClient
    from kvpool.client.pool_client import PoolClient
    from kvpool.common.keys import Namespace

    model = tl.load_model(0, layers=args.layers)
    prefix, suffix = tl.tokens(1, args.prefix), tl.tokens(2, args.suffix)
    full = prefix + suffix
    pool = PoolClient(master)
    engine = EngineClient(
        pool,
        Namespace(model=f"bench-tiny-llama-{args.layers}l"),
        page_size=PAGE,
        page_bytes=tl.object_bytes(model, PAGE),
        max_writeback_bytes=1 << 30,
    )
    try:
        # Some engine computed the prefix before and wrote it back.
        (_, cache), write_prefill_s = _timed(tl.forward, model, prefix)
        objects = tl.to_pages(tl.kv_layers(cache), PAGE)
        start = time.perf_counter()
        if not (engine.write_back(engine.page_keys(prefix), tl.byte_views(objects)) and engine.flush(60)):
            raise RuntimeError("writing the prefix KV failed")
        write_s = time.perf_counter() - start

        baseline: list[float] = []
        with_pool: list[float] = []
        parts: dict[str, list[float]] = {"lookup": [], "fetch": [], "rebuild": [], "suffix": []}
        diff = 0.0
        for _ in range(args.runs):
            (full_logits, _), seconds = _timed(tl.forward, model, full)
            baseline.append(seconds)
            logits, timings = _prefill_with_pool(tl, engine, model, full)
            with_pool.append(sum(timings.values()))
            for name, value in timings.items():
                parts[name].append(value)
            diff = max(diff, float((logits - full_logits[:, -logits.shape[1] :]).abs().max()))
    finally:
        engine.close()
        pool.close()
    base, pooled = statistics.median(baseline), statistics.median(with_pool)
    kv_bytes = len(objects) * tl.object_bytes(model, PAGE)
    return {
        "prefix_tokens": args.prefix,
        "suffix_tokens": args.suffix,
        "layers": args.layers,
        "torch_threads": torch.get_num_threads(),
        "kv_bytes": kv_bytes,
        "prefill_without_pool_ms": round(base * 1000, 2),
        "prefill_with_pool_ms": round(pooled * 1000, 2),
        "speedup": round(base / pooled, 2),
        **{f"{name}_ms": round(statistics.median(v) * 1000, 3) for name, v in parts.items()},
        "write_back_ms": round(write_s * 1000, 2),
        "first_prefill_ms": round(write_prefill_s * 1000, 2),
        "max_abs_diff": diff,
        "runs": args.runs,
    }


def _prefill_with_pool(tl: Any, engine: Any, model: Any, full: list[int]) -> tuple[Any, dict[str, float]]:
    keys = engine.page_keys(full)
    hit, lookup_s = _timed(engine.prefix_length, keys)
    host = tl.page_buffer(model, hit, PAGE)
    start = time.perf_counter()
    handle = engine.prefetch(keys[:hit], tl.byte_views(host), deadline_s=30, policy="wait_complete", hit_pages=hit)
    fetched = handle.wait(timeout=60)
    fetch_s = time.perf_counter() - start
    reused = min(fetched * PAGE, len(full) - 1)  # always compute at least the last token
    fetched = reused // PAGE
    cache, rebuild_s = _timed(lambda: tl.cache_from_layers(tl.from_pages(host[: 2 * fetched])) if fetched else None)
    (logits, _), suffix_s = _timed(tl.forward, model, full[fetched * PAGE :], cache)
    return logits, {"lookup": lookup_s, "fetch": fetch_s, "rebuild": rebuild_s, "suffix": suffix_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--master", default="", help="use this running cluster instead of starting one")
    parser.add_argument("--prefix", type=positive_int, default=2048, help="shared prefix tokens (default 2048)")
    parser.add_argument("--suffix", type=positive_int, default=64, help="new tokens per request (default 64)")
    parser.add_argument("--layers", type=positive_int, default=4, help="model layers (default 4)")
    parser.add_argument("--runs", type=positive_int, default=5, help="runs; medians are reported (default 5)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.master:
        result = measure(args.master, args)
    else:
        from kvpool.tools.local_cluster import LocalCluster

        with LocalCluster(stores=2, store_size="256MiB") as cluster:
            result = measure(cluster.master, args)
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"prefix {result['prefix_tokens']} + suffix {result['suffix_tokens']} tokens, "
            f"{result['layers']} layers, KV {result['kv_bytes'] / 2**20:.1f} MiB"
        )
        print(
            f"prefill without the pool {result['prefill_without_pool_ms']:.1f} ms, with it "
            f"{result['prefill_with_pool_ms']:.1f} ms (lookup {result['lookup_ms']:.2f} + fetch "
            f"{result['fetch_ms']:.1f} + rebuild {result['rebuild_ms']:.1f} + suffix "
            f"{result['suffix_ms']:.1f}) -> {result['speedup']:.2f}x; max |logit diff| "
            f"{result['max_abs_diff']:.2e}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
