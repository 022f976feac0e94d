"""Checks before any model is loaded: setting values and where they came from, paths,
datasets, the memory a model needs, and the defaults that --help shows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from vegas_core.config import preset_config
from vegas_core.errors import VegasError
from vegas_core.loading import memory
from vegas_core.loading.header import read_model_config
from vegas_tune import cli, preflight
from vegas_tune.datasets import check_dataset

GIB = 2**30


# ---- values ----------------------------------------------------------------------------

@pytest.mark.parametrize("name, value, message", [
    ("batch_size", 0, "--batch-size must be >= 1, got 0"),
    ("num_prompts", -3, "--num-prompts must be >= 1"),
    ("probe_gamma", 65, "--probe-gamma must be <= 64"),
    ("seed", 2**32, "--seed must be between 0 and 4294967295"),
    ("candidates", 0, "--candidates must be >= 1"),
    ("temperature", -0.1, "--temperature must be >= 0"),
    ("time_budget", 0.0, "--time-budget must be > 0"),
    ("time_budget", float("inf"), "--time-budget must be a finite number"),
    ("precision", 0.0, "--precision must be in (0, 1)"),
    ("max_rounds", 2, "--max-rounds must be >= 3"),
    ("log_level", "chatty", "--log-level 'chatty'"),
])
def test_bad_values(name, value, message):
    with pytest.raises(VegasError) as error:
        preflight.check_values({name: value})
    assert message in str(error.value)


def test_good_and_unset_values_pass():
    preflight.check_values({"batch_size": 1, "budgets": (64, 256), "ctx": 1024,
                            "target": "vllm", "temperature": 0.0,
                            "time_budget": None, "num_prompts": None, "seed": 0,
                            "log_level": "debug", "precision": 0.02, "max_rounds": 8})


def test_value_errors_name_their_source():
    with pytest.raises(VegasError, match=r"^VEGAS_TUNE_PRECISION must be"):
        preflight.check_values({"precision": 3.0}, {"precision": "VEGAS_TUNE_PRECISION"})
    with pytest.raises(VegasError, match=r"^tune.yaml: budgets 4096,8192: every budget covers"):
        preflight.check_values({"budgets": (4096, 8192), "ctx": 4096},
                               {"budgets": "tune.yaml: budgets"})


# ---- settings resolution ---------------------------------------------------------------

def test_labels_say_where_each_setting_came_from(tmp_path, monkeypatch):
    config = tmp_path / "c.yaml"
    config.write_text("num-prompts: 3\nbudgets: [256, 64]\n")
    monkeypatch.setenv("VEGAS_TUNE_SEED", "6")
    s = cli.resolve_settings({"ctx": "8k"}, config)
    assert s.labels["ctx"] == "--ctx"
    assert s.labels["seed"] == "VEGAS_TUNE_SEED"
    assert s.labels["num_prompts"] == f"{config}: num-prompts"
    assert s.labels["model"] == "--model"  # a default: the flag is how to change it
    assert s["budgets"] == (64, 256)  # a YAML list is taken as the budgets, ascending


@pytest.mark.parametrize("text, message", [
    ("batch-size: true\n", "batch-size 'True' is not a whole number"),
    ("precision: abc\n", "precision 'abc' is not a number"),
    ("resume: maybe\n", "resume 'maybe' is not a boolean"),
    ("budgets: 64,0.5\n", "budgets '64,0.5': give comma-separated slot counts"),
    ("target: sglang\n", "target 'sglang': choose one of vllm, vegas"),
])
def test_bad_config_values_name_the_file_and_key(text, message, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    with pytest.raises(VegasError) as error:
        cli.resolve_settings({}, config)
    assert str(error.value).startswith(f"{config}: {message}")


def test_env_value_that_is_not_a_number(monkeypatch):
    monkeypatch.setenv("VEGAS_TUNE_MAX_NEW_TOKENS", "lots")
    with pytest.raises(VegasError, match="^VEGAS_TUNE_MAX_NEW_TOKENS 'lots' is not a whole number"):
        cli.resolve_settings({}, None)


# ---- paths -----------------------------------------------------------------------------

def test_folder_that_can_be_created_is_not_created(tmp_path):
    folder = tmp_path / "a" / "b"
    preflight.check_writable_folder(folder, "--out", folder / "p.yaml")
    assert not (tmp_path / "a").exists()
    assert list(tmp_path.iterdir()) == []  # the probe file is gone too


def test_unwritable_and_blocked_folders(tmp_path):
    with pytest.raises(VegasError, match=r"^--out /sys/x/p.yaml: cannot write in /sys"):
        preflight.check_out(Path("/sys/x/p.yaml"), "--out")
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(VegasError, match="is a file, not a folder"):
        preflight.check_out(blocker / "sub" / "p.yaml", "--out")
    with pytest.raises(VegasError, match="is a folder; give the profile's file name"):
        preflight.check_out(tmp_path, "--out")


def test_storage_checks(tmp_path):
    preflight.check_storage(str(tmp_path / "new" / "s.journal"), "--storage")
    existing = tmp_path / "s.journal"
    existing.write_text("")
    preflight.check_storage(str(existing), "--storage")
    with pytest.raises(VegasError, match="is a folder"):
        preflight.check_storage(str(tmp_path), "--storage")
    with pytest.raises(VegasError, match=r"/sys"):
        preflight.check_storage("/sys/x.journal", "--storage")
    preflight.check_storage(f"sqlite:///{tmp_path}/t.db", "--storage")
    preflight.check_storage("sqlite:///:memory:", "--storage")
    with pytest.raises(VegasError, match="folder /nonexistent does not exist"):
        preflight.check_storage("sqlite:////nonexistent/t.db", "--storage")
    # Other databases: the tuner connects and reports.
    preflight.check_storage("postgresql://user@nohost/db", "--storage")


# ---- datasets --------------------------------------------------------------------------

def test_dataset_checks_need_no_tokenizer(tmp_path):
    check_dataset("mixed")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(VegasError, match="has no records"):
        check_dataset(str(empty))
    with pytest.raises(VegasError, match="unsupported dataset file type '.txt'"):
        (tmp_path / "d.txt").write_text("x")
        check_dataset(str(tmp_path / "d.txt"))
    with pytest.raises(VegasError, match="dataset file not found"):
        check_dataset(str(tmp_path / "missing.csv"))


def test_dataset_with_blank_lines_only_has_no_records(tmp_path):
    from vegas_tune.datasets import load_prompts

    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    with pytest.raises(VegasError, match="has no records"):
        load_prompts(None, str(blank), 32, 1)


# ---- memory ----------------------------------------------------------------------------

def test_memory_estimate_from_the_config():
    config = preset_config("qwen3-8b")
    assert memory.weight_bytes(config, torch.float32) == config.num_parameters() * 4
    assert memory.weight_bytes(config, torch.bfloat16) == config.num_parameters() * 2
    # K and V, 36 layers, 8 KV heads of 128, 1000 tokens, 2 sequences, 2 bytes.
    assert memory.kv_cache_bytes(config, torch.bfloat16, 1000, 2) == 2 * 36 * 8 * 128 * 1000 * 2 * 2


def test_model_that_does_not_fit_is_refused_with_the_smaller_dtype_suggested(monkeypatch):
    config = preset_config("qwen3-8b")  # 8.2 B parameters: 30.5 GiB in float32
    monkeypatch.setattr(memory, "available_bytes", lambda device: 24 * GIB)
    with pytest.raises(VegasError) as error:
        memory.check_model_fits(config, torch.device("cpu"), torch.float32, staging=False)
    message = str(error.value)
    assert "dummy:qwen3-8b in float32 needs about 30.5 GiB" in message
    assert "only 24.0 GiB is free on the CPU" in message and "--dtype bfloat16" in message
    memory.check_model_fits(config, torch.device("cpu"), torch.bfloat16, staging=False)
    monkeypatch.setattr(memory, "available_bytes", lambda device: 8 * GIB)
    with pytest.raises(VegasError) as error:
        memory.check_model_fits(config, torch.device("cpu"), torch.float32, staging=False,
                                extra_bytes=GIB, extra_what="KV cache", extra_fix="a smaller --ctx")
    assert "--dtype" not in str(error.value)  # bfloat16 would not fit either
    assert "KV cache 1.0 GiB" in str(error.value) and "a smaller --ctx" in str(error.value)


def test_unknown_free_memory_is_not_a_refusal(monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device: None)
    memory.check_model_fits(preset_config("qwen3-8b"), torch.device("cpu"), torch.float32)


def test_free_memory_of_this_machine_is_known():
    free = memory.available_bytes(torch.device("cpu"))
    assert free is not None and 0 < free


def test_load_model_refuses_before_allocating(monkeypatch):
    from vegas_core import load_model

    monkeypatch.setattr(memory, "available_bytes", lambda device: 1024)
    with pytest.raises(VegasError, match="dummy:tiny in float32 needs about"):
        load_model("dummy:tiny", device="cpu", dtype="float32")


def test_config_of_a_hugging_face_folder_is_read_without_weights(tmp_path):
    hf = dict(model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=1024)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    config = read_model_config(str(tmp_path))
    assert config.num_layers == 2 and config.max_position_embeddings == 1024
    assert read_model_config("owner/not-on-this-disk") is None  # may download: load_model


def test_config_of_a_gguf_file_is_read_from_its_header(smollm_path):
    config = read_model_config(str(smollm_path))
    assert config.max_position_embeddings == 8192 and config.num_layers == 30
    with pytest.raises(VegasError, match="not found"):
        read_model_config(str(smollm_path.parent / "missing.gguf"))


# ---- --help shows every default --------------------------------------------------------

def help_lines(argv, capsys, monkeypatch) -> dict[str, str]:
    """``--option`` -> its help line, from a help screen wide enough not to wrap."""
    monkeypatch.setenv("COLUMNS", "1000")
    with pytest.raises(SystemExit):
        cli.main(argv)
    text = capsys.readouterr().out
    found = {}
    for line in text.splitlines():
        match = re.match(r"^\W*(--[a-z-]+)", line)
        if match:
            found[match.group(1)] = line
    return found


def shown_default(value) -> str | None:
    if value is None:
        return None
    if isinstance(value, tuple):
        return ",".join(map(str, value))  # as the flag takes it: --budgets 128,256
    return str(value).lower() if isinstance(value, bool) else str(value)


def test_tune_help_shows_every_default(capsys, monkeypatch):
    lines = help_lines(["tune", "--help"], capsys, monkeypatch)
    for name, (default, _) in cli.TUNE_DEFAULTS.items():
        line = lines[preflight.flag(name)]
        expected = shown_default(default)
        if expected is None:
            assert "[default: " in line, line
        else:
            assert f"[default: {expected}]" in line, line
    assert all("[default: " in line for flag, line in lines.items() if flag != "--help")


@pytest.mark.parametrize("argv", [["bench", "--help"]])
def test_bench_help_shows_every_default(argv, capsys, monkeypatch):
    lines = help_lines(argv, capsys, monkeypatch)
    assert "[default: the batch size]" in lines["--num-prompts"]
    assert all("[default: " in line for flag, line in lines.items() if flag != "--help")


def test_generate_help_shows_every_default(capsys, monkeypatch):
    from vegas_core.cli import app, run_app

    monkeypatch.setenv("COLUMNS", "1000")
    run_app(app, ["generate", "--help"], prog_name="vegas")
    text = capsys.readouterr().out
    options = [line for line in text.splitlines() if re.match(r"^\W*--[a-z]", line)]
    assert len(options) > 10
    assert all("[default: " in line for line in options if "--help" not in line)
