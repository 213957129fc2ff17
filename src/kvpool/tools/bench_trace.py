"""``kvpool bench trace``: replay a Mooncake trace against the pool and compare with the in-process baselines.

One run reports, for the same trace, capacity and routing decisions:

* ``pool``: the real pool (or ``InMemoryLRUPool`` when no pool factory is given), driven through ``PoolLike``;
* ``private``: N private per-instance LRUs of ``capacity / N`` each behind the routing policy (what instances
  without a shared pool get);
* ``oracle``: one global LRU of the whole capacity (what a shared pool should reach whatever the routing).

Per request, in trace order, the driver asks the pool how many leading blocks it holds (one
``prefix_length`` round trip), then writes every block after that prefix (``batch_put``; the pool
deduplicates keys it already has). Block ``h`` of a run is the object ``trace-{run_tag}-{h}`` whose value is
``block_value(h, block_bytes)``.

The caller owns the pool: ``pool_factory(args)`` returns a context manager yielding a ``PoolLike`` sized for
``args.capacity`` (see ``pool_capacity_bytes``), connected to ``args.master``, or started locally when that
is None.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from kvpool.tools.argtypes import positive_int
from kvpool.tools.trace import (
    BLOCK_TOKENS,
    DEFAULT_TRACE,
    ROUTING_POLICIES,
    HitStats,
    Request,
    TraceFormatError,
    capacity_blocks,
    load_trace,
    make_router,
    route_all,
    simulate_global,
    simulate_routed,
)

__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "ERR_NO_SPACE",
    "InMemoryLRUPool",
    "PoolFactory",
    "PoolLike",
    "Progress",
    "ReplayReport",
    "add_arguments",
    "block_key",
    "block_value",
    "parse_token_count",
    "pool_capacity_bytes",
    "replay_pool",
    "run",
]

DEFAULT_BLOCK_BYTES = 4096
_DESCRIPTION = "Replay a Mooncake trace against the pool, private per-instance LRUs and a global LRU oracle."
ERR_NO_SPACE = -200
"""Returned by ``InMemoryLRUPool.batch_put`` for a key it cannot hold; Mooncake's NO_AVAILABLE_HANDLE."""


class PoolLike(Protocol):
    """The two pool operations the replay needs."""

    def prefix_length(self, keys: list[str]) -> int:
        """Number of leading ``keys`` present in the pool (stops at the first absent key); one round trip."""
        ...

    def batch_put(self, keys: list[str], values: list[bytes]) -> list[int]:
        """Store ``values[i]`` under ``keys[i]``; per key 0 = stored (or already there), < 0 = error code."""
        ...


PoolFactory = Callable[[argparse.Namespace], AbstractContextManager[PoolLike]]


# ----------------------------------------------------------------------------------------------------
# Keys, values, sizing
# ----------------------------------------------------------------------------------------------------


def block_key(run_tag: str, hash_id: int) -> str:
    """The pool key of trace block ``hash_id``; the run tag keeps runs against a long-lived pool apart."""
    return f"trace-{run_tag}-{hash_id}"


_MIX = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: spreads consecutive ids over all 64 bits
_MASK64 = (1 << 64) - 1


def block_value(hash_id: int, block_bytes: int) -> bytes:
    """``block_bytes`` deterministic bytes for block ``hash_id``: a 16-byte stamp (id, mixed id) repeated.

    Every 16 bytes name the block, so a value served for the wrong key, shifted or torn is detected by
    comparing with this function; repetition keeps generation cheap (no per-byte Python work).
    """
    stamp = struct.pack("<QQ", hash_id & _MASK64, (hash_id * _MIX) & _MASK64)
    reps = -(-block_bytes // len(stamp))
    return (stamp * reps)[:block_bytes]


def pool_capacity_bytes(capacity_tokens: int | None, block_bytes: int) -> int | None:
    """Pool bytes that hold the same number of blocks as ``capacity_tokens`` (None = unlimited).

    For pool factories: the pool is sized in bytes, the baselines in 512-token blocks.
    """
    blocks = capacity_blocks(capacity_tokens)
    return None if blocks is None else blocks * block_bytes


_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9}


