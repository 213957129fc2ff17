"""The peer benchmark's first-read workloads and the ``first_read`` flag of its get rows."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import pytest

PEERS = Path(__file__).resolve().parents[2] / "benchmarks" / "peers"
sys.path.insert(0, str(PEERS))  # run.py and the workers import _workload by its bare name

import _workload  # noqa: E402


def _load_run_py() -> ModuleType:
    """benchmarks/peers/run.py under a name of its own (a bare ``run`` could be any module)."""
    spec = importlib.util.spec_from_file_location("kvpool_peers_run", PEERS / "run.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


peers_run = _load_run_py()


class FakeStoreBackend(_workload.Backend):
    """A fake system (an in-memory dict): it records every key read, so the test can tell first reads
    from re-reads. The real systems run only in the benchmark itself (they need the peers' venv)."""

    name = "fake"

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.reads: list[str] = []

    def put(self, keys: Sequence[str], offsets: Sequence[int], size: int, single: bool) -> list[int]:
        self.values.update(dict.fromkeys(keys, size))
        return [0] * len(keys)

    def get(self, keys: Sequence[str], offsets: Sequence[int], size: int, single: bool) -> list[int]:
        self.reads += keys
        return [self.values.get(key, -1) for key in keys]

    def get_bytes(self, key: str) -> int:
        self.reads.append(key)
        return self.values.get(key, -1)

    def remove(self, keys: Sequence[str]) -> None:
        for key in keys:
            self.values.pop(key, None)


@pytest.mark.parametrize(("op", "batch"), [("get_first", 1), ("get_bytes", 1), ("get_first", 128)])
def test_a_first_read_workload_reads_every_key_once_and_only_keys_it_wrote(op: str, batch: int) -> None:
    backend = FakeStoreBackend()
    engine = _workload.Engine(backend)
    engine.prepare({"ns": "t", "sizes": [65536], "dataset_bytes": 1 << 20, "exists_keys": 4})
    engine.run({"op": "get", "size": 65536, "batch": 1, "seconds": 0.01})  # re-reads of the dataset
    earlier_reads = set(backend.reads)
    backend.reads.clear()
    result = engine.run({"op": op, "size": 65536, "batch": batch, "seconds": 0.05, "window_bytes": 8 << 20})
    assert result["op"] == op
    assert result["keys"] == len(backend.reads) > 0
    assert result["errors"] == 0
    assert len(set(backend.reads)) == len(backend.reads), "a key was read twice"
    assert not set(backend.reads) & earlier_reads, "a first read re-read a key read before"
    assert not backend.values.keys() & set(backend.reads), "the first-read keys were not removed after"


def test_every_get_row_says_whether_it_is_a_first_read() -> None:
    sample = {"gbps": 1.0, "ops_per_s": 10.0, "p50_us": 1.0, "p99_us": 2.0, "errors": 0}
    samples = {("kvpool", op, 65536, 1): [dict(sample)] for op in ("get", "get_first", "get_bytes", "put")} | {
        ("redis", "get_first", 65536, 1): [dict(sample)]
    }
    rows = peers_run.summarise(samples, {("kvpool", "get_same_node", 1 << 20, 32): "no shm"})
    flags = {(r["system"], r["op"]): r.get("first_read") for r in rows}
    assert flags == {
        ("kvpool", "get"): False,
        ("kvpool", "get_first"): True,
        ("kvpool", "get_bytes"): True,
        ("kvpool", "put"): None,
        ("redis", "get_first"): True,
        ("kvpool", "get_same_node"): False,
    }
    by_workload = {(r["op"], r["size"], r["batch"]): r for r in peers_run.ratios(rows)}
    assert by_workload[("get_first", 65536, 1)]["first_read"] is True
    assert by_workload[("get", 65536, 1)]["first_read"] is False
    assert "first_read" not in by_workload[("put", 65536, 1)]
