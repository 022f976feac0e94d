"""Sparse draft attention: one query row against an index list plus the recent tail.

For sequence b and KV head h the keys are ``indices[b, g, :counts[b]]`` (g = 0 when
the set is shared by all heads, g = h per KV head) followed by the contiguous slots
``tail_start[b] .. positions[b]``. Page size one: K/V rows are gathered by slot.
One program per (sequence, KV head, split of that key list); the group's query heads
share each gathered tile (GQA packing: row r of the tile is query head
``kv_head * G + r``).

As in ``vegas_kernels.verify_attention``, lengths live on the device only: the grid comes
from the static bound ``max_keys`` and a split count, and each program cuts its own
slice of ``total = counts[b] + max(positions[b] - tail_start[b] + 1, 0)`` keys, so one
launch (a captured CUDA graph) serves any key count up to the bound. The splits are
merged by log-sum-exp straight into out [B, 1, H, D] (``vegas_kernels.split_merge``), by
the last program of each (sequence, KV head) where one merge block holds them
(``launch.merges_in_kernel``), else by the merge launch; a single split writes out
itself. Tiles hold ``launch.BLOCK_N`` slots, half that when the lists are short and the
batch small (``launch.sparse_tiling``).

``reference_sparse_attention`` is the PyTorch ground truth.
"""

from __future__ import annotations

import math

import torch

from vegas_kernels import launch
from vegas_kernels.split_merge import merge_args, merge_partials, split_buffers, split_counters

try:
    import triton
    import triton.language as tl

    from vegas_kernels.split_merge import (merge_if_last, scaled_scores, softmax_step,
                                           split_range, store_partials, store_rows)
except ImportError:
    triton = None

