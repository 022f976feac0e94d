"""SpecSchedule: a tuned profile's schedule drives the engine (API and ``vegas generate
--profile``)."""

from __future__ import annotations

import copy
import dataclasses
import types
from pathlib import Path

import pytest
import yaml

from vegas_core import (GenerationStats, SpecConfig, SpecSchedule, SpeculativeStats,
                        generate)
from vegas_core.cli import app, run_app
from vegas_core.errors import VegasError
from vegas_core.schedule import ScheduleRange, config_words, context_bands
from vegas_core.speculative import SpeculativeSession
from tests.test_engine import prompt, tiny_model
from tests.test_profile import TUNED, sample_profile, sample_profile_dict

REPO = Path(__file__).resolve().parent.parent
SCHEMA_2 = REPO / "tests" / "data" / "profile-schema2.yaml"
FAST = SpecConfig(gamma=3, sparsity=0.1, min_tokens=4)
SLOW = SpecConfig(drafter="streaming", gamma=2, sparsity=0.2, min_tokens=8)


def one_line(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


# ---- validation ----------------------------------------------------------------------

@pytest.mark.parametrize("entries, fragments", [
    ((), ["entries: empty"]),
    (((2, 4, None),), ["entries[0].batch_min: 2; expected 1"]),
    (((1, 4, None), (6, 8, FAST)), ["entries[1].batch_min: 6; expected 5", "gaps"]),
    (((1, 4, None), (4, 8, FAST)), ["entries[1].batch_min: 4; expected 5", "overlaps"]),
    (((1, 4, None), (5, 3, FAST)), ["entries[1].batch_max: 3 is below batch_min 5"]),
    (((1, 4.0, None),), ["entries[0].batch_max: expected an integer"]),
    (((1, True, None),), ["entries[0].batch_max: expected an integer"]),
    (((1, 4, "vanilla"),), ["entries[0].spec: expected a SpecConfig or None"]),
    (((1, 4),), ["entries[0]: expected (batch_min, batch_max, spec)"]),
])
def test_bad_schedules_are_refused_with_one_line(entries, fragments):
    with pytest.raises(VegasError) as error:
        SpecSchedule(entries)
    one_line(error, *fragments)


def test_for_batch_picks_the_range_and_the_last_entry_above_it():
    schedule = SpecSchedule([(1, 3, None), (4, 15, FAST), (16, 64, SLOW)])
    assert isinstance(schedule.entries, tuple)
    assert schedule.entries[1] == ScheduleRange(4, 15, FAST)
    assert [schedule.for_batch(n) for n in (1, 3, 4, 15, 16, 64)] == [
        None, None, FAST, FAST, SLOW, SLOW]
    assert schedule.for_batch(1000) is SLOW  # above the largest size measured
    assert schedule.entry_for(500) == ScheduleRange(16, 64, SLOW)
    for bad in (0, -1, 2.0):
        with pytest.raises(VegasError, match="batch size must be an integer >= 1"):
            schedule.for_batch(bad)


# ---- from profile data ---------------------------------------------------------------

def test_from_schema_3_profile_data():
    schedule = SpecSchedule.from_profile_data(sample_profile_dict(), "p.yaml")
    tuned = SpecConfig(drafter="vegas", gamma=6, sparsity=0.05, min_tokens=256,
                       collect="two", score="logit", granularity="layer", window=0.125)
    assert schedule.entries == (ScheduleRange(1, 63, None), ScheduleRange(64, 64, tuned))
    assert schedule.for_batch(1) is None and schedule.for_batch(128) == tuned


def test_a_config_runs_its_rule_and_one_without_rule_this_engines():
    """Schema 5 records each configuration's selection rule; schemas 3 and 4 have none:
    they ran this engine's."""
    from tests.test_validate import vllm_target

    data = vllm_target(sample_profile_dict())
    assert SpecSchedule.from_profile_data(data, "p.yaml").for_batch(64).rule == "fork"
    old = copy.deepcopy(data)
    old["schema_version"] = 4
    del old["schedule"][-1]["config"]["rule"]
    assert SpecSchedule.from_profile_data(old, "p.yaml").for_batch(64).rule == "engine"


def test_profile_spec_schedule_matches_the_data():
    profile = sample_profile()
    assert profile.spec_schedule() == SpecSchedule.from_profile_data(sample_profile_dict(), "x")


def test_from_schema_2_profile_file():
    from vegas_core.yamlio import read_yaml_file

    data = read_yaml_file(SCHEMA_2, "profile")
    # Not recommended: vanilla for every batch size up to the tuned one (1).
    assert SpecSchedule.from_profile_data(data, str(SCHEMA_2)).entries == (
        ScheduleRange(1, 1, None),)
    data["recommended"], data["workload"]["batch_size"] = True, 8
    schedule = SpecSchedule.from_profile_data(data, str(SCHEMA_2))
    assert schedule.entries == (ScheduleRange(1, 8, SpecConfig(
        drafter="vegas", gamma=3, sparsity=0.1103, min_tokens=64, collect="two",
        score="logit", granularity="layer", window=0.75)),)


def _broken(change) -> dict:
    data = sample_profile_dict()
    change(data)
    return data


@pytest.mark.parametrize("change, fragments", [
    (lambda d: d.update(schema_version=1), ["schema_version: 1"]),
    (lambda d: d.pop("schedule"), ["schedule: expected a list"]),
    (lambda d: d.update(schedule=[]), ["schedule: empty"]),
    (lambda d: d["schedule"].__setitem__(0, "vanilla"), ["schedule[0]: expected a mapping"]),
    (lambda d: d["schedule"][1].pop("batch_max"), ["schedule[1].batch_max: missing"]),
    (lambda d: d["schedule"][1].update(batch_min=65), ["schedule[1].batch_min: 65; expected 64"]),
    (lambda d: d["schedule"][0].update(config="fast"), ["schedule[0].config: expected 'vanilla'"]),
    (lambda d: d["schedule"][1]["config"].pop("gamma"), ["schedule[1].config.gamma: missing"]),
    (lambda d: d["schedule"][1]["config"].update(gamma="6"),
     ["schedule[1].config.gamma: expected an integer"]),
    (lambda d: d["schedule"][1]["config"].update(sparsity=0.1),
     ["schedule[1].config.sparsity: unknown key"]),
    (lambda d: d["schedule"][1]["config"].update(drafter="eagle"),
     ["schedule[1].config: unknown drafter 'eagle'"]),
    (lambda d: d["schedule"][1]["config"].update(sparsity_ratio=1.5),
     ["schedule[1].config: sparsity must be in (0, 1]"]),
])
def test_bad_profile_data_names_the_source_and_field(change, fragments):
    with pytest.raises(VegasError) as error:
        SpecSchedule.from_profile_data(_broken(change), "p.yaml")
    one_line(error, "p.yaml: ", *fragments)


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d.pop("workload"), "workload: expected a mapping"),
    (lambda d: d["workload"].update(batch_size=0), "workload.batch_size: expected an integer >= 1"),
    (lambda d: d.update(recommended="yes"), "recommended: expected true or false"),
    (lambda d: (d.update(recommended=True), d.pop("tuned")), "tuned: expected 'vanilla' or a"),
])
def test_bad_schema_2_data_names_the_field(change, fragment):
    data = yaml.safe_load(SCHEMA_2.read_text())
    change(data)
    with pytest.raises(VegasError) as error:
        SpecSchedule.from_profile_data(data, "old.yaml")
    one_line(error, f"old.yaml: {fragment}")


