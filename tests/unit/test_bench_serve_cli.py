"""``kvpool bench serve``'s arguments, refusals and plot writer (no cluster: every case here is refused
before one would start, or works on a report built by hand)."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import pytest

from kvpool.tools import bench_serve
from kvpool.tools.cli import build_parser
from kvpool.tools.serve_plot import write_plot


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "serve", *argv])


def test_defaults_point_at_the_shipped_trace_and_all_profiles() -> None:
    args = _args()
    assert Path(args.trace) == bench_serve.DEFAULT_TRACE
    assert bench_serve.DEFAULT_TRACE.is_file()
    assert args.model is None
    assert args.instances == 8
    assert args.routing == "random"
    assert args.rate_scale == sorted(bench_serve.DEFAULT_RATE_SCALES)


def test_rate_scales_parse_sorted_and_distinct() -> None:
    assert bench_serve.parse_rate_scales("2, 1,1,0.5") == [0.5, 1.0, 2.0]
    for bad in ("0", "-1,2", "x", "", "inf"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_serve.parse_rate_scales(bad)


def test_bad_option_values_stop_the_parser() -> None:
    for argv in (["--instances", "0"], ["--slo-ttft-s", "-1"], ["--routing", "nearest"], ["--capacity", "lots"]):
        with pytest.raises(SystemExit):
            _args(*argv)


def test_an_unknown_profile_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_serve.run(_args("--model", "gpt-5")) == 2
    err = capsys.readouterr().err
    assert "unknown model profile 'gpt-5'" in err
    assert "llama-3.1-8b" in err


def test_a_missing_or_bad_trace_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_serve.run(_args("--trace", str(tmp_path / "absent.jsonl"))) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert bench_serve.run(_args("--trace", str(bad))) == 2
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert bench_serve.run(_args("--trace", str(empty))) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:1: missing field" in err
    assert "holds no requests" in err


def _report() -> dict[str, object]:
    rows = [
        {"model": "m", "config": c, "rate_scale": s, "ttft_p90_s": p90}
        for c, base in (("none", 2.0), ("pool", 1.0))
        for s, p90 in ((1.0, base), (2.0, base * 3))
    ]
    return {"rows": rows, "models": {"m": {"slo_ttft_s": 2.0}}, "base_rate_rps": 4.0}


def test_plot_without_matplotlib_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes the import fail
    err = io.StringIO()
    assert not write_plot(_report(), str(tmp_path / "p.png"), err)
    assert "kvpool[plot]" in err.getvalue()
    assert not (tmp_path / "p.png").exists()


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "p.png"
    assert write_plot(_report(), str(out), io.StringIO())
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_refused_before_any_cluster_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bench_serve.importlib.util, "find_spec", lambda name: None)  # as without matplotlib
    assert bench_serve.run(_args("--plot", str(tmp_path / "p.png"))) == 2
    assert "kvpool[plot]" in capsys.readouterr().err
