"""``kvpool master``: run one master until SIGTERM/SIGINT (with --etcd: one of the HA replicas)."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.common.groups import check_group_count
from kvpool.common.log import get_logger
from kvpool.master.config import MasterConfig
from kvpool.master.service import MasterServer

log = get_logger(__name__)


def _check_groups(config: MasterConfig) -> None:
    check_group_count(config.groups)
    if config.groups > 1 and not config.etcd:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, "--groups > 1 needs --etcd: each group elects its leader there")
    if not 0 <= config.group < config.groups:
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"--group {config.group} is not in 0..{config.groups - 1}")


async def _serve(config: MasterConfig, ready_file: str) -> None:
    _check_groups(config)
    server = MasterServer(config)
    events = None
    if config.kv_events:
        from kvpool.master.kv_events import KvEventPublisher, KvEventsConfig

        events = KvEventPublisher(KvEventsConfig(config.kv_events, page_size=config.kv_events_page_size)).start()
        server.state.on_change = events.record
    ha = None
    if config.etcd:
        from kvpool.master.ha import HaCoordinator

        ha = HaCoordinator(config, server)
    await server.start()
    if ha is not None:
        await ha.start()
    if ready_file:
        Path(ready_file).write_text(json.dumps(server.endpoints))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("master stopping")
    if ha is not None:
        await ha.stop()
    await server.stop()
    if events is not None:
        events.stop()


def serve(config: MasterConfig, ready_file: str = "") -> int:
    try:
        import uvloop  # a faster event loop for the framed hot path, where installed
    except ImportError:
        asyncio.run(_serve(config, ready_file))
    else:
        uvloop.run(_serve(config, ready_file))
    return 0
