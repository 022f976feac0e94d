"""Whole decode steps and Vegas iterations against the memory-bandwidth floor.

Random weights of a real model's shape (bf16) and a KV cache filled with random values to
``ctx`` tokens per sequence, recorded as holding random prompts, so that a session on
those prompts computes no prefill (only its first verify window). For each (model, ctx,
batch) that fits in memory:

- the device-to-device copy bandwidth, measured once in the same run;
- a vanilla decode step (one CUDA-graph replay: every layer, the LM head) against its
  floor = (weight bytes read + KV bytes read) / copy bandwidth. A mixture of experts
  counts the experts the step's tokens are routed to (each once per layer), and a
  sliding layer reads its window, not the whole context;
- Vegas and StreamingLLM iterations at gamma and sparsity given (drafts, verify, accept,
  selection, and the one copy of tokens to the host), with the per-phase times from CUDA
  events, and the selection's share of an iteration.

Every time is a median over iterations after warm-up (which compiles and captures).
With ``--tau drafter=L`` (mean accepted length measured with a real model, e.g. by
bench/end_to_end.py) the table adds modelled tokens/s: batch x L / iteration time, and
batch / step time for vanilla. ``--from-json`` re-renders an earlier run's table with
other accepted lengths, without a GPU.

    python bench/steps.py --out runs/steps-h200
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.acceptance import with_ext, write_atomic  # noqa: E402

MODELS = ("qwen3-8b", "llama-3.1-8b", "gpt-oss-20b", "qwen3-30b-a3b", "smollm2-135m",
          "gemma3-270m")
STEP_REPEATS = 30  # vanilla step replays timed
ITERATIONS, WARMUP_ITERATIONS = 12, 3
HEADROOM = 12 << 30  # bytes left free beside weights and cache (graphs, scores, logits)
COPY_BYTES = 2 << 30


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * COPY_BYTES / statistics.median(times)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _expert_tensors(moe) -> list:
    return [moe.experts_gate_up, moe.experts_down, moe.experts_gate_up_bias,
            moe.experts_down_bias]


def weight_bytes_read(net, experts_read: dict[int, int] | None = None) -> int:
    """Bytes a decode step reads from the weights: all of them but the embedding table
    (a lookup reads one row per token) unless the LM head shares it. In a mixture of
    experts only ``experts_read[layer]`` of the layer's experts are read (default: all)."""
    from vegas_core.model import MixtureOfExperts

    total = _bytes(net.parameters())
    if net.lm_head.weight is not net.embed_tokens.weight:
        total -= _bytes([net.embed_tokens.weight])
    for i, block in enumerate(net.layers):
        if isinstance(block.mlp, MixtureOfExperts):
            experts = block.mlp.config.num_experts
            unread = experts - (experts_read or {}).get(i, experts)
            total -= _bytes(_expert_tensors(block.mlp)) * unread // experts
    return total


def experts_read(model, cache, tokens: torch.Tensor, positions: torch.Tensor) -> dict[int, int]:
    """Layer -> how many distinct experts the tokens [B, 1] at ``positions`` are routed
    to in one decode step: an eager forward with the routers observed."""
    from vegas_core.attention import AttentionMeta
    from vegas_core.model import MixtureOfExperts

    net, counts, hooks = model.net, {}, []

    def observer(layer: int):
        def observe(module, args):
            x = args[0]
            _, chosen = module.route(x.reshape(-1, x.shape[-1]))
            counts[layer] = int(chosen.unique().numel())
        return observe

    for i, block in enumerate(net.layers):
        if isinstance(block.mlp, MixtureOfExperts):
            hooks.append(block.mlp.register_forward_pre_hook(observer(i)))
    try:
        with torch.inference_mode():
            net(tokens, positions, cache,
                AttentionMeta.full(positions, cache.max_len, model.config.window))
    finally:
        for hook in hooks:
            hook.remove()
    return counts


def kv_bytes_read(config, ctx: int, batch: int, dtype_bytes: int = 2,
                  keys: float | None = None) -> float:
    """K/V bytes a decode step reads at ``ctx`` tokens per sequence: a sliding layer
    reads its window only. ``keys``: a draft step's slots per sequence (selection and
    tail) in the other layers, instead of the whole context."""
    window = config.window
    keys = ctx if keys is None else keys
    tokens = sum(min(ctx, window.size) if window is not None and window.applies(i) else keys
                 for i in range(config.num_layers))
    return 2 * config.num_kv_heads * config.head_dim * dtype_bytes * tokens * batch


