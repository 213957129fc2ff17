"""A store given a master it cannot reach names the address and why, suggests --master, and backs off."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.cluster import wait_for

pytestmark = pytest.mark.integration


def _start_store(master: str, log_path: Path) -> subprocess.Popen[bytes]:
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvpool.tools.cli",
                "store",
                "--master",
                master,
                "--size",
                "4MiB",
                "--host",
                "127.0.0.1",
                "--heartbeat-interval-s",
                "0.05",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _refusing_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize(
    ("master", "why"),
    [("nowhere.invalid:1", "cannot be resolved"), (_refusing_address(), "does not answer")],
    ids=["unresolvable", "refusing"],
)
def test_a_store_names_the_master_it_cannot_reach_and_backs_off(tmp_path: Path, master: str, why: str) -> None:
    log_path = tmp_path / "store.log"
    store = _start_store(master, log_path)
    try:

        def failures() -> list[str]:
            return [line for line in log_path.read_text(errors="replace").splitlines() if "mount failed" in line]

        wait_for(lambda: failures(), 30.0, "the first mount failure")
        first = time.monotonic()
        line = failures()[0]
        assert master in line
        assert why in line
        assert "--master" in line
        # Heartbeats come every 50 ms; mount attempts back off (1, 2, 4 ... s): a few lines, not dozens.
        wait_for(lambda: time.monotonic() - first > 3.5, 10.0, "3.5 s of retries")
        assert len(failures()) <= 4, failures()
    finally:
        store.terminate()
        store.wait(10)