def parse_token_count(text: str) -> int:
    """``3000000``, ``3M``, ``10m``, ``500k`` -> tokens (decimal suffixes). For ``--capacity``."""
    s = text.strip().lower().replace("_", "")
    mult = _SUFFIXES.get(s[-1:], 1)
    if mult != 1:
        s = s[:-1]
    try:
        value = float(s) * mult if "." in s else int(s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count: {text!r} (e.g. 3000000, 3M, 500k)") from None
    if value < 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"token count must be a non-negative whole number: {text!r}")
    return int(value)


# ----------------------------------------------------------------------------------------------------
# In-memory pool
# ----------------------------------------------------------------------------------------------------


class InMemoryLRUPool:
    """A ``PoolLike`` holding at most ``capacity_blocks`` objects (None = unlimited), evicting the LRU one.

    Sanity baseline and test double. A lookup refreshes the keys it finds and a put of an existing key
    refreshes it: every block of a request is "used" by it, which is the oracle's rule, so the replay through
    this pool must equal ``simulate_global`` exactly. (Deliberately not built on ``BlockLRU``, so that this
    equality also cross-checks the LRU.)
    """

    def __init__(self, capacity_blocks: int | None) -> None:
        if capacity_blocks is not None and capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0 or None, got {capacity_blocks}")
        self._capacity = capacity_blocks
        self._objects: OrderedDict[str, bytes] = OrderedDict()
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._objects)

    def get(self, key: str) -> bytes | None:
        return self._objects.get(key)

    def prefix_length(self, keys: list[str]) -> int:
        objects = self._objects
        n = 0
        for key in keys:
            if key not in objects:
                break
            objects.move_to_end(key)
            n += 1
        return n

    def batch_put(self, keys: list[str], values: list[bytes]) -> list[int]:
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        return [self._put(k, v) for k, v in zip(keys, values, strict=True)]

    def _put(self, key: str, value: bytes) -> int:
        objects = self._objects
        if key in objects:
            # Immutable objects: a second put keeps the first value (Mooncake swallows OBJECT_ALREADY_EXISTS).
            objects.move_to_end(key)
            return 0
        if self._capacity == 0:
            return ERR_NO_SPACE
        objects[key] = value
        if self._capacity is not None and len(objects) > self._capacity:
            objects.popitem(last=False)
            self.evictions += 1
        return 0


# ----------------------------------------------------------------------------------------------------
# Replay
# ----------------------------------------------------------------------------------------------------


