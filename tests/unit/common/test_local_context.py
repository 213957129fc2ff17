"""The running local cluster as the tools' default (common/local_context.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpool.common import local_context
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.local_context import LocalContext


@pytest.fixture(autouse=True)
def context_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "context.json"
    monkeypatch.setenv("KVPOOL_LOCAL_CONTEXT", str(path))
    return path


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_recorded_cluster_with_a_live_master_is_current(tmp_path: Path) -> None:
    written = LocalContext("127.0.0.1:5", str(tmp_path), "/tok", "c", [os.getpid()])
    local_context.write(written)
    assert local_context.current() == written
    assert local_context.resolve("local") == "127.0.0.1:5"
    assert local_context.resolve("10.0.0.1:1") == "10.0.0.1:1"


def test_a_record_whose_masters_are_gone_is_ignored(tmp_path: Path) -> None:
    local_context.write(LocalContext("127.0.0.1:5", str(tmp_path), master_pids=[_dead_pid()]))
    assert local_context.current() is None
    with pytest.raises(KvPoolError) as refused:
        local_context.resolve("local")
    assert refused.value.code == ErrorCode.UNAVAILABLE
    assert "kvpool local up" in str(refused.value)


def test_clear_removes_only_the_record_of_its_own_directory(tmp_path: Path, context_file: Path) -> None:
    local_context.write(LocalContext("127.0.0.1:5", str(tmp_path / "a"), master_pids=[os.getpid()]))
    assert not local_context.clear(str(tmp_path / "b"))  # another cluster's `down`
    assert context_file.exists()
    assert local_context.clear(str(tmp_path / "a"))
    assert not context_file.exists()


def test_a_damaged_record_is_no_cluster(context_file: Path) -> None:
    context_file.write_text("{not json")
    assert local_context.current() is None
