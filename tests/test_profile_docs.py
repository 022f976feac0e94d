"""docs/profile-format.md against the schema: its example is a valid profile holding
every field, and each field table names exactly its model's fields."""

from __future__ import annotations

import math
import re
import types
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from vegas_tune.profile import SCHEMA_VERSION, Profile, Tuned, build_exports, profile_from_dict
from vegas_tune.space import budget_ratio, fits_target, longest_prefix
from vegas_tune.steps import RACE, STEPS

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


def _may_hold_a_plain_value(annotation) -> bool:
    """Whether a field that holds a profile model may hold a plain value instead
    (``config: vanilla``); null does not count: it holds nothing."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return False
    return any(arg is not type(None) and typing.get_origin(arg) is not list
               and not (isinstance(arg, type) and issubclass(arg, BaseModel))
               for arg in typing.get_args(annotation))


def schema_paths(model: type[BaseModel] = Profile, prefix: str = "") -> set[str]:
    """Every field's dotted path, optional ones included; a field that holds free-form
    data (``chosen``, ``within_noise``, ``exports.vegas``, ``serve_config``) is a leaf.
    A field that holds a model or a plain value (``schedule[].config``) is a leaf and
    has its model's paths below it: the example must show it both ways."""
    paths = set()
    for name, info in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        inner, is_list = _model_in(info.annotation)
        if inner is None or _may_hold_a_plain_value(info.annotation):
            paths.add(path)
        if inner is not None:
            paths |= schema_paths(inner, path + (LIST_MARK if is_list else ""))
    return paths


def example_paths(data, leaves: set[str], prefix: str = "") -> set[str]:
    """Every key path of ``data``, lists of mappings written ``[]``; the walk stops at a
    schema leaf, so free-form mappings count as one path, except at a field that may hold
    a model or a plain value, where a mapping is walked. An empty list of mappings, or a
    null where a model may stand (``measured: null``), adds no path: its fields must show
    in another item (another step's ``predictions``, another entry's ``measured``)."""
    below = any(path.startswith((prefix + ".", prefix + LIST_MARK)) for path in leaves)
    if prefix in leaves and not (below and isinstance(data, dict)):
        return {prefix}
    if data is None and below:
        return set()
    if not isinstance(data, (dict, list)):
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


# Relative slack between a figure and what it derives from: the profile rounds speedups
# to 4 digits, throughputs and accepted lengths to a few decimals.
ROUNDING = 1e-3


def test_example_makes_sense():
    """What the profile's semantic validation asks, checked here too, so the example
    holds to it whichever checks ``profile_from_dict`` makes; and the arithmetic the doc
    describes (speedups as ratios of throughputs, accepted length as 1 + the acceptance
    by position, the schedule's ranges) holds in it."""
    data = example()
    results, tuned, workload = data["results"], data["tuned"], data["workload"]
    schedule = data["schedule"]
    for path, value in numbers(data):
        assert math.isfinite(value), path
    figure_sets = [("results", results)] + [(f"schedule[{index}].results", entry["results"])
                                            for index, entry in enumerate(schedule)]
    mappings = list(figure_sets)
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

    # The schedule: several sizes, ranges as build_schedule makes them, speculation only
    # where the speedup's whole interval lies above 1, the headline its last entry.
    assert len(schedule) >= 2, "the example shows a schedule of several batch sizes"
    for index, entry in enumerate(schedule):
        where = f"schedule[{index}]"
        following = schedule[index + 1]["batch_size"] - 1 if index + 1 < len(schedule) else None
        assert entry["batch_min"] == (1 if index == 0 else entry["batch_size"]), where
        assert entry["batch_max"] == (following or entry["batch_size"]), where
        speculative = entry["config"] != "vanilla"
        interval = entry["results"]["speedup_interval"]
        assert speculative == (interval is not None and interval[0] > 1), where
        settings = entry["config"] if speculative else entry["measured"]
        assert len(entry["results"]["acceptance_by_position"]) == settings["gamma"], where
    head = schedule[-1]
    assert tuned == (head["config"] if head["config"] != "vanilla" else head["measured"])
    assert results == head["results"]
    assert data["recommended"] == (head["config"] != "vanilla")
    assert workload["batch_size"] == head["batch_size"]
    assert len(results["acceptance_by_position"]) == tuned["gamma"]
    assert results["speedup_interval"][0] > 1 or not data["recommended"]

    for where, figures in figure_sets:
        accepted = 1 + sum(figures["acceptance_by_position"])
        assert math.isclose(figures["mean_accepted_length"], accepted, rel_tol=ROUNDING), where
        for ratio, below in (("speedup", "vanilla_tokens_per_second"),
                             ("speedup_over_streaming", "streaming_tokens_per_second")):
            if figures[ratio] is not None:
                quotient = figures["tokens_per_second"] / figures[below]
                assert math.isclose(figures[ratio], quotient, rel_tol=ROUNDING), f"{where}.{ratio}"

    # Exports serve the headline's settings at its batch size and the tuned length, for
    # the profile's target.
    assert data["exports"] == build_exports(
        data["model"]["id"], Tuned(**tuned), head["batch_size"],
        workload["ctx"] + workload["max_new_tokens"], data["target"]).model_dump()
    # The within-noise rule the doc describes holds in the example: every raced
    # configuration still overlapping the pick has the lower mean.
    for step in data["steps"]:
        chosen = step["chosen"]
        for other in step["within_noise"]:
            assert other["speedup_low"] <= chosen["speedup_high"]
            assert chosen["speedup_low"] <= other["speedup_high"]
            assert other["speedup"] <= chosen["speedup"]


