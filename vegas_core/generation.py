"""Batched generation: prefill, then one decode loop for vanilla and speculative decoding.

``generate`` builds a decoder, the strategy that turns the batch's last tokens into new
ones (``VanillaDecoder``: one token per sequence per step; ``SpeculativeSession``: drafts
verified in one pass, 1..gamma+1 tokens per sequence per iteration), and ``_decode_loop``
drives it: EOS and token limits, progress, timing and statistics are the same for both.

Steady-state throughput. A serving engine keeps its batch full: a finished sequence's
slot takes the next request. A batch decoded to completion is not full at its end
(sequences that finished early idle while the slowest ones go on), and its first
iteration pays for one-off work (CUDA graph capture). ``GenerationStats.steady_*``
therefore count only the *steady iterations*: those that start with every sequence of
the batch still decoding and capture no graph; tokens are counted as produced, before a
token limit cuts them. ``tokens_per_second`` keeps the batch-to-completion rate.
``stop_after_steady`` ends the decode with the steady window: what a steady-state
measurement needs, without the tail (most of the iterations of a large speculative batch).
``warmup_iterations`` starts the window late: the first iterations count neither for
throughput nor for acceptance, so that a span decoded from a context deep into a long
generation (``vegas_tune.spans``) is measured once its selections come from verify passes
at that depth (the first comes from the prefill).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from vegas_core import graphs
from vegas_core.attention import AttentionMeta, kernels_serve_model
from vegas_core.errors import VegasError
from vegas_core.graphs import StaticForward, workspace
from vegas_core.loading import LoadedModel
from vegas_core.prefill import (PrefixCache, ProgressFn, check_lengths, encode_prompts,
                                prefill, sync)
from vegas_core.sampling import SamplingParams, choose_tokens
from vegas_core.schedule import SpecSchedule
from vegas_core.speculative import SpeculativeSession

if TYPE_CHECKING:
    from vegas_core.spec_config import SpecConfig


@dataclass
class GenerationStats:
    prompt_tokens: list[int]
    new_tokens: list[int]
    prefill_seconds: float
    decode_seconds: float
    decode_tokens: int  # tokens produced by decode forwards (the first comes from prefill)
    # Decode steps (vanilla) or speculative iterations.
    iterations: int = 0
    # The steady iterations (see the module docstring), their tokens and seconds.
    steady_iterations: int = 0
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_second(self) -> float:
        """Batch-to-completion decode throughput over the batch, prefill excluded."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    @property
    def steady_tokens_per_second(self) -> float | None:
        """Throughput while the whole batch decodes; None when no iteration qualified."""
        return self.steady_tokens / self.steady_seconds if self.steady_seconds > 0 else None


@dataclass
class SpeculativeStats(GenerationStats):
    gamma: int = 0
    # 1 + accepted drafts per (sequence, iteration), bonus token included.
    mean_accepted_length: float = 0.0
    # acceptance_by_position[i-1]: rate at which draft position i was accepted.
    acceptance_by_position: list[float] = field(default_factory=list)
    # (sequence, iteration) pairs in which a sequence was still generating.
    sequence_rounds: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    selection_seconds: float = 0.0
    # The same phases over the steady iterations only.
    steady_phase_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def selection_overhead(self) -> float:
        """Selection time / decode time."""
        return self.selection_seconds / self.decode_seconds if self.decode_seconds > 0 else 0.0


@dataclass
class GenerationResult:
    tokens: list[list[int]]  # new token ids per prompt, EOS included if produced
    texts: list[str] | None  # decoded new text per prompt (None without a tokenizer)
    stats: GenerationStats


class Decoder(Protocol):
    """One decoding strategy over a prefilled batch."""

    # Seconds per phase so far (e.g. draft, verify, selection); may stay empty.
    timers: dict[str, float]

    def first_tokens(self) -> list[int]:
        """The token each sequence gets from its prompt (from the prefill)."""
        ...

    def step(self, active: list[bool]) -> list[list[int]]:
        """One iteration; new tokens per sequence (finished ones are computed but keep
        their length). Ends with the results on the host."""
        ...


