"""Grouped mixture-of-experts MLP for decode, verify and draft steps: sync-free and
capturable in a CUDA graph.

The model's eager path (``vegas_core.model.MixtureOfExperts``) loops on the host over
the experts the batch routes to: it reads the chosen ids back to the host (so the step
cannot be captured in a CUDA graph) and launches a handful of tiny matmuls per expert.
Here the routing is grouped on the device and two launches cover every expert:

* Grouping (PyTorch, on the device, no host reads): the N * K (token, slot) pairs are
  numbered ``pair = token * K + slot`` and stably sorted by expert id, which gives
  ``order`` [P] (the pair at each sorted position). Per-expert counts [E] come from a
  ``scatter_add_`` and their exclusive cumulative sum gives each expert's first sorted
  position. (``bincount``, ``unique`` and ``nonzero`` are avoided: they size their
  outputs from device values, which syncs with the host.)
* ``_gate_up_kernel``, grid (E, cdiv(F, BLOCK_F)): program (e, j) walks expert e's pairs
  in blocks of BLOCK_M rows, gathers their x rows by token id, computes the gate and up
  columns [j * BLOCK_F, (j + 1) * BLOCK_F) with a loop over D, applies the activation in
  float32 and stores ``hidden`` [P, F] (x's dtype) at the pairs' sorted positions.
* ``_down_kernel``, grid (E, cdiv(D, BLOCK_D)): program (e, j) multiplies the same rows
  of ``hidden`` by columns [j * BLOCK_D, ...) of ``down[e]``, adds the bias, scales each
  row by its pair's routing weight and stores it into ``y`` [P, D] (float32) at the
  pair's own index. ``out = y.view(N, K, D).sum(1)`` then adds each token's K slots in
  PyTorch, in a fixed order (deterministic, no atomics).

A program whose expert has no pair returns before reading anything else, so only the
experts some token routes to are read, each once per block of BLOCK_M of its pairs (at
decode sizes: once). The grids depend on E, F and D alone, so one launch serves every
routing: a graph captured once stays right when ``chosen`` and ``weights`` are refilled
in place.

The tile sizes and launch options (BLOCK_M pairs, BLOCK_F, BLOCK_D and BLOCK_K columns,
warps, stages) are ``vegas_kernels.launch``'s ``MOE_*``.

Meant for decode, verify and draft batches (N from 1 to a few thousand tokens). At
prefill sizes every expert has many blocks of pairs and a tuned grouped GEMM (or the
eager loop) is the better tool; callers keep their PyTorch path there.

Layout and contract (as the model's parameters):

* x [N, D] (last dim contiguous); weights [N, K] (any float dtype); chosen [N, K]
  integer expert ids in [0, E) (an id outside that range is a device-side error).
* gate_up [E, 2F, D]: rows [0, F) the gate, [F, 2F) the up projection; down [E, D, F];
  optional gate_up_bias [E, 2F] and down_bias [E, D]. Last dims contiguous.
* x, gate_up and down share one dtype (float32, float16 or bfloat16). Products use
  tensor cores in the input dtype with float32 accumulation; float32 inputs get exact
  (IEEE) float32 products.
* activation ``"silu"``: silu(gate) * up; ``"clamped_swiglu"`` (gpt-oss): gate clamped
  above at ``limit``, up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate).

Numerics: the gate/up products and the activation are float32; ``hidden`` is rounded to
x's dtype once (as the eager path rounds it) and the down projection, the routing
weights and the sum over slots are float32; the result is rounded to x's dtype.
``reference_moe`` is the PyTorch ground truth (float32 or wider throughout).
"""

from __future__ import annotations

import torch

from vegas_kernels import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the reference is usable
    triton = None

__all__ = ["ACTIVATIONS", "moe", "reference_moe"]

ACTIVATIONS = ("silu", "clamped_swiglu")  # as vegas_core.config.EXPERT_ACTIVATIONS
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what tl.dot takes


# ---------------------------------------------------------------------------------------
# PyTorch reference (the model's eager code, in float32 or wider)
# ---------------------------------------------------------------------------------------


