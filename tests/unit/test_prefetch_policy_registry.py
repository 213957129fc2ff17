"""The prefetch policies' registry: one list of names, SGLang's, that EngineClient.prefetch looks up."""

from __future__ import annotations

import pytest

from kvpool.client.engine import PREFETCH_POLICIES, PrefetchPolicy


def test_every_policy_is_registered_under_sglangs_name() -> None:
    assert PREFETCH_POLICIES.names() == ("best_effort", "wait_complete", "timeout")
    for policy in PrefetchPolicy:
        assert PREFETCH_POLICIES.get(policy.value) is policy
        assert PREFETCH_POLICIES.get(policy) is policy  # a member is accepted as well as its name


def test_an_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="best_effort, wait_complete or timeout"):
        PREFETCH_POLICIES.get("eager")
