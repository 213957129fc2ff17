"""Placement and allocator quality, in-process (no cluster): ``kvpool bench placement`` or
``python benchmarks/placement.py``.

Two questions, each answered on the pure master code with a synthetic stream:

1. **Allocator utilisation** (>= 0.95 for uniform page sizes, docs/placement.md). One ``OffsetAllocator`` is filled
   until an allocation fails, then driven through churn (free a random tenth, refill until the next failure)
   for ``--rounds`` rounds; utilisation = the bytes the callers asked for that are live at a failure / the
   segment size, averaged over the failures after the first fill (and its minimum). Uniform sizes: KV pages
   of several models (64-byte aligned or not); mixed: sizes drawn from a set of page sizes, and uniformly
   random sizes.
2. **How fast a new store fills up** (Mooncake's random placement took ~30 min to absorb a new node: its PR
   #1511). A ``MasterState`` with ``--segments`` equal segments runs a put stream with the master's own
   eviction (watermark 0.90 -> 0.85, approximate LRU) until it is in steady state; then one more segment of
   the same size is mounted and the stream goes on. Reported: objects written until the new segment's used
   fraction is within ``--tolerance`` (absolute, default 0.05) of the others' mean, for free-ratio-first and
   for random placement, also in units of the pool's capacity in objects (a time at a given write rate).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

from kvpool.common.clock import ManualClock
from kvpool.common.errors import ErrorCode
from kvpool.master.allocator import OffsetAllocator
from kvpool.master.config import MasterConfig
from kvpool.master.state import MasterState
from kvpool.master.types import PutOptions, SegmentSpec
from kvpool.tools.argtypes import fraction, int_at_least, positive_int

__all__ = ["ConvergenceResult", "UtilisationResult", "add_arguments", "converge", "run", "utilisation"]

KiB = 1024
MiB = 1024 * KiB
UNIFORM_SIZES = {
    "4 KiB": 4 * KiB,
    "64 KiB": 64 * KiB,
    "100 KiB (LLaMA3-8B page, 64 tokens, 1 rank)": 100 * KiB,
    "160 KiB + 17 B (unaligned)": 160 * KiB + 17,
    "3.12 MB (Mooncake's bench object)": 3_120_000,
}
PAGE_MIX = (64 * KiB, 100 * KiB, 160 * KiB, 320 * KiB, 1 * MiB, 2 * MiB + 4 * KiB)


@dataclass(frozen=True)
class UtilisationResult:
    name: str
    mean: float
    minimum: float
    failures: int
    allocations_per_s: float
    """allocate + free calls per second (the allocator alone, in this process)."""


@dataclass(frozen=True)
class ConvergenceResult:
    policy: str
    objects_written: int | None
    """Puts after the new segment was mounted until it was within tolerance (None: not within the cap)."""
    pool_capacities: float | None
    """The same in units of the pool's capacity in objects."""
    new_fraction: float
    others_fraction: float


# ----------------------------------------------------------------------------------------------------
# 1. allocator utilisation
# ----------------------------------------------------------------------------------------------------


