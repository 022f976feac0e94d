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

import copy
import json
import math
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal, TextIO

import yaml
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field,
                      PlainValidator, ValidationError, field_validator, model_validator)

from vegas_core.errors import VegasError
from vegas_core.yamlio import MAX_YAML_BYTES, read_yaml, read_yaml_file  # noqa: F401 (public here too)
from vegas_core.spec_config import (COLLECT, DRAFTERS, GRANULARITIES, MAX_GAMMA, MAX_SPREAD,
                                    MAX_WINDOW, RULES, SCORES, SpecConfig)
from vegas_core.schedule import VANILLA, SpecSchedule, check_schedule_grid  # VANILLA: public here too
from vegas_tune.options import TARGETS
from vegas_tune.serving import (VLLM_SPECULATIVE_KEY, VLLM_TARGET, engine_settings,
                                speculative_json, vllm_note, vllm_serve_config,
                                vllm_speculative_config)
from vegas_tune.space import fits_target

SCHEMA_VERSION = 5
# Profiles of these older versions are read by upgrading them (``profile_from_dict``).
UPGRADABLE_VERSIONS = (2, 3, 4)

# Relative slack when checking low <= value <= high: floating-point sums, and a mean and
# its interval ends rounded to different digits, can leave a mean a last digit outside.
INTERVAL_SLACK = 1e-6

# How far a speedup may lie from tokens_per_second / vanilla_tokens_per_second. The tuner
# writes the geometric mean of per-round ratios, which equals the ratio of the rounds'
# geometric means; what separates them is rounding (throughputs to 3 decimals, speedups
# to 4, hand-written profiles to 2 digits: 2.12 for 61.4 / 28.9 = 2.1246, 0.2%).
SPEEDUP_AGREEMENT = 0.01
# A SHA-256 as the profile writes it: 64 lowercase hex digits.
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")

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


def _sha256(value: str | None) -> str | None:
    if value is not None and not SHA256_PATTERN.fullmatch(value):
        raise ValueError(f"'{value}' is not a SHA-256: expected 64 lowercase hex digits")
    return value


Sha256 = Annotated[str, AfterValidator(_sha256)]


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
    rule: Annotated[str, _one_of(RULES)] = Field(
        default="engine", description="this engine's selection rule, or the vLLM fork's")
    # Written only where set (``profile_to_dict``): a profile without it reads as before.
    spread: int = Field(default=0, ge=0, le=MAX_SPREAD,
                        description="vegas: each prefix slot ranks by the best score of "
                                    "itself and this many slots before it (0: the paper's "
                                    "rule)")

    def spec(self) -> SpecConfig:
        """The engine's configuration for these settings."""
        return SpecConfig(drafter=self.drafter, gamma=self.gamma, sparsity=self.sparsity_ratio,
                          min_tokens=self.min_tokens, collect=self.collect, score=self.score,
                          granularity=self.granularity, window=self.window, rule=self.rule,
                          spread=self.spread)


class ModelInfo(_Strict):
    """The target model the profile was tuned for."""

    id: str
    path: str | None
    architecture: str
    dtype: str
    weights_sha256: Sha256 | None
    dummy: bool = False


