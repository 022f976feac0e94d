"""Prefill attention: a block of query rows after a prefix already in the cache.

Every sequence of the batch holds its block at the same positions ``start .. start+T-1``
and attends to the cache slots ``[0, start + T)``: the whole prefix, and its own block
causally (the "lower-right" causal mask of a T x (start + T) score matrix). A whole
prompt is the case ``start == 0``.

Served by PyTorch's fused scaled-dot-product attention, which streams K/V in tiles and
never holds the [T, S] scores, so memory grows linearly with the context:

- ``start == 0``: plain causal SDPA. On CUDA the cuDNN kernel is asked for first: on an
  H200 it runs a causal 64k x 64k head-dim-128 block at about 600 TFLOP/s against 350
  for FlashAttention-2 (docs/results/prefill-h200.md).
- ``start > 0``: the lower-right causal bias (``torch.nn.attention.bias``), which PyTorch
  serves with FlashAttention-2 on CUDA in half precision; elsewhere an explicit
  [T, start + T] boolean mask (one per block, not per head).

Both take the GQA layout as it is (``enable_gqa``): no copy of K/V per query head.

A sliding layer (``window``: row p sees slots p - window < s <= p) runs in blocks of
``WINDOW_BLOCK_ROWS`` rows, each over only the keys its rows see (the block and the
window before it) with an explicit band mask: memory and work grow with the context
times the window, not with the context squared.

``reference_prefill_attention`` is the float32/float64 ground truth.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

# Kernel preference for whole-prompt blocks on CUDA; PyTorch falls through the list to
# the first one that supports the shape and dtype.
CUDA_CAUSAL_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
# Inputs FlashAttention serves, the only fused kernel with the lower-right mask and GQA.
FLASH_DTYPES = (torch.float16, torch.bfloat16)
# Query rows per call in a sliding layer: a block's keys are its rows plus the window
# before them, so the band mask of a block stays a few MB (Gemma3's 512-slot window).
WINDOW_BLOCK_ROWS = 2048


@functools.cache
def _can_set_priority() -> bool:
    """torch >= 2.6 lets ``sdpa_kernel`` order backends, not only enable them."""
    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def reference_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                start: int, window: int | None = None) -> torch.Tensor:
    """q [B, T, H, D]; k, v [B, H_kv, >= start + T, D] -> [B, T, H, D], computed in
    float32 or wider with an explicit mask (a band of ``window`` slots when given)."""
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
    out = torch.einsum("bkgts,bksd->bkgtd", torch.softmax(scores, dim=-1), vv)
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, h, d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      start: int, window: int | None = None) -> torch.Tensor:
    """q [B, T, H, D] at positions start..start+T-1 of every sequence; k, v
    [B, H_kv, >= start + T, D] (any strides with a contiguous last dim, e.g. cache
    views); window: a sliding window or None -> [B, T, H, D] in q's dtype."""
    t = q.shape[1]
    s = start + t
    if window is not None and window < s:
        return _windowed(q, k, v, start, window)
    qt = q.transpose(1, 2)  # [B, H, T, D]: SDPA's layout, as a view
    kk, vv = k[:, :, :s], v[:, :, :s]
    if start == 0:
        if q.is_cuda and _can_set_priority():
            with sdpa_kernel(CUDA_CAUSAL_BACKENDS, set_priority=True):
                out = F.scaled_dot_product_attention(qt, kk, vv, is_causal=True,
                                                     enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(qt, kk, vv, is_causal=True, enable_gqa=True)
    elif q.is_cuda and q.dtype in FLASH_DTYPES:
        out = F.scaled_dot_product_attention(qt, kk, vv, attn_mask=causal_lower_right(t, s),
                                             enable_gqa=True)
    else:
        # PyTorch would materialise the lower-right bias here anyway (and warn each call).
        visible = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=start)
        out = F.scaled_dot_product_attention(qt, kk, vv, attn_mask=visible, enable_gqa=True)
    return out.transpose(1, 2)  # [B, T, H, D]


def _windowed(q, k, v, start: int, window: int) -> torch.Tensor:
    """``prefill_attention`` of a sliding layer, block by block of query rows."""
    t = q.shape[1]
    blocks = []
    for a in range(0, t, WINDOW_BLOCK_ROWS):
        b = min(a + WINDOW_BLOCK_ROWS, t)
        first = max(0, start + a - window + 1)  # the lowest slot a row of the block sees
        positions = torch.arange(start + a, start + b, device=q.device)[:, None]  # [T', 1]
        slots = torch.arange(first, start + b, device=q.device)  # [S']
        visible = (slots <= positions) & (slots > positions - window)
        out = F.scaled_dot_product_attention(
            q[:, a:b].transpose(1, 2), k[:, :, first:start + b], v[:, :, first:start + b],
            attn_mask=visible, enable_gqa=True)
        blocks.append(out.transpose(1, 2))
    return torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]
