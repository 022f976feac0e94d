"""The decoder-only transformer (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, gpt-oss and
Gemma3's text model).

One forward for every mode: ``forward(tokens, positions, cache, meta)`` writes the new
tokens' K/V into the cache at their positions and attends as ``meta`` says. Parameter
names follow the Hugging Face layout, except that q/k/v and gate/up projections are
packed into one matrix each (``PACKED_PROJECTIONS`` says where a checkpoint's pieces go).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vegas_core.attention import AttentionMeta, attend, kernels_enabled, supported_head_dim
from vegas_core.cache import KVCache
from vegas_core.config import ModelConfig
from vegas_kernels.gemv import gemv, gemv_serves, gemv_silu_mul
from vegas_kernels.layer_ops import rms_norm, rope_and_store, silu_mul
from vegas_kernels.moe import moe

# Tokens up to which a mixture runs on the grouped Triton kernel (vegas_kernels.moe) where the
# kernels are enabled: decode, draft and verify forwards, up to a batch of 256 verifying
# 16 rows. Longer forwards (prefill chunks) give each expert many tokens, and the
# per-expert GEMMs of the eager loop serve them better.
MOE_KERNEL_MAX_TOKENS = 4096


def project(layer: nn.Linear, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """``layer(x)``; where the kernels are enabled, 1-16 rows of half precision go to
    the gemv kernel (vegas_kernels.gemv), which streams the weight once for all rows (as
    fast as cuBLAS there or up to 1.24x faster: docs/results/kernels.md)."""
    if fused:
        if gemv_serves(x, layer.weight):
            return gemv(x, layer.weight, layer.bias)
    return layer(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *,
                fused: bool = False):
        """-> norm(x); with ``residual``: (norm(h), h) for h = x + residual, the sum the
        next block adds to (one kernel on the fused path)."""
        if fused:
            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return self._norm(x)
        h = x + residual
        return self._norm(h), h

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


@dataclass
class Rope:
    """What the layers need for rotary embeddings: the tables [B, T, 1, D] on the
    PyTorch path; on the fused path the kernel computes them from positions."""

    inv_freq: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    @property
    def fused(self) -> bool:
        return self.cos is None


def rope_inverse_frequencies(config: ModelConfig, *, local: bool = False) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, with the config's RoPE scaling; with
    ``local``, those of the sliding layers (their own base, no scaling)."""
    d = config.head_dim
    theta = config.rope_local_theta if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    scaling = {} if local else (config.rope_scaling or {})
    kind = scaling.get("rope_type", "default")
    if kind == "freq_factors":
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth ramp
        # in between (the published rule).
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_ctx / wavelen - low) / (high - low)
        ramped = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
        between = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
        inv_freq = torch.where(between, ramped, inv_freq)
    elif kind == "yarn":
        inv_freq = _yarn_frequencies(inv_freq, theta, d, scaling)
    return inv_freq


