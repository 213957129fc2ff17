from collections.abc import Sequence
from typing import overload

from kvpool.master.objects import ObjectMeta

@overload
def lookup(keys: list[str], objects: tuple[dict[str, ObjectMeta], ...], /) -> list[ObjectMeta | None]: ...
@overload
def lookup(
    keys: list[str], objects: tuple[dict[str, ObjectMeta], ...], groups: int, group: int, /
) -> list[ObjectMeta | None] | int: ...
def foreign(keys: Sequence[str], groups: int, group: int, /) -> int: ...
