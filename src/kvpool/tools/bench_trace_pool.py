"""``kvpool bench trace`` against a real pool: a local cluster sized like the oracle, or ``--master ADDR``.

This module is the pool factory of :mod:`kvpool.tools.bench_trace` (which owns the replay, the simulators
and the report). Without ``--master`` it starts a :class:`~kvpool.tools.local_cluster.LocalCluster` whose DRAM
holds exactly as many blocks as the oracle: ``capacity_tokens // 512 * block_bytes`` bytes, split over
``--stores`` segments (block-aligned, so the allocator wastes nothing). With no ``--capacity`` the pool holds
the whole working set of the replayed trace.

Why the master runs with ``--eviction-high-watermark 1.0``: by default the master evicts above 90 % of the
pool down to 85 %, so a pool of N blocks would behave like an LRU of 0.85-0.90 N blocks and trail the oracle.
With the watermark at 1.0 eviction runs only when an allocation fails, and it frees down to a target just
under 1.0 (``EVICT_SLACK`` of the pool, at least a few blocks, so that one eviction serves several puts
instead of one scan per block). The master evicts with its default sampled LRU, whose pool of carried
candidates picks near-LRU victims even for evictions this small (decision 0086); ``--eviction-sample-factor 0``
makes each eviction rank every object instead (the exact LRU). The pool then behaves as an LRU of the requested
capacity, less the slack.

With ``--ssd`` each store also gets an SSD tier (``--ssd-dir`` in the cluster's temp dir, ``--ssd-size`` its
share of ``--ssd-capacity``, by default the whole working set, plus ``SSD_MARGIN``). DRAM then runs with the
master's normal background eviction (``SSD_DRAM_WATERMARKS``): evicted blocks are demoted to SSD while the
replay goes on, and the SSD tier evicts only when full (its watermark is 1.0, like the DRAM's above). The
report adds the oracle at unlimited capacity, which such a run should approach.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool.tools import bench_trace
from kvpool.tools.argtypes import non_negative_int, positive_int
from kvpool.tools.trace import BLOCK_TOKENS, Request, capacity_blocks, load_trace, simulate_global

__all__ = ["ClusterPlan", "EVICT_SLACK", "TracePoolFactory", "add_arguments", "plan_cluster", "run"]

MIN_SEGMENT = 1 << 20
"""Smallest store segment (StoreConfig)."""
EVICT_SLACK = 0.005
"""Fraction of the pool one allocation-failure eviction frees (at least ``MIN_SLACK_BLOCKS`` blocks)."""
MIN_SLACK_BLOCKS = 4
UNLIMITED_MARGIN = 1.02
"""Unlimited capacity: the working set plus this margin (no eviction at all)."""
SSD_MARGIN = 1.05
"""The SSD tier holds the working set plus this margin (an object may briefly be on SSD twice while a
demotion of it is being abandoned, and the per-store split is uneven by a few blocks)."""
SSD_DRAM_WATERMARKS = (
    "--eviction-high-watermark",
    "0.7",
    "--eviction-target",
    "0.6",
    "--demote-max-pending",
    "0.5",
    "--eviction-interval-s",
    "0.01",
)
"""DRAM with an SSD tier: demote in the background early enough that puts never wait for a demotion."""


@dataclass(frozen=True)
class ClusterPlan:
    """The local cluster of one run: DRAM (and SSD) bytes per store and the master's arguments."""

    dram: tuple[int, ...]
    ssd: tuple[int, ...] = ()
    master_args: tuple[str, ...] = ()

    @property
    def dram_bytes(self) -> int:
        return sum(self.dram)


def working_set_blocks(trace: list[Request]) -> int:
    """Distinct blocks of the trace: what an unlimited cache ends up holding."""
    return len({h for req in trace for h in req.hash_ids})


def _split(total: int, parts: int, unit: int) -> tuple[int, ...]:
    """``total`` units split into ``parts`` near-equal shares, in bytes of ``unit`` each."""
    base, extra = divmod(total, parts)
    return tuple((base + (1 if i < extra else 0)) * unit for i in range(parts))


