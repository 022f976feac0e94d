"""The tuner's options have one home (vegas_tune.options.TuneOptions): the CLI's defaults,
its --help and docs/tuning.md's options table all say what it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vegas_tune import cli
from vegas_tune.options import TuneOptions, option_default_text, option_help, option_names

DOC = Path(__file__).resolve().parents[1] / "docs" / "tuning.md"


def doc_defaults() -> dict[str, str]:
    """flag -> default cell of docs/tuning.md's options table (rows naming one flag)."""
    table = DOC.read_text(encoding="utf-8").split("## Options", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and re.fullmatch(r"`--[a-z-]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1].replace("`", "")
    return rows


def test_the_cli_takes_its_option_defaults_from_tune_options():
    defaults = TuneOptions()
    for name in option_names():
        assert cli.TUNE_DEFAULTS[name][0] == getattr(defaults, name), name


@pytest.mark.parametrize("name", option_names())
def test_help_and_the_docs_table_state_each_default_and_help_text(name):
    flag = "--" + name.replace("_", "-")
    text = CliRunner().invoke(cli.app, ["tune", "--help"], terminal_width=400).output
    flat = " ".join(re.sub("[│╭╮╰╯─]", " ", text).split())  # rich's box, wrapped lines
    assert f"[default: {option_default_text(name)}]" in flat
    assert " ".join(option_help(name).split()[:6]) in flat
    assert doc_defaults()[flag] == option_default_text(name), flag


def test_every_tune_setting_has_a_docs_row_with_its_default():
    rows = doc_defaults()
    for name in cli.TUNE_DEFAULTS:
        flag = "--" + name.replace("_", "-")
        if flag in rows:
            assert rows[flag] == cli.default_text(name), flag
    documented = set(rows) | {"--device", "--dtype", "--log-level"}
    assert {"--" + n.replace("_", "-") for n in cli.TUNE_DEFAULTS} <= documented
