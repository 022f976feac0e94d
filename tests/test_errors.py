"""Bad input: one line on stderr, exit code 2, a traceback only with --debug."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
