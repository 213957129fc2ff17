"""benchmarks/cpu_budget.py, briefly and for real: its CPU accounting counts only the timed blocks, its
hand-written READ frames are answered by the real store, and every figure it reports is there."""

from __future__ import annotations

import math
import os
import time

import pytest

from benchmarks import cpu_budget

pytestmark = pytest.mark.integration


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_the_cpu_meter_counts_the_timed_blocks_only() -> None:
    meter = cpu_budget.CpuMeter({"self": os.getpid()})
    with meter.timing():
        _burn(0.3)
    _burn(0.5)  # not timed: must not be counted
    with meter.timing():
        _burn(0.2)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert 0.5 <= meter.seconds < 1.0
    assert meter.process_s["self"] <= meter.seconds + 3 * tick  # the untimed 0.5 s would exceed this
    assert meter.process_s["self"] >= 0.1  # it was busy (even when sharing the cores with other tests)
    assert meter.machine_s >= meter.process_s["self"] - 3 * tick


@pytest.mark.slow
def test_a_short_run_reports_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    doc = cpu_budget.run(1, 0.2, (), lambda _message: None)

    ncpu = doc["ncpu"]
    assert isinstance(ncpu, int)
    rows = {(r["system"], r["op"], r["size"]): r for r in doc["batched"]}  # type: ignore[attr-defined]
    expected = {(c, "get", s) for s in cpu_budget.SIZES for c in ("ceiling", "ceiling_spread")} | {
        ("kvpool", op, s) for s in cpu_budget.SIZES for op in ("get", "put")
    }
    assert set(rows) == expected
    for key, row in rows.items():
        assert row["gbps"] > 0, key
        assert 0 < row["busy_cores"] <= ncpu * 1.05, key
        assert math.isclose(row["cpu_bound_gbps"], ncpu / row["core_s_per_gb"]), key
        names = {"client", "store", "master"} if key[0] == "kvpool" else {"client", "server"}
        assert set(row["process_cores"]) == names, key
    bounds = doc["bounds"]
    assert isinstance(bounds, dict)
    assert set(bounds) == {f"{op}_{s >> 20}MiB" for s in cpu_budget.SIZES for op in ("get", "put")}
    layers = [(r["layer"], r["p50_us"], r["mean_us"]) for r in doc["single_get_64KiB"]]  # type: ignore[attr-defined]
    assert [name for name, _, _ in layers] == ["raw_rpc", "bare_frames", "transport", "pool_client"]
    assert all(p50 > 0 and mean > 0 for _, p50, mean in layers)

    cpu_budget._print_table(doc)
    table = capsys.readouterr().out
    assert "cpu-bound" in table
    assert "pool_client" in table
