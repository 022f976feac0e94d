"""SpecSchedule: which speculative configuration (or vanilla decoding) to run at each
live batch size and context length, as a tuned profile's ``schedule`` records it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from vegas_core.errors import VegasError
from vegas_core.spec_config import SpecConfig

# Profile schema versions this engine reads. vegas_core cannot import vegas_tune (it sits
# below it), so the few fields read here are checked here; ``vegas-tune validate`` checks
# the whole profile.
# Profile schemas whose ``schedule`` this reads (4 added ``target``, 5 each config's
# ``rule`` and, optionally, context ranges: ``ctx_min``/``ctx_max`` on the entries of a
# profile tuned at several contexts), and the one-size schema before them.
PROFILE_SCHEMAS = (3, 4, 5)
PROFILE_SCHEMA_UPGRADABLE = 2
VANILLA = "vanilla"
# A profile's config mapping: SpecConfig's fields, with ``sparsity`` named ``sparsity_ratio``.
_PROFILE_TO_SPEC = {"drafter": "drafter", "gamma": "gamma", "sparsity_ratio": "sparsity",
                    "min_tokens": "min_tokens", "collect": "collect", "score": "score",
                    "granularity": "granularity", "window": "window", "rule": "rule",
                    "spread": "spread"}
# Keys older schemas lack: ``rule`` is then this engine's (what they measured). ``spread``
# is written only where set (0: the paper's rule).
_OPTIONAL = ("rule", "spread")
_INTS = ("gamma", "min_tokens", "spread")
_FLOATS = ("sparsity_ratio", "window")


class ScheduleRange(NamedTuple):
    """Batch sizes ``batch_min`` to ``batch_max`` at context lengths ``ctx_min`` to
    ``ctx_max`` run ``spec`` (None: vanilla decoding). A schedule tuned at one context
    has one band of contexts, 1 and above (``ctx_max`` None: no upper bound)."""

    batch_min: int
    batch_max: int
    spec: SpecConfig | None
    ctx_min: int = 1
    ctx_max: int | None = None


def range_words(batch_min: int, batch_max: int, last: bool) -> str:
    """A schedule range as output names it: ``16-63``; the last range ``256 and above``,
    since every larger live batch runs its entry too."""
    return f"{batch_min} and above" if last else f"{batch_min}-{batch_max}"


def context_bands(contexts: list[int]) -> list[tuple[int, int]]:
    """The (ctx_min, ctx_max) band each tuned context covers, for ascending ``contexts``:
    the first from 1, each boundary at the geometric mean of its neighbours (a step's
    K/V reads grow in proportion to context, so a context is as far in cost ratio from
    both), the last ending at the largest context (longer ones run its entries too)."""
    bands, low = [], 1
    for here, above in zip(contexts, contexts[1:] + [None]):
        high = here if above is None else max(here, int((here * above) ** 0.5))
        bands.append((low, high))
        low = high + 1
    return bands


def config_words(spec: SpecConfig | None) -> str:
    """A configuration in a few words, as statistics and output name it: ``vanilla``,
    or the drafter, gamma, sparsity and min_tokens, then any other setting that is not
    its default (``vegas gamma 3 sparsity 0.1 min_tokens 4 collect last``)."""
    if spec is None:
        return VANILLA
    words = [spec.drafter, f"gamma {spec.gamma}", f"sparsity {spec.sparsity:g}",
             f"min_tokens {spec.min_tokens}"]
    default = SpecConfig()
    for name, value in spec.to_dict().items():
        if name not in ("drafter", "gamma", "sparsity", "min_tokens") and \
                value != getattr(default, name):
            words.append(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}")
    return " ".join(words)


def _is_int(value: Any) -> bool:
    # bool is an int in Python, but `true` is not a batch size.
    return isinstance(value, int) and not isinstance(value, bool)


def _check_ranges(bounds: list[tuple[int, Any, Any]], name: str, what: str = "batch") -> None:
    """Raise ``VegasError`` unless the ``(index, min, max)`` ``bounds`` (of the entries'
    ``<what>_min`` and ``<what>_max`` fields) are integers, start at 1 and follow each
    other without gaps or overlaps; ``name`` prefixes the field in messages
    (``entries``, ``p.yaml: schedule``), ``index`` is the entry's there."""
    if not bounds:
        raise VegasError(f"{name}: empty; a schedule needs at least one entry")
    expected = 1
    for index, low, high in bounds:
        for field, value in ((f"{what}_min", low), (f"{what}_max", high)):
            if not _is_int(value):
                raise VegasError(f"{name}[{index}].{field}: expected an integer, "
                                 f"got {value!r}")
        if low != expected:
            raise VegasError(f"{name}[{index}].{what}_min: {low}; expected {expected}: the "
                             "ranges start at 1 and follow each other without gaps or overlaps")
        if low > high:
            raise VegasError(f"{name}[{index}].{what}_max: {high} is below {what}_min {low}")
        expected = high + 1


def check_schedule_grid(entries: list[tuple[Any, Any, Any, Any]], name: str) -> None:
    """Raise ``VegasError`` unless ``entries``' (batch_min, batch_max, ctx_min, ctx_max)
    are bands of contexts (consecutive entries naming the same contexts) that follow each
    other from context 1, each band's batch ranges following each other from batch 1.
    A schedule of one context band spans every context: (1, None)."""
    bands: list[list[tuple[int, tuple]]] = []  # per band: (entry index, entry)
    for index, entry in enumerate(entries):
        if bands and tuple(entry[2:]) == tuple(bands[-1][0][1][2:]):
            bands[-1].append((index, entry))
        else:
            bands.append([(index, entry)])
    if not (len(bands) == 1 and tuple(bands[0][0][1][2:]) == (1, None)):
        _check_ranges([(band[0][0], *band[0][1][2:]) for band in bands], name, "ctx")
    for band in bands:
        _check_ranges([(index, *entry[:2]) for index, entry in band], name)