def test_not_a_mapping():
    with pytest.raises(VegasError) as error:
        SpecSchedule.from_profile_data(None, "empty.yaml")
    one_line(error, "empty.yaml: not a profile", "got nothing")


# ---- generate(spec=schedule) ---------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return tiny_model()


PROMPTS = [list(range(1, 40)), list(range(7, 30))]


def test_generate_uses_the_entry_for_the_batch(model):
    schedule = SpecSchedule([(1, 1, None), (2, 4, FAST)])
    for prompts, entry in ((PROMPTS[:1], None), (PROMPTS, FAST)):
        got = generate(model, prompts, max_new_tokens=10, ignore_eos=True, spec=schedule)
        want = generate(model, prompts, max_new_tokens=10, ignore_eos=True, spec=entry)
        assert got.tokens == want.tokens
        assert type(got.stats) is (GenerationStats if entry is None else SpeculativeStats)
        assert type(got.stats) is type(want.stats)
        assert getattr(got.stats, "gamma", None) == getattr(want.stats, "gamma", None)


# Three prompts of different lengths, and schedules whose entries change inside their
# 30 new tokens. OTHER differs from FAST in every way a switch must carry over: gamma,
# budget and the rows its scores come from.
FOLLOWED = [prompt(40, 1), prompt(23, 2), prompt(31, 3)]
OTHER = SpecConfig(gamma=2, sparsity=0.2, min_tokens=6, collect="last")
# The mean context starts at 31 (32 with the prefill's token) and passes every boundary:
# FAST, vanilla, OTHER, FAST again.
BY_CONTEXT = SpecSchedule([(1, 8, FAST, 1, 40), (1, 8, None, 41, 46), (1, 8, OTHER, 47, 52),
                           (1, 8, FAST, 53, 1000)])


def sessions_made(monkeypatch) -> list[SpecConfig]:
    """The configuration of every SpeculativeSession made from now on."""
    made, init = [], SpeculativeSession.__init__

    def spy(self, model, prompt_ids, spec, *args, **kwargs):
        made.append(spec)
        init(self, model, prompt_ids, spec, *args, **kwargs)

    monkeypatch.setattr(SpeculativeSession, "__init__", spy)
    return made


