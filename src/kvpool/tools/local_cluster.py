"""A whole kvpool cluster as local processes on loopback: ``kvpool local up|status|down``, the demo,
the benchmarks and the integration tests all use :class:`LocalCluster`.

Each process is started in its own session (so ``local down`` and test cleanup can kill it and nothing
else), writes a *ready file* with its endpoints once it serves (readiness without sleeping), and logs
to a file in the cluster directory. ``cluster.json`` in that directory lists every process started.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpool.common import envs
from kvpool.common.errors import ErrorCode, KvPoolError, as_code


@dataclass
class ProcInfo:
    role: str  # "etcd" | "master" | "store"
    name: str
    pid: int
    address: str  # gRPC endpoint (master), data endpoint (store), client endpoint (etcd)
    node: str = ""
    log: str = ""
    endpoints: dict[str, Any] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    prefix: list[str] = field(default_factory=list)  # e.g. ["ip", "netns", "exec", NS]: kept on restart
    group: int = 0  # the shard group a master serves (decision 0080)


def default_dir() -> Path:
    return Path(envs.XDG_RUNTIME_DIR.get() or tempfile.gettempdir()) / f"kvpool-local-{os.getuid()}"


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvpool.tools.cli", *args]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); treat it as gone.
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


def _is_ours(pid: int, marker: str) -> bool:
    """Guard against pid reuse: only signal a process whose command line names this cluster dir."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return marker in cmdline


