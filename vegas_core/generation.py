"""Batched generation: prefill, then one decode loop for vanilla and speculative decoding.

``generate`` builds a decoder, the strategy that turns the batch's last tokens into new
ones (``VanillaDecoder``: one token per sequence per step; ``SpeculativeSession``: drafts
verified in one pass, 1..gamma+1 tokens per sequence per iteration; ``ScheduledDecoder``:
either, as a ``SpecSchedule`` names them while the batch changes), and ``_decode_loop``
drives it: EOS and token limits, progress, timing and statistics are the same for all.

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
from vegas_core.attention import AttentionMeta
from vegas_core.errors import VegasError
from vegas_core.decode_state import DecodeState, decode_capacity
from vegas_core.graphs import StaticForward
from vegas_core.loading import LoadedModel
from vegas_core.prefill import (PrefixCache, ProgressFn, check_lengths, encode_prompts,
                                prefill, sync)
from vegas_core.sampling import SamplingParams, choose_tokens
from vegas_core.schedule import SpecSchedule, config_words
from vegas_core.speculative import SpeculativeSession
from vegas_kernels.split_merge import counters_out_of_phase

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
    # Under a schedule that names several configurations (``generate(spec=SpecSchedule)``):
    # the switches between them, the seconds they took (counted in ``decode_seconds``)
    # and the iterations each configuration ran, by ``config_words`` ("vanilla", ...).
    switches: int = 0
    switch_seconds: float = 0.0
    iterations_by_config: dict[str, int] = field(default_factory=dict)

    @property
    def seconds_per_switch(self) -> float | None:
        """The mean cost of one switch; None without switches."""
        return self.switch_seconds / self.switches if self.switches else None

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
    # Whether the last iteration drafted: its tokens then count for acceptance.
    drafts: bool

    def first_tokens(self) -> list[int]:
        """The token each sequence gets from its prompt (from the prefill)."""
        ...

    def step(self, active: list[bool]) -> list[list[int]]:
        """One iteration; new tokens per sequence (finished ones are computed but keep
        their length). Ends with the results on the host."""
        ...

    def enter(self, histories: list[list[int]]) -> None:
        """Take over a batch that another decoder of the same ``DecodeState`` has been
        decoding; ``histories[b]``: sequence b's tokens, prompt first."""
        ...


class VanillaDecoder:
    """Plain decoding: one forward per step, one token per sequence.

    Prefills ``prompt_ids`` into a cache of its own, or into ``state``'s (a batch shared
    with other decoders) unless that is prefilled already: it then joins the batch."""

    def __init__(self, model: LoadedModel, prompt_ids: list[list[int]], params: SamplingParams,
                 max_new_tokens: int, *, prefill_chunk: int | None,
                 progress: ProgressFn | None, prefix_cache: PrefixCache | None,
                 state: DecodeState | None = None) -> None:
        self.params = params
        self.timers: dict[str, float] = {}
        if state is None:
            state = DecodeState.for_batch(model, prompt_ids,
                                          decode_capacity(prompt_ids, max_new_tokens, 0), 1,
                                          params.seed)
        self.state = state
        self._forward = _vanilla_forward(model, state)
        if not state.prefilled:
            last_hidden = prefill(model, prompt_ids, state.cache, chunk=prefill_chunk,
                                  progress=progress, reuse=prefix_cache)
            with torch.inference_mode():
                state.pending = choose_tokens(model.net.logits(last_hidden), params,
                                              state.generator)

    # A step drafts nothing: its tokens do not count for acceptance.
    drafts = False

    def first_tokens(self) -> list[int]:
        return self.state.pending.tolist()

    def enter(self, histories: list[list[int]]) -> None:
        """Take the batch over from another decoder of its state: a step needs only the
        cache and the pending tokens, which are there."""

    @torch.inference_mode()
    def step(self, active: list[bool]) -> list[list[int]]:
        s = self.state
        mask, active_host = s.active_mask(active)
        # The longest sequence bounds the keys; a finished one keeps its length (its
        # pending slot is rewritten), so that the cache holds what a switch to drafts
        # needs and a long decode stays within its capacity.
        logits = self._forward(s.pending[:, None], s.cache.lengths[:, None],
                               max(s.host_lengths) + 1)
        s.cache.lengths += mask
        for b, live in enumerate(active_host):
            s.host_lengths[b] += live
        s.pending = choose_tokens(logits, self.params, s.generator)
        return [[t] for t in s.pending.tolist()]  # the one sync per step


