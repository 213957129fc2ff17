"""A fresh machine builds everything: the build dependencies are installed before the venv is built, for
`make demo` as for `make test` and CI, so the compiled modules are built and their tests run."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_DEPS = "scripts/install-build-deps.sh"


def _dry_run(target: str) -> list[str]:
    """The commands `make TARGET` would run on a machine without a venv (make -n, nothing executed)."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed (the Makefile is how the README builds and tests)")
    done = subprocess.run(
        ["make", "-n", "-B", target, "VENV=/nonexistent-venv"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return done.stdout.splitlines()


@pytest.mark.parametrize("target", ["demo", "test"])
def test_build_dependencies_come_before_the_venv(target: str) -> None:
    commands = _dry_run(target)
    deps = next(i for i, c in enumerate(commands) if BUILD_DEPS in c)
    venv = next(i for i, c in enumerate(commands) if "-m venv" in c)
    install = next(i for i, c in enumerate(commands) if "pip install" in c and "-e" in c)
    assert deps < venv < install


def test_make_test_prints_the_slowest_tests() -> None:
    pytest_line = next(c for c in _dry_run("test") if " -m pytest" in c)
    assert "--durations=15" in pytest_line


def test_ci_installs_the_build_dependencies_before_make_test() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert BUILD_DEPS in ci
    assert ci.index(BUILD_DEPS) < ci.index("make test")
    script = (ROOT / BUILD_DEPS).read_text()
    for package in ("gcc", "python3-dev", "libxxhash-dev"):
        assert package in script