def utilisation(name: str, draw: Any, segment: int, rounds: int, seed: int) -> UtilisationResult:
    """Fill, then churn ``rounds`` times; utilisation of the requested bytes at each allocation failure."""
    rng = random.Random(seed)
    alloc = OffsetAllocator(segment)
    live: dict[int, int] = {}  # offset -> requested length
    requested = 0
    samples: list[float] = []
    ops = 0
    elapsed = 0.0  # time in allocate/free only (not in this loop's bookkeeping)
    clock = time.perf_counter
    for round_ in range(rounds + 1):
        while True:
            size = draw(rng)
            t0 = clock()
            offset = alloc.allocate(size)
            elapsed += clock() - t0
            ops += 1
            if offset is None:
                break
            live[offset] = size
            requested += size
        if round_ > 0:  # the first fill is not a steady state
            samples.append(requested / segment)
        for offset in rng.sample(sorted(live), max(1, len(live) // 10)):
            requested -= live.pop(offset)
            t0 = clock()
            alloc.free(offset)
            elapsed += clock() - t0
            ops += 1
    return UtilisationResult(name, statistics.fmean(samples), min(samples), len(samples), ops / elapsed)


def utilisation_suite(segment: int, rounds: int, seed: int) -> list[UtilisationResult]:
    out = [
        utilisation(f"uniform {name}", lambda _r, s=size: s, segment, rounds, seed)
        for name, size in UNIFORM_SIZES.items()
    ]
    out.append(
        utilisation(
            "mixed: KV pages of 6 sizes (64 KiB .. 2 MiB)",
            lambda r: r.choice(PAGE_MIX),
            segment,
            rounds,
            seed,
        )
    )
    out.append(
        utilisation("mixed: uniform random 1 KiB .. 1 MiB", lambda r: r.randint(KiB, MiB), segment, rounds, seed)
    )
    return out


# ----------------------------------------------------------------------------------------------------
# 2. convergence of a newly mounted segment
# ----------------------------------------------------------------------------------------------------


class _Stream:
    """A MasterState with equal segments and a put stream, eviction run as the master's thread would."""

    def __init__(self, policy: str, segments: int, segment_size: int, object_size: int, seed: int) -> None:
        self.clock = ManualClock()
        config = MasterConfig(placement=policy, num_shards=64)
        self.state = MasterState(config, self.clock, rng=random.Random(seed))
        self.segment_size = segment_size
        self.object_size = object_size
        self.next_key = 0
        for sid in range(1, segments + 1):
            self.mount(sid)

    def mount(self, sid: int) -> None:
        spec = SegmentSpec(
            sid,
            f"node{sid}",
            f"store{sid}",
            self.segment_size,
            f"10.0.0.{sid}:1",
            "",
            sid.to_bytes(4, "little") * 8,
        )
        assert self.state.mount_segment(spec).code == ErrorCode.OK

    def put(self) -> None:
        key = f"k{self.next_key}"
        self.next_key += 1
        self.clock.advance(0.001)  # distinct LRU times
        [result] = self.state.put_start("bench", [key], [self.object_size], PutOptions())
        if result.code == ErrorCode.OK:
            self.state.put_end("bench", [key], [self.next_key])
        if self.state.needs_eviction():
            self.state.evict()

    def fractions(self) -> dict[int, float]:
        return {s.id: s.used / s.size for s in self.state.segments()}


def converge(
    policy: str,
    segments: int,
    segment_size: int,
    object_size: int,
    tolerance: float,
    seed: int,
    cap_capacities: float = 20.0,
) -> ConvergenceResult:
    stream = _Stream(policy, segments, segment_size, object_size, seed)
    per_segment = segment_size // object_size
    for _ in range(3 * segments * per_segment):  # steady state: the pool has been rewritten a few times
        stream.put()
    new = segments + 1
    stream.mount(new)
    capacity = new * per_segment
    limit = int(cap_capacities * capacity)
    for written in range(1, limit + 1):
        stream.put()
        fractions = stream.fractions()
        others = statistics.fmean(f for sid, f in fractions.items() if sid != new)
        if abs(fractions[new] - others) <= tolerance:
            return ConvergenceResult(policy, written, written / capacity, fractions[new], others)
    fractions = stream.fractions()
    others = statistics.fmean(f for sid, f in fractions.items() if sid != new)
    return ConvergenceResult(policy, None, None, fractions[new], others)


# ----------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--segment-mib",
        type=int_at_least(4),  # it must hold the largest test object (3.12 MB)
        default=256,
        help="allocator test segment (256 MiB; at least 4)",
    )
    parser.add_argument("--rounds", type=positive_int, default=20, help="churn rounds per allocator test (20)")
    parser.add_argument("--segments", type=positive_int, default=4, help="segments before the new one (4)")
    parser.add_argument("--objects-per-segment", type=positive_int, default=512, help="capacity of each (512)")
    parser.add_argument(
        "--tolerance",
        type=fraction,
        default=0.05,
        help="'filled up': within this (absolute) of the others' used fraction",
    )
    parser.add_argument("--seeds", type=positive_int, default=3, help="random placement runs (median reported)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    util = utilisation_suite(args.segment_mib * MiB, args.rounds, seed=1)
    object_size = 64 * KiB
    segment_size = args.objects_per_segment * object_size
    results = [converge("free_ratio_first", args.segments, segment_size, object_size, args.tolerance, 0)]
    randoms = [
        converge("random", args.segments, segment_size, object_size, args.tolerance, seed) for seed in range(args.seeds)
    ]
    ranked = sorted(randoms, key=lambda r: sys.maxsize if r.objects_written is None else r.objects_written)
    results.append(ranked[len(ranked) // 2])
    if args.json:
        print(
            json.dumps(
                {
                    "utilisation": [asdict(u) for u in util],
                    "convergence": [asdict(r) for r in results],
                    "random_runs": [r.objects_written for r in randoms],
                }
            )
        )
        return 0
    print(
        "allocator utilisation (requested bytes live at an allocation failure / segment size, "
        f"{args.segment_mib} MiB segment, {args.rounds} churn rounds)"
    )
    print(f"  {'':50}{'mean':>8}{'min':>8}{'ops/s':>12}")
    for u in util:
        print(f"  {u.name:50}{u.mean:>8.3f}{u.minimum:>8.3f}{u.allocations_per_s:>12,.0f}")
    capacity = (args.segments + 1) * args.objects_per_segment
    print(
        f"\nnew segment fill-up: {args.segments} full segments + 1 new, {args.objects_per_segment} objects "
        f"each (pool capacity {capacity:,} objects), until within {args.tolerance:.0%} of the others"
    )
    for r in results:
        label = r.policy + (f" (median of {args.seeds} seeds)" if r.policy == "random" else "")
        if r.objects_written is None:
            print(
                f"  {label:36} not within tolerance after {20 * capacity:,} objects "
                f"(new {r.new_fraction:.2f}, others {r.others_fraction:.2f})"
            )
        else:
            print(
                f"  {label:36} {r.objects_written:>8,} objects written = {r.pool_capacities:.2f} pool "
                f"capacities (new {r.new_fraction:.2f}, others {r.others_fraction:.2f})"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvpool bench placement",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
