"""Several NICs (docs/rdma.md, "Several NICs"; decision 0022).

Client: :class:`RailsTransport` runs one :class:`RdmaTransport` per local device (a "rail"). A request of at
least ``stripe_bytes`` is cut into one contiguous part per rail, and the parts move at once; a smaller one
stays on one rail: the one whose device sits on the NUMA node of the request's buffer (the node of its first
page, asked of the kernel with ``get_mempolicy(MPOL_F_NODE | MPOL_F_ADDR)``), else the first. Rail N
connects to the store's device N modulo the number the store advertises. A written object is RECORDed once,
after every rail's part of it landed.

Store: :class:`RdmaResponders` serves the segments on several devices, one :class:`RdmaResponder` each
(every device registers every segment); ``RDMA_CONNECT`` names the device it wants.
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import Grant, GrantOp
from kvpool.common.log import get_logger
from kvpool.transfer.base import Replica, TransferBatch, TransferRequest, Transport
from kvpool.transfer.rdma_batch import _Batch
from kvpool.transfer.rdma_client import RdmaTransport
from kvpool.transfer.rdma_connection import _Connection
from kvpool.transfer.rdma_memory import SegmentMemory
from kvpool.transfer.rdma_responder import RdmaResponder
from kvpool.transfer.verbs import buffer_address

logger = get_logger(__name__)

DEFAULT_STRIPE_BYTES = 1 << 20
"""Requests of at least this many bytes are cut across every rail; smaller ones stay on one NIC."""
_STRIPE_ALIGN = 4096

_SYS_GET_MEMPOLICY = 239  # x86_64
_MPOL_F_NODE = 1
_MPOL_F_ADDR = 2
_libc = ctypes.CDLL(None, use_errno=True)


def buffer_numa_node(address: int) -> int:
    """The NUMA node of the page at ``address`` (the kernel allocates it there if it was never touched);
    -1 where the kernel cannot say (no NUMA support, another architecture)."""
    node = ctypes.c_int(-1)
    try:
        rc = _libc.syscall(
            _SYS_GET_MEMPOLICY,
            ctypes.byref(node),
            None,
            ctypes.c_ulong(0),
            ctypes.c_void_p(address),
            ctypes.c_ulong(_MPOL_F_NODE | _MPOL_F_ADDR),
        )
    except (OSError, AttributeError):
        return -1
    return node.value if rc == 0 else -1


def stripe_parts(length: int, rails: int, stripe_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) per rail: one part for a request under ``stripe_bytes`` (or one rail), else
    ``rails`` contiguous parts of near-equal size, cut at page multiples."""
    if rails <= 1 or length < stripe_bytes:
        return [(0, length)]
    share = -(-length // rails)
    share = -(-share // _STRIPE_ALIGN) * _STRIPE_ALIGN
    return [(start, min(share, length - start)) for start in range(0, length, share)]


class RailsTransport(Transport):
    """One-sided RDMA over several local NICs: one :class:`RdmaTransport` per device."""

    name = "rdma"

    def __init__(
        self,
        rails: Sequence[RdmaTransport],
        numa_nodes: Sequence[int],
        *,
        stripe_bytes: int = DEFAULT_STRIPE_BYTES,
        node_of: Callable[[int], int] = buffer_numa_node,
    ) -> None:
        if len(rails) < 2 or len(numa_nodes) != len(rails):
            raise ValueError("RailsTransport needs two or more rails and one NUMA node per rail")
        self.rails = list(rails)
        self.numa_nodes = list(numa_nodes)
        self.stripe_bytes = stripe_bytes
        self.device = ",".join(r.device for r in self.rails)
        self.max_mr_bytes = min(r.max_mr_bytes for r in self.rails)
        self._node_of = node_of
        first = self.rails[0]
        first.on_learn = self._teach_the_others  # the first rail discovers stores; the others learn from it

    def _teach_the_others(self, endpoint: str, info: Mapping[str, Any]) -> None:
        for rail in self.rails[1:]:
            rail.note_store_info(endpoint, info)

    @property
    def stats(self) -> Any:
        return self.rails[0].stats

    def note_store_info(self, endpoint: str, info: Mapping[str, Any]) -> bool:
        return all([rail.note_store_info(endpoint, info) for rail in self.rails])

    def can_reach(self, replica: Replica) -> bool:
        return self.rails[0].can_reach(replica)

    def preferred_rail(self, buffer: memoryview) -> int:
        """The rail whose NIC sits on the buffer's NUMA node; the first when none does (or nobody knows)."""
        if len(set(self.numa_nodes)) == 1:
            return 0
        try:
            node = self._node_of(buffer_address(buffer))
        except (TypeError, ValueError):
            return 0
        return self.numa_nodes.index(node) if node >= 0 and node in self.numa_nodes else 0

    def register_memory(self, buffer: memoryview) -> None:
        for rail in self.rails:
            rail.register_memory(buffer)

    def register_device_memory(
        self, base: int, size: int, buffer_id: int, export_dmabuf: Callable[[], int] | None
    ) -> None:
        """GPU memory on every rail (each rail's device registers its own MR; decision 0023)."""
        for rail in self.rails:
            rail.register_device_memory(base, size, buffer_id, export_dmabuf)

    def unregister_memory(self, buffer: memoryview) -> None:
        for rail in self.rails:
            rail.unregister_memory(buffer)

    def submit(self, requests: Sequence[TransferRequest], deadline: Deadline) -> TransferBatch:
        n = len(self.rails)
        parts: list[list[tuple[int, int]]] = [[(0, 0)] * len(requests) for _ in range(n)]
        for index, req in enumerate(requests):
            cut = stripe_parts(req.replica.length, n, self.stripe_bytes)
            if len(cut) == 1:
                parts[self._preferred(req)][index] = cut[0]
            else:
                for rail, part in enumerate(cut):
                    parts[rail][index] = part
        batches = [
            rail.submit_parts(requests, parts[r], deadline, record=False) if any(p[1] for p in parts[r]) else None
            for r, rail in enumerate(self.rails)
        ]
        return _RailsBatch(requests, batches)

    def _preferred(self, req: TransferRequest) -> int:
        try:
            view = req.buffer if isinstance(req.buffer, memoryview) else memoryview(req.buffer)
        except TypeError:
            return 0
        return self.preferred_rail(view)

    def post_us_per_wr(self) -> float | None:
        """As :meth:`RdmaTransport.post_us_per_wr`, over every rail (rails on one fake fabric share its NIC time)."""
        totals = [rail.posting_totals() for rail in self.rails]
        posted = sum(n for _, n in totals)
        if not posted:
            return None
        fabrics = {id(f): f for f in (rail.nic_fabric() for rail in self.rails) if f is not None}
        nic = sum(float(getattr(f, "nic_seconds", 0.0)) for f in fabrics.values())
        return max(0.0, sum(s for s, _ in totals) - nic) / posted * 1e6

    def close(self) -> None:
        for rail in self.rails:
            rail.close()


class _RailsBatch(TransferBatch):
    """The rails' batches of one submit: a request is OK when every rail moved its part; written objects are
    RECORDed once, on one of the connections that carried them, after all their parts landed."""

    def __init__(self, requests: Sequence[TransferRequest], batches: list[_Batch | None]) -> None:
        self._requests = requests
        self._batches = batches
        self._codes: list[ErrorCode] | None = None

    def wait(self, deadline: Deadline) -> list[ErrorCode]:
        if self._codes is not None:
            return self._codes
        codes = [ErrorCode.OK] * len(self._requests)
        carriers: dict[int, _Connection] = {}
        for batch in self._batches:
            if batch is None:
                continue
            for index, code in enumerate(batch.wait(deadline)):
                if code != ErrorCode.OK and codes[index] == ErrorCode.OK:
                    codes[index] = code
            for index, _, conn in batch.writes:
                carriers.setdefault(index, conn)
        by_conn: dict[_Connection, list[int]] = {}
        for index, conn in carriers.items():
            if codes[index] == ErrorCode.OK and self._requests[index].op == GrantOp.WRITE:
                by_conn.setdefault(conn, []).append(index)
        for conn, indices in by_conn.items():
            recorded = conn.record([self._requests[i] for i in indices], deadline)
            for index, code in zip(indices, recorded, strict=True):
                if code != ErrorCode.OK:
                    codes[index] = code
        self._codes = codes
        return codes


# ---------------------------------------------------------------------- the store side
class _WindowTotals:
    """The windows of every device together (the store's metrics)."""

    def __init__(self, responders: Sequence[RdmaResponder]) -> None:
        self._tables = [r.windows for r in responders if r.windows is not None]

    def live(self) -> int:
        return sum(t.live() for t in self._tables)

    @property
    def bound(self) -> int:
        return sum(t.bound for t in self._tables)

    @property
    def bytes_bound(self) -> int:
        return sum(t.bytes_bound for t in self._tables)


class RdmaResponders:
    """A store's RDMA on several devices: one :class:`RdmaResponder` per device, each registering every
    segment; the data plane talks to this as to one responder."""

    def __init__(self, responders: Sequence[RdmaResponder]) -> None:
        if not responders:
            raise ValueError("RdmaResponders needs at least one responder")
        self._responders = list(responders)
        self._by_device = {r.device: r for r in self._responders}
        self._by_conn: dict[Hashable, RdmaResponder] = {}
        self.device = self._responders[0].device
        windowed = all(r.windows is not None for r in self._responders)
        self.windows: _WindowTotals | None = _WindowTotals(self._responders) if windowed else None

    @property
    def devices(self) -> list[str]:
        return [r.device for r in self._responders]

    @property
    def connections(self) -> int:
        return sum(r.connections for r in self._responders)

    def advertisement(self) -> dict[str, Any]:
        ad = self._responders[0].advertisement()
        ad["devices"] = self.devices
        return ad

    def handle_connect(
        self, payload: bytes | bytearray | memoryview, *, conn_id: Hashable, token_verified: bool = False
    ) -> tuple[ErrorCode, bytes]:
        try:
            doc = json.loads(bytes(payload))
        except ValueError:
            doc = {}
        wanted = doc.get("device") if isinstance(doc, dict) else None
        responder = self._by_device.get(wanted) if isinstance(wanted, str) else self._responders[0]
        if responder is None:
            return ErrorCode.NOT_SUPPORTED, json.dumps({"error": f"no RDMA device {wanted!r} here"}).encode()
        code, body = responder.handle_connect(payload, conn_id=conn_id, token_verified=token_verified)
        if code == ErrorCode.OK:
            self._by_conn[conn_id] = responder
        return code, body

    def bind_windows(self, conn_id: Hashable, grants: list[Grant]) -> list[tuple[ErrorCode, list[dict[str, int]]]]:
        responder = self._by_conn.get(conn_id, self._responders[0])
        return responder.bind_windows(conn_id, grants)

    def release(self, conn_id: Hashable) -> int:
        self._by_conn.pop(conn_id, None)
        return sum(r.release(conn_id) for r in self._responders)

    def add_segment(self, segment_id: int, segment: SegmentMemory, secret: bytes) -> None:
        for responder in self._responders:
            responder.add_segment(segment_id, segment, secret)

    def remove_segment(self, segment_id: int) -> list[Hashable]:
        return [c for r in self._responders for c in r.remove_segment(segment_id)]

    def revoke(self, segment_id: int | None = None) -> list[Hashable]:
        return [c for r in self._responders for c in r.revoke(segment_id)]

    def close(self) -> None:
        for responder in self._responders:
            responder.close()


def make_rails(
    make_rail: Callable[[str, int], RdmaTransport], devices: Sequence[str], numa_nodes: Sequence[int]
) -> Transport:
    """One transport over ``devices``: a plain RdmaTransport for one, a RailsTransport for several
    (``make_rail(device, rail_index)`` opens each); a device that does not open is left out."""
    rails: list[RdmaTransport] = []
    nodes: list[int] = []
    for device, node in zip(devices, numa_nodes, strict=True):
        try:
            rails.append(make_rail(device, len(rails)))
            nodes.append(node)
        except KvPoolError as exc:
            logger.warning("RDMA: device %s left out: %s", device, exc)
    if not rails:
        raise KvPoolError(ErrorCode.NOT_SUPPORTED, f"no RDMA device opened of {', '.join(devices)}")
    return rails[0] if len(rails) == 1 else RailsTransport(rails, nodes)


Responder = RdmaResponder | RdmaResponders
"""What a store serves RDMA with: one device's responder, or several devices'."""
