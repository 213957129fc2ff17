"""Mooncake Store processes for the peer benchmark; runs INSIDE benchmarks/peers/.venv-mooncake.

``mooncake_worker.py store --master 127.0.0.1:P --segment BYTES``
    a store process: ``setup(..., global_segment_size=BYTES, protocol="tcp", metadata "P2PHANDSHAKE")``;
    prints one JSON line ``{"ok": true, "ready": ...}`` once mounted, then serves until stdin closes or
    it is signalled.
``mooncake_worker.py client --master 127.0.0.1:P [--spec JSON]``
    a client process with no segment of its own (``global_segment_size=0``) and two registered 32 MiB
    buffers; answers the workload commands of ``_workload.py`` (JSON lines on stdin, or the command list
    ``--spec``). Uses the zero-copy forms: ``register_buffer`` + ``put_from``/``get_into`` (single) and
    ``batch_put_from``/``batch_get_into`` (batched), ``is_exist`` and ``batch_is_exist``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _workload import Backend, Result, serve  # noqa: E402


def _store_cls() -> Any:
    from mooncake.store import MooncakeDistributedStore

    return MooncakeDistributedStore


def _setup(store: Any, master: str, segment: int, local_buffer: int) -> None:
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, local_buffer, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")


class MooncakeBackend(Backend):
    name = "mooncake"

    def __init__(self, master: str, local_buffer: int) -> None:
        super().__init__()
        self.store = _store_cls()()
        _setup(self.store, master, 0, local_buffer)
        for buf in (self.src, self.dst):
            rc = self.store.register_buffer(buf.ptr, buf.size)
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")

    def info(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {
            "version": version("mooncake-transfer-engine-non-cuda"),
            "hostname": self.store.get_hostname(),
        }

    def put(self, keys: Sequence[str], offsets: Sequence[int], size: int, single: bool) -> Result:
        base = self.src.ptr
        if single:
            return [self.store.put_from(keys[0], base + offsets[0], size)]
        return list(self.store.batch_put_from(keys, [base + o for o in offsets], [size] * len(keys)))

    def get(self, keys: Sequence[str], offsets: Sequence[int], size: int, single: bool) -> Result:
        base = self.dst.ptr
        if single:
            return [self.store.get_into(keys[0], base + offsets[0], size)]
        return list(self.store.batch_get_into(keys, [base + o for o in offsets], [size] * len(keys)))

    def get_bytes(self, key: str) -> int:
        value = self.store.get(key)  # bytes; empty where the key is missing
        return len(value) if value else -1

    def exists(self, keys: Sequence[str], single: bool) -> Result:
        if single:
            return [self.store.is_exist(keys[0])]
        return list(self.store.batch_is_exist(keys))

    def remove(self, keys: Sequence[str]) -> None:
        self.store.batch_remove(list(keys), True)

    def close(self) -> None:
        for buf in (self.src, self.dst):
            self.store.unregister_buffer(buf.ptr)
        self.store.close()


def run_store(master: str, segment: int, local_buffer: int) -> int:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    store = _store_cls()()
    try:
        _setup(store, master, segment, local_buffer)
    except Exception as exc:
        proto.write(json.dumps({"ok": False, "error": str(exc)}) + "\n")
        return 1
    proto.write(
        json.dumps(
            {
                "ok": True,
                "ready": "mooncake-store",
                "pid": os.getpid(),
                "hostname": store.get_hostname(),
                "segment": segment,
            }
        )
        + "\n"
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        sys.stdin.read()  # serve until the orchestrator closes our stdin (or signals us)
    finally:
        store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("role", choices=("store", "client"))
    parser.add_argument("--master", required=True, help="mooncake_master address host:port")
    parser.add_argument("--segment", type=int, default=1 << 30, help="store: global segment bytes")
    parser.add_argument("--local-buffer", type=int, default=64 << 20, help="local buffer bytes")
    parser.add_argument("--spec", help="client: a command (JSON object) or a list of them, instead of stdin")
    args = parser.parse_args(argv)
    if args.role == "store":
        return run_store(args.master, args.segment, args.local_buffer)
    return int(serve(lambda: MooncakeBackend(args.master, args.local_buffer), args.spec))


if __name__ == "__main__":
    sys.exit(main())
