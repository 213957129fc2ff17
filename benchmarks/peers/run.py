#!/usr/bin/env python3
"""Side-by-side benchmark of kvpool against Mooncake Store and Redis on this machine (loopback only).

Starts every system (Mooncake: ``mooncake_master`` with HA off, a store process with a global segment
and a client process with none, all over the TCP transport with ``P2PHANDSHAKE`` metadata; Redis: a
``redis-server`` without persistence and a redis-py client process; kvpool: ``LocalCluster(stores=1)``
and a ``PoolClient`` process), warms each one's memory, then for ``--runs`` rounds runs every workload
on every system in alternating order, measuring the raw loopback TCP ceiling and memcpy in each round.
Prints medians over the rounds, kvpool/peer ratios and the acceptance lines of the "Data plane speed"
issue; ``--json`` prints one JSON object instead. Needs ``benchmarks/peers/setup.sh`` once.

    .venv/bin/python benchmarks/peers/run.py [--json] [--quick] [--runs N] [--systems kvpool,mooncake,redis]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
PEERS_VENV = Path(os.environ.get("PEERS_VENV") or HERE / ".venv-mooncake")  # as setup.sh
PEERS_PY = PEERS_VENV / "bin" / "python"

KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 1 * MiB, 4 * MiB)
CALL_BYTES = 32 * MiB
EXISTS_KEYS = 1000
SYSTEMS = ("kvpool", "mooncake", "redis")
PEERS = ("mooncake", "redis")


def _workloads() -> list[tuple[str, int, int]]:
    """(op, value size, keys per call); size 0 for the exists workloads."""
    out: list[tuple[str, int, int]] = []
    for op in ("put", "get"):
        for size in SIZES:
            out += [(op, size, 1), (op, size, CALL_BYTES // size)]
    out += [("exists", 0, 1), ("exists", 0, EXISTS_KEYS)]
    out += [("get_same_node", size, CALL_BYTES // size) for size in (1 * MiB, 4 * MiB)]
    # first reads (keys never read before), the plain get returning bytes, and a HiCache batch of small pages
    out += [("get_first", size, 1) for size in SIZES]
    out += [("get_bytes", size, 1) for size in SIZES]
    out += [(op, 64 * KiB, HICACHE_BATCH) for op in ("put", "get", "get_first")]
    return out


HICACHE_BATCH = 128  # pages of one SGLang HiCache batch
FIRST_READ_OPS = ("get_first", "get_bytes")  # get workloads whose every read is of a key never read before
_NAMES = {"get_same_node": "same-node get", "get_first": "first get", "get_bytes": "get() bytes, first"}


def _label(op: str, size: int, batch: int) -> str:
    if op == "exists":
        return "exists single" if batch == 1 else f"batch-exists x{batch}"
    mode = "single" if batch == 1 else f"batched x{batch}"
    return f"{_NAMES.get(op, op)} {_size(size)} {mode}"


def first_read(op: str) -> bool | None:
    """Whether a workload's reads are first reads (None: not a get workload)."""
    return op in FIRST_READ_OPS if op.startswith("get") else None


def _size(n: int) -> str:
    return f"{n // MiB}MiB" if n >= MiB else f"{n // KiB}KiB"


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- processes -----------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} not listening on 127.0.0.1:{port} after {timeout:.0f} s")


class WorkerGone(RuntimeError):
    """The process exited or stopped answering: nothing more can be asked of it."""


class Proc:
    """A child in its own session (process group): stopping it stops everything it started."""

    def __init__(
        self, name: str, cmd: list[str], logdir: Path, env: dict[str, str] | None = None, pipes: bool = False
    ) -> None:
        self.name = name
        self.log_path = logdir / f"{name}.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE if pipes else self._log,
            stderr=self._log,
            stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self._buf = b""

    def readline(self, timeout: float) -> str:
        """One line of the child's stdout, within ``timeout`` seconds."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerGone(f"{self.name}: no answer within {timeout:.0f} s (log {self.log_path})")
                if sel.select(min(left, 1.0)):
                    chunk = os.read(fd, 1 << 16)
                    if not chunk:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            self.proc.wait(2)
                        raise WorkerGone(f"{self.name} exited ({self.proc.poll()}):\n{self.tail()}")
                    self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode()

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # whatever is left of the group (the child itself or anything it started)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()


class Worker(Proc):
    """A client process speaking _workload.py's JSON-line protocol."""

    def __init__(
        self,
        name: str,
        cmd: list[str],
        logdir: Path,
        env: dict[str, str] | None = None,
        ready_timeout: float = 120.0,
    ) -> None:
        super().__init__(name, cmd, logdir, env, pipes=True)
        self.ready = self._answer(ready_timeout)

    def _answer(self, timeout: float) -> dict[str, Any]:
        answer: dict[str, Any] = json.loads(self.readline(timeout))
        if not answer.get("ok"):
            raise RuntimeError(f"{self.name}: {answer.get('error')}\n{self.tail()}")
        return answer

    def request(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        stdin: IO[bytes] | None = self.proc.stdin
        assert stdin is not None
        stdin.write((json.dumps(cmd) + "\n").encode())
        stdin.flush()
        return self._answer(timeout)

    def stop(self, timeout: float = 10.0, fast: bool = False) -> None:
        if not fast and self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write(b'{"cmd": "quit"}\n')
                self.proc.stdin.flush()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout)
        super().stop(2.0 if fast else 5.0)


