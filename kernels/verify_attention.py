"""Verify (and decode) attention: a few query rows against the whole KV cache.

Flash-decoding layout: one program per (sequence, KV head, split of the KV length).
All query heads of a KV group and all T rows of the window are packed into one tile of
``G * T`` rows, so each K/V tile is read once for the whole group; splits are merged by
log-sum-exp afterwards. Row r of the tile is query head ``kv_head * G + r // T`` at
window row ``r % T``; key slot s is visible to it when ``s <= positions[b, r % T]``.

With ``row_weights`` ([B, T]) the kernel also emits the selection scores of the Vegas
``logit`` mode for free: for each slot, the sum over the group's heads and the window
rows of ``weight[row] * q.k / sqrt(d)`` (visible slots only), shape [B, H_kv, S].

``reference_verify_attention`` is the PyTorch ground truth for both outputs.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path is used
    triton = None

BLOCK_N = 64
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows
MIN_HEAD_DIM = 16  # and a reduction of at least 16
PROGRAMS_PER_SM = 4  # enough programs to keep every SM busy at batch 1


def supported(q: torch.Tensor) -> bool:
    """Head dims the kernels handle (a power of two of at least 16)."""
    d = q.shape[-1]
    return d >= MIN_HEAD_DIM and d & (d - 1) == 0


def split_size_for(device: torch.device, programs_per_split: int, keys: int) -> int:
    """KV slots per program: enough splits to give the GPU about PROGRAMS_PER_SM
    programs per SM, never fewer than BLOCK_N slots each."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 1
    splits = max(1, math.ceil(PROGRAMS_PER_SM * sms / max(programs_per_split, 1)))
    size = math.ceil(max(keys, 1) / splits)
    return max(BLOCK_N, math.ceil(size / BLOCK_N) * BLOCK_N)


def reference_verify_attention(q, k, v, positions, kv_len, row_weights=None):
    """q [B, T, H, D]; k, v [B, H_kv, S, D]; positions [B, T] -> (out [B, T, H, D],
    lse [B, T, H], scores [B, H_kv, kv_len] or None), all in float32 or wider."""
    b, t, h, d = q.shape
    h_kv = k.shape[1]
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).view(b, t, h_kv, h // h_kv, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    kk, vv = k[:, :, :kv_len].to(acc), v[:, :, :kv_len].to(acc)
    s = torch.einsum("bkgtd,bksd->bkgts", qg, kk) / math.sqrt(d)
    visible = torch.arange(kv_len, device=q.device) <= positions[:, None, None, :, None]
    scores = None
    if row_weights is not None:
        w = row_weights.to(acc)[:, None, None, :, None]
        scores = (s.masked_fill(~visible, 0.0) * w).sum(dim=(2, 3))
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, G, T]
    out = torch.einsum("bkgts,bksd->bkgtd", torch.softmax(s, dim=-1), vv)
    out = out.permute(0, 3, 1, 2, 4).reshape(b, t, h, d)
    return out, lse.permute(0, 3, 1, 2).reshape(b, t, h), scores


