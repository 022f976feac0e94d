"""End-to-end decode throughput of vanilla and self-speculative decoding, and greedy match.

For each batch size, on the same long embedded prompts (the tuner's workload for the same
dataset, ctx and number of prompts): vanilla greedy decoding, then each drafter (default
vegas and streaming) at the same budget and at each of the ``--gamma`` values. Every
(batch, method) gets an untimed warm-up generate (Triton compiles, CUDA graphs are
captured and kept with the model's workspace) and then a timed run. The prompts are
prefilled once per batch size: the workspace's cache remembers which prompt each row
holds, so later methods reuse it.

Measured per (batch, method), from one timed ``generate``:

- steady tok/s: tokens over the iterations in which every sequence of the batch is
  still decoding (``GenerationStats.steady_tokens_per_second``): the rate of a server
  whose finished sequences are replaced at once, and the tuner's objective;
- completion tok/s: the batch decoded to completion (``tokens_per_second``): the last
  iterations run with the batch partly idle, which a server would not do;
- speedups over vanilla at the same batch, measured in the same process;
- vegas against streaming at equal budget (steady tok/s), at the same gamma and against
  streaming at its best measured gamma, so a gamma that suits vegas is not compared
  with one that handicaps the peer;
- speculative runs: mean accepted length, iterations and the draft, verify and
  selection seconds (CUDA events), selection time / decode time;
- with ``--compare-tuner``: the same configuration measured by the tuner's
  ``Measurer`` on the same prompts, and its ratio to this tool's steady figure.

Greedy match: each speculative run's tokens against vanilla's at the same batch, per
sequence (identical leading tokens; whole sequence identical). For every sequence, one
forward over the prompt and vanilla's tokens gives the top-2 logit margin at each
generated position; at a sequence's first divergence the report gives that margin, the
speculative token's rank and logit gap under it, and where the margin falls among the
sequence's margins. Claim checked: in bf16, divergences happen only at near-ties (the
batched verify rows and the one-row decode round differently).

Writes OUT.md (hardware, versions, command, tables) and OUT.json (raw rows, tokens
included); both are rewritten after every batch, so a run cut short leaves its rows.

    python bench/end_to_end.py --device cuda --dtype bfloat16 --batch 1 16 64 128 256 \
        --out runs/end-to-end-h200

Long generations (``--spans K``, with short prompts: ``--dataset writing --ctx 256``):
``--max-new-tokens`` is the generation's length G, and each row of a batch is one
(prompt, span) pair of the tuner's span workload (``vegas_tune.spans``): a context of the
prompt and the first tokens of its vanilla output (decoded once per batch size), from
which every method decodes ``--span-tokens`` tokens, timed and counted after its first
``--span-warmup`` iterations. The K spans are centred on K equal strata of the generation and a batch of K
rows or more holds each equally, so the steady tok/s is that of a server whose batch
holds long generations at every stage, and per-token cost, nearly linear in the
context, averages to the whole generation's (the midpoint rule; docs/tuning.md). The
greedy match compares each method's spans with vanilla's on the same contexts.

    python bench/end_to_end.py --device cuda --dtype bfloat16 --dataset writing --ctx 256 \
        --max-new-tokens 7680 --spans 4 --span-tokens 256 --batch 128 256 \
        --out runs/end-to-end-long-h200
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.acceptance import hardware, with_ext, write_atomic  # noqa: E402
from vegas_core import SpecConfig, VegasError, generate, load_model  # noqa: E402
from vegas_core.attention import AttentionMeta  # noqa: E402
from vegas_core.backend import attention_backend  # noqa: E402
from vegas_core.prefill import prefill  # noqa: E402
from vegas_core.spec_config import COLLECT, DRAFTERS, GRANULARITIES  # noqa: E402
from vegas_tune.datasets import EMBEDDED_DATASETS, load_prompts  # noqa: E402
from vegas_tune.measure import Measurer, Workload  # noqa: E402
from vegas_tune.spans import (SpanLayout, prompts_for_rows, reference_continuations,  # noqa: E402
                              span_rows)
from bench.bench_args import add_model_args, add_output_args, add_span_args  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def fail(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def versions() -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    return dict(torch=torch.__version__, triton=triton_version,
                python=sys.version.split()[0])


def free_memory(device: torch.device) -> None:
    """Sessions hold multi-GB caches and graph pools in reference cycles."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def prefill_progress(label: str):
    """Prints the cold prefill's progress at most every 5 seconds."""
    last = [time.perf_counter()]

    def progress(phase: str, done: int, total: int) -> None:
        now = time.perf_counter()
        if phase == "prefill" and (now - last[0] > 5 or done == total) and total > 0:
            last[0] = now
            log(f"  {label} prefill {done}/{total} tokens")

    return progress


