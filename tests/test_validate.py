"""`vegas-tune validate` checks meaning, not only types; `export` is honest about profiles
whose served entry runs vanilla; YAML anchors, aliases and oversized files are refused."""

from __future__ import annotations

import copy
import json
import math
import time

import pytest
import yaml

from tests.test_profile import (MAX_MODEL_LEN, MODEL_ID, sample_profile_dict, sync_headline,
                                uneven_contexts_dict)
from vegas_core.errors import VegasError
from vegas_core.spec_config import MAX_GAMMA, SpecConfig
from vegas_tune import cli
from vegas_tune.export import recommendation_note, render_export
from vegas_tune.serving import vllm_speculative_config
from vegas_tune.profile import (MAX_YAML_BYTES, Tuned, profile_from_dict, profile_to_dict,
                                read_yaml)

# Alias-bomb depth and fan-out: 9 levels of 9 aliases each stand for 9**9 (387 million)
# strings once anything walks them.
BOMB_LEVELS = 9
BOMB_FANOUT = 9
# Refusing the bomb must take well under this, where expanding it would take minutes.
BOMB_SECONDS = 5.0
# The first bytes of every PNG file.
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


def write(tmp_path, data, name="p.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def at(data, loc):
    """The container holding ``loc``'s last key, and that key."""
    for key in loc[:-1]:
        data = data[key]
    return data, loc[-1]


def with_gamma(data: dict, gamma: int) -> dict:
    """``data`` with tuned.gamma changed consistently: acceptance, the headline schedule
    entry and the exports follow."""
    data["tuned"]["gamma"] = gamma
    data["results"]["acceptance_by_position"] = [0.5] * gamma
    data["results"]["mean_accepted_length"] = min(data["results"]["mean_accepted_length"],
                                                  gamma + 1)
    return sync_headline(data)


def not_recommended_dict(target: str = "vegas") -> dict:
    """The sample with its headline (batch 64) running vanilla: it lost to vanilla. With
    target ``vllm``, tuned as for the fork (``vllm_target``)."""
    data = sample_profile_dict() if target == "vegas" else vllm_target(sample_profile_dict())
    data["recommended"] = False
    # The throughput that speedup implies: 0.38 of vanilla's 28.9 tokens/s.
    data["results"].update(speedup=0.38, speedup_interval=[0.35, 0.41],
                           tokens_per_second=10.98, tokens_per_second_interval=[10.1, 11.8])
    return sync_headline(data)


def vllm_target(data: dict) -> dict:
    """The sample tuned for the vLLM fork: its configurations with the fork's fixed
    choices (softmax-weight scores, no window, its selection rule)."""
    data["target"] = "vllm"
    for config in [data["tuned"]] + [e.get(k) for e in data["schedule"]
                                     for k in ("config", "measured")]:
        if isinstance(config, dict):
            config.update(score="weight", window=0.0, rule="fork")
    return sync_headline(data)


# --- rules, each through `validate` --------------------------------------------------

NAN, INF = float("nan"), float("inf")

# (field location, bad value, expected "<field path>: <problem>" fragment)
BAD_VALUES = [
    # strict types: no silent coercion
    (("tuned", "gamma"), "1", "tuned.gamma: Input should be a valid integer"),
    (("tuned", "gamma"), 6.0, "tuned.gamma: Input should be a valid integer"),
    (("recommended",), "yes", "recommended: Input should be a valid boolean"),
    (("workload", "temperature"), True, "workload.temperature: Input should be a valid number"),
    (("results", "tokens_per_second"), "61.4", "results.tokens_per_second: Input should be"),
    (("model", "dummy"), 0, "model.dummy: Input should be a valid boolean"),
    # finite floats everywhere
    (("results", "tokens_per_second"), NAN, "results.tokens_per_second: Input should be a finite"),
    (("hardware", "gpu_memory_gb"), INF, "hardware.gpu_memory_gb: Input should be a finite"),
    (("steps", 0, "chosen", "window"), NAN, "steps[0].chosen.window: expected a finite number"),
    (("steps", 1, "within_noise", 0, "speedup"), -INF,
     "steps[1].within_noise[0].speedup: expected a finite number"),
    (("steps", 2, "predictions", 0, "predicted_tokens_per_second"), NAN,
     "steps[2].predictions[0].predicted_tokens_per_second: Input should be a finite"),
    (("results", "speedup_interval"), [2.05, INF], "results.speedup_interval[1]: Input should be a finite"),
    (("exports", "vllm", "serve_config", "max-model-len"), NAN,
     "exports.vllm.serve_config.max-model-len: expected a finite number"),
    (("steps", 0, "chosen", "window"), True, "steps[0].chosen.window: expected a number or a string"),
    # tuned values within the engine's limits
    (("tuned", "drafter"), "nonsense", "tuned.drafter: unknown value 'nonsense'; choose one of: vegas"),
    (("tuned", "gamma"), 100000, f"tuned.gamma: Input should be less than or equal to {MAX_GAMMA}"),
    (("tuned", "gamma"), 0, "tuned.gamma: Input should be greater than or equal to 1"),
    (("tuned", "sparsity_ratio"), 0.0, "tuned.sparsity_ratio: Input should be greater than 0"),
    (("tuned", "sparsity_ratio"), 1.5, "tuned.sparsity_ratio: Input should be less than or equal to 1"),
    (("tuned", "window"), 0.8, "tuned.window: Input should be less than or equal to 0.75"),
    (("tuned", "window"), -0.1, "tuned.window: Input should be greater than or equal to 0"),
    (("tuned", "min_tokens"), 0, "tuned.min_tokens: Input should be greater than or equal to 1"),
    (("tuned", "collect"), "first", "tuned.collect: unknown value 'first'; choose one of: two, all, last"),
    (("tuned", "score"), "cosine", "tuned.score: unknown value 'cosine'"),
    (("tuned", "granularity"), "head", "tuned.granularity: unknown value 'head'"),
    # workload numbers
    (("workload", "ctx"), 0, "workload.ctx: Input should be greater than or equal to 1"),
    (("workload", "batch_size"), -1, "workload.batch_size: Input should be greater than or equal to 1"),
    (("workload", "max_new_tokens"), 0, "workload.max_new_tokens: Input should be greater"),
    (("workload", "num_prompts"), 0, "workload.num_prompts: Input should be greater"),
    (("workload", "temperature"), -0.5, "workload.temperature: Input should be greater than or equal to 0"),
    # results
    (("results", "vanilla_tokens_per_second"), 0.0,
     "results.vanilla_tokens_per_second: Input should be greater than 0"),
    (("results", "speedup_interval"), [2.05, 2.12, 2.19],
     "results.speedup_interval: expected exactly two numbers [low, high], got 3"),
    (("results", "speedup_interval"), [2.2, 2.3],
     "results.speedup_interval: [2.2, 2.3] does not contain speedup 2.12"),
    (("results", "tokens_per_second_interval"), [62.6, 60.2],
     "results.tokens_per_second_interval: [62.6, 60.2] does not contain tokens_per_second"),
    # acceptance fits gamma: checked on each schedule entry (the headline is the last)
    (("results", "acceptance_by_position"), [0.9] * 5,
     "schedule[1].results.acceptance_by_position: has 5 entries; expected one per draft "
     "position, config.gamma = 6"),
    (("schedule", 0, "results", "acceptance_by_position"), [0.9] * 5,
     "schedule[0].results.acceptance_by_position: has 5 entries; expected one per draft "
     "position, measured.gamma = 6"),
    (("results", "acceptance_by_position"), [0.9] * 5 + [1.2],
     "results.acceptance_by_position[5]: Input should be less than or equal to 1"),
    (("results", "mean_accepted_length"), 0.5,
     "results.mean_accepted_length: Input should be greater than or equal to 1"),
    (("results", "mean_accepted_length"), 7.5,
     "schedule[1].results.mean_accepted_length: 7.5 exceeds config.gamma + 1 = 7"),
    (("results", "speedup_interval"), None,
     "results.speedup_interval: missing; 5 rounds give speedup an interval"),
    (("results", "selection_overhead"), 1.5, "results.selection_overhead: Input should be less"),
    (("results", "rounds"), 0, "results.rounds: Input should be greater than or equal to 1"),
    (("results", "confidence"), 1.0, "results.confidence: Input should be less than 1"),
    (("results", "confidence"), 0, "results.confidence: Input should be greater than 0"),
    (("steps", 2, "predictions", 1, "measured_speedup_interval"), [1.0, 2.0],
     "steps[2].predictions[1].measured_speedup_interval: [1, 2] does not contain "
     "measured_speedup 2.12"),
    (("steps", 2, "predictions", 1, "measured_speedup"), None,
     "steps[2].predictions[1].measured_speedup_interval: given without measured_speedup"),
    # a speculative entry needs its whole speedup interval above 1
    (("results", "speedup_interval"), [0.98, 2.19],
     "schedule[1].config: speculative, but the speedup interval [0.98, 2.19] does not lie "
     "wholly above 1"),
    (("schedule", 0, "config"), dict(sample_profile_dict()["tuned"]),
     "schedule[0].measured: only a vanilla entry has one"),
    # exports derived from tuned
    (("exports", "vegas", "window"), 0.0,
     "exports.vegas.window: 0.0 contradicts tuned, which gives 0.125"),
    (("exports", "vegas", "extra"), 1, "exports.vegas.extra: not derived from tuned"),
    (("exports", "vllm", "serve_config", "speculative-config", "sparse_attn_ratio"), 0.5,
     "exports.vllm.serve_config.speculative-config.sparse_attn_ratio: 0.5 contradicts tuned, "
     "which gives 0.05"),
    (("exports", "vllm", "serve_config", "speculative-config"), None,
     "exports.vllm.serve_config.speculative-config: None contradicts tuned, which gives "
     "{'method': 'sparse_attn'"),
    # exports serve the headline's batch size at the workload's context plus new tokens
    (("exports", "vllm", "serve_config", "max-num-seqs"), 8,
     "exports.vllm.serve_config.max-num-seqs: 8 contradicts the headline's batch_size and "
     "ctx + max_new_tokens, which gives 64"),
    (("exports", "vllm", "serve_config", "max-model-len"), 8192,
     f"exports.vllm.serve_config.max-model-len: 8192 contradicts the headline's batch_size "
     f"and ctx + max_new_tokens, which gives "
     f"{MAX_MODEL_LEN}"),
    (("exports", "vllm", "speculative_config_json"), '{"method": "sparse_attn"}',
     "exports.vllm.speculative_config_json: key 'num_speculative_tokens': missing"),
    (("exports", "vllm", "speculative_config_json"), "{not json",
     "exports.vllm.speculative_config_json: not valid JSON"),
]


@pytest.mark.parametrize("loc, value, expected", BAD_VALUES,
                         ids=[f"{'.'.join(map(str, loc))}={value!r}" for loc, value, _ in BAD_VALUES])
def test_validate_refuses_with_one_line_naming_the_field(tmp_path, capsys, loc, value, expected):
    data = sample_profile_dict()
    container, key = at(data, loc)
    container[key] = value
    if loc[0] == "results":
        sync_headline(data)  # the headline's results: the last schedule entry's too
    path = write(tmp_path, data)
    code, stdout, stderr = run(["validate", str(path)], capsys)
    assert code == 2 and stdout == ""
    assert stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"error: {path}: invalid profile: {expected}"), stderr


