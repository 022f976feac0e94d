"""Why a drafter's keys accept what they accept: the share of the draft query's true
attention mass that its selected slots hold.

For every draft step of a speculative decode, in every layer that drafts from a
selection (a hybrid model's sliding layers read their whole window and are skipped), the
draft query's full causal attention is computed by the PyTorch reference beside the
draft's own, and the probability mass on the slots the draft attends to is recorded:
``captured`` (1 would make the draft's attention exact), and the mass it misses in
three bands of the prefix: the 16 sink slots, the ``RECENT_BAND`` prefix slots just
before the tail, and the far rest; ``tail`` is the mass on the slots written since the
selection, which every drafter attends to. Each configuration decodes its own
iterations (greedy: the same tokens), so its mean accepted length comes beside.

Runs on the reference path (the probe wraps ``vegas_core.attention._reference``):

    python bench/key_recall.py --model gemma3-270m --ctx 2048 --datasets code prose \
        retrieval --configs vegas:score=weight streaming oracle --out runs/key-recall
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vegas_core import SpecConfig, VegasError, generate, load_model  # noqa: E402
from vegas_core import attention as attention_module  # noqa: E402
from vegas_core.attention import ATTENTION_ENV, reference_attention  # noqa: E402
from vegas_core.prefill import PrefixCache  # noqa: E402
from vegas_core.selection import STREAMING_SINKS  # noqa: E402
from vegas_tune.datasets import embedded_prompts  # noqa: E402
from bench.acceptance import hardware, with_ext, write_atomic  # noqa: E402
from bench.bench_args import add_model_args, add_output_args  # noqa: E402
from bench.spec_options import parse_config  # noqa: E402

# The prefix slots just before the tail that count as "recent": about the window a
# sink-and-recent draft keeps at the budgets measured here (5% of 2-8k slots).
RECENT_BAND = 128
BANDS = ("sink", "recent", "far")
# What is recorded per layer: the captured mass, the missed mass per band, the tail's mass.
# output_error: |draft's attention output - the true one| / |the true one|, per head.
MEASURES = ("captured", *(f"missed_{band}" for band in BANDS), "tail", "output_error")


class RecallProbe:
    """Records, per selecting layer, the mean share of each draft query's full attention
    mass on the slots its draft attends to (sums and a row count; ``means``)."""

    def __init__(self) -> None:
        self.sums: dict[int, dict[str, float]] = defaultdict(lambda: dict.fromkeys(MEASURES, 0.0))
        self.rows: dict[int, int] = defaultdict(int)

    @contextlib.contextmanager
    def installed(self):
        """Wraps the reference attention for the duration: every draft forward on it is
        measured (the kernels are turned off, so that every forward runs there)."""
        original = attention_module._reference
        previous = os.environ.get(ATTENTION_ENV)

        def probed(q, k, v, layer, meta, sinks=None):
            out = original(q, k, v, layer, meta, sinks)
            if meta.mode == "draft" and not meta.drafts_whole_window(layer):
                self.record(q, k, v, layer, meta, sinks, out)
            return out

        attention_module._reference = probed
        os.environ[ATTENTION_ENV] = "reference"
        try:
            yield self
        finally:
            attention_module._reference = original
            if previous is None:
                os.environ.pop(ATTENTION_ENV, None)
            else:
                os.environ[ATTENTION_ENV] = previous

    def record(self, q, k, v, layer: int, meta, sinks, drafted_out: torch.Tensor) -> None:
        grabbed = {}
        full = meta.causal_mask(layer)[:, None, None]  # [B, 1, 1, T, S]
        true_out = reference_attention(q, k, v, full, lambda s, p, m: grabbed.update(p=p),
                                       sinks)  # [B, T, H, D]
        error = (drafted_out - true_out).float().norm(dim=-1) / true_out.float().norm(dim=-1)
        probs = grabbed["p"]  # [B, H_kv, group, T, S]: the true attention
        drafted = meta.mask(layer, q, k)  # [B, G, 1, T, S]: what the draft reads
        slots = torch.arange(meta.kv_len, device=q.device)
        tail_start = meta.sparse.tail_start[:, None, None, None, None]  # [B, 1, 1, 1, 1]
        prefix = slots < tail_start
        sink = prefix & (slots < STREAMING_SINKS)
        recent = prefix & ~sink & (slots >= tail_start - RECENT_BAND)
        bands = {"sink": sink, "recent": recent, "far": prefix & ~sink & ~recent}

        def share(where) -> float:  # mean over sequences, heads and rows
            return float((probs * where).sum(-1).mean())

        values = {"captured": share(drafted), "tail": share(~prefix),
                  "output_error": float(error.mean())}
        for band, where in bands.items():
            values[f"missed_{band}"] = share(where & ~drafted)
        for name, value in values.items():
            self.sums[layer][name] += value
        self.rows[layer] += 1

    def means(self) -> dict[int, dict[str, float]]:
        return {layer: {name: total / self.rows[layer] for name, total in sums.items()}
                for layer, sums in sorted(self.sums.items())}


def run(args, out: Path) -> list[dict]:
    configs = [parse_config(text) for text in args.configs]
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    rows: list[dict] = []
    for dataset in args.datasets:
        for ctx in args.ctx:
            for prompt in embedded_prompts(model.tokenizer, dataset, ctx, args.num_prompts):
                # The prompt's K/V computed once: its prefill costs more than a short decode.
                reuse = PrefixCache()
                vanilla = generate(model, [prompt.ids], args.max_new_tokens, ignore_eos=True,
                                   prefix_cache=reuse)
                for label, drafter, options in configs:
                    t = time.perf_counter()
                    spec = SpecConfig(drafter=drafter, gamma=args.gamma, sparsity=args.sparsity,
                                      min_tokens=args.min_tokens, **options)
                    with RecallProbe().installed() as probe:
                        result = generate(model, [prompt.ids], args.max_new_tokens,
                                          ignore_eos=True, spec=spec, prefix_cache=reuse)
                    layers = probe.means()
                    rows.append(dict(
                        dataset=dataset, prompt=prompt.name, ctx=ctx, config=label,
                        mean_accepted_length=result.stats.mean_accepted_length,
                        matches_vanilla=result.tokens == vanilla.tokens,
                        layers={str(layer): m for layer, m in layers.items()}))
                    captured = sum(m["captured"] for m in layers.values()) / max(len(layers), 1)
                    print(f"[{dataset} {ctx} {prompt.name}] {label}: mal="
                          f"{result.stats.mean_accepted_length:.2f} captured={captured:.3f} "
                          f"({time.perf_counter() - t:.0f}s)", file=sys.stderr, flush=True)
                    write_atomic(with_ext(out, ".json"), json.dumps(rows, indent=1))
    return rows


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else float("nan")


def summarize(rows: list[dict], args, seconds: float) -> str:
    """Mean over prompts (and selecting layers) per dataset and configuration; per layer
    too where few layers select (a hybrid model's global layers)."""
    by_group: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        by_group[(r["dataset"], r["ctx"], r["config"])].append(r)
    lines = [
        "# Key recall: the share of the draft query's true attention its keys hold", "",
        f"- Model: {args.model} ({args.dtype}), greedy, gamma = {args.gamma}, "
        f"{args.max_new_tokens} new tokens, budget max({args.min_tokens}, ceil("
        f"{args.sparsity} x prefix)); {args.num_prompts} prompts per dataset.",
        f"- Hardware: {hardware()}; torch {torch.__version__}; {datetime.date.today()}; "
        f"run time {seconds / 60:.1f} min.",
        f"- Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- Mass shares averaged over draft steps, heads and the selecting layers; missed "
        f"mass by band: the {STREAMING_SINKS} sinks, the {RECENT_BAND} prefix slots before "
        "the tail, the far rest; tail: the slots written since the selection; output "
        "error: |draft attention output - true| / |true|, per head.", "",
        "| dataset | ctx | config | accepted length | captured | missed: sinks | "
        "missed: recent | missed: far | tail | output error | exact |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    layer_rows = []
    for (dataset, ctx, config), group in by_group.items():
        per_prompt = [r["layers"].values() for r in group]
        cell = {name: _mean(_mean(m.get(name, float("nan")) for m in layers)
                            for layers in per_prompt) for name in MEASURES}
        mal = _mean(r["mean_accepted_length"] for r in group)
        exact = f"{sum(r['matches_vanilla'] for r in group)}/{len(group)}"
        lines.append(f"| {dataset} | {ctx} | {config} | {mal:.2f} | "
                     + " | ".join(f"{cell[n]:.3f}" for n in MEASURES) + f" | {exact} |")
        layer_ids = sorted({int(layer) for r in group for layer in r["layers"]})
        if len(layer_ids) <= args.per_layer_max:
            per = [{n: _mean(r["layers"][str(i)].get(n, float("nan")) for r in group)
                    for n in ("captured", "output_error")} for i in layer_ids]
            layer_rows.append(f"| {dataset} | {ctx} | {config} | " + " | ".join(
                f"{i}: {m['captured']:.3f} / {m['output_error']:.3f}"
                for i, m in zip(layer_ids, per)) + " |")
    if layer_rows:
        lines += ["", "Captured mass / output error per selecting layer:", "",
                  "| dataset | ctx | config | layers |", "| --- | --- | --- | --- |", *layer_rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, dtype="float32")
    p.add_argument("--datasets", nargs="+", default=["code", "prose", "retrieval"])
    p.add_argument("--ctx", nargs="+", type=int, default=[2048])
    p.add_argument("--sparsity", type=float, default=0.05)
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=["vegas", "streaming", "oracle"],
                   help="DRAFTER or DRAFTER:name=value,... (SpecConfig's options)")
    p.add_argument("--per-layer-max", type=int, default=6,
                   help="list the captured mass per layer when at most this many select")
    add_output_args(p, "runs/key-recall", "summarize rows measured earlier")
    args = p.parse_args()
    out = Path(args.out)
    t = time.perf_counter()
    try:
        for text in args.configs:
            parse_config(text)  # checked before the model loads
        rows = json.loads(args.from_json.read_text()) if args.from_json else run(args, out)
    except VegasError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    write_atomic(with_ext(out, ".md"), summarize(rows, args, time.perf_counter() - t))
    print(with_ext(out, ".md").read_text())


if __name__ == "__main__":
    main()
