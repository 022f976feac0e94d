"""ModelConfig: the one description of a transformer's shape and variant flags.

Filled from a Hugging Face ``config.json``, from GGUF metadata, or from a dummy
preset. Architecture differences (Qwen2's qkv bias, Qwen3's q/k RMSNorm, Llama 3's
RoPE scaling, Gemma3's sandwich norms, GeGLU and local sliding layers) are flags here,
never separate model code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from vegas_core.errors import VegasError

# Hugging Face model_type -> our family. Mistral is a Llama with an optional sliding window.
HF_MODEL_TYPES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
                  "qwen3_moe": "qwen3_moe", "gemma3_text": "gemma3", "gpt_oss": "gpt_oss"}
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
# Hugging Face layer_types values.
SLIDING, FULL = "sliding_attention", "full_attention"
# Gemma3 (270M-27B): every sixth layer is global; the sliding layers' RoPE base.
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


def gemma3_layer_types(num_layers: int) -> list[str]:
    """Gemma3's attention pattern: five sliding layers, then one global, repeated."""
    return [FULL if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else SLIDING for i in range(num_layers)]


@dataclass(frozen=True)
class SlidingWindow:
    """Attention limited to the last ``size`` positions (the query's own included), in
    ``layers`` only (None: every layer, as in Mistral)."""

    size: int
    layers: frozenset[int] | None = None

    def applies(self, layer: int) -> bool:
        return self.layers is None or layer in self.layers
