"""The running local cluster as the default cluster, like kubectl's current context.

``kvpool local up`` records the cluster it started in a small per-user file (its master address, token
file, directory and master pids) and ``kvpool local down`` removes it. When no master is given
(no ``--master``, no ``KVPOOL_MASTER``), ``kvpool-admin`` and ``PoolClient.from_env()`` use that cluster
and say so in one line; the benchmarks use it with ``--master local``. A record whose masters are all
gone is ignored, so a crashed launcher cannot send tools to a dead address.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvpool.common import envs
from kvpool.common.errors import ErrorCode, KvPoolError

LOCAL = "local"
"""The master address that names the running local cluster explicitly (benchmarks: ``--master local``)."""


@dataclass(frozen=True)
class LocalContext:
    master: str
    directory: str
    token_file: str = ""
    cluster: str = "kvpool"
    master_pids: list[int] = field(default_factory=list)

    def alive(self) -> bool:
        return any(_alive(pid) for pid in self.master_pids)

    def describe(self) -> str:
        return f"using the local cluster at {self.master} (started by `kvpool local up` in {self.directory})"


def context_file() -> Path:
    explicit = envs.KVPOOL_LOCAL_CONTEXT.get()
    if explicit:
        return Path(explicit)
    base = envs.XDG_RUNTIME_DIR.get() or tempfile.gettempdir()
    return Path(base) / f"kvpool-local-{os.getuid()}.json"


def write(context: LocalContext) -> Path:
    """Record ``context`` as the current local cluster (atomically: a reader never sees half a file)."""
    path = context_file()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(context)))
    tmp.replace(path)
    return path


def clear(directory: str) -> bool:
    """Forget the current local cluster if it is the one in ``directory`` (another may have replaced it)."""
    current = _load()
    if current is None or Path(current.directory).resolve() != Path(directory).resolve():
        return False
    context_file().unlink(missing_ok=True)
    return True


def current() -> LocalContext | None:
    """The running local cluster, or None (no record, or its masters are gone)."""
    context = _load()
    return context if context is not None and context.alive() else None


def require() -> LocalContext:
    """The running local cluster, for an explicit ``--master local``."""
    context = current()
    if context is None:
        raise KvPoolError(
            ErrorCode.UNAVAILABLE, f"no local cluster is running (no live record in {context_file()}): kvpool local up"
        )
    return context


def _load() -> LocalContext | None:
    try:
        doc = json.loads(context_file().read_text())
        return LocalContext(
            master=str(doc["master"]),
            directory=str(doc["directory"]),
            token_file=str(doc.get("token_file", "")),
            cluster=str(doc.get("cluster", "kvpool")),
            master_pids=[int(pid) for pid in doc.get("master_pids", [])],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def resolve(master: str | None) -> str | None:
    """A benchmark's ``--master``: ``local`` names the running local cluster (said in one line on stderr);
    anything else is returned as given."""
    if master != LOCAL:
        return master
    context = require()
    print(f"kvpool: {context.describe()}", file=sys.stderr)
    return context.master
