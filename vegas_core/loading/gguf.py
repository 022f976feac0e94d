"""GGUF files: config and tokenizer from the metadata, weights dequantized with ``gguf``."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from vegas_core.config import GEMMA3_LOCAL_ROPE_THETA, ModelConfig, gemma3_layer_types
from vegas_core.errors import VegasError
from vegas_core.loading.embedded import cache_folder
from vegas_core.loading.gguf_header import GGUFFormatError, GGUFHeader
from vegas_core.loading.weights import build_with_weights
from vegas_core.tokenizer import TokenizersTokenizer, TransformersTokenizer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
# What llama.cpp assumes of Gemma3 files rather than storing it: the layer pattern and the
# local RoPE base (config.py), and attention scaled by head_dim ** -0.5 (the 270M-12B
# configs' query_pre_attn_scalar equals their head_dim).
GEMMA3_END_OF_TURN = "<end_of_turn>"

# GGUF tensor name -> Hugging Face parameter name (without the "model." prefix).
_GLOBAL_NAMES = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma3's sandwich norms: ffn_norm is the norm before the MLP there.
_GEMMA3_BLOCK_NAMES = {
    **_BLOCK_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# GGUF token types (llama.cpp's enum): control and user-defined tokens are matched whole.
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer split patterns by `tokenizer.ggml.pre` (published with each tokenizer).
# Others fall back to transformers' GGUF tokenizer conversion.
_GPT2_PATTERN = None  # the byte-level pre-tokenizer's own regex
_SPLIT_PATTERNS = {
    "default": _GPT2_PATTERN,
    "gpt2": _GPT2_PATTERN,
    "smollm": _GPT2_PATTERN,
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


class GGUFFile:
    """The parsed header of a GGUF file; tensors are read lazily."""

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():
            raise VegasError(f"GGUF file not found: {path}")
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise VegasError(f"{path} is not a GGUF file (bad magic); pass a .gguf model")
        try:
            # Every tensor's extent is checked against the file's size here, so that
            # truncation is caught before anything loads.
            self.header = GGUFHeader(path)
        except GGUFFormatError as e:
            raise VegasError(f"{path} is truncated or corrupt ({e}); download it again") from e
        self.tensors = self.header.tensors

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.fields.get(key, default)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise VegasError(f"{self.path}: metadata key '{key}' is missing; the file is incomplete")
        return value

    @property
    def architecture(self) -> str:
        return self.require("general.architecture")


def gguf_config(gf: GGUFFile) -> ModelConfig:
    arch = gf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise VegasError(
            f"{gf.path.name}: unsupported architecture '{arch}'; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    a = lambda key, default=None: gf.get(f"{arch}.{key}", default)  # noqa: E731
    heads = int(a("attention.head_count"))
    hidden = int(a("embedding_length"))
    tokens = gf.get("tokenizer.ggml.tokens")
    vocab = a("vocab_size") or (len(tokens) if tokens is not None else None)
    rope_scaling = None
    names = {t.name for t in gf.tensors}
    if "rope_freqs.weight" in names:
        factors = _tensor_array(next(t for t in gf.tensors if t.name == "rope_freqs.weight"))
        rope_scaling = {"rope_type": "freq_factors", "factors": factors.tolist()}
    elif a("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(a("rope.scaling.factor"))}
    eos = gf.get("tokenizer.ggml.eos_token_id")
    eot = gf.get("tokenizer.ggml.eot_token_id")
    variant: dict[str, Any] = {}
    if arch == "gemma3":
        layers = int(a("block_count"))
        head_dim = int(a("attention.key_length", hidden // heads))
        if eot is None and tokens is not None and GEMMA3_END_OF_TURN in tokens:
            eot = list(tokens).index(GEMMA3_END_OF_TURN)  # the chat turn's end
        variant = dict(
            sliding_window=int(a("attention.sliding_window")),
            layer_types=gemma3_layer_types(layers),
            rope_local_theta=GEMMA3_LOCAL_ROPE_THETA, mlp_activation="gelu_tanh",
            scale_embeddings=True, sandwich_norms=True, query_pre_attn_scalar=float(head_dim))
    return ModelConfig(
        name=gf.get("general.name") or gf.path.stem,
        family=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(a("feed_forward_length")),
        num_layers=int(a("block_count")),
        num_heads=heads,
        num_kv_heads=int(a("attention.head_count_kv", heads)),
        head_dim=int(a("attention.key_length", hidden // heads)),
        max_position_embeddings=int(a("context_length", 4096)),
        rms_norm_eps=float(a("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(a("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=gf.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=sorted({int(i) for i in (eos, eot) if i is not None}),
        **variant,
    )


def _tensor_array(tensor: Any) -> np.ndarray:
    import gguf  # deferred (0.15 s to import): only GGUF files need it

    # A copy: the header hands out read-only views of the memory-mapped file.
    return np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def _unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp stores Llama q/k rows in the interleaved-pair RoPE order; the model here
    # (like transformers) rotates halves, so undo that row permutation per head.
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(gf: GGUFFile, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    # Gemma's norms scale by 1 + w; llama.cpp stores 1 + w, which the model's RMSNorm
    # multiplies by as it is.
    block_names = _GEMMA3_BLOCK_NAMES if config.family == "gemma3" else _BLOCK_NAMES
    for tensor in gf.tensors:
        name = tensor.name
        if name == "rope_freqs.weight":
            continue  # folded into the config's RoPE frequencies
        if name in _GLOBAL_NAMES:
            hf_name = _GLOBAL_NAMES[name]
        else:
            m = _BLOCK_RE.fullmatch(name)
            if not m or m.group(2) not in block_names:
                raise VegasError(f"{gf.path.name}: unexpected tensor '{name}'; this model variant is not supported")
            hf_name = f"layers.{m.group(1)}.{block_names[m.group(2)]}.{m.group(3)}"
        w = torch.from_numpy(_tensor_array(tensor))
        if config.family == "llama" and name.endswith((".attn_q.weight", ".attn_k.weight", ".attn_q.bias", ".attn_k.bias")):
            heads = config.num_heads if ".attn_q." in name else config.num_kv_heads
            w = _unpermute_rotary(w, heads)
        yield hf_name, w


def gguf_tokenizer(gf: GGUFFile):
    """The tokenizer described by the file's metadata."""
    model = gf.get("tokenizer.ggml.model")
    pre = gf.get("tokenizer.ggml.pre", "default")
    eos_ids = sorted({int(i) for i in (gf.get("tokenizer.ggml.eos_token_id"),
                                        gf.get("tokenizer.ggml.eot_token_id")) if i is not None})
    if model != "gpt2" or pre not in _SPLIT_PATTERNS:
        # SentencePiece-style vocabularies: use transformers' converter for the same file.
        try:
            tok = _converted_tokenizer(gf)
        except VegasError:
            raise
        except Exception as e:
            raise VegasError(f"{gf.path.name}: cannot build its tokenizer ({model}/{pre}): {e}") from e
        return TransformersTokenizer(tok, eos_ids)

    tokens = list(gf.require("tokenizer.ggml.tokens"))
    merges = [tuple(m.split(" ", 1)) for m in gf.require("tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                     fuse_unk=False, byte_fallback=False)
    backend = Tokenizer(bpe)
    pattern = _SPLIT_PATTERNS[pre]
    if pattern is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    backend.decoder = decoders.ByteLevel()
    types = gf.get("tokenizer.ggml.token_type") or []
    backend.add_special_tokens([
        AddedToken(tokens[i], special=True, normalized=False)
        for i, kind in enumerate(types) if kind in (_CONTROL, _USER_DEFINED)
    ])
    bos = gf.get("tokenizer.ggml.bos_token_id")
    return TokenizersTokenizer(
        backend,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        add_bos=bool(gf.get("tokenizer.ggml.add_bos_token", False)),
        chat_template=gf.get("tokenizer.chat_template"),
    )


# Common words that SentencePiece vocabularies hold whole, as "\u2581" + word: a tokenizer
# that follows the vocabulary encodes each to that one piece. Converting Gemma3-270M's GGUF
# tokenizer, transformers 4.57.6 and 5.17.0 cut words into short pieces (5.17.0's saved
# copy reloaded as one token per character) and 5.18.0-5.22.2 left out the BOS the file
# asks for (docs/results/tuner-regret.md).
_PROBE_WORDS = ("the", "of", "and", "time", "return", "value", "first", "number", "people",
                "world", "state", "system")
_SPM_SPACE = "\u2581"
# The first transformers release whose conversion of Gemma3's GGUF tokenizer, and the
# saved copy of it, tokenize as the vocabulary says (of 4.57.6 and 5.17.0-5.25.0).
GOOD_TRANSFORMERS = "5.23.0"


def tokenizer_problem(tok, gf: GGUFFile) -> str | None:
    """Why transformers' tokenizer ``tok`` does not tokenize as the GGUF file's vocabulary
    says (a probe of common words, each a piece of its own, and the BOS the file asks
    for), or None when it does or the vocabulary holds too few of the words to tell."""
    pieces = {_SPM_SPACE + w for w in _PROBE_WORDS}
    index = {t: i for i, t in enumerate(gf.require("tokenizer.ggml.tokens")) if t in pieces}
    words = [w for w in _PROBE_WORDS if _SPM_SPACE + w in index]
    if len(words) < 3:
        return None
    text = "So " + " ".join(words)
    ids = list(tok(text)["input_ids"])
    eos = tok.eos_token_id
    while ids and ids[-1] == eos:  # a tokenizer that appends its EOS
        ids.pop()
    want = [index[_SPM_SPACE + w] for w in words]
    if ids[-len(want):] != want:
        return (f"{text!r} encodes to {len(ids)} tokens ending {ids[-len(want):]}, not to "
                f"the vocabulary's pieces {want}")
    bos = gf.get("tokenizer.ggml.bos_token_id")
    if gf.get("tokenizer.ggml.add_bos_token", False) and bos is not None and ids[0] != int(bos):
        return f"the file asks for BOS {int(bos)} first, and {text!r} starts with {ids[0]}"
    return None


def _converted_tokenizer(gf: GGUFFile):
    """transformers' tokenizer converted from the GGUF file, kept in the cache folder:
    the conversion parses the whole file again (about 40 s for Gemma3's vocabulary),
    loading the saved result takes a second. Keyed by the file's path, size and
    modification time and by the transformers version. Both the conversion and the
    saved copy are checked against the vocabulary (``tokenizer_problem``): a conversion
    that fails is refused, a copy that reloads differently is not kept."""
    # Deferred (0.7 s to import): only a tokenizer that needs converting uses it.
    import transformers
    from transformers import AutoTokenizer

    path = gf.path
    stat = path.resolve().stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|"
                         f"{transformers.__version__}".encode()).hexdigest()[:20]
    saved = cache_folder() / "tokenizers" / f"{path.stem}-{key}"
    if saved.is_dir():
        try:
            tok = AutoTokenizer.from_pretrained(str(saved))
            if tokenizer_problem(tok, gf) is None:
                return tok
        except Exception:  # an unreadable copy is rebuilt below
            pass
        shutil.rmtree(saved, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    problem = tokenizer_problem(tok, gf)
    if problem:
        raise VegasError(
            f"{path.name}: transformers {transformers.__version__} converts its tokenizer "
            f"wrongly ({problem}); install transformers>={GOOD_TRANSFORMERS}")
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=saved.parent, prefix=f".{saved.name}.")
        try:
            tok.save_pretrained(tmp)
            # Kept only if it reloads as converted: every later process loads the copy.
            if tokenizer_problem(AutoTokenizer.from_pretrained(tmp), gf) is None:
                os.replace(tmp, saved)  # whole or not at all; a concurrent writer's copy wins
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass  # no cache: the next load converts again
    return tok


def load_gguf(path: Path, *, device: torch.device, dtype: torch.dtype):
    gf = GGUFFile(path)
    config = gguf_config(gf)
    net = build_with_weights(config, _gguf_tensors(gf, config), device=device, dtype=dtype,
                             source=path.name)
    return config, net, gguf_tokenizer(gf)