def plan_cluster(
    capacity_tokens: int | None,
    block_bytes: int,
    stores: int,
    working_set: int,
    ssd_tokens: int | None = None,
    ssd: bool = False,
    sample_factor: int | None = None,
) -> ClusterPlan:
    """Size the cluster so that its DRAM holds ``capacity_tokens // 512`` blocks (see the module doc).
    ``sample_factor``: the master's ``--eviction-sample-factor`` (None: its default, sampled; 0: exact LRU)."""
    blocks = capacity_blocks(capacity_tokens)
    if blocks is None:
        blocks = int(working_set * UNLIMITED_MARGIN) + MIN_SLACK_BLOCKS
    # Every segment is at least 1 MiB: use fewer stores rather than a bigger pool than asked for.
    stores = max(1, min(stores, blocks * block_bytes // MIN_SEGMENT))
    dram = _split(blocks, stores, block_bytes)
    if min(dram) < MIN_SEGMENT:
        raise ValueError(
            f"a pool of {blocks:,} blocks of {block_bytes:,} B is below the 1 MiB a store "
            "needs: raise --block-bytes or --capacity"
        )
    args: tuple[str, ...]
    sampling = () if sample_factor is None else ("--eviction-sample-factor", str(sample_factor))
    if not ssd:
        slack = max(EVICT_SLACK, MIN_SLACK_BLOCKS / blocks)
        args = ("--eviction-high-watermark", "1.0", "--eviction-target", f"{1.0 - slack:.6f}", *sampling)
        return ClusterPlan(dram, (), args)
    ssd_blocks = capacity_blocks(ssd_tokens) if ssd_tokens is not None else working_set
    assert ssd_blocks is not None
    ssd_share = _split(int(ssd_blocks * SSD_MARGIN) + MIN_SLACK_BLOCKS * stores, stores, block_bytes)
    # The default sampled LRU: a DRAM victim is demoted, not lost, so exact ranking buys little, and a full
    # scan would also walk every SSD-only object on each pass.
    args = (*SSD_DRAM_WATERMARKS, "--ssd-high-watermark", "1.0", "--ssd-eviction-target", "0.99", *sampling)
    return ClusterPlan(dram, ssd_share, args)


@dataclass
class TracePoolFactory:
    """``pool_factory`` for bench_trace.run: a PoolClient on ``--master`` or on a local cluster it starts."""

    plan: ClusterPlan | None
    notes: dict[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def __call__(self, args: argparse.Namespace) -> Iterator[bench_trace.PoolLike]:
        from kvpool.client import ClientConfig, PoolClient

        config = ClientConfig(timeout_s=60.0, use_shm=False)
        if args.master:
            with PoolClient(args.master, config=config) as pool:
                yield pool
                self._collect(pool)
            return
        assert self.plan is not None
        with self._cluster(args) as master, PoolClient(master, config=config) as pool:
            _wait_mounted(pool, len(self.plan.dram) + len(self.plan.ssd))
            yield pool
            self._collect(pool)

    @contextlib.contextmanager
    def _cluster(self, args: argparse.Namespace) -> Iterator[str]:
        from kvpool.tools.local_cluster import LocalCluster

        plan = self.plan
        assert plan is not None
        with tempfile.TemporaryDirectory(prefix="kvpool-trace-") as tmp:
            cluster = LocalCluster(stores=0, base_dir=Path(tmp) / "cluster", master_args=plan.master_args)
            try:
                cluster.start()
                for i, size in enumerate(plan.dram):
                    extra: tuple[str, ...] = ()
                    if plan.ssd:
                        extra = ("--ssd-dir", str(Path(tmp) / f"ssd-{i}"), "--ssd-size", str(plan.ssd[i]))
                    cluster.add_store(size=str(size), extra=extra)
                self.notes.update(
                    stores=len(plan.dram),
                    pool_dram_bytes=plan.dram_bytes,
                    pool_ssd_bytes=sum(plan.ssd),
                    master_args=" ".join(plan.master_args),
                )
                yield cluster.master
            finally:
                cluster.stop()

    def _collect(self, pool: Any) -> None:
        """The master's counters at the end of the replay (evictions, demotions...)."""
        try:
            stats = pool.stats()
        except Exception as exc:  # the report still has the hit rates
            self.notes["pool_stats_error"] = str(exc)
            return
        self.notes.update(pool_objects=stats.objects, pool_evictions=stats.evictions)
        for name in (
            "demotions",
            "promotions",
            "dram_dropped",
            "dram_dropped_urgent",
            "ssd_used_bytes",
            "ssd_evictions",
            "demote_failures",
        ):
            if name in stats.extra:
                self.notes[f"pool_{name}"] = int(stats.extra[name])


def _wait_mounted(pool: Any, segments: int, timeout: float = 60.0) -> None:
    """A store writes its ready file before it mounts: wait until the master has every segment, so the
    first puts do not fail for want of space."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if len(pool.stats(timeout=5.0).segments) >= segments:
                return
        except Exception:  # the master is still starting: retry until the deadline
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the local cluster did not mount {segments} segments in {timeout:.0f} s")
        time.sleep(0.05)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    bench_trace.add_arguments(parser)
    parser.add_argument(
        "--master",
        default=None,
        help="replay against this running cluster (host:port or etcd://...) instead of "
        "starting a local one sized for --capacity (`local`: the cluster `kvpool local up` started)",
    )
    parser.add_argument(
        "--in-memory",
        action="store_true",
        help="replay against the in-memory LRU (no cluster; a check of the driver)",
    )
    parser.add_argument("--stores", type=positive_int, default=2, help="stores of the local cluster (2)")
    parser.add_argument("--ssd", action="store_true", help="give each store an SSD tier; --capacity is then the DRAM")
    parser.add_argument(
        "--ssd-capacity",
        type=bench_trace.parse_token_count,
        default=None,
        metavar="TOKENS",
        help="SSD tier in tokens over all stores (default: the trace's working set)",
    )
    parser.add_argument(
        "--eviction-sample-factor",
        type=non_negative_int,
        default=None,
        help="the local master's --eviction-sample-factor (default: the master's own, sampled LRU; 0 = exact LRU)",
    )


def run(args: argparse.Namespace) -> int:
    """``kvpool bench trace``: the replay of bench_trace.run with this module's pool."""
    if args.in_memory:
        args.master = None
        return bench_trace.run(args)
    from kvpool.common import local_context

    args.master = local_context.resolve(args.master)
    factory = TracePoolFactory(None)
    trace: list[Request] = []
    if not args.master:
        try:
            trace = load_trace(args.trace, args.limit_requests)
        except (OSError, ValueError):
            return bench_trace.run(args)  # reports the bad trace the usual way
        ws = working_set_blocks(trace)
        try:
            factory.plan = plan_cluster(
                args.capacity,
                args.block_bytes,
                args.stores,
                ws,
                args.ssd_capacity,
                args.ssd,
                sample_factor=args.eviction_sample_factor,
            )
        except ValueError as exc:
            print(f"kvpool bench trace: {exc}", file=sys.stderr)
            return 2
        factory.notes["working_set_blocks"] = ws

    def extra() -> dict[str, Any]:
        notes = dict(factory.notes)
        if args.ssd and trace:
            ssd_tokens = args.ssd_capacity
            if ssd_tokens is None:
                ssd_tokens = notes["working_set_blocks"] * BLOCK_TOKENS
            total = (args.capacity or 0) + ssd_tokens
            notes["oracle_dram_ssd_hit"] = simulate_global(trace, total).block_hit_rate
            notes["oracle_unlimited_hit"] = simulate_global(trace, None).block_hit_rate
        return notes

    return bench_trace.run(args, factory, extra)
