"""Bad input: one line on stderr, exit code 2, a traceback only with --debug."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.test_profile import sample_profile_dict
from vegas_core.cli import app, run_app


def run(argv, capsys):
    code = run_app(app, argv, prog_name="vegas")
    err = capsys.readouterr().err
    return code, err


def assert_one_line_error(code, err, *fragments):
    assert code == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.fixture
def bad_models(tmp_path, smollm_path):
    import gguf

    empty = tmp_path / "empty"
    empty.mkdir()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm_path.read_bytes()[:30_000_000])
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    not_gguf = tmp_path / "weights.gguf"
    not_gguf.write_text("this is not a model")
    phi = tmp_path / "phi3.gguf"
    writer = gguf.GGUFWriter(str(phi), "phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gpt2_dir = tmp_path / "gpt2"
    gpt2_dir.mkdir()
    (gpt2_dir / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": 10}))
    return dict(empty=empty, truncated=truncated, corrupt=corrupt, not_gguf=not_gguf,
                phi=phi, gpt2=gpt2_dir)


@pytest.mark.parametrize("case, fragments", [
    ("missing", ["not found"]),
    ("empty", ["holds no model"]),
    ("truncated", ["truncated or corrupt"]),
    ("corrupt", ["truncated or corrupt"]),
    ("not_gguf", ["not a GGUF file"]),
    ("phi", ["unsupported architecture 'phi3'"]),
    ("gpt2", ["unsupported architecture 'gpt2'"]),
])
def test_bad_model_paths(case, fragments, bad_models, tmp_path, capsys):
    path = tmp_path / "no-such-model.gguf" if case == "missing" else bad_models[case]
    code, err = run(["generate", "--model", str(path), "--prompt", "hi"], capsys)
    assert_one_line_error(code, err, *fragments)


def test_unknown_dummy_preset(capsys):
    code, err = run(["generate", "--model", "dummy:gpt-5", "--prompt", "hi"], capsys)
    assert_one_line_error(code, err, "unknown dummy preset 'gpt-5'", "qwen3-8b")


def test_prompt_longer_than_the_model_allows(tmp_path, capsys):
    long_prompt = tmp_path / "long.txt"
    long_prompt.write_text("x" * 9000)  # the dummy byte tokenizer: one token per byte
    code, err = run(["generate", "--model", "dummy:smollm2-135m", "--prompt-file",
                     str(long_prompt)], capsys)
    assert_one_line_error(code, err, "9000 tokens", "maximum of 8192 positions")


@pytest.mark.parametrize("argv, fragment", [
    (["generate", "--prompt", "a", "--prompt-file", "b"], "exactly one of"),
    (["generate", "--prompt-file", "/no/such/prompt.txt"], "prompt file not found"),
    (["generate", "--prompt", "a", "--max-new-tokens", "many"], "--max-new-tokens"),
    (["generate", "--prompt", "a", "--dtype", "float8"], "unknown dtype"),
])
def test_bad_options(argv, fragment, capsys):
    code, err = run(argv, capsys)
    assert_one_line_error(code, err, fragment)


def test_debug_shows_the_traceback(capsys):
    code, err = run(["generate", "--model", "dummy:nope", "--prompt", "a", "--debug"], capsys)
    assert code == 2 and "Traceback" in err and "error: unknown dummy preset" in err


def test_installed_entry_point_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "vegas_core.cli", "generate", "--model",
                           str(tmp_path / "missing"), "--prompt", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and "Traceback" not in proc.stderr


# ---- every user error: exit 2, exactly one line naming the flag or variable -----------

def assert_only_line(code, err, *fragments, absent=()):
    """Exit 2 and stderr is exactly one ``error:`` line (no warning, no second line)."""
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    for fragment in absent:
        assert fragment not in lines[0], lines[0]


def test_speculative_option_without_drafter_is_refused(capsys):
    code, err = run(["generate", "--model", "dummy:tiny", "--prompt", "a", "--sparsity", "1.5"],
                    capsys)
    assert_only_line(code, err, "--sparsity")
    # A valid value is refused too: without --drafter it would be silently ignored.
    code, err = run(["generate", "--model", "dummy:tiny", "--prompt", "a", "--sparsity", "0.5"],
                    capsys)
    assert_only_line(code, err, "--sparsity applies only to speculative decoding", "--drafter")
    code, err = run(["generate", "--model", "dummy:tiny", "--prompt", "a", "--gamma", "3"],
                    capsys)
    assert_only_line(code, err, "--gamma", "--drafter")


def test_speculative_option_out_of_range_names_the_flag(capsys):
    code, err = run(["generate", "--model", "dummy:tiny", "--prompt", "a", "--drafter", "vegas",
                     "--sparsity", "1.5"], capsys)
    assert_only_line(code, err, "--sparsity")


def test_prompt_file_that_is_not_utf8_is_refused(tmp_path, capsys):
    prompt = tmp_path / "latin1.txt"
    prompt.write_bytes("café au lait".encode("latin-1"))
    code, err = run(["generate", "--model", "dummy:tiny", "--prompt-file", str(prompt)], capsys)
    assert_only_line(code, err, "--prompt-file", "not UTF-8", "offset 3")


def test_model_too_big_for_memory_is_refused_before_loading(tmp_path):
    # In a child process with its address space capped: were the check missing, the
    # 30 GiB allocation would fail there (exit 1) instead of the kernel killing pytest.
    script = tmp_path / "run.py"
    script.write_text(
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (16 * 2**30, 16 * 2**30))\n"
        "import vegas_core.loading.memory as memory\n"
        "memory.available_bytes = lambda device: 24 * 2**30  # a 24 GiB machine\n"
        "from vegas_core.cli import app, run_app\n"
        "sys.exit(run_app(app, ['generate', '--model', 'dummy:qwen3-8b', '--prompt', 'hi',\n"
        "                       '--device', 'cpu', '--dtype', 'float32'], prog_name='vegas'))\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300)
    assert_only_line(proc.returncode, proc.stderr, "dummy:qwen3-8b in float32 needs about 30.5 GiB",
                     "only 24.0 GiB is free", "--dtype bfloat16")


# ---- vegas-tune -----------------------------------------------------------------------

TUNE = ["--model", "dummy:tiny", "--ctx", "512", "--device", "cpu"]


@pytest.fixture
def no_tuning(monkeypatch):
    """Bad input must be refused before ``run_tune`` loads a model or runs a step."""
    def run_tune(*args, **kwargs):
        raise AssertionError("run_tune was reached: the input was not checked up front")

    monkeypatch.setattr("vegas_tune.pipeline.run_tune", run_tune)
    for name in list(os.environ):
        if name.startswith("VEGAS_TUNE_"):
            monkeypatch.delenv(name)


def tune(argv, capsys):
    from vegas_tune import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("argv, fragments", [
    (["--storage", "/sys/x.journal"], ["--storage /sys/x.journal", "cannot write"]),
    (["--out", "/sys/x/p.yaml"], ["--out /sys/x/p.yaml", "cannot write"]),
    (["--storage", "sqlite:////nonexistent/t.db"], ["--storage", "/nonexistent does not exist"]),
    (["--budgets", "64,x"], ["--budgets '64,x': give comma-separated slot counts"]),
    (["--budgets", "8192"], ["--budgets 8192: every budget covers the whole 512-token prompt"]),
    (["--target", "tgi"], ["--target 'tgi': choose one of vllm, vegas"]),
    (["--temperature", "-0.5"], ["--temperature must be >= 0"]),
    (["--time-budget", "0"], ["--time-budget must be > 0"]),
    (["--seed", "-1"], ["--seed must be between 0 and"]),
    (["--candidates", "0"], ["--candidates must be >= 1"]),
    (["--probe-gamma", "100"], ["--probe-gamma must be <= 64"]),
    (["--precision", "1.5"], ["--precision must be in (0, 1)"]),
    (["--log-level", "LOUD"], ["--log-level 'LOUD'"]),
    (["--device", "tpu"], ["--device", "unknown device 'tpu'"]),
    (["--dtype", "float8"], ["--dtype", "unknown dtype 'float8'"]),
    (["--ctx", "20k"], ["--ctx 20480 + --max-new-tokens 64", "maximum of 16384 positions"]),
    # A list of contexts: each as one, none twice; positions checked at the longest,
    # budgets against the shortest.
    (["--ctx", "4k,4096"], ["--ctx '4k,4096': 4096 tokens is given twice"]),
    (["--ctx", "256,lots"], ["--ctx '256,lots' is not a token count or a comma-separated"]),
    (["--ctx", "256,,512"], ["--ctx '256,,512' is not a token count"]),
    (["--ctx", "256,8"], ["--ctx must be at least 16 tokens, got 8"]),
    (["--ctx", "512,20k"], ["--ctx 20480 + --max-new-tokens 64", "maximum of 16384 positions"]),
    (["--ctx", "16,512", "--budgets", "32,64"],
     ["--budgets 32,64: every budget covers the whole 16-token prompt of --ctx"]),
])
def test_bad_tune_settings_are_refused_up_front(argv, fragments, no_tuning, tmp_path, capsys):
    out = [] if "--out" in argv else ["--out", str(tmp_path / "p.yaml")]
    code, err = tune([*TUNE, *out, *argv], capsys)
    assert_only_line(code, err, *fragments)


def test_bench_batch_size_zero(no_tuning, capsys):
    code, err = tune(["bench", *TUNE, "--batch-size", "0"], capsys)
    assert_only_line(code, err, "--batch-size must be >= 1")
    code, err = tune(["bench", *TUNE, "--num-prompts", "0"], capsys)  # was taken as "unset"
    assert_only_line(code, err, "--num-prompts must be >= 1")
    code, err = tune(["bench", *TUNE, "--gamma", "0"], capsys)
    assert_only_line(code, err, "--gamma must be between 1 and 64")


@pytest.mark.parametrize("command", ["bench", "grid"])
def test_commands_of_one_context_refuse_a_list(command, no_tuning, tmp_path, capsys):
    code, err = tune([command, "--model", "dummy:tiny", "--device", "cpu", "--ctx", "4k,8k",
                      *(["--out", str(tmp_path / "g.json")] if command == "grid" else [])],
                     capsys)
    assert_only_line(code, err, "--ctx '4k,8k': this command takes one context")
    assert not list(tmp_path.iterdir())


def test_setting_from_the_environment_names_the_variable(no_tuning, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("VEGAS_TUNE_CTX", "abc")
    code, err = tune(["--out", str(tmp_path / "p.yaml")], capsys)
    assert_only_line(code, err, "VEGAS_TUNE_CTX 'abc' is not a token count", absent=["--ctx"])
    monkeypatch.setenv("VEGAS_TUNE_CTX", "4k")
    monkeypatch.setenv("VEGAS_TUNE_PRECISION", "2")
    code, err = tune(["--out", str(tmp_path / "p.yaml")], capsys)
    assert_only_line(code, err, "VEGAS_TUNE_PRECISION must be in (0, 1)", absent=["--precision"])


def test_setting_from_the_config_file_names_the_file_and_key(no_tuning, tmp_path, capsys):
    config = tmp_path / "tune.yaml"
    config.write_text("ctx: abc\n")
    code, err = tune(["--config", str(config), "--out", str(tmp_path / "p.yaml")], capsys)
    assert_only_line(code, err, f"{config}: ctx 'abc' is not a token count", absent=["--ctx"])
    config.write_text("ctx: [256, abc]\n")  # a YAML list of contexts, one of them bad
    code, err = tune(["--config", str(config), "--out", str(tmp_path / "p.yaml")], capsys)
    assert_only_line(code, err, f"{config}: ctx '256,abc' is not a token count", absent=["--ctx"])
    config.write_text("batch-size: 2.5\n")
    code, err = tune(["--config", str(config), "--out", str(tmp_path / "p.yaml")], capsys)
    assert_only_line(code, err, f"{config}: batch-size '2.5' is not a whole number")


def test_config_file_with_yaml_aliases_is_refused(no_tuning, tmp_path, capsys):
    config = tmp_path / "tune.yaml"
    config.write_text("a: &n 3\ncandidates: *n\n")
    code, err = tune(["--config", str(config), "--out", str(tmp_path / "p.yaml")], capsys)
    assert_only_line(code, err, str(config), "anchors")


def test_empty_dataset_file_says_it_has_no_records(no_tuning, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, err = tune([*TUNE, "--out", str(tmp_path / "p.yaml"), "--dataset", str(empty)],
                     capsys)
    assert_only_line(code, err, "has no records", absent=["column"])


def test_model_too_big_for_memory_is_refused_before_tuning(no_tuning, monkeypatch, tmp_path,
                                                          capsys):
    monkeypatch.setattr("vegas_core.loading.memory.available_bytes", lambda device: 24 * 2**30)
    code, err = tune(["--model", "dummy:qwen3-8b", "--device", "cpu", "--dtype", "float32",
                      "--out", str(tmp_path / "p.yaml")], capsys)
    # The KV cache in the message: the tune's own check ran, before loading.
    assert_only_line(code, err, "dummy:qwen3-8b in float32 needs about", "KV cache",
                     "--dtype bfloat16")


def test_multi_line_messages_are_printed_on_one_line(capsys):
    import typer

    from vegas_core.errors import VegasError

    lib = typer.Typer()

    @lib.command()
    def fail() -> None:
        raise VegasError("cannot open storage: OperationalError\n(Background on this error)")

    @lib.command()
    def other() -> None:
        pass

    code = run_app(lib, ["fail"])
    assert_only_line(code, capsys.readouterr().err, "OperationalError (Background")


# ---- issue 42: bad input never costs a model load, never leaves a file, never exit 1 ----
# One test (or parametrized family) per class of defect: files left behind, errors after
# the model loads, exit 1 for user errors, contradictions accepted.

@pytest.fixture
def no_weights(monkeypatch):
    """Loading weights fails the test: the input must be refused before it."""
    def load_model(*args, **kwargs):
        raise AssertionError("the model's weights were loaded before the input was refused")

    for where in ("vegas_tune.pipeline.load_model", "vegas_tune.cli.load_model",
                  "vegas_core.cli.load_model"):
        monkeypatch.setattr(where, load_model)
    for name in list(os.environ):
        if name.startswith("VEGAS_TUNE_"):
            monkeypatch.delenv(name)


def files_under(folder) -> set[str]:
    return {str(path.relative_to(folder)) for path in folder.rglob("*")}


@pytest.fixture
def bad_datasets(tmp_path):
    """Dataset files that exist and are not empty, but whose contents the tuner refuses."""
    no_column = tmp_path / "no-column.jsonl"
    no_column.write_text('{"body": "a record without a text column"}\n')
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes('{"text": "café au lait"}\n'.encode("latin-1"))
    short = tmp_path / "short.csv"
    short.write_text("text\ntoo short for one prompt\n")
    corrupt = tmp_path / "corrupt.parquet"
    corrupt.write_bytes(b"PAR1" + bytes(range(256)) * 4)
    return dict(no_column=no_column, latin1=latin1, short=short, corrupt=corrupt)


def assert_refused_leaving_nothing(argv, tmp_path, monkeypatch, capsys, *fragments):
    """``vegas-tune tune argv``, run in ``tmp_path``, exits 2 with one line holding
    ``fragments`` and leaves the folder as it was."""
    monkeypatch.chdir(tmp_path)
    before = files_under(tmp_path)
    code, err = tune(argv, capsys)
    assert_only_line(code, err, *fragments)
    assert files_under(tmp_path) == before


@pytest.mark.parametrize("case, fragment", [
    ("no_column", "has no 'text' or 'prompt' column (columns: body)"),
    ("latin1", "cannot read dataset file"),
    ("short", "makes only 0 of 4 prompts of 512 tokens"),
    ("corrupt", "cannot read dataset file"),
])
def test_dataset_contents_are_refused_before_loading_and_leave_no_file(
        case, fragment, bad_datasets, no_weights, tmp_path, monkeypatch, capsys):
    # No --out: the default profile folder (profiles/<model>/) must not appear either.
    assert_refused_leaving_nothing(
        ["--dataset", str(bad_datasets[case]), "--ctx", "512", "--device", "cpu"],
        tmp_path, monkeypatch, capsys, fragment)


@pytest.mark.parametrize("argv, fragments", [
    (["--ctx", "1000000"], ["--ctx 1000000 + --max-new-tokens 64",
                            "maximum of 8192 positions"]),
    # Full-width digits parse as 8192: the new tokens then lie past the limit.
    (["--ctx", "８１９２"], ["--ctx 8192 + --max-new-tokens 64", "maximum of 8192 positions"]),
])
def test_context_beyond_a_gguf_models_positions_is_refused_from_its_header(
        argv, fragments, no_weights, tmp_path, monkeypatch, capsys):
    assert files_under(tmp_path) == set()
    assert_refused_leaving_nothing([*argv, "--device", "cpu"], tmp_path, monkeypatch, capsys,
                                   *fragments)


@pytest.mark.parametrize("case, fragment", [
    ("truncated", "truncated or corrupt"),
    ("not_gguf", "not a GGUF file"),
    ("empty", "holds no model"),
])
def test_bad_model_file_is_refused_before_loading_and_leaves_no_file(
        case, fragment, bad_models, no_weights, tmp_path, monkeypatch, capsys):
    assert_refused_leaving_nothing(
        ["--model", str(bad_models[case]), "--ctx", "512", "--device", "cpu",
         "--out", str(tmp_path / "out" / "p.yaml")],
        tmp_path, monkeypatch, capsys, "--model", fragment)


def test_a_run_refused_after_making_its_journal_removes_it(monkeypatch, tmp_path, capsys):
    # A refusal that can only come at load time (here: a model whose weights fail to
    # load) arrives after the journal was made; the run removes it and its folder.
    from vegas_core.errors import VegasError

    def refuse(*args, **kwargs):
        raise VegasError("model 'owner/name' could not be downloaded; check the name")

    monkeypatch.setattr("vegas_tune.pipeline.load_model", refuse)
    code, err = tune([*TUNE, "--out", str(tmp_path / "new" / "p.yaml")], capsys)
    assert_one_line_error(code, err, "could not be downloaded")  # after "loading dummy:tiny"
    assert files_under(tmp_path) == set()
    # A journal that was there before (a study to resume) is kept as it was.
    journal = tmp_path / "kept.journal"
    journal.write_text("")
    code, err = tune([*TUNE, "--out", str(tmp_path / "p.yaml"), "--storage", str(journal)],
                     capsys)
    assert code == 2 and journal.is_file()


def test_empty_prompt_is_refused_before_loading(no_weights, tmp_path, capsys):
    code, err = run(["generate", "--prompt", ""], capsys)
    assert_only_line(code, err, "--prompt is empty")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    code, err = run(["generate", "--prompt-file", str(empty)], capsys)
    assert_only_line(code, err, f"--prompt-file {empty} is empty")


def test_batch_too_big_for_memory_is_refused_naming_the_largest_that_fits(
        no_tuning, monkeypatch, tmp_path, capsys):
    # The embedded GGUF model: its config comes from the file's header.
    monkeypatch.setattr("vegas_core.loading.memory.available_bytes", lambda device: 8 * 2**30)
    out = ["--out", str(tmp_path / "p.yaml"), "--device", "cpu", "--dtype", "float32"]
    code, err = tune(["--batch-size", "99999", *out], capsys)
    assert_only_line(code, err, "--batch-size: batch 99999 does not fit",
                     "only 8.0 GiB is free on the CPU", "the largest batch that fits is 40")
    # Every size of a list is checked, not only the smallest.
    code, err = tune(["--batch-size", "1,16,4096", *out], capsys)
    assert_only_line(code, err, "batch 4096 does not fit", "the largest batch that fits is 40")
    code, err = tune(["--batch-size", "40", *out], capsys)
    assert code == 1 and "run_tune was reached" in err  # it fits: on to tuning


@pytest.mark.parametrize("content", [b"schema_version: 5\nrecommended: true\n",
                                     bytes(range(256)) * 16])
def test_storage_that_is_not_an_optuna_journal_is_refused(content, no_tuning, tmp_path,
                                                          capsys):
    storage = tmp_path / "p.yaml"
    storage.write_bytes(content)
    code, err = tune([*TUNE, "--out", str(tmp_path / "q.yaml"), "--storage", str(storage)],
                     capsys)
    assert_only_line(code, err, f"--storage {storage} is not an optuna journal")
    assert storage.read_bytes() == content  # not appended to


def test_export_to_an_unwritable_path_is_refused(tmp_path, capsys):
    profile = tmp_path / "p.yaml"
    profile.write_text(yaml.safe_dump(sample_profile_dict(), sort_keys=False))
    code, err = tune(["export", str(profile), "--out", "/sys/x/serve.yaml"], capsys)
    assert_only_line(code, err, "--out /sys/x/serve.yaml: cannot write in /sys")
    code, err = tune(["export", str(profile), "--out", str(tmp_path)], capsys)
    assert_only_line(code, err, "is a folder; give the export's file name")
    code, err = tune(["export", str(profile), "--out", str(tmp_path / "serve.yaml")], capsys)
    assert code == 0 and (tmp_path / "serve.yaml").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_resume_with_new_study_is_refused(no_tuning, tmp_path, capsys):
    code, err = tune([*TUNE, "--out", str(tmp_path / "p.yaml"), "--resume", "--new-study"],
                     capsys)
    assert_only_line(code, err, "--resume and --new-study contradict each other")


def test_config_file_with_a_key_given_twice_is_refused(no_tuning, tmp_path, capsys):
    config = tmp_path / "tune.yaml"
    config.write_text("ctx: 8k\nseed: 1\nctx: 4k\n")
    code, err = tune(["--config", str(config), "--out", str(tmp_path / "p.yaml")], capsys)
    assert_only_line(code, err, f"{config}: key 'ctx' is given twice (lines 1 and 3)")