def _vanilla_forward(model: LoadedModel, state: DecodeState):
    """forward(tokens [B, 1], positions [B, 1], kv_len) -> last-row logits [B, V] on the
    state's cache. Where the kernels serve the step it runs on static buffers (a CUDA
    graph on a GPU) kept in the state's workspace; else eagerly with the host's key
    bound."""
    net, dev, window, cache = model.net, model.device, model.config.window, state.cache
    if state.space is not None:
        batch = cache.batch_size
        forward = state.space.get(("vanilla",), lambda: StaticForward(
            net, cache, batch, 1, lambda pos: AttentionMeta.full(pos, cache.max_len, window),
            all_rows=False, device=dev, pool=state.space.pool))
        return lambda tokens, positions, kv_len: forward(tokens, positions)

    def eager(tokens, positions, kv_len):
        hidden = net(tokens, positions, cache, AttentionMeta.full(positions, kv_len, window))
        return net.logits(hidden[:, -1])

    return eager


class ScheduledDecoder:
    """Decoding that follows a ``SpecSchedule`` as the batch changes.

    Before each iteration the schedule's entry for the sequences still decoding (their
    number, and their mean length: prompt and tokens so far) names the configuration;
    when it changes, the decoder for it (``VanillaDecoder`` or ``SpeculativeSession``)
    takes over. Every decoder works on one ``DecodeState``: one cache, one generator,
    the same pending tokens, so a switch neither prefills again nor changes what is
    sampled. A decoder is made on a configuration's first use and kept, with the static
    buffers and graphs it made in the workspace: a configuration met again captures
    nothing. A speculative decoder taking over selects as after the prefill, from one
    verify-style window over the sequences' last tokens (``SpeculativeSession.enter``).

    ``timers`` sums its decoders' phases, and ``switch``: the seconds switches took.
    """

    def __init__(self, model: LoadedModel, prompt_ids: list[list[int]], schedule: SpecSchedule,
                 params: SamplingParams, max_new_tokens: int, *, prefill_chunk: int | None,
                 progress: ProgressFn | None, prefix_cache: PrefixCache | None) -> None:
        self.model, self.schedule, self.params = model, schedule, params
        self.prompt_ids, self.max_new_tokens = prompt_ids, max_new_tokens
        # One cache for every configuration the schedule may switch to: room for the
        # longest drafts, static steps only where the kernels serve them all.
        gamma = max((e.spec.gamma for e in schedule.entries if e.spec is not None), default=0)
        self.state = DecodeState.for_batch(model, prompt_ids,
                                           decode_capacity(prompt_ids, max_new_tokens, gamma),
                                           gamma + 1, params.seed)
        # Each sequence's tokens, prompt first; the cache holds the first host_lengths[b].
        self.histories = [list(p) for p in prompt_ids]
        self.decoders: dict[SpecConfig | None, Decoder] = {}
        self.switches = 0
        self.iterations_by_config: dict[str, int] = {}
        self.timers = {"draft": 0.0, "verify": 0.0, "selection": 0.0, "switch": 0.0}
        self.spec = schedule.for_batch(len(prompt_ids), self._context(range(len(prompt_ids))))
        self.current = self._decoder(self.spec, prefill_chunk=prefill_chunk, progress=progress,
                                     prefix_cache=prefix_cache)
        self._add_timers(self.current, {})

    @property
    def drafts(self) -> bool:
        return self.current.drafts

    @property
    def configs_used(self) -> list[SpecConfig | None]:
        """The configurations decoded with so far, in order of first use."""
        return list(self.decoders)

    def _context(self, rows) -> int:
        """The mean length of the sequences ``rows``: what the schedule's context means."""
        rows = list(rows)
        return max(1, sum(len(self.histories[b]) for b in rows) // len(rows))

    def _decoder(self, spec: SpecConfig | None, *, prefill_chunk: int | None = None,
                 progress: ProgressFn | None = None,
                 prefix_cache: PrefixCache | None = None) -> Decoder:
        """The decoder for ``spec`` on the batch's state; the first one made prefills."""
        if spec not in self.decoders:
            common = dict(prefill_chunk=prefill_chunk, progress=progress,
                          prefix_cache=prefix_cache, state=self.state)
            self.decoders[spec] = (
                VanillaDecoder(self.model, self.prompt_ids, self.params, self.max_new_tokens,
                               **common) if spec is None else
                SpeculativeSession(self.model, self.prompt_ids, spec, self.params,
                                   self.max_new_tokens, **common))
        return self.decoders[spec]

    def _add_timers(self, decoder: Decoder, before: dict[str, float]) -> None:
        for phase, total in decoder.timers.items():
            self.timers[phase] = self.timers.get(phase, 0.0) + total - before.get(phase, 0.0)

    def first_tokens(self) -> list[int]:
        first = self.current.first_tokens()
        for history, token in zip(self.histories, first):
            history.append(token)
        return first

    def _switch(self, spec: SpecConfig | None) -> None:
        t0 = time.perf_counter()
        decoder = self._decoder(spec)
        decoder.enter(self.histories)
        sync(self.model.device)
        self.timers["switch"] += time.perf_counter() - t0
        self.switches += 1
        self.current, self.spec = decoder, spec

    def step(self, active: list[bool]) -> list[list[int]]:
        live = [b for b, a in enumerate(active) if a]
        spec = self.schedule.for_batch(len(live), self._context(live))
        if spec != self.spec:
            self._switch(spec)
        before = dict(self.current.timers)
        new = self.current.step(active)
        self._add_timers(self.current, before)
        for b in live:  # a finished sequence's tokens are computed, not committed
            self.histories[b].extend(new[b])
        label = config_words(spec)
        self.iterations_by_config[label] = self.iterations_by_config.get(label, 0) + 1
        return new


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
            counted = warm and decoder.drafts  # acceptance: over drafting iterations only
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
                if not counted:
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
    with its drafter, losslessly; a ``SpecSchedule`` (a tuned profile's) is followed
    while decoding: before each iteration, its entry for the sequences still decoding
    (their number and mean length) picks the configuration (``ScheduledDecoder``; one
    whose entries up to ``len(prompts)`` name one configuration decodes as that
    configuration). Greedy when ``temperature`` is 0;
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
    schedule = None
    if isinstance(spec, SpecSchedule):
        # A schedule whose entries within the batch's size name one configuration
        # decodes like that configuration; otherwise it is followed as the batch shrinks
        # and its contexts grow.
        configs = spec.configs_for(len(prompt_ids))
        schedule, spec = (None, configs[0]) if len(configs) == 1 else (spec, None)
    dev = model.device
    eos = set() if ignore_eos or model.tokenizer is None else set(model.tokenizer.eos_token_ids)

    sync(dev)
    t0 = time.perf_counter()
    if schedule is not None:
        decoder = ScheduledDecoder(model, prompt_ids, schedule, params, max_new_tokens,
                                   prefill_chunk=prefill_chunk, progress=progress,
                                   prefix_cache=prefix_cache)
    elif spec is None:
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
    stuck = counters_out_of_phase(dev)
    if stuck:
        raise VegasError(
            f"{stuck} merge counter(s) of the attention kernels were left out of phase by "
            "this call: some attention outputs were merged from incomplete partials, so "
            "its tokens and statistics cannot be trusted (a fault of the engine's "
            "attention kernels). The counters are reset: run again, and "
            "report it if it repeats")

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
    drafting = [spec] if spec is not None else []
    if isinstance(decoder, ScheduledDecoder):
        common.update(switches=decoder.switches, switch_seconds=decoder.timers["switch"],
                      iterations_by_config=dict(decoder.iterations_by_config))
        drafting = [c for c in decoder.configs_used if c is not None]
    if not drafting:
        stats: GenerationStats = GenerationStats(**common)
    else:
        # Acceptance is counted over the drafting iterations, by draft position up to
        # the longest drafts decoded with.
        gamma = max(c.gamma for c in drafting)
        phases = {k: v - prefill_timers.get(k, 0.0) for k, v in decoder.timers.items()}
        accepted = rec.accepted_at + [0] * (gamma - len(rec.accepted_at))
        by_position = [a / max(rec.rounds, 1) for a in accepted]
        stats = SpeculativeStats(
            **common,
            gamma=gamma,
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
