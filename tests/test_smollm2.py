"""The embedded SmolLM2-135M (GGUF Q4_1) against transformers' own GGUF loading."""

from __future__ import annotations

import pytest
import torch

from vegas_core import generate
from tests.test_hf_parity import full_logits, hf_greedy, rel_err

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Prices: 12345 apples at $3.50 each, 2026-11-29, π ≈ 3.14159; naïve café — 東京 🚀",
    "   leading spaces,\ttabs\n\n\nnewlines   and trailing   ",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's what we'd've done, isn't it?",
]


@pytest.fixture(scope="module")
def reference(smollm_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(smollm_path.parent), smollm_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return tok, model.eval()


def test_tokenizer_matches_transformers(smollm, reference):
    tok, _ = reference
    for text in TEXTS:
        assert smollm.tokenizer.encode(text) == tok(text)["input_ids"], text
        assert smollm.tokenizer.decode(smollm.tokenizer.encode(text)) == tok.decode(
            tok(text)["input_ids"], skip_special_tokens=True)


def test_special_ids_from_metadata(smollm):
    assert smollm.tokenizer.bos_token_id == 1
    assert smollm.tokenizer.eos_token_ids == [2]
    assert smollm.tokenizer.encode("<|im_end|>") == [2]


def test_logits_match_transformers_gguf(smollm, reference):
    tok, model = reference
    ids = tok(TEXTS[1] + TEXTS[0])["input_ids"]
    with torch.inference_mode():
        ref = model(torch.tensor([ids])).logits[0].float()
    assert rel_err(full_logits(smollm, ids), ref) <= 1e-3


def test_greedy_64_tokens_match_transformers_gguf(smollm, reference):
    tok, model = reference
    prompts = [TEXTS[1], "The history of the Roman Empire", TEXTS[4]]
    result = generate(smollm, prompts, max_new_tokens=64, ignore_eos=True)
    for text, got in zip(prompts, result.tokens):
        assert got == hf_greedy(model, tok(text)["input_ids"], 64)


def test_chat_template_renders(smollm):
    text = smollm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_cli_generates_and_reports_speed(capsys):
    from vegas_core.cli import app, run_app

    code = run_app(app, ["generate", "--prompt", "The capital of France is",
                         "--max-new-tokens", "8"], prog_name="vegas")
    out = capsys.readouterr()
    assert code == 0
    assert out.out.strip()
    assert "tok/s" in out.err and "smollm2-135m" in out.err


def test_cli_decodes_speculatively_and_reports_acceptance(capsys):
    from vegas_core.cli import app, run_app

    argv = ["generate", "--prompt", "def add(a, b):\n    return a + b\n" * 20,
            "--max-new-tokens", "12", "--drafter", "vegas", "--gamma", "3", "--min-tokens", "16"]
    code = run_app(app, argv, prog_name="vegas")
    out = capsys.readouterr()
    assert code == 0 and out.out.strip()
    assert "mean accepted length" in out.err and "acceptance by position" in out.err