class LocalCluster:
    """Start/stop a master (or 3 with etcd) and N stores as child processes."""

    def __init__(
        self,
        stores: int = 2,
        store_size: str = "256MiB",
        base_dir: str | Path | None = None,
        master_args: tuple[str, ...] = (),
        store_args: tuple[str, ...] = (),
        ha: bool = False,
        masters: int = 3,
        nodes: list[str] | None = None,
        env: dict[str, str] | None = None,
        cluster: str = "",
        etcd_endpoints: list[str] | None = None,
        token_file: str = "",
        groups: int = 1,
    ) -> None:
        self.groups = groups
        """Shard groups (decision 0080): ``masters`` masters per group; more than one needs ``ha``."""
        if groups > 1 and not ha:
            raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "several shard groups need --ha (each group elects in etcd)")
        self.base_dir = Path(base_dir) if base_dir else Path(tempfile.mkdtemp(prefix="kvpool-cluster-"))
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self.num_stores = stores
        self.store_size = store_size
        self.master_args = tuple(master_args)
        self.store_args = tuple(store_args)
        self.ha = ha
        self.num_masters = masters if ha else 1
        self.nodes = nodes
        # Each HA local cluster has its own etcd, so the default cluster name is safe to share.
        self.cluster = cluster or "kvpool"
        self.env = {**os.environ, **(env or {})}
        self.processes: list[ProcInfo] = []
        self._popen: dict[int, subprocess.Popen[bytes]] = {}
        self._counter = 0
        self.etcd: Any = None
        self._external_etcd = list(etcd_endpoints or [])
        # A cluster that requires this token: masters and stores get --token-file (clients read it from
        # KVPOOL_TOKEN_FILE or token_file=).
        self.token_file = str(Path(token_file).resolve()) if token_file else ""

    # --- start ---------------------------------------------------------------------------------

    @property
    def master(self) -> str:
        """The address clients and stores are given."""
        if self.ha:
            return "etcd://" + ",".join(self.etcd_endpoints)
        return self.masters[0].address

    @property
    def etcd_endpoints(self) -> list[str]:
        return self._external_etcd or (list(self.etcd.endpoints) if self.etcd is not None else [])

    @property
    def masters(self) -> list[ProcInfo]:
        return [p for p in self.processes if p.role == "master"]

    @property
    def stores(self) -> list[ProcInfo]:
        return [p for p in self.processes if p.role == "store"]

    def start(self, timeout: float = 60.0) -> LocalCluster:
        try:
            if self.ha and not self._external_etcd:
                self._start_etcd()
            for group in range(self.groups):
                for _ in range(self.num_masters):
                    self.add_master(timeout=timeout, group=group)
            for i in range(self.num_stores):
                self.add_store(node=self.nodes[i] if self.nodes else "", timeout=timeout)
            self.save()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_etcd(self) -> None:
        from kvpool.tools.etcd_process import EtcdCluster

        self.etcd = EtcdCluster(1, self.base_dir / "etcd")
        self.processes.append(ProcInfo("etcd", "etcd-0", self.etcd.member_pid(0), self.etcd.endpoints[0]))

    def _spawn(self, role: str, args: list[str], timeout: float, prefix: tuple[str, ...] = ()) -> ProcInfo:
        name = f"{role}-{self._counter}"
        self._counter += 1
        ready = self.base_dir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log_path = self.base_dir / f"{name}.log"
        cmd = [*prefix, *_cli(role, *args, "--ready-file", str(ready))]
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                cmd,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,
            )
        self._popen[proc.pid] = proc
        info = ProcInfo(role, name, proc.pid, "", log=str(log_path), args=args, prefix=list(prefix))
        self.processes.append(info)
        deadline = time.monotonic() + timeout
        while not ready.exists() or not ready.read_text():
            if proc.poll() is not None:
                raise KvPoolError(ErrorCode.UNAVAILABLE, f"{name} exited with {proc.returncode}:\n{_tail(log_path)}")
            if time.monotonic() > deadline:
                raise KvPoolError(ErrorCode.TIMEOUT, f"{name} not ready after {timeout:.0f} s:\n{_tail(log_path)}")
            time.sleep(0.02)
        info.endpoints = json.loads(ready.read_text())
        info.address = info.endpoints.get("grpc") or info.endpoints.get("tcp", "")
        info.node = info.endpoints.get("node", "")
        return info

    def add_master(
        self, extra: tuple[str, ...] = (), timeout: float = 60.0, prefix: tuple[str, ...] = (), group: int = 0
    ) -> ProcInfo:
        args = [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--cluster",
            self.cluster,
            *self._token_args(),
            *self.master_args,
            *extra,
        ]
        if self.ha:
            args += ["--etcd", ",".join(self.etcd_endpoints)]
        if self.groups > 1:
            args += ["--groups", str(self.groups), "--group", str(group)]
        info = self._spawn("master", args, timeout, prefix)
        info.group = group
        return info

    def group_masters(self, group: int) -> list[ProcInfo]:
        """The masters of one shard group (all of them with one group)."""
        return [p for p in self.masters if p.group == group]

    def _token_args(self) -> list[str]:
        return ["--token-file", self.token_file] if self.token_file else []

    def add_store(
        self,
        size: str | None = None,
        node: str = "",
        extra: tuple[str, ...] = (),
        timeout: float = 60.0,
        prefix: tuple[str, ...] = (),
    ) -> ProcInfo:
        """Start a store; ``prefix`` wraps its command line (``ip netns exec NS``: a store on another
        "host")."""
        args = [
            "--master",
            self.master,
            "--size",
            size or self.store_size,
            "--host",
            "127.0.0.1",
            "--cluster",
            self.cluster,
            *self._token_args(),
            *self.store_args,
            *extra,
        ]
        if node:
            args += ["--node", node]
        info = self._spawn("store", args, timeout, prefix)
        self.save()
        return info

    # --- faults and stop -------------------------------------------------------------------------

    def signal(self, info: ProcInfo, sig: int) -> None:
        if _alive(info.pid):
            os.kill(info.pid, sig)

    def kill(self, info: ProcInfo) -> None:
        """SIGKILL and reap (a killed store's segment file is removed, as its clean exit would)."""
        self.signal(info, signal.SIGKILL)
        self._reap(info, 10.0)
        _remove_segment_file(info)

    def terminate(self, info: ProcInfo, timeout: float = 10.0) -> None:
        """SIGTERM, wait, then SIGKILL."""
        self.signal(info, signal.SIGTERM)
        if not self._reap(info, timeout):
            self.kill(info)

    def _reap(self, info: ProcInfo, timeout: float) -> bool:
        proc = self._popen.get(info.pid)
        if proc is None:
            deadline = time.monotonic() + timeout
            while _alive(info.pid) and time.monotonic() < deadline:
                time.sleep(0.02)
            return not _alive(info.pid)
        try:
            proc.wait(timeout)
            return True
        except subprocess.TimeoutExpired:
            return False

    def restart(self, info: ProcInfo, timeout: float = 60.0) -> ProcInfo:
        """Start a process of the same role with the same arguments (a restarted master or store);
        a process still running is stopped first (SIGTERM)."""
        if _alive(info.pid):
            self.terminate(info)
        self.processes.remove(info)
        args = list(info.args)
        if info.role == "master" and not self.ha and info.address:
            # A standalone master comes back at the same address, or nobody could find it again.
            args += ["--port", info.address.rsplit(":", 1)[1]]
            if info.endpoints.get("rpc"):
                args += ["--rpc-port", info.endpoints["rpc"].rsplit(":", 1)[1]]
        new = self._spawn(info.role, args, timeout, tuple(info.prefix))
        new.group = info.group
        self.save()
        return new

    def stop(self) -> None:
        for info in reversed(self.processes):
            if info.role != "etcd":
                self.terminate(info, timeout=5.0)
                _remove_segment_file(info)
        if self.etcd is not None:
            self.etcd.close()
            self.etcd = None
        self.processes.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- persisted description (for `kvpool local status|down`) ---------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "master": self.master,
            "cluster": self.cluster,
            "dir": str(self.base_dir),
            "groups": self.groups,
            "processes": [
                {
                    "role": p.role,
                    "pid": p.pid,
                    "address": p.address,
                    "node": p.node,
                    "alive": _alive(p.pid),
                    **({"group": p.group} if p.role == "master" else {}),
                }
                for p in self.processes
            ],
        }

    def save(self) -> None:
        doc = {**self.status(), "detail": [asdict(p) for p in self.processes]}
        (self.base_dir / "cluster.json").write_text(json.dumps(doc, indent=2))


