"""The generated stubs must match the .proto files (regenerate with `make proto`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTOS = [
    "kvpool/proto/master.proto",
    "kvpool/proto/etcd/rpc.proto",
    "kvpool/proto/etcd/kv.proto",
    "kvpool/proto/etcd/auth.proto",
]


@pytest.mark.parametrize("proto", PROTOS)
def test_generated_stubs_are_fresh(proto: str, tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / Path(proto).parent).mkdir(parents=True)
    for sibling in (ROOT / "src" / proto).parent.glob("*.proto"):  # imports resolve within the folder
        shutil.copy(sibling, src / Path(proto).parent / sibling.name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{src}",
            f"--python_out={src}",
            f"--pyi_out={src}",
            f"--grpc_python_out={src}",
            str(src / proto),
        ],
        check=True,
    )
    stem = proto.removesuffix(".proto")
    for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
        fresh = (src / (stem + suffix)).read_text()
        committed = (ROOT / "src" / (stem + suffix)).read_text()
        assert fresh == committed, f"{stem}{suffix} is stale: run `make proto`"
