"""Third-party engine classes for the conformance tests, on a CPU-only machine.

SGLang 0.5.23 is installed with ``--no-deps`` (scripts/install-conformance-deps.sh): its ``__init__.py``
imports half of its ~70 GPU dependencies, but the storage interface (``hicache_storage.py``,
``storage/backend_factory.py``) needs only torch. The recipe (docs/sglang.md):
register a bare ``sglang`` package whose ``__path__`` is the installed one, so ``sglang/__init__.py``
never runs while the real submodules (and the real ``HiCacheStorage`` class) load. In a real SGLang
process sglang is imported already and the shim does nothing.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest

INSTALL_HINT = (
    "run scripts/install-conformance-deps.sh (torch 2.13.0 CPU, sglang 0.5.23, vllm 0.33.0 and lmcache 0.5.6 "
    "--no-deps, transformers 5.24.0)"
)


def require(*modules: str) -> None:
    """Skip the calling test when a third-party module is missing - or fail under CI (env CI set),
    where a skip would hide that the conformance suite never ran."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return
    message = f"conformance dependencies not importable: {', '.join(missing)} ({INSTALL_HINT})"
    if os.environ.get("CI"):
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def install_light_sglang() -> types.ModuleType:
    """Make ``import sglang.srt...`` work without executing ``sglang/__init__.py``."""
    if "sglang" in sys.modules:
        return sys.modules["sglang"]
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError("sglang is not installed")
    package = types.ModuleType("sglang")
    package.__path__ = list(spec.submodule_search_locations)
    package.__spec__ = spec
    package.__file__ = spec.origin
    sys.modules["sglang"] = package
    return package
