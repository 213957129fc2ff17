"""Engine worker processes of the end-to-end tests: each runs one engine instance and prints its result as
the last line of its output, a JSON object."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def worker_env() -> dict[str, str]:
    """This checkout's kvpool and tests first on the path; never a download of model files."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def last_json_line(stdout: str) -> dict[str, Any]:
    return dict(json.loads(stdout.strip().splitlines()[-1]))


def run_worker(worker: Path, *args: str) -> dict[str, Any]:
    """Run ``worker`` with ``args`` to its end (3 minutes at most) and return its result."""
    done = subprocess.run(
        [sys.executable, str(worker), *args],
        capture_output=True,
        text=True,
        env=worker_env(),
        timeout=180,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, f"worker {args[0]} failed:\n{done.stderr[-3000:]}"
    return last_json_line(done.stdout)