# --- throughput ------------------------------------------------------------------------


def run_label(method: str, gamma: int | None, gammas: list[int]) -> str:
    """How a run is named in logs and tables: the drafter, and its gamma when several
    gammas were asked for."""
    return method if gamma is None or len(gammas) == 1 else f"{method} g{gamma}"


def run_method(model, prompts, method: str, gamma: int | None, args, batch: int
               ) -> tuple[dict, list[list[int]]]:
    # --score, --window, --collect and --granularity describe a vegas configuration (a
    # tuned one, to cross-check a profile); the peers keep their own selection at the same
    # gamma and budget.
    options = dict(score=args.score, window=args.window, collect=args.collect,
                   granularity=args.granularity) if method == "vegas" else {}
    spec = None if method == "vanilla" else SpecConfig(
        drafter=method, gamma=gamma, sparsity=args.sparsity, min_tokens=args.min_tokens,
        **options)
    name = run_label(method, gamma, args.gamma)
    label = f"b={batch} {name}"
    ids = [p.ids for p in prompts]
    layout = span_layout(args)
    # A span decodes its own tokens; the generation before it is in its context already.
    new_tokens = layout.max_new_tokens if layout else args.max_new_tokens
    skipped = layout.warmup_iterations if layout else 0

    def gen(n: int, progress=None, warmup_iterations: int = 0):
        return generate(model, ids, n, spec=spec, ignore_eos=True, progress=progress,
                        warmup_iterations=warmup_iterations)

    t = time.perf_counter()
    warm = gen(args.warmup_tokens, prefill_progress(label))
    log(f"{label}: warm-up {time.perf_counter() - t:.1f}s "
        f"(prefill {warm.stats.prefill_seconds:.2f}s, decode {warm.stats.decode_seconds:.2f}s)")
    result = gen(new_tokens, warmup_iterations=skipped)
    s = result.stats
    row = dict(
        batch=batch, method=method, gamma=gamma, run=name, max_new_tokens=args.max_new_tokens,
        decode_tokens=s.decode_tokens, decode_seconds=s.decode_seconds,
        tokens_per_second=s.tokens_per_second, prefill_seconds=s.prefill_seconds,
        iterations=s.iterations, steady_iterations=s.steady_iterations,
        steady_tokens=s.steady_tokens, steady_seconds=s.steady_seconds,
        steady_tokens_per_second=s.steady_tokens_per_second,
        warmup_prefill_seconds=warm.stats.prefill_seconds,
        warmup_decode_seconds=warm.stats.decode_seconds,
    )
    if spec is not None:
        row.update(
            spec=spec.to_dict(), mean_accepted_length=s.mean_accepted_length,
            acceptance_by_position=s.acceptance_by_position,
            draft_seconds=s.draft_seconds, verify_seconds=s.verify_seconds,
            selection_seconds=s.selection_seconds, selection_overhead=s.selection_overhead,
        )
    if args.compare_tuner:
        # Right after the timed run, as a tuner's trials follow one another.
        workload = Workload(prompts, batch, new_tokens, warmup_iterations=skipped)
        m = Measurer(model, workload).measure(spec)
        row.update(tuner_tokens_per_second=m.tokens_per_second,
                   tuner_wall_seconds=m.wall_seconds, tuner_decode_seconds=m.decode_seconds)
    free_memory(model.device)
    steady = row["steady_tokens_per_second"]
    log(f"{label}: steady {rate(steady)} tok/s, to completion {rate(s.tokens_per_second)} "
        f"tok/s over {s.decode_seconds:.3f}s"
        + (f", mal {s.mean_accepted_length:.2f}" if spec is not None else "")
        + (f"; tuner {rate(row['tuner_tokens_per_second'])} tok/s" if args.compare_tuner
           else ""))
    return row, result.tokens


