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


@functools.cache
def _can_set_priority() -> bool:
    """torch >= 2.6 lets ``sdpa_kernel`` order backends, not only enable them."""
    return "set_priority" in inspect.signature(sdpa_kernel).parameters


def reference_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                start: int) -> torch.Tensor:
    """q [B, T, H, D]; k, v [B, H_kv, >= start + T, D] -> [B, T, H, D], computed in
    float32 or wider with an explicit mask."""
    b, t, h, d = q.shape
    h_kv = k.shape[1]
    s = start + t
    acc = torch.promote_types(q.dtype, torch.float32)
    qg = q.to(acc).view(b, t, h_kv, h // h_kv, d).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    kk, vv = k[:, :, :s].to(acc), v[:, :, :s].to(acc)
    scores = torch.einsum("bkgtd,bksd->bkgts", qg, kk) / math.sqrt(d)
    positions = torch.arange(start, s, device=q.device)[:, None]  # [T, 1]
    scores = scores.masked_fill(torch.arange(s, device=q.device) > positions, float("-inf"))
    out = torch.einsum("bkgts,bksd->bkgtd", torch.softmax(scores, dim=-1), vv)
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, h, d)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      start: int) -> torch.Tensor:
    """q [B, T, H, D] at positions start..start+T-1 of every sequence; k, v
    [B, H_kv, >= start + T, D] (any strides with a contiguous last dim, e.g. cache
    views) -> [B, T, H, D] in q's dtype."""
    t = q.shape[1]
    s = start + t
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