def test_example_budgets_are_slots_within_its_target():
    """Every configuration in the example is one its target runs, and writes its budget
    of B slots as ``min_tokens: B`` beside B / the longest prefix (``budget_ratio``)."""
    data = example()
    workload = data["workload"]
    prefix = longest_prefix(workload["ctx"], workload["max_new_tokens"])
    configs = [("tuned", data["tuned"])]
    for index, entry in enumerate(data["schedule"]):
        for name in ("config", "measured"):
            if isinstance(entry.get(name), dict):
                configs.append((f"schedule[{index}].{name}", entry[name]))
    for where, config in configs:
        assert fits_target(Tuned(**config).spec(), data["target"]) is None, where
        assert config["sparsity_ratio"] == budget_ratio(config["min_tokens"], prefix), where
    points = []
    for index, step in enumerate(data["steps"]):
        points.append((f"steps[{index}].chosen", step["chosen"]))
        points += [(f"steps[{index}].within_noise", item) for item in step["within_noise"]]
        points += [(f"steps[{index}].predictions", item) for item in step["predictions"]]
    for where, point in points:
        assert point["sparsity_ratio"] == budget_ratio(point["budget"], prefix), where
    # Each size's race picked the configuration its schedule entry describes, with the
    # entry's figures.
    for entry in data["schedule"]:
        races = [s for s in data["steps"]
                 if s["name"] == RACE and s["batch_size"] == entry["batch_size"]]
        assert len(races) == 1, entry["batch_size"]
        chosen = races[0]["chosen"]
        config = entry["config"] if entry["config"] != "vanilla" else entry["measured"]
        assert (chosen["drafter"], chosen["gamma"], chosen["budget"]) == (
            config["drafter"], config["gamma"], config["min_tokens"])
        assert chosen["speedup"] == entry["results"]["speedup"]
        assert [chosen["speedup_low"], chosen["speedup_high"]] == \
            entry["results"]["speedup_interval"]


def test_example_steps_run_per_batch_size_in_order():
    """Every step has a batch size; the list is sorted smallest size first, each size's
    steps in the tuner's order, and ends in a race."""
    steps = example()["steps"]
    assert all(step["batch_size"] is not None for step in steps)
    keys = [(step["batch_size"], STEPS.index(step["name"])) for step in steps]
    assert keys == sorted(keys)
    for step in steps:
        assert step["study"].endswith(f":{step['name']}@{step['batch_size']}")
        if step["name"] != RACE:
            assert not step["predictions"] and not step["within_noise"] and not step["edges"]


# --- the field tables -----------------------------------------------------------------