# --- the three systems -----------------------------------------------------------------------------------


class System:
    name = "?"

    def __init__(self, logdir: Path, segment: int) -> None:
        self.logdir = logdir
        self.segment = segment
        self.procs: list[Proc] = []
        self.client: Worker | None = None
        self.info: dict[str, Any] = {}

    def start(self) -> None:
        raise NotImplementedError

    def fill_bytes(self, dataset: int) -> int:
        """Filler the warm step writes (and removes) so that all of the server's memory is touched."""
        return max(0, int(self.segment * 0.75) - dataset)

    def stop(self, fast: bool = False) -> None:
        """Stop the client and the servers (``fast``: signal at once, no goodbye to a busy client)."""
        if self.client is not None:
            self.client.stop(fast=fast)
            self.client = None
        for proc in reversed(self.procs):
            proc.stop(2.0 if fast else 5.0)
        self.procs.clear()


class Mooncake(System):
    name = "mooncake"

    def start(self) -> None:
        pkg = PEERS_VENV / "lib"
        masters = sorted(pkg.glob("python3*/site-packages/mooncake/mooncake_master"))
        if not masters:
            raise RuntimeError("mooncake_master not found: run benchmarks/peers/setup.sh")
        port, metrics = free_port(), free_port()
        master = Proc(
            "mooncake-master",
            [
                str(masters[0]),
                f"--rpc_port={port}",
                "--rpc_address=127.0.0.1",
                f"--metrics_port={metrics}",
                "--metrics_host=127.0.0.1",
                "--enable_ha=false",
                "--enable_http_metadata_server=false",
            ],
            self.logdir,
        )
        self.procs.append(master)
        wait_port(port, master.proc, 30, "mooncake_master")
        addr = f"127.0.0.1:{port}"
        store = Worker(
            "mooncake-store",
            [
                str(PEERS_PY),
                str(HERE / "mooncake_worker.py"),
                "store",
                "--master",
                addr,
                "--segment",
                str(self.segment),
                "--local-buffer",
                str(16 * MiB),
            ],
            self.logdir,
        )
        self.procs.append(store)
        self.client = Worker(
            "mooncake-client",
            [str(PEERS_PY), str(HERE / "mooncake_worker.py"), "client", "--master", addr],
            self.logdir,
        )
        self.info = {
            "master": addr,
            "segment_bytes": self.segment,
            "protocol": "tcp",
            "metadata": "P2PHANDSHAKE",
            "version": self.client.ready.get("version"),
        }


class Redis(System):
    name = "redis"
    pipeline_bytes = 1 * MiB

    def fill_bytes(self, dataset: int) -> int:
        return self.segment // 6  # one put window: Redis' memory is its allocator's, not a segment

    def start(self) -> None:
        port = free_port()
        workdir = self.logdir / "redis"
        workdir.mkdir(exist_ok=True)
        server = Proc(
            "redis-server",
            [
                "redis-server",
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--protected-mode",
                "yes",
                "--daemonize",
                "no",
                "--logfile",
                "",
            ],
            self.logdir,
        )
        self.procs.append(server)
        wait_port(port, server.proc, 30, "redis-server")
        cmd = [
            str(PEERS_PY),
            str(HERE / "redis_worker.py"),
            "--port",
            str(port),
            "--pipeline-bytes",
            str(self.pipeline_bytes),
        ]
        self.client = Worker("redis-client", cmd, self.logdir)
        self.info = {
            "port": port,
            "persistence": "off",
            "version": self.client.ready.get("version"),
            "redis_py": self.client.ready.get("redis_py"),
            "parser": self.client.ready.get("parser"),
            "pipeline_bytes": self.pipeline_bytes,
        }


