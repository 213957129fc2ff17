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


def from_args(cls: type[C], args: argparse.Namespace, **overrides: Any) -> C:
    """Build ``cls`` from parsed args: unset options fall back to the env variable, then the default."""
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        value = getattr(args, field.name, None)
        env = field.metadata.get("env")
        if value is None and env is not None and env.is_set():
            parse = field.metadata.get("parse")
            value = parse(env.get()) if parse else env.get()
        if value is not None:
            values[field.name] = value
    values.update(overrides)
    return cls(**values)
