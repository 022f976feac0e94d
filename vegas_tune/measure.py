"""Run one configuration on a workload and return its metrics.

Throughput is the steady-state rate (``GenerationStats.steady_*``): decode tokens over
the iterations in which every sequence of the batch is still decoding, as in a server
whose finished sequences are replaced at once; ``bench/end_to_end.py`` reports the same
figure. A measurement stops decoding when that window ends (``stop_after_steady``): the
tail, where finished sequences idle while the slowest go on, is most of a large
speculative batch's iterations and is not part of the figure (SmolLM2 8k at batch 256,
gamma 12, on an H100: 9 steady iterations of 40). The prompts' K/V are computed once per tune: the model's kept cache remembers
which prompt each row holds, and a ``PrefixCache`` keeps copies when the workload has
more batches than one.

A long-generation workload (``vegas_tune.spans``) is the same loop over span contexts
(each a prompt and the start of its reference output) with ``warmup_iterations``: what
is timed and counted begins after them.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import torch

from vegas_core import SpecConfig, generate
from vegas_core.graphs import forget_kept_graphs, release_workspace, static_steps
from vegas_core.loading import LoadedModel
from vegas_core.prefill import PrefixCache
from vegas_tune.datasets import Prompt
from vegas_tune.stats import Estimate, estimate

log = logging.getLogger("vegas_tune")

# What PyTorch's CPU allocator says when an allocation fails (a RuntimeError, where a GPU
# raises torch.OutOfMemoryError).
CPU_OUT_OF_MEMORY_MESSAGES = ("can't allocate memory", "DefaultCPUAllocator: not enough memory")


def out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that did not fit: the GPU's
    ``torch.OutOfMemoryError``, Python's ``MemoryError``, or the CPU allocator's
    ``RuntimeError``."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(
        message in str(error) for message in CPU_OUT_OF_MEMORY_MESSAGES)


def out_of_memory_words(error: BaseException) -> str:
    """The first line of an out-of-memory error (the allocator's request and what was
    free), for a trial's or a grid point's record."""
    return str(error).splitlines()[0] if str(error) else type(error).__name__


@dataclass
class Workload:
    prompts: list[Prompt]
    batch_size: int
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    # Iterations decoded before iterations are timed and counted (spans).
    warmup_iterations: int = 0
    # The most positions a sequence of the workload reaches; None: the longest prompt
    # and max_new_tokens. A span workload stands for whole generations: prompt + all
    # their new tokens.
    positions: int | None = None

    @property
    def longest_sequence(self) -> int:
        if self.positions is not None:
            return self.positions
        return max(len(p.ids) for p in self.prompts) + self.max_new_tokens

    def batches(self) -> list[list[list[int]]]:
        """Full batches only: the prompts in order, wrapped around to fill the last
        batch (a batch of another size would need its own cache and CUDA graphs)."""
        ids = [p.ids for p in self.prompts]
        count = -(-len(ids) // self.batch_size) * self.batch_size
        ids = [ids[i % len(ids)] for i in range(count)]
        return [ids[i : i + self.batch_size] for i in range(0, count, self.batch_size)]


@dataclass
class Measurement:
    """Metrics of one configuration over the whole workload.

    tokens_per_second: steady-state decode tokens / seconds (see the module docstring),
    summed over batches; ``decode_*`` and ``iterations`` count every iteration decoded
    (those that captured CUDA graphs, the steady ones), and acceptance is over them. Step
    costs are per forward (draft, verify, vanilla decode) or per iteration (selection),
    over the steady iterations. wall_seconds: the whole measurement (prefill, decode,
    set-up); prefill_seconds: the part spent getting prompts into the cache.
    """

    tokens_per_second: float
    decode_seconds: float
    decode_tokens: int
    steady_seconds: float
    steady_tokens: int
    iterations: int
    steady_iterations: int
    prefill_seconds: float
    wall_seconds: float
    mean_accepted_length: float
    acceptance_by_position: list[float]
    selection_overhead: float
    draft_step_seconds: float
    verify_step_seconds: float
    selection_step_seconds: float
    decode_step_seconds: float

    def as_attrs(self) -> dict:
        return asdict(self)

    @classmethod
    def average(cls, rounds: list[Measurement]) -> Measurement:
        """One measurement from repeated ones: every rate and cost is the mean over the
        rounds (lists element by element), every count and time the total."""
        summed = ("decode_seconds", "decode_tokens", "steady_seconds", "steady_tokens",
                  "iterations", "steady_iterations", "prefill_seconds", "wall_seconds")
        values = {}
        for f in fields(cls):
            column = [getattr(m, f.name) for m in rounds]
            if f.name in summed:
                values[f.name] = sum(column)
            elif isinstance(column[0], list):
                values[f.name] = [statistics.fmean(items) for items in zip(*column)]
            else:
                values[f.name] = statistics.fmean(column)
        return cls(**values)


# report(batch_index, running tokens/s) after each batch; it may raise to stop early.
BatchReport = Callable[[int, float], None]


def _ratio(a: float, b: float) -> float:
    return a / b if b else 0.0


class Measurer:
    """Measures configurations of one model on one workload, reusing prompt K/V."""

    def __init__(self, model: LoadedModel, workload: Workload) -> None:
        self.model, self.workload = model, workload
        # A kept cache (static decode steps: GPUs) holds one batch's prompts between
        # calls; copies serve other batches, and every call where nothing is kept.
        kept = static_steps(model.device)
        self.prefix_cache = PrefixCache() if len(workload.batches()) > 1 or not kept else None
        self._warned_short = False

    def release(self) -> None:
        """Free what this workload keeps between measurements: its prompts' K/V copies
        and the model's kept cache and graphs. A later measurement computes them again."""
        if self.prefix_cache is not None:
            self.prefix_cache = PrefixCache()
        release_workspace(self.model.net)

    def forget_kept_graphs(self) -> bool:
        """Free the graphs and static buffers kept for configurations measured before
        (each gamma and budget keeps its own); the prompts' K/V stay. False when none
        were kept."""
        return forget_kept_graphs(self.model.net)

    def measure_freeing_graphs(self, spec: SpecConfig | None) -> Measurement:
        """``measure``, run once more after ``forget_kept_graphs`` when it runs out of
        memory: where the cache fills most of the GPU, the graphs kept for the
        configurations measured before (one set per gamma and budget) are what a new one
        lacks room for. Out of memory again (or with nothing to free), the error stands."""
        try:
            return self.measure(spec)
        except (RuntimeError, MemoryError) as e:
            if not out_of_memory(e) or not self.forget_kept_graphs():
                raise
        # Out of the handler, the failed attempt's traceback no longer holds its frames:
        # what it allocated, and any cycle around it, can be freed before the retry.
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        log.info("out of memory: freed the graphs kept for earlier configurations, "
                 "measuring again")
        return self.measure(spec)

    def measure(self, spec: SpecConfig | None, report: BatchReport | None = None) -> Measurement:
        w = self.workload
        start = time.perf_counter()
        tokens = steady_tokens = iterations = steady_iterations = rounds = 0
        seconds = steady_seconds = prefill_seconds = 0.0
        phases = {"draft": 0.0, "verify": 0.0, "selection": 0.0}  # steady iterations
        totals = dict(phases)  # every iteration
        accepted = [0.0] * (spec.gamma if spec else 0)
        for i, batch in enumerate(w.batches()):
            s = generate(self.model, batch, w.max_new_tokens, spec=spec,
                         temperature=w.temperature, seed=w.seed + i, ignore_eos=True,
                         prefix_cache=self.prefix_cache, stop_after_steady=True,
                         warmup_iterations=w.warmup_iterations).stats
            tokens += s.decode_tokens
            seconds += s.decode_seconds
            prefill_seconds += s.prefill_seconds
            iterations += s.iterations
            steady_tokens += s.steady_tokens
            steady_seconds += s.steady_seconds
            steady_iterations += s.steady_iterations
            if spec is not None:
                for phase in phases:
                    phases[phase] += s.steady_phase_seconds.get(phase, 0.0)
                    totals[phase] += getattr(s, f"{phase}_seconds")
                rounds += s.sequence_rounds
                accepted = [a + r * s.sequence_rounds
                            for a, r in zip(accepted, s.acceptance_by_position)]
            if report:
                report(i, _ratio(steady_tokens or tokens, steady_seconds or seconds))
        if not steady_seconds and not self._warned_short:
            self._warned_short = True
            log.warning("no steady decode iteration (raise --max-new-tokens): reporting "
                        "the rate of every iteration, the batch decoded to completion")
        by_position = [a / rounds for a in accepted] if rounds else []
        gamma = spec.gamma if spec else 0
        if steady_seconds:
            costs, steps, timed, produced = phases, steady_iterations, steady_seconds, steady_tokens
        else:  # a workload too short for a steady window: every iteration
            costs, steps, timed, produced = totals, iterations, seconds, tokens
        return Measurement(
            tokens_per_second=_ratio(produced, timed),
            decode_seconds=seconds,
            decode_tokens=tokens,
            steady_seconds=steady_seconds,
            steady_tokens=steady_tokens,
            iterations=iterations,
            steady_iterations=steady_iterations,
            prefill_seconds=prefill_seconds,
            wall_seconds=time.perf_counter() - start,
            mean_accepted_length=1.0 + sum(by_position),
            acceptance_by_position=by_position,
            selection_overhead=_ratio(totals["selection"], seconds),
            draft_step_seconds=_ratio(costs["draft"], steps * gamma),
            verify_step_seconds=_ratio(costs["verify"], steps),
            selection_step_seconds=_ratio(costs["selection"], steps),
            decode_step_seconds=_ratio(timed, steps) if spec is None else 0.0,
        )