def test_generate_follows_the_schedule_as_contexts_grow(model, monkeypatch):
    vanilla = generate(model, FOLLOWED, max_new_tokens=30, ignore_eos=True)
    made = sessions_made(monkeypatch)
    got = generate(model, FOLLOWED, max_new_tokens=30, ignore_eos=True, spec=BY_CONTEXT)
    assert got.tokens == vanilla.tokens
    s = got.stats
    assert s.switches == 3 and s.switch_seconds > 0 and s.seconds_per_switch > 0
    assert list(s.iterations_by_config) == [config_words(c) for c in (FAST, None, OTHER)]
    assert sum(s.iterations_by_config.values()) == s.iterations
    # FAST's decoder, made for the prefill, takes the batch back: nothing is made twice.
    assert made == [FAST, OTHER]
    assert type(s) is SpeculativeStats and s.gamma == FAST.gamma
    assert len(s.acceptance_by_position) == FAST.gamma and s.mean_accepted_length >= 1


def with_eos(model, *eos: int):
    """The model with a tokenizer that names ``eos`` its end-of-sequence tokens."""
    tokenizer = types.SimpleNamespace(eos_token_ids=list(eos), decode=lambda ids: "")
    return dataclasses.replace(model, tokenizer=tokenizer)


def test_generate_follows_the_schedule_as_sequences_finish(model, monkeypatch):
    # The first sequence's 8th greedy token (90) and the second's 13th (24) come nowhere
    # earlier in the batch: the batch of 3 shrinks to 2, then to 1.
    eos_model = with_eos(model, 90, 24)
    vanilla = generate(eos_model, FOLLOWED, max_new_tokens=30)
    assert vanilla.stats.new_tokens == [8, 13, 30]
    by_batch = SpecSchedule([(1, 1, FAST), (2, 2, OTHER), (3, 3, None)])
    made = sessions_made(monkeypatch)
    got = generate(eos_model, FOLLOWED, max_new_tokens=30, spec=by_batch)
    assert got.tokens == vanilla.tokens
    assert got.stats.switches == 2 and made == [OTHER, FAST]
    assert got.stats.iterations_by_config[config_words(None)] == 7


def test_a_schedule_of_one_configuration_decodes_as_that_configuration(model):
    """Entries that name one configuration (within the batch's size) switch nothing:
    the call is the configuration's own, statistics included."""
    one = SpecSchedule([(1, 2, FAST), (3, 8, None)])
    got = generate(model, FOLLOWED[:2], max_new_tokens=12, ignore_eos=True, spec=one)
    want = generate(model, FOLLOWED[:2], max_new_tokens=12, ignore_eos=True, spec=FAST)
    assert got.tokens == want.tokens and got.stats.iterations == want.stats.iterations
    assert got.stats.switches == 0 and got.stats.iterations_by_config == {}
    assert got.stats.mean_accepted_length == want.stats.mean_accepted_length


# ---- vegas generate --profile --------------------------------------------------------

def run(argv, capsys):
    code = run_app(app, argv, prog_name="vegas")
    return code, capsys.readouterr()


GENERATE = ["generate", "--model", "dummy:tiny", "--device", "cpu", "--dtype", "float32",
            "--prompt", "hello there", "--max-new-tokens", "4", "--ignore-eos"]


