"""Fused per-layer elementwise ops: RMSNorm (+ residual add), RoPE + KV-cache write,
and SiLU-gated multiply.

Why fused: at decode time (one or a few tokens per sequence) a transformer layer moves
little data, so its cost is launch count rather than bandwidth. In eager PyTorch an
RMSNorm decomposes into ~7 kernels (cast, square, mean, add, rsqrt, multiply, cast,
multiply), RoPE into ~10 per tensor (rotate_half's chunk/neg/cat, two multiplies, an
add, the casts) and the cache write into two ``index_put``. Even replayed from a CUDA
graph, ~50 tiny launches per layer keep an 8B model's decode step at about twice its
memory-bandwidth floor. Each op below is one launch that reads its inputs once and
writes its outputs once.

Layout and contracts:

* ``rms_norm``: x [..., N] (last dim contiguous), weight [N]; the leading dims are
  flattened into rows (a copy is made only when they cannot be viewed as rows with one
  stride). Optional residual (x's shape): ``h = x + residual`` is returned alongside.
* ``rope_and_store``: q [B, T, H, D], k, v [B, T, H_kv, D] with any strides for B, T
  and the head dim (views of one fused QKV projection), last-dim stride 1; positions
  [B, T] on the device; cache_k / cache_v [L, B, H_kv, S, D] (``KVCache.store``).
  One program per (token, head) over the H query heads and then the H_kv KV heads: a
  query-head program writes q_rot, a KV-head program writes the rotated k and the raw v
  into slot ``positions[b, t]`` of the cache (``positions[b, t] % S`` in a ring).
  Positions outside [0, S) (below 0 in a ring) write nothing (rather than corrupting
  memory).
* ``silu_mul``: gate_up [..., 2F] (gate half first, as a fused gate/up projection
  produces) -> [..., F].

The wrappers never read device values on the host and allocate nothing but their
outputs, so they can be captured in a CUDA graph. Numerics follow the model's eager code
(``vegas_core.model``): normalise in float32, round to x's dtype, then multiply by the
weight; RoPE is computed in float32 throughout (the eager path rounds cos/sin and each
product to the model dtype, so the two agree within that dtype's rounding).

``reference_*`` are the PyTorch ground truths, written like the model's eager code.
"""

from __future__ import annotations

import torch

from vegas_kernels import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the references are usable
    triton = None

__all__ = ["rms_norm", "rope_and_store", "silu_mul",
           "reference_rms_norm", "reference_rope_and_store", "reference_silu_mul"]

