"""Real etcd members on loopback (tests and `kvpool local up --ha`): start, wait until healthy, kill / freeze /
restart, clean up.

Independent of kvpool's own etcd client on purpose (it is one of the things under test): readiness and
leader discovery use etcd's HTTP endpoints (``/health`` and the JSON gateway ``/v3/maintenance/status``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ETCD_BINARY = "etcd"

# Fast raft timings for tests: a lost leader is replaced in well under a second. etcd's minimum lease TTL
# becomes ceil(1.5 * election timeout) = 1 s.
FAST_TIMINGS = ("--heartbeat-interval=50", "--election-timeout=300")


def etcd_binary() -> str | None:
    return shutil.which(ETCD_BINARY)


def free_port() -> int:
    """A port the kernel considers free now (bind to 0, read it, release it); callers retry on a clash."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdClusterError(RuntimeError):
    pass


@dataclass
class _Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    member_id: str = ""  # decimal string as the JSON gateway reports it
    stopped: bool = False  # SIGSTOPped

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


class EtcdCluster:
    """``size`` etcd members on free loopback ports with data under ``base_dir``.

    Use as a context manager (or call :meth:`close`): every member it started is killed and ``base_dir``'s
    member directories are removed, also when start-up fails.
    """

    def __init__(
        self,
        size: int = 1,
        base_dir: str | os.PathLike[str] | None = None,
        *,
        extra_args: tuple[str, ...] = FAST_TIMINGS,
        start_timeout: float = 20.0,
        attempts: int = 3,
    ) -> None:
        if size not in (1, 3, 5):
            raise ValueError("etcd clusters here have 1, 3 or 5 members")
        binary = etcd_binary()
        if binary is None:
            raise EtcdClusterError("the etcd binary is not installed (apt-get install etcd-server)")
        self._binary = binary
        self._owns_base = base_dir is None
        self.base_dir = Path(base_dir) if base_dir is not None else Path(_mkdtemp())
        self.size = size
        self._extra = extra_args
        self._start_timeout = start_timeout
        self.members: list[_Member] = []
        try:
            self._start_with_retries(attempts)
        except BaseException:
            self.close()
            raise

    # ---- start-up -----------------------------------------------------------------------------------

    def _start_with_retries(self, attempts: int) -> None:
        last: Exception | None = None
        for attempt in range(attempts):
            try:
                self._start_all(attempt)
                return
            except EtcdClusterError as e:
                last = e
                port_clash = "address already in use" in str(e)
                self._kill_all()
                if not port_clash:
                    raise
        raise EtcdClusterError(f"etcd did not start after {attempts} attempts (port clashes): {last}")

    def _start_all(self, attempt: int) -> None:
        token = f"kvpool-test-{uuid.uuid4().hex[:12]}"
        self.members = []
        ports = _distinct_free_ports(2 * self.size)
        for i in range(self.size):
            mdir = self.base_dir / f"etcd-a{attempt}-m{i}"
            mdir.mkdir(parents=True, exist_ok=True)
            self.members.append(
                _Member(
                    name=f"m{i}",
                    client_port=ports[2 * i],
                    peer_port=ports[2 * i + 1],
                    data_dir=mdir / "data",
                    log_path=mdir / "etcd.log",
                )
            )
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            self._spawn(m, initial, token)
        deadline = time.monotonic() + self._start_timeout
        for i in range(self.size):
            self._wait_healthy(i, deadline)
        for m in self.members:
            m.member_id = str(self._status(m)["header"]["member_id"])

    def _spawn(self, m: _Member, initial_cluster: str = "", token: str = "") -> None:
        args = [
            self._binary,
            f"--name={m.name}",
            f"--data-dir={m.data_dir}",
            f"--listen-client-urls={m.client_url}",
            f"--advertise-client-urls={m.client_url}",
            f"--listen-peer-urls={m.peer_url}",
            f"--initial-advertise-peer-urls={m.peer_url}",
            f"--initial-cluster={initial_cluster or self._initial_cluster()}",
            "--initial-cluster-state=new",
            f"--initial-cluster-token={token or 'restart'}",
            "--logger=zap",
            "--log-outputs=stderr",
            *self._extra,
        ]
        log = open(m.log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            m.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        finally:
            log.close()
        m.stopped = False

    def _initial_cluster(self) -> str:
        return ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def _wait_healthy(self, i: int, deadline: float) -> None:
        m = self.members[i]
        while True:
            if not m.running():
                tail = m.log_tail()
                raise EtcdClusterError(f"etcd member {m.name} exited during start-up:\n{tail}")
            if _health(m.client_url):
                return
            if time.monotonic() > deadline:
                raise EtcdClusterError(f"etcd member {m.name} not healthy in time:\n{m.log_tail()}")
            time.sleep(0.05)

    # ---- queries --------------------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    @property
    def endpoints_str(self) -> str:
        return ",".join(self.endpoints)

    def member_pid(self, i: int) -> int:
        proc = self.members[i].proc
        if proc is None:
            raise EtcdClusterError(f"member {i} is not running")
        return proc.pid

    def member_id(self, i: int) -> int:
        return int(self.members[i].member_id)

    def index_of_member_id(self, member_id: int) -> int:
        for i, m in enumerate(self.members):
            if m.member_id == str(member_id):
                return i
        raise KeyError(member_id)

    def _status(self, m: _Member) -> dict[str, Any]:
        req = urllib.request.Request(
            f"{m.client_url}/v3/maintenance/status", data=b"{}", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=1.0) as resp:
            doc = json.loads(resp.read())
        if not isinstance(doc, dict):
            raise EtcdClusterError(f"unexpected status answer {doc!r}")
        return doc

    def leader_index(self, timeout: float = 10.0) -> int:
        """The index of the raft leader, as agreed by every live, unfrozen member (polls until then)."""
        deadline = time.monotonic() + timeout
        while True:
            seen: set[str] = set()
            for m in self.members:
                if m.running() and not m.stopped:
                    try:
                        seen.add(str(self._status(m).get("leader", "")))
                    except (OSError, ValueError):
                        seen.add("?")
            if len(seen) == 1:
                (leader,) = seen
                for i, m in enumerate(self.members):
                    if m.member_id == leader and m.running() and not m.stopped:
                        return i
            if time.monotonic() > deadline:
                raise EtcdClusterError(f"no agreed etcd leader within {timeout}s (saw {seen})")
            time.sleep(0.05)

    def wait_healthy(self, i: int | None = None, timeout: float = 15.0) -> None:
        """Wait until member ``i`` (default: every running member) answers /health with true."""
        deadline = time.monotonic() + timeout
        indexes = [i] if i is not None else [j for j, m in enumerate(self.members) if m.running()]
        for j in indexes:
            self._wait_healthy(j, deadline)

    # ---- faults ---------------------------------------------------------------------------------------

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` and reap it."""
        m = self.members[i]
        if m.proc is not None and m.proc.poll() is None:
            m.proc.kill()
            m.proc.wait(10)
        m.stopped = False

    def stop(self, i: int) -> None:
        """Freeze member ``i`` (SIGSTOP): its sockets stay open but it never answers."""
        m = self.members[i]
        if m.proc is None or m.proc.poll() is not None:
            raise EtcdClusterError(f"member {i} is not running")
        os.kill(m.proc.pid, signal.SIGSTOP)
        m.stopped = True

    def cont(self, i: int) -> None:
        m = self.members[i]
        if m.proc is not None and m.proc.poll() is None:
            os.kill(m.proc.pid, signal.SIGCONT)
        m.stopped = False

    def restart(self, i: int, timeout: float = 15.0) -> None:
        """Restart member ``i`` on its old ports and data; a running one is stopped (SIGTERM) first.

        Waits for the old process to exit before starting the new one: etcd 3.4 dies silently when it is
        started again too quickly.
        """
        m = self.members[i]
        if m.proc is not None:
            if m.stopped:
                self.cont(i)
            if m.proc.poll() is None:
                m.proc.terminate()
            try:
                m.proc.wait(10)
            except subprocess.TimeoutExpired:
                m.proc.kill()
                m.proc.wait(10)
        self._spawn(m)
        self.wait_healthy(i, timeout)

    # ---- teardown -------------------------------------------------------------------------------------

    def _kill_all(self) -> None:
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    m.proc.kill()  # SIGKILL also ends a SIGSTOPped process
                with contextlib.suppress(subprocess.TimeoutExpired):
                    m.proc.wait(10)

    def close(self) -> None:
        """Kill every member this object started and remove their directories. Idempotent."""
        self._kill_all()
        for m in self.members:
            shutil.rmtree(m.data_dir.parent, ignore_errors=True)
        self.members = []
        if self._owns_base:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _distinct_free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        p = free_port()
        if p not in ports:
            ports.append(p)
    return ports


def _health(client_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{client_url}/health", timeout=0.5) as resp:
            return bool(json.loads(resp.read()).get("health") in ("true", True))
    except (OSError, ValueError, urllib.error.URLError):
        return False


def _mkdtemp() -> str:
    return tempfile.mkdtemp(prefix="kvpool-etcd-")
