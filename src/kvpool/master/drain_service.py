"""The drain/rebalance RPCs of the master: decode -> DrainManager -> encode (no logic of their own).

``MasterHandlers`` registers :meth:`DrainRpc.methods` next to its own; errors are raised as KvPoolError and
turned into the response's status by ``MasterHandlers.dispatch``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.common.errors import as_code
from kvpool.master import convert
from kvpool.master.drain import DrainManager, DrainStatus, RebalanceStatus
from kvpool.master.moves import MoveTask
from kvpool.proto import master_pb2 as pb

__all__ = ["DrainRpc", "DEFAULT_TOLERANCE"]

DEFAULT_TOLERANCE = 0.05


class DrainRpc:
    """SyncMoves (stores), Drain / Undrain / DrainStatus / Rebalance / RebalanceStatus (operators)."""

    def __init__(self, drains: DrainManager, status: Callable[[], pb.Status]) -> None:
        self.drains = drains
        self._status = status

    def methods(self) -> dict[str, Callable[[Any], Any]]:
        return {
            "SyncMoves": self.sync_moves,
            "Drain": self.drain,
            "Undrain": self.undrain,
            "DrainStatus": self.drain_status,
            "Rebalance": self.rebalance,
            "RebalanceStatus": self.rebalance_status,
        }

    def sync_moves(self, req: pb.SyncMovesRequest) -> pb.SyncMovesResponse:
        results = [(r.task_id, as_code(r.code)) for r in req.results]
        tasks = self.drains.sync(req.store_id, results, req.max_tasks)
        return pb.SyncMovesResponse(
            status=self._status(),
            tasks=[move_task(t) for t in tasks],
            pending=self.drains.pending_for(req.store_id),
        )

    def drain(self, req: pb.DrainRequest) -> pb.DrainStatusResponse:
        return self._jobs([self.drains.start(req.node, req.remove)])

    def undrain(self, req: pb.DrainRequest) -> pb.DrainStatusResponse:
        return self._jobs([self.drains.undrain(req.node)])

    def drain_status(self, req: pb.DrainStatusRequest) -> pb.DrainStatusResponse:
        if req.node:
            return self._jobs([self.drains.status(req.node)])
        return self._jobs(self.drains.statuses())

    def rebalance(self, req: pb.RebalanceRequest) -> pb.RebalanceStatusResponse:
        return self._rebalance(self.drains.start_rebalance(req.max_moves, req.tolerance or DEFAULT_TOLERANCE))

    def rebalance_status(self, req: pb.RebalanceStatusRequest) -> pb.RebalanceStatusResponse:
        return self._rebalance(self.drains.rebalance_status())

    def _jobs(self, statuses: list[DrainStatus]) -> pb.DrainStatusResponse:
        return pb.DrainStatusResponse(status=self._status(), jobs=[job_status(s) for s in statuses])

    def _rebalance(self, s: RebalanceStatus) -> pb.RebalanceStatusResponse:
        return pb.RebalanceStatusResponse(
            status=self._status(),
            state=s.state,
            objects_moved=s.objects_moved,
            bytes_moved=s.bytes_moved,
            in_flight=s.in_flight,
            spread=s.spread,
            seconds=s.seconds,
            message=s.message,
            planned=s.planned,
        )


def move_task(t: MoveTask) -> pb.MoveTask:
    return pb.MoveTask(
        task_id=t.task_id,
        key=t.key,
        size=t.size,
        checksum=t.checksum,
        source=convert.replica(t.source),
        target=convert.replica(t.target),
    )


def job_status(s: DrainStatus) -> pb.DrainJobStatus:
    return pb.DrainJobStatus(
        node=s.node,
        state=s.state,
        objects_moved=s.objects_moved,
        bytes_moved=s.bytes_moved,
        objects_remaining=s.objects_remaining,
        bytes_remaining=s.bytes_remaining,
        in_flight=s.in_flight,
        seconds=s.seconds,
        message=s.message,
        segment_ids=list(s.segment_ids),
        failures=s.failures,
        remove=s.remove,
    )