@pytest.mark.parametrize("change, expected", [
    (lambda d: d["results"].update(tokens_per_second=61.5),
     "results: differs from the last schedule entry's results; results repeat them"),
    (lambda d: d["tuned"].update(window=0.25),
     "tuned: differs from the last schedule entry's configuration; tuned repeats it"),
    (lambda d: d["workload"].update(batch_size=32),
     "workload.batch_size: 32, but the last schedule entry was measured at 64"),
    (lambda d: d["workload"].update(batch_sizes=[1, 32, 64]),
     "workload.batch_sizes: [1, 32, 64], but the schedule and not_tuned account for [1, 64]"),
    (lambda d: d["workload"].update(batch_sizes=[64, 1]),
     "workload.batch_sizes: must be ascending, without repeats"),
    (lambda d: d.update(recommended=False),
     "recommended: false, but the last schedule entry runs speculatively"),
])
def test_headline_must_repeat_the_last_schedule_entry(tmp_path, capsys, change, expected):
    data = sample_profile_dict()
    change(data)  # the top level only: the schedule is left as it was
    path = write(tmp_path, data)
    code, stdout, stderr = run(["validate", str(path)], capsys)
    assert code == 2 and stdout == "" and stderr.count("\n") == 1, stderr
    assert stderr.startswith(f"error: {path}: invalid profile: {expected}"), stderr


