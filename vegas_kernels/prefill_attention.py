"""Prefill attention: a block of query rows after a prefix already in the cache.

Every sequence of the batch holds its block at the same positions ``start .. start+T-1``
and attends to the cache slots ``[0, start + T)``: the whole prefix, and its own block
causally (the "lower-right" causal mask of a T x (start + T) score matrix). A whole
prompt is the case ``start == 0``.

Served by PyTorch's fused scaled-dot-product attention, which streams K/V in tiles and
never holds the [T, S] scores, so memory grows linearly with the context:

- ``start == 0``: plain causal SDPA. On CUDA the cuDNN kernel is asked for first: on an
  H200 it runs a causal 64k x 64k head-dim-128 block at about 600 TFLOP/s against 350
  for FlashAttention-2 (docs/results/prefill.md).
- ``start > 0``: the lower-right causal bias (``torch.nn.attention.bias``), which PyTorch
  serves with FlashAttention-2 on CUDA in half precision; elsewhere an explicit
  [T, start + T] boolean mask (one per block, not per head).

Both take the GQA layout as it is (``enable_gqa``): no copy of K/V per query head.

A sliding layer (``window``: row p sees slots p - window < s <= p) runs in blocks of
``WINDOW_BLOCK_ROWS`` rows, each over only the keys its rows see (the block and the
window before it) with an explicit band mask: memory and work grow with the context
times the window, not with the context squared.

Attention ``sinks`` ([H], gpt-oss: a logit per query head that joins every row's
softmax as one more slot with no value) become a real key slot in front of the cache
that every row sees, with value 0; its logit reaches each query head through extra head
dimensions that only the queries fill (``_with_sink_slot``), so the fused kernels serve
these models too.

``reference_prefill_attention`` is the float32/float64 ground truth.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Kernel preference for whole-prompt blocks on CUDA; PyTorch falls through the list to
# the first one that supports the shape and dtype.
CUDA_CAUSAL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Inputs FlashAttention serves, the only fused kernel with the lower-right mask and GQA.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# Query rows per call in a sliding layer: a block's keys are its rows plus the window
# before them, so the band mask of a block stays a few MB (Gemma3's 512-slot window).
WINDOW_BLOCK_ROWS = 2048
# Head dims added to carry a sink's logit (two used: the logit split into a high and a
# low part, so bf16 keeps it to float32 precision); a multiple of 8, which the fused
# kernels want of head dims.
SINK_DIMS = 8


@functools.cache
def _can_set_priority() -> bool:
    """torch >= 2.6 lets ``sdpa_kernel`` order backends, not only enable them."""
    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def reference_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                start: int, window: int | None = None,
                                sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, T, H, D]; k, v [B, H_kv, >= start + T, D]; sinks [H] or None ->
    [B, T, H, D], computed in float32 or wider with an explicit mask (a band of
    ``window`` slots when given)."""
    b, t, h, d = q.shape
    h_kv = k.shape[1]
    s = start + t
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).view(b, t, h_kv, h // h_kv, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    kk, vv = k[:, :, :s].to(acc), v[:, :, :s].to(acc)
    scores = torch.einsum("bkgtd,bksd->bkgts", qg, kk) / math.sqrt(d)
    positions = torch.arange(start, s, device=q.device)[:, None]  # [T, 1]
    slots = torch.arange(s, device=q.device)
    hidden = slots > positions
    if window is not None:
        hidden |= slots <= positions - window
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = scores.logsumexp(dim=-1, keepdim=True)  # [B, Hkv, G, T, 1]
    if sinks is not None:
        lse = torch.logaddexp(lse, sinks.to(acc).view(1, h_kv, h // h_kv, 1, 1))
    out = torch.einsum("bkgts,bksd->bkgtd", torch.exp(scores - lse), vv)
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, h, d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      start: int, window: int | None = None,
                      sinks: torch.Tensor | None = None, *,
                      ring: int | None = None) -> torch.Tensor:
    """q [B, T, H, D] at positions start..start+T-1 of every sequence; k, v
    [B, H_kv, >= start + T, D] (any strides with a contiguous last dim, e.g. cache
    views), or with ``ring`` a layer's whole ring [B, H_kv, ring, D] (position p at
    slot p % ring; it must hold the window before the block and the block itself);
    window: a sliding window or None; sinks: [H] or None -> [B, T, H, D] in q's
    dtype."""
    b, t, h, d = q.shape
    s = start + t
    if ring is not None and s > ring:
        if window is None or window + t - 1 > ring:
            raise ValueError(f"a ring of {ring} slots cannot hold a window of {window} "
                             f"positions before a block of {t} rows")
        # The positions the block sees, in order: the band mask depends on differences
        # of positions only, so the block attends as if they started at 0.
        first = max(0, start - window + 1)
        slots = torch.arange(first, s, device=k.device) % ring
        k, v = k.index_select(2, slots), v.index_select(2, slots)
        start -= first
        s = start + t
    if sinks is not None:
        # The sink is slot 0 now: every position moves up by one.
        q, k, v = _with_sink_slot(q, k[:, :, :s], v[:, :, :s], sinks)
        out = _attend(q, k, v, start + 1, window, 1 / math.sqrt(d), sink_slot=True)
        return out[..., :d]
    return _attend(q, k, v, start, window, None, sink_slot=False)


def _attend(q, k, v, start: int, window: int | None, scale: float | None,
            sink_slot: bool) -> torch.Tensor:
    t = q.shape[1]
    s = start + t
    if window is not None and window < s:
        return _windowed(q, k, v, start, window, scale, sink_slot)
    qt = q.transpose(1, 2)  # [B, H, T, D]: SDPA's layout, as a view
    kk, vv = k[:, :, :s], v[:, :, :s]
    if start == 0:
        if q.is_cuda and _can_set_priority():
            with sdpa_kernel(CUDA_CAUSAL_BACKENDS, set_priority=True):
                out = F.scaled_dot_product_attention(qt, kk, vv, is_causal=True,
                                                     enable_gqa=True, scale=scale)
        else:
            out = F.scaled_dot_product_attention(qt, kk, vv, is_causal=True, enable_gqa=True,
                                                 scale=scale)
    elif q.is_cuda and q.dtype in FLASH_DTYPES:
        # Deferred: torch.nn.attention.bias imports torch._dynamo (1.4 s), and only this
        # branch needs it.
        from torch.nn.attention.bias import causal_lower_right

        out = F.scaled_dot_product_attention(qt, kk, vv, attn_mask=causal_lower_right(t, s),
                                             enable_gqa=True, scale=scale)
    else:
        # PyTorch would materialise the lower-right bias here anyway (and warn each call).
        visible = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(qt, kk, vv, attn_mask=visible, enable_gqa=True,
                                             scale=scale)
    return out.transpose(1, 2)  # [B, T, H, D]


def _windowed(q, k, v, start: int, window: int, scale: float | None,
              sink_slot: bool) -> torch.Tensor:
    """``prefill_attention`` of a sliding layer, block by block of query rows; with
    ``sink_slot``, slot 0 (the sink) is seen by every row as well."""
    t = q.shape[1]
    blocks = []
    for a in range(0, t, WINDOW_BLOCK_ROWS):
        b = min(a + WINDOW_BLOCK_ROWS, t)
        first = max(0, start + a - window + 1)  # the lowest slot a row of the block sees
        positions = torch.arange(start + a, start + b, device=q.device)[:, None]  # [T', 1]
        slots = torch.arange(first, start + b, device=q.device)  # [S']
        visible = (slots <= positions) & (slots > positions - window)
        kk, vv = k[:, :, first:start + b], v[:, :, first:start + b]
        if sink_slot and first > 0:
            kk, vv = torch.cat([k[:, :, :1], kk], dim=2), torch.cat([v[:, :, :1], vv], dim=2)
            visible = torch.cat([visible.new_ones(b - a, 1), visible], dim=1)
        elif sink_slot:
            visible[:, 0] = True
        out = F.scaled_dot_product_attention(q[:, a:b].transpose(1, 2), kk, vv,
                                             attn_mask=visible, enable_gqa=True, scale=scale)
        blocks.append(out.transpose(1, 2))
    return torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]


def _with_sink_slot(q, k, v, sinks):
    """(q, k, v) with SINK_DIMS more head dims and one more key slot in front: q's extra
    dims hold sinks[h] * sqrt(D) (high and low parts), the new slot's key is 1 in those
    dims and 0 elsewhere, real keys 0 there, and every value of the new slot is 0. With
    the scale kept at 1 / sqrt(D), q.k of a real slot is unchanged and that of the new
    slot is the sink."""
    b, t, h, d = q.shape
    h_kv, s = k.shape[1], k.shape[2]
    logit = sinks.to(torch.promote_types(q.dtype, torch.float32)) * math.sqrt(d)  # [H]
    high = logit.to(q.dtype)
    low = (logit - high.to(logit.dtype)).to(q.dtype)
    extra = q.new_zeros(b, t, h, SINK_DIMS)
    extra[..., 0], extra[..., 1] = high, low
    k2 = k.new_zeros(b, h_kv, s + 1, d + SINK_DIMS)
    k2[:, :, 1:, :d] = k
    k2[:, :, 0, d:d + 2] = 1
    v2 = v.new_zeros(b, h_kv, s + 1, d + SINK_DIMS)
    v2[:, :, 1:, :d] = v
    return torch.cat([q, extra], dim=-1), k2, v2