# The longest row one program keeps in registers (hidden sizes go up to 8192).
MAX_NORM_COLUMNS = 65536
# Head dims the RoPE kernel accepts: powers of two, so each half is one Triton block.
ROPE_HEAD_DIMS = (16, 32, 64, 128, 256)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., N] -> [M, N] with one row stride; a view whenever the strides allow."""
    if x.stride(-1) != 1:
        raise ValueError("the last dim must be contiguous (stride 1)")
    return x.reshape(-1, x.shape[-1])


# ---------------------------------------------------------------------------------------
# PyTorch references (the model's eager code)
# ---------------------------------------------------------------------------------------


def _reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As vegas_core.model.RMSNorm.forward.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def reference_rms_norm(x, weight, eps, residual=None):
    """x [..., N], weight [N] -> y, or (y, h = x + residual) when residual is given."""
    if residual is None:
        return _reference_norm(x, weight, eps)
    h = x + residual
    return _reference_norm(h, weight, eps), h


def _reference_rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def reference_rope_and_store(q, k, v, positions, inv_freq, cache_k, cache_v, layer,
                             q_norm=None, k_norm=None, eps=1e-6):
    """As Transformer.forward's cos/sin and Attention.forward up to ``cache.write``.

    q [B, T, H, D]; k, v [B, T, H_kv, D]; positions [B, T]; inv_freq [D/2] float32;
    cache_k, cache_v [L, B, H_kv, S, D] (written in place) -> q_rot [B, T, H, D].
    """
    if q_norm is not None:
        q, k = _reference_norm(q, q_norm, eps), _reference_norm(k, k_norm, eps)
    freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)
    q = q * cos + _reference_rotate_half(q) * sin
    k = k * cos + _reference_rotate_half(k) * sin
    # As KVCache.write: advanced indices around a slice give a [B, T, H_kv, D] target.
    batch_index = torch.arange(positions.shape[0], device=positions.device)[:, None]
    cache_k[layer][batch_index, :, positions] = k
    cache_v[layer][batch_index, :, positions] = v
    return q


def reference_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2F] -> silu(gate) * up [..., F], as MLP.forward."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# ---------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, h_ptr, M, N, eps,
                         stride_x, stride_res, stride_y, stride_h,
                         BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_RESIDUAL: tl.constexpr):
        # x, res: [M, N] (row strides given); w: [N]; y, h: [M, N].
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_N)
        col_ok = cols < N
        mask = (rows < M)[:, None] & col_ok[None, :]
        # int64 row offsets: prefill activations can pass 2^31 elements.
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + rows64 * stride_x + cols[None, :], mask=mask, other=0.0)
        x_dtype = x_ptr.dtype.element_ty
        x = x.to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows64 * stride_res + cols[None, :], mask=mask, other=0.0)
            # The sum is rounded to x's dtype, as torch's `x + residual` would be, and
            # that rounded h is what gets normalised.
            h = (x + r.to(tl.float32)).to(x_dtype)
            tl.store(h_ptr + rows64 * stride_h + cols[None, :], h, mask=mask)
            x = h.to(tl.float32)
        mean_square = tl.sum(x * x, axis=1) / N  # padding columns load as 0
        inv_rms = tl.rsqrt(mean_square + eps)
        # Round the normalised value to x's dtype before the weight, as RMSNorm does.
        normed = (x * inv_rms[:, None]).to(x_dtype).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = (normed * w[None, :]).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows64 * stride_y + cols[None, :], y, mask=mask)

    @triton.jit
    def _rotated_head(src_ptr, norm_ptr, cos, sin, eps, HALF: tl.constexpr,
                      HAS_NORM: tl.constexpr):
        # One head [2 * HALF] at src_ptr -> its rotated halves [HALF] in float32, after
        # the per-head RMSNorm with weight norm_ptr [2 * HALF] when HAS_NORM.
        half = tl.arange(0, HALF)
        x1 = tl.load(src_ptr + half).to(tl.float32)
        x2 = tl.load(src_ptr + HALF + half).to(tl.float32)
        if HAS_NORM:
            # As RMSNorm: the normalised value and the weighted one are both rounded to
            # the model dtype (the head's own).
            dtype = src_ptr.dtype.element_ty
            inv_rms = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0))
                               / (2 * HALF) + eps)
            w1 = tl.load(norm_ptr + half).to(tl.float32)
            w2 = tl.load(norm_ptr + HALF + half).to(tl.float32)
            x1 = ((x1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = ((x2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
        # x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1): element i
        # pairs with i + HALF, and cat(angle, angle) gives both the same angle.
        return x1 * cos - x2 * sin, x2 * cos + x1 * sin

    @triton.jit
    def _rope_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, qn_ptr, kn_ptr,
                           out_ptr, ck_ptr, cv_ptr,
                           T, H, S, eps,
                           sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                           sp_b, sp_t, so_b, so_t, so_h,
                           sck_b, sck_h, sck_s, scv_b, scv_h, scv_s,
                           HALF: tl.constexpr, HAS_QK_NORM: tl.constexpr,
                           RING: tl.constexpr):
        # q: [B, T, H, D]; k, v: [B, T, H_kv, D]; pos: [B, T]; inv_freq: [HALF];
        # out: [B, T, H, D]; ck, cv: one layer of the cache, [B, H_kv, S, D]; a RING
        # keeps position p at slot p % S.
        # Grid: (B * T, H + H_kv); head ids past H are KV heads.
        token = tl.program_id(0)
        head = tl.program_id(1)
        b = (token // T).to(tl.int64)
        t = (token % T).to(tl.int64)
        half = tl.arange(0, HALF)
        pos = tl.load(pos_ptr + b * sp_b + t * sp_t).to(tl.int64)
        # One angle per (i, i + HALF) pair: cat(angle, angle) repeats it for both halves.
        angle = pos.to(tl.float32) * tl.load(inv_freq_ptr + half)
        cos = tl.cos(angle)
        sin = tl.sin(angle)
        # The two branches use distinct names: Triton merges a name defined in both
        # branches of a runtime `if`, which would require q's and the cache's pointer
        # types to agree.
        if head < H:
            q_src = q_ptr + b * sq_b + t * sq_t + head.to(tl.int64) * sq_h
            q1, q2 = _rotated_head(q_src, qn_ptr, cos, sin, eps, HALF, HAS_QK_NORM)
            q_dst = out_ptr + b * so_b + t * so_t + head.to(tl.int64) * so_h
            tl.store(q_dst + half, q1.to(out_ptr.dtype.element_ty))
            tl.store(q_dst + HALF + half, q2.to(out_ptr.dtype.element_ty))
        else:
            kv_head = (head - H).to(tl.int64)
            # A slot outside the cache would be a write to someone else's memory: drop it.
            # (Built as a block: the interpreter mis-types a block mask & a scalar one.)
            at = tl.zeros([HALF], dtype=tl.int64) + pos
            if RING:
                in_cache = at >= 0
                slot = pos % S
            else:
                in_cache = (at >= 0) & (at < S)
                slot = pos
            k_src = k_ptr + b * sk_b + t * sk_t + kv_head * sk_h
            k1, k2 = _rotated_head(k_src, kn_ptr, cos, sin, eps, HALF, HAS_QK_NORM)
            k_dst = ck_ptr + b * sck_b + kv_head * sck_h + slot * sck_s
            tl.store(k_dst + half, k1.to(ck_ptr.dtype.element_ty), mask=in_cache)
            tl.store(k_dst + HALF + half, k2.to(ck_ptr.dtype.element_ty), mask=in_cache)
            # v is stored as is (cast only if the cache has another dtype).
            v_src = v_ptr + b * sv_b + t * sv_t + kv_head * sv_h
            v_dst = cv_ptr + b * scv_b + kv_head * scv_h + slot * scv_s
            v_dtype = cv_ptr.dtype.element_ty
            tl.store(v_dst + half, tl.load(v_src + half).to(v_dtype), mask=in_cache)
            tl.store(v_dst + HALF + half, tl.load(v_src + HALF + half).to(v_dtype),
                     mask=in_cache)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, F, stride_gu, stride_out, BLOCK: tl.constexpr):
        # gu: [M, 2F] (gate = [:, :F], up = [:, F:]); out: [M, F].
        # Grid: (M, cdiv(F, BLOCK)): rows on axis 0, which allows far more programs.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < F
        src = gu_ptr + row * stride_gu
        gate = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(src + F + cols, mask=mask, other=0.0).to(tl.float32)
        out_dtype = out_ptr.dtype.element_ty
        # F.silu rounds to the input dtype before `* up`; keep that rounding.
        act = (gate / (1.0 + tl.exp(-gate))).to(out_dtype).to(tl.float32)
        tl.store(out_ptr + row * stride_out + cols, (act * up).to(out_dtype), mask=mask)


# ---------------------------------------------------------------------------------------
# Wrappers
# ---------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm of x's last dim (fused with ``h = x + residual`` when residual is given).

    x [..., N], weight [N], residual None or x's shape and dtype -> y [..., N], or
    (y, h) with h [..., N] in x's dtype. y's dtype is ``weight * x``'s (x's dtype when
    the weight has it, as in the model).
    """
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"weight shape {tuple(weight.shape)} does not match N={n}")
    if n > MAX_NORM_COLUMNS:
        raise ValueError(f"rows longer than {MAX_NORM_COLUMNS} are not supported")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must have x's shape and dtype")
    x2 = _rows(x)  # [M, N]
    m = x2.shape[0]
    y = torch.empty(x.shape, device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    y2 = y.view(-1, n)
    if residual is not None:
        h = torch.empty(x.shape, device=x.device, dtype=x.dtype)
        res2, h2 = _rows(residual), h.view(-1, n)
    else:
        h, res2, h2 = None, x2, y2  # placeholders: the kernel does not touch them
    if m > 0:
        block_rows, block_n, warps = launch.norm_tile(n)
        _rms_norm_kernel[(triton.cdiv(m, block_rows),)](
            x2, res2, weight.contiguous(), y2, h2, m, n, eps,
            x2.stride(0), res2.stride(0), y2.stride(0), h2.stride(0),
            BLOCK_ROWS=block_rows, BLOCK_N=block_n, HAS_RESIDUAL=residual is not None,
            num_warps=warps)
    return y if residual is None else (y, h)


def rope_and_store(q, k, v, positions, inv_freq, cache_k, cache_v, layer: int,
                   q_norm=None, k_norm=None, eps: float = 1e-6, *,
                   ring: bool = False) -> torch.Tensor:
    """Rotary embedding of q and k (after Qwen3's per-head RMSNorm when q_norm/k_norm are
    given), with the rotated k and the raw v stored in the cache at their positions.

    q [B, T, H, D]; k, v [B, T, H_kv, D] (any B/T/head strides, last-dim stride 1);
    positions [B, T] (device ints); inv_freq [D/2] float32; cache_k, cache_v
    [L, B, H_kv, S, D], written at ``[layer, b, h, positions[b, t]]`` (at slot
    ``positions[b, t] % S`` where the layer is a ``ring``); q_norm, k_norm
    None or [D] in the model dtype (the normed heads are rounded to q's / k's dtype, as
    RMSNorm does) -> q_rot [B, T, H, D], contiguous, in q's dtype.
    """
    b, t, h, d = q.shape
    h_kv = k.shape[2]
    if d not in ROPE_HEAD_DIMS:
        raise ValueError(f"head dim {d} not in {ROPE_HEAD_DIMS}")
    if k.shape != (b, t, h_kv, d) or v.shape != k.shape:
        raise ValueError("k and v must be [B, T, H_kv, D] with q's B, T and D")
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise ValueError("q, k and v must have a contiguous last dim")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("give both q_norm and k_norm, or neither")
    if inv_freq.shape != (d // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError("inv_freq must be [D/2] float32")
    ck, cv = cache_k[layer], cache_v[layer]  # [B, H_kv, S, D] views
    if ck.shape[0] != b or ck.shape[1] != h_kv or ck.shape[3] != d or cv.shape != ck.shape:
        raise ValueError("cache layers must be [B, H_kv, S, D] matching k")
    if ck.stride(-1) != 1 or cv.stride(-1) != 1:
        raise ValueError("the cache must have a contiguous last dim")
    out = torch.empty(b, t, h, d, device=q.device, dtype=q.dtype)
    if b * t == 0:
        return out
    has_norm = q_norm is not None
    qn = q_norm.contiguous() if has_norm else inv_freq  # placeholder when unused
    kn = k_norm.contiguous() if has_norm else inv_freq
    _rope_store_kernel[(b * t, h + h_kv)](
        q, k, v, positions, inv_freq.contiguous(), qn, kn, out, ck, cv,
        t, h, ck.shape[2], eps,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), positions.stride(0), positions.stride(1),
        out.stride(0), out.stride(1), out.stride(2),
        ck.stride(0), ck.stride(1), ck.stride(2), cv.stride(0), cv.stride(1), cv.stride(2),
        HALF=d // 2, HAS_QK_NORM=has_norm, RING=ring, num_warps=launch.elementwise_warps(d))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2F] (gate half first) -> silu(gate) * up [..., F] in its dtype."""
    two_f = gate_up.shape[-1]
    if two_f % 2:
        raise ValueError("the last dim must be even (gate and up halves)")
    f = two_f // 2
    gu = _rows(gate_up)  # [M, 2F]
    out = torch.empty(*gate_up.shape[:-1], f, device=gate_up.device, dtype=gate_up.dtype)
    out2 = out.view(-1, f)
    if gu.shape[0] > 0 and f > 0:
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(f, launch.SILU_BLOCK))](
            gu, out2, f, gu.stride(0), out2.stride(0), BLOCK=launch.SILU_BLOCK,
            num_warps=launch.SILU_WARPS)
    return out
