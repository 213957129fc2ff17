"""Which transport serves which replica: shared memory for same-node segments, RDMA where a device
exists, TCP for everything else. ``TransportSet`` splits a batch by transport, runs the parts
concurrently and returns the codes in request order.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode
from kvpool.common.grants import GrantOp
from kvpool.transfer.base import Replica, TransferRequest, Transport

_PATH_FAILURES = frozenset({ErrorCode.TRANSFER_FAILED, ErrorCode.CONNECTION_FAILED})


class TransportSet:
    """Transports in preference order; the first that ``can_reach`` a replica serves it."""

    def __init__(self, transports: Sequence[Transport], node: str = "") -> None:
        if not transports:
            raise ValueError("a TransportSet needs at least one transport")
        self._transports = list(transports)
        self._node = node
        self._bytes_lock = threading.Lock()
        self._bytes: dict[str, int] = {"rdma": 0, "tcp": 0, "shm": 0}
        """Payload bytes moved OK, by the name of the transport that moved them (metrics: bytes_<name>)."""

    @classmethod
    def default(cls, config: Any, node: str) -> TransportSet:
        """Shared memory for same-node segments, RDMA where a device exists, TCP for the rest."""
        from kvpool.common.auth import load_token
        from kvpool.transfer.factory import make_transports

        # The cluster token opens every data-plane connection (HELLO), as it opens the master's.
        transports = make_transports(
            node,
            prefer_rdma=getattr(config, "use_rdma", False),
            use_shm=getattr(config, "use_shm", False),
            token=load_token(getattr(config, "token_file", "")),
            connections_per_store=config.connections_per_store,
            stripe_bytes=config.stripe_bytes,
            spin_us=getattr(config, "spin_us", 0),
            native_lanes=getattr(config, "native_lanes", True),
        )
        return cls(transports, node)

    def order(self, replicas: Sequence[Replica]) -> list[Replica]:
        """Replicas in read preference: DRAM before an SSD tier (a disk read is slower than any network),
        then same node first (memcpy beats any network)."""
        return sorted(replicas, key=lambda r: (r.tier != 0, r.node != self._node))

    def revalidating(self, replicas: Sequence[Replica]) -> list[Replica]:
        """The DRAM replicas, in read preference, whose transport sends a revalidated READ to the store
        (a transport that reads the segment itself could not ask the store whether the object is there)."""
        return [r for r in self.order(replicas) if r.tier == 0 and self._transports[self._pick(r)].revalidates_reads]

    def _pick(self, replica: Replica) -> int:
        for index, transport in enumerate(self._transports):
            if transport.can_reach(replica):
                return index
        return len(self._transports) - 1

    def transfer(self, requests: Sequence[TransferRequest], deadline: Deadline) -> list[ErrorCode]:
        if not requests:
            return []
        groups: dict[int, list[int]] = {}
        for position, request in enumerate(requests):
            groups.setdefault(self._pick(request.replica), []).append(position)
        if len(groups) == 1:
            # One transport serves the whole batch: its own transfer() has the faster single-batch path.
            transport = self._transports[next(iter(groups))]
            codes = self._counted(
                transport, requests, _verified(transport, requests, transport.transfer(requests, deadline))
            )
            return self._fall_back(requests, codes, [transport.name] * len(requests), deadline)
        # Submit every group first, then wait: transports run concurrently.
        batches = []
        for t, positions in groups.items():
            group = [requests[p] for p in positions]
            batches.append((self._transports[t], positions, group, self._transports[t].submit(group, deadline)))
        codes = [ErrorCode.INTERNAL] * len(requests)
        for transport, positions, group, batch in batches:
            group_codes = self._counted(transport, group, _verified(transport, group, batch.wait(deadline)))
            for position, code in zip(positions, group_codes, strict=True):
                codes[position] = code
        served = [""] * len(requests)
        for t, positions in groups.items():
            for position in positions:
                served[position] = self._transports[t].name
        return self._fall_back(requests, codes, served, deadline)

    def _fall_back(
        self, requests: Sequence[TransferRequest], codes: list[ErrorCode], served: list[str], deadline: Deadline
    ) -> list[ErrorCode]:
        """Requests a one-sided transport lost to its path (a broken QP takes every request on it) go once
        more over the last transport (TCP), where the store checks each one itself."""
        last = self._transports[-1]
        retry = [i for i, code in enumerate(codes) if code in _PATH_FAILURES and served[i] == "rdma"]
        if not retry or deadline.expired() or last.name == "rdma":
            return codes
        group = [requests[i] for i in retry]
        for i, code in zip(
            retry, self._counted(last, group, _verified(last, group, last.transfer(group, deadline))), strict=True
        ):
            codes[i] = code
        return codes

    def _counted(
        self, transport: Transport, requests: Sequence[TransferRequest], codes: list[ErrorCode]
    ) -> list[ErrorCode]:
        moved = sum(r.replica.length for r, c in zip(requests, codes, strict=True) if c == ErrorCode.OK)
        with self._bytes_lock:
            self._bytes[transport.name] = self._bytes.get(transport.name, 0) + moved
        return codes

    def bytes_by_transport(self) -> dict[str, int]:
        """Payload bytes moved OK so far, per transport name (rdma, tcp, shm)."""
        with self._bytes_lock:
            return dict(self._bytes)

    def transport_names(self) -> list[str]:
        return [t.name for t in self._transports]

    def transport(self, name: str) -> Transport | None:
        """The transport called ``name`` (benchmarks read its own figures), if this set has one."""
        return next((t for t in self._transports if t.name == name), None)

    def register_memory(self, buffer: memoryview) -> None:
        for transport in self._transports:
            transport.register_memory(buffer)

    def unregister_memory(self, buffer: memoryview) -> None:
        for transport in self._transports:
            transport.unregister_memory(buffer)

    def close(self) -> None:
        for transport in self._transports:
            transport.close()


def _verified(transport: Transport, requests: Sequence[TransferRequest], codes: list[ErrorCode]) -> list[ErrorCode]:
    """Check READs that asked for verification where the transport does not do it itself."""
    if transport.verifies_reads:
        return codes
    return [
        req.check_landed() if code == ErrorCode.OK and req.verify and req.op == GrantOp.READ else code
        for req, code in zip(requests, codes, strict=True)
    ]
