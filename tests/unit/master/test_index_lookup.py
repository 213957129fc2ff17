"""kvpool.master._index (the compiled batched lookup): built where it can be, and the same answers as the
Python lookup it replaces, shard for shard."""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

import pytest

from kvpool.master import shards
from kvpool.master.objects import ObjectMeta
from kvpool.master.shards import ShardMap, shard_index


def _can_build() -> bool:
    compiler = shutil.which("gcc") or shutil.which("cc")
    headers = Path(sysconfig.get_path("include"), "Python.h").exists()
    return compiler is not None and headers and Path("/usr/include/xxhash.h").exists()


def test_it_is_built_wherever_a_compiler_python_and_xxhash_headers_are() -> None:
    if not _can_build():
        pytest.skip("no C compiler, Python headers or xxhash.h here: the Python lookup is the expected one")
    assert shards._native_lookup is not None, "kvpool.master._index is missing: rebuild with `make venv`"


class _Str(str):
    pass


KEYS: list[object] = [
    *(f"{i:064x}_0_k" for i in range(300)),
    "é-ü-漢字-🙂",
    "a\nb\0c",
    "x" * 600,
    "",
    "\udcff-lone-surrogate",
    b"bytes-are-not-keys",
    None,
    42,
    _Str("a-str-subclass"),
]


@pytest.fixture(params=["native", "python"])
def lookup_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "python":
        monkeypatch.setattr(shards, "_native_lookup", None)
    elif shards._native_lookup is None:
        pytest.skip("kvpool.master._index was not built")
    return str(request.param)


@pytest.mark.parametrize("num_shards", [1, 7, 16])
def test_every_key_is_found_in_its_shard_and_nowhere_else(lookup_impl: str, num_shards: int) -> None:
    """Each held key is placed by shard_index (python-xxhash), and found; a held key put into any other
    shard is not (so the compiled xxh3 must agree with python-xxhash's)."""
    index = ShardMap(num_shards)
    metas: dict[str, ObjectMeta] = {}
    for n, key in enumerate(k for k in KEYS if type(k) is str and k and not k.startswith("\udcff")):
        assert isinstance(key, str)
        meta = ObjectMeta(4096, 1, n * 4096, 0.0)
        metas[key] = meta
        index.shards[shard_index(key.encode(), num_shards)].objects[key] = meta
    misplaced = "misplaced-key"
    if num_shards > 1:
        index.shards[(shard_index(misplaced.encode(), num_shards) + 1) % num_shards].objects[misplaced] = ObjectMeta(
            1, 1, 0, 0.0
        )
    found = index.lookup_many([*KEYS, misplaced, "never-put"])  # type: ignore[list-item]
    assert found[: len(KEYS)] == [metas.get(k) if type(k) is str else None for k in KEYS]
    assert found[len(KEYS) :] == [None, None]


def test_an_empty_batch(lookup_impl: str) -> None:
    assert ShardMap(4).lookup_many([]) == []


def test_the_compiled_lookup_refuses_bad_arguments() -> None:
    native = shards._native_lookup
    if native is None:
        pytest.skip("kvpool.master._index was not built")
    with pytest.raises(TypeError):
        native(("a",), ({},))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        native(["a"], [{}])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        native(["a"], ({}, []))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no shards"):
        native(["a"], ())