def kv_bytes_per_token(config, dtype_bytes: int = 2) -> int:
    return config.num_layers * 2 * config.num_kv_heads * config.head_dim * dtype_bytes


def step_positions(cache, rows: int) -> torch.Tensor:
    """[B, rows] positions of a step's tokens: the cache's lengths onwards."""
    return cache.lengths[:, None] + torch.arange(rows, device=cache.lengths.device)


def step_seconds(model, cache, tokens: torch.Tensor, meta=None) -> float:
    """Median seconds of a captured vanilla step of ``tokens`` [B, 1] at the cache's
    lengths; ``meta(positions)``: another step's attention (e.g. a draft's); tokens
    [B, T] with a verify ``meta``: a verify pass (logits of every row)."""
    from vegas_core.attention import AttentionMeta
    from vegas_core.graphs import StaticForward, new_pool

    dev = model.device
    if meta is None:
        meta = lambda pos: AttentionMeta.full(pos, cache.max_len, model.config.window)  # noqa: E731
    rows = tokens.shape[1]
    forward = StaticForward(model.net, cache, cache.batch_size, rows, meta,
                            all_rows=rows > 1, device=dev, pool=new_pool(dev))
    positions = step_positions(cache, rows)
    times = []
    with torch.inference_mode():
        for i in range(STEP_REPEATS + WARMUP_ITERATIONS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward(tokens, positions)
            end.record()
            end.synchronize()
            if i >= WARMUP_ITERATIONS:
                times.append(start.elapsed_time(end) / 1000)
    return statistics.median(times)


def fill_kept_cache(model, batch: int, ctx: int, room: int, seed: int):
    """The model's kept cache (as generate() and sessions find it) for ``batch``
    sequences of ``ctx`` random tokens plus ``room`` slots, filled with random K/V and
    recorded as holding those prompts -> (cache, prompts, next tokens [B, 1])."""
    from vegas_core.cache import PromptSlots
    from vegas_core.graphs import workspace

    cache = workspace(model.net, batch, ctx + room, model.device).cache
    gen = torch.Generator(device=model.device).manual_seed(seed)
    cache.fill_(lambda t: t.normal_(generator=gen))
    cache.lengths.fill_(ctx)
    ids = torch.randint(0, model.config.vocab_size, (batch, ctx + 1), device=model.device,
                        generator=gen)
    prompts = ids[:, :ctx].tolist()
    cache.prompts = [PromptSlots(p) for p in prompts]
    for row in range(batch):
        cache.save_prompt_tail(row, ctx)  # a ring's prompt end, as prefill keeps it
    return cache, prompts, ids[:, ctx:]


def iteration_seconds(model, prompts: list[list[int]], spec) -> dict:
    """Median wall time of an iteration (host sync included) and of each phase, on
    ``prompts`` that the model's kept cache holds already."""
    from vegas_core.sampling import SamplingParams
    from vegas_core.speculative import SpeculativeSession

    b = len(prompts)
    new_tokens = (spec.gamma + 1) * (ITERATIONS + WARMUP_ITERATIONS)
    session = SpeculativeSession(model, prompts, spec, SamplingParams(), new_tokens)
    walls, phases = [], {k: [] for k in session.timers}
    for i in range(ITERATIONS + WARMUP_ITERATIONS):
        before = dict(session.timers)
        torch.cuda.synchronize()
        t = time.perf_counter()
        session.step([True] * b)  # ends with the iteration's one device-to-host copy
        wall = time.perf_counter() - t
        if i >= WARMUP_ITERATIONS:
            walls.append(wall)
            for k in phases:
                phases[k].append(session.timers[k] - before[k])
    out = {"iteration": statistics.median(walls)}
    out.update({k: statistics.median(v) for k, v in phases.items()})
    out["selection_share"] = out["selection"] / out["iteration"]
    out["drafted_budget"] = int(session.selection.counts.max())
    del session
    return out


def run(args, save) -> dict:
    import triton

    from vegas_core import SpecConfig, load_model
    from vegas_core.graphs import release_workspace
    from vegas_core.loading.memory import kv_cache_bytes

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s", file=sys.stderr, flush=True)
    total_memory = torch.cuda.get_device_properties(0).total_memory
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "command": "python " + shlex.join(sys.argv),
              "copy_bandwidth": bandwidth, "gamma": args.gamma, "sparsity": args.sparsity,
              "min_tokens": args.min_tokens, "score": args.score, "rows": []}
    # Room for the iterations to come (each advances a sequence by at most gamma + 1) and
    # for a session's last one.
    margin = (args.gamma + 1) * (ITERATIONS + WARMUP_ITERATIONS + 2)
    for name in args.models:
        model = load_model(f"dummy:{name}", device="cuda", dtype="bfloat16")
        wbytes = weight_bytes_read(model.net)  # every expert: what memory must hold
        for ctx in args.ctx:
            for b in args.batch:
                row = {"model": name, "ctx": ctx, "batch": b}
                # The cache as allocated: a hybrid model's sliding layers as rings.
                need = wbytes + kv_cache_bytes(model.config, torch.bfloat16, ctx + margin, b)
                if need + HEADROOM > total_memory:
                    row["skipped"] = (f"needs {need / 2**30:.0f} GiB of weights and KV; the GPU "
                                      f"has {total_memory / 2**30:.0f} GiB")
                    result["rows"].append(row)
                    print(f"{name} ctx={ctx} B={b}: {row['skipped']}", file=sys.stderr, flush=True)
                    continue
                cache, prompts, tokens = fill_kept_cache(model, b, ctx, margin, seed=ctx + b)
                routed = experts_read(model, cache, tokens, cache.lengths[:, None].clone())
                weights = weight_bytes_read(model.net, routed)
                floor = (weights + kv_bytes_read(model.config, ctx, b)) / bandwidth
                row.update(floor=floor, vanilla=step_seconds(model, cache, tokens))
                if routed:
                    row["experts_read"] = statistics.fmean(routed.values())
                    row["experts"] = model.config.num_experts
                for drafter in args.drafters:
                    spec = SpecConfig(drafter=drafter, gamma=args.gamma, sparsity=args.sparsity,
                                      min_tokens=args.min_tokens, score=args.score)
                    it = iteration_seconds(model, prompts, spec)
                    # A draft step reads the weights and, per sequence, the selection and
                    # a tail of (gamma + 1) / 2 slots on average.
                    keys = it["drafted_budget"] + (args.gamma + 1) / 2
                    it["draft_floor"] = (weights + kv_bytes_read(model.config, ctx, b,
                                                                 keys=keys)) / bandwidth
                    row[drafter] = it
                result["rows"].append(row)
                save(result)  # a run cut short keeps its finished rows
                print(json.dumps(row), file=sys.stderr, flush=True)
                del cache
                release_workspace(model.net)
                gc.collect()
                torch.cuda.empty_cache()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    return result


