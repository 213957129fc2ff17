"""Numeric and size options of every command are checked while the arguments are parsed: a value the
command cannot run with exits with argparse's usage error (code 2) naming the option, before any process
starts, instead of a traceback (a division by zero, an empty median) or a loop that never ends."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool.tools import admin, argtypes, cli

ROOT = Path(__file__).resolve().parents[2]

KVPOOL_BAD = [
    (["bench", "metadata", "--seconds", "0"], "--seconds"),
    (["bench", "metadata", "--runs", "0"], "--runs"),
    (["bench", "master-memory", "--objects", "5"], "--objects"),
    (["bench", "master-memory", "--seconds", "-1"], "--seconds"),
    (["bench", "placement", "--segment-mib", "1"], "--segment-mib"),
    (["bench", "placement", "--rounds", "0"], "--rounds"),
    (["bench", "placement", "--segments", "0"], "--segments"),
    (["bench", "placement", "--objects-per-segment", "0"], "--objects-per-segment"),
    (["bench", "placement", "--seeds", "0"], "--seeds"),
    (["bench", "placement", "--tolerance", "-1"], "--tolerance"),
    (["bench", "transfer", "--seconds", "0"], "--seconds"),
    (["bench", "transfer", "--runs", "0"], "--runs"),
    (["bench", "transfer", "--connections", "0"], "--connections"),
    (["bench", "transfer", "--sizes", "64KiB,foo"], "--sizes"),
    (["bench", "transfer", "--sizes", ","], "--sizes"),
    (["bench", "transfer", "--store-size", "foo"], "--store-size"),
    (["bench", "prefetch", "--runs", "0"], "--runs"),
    (["bench", "batch", "--keys", "0"], "--keys"),
    (["bench", "batch", "--value-size", "0"], "--value-size"),
    (["local", "up", "--ready-timeout", "0"], "--ready-timeout"),
    (["bench", "prefetch", "--pages", "0"], "--pages"),
    (["bench", "prefetch", "--io-threads", "0"], "--io-threads"),
    (["bench", "prefetch", "--poll-ms", "0"], "--poll-ms"),
    (["bench", "prefetch", "--compute-ms", "-5"], "--compute-ms"),
    (["bench", "prefetch", "--object-size", "0"], "--object-size"),
    (["bench", "soak", "--duration", "nan"], "--duration"),
    (["bench", "soak", "--clients", "0"], "--clients"),
    (["bench", "soak", "--threads", "0"], "--threads"),
    (["bench", "soak", "--stores", "0"], "--stores"),
    (["bench", "soak", "--value-bytes", "0"], "--value-bytes"),
    (["bench", "soak", "--timeout", "0"], "--timeout"),
    (["bench", "failover", "--runs", "0"], "--runs"),
    (["bench", "failover", "--objects", "0"], "--objects"),
    (["bench", "failover", "--leader-ttl-s", "inf"], "--leader-ttl-s"),
    (["bench", "trace", "--trace", "t.jsonl", "--stores", "0"], "--stores"),
    (["bench", "trace", "--trace", "t.jsonl", "--instances", "0"], "--instances"),
    (["demo", "--instances", "0"], "--instances"),
    (["demo", "--sessions", "0"], "--sessions"),
    (["demo", "--turns", "0"], "--turns"),
    (["demo", "--stores", "0"], "--stores"),
    (["demo", "--system-tokens", "-5"], "--system-tokens"),
    (["demo", "--turn-tokens", "0"], "--turn-tokens"),
    (["demo", "--page-bytes", "foo"], "--page-bytes"),
    (["local", "up", "--stores", "-1"], "--stores"),
    (["local", "up", "--size", "foo"], "--size"),
]

ADMIN_BAD = [
    (["--timeout", "0", "status"], "--timeout"),
    (["status", "--timeout", "-1"], "--timeout"),
    (["rebalance", "--max-moves", "-1"], "--max-moves"),
    (["rebalance", "--tolerance", "5"], "--tolerance"),
    (["drain", "node1", "--wait", "--timeout", "-1"], "--timeout"),
]


BAD = [("kvpool", cli.build_parser, argv, option) for argv, option in KVPOOL_BAD] + [
    ("kvpool-admin", admin.build_parser, argv, option) for argv, option in ADMIN_BAD
]


@pytest.mark.parametrize(
    ("build_parser", "argv", "option"), [b[1:] for b in BAD], ids=[f"{b[0]} {' '.join(b[2])}" for b in BAD]
)
def test_a_command_refuses_a_value_it_cannot_run_with(
    build_parser: Callable[[], argparse.ArgumentParser],
    argv: list[str],
    option: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}" in err, err
    assert "Traceback" not in err


def test_the_defaults_and_good_values_parse_to_what_the_commands_use() -> None:
    parser = cli.build_parser()
    transfer = parser.parse_args(["bench", "transfer"])
    assert transfer.sizes == [64 << 10, 1 << 20, 4 << 20]
    assert parser.parse_args(["bench", "transfer", "--sizes", "4KiB, 2MiB"]).sizes == [4096, 2 << 20]
    assert parser.parse_args(["demo"]).page_bytes == 64 << 10
    assert parser.parse_args(["bench", "prefetch", "--object-size", "1MiB"]).object_size == 1 << 20
    assert parser.parse_args(["local", "up", "--stores", "0", "--size", "1GiB"]).size == "1GiB"
    assert parser.parse_args(["bench", "master-memory", "--objects", "20000"]).objects == 20_000
    assert admin.build_parser().parse_args(["rebalance", "--max-moves", "0"]).max_moves == 0


@pytest.mark.parametrize(
    ("parse", "text", "message"),
    [
        (argtypes.positive_int, "1.5", "not a whole number"),
        (argtypes.positive_int, "0", "must be >= 1"),
        (argtypes.non_negative_int, "-1", "must be >= 0"),
        (argtypes.positive_float, "abc", "not a number"),
        (argtypes.positive_float, "nan", "finite"),
        (argtypes.positive_float, "-0.0", "must be > 0"),
        (argtypes.non_negative_float, "-inf", "finite"),
        (argtypes.fraction, "1.01", "between 0 and 1"),
        (argtypes.size_bytes, "0", "at least 1 byte"),
        (argtypes.size_bytes, "12 parsecs", "bad size"),
    ],
)
def test_each_type_says_what_is_wrong(parse: object, text: str, message: str) -> None:
    assert callable(parse)
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse(text)


def test_each_type_keeps_a_good_value() -> None:
    assert argtypes.positive_int("7") == 7
    assert argtypes.non_negative_int("0") == 0
    assert math.isclose(argtypes.positive_float("0.25"), 0.25)
    assert argtypes.non_negative_float("0") == 0.0
    assert argtypes.fraction("1") == 1.0
    assert argtypes.size("2MiB") == "2MiB"
    assert argtypes.sizes_bytes("1KiB,2") == [1024, 2]


@pytest.mark.parametrize(
    ("script", "argv"),
    [
        ("benchmarks/peers/run.py", ["--runs", "-1"]),
        ("benchmarks/peers/run.py", ["--seconds", "0"]),
        ("benchmarks/cpu_budget.py", ["--runs", "0"]),
        ("benchmarks/prefill_with_pool.py", ["--layers", "0"]),
        ("benchmarks/dataplane_quick.py", ["--window", "0"]),
    ],
)
def test_the_benchmark_scripts_refuse_bad_values_before_starting_anything(script: str, argv: list[str]) -> None:
    # Its own process group: were the value accepted, whatever the benchmark started is killed with it.
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / script), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 2, err[-2000:]
    assert argv[0] in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["master", "--num-shards", "0"], "num_shards must be >= 1"),
        (["master", "--port", "70000"], "--port must be 0-65535, got 70000"),
        (["store", "--master", "127.0.0.1:1", "--size", "0"], "--size must be at least 1 MiB"),
        (["store", "--master", "127.0.0.1:1", "--metrics-port", "-2"], "--metrics-port must be 0-65535 or -1"),
    ],
)
def test_a_service_refuses_its_config_with_a_message_not_a_traceback(argv: list[str], message: str) -> None:
    """The config's own checks (``__post_init__``) run after parsing: the service exits 2 with their
    message, before it binds or connects to anything."""
    done = subprocess.run([sys.executable, "-m", "kvpool.tools.cli", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr[-2000:]
    assert f"INVALID_ARGUMENT: {message}" in done.stderr
    assert "Traceback" not in done.stderr
