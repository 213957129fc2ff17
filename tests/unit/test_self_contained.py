"""The repository stands on its own: no code, test or doc names a path outside it (a team folder, an
absolute home), so that a clone anywhere builds, tests and reads the same."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Spelled in parts so that this file does not match itself.
OUTSIDE = ["/" + "work/", "../" + "shared"]


def _tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=30
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.fail("the repository's files cannot be listed with git")
    return [ROOT / name for name in listed if not name.endswith((".jsonl", ".so", ".png"))]


def test_no_tracked_file_names_a_path_outside_the_repository() -> None:
    offenders = []
    for path in _tracked_text_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        offenders += [f"{path.relative_to(ROOT)}: {needle}" for needle in OUTSIDE if needle in text]
    assert not offenders, offenders
