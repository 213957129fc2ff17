"""Helpers of the drain / scale tests: kvpool-admin as a subprocess, and a checked read/write load."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from kvpool.client import ClientConfig, PoolClient
from kvpool.tools.local_cluster import LocalCluster


def admin(cluster: LocalCluster, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
    """``kvpool-admin --master <cluster> ARGS`` in a subprocess (what an operator runs)."""
    cmd = [
        sys.executable,
        "-m",
        "kvpool.tools.admin",
        "--master",
        cluster.master,
        "--cluster",
        cluster.cluster,
        *args,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ), check=False)


def admin_json(cluster: LocalCluster, *args: str, timeout: float = 180.0) -> dict[str, Any]:
    result = admin(cluster, *args, "--json", timeout=timeout)
    assert result.returncode == 0, f"kvpool-admin {' '.join(args)}: rc {result.returncode}\n{result.stderr}"
    doc: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return doc


def nodes(cluster: LocalCluster) -> dict[str, dict[str, Any]]:
    return {n["node"]: n for n in admin_json(cluster, "nodes")["nodes"]}


def store_objects(cluster: LocalCluster) -> dict[str, int]:
    """Objects in the stores' own inventories (from each store's ``/health``), summed by node."""
    counts: dict[str, int] = {}
    for store in cluster.stores:
        url = f"http://{store.endpoints['metrics']}/health"
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                body = answer.read()
        except urllib.error.HTTPError as unmounted:  # 503 while not mounted: the body still counts
            body = unmounted.read()
        counts[store.node] = counts.get(store.node, 0) + int(json.loads(body)["objects"])
    return counts


def inventories_settled(cluster: LocalCluster) -> dict[str, tuple[int, int]]:
    """Nodes whose store inventory and master view disagree, as ``{node: (store, master)}``; empty = settled.

    Settled means every acknowledged object is in its store's inventory (so a new master that rebuilds
    from the inventories finds it) and every free the master sent has reached the store.
    """
    master_view = {node: int(info["objects"]) for node, info in nodes(cluster).items()}
    held = store_objects(cluster)
    return {
        node: (held.get(node, -1), master_view.get(node, -1))
        for node in held.keys() | master_view.keys()
        if held.get(node) != master_view.get(node)
    }


def new_client(master: str, cluster: str = "kvpool") -> PoolClient:
    return PoolClient(
        config=ClientConfig(
            master=master,
            cluster=cluster,
            use_shm=False,
            timeout_s=15.0,
            breaker_backoff_s=0.1,
            breaker_max_backoff_s=0.5,
        )
    )


class Load:
    """Objects written with their sha256, then readers and a writer running until ``stop()``.

    Every read is checked byte for byte. ``read_failures`` counts reads of acknowledged objects that
    returned nothing (during a drain there must be none), ``wrong`` reads that returned other bytes.
    """

    def __init__(self, master: str, value_bytes: int = 16 << 10, cluster: str = "kvpool") -> None:
        self.master = master
        self.cluster = cluster
        self.client = new_client(master, cluster)
        self.value_bytes = value_bytes
        self.acked: dict[str, bytes] = {}
        self.reads = self.read_failures = self.wrong = 0
        self.writes = self.write_failures = 0
        self.failed_keys: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def write(self, keys: list[str], client: PoolClient | None = None) -> int:
        values = [os.urandom(self.value_bytes) for _ in keys]
        codes = (client or self.client).batch_put_from(keys, values)
        ok = 0
        with self._lock:
            for key, value, code in zip(keys, values, codes, strict=True):
                self.writes += 1
                if code == 0:
                    self.acked[key] = hashlib.sha256(value).digest()
                    ok += 1
                else:
                    self.write_failures += 1
        return ok

    def fill(self, count: int, prefix: str, batch: int = 64) -> None:
        for start in range(0, count, batch):
            keys = [f"{prefix}-{i}" for i in range(start, min(count, start + batch))]
            assert self.write(keys) == len(keys)

    def _reader(self) -> None:
        client = new_client(self.master, self.cluster)
        rng = random.Random()
        try:
            while not self._stop.is_set():
                with self._lock:
                    keys = rng.sample(list(self.acked), min(16, len(self.acked)))
                for key, value in zip(keys, client.batch_get(keys), strict=True):
                    with self._lock:
                        self.reads += 1
                        if value is None:
                            self.read_failures += 1
                            self.failed_keys.append(key)
                        elif hashlib.sha256(value).digest() != self.acked[key]:
                            self.wrong += 1
        finally:
            client.close()

    def _writer(self) -> None:
        client = new_client(self.master, self.cluster)
        n = 0
        try:
            while not self._stop.is_set():
                self.write([f"live-{n}-{i}" for i in range(8)], client)
                n += 1
                time.sleep(0.02)  # paces the writer: a load, not a wait
        finally:
            client.close()

    def start(self, readers: int = 2) -> None:
        self._threads = [threading.Thread(target=self._reader, daemon=True) for _ in range(readers)]
        self._threads.append(threading.Thread(target=self._writer, daemon=True))
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def verify(self) -> tuple[int, int, list[str]]:
        """(objects checked, readable with the right bytes, keys missing or wrong)."""
        keys = sorted(self.acked)
        good = 0
        bad: list[str] = []
        for start in range(0, len(keys), 128):
            chunk = keys[start : start + 128]
            for key, value in zip(chunk, self.client.batch_get(chunk), strict=True):
                if value is not None and hashlib.sha256(value).digest() == self.acked[key]:
                    good += 1
                else:
                    bad.append(key)
        return len(keys), good, bad

    def close(self) -> None:
        self.stop()
        self.client.close()
