"""The HTTP side every kvpool service exposes: Prometheus ``/metrics`` and ``/health``.

Each process passes its own ``CollectorRegistry`` (never the global one, so tests can run several
services in one process) and a health callback returning ``(ok, details)``.

A connection that sends nothing for ``idle_timeout_s`` is closed, so idle or stalled scrapers cannot pin
the server's threads; a health callback or extra route that fails answers 503 or 500 with the error
(logged), never a dropped connection.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvpool.common.log import get_logger

logger = get_logger(__name__)

HealthFn = Callable[[], tuple[bool, dict[str, Any]]]


class _Handler(BaseHTTPRequestHandler):
    registry: CollectorRegistry
    health: HealthFn
    extra_routes: dict[str, Callable[[], dict[str, Any]]]

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._answer(path, 500, lambda: (200, generate_latest(self.registry), CONTENT_TYPE_LATEST))
        elif path == "/health":
            self._answer(path, 503, self._health)
        elif path in self.extra_routes:
            route = self.extra_routes[path]
            self._answer(path, 500, lambda: (200, json.dumps(route()).encode(), "application/json"))
        else:
            self._send(404, b"not found\n", "text/plain")

    def _health(self) -> tuple[int, bytes, str]:
        ok, details = self.health()
        return 200 if ok else 503, json.dumps({"ok": ok, **details}).encode(), "application/json"

    def _answer(self, path: str, failed_code: int, render: Callable[[], tuple[int, bytes, str]]) -> None:
        try:
            code, body, content_type = render()
        except Exception as exc:  # a bug in a collector or callback: say so, keep serving
            logger.exception("%s failed", path)
            code, content_type = failed_code, "application/json"
            body = json.dumps({"ok": False, "error": f"{type(exc).__name__}: {exc}"}).encode()
        self._send(code, body, content_type)

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - keep scrapes out of the logs
        pass


class MetricsServer:
    """Serves /metrics and /health on a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        health: HealthFn,
        extra_routes: dict[str, Callable[[], dict[str, Any]]] | None = None,
        idle_timeout_s: float = 30.0,
    ) -> None:
        handler = type(
            "Handler",
            (_Handler,),
            {
                "registry": registry,
                "health": staticmethod(health),
                "extra_routes": extra_routes or {},
                "timeout": idle_timeout_s,  # StreamRequestHandler: the socket timeout of each connection
            },
        )
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
