"""SpecSchedule: which speculative configuration (or vanilla decoding) to run at each
live batch size, as a tuned profile's ``schedule`` records it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from vegas_core.errors import VegasError
from vegas_core.spec_config import SpecConfig

# Profile schema versions this engine reads. vegas_core cannot import vegas_tune (it sits
# below it), so the few fields read here are checked here; ``vegas-tune validate`` checks
# the whole profile.
# Profile schemas whose ``schedule`` this reads (4 added ``target``, 5 each config's
# ``rule``; the schedule is otherwise unchanged since 3), and the one-size schema before
# them.
PROFILE_SCHEMAS = (3, 4, 5)
PROFILE_SCHEMA_UPGRADABLE = 2
VANILLA = "vanilla"
# A profile's config mapping: SpecConfig's fields, with ``sparsity`` named ``sparsity_ratio``.
_PROFILE_TO_SPEC = {"drafter": "drafter", "gamma": "gamma", "sparsity_ratio": "sparsity",
                    "min_tokens": "min_tokens", "collect": "collect", "score": "score",
                    "granularity": "granularity", "window": "window", "rule": "rule"}
# Keys older schemas lack: ``rule`` is then this engine's (what they measured).
_OPTIONAL = ("rule",)
_INTS = ("gamma", "min_tokens")
_FLOATS = ("sparsity_ratio", "window")


class ScheduleRange(NamedTuple):
    """Batch sizes ``batch_min`` to ``batch_max`` run ``spec`` (None: vanilla decoding)."""

    batch_min: int
    batch_max: int
    spec: SpecConfig | None


def range_words(batch_min: int, batch_max: int, last: bool) -> str:
    """A schedule range as output names it: ``16-63``; the last range ``256 and above``,
    since every larger live batch runs its entry too."""
    return f"{batch_min} and above" if last else f"{batch_min}-{batch_max}"


def _is_int(value: Any) -> bool:
    # bool is an int in Python, but `true` is not a batch size.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ranges(bounds: list[tuple[Any, Any]], name: str) -> None:
    """Raise ``VegasError`` unless the (batch_min, batch_max) ``bounds`` are integers,
    start at 1 and follow each other without gaps or overlaps; ``name`` prefixes the
    field in messages (``entries``, ``p.yaml: schedule``)."""
    if not bounds:
        raise VegasError(f"{name}: empty; a schedule needs at least one entry")
    expected = 1
    for index, (low, high) in enumerate(bounds):
        for field, value in (("batch_min", low), ("batch_max", high)):
            if not _is_int(value):
                raise VegasError(f"{name}[{index}].{field}: expected an integer, "
                                 f"got {value!r}")
        if low != expected:
            raise VegasError(f"{name}[{index}].batch_min: {low}; expected {expected}: the "
                             "ranges start at 1 and follow each other without gaps or overlaps")
        if low > high:
            raise VegasError(f"{name}[{index}].batch_max: {high} is below batch_min {low}")
        expected = high + 1


@dataclass(frozen=True)
class SpecSchedule:
    """What to decode with at each live batch size (the number of prompts decoded
    together): ``entries`` are ``ScheduleRange``\\ s (or plain ``(batch_min, batch_max,
    spec)`` tuples) whose ranges start at 1 and follow each other without gaps or
    overlaps; a ``spec`` of None decodes vanilla.

    Pass one as ``generate(..., spec=schedule)``; build one from a tuned profile with
    ``from_profile_data`` (or ``vegas_tune.Profile.spec_schedule()``).
    """

    entries: tuple[ScheduleRange, ...]

    def __post_init__(self) -> None:
        if isinstance(self.entries, (str, bytes)) or not hasattr(self.entries, "__iter__"):
            raise VegasError(f"entries: expected a sequence of (batch_min, batch_max, spec), "
                             f"got {type(self.entries).__name__}")
        entries = []
        for index, entry in enumerate(self.entries):
            if not isinstance(entry, tuple) or len(entry) != 3:
                raise VegasError(f"entries[{index}]: expected (batch_min, batch_max, spec), "
                                 f"got {entry!r}")
            if entry[2] is not None and not isinstance(entry[2], SpecConfig):
                raise VegasError(f"entries[{index}].spec: expected a SpecConfig or None "
                                 f"(vanilla), got {type(entry[2]).__name__}")
            entries.append(ScheduleRange(*entry))
        _check_ranges([(e.batch_min, e.batch_max) for e in entries], "entries")
        # Frozen: a tuple, so the schedule stays hashable and cannot change under a caller.
        object.__setattr__(self, "entries", tuple(entries))

    def entry_for(self, batch_size: int) -> ScheduleRange:
        """The entry whose range holds ``batch_size``; above the last range, the last
        entry (the largest size measured)."""
        if not _is_int(batch_size) or batch_size < 1:
            raise VegasError(f"batch size must be an integer >= 1, got {batch_size!r}")
        for entry in self.entries:
            if entry.batch_min <= batch_size <= entry.batch_max:
                return entry
        return self.entries[-1]

    def for_batch(self, batch_size: int) -> SpecConfig | None:
        """The configuration to decode ``batch_size`` prompts with; None: vanilla."""
        return self.entry_for(batch_size).spec

    @classmethod
    def from_profile_data(cls, data: Any, source: str) -> SpecSchedule:
        """The schedule of a tuned profile, as parsed from its YAML (plain dicts and
        lists); ``source`` names it in messages (a file name).

        Schemas 3 to 5 read ``schedule``: ``config: vanilla`` is None, a mapping is a
        ``SpecConfig`` (its ``sparsity_ratio`` is ``sparsity``). Schema 2 (one batch size)
        gives one entry for sizes 1 to ``workload.batch_size``: ``tuned`` where
        ``recommended``, else vanilla. Only these fields are read; missing or bad ones
        raise ``VegasError`` with one line naming ``source`` and the field.
        """
        if not isinstance(data, dict):
            kind = "nothing" if data is None else type(data).__name__
            raise VegasError(f"{source}: not a profile: expected a mapping at the top level, "
                             f"got {kind}")
        version = data.get("schema_version")
        if version in PROFILE_SCHEMAS:
            return cls._from_schedule(data, source)
        if version == PROFILE_SCHEMA_UPGRADABLE:
            return cls._from_schema_2(data, source)
        readable = ", ".join(map(str, (PROFILE_SCHEMA_UPGRADABLE, *PROFILE_SCHEMAS)))
        raise VegasError(f"{source}: schema_version: {version!r} is not one this engine reads "
                         f"({readable}); re-run the tuner")

    @classmethod
    def _from_schedule(cls, data: dict, source: str) -> SpecSchedule:
        schedule = data.get("schedule")
        if not isinstance(schedule, list):
            raise VegasError(f"{source}: schedule: expected a list of entries, "
                             f"got {_kind(schedule)}")
        for index, item in enumerate(schedule):
            if not isinstance(item, dict):
                raise VegasError(f"{source}: schedule[{index}]: expected a mapping, "
                                 f"got {_kind(item)}")
            for key in ("batch_min", "batch_max", "config"):
                if key not in item:
                    raise VegasError(f"{source}: schedule[{index}].{key}: missing")
        _check_ranges([(e["batch_min"], e["batch_max"]) for e in schedule],
                      f"{source}: schedule")
        return cls(tuple(
            ScheduleRange(e["batch_min"], e["batch_max"],
                          None if e["config"] == VANILLA
                          else _spec(e["config"], f"{source}: schedule[{i}].config"))
            for i, e in enumerate(schedule)))

    @classmethod
    def _from_schema_2(cls, data: dict, source: str) -> SpecSchedule:
        workload = data.get("workload")
        if not isinstance(workload, dict):
            raise VegasError(f"{source}: workload: expected a mapping, got {_kind(workload)}")
        batch = workload.get("batch_size")
        if not _is_int(batch) or batch < 1:
            raise VegasError(f"{source}: workload.batch_size: expected an integer >= 1, "
                             f"got {batch!r}")
        recommended = data.get("recommended")
        if not isinstance(recommended, bool):
            raise VegasError(f"{source}: recommended: expected true or false, "
                             f"got {recommended!r}")
        spec = _spec(data.get("tuned"), f"{source}: tuned") if recommended else None
        return cls((ScheduleRange(1, batch, spec),))


def _kind(value: Any) -> str:
    return "nothing" if value is None else type(value).__name__


def _spec(config: Any, where: str) -> SpecConfig:
    """A profile's config mapping as a ``SpecConfig``; ``where`` prefixes messages."""
    if not isinstance(config, dict):
        raise VegasError(f"{where}: expected '{VANILLA}' or a mapping of speculative "
                         f"settings, got {config!r}")
    for key in config:
        if key not in _PROFILE_TO_SPEC:
            raise VegasError(f"{where}.{key}: unknown key; expected: "
                             f"{', '.join(_PROFILE_TO_SPEC)}")
    for key in _PROFILE_TO_SPEC:
        if key not in config:
            if key in _OPTIONAL:
                continue
            raise VegasError(f"{where}.{key}: missing")
        value = config[key]
        if key in _INTS:
            ok = _is_int(value)
        elif key in _FLOATS:
            ok = _is_int(value) or isinstance(value, float)
        else:
            ok = isinstance(value, str)
        if not ok:
            want = "an integer" if key in _INTS else "a number" if key in _FLOATS else "a name"
            raise VegasError(f"{where}.{key}: expected {want}, got {value!r}")
    try:
        return SpecConfig(**{_PROFILE_TO_SPEC[key]: value for key, value in config.items()})
    except VegasError as error:
        # SpecConfig names the engine's field; the profile's reader needs the profile's.
        raise VegasError(f"{where}: {error}") from None
