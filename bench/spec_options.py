"""Drafter configurations written on a bench's command line: ``DRAFTER`` or
``DRAFTER:name=value,name=value`` (``vegas:score=weight,accumulate=0.5``), the names
being ``SpecConfig``'s selection options; the text itself labels the row."""

from __future__ import annotations

from dataclasses import fields

from vegas_core import SpecConfig, VegasError
from vegas_core.spec_config import DRAFTERS

# What the bench sets for every configuration alike: not per-configuration options.
SHARED = ("drafter", "gamma", "sparsity", "min_tokens")
OPTIONS = tuple(f.name for f in fields(SpecConfig) if f.name not in SHARED)
FLOAT_OPTIONS = tuple(f.name for f in fields(SpecConfig) if f.type in ("float", float))
INT_OPTIONS = tuple(f.name for f in fields(SpecConfig) if f.type in ("int", int))


def parse_config(text: str, names: tuple[str, ...] = OPTIONS) -> tuple[str, str, dict]:
    """``text`` -> (label, drafter, options), checked by building a SpecConfig; the
    options may be ``names`` (by default the selection options)."""
    drafter, _, rest = text.partition(":")
    if drafter not in DRAFTERS:
        raise VegasError(f"unknown drafter '{drafter}' in '{text}'; choose one of: "
                         f"{', '.join(DRAFTERS)}")
    options: dict = {}
    for item in filter(None, rest.split(",")):
        name, eq, value = item.partition("=")
        if not eq or name not in names:
            raise VegasError(f"'{item}' in '{text}' is not name=value with a SpecConfig "
                             f"field of: {', '.join(names)}")
        try:
            options[name] = (float(value) if name in FLOAT_OPTIONS
                             else int(value) if name in INT_OPTIONS else value)
        except ValueError:
            raise VegasError(f"'{item}' in '{text}': {name} takes a number") from None
    SpecConfig(drafter=drafter, **options)  # refuses bad values with its own message
    return text, drafter, options
