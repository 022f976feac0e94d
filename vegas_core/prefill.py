"""Prompts into the KV cache: token ids, checks, chunked prefill, and prompt K/V reuse.

Prefill runs whole prompts (or as much of them as one forward's token budget allows)
through the model, on the fused prefill attention (``vegas_kernels.prefill_attention``). Two
things let it skip work:

- the cache's own memory of its rows (``KVCache.prompts``): a kept cache whose row
  already holds the prompt, or a leading part of it, computes only the rest;
- a ``PrefixCache``: copies of earlier prompts' K/V, for workloads that cycle more
  prompts through a batch than it has rows. Where the cache keeps a hybrid model's
  sliding layers as rings (``vegas_core.cache``), a copy holds those layers' saved tail
  only, and serves prompts that share all but its last ``PROMPT_TAIL_SLACK`` tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from vegas_core.attention import AttentionMeta, prefill_kernels_enabled
from vegas_core.cache import KVCache, PromptCopy, PromptSlots, common_prefix
from vegas_core.errors import VegasError

# progress(phase, done, total) with phase "prefill" (tokens) or "decode" (tokens).
ProgressFn = Callable[[str, int, int], None]

# Rows of one sequence per forward on the reference attention: bounds its
# [H, rows, ctx] score tensor (512 rows x 8k slots x 9 heads x 4 bytes = 150 MB).
REFERENCE_CHUNK_ROWS = 512
REFERENCE_TOKENS_PER_FORWARD = 16 * REFERENCE_CHUNK_ROWS
# Tokens per forward on the fused path: large enough for full-rate GEMMs and attention
# blocks, bounded by the activation memory a forward may take (see ``prefill_budget``).
MAX_TOKENS_PER_FORWARD = 1 << 16
MIN_TOKENS_PER_FORWARD = 1 << 10
CPU_TOKENS_PER_FORWARD = 1 << 13
# Share of the free device memory one forward's activations may take.
ACTIVATION_SHARE = 0.25
# Device memory a PrefixCache leaves free for prefill activations and graph pools.
PREFIX_CACHE_HEADROOM = 4 << 30
# Leading tokens that index a PrefixCache entry (shorter prompts are looked up by scan).
INDEX_TOKENS = 32


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def encode_prompts(model, prompts: Sequence[str] | Sequence[Sequence[int]] | str
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
            # One C-level pass (a tuner passes 128 x 8k ids per call; a Python loop over
            # them costs more than a decode step), then the ids as Python ints.
            try:
                array = np.fromiter(p, dtype=np.int64, count=len(p))
            except (TypeError, ValueError, OverflowError):
                raise VegasError(f"prompt {i}: token ids must be integers") from None
            bad = array[(array < 0) | (array >= vocab)]
            if bad.size:
                raise VegasError(f"prompt {i}: token id {bad[0]} outside the vocabulary "
                                 f"[0, {vocab})")
            ids = array.tolist()
        if not ids:
            raise VegasError(f"prompt {i} is empty; give it at least one token")
        out.append(ids)
    return out


def check_lengths(model, prompt_ids: list[list[int]], max_new_tokens: int) -> None:
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


def _available_host_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class PrefixCache:
    """Copies of prompts' K/V, kept across ``generate`` calls on one model.

    A prompt's K/V do not depend on what is decoded after it (slot p depends on tokens
    0..p only), so a tuner measuring many configurations on the same prompts computes
    them once. A stored prompt serves any prompt that shares a leading part with it:
    the shared slots are copied, the rest computed.

    ``device_bytes``: what the store may take on the model's device; None sizes it at
    the first store from the memory then free, less ``PREFIX_CACHE_HEADROOM`` (so create
    the largest batch's cache first). ``host_bytes``: a second tier in host memory
    (pinned on CUDA) for what does not fit; None takes half the available host memory on
    a GPU machine, nothing on the CPU (where the first tier is host memory already).
    """

    def __init__(self, device_bytes: int | None = None, host_bytes: int | None = None) -> None:
        self.device_bytes, self.host_bytes = device_bytes, host_bytes
        # (ids, their K/V, last_hidden or None)
        self._entries: list[tuple[list[int], PromptCopy, torch.Tensor | None]] = []
        self._index: dict[tuple[int, ...], list[int]] = {}
        self._used = {"device": 0, "host": 0}

    @property
    def nbytes(self) -> int:
        return self._used["device"] + self._used["host"]

    def _candidates(self, ids: list[int]) -> list[int]:
        if len(ids) >= INDEX_TOKENS:
            return self._index.get(tuple(ids[:INDEX_TOKENS]), [])
        return list(range(len(self._entries)))

    def find(self, ids: list[int]) -> tuple[int, PromptCopy | None, torch.Tensor | None]:
        """(m, the copy, last_hidden or None) for the stored prompt sharing the most
        leading tokens (m) with ``ids``; last_hidden only if it is ids' own."""
        best, best_len = None, 0
        for i in self._candidates(ids):
            m = common_prefix(self._entries[i][0], ids)
            if m > best_len:
                best, best_len = i, m
        if best is None:
            return 0, None, None
        stored, copy, last = self._entries[best]
        whole = best_len == len(ids) == len(stored)
        return best_len, copy, (last if whole else None)

    def _tier(self, size: int, device: torch.device) -> str | None:
        if self.device_bytes is None:
            if device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(device)
                self.device_bytes = max(0, free - PREFIX_CACHE_HEADROOM)
            else:
                self.device_bytes = _available_host_bytes() // 2
        if self.host_bytes is None:
            self.host_bytes = _available_host_bytes() // 2 if device.type == "cuda" else 0
        if self._used["device"] + size <= self.device_bytes:
            return "device"
        if self._used["host"] + size <= self.host_bytes:
            return "host"
        return None

    def add(self, ids: list[int], copy: PromptCopy, last: torch.Tensor | None) -> bool:
        """Store a prompt's K/V (``KVCache.prompt_copy``); False when no tier has room or
        a stored prompt already covers it."""
        m, *_ = self.find(ids)
        if m == len(ids):
            return False
        size = copy.nbytes
        tier = self._tier(size, copy.k.device)
        if tier is None:
            return False

        def keep(t: torch.Tensor) -> torch.Tensor:
            if tier == "device":
                return t.clone()
            return t.to("cpu").pin_memory() if t.is_cuda else t.to("cpu", copy=True)

        self._entries.append((list(ids), copy.map(keep), None if last is None else last.clone()))
        if len(ids) >= INDEX_TOKENS:
            self._index.setdefault(tuple(ids[:INDEX_TOKENS]), []).append(len(self._entries) - 1)
        self._used[tier] += size
        return True


def prefill_budget(model) -> tuple[int, int]:
    """-> (rows of one sequence per forward, tokens per forward) for this model's
    attention path: on the fused path as many tokens as keep one forward's activations
    within ``ACTIVATION_SHARE`` of the free device memory (whole prompts where they fit),
    on the reference path small chunks."""
    if not prefill_kernels_enabled():
        return REFERENCE_CHUNK_ROWS, REFERENCE_TOKENS_PER_FORWARD
    if model.device.type != "cuda":
        return CPU_TOKENS_PER_FORWARD, CPU_TOKENS_PER_FORWARD
    c = model.config
    width = (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    # residual, normed input, attention output, q/k/v, gate/up, their product
    per_token = model.dtype.itemsize * (4 * c.hidden_size + width + 3 * c.intermediate_size)
    free, _ = torch.cuda.mem_get_info(model.device)
    tokens = int(ACTIVATION_SHARE * free) // per_token
    tokens = max(MIN_TOKENS_PER_FORWARD, min(MAX_TOKENS_PER_FORWARD, tokens))
    return tokens, tokens


def _runs(starts: list[int], prompt_ids: list[list[int]], todo: list[int]):
    """Consecutive rows needing the same slots [start, n): each run prefills together."""
    run: list[int] = []
    for b in todo:
        if run and (b != run[-1] + 1 or starts[b] != starts[run[0]]
                    or len(prompt_ids[b]) != len(prompt_ids[run[0]])):
            yield run
            run = []
        run.append(b)
    if run:
        yield run


@torch.inference_mode()
def prefill(model, prompt_ids: list[list[int]], cache: KVCache, *,
            chunk: int | None = None, progress: ProgressFn | None = None,
            reuse: PrefixCache | None = None, need_last_hidden: bool = True) -> torch.Tensor:
    """Put the prompts' K/V into the cache's rows and set ``cache.lengths`` to the prompt
    lengths; returns each prompt's last hidden state [B, hidden] (zeros where
    ``need_last_hidden`` is False and nothing computed it).

    Slots that the row already holds (``cache.prompts``) or that ``reuse`` has stored are
    not computed again. The rest runs in forwards of up to ``chunk`` rows per sequence
    (default: ``prefill_budget``), as many sequences of equal remaining work together as
    the token budget allows.
    """
    net, dev = model.net, model.device
    window = model.config.window
    rows_per_chunk, tokens_per_forward = prefill_budget(model)
    rows_per_chunk = chunk or rows_per_chunk
    if cache.forward_rows is not None:
        # A ring holds the window before a chunk and the chunk: chunks of at most its
        # headroom, the same tokens per forward (more sequences together).
        rows_per_chunk = min(rows_per_chunk, cache.forward_rows)
    last_hidden = torch.zeros(len(prompt_ids), model.config.hidden_size, dtype=model.dtype,
                              device=dev)
    starts, hidden_known = [], [False] * len(prompt_ids)
    for b, ids in enumerate(prompt_ids):
        if not ids:  # nothing to compute; its row of last_hidden stays zero
            starts.append(0)
            continue
        held = cache.prompts[b]
        start = common_prefix(held.ids, ids) if held is not None else 0
        if not cache.restore_prompt_tail(b, start):
            start, held = 0, None
        if start < len(ids) and reuse is not None:
            m, stored, last = reuse.find(ids)
            if m > start and cache.take_prompt(b, stored, start, m):
                start = m
                held = PromptSlots(ids[:m], last)
        if start == len(ids) and held.last_hidden is not None and len(held.ids) == len(ids):
            last_hidden[b] = held.last_hidden
            hidden_known[b] = True
        elif start == len(ids) and need_last_hidden:
            start -= 1  # compute the last token again for its hidden state
        starts.append(start)

    todo = [b for b, ids in enumerate(prompt_ids) if starts[b] < len(ids)]
    total, done = sum(len(prompt_ids[b]) - starts[b] for b in todo), 0
    for run in _runs(starts, prompt_ids, todo):
        start, n = starts[run[0]], len(prompt_ids[run[0]])
        rows = min(rows_per_chunk, n - start)
        together = max(1, tokens_per_forward // rows)
        for first in range(0, len(run), together):
            group = run[first : first + together]
            view = cache.rows(group[0], group[-1] + 1)
            tokens = torch.tensor([prompt_ids[b][start:] for b in group], device=dev)
            for lo in range(start, n, rows):
                hi = min(n, lo + rows)
                meta = AttentionMeta.prefill(len(group), lo, hi, dev, window)
                hidden = net(tokens[:, lo - start : hi - start], meta.positions, view, meta)
                done += (hi - lo) * len(group)
                if progress:
                    progress("prefill", done, total)
            last_hidden[group] = hidden[:, -1]

    computed = set(todo)
    for b, ids in enumerate(prompt_ids):
        # The row now holds exactly this prompt: decoding writes right after it.
        known = b in computed or hidden_known[b]
        cache.prompts[b] = PromptSlots(ids, last_hidden[b].clone() if known else None)
        if b in computed:
            cache.save_prompt_tail(b, len(ids))
        if b in computed and reuse is not None:
            reuse.add(ids, cache.prompt_copy(b, len(ids)), last_hidden[b])
    cache.lengths.copy_(torch.tensor([len(p) for p in prompt_ids], device=dev))
    return last_hidden