if triton is not None:

    @triton.jit
    def _scaled_scores(q, k, sm_scale, IEEE: tl.constexpr):
        """q [M, D] . k [N, D]^T * scale; exact float32 products for float32 inputs."""
        if IEEE:
            return tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
        return tl.dot(q, tl.trans(k)) * sm_scale

    @triton.jit
    def _softmax_step(s, vt, m_i, l_i, acc, IEEE: tl.constexpr):
        """One online-softmax step over a tile of masked scores s [M, N] and values
        vt [N, D]; rows with nothing visible yet keep max -inf and add nothing."""
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        return m_new, l_i, acc

    @triton.jit
    def _store_partials(OUT, MAX, SUM, out_base, stat_base, so_m, acc, m_i, l_i,
                        BLOCK_M: tl.constexpr, D: tl.constexpr):
        rows = tl.arange(0, BLOCK_M)
        tl.store(OUT + out_base + rows[:, None] * so_m + tl.arange(0, D)[None, :], acc)
        tl.store(MAX + stat_base + rows, m_i)
        tl.store(SUM + stat_base + rows, l_i)

    @triton.jit
    def _verify_split_kernel(
        Q, K, V, POS, ROWW, OUT, MAX, SUM, SCORES,
        sq_b, sq_t, sq_h, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sp_b, sw_b,
        so_b, so_h, so_sp, so_m, sm_b, sm_h, sm_sp, ss_b, ss_h,
        kv_len, split_size, sm_scale,
        H_KV: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COLLECT: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        b = bh // H_KV
        kvh = bh % H_KV
        rows = tl.arange(0, BLOCK_M)
        row_ok = rows < G * T
        head = kvh * G + rows // T
        trow = rows % T
        dims = tl.arange(0, D)
        q = tl.load(Q + b * sq_b + trow[:, None] * sq_t + head[:, None] * sq_h + dims[None, :],
                    mask=row_ok[:, None], other=0.0)
        pos = tl.load(POS + b * sp_b + trow, mask=row_ok, other=-1)
        if COLLECT:
            weight = tl.load(ROWW + b * sw_b + trow, mask=row_ok, other=0.0)
        start = split * split_size
        end = tl.minimum(start + split_size, kv_len)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            slots = n0 + tl.arange(0, BLOCK_N)
            in_range = slots < end
            k = tl.load(K + b * sk_b + kvh * sk_h + slots[:, None] * sk_s + dims[None, :],
                        mask=in_range[:, None], other=0.0)
            s = _scaled_scores(q, k, sm_scale, IEEE)
            visible = (slots[None, :] <= pos[:, None]) & in_range[None, :] & row_ok[:, None]
            if COLLECT:
                collected = tl.sum(tl.where(visible, s, 0.0) * weight[:, None], axis=0)
                tl.store(SCORES + b * ss_b + kvh * ss_h + slots, collected, mask=in_range)
            vt = tl.load(V + b * sv_b + kvh * sv_h + slots[:, None] * sv_s + dims[None, :],
                         mask=in_range[:, None], other=0.0)
            m_i, l_i, acc = _softmax_step(tl.where(visible, s, float("-inf")), vt, m_i, l_i,
                                          acc, IEEE)
        _store_partials(OUT, MAX, SUM, b * so_b + kvh * so_h + split * so_sp,
                        b * sm_b + kvh * sm_h + split * sm_sp, so_m, acc, m_i, l_i, BLOCK_M, D)


def split_buffers(b: int, h_kv: int, splits: int, block_m: int, d: int, device):
    """Per-split partial outputs [B, H_kv, splits, M, D], row maxima and sums."""
    acc = torch.empty(b, h_kv, splits, block_m, d, device=device, dtype=torch.float32)
    maxes = torch.empty(b, h_kv, splits, block_m, device=device, dtype=torch.float32)
    return acc, maxes, torch.empty_like(maxes)


def merge_splits(acc, maxes, sums):
    """acc [..., S, M, D], maxes/sums [..., S, M] -> (out [..., M, D], lse [..., M])."""
    top = maxes.max(dim=-2, keepdim=True).values
    top_safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    scale = torch.exp(maxes - top_safe)  # empty splits: exp(-inf) = 0
    total = (sums * scale).sum(dim=-2)
    out = (acc * scale[..., None]).sum(dim=-3) / total[..., None]
    return out, top_safe.squeeze(-2) + torch.log(total)


def verify_attention(q, k, v, positions, kv_len, row_weights=None, split_size=None):
    """Triton verify/decode attention; same contract as ``reference_verify_attention``
    but ``out`` in q's dtype."""
    b, t, h, d = q.shape
    h_kv = k.shape[1]
    g = h // h_kv
    block_m = max(MIN_BLOCK_M, triton.next_power_of_2(g * t))
    split_size = split_size or split_size_for(q.device, b * h_kv, kv_len)
    splits = max(1, math.ceil(kv_len / split_size))
    dev = q.device
    acc, maxes, sums = split_buffers(b, h_kv, splits, block_m, d, dev)
    collect = row_weights is not None
    scores = torch.zeros(b, h_kv, kv_len, device=dev, dtype=torch.float32) if collect else maxes
    weights = row_weights.float().contiguous() if collect else maxes
    positions = positions.contiguous()
    _verify_split_kernel[(b * h_kv, splits)](
        q, k, v, positions, weights, acc, maxes, sums, scores,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), positions.stride(0), weights.stride(0),
        acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3),
        maxes.stride(0), maxes.stride(1), maxes.stride(2),
        scores.stride(0), scores.stride(1),
        kv_len, split_size, 1.0 / math.sqrt(d),
        H_KV=h_kv, G=g, T=t, D=d, BLOCK_M=block_m, BLOCK_N=BLOCK_N, COLLECT=collect,
        IEEE=q.dtype == torch.float32,
    )
    out, lse = merge_splits(acc, maxes, sums)  # [B, Hkv, M, D], [B, Hkv, M]
    out = out[:, :, : g * t].view(b, h_kv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h, d)
    lse = lse[:, :, : g * t].view(b, h_kv, g, t).permute(0, 3, 1, 2).reshape(b, t, h)
    return out.to(q.dtype), lse, (scores if collect else None)