class Kvpool(System):
    name = "kvpool"

    def __init__(self, logdir: Path, segment: int) -> None:
        super().__init__(logdir, segment)
        self.cluster: Any = None

    def start(self) -> None:
        from kvpool.tools.local_cluster import LocalCluster

        self.cluster = LocalCluster(stores=1, store_size=str(self.segment), base_dir=self.logdir / "kvpool")
        self.cluster.start()
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "src"), os.environ.get("PYTHONPATH")]))}
        self.client = Worker(
            "kvpool-client",
            [sys.executable, str(HERE / "kvpool_worker.py"), "--master", self.cluster.master],
            self.logdir,
            env=env,
        )
        self.info = {
            "master": self.cluster.master,
            "store_size_bytes": self.segment,
            "version": self.client.ready.get("version"),
        }

    def stop(self, fast: bool = False) -> None:
        try:
            super().stop(fast)
        finally:
            if self.cluster is not None:
                self.cluster.stop()
                self.cluster = None


# --- ceilings --------------------------------------------------------------------------------------------


Ceiling = Callable[[int, float], float | None]


def _ceiling_funcs() -> tuple[Ceiling, Ceiling, Callable[[int], float | None], str]:
    """benchmarks/ceiling.py's measurements (the same ones `make bench` compares against): the TCP
    ceiling into one hot buffer, the same into a 32 MiB 4 KiB-page buffer (spread), memcpy."""
    sys.path.insert(0, str(REPO))
    try:
        from benchmarks.ceiling import measure_memcpy, measure_tcp_ceiling, measure_tcp_spread_ceiling
    except ImportError as exc:
        none: Ceiling = lambda size, seconds: None  # noqa: E731
        return none, none, (lambda size: None), f"unavailable: {exc}"
    return measure_tcp_ceiling, measure_tcp_spread_ceiling, measure_memcpy, "benchmarks/ceiling.py"


# --- statistics ------------------------------------------------------------------------------------------


def merge_slices(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One workload's slices (each with its raw latencies) as one measurement."""
    lat = sorted(x for p in parts for x in p.pop("lat_us"))
    secs = sum(p["seconds"] for p in parts)
    keys = sum(p["keys"] for p in parts)
    nbytes = sum(p["bytes"] for p in parts)
    first = parts[0]

    def pct(q: float) -> float | None:
        return lat[min(len(lat) - 1, max(0, round(q * (len(lat) - 1))))] if lat else None

    return {
        "op": first["op"],
        "size": first["size"],
        "batch": first["batch"],
        "calls": len(lat),
        "keys": keys,
        "bytes": nbytes,
        "seconds": round(secs, 4),
        "slices": len(parts),
        "gbps": round(nbytes / secs / 1e9, 4) if first["size"] and secs > 0 else None,
        "ops_per_s": round(keys / secs, 1) if secs > 0 else None,
        "calls_per_s": round(len(lat) / secs, 1) if secs > 0 else None,
        "p50_us": pct(0.50),
        "p99_us": pct(0.99),
        "errors": sum(p.get("errors", 0) for p in parts),
    }


def _median(values: list[float | None]) -> float | None:
    clean = [v for v in values if v is not None]
    return round(statistics.median(clean), 4) if clean else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _metric(row: dict[str, Any]) -> float | None:
    return row.get("ops_per_s") if row["op"] == "exists" else row.get("gbps")


def summarise(
    samples: dict[tuple[str, str, int, int], list[dict[str, Any]]],
    missing: dict[tuple[str, str, int, int], str],
) -> list[dict[str, Any]]:
    rows = []
    for (system, op, size, batch), runs in samples.items():
        row: dict[str, Any] = {"system": system, "op": op, "size": size, "batch": batch}
        for field in ("gbps", "ops_per_s", "p50_us", "p99_us"):
            row[field] = _median([r.get(field) for r in runs])
        row["runs"] = len(runs)
        row["samples"] = [_metric({"op": op, **r}) for r in runs]
        row["errors"] = sum(r.get("errors", 0) for r in runs)
        if (first := first_read(op)) is not None:
            row["first_read"] = first
        rows.append(row)
    for (system, op, size, batch), reason in missing.items():
        if (system, op, size, batch) not in samples:
            rows.append(
                {
                    "system": system,
                    "op": op,
                    "size": size,
                    "batch": batch,
                    "gbps": None,
                    "ops_per_s": None,
                    "p50_us": None,
                    "p99_us": None,
                    "runs": 0,
                    "missing": reason,
                    **({"first_read": first_read(op)} if first_read(op) is not None else {}),
                }
            )
    return rows


def ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["system"], r["op"], r["size"], r["batch"]): r for r in rows}
    out = []
    for op, size, batch in _workloads():
        if op == "get_same_node":
            continue
        kv = by.get(("kvpool", op, size, batch))
        measured = {p: _metric(by[(p, op, size, batch)]) for p in PEERS if (p, op, size, batch) in by}
        peers: dict[str, float] = {p: v for p, v in measured.items() if v is not None}
        best = max(peers, key=lambda p: peers[p]) if peers else None
        kv_value = _metric(kv) if kv else None
        out.append(
            {
                "workload": _label(op, size, batch),
                "op": op,
                "size": size,
                "batch": batch,
                "metric": "ops_per_s" if op == "exists" else "gbps",
                "kvpool": kv_value,
                "mooncake": peers.get("mooncake"),
                "redis": peers.get("redis"),
                "best_peer": best,
                "kvpool/mooncake": _ratio(kv_value, peers.get("mooncake")),
                "kvpool/redis": _ratio(kv_value, peers.get("redis")),
                "kvpool/best_peer": _ratio(kv_value, peers[best] if best else None),
                **({"first_read": first_read(op)} if first_read(op) is not None else {}),
            }
        )
    return out


