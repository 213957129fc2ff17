"""The status every master answer carries: the view and leader of the moment, and an error code only on
the answer that had the error (the OK status is built once per view and shared)."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.common.errors import ErrorCode
from kvpool.master.config import MasterConfig
from kvpool.master.service import MasterServer, Role
from kvpool.proto import master_pb2 as pb


@dataclass
class Elector:
    """A leadership probe whose answers the test sets (the real elector runs against etcd elsewhere)."""

    view: int = 1
    is_leader: bool = True
    is_warming_up: bool = False

    def lease_valid_for(self) -> float:
        return 10.0


def exists(server: MasterServer) -> pb.BatchExistsResponse:
    response: pb.BatchExistsResponse = server.handlers.dispatch(
        "BatchExists", pb.BatchExistsRequest(keys=["k"]), pb.BatchExistsResponse
    )
    return response


def test_ok_answers_follow_the_view_and_the_leader() -> None:
    elector = Elector(view=3)
    server = MasterServer(MasterConfig(), role=Role(elector=elector))
    server.endpoints["grpc"] = "10.0.0.1:5000"
    first = exists(server).status
    assert (first.code, first.view, first.leader) == (0, 3, "10.0.0.1:5000")
    elector.view = 4
    server.endpoints["grpc"] = "10.0.0.2:5000"
    second = exists(server).status
    assert (second.code, second.view, second.leader) == (0, 4, "10.0.0.2:5000")


def test_an_error_answer_does_not_leak_its_code_into_later_answers() -> None:
    server = MasterServer(MasterConfig())
    assert exists(server).status.code == 0
    refused = server.handlers.dispatch("TierTasks", pb.TierTasksRequest(store_id="no-such-store"), pb.TierTasksResponse)
    assert refused.status.code == ErrorCode.NEED_REMOUNT
    assert exists(server).status.code == 0
    assert server.handlers.status().code == 0
