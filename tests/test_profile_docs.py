"""docs/profile-format.md against the schema: its example is a valid profile holding
every field, and each field table names exactly its model's fields."""

from __future__ import annotations

import math
import re
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from vegas_tune.export import build_exports
from vegas_tune.profile import SCHEMA_VERSION, Profile, Tuned, profile_from_dict

DOC = Path(__file__).resolve().parents[1] / "docs" / "profile-format.md"
EXAMPLE_HEADING = "## Example"
# The header every field table has; other tables (files, steps) have other headers.
FIELD_TABLE_HEADER = "| field | type | meaning |"
# The heading of the table that documents Profile itself.
TOP_LEVEL_HEADING = "Top level"
LIST_MARK = "[]"
INTERVAL_SUFFIX = "_interval"
BOUND_SUFFIXES = ("_low", "_high")


def doc_text() -> str:
    return DOC.read_text(encoding="utf-8")


def example() -> dict:
    """The YAML block under the Example heading, parsed."""
    after = doc_text().split(EXAMPLE_HEADING + "\n", 1)[1]
    block = re.search(r"```yaml\n(.*?)```", after, re.DOTALL)
    assert block, f"no ```yaml block under {EXAMPLE_HEADING!r} in {DOC}"
    return yaml.safe_load(block.group(1))


# --- the schema's field paths ---------------------------------------------------------

def _model_in(annotation) -> tuple[type[BaseModel] | None, bool]:
    """(the profile model inside ``annotation``, whether it is a list of them)."""
    for arg in typing.get_args(annotation) or ():
        if typing.get_origin(annotation) is list:
            inner, _ = _model_in(arg)
            if inner is not None:
                return inner, True
        inner, is_list = _model_in(arg)  # e.g. Optional[Model]
        if inner is not None:
            return inner, is_list
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    return None, False


def models_by_path(model: type[BaseModel] = Profile, prefix: str = "") -> dict[str, type]:
    """Dotted path -> the model found there: '' -> Profile, 'steps[]' -> StepSummary..."""
    found = {prefix: model}
    for name, info in model.model_fields.items():
        inner, is_list = _model_in(info.annotation)
        if inner is not None:
            path = (f"{prefix}.{name}" if prefix else name) + (LIST_MARK if is_list else "")
            found.update(models_by_path(inner, path))
    return found


def schema_paths(model: type[BaseModel] = Profile, prefix: str = "") -> set[str]:
    """Every field's dotted path, optional ones included; a field that holds free-form
    data (``chosen``, ``within_noise``, ``exports.vegas``, ``serve_config``) is a leaf."""
    paths = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        inner, is_list = _model_in(info.annotation)
        if inner is None:
            paths.add(path)
        else:
            paths |= schema_paths(inner, path + (LIST_MARK if is_list else ""))
    return paths


def example_paths(data, leaves: set[str], prefix: str = "") -> set[str]:
    """Every key path of ``data``, lists of mappings written ``[]``; the walk stops at a
    schema leaf, so free-form mappings count as one path. An empty list of mappings adds
    no path: its fields must show in another item (another step's ``predictions``)."""
    if prefix in leaves or not isinstance(data, (dict, list)):
        return {prefix}
    if isinstance(data, list):
        return set().union(*(example_paths(item, leaves, prefix + LIST_MARK) for item in data))
    return set().union(*(example_paths(value, leaves, f"{prefix}.{key}" if prefix else str(key))
                         for key, value in data.items()))


# --- the example ----------------------------------------------------------------------

def test_example_is_a_valid_profile_of_this_schema_version():
    data = example()
    assert data["schema_version"] == SCHEMA_VERSION
    profile = profile_from_dict(data, source=f"{DOC} example")
    assert profile.recommended


def test_example_holds_every_field_of_the_schema():
    leaves = schema_paths()
    found = example_paths(example(), leaves)
    assert found - leaves == set(), "the example has keys the schema lacks"
    assert leaves - found == set(), "the example leaves out schema fields"


