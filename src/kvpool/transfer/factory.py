"""Build a client's transports in preference order: [shm], [rdma], tcp.

RDMA is included only where it can work: ``prefer_rdma`` is set, a verbs library is importable and lists a
device, and the device opens. Anything else - pyverbs missing, ``get_device_list()`` raising (as Debian's
pyverbs does on a host without RDMA), no device, a device that fails to open - leaves RDMA out with one log
line per process and the client runs on TCP; nothing fails.

Order: shared memory first (it only claims same-node segments, where a memcpy beats even a NIC loopback),
then RDMA (it only claims replicas whose store advertised RDMA), then TCP, which reaches everything.
"""

from __future__ import annotations

import logging

from kvpool.common.errors import KvPoolError
from kvpool.common.log import get_logger, log_once
from kvpool.transfer.base import Transport
from kvpool.transfer.verbs import NO_RDMA_LOG_KEY, Verbs, VerbsError, discover_devices

logger = get_logger(__name__)


def make_transports(
    node: str,
    prefer_rdma: bool,
    *,
    use_shm: bool = False,
    verbs: Verbs | None = None,
    rdma_device: str | None = None,
    gid_index: int = 0,
    max_mr_bytes: int | None = None,
    token: bytes = b"",
    connections_per_store: int = 4,
    stripe_bytes: int = 1 << 20,
    spin_us: int = 0,
    native_lanes: bool = True,
) -> list[Transport]:
    """The transports for a client on ``node``, best first; the last one (TCP) reaches every store.

    ``verbs`` defaults to the real pyverbs layer; tests pass :class:`kvpool.transfer.verbs_fake.FakeVerbs`.
    """
    from kvpool.transfer.tcp import TcpTransport

    transports: list[Transport] = []
    if use_shm:
        shm = _shm_transport(node, token)
        if shm is not None:
            transports.append(shm)
    if prefer_rdma:
        rdma = make_rdma_transport(
            verbs=verbs, device=rdma_device, gid_index=gid_index, max_mr_bytes=max_mr_bytes, token=token
        )
        if rdma is not None:
            transports.append(rdma)
    transports.append(
        TcpTransport(
            connections_per_endpoint=connections_per_store,
            stripe_bytes=stripe_bytes,
            token=token,
            spin_us=spin_us,
            native_lanes=native_lanes,
        )
    )
    return transports


def make_rdma_transport(
    *,
    verbs: Verbs | None = None,
    device: str | None = None,
    gid_index: int = 0,
    max_mr_bytes: int | None = None,
    token: bytes = b"",
) -> Transport | None:
    """An RdmaTransport on ``device`` (default: the first one found), or None - logged once - without RDMA."""
    devices = discover_devices(verbs)  # logs "RDMA unavailable ...: using TCP" once when empty
    if not devices:
        return None
    if device is not None and device not in devices:
        _no_rdma(f"device {device} not found (have {', '.join(devices)})")
        return None
    from kvpool.transfer.rdma import RdmaTransport
    from kvpool.transfer.verbs import PyverbsVerbs

    try:
        transport = RdmaTransport(
            verbs if verbs is not None else PyverbsVerbs(),
            device or devices[0],
            max_mr_bytes,
            gid_index=gid_index,
            token=token,
        )
    except (KvPoolError, VerbsError, ImportError) as exc:
        _no_rdma(f"cannot open {device or devices[0]}: {exc}")
        return None
    logger.info("RDMA transport on %s (max MR %d bytes)", transport.device, transport.max_mr_bytes)
    return transport


def _no_rdma(reason: str) -> None:
    log_once(logger, logging.INFO, NO_RDMA_LOG_KEY, "RDMA unavailable (%s): using TCP", reason)


def _shm_transport(node: str, token: bytes) -> Transport | None:
    from kvpool.transfer.shm import ShmTransport

    return ShmTransport(node, token=token)
