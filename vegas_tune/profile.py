"""The tuned profile: a versioned YAML record of what was tuned, where, and how well it ran.

A profile is the tuner's deliverable. It names the settings it recommends (``tuned``),
the model, workload and hardware they were measured on, the measured results, a summary
of each tuning step, how the run was started (``provenance``) and ready-made exports for
deployment. ``docs/profile-format.md`` documents every field.

The schema is strict: every model rejects unknown keys, and ``schema_version`` must equal
``SCHEMA_VERSION``. An incompatible change to the format takes a new version number.

Public API: the models below, ``load_profile``, ``write_profile``, ``profile_to_dict``,
``profile_from_dict``, ``diff_profiles`` and ``ProfileDiff``.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from vegas_core.errors import VegasError

SCHEMA_VERSION = 2

# Upper bound of ``Tuned.window`` (as ``vegas_core.spec_config.MAX_WINDOW``): at least a
# quarter of a vegas budget stays verification-guided.
MAX_WINDOW_SHARE = 0.75

# YAML lines are not wrapped: long values (the command line, notes) stay on one line.
_YAML_LINE_WIDTH = 1_000_000


class _Strict(BaseModel):
    """Base of every profile model: unknown keys are errors, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


class Tuned(_Strict):
    """The recommended speculative settings: the engine's ``SpecConfig`` fields, with
    ``sparsity`` named ``sparsity_ratio``."""

    drafter: str = Field(description="drafter name; the tuner tunes 'vegas'")
    gamma: int = Field(ge=1, description="draft tokens per iteration")
    sparsity_ratio: float = Field(gt=0.0, le=1.0, description="draft budget share of the prefix")
    min_tokens: int = Field(ge=1, description="smallest draft budget, in tokens")
    collect: Literal["two", "all", "last"]
    score: Literal["logit", "weight"]
    granularity: Literal["layer", "kv_head"]
    window: float = Field(ge=0.0, le=MAX_WINDOW_SHARE,
                          description="budget share reserved for sink and recent tokens")


class ModelInfo(_Strict):
    """The target model the profile was tuned for."""

    id: str
    path: str | None
    architecture: str
    dtype: str
    weights_sha256: str | None
    dummy: bool = False


class Workload(_Strict):
    """The prompts and decoding settings the measurements used."""

    ctx: int
    batch_size: int
    max_new_tokens: int
    temperature: float
    dataset: str
    dataset_sha256: str
    num_prompts: int


class Hardware(_Strict):
    """The machine and software stack the measurements ran on."""

    gpu_name: str | None
    gpu_count: int
    gpu_memory_gb: float | None
    driver: str | None
    cuda: str | None
    torch: str
    triton: str | None
    cpu: str
    cpu_count: int


# A confidence interval: [low, high] around a mean.
Interval = list[float]


class Results(_Strict):
    """Measured throughput and acceptance of the tuned settings.

    Every throughput and speedup is the mean over ``rounds`` interleaved measurement
    rounds (tuned, vanilla and streaming measured one after another in each round), with
    its ``confidence`` interval beside it as ``<name>_interval: [low, high]``. Speedups
    are means of per-round ratios, so drift between rounds hits both sides of a ratio.
    """

    tokens_per_second: float
    tokens_per_second_interval: Interval
    vanilla_tokens_per_second: float
    vanilla_tokens_per_second_interval: Interval
    streaming_tokens_per_second: float
    streaming_tokens_per_second_interval: Interval
    speedup: float
    speedup_interval: Interval
    speedup_over_streaming: float
    speedup_over_streaming_interval: Interval
    mean_accepted_length: float
    acceptance_by_position: list[float]
    selection_overhead: float
    rounds: int = Field(description="interleaved measurement rounds behind each figure")
    confidence: float = Field(description="confidence level of the intervals, e.g. 0.95")


class GammaPrediction(_Strict):
    """One gamma's predicted throughput, and the measured one where it was run."""

    gamma: int
    predicted_tokens_per_second: float
    measured_tokens_per_second: float | None
    measured_speedup: float | None = None
    measured_speedup_interval: Interval | None = None


class StepSummary(_Strict):
    """What one tuning step searched and what it chose."""

    name: str
    study: str
    trials: int
    chosen: dict[str, float | int | str]
    notes: str = ""
    predictions: list[GammaPrediction] = Field(default_factory=list)
    # Measured configurations whose speedup interval overlaps the chosen one's: the step
    # could not tell them apart, and chose the cheapest (see docs/tuning.md).
    within_noise: list[dict[str, float | int | str]] = Field(default_factory=list)


