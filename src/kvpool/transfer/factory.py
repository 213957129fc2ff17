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
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvpool.common import envs
from kvpool.common.errors import KvPoolError
from kvpool.common.log import get_logger, log_once
from kvpool.transfer.base import Transport
from kvpool.transfer.verbs import NO_RDMA_LOG_KEY, Verbs, VerbsError, discover_devices

if TYPE_CHECKING:
    from kvpool.transfer.rdma_memory import SegmentMemory
    from kvpool.transfer.rdma_rails import Responder

logger = get_logger(__name__)


def default_verbs() -> Verbs | None:
    """The verbs provider this process uses: the cross-process FAKE NIC when ``KVPOOL_VERBS=fake``; the compiled
    layer for ``native``, and for an empty value where it is built and finds a device; else None (pyverbs)."""
    from kvpool.transfer.verbs_fake_ipc import IpcFakeVerbs, fake_requested

    if fake_requested():
        logger.info("RDMA through the FAKE NIC (KVPOOL_VERBS=fake): for tests only")
        return IpcFakeVerbs()
    from kvpool.transfer.verbs_native import native_verbs

    return native_verbs(envs.KVPOOL_VERBS.get().strip().lower())


def select_devices(spec: str, available: list[str]) -> list[str]:
    """The devices a ``--rdma-device`` value names: ``auto`` = every one found, ``off`` = none, else a list."""
    spec = spec.strip()
    if spec in ("", "off"):
        return []
    if spec == "auto":
        return list(available)
    wanted = [d.strip() for d in spec.split(",") if d.strip()]
    missing = [d for d in wanted if d not in available]
    if missing:
        _no_rdma(f"device {', '.join(missing)} not found (have {', '.join(available) or 'none'})")
    return [d for d in wanted if d in available]


def make_responder(
    spec: str,
    segments: Mapping[int, SegmentMemory],
    secrets_by_segment: Mapping[int, bytes],
    *,
    gid_index: int = 0,
    verbs: Verbs | None = None,
) -> Responder | None:
    """The store's RDMA responder on every device ``spec`` selects (each registers every segment), or None -
    logged once - without RDMA. Call after the segment is bound and prefaulted: registration pins its pages.
    """
    if spec.strip() == "off":
        logger.info("RDMA off (--rdma-device off): clients use TCP")
        return None
    verbs = verbs if verbs is not None else default_verbs()
    devices = select_devices(spec, discover_devices(verbs))
    if not devices:
        return None
    from kvpool.transfer.rdma_rails import RdmaResponders
    from kvpool.transfer.rdma_responder import RdmaResponder
    from kvpool.transfer.verbs import PyverbsVerbs

    library = verbs if verbs is not None else PyverbsVerbs()
    responders: list[RdmaResponder] = []
    for device in devices:
        try:
            responders.append(
                RdmaResponder(library, segments, secrets_by_segment, device=device, gid_index=gid_index, windows=True)
            )
        except (KvPoolError, VerbsError, ImportError) as exc:
            logger.warning("RDMA: cannot serve on %s: %s", device, exc)
    if not responders:
        _no_rdma(f"cannot serve RDMA on {', '.join(devices)}")
        return None
    names = ", ".join(r.device for r in responders)
    logger.info("RDMA responder on %s (%d segments)", names, len(segments))
    return responders[0] if len(responders) == 1 else RdmaResponders(responders)


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
            verbs=verbs if verbs is not None else default_verbs(),
            device=rdma_device,
            gid_index=gid_index,
            max_mr_bytes=max_mr_bytes,
            token=token,
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
    """RDMA on ``device`` (``NAME[,NAME...]``; default: every device found), or None - logged once - without
    RDMA. Several devices make one transport that stripes large transfers across them and keeps small ones on
    the NIC of the buffer's NUMA node (``rdma_rails``)."""
    found = discover_devices(verbs)  # logs "RDMA unavailable ...: using TCP" once when empty
    if not found:
        return None
    wanted = [d.strip() for d in device.split(",") if d.strip()] if device else list(found)
    missing = [d for d in wanted if d not in found]
    if missing:
        _no_rdma(f"device {', '.join(missing)} not found (have {', '.join(found)})")
        return None
    from kvpool.transfer.rdma import RdmaTransport
    from kvpool.transfer.rdma_rails import make_rails
    from kvpool.transfer.verbs import PyverbsVerbs

    try:
        library = verbs if verbs is not None else PyverbsVerbs()

        def rail(name: str, index: int) -> RdmaTransport:
            return RdmaTransport(
                library, name, max_mr_bytes, gid_index=gid_index, token=token, discover=True, rail=index
            )

        transport = make_rails(rail, wanted, [library.numa_node(d) for d in wanted])
    except (KvPoolError, VerbsError, ImportError) as exc:
        _no_rdma(f"cannot open {', '.join(wanted)}: {exc}")
        return None
    logger.info("RDMA transport on %s", getattr(transport, "device", ", ".join(wanted)))
    return transport


def _no_rdma(reason: str) -> None:
    log_once(logger, logging.INFO, NO_RDMA_LOG_KEY, "RDMA unavailable (%s): using TCP", reason)


def _shm_transport(node: str, token: bytes) -> Transport | None:
    from kvpool.transfer.shm import ShmTransport

    return ShmTransport(node, token=token)
