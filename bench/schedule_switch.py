"""What a schedule's switch between two configurations costs while decoding.

A batch of random prompts decodes greedily under a schedule whose context bands alternate
between two configurations (``--configs A B``) every ``--every`` tokens of context, so
that it switches decoder every few iterations (``generate`` follows the schedule as the
context grows); then under each configuration alone. Each run is repeated ``--repeats``
times after one untimed run (kernel compilation, graph capture), the three decodes in
turn, and each one's median is kept.

Two costs per switch are reported: the *direct* one, the time the switches themselves
took (``GenerationStats.switch_seconds``: a speculative decoder taking over runs one
verify-style window and selects), and the *total* one, the alternating decode's time
beyond what its iterations cost in the runs of one configuration, per switch (what the
switches cost including their effect on the iterations around them). Both in ms and as
a share of a mean iteration of the alternating decode. The outputs must equal each
other token for token (greedy decoding is lossless whatever the schedule).

    python bench/schedule_switch.py --model qwen3-8b --batch 8 --ctx 4096 \\
        --configs vegas:gamma=6,sparsity=0.05 vanilla --every 16 --out runs/schedule-switch
    python bench/schedule_switch.py --model dummy:tiny --device cpu --dtype float32 \\
        --ctx 64 --new-tokens 48 --every 8 --configs vegas:gamma=3,min_tokens=4 vanilla
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from dataclasses import fields
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vegas_core import SpecConfig, SpecSchedule, VegasError, generate, load_model  # noqa: E402
from vegas_core.schedule import VANILLA, config_words  # noqa: E402
from bench.acceptance import hardware, with_ext, write_atomic  # noqa: E402
from bench.bench_args import add_model_args, add_output_args  # noqa: E402
from bench.spec_options import parse_config  # noqa: E402

# Unlike the other benches, which set gamma and the budget for all configurations
# alike, each configuration here names its own.
EVERY_FIELD = tuple(f.name for f in fields(SpecConfig) if f.name != "drafter")
SWITCHING = "switching"


def parse_switch_config(text: str) -> SpecConfig | None:
    """``vanilla`` -> None; ``DRAFTER:name=value,...`` (any ``SpecConfig`` field, gamma
    and the budget included) -> that configuration."""
    if text == VANILLA:
        return None
    _, drafter, options = parse_config(text, EVERY_FIELD)
    return SpecConfig(drafter=drafter, **options)


def alternating(first: SpecConfig | None, second: SpecConfig | None, start: int, end: int,
                every: int, batch: int) -> SpecSchedule:
    """A schedule running ``first`` up to context ``start`` and then in turn ``second``
    and ``first`` for ``every`` tokens of context each, until ``end`` (after which the
    last band's entry applies)."""
    entries, low, turn = [(1, batch, first, 1, start)], start + 1, 1
    while low <= end:
        entries.append((1, batch, (first, second)[turn], low, low + every - 1))
        low, turn = low + every, 1 - turn
    return SpecSchedule(entries)


def figures(result) -> dict:
    s = result.stats
    return dict(decode_seconds=s.decode_seconds, iterations=s.iterations,
                switches=s.switches, switch_seconds=s.switch_seconds,
                iterations_by_config=dict(s.iterations_by_config), tokens=result.tokens)


def interleaved(model, prompts, new_tokens: int, specs: dict, repeats: int) -> dict:
    """Each of ``specs`` (name -> config or schedule) decoded once untimed, then
    ``repeats`` rounds of one decode each, in turn, so that a drift of the machine's
    speed falls on all alike; per name, the figures of its median decode."""
    decode = lambda spec: generate(model, prompts, max_new_tokens=new_tokens,  # noqa: E731
                                   ignore_eos=True, spec=spec)
    for spec in specs.values():
        decode(spec)
    runs: dict[str, list] = {name: [] for name in specs}
    for _ in range(repeats):
        for name, spec in specs.items():
            runs[name].append(decode(spec))
    return {name: figures(sorted(done, key=lambda r: r.stats.decode_seconds)[len(done) // 2])
            for name, done in runs.items()}


def measure(args) -> dict:
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    first, second = map(parse_switch_config, args.configs)
    if first == second:
        raise VegasError("--configs names one configuration twice; a switch needs two")
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, model.config.vocab_size, (args.batch, args.ctx),
                            generator=g).tolist()
    schedule = alternating(first, second, args.ctx + args.every, args.ctx + args.new_tokens,
                           args.every, args.batch)
    specs = {config_words(first): first, config_words(second): second, SWITCHING: schedule}
    done = interleaved(model, prompts, args.new_tokens, specs, args.repeats)
    switching = done.pop(SWITCHING)
    return dict(model=model.label, device=str(model.device), dtype=args.dtype,
                batch=args.batch, ctx=args.ctx, new_tokens=args.new_tokens, every=args.every,
                repeats=args.repeats, alone=done, switching=switching)


def summary(row: dict) -> dict:
    """Per-iteration times alone, and the direct and total per-switch costs."""
    alone = {name: r["decode_seconds"] / r["iterations"] for name, r in row["alone"].items()}
    sw = row["switching"]
    n = max(sw["switches"], 1)
    iteration = (sw["decode_seconds"] - sw["switch_seconds"]) / sw["iterations"]
    expected = sum(alone[name] * k for name, k in sw["iterations_by_config"].items())
    total = (sw["decode_seconds"] - expected) / n
    direct = sw["switch_seconds"] / n
    same = all(r["tokens"] == sw["tokens"] for r in row["alone"].values())
    return dict(iteration_alone=alone, iteration=iteration, direct=direct, total=total,
                direct_share=direct / iteration, total_share=total / iteration,
                iterations_per_switch=sw["iterations"] / n, same_output=same)


def markdown(row: dict, command: str) -> str:
    s = summary(row)
    sw = row["switching"]
    lines = [
        f"# Schedule switches: {' <-> '.join(row['alone'])}",
        "",
        f"- Model: {row['model']} ({row['dtype']}) on {hardware()}; batch {row['batch']}, "
        f"context {row['ctx']}, {row['new_tokens']} new tokens, greedy; median of "
        f"{row['repeats']} runs.",
        f"- Command: `{command}`",
        f"- Date: {datetime.date.today().isoformat()}",
        "",
        "| decode | iterations | ms per iteration | switches | ms per switch (direct) "
        "| ms per switch (total) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in row["alone"].items():
        lines.append(f"| {name} alone | {r['iterations']} | "
                     f"{1000 * s['iteration_alone'][name]:.2f} | 0 | | |")
    lines.append(f"| alternating every {row['every']} tokens of context | {sw['iterations']} | "
                 f"{1000 * s['iteration']:.2f} | {sw['switches']} | {1000 * s['direct']:.2f} "
                 f"({100 * s['direct_share']:.0f}% of an iteration) | {1000 * s['total']:.2f} "
                 f"({100 * s['total_share']:.0f}%) |")
    lines += [
        "",
        f"One switch every {s['iterations_per_switch']:.1f} iterations. Direct: the time the "
        "switches took; total: the alternating decode's time beyond its iterations' cost "
        "alone, per switch. Outputs equal token for token: "
        f"{'yes' if s['same_output'] else 'NO'}.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, dtype="auto")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=1024, help="prompt tokens per sequence")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--configs", nargs=2, default=["vegas", VANILLA],
                   metavar=("A", "B"),
                   help=f"the two configurations: {VANILLA}, or DRAFTER:name=value,... "
                        "with SpecConfig's fields (vegas:gamma=4,sparsity=0.1)")
    p.add_argument("--every", type=int, default=16,
                   help="tokens of context each configuration runs before the next switch")
    p.add_argument("--repeats", type=int, default=3)
    add_output_args(p, out="runs/schedule-switch",
                    from_json_help="summarize a run's JSON instead of measuring")
    args = p.parse_args()
    if min(args.batch, args.ctx, args.new_tokens, args.every, args.repeats) < 1:
        p.error("--batch, --ctx, --new-tokens, --every and --repeats must be at least 1")
    command = f"python {shlex.join(sys.argv)}"
    try:
        row = (json.loads(args.from_json.read_text()) if args.from_json is not None
               else measure(args))
    except VegasError as e:
        p.error(str(e))
    out = Path(args.out)
    text = markdown(row, command)
    if args.from_json is None:
        write_atomic(with_ext(out, ".json"), json.dumps(row, indent=1) + "\n")
    write_atomic(with_ext(out, ".md"), text)
    print(text, end="")


if __name__ == "__main__":
    main()
