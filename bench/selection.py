"""Vegas selection (top-k prefix slots from verify scores) against reading the scores once.

For each (ctx, batch): the scores of every layer, as the verify pass leaves them
([layers, batch, KV heads, ctx] float32); the PyTorch path (heads summed, the prefix
masked, ``torch.topk``) and ``vegas_kernels.select_slots.topk_slots`` (one launch), each timed
as in ``bench/kernels.py`` (median of CUDA-event timings of a graph of calls, after
warm-up). Floor = the score bytes / the copy bandwidth measured in the run. Both paths
are first checked to select the same slots on fresh random scores.

    python bench/selection.py --shape smollm2-135m --ctx 8192 --batch 64 128 256
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.acceptance import write_atomic  # noqa: E402
from bench.kernels import CALLS_PER_GRAPH, REPEATS, copy_bandwidth, median_us  # noqa: E402
from vegas_kernels.select_slots import reference_topk_slots, topk_slots  # noqa: E402
from vegas_core.spec_config import draft_budget  # noqa: E402

SHAPES = {"smollm2-135m": (30, 3), "qwen3-8b": (36, 8), "llama-3.1-8b": (32, 8)}  # layers, KV heads


def inputs(layers, kv_heads, ctx, batch, sparsity, min_tokens, seed=0):
    """Scores of a verify window, ragged prefixes (ctx down to 3/4 of it), their budgets."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    scores = torch.randn(layers, batch, kv_heads, ctx, device="cuda", generator=g)
    prefix = ctx - torch.randint(0, ctx // 4, (batch,), device="cuda", generator=g)
    budget = draft_budget(prefix, sparsity, min_tokens)
    return scores, prefix, budget, draft_budget(ctx, sparsity, min_tokens)


def same_selection(got, ref, budget) -> bool:
    for b, n in enumerate(budget.tolist()):
        a = got[:, b, :, :n].sort(-1).values
        r = ref[:, b, :, :n].sort(-1).values
        if not torch.equal(a, r):
            return False
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    p.add_argument("--ctx", nargs="+", type=int, default=[8192])
    p.add_argument("--batch", nargs="+", type=int, default=[64, 128, 256])
    p.add_argument("--sparsity", type=float, default=0.05)
    p.add_argument("--min-tokens", type=int, default=128)
    p.add_argument("--out", default="runs/selection.md")
    args = p.parse_args()
    layers, kv_heads = SHAPES[args.shape]
    import triton

    bandwidth = copy_bandwidth()
    lines = [
        f"# Selection: top-k prefix slots of every layer ({args.shape}: {layers} layers, "
        f"{kv_heads} KV heads; sparsity {args.sparsity}, min {args.min_tokens} tokens)",
        "",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
        f"triton {triton.__version__}",
        f"- Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- Copy bandwidth measured in this run: {bandwidth / 1e12:.2f} TB/s (read + write).",
        f"- Floor = float32 score bytes read once / that bandwidth. Microseconds: median of "
        f"{REPEATS} CUDA-event timings of a CUDA graph of {CALLS_PER_GRAPH} calls, per call.",
        "- `layer`: heads summed, one list per layer; `kv_head`: one list per KV head. "
        "Prefixes are ragged (ctx down to 3/4 of it); `same` checks both paths pick the "
        "same slots.",
        "",
        "| ctx | batch | granularity | floor us | PyTorch us | kernel us | kernel / floor | "
        "PyTorch / kernel | same |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for ctx in args.ctx:
        for batch in args.batch:
            scores, prefix, budget, k_cap = inputs(layers, kv_heads, ctx, batch,
                                                   args.sparsity, args.min_tokens)
            floor_us = scores.numel() * 4 / bandwidth * 1e6
            for granularity, sum_heads in (("layer", True), ("kv_head", False)):
                fresh, *_ = inputs(layers, kv_heads, ctx, batch, args.sparsity,
                                   args.min_tokens, seed=1)
                same = same_selection(topk_slots(fresh, prefix, budget, k_cap, sum_heads),
                                      reference_topk_slots(fresh, prefix, budget, k_cap,
                                                           sum_heads), budget)
                torch_us = median_us(lambda: reference_topk_slots(scores, prefix, budget, k_cap,
                                                                  sum_heads))
                kernel_us = median_us(lambda: topk_slots(scores, prefix, budget, k_cap,
                                                         sum_heads))
                lines.append(f"| {ctx} | {batch} | {granularity} | {floor_us:.0f} | "
                             f"{torch_us:.0f} | {kernel_us:.0f} | {kernel_us / floor_us:.2f} | "
                             f"{torch_us / kernel_us:.2f} | {'yes' if same else 'NO'} |")
                print(lines[-1], flush=True)
            del scores
            torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    write_atomic(Path(args.out), text)
    print(text)


if __name__ == "__main__":
    main()