class Progress:
    """Prints ``label: P% (i/total)`` to ``stream`` about every 5 % of ``total`` (and at the end)."""

    def __init__(self, label: str, total: int, stream: TextIO | None, step_percent: int = 5) -> None:
        self._label = label
        self._total = total
        self._stream = stream
        self._every = max(1, total * step_percent // 100)

    def update(self, done: int) -> None:
        if self._stream is None or self._total == 0:
            return
        if done % self._every == 0 or done == self._total:
            print(
                f"{self._label}: {100 * done // self._total}% ({done}/{self._total})",
                file=self._stream,
                flush=True,
            )


@dataclass(slots=True)
class PoolReplay:
    """What the pool replay saw: hit counters plus write-side counts."""

    stats: HitStats
    blocks_written: int = 0
    """Blocks sent in ``batch_put`` (after each request's hit prefix)."""
    put_errors: int = 0
    """Blocks the pool refused (negative status); they count as not stored, which the next lookups show."""
    seconds: float = 0.0


def replay_pool(
    trace: Sequence[Request],
    pool: PoolLike,
    *,
    run_tag: str,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    progress: Progress | None = None,
) -> PoolReplay:
    """Replay ``trace`` against ``pool``: per request one prefix lookup, then one batch put of the rest."""
    out = PoolReplay(HitStats())
    start = time.perf_counter()
    prefix = f"trace-{run_tag}-"  # block_key() inlined: ~120k keys per pass
    for i, req in enumerate(trace, start=1):
        ids = req.hash_ids
        keys = [prefix + str(h) for h in ids]
        # Clamp: a pool answering more than asked would otherwise inflate the hit rate silently.
        hit = min(max(pool.prefix_length(keys), 0), len(keys))
        out.stats.record(req, hit)
        if hit < len(keys):
            values = [block_value(h, block_bytes) for h in ids[hit:]]
            codes = pool.batch_put(keys[hit:], values)
            out.blocks_written += len(values)
            out.put_errors += sum(1 for c in codes if c < 0)
        if progress is not None:
            progress.update(i)
    out.seconds = time.perf_counter() - start
    return out


@dataclass(slots=True)
class ReplayReport:
    """All figures of one ``bench trace`` run."""

    trace: str
    requests: int
    blocks: int
    instances: int
    routing: str
    seed: int
    capacity_tokens: int | None
    block_bytes: int
    pool_backend: str
    run_tag: str
    pool: PoolReplay
    private: HitStats
    oracle: HitStats
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)
    """What the pool factory adds (cluster layout, tier counters, more oracles); printed after the rest."""

    def to_json(self) -> dict[str, Any]:
        return self.extra | {
            "pool_hit": self.pool.stats.block_hit_rate,
            "private_hit": self.private.block_hit_rate,
            "oracle_hit": self.oracle.block_hit_rate,
            "pool_token_hit": self.pool.stats.token_hit_rate,
            "private_token_hit": self.private.token_hit_rate,
            "oracle_token_hit": self.oracle.token_hit_rate,
            "requests": self.requests,
            "blocks": self.blocks,
            "instances": self.instances,
            "routing": self.routing,
            "seed": self.seed,
            "capacity_tokens": self.capacity_tokens,
            "seconds": round(self.seconds, 3),
            "pool_seconds": round(self.pool.seconds, 3),
            "block_bytes": self.block_bytes,
            "pool_backend": self.pool_backend,
            "pool_blocks_written": self.pool.blocks_written,
            "pool_put_errors": self.pool.put_errors,
            "run_tag": self.run_tag,
            "trace": self.trace,
        }

    def to_table(self) -> str:
        cap = "unlimited"
        if self.capacity_tokens is not None:
            total = capacity_blocks(self.capacity_tokens)
            each = capacity_blocks(self.capacity_tokens, self.instances)
            cap = f"{self.capacity_tokens:,} tokens ({total:,} blocks; {each:,} per private cache)"
        routing = self.routing + (f" (seed {self.seed})" if self.routing == "random" else "")
        rows = [
            (f"pool ({self.pool_backend})", self.pool.stats),
            (f"{self.instances} private LRUs", self.private),
            ("oracle (one global LRU)", self.oracle),
        ]
        lines = [
            f"trace      {self.trace}: {self.requests:,} requests, {self.blocks:,} blocks of {BLOCK_TOKENS} tokens",
            f"instances  {self.instances}, routing {routing}",
            f"capacity   {cap}",
            "",
            f"{'':26}{'block hit':>10}{'token hit':>11}",
        ]
        lines += [f"{name:26}{s.block_hit_rate:>10.1%}{s.token_hit_rate:>11.1%}" for name, s in rows]
        lines += [
            "",
            f"pool: {self.pool.blocks_written:,} blocks written ({self.block_bytes:,} B each), "
            f"{self.pool.put_errors:,} put errors, {self.pool.seconds:.2f} s; total {self.seconds:.2f} s",
        ]
        lines += [f"{name}: {_show(value)}" for name, value in self.extra.items()]
        return "\n".join(lines)