@dataclass(frozen=True)
class SpecSchedule:
    """What to decode with at each live batch size (the number of sequences still
    decoding) and context length (the tokens a live sequence holds, on average: what a
    step's K/V reads grow with). ``entries`` are ``ScheduleRange``\\ s (or plain
    ``(batch_min, batch_max, spec[, ctx_min, ctx_max])`` tuples) in bands of contexts
    that follow each other from 1, each band's batch ranges following each other from 1;
    a ``spec`` of None decodes vanilla. Above a band's last batch range, and above the
    last band's contexts, the last entry applies (the largest size measured).

    Pass one as ``generate(..., spec=schedule)``: it follows the schedule as sequences
    finish and contexts grow. Build one from a tuned profile with ``from_profile_data``
    (or ``vegas_tune.Profile.spec_schedule()``).
    """

    entries: tuple[ScheduleRange, ...]

    def __post_init__(self) -> None:
        if isinstance(self.entries, (str, bytes)) or not hasattr(self.entries, "__iter__"):
            raise VegasError(f"entries: expected a sequence of (batch_min, batch_max, spec), "
                             f"got {type(self.entries).__name__}")
        entries = []
        for index, entry in enumerate(self.entries):
            if not isinstance(entry, tuple) or len(entry) not in (3, 5):
                raise VegasError(f"entries[{index}]: expected (batch_min, batch_max, spec) or "
                                 f"(batch_min, batch_max, spec, ctx_min, ctx_max), got {entry!r}")
            if entry[2] is not None and not isinstance(entry[2], SpecConfig):
                raise VegasError(f"entries[{index}].spec: expected a SpecConfig or None "
                                 f"(vanilla), got {type(entry[2]).__name__}")
            entries.append(ScheduleRange(*entry))
        check_schedule_grid([(e.batch_min, e.batch_max, e.ctx_min, e.ctx_max)
                             for e in entries], "entries")
        # Frozen: a tuple, so the schedule stays hashable and cannot change under a caller.
        object.__setattr__(self, "entries", tuple(entries))

    @property
    def has_contexts(self) -> bool:
        """Whether entries differ by context (a profile tuned at several contexts)."""
        return self.entries[0].ctx_max is not None

    def entry_for(self, batch_size: int, context: int | None = None) -> ScheduleRange:
        """The entry whose ranges hold ``batch_size`` and ``context`` (None: the last
        band's, the longest context measured); above a band's last batch range or the
        last band, its last entry."""
        if not _is_int(batch_size) or batch_size < 1:
            raise VegasError(f"batch size must be an integer >= 1, got {batch_size!r}")
        if context is not None and (not _is_int(context) or context < 1):
            raise VegasError(f"context must be an integer >= 1, got {context!r}")
        band = [e for e in self.entries
                if context is not None and e.ctx_min <= context <= (e.ctx_max or context)]
        if not band:  # above the last band, or no context given
            last = self.entries[-1]
            band = [e for e in self.entries if (e.ctx_min, e.ctx_max) == (last.ctx_min,
                                                                          last.ctx_max)]
        for entry in band:
            if entry.batch_min <= batch_size <= entry.batch_max:
                return entry
        return band[-1]

    def configs_for(self, batch_size: int) -> list[SpecConfig | None]:
        """The configurations (None: vanilla) a batch of ``batch_size`` sequences may
        decode with as its sequences finish and its contexts grow: those of the entries
        for sizes up to it, in every band; each once, in the entries' order."""
        configs: list[SpecConfig | None] = []
        for entry in self.entries:
            if entry.batch_min <= batch_size and entry.spec not in configs:
                configs.append(entry.spec)
        return configs

    def for_batch(self, batch_size: int, context: int | None = None) -> SpecConfig | None:
        """The configuration to decode ``batch_size`` prompts with at ``context`` tokens
        each (see ``entry_for``); None: vanilla."""
        return self.entry_for(batch_size, context).spec

    @classmethod
    def from_profile_data(cls, data: Any, source: str) -> SpecSchedule:
        """The schedule of a tuned profile, as parsed from its YAML (plain dicts and
        lists); ``source`` names it in messages (a file name).

        Schemas 3 to 5 read ``schedule`` (5: entries may name context ranges): ``config: vanilla`` is None, a mapping is a
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
            if ("ctx_min" in item) != ("ctx_max" in item):
                missing = "ctx_max" if "ctx_min" in item else "ctx_min"
                raise VegasError(f"{source}: schedule[{index}].{missing}: missing (an entry "
                                 "names both ends of its context range, or neither)")
        check_schedule_grid([(e["batch_min"], e["batch_max"], e.get("ctx_min", 1),
                              e.get("ctx_max")) for e in schedule], f"{source}: schedule")
        return cls(tuple(
            ScheduleRange(e["batch_min"], e["batch_max"],
                          None if e["config"] == VANILLA
                          else _spec(e["config"], f"{source}: schedule[{i}].config"),
                          e.get("ctx_min", 1), e.get("ctx_max"))
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
