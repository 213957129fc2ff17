"""One engine process of the end-to-end model check (tests/conformance/test_model_e2e.py).

    model_worker.py write --master M --seed S [--prompt-len 256]
        prefill the prompt, write its full KV pages to the pool (write-back, then flush)
    model_worker.py read --master M --seed S [--prompt-len 256] [--turn-len 40]
        prompt + a new turn: prefix_length, prefetch the prefix pages, rebuild the cache, prefill only
        the suffix, and compare its logits with a full recompute

Each prints one JSON object on stdout. Both processes derive the same tokens and weights from the seed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import tiny_llama as tl  # the adapter sits next to this script (sys.path[0])
import torch

from kvpool.client.engine import EngineClient
from kvpool.client.pool_client import PoolClient
from kvpool.common.keys import Namespace

PAGE = 64


def engine_for(master: str, model: Any, seed: int) -> EngineClient:
    pool = PoolClient(master)
    return EngineClient(
        pool, Namespace(model=f"tiny-llama-{seed}"), page_size=PAGE, page_bytes=tl.object_bytes(model, PAGE)
    )


def write(args: argparse.Namespace) -> dict[str, Any]:
    model = tl.load_model(args.seed)
    prompt = tl.tokens(args.seed, args.prompt_len)
    start = time.perf_counter()
    _, cache = tl.forward(model, prompt)
    prefill_ms = (time.perf_counter() - start) * 1000
    objects = tl.to_pages(tl.kv_layers(cache), PAGE)
    engine = engine_for(args.master, model, args.seed)
    try:
        keys = engine.page_keys(prompt)
        queued = engine.write_back(keys, tl.byte_views(objects))
        flushed = engine.flush(timeout=60)
        metrics = engine.metrics()
    finally:
        engine.close()
        engine.pool.close()
    return {
        "pages": len(keys),
        "queued": queued,
        "flushed": flushed,
        "written": metrics["writeback_done"] == 1,
        "prefill_ms": prefill_ms,
    }


def read(args: argparse.Namespace) -> dict[str, Any]:
    model = tl.load_model(args.seed)
    full = tl.tokens(args.seed, args.prompt_len) + tl.tokens(args.seed + 1, args.turn_len)
    engine = engine_for(args.master, model, args.seed)
    try:
        keys = engine.page_keys(full)
        hit = engine.prefix_length(keys)
        host = tl.page_buffer(model, hit, PAGE)
        handle = engine.prefetch(keys[:hit], tl.byte_views(host), deadline_s=10, policy="wait_complete", hit_pages=hit)
        fetched = handle.wait(timeout=30)
    finally:
        engine.close()
        engine.pool.close()
    reused = fetched * PAGE
    start = time.perf_counter()
    cache = tl.cache_from_layers(tl.from_pages(host[: 2 * fetched])) if fetched else None
    suffix_logits, _ = tl.forward(model, full[reused:], cache)
    suffix_ms = (time.perf_counter() - start) * 1000
    start = time.perf_counter()
    full_logits, _ = tl.forward(model, full)
    full_ms = (time.perf_counter() - start) * 1000
    expected = full_logits[:, reused:]
    # Control: the same suffix without the prefix's KV must differ - the cache is what makes it right.
    alone, _ = tl.forward(model, full[reused:])
    return {
        "hit_pages": hit,
        "fetched_pages": fetched,
        "reused_tokens": reused,
        "suffix_tokens": len(full) - reused,
        "max_abs_diff": float((suffix_logits - expected).abs().max()),
        "control_diff": float((alone - expected).abs().max()),
        "suffix_prefill_ms": suffix_ms,
        "full_prefill_ms": full_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("role", choices=("write", "read"))
    parser.add_argument("--master", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--turn-len", type=int, default=40)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # two of these may share 2 cores with the cluster
    result = write(args) if args.role == "write" else read(args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