def _yarn_frequencies(inv_freq: torch.Tensor, theta: float, d: int, s: dict) -> torch.Tensor:
    """YaRN (Peng et al. 2023): frequencies that turn fewer than ``beta_slow`` times over
    the original context are divided by ``factor``, those that turn more than
    ``beta_fast`` times are kept, with a linear ramp between."""
    old_ctx = s["original_max_position_embeddings"]

    def dimension(rotations: float) -> float:  # the dim index that turns that often
        return d * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(s.get("beta_fast") or 32), dimension(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return inv_freq / s["factor"] * ramp + inv_freq * (1 - ramp)


def rope_attention_factor(config: ModelConfig) -> float:
    """YaRN's scale of cos and sin (so of q and k each): 0.1 ln(factor) + 1 unless the
    config gives ``attention_factor``; 1 for other RoPE types."""
    s = config.rope_scaling or {}
    if s.get("rope_type") != "yarn":
        return 1.0
    if s.get("attention_factor") is not None:
        return float(s["attention_factor"])
    return 0.1 * math.log(s["factor"]) + 1.0 if s["factor"] > 1 else 1.0


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def packed_projections(config: ModelConfig, layer: int) -> dict[str, tuple[str, tuple]]:
    """Checkpoint parameter name (less ``.weight``/``.bias``) within ``layer`` ->
    (packed parameter, the index of its block there): q/k/v and gate/up are packed
    row-wise, and a mixture's experts into one tensor each, expert first."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    packed = {
        "self_attn.q_proj": ("self_attn.qkv_proj", (slice(0, q),)),
        "self_attn.k_proj": ("self_attn.qkv_proj", (slice(q, q + kv),)),
        "self_attn.v_proj": ("self_attn.qkv_proj", (slice(q + kv, q + 2 * kv),)),
    }
    if config.is_moe(layer):
        f = config.expert_intermediate_size
        for e in range(config.num_experts):
            packed[f"mlp.experts.{e}.gate_proj"] = ("mlp.experts_gate_up", (e, slice(0, f)))
            packed[f"mlp.experts.{e}.up_proj"] = ("mlp.experts_gate_up", (e, slice(f, 2 * f)))
            packed[f"mlp.experts.{e}.down_proj"] = ("mlp.experts_down", (e,))
    else:
        f = config.intermediate_size
        packed["mlp.gate_proj"] = ("mlp.gate_up_proj", (slice(0, f),))
        packed["mlp.up_proj"] = ("mlp.gate_up_proj", (slice(f, 2 * f),))
    return packed


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = hd = config.head_dim
        d = config.hidden_size
        # q, k and v in one GEMM (checkpoints' q_proj/k_proj/v_proj fill its row blocks):
        # one weight read and one launch per layer instead of three.
        self.qkv_proj = nn.Linear(d, (config.num_heads + 2 * config.num_kv_heads) * hd,
                                  bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * hd, d, bias=config.o_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Attention divides by sqrt(head_dim); a model scaled by another constant
        # (Gemma3's query_pre_attn_scalar) has its queries rescaled to match, and YaRN's
        # scale of q and k both is put on q alone (the cache keeps plain keys).
        scalar = config.query_pre_attn_scalar
        self.query_scale = 1.0 if scalar is None else math.sqrt(hd / scalar)
        if not config.is_local(layer):
            self.query_scale *= rope_attention_factor(config) ** 2
        self.sinks = nn.Parameter(torch.empty(config.num_heads)) if config.attention_sinks else None

    def forward(self, x, rope: Rope, cache: KVCache, meta: AttentionMeta) -> torch.Tensor:
        b, t, _ = x.shape
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = project(self.qkv_proj, x, rope.fused).view(b, t, h + 2 * h_kv, d)
        q, k, v = qkv[:, :, :h], qkv[:, :, h:h + h_kv], qkv[:, :, h + h_kv:]  # q: [B, T, H, D]
        if rope.fused:
            # q/k norm, rotation and the cache write in one kernel.
            norms = (None, None) if self.q_norm is None else (self.q_norm.weight,
                                                              self.k_norm.weight)
            eps = self.q_norm.eps if self.q_norm is not None else 0.0
            keys, values, index = cache.store(self.layer)
            q = rope_and_store(q, k, v, meta.positions, rope.inv_freq, keys, values, index,
                               *norms, eps=eps, ring=cache.ring_of(self.layer) is not None)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = q * rope.cos + rotate_half(q) * rope.sin
            k = k * rope.cos + rotate_half(k) * rope.sin
            cache.write(self.layer, meta.positions, k, v)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        out = attend(q, cache, self.layer, meta, self.sinks)  # [B, T, H, D]
        return project(self.o_proj, out.reshape(b, t, -1), rope.fused)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, f = config.hidden_size, config.intermediate_size
        # gate and up in one GEMM, like qkv_proj: rows [0, f) gate, [f, 2f) up.
        self.gate_up_proj = nn.Linear(d, 2 * f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)
        self.gelu = config.mlp_activation == "gelu_tanh"  # GeGLU (Gemma3), else SwiGLU

    def forward(self, x: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
        if fused and not self.gelu:
            if gemv_serves(x, self.gate_up_proj.weight):  # the GEMM and SiLU-mul in one
                hidden = gemv_silu_mul(x, self.gate_up_proj.weight)
            else:
                hidden = silu_mul(self.gate_up_proj(x))
        else:
            gate, up = project(self.gate_up_proj, x, fused).chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            hidden = act * up
        return project(self.down_proj, hidden, fused)


class MixtureOfExperts(nn.Module):
    """Each token's MLP: its router's top experts (SwiGLU each), weighted by their
    routing probabilities. Only the experts some token of the batch routes to are run,
    each once over the tokens routed to it: on the fused path by the grouped kernel,
    which never waits on the host (so decode steps can be captured in CUDA graphs),
    else by a loop over those experts."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, f, e = config.hidden_size, config.expert_intermediate_size, config.num_experts
        self.config = config
        self.gate = nn.Linear(d, e, bias=config.router_bias)  # the router
        self.experts_gate_up = nn.Parameter(torch.empty(e, 2 * f, d))  # [E, 2F, D]
        self.experts_down = nn.Parameter(torch.empty(e, d, f))  # [E, D, F]
        if config.expert_bias:
            self.experts_gate_up_bias = nn.Parameter(torch.empty(e, 2 * f))
            self.experts_down_bias = nn.Parameter(torch.empty(e, d))
        else:
            self.experts_gate_up_bias = self.experts_down_bias = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, K] in x's dtype, expert ids [N, K])."""
        c = self.config
        logits = self.gate(x)  # [N, E]
        if c.routing == "top_k_softmax":
            top, chosen = logits.topk(c.experts_per_token, dim=-1)
            return torch.softmax(top, dim=-1), chosen
        weights, chosen = torch.softmax(logits.float(), dim=-1).topk(c.experts_per_token, dim=-1)
        if c.normalize_routing:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` on x [n, D]."""
        c = self.config
        bias = lambda b: None if b is None else b[e]  # noqa: E731
        gate_up = F.linear(x, self.experts_gate_up[e], bias(self.experts_gate_up_bias))
        gate, up = gate_up.chunk(2, dim=-1)
        if c.expert_activation == "clamped_swiglu":
            gate = gate.clamp(max=c.swiglu_limit)
            up = up.clamp(-c.swiglu_limit, c.swiglu_limit)
            hidden = (up + 1) * gate * torch.sigmoid(gate * c.swiglu_alpha)
        else:
            hidden = F.silu(gate) * up
        return F.linear(hidden, self.experts_down[e], bias(self.experts_down_bias))

    def forward(self, x: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [N, D]
        weights, chosen = self.route(x)  # [N, K]
        if fused and x.shape[0] <= MOE_KERNEL_MAX_TOKENS:
            c = self.config
            return moe(x, weights, chosen, self.experts_gate_up, self.experts_down,
                       self.experts_gate_up_bias, self.experts_down_bias,
                       c.expert_activation, c.swiglu_alpha, c.swiglu_limit).reshape(shape)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            token, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, token, self.expert(e, x[token]) * weights[token, slot, None])
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        d, eps = config.hidden_size, config.rms_norm_eps
        self.local_rope = config.is_local(layer)
        self.input_layernorm = RMSNorm(d, eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(d, eps)
        if config.sandwich_norms:
            # Gemma3: post_attention_layernorm norms the attention output before the
            # residual add; these two norm before and after the MLP.
            self.pre_feedforward_layernorm = RMSNorm(d, eps)
            self.post_feedforward_layernorm = RMSNorm(d, eps)
        self.sandwich = config.sandwich_norms
        self.mlp = MixtureOfExperts(config) if config.is_moe(layer) else MLP(config)

    def forward(self, x, residual: torch.Tensor | None, rope: Rope, cache: KVCache,
                meta: AttentionMeta) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this block's MLP output, the residual stream before it): the caller's
        next norm adds them, so each residual add shares a kernel with a norm."""
        fused = rope.fused
        if residual is None:
            normed, residual = self.input_layernorm(x, fused=fused), x
        else:
            normed, residual = self.input_layernorm(x, residual, fused=fused)
        attended = self.self_attn(normed, rope, cache, meta)
        if not self.sandwich:
            normed, residual = self.post_attention_layernorm(attended, residual, fused=fused)
            return self.mlp(normed, fused=fused), residual
        attended = self.post_attention_layernorm(attended, fused=fused)
        normed, residual = self.pre_feedforward_layernorm(attended, residual, fused=fused)
        return self.post_feedforward_layernorm(self.mlp(normed, fused=fused), fused=fused), residual


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for name, table in self.rope_tables().items():
            self.register_buffer(name, table, persistent=False)

    def rope_tables(self) -> dict[str, torch.Tensor]:
        """The RoPE buffers by name: ``inv_freq``, and ``local_inv_freq`` where the
        sliding layers have their own base."""
        tables = {"inv_freq": rope_inverse_frequencies(self.config)}
        if any(self.config.is_local(i) for i in range(self.config.num_layers)):
            tables["local_inv_freq"] = rope_inverse_frequencies(self.config, local=True)
        return tables

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        c = self.config
        p = self.embed_tokens.weight
        return KVCache(c.num_layers, batch_size, max_len, c.num_kv_heads, c.head_dim,
                       dtype=p.dtype, device=p.device, window=c.window)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        meta: AttentionMeta,
    ) -> torch.Tensor:
        """tokens, positions: [B, T] -> final hidden states [B, T, hidden] (normed).

        Use ``logits`` on the rows whose next-token distribution is needed; prefill
        needs only one row per sequence.
        """
        x = self.embed_tokens(tokens)
        if self.config.scale_embeddings:
            # In the activations' dtype, as the reference implementation rounds it.
            x = x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)
        fused = self._fused_layers(x)
        ropes = {False: self._rope(self.inv_freq, positions, x.dtype, fused)}
        if hasattr(self, "local_inv_freq"):
            ropes[True] = self._rope(self.local_inv_freq, positions, x.dtype, fused)
        residual = None
        for block in self.layers:
            x, residual = block(x, residual, ropes[block.local_rope], cache, meta)
        return self.norm(x, residual, fused=fused)[0]

    @staticmethod
    def _rope(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
              fused: bool) -> Rope:
        if fused:
            return Rope(inv_freq)
        freqs = positions[..., None].float() * inv_freq  # [B, T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, D]
        return Rope(inv_freq, angles.cos().to(dtype), angles.sin().to(dtype))

    def _fused_layers(self, x: torch.Tensor) -> bool:
        """Fused Triton norms, rotary + cache write and SiLU-mul wherever the Triton
        kernels are enabled (see VEGAS_ATTENTION): on a GPU by default."""
        return kernels_enabled(x) and supported_head_dim(self.config.head_dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., hidden] -> float32 logits [..., vocab]."""
        return project(self.lm_head, hidden, kernels_enabled(hidden)).float()