def _reference_activation(gate, up, activation, alpha, limit):
    # As MixtureOfExperts.expert.
    if activation == "clamped_swiglu":
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)
    return torch.nn.functional.silu(gate) * up


def reference_moe(x, weights, chosen, gate_up, down, gate_up_bias=None, down_bias=None,
                  activation="silu", alpha=1.702, limit=7.0):
    """x [N, D]; weights, chosen [N, K]; gate_up [E, 2F, D]; down [E, D, F]; biases
    [E, 2F] / [E, D] or None -> out [N, D] in float32 or wider (float64 stays float64):
    out[n] = sum_k weights[n, k] * expert(chosen[n, k], x[n]). One pass per routed
    expert over the tokens routed to it, as the model's eager loop."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    acc = torch.promote_types(x.dtype, torch.float32)
    f = gate_up.shape[1] // 2
    xa, wa = x.to(acc), weights.to(acc)
    out = torch.zeros(x.shape, dtype=acc, device=x.device)
    for e in chosen.unique().tolist():
        token, slot = (chosen == e).nonzero(as_tuple=True)
        h = xa[token] @ gate_up[e].to(acc).T  # [n, 2F]
        if gate_up_bias is not None:
            h = h + gate_up_bias[e].to(acc)
        hidden = _reference_activation(h[:, :f], h[:, f:], activation, alpha, limit)
        y = hidden @ down[e].to(acc).T  # [n, D]
        if down_bias is not None:
            y = y + down_bias[e].to(acc)
        out.index_add_(0, token, y * wa[token, slot, None])
    return out


# ---------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _dot_t(a, b, IEEE: tl.constexpr):
        """a [M, R] . b [C, R]^T -> [M, C] float32; exact products for float32 inputs."""
        if IEEE:
            return tl.dot(a, tl.trans(b), input_precision="ieee")
        return tl.dot(a, tl.trans(b))

    @triton.jit
    def _rows_dot(a_rows, a_ok, b_rows, b_ok, n, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr,
                  BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
        """sum over k < n of a[m, k] * b[c, k] -> [BLOCK_M, BLOCK_C] float32, for row
        pointers a_rows [BLOCK_M, 1] and b_rows [BLOCK_C, 1] (masked by a_ok, b_ok)."""
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
        for k0 in range(0, n, BLOCK_K):
            k_ok = (k0 + ks < n)[None, :]
            a = tl.load(a_rows + k0 + ks[None, :], mask=a_ok[:, None] & k_ok, other=0.0)
            b = tl.load(b_rows + k0 + ks[None, :], mask=b_ok[:, None] & k_ok, other=0.0)
            acc += _dot_t(a, b, IEEE)
        return acc

    @triton.jit
    def _pair_block(ORDER, start, count, m0, BLOCK_M: tl.constexpr):
        """Block m0 of an expert's pairs: (valid rows, sorted positions, pair ids)."""
        rows = tl.arange(0, BLOCK_M)
        row_ok = m0 + rows < count
        sorted_pos = start + m0 + rows
        return row_ok, sorted_pos, tl.load(ORDER + sorted_pos, mask=row_ok, other=0)

    @triton.jit
    def _gate_up_kernel(X, ORDER, COUNTS, STARTS, W, BIAS, HIDDEN,
                        D, F, sx_n, sw_e, sw_r, sb_e, sh_p, alpha, limit,
                        K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
                        BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                        CLAMPED: tl.constexpr, IEEE: tl.constexpr):
        # X: [N, D]; ORDER: [P] pair ids by sorted position; COUNTS, STARTS: [E] (int32);
        # W: [E, 2F, D]; BIAS: [E, 2F]; HIDDEN: [P, F], row = sorted position.
        # Grid: (E, cdiv(F, BLOCK_F)).
        e = tl.program_id(0)
        count = tl.load(COUNTS + e)
        if count == 0:  # no pair routed here: this expert's weights are not read
            return
        start = tl.load(STARTS + e)
        cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)  # hidden columns
        col_ok = cols < F
        # Expert base in 64 bits (E * 2F * D passes 2**31 for big models), 32-bit rest.
        w_gate = W + e.to(tl.int64) * sw_e + cols[:, None] * sw_r  # [BLOCK_F, 1]
        w_up = w_gate + F * sw_r
        if HAS_BIAS:
            b_gate = tl.load(BIAS + e * sb_e + cols, mask=col_ok, other=0.0).to(tl.float32)
            b_up = tl.load(BIAS + e * sb_e + F + cols, mask=col_ok, other=0.0).to(tl.float32)
        for m0 in range(0, count, BLOCK_M):
            row_ok, sorted_pos, pair = _pair_block(ORDER, start, count, m0, BLOCK_M)
            x_rows = X + (pair // K).to(tl.int64)[:, None] * sx_n  # [BLOCK_M, 1]
            gate = _rows_dot(x_rows, row_ok, w_gate, col_ok, D, BLOCK_M, BLOCK_F, BLOCK_K, IEEE)
            up = _rows_dot(x_rows, row_ok, w_up, col_ok, D, BLOCK_M, BLOCK_F, BLOCK_K, IEEE)
            if HAS_BIAS:
                gate += b_gate[None, :]
                up += b_up[None, :]
            if CLAMPED:
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
                hidden = (up + 1.0) * gate * tl.sigmoid(gate * alpha)
            else:
                hidden = gate * tl.sigmoid(gate) * up
            tl.store(HIDDEN + sorted_pos[:, None] * sh_p + cols[None, :],
                     hidden.to(HIDDEN.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(HIDDEN, ORDER, COUNTS, STARTS, ROUTE_W, W, BIAS, Y,
                     D, F, sh_p, sw_e, sw_r, sb_e, sy_p,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
        # HIDDEN: [P, F] by sorted position; ORDER: [P]; COUNTS, STARTS: [E] (int32);
        # ROUTE_W: [P] routing weights by pair id; W: [E, D, F]; BIAS: [E, D];
        # Y: [P, D] float32 by pair id. Grid: (E, cdiv(D, BLOCK_D)).
        e = tl.program_id(0)
        count = tl.load(COUNTS + e)
        if count == 0:
            return
        start = tl.load(STARTS + e)
        dims = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # output columns
        dim_ok = dims < D
        w_rows = W + e.to(tl.int64) * sw_e + dims[:, None] * sw_r  # [BLOCK_D, 1]
        if HAS_BIAS:
            bias = tl.load(BIAS + e * sb_e + dims, mask=dim_ok, other=0.0).to(tl.float32)
        for m0 in range(0, count, BLOCK_M):
            row_ok, sorted_pos, pair = _pair_block(ORDER, start, count, m0, BLOCK_M)
            h_rows = HIDDEN + sorted_pos[:, None] * sh_p  # [BLOCK_M, 1]
            acc = _rows_dot(h_rows, row_ok, w_rows, dim_ok, F, BLOCK_M, BLOCK_D, BLOCK_K, IEEE)
            if HAS_BIAS:
                acc += bias[None, :]
            route_w = tl.load(ROUTE_W + pair, mask=row_ok, other=0.0).to(tl.float32)
            tl.store(Y + pair.to(tl.int64)[:, None] * sy_p + dims[None, :],
                     acc * route_w[:, None], mask=row_ok[:, None] & dim_ok[None, :])


# ---------------------------------------------------------------------------------------
# Wrapper
# ---------------------------------------------------------------------------------------


def _check(x, weights, chosen, gate_up, down, gate_up_bias, down_bias, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 2 or chosen.dim() != 2 or weights.shape != chosen.shape:
        raise ValueError("x must be [N, D], weights and chosen [N, K]")
    n, d = x.shape
    e, two_f = gate_up.shape[:2]
    f = two_f // 2
    if chosen.shape[0] != n or gate_up.shape != (e, 2 * f, d) or down.shape != (e, d, f):
        raise ValueError(f"shapes do not agree: x {tuple(x.shape)}, chosen "
                         f"{tuple(chosen.shape)}, gate_up {tuple(gate_up.shape)} (want "
                         f"[E, 2F, D]), down {tuple(down.shape)} (want [E, D, F])")
    if gate_up_bias is not None and gate_up_bias.shape != (e, 2 * f):
        raise ValueError("gate_up_bias must be [E, 2F]")
    if down_bias is not None and down_bias.shape != (e, d):
        raise ValueError("down_bias must be [E, D]")
    if x.dtype not in DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"x, gate_up and down must share one dtype of {DTYPES}")
    if chosen.dtype.is_floating_point or chosen.dtype == torch.bool:
        raise ValueError("chosen must hold integer expert ids")
    if any(t.stride(-1) != 1 for t in (x, gate_up, down)):
        raise ValueError("x, gate_up and down must have a contiguous last dim")


def moe(x, weights, chosen, gate_up, down, gate_up_bias=None, down_bias=None,
        activation="silu", alpha=1.702, limit=7.0):
    """Triton mixture of experts; same contract as ``reference_moe`` but the result in
    x's dtype. Groups the routing on the device and never reads device values on the
    host: the launch is the same for any ``chosen``, so it can be captured in a CUDA
    graph and replayed with a new routing written into ``weights``/``chosen`` in place.

    x [N, D]; weights [N, K]; chosen [N, K] ids in [0, E); gate_up [E, 2F, D]; down
    [E, D, F]; gate_up_bias [E, 2F] and down_bias [E, D] or None -> out [N, D].
    """
    _check(x, weights, chosen, gate_up, down, gate_up_bias, down_bias, activation)
    n, d = x.shape
    k = chosen.shape[1]
    e, two_f = gate_up.shape[:2]
    f = two_f // 2
    dev = x.device
    if n * k == 0:
        return torch.zeros(n, d, device=dev, dtype=x.dtype)
    pairs = n * k
    # Group the (token, slot) pairs by expert, on the device.
    ids = chosen.reshape(pairs)  # [P], pair = token * K + slot
    order = torch.sort(ids, stable=True).indices  # [P] pair at each sorted position
    counts = torch.zeros(e, device=dev, dtype=torch.int32)
    counts.scatter_add_(0, ids.long(), torch.ones(pairs, device=dev, dtype=torch.int32))
    starts = torch.cumsum(counts, 0, dtype=torch.int32) - counts  # [E] exclusive
    route_w = weights.reshape(pairs)  # [P] by pair id (a copy only if not contiguous)

    ieee = x.dtype == torch.float32
    gu_bias = gate_up_bias.contiguous() if gate_up_bias is not None else counts  # placeholder
    dn_bias = down_bias.contiguous() if down_bias is not None else counts
    hidden = torch.empty(pairs, f, device=dev, dtype=x.dtype)  # [P, F] by sorted position
    _gate_up_kernel[(e, triton.cdiv(f, launch.MOE_BLOCK_F))](
        x, order, counts, starts, gate_up, gu_bias, hidden,
        d, f, x.stride(0), gate_up.stride(0), gate_up.stride(1),
        gu_bias.stride(0) if gate_up_bias is not None else 0, hidden.stride(0),
        float(alpha), float(limit),
        K=k, BLOCK_M=launch.MOE_BLOCK_M, BLOCK_F=launch.MOE_BLOCK_F,
        BLOCK_K=launch.MOE_BLOCK_K, HAS_BIAS=gate_up_bias is not None,
        CLAMPED=activation == "clamped_swiglu", IEEE=ieee,
        num_warps=launch.MOE_WARPS, num_stages=launch.MOE_STAGES,
    )
    y = torch.empty(pairs, d, device=dev, dtype=torch.float32)  # [P, D] by pair id
    _down_kernel[(e, triton.cdiv(d, launch.MOE_BLOCK_D))](
        hidden, order, counts, starts, route_w, down, dn_bias, y,
        d, f, hidden.stride(0), down.stride(0), down.stride(1),
        dn_bias.stride(0) if down_bias is not None else 0, y.stride(0),
        BLOCK_M=launch.MOE_BLOCK_M, BLOCK_D=launch.MOE_BLOCK_D, BLOCK_K=launch.MOE_BLOCK_K,
        HAS_BIAS=down_bias is not None, IEEE=ieee,
        num_warps=launch.MOE_WARPS, num_stages=launch.MOE_STAGES,
    )
    return y.view(n, k, d).sum(dim=1).to(x.dtype)