def field_tables() -> dict[str, list[tuple[str, str]]]:
    """Heading (backticks dropped) -> the (field name, meaning) rows of the field table
    under it."""
    tables: dict[str, list[tuple[str, str]]] = {}
    heading = None
    lines = doc_text().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("#"):
            heading = line.lstrip("#").strip().strip("`")
        elif line.strip() == FIELD_TABLE_HEADER:
            assert heading not in tables, f"two field tables under {heading!r}"
            rows = []
            for row in lines[index + 2:]:
                if not row.startswith("|"):
                    break
                cells = row.split("|")
                rows.append((cells[1].strip().strip("`"), "|".join(cells[3:])))
            tables[heading] = rows
    return tables


def test_every_model_has_a_field_table_naming_exactly_its_fields():
    """One field table per model, under the heading of the first path that holds it
    (``Top level`` for Profile). A model held at several paths (``Tuned`` at ``tuned``,
    ``schedule[].config``, ``schedule[].measured``) is tabled once: the row of each
    other path names the heading of its table."""
    models = models_by_path()
    documented: dict[type, str] = {}
    for path, model in models.items():  # schema order: a model's first path comes first
        documented.setdefault(model, TOP_LEVEL_HEADING if path == "" else path)
    tables = field_tables()
    assert set(tables) == set(documented.values()), "field tables and schema models differ"
    for model, heading in documented.items():
        names = [name for name, _ in tables[heading]]
        assert len(names) == len(set(names)), f"{heading}: a field is listed twice"
        assert names == list(model.model_fields), (
            f"{heading}: the table lists {names}, {model.__name__} has "
            f"{list(model.model_fields)} (same fields, in schema order)")
    for path, model in models.items():
        heading = documented[model]
        if path in ("", heading):
            continue
        parent, _, name = path.removesuffix(LIST_MARK).rpartition(".")
        parent_heading = documented[models[parent]]
        meaning = dict(tables[parent_heading])[name]
        assert f"`{heading}`" in meaning, (
            f"{parent_heading}: the row of {name!r} holds a {model.__name__} without "
            f"naming `{heading}`, where its fields are tabled")


@pytest.mark.parametrize("stale", [
    "vegas-tune run", "LlamaForCausalLM", "name: options", "name: budget",
    # steps and options of earlier tuners
    "name: sparsity", "name: gamma", "name: refine", "name: costs", "name: baselines",
    "step `sparsity`", "step `gamma`", "step `refine`", "`costs`", "`baselines`",
    "--sparsity-grid", "--gamma-max", "--gamma-candidates", "--refine-trials",
    "GammaPrediction", "cheapest",
])
def test_doc_names_nothing_the_tool_does_not_write(stale):
    assert stale not in doc_text()


def steps_table() -> list[tuple[str, str, str]]:
    """(step, what it measures, what ``chosen`` holds) rows of the steps table."""
    lines = doc_text().splitlines()
    start = lines.index("| step | what it measures | `chosen` holds |")
    rows = []
    for row in lines[start + 2:]:
        if not row.startswith("|"):
            break
        cells = [cell.strip() for cell in row.split("|")[1:-1]]
        rows.append((cells[0].strip("`"), cells[1], cells[2]))
    return rows


def test_steps_table_names_the_tuner_steps_and_their_chosen_keys():
    rows = steps_table()
    assert [name for name, _, _ in rows] == list(STEPS)
    # Each step's chosen keys, as the example writes them, are named in its row.
    data = example()
    for name, _, holds in rows:
        keys = {key for step in data["steps"] if step["name"] == name for key in step["chosen"]}
        assert keys, f"the example has no {name} step"
        for key in keys:
            assert f"`{key}`" in holds, f"{name}: chosen key {key!r} not in the steps table"


def test_doc_names_the_tune_options_that_exist():
    """Every tune option the doc names in backticks exists (``TuneOptions``), or is one of
    the workload's or the other commands'."""
    from vegas_tune.options import option_names

    flags = set(re.findall(r"`(--[a-z][a-z-]*)", doc_text()))
    known = {"--" + name.replace("_", "-") for name in option_names()}
    others = {"--batch-size", "--ctx", "--max-new-tokens", "--out", "--storage", "--resume",
              "--model", "--serve-batch", "--per-batch-size", "--context-ranges", "--force",
              "--target",
              "--format", "--tolerance",
              "--profile", "--prompt", "--drafter", "--config",
              "--speculative-config"}  # the last is vLLM's
    assert flags - known - others == set()
    assert {"--target", "--budgets", "--probe-gamma", "--candidates", "--max-rounds",
            "--precision", "--time-budget"} <= flags