class Workload(_Strict):
    """The prompts and decoding settings the measurements used."""

    ctx: int = Field(ge=1)
    batch_size: int = Field(ge=1, description="the largest size tuned: the headline's")
    batch_sizes: list[Annotated[int, Field(ge=1)]] = Field(
        min_length=1, description="every batch size asked for, ascending")
    max_new_tokens: int = Field(ge=1)
    temperature: float = Field(ge=0.0)
    dataset: str
    dataset_sha256: Sha256
    num_prompts: int = Field(ge=1)
    # Long generations (vegas_tune.spans): trials timed spans of span_tokens at this many
    # depths of max_new_tokens, each after span_warmup_iterations; absent: every token.
    spans: int | None = Field(default=None, ge=1)
    span_tokens: int | None = Field(default=None, ge=1)
    span_warmup_iterations: int | None = Field(default=None, ge=0)
    # Tuned at several contexts (``--ctx 4k,16k,32k``): every one, ascending; ``ctx`` is
    # the largest (the headline's). Absent: tuned at ``ctx`` alone.
    contexts: list[Annotated[int, Field(ge=1)]] | None = None


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
    """Measured throughput and acceptance of one speculative configuration.

    Every throughput and speedup is the mean over ``rounds`` interleaved measurement
    rounds (the configuration, vanilla and streaming measured one after another in each
    round), with its ``confidence`` interval beside it as ``<name>_interval: [low, high]``.
    Means are geometric (``vegas_tune.stats``); speedups are means of per-round ratios, so
    drift between rounds hits both sides of a ratio.

    A run cut short (``cut_short`` in the profile) may lack figures: streaming is measured
    last, and a configuration measured once has no interval. Those are null; with two or
    more rounds every figure present has its interval.
    """

    tokens_per_second: Positive
    tokens_per_second_interval: Interval | None = None
    vanilla_tokens_per_second: Positive | None = None
    vanilla_tokens_per_second_interval: Interval | None = None
    streaming_tokens_per_second: Positive | None = None
    streaming_tokens_per_second_interval: Interval | None = None
    speedup: Positive | None = None
    speedup_interval: Interval | None = None
    speedup_over_streaming: Positive | None = None
    speedup_over_streaming_interval: Interval | None = None
    # At least the one token the verify pass always yields; at most gamma + 1 (checked
    # where gamma is known).
    mean_accepted_length: float = Field(ge=1.0)
    acceptance_by_position: list[Share]
    selection_overhead: Share
    rounds: int = Field(ge=1, description="interleaved measurement rounds behind each figure")
    confidence: float = Field(gt=0.0, lt=1.0,
                              description="confidence level of the intervals, e.g. 0.95")

    @model_validator(mode="after")
    def _intervals_contain_means(self) -> Results:
        _check_intervals(self)
        figures = (self.speedup, self.tokens_per_second, self.vanilla_tokens_per_second)
        if None not in figures:
            ratio = self.tokens_per_second / self.vanilla_tokens_per_second
            if abs(self.speedup - ratio) > SPEEDUP_AGREEMENT * ratio:
                raise _FieldProblem(("speedup",),
                                    f"{self.speedup:g} disagrees with tokens_per_second / "
                                    f"vanilla_tokens_per_second = {ratio:.4g}; the speedup "
                                    "is their ratio")
        if self.rounds >= 2:
            for name in type(self).model_fields:
                if (not name.endswith("_interval") and f"{name}_interval" in type(self).model_fields
                        and getattr(self, name) is not None
                        and getattr(self, f"{name}_interval") is None):
                    raise _FieldProblem((f"{name}_interval",),
                                        f"missing; {self.rounds} rounds give {name} an interval")
        return self

    def beats_vanilla(self) -> bool:
        """The recommendation rule: the speedup's whole interval lies above 1."""
        return self.speedup_interval is not None and self.speedup_interval[0] > 1.0


def _check_acceptance(results: Results, gamma: int, loc: tuple, gamma_name: str) -> None:
    """Raise ``_FieldProblem`` unless ``results``' acceptance fits ``gamma``."""
    if len(results.acceptance_by_position) != gamma:
        raise _FieldProblem(
            (*loc, "acceptance_by_position"),
            f"has {len(results.acceptance_by_position)} entries; expected one per draft "
            f"position, {gamma_name} = {gamma}")
    if results.mean_accepted_length > gamma + 1:
        raise _FieldProblem(
            (*loc, "mean_accepted_length"),
            f"{results.mean_accepted_length:g} exceeds {gamma_name} + 1 = {gamma + 1}, "
            "the most one iteration can accept")


class ScheduleEntry(_Strict):
    """What to run for live batch sizes ``batch_min`` to ``batch_max``, measured at
    ``batch_size``.

    ``config`` is the speculative configuration to run, or ``vanilla`` where none beat
    vanilla decoding (the speedup's interval does not lie wholly above 1). ``results``
    always describe a speculative configuration: ``config``'s, or, for a vanilla entry,
    ``measured``, the best one found at this size, which lost.
    """

    batch_min: int = Field(ge=1)
    batch_max: int = Field(ge=1)
    batch_size: int = Field(ge=1, description="the batch size the results were measured at")
    # A profile tuned at several contexts: this entry runs at contexts ctx_min to ctx_max
    # (tokens per live sequence), measured at ctx. Absent: at every context.
    ctx_min: int | None = Field(default=None, ge=1)
    ctx_max: int | None = Field(default=None, ge=1)
    ctx: int | None = Field(default=None, ge=1, description="the context the results were "
                                                             "measured at")
    config: Tuned | Literal["vanilla"]
    measured: Tuned | None = None
    results: Results
    reason: str = ""

    @property
    def speculative(self) -> Tuned:
        """The configuration ``results`` describe."""
        return self.measured if self.config == VANILLA else self.config

    @model_validator(mode="after")
    def _consistent(self) -> ScheduleEntry:
        if not self.batch_min <= self.batch_size <= self.batch_max:
            raise _FieldProblem(("batch_size",),
                                f"{self.batch_size} lies outside this entry's range "
                                f"[{self.batch_min}, {self.batch_max}]")
        contexts = (self.ctx_min, self.ctx_max, self.ctx)
        if None in contexts and contexts != (None, None, None):
            missing = ("ctx_min", "ctx_max", "ctx")[contexts.index(None)]
            raise _FieldProblem((missing,), "missing: an entry names its context range and "
                                            "measured context, or none of them")
        if self.ctx is not None and not self.ctx_min <= self.ctx <= self.ctx_max:
            raise _FieldProblem(("ctx",), f"{self.ctx} lies outside this entry's context range "
                                          f"[{self.ctx_min}, {self.ctx_max}]")
        if self.config == VANILLA and self.measured is None:
            raise _FieldProblem(("measured",), "missing: a vanilla entry names the speculative "
                                               "configuration its results describe")
        if self.config != VANILLA and self.measured is not None:
            raise _FieldProblem(("measured",), "only a vanilla entry has one; remove it")
        if self.config != VANILLA and not self.results.beats_vanilla():
            interval = self.results.speedup_interval
            raise _FieldProblem(("config",),
                                f"speculative, but the speedup interval {interval} does not lie "
                                "wholly above 1; the tuner runs vanilla there (config: vanilla)")
        gamma_name = "measured.gamma" if self.config == VANILLA else "config.gamma"
        _check_acceptance(self.results, self.speculative.gamma, ("results",), gamma_name)
        return self


