"""The CI recipe (docs/ci/tune-profiles.yml): it parses as a workflow, and every
vegas-tune command in it is one the CLI accepts, flags and values."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import typer
import yaml

from vegas_tune.cli import SUBCOMMANDS, app, resolve_settings
from vegas_tune.preflight import check_values

WORKFLOW = Path(__file__).resolve().parents[1] / "docs" / "ci" / "tune-profiles.yml"
# Values the runner fills in: a matrix entry, the runner's temp folder.
RUNNER = {"matrix.gpu": "h200", "RUNNER_TEMP": "/tmp/runner"}


def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def expand(text: str, env: dict[str, str]) -> str:
    text = re.sub(r"\$\{\{\s*(?:env\.)?([\w.]+)\s*\}\}", lambda m: {**env, **RUNNER}[m[1]], text)
    return re.sub(r"\$\{?(\w+)\}?", lambda m: {**env, **RUNNER}.get(m[1], m[0]), text)


def vegas_tune_commands() -> list[list[str]]:
    """Each ``vegas-tune`` command line of every step, expanded, as argv."""
    flow = workflow()
    env = {k: str(v) for k, v in flow.get("env", {}).items()}
    commands = []
    for job in flow["jobs"].values():
        for step in job["steps"]:
            script = step.get("run", "").replace("\\\n", " ")
            for line in script.splitlines():
                line = line.strip().split("||")[0]
                if line.startswith("vegas-tune"):
                    commands.append(shlex.split(expand(line, env))[1:])
    return commands


def test_the_workflow_parses_and_tunes_gates_and_keeps_the_profile():
    flow = workflow()
    assert flow["name"] and flow[True if True in flow else "on"]  # YAML 1.1 reads "on" as True
    steps = flow["jobs"]["tune"]["steps"]
    runs = " ".join(step.get("run", "") for step in steps)
    assert "--devices all" in runs and "vegas-tune diff" in runs and "--tolerance" in runs
    assert any(step.get("uses", "").startswith("actions/upload-artifact") for step in steps)


def test_every_vegas_tune_command_in_the_workflow_is_accepted():
    group = typer.main.get_command(app)
    commands = vegas_tune_commands()
    assert len(commands) >= 5
    for argv in commands:
        if not argv or argv[0] not in SUBCOMMANDS:
            argv = ["tune", *argv]  # as vegas-tune's main does
        with group.make_context("vegas-tune", list(argv)) as ctx:
            name, command, rest = group.resolve_command(ctx, list(argv))
            try:
                sub = command.make_context(name, rest, parent=ctx)
            except click.UsageError as error:
                raise AssertionError(f"vegas-tune {shlex.join(argv)}: {error}") from None
        if name == "tune":
            params = dict(sub.params)
            flags = {k: v for k, v in params.items() if k not in ("config", "debug", "json_out")}
            flags["json"] = params["json_out"]
            settings = resolve_settings(flags, None)
            check_values(settings, settings.labels)
