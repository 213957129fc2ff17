"""The test directories have no ``__init__.py`` (pytest's default rootdir-relative import): two test files
with one basename make the whole suite fail to collect, though each directory passes on its own."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_basename_is_unique() -> None:
    where: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name.startswith("test_") or path.name == "conftest.py":
            where[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in where.items() if len(paths) > 1 and name != "conftest.py"}
    assert not clashes, f"rename one of each: {clashes}"