class NotTuned(_Strict):
    """A requested batch size with no schedule entry, and why (e.g. out of memory)."""

    batch_size: int = Field(ge=1)
    ctx: int | None = Field(default=None, ge=1, description="where tuned at several contexts")
    reason: str


class Prediction(_Strict):
    """The cost model's throughput for one configuration, and the measured one where it
    was raced (``vegas_tune.costmodel``). Profiles before schema 4 name only gamma and
    sparsity (the configuration fields are null there)."""

    drafter: Annotated[str, _one_of(DRAFTERS)] | None = None
    score: Annotated[str, _one_of(SCORES)] | None = None
    window: float | None = Field(default=None, ge=0.0, le=MAX_WINDOW)
    spread: int | None = Field(default=None, ge=0, le=MAX_SPREAD)
    budget: int | None = Field(default=None, ge=1, description="draft budget, KV slots")
    gamma: int = Field(ge=1, le=MAX_GAMMA)
    sparsity_ratio: float | None = Field(default=None, gt=0.0, le=1.0)
    predicted_tokens_per_second: float
    # Tokens per iteration the prediction assumed, and what the race accepted: with the
    # throughputs they split a miss into acceptance and time.
    predicted_mean_accepted_length: float | None = Field(default=None, ge=1.0)
    measured_tokens_per_second: Positive | None
    measured_mean_accepted_length: float | None = Field(default=None, ge=1.0)
    measured_speedup: Positive | None = None
    measured_speedup_interval: Interval | None = None

    @model_validator(mode="after")
    def _interval_contains_mean(self) -> Prediction:
        _check_intervals(self)
        return self


