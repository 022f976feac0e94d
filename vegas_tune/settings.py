"""A tune's settings (``TuneSettings``, as the CLI or a caller of ``run_tune`` gives them)
and where they put its files by default: the profile under ``profiles/<model>/`` and the
optuna journal beside it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from vegas_core.errors import VegasError
from vegas_tune.hardware import gpu_slug
from vegas_tune.options import TuneOptions
from vegas_tune.spans import DEFAULT_SPAN_TOKENS, SpanLayout


@dataclass
class TuneSettings:
    """Everything one tune runs with: the model and workload, where it writes, and the
    search's ``TuneOptions``."""

    model: str
    ctx: int  # the longest context tuned (the headline's)
    dataset: str
    out: Path | None
    device: str
    dtype: str
    storage: str | None
    study_name: str | None
    resume: bool
    seed: int
    batch_sizes: tuple[int, ...]  # ascending
    max_new_tokens: int
    temperature: float
    num_prompts: int
    options: TuneOptions
    command: str
    new_study: bool = False
    # Long generations (vegas_tune.spans): a trial times this many spans of span_tokens
    # spread over max_new_tokens; 0 decodes every new token from the prompt.
    spans: int = 0
    span_tokens: int = DEFAULT_SPAN_TOKENS
    # Every context to tune (--ctx 4k,16k,32k), ascending, the last ``ctx``; empty: ``ctx``
    # alone.
    contexts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        self.contexts = tuple(sorted(set(self.contexts))) or (self.ctx,)
        if self.contexts[-1] != self.ctx:
            raise VegasError(f"ctx {self.ctx} is not the longest of contexts "
                             f"{list(self.contexts)}; give ctx=max(contexts)")

    @property
    def several_contexts(self) -> bool:
        return len(self.contexts) > 1

    def span_layout(self) -> SpanLayout | None:
        """Where a trial's spans lie in the generation; None without spans."""
        if not self.spans:
            return None
        return SpanLayout(self.max_new_tokens, self.spans, self.span_tokens)


def model_slug(spec: str) -> str:
    """'dummy:qwen3-8b' -> 'dummy-qwen3-8b'; '/m/Qwen3-8B' -> 'qwen3-8b'."""
    name = spec.rstrip("/").split("/")[-1]
    name = re.sub(r"\.gguf$", "", name, flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-") or "model"


def ctx_label(ctx: int) -> str:
    """8192 -> '8k', 2000 -> '2000'."""
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def contexts_label(contexts: tuple[int, ...]) -> str:
    """(4096,) -> '4k'; (4096, 16384, 32768) -> '4k-16k-32k'."""
    return "-".join(map(ctx_label, contexts))


def default_out(settings: TuneSettings, hardware: dict) -> Path:
    """``profiles/<model>/<gpu>-<ctx>.yaml`` (every context, ``4k-16k-32k``, for several)."""
    name = f"{gpu_slug(hardware)}-{contexts_label(settings.contexts)}.yaml"
    return Path("profiles") / model_slug(settings.model) / name


def study_location(settings: TuneSettings, hardware: dict) -> tuple[Path, str, str]:
    """(profile path, storage, study name) with their defaults filled in."""
    out = settings.out or default_out(settings, hardware)
    storage = settings.storage or str(out.with_suffix("")) + ".optuna.journal"
    study_name = (settings.study_name or
                  f"{model_slug(settings.model)}-{gpu_slug(hardware)}-"
                  f"{contexts_label(settings.contexts)}")
    return out, storage, study_name
