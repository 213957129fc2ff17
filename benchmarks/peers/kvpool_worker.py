"""The kvpool client process of the peer benchmark; runs in the kvpool venv.

``kvpool_worker.py --master 127.0.0.1:P [--spec JSON]`` answers the workload commands of ``_workload.py``
against a cluster run.py started with ``LocalCluster(stores=1, ...)``, through
``kvpool.client.PoolClient`` over TCP (``ClientConfig(use_shm=False)``): single ``put``/``get_into``/
``is_exist``, batched ``batch_put_from``/``batch_get_into``/``batch_exists``, from and into two registered
32 MiB buffers.

It also serves ``{"op": "get_same_node"}``: the batched get again, through a second client with
``ClientConfig(use_shm=True)`` (the store's segment mapped into this process, reads are memcpy). If
kvpool has no shared-memory transport the row comes back ``{"missing": reason}``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _workload import Backend, Engine, Result, serve  # noqa: E402


class KvpoolBackend(Backend):
    name = "kvpool"

    def __init__(self, master: str) -> None:
        super().__init__()
        from kvpool.client import pool_client
        from kvpool.client.config import ClientConfig

        self.client = pool_client.PoolClient(config=ClientConfig(master=master, use_shm=False))
        for buf in (self.src, self.dst):
            self.client.register_buffer(buf.view)
        self.master = master
        self._src_views: dict[tuple[int, int], memoryview] = {}
        self._dst_views: dict[tuple[int, int], memoryview] = {}
        self._shm: Any = None
        self._shm_missing = ""

    def info(self) -> dict[str, Any]:
        from importlib.metadata import version

        return {"version": version("kvpool"), "node": self.client.node}

    def _src(self, off: int, size: int) -> memoryview:
        view = self._src_views.get((off, size))
        if view is None:
            view = self._src_views[(off, size)] = self.src.view[off : off + size]
        return view

    def _dst(self, off: int, size: int) -> memoryview:
        view = self._dst_views.get((off, size))
        if view is None:
            view = self._dst_views[(off, size)] = self.dst.view[off : off + size]
        return view

    def put(self, keys: Sequence[str], offsets: Sequence[int], size: int, single: bool) -> Result:
        if single:
            return [self.client.put(keys[0], self._src(offsets[0], size))]
        return self.client.batch_put_from(keys, [self._src(o, size) for o in offsets])

    def get(self, keys: Sequence[str], offsets: Sequence[int], size: int, single: bool) -> Result:
        if single:
            return [self.client.get_into(keys[0], self._dst(offsets[0], size))]
        return self.client.batch_get_into(keys, [self._dst(o, size) for o in offsets])

    def get_bytes(self, key: str) -> int:
        value = self.client.get(key)
        return -1 if value is None else len(value)

    def exists(self, keys: Sequence[str], single: bool) -> Result:
        if single:
            return [self.client.is_exist(keys[0])]
        return self.client.batch_exists(keys)

    def remove(self, keys: Sequence[str]) -> None:
        self.client.batch_remove(list(keys), force=True)

    # --- same-node get through the shared-memory transport --------------------------------------------

    def _shm_client(self) -> Any:
        if self._shm is not None or self._shm_missing:
            return self._shm
        try:
            import kvpool.transfer.shm  # noqa: F401
        except ImportError as exc:
            self._shm_missing = f"kvpool has no shared-memory transport yet ({exc})"
            return None
        from kvpool.client import pool_client
        from kvpool.client.config import ClientConfig

        client = pool_client.PoolClient(config=ClientConfig(master=self.master, use_shm=True))
        kinds = _transport_kinds(client)
        if not any("shm" in k.lower() for k in kinds):
            client.close()
            self._shm_missing = f"use_shm=True gave no shared-memory transport (transports: {kinds})"
            return None
        client.register_buffer(self.dst.view)
        self._shm = client
        return client

    def _get_same_node(self, spec: dict[str, Any]) -> dict[str, Any]:
        client = self._shm_client()
        size, batch = int(spec["size"]), int(spec["batch"])
        if client is None:
            return {"op": "get_same_node", "size": size, "batch": batch, "missing": self._shm_missing}

        def getter(keys: Sequence[str], offsets: Sequence[int], size: int, single: bool) -> Result:
            if single:
                return [client.get_into(keys[0], self._dst(offsets[0], size))]
            return client.batch_get_into(keys, [self._dst(o, size) for o in offsets])

        engine: Engine = self.engine
        return engine.run_get(spec, getter=getter, op="get_same_node")

    def extra_ops(self) -> dict[str, Callable[[dict[str, Any]], dict[str, Any]]]:
        return {"get_same_node": self._get_same_node}

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
        self.client.close()


def _transport_kinds(client: Any) -> list[str]:
    """Class names of the client's transports (whatever the TransportSet calls its list)."""
    holder = getattr(client, "_transports", None)
    kinds = []
    for value in vars(holder).values() if holder is not None and hasattr(holder, "__dict__") else ():
        if isinstance(value, (list, tuple)):
            kinds += [type(t).__name__ for t in value]
    return kinds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--master", required=True)
    parser.add_argument("--spec", help="a command (JSON object) or a list of them, instead of stdin")
    args = parser.parse_args(argv)
    return serve(lambda: KvpoolBackend(args.master), args.spec)


if __name__ == "__main__":
    sys.exit(main())