def render(result: dict, tau: dict[str, float], tau_source: str) -> str:
    ms = lambda s: f"{1000 * s:.2f}"  # noqa: E731
    drafters = [d for d in ("vegas", "streaming") if any(d in r for r in result["rows"])]
    lines = [
        f"# Decode steps and iterations vs the bandwidth floor (gamma {result['gamma']}, "
        f"sparsity {result['sparsity']}, min tokens {result['min_tokens']}, "
        f"{result.get('score', 'logit')} scores; bf16, random weights "
        "of the real shape)",
        "",
        f"- GPU: {result['gpu']}; torch {result['torch']}; triton {result['triton']}",
        f"- Command: `{result['command']}`",
        f"- Copy bandwidth measured in this run: {result['copy_bandwidth'] / 1e12:.2f} TB/s "
        "(read + write). Floor = (weight bytes read + KV bytes read) / that bandwidth; "
        "a mixture counts the experts its step is routed to (mean per layer beside the "
        "model), a sliding layer reads its window.",
        f"- Vanilla step: median of {STEP_REPEATS} CUDA-graph replays (CUDA events). Iterations: "
        f"median of {ITERATIONS} after {WARMUP_ITERATIONS} warm-ups, wall time including the "
        "iteration's one host sync; phases from CUDA events. Milliseconds.",
        "- Targets: vanilla step <= 1.10x floor at batch 8 / 64k and <= 1.25x at batch 1; "
        "selection <= 5% of an iteration at gamma 6 / 64k.",
        "",
        "| model | ctx | batch | floor | vanilla step | / floor | "
        + " | ".join(f"{d} iteration (draft / verify / select) | {d} select share"
                     for d in drafters) + " |",
        "| --- | --- | --- | --- | --- | --- |" + " --- | --- |" * len(drafters),
    ]
    for r in result["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['model']} | {r['ctx']} | {r['batch']} | " + "| " * 3
                         + f"does not fit: {r['skipped']} |" + " |" * (2 * len(drafters) - 1))
            continue
        name = r["model"] + (f" ({r['experts_read']:.1f} of {r['experts']} experts)"
                             if "experts_read" in r else "")
        cells = [name, str(r["ctx"]), str(r["batch"]), ms(r["floor"]), ms(r["vanilla"]),
                 f"{r['vanilla'] / r['floor']:.2f}"]
        for d in drafters:
            it = r[d]
            cells.append(f"{ms(it['iteration'])} ({ms(it['draft'])} / {ms(it['verify'])} / "
                         f"{ms(it['selection'])})")
            cells.append(f"{100 * it['selection_share']:.1f}%")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Each step against its own floor", "",
              f"A draft step is the draft phase / gamma; its floor reads the weights and each "
              "sequence's selection plus half the tail (sliding layers: their window). A verify "
              "pass is the verify phase, against one vanilla step.", "",
              "| model | ctx | batch | vanilla / floor | "
              + " | ".join(f"{d} draft step (floor) | / floor | {d} verify / vanilla"
                           for d in drafters) + " |",
              "| --- | --- | --- | --- |" + " --- | --- | --- |" * len(drafters)]
    for r in result["rows"]:
        if "skipped" in r or not all("draft_floor" in r[d] for d in drafters):
            continue
        cells = [r["model"], str(r["ctx"]), str(r["batch"]), f"{r['vanilla'] / r['floor']:.2f}"]
        for d in drafters:
            step = r[d]["draft"] / result["gamma"]
            cells += [f"{ms(step)} ({ms(r[d]['draft_floor'])})",
                      f"{step / r[d]['draft_floor']:.2f}", f"{r[d]['verify'] / r['vanilla']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if tau:
        lines += ["", f"## Modelled tokens/s (accepted lengths: {tau_source})", "",
                  "tokens/s = batch x mean accepted length / iteration time; vanilla: batch / "
                  "step time. Speed-up is against vanilla in the same row.", "",
                  "| model | ctx | batch | vanilla tok/s | "
                  + " | ".join(f"{d} tok/s (x vanilla)" for d in drafters if d in tau) + " |",
                  "| --- | --- | --- | --- |" + " --- |" * len([d for d in drafters if d in tau])]
        for r in result["rows"]:
            if "skipped" in r:
                continue
            van = r["batch"] / r["vanilla"]
            cells = [r["model"], str(r["ctx"]), str(r["batch"]), f"{van:.0f}"]
            for d in drafters:
                if d in tau:
                    tps = r["batch"] * tau[d] / r[d]["iteration"]
                    cells.append(f"{tps:.0f} ({tps / van:.2f}x)")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--ctx", nargs="+", type=int, default=[32768, 65536, 131072])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--drafters", nargs="+", default=["vegas", "streaming"])
    p.add_argument("--gamma", type=int, default=6)
    p.add_argument("--sparsity", type=float, default=0.05)
    p.add_argument("--min-tokens", type=int, default=256)
    p.add_argument("--score", default="logit", choices=("logit", "weight"),
                   help="vegas selection scores")
    p.add_argument("--tau", nargs="*", default=[], metavar="DRAFTER=LENGTH",
                   help="mean accepted length per drafter, for the modelled tokens/s table")
    p.add_argument("--tau-source", default="given on the command line",
                   help="where the accepted lengths were measured (printed with the table)")
    p.add_argument("--from-json", help="re-render this earlier result instead of measuring")
    p.add_argument("--out", default="runs/steps", help="writes OUT.md and OUT.json")
    args = p.parse_args()
    try:
        tau = {k: float(v) for k, v in (t.split("=", 1) for t in args.tau)}
    except ValueError:
        p.error("--tau takes DRAFTER=LENGTH pairs, e.g. --tau vegas=5.1 streaming=4.2")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:
        write_atomic(with_ext(out, ".json"), json.dumps(result, indent=1))
        write_atomic(with_ext(out, ".md"), render(result, tau, args.tau_source))

    if args.from_json:
        write_atomic(with_ext(out, ".md"),
                     render(json.loads(Path(args.from_json).read_text()), tau, args.tau_source))
    else:
        if not torch.cuda.is_available():
            p.error("this benchmark needs a CUDA GPU (or --from-json to re-render a result)")
        save(run(args, save))
    print(with_ext(out, ".md").read_text())


if __name__ == "__main__":
    main()
