"""Sparse draft attention: one query row against an index list plus the recent tail.

For sequence b and KV head h the keys are ``indices[b, g, :counts[b]]`` (g = 0 when
the set is shared by all heads, g = h per KV head) followed by the contiguous slots
``tail_start[b] .. positions[b]``. Page size one: K/V rows are gathered by slot.
One program per (sequence, KV head, split of that key list); the group's query heads
share each gathered tile (GQA packing); splits are merged by log-sum-exp.

``reference_sparse_attention`` is the PyTorch ground truth.
"""

from __future__ import annotations

import math

import torch

from kernels.verify_attention import (BLOCK_N, MIN_BLOCK_M, merge_splits, split_buffers,
                                     split_size_for)

try:
    import triton
    import triton.language as tl

    from kernels.verify_attention import _scaled_scores, _softmax_step, _store_partials
except ImportError:
    triton = None


def reference_sparse_attention(q, k, v, positions, indices, counts, tail_start):
    """q [B, 1, H, D]; k, v [B, H_kv, S, D]; positions [B, 1]; indices [B, G, K];
    counts [B]; tail_start [B] -> out [B, 1, H, D] in float32 or wider."""
    b, _, h, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    acc = torch.promote_types(q.dtype, torch.float32)
    slots = torch.arange(s, device=q.device)
    valid = (torch.arange(indices.shape[-1], device=q.device) < counts[:, None, None]).expand_as(indices)
    chosen = torch.zeros(b, indices.shape[1], s, dtype=torch.int32, device=q.device)
    chosen.scatter_add_(-1, indices.clamp(0, s - 1), valid.to(torch.int32))
    tail = (slots >= tail_start[:, None, None]) & (slots <= positions[:, :1, None])
    visible = (chosen > 0) | tail  # [B, G, S]
    qg = q[:, 0].to(acc).view(b, h_kv, h // h_kv, d)
    scores = torch.einsum("bkgd,bksd->bkgs", qg, k.to(acc)) / math.sqrt(d)
    scores = scores.masked_fill(~visible[:, :, None, :], float("-inf"))
    out = torch.einsum("bkgs,bksd->bkgd", torch.softmax(scores, -1), v.to(acc))
    return out.reshape(b, 1, h, d)


if triton is not None:

    @triton.jit
    def _sparse_split_kernel(
        Q, K, V, POS, IDX, CNT, TAIL, OUT, MAX, SUM,
        sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, si_b, si_g,
        so_b, so_h, so_sp, so_m, sm_b, sm_h, sm_sp,
        split_size, sm_scale,
        H_KV: tl.constexpr, G: tl.constexpr, PER_HEAD: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H_KV
        kvh = bh % H_KV
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < G
        dims = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + (kvh * G + rows)[:, None] * sq_h + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        count = tl.load(CNT + b)
        tail0 = tl.load(TAIL + b)
        pos = tl.load(POS + b)
        total = count + tl.maximum(pos - tail0 + 1, 0)  # selected slots, then the tail
        idx_base = IDX + b * si_b + (kvh * si_g if PER_HEAD else 0)
        start = split * split_size
        end = tl.minimum(start + split_size, total)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for j0 in range(start, end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            in_range = j < end
            listed = tl.load(idx_base + j, mask=in_range & (j < count), other=0)
            slot = tl.where(j < count, listed, tail0 + (j - count))
            k = tl.load(K + b * sk_b + kvh * sk_h + slot[:, None] * sk_s + dims[None, :],
                        mask=in_range[:, None], other=0.0)
            s = _scaled_scores(q, k, sm_scale, IEEE)
            s = tl.where(in_range[None, :] & row_ok[:, None], s, float("-inf"))
            vt = tl.load(V + b * sv_b + kvh * sv_h + slot[:, None] * sv_s + dims[None, :],
                         mask=in_range[:, None], other=0.0)
            m_i, l_i, acc = _softmax_step(s, vt, m_i, l_i, acc, IEEE)
        _store_partials(OUT, MAX, SUM, b * so_b + kvh * so_h + split * so_sp,
                        b * sm_b + kvh * sm_h + split * sm_sp, so_m, acc, m_i, l_i, BLOCK_M, D)


def sparse_attention(q, k, v, positions, indices, counts, tail_start, max_keys: int,
                     split_size=None):
    """Triton sparse draft attention; ``max_keys`` bounds every sequence's key count
    (selected + tail), which sizes the grid without reading device values."""
    b, t, h, d = q.shape
    assert t == 1, "drafts attend with one query row"
    h_kv = k.shape[1]
    g = h // h_kv
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(g))
    split_size = split_size or split_size_for(q.device, b * h_kv, max_keys)
    splits = max(1, math.ceil(max_keys / split_size))
    acc, maxes, sums = split_buffers(b, h_kv, splits, block_m, d, q.device)
    indices = indices.contiguous()
    counts = counts.to(torch.int32).contiguous()
    tail_start = tail_start.to(torch.int32).contiguous()
    pos = positions[:, 0].to(torch.int32).contiguous()
    _sparse_split_kernel[(b * h_kv, splits)](
        q, k, v, pos, indices, counts, tail_start, acc, maxes, sums,
        q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), indices.stride(0), indices.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3),
        maxes.stride(0), maxes.stride(1), maxes.stride(2),
        split_size, 1.0 / math.sqrt(d),
        H_KV=h_kv, G=g, PER_HEAD=indices.shape[1] > 1, D=d, BLOCK_M=block_m,
        BLOCK_N=BLOCK_N, IEEE=q.dtype == torch.float32,
    )
    out, _ = merge_splits(acc, maxes, sums)  # [B, Hkv, M, D]
    return out[:, :, :g].reshape(b, 1, h, d).to(q.dtype)
