"""Failpoints (kvpool.common.failpoints) and the checked workload's histogram (kvpool.tools.workload)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from kvpool.common import failpoints
from kvpool.tools.workload import Histogram, WorkloadResult, expected_value


@pytest.fixture(autouse=True)
def _reset() -> object:
    yield
    failpoints.reload()


def test_parse() -> None:
    table = failpoints.parse("a=sleep:0.5, b=exit,c=raise, d")
    assert {k: (v.kind, v.seconds) for k, v in table.items()} == {
        "a": ("sleep", 0.5),
        "b": ("exit", 0.0),
        "c": ("raise", 0.0),
        "d": ("exit", 0.0),
    }
    with pytest.raises(ValueError, match="unknown failpoint action"):
        failpoints.parse("a=explode")


def test_inactive_failpoints_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPOOL_FAILPOINTS", "other=raise")
    failpoints.reload()
    failpoints.failpoint("mine")


def test_raise_and_sleep(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KVPOOL_FAILPOINTS", "boom=raise,nap=sleep:0.05")
    failpoints.reload()
    with pytest.raises(failpoints.FailpointError):
        failpoints.failpoint("boom")
    started = time.monotonic()
    failpoints.failpoint("nap")
    assert time.monotonic() - started >= 0.05
    assert "kvpool failpoint boom hit" in capsys.readouterr().err


def test_exit_stops_the_process_without_cleanup() -> None:
    code = "from kvpool.common.failpoints import failpoint\ntry:\n    failpoint('x')\nfinally:\n    print('cleanup')"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"KVPOOL_FAILPOINTS": "x=exit", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == failpoints.EXIT_CODE
    assert "cleanup" not in done.stdout
    assert "kvpool failpoint x hit" in done.stderr


def test_histogram_percentiles_within_5_percent() -> None:
    h = Histogram()
    for us in range(1, 10_001):
        h.record(us)
    assert h.percentile(50) == pytest.approx(5000, rel=0.05)
    assert h.percentile(99) == pytest.approx(9900, rel=0.05)
    merged = WorkloadResult(latency=dict(h.counts))
    merged.merge(WorkloadResult(latency=dict(h.counts), ops=3, errors={"TIMEOUT": 1}))
    assert merged.histogram().total == 20_000
    assert merged.errors == {"TIMEOUT": 1}


def test_expected_values_are_a_function_of_the_key() -> None:
    assert expected_value("k", 100) == expected_value("k", 100)
    assert expected_value("k", 100) != expected_value("j", 100)
    assert len(expected_value("k", 1 << 20)) == 1 << 20