class StepSummary(_Strict):
    """What one tuning step searched and what it chose."""

    name: str
    study: str
    # The batch size the step measured at; None for a step shared by every size.
    batch_size: int | None = Field(default=None, ge=1)
    # The context it measured at, in a profile tuned at several contexts; None otherwise.
    ctx: int | None = Field(default=None, ge=1)
    trials: int = Field(ge=0)
    chosen: dict[str, Scalar]
    notes: str = ""
    predictions: list[Prediction] = Field(default_factory=list)
    # Measured configurations whose speedup interval overlaps the pick's after the race's
    # rounds: the pick has the higher mean (see docs/tuning.md).
    within_noise: list[dict[str, Scalar]] = Field(default_factory=list)
    # Axes on whose searched edge the pick lies, with the predicted figure there.
    edges: list[str] = Field(default_factory=list)


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
    """A complete tuned profile: the root of the YAML document.

    ``schedule`` holds one entry per tuned batch size. The headline is its last entry,
    the largest size: ``tuned`` and ``results`` repeat that entry's speculative
    configuration and results, ``recommended`` says whether it runs speculatively, and
    ``exports`` serve it (``vegas-tune export --serve-batch`` picks another entry).
    """

    schema_version: int
    # Where the profile is served: the configurations it recommends are ones that target
    # runs as measured (``vegas_tune.space``).
    target: Annotated[str, _one_of(TARGETS)]
    recommended: bool
    tuned: Tuned
    model: ModelInfo
    workload: Workload
    hardware: Hardware
    results: Results
    schedule: list[ScheduleEntry] = Field(min_length=1)
    not_tuned: list[NotTuned] = Field(default_factory=list)
    # Steps a --time-budget or Ctrl-C stopped before they finished, in words.
    cut_short: list[str] = Field(default_factory=list)
    steps: list[StepSummary]
    provenance: Provenance
    exports: Exports

    @field_validator("schema_version")
    @classmethod
    def _supported_version(cls, value: int) -> int:
        if value != SCHEMA_VERSION:
            raise ValueError(_version_message(value))
        return value

    @property
    def headline(self) -> ScheduleEntry:
        """The schedule's entry for the largest tuned batch size."""
        return self.schedule[-1]

    @property
    def contexts(self) -> list[int]:
        """Every context tuned, ascending (one, unless tuned at several)."""
        return self.workload.contexts or [self.workload.ctx]

    def entries_at(self, ctx: int | None = None) -> list[ScheduleEntry]:
        """The entries of the band of contexts that holds ``ctx`` (None: the longest
        context's band; above the last band, the last); all of them where the profile
        was tuned at one context."""
        last = self.schedule[-1]
        band = [e for e in self.schedule if e.ctx_min is None
                or (ctx is not None and e.ctx_min <= ctx <= e.ctx_max)]
        return band or [e for e in self.schedule if e.ctx == last.ctx]

    def entry_for(self, batch_size: int, ctx: int | None = None) -> ScheduleEntry:
        """The schedule entry whose ranges hold ``batch_size`` and ``ctx`` (None: the
        longest context tuned); above a band's last range, its last entry (the largest
        size measured)."""
        band = self.entries_at(ctx)
        for entry in band:
            if entry.batch_min <= batch_size <= entry.batch_max:
                return entry
        return band[-1]

    @model_validator(mode="after")
    def _sections_agree(self) -> Profile:
        """The checks that span sections: the schedule's ranges, the headline against
        ``tuned``, ``results`` and ``recommended``, the exports against ``tuned``."""
        _check_schedule(self.schedule)
        head = self.headline
        if self.tuned != head.speculative:
            raise _FieldProblem(("tuned",), "differs from the last schedule entry's "
                                            "configuration; tuned repeats it")
        if self.results != head.results:
            raise _FieldProblem(("results",), "differs from the last schedule entry's "
                                              "results; results repeat them")
        if self.workload.batch_size != head.batch_size:
            raise _FieldProblem(("workload", "batch_size"),
                                f"{self.workload.batch_size}, but the last schedule entry was "
                                f"measured at {head.batch_size}")
        sizes = self.workload.batch_sizes
        if sizes != sorted(set(sizes)):
            raise _FieldProblem(("workload", "batch_sizes"), "must be ascending, without repeats")
        _check_contexts(self)
        for ctx in self.contexts:
            accounted = ({e.batch_size for e in self.schedule if e.ctx in (None, ctx)}
                         | {n.batch_size for n in self.not_tuned if n.ctx in (None, ctx)})
            if accounted != set(sizes):
                at = f" at ctx {ctx}" if self.workload.contexts else ""
                raise _FieldProblem(("workload", "batch_sizes"),
                                    f"{sizes}, but the schedule and not_tuned account for "
                                    f"{sorted(accounted)}{at}")
        if self.recommended != (head.config != VANILLA):
            raise _FieldProblem(
                ("recommended",),
                f"{str(self.recommended).lower()}, but the last schedule entry runs "
                f"{'vanilla' if head.config == VANILLA else 'speculatively'}; recommended "
                "says whether the largest tuned size runs speculatively")
        for index, entry in enumerate(self.schedule):
            for name in ("config", "measured"):
                config = getattr(entry, name)
                if isinstance(config, Tuned):
                    why = fits_target(config.spec(), self.target)
                    if why:
                        raise _FieldProblem(("schedule", index, name),
                                            f"{why} (the profile's target is {self.target})")
        _check_exports(self.exports, self.tuned, self.workload, head.batch_size, self.target)
        return self

    def spec_schedule(self) -> SpecSchedule:
        """The schedule as the engine runs it: pass it as ``vegas_core.generate(...,
        spec=...)`` to decode with the entry for the live batch size."""
        return SpecSchedule.from_profile_data(profile_to_dict(self), "profile")


def build_exports(model_id: str, tuned: Tuned, max_num_seqs: int, max_model_len: int,
                  target: str) -> Exports:
    """The ``exports`` section of a profile tuned for ``target``: ``tuned`` served as
    ``model_id`` at ``max_num_seqs`` sequences of up to ``max_model_len`` positions."""
    return Exports(
        vllm=VllmExport(
            target=VLLM_TARGET,
            note=vllm_note(tuned, target),
            serve_config=vllm_serve_config(model_id, tuned, max_num_seqs, max_model_len),
            speculative_config_json=speculative_json(tuned),
        ),
        vegas=engine_settings(tuned),
    )


