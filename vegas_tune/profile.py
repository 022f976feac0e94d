"""The tuned profile: a versioned YAML record of what was tuned, where, and how well it ran.

A profile is the tuner's deliverable. It names the settings it recommends (``tuned``),
the model, workload and hardware they were measured on, the measured results, a summary
of each tuning step, how the run was started (``provenance``) and ready-made exports for
deployment. ``docs/profile-format.md`` documents every field.

The schema is strict: every model rejects unknown keys, and ``schema_version`` must equal
``SCHEMA_VERSION``. An incompatible change to the format takes a new version number.
Types are strict too (``gamma: '1'`` or ``recommended: 'yes'`` are errors, not coerced;
an int may stand for a float), every float is finite, and the values must make sense:
tuned settings within the engine's limits, intervals that contain their means, a
recommendation backed by the speedup interval, exports derived from ``tuned``. The
validators below enforce this, so ``profile_from_dict`` (which the tuner calls before
writing) and ``load_profile`` apply the same rules.

YAML is read by ``read_yaml``, which refuses anchors and aliases (the tool never writes
them; they allow "billion laughs" documents) and texts over ``MAX_YAML_BYTES``.

Public API: the models below, ``read_yaml``, ``load_profile``, ``write_profile``,
``profile_to_dict``, ``profile_from_dict``, ``diff_profiles`` and ``ProfileDiff``.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      PlainValidator, ValidationError, field_validator, model_validator)

from vegas_core.errors import VegasError
from vegas_core.spec_config import (COLLECT, DRAFTERS, GRANULARITIES, MAX_GAMMA, MAX_WINDOW,
                                    SCORES)

SCHEMA_VERSION = 2


# Profiles are a few KiB; anything this large is not one, and is refused before parsing.
MAX_YAML_BYTES = 4 * 2**20

# Relative slack when checking low <= value <= high: floating-point sums, and a mean and
# its interval ends rounded to different digits, can leave a mean a last digit outside.
INTERVAL_SLACK = 1e-6

# YAML lines are not wrapped: long values (the command line, notes) stay on one line.
_YAML_LINE_WIDTH = 1_000_000


class _FieldProblem(ValueError):
    """A validator's finding about a field below the one being validated; ``loc`` is its
    path relative to the model that raised it, so the error names the exact field."""

    def __init__(self, loc: tuple, problem: str) -> None:
        super().__init__(problem)
        self.loc = loc
        self.problem = problem


class _Strict(BaseModel):
    """Base of every profile model: unknown keys are errors, not silently dropped; types
    are not coerced (``'1'`` is not an int, ``'yes'`` not a bool; an int may stand for a
    float); NaN and infinities are refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _one_of(allowed: tuple[str, ...]):
    """A validator accepting only the engine's names in ``allowed``."""
    def check(value: str) -> str:
        if value not in allowed:
            raise ValueError(f"unknown value {value!r}; choose one of: {', '.join(allowed)}")
        return value
    return AfterValidator(check)


def _scalar(value: Any) -> int | float | str:
    # A plain validator, not a union of types, so errors name the key, not a union member.
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"expected a number or a string, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {value}")
    return value


# A value in a step's ``chosen`` or ``within_noise`` mapping.
Scalar = Annotated[int | float | str, PlainValidator(_scalar)]


def _list_from_tuple(value: Any) -> Any:
    # The tuner may hand over (low, high) tuples; YAML only ever gives lists.
    return list(value) if isinstance(value, tuple) else value


def _two_numbers(value: list[float]) -> list[float]:
    if len(value) != 2:
        raise ValueError(f"expected exactly two numbers [low, high], got {len(value)}")
    return value


def _check_interval(name: str, value: float | None, interval: list[float] | None) -> None:
    """Raise ``_FieldProblem`` unless ``interval`` = [low, high] contains ``value``."""
    if interval is None:
        return
    if value is None:
        raise _FieldProblem((f"{name}_interval",), f"given without {name}")
    low, high = interval
    slack = INTERVAL_SLACK * max(abs(low), abs(high), abs(value))
    if not low - slack <= value <= high + slack:
        raise _FieldProblem((f"{name}_interval",),
                            f"[{low:g}, {high:g}] does not contain {name} {value:g}; "
                            "expected low <= value <= high")