class Provenance(_Strict):
    """How the profile was produced; ignored when comparing profiles."""

    tool_version: str
    git_revision: str | None
    command: str
    started: str
    duration_seconds: float
    engine_path: str

    @field_validator("started")
    @classmethod
    def _started_is_iso8601(cls, value: str) -> str:
        try:
            datetime.fromisoformat(value)
        except ValueError:
            raise ValueError(f"expected an ISO 8601 timestamp, got {value!r}") from None
        return value


class VllmExport(_Strict):
    """Settings for serving the tuned configuration with vLLM (see ``vegas_tune.export``)."""

    target: str
    note: str
    serve_config: dict[str, Any]
    speculative_config_json: str


class Exports(_Strict):
    """Ready-to-use settings derived from ``tuned``, one entry per consumer."""

    vllm: VllmExport
    vegas: dict[str, Any]


class Profile(_Strict):
    """A complete tuned profile: the root of the YAML document."""

    schema_version: int
    recommended: bool
    tuned: Tuned
    model: ModelInfo
    workload: Workload
    hardware: Hardware
    results: Results
    steps: list[StepSummary]
    provenance: Provenance
    exports: Exports

    @field_validator("schema_version")
    @classmethod
    def _supported_version(cls, value: int) -> int:
        if value != SCHEMA_VERSION:
            raise ValueError(_version_message(value))
        return value


def _version_message(found: Any) -> str:
    return (f"unsupported schema_version {found!r}; this vegas-tune reads version "
            f"{SCHEMA_VERSION} (re-run the tuner, or use the vegas-tune that wrote it)")


# --- reading and writing -------------------------------------------------------------

def _field_path(loc: tuple) -> str:
    """``('steps', 0, 'name')`` -> ``steps[0].name``."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path or "<root>"


def _first_problem(error: ValidationError) -> str:
    first = error.errors()[0]
    message = first["msg"]
    # Our own validators' messages arrive as "Value error, ..."; the prefix adds nothing.
    message = message.removeprefix("Value error, ")
    return f"{_field_path(first['loc'])}: {message}"


def profile_from_dict(data: Any, source: str = "<dict>") -> Profile:
    """Validate a mapping (as parsed from YAML) into a ``Profile``.

    Raises ``VegasError`` with one line, ``<source>: invalid profile: <field path>:
    <problem>``, naming the first problem found.
    """
    if not isinstance(data, dict):
        kind = "nothing" if data is None else type(data).__name__
        raise VegasError(f"{source}: invalid profile: expected a mapping at the top level, "
                         f"got {kind}")
    # A profile from another schema version would fail on many fields; say why once.
    version = data.get("schema_version", SCHEMA_VERSION)
    if version != SCHEMA_VERSION:
        raise VegasError(f"{source}: invalid profile: schema_version: {_version_message(version)}")
    try:
        return Profile.model_validate(data)
    except ValidationError as error:
        raise VegasError(f"{source}: invalid profile: {_first_problem(error)}") from None


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The profile as plain Python data (dicts, lists, scalars), keys in schema order."""
    return profile.model_dump(mode="python")


