"""How a store of a G-group cluster splits its DRAM and its SSD tier into one share per group (decisions
0080, 0081)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.common.errors import ErrorCode, KvPoolError
from kvpool.store.config import StoreConfig
from kvpool.store.groups import group_configs

MIB = 1 << 20


def test_each_group_gets_an_equal_dram_and_ssd_share_in_its_own_directory(tmp_path: Path) -> None:
    config = StoreConfig(master="etcd://127.0.0.1:2379", size=64 * MIB, ssd_dir=str(tmp_path), ssd_size=99 * MIB)
    parts = group_configs(config, 3)
    assert [p.size for p in parts] == [20 * MIB] * 3  # 64/3 rounded down to 2 MiB
    assert [p.ssd_size for p in parts] == [32 * MIB] * 3
    assert [p.ssd_dir for p in parts] == [str(tmp_path / f"group-{g}") for g in range(3)]
    assert len({p.ssd_dir for p in parts}) == 3  # no two groups share a data file, journal or lock


def test_without_an_ssd_tier_no_group_gets_one() -> None:
    parts = group_configs(StoreConfig(master="etcd://127.0.0.1:2379", size=8 * MIB), 2)
    assert [(p.size, p.ssd_dir, p.ssd_size) for p in parts] == [(4 * MIB, "", 0)] * 2


def test_an_ssd_tier_too_small_to_split_is_refused_with_the_option_named(tmp_path: Path) -> None:
    config = StoreConfig(master="etcd://127.0.0.1:2379", size=8 * MIB, ssd_dir=str(tmp_path), ssd_size=3 * MIB)
    with pytest.raises(KvPoolError) as err:
        group_configs(config, 2)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT
    assert "--ssd-size" in err.value.message