def _check_intervals(model: BaseModel) -> None:
    """Check every ``<x>_interval`` field of ``model`` against its ``<x>``."""
    for name in type(model).model_fields:
        if name.endswith("_interval"):
            base = name.removesuffix("_interval")
            _check_interval(base, getattr(model, base), getattr(model, name))


def _check_finite(value: Any, loc: tuple = ()) -> None:
    """Raise ``_FieldProblem`` at the first NaN or infinity inside free-form data."""
    if isinstance(value, float) and not math.isfinite(value):
        raise _FieldProblem(loc, f"expected a finite number, got {value}")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, (*loc, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_finite(item, (*loc, index))


class Tuned(_Strict):
    """The recommended speculative settings: the engine's ``SpecConfig`` fields, with
    ``sparsity`` named ``sparsity_ratio``."""

    drafter: Annotated[str, _one_of(DRAFTERS)] = Field(
        description="drafter name; the tuner tunes 'vegas'")
    gamma: int = Field(ge=1, le=MAX_GAMMA, description="draft tokens per iteration")
    sparsity_ratio: float = Field(gt=0.0, le=1.0, description="draft budget share of the prefix")
    min_tokens: int = Field(ge=1, description="smallest draft budget, in tokens")
    collect: Annotated[str, _one_of(COLLECT)]
    score: Annotated[str, _one_of(SCORES)]
    granularity: Annotated[str, _one_of(GRANULARITIES)]
    window: float = Field(ge=0.0, le=MAX_WINDOW,
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

    ctx: int = Field(ge=1)
    batch_size: int = Field(ge=1)
    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0.0)
    dataset: str
    dataset_sha256: str
    num_prompts: int = Field(ge=1)


class Hardware(_Strict):
    """The machine and software stack the measurements ran on."""

    gpu_name: str | None
    gpu_count: int = Field(ge=0)
    gpu_memory_gb: float | None
    driver: str | None
    cuda: str | None
    torch: str
    triton: str | None
    cpu: str
    cpu_count: int


# A confidence interval: [low, high] around a mean.
Interval = Annotated[list[float], BeforeValidator(_list_from_tuple), AfterValidator(_two_numbers)]
# Throughputs and ratios of throughputs: a measurement of zero or less is not one.
Positive = Annotated[float, Field(gt=0.0)]
Share = Annotated[float, Field(ge=0.0, le=1.0)]


class Results(_Strict):
    """Measured throughput and acceptance of the tuned settings.

    Every throughput and speedup is the mean over ``rounds`` interleaved measurement
    rounds (tuned, vanilla and streaming measured one after another in each round), with
    its ``confidence`` interval beside it as ``<name>_interval: [low, high]``. Means are
    geometric (``vegas_tune.stats``); speedups are means of per-round ratios, so drift
    between rounds hits both sides of a ratio.
    """

    tokens_per_second: Positive
    tokens_per_second_interval: Interval
    vanilla_tokens_per_second: Positive
    vanilla_tokens_per_second_interval: Interval
    streaming_tokens_per_second: Positive
    streaming_tokens_per_second_interval: Interval
    speedup: Positive
    speedup_interval: Interval
    speedup_over_streaming: Positive
    speedup_over_streaming_interval: Interval
    # At least the one token the verify pass always yields; at most gamma + 1 (checked
    # by Profile, which knows gamma).
    mean_accepted_length: float = Field(ge=1.0)
    acceptance_by_position: list[Share]
    selection_overhead: Share
    rounds: int = Field(ge=1, description="interleaved measurement rounds behind each figure")
    confidence: float = Field(gt=0.0, lt=1.0,
                              description="confidence level of the intervals, e.g. 0.95")

    @model_validator(mode="after")
    def _intervals_contain_means(self) -> Results:
        _check_intervals(self)
        return self


class GammaPrediction(_Strict):
    """One gamma's predicted throughput, and the measured one where it was run."""

    gamma: int = Field(ge=1, le=MAX_GAMMA)
    predicted_tokens_per_second: float
    measured_tokens_per_second: Positive | None
    measured_speedup: Positive | None = None
    measured_speedup_interval: Interval | None = None

    @model_validator(mode="after")
    def _interval_contains_mean(self) -> GammaPrediction:
        _check_intervals(self)
        return self


class StepSummary(_Strict):
    """What one tuning step searched and what it chose."""

    name: str
    study: str
    trials: int = Field(ge=0)
    chosen: dict[str, Scalar]
    notes: str = ""
    predictions: list[GammaPrediction] = Field(default_factory=list)
    # Measured configurations whose speedup interval overlaps the best mean's: the step
    # could not tell them apart, and chose the cheapest (see docs/tuning.md).
    within_noise: list[dict[str, Scalar]] = Field(default_factory=list)


class Provenance(_Strict):
    """How the profile was produced; ignored when comparing profiles."""

    tool_version: str
    git_revision: str | None
    command: str
    started: str
    duration_seconds: float = Field(ge=0.0)
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

    @field_validator("serve_config")
    @classmethod
    def _serve_config_is_finite(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_finite(value)
        return value


class Exports(_Strict):
    """Ready-to-use settings derived from ``tuned``, one entry per consumer."""

    vllm: VllmExport
    vegas: dict[str, Any]

    @field_validator("vegas")
    @classmethod
    def _vegas_is_finite(cls, value: dict[str, Any]) -> dict[str, Any]:
        _check_finite(value)
        return value


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

    @model_validator(mode="after")
    def _sections_agree(self) -> Profile:
        """The checks that span sections: results against gamma, the recommendation
        against the speedup interval, the exports against ``tuned``."""
        gamma, results = self.tuned.gamma, self.results
        if len(results.acceptance_by_position) != gamma:
            raise _FieldProblem(
                ("results", "acceptance_by_position"),
                f"has {len(results.acceptance_by_position)} entries; expected one per draft "
                f"position, tuned.gamma = {gamma}")
        if results.mean_accepted_length > gamma + 1:
            raise _FieldProblem(
                ("results", "mean_accepted_length"),
                f"{results.mean_accepted_length:g} exceeds tuned.gamma + 1 = {gamma + 1}, "
                "the most one iteration can accept")
        low, high = results.speedup_interval
        if self.recommended and not low > 1.0:
            raise _FieldProblem(
                ("recommended",),
                f"true, but the speedup interval [{low:g}, {high:g}] does not lie wholly "
                "above 1; the tuner recommends only when it does (set recommended: false)")
        _check_exports(self.exports, self.tuned)
        return self


def _mismatch(found: dict[str, Any], expected: dict[str, Any]) -> tuple[str, str] | None:
    """The first key where ``found`` differs from ``expected``, and how; None if equal."""
    for key, want in expected.items():
        if key not in found:
            return key, f"missing; tuned gives {want!r}"
        have = found[key]
        # 1 == True in Python; a bool where a number belongs is still a mismatch.
        if have != want or isinstance(have, bool) != isinstance(want, bool):
            return key, f"{have!r} contradicts tuned, which gives {want!r}"
    for key in found:
        if key not in expected:
            return key, "not derived from tuned; remove it"
    return None


_REGENERATE = "; exports must be derived from tuned (re-run the tuner, or fix the value)"


def _check_exports(exports: Exports, tuned: Tuned) -> None:
    """Raise ``_FieldProblem`` unless every export says what ``tuned`` says."""
    # export.py imports this module at its top; importing it here, at validation time,
    # avoids the cycle and keeps one definition of each export.
    from vegas_tune.export import VLLM_SPECULATIVE_KEY, engine_settings, vllm_speculative_config

    problem = _mismatch(exports.vegas, engine_settings(tuned))
    if problem:
        raise _FieldProblem(("exports", "vegas", problem[0]), problem[1] + _REGENERATE)
    speculative = vllm_speculative_config(tuned)
    serve_loc = ("exports", "vllm", "serve_config", VLLM_SPECULATIVE_KEY)
    in_serve = exports.vllm.serve_config.get(VLLM_SPECULATIVE_KEY)
    if not isinstance(in_serve, dict):
        raise _FieldProblem(serve_loc, f"expected the speculative config mapping, got "
                                       f"{type(in_serve).__name__}{_REGENERATE}")
    problem = _mismatch(in_serve, speculative)
    if problem:
        raise _FieldProblem((*serve_loc, problem[0]), problem[1] + _REGENERATE)
    json_loc = ("exports", "vllm", "speculative_config_json")
    try:
        in_json = json.loads(exports.vllm.speculative_config_json)
    except json.JSONDecodeError as error:
        raise _FieldProblem(json_loc, f"not valid JSON: {error}") from None
    if not isinstance(in_json, dict):
        raise _FieldProblem(json_loc, f"expected a JSON object, got {type(in_json).__name__}")
    problem = _mismatch(in_json, speculative)
    if problem:
        raise _FieldProblem(json_loc, f"key {problem[0]!r}: {problem[1]}{_REGENERATE}")


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
    loc, message = tuple(first["loc"]), first["msg"]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, _FieldProblem):
        # A model validator found it in a field below the model: name that field.
        loc, message = loc + cause.loc, cause.problem
    # Our own validators' messages arrive as "Value error, ..."; the prefix adds nothing.
    message = message.removeprefix("Value error, ")
    return f"{_field_path(loc)}: {message}"


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


class _RefusedYaml(Exception):
    """A YAML construct ``read_yaml`` does not accept."""


class _AliasFreeLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors and aliases. An alias repeats a node without
    copying it, so a few lines of nested aliases ("billion laughs") expand to more data
    than memory holds once anything walks them; profiles and config files never need them."""

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise _RefusedYaml("YAML aliases (*name) are not allowed; write the values out")
        if getattr(event, "anchor", None) is not None:
            raise _RefusedYaml("YAML anchors (&name) are not allowed; write the values out")
        return super().compose_node(parent, index)


def read_yaml(text: str, source: str) -> Any:
    """Parse one YAML document safely: the data, or ``VegasError`` with one line naming
    ``source`` (a file name, for messages).

    Refused: texts over ``MAX_YAML_BYTES``, anchors and aliases (and so merge keys),
    nesting deeper than Python can walk, and anything that is not YAML.
    """
    # Characters never outnumber UTF-8 bytes, so this cheap test errs only on the safe side.
    if len(text) > MAX_YAML_BYTES:
        raise VegasError(_too_large(source))
    try:
        # Safe: the loader is a SafeLoader, which builds only plain data.
        return yaml.load(text, Loader=_AliasFreeLoader)
    except _RefusedYaml as error:
        raise VegasError(f"{source}: {error}") from None
    except yaml.YAMLError as error:
        raise VegasError(f"{source}: not valid YAML: {_yaml_problem(error)}") from None
    except RecursionError:
        raise VegasError(f"{source}: not valid YAML: nested too deeply") from None
    except ValueError as error:
        # e.g. an integer with more digits than Python converts.
        raise VegasError(f"{source}: not valid YAML: {error}") from None


def _too_large(source: str) -> str:
    return (f"{source}: too large to be a profile or config file "
            f"(over {MAX_YAML_BYTES // 2**20} MiB)")


def load_profile(path: str | os.PathLike) -> Profile:
    """Read and validate a profile YAML file.

    Any problem (missing, unreadable or oversized file, not YAML, YAML anchors or aliases,
    a schema violation, an unknown key, a value that makes no sense, another schema
    version) raises ``VegasError`` with one line naming the file and the
    first problem, e.g. ``profiles/x.yaml: invalid profile: tuned.gamma: Input should be
    greater than or equal to 1``.
    """
    path = Path(path)
    try:
        # Read one byte past the bound, not the whole file: a huge file (or /dev/zero) is
        # refused without loading it into memory.
        with path.open("rb") as stream:
            raw = stream.read(MAX_YAML_BYTES + 1)
        if len(raw) > MAX_YAML_BYTES:
            raise VegasError(_too_large(str(path)))
        text = raw.decode("utf-8")
    except FileNotFoundError:
        raise VegasError(f"{path}: no such profile file") from None
    except UnicodeDecodeError:
        raise VegasError(f"{path}: not a profile: the file is not UTF-8 text") from None
    except OSError as error:
        raise VegasError(f"{path}: cannot read the profile: {error.strerror or error}") from None
    return profile_from_dict(read_yaml(text, str(path)), source=str(path))


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
