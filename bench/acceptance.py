"""Acceptance of every drafter at matched budgets on long embedded prompts.

Runs vanilla greedy once per prompt, then each drafter at each sparsity (vegas once per
score of ``--scores``, labelled ``vegas:logit``, ``vegas:weight`` when there are several;
vegas and streaming once more per rule of ``--rules`` beyond ``engine``, labelled
``vegas@fork``, ``streaming@fork``), and records the
mean accepted length (1 + accepted drafts per iteration, bonus included), the
acceptance by draft position, and whether the output equals vanilla's token for token.
Writes a Markdown table (with the hardware and the command) and the raw rows as JSON.

    python bench/acceptance.py --ctx 4096 --gamma 6 --sparsity 0.05 --out runs/acceptance-cpu

Long generations (``--spans K``): short prompts (``--ctx 256 --datasets writing``) and
``--max-new-tokens`` G in the thousands. Vanilla decodes every prompt of a group in one
batch to the deepest span's end (the reference); each drafter then decodes K spans from
contexts that hold the prompt and the reference's first tokens, one row per span
(``vegas_tune.spans``: ``--span-tokens`` each, centred on K equal strata of the
generation, counted after ``--span-warmup`` iterations).
The mean accepted length is over the spans' counted iterations, and a row matches
vanilla when every span's output equals the reference at its positions. ``--full`` also
decodes every token of the generation with each drafter and reports its mean accepted
length beside the spans': the sampling error of the span estimate.

    python bench/acceptance.py --datasets writing --ctx 256 --max-new-tokens 6000 \
        --spans 4 --span-tokens 256 --out runs/acceptance-long
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vegas_core import SpecConfig, VegasError, generate, load_model  # noqa: E402
from vegas_core.spec_config import (DRAFTERS, FORK_RULE_DRAFTERS, RULES, SCORES,  # noqa: E402
                                    draft_budget)
from vegas_tune.datasets import embedded_prompts  # noqa: E402
from bench.bench_args import add_model_args, add_output_args, add_span_args  # noqa: E402
from bench.spec_options import parse_config  # noqa: E402
from vegas_tune.spans import SpanLayout, reference_continuations, span_rows  # noqa: E402


def hardware() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, making its folder (the
    benches' default, ``runs/``, is not in git)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def with_ext(out: Path, ext: str) -> Path:
    """OUT + ext: ``--out`` names a path without its suffix, and may contain dots
    (``end-to-end-budget-0.02``), which ``with_suffix`` would cut."""
    return out.with_name(out.name + ext)


def configurations(drafters: list[str], scores: list[str],
                   rules: tuple[str, ...] = ("engine",),
                   extra: tuple[str, ...] = ()) -> list[tuple[str, str, dict]]:
    """(label, drafter, SpecConfig options) for each configuration to run: every drafter
    under this engine's rule, vegas and streaming under each other rule (``@rule``), and
    the ``extra`` ones written as ``DRAFTER:name=value,...`` (``bench.spec_options``)."""
    out = []
    for rule in rules:
        tag = "" if rule == "engine" else f"@{rule}"
        for drafter in drafters:
            if rule != "engine" and drafter not in FORK_RULE_DRAFTERS:
                continue
            options = {"rule": rule} if tag else {}
            if drafter == "vegas" and len(scores) > 1:
                out += [(f"vegas:{score}{tag}", drafter, {"score": score, **options})
                        for score in scores]
            elif drafter == "vegas":
                out.append((drafter + tag, drafter, {"score": scores[0], **options}))
            else:
                out.append((drafter + tag, drafter, options))
    return out + [parse_config(text) for text in extra]


def span_layout(args) -> SpanLayout | None:
    """Where the spans lie in the generation (``--spans``); None decodes every token."""
    if not args.spans:
        return None
    return SpanLayout(args.max_new_tokens, args.spans, args.span_tokens, args.span_warmup)


def decode(model, prompt, vanilla: list[int], spec: SpecConfig, layout: SpanLayout | None,
           max_new_tokens: int) -> tuple[object, bool]:
    """(stats, output equal to vanilla's): the whole generation, or its spans (one row
    each, from contexts of the prompt and vanilla's first tokens)."""
    if layout is None:
        result = generate(model, [prompt.ids], max_new_tokens, ignore_eos=True, spec=spec)
        return result.stats, result.tokens[0] == vanilla
    rows = span_rows([prompt], [vanilla], layout)
    result = generate(model, [r.ids for r in rows], layout.max_new_tokens, ignore_eos=True,
                      spec=spec, warmup_iterations=layout.warmup_iterations)
    starts = [len(r.ids) - len(prompt.ids) for r in rows]
    exact = all(tokens == vanilla[start:start + layout.max_new_tokens]
                for start, tokens in zip(starts, result.tokens))
    return result.stats, exact


def vanilla_outputs(model, prompts, layout: SpanLayout | None, args) -> list[list[int]]:
    """Each prompt's vanilla greedy output: decoded alone when every drafter decodes it
    whole, at batch 1 like them; for spans, every prompt of the group in one batch, as
    far as the deepest span's end (or the whole generation with ``--full``): thousands
    of tokens one prompt at a time would cost more than all the drafters' spans."""
    if layout is None:
        return [generate(model, [p.ids], args.max_new_tokens, ignore_eos=True).tokens[0]
                for p in prompts]
    tokens = (args.max_new_tokens if args.full
              else layout.starts()[-1] + layout.max_new_tokens)
    return reference_continuations(model, [p.ids for p in prompts], tokens,
                                   batch_size=len(prompts))


def run(args, out: Path) -> list[dict]:
    layout = span_layout(args)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    limit = model.config.max_position_embeddings
    if max(args.ctx) + args.max_new_tokens > limit:
        raise VegasError(f"--ctx {max(args.ctx)} + --max-new-tokens {args.max_new_tokens} "
                         f"exceeds {args.model}'s {limit} positions; lower one of them")
    rows: list[dict] = []
    # Context outermost: a run cut short has every dataset at the contexts it reached.
    for ctx in args.ctx:
        for dataset in args.datasets:
            prompts = embedded_prompts(model.tokenizer, dataset, ctx, args.num_prompts)
            t = time.perf_counter()
            references = vanilla_outputs(model, prompts, layout, args)
            print(f"[{dataset} ctx={ctx}] vanilla {time.perf_counter() - t:.1f}s",
                  file=sys.stderr, flush=True)
            for prompt, vanilla in zip(prompts, references, strict=True):
                print(f"[{dataset} ctx={ctx} {prompt.name}]", file=sys.stderr, flush=True)
                for sparsity in args.sparsity:
                    for label, drafter, options in configurations(args.drafters, args.scores,
                                                                  args.rules, args.extra):
                        spec = SpecConfig(drafter=drafter, gamma=args.gamma, sparsity=sparsity,
                                          min_tokens=args.min_tokens, **options)
                        s, exact = decode(model, prompt, vanilla, spec, layout,
                                          args.max_new_tokens)
                        full = None
                        if layout is not None and args.full:
                            full, full_exact = decode(model, prompt, vanilla, spec, None,
                                                      args.max_new_tokens)
                            exact = exact and full_exact
                        rows.append(dict(
                            dataset=dataset, prompt=prompt.name, ctx=ctx, drafter=label,
                            sparsity=sparsity, gamma=args.gamma,
                            # The draft's prefix grows through a long generation: the
                            # budget at its end.
                            budget=draft_budget(ctx + (args.max_new_tokens if layout else 0),
                                                sparsity, args.min_tokens),
                            mean_accepted_length=s.mean_accepted_length,
                            acceptance_by_position=s.acceptance_by_position,
                            iterations=s.iterations,
                            matches_vanilla=exact,
                            full_mean_accepted_length=full and full.mean_accepted_length,
                        ))
                        print(f"  {label:12s} s={sparsity:<5} mal={s.mean_accepted_length:.2f}"
                              + (f" full={full.mean_accepted_length:.2f}" if full else "")
                              + f" exact={rows[-1]['matches_vanilla']}", file=sys.stderr,
                              flush=True)
                # Rows so far, so an interrupted run still leaves its measurements.
                write_atomic(with_ext(out, ".json"), json.dumps(rows, indent=1))
    return rows


def summarize(rows: list[dict], args, seconds: float) -> str:
    groups: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    exact = defaultdict(list)
    for r in rows:
        groups[(r["dataset"], r["ctx"], r["sparsity"])][r["drafter"]].append(r["mean_accepted_length"])
        exact[r["drafter"]].append(r["matches_vanilla"])
    drafters = [label for label, _, _ in configurations(args.drafters, args.scores, args.rules,
                                                            args.extra)]
    vegas = [d for d in drafters if d.startswith("vegas")]
    layout = span_layout(args)
    lines = [
        "# Acceptance by drafter at matched budgets",
        "",
        f"- Model: {args.model} ({args.dtype}), greedy, gamma = {args.gamma}, "
        f"{args.max_new_tokens} new tokens, budget = max({args.min_tokens}, ceil(sparsity x prefix)) "
        f"per layer and sequence, the same for every drafter.",
        *([f"- Long generations: each drafter decoded {layout.words()}, from contexts of the "
           "prompt and vanilla's output (vegas_tune.spans); acceptance over the spans' "
           "counted iterations."] if layout else []),
        f"- Hardware: {hardware()}; torch {torch.__version__}; {args.num_prompts} prompts per dataset.",
        f"- Date: {datetime.date.today()}; run time {seconds / 60:.1f} min.",
        f"- Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        "- Metric: mean accepted length = 1 + accepted drafts per iteration (bonus included), "
        "averaged over prompts.",
        "",
        "| dataset | ctx | sparsity | " + " | ".join(drafters) + " | "
        + " | ".join(f"{d} - streaming | gap to oracle closed" for d in vegas) + " |",
        "| --- | --- | --- | " + " | ".join("---" for _ in drafters) + " |"
        + " --- | --- |" * len(vegas),
    ]
    verdicts = []
    for (dataset, ctx, sparsity), by in sorted(groups.items()):
        mean = {d: sum(v) / len(v) for d, v in by.items()}
        cells = [f"{mean[d]:.2f}" if d in mean else "-" for d in drafters]
        for d in vegas:
            delta = closed = "-"
            if {d, "streaming"} <= mean.keys():
                delta = f"{mean[d] - mean['streaming']:+.2f}"
                verdicts.append(mean[d] >= mean["streaming"])
                if "oracle" in mean and mean["oracle"] > mean["streaming"]:
                    gap = mean["oracle"] - mean["streaming"]
                    closed = f"{(mean[d] - mean['streaming']) / gap:.0%}"
            cells += [delta, closed]
        lines.append(f"| {dataset} | {ctx} | {sparsity} | " + " | ".join(cells) + " |")
    full = defaultdict(list)
    for r in rows:
        if r.get("full_mean_accepted_length") is not None:
            full[r["drafter"]].append((r["mean_accepted_length"], r["full_mean_accepted_length"]))
    if full:
        lines += ["", "Spans against every token of the generation (mean accepted length over "
                  "prompts and groups; the sampling error of the span estimate):", "",
                  "| drafter | spans | every token | spans - every token |",
                  "| --- | --- | --- | --- |"]
        for d, pairs in full.items():
            spans = sum(a for a, _ in pairs) / len(pairs)
            whole = sum(b for _, b in pairs) / len(pairs)
            lines.append(f"| {d} | {spans:.2f} | {whole:.2f} | {spans - whole:+.2f} |")
    lines += ["", "Exact match with vanilla greedy output (prompts):", ""]
    lines += [f"- {d}: {sum(v)}/{len(v)}" for d, v in exact.items()]
    if verdicts:
        held = sum(verdicts)
        lines += ["", f"vegas >= streaming at equal budget held in {held} of {len(verdicts)} "
                      "(vegas score, dataset, ctx, sparsity) groups."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, dtype="float32")
    p.add_argument("--datasets", nargs="+", default=["code", "prose", "retrieval"])
    p.add_argument("--ctx", nargs="+", type=int, default=[4096])
    p.add_argument("--sparsity", nargs="+", type=float, default=[0.05])
    p.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=DRAFTERS)
    p.add_argument("--scores", nargs="+", default=["logit"], choices=SCORES,
                   help="vegas's score modes; several run vegas once per mode")
    p.add_argument("--rules", nargs="+", default=["engine"], choices=RULES,
                   help="selection rules; fork runs vegas and streaming again under the "
                        "vLLM fork's rule (docs/drafters.md)")
    p.add_argument("--extra", nargs="+", default=[],
                   help="more configurations, DRAFTER:name=value,... with SpecConfig's "
                        "options (vegas:score=weight,accumulate=0.8), run beside --drafters")
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--min-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=2)
    add_span_args(p, "long generations: decode this many spans spread over "
                     "--max-new-tokens instead of every token (0: every token)")
    p.add_argument("--full", action="store_true",
                   help="with --spans, also decode every token with each drafter: the "
                        "spans' error")
    add_output_args(p, "runs/acceptance", "summarize rows measured earlier (e.g. by a run that was cut short)")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    try:
        span_layout(args)  # checked before the model loads
        configurations(args.drafters, args.scores, args.rules, args.extra)
        rows = json.loads(args.from_json.read_text()) if args.from_json else run(args, out)
    except VegasError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    write_atomic(with_ext(out, ".md"), summarize(rows, args, time.perf_counter() - t))
    print(with_ext(out, ".md").read_text())


if __name__ == "__main__":
    main()
