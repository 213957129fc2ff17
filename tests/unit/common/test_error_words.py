"""Errors in words: every code prints its name and meaning; an unreachable master is logged once per
outage, with its address."""

from __future__ import annotations

import logging
import socket

import pytest

from kvpool.client.master_client import MasterClient
from kvpool.common.clock import Deadline
from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.proto import frames
from kvpool.proto import master_pb2 as pb


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_code_prints_its_name_number_and_a_message(code: ErrorCode) -> None:
    text = str(code)
    assert text.startswith(f"{code.name} ({int(code)}): ")
    assert len(code.message) > 5
    assert f"{code}" == text
    assert f"{code:d}" == str(int(code))  # numeric formats stay numbers
    assert "%d" % code == str(int(code))  # noqa: UP031 (the old-style format is what is tested)


def test_the_exception_names_its_code_and_says_what_it_means() -> None:
    assert str(KvPoolError(ErrorCode.UNAVAILABLE)).startswith("UNAVAILABLE: the master or store cannot be reached")
    assert str(KvPoolError(ErrorCode.NO_SPACE, "64 MiB wanted")) == "NO_SPACE: 64 MiB wanted"


def _refusing_address() -> str:
    """A loopback port nothing listens on (bound, then released: connecting is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_an_unreachable_master_is_logged_once_per_outage_with_its_address(caplog: pytest.LogCaptureFixture) -> None:
    address = _refusing_address()
    master = MasterClient(address, breaker_backoff_s=0.0, breaker_max_backoff_s=0.0)
    caplog.set_level(logging.WARNING, logger="kvpool.client.master_client")
    codes = []
    for _ in range(5):
        with pytest.raises(KvPoolError) as failed:
            master.call(frames.Op.BATCH_EXISTS, pb.BatchExistsRequest(keys=["k"]), Deadline(2.0))
        codes.append(failed.value.code)
        assert address in str(failed.value)
    assert set(codes) == {ErrorCode.UNAVAILABLE}
    warnings = [r.getMessage() for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert address in warnings[0]
    assert "KVPOOL_MASTER" in warnings[0]
