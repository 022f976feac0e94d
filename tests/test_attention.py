"""The reference attention and its metadata: full, verify and sparse draft masks."""

from __future__ import annotations

import math

import torch

from vegas_core.attention import AttentionMeta, SparseSelection, attend
from vegas_core.cache import KVCache

B, HKV, GROUP, D, S = 2, 2, 3, 8, 24


def filled_cache(seed: int = 0) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    cache = KVCache(2, B, S, HKV, D, dtype=torch.float64, device="cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g, dtype=torch.float64))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g, dtype=torch.float64))
    return cache


def brute_force(q, cache, layer, visible):
    """Loop over every (sequence, head, row): softmax over the visible slots only."""
    b, t, h, d = q.shape
    out = torch.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            kv = hi // GROUP
            for ti in range(t):
                slots = [s for s in range(S) if visible(bi, kv, ti, s)]
                k = cache.k[layer, bi, kv, slots]
                v = cache.v[layer, bi, kv, slots]
                w = torch.softmax(k @ q[bi, ti, hi] / math.sqrt(d), dim=0)
                out[bi, ti, hi] = w @ v
    return out


def test_full_and_verify_are_causal_over_positions():
    cache = filled_cache()
    positions = torch.tensor([[10, 11, 12], [20, 21, 22]])
    q = torch.randn(B, 3, HKV * GROUP, D, dtype=torch.float64)
    ref = brute_force(q, cache, 1, lambda b, kv, t, s: s <= positions[b, t])
    for meta in (AttentionMeta.full(positions, S), AttentionMeta.verify(positions, S)):
        torch.testing.assert_close(attend(q, cache, 1, meta), ref)


def test_sparse_draft_sees_selected_slots_and_recent_tail():
    cache = filled_cache(1)
    positions = torch.tensor([[15], [21]])
    tail = torch.tensor([13, 18])
    for per_head in (False, True):
        groups = HKV if per_head else 1
        idx = torch.randint(0, 13, (2, B, groups, 5), generator=torch.Generator().manual_seed(2))
        counts = torch.tensor([[5, 3], [4, 5]])
        sel = SparseSelection(idx, counts, tail)
        q = torch.randn(B, 1, HKV * GROUP, D, dtype=torch.float64)
        for layer in range(2):
            def visible(b, kv, t, s):
                chosen = idx[layer, b, kv if per_head else 0, : counts[layer, b]].tolist()
                return s <= positions[b, t] and (s in chosen or s >= tail[b])

            got = attend(q, cache, layer, AttentionMeta.draft(positions, S, sel))
            torch.testing.assert_close(got, brute_force(q, cache, layer, visible))


def test_sparse_selecting_everything_equals_full():
    cache = filled_cache(2)
    positions = torch.tensor([[16], [16]])
    everything = torch.arange(16).expand(1, B, 1, 16).contiguous()
    sel = SparseSelection(everything, torch.full((1, B), 16), torch.tensor([16, 16]))
    q = torch.randn(B, 1, HKV * GROUP, D, dtype=torch.float64)
    torch.testing.assert_close(attend(q, cache, 0, AttentionMeta.draft(positions, S, sel)),
                               attend(q, cache, 0, AttentionMeta.full(positions, S)))


def test_a_hybrid_models_sliding_layers_draft_their_whole_window():
    """Selection applies to global layers; a sliding layer of a hybrid model reads its
    window whatever was selected (here: one slot of 13)."""
    from vegas_core.config import SlidingWindow

    cache = filled_cache(1)
    positions = torch.tensor([[15], [21]])
    tail = torch.tensor([13, 18])
    idx = torch.zeros(2, B, 1, 1, dtype=torch.long)
    sel = SparseSelection(idx, torch.ones(2, B, dtype=torch.long), tail)
    q = torch.randn(B, 1, HKV * GROUP, D, dtype=torch.float64)
    window = SlidingWindow(4, frozenset({0}))
    meta = AttentionMeta.draft(positions, S, sel, window)
    in_window = lambda b, kv, t, s: positions[b, t] - 4 < s <= positions[b, t]  # noqa: E731
    torch.testing.assert_close(attend(q, cache, 0, meta), brute_force(q, cache, 0, in_window))
    selected = lambda b, kv, t, s: s <= positions[b, t] and (s == 0 or s >= tail[b])  # noqa: E731
    torch.testing.assert_close(attend(q, cache, 1, meta), brute_force(q, cache, 1, selected))