def test_every_speculative_entry_needs_its_speedup_interval_above_1():
    data = sample_profile_dict()
    entry = data["schedule"][0]  # batch 1: speedup 0.81x [0.79, 0.83], so vanilla
    entry["config"] = entry.pop("measured")
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert str(error.value).startswith(
        "mem: invalid profile: schedule[0].config: speculative, but the speedup interval "
        "[0.79, 0.83] does not lie wholly above 1; the tuner runs vanilla there")
    # 1.2 x vanilla's 31.0 tokens/s.
    entry["results"].update(speedup=1.2, speedup_interval=[1.01, 1.4], tokens_per_second=37.2,
                            tokens_per_second_interval=[31.4, 43.4])
    assert profile_from_dict(data).schedule[0].config.gamma == 6  # wholly above 1: valid


def test_recommended_says_whether_the_headline_runs_speculatively():
    data = not_recommended_dict()
    assert profile_from_dict(copy.deepcopy(data)).headline.config == "vanilla"
    data["recommended"] = True  # the headline entry still runs vanilla
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert str(error.value) == (
        "mem: invalid profile: recommended: true, but the last schedule entry runs vanilla; "
        "recommended says whether the largest tuned size runs speculatively")
    # An earlier entry running vanilla does not touch the recommendation.
    profile = profile_from_dict(sample_profile_dict())
    assert profile.schedule[0].config == "vanilla" and profile.recommended is True