# after_round(rounds done, samples so far by name) -> True to stop.
RoundCheck = Callable[[int, dict[str, list[Measurement]]], bool]


def interleave(measurer: Measurer, configs: dict[str, SpecConfig | None], max_rounds: int,
               after_round: RoundCheck) -> dict[str, list[Measurement]]:
    """Measure every configuration once per round until ``after_round`` says stop or
    ``max_rounds`` are done. Configurations compared with each other are measured side
    by side, so a machine that slows down (another job, a warm-up, thermal throttling)
    slows them alike; the order rotates each round so that no position is favoured."""
    every = set(configs)
    return race(measurer, configs, max_rounds,
                lambda done, samples: set() if after_round(done, samples) else every)


# decide(rounds done, samples so far by name) -> the names to measure in the next round;
# empty to stop.
RaceDecision = Callable[[int, dict[str, list[Measurement]]], set[str]]


def race(measurer: Measurer, configs: dict[str, SpecConfig | None], max_rounds: int,
         decide: RaceDecision) -> dict[str, list[Measurement]]:
    """``interleave`` for configurations that drop out: each round measures the names
    ``decide`` kept after the last one (every name in the first round), in rotating order,
    until it keeps none or ``max_rounds`` are done. A dropped configuration keeps the
    rounds it had, which are the first rounds of the race."""
    names = list(configs)
    samples: dict[str, list[Measurement]] = {name: [] for name in names}
    live = list(names)
    for done in range(1, max_rounds + 1):
        first = (done - 1) % len(live)
        for name in live[first:] + live[:first]:
            samples[name].append(measurer.measure_freeing_graphs(configs[name]))
        keep = decide(done, samples)
        live = [name for name in names if name in keep]
        if not live:
            break
    return samples


def ratio_estimate(numerators: list[Measurement], denominators: list[Measurement]) -> Estimate:
    """The interval of per-round throughput ratios (e.g. the speedup over vanilla)."""
    return estimate([n.tokens_per_second / d.tokens_per_second if d.tokens_per_second else 0.0
                     for n, d in zip(numerators, denominators)])


def series_attrs(config: list[Measurement], vanilla: list[Measurement]) -> dict:
    """A configuration's rounds beside vanilla's, as plain data: its averaged metrics,
    mean and interval of its throughput, of vanilla's and of the speedup, and each
    round's throughputs (``round_*``), so the noise behind an interval can be seen."""
    return {**Measurement.average(config).as_attrs(),
            **estimate([m.tokens_per_second for m in config]).attrs("tokens_per_second"),
            **estimate([m.tokens_per_second for m in vanilla]).attrs("vanilla_tokens_per_second"),
            **ratio_estimate(config, vanilla).attrs("speedup"),
            "rounds": len(config),
            "round_tokens_per_second": [round(m.tokens_per_second, 3) for m in config],
            "round_vanilla_tokens_per_second": [round(m.tokens_per_second, 3) for m in vanilla]}
