"""The store half of RDMA: :class:`RdmaResponder` registers the segments and answers RDMA_CONNECT for
the data plane. The overview is in :mod:`kvpool.transfer.rdma`.
"""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from kvpool.common.clock import SYSTEM_CLOCK, Clock
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.grants import Grant, GrantOp, verify
from kvpool.common.log import get_logger
from kvpool.transfer.rdma_memory import SegmentMemory, _close_quietly, register_chunked
from kvpool.transfer.rdma_windows import WindowTable
from kvpool.transfer.rdma_wire import (
    PROTOCOL_VERSION,
    RemoteRegion,
    _decode,
    _encode,
    grant_from_json,
    qp_info_from_json,
    qp_info_to_json,
)
from kvpool.transfer.verbs import Access, MemoryRegion, Mtu, QpInfo, QueuePair, Verbs, VerbsError, buffer_address
from kvpool.transfer.verbs_native import window_usable

logger = get_logger(__name__)

WINDOW_SEND_DEPTH = 64
"""Send queue of a store QP that binds windows: binds and invalidations in flight before a flush waits."""
WINDOW_CQ_DEPTH = 256
"""The store's CQ with windows: the window binder keeps what is in flight below this (an overrun CQ is fatal)."""


# ---------------------------------------------------------------------- the store side
@dataclass(eq=False)
class _Admitted:
    qp: QueuePair
    writable: bool
    segments: frozenset[int]


