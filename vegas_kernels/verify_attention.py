"""Verify (and decode) attention: a few query rows against the whole KV cache.

Flash-decoding layout: one program per (sequence, KV head, split of the KV length).
All query heads of a KV group and all T rows of the window are packed into one tile of
``G * T`` rows, so each K/V tile is read once for the whole group. Row r of the tile is
query head ``kv_head * G + r // T`` at window row ``r % T``; key slot s is visible to it
when ``s <= positions[b, r % T]``.

Lengths live on the device only. The host fixes the grid from a static bound (``kv_len``:
the number of cache slots that may be read) and a number of splits; each program then
sizes its own slice from the positions: ``total = min(kv_len, max(positions[b]) + 1)``
slots are cut into ``splits`` slices of a whole number of BLOCK_N tiles, and splits past
the end do nothing. The same launch is therefore correct for any length up to the bound,
which is what a CUDA graph captured once and replayed as the sequences grow needs.

Tiles wholly below every row's position (all but the window's own tiles and the range's
end) need no mask at all, so they run on a mask-free path. The splits' partial rows are
merged by log-sum-exp (``vegas_kernels.split_merge``) into ``out`` [B, T, H, D] (q's
dtype) and ``lse`` [B, T, H] (float32): by the last program of each (sequence, KV head)
where one merge block holds its splits (``launch.merges_in_kernel``), else by a merge
launch. Even one split stores partials and merges: finishing the rows inside this kernel
made a decode step's attention 9% slower at SmolLM2's batch 64 on the H200 (109 against
100 us per layer at 8k, 9cbf295; the sparse draft kernel, which gained from it, does so).
A row that sees no slot gets out 0 and lse -inf.

A sliding ``window`` (hybrid models' local layers) limits row r to the slots
``positions[b, r] - window < s <= positions[b, r]``: the splits then cut only the slots
some row of the window sees, so a local layer reads its window, not the whole cache.
Where the cache keeps a sliding layer as a ring (``vegas_core.cache``), ``ring`` maps
position p to slot p % ring: the window says which positions are read, the ring where
they lie.

Attention ``sinks`` ([H], gpt-oss) are a logit per query head that joins every row's
softmax as one more slot with no value; it is added once, after the splits.

With ``row_weights`` ([B, T]) the kernel also emits the selection scores of the Vegas
``logit`` mode for free: for each slot, the sum over the group's heads and the window
rows of ``weight[row] * q.k / sqrt(d)`` (visible slots only), shape [B, H_kv, kv_len]
(float32). Slots at or past each sequence's ``total`` are left unwritten: callers mask
the slots beyond the prefix anyway. The sum is linear in the queries, so in a tile every
row sees it is one dot of K with the weighted query sum ``sum_r weight[r] * q[r]`` (kept
as a bfloat16/float16 pair, high and low part, so its rounding stays near float32's)
when the packed rows are ``launch.DOT_SUM_ROWS`` or more, where summing the main tile's
columns would cross warps (a shared-memory reduction per tile). Tiles with per-row masks
sum the rows.

``reference_verify_attention`` is the PyTorch ground truth for all three outputs.
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
                                           split_range, store_partials)
except ImportError:  # CPU-only installs: the reference path is used
    triton = None

# The window of a layer without one: wider than any cache, small enough that position
# arithmetic in 32 bits never overflows.
NO_WINDOW = 1 << 30


def reference_verify_attention(q, k, v, positions, kv_len, row_weights=None, window=None,
                               sinks=None):
    """q [B, T, H, D]; k, v [B, H_kv, S, D]; positions [B, T]; window: a sliding window
    or None; sinks [H] or None -> (out [B, T, H, D], lse [B, T, H], scores [B, H_kv,
    kv_len] or None), all in float32 or wider. ``lse`` includes the sink."""
    b, t, h, d = q.shape
    h_kv = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).view(b, t, h_kv, h // h_kv, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    kk, vv = k[:, :, :kv_len].to(acc), v[:, :, :kv_len].to(acc)
    s = torch.einsum("bkgtd,bksd->bkgts", qg, kk) / math.sqrt(d)
    slots = torch.arange(kv_len, device=q.device)
    pos = positions[:, None, None, :, None]
    visible = slots <= pos
    if window is not None:
        visible &= slots > pos - window
    scores = None
    if row_weights is not None:
        w = row_weights.to(acc)[:, None, None, :, None]
        scores = (s.masked_fill(~visible, 0.0) * w).sum(dim=(2, 3))
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, T]
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(acc).view(1, h_kv, h // h_kv, 1))
    out = torch.einsum("bkgts,bksd->bkgtd", torch.exp(s - lse[..., None]), vv)
    out = out.permute(0, 3, 1, 2, 4).reshape(b, t, h, d)
    return out, lse.permute(0, 3, 1, 2).reshape(b, t, h), scores


if triton is not None:
    # float16's largest finite value is 65504: kept edge logits are clamped inside it
    # (a logit that large makes its row's softmax one-hot either way).
    EDGE_LOGIT_LIMIT = tl.constexpr(60000.0)
    MIN_SUM_M = tl.constexpr(launch.MIN_BLOCK_M)  # rows of q_sum: tl.dot needs 16

    @triton.jit
    def _store_edges(edges_head, side_rows, keep, slots, s, se_r):
        """Keep the edge rows' logits of a tile as float16, clamped to its finite range;
        keep: [SIDE_M, 1] or [SIDE_M, N]."""
        kept = tl.minimum(tl.maximum(s, -EDGE_LOGIT_LIMIT), EDGE_LOGIT_LIMIT)
        tl.store(edges_head + side_rows[:, None] * se_r + slots[None, :],
                 kept.to(tl.float16), mask=keep)

    @triton.jit
    def _verify_tile(q, q_side, q_sum, k_head, v_head, scores_head, edges_head, n0, end, pos,
                     side_pos, window, weight, row_ok, side_ok, m_i, l_i, acc, sk_s, sv_s,
                     se_r, sm_scale, ring, BLOCK_N: tl.constexpr, D: tl.constexpr,
                     SIDE_M: tl.constexpr, COLLECT: tl.constexpr, DOT_SUM: tl.constexpr,
                     KEEP_EDGES: tl.constexpr, IEEE: tl.constexpr, VISIBLE: tl.constexpr,
                     RING: tl.constexpr):
        """One tile of BLOCK_N slots from n0. A VISIBLE tile lies wholly before every
        row's position, inside every row's sliding window and inside the range: no masks
        at all (wide, pipelined loads). Other tiles (the verify window's own slots, a
        sliding window's start, the end of the range) mask slots per row.

        COLLECT sums the main tile's rows (visible ones only, in masked tiles); with
        DOT_SUM a VISIBLE tile instead takes the column sum of a small dot of K with
        ``q_sum`` [MIN_BLOCK_M, D] (the weighted query sum's high and low parts). The edge
        logits (KEEP_EDGES) come from a second, small dot of K with the edge rows'
        queries ``q_side`` [SIDE_M, D]: storing those rows of the main [BLOCK_M, N] tile
        instead cost 62% of a 9-row verify at the Qwen3-8B shape, the side dot 19%
        (docs/results/kernels.md)."""
        slots = n0 + tl.arange(0, BLOCK_N)
        side_rows = tl.arange(0, SIDE_M)
        dims = tl.arange(0, D)
        if RING:
            stored = slots % ring  # position p lives in slot p % ring
        else:
            stored = slots
        k_ptrs = k_head + stored[:, None] * sk_s + dims[None, :]
        v_ptrs = v_head + stored[:, None] * sv_s + dims[None, :]
        if VISIBLE:
            k = tl.load(k_ptrs)
            s = scaled_scores(q, k, sm_scale, IEEE)
            if COLLECT and DOT_SUM:
                tl.store(scores_head + slots,
                         tl.sum(scaled_scores(q_sum, k, sm_scale, IEEE), axis=0))
            elif COLLECT:
                # The weighted column sum of the dot's own output: K stays a pure dot
                # operand, so its shared-memory tile keeps the swizzled layout (a second
                # consumer of K dropped it, and ldmatrix then bank-conflicted 8 ways).
                # Padding rows have q = 0 and weight 0: they add nothing.
                tl.store(scores_head + slots, tl.sum(s * weight[:, None], axis=0))
            if KEEP_EDGES:
                s_side = scaled_scores(q_side, k, sm_scale, IEEE)
                _store_edges(edges_head, side_rows, side_ok[:, None], slots, s_side, se_r)
            vt = tl.load(v_ptrs)
        else:
            in_range = slots < end
            k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
            s = scaled_scores(q, k, sm_scale, IEEE)
            visible = ((slots[None, :] <= pos[:, None]) & (slots[None, :] > pos[:, None] - window)
                       & in_range[None, :] & row_ok[:, None])
            if COLLECT:
                collected = tl.sum(tl.where(visible, s, 0.0) * weight[:, None], axis=0)
                tl.store(scores_head + slots, collected, mask=in_range)
            if KEEP_EDGES:
                s_side = scaled_scores(q_side, k, sm_scale, IEEE)
                seen = slots[None, :] <= side_pos[:, None]  # edge layers have no window
                _store_edges(edges_head, side_rows, side_ok[:, None] & in_range[None, :],
                             slots, tl.where(seen, s_side, float("-inf")), se_r)
            vt = tl.load(v_ptrs, mask=in_range[:, None], other=0.0)
            s = tl.where(visible, s, float("-inf"))
        return softmax_step(s, vt, m_i, l_i, acc, IEEE)

    @triton.jit
    def _verify_split_kernel(
        Q, K, V, POS, ROWW, ACC, MAX, SUM, LIVE, SCORES, EDGES,
        COUNT, SINKS, OUT, LSE, so_b, so_t, so_h, sl_b, sl_t, sl_h,
        sq_b, sq_t, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sp_b, sp_t, sw_b, sw_t,
        sa_bh, sa_sp, sa_m, sm_bh, sm_sp, ss_b, ss_h, se_b, se_h, se_r,
        kv_len, window, splits, sm_scale, ring,
        H_KV: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COLLECT: tl.constexpr,
        DOT_SUM: tl.constexpr, SIDE_M: tl.constexpr, KEEP_EDGES: tl.constexpr,
        WINDOWED: tl.constexpr, RING: tl.constexpr, IEEE: tl.constexpr,
        MERGE: tl.constexpr, LANES: tl.constexpr, MERGE_ROWS: tl.constexpr,
        MERGE_DIMS: tl.constexpr, STORE_LSE: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H_KV
        kvh = bh % H_KV
        # This head's K/V rows: 64-bit scalar bases (a cache can pass 2**31 elements),
        # 32-bit offsets within them.
        k_head = K + (b.to(tl.int64) * sk_b + kvh.to(tl.int64) * sk_h)
        v_head = V + (b.to(tl.int64) * sv_b + kvh.to(tl.int64) * sv_h)
        scores_head = SCORES + b * ss_b + kvh * ss_h
        edges_head = EDGES + (b.to(tl.int64) * se_b + kvh.to(tl.int64) * se_h)
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < G * T
        head = kvh * G + rows // T
        trow = rows % T
        dims = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + trow[:, None] * sq_t + head[:, None] * sq_h + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        # Slot arithmetic in 32 bits (int64 positions would widen every [M, N] compare).
        pos = tl.load(POS + b * sp_b + trow * sp_t, mask=row_ok, other=-1).to(tl.int32)
        weight = tl.zeros([BLOCK_M], tl.float32)
        # The edge rows' queries for the side dot (see _verify_tile), their positions and
        # valid rows.
        side_rows = tl.arange(0, SIDE_M)
        q_side = tl.zeros([SIDE_M, D], q.dtype)
        side_pos = tl.zeros([SIDE_M], tl.int32)
        side_ok = side_rows < 0
        q_sum = tl.zeros([MIN_SUM_M, D], q.dtype)
        if COLLECT:
            weight = tl.load(ROWW + b * sw_b + trow * sw_t, mask=row_ok, other=0.0)
        if COLLECT and DOT_SUM:
            # Row 0: the weighted query sum in q's dtype; row 1: what that rounding lost
            # (0 in float32), so the dot sees it to about float32 precision.
            summed = tl.sum(q.to(tl.float32) * weight[:, None], axis=0)  # [D]
            high = summed.to(q.dtype)
            low = (summed - high.to(tl.float32)).to(q.dtype)
            part = tl.arange(0, MIN_SUM_M)[:, None]
            q_sum = tl.where(part == 0, high[None, :],
                             tl.where(part == 1, low[None, :], tl.zeros_like(high)[None, :]))
        if KEEP_EDGES:
            # Edge row r: head r // E of the group at window row 0 (r % E == 0) or T - 1,
            # E = 2 (1 when T == 1); row r of the edge logits.
            E: tl.constexpr = 2 if T > 1 else 1
            side_ok = side_rows < E * G
            side_t = tl.where(side_rows % E == 0, 0, T - 1)
            side_head = kvh * G + side_rows // E
            q_side = tl.load(Q + b * sq_b + side_t[:, None] * sq_t + side_head[:, None] * sq_h
                             + dims[None, :], mask=side_ok[:, None], other=0.0)
            side_pos = tl.load(POS + b * sp_b + side_t * sp_t, mask=side_ok,
                               other=-1).to(tl.int32)
        # The slots any row of this sequence sees, [low, total), from the device
        # positions alone.
        first_pos = tl.min(tl.where(row_ok, pos, kv_len), axis=0)
        last_pos = tl.max(pos, axis=0)
        total = tl.maximum(tl.minimum(last_pos + 1, kv_len), 0)
        if WINDOWED:
            low = tl.minimum(tl.maximum(first_pos - window + 1, 0), total)
        else:
            low = total * 0
        start, end, live = split_range(low, total, split, splits, BLOCK_N)
        # Whole tiles inside every row's window and below every row's position: visible
        # to all rows. Before them, the tiles where a sliding window starts; after, the
        # verify window's own tiles and the range's end. Without a window there is no
        # head: WINDOWED compiles its loop away, because a third loop in every kernel took
        # 36-row fused scores at the Qwen3-8B shape from +6% to +18% over a plain verify
        # (docs/results/kernel-launch.md#fused-score-sums-a-dot-from-64-rows).
        if WINDOWED:
            inside_all = tl.minimum(tl.maximum(last_pos - window + 1 - start, 0), end - start)
            head_end = start + tl.minimum(tl.cdiv(inside_all, BLOCK_N) * BLOCK_N, end - start)
        else:
            head_end = start
        seen_by_all = tl.minimum(first_pos + 1, end)
        visible_end = head_end + tl.maximum(seen_by_all - head_end, 0) // BLOCK_N * BLOCK_N
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        if WINDOWED:
            for n0 in range(start, head_end, BLOCK_N):
                m_i, l_i, acc = _verify_tile(q, q_side, q_sum, k_head, v_head, scores_head,
                                             edges_head, n0, end, pos, side_pos, window,
                                             weight, row_ok, side_ok, m_i, l_i, acc, sk_s,
                                             sv_s, se_r, sm_scale, ring, BLOCK_N, D, SIDE_M,
                                             COLLECT, DOT_SUM, KEEP_EDGES, IEEE, False, RING)
        for n0 in range(head_end, visible_end, BLOCK_N):
            m_i, l_i, acc = _verify_tile(q, q_side, q_sum, k_head, v_head, scores_head,
                                         edges_head, n0, end, pos, side_pos, window, weight,
                                         row_ok, side_ok, m_i, l_i, acc, sk_s, sv_s, se_r,
                                         sm_scale, ring, BLOCK_N, D, SIDE_M, COLLECT,
                                         DOT_SUM, KEEP_EDGES, IEEE, True, RING)
        for n0 in range(visible_end, end, BLOCK_N):
            m_i, l_i, acc = _verify_tile(q, q_side, q_sum, k_head, v_head, scores_head,
                                         edges_head, n0, end, pos, side_pos, window, weight,
                                         row_ok, side_ok, m_i, l_i, acc, sk_s, sv_s, se_r,
                                         sm_scale, ring, BLOCK_N, D, SIDE_M, COLLECT,
                                         DOT_SUM, KEEP_EDGES, IEEE, False, RING)
        store_partials(ACC, MAX, SUM, LIVE, bh, split, bh * sa_bh + split * sa_sp,
                       bh * sm_bh + split * sm_sp, sa_m, acc, m_i, l_i, live, start, end,
                       G * T, BLOCK_M, D)
        if MERGE:
            merge_if_last(COUNT, ACC, MAX, SUM, SINKS, OUT, LSE, bh, splits, live, sa_bh,
                          sa_sp, sa_m, sm_bh, sm_sp, so_b, so_t, so_h, sl_b, sl_t, sl_h,
                          H_KV, G, T, LANES, MERGE_ROWS, MERGE_DIMS, STORE_LSE, HAS_SINKS)


def edge_rows(t: int) -> int:
    """Window rows whose logits ``edge_logits`` keeps: the first and last (one if T == 1)."""
    return 2 if t > 1 else 1


def scores_home(scores_out, b: int, h_kv: int, kv_len: int, device) -> torch.Tensor:
    """``scores_out`` checked as a home for [B, H_kv, kv_len] float32 scores, or a new
    tensor when None."""
    if scores_out is None:
        # Slots past each sequence's total stay unwritten, so no zero-fill.
        return torch.empty(b, h_kv, kv_len, device=device, dtype=torch.float32)
    if (scores_out.dtype != torch.float32 or tuple(scores_out.shape[:2]) != (b, h_kv)
            or scores_out.shape[2] < kv_len or scores_out.stride(2) != 1):
        raise ValueError(f"scores_out must be float32 [{b}, {h_kv}, >= {kv_len}] with a "
                         f"contiguous last dim, got {scores_out.dtype} {tuple(scores_out.shape)} "
                         f"strides {scores_out.stride()}")
    return scores_out


def verify_attention(q, k, v, positions, kv_len: int, row_weights=None, *, scores_out=None,
                     edge_logits: bool = False, splits: int | None = None,
                     window: int | None = None, sinks=None, ring: int | None = None):
    """Triton verify/decode attention; same contract as ``reference_verify_attention``
    but ``out`` in q's dtype, and scores only at the slots each sequence's rows see
    (below its total, and from its first row's window start).

    With ``edge_logits`` (no row_weights, no window) the third output is instead the
    logits q.k / sqrt(D) of the first and last window rows, float16 [B, H_kv, E * G,
    kv_len] (E = 2 rows, or 1 when T == 1; row ``E * g + e`` is head g of the group at
    edge e), invisible slots -inf: with the returned lse they give the Collect-2-Query
    ``weight`` scores (``vegas_kernels.collect_scores.edge_weight_scores``) without reading K
    again. Slots at or past each sequence's total are left unwritten.

    q [B, T, H, D]; k, v [B, H_kv, >= kv_len, D] (last dim contiguous); positions [B, T];
    kv_len: a static bound on the slots read; row_weights [B, T] or None; scores_out: an
    optional float32 [B, H_kv, >= kv_len] home for the scores (any strides but the last);
    splits: the split count (default ``splits_for``); window: a sliding window or None;
    sinks: [H] or None; ring: k and v are a sliding layer's ring of this many slots,
    position p at slot p % ring (it must hold every row's window: ring >= window + T - 1).
    Reads nothing back from the device.
    """
    b, t, h, d = q.shape
    h_kv = k.shape[1]
    g = h // h_kv
    dev = q.device
    # With a window, a sequence's rows see at most window + T - 1 slots.
    bound = kv_len if window is None else min(kv_len, window + t - 1)
    block_n = launch.tile_slots(d)
    splits = splits or launch.splits_for(dev, b * h_kv, bound, block_n)
    partials = split_buffers(b, h_kv, splits, g * t, d, dev)
    acc, maxes, sums, live = partials
    collect = row_weights is not None
    if scores_out is not None and not collect:
        raise ValueError("scores_out needs row_weights")
    if ring is not None and (collect or window is None or window + t - 1 > ring):
        raise ValueError(f"a ring of {ring} slots serves a sliding window of at most "
                         f"{ring - t + 1} positions, without scores")
    if edge_logits and (collect or window is not None):
        raise ValueError("edge_logits replaces row_weights and needs a layer without a "
                         "sliding window")
    scores = scores_home(scores_out, b, h_kv, kv_len, dev) if collect else maxes
    weights = row_weights.float() if collect else positions  # placeholder pointer
    edges = (torch.empty(b, h_kv, edge_rows(t) * g, kv_len, device=dev, dtype=torch.float16)
             if edge_logits else maxes)  # placeholder pointer
    out = torch.empty(b, t, h, d, device=dev, dtype=q.dtype)
    lse = torch.empty(b, t, h, device=dev, dtype=torch.float32)
    counters = (split_counters(dev, b * h_kv) if launch.merges_in_kernel(splits, g * t, d)
                else None)
    merge, merge_flags = merge_args(partials, out, lse, counters, sinks)
    _verify_split_kernel[(b * h_kv, splits)](
        q, k, v, positions, weights, acc, maxes, sums, live, scores, edges, *merge,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), positions.stride(0), positions.stride(1),
        weights.stride(0), weights.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2), maxes.stride(0), maxes.stride(1),
        scores.stride(0), scores.stride(1), edges.stride(0), edges.stride(1), edges.stride(2),
        kv_len, NO_WINDOW if window is None else window, splits, 1.0 / math.sqrt(d),
        ring or 1,
        H_KV=h_kv, G=g, T=t, D=d, BLOCK_M=launch.block_rows(g * t), BLOCK_N=block_n,
        COLLECT=collect, DOT_SUM=launch.block_rows(g * t) >= launch.DOT_SUM_ROWS,
        SIDE_M=launch.block_rows(edge_rows(t) * g if edge_logits else 1),
        KEEP_EDGES=edge_logits, WINDOWED=window is not None, RING=ring is not None,
        IEEE=q.dtype == torch.float32,
        **merge_flags, num_warps=launch.SPLIT_WARPS, num_stages=launch.split_stages(d),
    )
    if counters is None:
        merge_partials(partials, out, lse, h_kv, g, t, sinks)
    return out, lse, (scores if collect else edges if edge_logits else None)