def test_doc_states_this_schema_version():
    text = doc_text()
    assert f"writes **version {SCHEMA_VERSION}**" in text
    assert f"must be `{SCHEMA_VERSION}`" in text
    assert f"### Changes from version {SCHEMA_VERSION - 1}" in text


def test_doc_keeps_the_validate_section_for_its_owner():
    text = doc_text()
    assert "## What `validate` checks" in text


# --- docs/results: one page per question, and what README.md and profiles/README.md quote

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
INDEX = RESULTS / "README.md"
QUOTING = [ROOT / "README.md", ROOT / "profiles" / "README.md"]
RESULTS_LIMIT_BYTES = 1_000_000
# Figures as the READMEs write them: speedups and percentages (single or ranges),
# 95% intervals, and throughput pairs.
NUMBER = r"\d[\d,]*(?:\.\d+)?"
FIGURES = re.compile(rf"{NUMBER}(?: ?- ?{NUMBER})?(?:x\b|%)"
                     rf"|\[{NUMBER}, {NUMBER}\]"
                     rf"|{NUMBER} vs {NUMBER} tok/s")
# Percentages in those texts that are settings, not measurements.
NOT_FIGURES = {"95%",  # the confidence level of every interval
               "1%"}   # the race's default --precision
WORK_PERIODS = re.compile(r"\bstops? \d+|\bwork periods?\b", re.IGNORECASE)
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def prose(path: Path) -> str:
    """The text outside fenced code blocks (examples and commands), whitespace collapsed
    and dashes made hyphens, so that a figure wrapped over two lines still matches."""
    text = re.sub(r"```.*?```", " ", path.read_text(encoding="utf-8"), flags=re.DOTALL)
    return " ".join(text.replace("–", "-").split())


def result_pages() -> list[Path]:
    return sorted(p for p in RESULTS.glob("*.md") if p != INDEX)


def test_results_stay_under_a_megabyte_of_pages():
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) < RESULTS_LIMIT_BYTES
    assert all(p.suffix == ".md" for p in files), "raw rows belong in runs/, not docs/results"


def test_every_results_page_names_its_hardware_commit_and_command():
    for page in result_pages():
        text = page.read_text(encoding="utf-8")
        assert re.search(r"\b(H100|H200)\b", text), f"{page.name}: no hardware"
        assert COMMIT.search(text), f"{page.name}: no commit"
        assert "```bash" in text, f"{page.name}: no command"


def test_the_index_lists_each_page_once():
    listed = re.findall(r"^\| \[([^\]]+)\]\(\1\) \|", INDEX.read_text(encoding="utf-8"), re.M)
    assert sorted(listed) == [p.name for p in result_pages()]


@pytest.mark.parametrize("quoting", QUOTING, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_quoted_is_on_a_results_page(quoting):
    """README.md and profiles/README.md quote only figures that a results page gives
    (beside its command), written the same way."""
    pages = " ".join(prose(p) for p in result_pages())
    quoted = {m.group(0) for m in FIGURES.finditer(prose(quoting))} - NOT_FIGURES
    assert quoted, f"no figures found in {quoting}"
    missing = [f for f in quoted
               if not re.search(rf"(?<![\d.]){re.escape(f)}(?!\d)", pages)]
    assert sorted(missing) == []


def test_results_links_resolve():
    for page in [INDEX, *result_pages(), *QUOTING]:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "#")):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve()
            assert resolved.exists(), f"{page.name}: {target}"
            if anchor and resolved.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", resolved.read_text(encoding="utf-8"), re.M)
                slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                         for h in headings}
                assert anchor in slugs, f"{page.name}: {target}"


def test_docs_speak_of_commits_and_dates_not_work_periods():
    texts = [*ROOT.joinpath("docs").rglob("*.md"), *QUOTING]
    for path in texts:
        text = path.read_text(encoding="utf-8")
        assert not WORK_PERIODS.search(text), f"{path}: {WORK_PERIODS.search(text).group(0)}"
    for path in [*RESULTS.glob("*.md"), *QUOTING]:
        assert not re.search(r"\bsession\b", path.read_text(encoding="utf-8"), re.I), path
