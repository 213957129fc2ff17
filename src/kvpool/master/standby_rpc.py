"""The gRPC edge of the warm-standby feed (decision 0070): decode, :class:`StandbyIndex`, encode."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvpool.common.errors import ErrorCode
from kvpool.master import convert
from kvpool.master.standby import FeedResult, StandbyIndex
from kvpool.proto import master_pb2 as pb


class StandbyRpc:
    """StandbySync and StandbyDelta, which stores call on every live standby master."""

    def __init__(self, standby: StandbyIndex, status: Callable[..., pb.Status]) -> None:
        self.standby = standby
        self._status = status

    def methods(self) -> dict[str, Callable[[Any], Any]]:
        return {"StandbySync": self.sync, "StandbyDelta": self.delta}

    def sync(self, req: pb.MountSegmentRequest) -> pb.StandbyFeedResponse:
        spec = convert.segment_spec(req.segment, req.secret)
        return self._answer(self.standby.sync(spec, convert.inventory(req.inventory)))

    def delta(self, req: pb.StandbyDeltaRequest) -> pb.StandbyFeedResponse:
        if len(req.removed) != len(req.changes):
            return self._answer(FeedResult(ErrorCode.INVALID_ARGUMENT))
        changes = list(zip(convert.inventory(req.changes), req.removed, strict=True))
        return self._answer(self.standby.delta(req.store_id, req.segment_id, req.epoch, changes))

    def _answer(self, result: FeedResult) -> pb.StandbyFeedResponse:
        return pb.StandbyFeedResponse(
            status=self._status(result.code),
            epoch=result.epoch,
            adopted=result.adopted,
            rejected=result.rejected,
        )