def numbers(value, path: str = ""):
    """(path, number) for every number in ``value``."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from numbers(item, f"{path}[{index}]")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield path, value


def intervals(mapping: dict):
    """(name, mean, low, high) of every interval in ``mapping``, in both spellings."""
    for key, value in mapping.items():
        if key.endswith(INTERVAL_SUFFIX) and value is not None:
            name = key.removesuffix(INTERVAL_SUFFIX)
            yield name, mapping[name], *value
        elif key.endswith(BOUND_SUFFIXES[0]):
            name = key.removesuffix(BOUND_SUFFIXES[0])
            yield name, mapping[name], value, mapping[name + BOUND_SUFFIXES[1]]


def test_example_makes_sense():
    """What the profile's semantic validation asks, checked here too, so the example
    holds to it whichever checks ``profile_from_dict`` makes."""
    data = example()
    results, tuned = data["results"], data["tuned"]
    for path, value in numbers(data):
        assert math.isfinite(value), path
    mappings = [("results", results)]
    for index, step in enumerate(data["steps"]):
        mappings.append((f"steps[{index}].chosen", step["chosen"]))
        mappings += [(f"steps[{index}].within_noise", item) for item in step["within_noise"]]
        mappings += [(f"steps[{index}].predictions", item) for item in step["predictions"]]
    checked = 0
    for where, mapping in mappings:
        for name, mean, low, high in intervals(mapping):
            assert low <= mean <= high, f"{where}.{name}: {mean} outside [{low}, {high}]"
            checked += 1
    assert checked > len(mappings) // 2
    assert len(results["acceptance_by_position"]) == tuned["gamma"]
    assert results["speedup_interval"][0] > 1 or not data["recommended"]
    assert data["exports"] == build_exports(data["model"]["id"], Tuned(**tuned)).model_dump()
    # The cheapest-within-noise rule the doc describes holds in the example.
    for step in data["steps"]:
        chosen = step["chosen"]
        for other in step["within_noise"]:
            assert other["speedup_low"] <= chosen["speedup_high"]
            assert chosen["speedup_low"] <= other["speedup_high"]


# --- the field tables -----------------------------------------------------------------

def field_tables() -> dict[str, list[str]]:
    """Heading (backticks dropped) -> the field names of the field table under it."""
    tables: dict[str, list[str]] = {}
    heading = None
    lines = doc_text().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("#"):
            heading = line.lstrip("#").strip().strip("`")
        elif line.strip() == FIELD_TABLE_HEADER:
            assert heading not in tables, f"two field tables under {heading!r}"
            names = []
            for row in lines[index + 2:]:
                if not row.startswith("|"):
                    break
                names.append(row.split("|")[1].strip().strip("`"))
            tables[heading] = names
    return tables


def test_every_model_has_a_field_table_naming_exactly_its_fields():
    models = models_by_path()
    tables = field_tables()
    headings = {TOP_LEVEL_HEADING if path == "" else path: model
                for path, model in models.items()}
    assert set(tables) == set(headings), "field tables and schema models differ"
    for heading, names in tables.items():
        model = headings[heading]
        assert len(names) == len(set(names)), f"{heading}: a field is listed twice"
        assert names == list(model.model_fields), (
            f"{heading}: the table lists {names}, {model.__name__} has "
            f"{list(model.model_fields)} (same fields, in schema order)")


@pytest.mark.parametrize("stale", ["vegas-tune run", "LlamaForCausalLM", "name: options",
                                   "name: budget"])
def test_doc_names_nothing_the_tool_does_not_write(stale):
    assert stale not in doc_text()


def test_doc_states_this_schema_version():
    text = doc_text()
    assert f"writes **version {SCHEMA_VERSION}**" in text
    assert f"must be `{SCHEMA_VERSION}`" in text
    assert f"### Changes from version {SCHEMA_VERSION - 1}" in text


def test_doc_keeps_the_validate_section_for_its_owner():
    text = doc_text()
    assert "## What `validate` checks" in text
