"""Engine invariants on tiny random models: decode == full forward, chunking, batching."""

from __future__ import annotations

import pytest
import torch

from vegas_core import generate
from vegas_core.attention import AttentionMeta
from vegas_core.config import ModelConfig
from vegas_core.loading import LoadedModel
from vegas_core.loading.weights import build_random

TINY = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=6,
            num_kv_heads=2, head_dim=8, max_position_embeddings=256)


def tiny_model(family: str = "qwen3", **changes) -> LoadedModel:
    flags = {"qwen3": dict(qk_norm=True), "qwen2": dict(qkv_bias=True), "llama": {}}[family]
    config = ModelConfig(name=f"tiny-{family}", family=family, **{**TINY, **flags, **changes})
    net = build_random(config, device=torch.device("cpu"), dtype=torch.float32, seed=3)
    with torch.no_grad():  # a wide init so greedy choices are far from ties
        for p in net.parameters():
            p.mul_(10.0) if p.dim() > 1 else None
    return LoadedModel(config, net, None, config.name, None, True)


def prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_token_by_token_decode_equals_full_forward(family):
    model, ids = tiny_model(family), prompt(40)
    net = model.net
    positions = torch.arange(40)[None]
    with torch.inference_mode():
        full = net.logits(net(torch.tensor([ids]), positions, net.new_cache(1, 40),
                              AttentionMeta.full(positions, 40)))[0]
        cache = net.new_cache(1, 40)
        steps = []
        for p, tok in enumerate(ids):
            pos = torch.tensor([[p]])
            steps.append(net.logits(net(torch.tensor([[tok]]), pos, cache,
                                        AttentionMeta.full(pos, p + 1)))[0, 0])
    torch.testing.assert_close(torch.stack(steps), full, rtol=1e-5, atol=1e-5)


def test_chunked_prefill_and_batching_do_not_change_tokens():
    model = tiny_model()
    prompts = [prompt(n, seed=n) for n in (50, 7, 33)]
    batched = generate(model, prompts, max_new_tokens=20, ignore_eos=True, prefill_chunk=8)
    for p, got in zip(prompts, batched.tokens):
        alone = generate(model, [p], max_new_tokens=20, ignore_eos=True, prefill_chunk=512)
        assert got == alone.tokens[0]


def test_sliding_window_limits_attention():
    windowed = tiny_model(sliding_window=4)
    plain = tiny_model()
    ids = prompt(12)
    short = generate(windowed, [ids], max_new_tokens=1).tokens[0]
    # Window 4 over 2 layers: the last row reaches back 2 * 3 positions, to position 5;
    # changing positions 0..4 must be invisible.
    changed = [(t + 1) % 97 for t in ids[:5]] + ids[5:]
    assert generate(windowed, [changed], max_new_tokens=1).tokens[0] == short
    # Without a window the early tokens do matter.
    assert generate(plain, [ids], max_new_tokens=8).tokens[0] != generate(
        plain, [changed], max_new_tokens=8).tokens[0]


def test_cache_rollback_is_a_length_pointer():
    model = tiny_model()
    net, ids = model.net, prompt(20)
    with torch.inference_mode():
        cache = net.new_cache(1, 32)
        pos = torch.arange(20)[None]
        net(torch.tensor([ids]), pos, cache, AttentionMeta.full(pos, 20))
        # Write 3 junk tokens at 20..22, then overwrite from 20 with the real next token.
        junk = torch.arange(20, 23)[None]
        net(torch.tensor([[5, 6, 7]]), junk, cache, AttentionMeta.full(junk, 23))
        p = torch.tensor([[20]])
        after = net.logits(net(torch.tensor([[9]]), p, cache, AttentionMeta.full(p, 21)))
        fresh = net.new_cache(1, 32)
        full_pos = torch.arange(21)[None]
        ref = net.logits(net(torch.tensor([ids + [9]]), full_pos, fresh,
                             AttentionMeta.full(full_pos, 21)))[:, -1:]
    torch.testing.assert_close(after, ref, rtol=1e-5, atol=1e-5)


def test_eos_stops_each_sequence():
    model = tiny_model()
    first = generate(model, [prompt(10)], max_new_tokens=6, ignore_eos=True).tokens[0]

    class Tok:  # eos = the 3rd generated token
        eos_token_ids = [first[2]]
        bos_token_id = None

        def decode(self, ids):
            return ""

    model.tokenizer = Tok()
    out = generate(model, [prompt(10)], max_new_tokens=6).tokens[0]
    assert out == first[: first.index(first[2]) + 1]


def test_prefix_cache_reuses_prompt_kv_without_changing_outputs():
    from vegas_core import SpecConfig
    from vegas_core.prefill import PrefixCache

    model = tiny_model()
    prompts = [prompt(60, seed=1), prompt(45, seed=2)]
    reuse = PrefixCache(device_bytes=1 << 30)
    plain = generate(model, prompts, max_new_tokens=12, ignore_eos=True)
    first = generate(model, prompts, max_new_tokens=12, ignore_eos=True, prefix_cache=reuse)
    assert len(reuse._entries) == 2
    again = generate(model, prompts, max_new_tokens=12, ignore_eos=True, prefix_cache=reuse)
    spec = generate(model, prompts, max_new_tokens=12, ignore_eos=True, prefix_cache=reuse,
                    spec=SpecConfig(gamma=3, min_tokens=4, sparsity=0.1))
    assert plain.tokens == first.tokens == again.tokens == spec.tokens
    assert len(reuse._entries) == 2  # the spec run's prompt heads were served from the store
    tiny = PrefixCache(device_bytes=1, host_bytes=0)
    generate(model, prompts, max_new_tokens=2, prefix_cache=tiny)
    assert not tiny._entries
