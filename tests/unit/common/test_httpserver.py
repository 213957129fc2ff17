"""The /metrics and /health server every service runs, on a real loopback socket."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from kvpool.common.httpserver import MetricsServer


class _Health:
    def __init__(self) -> None:
        self.answer: tuple[bool, dict[str, Any]] | Exception = (True, {"role": "test"})

    def __call__(self) -> tuple[bool, dict[str, Any]]:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.fixture
def served() -> Iterator[tuple[str, _Health]]:
    registry = CollectorRegistry()
    Counter("kvpool_test_things", "things", registry=registry).inc(3)
    health = _Health()

    def broken() -> dict[str, Any]:
        raise ValueError("no route today")

    server = MetricsServer("127.0.0.1", 0, registry, health, {"/broken": broken}, idle_timeout_s=0.3).start()
    try:
        yield f"127.0.0.1:{server.port}", health
    finally:
        server.stop()


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def test_metrics_and_health(served: tuple[str, _Health]) -> None:
    address, health = served
    status, body = _get(f"http://{address}/metrics")
    assert status == 200
    assert b"kvpool_test_things_total 3.0" in body
    assert _get(f"http://{address}/health") == (200, json.dumps({"ok": True, "role": "test"}).encode())
    health.answer = (False, {"why": "draining"})
    assert _get(f"http://{address}/health")[0] == 503
    assert _get(f"http://{address}/nope")[0] == 404


def test_a_failing_callback_answers_with_its_error_and_the_server_keeps_serving(served: tuple[str, _Health]) -> None:
    address, health = served
    health.answer = RuntimeError("etcd unreachable")
    status, body = _get(f"http://{address}/health")
    assert status == 503
    assert json.loads(body) == {"ok": False, "error": "RuntimeError: etcd unreachable"}
    status, body = _get(f"http://{address}/broken")
    assert (status, json.loads(body)["error"]) == (500, "ValueError: no route today")
    assert _get(f"http://{address}/metrics")[0] == 200


def test_an_idle_connection_is_closed(served: tuple[str, _Health]) -> None:
    address, _ = served
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=5) as idle:
        started = time.monotonic()
        assert idle.recv(1) == b""  # the server hung up on a connection that never sent a request
        assert time.monotonic() - started < 4.0
    assert _get(f"http://{address}/health")[0] == 200
