"""Named registries of pluggable parts (placement, eviction, prefetch): one list of names per kind of policy.

A registry maps a name to a factory. The config takes its ``choices`` from it, the factory function
(``make_placement``, ``make_eviction``) looks names up in it, and ``kvpool ... --help`` and the docs list
its names, so a new policy is added in exactly one place: its module's registry.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

F = TypeVar("F")

__all__ = ["Registry"]


class Registry(Generic[F]):
    """Factories of one kind of part, by name, in registration order (the first is listed first)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, F] = {}

    def add(self, name: str, factory: F) -> F:
        """Register ``factory`` under ``name``; a name may be registered once."""
        if name in self._factories:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._factories[name] = factory
        return factory

    def get(self, name: str) -> F:
        """The factory called ``name``; ValueError lists the known names."""
        try:
            return self._factories[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}: use {self.spelled_out()}") from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._factories)

    def spelled_out(self) -> str:
        """``"a, b or c"``: the names as an error message lists them."""
        names = self.names()
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"

    def __contains__(self, name: object) -> bool:
        return name in self._factories

    def __iter__(self) -> Iterator[str]:
        return iter(self._factories)
