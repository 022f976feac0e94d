"""The tuner's options: one home for their defaults and help texts.

``TuneOptions`` is what ``Tuner`` takes. The CLI builds its flags, their defaults and
their ``--help`` texts from the fields here (``option_help``, ``option_default_text``),
and docs/tuning.md's options table states the same defaults (tests/test_options.py
compares the three).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from vegas_core.errors import VegasError
from vegas_tune.space import MIN_BUDGET

# Where a profile will be served: the authors' vLLM fork, or this engine.
TARGETS = ("vllm", "vegas")


def _option(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass
class TuneOptions:
    """How the tuner searches and measures (the workload is the pipeline's)."""

    target: str = _option(
        "vllm", "Where the profile will run: vllm (the authors' vLLM fork: the vegas drafter "
                "with softmax-weight scores and no window, or streaming, both under the "
                "fork's selection rule) or vegas (this engine: every score and window, and "
                "spread 8).")
    budgets: tuple[int, ...] = _option(
        (128, 256, 512, 1024), "Draft budgets to search, in KV slots per layer and sequence, "
                               "comma-separated (an edge pick is extended once).")
    probe_gamma: int = _option(
        12, "Gamma of the sweep: acceptance is measured at every draft position up to it and "
            "throughput predicted for every gamma below it (extended once where the best "
            "prediction lies at it).")
    candidates: int = _option(
        3, "Best predicted (selection, budget) pairs measured against vanilla in "
           "interleaved rounds at each batch size, each at its best predicted gamma and the "
           "gammas either side (with the two best of each drafter).")
    max_rounds: int = _option(8, "Measurement rounds per configuration, at most.")
    precision: float = _option(
        0.01, "The race ends when no configuration left can beat the leader by more than "
              "this share (the 95% interval of their round-by-round ratio).")
    seed: int = _option(0, "Seed for samplers and sampling.")
    time_budget: float | None = _option(
        None, "Seconds for the whole run; when they run out, the profile the finished "
              "trials support is written.")

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise VegasError(f"--target '{self.target}': choose one of {', '.join(TARGETS)}")
        self.budgets = tuple(sorted(set(self.budgets)))


# What --help and docs/tuning.md say for defaults that are not a plain value.
DEFAULT_WORDS = {"time_budget": "no limit"}


def option_names() -> list[str]:
    return [f.name for f in fields(TuneOptions)]


def option_help(name: str) -> str:
    return next(f.metadata["help"] for f in fields(TuneOptions) if f.name == name)


def option_default(name: str) -> Any:
    return next(f.default for f in fields(TuneOptions) if f.name == name)


def default_words(value: Any) -> str:
    """A default as --help and the docs write it: lists comma-separated, booleans lower."""
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def option_default_text(name: str) -> str:
    return DEFAULT_WORDS.get(name) or default_words(option_default(name))


def parse_target(text: str) -> str:
    value = str(text).strip().lower()
    if value not in TARGETS:
        raise VegasError(f"--target '{text}': choose one of {', '.join(TARGETS)} (vllm: the "
                         "authors' vLLM fork; vegas: this engine)")
    return value


def parse_whole_numbers(text: str | int, flag: str, malformed: str, minimum: int,
                        too_small: str) -> tuple[int, ...]:
    """Comma-separated whole numbers, each >= ``minimum``, none twice; ascending. The
    errors name ``flag`` and the text: ``malformed`` follows it where a part is not a
    whole number, ``too_small`` (with the value) where one is below the minimum."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        numbers = [int(p) for p in parts]
    except ValueError:
        raise VegasError(f"{flag} '{text}'{malformed}") from None
    small = [n for n in numbers if n < minimum]
    if small:
        raise VegasError(f"{flag} '{text}': {too_small}, got {small[0]}")
    repeated = sorted({n for n in numbers if numbers.count(n) > 1})
    if repeated:
        raise VegasError(f"{flag} '{text}': {repeated[0]} is given twice; list each once")
    return tuple(sorted(numbers))


def parse_budgets(text: str | int) -> tuple[int, ...]:
    """'128,256,512' -> (128, 256, 512): draft budgets in KV slots, each >= MIN_BUDGET,
    no repeats; ascending."""
    return parse_whole_numbers(
        text, "--budgets", ": give comma-separated slot counts, e.g. 128,256,512,1024",
        MIN_BUDGET, f"every budget must be >= {MIN_BUDGET} slots (16 sink tokens and a "
                    "recent window)")
