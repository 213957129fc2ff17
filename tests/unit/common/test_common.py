"""common/: sizes, errors, config-to-argparse, grants, page keys."""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from kvpool.common import grants
from kvpool.common.config import add_arguments, check_ports, from_args, option
from kvpool.common.envs import EnvVar
from kvpool.common.errors import ErrorCode, KvPoolError, as_code, batch_failure, strerror
from kvpool.common.keys import Namespace, namespace_seed, page_keys
from kvpool.common.units import format_size, parse_duration, parse_size
from kvpool.master.config import MasterConfig
from kvpool.store.config import StoreConfig


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("4GiB", 4 << 30),
        ("4g", 4 << 30),
        ("512MB", 512_000_000),
        ("1.5KiB", 1536),
        ("4096", 4096),
        (7, 7),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "4 parsecs", "-1", "GiB", "1..2k"])
def test_parse_size_rejects_garbage_with_a_clear_message(bad: str) -> None:
    with pytest.raises(ValueError, match="bad size"):
        parse_size(bad)


def test_durations_and_format() -> None:
    assert parse_duration("500ms") == 0.5
    assert parse_duration("2m") == 120.0
    assert format_size(3 << 30) == "3.0 GiB"


def test_error_codes_are_negative_and_ranged() -> None:
    assert ErrorCode.OK == 0
    assert all(code < 0 for code in ErrorCode if code != ErrorCode.OK)
    assert -299 <= ErrorCode.NO_SPACE <= -200
    assert strerror(-100) == "OBJECT_NOT_FOUND"
    assert strerror(-99999) == "UNKNOWN_ERROR(-99999)"
    assert as_code(-99999) == ErrorCode.INTERNAL
    assert "NO_SPACE: full" in str(KvPoolError(ErrorCode.NO_SPACE, "full"))


def test_a_batch_failure_carries_the_first_failure_and_names_them_all() -> None:
    error = batch_failure("put failed", [0, ErrorCode.NO_SPACE, 0, ErrorCode.TIMEOUT, ErrorCode.NO_SPACE])
    assert error.code == ErrorCode.NO_SPACE
    assert str(error) == "NO_SPACE: put failed: NO_SPACE, TIMEOUT"
    assert batch_failure("get failed", [5, 7]).code == ErrorCode.INTERNAL  # wrong sizes, no code


@dataclasses.dataclass
class _Cfg:
    size: int = option(1 << 20, "the size", parse=parse_size)
    name: str = option("x", "a name", choices=("x", "y"))
    fast: bool = option(False, "go fast")

    def __post_init__(self) -> None:
        if self.size <= 0:
            raise ValueError("size must be > 0")


def test_config_fields_become_options_with_docs() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, _Cfg)
    assert "the size" in parser.format_help()
    cfg = from_args(_Cfg, parser.parse_args(["--size", "2MiB", "--fast"]))
    assert cfg == _Cfg(size=2 << 20, name="x", fast=True)
    with pytest.raises(SystemExit):
        parser.parse_args(["--name", "z"])
    with pytest.raises(KvPoolError, match="size must be") as refused:  # the CLI prints it, exit code 2
        from_args(_Cfg, parser.parse_args(["--size", "0"]))
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT


_SIZE_ENV = EnvVar("KVPOOL_TEST_CFG_SIZE", "", "a size, for this test only")


@dataclasses.dataclass
class _EnvCfg:
    size: int = option(1 << 20, "the size", parse=parse_size, env=_SIZE_ENV)


def test_a_bad_environment_value_names_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, _EnvCfg)
    monkeypatch.setenv(_SIZE_ENV.name, "2MiB")
    assert from_args(_EnvCfg, parser.parse_args([])).size == 2 << 20
    monkeypatch.setenv(_SIZE_ENV.name, "lots")
    with pytest.raises(KvPoolError, match="KVPOOL_TEST_CFG_SIZE='lots': bad size") as refused:
        from_args(_EnvCfg, parser.parse_args([]))
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT


def test_ports_are_checked() -> None:
    check_ports(port=0, rpc_port=65535)
    check_ports(metrics_port=-1, off=-1)
    with pytest.raises(ValueError, match="--rpc-port must be 0-65535, got 65536"):
        check_ports(port=1, rpc_port=65536)
    with pytest.raises(ValueError, match=r"--metrics-port must be 0-65535 or -1 \(off\), got -2"):
        check_ports(metrics_port=-2, off=-1)
    with pytest.raises(ValueError, match="--port must be 0-65535, got -1"):
        StoreConfig(master="m:1", port=-1)
    with pytest.raises(ValueError, match="--port must be 0-65535, got 70000"):
        MasterConfig(port=70000)


def test_grants_verify_and_bind_every_field() -> None:
    secret = grants.new_secret()
    grant = grants.make_grant(secret, grants.GrantOp.WRITE, 7, 4096, 100, 123, b"key")
    assert grants.verify(secret, grant)
    assert not grants.verify(grants.new_secret(), grant)
    for change in (
        {"offset": 0},
        {"length": 101},
        {"segment_id": 8},
        {"key": b"kex"},
        {"expiry_ms": 124},
        {"op": grants.GrantOp.READ},
    ):
        assert not grants.verify(secret, grant._replace(**change)), change


# Test vectors from SGLang's pure-Python page-hash chain (docs/sglang.md).
def test_page_keys_match_sglang_vectors() -> None:
    assert page_keys(list(range(8)), 4) == [
        "baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe",
        "01414b052706d93bd0f1f1646c0e8ca2fa8ef5efd7bcc99f7a1cee8eb11ad052",
    ]


def test_page_keys_chain_partial_page_and_prior() -> None:
    keys = page_keys(list(range(10)), 4)
    assert len(keys) == 3  # the partial last page is hashed too
    assert page_keys(list(range(8, 10)), 4, prior=keys[1]) == [keys[2]]
    assert page_keys(list(range(8)), 4, prior=namespace_seed("m", None))[0] != keys[0]
    assert namespace_seed(None, None) is None
    with pytest.raises(ValueError, match="page_size"):
        page_keys([1], 0)


def test_namespace_object_keys_like_sglang_mooncake_backend() -> None:
    h = "ab" * 32
    assert Namespace(model="org/m", tp_rank=1).object_keys(h) == [f"org-m_{h}_1_k", f"org-m_{h}_1_v"]
    assert Namespace(mla=True).object_keys(h) == [f"{h}__k"]
    assert Namespace(tag="t", model="m", tp_rank=0, pp_rank=2, pp_size=4).object_keys(h)[1] == f"t_m_{h}_0_2_v"


def test_an_unknown_log_level_is_reported_and_logging_goes_on_at_info() -> None:
    code = "from kvpool.common.log import get_logger, setup_logging; setup_logging('t'); get_logger('x').info('hello')"
    env = {**os.environ, "KVPOOL_LOG_LEVEL": "LOUD"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "unknown log level 'LOUD' (KVPOOL_LOG_LEVEL): logging at INFO" in done.stderr
    assert "x: hello" in done.stderr