def test_exports_contradicting_tuned_gamma_are_refused(tmp_path, capsys):
    data = with_gamma(sample_profile_dict(), 7)
    assert profile_from_dict(copy.deepcopy(data)).tuned.gamma == 7  # consistent: valid
    data["exports"]["vegas"]["gamma"] = 1
    code, _, stderr = run(["validate", str(write(tmp_path, data))], capsys)
    assert code == 2
    assert "invalid profile: exports.vegas.gamma: 1 contradicts tuned, which gives 7" in stderr


def test_speculative_json_contradicting_tuned_is_refused():
    data = with_gamma(sample_profile_dict(), 7)
    stale = vllm_speculative_config(Tuned(**{**data["tuned"], "gamma": 1}))
    data["exports"]["vllm"]["speculative_config_json"] = json.dumps(stale)
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert str(error.value) == (
        "mem: invalid profile: exports.vllm.speculative_config_json: key "
        "'num_speculative_tokens': 1 contradicts tuned, which gives 7; exports must be "
        "derived from tuned (re-run the tuner, or fix the value)")


@pytest.mark.parametrize("loc, value", [
    (("workload", "temperature"), 0),  # users write 0, not 0.0
    (("tuned", "window"), 0),
    (("results", "tokens_per_second_interval"), [60, 63]),
    (("results", "speedup_interval"), [2.05, 2.12 * (1 - 1e-9)]),  # a rounded end
    (("results", "acceptance_by_position"), [1, 1, 1, 0, 0, 0]),
    (("recommended",), False),  # running vanilla at the headline is always allowed
])
def test_sensible_values_are_accepted(tmp_path, capsys, loc, value):
    data = sample_profile_dict()
    container, key = at(data, loc)
    container[key] = value
    # The schedule's last entry and the exports follow the top level.
    data = with_gamma(data, data["tuned"]["gamma"]) if loc[0] == "tuned" else sync_headline(data)
    code, stdout, stderr = run(["validate", str(write(tmp_path, data))], capsys)
    assert code == 0, stderr
    assert stdout.count("\n") == 1 and ": valid (schema 5;" in stdout
    assert f"recommended {str(data['recommended']).lower()})" in stdout


def test_ints_stay_floats_where_floats_are_expected():
    data = sample_profile_dict()
    data["workload"]["temperature"] = 0
    profile = profile_from_dict(data)
    assert type(profile.workload.temperature) is float


def test_engine_and_profile_share_the_gamma_limit():
    SpecConfig(gamma=MAX_GAMMA)
    with pytest.raises(VegasError, match=f"between 1 and {MAX_GAMMA}"):
        SpecConfig(gamma=MAX_GAMMA + 1)
    assert profile_from_dict(with_gamma(sample_profile_dict(), MAX_GAMMA)).tuned.gamma == MAX_GAMMA
    with pytest.raises(VegasError, match="tuned.gamma: Input should be less than or equal"):
        profile_from_dict(with_gamma(sample_profile_dict(), MAX_GAMMA + 1))


def test_tuner_built_profiles_get_the_same_checks():
    """profile_from_dict is what the tuner calls before writing: the rules apply there."""
    data = sample_profile_dict()
    data["results"]["speedup"] = math.nan
    with pytest.raises(VegasError, match="<dict>: invalid profile: results.speedup: "):
        profile_from_dict(data)
    # The tuner may hand intervals over as tuples.
    data = sample_profile_dict()
    data["results"]["speedup_interval"] = (2.05, 2.19)
    data["schedule"][-1]["results"]["speedup_interval"] = (2.05, 2.19)
    profile = profile_from_dict(data)
    assert profile.results.speedup_interval == [2.05, 2.19]
    assert profile.headline.results.speedup_interval == [2.05, 2.19]


# --- YAML that must not be parsed ----------------------------------------------------

def test_aliases_are_refused_even_when_harmless(tmp_path, capsys):
    text = yaml.safe_dump(sample_profile_dict(), sort_keys=False)
    text = text.replace("speedup_interval:\n  - 2.05\n  - 2.19\n",
                        "speedup_interval: &s\n  - 2.05\n  - 2.19\n", 1)
    assert "&s" in text
    text = text.replace("measured_speedup_interval:\n    - 2.05\n    - 2.19\n",
                        "measured_speedup_interval: *s\n", 1)
    assert "*s" in text
    path = tmp_path / "alias.yaml"
    path.write_text(text)
    assert profile_from_dict(yaml.safe_load(text)).results.speedup == 2.12  # it is valid data
    code, _, stderr = run(["validate", str(path)], capsys)
    assert code == 2 and stderr.count("\n") == 1
    # The anchor comes first in the file, so it is what the one line names.
    assert f"{path}: YAML anchors (&name) are not allowed; write the values out" in stderr