def _check_schedule(schedule: list[ScheduleEntry]) -> None:
    """Raise ``_FieldProblem`` unless the entries' ranges start at 1 and are contiguous
    (batch sizes within each band of contexts, and the bands), and each band's last
    range ends at the size it was measured at (the sizes above it use it too,
    ``Profile.entry_for``)."""
    try:
        check_schedule_grid([(e.batch_min, e.batch_max, e.ctx_min or 1, e.ctx_max)
                             for e in schedule], "schedule")
    except VegasError as error:
        # "schedule[2].batch_min: 5; expected 1: ..." -> the field's path and the problem.
        where, problem = str(error).split(": ", 1)
        index = int(where[where.index("[") + 1:where.index("]")])
        raise _FieldProblem(("schedule", index, where.rsplit(".", 1)[1]), problem) from None
    for index, entry in enumerate(schedule):
        following = schedule[index + 1] if index + 1 < len(schedule) else None
        if following is None or following.ctx != entry.ctx:  # a band's last entry
            if entry.batch_max != entry.batch_size:
                raise _FieldProblem(("schedule", index, "batch_max"),
                                    f"{entry.batch_max}; expected {entry.batch_size}: the last "
                                    "range ends at the largest tuned size (larger batches use "
                                    "it too)")


def _check_contexts(profile: Profile) -> None:
    """A profile tuned at several contexts names them (``workload.contexts``, ascending,
    the last ``workload.ctx``), and its schedule's bands are theirs, in order, the last
    ending at the longest; one tuned at one context names none."""
    contexts, schedule = profile.workload.contexts, profile.schedule
    banded = schedule[0].ctx is not None
    if contexts is None:
        if banded:
            raise _FieldProblem(("workload", "contexts"), "missing: the schedule names context "
                                                          "ranges; list the contexts tuned")
        return
    if contexts != sorted(set(contexts)) or contexts[-1] != profile.workload.ctx:
        raise _FieldProblem(("workload", "contexts"),
                            f"{contexts}: expected ascending contexts without repeats, the last "
                            f"the headline's ctx {profile.workload.ctx}")
    if not banded:
        raise _FieldProblem(("schedule", 0, "ctx"), "missing: workload.contexts lists several "
                                                     "contexts; each entry names its own")
    bands = list(dict.fromkeys(e.ctx for e in schedule))
    if bands != contexts:
        raise _FieldProblem(("schedule",), f"its entries are measured at contexts {bands}, in "
                                           f"that order; workload.contexts lists {contexts}")
    last = schedule[-1]
    if last.ctx_max != last.ctx:
        raise _FieldProblem(("schedule", len(schedule) - 1, "ctx_max"),
                            f"{last.ctx_max}; expected {last.ctx}: the last band ends at the "
                            "longest context tuned (longer ones use it too)")
    for index, entry in enumerate(schedule):
        if entry.ctx is None:
            raise _FieldProblem(("schedule", index, "ctx"), "missing: every entry of a "
                                                             "profile tuned at several "
                                                             "contexts names its own")


def _mismatch(found: dict[str, Any], expected: dict[str, Any],
              source: str = "tuned") -> tuple[tuple, str] | None:
    """The path of the first key where ``found`` differs from ``expected``, and how; None
    if equal. Nested mappings are compared key by key."""
    for key, want in expected.items():
        if key not in found:
            return (key,), f"missing; {source} gives {want!r}"
        have = found[key]
        if isinstance(have, dict) and isinstance(want, dict):
            inner = _mismatch(have, want, source)
            if inner:
                return (key, *inner[0]), inner[1]
            continue
        # 1 == True in Python; a bool where a number belongs is still a mismatch.
        if have != want or isinstance(have, bool) != isinstance(want, bool):
            return (key,), f"{have!r} contradicts {source}, which gives {want!r}"
    for key in found:
        if key not in expected:
            return (key,), f"not derived from {source}; remove it"
    return None


_REGENERATE = "; exports must be derived from tuned (re-run the tuner, or fix the value)"


