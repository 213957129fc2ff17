"""Logging: one setup per process, ``get_logger(__name__)`` everywhere, and ``log_once`` for noisy cases."""

from __future__ import annotations

import json
import logging
import sys
import threading

from kvpool.common import envs

_once_lock = threading.Lock()
_once_seen: set[str] = set()


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 3),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def setup_logging(role: str, level: str | None = None) -> None:
    """Configure the root logger once for a kvpool process (``role`` names it in every line)."""
    handler = logging.StreamHandler(sys.stderr)
    if envs.KVPOOL_LOG_JSON.get():
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    wanted = (level or envs.KVPOOL_LOG_LEVEL.get()).upper()
    if isinstance(logging.getLevelName(wanted), int):
        root.setLevel(wanted)
    else:  # a typo in the log level must not keep a service from starting
        root.setLevel(logging.INFO)
        root.warning("unknown log level %r (%s): logging at INFO", wanted, envs.KVPOOL_LOG_LEVEL.name)


def get_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)


def log_once(logger: logging.Logger, level: int, key: str, msg: str, *args: object) -> None:
    """Log ``msg`` the first time ``key`` is seen in this process (e.g. "RDMA unavailable, using TCP")."""
    with _once_lock:
        if key in _once_seen:
            return
        _once_seen.add(key)
    logger.log(level, msg, *args)