def _yaml_problem(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    if mark is None:
        return problem
    # PyYAML's marks count from zero; editors count from one.
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def load_profile(path: str | os.PathLike) -> Profile:
    """Read and validate a profile YAML file.

    Any problem (missing or unreadable file, not YAML, a schema violation, an unknown key,
    another schema version) raises ``VegasError`` with one line naming the file and the
    first problem, e.g. ``profiles/x.yaml: invalid profile: tuned.gamma: Input should be
    greater than or equal to 1``.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise VegasError(f"{path}: no such profile file") from None
    except UnicodeDecodeError:
        raise VegasError(f"{path}: not a profile: the file is not UTF-8 text") from None
    except OSError as error:
        raise VegasError(f"{path}: cannot read the profile: {error.strerror or error}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise VegasError(f"{path}: not valid YAML: {_yaml_problem(error)}") from None
    return profile_from_dict(data, source=str(path))


class _ProfileDumper(yaml.SafeDumper):
    """Safe YAML dumper that writes multi-line strings as ``|`` blocks, so the embedded
    JSON in ``exports.vllm.speculative_config_json`` reads as it will be pasted."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ProfileDumper.add_representer(str, _represent_str)


def write_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write ``profile`` as YAML to ``path``, atomically.

    The YAML goes to a temporary file in the same folder, which is flushed, fsynced and
    then renamed over ``path``: readers see the old file or the new one, never a partial
    one, and a failure part-way leaves the old file as it was. Parent folders are created.
    Keys keep the schema's order. An ``OSError`` becomes a one-line ``VegasError``.
    """
    path = Path(path)
    data = profile_to_dict(profile)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A unique hidden name beside the target: same file system, so os.replace is atomic.
        temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        # os.open with 0o666 lets the umask decide the final permissions, as a plain open does.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as error:
        raise VegasError(f"{path}: cannot write the profile: {error.strerror or error}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            yaml.dump(data, stream, Dumper=_ProfileDumper, sort_keys=False,
                      default_flow_style=False, allow_unicode=True, width=_YAML_LINE_WIDTH)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, path)
    except BaseException as error:
        temp.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise VegasError(
                f"{path}: cannot write the profile: {error.strerror or error}") from None
        raise
    _fsync_folder(path.parent)


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable; not every platform can open a folder, so best effort."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# --- comparing -----------------------------------------------------------------------

# Results that must not fall by more than the tolerance: field -> what it is, for reports.
_GUARDED_RESULTS = {
    "tokens_per_second": "throughput",
    "speedup": "speedup over vanilla",
    "mean_accepted_length": "mean accepted length",
}
_IGNORED_SECTIONS = ("provenance",)


@dataclass
class ProfileDiff:
    """What changed between two profiles, and which changes are regressions.

    changes: ``(dotted path, old, new)`` for every differing leaf outside ``provenance``;
        ``None`` stands for a side that lacks the leaf. Lists of scalars are one leaf;
        lists of mappings (``steps``) are compared item by item, ``steps[0].trials``.
    regressions: one readable line per regression.
    """

    changes: list[tuple[str, Any, Any]] = field(default_factory=list)
    regressions: list[str] = field(default_factory=list)

    @property
    def regressed(self) -> bool:
        """True when the new profile is worse than the old one beyond the tolerance."""
        return bool(self.regressions)

    def format(self) -> str:
        """The diff as readable lines: each change, then each regression."""
        if not self.changes and not self.regressions:
            return "no changes"
        lines = [f"{path}: {old!r} -> {new!r}" for path, old, new in self.changes]
        lines += [f"REGRESSION: {line}" for line in self.regressions]
        return "\n".join(lines)


def _leaves(value: Any, prefix: str) -> dict[str, Any]:
    """Flatten nested data to ``{dotted path: leaf}``."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_leaves(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        out = {}
        for index, item in enumerate(value):
            out.update(_leaves(item, f"{prefix}[{index}]"))
        return out
    return {prefix: value}


def diff_profiles(old: Profile, new: Profile, tolerance: float) -> ProfileDiff:
    """Compare two profiles; ``tolerance`` is the allowed relative drop (0.05 = 5%).

    A regression is: ``results.tokens_per_second``, ``results.speedup`` or
    ``results.mean_accepted_length`` below old × (1 − tolerance), or a profile that was
    recommended and no longer is.
    """
    if not 0.0 <= tolerance < 1.0:
        raise VegasError(f"tolerance must be in [0, 1), got {tolerance}")
    old_data = {k: v for k, v in profile_to_dict(old).items() if k not in _IGNORED_SECTIONS}
    new_data = {k: v for k, v in profile_to_dict(new).items() if k not in _IGNORED_SECTIONS}
    old_leaves, new_leaves = _leaves(old_data, ""), _leaves(new_data, "")
    # Old profile's order first, then leaves only the new one has.
    paths = list(old_leaves) + [p for p in new_leaves if p not in old_leaves]
    diff = ProfileDiff()
    for path in paths:
        before, after = old_leaves.get(path), new_leaves.get(path)
        if before != after:
            diff.changes.append((path, before, after))

    for name, label in _GUARDED_RESULTS.items():
        before, after = getattr(old.results, name), getattr(new.results, name)
        if after < before * (1.0 - tolerance):
            drop = (before - after) / before if before else 0.0
            diff.regressions.append(
                f"results.{name} ({label}) fell {drop:.1%}: {before:g} -> {after:g}, "
                f"beyond the {tolerance:.1%} tolerance")
    if old.recommended and not new.recommended:
        diff.regressions.append("recommended: the old profile was recommended, the new one is not")
    return diff