def _check_exports(exports: Exports, tuned: Tuned, workload: Workload, batch: int,
                   target: str) -> None:
    """Raise ``_FieldProblem`` unless every export says what ``tuned`` says, served at
    ``batch`` sequences of ``workload``'s context plus new tokens."""
    problem = _mismatch(exports.vegas, engine_settings(tuned))
    if problem:
        raise _FieldProblem(("exports", "vegas", *problem[0]), problem[1] + _REGENERATE)
    model_id = exports.vllm.serve_config.get("model")
    if not isinstance(model_id, str):
        raise _FieldProblem(("exports", "vllm", "serve_config", "model"),
                            "missing: the model vLLM serves")
    serve_loc = ("exports", "vllm", "serve_config")
    expected = vllm_serve_config(model_id, tuned, batch, workload.ctx + workload.max_new_tokens)
    # The served size and length come from the workload, the speculative config from tuned.
    wanted_speculative = expected.pop(VLLM_SPECULATIVE_KEY, None)
    found = dict(exports.vllm.serve_config)
    found_speculative = found.pop(VLLM_SPECULATIVE_KEY, None)
    problem = _mismatch(found, expected, "the headline's batch_size and ctx + max_new_tokens")
    if problem:
        raise _FieldProblem((*serve_loc, *problem[0]), problem[1] + _REGENERATE)
    if wanted_speculative is None and found_speculative is not None:
        raise _FieldProblem((*serve_loc, VLLM_SPECULATIVE_KEY),
                            f"not derived from tuned (sparsity_ratio {tuned.sparsity_ratio:g} "
                            f"has no speculative config: the fork needs a ratio below 1); "
                            f"remove it{_REGENERATE}")
    if wanted_speculative is not None:
        if not isinstance(found_speculative, dict):
            raise _FieldProblem((*serve_loc, VLLM_SPECULATIVE_KEY),
                                f"{found_speculative!r} contradicts tuned, which gives "
                                f"{wanted_speculative!r}{_REGENERATE}")
        problem = _mismatch(found_speculative, wanted_speculative)
        if problem:
            raise _FieldProblem((*serve_loc, VLLM_SPECULATIVE_KEY, *problem[0]),
                                problem[1] + _REGENERATE)
    json_loc = ("exports", "vllm", "speculative_config_json")
    try:
        in_json = json.loads(exports.vllm.speculative_config_json)
    except json.JSONDecodeError as error:
        raise _FieldProblem(json_loc, f"not valid JSON: {error}") from None
    speculative = vllm_speculative_config(tuned)
    if speculative is None or not isinstance(in_json, dict):
        if in_json != speculative:
            raise _FieldProblem(json_loc, f"expected {json.dumps(speculative)}{_REGENERATE}")
    else:
        problem = _mismatch(in_json, speculative)
        if problem:
            raise _FieldProblem(json_loc,
                                f"key {'.'.join(problem[0])!r}: {problem[1]}{_REGENERATE}")
    # Checked for every configuration, one without a speculative config too.
    note = vllm_note(tuned, target)
    if exports.vllm.note != note:
        raise _FieldProblem(("exports", "vllm", "note"), f"expected {note!r}{_REGENERATE}")


def _version_message(found: Any) -> str:
    older = ", ".join(map(str, UPGRADABLE_VERSIONS[:-1])) + f" and {UPGRADABLE_VERSIONS[-1]}"
    return (f"unsupported schema_version {found!r}; this vegas-tune reads version "
            f"{SCHEMA_VERSION} (and upgrades {older}); re-run the tuner, or use the "
            "vegas-tune that wrote it")


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
    if version == 2:
        data = _upgrade_from_2(data, source)
        version = 3
    if version == 3:
        data = _upgrade_from_3(data, source)
        version = 4
    if version == 4:
        data = _upgrade_from_4(data)
    elif version != SCHEMA_VERSION:
        raise VegasError(f"{source}: invalid profile: schema_version: {_version_message(version)}")
    try:
        return Profile.model_validate(data)
    except ValidationError as error:
        raise VegasError(f"{source}: invalid profile: {_first_problem(error)}") from None


def _upgrade_from_2(data: dict, source: str) -> dict:
    """A schema 2 profile (one batch size, no schedule) as schema 3: a one-entry schedule
    covering batch sizes 1 to the tuned one, and exports that set the served concurrency
    and length. Its figures are unchanged."""
    try:
        upgraded = json.loads(json.dumps(data))  # a deep copy of plain data
        workload, results = upgraded["workload"], upgraded["results"]
        batch = workload["batch_size"]
        workload["batch_sizes"] = [batch]
        speculative = bool(upgraded["recommended"])
        upgraded["schedule"] = [{
            "batch_min": 1, "batch_max": batch, "batch_size": batch,
            "config": dict(upgraded["tuned"]) if speculative else VANILLA,
            **({} if speculative else {"measured": dict(upgraded["tuned"])}),
            "results": dict(results),
            "reason": "tuned at one batch size (a schema 2 profile)"}]
        model_id = upgraded["exports"]["vllm"]["serve_config"]["model"]
        try:
            upgraded["exports"] = build_exports(
                model_id, Tuned.model_validate(upgraded["tuned"]), batch,
                workload["ctx"] + workload["max_new_tokens"], "vegas").model_dump()
        except (ValidationError, TypeError):
            # An invalid tuned or workload value: validating the upgraded data names it.
            pass
    except (KeyError, TypeError, ValueError) as error:
        raise VegasError(f"{source}: invalid profile: a schema 2 profile that cannot be read as "
                         f"schema {SCHEMA_VERSION} ({type(error).__name__}: "
                         f"{str(error).splitlines()[0]}); re-run the tuner") from None
    upgraded["schema_version"] = 3
    return upgraded