class VanillaDecoder:
    """Plain decoding: one forward per step, one token per sequence."""

    def __init__(self, model: LoadedModel, prompt_ids: list[list[int]], params: SamplingParams,
                 max_new_tokens: int, *, prefill_chunk: int | None,
                 progress: ProgressFn | None, prefix_cache: PrefixCache | None) -> None:
        self.params = params
        self.timers: dict[str, float] = {}
        batch = len(prompt_ids)
        self.cache, self._forward = _decode_setup(
            model, batch, max(len(p) for p in prompt_ids) + max_new_tokens)
        self.generator = torch.Generator(device=model.device).manual_seed(params.seed)
        last_hidden = prefill(model, prompt_ids, self.cache, chunk=prefill_chunk,
                              progress=progress, reuse=prefix_cache)
        with torch.inference_mode():
            self.next = choose_tokens(model.net.logits(last_hidden), params, self.generator)
        self.host_len = max(len(p) for p in prompt_ids)  # longest sequence: the key bound

    def first_tokens(self) -> list[int]:
        return self.next.tolist()

    @torch.inference_mode()
    def step(self, active: list[bool]) -> list[list[int]]:
        self.host_len += 1
        logits = self._forward(self.next[:, None], self.cache.lengths[:, None], self.host_len)
        self.cache.lengths += 1
        self.next = choose_tokens(logits, self.params, self.generator)
        return [[t] for t in self.next.tolist()]  # the one sync per step


def _decode_setup(model: LoadedModel, batch: int, capacity: int):
    """-> (cache, forward): forward(tokens [B, 1], positions [B, 1], kv_len) -> last-row
    logits [B, V]. Where the kernels serve the step it runs on static buffers (a CUDA
    graph on a GPU) kept in the model's workspace; else eagerly with the host's key bound."""
    net, dev, window = model.net, model.device, model.config.window
    space = workspace(net, batch, capacity, dev) if kernels_serve_model(
        model.config, dev, 1) else None
    if space is not None:
        cache = space.cache
        forward = space.get(("vanilla",), lambda: StaticForward(
            net, cache, batch, 1, lambda pos: AttentionMeta.full(pos, cache.max_len, window),
            all_rows=False, device=dev, pool=space.pool))
        return cache, lambda tokens, positions, kv_len: forward(tokens, positions)
    cache = net.new_cache(batch, capacity)

    def eager(tokens, positions, kv_len):
        hidden = net(tokens, positions, cache, AttentionMeta.full(positions, kv_len, window))
        return net.logits(hidden[:, -1])

    return cache, eager


@dataclass
class _LoopRecord:
    out: list[list[int]]
    iterations: int = 0
    # (sequence, iteration) pairs of still-generating sequences; drafts accepted at each
    # draft position over them.
    rounds: int = 0
    accepted_at: list[int] = field(default_factory=list)
    steady_iterations: int = 0
    steady_tokens: int = 0
    steady_seconds: float = 0.0
    steady_phases: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the loop: a full collection walks every
    object the process holds (a loaded tokenizer, long prompts: over 100 ms on a slow
    host) and would land in one iteration's time. The loop's own garbage is freed by
    reference counting; cycles are collected once it ends."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _decode_loop(decoder: Decoder, batch: int, max_new_tokens: int, eos: set[int],
                 progress: ProgressFn | None, stop_after_steady: bool = False,
                 warmup_iterations: int = 0) -> _LoopRecord:
    """Run ``decoder`` until every sequence has hit EOS or ``max_new_tokens``; with
    ``stop_after_steady``, as soon as one has after at least one steady iteration.
    The first ``warmup_iterations`` iterations are decoded but neither timed as steady
    nor counted for acceptance."""
    rec = _LoopRecord(out=[[] for _ in range(batch)])
    done = [False] * batch

    def take(i: int, new: list[int]) -> None:
        for tok in new:
            rec.out[i].append(tok)
            if tok in eos or len(rec.out[i]) >= max_new_tokens:
                done[i] = True
                return

    with _gc_paused():
        for i, tok in enumerate(decoder.first_tokens()):
            take(i, [tok])
        while not all(done):
            warm = rec.iterations >= warmup_iterations
            full = not any(done)
            captures = graphs.capture_count()
            phases = dict(decoder.timers)
            t0 = time.perf_counter()
            new = decoder.step([not d for d in done])
            seconds = time.perf_counter() - t0
            rec.iterations += 1
            if full and warm and graphs.capture_count() == captures:
                rec.steady_iterations += 1
                rec.steady_tokens += sum(len(n) for n in new)
                rec.steady_seconds += seconds
                for phase, total in decoder.timers.items():
                    rec.steady_phases[phase] = (rec.steady_phases.get(phase, 0.0)
                                                + total - phases.get(phase, 0.0))
            for i in range(batch):
                if done[i]:
                    continue
                if not warm:
                    take(i, new[i])
                    continue
                rec.rounds += 1
                drafted = len(new[i]) - 1  # accepted drafts; the last token is the bonus
                rec.accepted_at.extend([0] * (drafted - len(rec.accepted_at)))
                for p in range(drafted):
                    rec.accepted_at[p] += 1
                take(i, new[i])
            if progress:
                progress("decode", min(len(o) for o in rec.out), max_new_tokens)
            if stop_after_steady and rec.steady_iterations and any(done):
                break
    return rec


