"""Where a decode (or draft) step's time goes, kernel by kernel, against its floor.

Random weights of a real shape and a random KV cache at ``ctx`` (as bench/steps.py). The
step is run eagerly under the PyTorch profiler to get each kernel's device time (a kernel
runs as long eagerly as in a graph), grouped by what it does; the GEMMs' time is set
against the weight bytes they read, the attention kernels' against the K+V bytes, both as
fractions of the copy bandwidth measured in the same run. The CUDA-graph replay of the
same step, minus the kernels' summed time, is the time between kernels in the graph.
With ``--draft-sparsity`` the step is a draft: each layer and sequence attends to a random
selection of the budget's slots (``draft_budget``) plus a tail of DRAFT_TAIL slots. With
``--verify-rows T`` it is a verify pass of T rows (logits of every row), and with
``--scores`` that pass also sums Vegas's fused logit scores (Collect-2-Query rows, every
layer, into one static buffer, as a session does): run it with and without to see what
the scores cost, kernel by kernel.

    python bench/step_breakdown.py --out runs/step-breakdown-h200.md
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.acceptance import write_atomic  # noqa: E402
from bench.steps import (copy_bandwidth, kv_bytes_per_token, step_positions,  # noqa: E402
                         step_seconds, weight_bytes_read)

PROFILED_STEPS = 5
DRAFT_TAIL = 4  # slots written since the selection, mid-iteration at gamma 6
# Kernel-name fragments -> group, first match wins (Triton kernels keep their function
# names; cuBLAS/cuTLASS GEMMs carry one of the GEMM fragments).
GROUPS = (
    ("attention: split", ("_verify_split_kernel",)),
    ("attention: sparse split", ("_sparse_split_kernel",)),
    ("attention: merge", ("_merge_kernel",)),
    ("rms norm (+ residual)", ("rms_norm",)),
    ("q/k norm + rope + KV write", ("rope_store",)),
    ("silu * mul", ("silu_mul",)),
    ("GEMM", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "xmma", "splitk")),
)


def group_of(name: str) -> str:
    lowered = name.lower()
    for group, fragments in GROUPS:
        if any(f in lowered for f in fragments):
            return group
    return "other: " + name[:60]


def draft_selection(model, cache, budget: int, generator):
    """A SparseSelection of ``budget`` random prefix slots per layer and sequence, with
    the last DRAFT_TAIL slots before each sequence's length as its tail."""
    from vegas_core.attention import SparseSelection

    layers, b = model.config.num_layers, cache.batch_size
    prefix = int(cache.lengths.min()) - DRAFT_TAIL
    scores = torch.rand(layers * b, prefix, device=cache.lengths.device, generator=generator)
    indices = scores.topk(budget, dim=-1).indices.sort(dim=-1).values  # distinct slots
    return SparseSelection(indices.view(layers, b, 1, budget),
                           torch.full((layers, b), budget, device=indices.device),
                           cache.lengths - DRAFT_TAIL, tail_floor=prefix)


