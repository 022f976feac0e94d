"""Where a vanilla decode step's time goes, kernel by kernel, against its floor.

Random weights of a real shape and a random KV cache at ``ctx`` (as bench/steps.py). The
step is run eagerly under the PyTorch profiler to get each kernel's device time (a kernel
runs as long eagerly as in a graph), grouped by what it does; the GEMMs' time is set
against the weight bytes they read, the attention kernels' against the K+V bytes, both as
fractions of the copy bandwidth measured in the same run. The CUDA-graph replay of the
same step, minus the kernels' summed time, is the time between kernels in the graph.

    python bench/step_breakdown.py --out docs/results/step-breakdown-h200.md
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
from bench.steps import (copy_bandwidth, kv_bytes_per_token, vanilla_step_seconds,  # noqa: E402
                         weight_bytes_read)

PROFILED_STEPS = 5
# Kernel-name fragments -> group, first match wins (Triton kernels keep their function
# names; cuBLAS/cuTLASS GEMMs carry one of the GEMM fragments).
GROUPS = (
    ("attention: split", ("_verify_split_kernel",)),
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


def kernel_times(model, cache) -> dict[str, tuple[float, int]]:
    """Device seconds per step and kernel launches per step, by group."""
    from torch.profiler import ProfilerActivity, profile

    from vegas_core.attention import AttentionMeta

    net, b = model.net, cache.batch_size
    tokens = torch.randint(0, model.config.vocab_size, (b, 1), device=model.device)
    positions = cache.lengths[:, None].clone()

    def step():
        hidden = net(tokens, positions, cache, AttentionMeta.full(positions, cache.max_len,
                                                                    model.config.window))
        return net.logits(hidden[:, -1])

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
    p.add_argument("--out", default="docs/results/step-breakdown-h200.md")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("this benchmark needs a CUDA GPU")
    import triton

    from vegas_core import load_model

    bandwidth = copy_bandwidth()
    model = load_model(f"dummy:{args.model}", device="cuda", dtype="bfloat16")
    wbytes = weight_bytes_read(model.net)
    per_token = kv_bytes_per_token(model.config)
    lines = [
        f"# A vanilla decode step, kernel by kernel ({args.model}, bf16, random weights)",
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
            cache = model.net.new_cache(b, ctx + 8)
            gen = torch.Generator(device="cuda").manual_seed(ctx + b)
            for layer in range(model.config.num_layers):
                cache.k[layer].normal_(generator=gen)
                cache.v[layer].normal_(generator=gen)
            cache.lengths.fill_(ctx)
            kv = per_token * b * ctx
            floor = (wbytes + kv) / bandwidth
            graph_step = vanilla_step_seconds(model, cache)
            groups = kernel_times(model, cache)
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
                elif g == "attention: split":
                    frac = f"{kv / t / bandwidth:.2f} (with merge {kv / attention / bandwidth:.2f})"
                lines.append(f"| {g} | {n} | {1e3 * t:.3f} | {t / graph_step:.1%} | {frac} |")
            lines.append("")
            write_atomic(out, "\n".join(lines) + "\n")
            print("\n".join(lines[-len(groups) - 6:]), flush=True)
            del cache
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
