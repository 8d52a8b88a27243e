"""Configuration fields that document and check themselves: ``opt(default, help, choices=...)`` declares a
dataclass field whose help text becomes ``--help`` and whose choices are checked in one place
(:func:`check_choices`). Used by the training configuration (:mod:`dlm.config`) and the objectives' configs
(:mod:`dlm.objectives.configs`). No torch here: ``dlm train --help`` stays instant."""

from __future__ import annotations

import dataclasses
from typing import Any

from dlm.errors import DLMError


def opt(default: Any, help: str, choices: tuple = (), unit: str | None = None, **more: Any):
    """A dataclass field with its help text (and choices, and unit, and ``more``: e.g. the decoders' ``flag``,
    ``arg``, ``old``) in its metadata; a list default is copied per instance."""
    meta = {"help": help, "choices": tuple(choices), "unit": unit, **more}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def default_of(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]


def describe(f: dataclasses.Field) -> str:
    """``help (choices; unit; default X)`` for ``--help`` and the docs' tables."""
    meta = f.metadata
    text = meta.get("help") or ""
    extra = []
    if meta.get("choices"):
        extra.append(" | ".join(map(str, meta["choices"])))
    if meta.get("unit"):
        extra.append(meta["unit"])
    extra.append(f"default {default_of(f)!r}")
    return f"{text} ({'; '.join(extra)})" if text else "; ".join(extra)


def check_choices(obj, section: str) -> None:
    """Every field of dataclass ``obj`` that declares choices holds one of them; DLMError naming
    ``section.field`` and the valid values otherwise."""
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices") if f.metadata else None
        value = getattr(obj, f.name)
        if choices and value is not None and value not in choices:
            raise DLMError(f"{section}.{f.name} = {value!r} is not valid; use one of: {', '.join(map(str, choices))}")