def acceptance(
    rows: list[dict[str, Any]], ceiling: dict[int, float | None], memcpy: float | None
) -> dict[str, dict[str, Any]]:
    by = {(r["system"], r["op"], r["size"], r["batch"]): r for r in rows}

    def value(system: str, op: str, size: int, batch: int) -> float | None:
        row = by.get((system, op, size, batch))
        return _metric(row) if row else None

    def line(kv: float | None, ref: float | None, need: float, ref_name: str, **extra: Any) -> dict[str, Any]:
        r = _ratio(kv, ref)
        ok = kv is not None and ref is not None and ref > 0 and kv / ref >= need  # unrounded
        return {"pass": ok, "kvpool": kv, ref_name: ref, "ratio": r, "required_ratio": need, **extra}

    out: dict[str, dict[str, Any]] = {}
    for op in ("put", "get"):
        for size in (1 * MiB, 4 * MiB):
            batch = CALL_BYTES // size
            kv = value("kvpool", op, size, batch)
            peers = {p: value(p, op, size, batch) for p in PEERS}
            known = {p: v for p, v in peers.items() if v is not None}
            best = max(known, key=lambda p: known[p]) if known else None
            out[f"{op}_batched_{_size(size)}_vs_best_peer"] = line(
                kv, known.get(best) if best else None, 1.5, "best_peer_gbps", best_peer=best, unit="GB/s"
            )
            out[f"{op}_batched_{_size(size)}_vs_tcp_ceiling"] = line(
                kv, ceiling.get(size), 0.8, "ceiling_tcp_gbps", unit="GB/s"
            )
    out["get_single_64KiB_vs_mooncake"] = line(
        value("kvpool", "get", 64 * KiB, 1),
        value("mooncake", "get", 64 * KiB, 1),
        2.0,
        "mooncake_gbps",
        unit="GB/s",
    )
    for size in (1 * MiB, 4 * MiB):
        out[f"same_node_get_{_size(size)}_vs_memcpy"] = line(
            value("kvpool", "get_same_node", size, CALL_BYTES // size),
            memcpy,
            0.5,
            "memcpy_gbps",
            unit="GB/s",
        )
    out["exists_single_vs_mooncake"] = line(
        value("kvpool", "exists", 0, 1),
        value("mooncake", "exists", 0, 1),
        1.0,
        "mooncake_ops_per_s",
        unit="calls/s",
    )
    out["batch_exists_vs_mooncake"] = line(
        value("kvpool", "exists", 0, EXISTS_KEYS),
        value("mooncake", "exists", 0, EXISTS_KEYS),
        1.0,
        "mooncake_ops_per_s",
        unit="keys/s",
    )
    out.update(_client_path_lines(value, line))
    for name, entry in out.items():
        if entry["kvpool"] is None:
            row = by.get(("kvpool", *_acceptance_key(name)))
            entry["missing"] = (row or {}).get("missing", "no kvpool measurement")
    return out


# The client paths of the "every client path at least as fast as the best peer" issue: name -> (op, size,
# batch, the ratio to the best peer it needs).
CLIENT_PATHS = {
    "first_get_64KiB": ("get_first", 64 * KiB, 1, 1.0),
    "first_get_1MiB": ("get_first", 1 * MiB, 1, 1.0),
    "put_single_64KiB": ("put", 64 * KiB, 1, 1.0),
    "get_bytes_1MiB": ("get_bytes", 1 * MiB, 1, 1.0),
    "get_bytes_4MiB": ("get_bytes", 4 * MiB, 1, 1.0),
    "put_batched_64KiB": ("put", 64 * KiB, CALL_BYTES // (64 * KiB), 1.5),
    "get_batched_64KiB": ("get", 64 * KiB, CALL_BYTES // (64 * KiB), 1.5),
    f"put_hicache_x{HICACHE_BATCH}_64KiB": ("put", 64 * KiB, HICACHE_BATCH, 1.5),
    f"get_hicache_x{HICACHE_BATCH}_64KiB": ("get", 64 * KiB, HICACHE_BATCH, 1.5),
    f"first_get_hicache_x{HICACHE_BATCH}_64KiB": ("get_first", 64 * KiB, HICACHE_BATCH, 1.5),
}


def _client_path_lines(
    value: Callable[[str, str, int, int], float | None], line: Callable[..., dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Each client path against the best peer on the same path, and kvpool's plain get of 1-4 MiB
    against its own get_into of the same size (both first reads)."""
    out: dict[str, dict[str, Any]] = {}
    for name, (op, size, batch, need) in CLIENT_PATHS.items():
        known = {p: v for p in PEERS if (v := value(p, op, size, batch)) is not None}
        best = max(known, key=lambda p: known[p]) if known else None
        out[f"{name}_vs_best_peer"] = line(
            value("kvpool", op, size, batch),
            known.get(best) if best else None,
            need,
            "best_peer_gbps",
            best_peer=best,
            unit="GB/s",
        )
    for size in (1 * MiB, 4 * MiB):
        out[f"get_bytes_{_size(size)}_vs_get_into"] = line(
            value("kvpool", "get_bytes", size, 1),
            value("kvpool", "get_first", size, 1),
            0.8,
            "get_into_gbps",
            unit="GB/s",
        )
    return out


def _acceptance_key(name: str) -> tuple[str, int, int]:
    for path, (op, size, batch, _) in CLIENT_PATHS.items():
        if name.startswith(path + "_vs_"):
            return op, size, batch
    if name.startswith("get_bytes_") and name.endswith("_vs_get_into"):
        return "get_bytes", MiB if "_1MiB_" in name else 4 * MiB, 1
    if name.startswith("same_node_get_"):
        size = MiB if "_1MiB_" in name else 4 * MiB
        return "get_same_node", size, CALL_BYTES // size
    if name.startswith("exists_single"):
        return "exists", 0, 1
    if name.startswith("batch_exists"):
        return "exists", 0, EXISTS_KEYS
    if name.startswith("get_single_64KiB"):
        return "get", 64 * KiB, 1
    op = name.split("_")[0]
    size = MiB if "_1MiB_" in name else 4 * MiB
    return op, size, CALL_BYTES // size


# --- output ----------------------------------------------------------------------------------------------


def _fmt(v: float | None, op: str) -> str:
    if v is None:
        return "-"
    if op == "exists":
        return f"{v / 1e6:.2f} M/s" if v >= 1e6 else f"{v / 1e3:.1f} k/s"
    return f"{v:.2f}"


def human(doc: dict[str, Any]) -> str:
    lines = [
        f"kvpool vs peers, {doc['date']} on {doc['machine']['summary']}; "
        f"medians of {doc['runs']} run(s); kvpool {doc.get('kvpool_revision', '?')}",
        f"load average during the run (1 min, per round): {doc['load_average']}",
        "TCP ceiling (raw loopback, Python): "
        + ", ".join(
            f"{_size(int(s))} {v:.2f} GB/s" for s, v in doc["ceiling_tcp_gbps_by_size"].items() if v is not None
        )
        + f"; memcpy {doc['memcpy_gbps'] or 0:.2f} GB/s",
        "TCP ceiling into a 32 MiB 4 KiB-page buffer (informational): "
        + ", ".join(
            f"{_size(int(s))} {v:.2f} GB/s"
            for s, v in doc.get("ceiling_tcp_spread_gbps_by_size", {}).items()
            if v is not None
        ),
        "",
    ]
    by = {(r["system"], r["op"], r["size"], r["batch"]): r for r in doc["rows"]}
    head = (
        f"{'workload':<32}{'kvpool':>11}{'mooncake':>11}{'redis':>11}{'kv/mc':>8}{'kv/best':>9}"
        f"{'kv p50 us':>11}{'mc p50 us':>11}{'rd p50 us':>11}"
    )
    lines += ["GB/s (exists: calls/s single, keys/s batch)", head, "-" * len(head)]
    rat = {(r["op"], r["size"], r["batch"]): r for r in doc["ratios"]}
    for op, size, batch in _workloads():
        cells = []
        p50s = []
        for system in SYSTEMS:
            row = by.get((system, op, size, batch))
            cells.append(_fmt(_metric(row), op) if row else "-")
            p50s.append(f"{row['p50_us']:.0f}" if row and row.get("p50_us") is not None else "-")
        r = rat.get((op, size, batch), {})
        kv_mc = r.get("kvpool/mooncake")
        kv_best = r.get("kvpool/best_peer")
        lines.append(
            f"{_label(op, size, batch):<32}{cells[0]:>11}{cells[1]:>11}{cells[2]:>11}"
            f"{(f'{kv_mc:.2f}x' if kv_mc else '-'):>8}{(f'{kv_best:.2f}x' if kv_best else '-'):>9}"
            f"{p50s[0]:>11}{p50s[1]:>11}{p50s[2]:>11}"
        )
        row = by.get(("kvpool", op, size, batch))
        if row and row.get("missing"):
            lines.append(f"{'':<32}kvpool: {row['missing']}")
    lines += ["", "acceptance:"]
    for name, entry in doc["acceptance"].items():
        ref = next(v for k, v in entry.items() if k.endswith(("_gbps", "_ops_per_s")))
        ratio = "-" if entry["ratio"] is None else f"{entry['ratio']}x"
        verdict = "PASS" if entry["pass"] else "FAIL"
        lines.append(
            f"  {verdict}  {name:<34} kvpool {entry['kvpool'] or '-'} vs "
            f"{ref or '-'} -> {ratio} (need {entry['required_ratio']}x)"
            + (f"  [{entry['missing']}]" if entry.get("missing") else "")
        )
    if doc.get("errors"):
        lines += ["", "errors:"] + [f"  {k}: {v}" for k, v in doc["errors"].items()]
    return "\n".join(lines)


def kvpool_revision() -> str:
    """The commit of the kvpool checkout measured, "+dirty" when src/ differs from it (read-only git)."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            env=env,
            check=True,
        ).stdout.strip()
        dirty = (
            subprocess.run(
                ["git", "-C", str(REPO), "diff", "--quiet", "HEAD", "--", "src"],
                capture_output=True,
                timeout=10,
                env=env,
            ).returncode
            != 0
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                model = text.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError):
        mem = f"{int(Path('/proc/meminfo').read_text().split()[1]) / 2**20:.0f} GiB"
    os_name = ""
    with contextlib.suppress(OSError):
        os_name = next(
            t.split("=", 1)[1].strip('"')
            for t in Path("/etc/os-release").read_text().splitlines()
            if t.startswith("PRETTY_NAME=")
        )
    cpus = os.cpu_count()
    return {
        "cpus": cpus,
        "cpu_model": model,
        "memory": mem,
        "os": os_name,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "summary": f"{os_name}, {cpus} CPUs ({model}), {mem} RAM, loopback only",
    }


# --- orchestration ---------------------------------------------------------------------------------------


def check_setup() -> list[str]:
    problems = []
    if not PEERS_PY.exists():
        problems.append(f"{PEERS_VENV} missing")
    elif not sorted((PEERS_VENV / "lib").glob("python3*/site-packages/mooncake/mooncake_master")):
        problems.append("mooncake_master missing from the peers venv")
    if not any((Path(d) / "redis-server").exists() for d in os.environ.get("PATH", "").split(os.pathsep)):
        problems.append("redis-server not installed")
    return problems


def _raise_interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object (progress goes to stderr)")
    parser.add_argument("--quick", action="store_true", help="a short run (small data, short timings, 1 run)")
    parser.add_argument("--runs", type=int, help="rounds; the medians are over them (default 3, --quick 1)")
    parser.add_argument("--seconds", type=float, help="timed seconds per workload per run (default 1.0)")
    parser.add_argument(
        "--slices",
        type=int,
        help="a workload's seconds are split into this many turns per system, alternating (default 4, --quick 2)",
    )
    parser.add_argument("--dataset-mib", type=int, help="get dataset per value size, MiB (default 256)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset")
    parser.add_argument(
        "--workloads",
        default="",
        help="comma-separated substrings: run only the workloads whose label contains one (e.g. 'first,single')",
    )
    parser.add_argument(
        "--redis-pipeline-bytes",
        type=int,
        default=Redis.pipeline_bytes,
        help="Redis batched calls are sent as pipelines of this many value bytes (0: the "
        "whole batch in one pipeline); default 1 MiB, Redis' best here",
    )
    parser.add_argument("--setup", action="store_true", help="run setup.sh first")
    parser.add_argument(
        "--keep-logs", action="store_true", help="keep the processes' logs (they are always kept on failure)"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 unless every acceptance line passes")
    parser.add_argument("--save", metavar="PATH", help="also write the JSON object to PATH")
    parser.add_argument("--show", metavar="PATH", help="print the table of a saved JSON object and exit")
    args = parser.parse_args(argv)
    for option in ("runs", "slices", "dataset_mib"):
        if (value := getattr(args, option)) is not None and value < 1:
            parser.error(f"--{option.replace('_', '-')} must be >= 1, not {value}")
    if args.seconds is not None and not args.seconds > 0:
        parser.error(f"--seconds must be > 0, not {args.seconds}")
    if args.redis_pipeline_bytes < 0:
        parser.error(f"--redis-pipeline-bytes must be >= 0, not {args.redis_pipeline_bytes}")
    if args.show:
        print(human(json.loads(Path(args.show).read_text())))
        return 0

    runs = args.runs or (1 if args.quick else 3)
    seconds = args.seconds or (0.3 if args.quick else 1.0)
    slices = args.slices or (2 if args.quick else 4)
    dataset = (args.dataset_mib or (64 if args.quick else 256)) * MiB
    segment = 6 * dataset
    Redis.pipeline_bytes = args.redis_pipeline_bytes
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    if bad := [n for n in names if n not in SYSTEMS]:
        parser.error(f"unknown systems {bad}")
    if args.setup:
        subprocess.run(["bash", str(HERE / "setup.sh")], check=True, stdout=sys.stderr)
    if (problems := check_setup()) and any(n in PEERS for n in names):
        print(
            f"peers not set up ({'; '.join(problems)}): run bash benchmarks/peers/setup.sh (or pass --setup)",
            file=sys.stderr,
        )
        return 2
    tcp_ceiling, tcp_spread_ceiling, memcpy, ceiling_source = _ceiling_funcs()
    spread_ceilings: dict[int, list[float | None]] = {MiB: [], 4 * MiB: []}

    logdir = Path(tempfile.mkdtemp(prefix="kvpool-peers-"))
    classes = {"kvpool": Kvpool, "mooncake": Mooncake, "redis": Redis}
    systems: list[System] = []
    errors: dict[str, str] = {}
    samples: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    missing: dict[tuple[str, str, int, int], str] = {}
    ceilings: dict[int, list[float | None]] = {s: [] for s in SIZES}
    memcpys: list[float | None] = []
    loads: list[float] = [os.getloadavg()[0]]
    failed = interrupted = False
    old = {s: signal.signal(s, _raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    t_start = time.monotonic()
    try:
        for name in names:
            system = classes[name](logdir, segment)
            systems.append(system)
            log(f"starting {name}")
            t0 = time.monotonic()
            try:
                system.start()
                assert system.client is not None
                prep = system.client.request(
                    {
                        "cmd": "prepare",
                        "ns": f"bench{os.getpid()}",
                        "sizes": list(SIZES),
                        "dataset_bytes": dataset,
                        "exists_keys": EXISTS_KEYS,
                    },
                    600,
                )
                warm = system.client.request(
                    {"cmd": "warm", "fill_bytes": system.fill_bytes(len(SIZES) * dataset)}, 600
                )
                system.info.update(
                    start_s=round(time.monotonic() - t0, 2),
                    prepare_s=prep["seconds"],
                    warm_s=warm["seconds"],
                    warm_fill_bytes=warm["filled_bytes"],
                )
                log(f"{name} ready: {system.info}")
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                log(f"{name} failed to start, continuing without it: {errors[name]}")
                failed = True
                system.stop()
                systems.remove(system)
        wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
        workloads = [w for w in _workloads() if not wanted or any(x in _label(*w) for x in wanted)]
        for run in range(runs):
            loads.append(os.getloadavg()[0])
            log(f"run {run + 1}/{runs} (load average {loads[-1]:.2f})")
            # The 64 KiB ceiling and memcpy are measured here; the 1 MiB and 4 MiB ceilings, which the
            # acceptance lines divide by, take turns with the systems in the batched workloads of that size.
            ceilings[64 * KiB].append(tcp_ceiling(64 * KiB, seconds))
            for size, values in spread_ceilings.items():  # informational: the same RPC, a cold destination
                values.append(tcp_spread_ceiling(size, seconds / 2))
            memcpys.append(memcpy(64 * MiB))
            turns: dict[int, list[float]] = {MiB: [], 4 * MiB: []}
            for w, (op, size, batch) in enumerate(workloads):
                # alternate: every workload starts with the next system, every round shifts again
                order = [systems[(run + w + i) % len(systems)] for i in range(len(systems))]
                order = [s for s in order if op != "get_same_node" or s.name == "kvpool"]
                # ... and within the workload the systems take turns in `slices` slices, so that a change
                # of background load hits them alike
                parts: dict[str, list[dict[str, Any]]] = {s.name: [] for s in order}
                with_ceiling = op in ("put", "get") and batch > 1 and size in turns
                for _ in range(slices):
                    if with_ceiling:
                        value = tcp_ceiling(size, seconds / slices)
                        if value is not None:
                            turns[size].append(value)
                    for system in order:
                        key = (system.name, op, size, batch)
                        if key in missing:
                            continue
                        if system.client is None:  # stopped after its client went away
                            missing[key] = f"{system.name} stopped after an earlier failure"
                            continue
                        spec = {
                            "cmd": "run",
                            "op": op,
                            "size": size,
                            "batch": batch,
                            "seconds": seconds / slices,
                            "min_calls": 1,
                            "window_bytes": dataset,
                            "raw": True,
                        }
                        try:
                            parts[system.name].append(system.client.request(spec, 120 + 20 * seconds))
                        except Exception as exc:
                            missing[key] = f"{type(exc).__name__}: {exc}"
                            errors[f"{system.name} {_label(op, size, batch)}"] = missing[key]
                            failed = True
                            if isinstance(exc, WorkerGone):  # hung or dead: stop it, skip its workloads
                                log(f"{system.name}: {exc}; stopping it")
                                system.stop(fast=True)
                            continue
                        if parts[system.name][-1].get("missing"):
                            missing[key] = parts[system.name][-1]["missing"]
                for system in order:
                    key = (system.name, op, size, batch)
                    if key in missing or not parts[system.name]:
                        continue
                    res = merge_slices(parts[system.name])
                    samples.setdefault(key, []).append(res)
                    log(
                        f"  {system.name:<8} {_label(op, size, batch):<24} "
                        f"{_fmt(_metric({'op': op, **res}), op):>10}  p50 {res['p50_us']:.0f} us"
                        + (f"  ERRORS {res['errors']}" if res.get("errors") else "")
                    )
            for size, values in turns.items():
                ceilings[size].append(statistics.mean(values) if values else tcp_ceiling(size, seconds))
                log(f"  tcp ceiling {_size(size)} (interleaved): {ceilings[size][-1] or 0:.2f} GB/s")
    except KeyboardInterrupt as exc:
        log(f"interrupted ({exc or 'Ctrl-C'}); stopping everything")
        failed = interrupted = True
    finally:
        for system in systems:
            with contextlib.suppress(Exception):
                system.stop(fast=interrupted)
        for sig, handler in old.items():
            signal.signal(sig, handler)
        if failed or args.keep_logs:
            log(f"logs kept in {logdir}")
        else:
            import shutil

            shutil.rmtree(logdir, ignore_errors=True)

    if interrupted:
        return 130
    rows = summarise(samples, missing)
    ceiling_med = {s: _median(list(v)) for s, v in ceilings.items()}
    memcpy_med = _median(list(memcpys))
    doc: dict[str, Any] = {
        "ceiling_tcp_gbps": ceiling_med.get(4 * MiB),
        "ceiling_tcp_gbps_by_size": {str(s): v for s, v in ceiling_med.items()},
        "ceiling_tcp_spread_gbps_by_size": {str(s): _median(list(v)) for s, v in spread_ceilings.items()},
        "memcpy_gbps": memcpy_med,
        "rows": rows,
        "ratios": ratios(rows),
        "acceptance": acceptance(rows, ceiling_med, memcpy_med),
        "runs": runs,
        "load_average": [round(x, 2) for x in loads + [os.getloadavg()[0]]],
        "config": {
            "seconds_per_workload": seconds,
            "dataset_bytes_per_size": dataset,
            "segment_bytes": segment,
            "call_bytes": CALL_BYTES,
            "exists_keys": EXISTS_KEYS,
            "slices": slices,
            "quick": args.quick,
            "redis_pipeline_bytes": args.redis_pipeline_bytes,
            "ceiling_source": ceiling_source,
            "memcpy_bytes": 64 * MiB,
        },
        "systems": {s.name: s.info for s in systems},
        "errors": errors,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "kvpool_revision": kvpool_revision(),
        "elapsed_s": round(time.monotonic() - t_start, 1),
    }
    if args.save:
        Path(args.save).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc) if args.json else human(doc))
    if args.check and not all(e["pass"] for e in doc["acceptance"].values()):
        return 1
    return 1 if errors else 0


if __name__ == "__main__":
    try:
        import kvpool  # noqa: F401
    except ImportError:
        venv_py = REPO / ".venv" / "bin" / "python"
        if venv_py.exists() and Path(sys.executable).resolve() != venv_py.resolve():
            os.execv(str(venv_py), [str(venv_py), *sys.argv])
    sys.exit(main())
