"""Config as dataclasses whose field docs become ``--help``.

A field is declared with :func:`option`; :func:`add_arguments` turns a dataclass into argparse options
(``--field-name``) and :func:`from_args` builds the dataclass back, running its ``__post_init__``
validation. Precedence: field default < environment (only where a field names an ``envs`` variable)
< command line.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

from kvpool.common.envs import EnvVar
from kvpool.common.errors import ErrorCode, KvPoolError

C = TypeVar("C")


def option(
    default: Any,
    doc: str,
    *,
    parse: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    env: EnvVar[Any] | None = None,
    cli: bool = True,
) -> Any:
    """A config field: its default, its one-line doc (shown by --help) and how to parse it."""
    return dataclasses.field(
        default=default,
        metadata={"doc": doc, "parse": parse, "choices": choices, "env": env, "cli": cli},
    )


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, cls: type[Any], *, skip: tuple[str, ...] = ()) -> None:
    """Add one option per field of the dataclass ``cls`` (fields named in ``skip`` are left out)."""
    for field in dataclasses.fields(cls):
        meta = field.metadata
        if field.name in skip or not meta.get("cli", True):
            continue
        help_text = f"{meta.get('doc', '')} (default: {field.default!r})"
        env = meta.get("env")
        if env is not None:
            help_text += f"; env {env.name}"
        if isinstance(field.default, bool):
            parser.add_argument(
                _flag(field.name),
                dest=field.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
            continue
        parse = meta.get("parse") or (type(field.default) if field.default is not None else str)
        parser.add_argument(
            _flag(field.name),
            dest=field.name,
            default=None,
            type=parse,
            choices=meta.get("choices"),
            help=help_text,
        )


def check_ports(off: int | None = None, **ports: int) -> None:
    """ValueError unless every port is 0 (any free port), 1-65535, or ``off`` where one may be turned off."""
    for name, port in ports.items():
        if not (0 <= port <= 65535 or port == off):
            allowed = "0-65535" + (f" or {off} (off)" if off is not None else "")
            raise ValueError(f"--{name.replace('_', '-')} must be {allowed}, got {port}")


def from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """Build ``cls`` from parsed args: unset options fall back to the env variable, then the default.
    A value the config refuses raises KvPoolError(INVALID_ARGUMENT) with the config's message."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(args, field.name, None)
        env = field.metadata.get("env")
        if value is None and env is not None and env.is_set():
            parse = field.metadata.get("parse")
            try:
                value = parse(env.get()) if parse else env.get()
            except ValueError as exc:
                raise KvPoolError(ErrorCode.INVALID_ARGUMENT, f"{env.name}={env.get()!r}: {exc}") from None
        if value is not None:
            values[field.name] = value
    values.update(overrides)
    try:
        return cls(**values)
    except ValueError as exc:  # __post_init__'s checks: a usage error, not a crash
        raise KvPoolError(ErrorCode.INVALID_ARGUMENT, str(exc)) from None