def _upgrade_from_3(data: dict, source: str) -> dict:
    """A schema 3 profile as schema 4: tuned for this engine (``target: vegas``: schema 3
    tunes searched scores and windows the vLLM fork cannot run), its vLLM note saying
    so. Its figures and steps are unchanged."""
    # A deep copy; not through JSON, which fails on values YAML may hold (an unquoted
    # timestamp is a datetime) that validation then names.
    upgraded = copy.deepcopy(data)
    upgraded["target"] = "vegas"
    try:
        upgraded["exports"]["vllm"]["note"] = vllm_note(
            Tuned.model_validate(upgraded["tuned"]), "vegas")
    except (KeyError, TypeError, ValidationError):
        pass  # validating the upgraded data names what is wrong
    upgraded["schema_version"] = 4
    return _in_schema_order(upgraded)


def _upgrade_from_4(data: dict) -> dict:
    """A schema 4 profile as schema 5: its configurations ran this engine's selection
    rule (``rule: engine``, the default), so one tuned for ``vllm`` becomes tuned for
    this engine (the fork's rule differs: docs/drafters.md); the vegas export gains
    ``rule`` and the vLLM note is regenerated. Its figures and steps are unchanged."""
    upgraded = copy.deepcopy(data)
    upgraded["target"] = "vegas"
    try:
        upgraded["exports"]["vegas"]["rule"] = "engine"
        upgraded["exports"]["vllm"]["note"] = vllm_note(
            Tuned.model_validate(upgraded["tuned"]), "vegas")
    except (KeyError, TypeError, ValidationError):
        pass  # validating the upgraded data names what is wrong
    upgraded["schema_version"] = SCHEMA_VERSION
    return _in_schema_order(upgraded)


def _in_schema_order(data: dict) -> dict:
    """Keys in schema order, as a profile written now would have them."""
    order = list(Profile.model_fields)
    return {key: data[key] for key in sorted(data, key=lambda k: (
        order.index(k) if k in order else len(order)))}


# Workload keys written only where a run used them (long generations over spans), so a
# profile that decoded every token reads as it did before they existed.
SPAN_WORKLOAD_KEYS = ("spans", "span_tokens", "span_warmup_iterations")
CONTEXT_ENTRY_KEYS = ("ctx_min", "ctx_max", "ctx")


def profile_to_dict(profile: Profile) -> dict[str, Any]:
    """The profile as plain Python data (dicts, lists, scalars), keys in schema order."""
    data = profile.model_dump(mode="python")
    # ``spread`` only where a configuration uses it.
    configs = [data["tuned"], *(entry.get(key) for entry in data["schedule"]
                                for key in ("config", "measured")),
               *(p for step in data["steps"] for p in step["predictions"])]
    for config in configs:
        if isinstance(config, dict) and not config.get("spread"):
            config.pop("spread", None)
    for key in (*SPAN_WORKLOAD_KEYS, "contexts"):
        if data["workload"].get(key) is None:
            data["workload"].pop(key, None)
    # Context keys only in a profile tuned at several contexts.
    for item in (*data["schedule"], *data["not_tuned"], *data["steps"]):
        for key in CONTEXT_ENTRY_KEYS:
            if item.get(key, 0) is None:
                item.pop(key)
    return data


def load_profile(path: str | os.PathLike) -> Profile:
    """Read and validate a profile YAML file.

    Any problem (missing, unreadable or oversized file, not YAML, YAML anchors or aliases,
    a schema violation, an unknown key, a value that makes no sense, another schema
    version) raises ``VegasError`` with one line naming the file and the
    first problem, e.g. ``profiles/x.yaml: invalid profile: tuned.gamma: Input should be
    greater than or equal to 1``.
    """
    return profile_from_dict(read_yaml_file(path, "profile"), source=str(path))