def reference_sparse_attention(q, k, v, positions, indices, counts, tail_start, sinks=None):
    """q [B, 1, H, D]; k, v [B, H_kv, S, D]; positions [B, 1]; indices [B, G, K];
    counts [B]; tail_start [B]; sinks [H] or None -> out [B, 1, H, D] in float32 or
    wider."""
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
    lse = scores.logsumexp(-1, keepdim=True)  # [B, H_kv, G, 1]
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(acc).view(1, h_kv, h // h_kv, 1))
    out = torch.einsum("bkgs,bksd->bkgd", torch.exp(scores - lse), v.to(acc))
    return out.reshape(b, 1, h, d)


if triton is not None:

    @triton.jit
    def _sparse_split_kernel(
        Q, K, V, POS, IDX, CNT, TAIL, ACC, MAX, SUM, LIVE,
        COUNT, SINKS, OUT, LSE, so_b, so_t, so_h, sl_b, sl_t, sl_h,
        sq_b, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sp_b, si_b, si_g, sc_b, st_b,
        sa_bh, sa_sp, sa_m, sm_bh, sm_sp,
        splits, sm_scale,
        H_KV: tl.constexpr, G: tl.constexpr, PER_HEAD: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
        SINGLE: tl.constexpr, MERGE: tl.constexpr, LANES: tl.constexpr,
        MERGE_ROWS: tl.constexpr, MERGE_DIMS: tl.constexpr, STORE_LSE: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H_KV
        kvh = bh % H_KV
        # This head's K/V rows: 64-bit scalar bases (a cache can pass 2**31 elements),
        # 32-bit offsets within them.
        k_head = K + (b.to(tl.int64) * sk_b + kvh.to(tl.int64) * sk_h)
        v_head = V + (b.to(tl.int64) * sv_b + kvh.to(tl.int64) * sv_h)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < G
        dims = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + (kvh * G + rows)[:, None] * sq_h + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        # Slot arithmetic in 32 bits, whatever integer dtype the caller passes.
        count = tl.load(CNT + b * sc_b).to(tl.int32)
        tail0 = tl.load(TAIL + b * st_b).to(tl.int32)
        pos = tl.load(POS + b * sp_b).to(tl.int32)
        total = count + tl.maximum(pos - tail0 + 1, 0)  # selected slots, then the tail
        start, end, live = split_range(0, total, split, splits, BLOCK_N)
        idx_base = IDX + b * si_b + (kvh * si_g if PER_HEAD else 0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        # The next tile's list entries load while this tile computes: each gather waits
        # on its entries, and the loop's own pipelining left that wait exposed.
        j = start + tl.arange(0, BLOCK_N)
        listed = tl.load(idx_base + j, mask=(j < end) & (j < count), other=0).to(tl.int32)
        for j0 in range(start, end, BLOCK_N):
            j = j0 + tl.arange(0, BLOCK_N)
            in_range = j < end
            slot = tl.where(j < count, listed, tail0 + (j - count))
            k = tl.load(k_head + slot[:, None] * sk_s + dims[None, :], mask=in_range[:, None],
                        other=0.0)
            after = j + BLOCK_N
            listed = tl.load(idx_base + after, mask=(after < end) & (after < count),
                             other=0).to(tl.int32)
            s = scaled_scores(q, k, sm_scale, IEEE)
            s = tl.where(in_range[None, :] & row_ok[:, None], s, float("-inf"))
            vt = tl.load(v_head + slot[:, None] * sv_s + dims[None, :], mask=in_range[:, None],
                         other=0.0)
            m_i, l_i, acc = softmax_step(s, vt, m_i, l_i, acc, IEEE)
        if SINGLE:  # the only split: finish the rows here, no merge launch
            store_rows(OUT, OUT, SINKS, b, kvh * G + rows, rows * 0, row_ok, dims, acc, m_i,
                       l_i, so_b, 0, so_h, 0, 0, 0, row_ok, False, HAS_SINKS)
        else:
            store_partials(ACC, MAX, SUM, LIVE, bh, split, bh * sa_bh + split * sa_sp,
                           bh * sm_bh + split * sm_sp, sa_m, acc, m_i, l_i, live, start, end,
                           G, BLOCK_M, D)
            if MERGE:
                merge_if_last(COUNT, ACC, MAX, SUM, SINKS, OUT, LSE, bh, splits, live,
                              sa_bh, sa_sp, sa_m, sm_bh, sm_sp, so_b, so_t, so_h, sl_b, sl_t,
                              sl_h, H_KV, G, 1, LANES, MERGE_ROWS, MERGE_DIMS, STORE_LSE,
                              HAS_SINKS)


def sparse_attention(q, k, v, positions, indices, counts, tail_start, max_keys: int, *,
                     splits: int | None = None, block_n: int | None = None, sinks=None):
    """Triton sparse draft attention -> out [B, 1, H, D] in q's dtype.

    q [B, 1, H, D]; k, v [B, H_kv, S, D] (last dim contiguous); positions [B, 1];
    indices [B, 1 or H_kv, K]; counts, tail_start [B] (any integer dtype); max_keys: a
    static bound on every sequence's key count (selected + tail), which only sizes the
    grid; splits, block_n: the split count and slots per tile (default
    ``launch.sparse_tiling``; ``launch.BLOCK_N`` when only ``splits`` is given); sinks:
    [H] or None, logits that join each head's softmax (added once, after the splits).
    Reads nothing back from the device."""
    b, t, h, d = q.shape
    assert t == 1, "drafts attend with one query row"
    h_kv = k.shape[1]
    g = h // h_kv
    dev = q.device
    if splits is None:
        splits, tiled = launch.sparse_tiling(dev, b * h_kv, max_keys)
        block_n = block_n or tiled
    block_n = block_n or launch.BLOCK_N
    out = torch.empty(b, 1, h, d, device=dev, dtype=q.dtype)
    # One split finishes its rows itself: no partials to allocate or merge (``out``
    # stands in for their pointers, which that launch never reads).
    single = splits == 1
    partials = None if single else split_buffers(b, h_kv, splits, g, d, dev)
    acc, maxes, sums, live = (out,) * 4 if single else partials
    counters = (split_counters(dev, b * h_kv)
                if not single and launch.merges_in_kernel(splits, g, d)
                else None)
    merge, merge_flags = merge_args(partials, out, None, counters, sinks)
    if indices.stride(-1) != 1:
        indices = indices.contiguous()
    _sparse_split_kernel[(b * h_kv, splits)](
        q, k, v, positions, indices, counts, tail_start, acc, maxes, sums, live, *merge,
        q.stride(0), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), positions.stride(0),
        indices.stride(0), indices.stride(1), counts.stride(0), tail_start.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), maxes.stride(0), maxes.stride(1),
        splits, 1.0 / math.sqrt(d),
        H_KV=h_kv, G=g, PER_HEAD=indices.shape[1] > 1, D=d, BLOCK_M=launch.block_rows(g),
        BLOCK_N=block_n, IEEE=q.dtype == torch.float32, SINGLE=single, **merge_flags,
        num_warps=launch.SPLIT_WARPS, num_stages=launch.sparse_stages(d),
    )
    if not single and counters is None:
        merge_partials(partials, out, None, h_kv, g, 1, sinks)
    return out