def load_status(base_dir: Path) -> dict[str, Any]:
    path = base_dir / "cluster.json"
    if not path.exists():
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"no local cluster in {base_dir} (run `kvpool local up`)")
    doc: dict[str, Any] = json.loads(path.read_text())
    for proc in doc["processes"]:
        proc["alive"] = _alive(proc["pid"])
    return doc


def down(base_dir: Path, timeout: float = 10.0) -> list[int]:
    """Stop exactly the processes `local up` started in ``base_dir``; returns their pids."""
    doc = load_status(base_dir)
    pids = [p["pid"] for p in doc["processes"] if _alive(p["pid"]) and _is_ours(p["pid"], str(base_dir))]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    for detail in doc.get("detail", []):
        _remove_segment_file(ProcInfo(**detail))
    (base_dir / "cluster.json").unlink(missing_ok=True)
    return pids


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _remove_segment_file(info: ProcInfo) -> None:
    """A store that died without its clean exit leaves its shared-memory file (RAM) behind."""
    if info.role != "store" or _alive(info.pid):
        return
    paths = {info.endpoints.get("shm", ""), *info.endpoints.get("shm_paths", [])}  # one per shard group
    for path in paths - {""}:
        Path(path).unlink(missing_ok=True)


# --- `kvpool local up`: a fresh cluster, what a kept one kept, and readiness ----------------------

_STATE_DIRS = ("etcd",)
"""What a run leaves in the cluster directory that the next run would inherit: etcd's data (drains,
cluster config and every other durable intent)."""

_KIND_NAMES = {"drain": "drained nodes", "config": "cluster config"}


def reset_state(base_dir: Path) -> list[str]:
    """Remove what an earlier `local up` in ``base_dir`` left behind (a fresh cluster); the names removed."""
    removed = []
    for name in _STATE_DIRS:
        path = base_dir / name
        if path.exists():
            shutil.rmtree(path)
            removed.append(name)
    for stale in [*base_dir.glob("*.ready"), *base_dir.glob("*.log")]:
        stale.unlink(missing_ok=True)
    return removed


def kept_state(cluster: LocalCluster) -> dict[str, list[str]]:
    """What a kept cluster inherited from etcd, by kind: {"drained nodes": [...], "cluster config": [...]}."""
    if not cluster.etcd_endpoints:
        return {}
    from kvpool.common.etcd import EtcdClient, cluster_prefix

    root = cluster_prefix(cluster.cluster) + "intents/"
    etcd = EtcdClient(cluster.etcd_endpoints, timeout=5.0)
    try:
        kept: dict[str, list[str]] = {}
        for kv in etcd.get_prefix(root):
            kind, _, name = kv.key[len(root) :].partition("/")
            kept.setdefault(_KIND_NAMES.get(kind, kind), []).append(name)
        return kept
    finally:
        etcd.close()


PROBE_KEY = "kvpool-local-up-probe"


def wait_serving(master: str, token_file: str, can_store: bool, timeout: float = 60.0) -> None:
    """Return once the cluster serves: a put and a get of a probe object work (only a lookup when it has
    no stores). A new HA leader warms up for a lease TTL before it serves."""
    from kvpool.client import ClientConfig, PoolClient

    config = ClientConfig(master=master, token_file=token_file, timeout_s=2.0, use_shm=False, lease_cache_entries=0)
    deadline = time.monotonic() + timeout
    last = ""
    with PoolClient(config=config) as pool:
        while time.monotonic() < deadline:
            last = _probe(pool, can_store)
            if not last:
                return
            time.sleep(0.1)
    raise KvPoolError(ErrorCode.TIMEOUT, f"the local cluster does not serve after {timeout:.0f} s: {last}")


def _probe(pool: Any, can_store: bool) -> str:
    """ "" when the cluster served a put and a get (or a lookup); else what failed."""
    if not can_store:
        found = pool.batch_exists([PROBE_KEY])[0]
        return "" if found >= 0 else f"lookup: {as_code(found)}"
    code = pool.put(PROBE_KEY, b"probe")
    if code != 0:
        return f"put: {as_code(code)}"
    if pool.get(PROBE_KEY) != b"probe":
        return "get: the probe object did not read back"
    pool.remove(PROBE_KEY, force=True)
    return ""