def billion_laughs() -> str:
    lines = ['a0: &a0 "lol"']
    for level in range(1, BOMB_LEVELS + 1):
        items = ", ".join([f"*a{level - 1}"] * BOMB_FANOUT)
        lines.append(f"a{level}: &a{level} [{items}]")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("argv", [["validate"], ["show", "--json"], ["export"],
                                  ["export", "--target", "vegas", "--format", "json"]])
def test_alias_bomb_is_refused_quickly(tmp_path, capsys, argv):
    data = sample_profile_dict()
    text = yaml.safe_dump(data, sort_keys=False) + billion_laughs()
    path = tmp_path / "bomb.yaml"
    path.write_text(text)
    started = time.monotonic()
    code, stdout, stderr = run([*argv, str(path)], capsys)
    assert time.monotonic() - started < BOMB_SECONDS
    assert code == 2 and stdout == "" and stderr.count("\n") == 1
    assert "aliases" in stderr or "anchors" in stderr


def test_alias_bomb_is_refused_by_diff(tmp_path, capsys):
    good = write(tmp_path, sample_profile_dict(), "good.yaml")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(yaml.safe_dump(sample_profile_dict()) + billion_laughs())
    code, _, stderr = run(["diff", str(good), str(bomb)], capsys)
    assert code == 2 and "bomb.yaml" in stderr and stderr.count("\n") == 1


@pytest.mark.parametrize("text, fragment", [
    ("base: &b {x: 1}\n", "YAML anchors (&name) are not allowed"),
    ("base: {x: 1}\nmore:\n  <<: *b\n", "YAML aliases (*name) are not allowed"),
    ("[" * 100_000, "not valid YAML"),  # deeper than the composer can recurse
    ("n: " + "9" * 100_000 + "\n", "not valid YAML"),  # more digits than int() converts
    ("a: [1,\n", "not valid YAML: line"),
])
def test_read_yaml_refusals_are_one_line(text, fragment):
    with pytest.raises(VegasError) as error:
        read_yaml(text, "c.yaml")
    message = str(error.value)
    assert message.startswith("c.yaml: ") and fragment in message and "\n" not in message


def test_read_yaml_returns_plain_data():
    assert read_yaml("ctx: 8k\nnum-prompts: 3\nseed: 5\n", "c.yaml") == \
        {"ctx": "8k", "num-prompts": 3, "seed": 5}
    assert read_yaml("", "c.yaml") is None


