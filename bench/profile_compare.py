"""Profiles side by side on one workload of mixed prompt lengths.

The question (issue 44): does a profile tuned at several contexts decode traffic whose
prompt lengths vary at least as fast as the best profile tuned at one context? Each
profile's schedule decodes the same batch (``generate(..., spec=profile.spec_schedule())``,
which follows the schedule as sequences finish and contexts grow), beside vanilla, in
interleaved rounds, so that drift between rounds affects every method alike.

A profile tuned at several contexts stands for the profiles tuned at each of them alone:
``P.yaml@4000`` decodes with the band of ``P.yaml`` tuned at 4000 tokens, at every context
(what a profile tuned at 4000 alone would run, except that its first point would have
searched every selection rule, where the band searched those raced at the longest context
and streaming).

Workload: ``--batch-size`` prompts of the embedded dataset, prompt i cut to a length drawn
log-uniformly between ``--min-ctx`` and ``--max-ctx`` (seeded: the same lengths for every
method and round), ``--max-new-tokens`` each, greedy, EOS ignored. A prompt is the leading
tokens of the dataset's prompt at ``--max-ctx``. Every method gets an untimed warm-up
decode first (Triton compiles, CUDA graphs are captured and kept).

Measured per method and round: decode tokens per second of the batch to completion (the
schedule's tail, where some sequences have finished, included: it is where a batch-size
schedule switches) and the steady rate (while every sequence decodes). Reported: each
method's geometric mean with a 95% interval, and each profile's rate over the first
profile's and over vanilla, round by round.

    python bench/profile_compare.py --device cuda --dtype bfloat16 --model gemma3-270m \\
        --min-ctx 4000 --max-ctx 32000 --batch-size 64 --max-new-tokens 128 \\
        --profiles gemma3-4k-16k-32k.yaml gemma3-4k-16k-32k.yaml@4000 \\
        gemma3-4k-16k-32k.yaml@16000 gemma3-4k-16k-32k.yaml@32000 gemma3-32k.yaml \\
        --out runs/profile-compare-gemma3
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.acceptance import hardware, with_ext, write_atomic  # noqa: E402
from bench.bench_args import add_model_args, add_output_args  # noqa: E402
from vegas_core import SpecSchedule, VegasError, generate, load_model  # noqa: E402
from vegas_core.schedule import ScheduleRange  # noqa: E402
from vegas_tune.datasets import load_prompts  # noqa: E402
from vegas_tune.profile import load_profile  # noqa: E402
from vegas_tune.stats import estimate  # noqa: E402

VANILLA = "vanilla"
MIN_ROUNDS = 2  # an interval needs two samples


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prompt_lengths(count: int, low: int, high: int, seed: int) -> list[int]:
    """``count`` lengths drawn log-uniformly in [low, high]: as many prompts near 4k as
    near 32k in ratio terms, since a step's cost grows in proportion to context."""
    rng = random.Random(seed)
    return [min(high, max(low, round(math.exp(rng.uniform(math.log(low), math.log(high))))))
            for _ in range(count)]


def band_of(schedule: SpecSchedule, context: int, name: str) -> SpecSchedule:
    """The entries of ``schedule`` tuned at ``context`` tokens, as a schedule of one band
    (applied at every context): the profile tuned at that context alone."""
    if not schedule.has_contexts:
        raise VegasError(f"{name}: the profile was tuned at one context; drop the @{context}")
    band = tuple(ScheduleRange(e.batch_min, e.batch_max, e.spec) for e in schedule.entries
                 if e.ctx_min <= context <= (e.ctx_max or context))
    if not band:
        raise VegasError(f"{name}: no band holds context {context}")
    return SpecSchedule(band)


def load_method(name: str) -> tuple[str, SpecSchedule]:
    """``PATH`` (the profile's schedule) or ``PATH@CTX`` (its band tuned at ``CTX``): the
    model id it was tuned for, and the schedule to decode with."""
    path, context = name, ""
    if "@" in name and not Path(name).exists():
        path, _, context = name.rpartition("@")
    if context and not context.isdigit():
        raise VegasError(f"{name}: expected PATH or PATH@CONTEXT (a number of tokens)")
    profile = load_profile(Path(path))
    schedule = profile.spec_schedule()
    return profile.model.id, band_of(schedule, int(context), name) if context else schedule


def decode(model, ids: list[list[int]], spec, max_new_tokens: int) -> dict:
    s = generate(model, ids, max_new_tokens, spec=spec, ignore_eos=True).stats
    return {"tokens_per_second": s.tokens_per_second,
            "steady_tokens_per_second": s.steady_tokens_per_second,
            "decode_seconds": s.decode_seconds}