# "freq_factors": per-frequency divisors stored in a GGUF file (rope_freqs.weight).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "freq_factors")
# How a mixture's router turns logits into expert weights: a softmax over every expert,
# then the top k (Qwen3-MoE), or the top k logits, then a softmax over them (gpt-oss).
ROUTINGS = ("softmax_top_k", "top_k_softmax")
EXPERT_ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass
class ModelConfig:
    name: str
    family: str  # "llama" | "qwen2" | "qwen3" | "qwen3_moe" | "gemma3" | "gpt_oss"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, ...} or None
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    # Per layer SLIDING or FULL (Gemma3's local and global layers); None: every layer
    # as ``sliding_window`` says.
    layer_types: list[str] | None = None
    # RoPE base of the sliding layers, where it differs (Gemma3: 10k local, 1M global);
    # ``rope_scaling`` applies to the other layers only.
    rope_local_theta: float | None = None
    mlp_activation: str = "silu"
    # Gemma3: embeddings times sqrt(hidden_size); a norm after attention and after the
    # MLP as well as before each ("sandwich"); attention scaled by
    # query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5.
    scale_embeddings: bool = False
    sandwich_norms: bool = False
    query_pre_attn_scalar: float | None = None
    # Mixture of experts (Qwen3-MoE): each token's MLP is the weighted sum of the
    # ``experts_per_token`` experts its router ranks first (softmax over all experts,
    # renormalized over the chosen ones with ``normalize_routing``). Layers in
    # ``dense_layers``, and those not a multiple of ``moe_every``, keep a dense MLP.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    normalize_routing: bool = False
    moe_every: int = 1
    dense_layers: tuple[int, ...] = ()
    # gpt-oss: biased router and experts, top-k before the softmax, and its clamped
    # SwiGLU: (clamp(up) + 1) * g * sigmoid(alpha * g), g = gate clamped above.
    routing: str = "softmax_top_k"
    router_bias: bool = False
    expert_bias: bool = False
    expert_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # gpt-oss: a learned logit per query head that joins every softmax of attention
    # (its probability mass is dropped: the head may attend to nothing).
    attention_sinks: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise VegasError(
                f"model config: num_heads {self.num_heads} is not a multiple of "
                f"num_kv_heads {self.num_kv_heads}; the config is inconsistent"
            )
        if self.routing not in ROUTINGS or self.expert_activation not in EXPERT_ACTIVATIONS:
            raise VegasError(f"model config: routing must be one of {', '.join(ROUTINGS)} "
                             f"and expert_activation one of {', '.join(EXPERT_ACTIVATIONS)}")
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise VegasError(f"MLP activation '{self.mlp_activation}' is not supported "
                             f"(supported: {', '.join(MLP_ACTIVATIONS)})")
        if self.layer_types is not None and (
                len(self.layer_types) != self.num_layers
                or not set(self.layer_types) <= {SLIDING, FULL}):
            raise VegasError(f"model config: layer_types must give {SLIDING} or {FULL} for "
                             f"each of the {self.num_layers} layers")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise VegasError(
                f"RoPE scaling '{rope_type}' is not supported (supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}); use a model without it"
            )
        missing = [k for k in ("factor", "original_max_position_embeddings")
                   if rope_type == "yarn" and k not in self.rope_scaling]
        if missing:
            raise VegasError(f"model config: YaRN needs {' and '.join(missing)} in its RoPE "
                             "scaling; the config is incomplete")

    @property
    def window(self) -> SlidingWindow | None:
        """The sliding window and the layers it limits; None when attention is global."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return SlidingWindow(self.sliding_window)
        layers = frozenset(i for i, t in enumerate(self.layer_types) if t == SLIDING)
        return SlidingWindow(self.sliding_window, layers) if layers else None

    def is_moe(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return (self.num_experts > 0 and layer not in self.dense_layers
                and (layer + 1) % self.moe_every == 0)

    def is_local(self, layer: int) -> bool:
        """Whether ``layer`` is a sliding layer with its own RoPE base."""
        window = self.window
        return (self.rope_local_theta is not None and window is not None
                and window.applies(layer))

    @property
    def selection_layers(self) -> list[int]:
        """The layers whose drafts attend to a selection: all but a hybrid model's
        sliding layers (Gemma3, gpt-oss), whose windows are shorter than a budget worth
        selecting. Where every layer slides (Mistral), drafts select within the window."""
        window = self.window
        if window is None or window.layers is None:
            return list(range(self.num_layers))
        return [i for i in range(self.num_layers) if i not in window.layers]

    def num_parameters(self) -> int:
        """Parameter count implied by the shape (embeddings counted once if tied)."""
        d, h, kv, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * h * hd + 2 * d * kv * hd + h * hd * d
        if self.qkv_bias:
            attn += h * hd + 2 * kv * hd
        if self.o_bias:
            attn += d
        if self.attention_sinks:
            attn += h
        dense = 3 * d * self.intermediate_size
        f = self.expert_intermediate_size
        experts = self.num_experts * (3 * d * f + d + ((2 * f + d) if self.expert_bias else 0))
        if self.router_bias:
            experts += self.num_experts
        mlps = sum(experts if self.is_moe(i) else dense for i in range(self.num_layers))
        norms = (4 if self.sandwich_norms else 2) * d + (2 * hd if self.qk_norm else 0)
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + norms) + mlps + embed + d

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], name: str) -> "ModelConfig":
        """Build from a parsed Hugging Face ``config.json``."""
        model_type = hf.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            archs = ", ".join(hf.get("architectures") or []) or "unknown"
            raise VegasError(
                f"unsupported architecture '{model_type}' ({archs}) in {name}; supported "
                f"model types: {', '.join(sorted(HF_MODEL_TYPES))}"
            )
        family = HF_MODEL_TYPES[model_type]
        if family == "gemma3":
            return _gemma3_config(cls, hf, name)
        if family == "gpt_oss":
            return _gpt_oss_config(cls, hf, name)
        # transformers 5 stores RoPE settings in rope_parameters; older configs use
        # rope_theta + rope_scaling.
        theta, rope_scaling = _rope_settings(
            hf.get("rope_parameters") or hf.get("rope_scaling") or {},
            hf.get("rope_theta", 10000.0))
        sliding = hf.get("sliding_window")
        if family != "llama" and not hf.get("use_sliding_window", False):
            sliding = None
        return cls(
            name=name,
            family=family,
            **_hf_shape(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=family == "qwen2" or bool(hf.get("attention_bias", False)),
            o_bias=family == "llama" and bool(hf.get("attention_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            sliding_window=sliding,
            **(_moe_settings(hf) if family == "qwen3_moe" else {}),
        )


def _hf_shape(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields every config.json gives alike: sizes, heads and special tokens."""
    heads = hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                intermediate_size=hf["intermediate_size"], num_layers=hf["num_hidden_layers"],
                num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)))


