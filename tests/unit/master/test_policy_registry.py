"""The policy registries: the one list of names that the config, the factories and the docs share."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from kvpool.common.registry import Registry
from kvpool.master.config import MasterConfig
from kvpool.master.eviction import EVICTION_POLICIES, EvictionPolicy, FifoPolicy, LruPolicy, make_eviction
from kvpool.master.placement import (
    PLACEMENT_POLICIES,
    FreeRatioFirst,
    LocalFirst,
    PlacementPolicy,
    RandomPlacement,
    make_placement,
)

ARCHITECTURE = Path(__file__).resolve().parents[3] / "docs" / "architecture.md"


def choices_of(field_name: str) -> tuple[str, ...] | None:
    field = next(f for f in dataclasses.fields(MasterConfig) if f.name == field_name)
    choices: tuple[str, ...] | None = field.metadata["choices"]
    return choices


def test_the_config_offers_exactly_the_registered_policies() -> None:
    assert choices_of("placement") == PLACEMENT_POLICIES.names() == ("free_ratio_first", "random", "local_first")
    assert choices_of("eviction") == EVICTION_POLICIES.names() == ("lru", "fifo")
    assert MasterConfig().placement in PLACEMENT_POLICIES
    assert MasterConfig().eviction in EVICTION_POLICIES


@pytest.mark.parametrize(
    ("name", "kind"), [("free_ratio_first", FreeRatioFirst), ("random", RandomPlacement), ("local_first", LocalFirst)]
)
def test_every_placement_name_builds_its_policy(name: str, kind: type[PlacementPolicy]) -> None:
    assert type(make_placement(name, random.Random(1))) is kind


@pytest.mark.parametrize(("name", "kind"), [("lru", LruPolicy), ("fifo", FifoPolicy)])
def test_every_eviction_name_builds_its_policy(name: str, kind: type[EvictionPolicy]) -> None:
    assert type(make_eviction(name)) is kind


def test_an_unknown_name_is_refused_with_the_known_ones() -> None:
    with pytest.raises(
        ValueError, match="unknown placement policy 'nearest': use free_ratio_first, random or local_first"
    ):
        make_placement("nearest")
    with pytest.raises(ValueError, match="unknown eviction policy 'arc': use lru or fifo"):
        make_eviction("arc")


def test_a_name_is_registered_once() -> None:
    registry: Registry[int] = Registry("test part")
    registry.add("one", 1)
    with pytest.raises(ValueError, match="test part 'one' is registered twice"):
        registry.add("one", 2)
    assert registry.get("one") == 1
    assert list(registry) == ["one"]
    assert registry.spelled_out() == "one"


def test_the_architecture_doc_names_every_registered_policy() -> None:
    text = ARCHITECTURE.read_text()
    for name in (*PLACEMENT_POLICIES, *EVICTION_POLICIES):
        assert f"`{name}`" in text, f"docs/architecture.md does not mention the policy {name!r}"