def generate(
    model: LoadedModel,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    *,
    spec: "SpecConfig | SpecSchedule | None" = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    ignore_eos: bool = False,
    prefill_chunk: int | None = None,
    progress: ProgressFn | None = None,
    prefix_cache: PrefixCache | None = None,
    stop_after_steady: bool = False,
    warmup_iterations: int = 0,
) -> GenerationResult:
    """Generate up to ``max_new_tokens`` per prompt.

    ``spec=None`` decodes plainly (vanilla); a ``SpecConfig`` decodes self-speculatively
    with its drafter, losslessly; a ``SpecSchedule`` (a tuned profile's) decodes with its
    entry for the batch size, ``len(prompts)``. Greedy when ``temperature`` is 0;
    otherwise sampling after top-k and top-p with a generator seeded by ``seed``. A
    sequence stops at its first EOS token unless ``ignore_eos``; the batch stops when
    all have.
    ``prefill_chunk``: rows of one prompt per prefill forward (default: whole prompts
    where memory allows). ``prefix_cache`` reuses prompt K/V across calls (see
    ``PrefixCache``; a model's kept cache also remembers its rows' prompts).
    ``stop_after_steady``: end the decode when the steady window does (the first
    sequence finishes), once it has at least one steady iteration; sequences then hold
    fewer tokens than they would have, and the statistics cover what was decoded.
    ``warmup_iterations``: the steady window and the acceptance statistics begin after
    this many iterations (the output is the same).
    """
    params = SamplingParams(temperature, top_p, top_k, seed)
    if prefill_chunk is not None and prefill_chunk < 1:
        raise VegasError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    if warmup_iterations < 0:
        raise VegasError(f"warmup_iterations must be >= 0, got {warmup_iterations}")
    prompt_ids = encode_prompts(model, prompts)
    check_lengths(model, prompt_ids, max_new_tokens)
    if isinstance(spec, SpecSchedule):
        spec = spec.for_batch(len(prompt_ids))
    dev = model.device
    eos = set() if ignore_eos or model.tokenizer is None else set(model.tokenizer.eos_token_ids)

    sync(dev)
    t0 = time.perf_counter()
    if spec is None:
        decoder = VanillaDecoder(model, prompt_ids, params, max_new_tokens,
                                 prefill_chunk=prefill_chunk, progress=progress,
                                 prefix_cache=prefix_cache)
    else:
        decoder = SpeculativeSession(model, prompt_ids, spec, params, max_new_tokens,
                                     prefill_chunk=prefill_chunk, progress=progress,
                                     prefix_cache=prefix_cache)
    prefill_timers = dict(decoder.timers)
    sync(dev)
    t1 = time.perf_counter()
    rec = _decode_loop(decoder, len(prompt_ids), max_new_tokens, eos, progress,
                       stop_after_steady, warmup_iterations)
    sync(dev)
    t2 = time.perf_counter()

    out = rec.out
    common = dict(
        prompt_tokens=[len(p) for p in prompt_ids],
        new_tokens=[len(o) for o in out],
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        decode_tokens=sum(len(o) - 1 for o in out),
        iterations=rec.iterations,
        steady_iterations=rec.steady_iterations,
        steady_tokens=rec.steady_tokens,
        steady_seconds=rec.steady_seconds,
    )
    if spec is None:
        stats: GenerationStats = GenerationStats(**common)
    else:
        phases = {k: v - prefill_timers.get(k, 0.0) for k, v in decoder.timers.items()}
        accepted = rec.accepted_at + [0] * (spec.gamma - len(rec.accepted_at))
        by_position = [a / max(rec.rounds, 1) for a in accepted]
        stats = SpeculativeStats(
            **common,
            gamma=spec.gamma,
            mean_accepted_length=1.0 + sum(by_position),
            acceptance_by_position=by_position,
            sequence_rounds=rec.rounds,
            draft_seconds=phases["draft"],
            verify_seconds=phases["verify"],
            selection_seconds=phases["selection"],
            steady_phase_seconds=rec.steady_phases,
        )
    texts = [model.tokenizer.decode(ids) for ids in out] if model.tokenizer else None
    return GenerationResult(out, texts, stats)
