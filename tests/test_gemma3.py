"""The embedded Gemma3-270M (GGUF Q4_K_M, 32k positions, local and global layers)
against transformers' own GGUF loading, and lossless under every drafter (CPU, fp32)."""

from __future__ import annotations

import inspect
import pathlib

import pytest
import torch

from vegas_core import SpecConfig, generate, load_model
from vegas_core.attention import AttentionMeta
from vegas_core.prefill import PrefixCache
from vegas_core.spec_config import DRAFTERS

LOGIT_RTOL = 1e-4
PROMPT_TOKENS = 2500  # several times the 512-token window of the local layers
COMPARED_ROWS = 64  # logits over 262k tokens: compare the last rows only


def source_tokens(model, module, start: int, count: int) -> list[int]:
    text = pathlib.Path(inspect.getsourcefile(module)).read_text()
    return model.tokenizer.encode(text)[start:start + count]


@pytest.fixture(scope="module")
def gemma():
    return load_model("gemma3-270m", device="cpu", dtype="float32")


def test_gemma3_tokenizer_is_kept_converted_and_loads_the_same(gemma):
    """transformers' conversion of the GGUF vocabulary (about 40 s) is kept in the cache
    folder; the kept copy tokenizes, decodes and renders chats as the model's own."""
    import argparse

    from vegas_core.loading.embedded import cache_folder
    from vegas_core.loading.gguf import GGUFFile, gguf_tokenizer

    assert list((cache_folder() / "tokenizers").glob(f"{gemma.path.stem}-*/tokenizer.json"))
    again = gguf_tokenizer(GGUFFile(gemma.path))
    text = (pathlib.Path(inspect.getsourcefile(argparse)).read_text()[:20000]
            + "<start_of_turn>user\nhi<end_of_turn>\n")
    ids = gemma.tokenizer.encode(text)
    assert again.encode(text) == ids and again.decode(ids) == gemma.tokenizer.decode(ids)
    assert again.eos_token_ids == gemma.tokenizer.eos_token_ids
    chat = [{"role": "user", "content": "Name three prime numbers."}]
    assert again.apply_chat_template(chat) == gemma.tokenizer.apply_chat_template(chat)


@pytest.mark.slow
def test_gemma3_270m_matches_transformers_gguf_loading(gemma):
    import argparse

    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = gemma.path
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=torch.float32).eval()
    text = pathlib.Path(inspect.getsourcefile(argparse)).read_text()
    ids = gemma.tokenizer.encode(text)[:PROMPT_TOKENS]
    hf_ids = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)(text).input_ids
    assert ids == hf_ids[:PROMPT_TOKENS]
    tokens = torch.tensor([ids])
    positions = torch.arange(len(ids))[None]
    with torch.inference_mode():
        ref = hf.lm_head(hf.model(tokens).last_hidden_state[0, -COMPARED_ROWS:]).float()
        net = gemma.net
        meta = AttentionMeta.full(positions, len(ids), gemma.config.window)
        hidden = net(tokens, positions, net.new_cache(1, len(ids)), meta)
        got = net.logits(hidden[0, -COMPARED_ROWS:])
    assert ((got - ref).abs().max() / ref.abs().max()).item() <= LOGIT_RTOL
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_gemma3_270m_speculative_greedy_equals_vanilla(gemma, gemma_batch, drafter):
    prompts, vanilla, prefix_cache = gemma_batch
    spec = SpecConfig(drafter=drafter, gamma=4, sparsity=0.05, min_tokens=32)
    out = generate(gemma, prompts, max_new_tokens=16, ignore_eos=True, spec=spec,
                   prefix_cache=prefix_cache)
    assert out.tokens == vanilla
    assert out.stats.mean_accepted_length > 1.0


@pytest.fixture(scope="module")
def gemma_batch(gemma):
    """Prompts longer than the local window, their vanilla output, and their K/V kept
    for the drafters' runs."""
    import argparse
    import json.decoder

    prompts = [source_tokens(gemma, argparse, 0, 1400), source_tokens(gemma, json.decoder, 0, 700)]
    prefix_cache = PrefixCache()
    vanilla = generate(gemma, prompts, max_new_tokens=16, ignore_eos=True,
                       prefix_cache=prefix_cache).tokens
    return prompts, vanilla, prefix_cache


def test_a_missing_embedded_gemma3_says_how_to_install_it(monkeypatch):
    from vegas_core.errors import VegasError
    from vegas_core.loading import embedded

    monkeypatch.setattr(embedded, "_package_file", lambda package, filename: None)
    with pytest.raises(VegasError, match=r"not installed; install it with: pip install "
                                         r"'vegas-tune\[gemma\]'"):
        embedded.embedded_path("gemma3-270m")


def test_chunks_that_do_not_join_into_the_published_file_are_refused(tmp_path, monkeypatch):
    from vegas_core.errors import VegasError
    from vegas_core.loading import embedded

    part = tmp_path / "part"
    part.write_bytes(b"not the model")
    monkeypatch.setenv(embedded.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(embedded, "_package_file", lambda package, filename: part)
    with pytest.raises(VegasError, match="do not join into the published file"):
        embedded.embedded_path("gemma3-270m")
    assert not any((tmp_path / "cache").iterdir())  # nothing half-written left behind