def kernel_times(model, cache, tokens, meta) -> dict[str, tuple[float, int]]:
    """Device seconds per step and kernel launches per step, by group."""
    from torch.profiler import ProfilerActivity, profile

    net = model.net
    positions = step_positions(cache, tokens.shape[1])

    def step():
        hidden = net(tokens, positions, cache, meta(positions))
        return net.logits(hidden if tokens.shape[1] > 1 else hidden[:, -1])

    with torch.inference_mode():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_STEPS):
                step()
            torch.cuda.synchronize()
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.device_time > 0:
            entry = totals[group_of(event.name)]
            entry[0] += event.device_time * 1e-6 / PROFILED_STEPS
            entry[1] += 1
    return {g: (t, n // PROFILED_STEPS) for g, (t, n) in totals.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--ctx", nargs="+", type=int, default=[32768, 65536])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--draft-sparsity", type=float, default=None,
                   help="profile a draft step at this sparsity instead of a decode step")
    p.add_argument("--min-tokens", type=int, default=256, help="the draft budget's minimum")
    p.add_argument("--verify-rows", type=int, default=None,
                   help="profile a verify pass of this many rows instead of a decode step")
    p.add_argument("--scores", action="store_true",
                   help="with --verify-rows: the pass also sums fused logit scores")
    p.add_argument("--out", default="runs/step-breakdown.md")
    args = p.parse_args()
    if args.verify_rows is not None and args.draft_sparsity is not None:
        p.error("--verify-rows and --draft-sparsity profile different steps: give one")
    if args.verify_rows is not None and args.verify_rows < 1:
        p.error("--verify-rows must be at least 1")
    if args.scores and args.verify_rows is None:
        p.error("--scores needs --verify-rows: only a verify pass sums scores")
    if not torch.cuda.is_available():
        p.error("this benchmark needs a CUDA GPU")
    import triton

    from vegas_core import load_model
    from vegas_core.attention import AttentionMeta
    from vegas_core.scores import ScoreCollector
    from vegas_core.selection import collected_rows
    from vegas_core.spec_config import draft_budget
    from vegas_kernels.select_slots import aligned_slots

    bandwidth = copy_bandwidth()
    model = load_model(f"dummy:{args.model}", device="cuda", dtype="bfloat16")
    wbytes = weight_bytes_read(model.net)
    per_token = kv_bytes_per_token(model.config)
    if args.draft_sparsity is not None:
        title = (f"# A draft step (sparsity {args.draft_sparsity}, min tokens "
                 f"{args.min_tokens}, a tail of {DRAFT_TAIL})")
    elif args.verify_rows is not None:
        title = (f"# A verify pass of {args.verify_rows} rows"
                 + (" with fused logit scores (Collect-2-Query rows, every layer)"
                    if args.scores else ", no scores"))
    else:
        title = "# A vanilla decode step"
    rows = args.verify_rows or 1
    lines = [
        title + f", kernel by kernel ({args.model}, bf16, random weights)",
        "",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}",
        f"- Command: `python {shlex.join(sys.argv)}`",
        f"- Copy bandwidth measured in this run: {bandwidth / 1e12:.2f} TB/s (read + write).",
        f"- Kernel times: device time from the PyTorch profiler, eager steps, mean of "
        f"{PROFILED_STEPS}; graph step: median CUDA-graph replay (bench/steps.py). "
        "Milliseconds. 'of bandwidth': bytes read / time / copy bandwidth.",
        "",
    ]
    out = Path(args.out)
    for ctx in args.ctx:
        for b in args.batch:
            cache = model.net.new_cache(b, ctx + rows + 8)
            gen = torch.Generator(device="cuda").manual_seed(ctx + b)
            cache.fill_(lambda t: t.normal_(generator=gen))
            cache.lengths.fill_(ctx)
            tokens = torch.randint(0, model.config.vocab_size, (b, rows), device="cuda",
                                   generator=gen)
            window = model.config.window
            if args.verify_rows is not None:
                keys = ctx  # the floor of the vanilla step the target compares it with
                collector = None
                if args.scores:
                    layers, kv_heads = model.config.num_layers, model.config.num_kv_heads
                    collector = ScoreCollector(
                        "logit", fused_rows=collected_rows("two", rows, cache.lengths),
                        scores_out=torch.empty(layers, b, kv_heads,  # as a session pads
                                               aligned_slots(cache.max_len), device="cuda"))
                meta = lambda pos: AttentionMeta.verify(  # noqa: E731
                    pos, cache.max_len, window, collector)
            elif args.draft_sparsity is None:
                keys = ctx
                meta = lambda pos: AttentionMeta.full(pos, cache.max_len, window)  # noqa: E731
            else:
                budget = draft_budget(ctx - DRAFT_TAIL, args.draft_sparsity, args.min_tokens)
                keys = budget + DRAFT_TAIL + 1  # the selection, the tail, the own slot
                sel = draft_selection(model, cache, budget, gen)
                meta = lambda pos: AttentionMeta.draft(  # noqa: E731
                    pos, cache.max_len, sel, window)
            kv = per_token * b * keys
            floor = (wbytes + kv) / bandwidth
            graph_step = step_seconds(model, cache, tokens, meta)
            groups = kernel_times(model, cache, tokens, meta)
            summed = sum(t for t, _ in groups.values())
            launches = sum(n for _, n in groups.values())
            lines += [
                f"## ctx {ctx}, batch {b}",
                "",
                f"Floor {1e3 * floor:.2f} (weights {1e3 * wbytes / bandwidth:.2f}, KV "
                f"{1e3 * kv / bandwidth:.2f}); graph step {1e3 * graph_step:.2f} "
                f"({graph_step / floor:.2f}x floor); kernels summed {1e3 * summed:.2f} in "
                f"{launches} launches; between kernels {1e3 * (graph_step - summed):.2f} "
                f"({1e6 * (graph_step - summed) / max(launches, 1):.2f} us per launch).",
                "",
                "| kernels | launches / step | ms / step | share of graph step | of bandwidth |",
                "| --- | --- | --- | --- | --- |",
            ]
            attention = sum(t for g, (t, _) in groups.items() if g.startswith("attention"))
            for g, (t, n) in sorted(groups.items(), key=lambda kv_: -kv_[1][0]):
                frac = ""
                if g == "GEMM":
                    frac = f"{wbytes / t / bandwidth:.2f}"
                elif g in ("attention: split", "attention: sparse split"):
                    frac = f"{kv / t / bandwidth:.2f} (with merge {kv / attention / bandwidth:.2f})"
                lines.append(f"| {g} | {n} | {1e3 * t:.3f} | {t / graph_step:.1%} | {frac} |")
            lines.append("")
            write_atomic(out, "\n".join(lines) + "\n")
            print("\n".join(lines[-len(groups) - 6:]), flush=True)
            del cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