def _rope_settings(rope: dict[str, Any], default_theta: float) -> tuple[float, dict | None]:
    """(theta, rope_scaling or None) from one RoPE mapping of a config."""
    rope = dict(rope)
    theta = rope.pop("rope_theta", None) or default_theta
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    return float(theta), (None if rope_type == "default" else {**rope, "rope_type": rope_type})


def _gemma3_config(cls, hf: dict[str, Any], name: str) -> "ModelConfig":
    """Gemma3's text model: its layer types, two RoPE bases and variant flags."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if hf.get(key) is not None:
            raise VegasError(f"{name}: {key} is set; Gemma3 models have none, and soft-capped "
                             "logits are not supported")
    if hf.get("use_bidirectional_attention"):
        raise VegasError(f"{name}: bidirectional attention (an encoder) is not supported")
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types is None:  # older configs: every sliding_window_pattern-th layer is global
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers)]
    rope = hf.get("rope_parameters") or {}
    if SLIDING in rope or FULL in rope:  # transformers 5: one mapping per layer type
        theta, scaling = _rope_settings(rope.get(FULL, {}), 1e6)
        local_theta, local_scaling = _rope_settings(rope.get(SLIDING, {}), 1e4)
        if local_scaling is not None:
            raise VegasError(f"{name}: RoPE scaling on sliding layers is not supported")
    else:
        theta, scaling = _rope_settings(hf.get("rope_scaling") or {}, hf.get("rope_theta", 1e6))
        local_theta = float(hf.get("rope_local_base_freq", 1e4))
    return cls(
        name=name, family="gemma3", **_hf_shape(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)), qk_norm=True,
        sliding_window=hf.get("sliding_window"), layer_types=list(types),
        rope_local_theta=local_theta,
        mlp_activation=_hf_activation(hf.get("hidden_activation", "gelu_pytorch_tanh"), name),
        scale_embeddings=True, sandwich_norms=True,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or hf.get("head_dim")),
    )


def _gpt_oss_config(cls, hf: dict[str, Any], name: str) -> "ModelConfig":
    """gpt-oss: alternating sliding and full layers, attention sinks, YaRN RoPE, and its
    mixture (biased router and experts, top-k then softmax, clamped SwiGLU)."""
    theta, scaling = _rope_settings(hf.get("rope_parameters") or hf.get("rope_scaling") or {},
                                    hf.get("rope_theta", 150000.0))
    layers = hf["num_hidden_layers"]
    return cls(
        name=name, family="gpt_oss", **_hf_shape(hf),
        max_position_embeddings=hf.get("max_position_embeddings", 131072),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bool(hf.get("attention_bias", True)), o_bias=bool(hf.get("attention_bias", True)),
        sliding_window=hf.get("sliding_window"),
        layer_types=list(hf.get("layer_types") or
                         [SLIDING if i % 2 == 0 else FULL for i in range(layers)]),
        **_moe_settings(hf), routing="top_k_softmax", router_bias=True, expert_bias=True,
        expert_activation="clamped_swiglu", swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)), attention_sinks=True,
    )


def _moe_settings(hf: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes num_local_experts; the published configs, num_experts.
    experts = hf.get("num_experts") or hf["num_local_experts"]
    return dict(num_experts=experts, experts_per_token=hf["num_experts_per_tok"],
                # gpt-oss names its experts' width intermediate_size
                expert_intermediate_size=hf.get("moe_intermediate_size") or hf["intermediate_size"],
                normalize_routing=bool(hf.get("norm_topk_prob", False)),
                moe_every=hf.get("decoder_sparse_step", 1) or 1,
                dense_layers=tuple(hf.get("mlp_only_layers") or ()))


def _hf_activation(name: str, model: str) -> str:
    known = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}
    if name not in known:
        raise VegasError(f"{model}: hidden activation '{name}' is not supported (supported: "
                         f"{', '.join(known)})")
    return known[name]


# Shapes from the models' public config.json files. Dummy models use these with random
# weights: they time like the real model and say nothing about its outputs.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-8b": dict(
        family="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, qk_norm=True, bos_token_id=151643, eos_token_ids=[151645],
        # 32k native; the model card extends to 128k with YaRN. Dummy weights only time
        # the shape, so the longer bound is allowed.
        max_position_embeddings=131072,
    ),
    "qwen3-4b": dict(
        family="qwen3", vocab_size=151936, hidden_size=2560, intermediate_size=9728,
        num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, qk_norm=True, tie_word_embeddings=True, bos_token_id=151643,
        eos_token_ids=[151645], max_position_embeddings=131072,
    ),
    "llama-3.1-8b": dict(
        family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
        rope_theta=500000.0,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192),
        bos_token_id=128000, eos_token_ids=[128001, 128008, 128009],
        max_position_embeddings=131072,
    ),
    "qwen2.5-7b": dict(
        family="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, qkv_bias=True, bos_token_id=151643, eos_token_ids=[151645],
        max_position_embeddings=131072,
    ),
    "gpt-oss-20b": dict(
        family="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        num_layers=24, num_heads=64, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=150000.0, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0,
                                               beta_slow=1.0, truncate=False,
                                               original_max_position_embeddings=4096),
        qkv_bias=True, o_bias=True, sliding_window=128,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(24)],
        num_experts=32, experts_per_token=4, expert_intermediate_size=2880,
        routing="top_k_softmax", router_bias=True, expert_bias=True,
        expert_activation="clamped_swiglu", attention_sinks=True, bos_token_id=199998,
        eos_token_ids=[200002, 199999], max_position_embeddings=131072,
    ),
    "qwen3-30b-a3b": dict(
        family="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, qk_norm=True, num_experts=128, experts_per_token=8,
        expert_intermediate_size=768, normalize_routing=True, bos_token_id=151643,
        eos_token_ids=[151645], max_position_embeddings=131072,
    ),
    # The embedded GGUF's shape (tests check the two agree): five sliding layers of 512
    # slots, then one global, with 256-dim heads and one KV head.
    "gemma3-270m": dict(
        family="gemma3", vocab_size=262144, hidden_size=640, intermediate_size=2048,
        num_layers=18, num_heads=4, num_kv_heads=1, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=1e6, rope_local_theta=GEMMA3_LOCAL_ROPE_THETA, qk_norm=True,
        tie_word_embeddings=True, sliding_window=512, layer_types=gemma3_layer_types(18),
        mlp_activation="gelu_tanh", scale_embeddings=True, sandwich_norms=True,
        query_pre_attn_scalar=256.0, bos_token_id=2, eos_token_ids=[1, 106],
        max_position_embeddings=32768,
    ),
    # Not a real model: a few-layer shape with a byte vocabulary, for smoke tests and CI.
    "tiny": dict(
        family="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        qk_norm=True, max_position_embeddings=16384,
    ),
    "smollm2-135m": dict(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2],
        max_position_embeddings=8192,
    ),
}


# A model spec naming a preset shape with random weights: ``dummy:<preset>``.
DUMMY_PREFIX = "dummy:"


def preset_config(preset: str) -> ModelConfig:
    """The config of ``dummy:<preset>``."""
    if preset not in PRESETS:
        raise VegasError(
            f"unknown dummy preset '{preset}'; choose one of: {', '.join(sorted(PRESETS))}"
        )
    return ModelConfig(name=f"{DUMMY_PREFIX}{preset}", **PRESETS[preset])