# --- greedy match and margins ------------------------------------------------------------


@torch.inference_mode()
def vanilla_logits(model, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """[len(generated), V] float32 logits that chose each generated token: the prompt's
    last row (prefill) and one forward over generated[:-1]."""
    net, dev = model.net, model.device
    n, length = len(prompt), len(generated)
    kv = net.new_cache(1, n + length)
    rows = [net.logits(prefill(model, [prompt], kv))]  # [1, V]
    tokens = torch.tensor([generated[:-1]], dtype=torch.long, device=dev)
    # In blocks a sliding layer's ring holds (vegas_core.cache).
    block = kv.forward_rows or max(1, length - 1)
    for lo in range(0, length - 1, block):
        hi = min(length - 1, lo + block)
        meta = AttentionMeta.prefill(1, n + lo, n + hi, dev, model.config.window)
        rows.append(net.logits(net(tokens[:, lo:hi], meta.positions, kv, meta)[0]))
    return torch.cat(rows)


def margin_profile(model, prompt: list[int], generated: list[int]) -> dict:
    logits = vanilla_logits(model, prompt, generated)
    top = logits.topk(2, dim=-1)
    margins = (top.values[:, 0] - top.values[:, 1]).tolist()
    return dict(logits=logits, margins=margins, top1=top.indices[:, 0].tolist(),
                top2=top.indices[:, 1].tolist())


def leading_match(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def analyse_matches(model, prompts, tokens: dict[str, list[list[int]]], batch: int,
                    args) -> tuple[list[dict], list[dict]]:
    """-> (one row per (method, sequence), one row per vanilla sequence's margins)."""
    vanilla = tokens["vanilla"]
    profiles: dict[int, dict] = {}

    def profile(b: int) -> dict:
        if b not in profiles:
            profiles[b] = margin_profile(model, prompts[b].ids, vanilla[b])
        return profiles[b]

    if args.margins == "all":
        for b in range(len(prompts)):
            profile(b)
    rows = []
    for method, outs in tokens.items():
        if method == "vanilla":
            continue
        for b, (v, s) in enumerate(zip(vanilla, outs)):
            lead = leading_match(v, s)
            row = dict(batch=batch, method=method, sequence=b, prompt=prompts[b].name,
                       tokens=len(v), leading_identical=lead,
                       identical=v == s, divergence=None)
            if lead < min(len(v), len(s)) and args.margins != "none":
                p = profile(b)
                i, vt, st = lead, v[lead], s[lead]
                lg = p["logits"][i]
                ms = p["margins"]
                row["divergence"] = dict(
                    position=i, vanilla_token=vt, spec_token=st,
                    vanilla_text=model.tokenizer.decode([vt]) if model.tokenizer else None,
                    spec_text=model.tokenizer.decode([st]) if model.tokenizer else None,
                    top2_margin=ms[i],
                    # Vanilla's token minus the speculative one, from the same logits.
                    logit_gap=float(lg[vt] - lg[st]),
                    spec_rank=int((lg > lg[st]).sum()) + 1,
                    spec_is_second=p["top2"][i] == st,
                    recomputed_top1_is_vanilla=p["top1"][i] == vt,
                    margin_percentile=sum(m <= ms[i] for m in ms) / len(ms),
                    median_margin=statistics.median(ms),
                )
            elif lead < min(len(v), len(s)):
                row["divergence"] = dict(position=lead, vanilla_token=v[lead],
                                         spec_token=s[lead])
            rows.append(row)
            d = row["divergence"]
            log(f"b={batch} {method} seq {b}: {lead}/{len(v)} identical"
                + (f"; diverges at {d['position']}, margin {d['top2_margin']:.3f}, "
                   f"spec token rank {d['spec_rank']}" if d and "top2_margin" in d else ""))
    margins = [dict(batch=batch, sequence=b, prompt=prompts[b].name,
                    top2_margins=[round(m, 4) for m in p["margins"]],
                    median_margin=statistics.median(p["margins"]),
                    near_tie_share=sum(m <= args.tie_margin for m in p["margins"])
                    / len(p["margins"]))
               for b, p in sorted(profiles.items())]
    profiles.clear()
    free_memory(model.device)
    return rows, margins


# --- report ----------------------------------------------------------------------------


def fmt(x, spec: str = ".2f", empty: str = "-") -> str:
    return empty if x is None else format(x, spec)


def cell(text: str | None) -> str:
    """A token's text, quoted, safe inside a Markdown table cell."""
    return "" if text is None else json.dumps(text).replace("|", "\\|")


def rate(x: float | None) -> str:
    """Tokens per second: whole numbers on a GPU, two decimals for CPU smoke runs."""
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.2f}"


def gammas_text(gamma) -> str:
    """--gamma as recorded: one int (older runs) or a list."""
    return str(gamma) if isinstance(gamma, int) else ", ".join(map(str, gamma))


def vegas_against_streaming(runs: list[dict]) -> list[str]:
    """Steady tok/s of each vegas run over streaming's at the same batch (equal budget):
    at vegas's gamma and at streaming's best measured gamma."""
    streaming: dict[int, list[dict]] = {}
    for r in runs:
        if r["method"] == "streaming" and r["steady_tokens_per_second"]:
            streaming.setdefault(r["batch"], []).append(r)
    lines = []
    for r in runs:
        peers = streaming.get(r["batch"])
        if r["method"] != "vegas" or not peers or not r["steady_tokens_per_second"]:
            continue
        mine = r["steady_tokens_per_second"]
        same = [p for p in peers if p.get("gamma") == r.get("gamma")]
        best = max(peers, key=lambda p: p["steady_tokens_per_second"])
        cells = [f"{r['batch']}", r.get("run", "vegas")]
        cells.append(f"{mine / same[0]['steady_tokens_per_second']:.3f}x" if same else "-")
        cells.append(f"{mine / best['steady_tokens_per_second']:.3f}x "
                     f"({best.get('run', 'streaming')})")
        cells.append(fmt(r.get("mean_accepted_length")) + " / "
                     + (fmt(same[0].get("mean_accepted_length")) if same else "-"))
        cells.append(fmt(r.get("selection_overhead"), ".1%"))
        lines.append("| " + " | ".join(cells) + " |")
    if not lines:
        return []
    return ["", "## Vegas against streaming at equal budget (steady tok/s)", "",
            "| batch | run | over streaming, same gamma | over streaming's best gamma | "
            "accepted vegas / streaming (same gamma) | vegas selection overhead |",
            "| --- | --- | --- | --- | --- | --- |", *lines]


def summarize(data: dict) -> str:
    meta, a = data["meta"], data["meta"]["args"]
    runs, matches, margins = data["runs"], data["matches"], data["margins"]
    by_key = {(r["batch"], r["method"]): r for r in runs}
    tuner = any("tuner_tokens_per_second" in r for r in runs)
    lines = [
        "# End-to-end decode: vanilla vs self-speculative",
        "",
        f"- Model: {a['model']} ({a['dtype']}), greedy, ignore_eos; dataset {a['dataset']}, "
        f"ctx {a['ctx']} prompt tokens, {a['max_new_tokens']} new tokens, batch sizes "
        f"{', '.join(map(str, a['batch']))}.",
        *([f"- Long generations: every row is one of {span_layout(argparse.Namespace(**a)).words()}"
           ", decoded from a context of its prompt and the start of the prompt's vanilla "
           "output; tok/s and acceptance count the iterations after the spans' warm-up."]
          if a.get("spans") else []),
        f"- Speculative: gamma = {gammas_text(a['gamma'])}, sparsity {a['sparsity']}, min_tokens "
        f"{a['min_tokens']} (budget max(min_tokens, ceil(sparsity x prefix))); drafters "
        f"{', '.join(a['drafters'])}; vegas: {a.get('score', 'logit')} scores, collect "
        f"{a.get('collect', 'two')}, granularity {a.get('granularity', 'layer')}, window "
        f"share {a.get('window', 0.0):g}.",
        f"- Hardware: {meta['hardware']}; torch {meta['versions']['torch']}, triton "
        f"{meta['versions']['triton']}; attention: {meta['attention_backend']}.",
        f"- Date: {meta['date']}; run time {meta.get('seconds', 0) / 60:.1f} min"
        + ("" if meta.get("complete") else " (INCOMPLETE: rows so far)") + ".",
        f"- Command: `{meta['command']}`",
        f"- Each (batch, method): one untimed warm-up of {a['warmup_tokens']} new tokens "
        "(kernel compilation, CUDA graph capture), then one timed run on the same prompts. "
        "The prompts are prefilled once per batch size; later runs find them in the cache.",
        "- steady tok/s: decode tokens / seconds over the iterations in which every sequence "
        "of the batch is still decoding (a server's full batch; the tuner's objective). "
        "completion tok/s: decode tokens / decode seconds of the whole run, to the batch's "
        "last token. iterations: steady / all.",
        "",
        "## Throughput",
        "",
        "| batch | method | steady tok/s | steady speedup | completion tok/s | completion "
        "speedup | iterations | mean accepted length | draft s | verify s | selection s | "
        "selection overhead |" + (" tuner tok/s | tuner / steady |" if tuner else ""),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
        + (" --- | --- |" if tuner else ""),
    ]
    for r in runs:
        base = by_key.get((r["batch"], "vanilla"))
        speedup = steady_up = None
        if base and base["tokens_per_second"]:
            speedup = r["tokens_per_second"] / base["tokens_per_second"]
        if base and base["steady_tokens_per_second"] and r["steady_tokens_per_second"]:
            steady_up = r["steady_tokens_per_second"] / base["steady_tokens_per_second"]
        line = (
            f"| {r['batch']} | {r.get('run', r['method'])} | "
            f"{rate(r['steady_tokens_per_second'])} | "
            f"{fmt(steady_up)}{'x' if steady_up else ''} | {rate(r['tokens_per_second'])} | "
            f"{fmt(speedup)}x | {r['steady_iterations']} / {r['iterations']} | "
            f"{fmt(r.get('mean_accepted_length'))} | "
            f"{fmt(r.get('draft_seconds'), '.3f')} | {fmt(r.get('verify_seconds'), '.3f')} | "
            f"{fmt(r.get('selection_seconds'), '.3f')} | "
            f"{fmt(r.get('selection_overhead'), '.1%')} |")
        if tuner:
            t, steady = r.get("tuner_tokens_per_second"), r["steady_tokens_per_second"]
            line += (f" {rate(t)} | "
                     f"{fmt(t / steady if t and steady else None, '.3f')} |")
        lines.append(line)
    lines += vegas_against_streaming(runs)
    cold = [r["warmup_prefill_seconds"] for r in runs if r["method"] == "vanilla"]
    if cold:
        lines += ["", "Prefill of the prompts (the vanilla warm-up, fused prefill attention): "
                  + ", ".join(f"b={r['batch']}: {r['warmup_prefill_seconds']:.1f}s"
                              for r in runs if r["method"] == "vanilla") + "."]

    lines += ["", "## Greedy match with vanilla (same batch)", "",
              "| batch | method | sequences identical | match rate (identical leading tokens "
              "/ tokens) | divergences at margin <= tie | spec token = recomputed runner-up |",
              "| --- | --- | --- | --- | --- | --- |"]
    tie = a["tie_margin"]
    groups: dict[tuple, list[dict]] = {}
    for m in matches:
        groups.setdefault((m["batch"], m["method"]), []).append(m)
    all_div = []
    for (batch, method), ms in groups.items():
        divs = [m["divergence"] for m in ms if m["divergence"] and "top2_margin" in m["divergence"]]
        all_div += divs
        lead = sum(m["leading_identical"] for m in ms)
        total = sum(m["tokens"] for m in ms)
        lines.append(
            f"| {batch} | {method} | {sum(m['identical'] for m in ms)}/{len(ms)} | "
            f"{lead / total:.2%} | {sum(d['top2_margin'] <= tie for d in divs)}/{len(divs)} | "
            f"{sum(d['spec_is_second'] for d in divs)}/{len(divs)} |")
    detail = [m for m in matches if m["divergence"] and "top2_margin" in m["divergence"]]
    if detail:
        lines += ["", "### First divergence per sequence", "",
                  f"Margins come from one {a['dtype']} forward (the prompt prefilled alone, "
                  "then vanilla's tokens as one multi-row block): it rounds in its own "
                  "way, so a margin near 0 may even flip the recomputed top-1.", "",
                  "| batch | method | seq | prompt | position | vanilla token | spec token | "
                  "top-2 margin | logit gap vanilla - spec | spec rank | recomputed top-1 = "
                  "vanilla | margin percentile in seq | median margin in seq |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for m in detail:
            d = m["divergence"]
            lines.append(
                f"| {m['batch']} | {m['method']} | {m['sequence']} | {m['prompt']} | "
                f"{d['position']} | {d['vanilla_token']} {cell(d['vanilla_text'])} | "
                f"{d['spec_token']} {cell(d['spec_text'])} | {d['top2_margin']:.3f} | "
                f"{d['logit_gap']:.3f} | {d['spec_rank']} | {d['recomputed_top1_is_vanilla']} | "
                f"{d['margin_percentile']:.1%} | {d['median_margin']:.2f} |")
    if margins:
        pooled = [x for m in margins for x in m["top2_margins"]]
        lines += ["", f"Vanilla top-2 margins over {len(margins)} sequences, {len(pooled)} "
                  f"generated positions: median {statistics.median(pooled):.2f}, share "
                  f"<= {tie} (near-tie): {sum(x <= tie for x in pooled) / len(pooled):.1%}."]
    lines += ["", f"### Claim: {a['dtype']} divergences happen only at near-ties", ""]
    if not matches:
        lines.append("Not measured.")
    elif not all_div:
        n_div = sum(1 for m in matches if m["divergence"])
        lines.append("No divergence: every speculative output equals vanilla's." if not n_div
                     else f"{n_div} divergences, margins not computed (--margins none).")
    else:
        near = sum(d["top2_margin"] <= tie for d in all_div)
        second = sum(d["spec_is_second"] for d in all_div)
        top_two = sum(d["spec_rank"] <= 2 for d in all_div)
        worst = max(d["top2_margin"] for d in all_div)
        verdict = ("supported" if near == len(all_div) and top_two == len(all_div)
                   else "not supported" if near < len(all_div) else "partly supported")
        lines.append(
            f"{verdict}: {near} of {len(all_div)} first divergences are at a top-2 margin "
            f"<= {tie} logits (largest {worst:.3f}); at {top_two} of them the speculative "
            f"token is one of the recomputed forward's top two ({second} as the runner-up, "
            f"{top_two - second} as its top-1: that forward rounds the tie the speculative "
            "way). (bf16 logits between 16 and 32 are spaced 0.125 apart.)")
    # The same prompt decoded vanilla at two batch sizes: batch-dependent rounding.
    van = {(r["batch"]): r["tokens"] for r in data.get("tokens", []) if r["method"] == "vanilla"}
    if len(van) > 1:
        batches = sorted(van)
        small = batches[0]
        pairs = []
        for big in batches[1:]:
            n = min(len(van[small]), len(van[big]))
            same = sum(van[small][i] == van[big][i] for i in range(n))
            pairs.append(f"b={small} vs b={big}: {same}/{n} sequences identical")
        lines += ["", "Vanilla against itself at other batch sizes (same prompts; each batch "
                  "size prefills its own, in forwards of other shapes, so bf16 rounding "
                  "differs): " + "; ".join(pairs) + "."]
    return "\n".join(lines) + "\n"


# --- main ------------------------------------------------------------------------------


def compact_json(data: dict) -> str:
    """``data`` as JSON with one line per top-level key: the token lists of a batch-256 run
    take half the bytes of an indented dump (about 0.9 against 1.9 MB)."""
    items = [f"{json.dumps(key)}: {json.dumps(value, separators=(',', ':'))}"
             for key, value in data.items()]
    return "{\n" + ",\n".join(items) + "\n}\n"


def write_outputs(out: Path, data: dict) -> None:
    data["meta"]["seconds"] = time.perf_counter() - T0
    write_atomic(with_ext(out, ".json"), compact_json(data))
    write_atomic(with_ext(out, ".md"), summarize(data))


def span_layout(args) -> SpanLayout | None:
    """Where the spans lie in the generation (``--spans``); None decodes every token."""
    if not args.spans:
        return None
    return SpanLayout(args.max_new_tokens, args.spans, args.span_tokens, args.span_warmup)


def batch_prompts(model, args, batch: int) -> list:
    """The batch's rows: prompts of --ctx tokens (fewer --num-prompts wrap around), or
    with --spans a (prompt, span) context each, from one vanilla decode of the prompts."""
    layout = span_layout(args)
    rows = args.num_prompts or batch
    count = prompts_for_rows(rows, layout) if layout else rows
    distinct = load_prompts(model.tokenizer, args.dataset, args.ctx, count)
    if layout is not None:
        t = time.perf_counter()
        continuations = reference_continuations(model, [p.ids for p in distinct],
                                                layout.reference_tokens, batch_size=batch)
        log(f"batch {batch}: {len(distinct)} reference outputs of {layout.reference_tokens} "
            f"tokens in {time.perf_counter() - t:.1f}s; {layout.words()}")
        distinct = span_rows(distinct, continuations, layout)
    return [distinct[i % len(distinct)] for i in range(batch)]


def run(args, out: Path) -> dict:
    log(f"loading {args.model} on {args.device} ({args.dtype})")
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    limit = model.config.max_position_embeddings
    need = args.ctx + args.max_new_tokens + 2 * (max(args.gamma) + 1)
    if need > limit:
        fail(f"ctx {args.ctx} + max-new-tokens {args.max_new_tokens} + 2*(gamma+1) = {need} "
             f"exceeds {args.model}'s {limit} positions; lower --ctx or --max-new-tokens")
    if model.device.type != "cuda":
        log(f"warning: running on {model.device}; throughput figures are not GPU figures")
    data = dict(
        meta=dict(args=vars(args), hardware=hardware(), versions=versions(),
                  attention_backend=attention_backend(model.device),
                  model=model.label, device=str(model.device), dtype=str(model.dtype),
                  date=str(datetime.date.today()), complete=False,
                  command="python " + " ".join(shlex.quote(x) for x in sys.argv)),
        runs=[], matches=[], margins=[], tokens=[])
    runs = [("vanilla", None)] + [(d, g) for g in args.gamma for d in args.drafters]
    for batch in args.batch:
        # --num-prompts: as the tuner's Measurer does, fewer prompts than the batch fill it
        # by wrapping around.
        prompts = batch_prompts(model, args, batch)
        log(f"batch {batch}: {len(prompts)} prompts of {len(prompts[0].ids)} tokens "
            f"({', '.join(p.name for p in prompts[:4])}{', ...' if batch > 4 else ''})")
        tokens: dict[str, list[list[int]]] = {}
        for method, gamma in runs:
            row, generated = run_method(model, prompts, method, gamma, args, batch)
            name = row["run"]
            tokens[name] = generated
            data["runs"].append(row)
            data["tokens"].append(dict(batch=batch, method=name, tokens=tokens[name]))
            write_outputs(out, data)
        log(f"batch {batch}: greedy match and margins")
        rows, margins = analyse_matches(model, prompts, tokens, batch, args)
        data["matches"] += rows
        data["margins"] += margins
        write_outputs(out, data)
    data["meta"]["complete"] = True
    return data


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_args(p, dtype="bfloat16")
    p.add_argument("--dataset", default="mixed", choices=EMBEDDED_DATASETS)
    p.add_argument("--ctx", type=int, default=8000, help="prompt tokens per sequence")
    p.add_argument("--batch", nargs="+", type=int, default=[1, 16])
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--drafters", nargs="+", default=["vegas", "streaming"], choices=DRAFTERS)
    p.add_argument("--gamma", nargs="+", type=int, default=[6],
                   help="draft tokens per iteration; several values run each drafter at each")
    p.add_argument("--sparsity", type=float, default=0.05)
    p.add_argument("--min-tokens", type=int, default=256)
    p.add_argument("--score", default="logit", help="vegas score (logit or weight)")
    p.add_argument("--window", type=float, default=0.0, help="vegas sink/window budget share")
    p.add_argument("--collect", choices=COLLECT, default="two",
                   help="vegas: the verify rows whose scores select")
    p.add_argument("--granularity", choices=GRANULARITIES, default="layer",
                   help="vegas: one set per layer or per KV head")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="distinct prompts, repeated to fill each batch (default: the batch size)")
    add_span_args(p, "long generations: rows decode spans at this many depths of "
                     "--max-new-tokens instead of every token (0: every token)")
    p.add_argument("--warmup-tokens", type=int, default=8,
                   help="new tokens of the untimed warm-up generate per (batch, method)")
    p.add_argument("--compare-tuner", action="store_true",
                   help="also measure each configuration with the tuner's Measurer")
    p.add_argument("--margins", choices=("all", "diverging", "none"), default="all",
                   help="top-2 margins for every vanilla sequence, only diverging ones, or none")
    p.add_argument("--tie-margin", type=float, default=0.25,
                   help="a top-2 margin at or below this (logits) counts as a near-tie")
    add_output_args(p, "runs/end-to-end", "summarize rows measured earlier (e.g. by a run that was cut short)")
    args = p.parse_args()
    if min(args.batch) < 1:
        fail("batch sizes must be >= 1")
    if min(args.gamma) < 1 or len(set(args.gamma)) != len(args.gamma):
        fail("--gamma values must be distinct and >= 1")
    if args.max_new_tokens < 2 or args.warmup_tokens < 1:
        fail("--max-new-tokens must be >= 2 and --warmup-tokens >= 1")
    try:
        span_layout(args)  # checked before the model loads
    except VegasError as exc:
        fail(str(exc))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        write_atomic(with_ext(out, ".md"), summarize(data))
    else:
        try:
            data = run(args, out)
        except VegasError as exc:
            fail(str(exc))
        write_outputs(out, data)
    log(f"wrote {with_ext(out, '.md')} and {with_ext(out, '.json')}")
    print(with_ext(out, ".md").read_text())


if __name__ == "__main__":
    main()
