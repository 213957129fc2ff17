"""A FAKE verbs provider that works across processes: a test double for a NIC, selected by ``KVPOOL_VERBS=fake``.

It reuses the in-process fake's objects (:mod:`kvpool.transfer.verbs_fake`: QP state machine, CQs, MR
keys and limits, injected faults) and replaces the "wire". Each opened device context publishes what a
responder's HCA would know - its QPs (state, connected peer, access flags) and its MRs (address, length,
rkey, access) - in a small state file under a fabric directory shared by the processes
(``KVPOOL_FAKE_VERBS_DIR``, default ``/dev/shm/kvpool-fake-verbs-<uid>``). A one-sided READ/WRITE posted in
the client process looks the peer up in that file and makes the checks an HCA makes (peer QP connected back
and in RTR/RTS, rkey names a live MR covering the range, QP and MR allow the access), then moves the bytes
with ``process_vm_readv``/``process_vm_writev`` into or out of the peer process's memory. The store's CPU
takes no part in the transfer, as with real hardware. A violation completes with REM_ACCESS_ERR and moves
the initiator's QP to ERR (the responder's QP lives in the other process and is left as it is).

Limits of the fake: both processes must run as one user (``process_vm_*`` needs ptrace rights), and the
state file is re-read whenever its version counter (a mapped 8-byte file next to it) moved, so a
deregistered MR or destroyed QP stops working for the next work request posted after the change returned.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import mmap
import os
import tempfile
from collections import deque
from typing import Any, ClassVar

from kvpool.common import envs
from kvpool.common.log import get_logger
from kvpool.transfer.verbs import (
    Access,
    CompletionQueue,
    MemoryRegion,
    Mtu,
    Opcode,
    QpInfo,
    QpState,
    QueuePair,
    VerbsError,
    WcStatus,
    WorkRequest,
)
from kvpool.transfer.verbs_fake import (
    MAX_MSG_BYTES,
    FakeContext,
    FakeCQ,
    FakeDmabufMR,
    FakeFabric,
    FakeMR,
    FakeQP,
    FakeVerbs,
)

logger = get_logger(__name__)

_PORT_NUMBERS = itertools.count(1)
_REMOTE = Access.REMOTE_READ | Access.REMOTE_WRITE
_RESPONDER_STATES = frozenset({int(QpState.RTR), int(QpState.RTS), int(QpState.SQD)})


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("length", ctypes.c_size_t)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.process_vm_readv.restype = ctypes.c_ssize_t
_libc.process_vm_writev.restype = ctypes.c_ssize_t


def fabric_dir() -> str:
    """The directory the fake devices of every process on this machine share."""
    return envs.KVPOOL_FAKE_VERBS_DIR.get() or os.path.join("/dev/shm", f"kvpool-fake-verbs-{os.getuid()}")


def _remote_copy(pid: int, local_addr: int, remote_addr: int, length: int, write: bool) -> bool:
    """Copy ``length`` bytes between this process and ``pid`` (the fake's wire); False when the peer is gone."""
    done = 0
    while done < length:
        local = _Iovec(local_addr + done, length - done)
        remote = _Iovec(remote_addr + done, length - done)
        call = _libc.process_vm_writev if write else _libc.process_vm_readv
        n = call(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n <= 0:
            return False
        done += n
    return True


class IpcFakeFabric(FakeFabric):
    """The fabric of the cross-process fake: the in-process bookkeeping plus the shared state directory."""

    total_bytes_moved = 0
    """Bytes this process's fake NICs moved, all fabrics together (tests prove a run used RDMA with it)."""
    bytes_by_device: ClassVar[dict[str, int]] = {}
    """The same, per fake device of this process (tests prove that several NICs carried bytes)."""

    def __init__(self, directory: str | None = None) -> None:
        super().__init__()
        self.posted = deque(maxlen=1024)  # type: ignore[assignment]  # a long run must not keep every WR
        self.directory = directory or fabric_dir()
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        self._peers: dict[str, tuple[int, dict[str, Any]]] = {}  # gid -> (version, state)
        self._versions: dict[str, mmap.mmap] = {}  # gid -> its 8-byte version counter, mapped

    def peer_state(self, gid: str) -> dict[str, Any] | None:
        """The published state of the device context with this GID, re-read whenever its version moved."""
        version = self._versions.get(gid)
        if version is None:
            version = _map_version(os.path.join(self.directory, _file_name(gid, ".ver")), create=False)
            if version is None:
                return None
            self._versions[gid] = version
        seen = int.from_bytes(version[:8], "little")
        cached = self._peers.get(gid)
        if cached is not None and cached[0] == seen:
            return cached[1]
        try:
            with open(os.path.join(self.directory, _file_name(gid, ".json")), encoding="ascii") as f:
                state: dict[str, Any] = json.load(f)
        except (OSError, ValueError):
            return None
        self._peers[gid] = (seen, state)
        return state


def _file_name(gid: str, suffix: str) -> str:
    return gid.replace(":", "") + suffix


def _map_version(path: str, create: bool) -> mmap.mmap | None:
    """The 8-byte version counter of a context's state file, mapped shared."""
    try:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0) | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        if create:
            os.ftruncate(fd, 8)
        return mmap.mmap(fd, 8, flags=mmap.MAP_SHARED)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


class IpcFakeVerbs(FakeVerbs):
    """The cross-process FAKE verbs library (``KVPOOL_VERBS=fake``): every process gets its own GIDs."""

    name = "fake-ipc"

    def __init__(
        self,
        directory: str | None = None,
        devices: tuple[str, ...] | None = None,
        max_mr_bytes: int = 1 << 30,
        max_qp_wr: int = 1024,
        mtu: Mtu = Mtu.MTU_4096,
        numa_nodes: dict[str, int] | None = None,
        native: bool | None = None,
    ) -> None:
        if devices is None:
            devices, numa_nodes = fake_devices_from_env()
        super().__init__(IpcFakeFabric(directory), devices, max_mr_bytes, max_qp_wr, mtu, numa_nodes, native)

    def open(self, device: str, port: int = 1, gid_index: int = 0) -> IpcFakeContext:
        if device not in self.devices:
            raise VerbsError(
                f"no RDMA device named {device!r} (have {', '.join(self.devices) or 'none'})", errno.ENODEV
            )
        if port != 1:
            raise VerbsError(f"device {device} has no port {port}", errno.EINVAL)
        ctx = IpcFakeContext(self, device, gid_index)
        self.contexts.append(ctx)
        return ctx


class IpcFakeContext(FakeContext):
    """A fake device port whose QPs and MRs are published for the other processes' fake NICs."""

    def __init__(self, verbs: IpcFakeVerbs, device: str, gid_index: int) -> None:
        super().__init__(verbs, device, gid_index)
        # Unique across processes: the pid and a per-process port number.
        # Every context of this process gets its own port number (several clients may live in one process).
        self.lid = next(_PORT_NUMBERS) & 0xFFFF or 1
        self.gid = f"fe80:0000:{os.getpid() >> 16:04x}:{os.getpid() & 0xFFFF:04x}:0000:0000:{self.lid:04x}:0001"
        assert isinstance(self.fabric, IpcFakeFabric)
        self.ipc_fabric: IpcFakeFabric = self.fabric
        self._path = os.path.join(self.ipc_fabric.directory, _file_name(self.gid, ".json"))
        self._version_path = os.path.join(self.ipc_fabric.directory, _file_name(self.gid, ".ver"))
        self._version = 0
        version = _map_version(self._version_path, create=True)
        if version is None:
            raise VerbsError(f"fake NIC: cannot create {self._version_path}", errno.EIO)
        self._version_map: mmap.mmap = version
        self.publish()

    def publish(self) -> None:
        """Write what this device's HCA knows, atomically (readers see the old or the new state).

        Snapshot and write happen under one lock: two threads publishing at once must not let an older
        snapshot overwrite a newer one (a just-bound window would vanish for the peers)."""
        with self.fabric.lock:
            if self.closed:
                return
            state = self._snapshot()
            fd, tmp = tempfile.mkstemp(dir=self.ipc_fabric.directory, prefix=".tmp-")
            with os.fdopen(fd, "w", encoding="ascii") as f:
                json.dump(state, f)
            os.replace(tmp, self._path)
            # Bumped after the replace: once publish() returns, every peer's next check sees this state.
            self._version += 1
            self._version_map[:8] = self._version.to_bytes(8, "little")

    def _snapshot(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "device": self.name,
            "qps": {
                str(qp.qp_num): {
                    "state": int(qp.state),
                    "access": int(qp.access),
                    "remote": list(qp.remote) if qp.remote else None,
                }
                for qp in self.qps
                if not qp.closed
            },
            "mrs": {
                str(mr.rkey): [mr.addr, mr.length, int(mr.access), mr.bound_qp]
                for mr in self._by_rkey.values()
                if not mr.closed and mr.access & _REMOTE
            },
        }

    def reg_mr(self, address: int, length: int, access: Access) -> FakeMR:
        mr = super().reg_mr(address, length, access)
        if access & _REMOTE:  # only what a peer may reach is published: local-only MRs stay private
            self.publish()
        return mr

    def bind_window(self, mr: MemoryRegion, qp: QueuePair, addr: int, length: int, access: Access) -> MemoryRegion:
        return super().bind_window(mr, qp, addr, length, access)  # visible to peers at flush_windows()

    def flush_windows(self) -> None:
        super().flush_windows()  # the binds and invalidations posted through the fake provider completed
        self.publish()

    def forget_mr(self, mr: FakeMR) -> None:
        super().forget_mr(mr)
        if not self.closed and mr.access & _REMOTE and mr.bound_qp is None:
            self.publish()  # a window's invalidation is published by flush_windows()

    def create_qp(self, cq: CompletionQueue, max_send_wr: int) -> IpcFakeQP:
        self._check_open()
        if not isinstance(cq, FakeCQ) or cq.ctx is not self:
            raise VerbsError("the CQ belongs to another context", errno.EINVAL)
        if not 0 < max_send_wr <= self.max_qp_wr:
            raise VerbsError(f"max_send_wr {max_send_wr} outside 1..{self.max_qp_wr}", errno.EINVAL)
        qp = self.new_qp(cq, max_send_wr)
        self.qps.append(qp)
        self.fabric.add_qp(qp)
        self.publish()
        return qp

    def new_qp(self, cq: FakeCQ, max_send_wr: int) -> IpcFakeQP:
        if self.verbs.native:
            from kvpool.transfer.verbs_native import NativeFakeCQ, NativeIpcFakeQP

            if isinstance(cq, NativeFakeCQ):
                return NativeIpcFakeQP(self, cq, max_send_wr)
        return IpcFakeQP(self, cq, max_send_wr)

    def close(self) -> None:
        super().close()
        with self.fabric.lock:
            _unlink(self._path)
            _unlink(self._version_path)
            self._version_map.close()


class IpcFakeQP(FakeQP):
    """An RC QP of the cross-process fake: its peer may live in another process."""

    ctx: IpcFakeContext

    def _move(self, target: QpState) -> None:
        super()._move(target)
        self.ctx.publish()

    def to_init(self, access: Access) -> None:
        super().to_init(access)
        self.ctx.publish()  # the access flags are part of what the peer's NIC checks

    def to_rtr(self, remote: QpInfo, mtu: Mtu) -> None:
        super().to_rtr(remote, mtu)
        self.ctx.publish()

    def force_error(self) -> None:
        super().force_error()
        self.ctx.publish()

    def close(self) -> None:
        super().close()
        if not self.ctx.closed:
            self.ctx.publish()

    def _execute(self, wr: WorkRequest) -> WcStatus:
        return self._execute_remote(wr)  # timed as the NIC's share by FakeQP._run

    def _execute_remote(self, wr: WorkRequest) -> WcStatus:
        """What the NIC checks against the peer's published state, then the copy into or out of its process."""
        if wr.length > MAX_MSG_BYTES:
            return WcStatus.LOC_LEN_ERR
        local = self.ctx.local_mr(wr.lkey, wr.local_addr, wr.length)
        if local is None or (wr.opcode == Opcode.RDMA_READ and not local.access & Access.LOCAL_WRITE):
            return WcStatus.LOC_PROT_ERR
        if self.remote is None:
            return WcStatus.RETRY_EXC_ERR
        gid, qpn = self.remote
        peer = self.ctx.ipc_fabric.peer_state(gid)
        peer_qp = None if peer is None else peer["qps"].get(str(qpn))
        if (
            peer is None
            or peer_qp is None
            or peer_qp["state"] not in _RESPONDER_STATES
            or peer_qp["remote"] != [self.ctx.gid, self._num]
        ):
            return WcStatus.RETRY_EXC_ERR  # nobody answers on the other end: the retries run out
        need = Access.REMOTE_READ if wr.opcode == Opcode.RDMA_READ else Access.REMOTE_WRITE
        mr = peer["mrs"].get(str(wr.rkey))
        covered = (
            mr is not None
            and mr[0] <= wr.remote_addr
            and wr.remote_addr + wr.length <= mr[0] + mr[1]
            and mr[3] in (None, qpn)  # a memory window works only through the QP it is bound to
        )
        if not peer_qp["access"] & need or not covered or mr is None or not mr[2] & need:
            logger.debug(
                "fake NIC: REM_ACCESS_ERR: rkey %#x [%#x, +%d) %s, peer QP access %d, entry %s",
                wr.rkey,
                wr.remote_addr,
                wr.length,
                wr.opcode.name,
                peer_qp["access"],
                mr,
            )
            return WcStatus.REM_ACCESS_ERR
        here = local.host_address(wr.local_addr)  # an SGE of a dma-buf MR is an IOVA
        if not _remote_copy(int(peer["pid"]), here, wr.remote_addr, wr.length, wr.opcode != Opcode.RDMA_READ):
            return WcStatus.RETRY_EXC_ERR  # the peer process is gone
        self.ctx.fabric.bytes_moved += wr.length
        if isinstance(local, FakeDmabufMR):
            self.ctx.fabric.dmabuf_bytes += wr.length
        IpcFakeFabric.total_bytes_moved += wr.length
        by_device = IpcFakeFabric.bytes_by_device
        by_device[self.ctx.name] = by_device.get(self.ctx.name, 0) + wr.length
        return WcStatus.SUCCESS


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def fake_devices_from_env() -> tuple[tuple[str, ...], dict[str, int]]:
    """The fake devices ``KVPOOL_FAKE_VERBS_DEVICES`` names (``NAME[:NUMA_NODE][,...]``), with their NUMA nodes."""
    names: list[str] = []
    nodes: dict[str, int] = {}
    for item in envs.KVPOOL_FAKE_VERBS_DEVICES.get().split(","):
        name, _, node = item.strip().partition(":")
        if not name:
            continue
        names.append(name)
        if node.strip().lstrip("-").isdigit():
            nodes[name] = int(node)
    return (tuple(names) or ("fake_mlx5_0",)), nodes


def fake_requested() -> bool:
    """Whether this process was told to use the cross-process fake NIC (``KVPOOL_VERBS=fake``)."""
    return envs.KVPOOL_VERBS.get().strip().lower() == "fake"


def stale_state_files(directory: str | None = None) -> list[str]:
    """State files whose process is gone (a killed store): tests and tools may remove them."""
    base = directory or fabric_dir()
    stale = []
    for name in os.listdir(base) if os.path.isdir(base) else []:
        if not name.endswith(".json"):
            continue
        try:
            with open(os.path.join(base, name), encoding="ascii") as f:
                pid = int(json.load(f)["pid"])
            os.kill(pid, 0)
        except ProcessLookupError:
            stale.append(os.path.join(base, name))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return stale
