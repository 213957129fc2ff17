"""Fault injection for the chaos tests: a delaying TCP proxy and network namespaces with veth + iptables.

netem is not available on the team's kernels (no sch_netem module), so delay comes from a
user-space proxy; partitions come from iptables rules inside namespaces this module creates. Everything
is created by the test that uses it and removed by ``close()`` even when the test fails; the namespaces
use only 10.x addresses, inside namespaces created here.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass

import pytest


# ---------------------------------------------------------------------- a delaying TCP proxy
class DelayProxy:
    """Forwards TCP from ``listen`` to ``target``, holding every chunk ``delay_s`` in each direction.

    ``stall = True`` holds everything (a store that accepts but never answers) until set back. The proxy
    runs its own asyncio loop on a daemon thread; ``close()`` stops it and drops every connection.
    """

    CHUNK = 64 * 1024

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], delay_s: float = 0.0) -> None:
        self.listen = listen
        self.target = target
        self.delay_s = delay_s
        self.stall = False
        self.connections = 0
        self.pending = 0  # chunks read and not yet forwarded
        self.active = 0  # directions (two per connection) still open
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)

    def start(self) -> DelayProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("delay proxy did not start")
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, self.listen[0], self.listen[1]))
        self._ready.set()
        self._loop.run_forever()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self.connections += 1
        self._writers.update((writer, up_writer))
        for src, dst in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.ensure_future(self._pump(src, dst))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Read chunks as they come and forward each once ``delay_s`` has passed since it arrived."""
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        sender = asyncio.ensure_future(self._send(queue, dst))
        self.active += 1
        try:
            while True:
                try:
                    data = await src.read(self.CHUNK)
                except OSError:
                    data = b""  # a reset: forward what was read, then end this direction
                self.pending += 1
                await queue.put((time.monotonic() + self.delay_s, data))
                if not data:
                    break
            await sender
        except (OSError, asyncio.CancelledError):
            sender.cancel()
        finally:
            self.active -= 1
            dst.close()

    async def _send(self, queue: asyncio.Queue[tuple[float, bytes]], dst: asyncio.StreamWriter) -> None:
        while True:
            due, data = await queue.get()
            while self.stall or time.monotonic() < due:
                await asyncio.sleep(max(0.001, min(0.05, due - time.monotonic())))
            self.pending -= 1
            if not data:
                with contextlib.suppress(OSError):
                    dst.write_eof()
                return
            dst.write(data)
            await dst.drain()

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def shutdown() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.close()
            for task in list(self._tasks):
                task.cancel()
            await asyncio.sleep(0)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


# ---------------------------------------------------------------------- network namespaces
def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


@dataclass
class NetnsPair:
    """Two "hosts": namespaces ``a`` and ``b`` joined by a veth pair, 10.<x>.<y>.1 (a) and .2 (b)."""

    a: str
    b: str
    addr_a: str
    addr_b: str

    @classmethod
    def create(cls) -> NetnsPair:
        """Create the pair, or skip the test with the kernel's reason (no netns, no veth, not root)."""
        if os.geteuid() != 0:
            pytest.skip("network namespaces need root")
        if shutil.which("ip") is None:
            pytest.skip("iproute2 (ip) is not installed")
        tag = f"{os.getpid() % 100000}{random.randrange(100)}"
        x, y = 200 + random.randrange(50), random.randrange(1, 250)
        pair = cls(f"kvpa{tag}", f"kvpb{tag}", f"10.{x}.{y}.1", f"10.{x}.{y}.2")
        try:
            pair._setup()
        except subprocess.CalledProcessError as exc:
            pair.close()
            pytest.skip(f"the kernel refused a network namespace or veth pair: {exc.stderr.strip()}")
        return pair

    def _setup(self) -> None:
        a, b = self.a, self.b
        _run("ip", "netns", "add", a)
        _run("ip", "netns", "add", b)
        # The veth ends are created inside the namespaces, never in the host's: nothing leaks on failure.
        _run("ip", "-n", a, "link", "add", "veth0", "type", "veth", "peer", "name", "veth0", "netns", b)
        _run("ip", "-n", a, "addr", "add", f"{self.addr_a}/24", "dev", "veth0")
        _run("ip", "-n", b, "addr", "add", f"{self.addr_b}/24", "dev", "veth0")
        for ns in (a, b):
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "link", "set", "veth0", "up")

    def exec_prefix(self, ns: str) -> tuple[str, ...]:
        return ("ip", "netns", "exec", ns)

    def iptables(self, ns: str, *rule: str) -> None:
        """Run ``iptables RULE`` inside ``ns`` (its rules vanish with the namespace)."""
        if shutil.which("iptables") is None:
            pytest.skip("iptables is not installed (apt-get install iptables)")
        try:
            _run("ip", "netns", "exec", ns, "iptables", *rule)
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"iptables refused {' '.join(rule)}: {exc.stderr.strip()}")

    def close(self) -> None:
        for ns in (self.a, self.b):
            _run("ip", "netns", "del", ns, check=False)

    @staticmethod
    def leftovers(prefix: str = "kvp") -> list[str]:
        out = _run("ip", "netns", "list", check=False).stdout
        return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def free_port(host: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
