"""Linear layers for a few rows (batched GEMV), and the gate/up projection with its
SiLU-gated multiply in the same kernel.

Why: a decode or draft step at batch 1-8 reads every weight once for a handful of rows,
so a linear layer is a pure weight stream. cuBLAS runs those GEMMs at about 0.88 of the
H200's copy bandwidth (docs/results/steps.md), and the weights are most of
an 8B model's draft step. Here each program streams ``BLOCK_N`` whole weight rows and
multiplies them with all the rows of x at once: the weight tile is the left operand of a
tensor-core dot and x, padded to ``ROWS_PAD`` rows, the right one (the output is
computed transposed), so one weight read serves every row.

Each output element is one dot product over K in a fixed order, whatever the number of
rows: a sequence's result does not depend on which other sequences share its batch.

Layout and contracts:

* ``gemv``: x [..., K] (last dim contiguous), weight [N, K] row-major (``nn.Linear``),
  bias None or [N] -> x @ weight.T + bias, [..., N], in x's dtype. At most ``MAX_ROWS``
  rows; accumulation in float32.
* ``gemv_silu_mul``: x [..., K], gate_up [2F, K] (gate rows first, as
  ``MLP.gate_up_proj``) -> silu(x @ gate.T) * (x @ up.T), [..., F]. The gate and up
  products are rounded to x's dtype before the multiply, as the model's eager path
  (a GEMM, then ``silu_mul``) rounds them.

The engine sends it half-precision weights only (bf16 / fp16, see ``gemv_serves``):
float32 models, which the lossless tests run, keep ``F.linear``. The kernel takes float32
as well (exact products, no TF32), which is how the interpreter tests it. The wrappers
allocate only their outputs and never read device values on the host, so they can be
captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vegas_kernels import launch
from vegas_kernels.launch import GemvConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the references are usable
    triton = None

__all__ = ["gemv", "gemv_silu_mul", "gemv_serves", "reference_gemv",
           "reference_gemv_silu_mul", "MAX_ROWS"]

# x is padded to this many rows: the narrowest operand a tensor-core dot takes.
ROWS_PAD = 16
MAX_ROWS = ROWS_PAD
HALF_DTYPES = (torch.bfloat16, torch.float16)
# float32 runs too (exact float32 products, no TF32), for the interpreter's tests.
KERNEL_DTYPES = HALF_DTYPES + (torch.float32,)


def gemv_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the engine sends this product to ``gemv``: a half-precision weight and x
    of at most ``MAX_ROWS`` rows in its dtype (the caller decides whether the Triton
    kernels run at all: see ``vegas_core.attention.kernels_enabled``)."""
    rows = x.numel() // max(1, x.shape[-1])
    return (triton is not None and weight.dtype in HALF_DTYPES and x.dtype == weight.dtype
            and 0 < rows <= MAX_ROWS)


# ---------------------------------------------------------------------------------------
# PyTorch references
# ---------------------------------------------------------------------------------------


