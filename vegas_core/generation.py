"""Batched generation: chunked prefill, then decode steps until EOS or the token limit."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from vegas_core.attention import AttentionMeta, kernels_serve_model
from vegas_core.cache import KVCache
from vegas_core.errors import VegasError
from vegas_core.graphs import StaticForward, workspace
from vegas_core.loading import LoadedModel
from vegas_core.sampling import SamplingParams, choose_tokens

if TYPE_CHECKING:
    from vegas_core.spec_config import SpecConfig

# Rows per prefill forward: bounds the [H, rows, ctx] score tensor of the reference
# attention (512 rows x 8k slots x 9 heads x 4 bytes = 150 MB).
DEFAULT_PREFILL_CHUNK = 512

# progress(phase, done, total) with phase "prefill" (tokens) or "decode" (tokens).
ProgressFn = Callable[[str, int, int], None]


@dataclass
class GenerationStats:
    prompt_tokens: list[int]
    new_tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    decode_tokens: int  # tokens produced by decode forwards (the first comes from prefill)
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        """Decode throughput over the batch, prefill excluded."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new token ids per prompt, EOS included if produced
    texts: list[str] | None  # decoded new text per prompt (None without a tokenizer)
    stats: GenerationStats


def encode_prompts(model: LoadedModel, prompts: Sequence[str] | Sequence[Sequence[int]] | str
                   ) -> list[list[int]]:
    """Strings are tokenized with the model's tokenizer; id lists pass through checked."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if len(prompts) == 0:
        raise VegasError("no prompts given; pass at least one prompt")
    out = []
    vocab = model.config.vocab_size
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if model.tokenizer is None:
                raise VegasError(f"{model.spec} has no tokenizer; pass prompts as token-id lists")
            ids = model.tokenizer.encode(p)
        else:
            ids = [int(t) for t in p]
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise VegasError(f"prompt {i}: token id {bad[0]} outside the vocabulary [0, {vocab})")
        if not ids:
            raise VegasError(f"prompt {i} is empty; give it at least one token")
        out.append(ids)
    return out


def check_lengths(model: LoadedModel, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
    limit = model.config.max_position_embeddings
    if max_new_tokens < 1:
        raise VegasError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, ids in enumerate(prompt_ids):
        if len(ids) + max_new_tokens > limit:
            raise VegasError(
                f"prompt {i} has {len(ids)} tokens; with {max_new_tokens} new tokens that "
                f"exceeds the model's maximum of {limit} positions; shorten the prompt or "
                f"lower max_new_tokens"
            )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PrefixCache:
    """K/V of prompts already prefilled, kept across ``generate`` calls on one model.

    Tuning measures many configurations on the same prompts; the prompt's K/V do not
    depend on the configuration (slot p depends on tokens 0..p only), so they are
    computed once. A stored prompt also serves any of its leading parts. Entries past
    ``max_bytes`` are not kept.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: list[tuple[tuple[int, ...], torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._bytes = 0

    def find(self, ids: list[int], need_last_hidden: bool):
        """(k [L, H_kv, n, D], v, last_hidden) of a stored prompt starting with ``ids``."""
        key = tuple(ids)
        for stored, k, v, last in self._entries:
            exact = len(stored) == len(key)
            if stored[: len(key)] == key and (exact or not need_last_hidden):
                return k[:, :, : len(key)], v[:, :, : len(key)], (last if exact else None)
        return None

    def add(self, ids: list[int], k: torch.Tensor, v: torch.Tensor, last: torch.Tensor) -> None:
        size = 2 * k.numel() * k.element_size()
        if self._bytes + size <= self.max_bytes and self.find(ids, True) is None:
            self._entries.append((tuple(ids), k.clone(), v.clone(), last.clone()))
            self._bytes += size


@torch.inference_mode()
def prefill(model: LoadedModel, prompt_ids: list[list[int]], cache: KVCache, *,
            chunk: int = DEFAULT_PREFILL_CHUNK, progress: ProgressFn | None = None,
            reuse: PrefixCache | None = None, need_last_hidden: bool = True) -> torch.Tensor:
    """Run the prompts through the model in chunks; returns the last row's hidden state
    per sequence, [B, hidden], and sets ``cache.lengths`` to the prompt lengths.

    Prompts of one length run as a batch; otherwise each sequence runs alone through a
    batch-1 view of the cache, so a ragged batch costs no padding. An empty prompt is
    skipped (its row stays zero). With ``reuse``, stored prompts are copied in instead
    of recomputed, and computed ones are stored.
    """
    net, dev = model.net, model.device
    window = model.config.sliding_window
    last_hidden = torch.zeros(len(prompt_ids), model.config.hidden_size, dtype=model.dtype,
                              device=dev)
    todo = []
    for b, ids in enumerate(prompt_ids):
        hit = reuse.find(ids, need_last_hidden) if reuse is not None and ids else None
        if hit is None:
            todo.append(b)
            continue
        k, v, last = hit
        cache.k[:, b, :, : len(ids)] = k
        cache.v[:, b, :, : len(ids)] = v
        if last is not None:
            last_hidden[b] = last
    # Equal lengths run as one batch; a ragged batch runs sequence by sequence.
    if len(todo) == len(prompt_ids) and len({len(p) for p in prompt_ids}) == 1:
        groups = [(todo, cache)]
    else:
        groups = [([b], cache.sequence(b)) for b in todo]
    total, done = sum(len(prompt_ids[b]) for b in todo), 0
    for rows, view in groups:
        ids = [prompt_ids[b] for b in rows]
        n = len(ids[0])
        tokens = torch.tensor(ids, dtype=torch.long, device=dev)
        for start in range(0, n, chunk):
            end = min(n, start + chunk)
            positions = torch.arange(start, end, device=dev).expand(len(rows), -1)  # [B, T]
            hidden = net(tokens[:, start:end], positions, view,
                         AttentionMeta.full(positions, end, window))
            done += (end - start) * len(rows)
            if progress:
                progress("prefill", done, total)
        if n:
            last_hidden[rows] = hidden[:, -1]
            if reuse is not None:
                for b in rows:
                    reuse.add(prompt_ids[b], cache.k[:, b, :, :n], cache.v[:, b, :, :n],
                              last_hidden[b])
    cache.lengths.copy_(torch.tensor([len(p) for p in prompt_ids], device=dev))
    return last_hidden


def _decode_setup(model: LoadedModel, batch: int, capacity: int):
    """-> (cache, step): step(tokens [B, 1], positions [B, 1], kv_len) -> last-row logits
    [B, V]. Where the kernels serve the step it runs on static buffers (a CUDA graph on
    a GPU) kept in the model's workspace; else eagerly with the host's key bound."""
    net, dev, window = model.net, model.device, model.config.sliding_window
    space = workspace(net, batch, capacity, dev) if kernels_serve_model(
        model.config, dev, 1) else None
    if space is not None:
        cache = space.cache
        forward = space.get(("vanilla",), lambda: StaticForward(
            net, cache, batch, 1, lambda pos: AttentionMeta.full(pos, cache.max_len),
            all_rows=False, device=dev, pool=space.pool))
        return cache, lambda tokens, positions, kv_len: forward(tokens, positions)
    cache = net.new_cache(batch, capacity)

    def eager(tokens, positions, kv_len):
        hidden = net(tokens, positions, cache, AttentionMeta.full(positions, kv_len, window))
        return net.logits(hidden[:, -1])

    return cache, eager


def generate(
    model: LoadedModel,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    *,
    spec: "SpecConfig | None" = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    ignore_eos: bool = False,
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    progress: ProgressFn | None = None,
    prefix_cache: PrefixCache | None = None,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per prompt.

    ``spec=None`` decodes plainly (vanilla); a ``SpecConfig`` decodes self-speculatively
    with its drafter, losslessly. Greedy when ``temperature`` is 0; otherwise sampling
    after top-k and top-p with a generator seeded by ``seed``. A sequence stops at its
    first EOS token unless ``ignore_eos``; the batch stops when all have.
    ``prefix_cache`` reuses prompt K/V across calls (see ``PrefixCache``).
    """
    params = SamplingParams(temperature, top_p, top_k, seed)
    if prefill_chunk < 1:
        raise VegasError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    if spec is not None:
        from vegas_core.speculative import generate_speculative

        return generate_speculative(model, prompts, max_new_tokens, spec, params,
                                    ignore_eos=ignore_eos, prefill_chunk=prefill_chunk,
                                    progress=progress, prefix_cache=prefix_cache)
    prompt_ids = encode_prompts(model, prompts)
    check_lengths(model, prompt_ids, max_new_tokens)
    dev, net = model.device, model.net
    b = len(prompt_ids)
    cache, step = _decode_setup(model, b, max(len(p) for p in prompt_ids) + max_new_tokens)
    generator = torch.Generator(device=dev).manual_seed(seed)
    eos = set() if ignore_eos or model.tokenizer is None else set(model.tokenizer.eos_token_ids)

    _sync(dev)
    t0 = time.perf_counter()
    last_hidden = prefill(model, prompt_ids, cache, chunk=prefill_chunk, progress=progress,
                          reuse=prefix_cache)
    with torch.inference_mode():
        next_tokens = choose_tokens(net.logits(last_hidden), params, generator)  # [B]
    _sync(dev)
    t1 = time.perf_counter()

    out: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b
    host_len = max(len(p) for p in prompt_ids)  # longest sequence, for the key bound
    decode_tokens = 0
    with torch.inference_mode():
        for i in range(max_new_tokens):
            for j, tok in enumerate(next_tokens.tolist()):  # the one sync per step
                if not done[j]:
                    out[j].append(tok)
                    done[j] = tok in eos or len(out[j]) == max_new_tokens
            if progress:
                progress("decode", i + 1, max_new_tokens)
            if all(done):
                break
            host_len += 1
            logits = step(next_tokens[:, None], cache.lengths[:, None], host_len)
            cache.lengths += 1
            next_tokens = choose_tokens(logits, params, generator)
            decode_tokens += sum(not d for d in done)
    _sync(dev)
    t2 = time.perf_counter()

    texts = [model.tokenizer.decode(ids) for ids in out] if model.tokenizer else None
    stats = GenerationStats(
        prompt_tokens=[len(p) for p in prompt_ids],
        new_tokens=[len(o) for o in out],
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        decode_tokens=decode_tokens,
    )
    return GenerationResult(out, texts, stats)