def interval(samples: list[float]) -> dict:
    e = estimate(samples)
    return {"mean": e.mean, "low": e.low, "high": e.high}


def run(args) -> dict:
    # The profiles first: a bad one is refused before the model loads.
    tuned_for, schedules = {}, {}
    for name in args.profiles:
        tuned_for[name], schedules[name] = load_method(name)
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    for name, model_id in tuned_for.items():
        if model_id != model.label:
            log(f"note: {name} was tuned for {model_id}, decoding {model.label}")
    lengths = prompt_lengths(args.batch_size, args.min_ctx, args.max_ctx, args.seed)
    full = load_prompts(model.tokenizer, args.dataset, args.max_ctx, args.batch_size)
    ids = [p.ids[:n] for p, n in zip(full, lengths)]
    methods = {VANILLA: None, **schedules}
    for name, spec in methods.items():
        t = time.perf_counter()
        decode(model, ids, spec, args.max_new_tokens)
        log(f"{name}: warm-up {time.perf_counter() - t:.1f} s")
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):
        rounds.append({name: decode(model, ids, spec, args.max_new_tokens)
                       for name, spec in methods.items()})
        log(f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{name} {row['tokens_per_second']:.1f} tok/s" for name, row in rounds[-1].items()))
    return {"command": "python " + shlex.join(sys.argv), "hardware": hardware(),
            "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "model": model.label, "dtype": str(model.dtype), "dataset": args.dataset,
            "batch_size": args.batch_size, "max_new_tokens": args.max_new_tokens,
            "lengths": lengths, "rounds": rounds}


def summarize(data: dict) -> str:
    rounds = data["rounds"]
    names = list(rounds[0])
    reference = names[1]  # the first profile
    lengths = data["lengths"]
    lines = [
        "# Profiles side by side on prompts of mixed lengths", "",
        f"- Model: {data['model']} ({data['dtype']}), dataset {data['dataset']}, batch "
        f"{data['batch_size']}, {data['max_new_tokens']} new tokens, greedy; prompt lengths "
        f"{min(lengths)}-{max(lengths)} (median {sorted(lengths)[len(lengths) // 2]}).",
        f"- Hardware: {data['hardware']}; torch {data['torch']}; {data['date']}; "
        f"{len(rounds)} interleaved rounds.",
        f"- Command: `{data['command']}`", "",
        "| method | tokens/s to completion | steady tokens/s | over vanilla | over the first "
        "profile |", "| --- | --- | --- | --- | --- |"]
    for name in names:
        rate = interval([r[name]["tokens_per_second"] for r in rounds])
        steady = [r[name]["steady_tokens_per_second"] for r in rounds]
        steady_text = ("-" if None in steady else "{mean:.1f} [{low:.1f}, {high:.1f}]".format(
            **interval(steady)))
        ratios = []
        for base in (VANILLA, reference):
            if name == base:
                ratios.append("-")
                continue
            e = interval([r[name]["tokens_per_second"] / r[base]["tokens_per_second"]
                          for r in rounds])
            ratios.append("{mean:.3f}x [{low:.3f}, {high:.3f}]".format(**e))
        lines.append(f"| {name} | {rate['mean']:.1f} [{rate['low']:.1f}, {rate['high']:.1f}] "
                     f"| {steady_text} | {ratios[0]} | {ratios[1]} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p, dtype="auto")
    p.add_argument("--profiles", nargs="+", default=[],
                   help="profiles to compare (PATH, or PATH@CTX: the band of a profile of "
                   "several contexts tuned at CTX); the first is the reference")
    p.add_argument("--dataset", default="mixed")
    p.add_argument("--min-ctx", type=int, default=256)
    p.add_argument("--max-ctx", type=int, default=1024)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    add_output_args(p, "runs/profile-compare", "summarize rounds measured earlier")
    args = p.parse_args()
    out = Path(args.out)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
    else:
        if not args.profiles:
            p.error("--profiles: give at least one profile")
        if not 1 <= args.min_ctx <= args.max_ctx:
            p.error(f"--min-ctx {args.min_ctx} and --max-ctx {args.max_ctx}: give "
                    "1 <= min <= max")
        if args.rounds < MIN_ROUNDS:
            p.error(f"--rounds must be at least {MIN_ROUNDS} for an interval")
        try:
            data = run(args)
        except VegasError as error:
            p.exit(2, f"error: {error}\n")
        write_atomic(with_ext(out, ".json"), json.dumps(data, indent=1) + "\n")
    text = summarize(data)
    write_atomic(with_ext(out, ".md"), text)
    print(text)


if __name__ == "__main__":
    main()