class _ProfileDumper(yaml.SafeDumper):
    """Safe YAML dumper that writes multi-line strings as ``|`` blocks, so the embedded
    JSON in ``exports.vllm.speculative_config_json`` reads as it will be pasted."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_ProfileDumper.add_representer(str, _represent_str)


def write_profile(profile: Profile, path: str | os.PathLike) -> None:
    """Write ``profile`` as YAML to ``path``, atomically (``write_atomically``). Keys keep
    the schema's order. An ``OSError`` becomes a one-line ``VegasError``."""
    data = profile_to_dict(profile)
    write_atomically(path, lambda stream: yaml.dump(
        data, stream, Dumper=_ProfileDumper, sort_keys=False, default_flow_style=False,
        allow_unicode=True, width=_YAML_LINE_WIDTH), "the profile")


def write_text_atomically(path: str | os.PathLike, text: str, what: str) -> None:
    """Write ``text`` to ``path``, atomically (``write_atomically``)."""
    write_atomically(path, lambda stream: stream.write(text), what)


def write_atomically(path: str | os.PathLike, write: Callable[[TextIO], object],
                     what: str) -> None:
    """Call ``write`` on a UTF-8 text stream that replaces ``path``, atomically.

    The text goes to a temporary file in the same folder, which is flushed, fsynced and
    then renamed over ``path``: readers see the old file or the new one, never a partial
    one, and a failure part-way leaves the old file as it was. Parent folders are created.
    An ``OSError`` becomes a one-line ``VegasError`` naming ``what`` was written.
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # A unique hidden name beside the target: same file system, so os.replace is atomic.
        temp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        # os.open with 0o666 lets the umask decide the final permissions, as a plain open does.
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as error:
        raise VegasError(f"{path}: cannot write {what}: {error.strerror or error}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as stream:
            write(stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, path)
    except BaseException as error:
        temp.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise VegasError(f"{path}: cannot write {what}: {error.strerror or error}") from None
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


# What two profiles must share for their figures to compare (a change in any of these
# changes every figure, whatever the code did), and what says which machine measured them.
_LIKE_FOR_LIKE = {"model": ("id", "dtype"),
                  "workload": ("ctx", "dataset", "max_new_tokens", "temperature"),
                  "target": ()}
_HARDWARE_KEYS = ("gpu_name", "gpu_count", "cpu")


def incomparable(old: Profile, new: Profile) -> tuple[list[str], list[str]]:
    """How ``old`` and ``new`` differ beyond what a diff can judge: (model, workload and
    target differences, hardware differences), each as ``name: old vs new``."""
    def differences(section: str, keys: tuple[str, ...]) -> list[str]:
        if not keys:
            before, after = getattr(old, section), getattr(new, section)
            return [] if before == after else [f"{section}: {before} vs {after}"]
        found = []
        for key in keys:
            before = getattr(getattr(old, section), key)
            after = getattr(getattr(new, section), key)
            if before != after:
                found.append(f"{section}.{key}: {before} vs {after}")
        return found

    workload = [line for section, keys in _LIKE_FOR_LIKE.items()
                for line in differences(section, keys)]
    return workload, differences("hardware", _HARDWARE_KEYS)


def diff_profiles(old: Profile, new: Profile, tolerance: float) -> ProfileDiff:
    """Compare two profiles; ``tolerance`` is the allowed relative drop (0.05 = 5%).

    Regressions are judged per batch size that both schedules measured (entries matched
    by ``batch_size``, and ``ctx`` where tuned at several contexts): ``tokens_per_second``, ``speedup`` or ``mean_accepted_length``
    below old x (1 - tolerance); an entry that ran speculatively and now runs vanilla; a
    size the old profile tuned and the new one does not. A profile that was recommended
    and no longer is regresses too.
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

    # Tuned at several contexts, an entry is a (context, batch size); else ctx is None.
    new_entries = {(e.ctx, e.batch_size): e for e in new.schedule}
    for entry in old.schedule:
        batch = f"{entry.batch_size}" + ("" if entry.ctx is None else f" at ctx {entry.ctx}")
        now = new_entries.get((entry.ctx, entry.batch_size))
        if now is None:
            diff.regressions.append(f"batch {batch}: tuned in the old profile, not in the new one")
            continue
        for name, label in _GUARDED_RESULTS.items():
            before, after = getattr(entry.results, name), getattr(now.results, name)
            if before is None or after is None:
                continue
            if after < before * (1.0 - tolerance):
                drop = (before - after) / before if before else 0.0
                diff.regressions.append(
                    f"batch {batch}: results.{name} ({label}) fell {drop:.1%}: {before:g} -> "
                    f"{after:g}, beyond the {tolerance:.1%} tolerance")
        if entry.config != VANILLA and now.config == VANILLA:
            diff.regressions.append(f"batch {batch}: ran speculatively in the old profile, "
                                    "now vanilla")
    if old.recommended and not new.recommended:
        diff.regressions.append("recommended: the old profile was recommended, the new one is not")
    return diff