def test_oversized_text_and_file_are_refused_before_parsing(tmp_path, capsys):
    huge = "# padding\n" * (MAX_YAML_BYTES // 10 + 1)
    with pytest.raises(VegasError, match="c.yaml: too large"):
        read_yaml(huge, "c.yaml")
    path = tmp_path / "huge.yaml"
    path.write_text(yaml.safe_dump(sample_profile_dict()) + huge)
    code, _, stderr = run(["validate", str(path)], capsys)
    assert code == 2 and f"{path}: too large" in stderr and stderr.count("\n") == 1


# --- export of a profile whose served entry runs vanilla ------------------------------

WARNING = ("runs vanilla at batch 64 (measured at 64: speedup 0.38x, interval [0.35, 0.41]): "
           "exporting vanilla decoding; pass --force to export the measured speculative "
           "settings")
# The vanilla serve config at the sample's headline size: no speculative key.
VANILLA_SERVE = {"model": MODEL_ID, "max-num-seqs": 64, "max-model-len": MAX_MODEL_LEN}


def test_not_recommended_vllm_export_is_vanilla_with_one_warning(tmp_path, capsys):
    path = write(tmp_path, not_recommended_dict("vllm"))
    code, stdout, stderr = run(["export", str(path), "--target", "vllm"], capsys)
    assert code == 0
    assert yaml.safe_load(stdout) == VANILLA_SERVE
    assert "speculative-config" not in yaml.safe_load(stdout)
    assert stderr == f"warning: {path} {WARNING}\n"


@pytest.mark.parametrize("target, fmt", [("vllm", "json"), ("vegas", "json"), ("vegas", "yaml")])
def test_not_recommended_export_is_null_where_there_is_no_serve_config(tmp_path, capsys,
                                                                       target, fmt):
    path = write(tmp_path, not_recommended_dict(target))
    code, stdout, stderr = run(["export", str(path), "--target", target, "--format", fmt],
                               capsys)
    assert code == 0 and stderr.count("\n") == 1 and "warning:" in stderr
    parse = json.loads if fmt == "json" else yaml.safe_load
    assert parse(stdout) is None


@pytest.mark.parametrize("target, key", [("vllm", "speculative-config"), ("vegas", "gamma")])
def test_force_exports_the_tuned_settings_with_a_note(tmp_path, capsys, target, key):
    path = write(tmp_path, not_recommended_dict(target))
    code, stdout, stderr = run(["export", str(path), "--target", target, "--force"], capsys)
    assert code == 0 and key in yaml.safe_load(stdout)
    assert stderr.count("\n") == 1
    assert stderr.startswith(f"note: {path} runs vanilla at batch 64 (measured at 64: "
                             "speedup 0.38x")
    assert "--force" in stderr


def test_export_to_a_file_is_vanilla_too(tmp_path, capsys):
    path = write(tmp_path, not_recommended_dict("vllm"))
    out = tmp_path / "serve.yaml"
    code, stdout, stderr = run(["export", str(path), "--out", str(out)], capsys)
    assert code == 0 and stdout == ""
    assert yaml.safe_load(out.read_text()) == VANILLA_SERVE
    assert "warning:" in stderr


def test_recommended_export_prints_no_warning(tmp_path, capsys):
    path = write(tmp_path, vllm_target(sample_profile_dict()))
    code, stdout, stderr = run(["export", str(path)], capsys)
    assert code == 0 and stderr == ""
    assert yaml.safe_load(stdout)["speculative-config"]["num_speculative_tokens"] == 6


def test_render_export_force_parameter():
    profile = profile_from_dict(not_recommended_dict())
    assert yaml.safe_load(render_export(profile, "vllm", "yaml")) == VANILLA_SERVE
    forced = yaml.safe_load(render_export(profile, "vllm", "yaml", force=True))
    assert forced["speculative-config"] == vllm_speculative_config(profile.tuned)
    assert forced["max-num-seqs"] == 64
    assert json.loads(render_export(profile, "vegas", "json", force=True))["gamma"] == 6


def test_vanilla_entry_below_a_speculative_headline_is_exported_as_vanilla():
    # The sample runs vanilla for 1 to 63 (measured at 1) and speculatively at 64.
    profile = profile_from_dict(sample_profile_dict())
    assert recommendation_note(profile, "p.yaml", False) is None
    assert recommendation_note(profile, "p.yaml", False, serve_batch=64) is None
    assert recommendation_note(profile, "p.yaml", False, serve_batch=10) == (
        "warning: p.yaml runs vanilla at batch 10 (measured at 1: speedup 0.81x, interval "
        "[0.79, 0.83]): exporting vanilla decoding; pass --force to export the measured "
        "speculative settings")
    served = yaml.safe_load(render_export(profile, "vllm", "yaml", serve_batch=10))
    assert served == {**VANILLA_SERVE, "max-num-seqs": 10}
    forced = yaml.safe_load(render_export(profile, "vllm", "yaml", force=True, serve_batch=10))
    assert forced["speculative-config"] == vllm_speculative_config(profile.schedule[0].measured)


def test_cut_short_vanilla_headline_without_figures_exports_vanilla():
    """A run cut short may leave a one-round entry with only its own throughput."""
    data = sample_profile_dict()
    data["recommended"] = False
    results = data["results"]
    data["results"] = {key: results[key] for key in (
        "tokens_per_second", "mean_accepted_length", "acceptance_by_position",
        "selection_overhead", "confidence")}
    data["results"]["rounds"] = 1
    data["cut_short"] = ["bench: stopped by --time-budget after one round"]
    profile = profile_from_dict(sync_headline(data))
    assert profile.results.speedup is None and profile.results.speedup_interval is None
    assert yaml.safe_load(render_export(profile, "vllm", "yaml")) == VANILLA_SERVE
    assert recommendation_note(profile, "p.yaml", False) == (
        "warning: p.yaml runs vanilla at batch 64 (measured at 64: not measured against "
        "vanilla): exporting vanilla decoding; pass --force to export the measured "
        "speculative settings")


# --- show, diff and validate on schema 5 ---------------------------------------------

def test_show_prints_results_with_their_intervals(tmp_path, capsys):
    path = write(tmp_path, sample_profile_dict())
    code, stdout, _ = run(["show", str(path)], capsys)
    assert code == 0
    assert "61.4 tok/s [60.2, 62.6]" in stdout
    assert "vanilla 28.9 tok/s [28.5, 29.3]" in stdout
    assert ("speedup 2.12x [2.05, 2.19] over vanilla, 1.30x [1.26, 1.34] over the best "
            "streaming configuration" in stdout)
    assert "means of 5 interleaved rounds, 95% confidence" in stdout


def test_validate_success_is_one_line_with_the_speedup_interval(tmp_path, capsys):
    path = write(tmp_path, sample_profile_dict())
    code, stdout, _ = run(["validate", str(path)], capsys)
    assert code == 0
    assert stdout.count("\n") == 1 and stdout.endswith("; recommended true)\n"), stdout
    assert stdout.startswith(f"{path}: valid (schema 5; "), stdout
    # The schedule's ranges, then the headline (batch 64) with its speedup interval.
    assert "1-63: vanilla, 64 and above: gamma 6" in stdout, stdout
    assert "256 slots, gamma 6 (ratio 0.05" in stdout and "speedup 2.12x [2.05, 2.19]" in stdout, stdout


def test_diff_compares_schema_3_profiles(tmp_path, capsys):
    old = write(tmp_path, sample_profile_dict(), "old.yaml")
    newer = sample_profile_dict()
    # Vanilla got faster (61.4 / 1.5 = 40.93 tokens/s): the speedup fell, the throughput stayed.
    newer["results"].update(speedup=1.5, speedup_interval=[1.4, 1.6],
                            vanilla_tokens_per_second=40.93,
                            vanilla_tokens_per_second_interval=[40.5, 41.4])
    new = write(tmp_path, sync_headline(newer), "new.yaml")
    code, stdout, _ = run(["diff", str(old), str(new), "--tolerance", "0.1"], capsys)
    assert code == 1
    assert "results.speedup_interval: [2.05, 2.19] -> [1.4, 1.6]" in stdout
    assert "schedule[1].results.speedup_interval: [2.05, 2.19] -> [1.4, 1.6]" in stdout
    assert "REGRESSION: batch 64: results.speedup (speedup over vanilla) fell" in stdout
    code, stdout, _ = run(["diff", str(old), str(old)], capsys)
    assert code == 0 and stdout == "no changes\n"


def test_json_show_round_trips(tmp_path, capsys):
    data = sample_profile_dict()
    code, stdout, _ = run(["show", "--json", str(write(tmp_path, data))], capsys)
    assert code == 0
    assert json.loads(stdout) == profile_to_dict(profile_from_dict(data))


# --- issue 42: figures derivable from others agree; keys are given once -----------------

@pytest.mark.parametrize("change, expected", [
    # The profile: a speedup its own throughputs contradict (61.4 / 28.9 = 2.12).
    (lambda d: d["results"].update(speedup=1.5, speedup_interval=[1.4, 1.6]),
     "speedup: 1.5 disagrees with tokens_per_second / vanilla_tokens_per_second = 2.125"),
    (lambda d: d["workload"].update(dataset_sha256="9a7b"),
     "workload.dataset_sha256: '9a7b' is not a SHA-256"),
    (lambda d: d["model"].update(weights_sha256="Z" * 64),
     "model.weights_sha256: '" + "Z" * 64 + "' is not a SHA-256"),
    (lambda d: d["results"].update(mean_accepted_length=7.5),
     "mean_accepted_length: 7.5 exceeds config.gamma + 1 = 7"),
])
def test_validate_refuses_figures_that_contradict_each_other(tmp_path, capsys, change,
                                                              expected):
    data = sample_profile_dict()
    change(data)
    path = write(tmp_path, sync_headline(data))
    code, _, err = run(["validate", str(path)], capsys)
    assert code == 2 and err.count("\n") == 1 and expected in err, err


def test_validate_refuses_a_last_range_beyond_its_tuned_size(tmp_path, capsys):
    data = sample_profile_dict()
    data["schedule"][-1]["batch_max"] = 100
    code, _, err = run(["validate", str(write(tmp_path, data))], capsys)
    assert code == 2 and "schedule[1].batch_max: 100; expected 64" in err, err


def test_validate_refuses_a_key_given_twice_with_its_lines(tmp_path, capsys):
    path = write(tmp_path, sample_profile_dict())
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines + ["recommended: false"]) + "\n")
    first = lines.index("recommended: true") + 1
    code, _, err = run(["validate", str(path)], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"key 'recommended' is given twice (lines {first} and {len(lines) + 1})" in err


def test_diff_refuses_profiles_of_another_workload_and_warns_of_other_hardware(
        tmp_path, capsys):
    old = write(tmp_path, sample_profile_dict(), "old.yaml")
    other = sample_profile_dict()
    other["workload"]["dataset"] = "code"
    other_path = write(tmp_path, other, "other.yaml")
    code, stdout, err = run(["diff", str(old), str(other_path)], capsys)
    assert code == 2 and stdout == "" and err.count("\n") == 1, err
    assert "do not compare: workload.dataset: mixed vs code" in err and "--force" in err
    code, stdout, _ = run(["diff", str(old), str(other_path), "--force"], capsys)
    assert code == 0
    assert stdout.splitlines()[0] == "WARNING: not like for like: workload.dataset: mixed vs code"
    moved = sample_profile_dict()
    moved["hardware"]["gpu_name"] = "NVIDIA H100 80GB HBM3"
    code, stdout, _ = run(["diff", str(old), str(write(tmp_path, moved, "moved.yaml"))], capsys)
    assert code == 0 and stdout.splitlines()[0].startswith(
        "WARNING: not like for like: hardware.gpu_name: NVIDIA H200 vs NVIDIA H100")


def test_show_names_the_last_range_as_open_ended(tmp_path, capsys):
    code, stdout, _ = run(["show", str(write(tmp_path, sample_profile_dict()))], capsys)
    assert code == 0 and "batch 64 and above: " in stdout and "64-64" not in stdout, stdout


# --- show: a profile tuned at several contexts (issue 44) ------------------------------

def test_show_tabulates_batch_ranges_by_context_band(tmp_path, capsys):
    code, stdout, _ = run(["show", str(write(tmp_path, uneven_contexts_dict()))], capsys)
    assert code == 0, stdout
    lines = stdout.splitlines()
    assert "ctx 4096, 8192, batch 1, 8, 64" in lines[1]
    assert "tuned for vegas (batch 64, ctx 8192)" in lines[2]
    heading = next(index for index, line in enumerate(lines)
                   if line.startswith("    batch ") and "ctx 1-5792" in line)
    columns = lines[heading].split("  ")
    assert [c.strip() for c in columns if c.strip()] == [
        "batch", "ctx 1-5792 (tuned 4096)", "ctx 5793 and above (tuned 8192)"]
    rows = [[cell.strip() for cell in line.split("  ") if cell.strip()]
            for line in lines[heading + 1:heading + 4]]
    assert rows == [
        ["1-1", "vanilla (K 6: 0.81x [0.79, 0.83])", "vanilla (K 6: 0.81x [0.79, 0.83])"],
        ["2-8", "K 4: 1.60x [1.50, 1.70]", "K 4: 1.60x [1.50, 1.70]"],
        # Batch 64 ran out of memory at 4096: 9 and above run the entry measured at 8.
        ["9 and above", "K 4: 1.60x [1.50, 1.70] (at 8)", "K 6: 2.12x [2.05, 2.19]"],
    ], stdout
    assert "(at N): a size of the row was not tuned at that context" in lines[heading + 4]
    assert "    not tuned: batch 64 at ctx 4096: out of memory" in lines
    # Cells sit under their column titles.
    starts = [lines[heading].index(title) for title in ("ctx 1-5792", "ctx 5793")]
    assert [lines[heading + 3].index(cell) for cell in ("K 4:", "K 6:")] == starts


def test_show_plot_writes_a_png_heat_map_for_one_context_or_several(tmp_path, capsys):
    for name, data in (("one", sample_profile_dict()), ("several", uneven_contexts_dict())):
        plot = tmp_path / "plots" / f"{name}.png"
        code, stdout, err = run(["show", str(write(tmp_path, data, f"{name}.yaml")),
                                 "--plot", str(plot)], capsys)
        assert code == 0 and f"wrote {plot}" in err, err
        assert plot.read_bytes().startswith(PNG_SIGNATURE)
        assert "recommended: true" in stdout  # the text is printed as well
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == ["one.png", "several.png"]


def test_schedule_heat_map_has_a_cell_per_size_and_context():
    from vegas_tune.report import schedule_heatmap_figure

    axes = schedule_heatmap_figure(uneven_contexts_dict()).axes[0]
    texts = sorted(t.get_text() for t in axes.texts)
    assert texts == sorted(["K 0\n(best 0.81x)", "K 0\n(best 0.81x)", "K 4\n1.60x",
                            "K 4\n1.60x", "not tuned", "K 6\n2.12x"])
    assert [t.get_text() for t in axes.get_xticklabels()] == ["4096", "8192"]
    assert [t.get_text() for t in axes.get_yticklabels()] == ["1", "8", "64"]
    colours = axes.images[0].get_array()
    # Vanilla cells are coloured as no speedup; the size not tuned has no colour.
    assert colours[0, 0] == 1.0 and colours[2, 1] == pytest.approx(2.12)
    assert colours.mask[2, 0] and not colours.mask[2, 1]


@pytest.mark.parametrize("plot, fragment", [
    ("folder", "is a folder; give the heat map's file name"),
    ("heat.jpg", "the heat map is a PNG; give a file name ending in .png"),
    ("p.yaml/heat.png", "is a file, not a folder"),
])
def test_show_plot_refuses_a_bad_path_leaving_nothing(tmp_path, capsys, monkeypatch, plot,
                                                      fragment):
    write(tmp_path, uneven_contexts_dict())
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    code, stdout, err = run(["show", "p.yaml", "--plot", plot], capsys)
    assert code == 2 and stdout == "" and err.count("\n") == 1 and fragment in err, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_doctor_prints_free_memory(capsys):
    code, stdout, _ = run(["doctor"], capsys)
    assert code in (0, 2)
    (line,) = [line for line in stdout.splitlines() if line.startswith("memory free")]
    assert line.split()[2].replace(".", "").isdigit() and "GiB" in line, line