def write_profile_data(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_cli_profile_vanilla_entry(tmp_path, capsys):
    profile = write_profile_data(tmp_path / "p.yaml", sample_profile_dict())
    code, out = run([*GENERATE, "--profile", str(profile)], capsys)
    assert code == 0, out.err
    assert out.out.strip()
    assert f"profile {profile}: batch 1 -> vanilla (range 1-63)" in out.err
    # The sample was tuned for another model than dummy:tiny: said once, not refused.
    assert "warning: profile" in out.err and "meta-llama/Llama-3.1-8B-Instruct" in out.err
    assert "mean accepted length" not in out.err


def test_cli_profile_speculative_entry(tmp_path, capsys):
    data = sample_profile_dict()
    data["model"]["id"] = "dummy:tiny"
    data["schedule"][0]["config"] = dict(TUNED, min_tokens=4)
    profile = write_profile_data(tmp_path / "p.yaml", data)
    code, out = run([*GENERATE, "--profile", str(profile)], capsys)
    assert code == 0, out.err
    assert f"profile {profile}: batch 1 -> vegas gamma 6, sparsity 0.05 (range 1-63)" in out.err
    assert "warning" not in out.err
    assert "vegas gamma=6: mean accepted length" in out.err


def test_cli_profile_follows_the_context(tmp_path, capsys):
    """A profile of two context bands: the prompt (11 tokens) starts in the first band,
    vanilla for batch 1, and grows into the second, speculative."""
    data = sample_profile_dict()
    data["model"]["id"] = "dummy:tiny"
    short = copy.deepcopy(data["schedule"])
    long = copy.deepcopy(data["schedule"])
    long[0]["config"] = dict(TUNED, min_tokens=4)
    for band, (low, high) in ((short, (1, 12)), (long, (13, 4096))):
        for entry in band:
            entry.update(ctx_min=low, ctx_max=high)
    data["schedule"] = short + long
    profile = write_profile_data(tmp_path / "p.yaml", data)
    code, out = run([*GENERATE[:-2], "8", "--ignore-eos", "--profile", str(profile)], capsys)
    assert code == 0, out.err
    assert (f"profile {profile}: batch 1 -> vanilla (context 1-12, range 1-63); vegas gamma 6, "
            "sparsity 0.05 (context 13-4096, range 1-63)") in out.err
    assert "schedule followed: 1 switch, " in out.err
    assert "the profile's drafts: mean accepted length" in out.err
    assert "vanilla: 1; vegas gamma 6 sparsity 0.05 min_tokens 4 window 0.125: " in out.err


def assert_only_error_line(code, err, *fragments):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("extra, fragments", [
    (["--drafter", "vegas"], ["--profile and --drafter"]),
    (["--gamma", "3"], ["--gamma does not combine with --profile"]),
    (["--min-tokens", "16"], ["--min-tokens does not combine with --profile"]),
])
def test_cli_profile_with_speculative_options_is_a_usage_error(extra, fragments, tmp_path,
                                                                capsys):
    profile = write_profile_data(tmp_path / "p.yaml", sample_profile_dict())
    code, out = run([*GENERATE, "--profile", str(profile), *extra], capsys)
    assert_only_error_line(code, out.err, *fragments)


def test_cli_bad_profiles(tmp_path, capsys):
    code, out = run([*GENERATE, "--profile", str(tmp_path / "missing.yaml")], capsys)
    assert_only_error_line(code, out.err, "missing.yaml: no such profile file")
    data = copy.deepcopy(sample_profile_dict())
    data["schedule"][1]["config"]["gamma"] = 0
    bad = write_profile_data(tmp_path / "bad.yaml", data)
    code, out = run([*GENERATE, "--profile", str(bad)], capsys)
    assert_only_error_line(code, out.err, "bad.yaml: schedule[1].config: gamma must be")


# ---- context ranges (a profile tuned at several contexts) ------------------------------

def banded(*bands):
    """Entries of a schedule of several context bands: (ctx_min, ctx_max, entries)."""
    return tuple(ScheduleRange(*entry, low, high) for low, high, entries in bands
                 for entry in entries)


SHORT_BAND = (1, 8192, ((1, 15, None), (16, 16, FAST)))
LONG_BAND = (8193, 32768, ((1, 3, None), (4, 16, SLOW)))


def test_context_bands_meet_at_the_geometric_mean():
    assert context_bands([4096, 16384, 32768]) == [(1, 8192), (8193, 23170), (23171, 32768)]
    assert context_bands([8000]) == [(1, 8000)]


def test_entry_for_picks_the_band_of_the_context_then_the_batch():
    schedule = SpecSchedule(banded(SHORT_BAND, LONG_BAND))
    assert schedule.has_contexts
    assert schedule.for_batch(8, 100) is None and schedule.for_batch(16, 8192) == FAST
    assert schedule.for_batch(8, 8193) == SLOW and schedule.for_batch(2, 20000) is None
    # Above the last band and above a band's last range: the last entries.
    assert schedule.for_batch(64, 100) == FAST and schedule.for_batch(64, 10 ** 6) == SLOW
    # No context given: the longest context's band.
    assert schedule.for_batch(8) == SLOW
    assert not SpecSchedule(((1, 4, None),)).has_contexts


@pytest.mark.parametrize("bands, fragment", [
    ((SHORT_BAND, (8194, 32768, ((1, 16, SLOW),))),
     "entries[2].ctx_min: 8194; expected 8193"),
    ((SHORT_BAND, (8193, 32768, ((2, 16, SLOW),))), "entries[2].batch_min: 2; expected 1"),
    (((2, 100, ((1, 4, None),)),), "entries[0].ctx_min: 2; expected 1"),
])
def test_bad_context_bands_are_refused_with_one_line(bands, fragment):
    with pytest.raises(VegasError) as error:
        SpecSchedule(banded(*bands))
    one_line(error, fragment)


def test_a_profile_entry_names_both_ends_of_its_context_range_or_neither():
    data = sample_profile_dict()
    data["schedule"][0]["ctx_min"] = 1
    with pytest.raises(VegasError) as error:
        SpecSchedule.from_profile_data(data, "p.yaml")
    one_line(error, "p.yaml: schedule[0].ctx_max: missing")
