"""Selection scores after the verify pass, when they could not be fused into it.

The Vegas drafter ranks the prefix slots of each KV head by the attention of a few
window rows. When those rows are only known once acceptance is decided (the ``last``
accepted row) or the scores are softmax weights (which need the final log-sum-exp of
each row), the verify kernel cannot sum them on the fly; this kernel computes them
afterwards from the same q, reading K once more:

    scores[b, kvh, s] = sum over the group's heads h and window rows t of
                        row_weights[b, t] * x(b, t, h, s),   for s <= positions[b, t]

with ``x = q.k / sqrt(D)`` (``logit`` mode, ``lse`` None) or ``x = exp(q.k / sqrt(D) -
lse[b, t, h])`` (``weight`` mode, ``lse`` [B, T, H] from ``verify_attention``).
Invisible slots contribute 0.

Layout as in ``vegas_kernels.verify_attention``: the G * T rows of a KV group are packed into
one tile (row r: head ``kvh * G + r // T``, window row ``r % T``). One program per
(sequence * KV head, block of ``launch.COLLECT_TILES`` tiles of BLOCK_N slots up to the
static ``kv_len``); a program reads ``total = min(kv_len, max(positions[b]) + 1)`` from the
device and does nothing past it, so one launch (a captured CUDA graph) serves any length
up to the bound. Slots at or past ``total`` are left unwritten.

When the rows are the first and last of the window (Collect-2-Query) and known before
the pass, the verify kernel keeps those rows' logits instead (``verify_attention(...,
edge_logits=True)``, float16), and ``edge_weight_scores`` turns them into the ``weight``
scores with the pass's lse: 4 bytes per slot and head of the group written and read
back, not K (D elements per slot) read again. Float16 keeps a logit x to within
|x| * 2**-11, so a weight exp(x - lse) to that relative error.

``reference_collect_scores`` is the PyTorch ground truth.
"""

from __future__ import annotations

import math

import torch

from vegas_kernels import launch
from vegas_kernels.verify_attention import edge_rows, scores_home

try:
    import triton
    import triton.language as tl

    from vegas_kernels.split_merge import scaled_scores
except ImportError:  # CPU-only installs: the reference path is used
    triton = None

__all__ = ["collect_scores", "edge_weight_scores", "reference_collect_scores"]


