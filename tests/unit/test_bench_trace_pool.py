"""bench_trace_pool: how the local cluster is sized for a trace replay (no processes started)."""

from __future__ import annotations

import pytest

from kvpool.tools import bench_trace_pool as btp


def test_the_dram_holds_exactly_the_oracles_blocks() -> None:
    plan = btp.plan_cluster(3_000_000, 1024, 2, working_set=43_924)
    assert plan.dram_bytes == 5859 * 1024  # 3M tokens // 512 blocks
    assert len(plan.dram) == 2
    assert all(size % 1024 == 0 for size in plan.dram)
    args = dict(zip(plan.master_args[::2], plan.master_args[1::2], strict=True))
    assert args["--eviction-high-watermark"] == "1.0"
    assert 0.99 <= float(args["--eviction-target"]) < 1.0
    assert "--eviction-sample-factor" not in args  # the master's default: sampled, with its carried pool
    assert plan.ssd == ()


def test_exact_lru_stays_selectable() -> None:
    plan = btp.plan_cluster(3_000_000, 1024, 2, working_set=43_924, sample_factor=0)
    args = dict(zip(plan.master_args[::2], plan.master_args[1::2], strict=True))
    assert args["--eviction-sample-factor"] == "0"


def test_unlimited_capacity_holds_the_working_set() -> None:
    plan = btp.plan_cluster(None, 1024, 2, working_set=10_000)
    assert plan.dram_bytes >= 10_000 * 1024


def test_small_pools_use_fewer_stores_and_tiny_ones_are_refused() -> None:
    assert len(btp.plan_cluster(None, 1024, 4, working_set=1500).dram) == 1
    with pytest.raises(ValueError, match="1 MiB"):
        btp.plan_cluster(200 * 512, 1024, 1, working_set=1000)


def test_ssd_plan_holds_the_working_set_and_demotes_in_the_background() -> None:
    plan = btp.plan_cluster(2_249_000, 1024, 2, working_set=43_924, ssd=True)
    assert plan.dram_bytes == 4392 * 1024
    assert sum(plan.ssd) >= 43_924 * 1024
    args = dict(zip(plan.master_args[::2], plan.master_args[1::2], strict=True))
    assert float(args["--eviction-high-watermark"]) < 1.0
    assert args["--ssd-high-watermark"] == "1.0"