def reference_gemv(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias, accumulated in float32 (float64 for float64 x), rounded to
    x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    out = x.to(acc) @ weight.to(acc).T
    if bias is not None:
        out = out + bias.to(acc)
    return out.to(x.dtype)


def reference_gemv_silu_mul(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = reference_gemv(x, gate_up).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


# ---------------------------------------------------------------------------------------
# Kernel
# ---------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _weight_rows_dot(acc, x_ptr, w_ptr, rows, n, M, K, stride_x, stride_w,
                         EVEN_K: tl.constexpr, BLOCK_K: tl.constexpr):
        # acc [BLOCK_N, ROWS_PAD] += weight[n, :] @ x[rows, :].T over all of K.
        ks = tl.arange(0, BLOCK_K)
        w_row = w_ptr + n.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
        x_col = x_ptr + rows[None, :] * stride_x  # [1, ROWS_PAD]
        row_mask = rows[None, :] < M
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            if EVEN_K:
                w = tl.load(w_row + k[None, :])
                xt = tl.load(x_col + k[:, None], mask=row_mask, other=0.0)
            else:
                w = tl.load(w_row + k[None, :], mask=k[None, :] < K, other=0.0)
                xt = tl.load(x_col + k[:, None], mask=row_mask & (k[:, None] < K), other=0.0)
            # [BLOCK_N, BLOCK_K] @ [BLOCK_K, ROWS_PAD]; "ieee" keeps float32 exact (no TF32)
            acc = tl.dot(w, xt, acc, input_precision="ieee")
        return acc

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                     HAS_BIAS: tl.constexpr, SILU_MUL: tl.constexpr, EVEN_K: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
        # x: [M, K]; w: [N, K] ([2N, K] with SILU_MUL: gate rows, then up rows);
        # y: [M, N]. One program per BLOCK_N output columns, over every row of x.
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, ROWS)
        n_in = n < N
        n_safe = tl.where(n_in, n, 0)  # clamp: the weight loads then need no mask
        acc = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
        acc = _weight_rows_dot(acc, x_ptr, w_ptr, rows, n_safe, M, K, stride_x, stride_w,
                               EVEN_K, BLOCK_K)
        out_dtype = y_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(b_ptr + n_safe).to(tl.float32)[:, None]
        if SILU_MUL:
            up = tl.zeros([BLOCK_N, ROWS], dtype=tl.float32)
            up = _weight_rows_dot(up, x_ptr, w_ptr, rows, n_safe + N, M, K, stride_x,
                                  stride_w, EVEN_K, BLOCK_K)
            # Round as the eager path does: the GEMM's output, then F.silu's.
            gate = acc.to(out_dtype).to(tl.float32)
            up = up.to(out_dtype).to(tl.float32)
            act = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
            acc = act * up
        dst = y_ptr + rows[None, :] * stride_y + n[:, None]
        tl.store(dst, acc.to(out_dtype), mask=n_in[:, None] & (rows[None, :] < M))


# ---------------------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------------------


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, n: int,
            silu_mul: bool, config: GemvConfig | None) -> torch.Tensor:
    k = x.shape[-1]
    if x.stride(-1) != 1:
        raise ValueError("x must have a contiguous last dim")
    if weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight must be [N, {k}] with a contiguous last dim, "
                         f"got {tuple(weight.shape)}")
    if weight.dtype not in KERNEL_DTYPES or x.dtype != weight.dtype:
        raise ValueError(f"gemv takes bf16, fp16 or fp32 x and weight of one dtype, "
                         f"got {x.dtype} and {weight.dtype}")
    x2 = x.reshape(-1, k)  # [M, K]
    if not 0 < x2.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv takes 1 to {MAX_ROWS} rows, got {x2.shape[0]}")
    out = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    y2 = out.view(-1, n)
    c = config or launch.gemv_config(n, k)
    _gemv_kernel[(triton.cdiv(n, c.block_n),)](
        x2, weight, bias if bias is not None else weight, y2, x2.shape[0], n, k,
        x2.stride(0), weight.stride(0), y2.stride(0),
        HAS_BIAS=bias is not None, SILU_MUL=silu_mul, EVEN_K=k % c.block_k == 0,
        BLOCK_N=c.block_n, BLOCK_K=c.block_k, ROWS=ROWS_PAD,
        num_warps=c.num_warps, num_stages=c.num_stages)
    return out


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) -> [..., N], for at most MAX_ROWS rows."""
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    return _launch(x, weight, bias, weight.shape[0], False, config)


def gemv_silu_mul(x: torch.Tensor, gate_up: torch.Tensor, *,
                  config: GemvConfig | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) -> [..., F], with gate_up [2F, K] gate rows first."""
    if gate_up.shape[0] % 2:
        raise ValueError("gate_up must have an even number of rows (gate, then up)")
    return _launch(x, gate_up, None, gate_up.shape[0] // 2, True, config)
