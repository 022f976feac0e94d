"""Run one configuration on a workload and return its metrics."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

from vegas_core import SpecConfig, generate
from vegas_core.generation import PrefixCache
from vegas_core.graphs import static_steps
from vegas_core.loading import LoadedModel
from vegas_tune.datasets import Prompt

# Prompt K/V kept for reuse across trials (see vegas_core.generation.PrefixCache).
DEFAULT_PREFIX_CACHE_BYTES = 4 << 30


@dataclass
class Workload:
    prompts: list[Prompt]
    batch_size: int
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0

    def batches(self) -> list[list[list[int]]]:
        ids = [p.ids for p in self.prompts]
        return [ids[i : i + self.batch_size] for i in range(0, len(ids), self.batch_size)]


@dataclass
class Measurement:
    """Metrics of one configuration over the whole workload.

    tokens_per_second: generated tokens / decode seconds (prefill excluded), summed over
    batches. Step costs are per forward (draft, verify, vanilla decode) or per iteration
    (selection), averaged over the workload.
    """

    tokens_per_second: float
    decode_seconds: float
    decode_tokens: int
    mean_accepted_length: float
    acceptance_by_position: list[float]
    selection_overhead: float
    draft_step_seconds: float
    verify_step_seconds: float
    selection_step_seconds: float
    decode_step_seconds: float

    def as_attrs(self) -> dict:
        return asdict(self)


# report(batch_index, running tokens/s) after each batch; it may raise to stop early.
BatchReport = Callable[[int, float], None]


class Measurer:
    """Measures configurations of one model on one workload, reusing prompt K/V."""

    def __init__(self, model: LoadedModel, workload: Workload,
                 prefix_cache_bytes: int = DEFAULT_PREFIX_CACHE_BYTES) -> None:
        self.model, self.workload = model, workload
        self.prefix_cache = PrefixCache(prefix_cache_bytes)

    def measure(self, spec: SpecConfig | None, report: BatchReport | None = None) -> Measurement:
        w = self.workload
        tokens = 0
        seconds = sel = draft = verify = 0.0
        draft_steps = verify_steps = vanilla_steps = rounds = 0
        accepted = [0.0] * (spec.gamma if spec else 0)
        if static_steps(self.model.device):
            # Untimed: captures this configuration's CUDA graphs (kept for later calls),
            # so that no measured run pays for a capture.
            generate(self.model, next(iter(w.batches())), w.max_new_tokens, spec=spec,
                     temperature=w.temperature, seed=w.seed, ignore_eos=True,
                     prefix_cache=self.prefix_cache)
        for i, batch in enumerate(w.batches()):
            out = generate(self.model, batch, w.max_new_tokens, spec=spec,
                           temperature=w.temperature, seed=w.seed + i, ignore_eos=True,
                           prefix_cache=self.prefix_cache)
            s = out.stats
            tokens += s.decode_tokens
            seconds += s.decode_seconds
            if spec is None:
                vanilla_steps += max(s.new_tokens) - 1
            else:
                sel += s.selection_seconds
                draft += s.draft_seconds
                verify += s.verify_seconds
                draft_steps += s.iterations * spec.gamma
                verify_steps += s.iterations
                rounds += s.sequence_rounds
                accepted = [a + r * s.sequence_rounds
                            for a, r in zip(accepted, s.acceptance_by_position)]
            if report:
                report(i, tokens / seconds if seconds else 0.0)
        by_position = [a / rounds for a in accepted] if rounds else []
        return Measurement(
            tokens_per_second=tokens / seconds if seconds else 0.0,
            decode_seconds=seconds,
            decode_tokens=tokens,
            mean_accepted_length=1.0 + sum(by_position),
            acceptance_by_position=by_position,
            selection_overhead=sel / seconds if seconds else 0.0,
            draft_step_seconds=draft / draft_steps if draft_steps else 0.0,
            verify_step_seconds=verify / verify_steps if verify_steps else 0.0,
            selection_step_seconds=sel / verify_steps if verify_steps else 0.0,
            decode_step_seconds=seconds / vanilla_steps if vanilla_steps else 0.0,
        )