def reference_collect_scores(q, k, positions, row_weights, kv_len, lse=None):
    """q [B, T, H, D]; k [B, H_kv, S, D]; positions, row_weights [B, T]; lse [B, T, H] or
    None -> scores [B, H_kv, kv_len] in float32 or wider (q's dtype if wider)."""
    b, t, h, d = q.shape
    h_kv = k.shape[1]
    g = h // h_kv
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).view(b, t, h_kv, g, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    x = torch.einsum("bkgtd,bksd->bkgts", qg, k[:, :, :kv_len].to(acc)) / math.sqrt(d)
    if lse is not None:
        row_lse = lse.to(acc).view(b, t, h_kv, g).permute(0, 2, 3, 1)  # [B, Hkv, G, T]
        x = torch.exp(x - row_lse[..., None])
    visible = torch.arange(kv_len, device=q.device) <= positions[:, None, None, :, None]
    w = row_weights.to(acc)[:, None, None, :, None]
    return (x.masked_fill(~visible, 0.0) * w).sum(dim=(2, 3))


if triton is not None:

    @triton.jit
    def _collect_tile(q, k_head, out_head, n0, end, pos, weight, row_lse, row_ok, sk_s,
                      sm_scale, BLOCK_N: tl.constexpr, D: tl.constexpr,
                      WEIGHT_MODE: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr):
        """Scores of the BLOCK_N slots from n0. The tile is transposed, slots x rows, so
        that the sum over rows stays inside each warp (the slots are spread over the
        warps). Only the tile holding the sequence's end (MASKED) masks slots at or past
        ``end``, so whole tiles load wide."""
        slots = n0 + tl.arange(0, BLOCK_N)
        in_range = slots < end
        k_ptrs = k_head + slots[:, None] * sk_s + tl.arange(0, D)[None, :]
        if MASKED:
            k = tl.load(k_ptrs, mask=in_range[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs)
        x = scaled_scores(k, q, sm_scale, IEEE)  # [BLOCK_N, BLOCK_M]
        if WEIGHT_MODE:
            x = tl.exp(x - row_lse[None, :])
        visible = (slots[:, None] <= pos[None, :]) & row_ok[None, :]
        if MASKED:
            visible = visible & in_range[:, None]
        collected = tl.sum(tl.where(visible, x, 0.0) * weight[None, :], axis=1)
        if MASKED:
            tl.store(out_head + slots, collected, mask=in_range)
        else:
            tl.store(out_head + slots, collected)

    @triton.jit
    def _collect_kernel(
        Q, K, POS, ROWW, LSE, OUT,
        sq_b, sq_t, sq_h, sk_b, sk_h, sk_s, sp_b, sp_t, sw_b, sw_t, sl_b, sl_t, sl_h,
        so_b, so_h, kv_len, sm_scale,
        H_KV: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TILES: tl.constexpr,
        WEIGHT_MODE: tl.constexpr, IEEE: tl.constexpr,
    ):
        bh = tl.program_id(0)
        first = tl.program_id(1) * (TILES * BLOCK_N)
        b = bh // H_KV
        kvh = bh % H_KV
        # This head's K rows: a 64-bit scalar base (a cache can pass 2**31 elements),
        # 32-bit offsets within it.
        k_head = K + (b.to(tl.int64) * sk_b + kvh.to(tl.int64) * sk_h)
        out_head = OUT + b * so_b + kvh * so_h
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < G * T
        trow = rows % T
        # Slot arithmetic in 32 bits (int64 positions would widen every [M, N] compare).
        pos = tl.load(POS + b * sp_b + trow * sp_t, mask=row_ok, other=-1).to(tl.int32)
        total = tl.minimum(tl.max(pos, axis=0) + 1, kv_len)
        # Tiles past this sequence's last position are skipped: no loads, no stores.
        end = tl.maximum(tl.minimum(first + TILES * BLOCK_N, total), first)
        full_end = first + (end - first) // BLOCK_N * BLOCK_N
        if first < end:
            head = kvh * G + rows // T
            dims = tl.arange(0, D)
            q = tl.load(Q + b * sq_b + trow[:, None] * sq_t + head[:, None] * sq_h
                        + dims[None, :], mask=row_ok[:, None], other=0.0)
            weight = tl.load(ROWW + b * sw_b + trow * sw_t, mask=row_ok, other=0.0)
            row_lse = tl.zeros([BLOCK_M], tl.float32)
            if WEIGHT_MODE:
                row_lse = tl.load(LSE + b * sl_b + trow * sl_t + head * sl_h, mask=row_ok,
                                  other=0.0)
            for n0 in range(first, full_end, BLOCK_N):
                _collect_tile(q, k_head, out_head, n0, end, pos, weight, row_lse, row_ok, sk_s,
                              sm_scale, BLOCK_N, D, WEIGHT_MODE, IEEE, False)
            for n0 in range(full_end, end, BLOCK_N):  # at most one partial tile
                _collect_tile(q, k_head, out_head, n0, end, pos, weight, row_lse, row_ok, sk_s,
                              sm_scale, BLOCK_N, D, WEIGHT_MODE, IEEE, True)


if triton is not None:

    @triton.jit
    def _edge_weight_kernel(
        EDGES, LSE, POS, ROWW, OUT,
        se_b, se_h, se_r, sl_b, sl_t, sl_h, sp_b, sp_t, sw_b, sw_t, so_b, so_h, kv_len,
        H_KV: tl.constexpr, G: tl.constexpr, T: tl.constexpr, E: tl.constexpr,
        ROWS: tl.constexpr, T_PAD: tl.constexpr, BLOCK: tl.constexpr,
    ):
        bh = tl.program_id(0)
        b = bh // H_KV
        kvh = bh % H_KV
        slots = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        window = tl.arange(0, T_PAD)
        pos = tl.load(POS + b * sp_b + window * sp_t, mask=window < T, other=-1)
        total = tl.minimum(tl.max(pos, axis=0) + 1, kv_len).to(tl.int32)
        in_range = slots < total
        # Edge row r: head r // E of the group at window row 0 (r % E == 0) or T - 1.
        r = tl.arange(0, ROWS)
        r_ok = r < E * G
        trow = tl.where(r % E == 0, 0, T - 1)
        head = kvh * G + r // E
        lse = tl.load(LSE + b * sl_b + trow * sl_t + head * sl_h, mask=r_ok, other=0.0)
        weight = tl.load(ROWW + b * sw_b + trow * sw_t, mask=r_ok, other=0.0)
        # A row that saw no slot (lse -inf) adds nothing, rather than exp(-inf + inf).
        use = r_ok & (lse > float("-inf"))
        logits = tl.load(EDGES + (b.to(tl.int64) * se_b + kvh.to(tl.int64) * se_h)
                         + r[:, None] * se_r + slots[None, :],
                         mask=use[:, None] & in_range[None, :], other=float("-inf"))
        p = tl.exp(logits.to(tl.float32) - tl.where(use, lse, 0.0)[:, None])
        scores = tl.sum(tl.where(use[:, None], p * weight[:, None], 0.0), axis=0)
        tl.store(OUT + b * so_b + kvh * so_h + slots, scores, mask=in_range)


def edge_weight_scores(edges, lse, positions, row_weights, kv_len: int, out=None):
    """Collect-2-Query ``weight`` scores from the edge logits of a verify pass ->
    [B, H_kv, kv_len] float32 (``out`` when given), as ``reference_collect_scores`` with
    ``lse`` for row weights that are 0 outside the first and last row.

    edges: float16 [B, H_kv, E * G, >= kv_len] from ``verify_attention(...,
    edge_logits=True)``; lse [B, T, H] from the same call; positions, row_weights
    [B, T]; out: an optional float32 [B, H_kv, >= kv_len] (any strides but the last).
    Slots at or past each sequence's total are left unwritten."""
    b, t, h = lse.shape
    h_kv = edges.shape[1]
    g = h // h_kv
    e = edge_rows(t)
    if tuple(edges.shape[:3]) != (b, h_kv, e * g) or edges.dtype != torch.float16:
        raise ValueError(f"edges must be float16 [{b}, {h_kv}, {e * g}, S], got "
                         f"{edges.dtype} {tuple(edges.shape)}")
    out = scores_home(out, b, h_kv, kv_len, lse.device)
    weights = row_weights.float()
    if kv_len == 0:
        return out
    _edge_weight_kernel[(b * h_kv, triton.cdiv(kv_len, launch.EDGE_BLOCK))](
        edges, lse, positions, weights, out,
        edges.stride(0), edges.stride(1), edges.stride(2), *lse.stride(),
        positions.stride(0), positions.stride(1), weights.stride(0), weights.stride(1),
        out.stride(0), out.stride(1), kv_len,
        H_KV=h_kv, G=g, T=t, E=e, ROWS=triton.next_power_of_2(e * g),
        T_PAD=triton.next_power_of_2(t), BLOCK=launch.EDGE_BLOCK,
    )
    return out


def collect_scores(q, k, positions, row_weights, kv_len: int, lse=None, out=None):
    """Row-weighted selection scores -> [B, H_kv, kv_len] float32 (``out`` when given).

    q [B, T, H, D]; k [B, H_kv, >= kv_len, D] (last dim contiguous); positions,
    row_weights [B, T]; kv_len: a static bound on the slots read; lse [B, T, H] float32
    (weight mode) or None (logit mode); out: an optional float32 [B, H_kv, >= kv_len]
    tensor (any strides but the last). Slots at or past each sequence's
    ``min(kv_len, max(positions[b]) + 1)`` are left unwritten. Reads nothing back from
    the device."""
    b, t, h, d = q.shape
    h_kv = k.shape[1]
    g = h // h_kv
    out = scores_home(out, b, h_kv, kv_len, q.device)
    weights = row_weights.float()
    weight_mode = lse is not None
    lse_arg = lse if weight_mode else weights  # unused placeholder pointer
    lse_strides = lse.stride() if weight_mode else (0, 0, 0)
    if kv_len == 0:  # an empty grid is not launched
        return out
    per_program = launch.COLLECT_TILES * launch.BLOCK_N  # slots
    _collect_kernel[(b * h_kv, triton.cdiv(kv_len, per_program))](
        q, k, positions, weights, lse_arg, out,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        positions.stride(0), positions.stride(1), weights.stride(0), weights.stride(1),
        *lse_strides, out.stride(0), out.stride(1), kv_len, 1.0 / math.sqrt(d),
        H_KV=h_kv, G=g, T=t, D=d, BLOCK_M=launch.block_rows(g * t), BLOCK_N=launch.BLOCK_N,
        TILES=launch.COLLECT_TILES, WEIGHT_MODE=weight_mode, IEEE=q.dtype == torch.float32,
    )
    return out