def _show(value: Any) -> str:
    return f"{value:.1%}" if isinstance(value, float) and 0.0 <= value <= 1.0 else str(value)


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvpool bench trace``; ``--master`` belongs to the top-level CLI (read as args.master)."""
    parser.add_argument(
        "--trace",
        default=str(DEFAULT_TRACE),
        help="Mooncake-format JSONL trace (default: the synthetic Mooncake trace in benchmarks/traces/)",
    )
    parser.add_argument("--instances", type=positive_int, default=8, help="simulated prefill instances (8)")
    parser.add_argument("--routing", choices=ROUTING_POLICIES, default="random", help="request routing (random)")
    parser.add_argument(
        "--capacity",
        type=parse_token_count,
        default=None,
        metavar="TOKENS",
        help="total cache capacity in tokens, e.g. 3M or 10000000 (default: unlimited); "
        "the private caches get capacity/instances each",
    )
    parser.add_argument(
        "--block-bytes", type=positive_int, default=DEFAULT_BLOCK_BYTES, help="bytes per block object (4096)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random routing (0)")
    parser.add_argument(
        "--limit-requests",
        type=positive_int,
        default=None,
        metavar="K",
        help="replay only the first K requests",
    )
    parser.add_argument(
        "--run-tag", default=None, help="key namespace of this run: trace-<tag>-<hash_id> (default: random)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _default_pool(args: argparse.Namespace) -> AbstractContextManager[PoolLike]:
    return nullcontext(InMemoryLRUPool(capacity_blocks(args.capacity)))


def run(
    args: argparse.Namespace,
    pool_factory: PoolFactory | None = None,
    report_extra: Callable[[], dict[str, Any]] | None = None,
) -> int:
    """Run the benchmark; returns the process exit status (0 ok, 2 bad trace or arguments).

    Without ``pool_factory`` the pool is ``InMemoryLRUPool`` (reported as ``pool_backend: in-memory``).
    ``report_extra()``, called once the pool is closed, adds fields to the report (JSON and table).
    """
    started = time.perf_counter()
    err = sys.stderr
    try:
        trace = load_trace(args.trace, args.limit_requests)
    except (OSError, TraceFormatError) as e:
        print(f"kvpool bench trace: {e}", file=err)
        return 2
    if pool_factory is None and getattr(args, "master", None) is not None:
        print("kvpool bench trace: --master given but no pool factory is available", file=err)
        return 2
    cap: int | None = args.capacity
    routes = route_all(trace, make_router(args.routing, args.instances, args.seed))
    oracle = simulate_global(trace, cap)
    private = simulate_routed(trace, routes, args.instances, cap)

    run_tag = args.run_tag or uuid.uuid4().hex[:12]
    backend = "in-memory" if pool_factory is None else ("cluster" if getattr(args, "master", None) else "local")
    print(f"kvpool bench trace: replaying {len(trace):,} requests against the {backend} pool", file=err)
    with (pool_factory or _default_pool)(args) as pool:
        replay = replay_pool(
            trace,
            pool,
            run_tag=run_tag,
            block_bytes=args.block_bytes,
            progress=Progress("pool replay", len(trace), err),
        )
    report = ReplayReport(
        trace=str(args.trace),
        requests=len(trace),
        blocks=sum(r.num_blocks for r in trace),
        instances=args.instances,
        routing=args.routing,
        seed=args.seed,
        capacity_tokens=cap,
        block_bytes=args.block_bytes,
        pool_backend=backend,
        run_tag=run_tag,
        pool=replay,
        private=private,
        oracle=oracle,
        seconds=time.perf_counter() - started,
        extra=report_extra() if report_extra is not None else {},
    )
    print(json.dumps(report.to_json()) if args.json else report.to_table())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point (``python -m kvpool.tools.bench_trace``) with the in-memory pool."""
    parser = argparse.ArgumentParser(prog="kvpool bench trace", description=_DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.master = None
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