class RdmaResponder:
    """The store's half of RDMA: registers the segments and answers RDMA_CONNECT from the data plane.

    The data plane owns the sockets; for a frame with ``Op.RDMA_CONNECT`` it calls :meth:`handle_connect` with
    the payload and sends back the returned (status, payload). When that TCP connection closes it calls
    :meth:`release` with the same ``conn_id``, which destroys the QPs admitted on it. :meth:`advertisement` is
    what the store adds to STORE_INFO under ``"rdma"`` so clients know to use RDMA. Segments come and go with
    :meth:`add_segment` / :meth:`remove_segment` (which also cuts off every QP admitted to that segment);
    :meth:`revoke` cuts off QPs without removing anything (a rotated secret, a drain).

    Close the responder before unmapping the segments: its MRs pin their pages.
    """

    def __init__(
        self,
        verbs: Verbs,
        segments: Mapping[int, SegmentMemory],
        secrets_by_segment: Mapping[int, bytes],
        *,
        device: str | None = None,
        port: int = 1,
        gid_index: int = 0,
        max_mr_bytes: int | None = None,
        max_qps: int = 1024,
        clock: Clock = SYSTEM_CLOCK,
        windows: bool = False,
    ) -> None:
        if device is None:
            devices = verbs.list_devices()
            if not devices:
                raise KvPoolError(ErrorCode.NOT_SUPPORTED, "no RDMA device")
            device = devices[0]
        self.device = device
        self.max_qps = max_qps
        self._clock = clock
        self._secrets = dict(secrets_by_segment)
        self._lock = threading.Lock()
        self._admitted: dict[Hashable, list[_Admitted]] = {}
        self._closed = False
        try:
            self._ctx = verbs.open(device, port, gid_index)
        except VerbsError as exc:
            raise KvPoolError(ErrorCode.NOT_SUPPORTED, f"cannot open RDMA device {device}: {exc}") from exc
        self.max_mr_bytes = min(max_mr_bytes or self._ctx.max_mr_bytes, self._ctx.max_mr_bytes)
        self.windows: WindowTable | None = None
        """Per-grant memory windows (decision 0020); None: a client is admitted to whole segments."""
        if windows and self._ctx.supports_windows:
            self.windows = WindowTable(clock, self._ctx.flush_windows)
            self.windows.start()
        elif windows:
            logger.warning(
                "RDMA on %s: no memory windows in this verbs layer: admitted clients reach whole segments "
                "(docs/decisions/0020-rdma-grant-windows.md)",
                device,
            )
        self._mrs: dict[int, list[MemoryRegion]] = {}
        self._regions: dict[int, list[RemoteRegion]] = {}
        try:
            # Store QPs post nothing but window binds and invalidations (awaited a batch at a time).
            self._cq = self._ctx.create_cq(WINDOW_CQ_DEPTH if self.windows is not None else 16)
            for seg_id, segment in segments.items():
                self._register(seg_id, segment)
        except KvPoolError:
            self.close()
            raise

    def _register(self, segment_id: int, segment: SegmentMemory) -> None:
        base = buffer_address(segment.view)
        access = Access.LOCAL_WRITE
        if self.windows is None:
            access |= Access.REMOTE_READ | Access.REMOTE_WRITE
        else:  # a peer reaches the segment only through a grant's window, bound to this MR
            access |= Access.MW_BIND
        try:
            mrs = register_chunked(self._ctx, base, segment.size, access, self.max_mr_bytes)
        except VerbsError as exc:
            raise KvPoolError(
                ErrorCode.TRANSFER_FAILED,
                f"cannot register segment {segment_id} for RDMA: {exc} (memlock ulimit? see docs/rdma.md)",
            ) from exc
        with self._lock:
            self._mrs[segment_id] = mrs
            self._regions[segment_id] = [
                RemoteRegion(segment_id, mr.addr - base, mr.length, mr.addr, mr.rkey) for mr in mrs
            ]

    def add_segment(self, segment_id: int, segment: SegmentMemory, secret: bytes) -> None:
        """Serve one more segment over RDMA (register it; its grants verify with ``secret``)."""
        self._register(segment_id, segment)
        with self._lock:
            self._secrets[segment_id] = secret

    def remove_segment(self, segment_id: int) -> list[Hashable]:
        """Stop serving a segment: cut off the QPs admitted to it (their ``conn_id`` is returned, see
        :meth:`revoke`), then deregister its MRs."""
        conns = self.revoke(segment_id)
        if self.windows is not None:
            self.windows.revoke(segment_id)
        with self._lock:
            mrs = self._mrs.pop(segment_id, [])
            self._regions.pop(segment_id, None)
            self._secrets.pop(segment_id, None)
        for mr in mrs:
            _close_quietly(mr)
        return conns

    def revoke(self, segment_id: int | None = None) -> list[Hashable]:
        """Destroy the QPs admitted to ``segment_id`` (None: all); returns their connections' ``conn_id``.

        The caller should close those control connections: their clients then notice at once and reconnect
        with a fresh grant (otherwise their next work request fails with a retry timeout first).
        """
        with self._lock:
            victims: list[_Admitted] = []
            conns: list[Hashable] = []
            for conn_id, admitted in list(self._admitted.items()):
                keep = [a for a in admitted if segment_id is not None and segment_id not in a.segments]
                if len(keep) == len(admitted):
                    continue
                conns.append(conn_id)
                victims.extend(a for a in admitted if a not in keep)
                if keep:
                    self._admitted[conn_id] = keep
                else:
                    del self._admitted[conn_id]
        for entry in victims:
            _close_quietly(entry.qp)
        return conns

    # ---- what the data plane calls
    def advertisement(self) -> dict[str, Any]:
        """The ``"rdma"`` entry of STORE_INFO."""
        with self._lock:
            segments = sorted(self._regions)
        return {"v": PROTOCOL_VERSION, "device": self.device, "segments": segments}

    @property
    def connections(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._admitted.values())

    def handle_connect(
        self, payload: bytes | bytearray | memoryview, *, conn_id: Hashable, token_verified: bool = False
    ) -> tuple[ErrorCode, bytes]:
        """Answer one RDMA_CONNECT: (status for the reply header, reply payload). Never raises.

        ``token_verified`` says the connection presented the cluster token (HELLO); without it the request
        must carry a valid, unexpired master grant for every segment it wants.
        """
        try:
            return ErrorCode.OK, self._connect(payload, conn_id, token_verified)
        except KvPoolError as exc:
            if exc.code != ErrorCode.BAD_FRAME:
                logger.info("RDMA_CONNECT refused: %s", exc)
            return exc.code, json.dumps({"error": exc.message}).encode()
        except VerbsError as exc:
            logger.warning("RDMA_CONNECT failed: %s", exc)
            return ErrorCode.TRANSFER_FAILED, json.dumps({"error": str(exc)}).encode()

    def release(self, conn_id: Hashable) -> int:
        """Destroy the QPs admitted on a closed control connection; returns how many."""
        if self.windows is not None:
            self.windows.release(conn_id)
        with self._lock:
            admitted = self._admitted.pop(conn_id, [])
        for entry in admitted:
            _close_quietly(entry.qp)
        return len(admitted)

    def bind_windows(self, conn_id: Hashable, grants: list[Grant]) -> list[tuple[ErrorCode, list[dict[str, int]]]]:
        """One memory window per grant (the caller checked each grant as for a TCP request), through the QP
        admitted on ``conn_id``: (code, regions) per grant, a region being a RemoteRegion's JSON."""
        windows = self.windows
        if windows is None:
            return [(ErrorCode.NOT_SUPPORTED, [])] * len(grants)
        with self._lock:
            admitted = self._admitted.get(conn_id, [])
            entry = admitted[-1] if admitted else None
            mrs = {g.segment_id: list(self._mrs.get(g.segment_id, [])) for g in grants}
        bound: list[tuple[ErrorCode, list[dict[str, int]], list[MemoryRegion]]] = []
        for grant in grants:
            if entry is None or grant.segment_id not in entry.segments:
                bound.append((ErrorCode.AUTH_FAILED, [], []))
            elif grant.op == GrantOp.WRITE and not entry.writable:
                bound.append((ErrorCode.AUTH_FAILED, [], []))
            else:
                bound.append(self._bind(entry.qp, mrs[grant.segment_id], grant))
        self._flush_windows()  # every window of the batch takes effect before the answer leaves
        return [self._settle(windows, conn_id, grant, *b) for grant, b in zip(grants, bound, strict=True)]

    def _bind(
        self, qp: QueuePair, mrs: list[MemoryRegion], grant: Grant
    ) -> tuple[ErrorCode, list[dict[str, int]], list[MemoryRegion]]:
        """Windows over the grant's range, one per segment MR it crosses (usable once flushed)."""
        access = Access.REMOTE_READ if grant.op == GrantOp.READ else Access.REMOTE_WRITE
        base = mrs[0].addr if mrs else 0
        start, end = base + grant.offset, base + grant.offset + grant.length
        regions: list[dict[str, int]] = []
        bound: list[MemoryRegion] = []
        for mr in mrs:
            lo, hi = max(start, mr.addr), min(end, mr.addr + mr.length)
            if lo >= hi:
                continue
            try:
                window = self._ctx.bind_window(mr, qp, lo, hi - lo, access)
            except VerbsError as exc:
                logger.warning("RDMA: binding a window failed: %s", exc)
                return ErrorCode.TRANSFER_FAILED, [], bound
            bound.append(window)
            regions.append(RemoteRegion(grant.segment_id, lo - base, hi - lo, lo, window.rkey).to_json())
        if sum(r["length"] for r in regions) != grant.length:
            return ErrorCode.OUT_OF_BOUNDS, [], bound
        return ErrorCode.OK, regions, bound

    def _settle(
        self,
        windows: WindowTable,
        conn_id: Hashable,
        grant: Grant,
        code: ErrorCode,
        regions: list[dict[str, int]],
        bound: list[MemoryRegion],
    ) -> tuple[ErrorCode, list[dict[str, int]]]:
        """After the flush: a grant's windows are tracked and their rkeys sent only if every bind completed
        successfully; otherwise they are invalidated and the grant gets no window."""
        if code == ErrorCode.OK and not all(window_usable(w) for w in bound):
            code, regions = ErrorCode.TRANSFER_FAILED, []
        if code != ErrorCode.OK:
            for window in bound:
                _close_quietly(window)
            if bound:
                self._flush_windows()
            return code, []
        for window in bound:
            windows.add(conn_id, grant.segment_id, grant.expiry_ms, window)
        return code, regions

    def _flush_windows(self) -> None:
        try:
            self._ctx.flush_windows()
        except VerbsError as exc:  # what did not complete is not usable: its grant gets no window
            logger.warning("RDMA: window binds or invalidations did not complete: %s", exc)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._admitted = list(self._admitted.values()), {}
        if getattr(self, "windows", None) is not None:
            assert self.windows is not None
            self.windows.close()
        for admitted in conns:
            for entry in admitted:
                _close_quietly(entry.qp)
        for mrs in self._mrs.values():
            for mr in mrs:
                _close_quietly(mr)
        self._mrs = {}
        cq = getattr(self, "_cq", None)
        if cq is not None:
            _close_quietly(cq)
        _close_quietly(self._ctx)

    # ---- inside
    def _connect(self, payload: bytes | bytearray | memoryview, conn_id: Hashable, token_verified: bool) -> bytes:
        doc = _decode(payload, "RDMA_CONNECT")
        remote = qp_info_from_json(doc.get("qp"))
        raw_grants = doc.get("grants", [])
        if not isinstance(raw_grants, list) or len(raw_grants) > 64:
            raise KvPoolError(ErrorCode.BAD_FRAME, "RDMA_CONNECT: grants must be a list of at most 64")
        segments, writable = self._authorize([grant_from_json(g) for g in raw_grants], token_verified)
        writable = writable and doc.get("access") == "rw"
        with self._lock:
            if self._closed:
                raise KvPoolError(ErrorCode.SHUTTING_DOWN, "store is stopping")
            if sum(len(v) for v in self._admitted.values()) >= self.max_qps:
                raise KvPoolError(ErrorCode.TOO_MANY_CONNECTIONS, f"{self.max_qps} RDMA connections already")
        qp = self._ctx.create_qp(self._cq, WINDOW_SEND_DEPTH if self.windows is not None else 1)
        try:
            access = Access.LOCAL_WRITE | Access.REMOTE_READ
            if writable:
                access |= Access.REMOTE_WRITE
            qp.to_init(access)
            port = self._ctx.port_info()
            mtu = Mtu(min(port.mtu, remote.mtu))
            qp.to_rtr(remote, mtu)
            psn = secrets.randbits(24)
            qp.to_rts(psn)
        except BaseException:
            _close_quietly(qp)
            raise
        with self._lock:
            self._admitted.setdefault(conn_id, []).append(_Admitted(qp, writable, segments))
        with self._lock:
            regions = [r.to_json() for s in sorted(segments) for r in self._regions.get(s, [])]
        local = QpInfo(qp.qp_num, port.lid, port.gid, psn, mtu)
        reply: dict[str, Any] = {"qp": qp_info_to_json(local), "access": "rw" if writable else "r"}
        if self.windows is not None:  # no segment rkey: each grant gets its window (RDMA_WINDOWS)
            reply.update(regions=[], windows=True, segments=sorted(segments))
        else:
            reply["regions"] = regions
        return _encode(reply)

    def _authorize(self, grants: list[Grant], token_verified: bool) -> tuple[frozenset[int], bool]:
        """Which segments the peer may reach and whether it may write.

        A token holder may reach every segment and write; otherwise each grant must verify with its
        segment's secret (and be unexpired where there are no windows), and a WRITE grant is what allows
        writes.
        """
        now = self._clock.wall_ms()
        with self._lock:
            secrets_now, served = dict(self._secrets), set(self._regions)
        segments: set[int] = set()
        writable = token_verified
        for grant in grants:
            seg = grant.segment_id
            secret = secrets_now.get(seg)
            if secret is None or seg not in served:
                raise KvPoolError(ErrorCode.SEGMENT_NOT_FOUND, f"segment {seg} is not served here")
            if not verify(secret, grant):
                raise KvPoolError(ErrorCode.AUTH_FAILED, f"the grant for segment {seg} does not verify")
            if self.windows is None and grant.expiry_ms and grant.expiry_ms <= now:
                # Without windows admission opens whole segments, so only a live grant admits. With windows
                # the QP reaches nothing until RDMA_WINDOWS binds a window for a live grant: a verified grant
                # that expired while the client connected still shows the master let it in (decision 0024).
                raise KvPoolError(ErrorCode.GRANT_EXPIRED, f"the grant for segment {seg} expired")
            segments.add(grant.segment_id)
            writable = writable or grant.op == GrantOp.WRITE
        if token_verified:
            segments = served
        if not segments:
            raise KvPoolError(ErrorCode.AUTH_FAILED, "RDMA_CONNECT needs the cluster token or a master grant")
        return frozenset(segments), writable
