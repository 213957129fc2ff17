"""Failpoints: named places in the code where a test can make a real process sleep, exit or raise.

``failpoint(name)`` costs one dict lookup and does nothing unless ``KVPOOL_FAILPOINTS`` names it. The
variable is a comma-separated list of ``name=action`` entries (a bare ``name`` means ``exit``)::

    KVPOOL_FAILPOINTS="client.put.before_end=sleep:30"   # hang there (a test then SIGKILLs the process)
    KVPOOL_FAILPOINTS="client.put.before_end=exit"       # os._exit(77) there: no cleanup, no PutEnd
    KVPOOL_FAILPOINTS="client.put.before_end=raise"      # raise FailpointError there

When a failpoint fires it first writes ``kvpool failpoint <name> hit`` to stderr (flushed), so a test
driving a child process can wait for that line instead of sleeping and hoping the child got there.

The variable is read once per process (the first time any failpoint is reached): failpoints are for
tests that start a process with them set, not for toggling at run time. ``reload()`` re-reads it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass

from kvpool.common import envs

EXIT_CODE = 77
"""The exit status of a process stopped by an ``exit`` failpoint (distinct from crashes and signals)."""

CLIENT_PUT_BEFORE_END = "client.put.before_end"
"""PoolClient.batch_put_from: the bytes are written to the stores, PutEnd has not been sent."""
STORE_TIER_BEFORE_WRITE = "store.tier.before_write"
"""TierWorker.demote_many: a batch of demotions is about to be written to the SSD (a slow disk)."""


class FailpointError(RuntimeError):
    """Raised by a failpoint whose action is ``raise``."""


@dataclass(frozen=True)
class _Action:
    kind: str  # "sleep" | "exit" | "raise"
    seconds: float = 0.0


_lock = threading.Lock()
_active: dict[str, _Action] | None = None


def parse(spec: str) -> dict[str, _Action]:
    """``name=action,...`` -> {name: action}; raises ValueError on an unknown action (a typo in a test)."""
    table: dict[str, _Action] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        name, _, action = entry.partition("=")
        table[name.strip()] = _parse_action(action.strip() or "exit")
    return table


def _parse_action(action: str) -> _Action:
    kind, _, arg = action.partition(":")
    if kind == "sleep":
        return _Action("sleep", float(arg or "3600"))
    if kind in ("exit", "raise") and not arg:
        return _Action(kind)
    raise ValueError(f"unknown failpoint action {action!r} (sleep:S, exit or raise)")


def reload() -> None:
    """Re-read KVPOOL_FAILPOINTS (tests that set it in-process)."""
    global _active
    with _lock:
        _active = parse(envs.KVPOOL_FAILPOINTS.get())


def _table() -> dict[str, _Action]:
    if _active is None:
        reload()
    assert _active is not None
    return _active


def failpoint(name: str) -> None:
    """Do what KVPOOL_FAILPOINTS says for ``name``; nothing when it is not named (the normal case)."""
    action = _table().get(name)
    if action is None:
        return
    sys.stderr.write(f"kvpool failpoint {name} hit\n")
    sys.stderr.flush()
    if action.kind == "sleep":
        time.sleep(action.seconds)
    elif action.kind == "exit":
        os._exit(EXIT_CODE)  # like a crash: no finally blocks, no atexit, no PutEnd
    else:
        raise FailpointError(f"failpoint {name}")
