"""Linear layers of a few rows: vegas_kernels.gemv against cuBLAS (``F.linear``), at a
dense model's projection shapes, bf16.

For each projection (qkv, o, gate/up with its SiLU multiply, down, LM head) and row
count: distinct weights run back to back in one CUDA graph, enough of them that none is
still in L2 when its turn comes (as in a decode step, where every layer has its own), and
the replay's median divided by the number of products. cuBLAS's gate/up is timed with the
engine's ``silu_mul`` after it, as the model runs it. 'of bandwidth' is weight bytes /
time / the device-to-device copy bandwidth measured in the same run. Each kernel is
checked against a float32 reference on fresh random inputs before it is timed.

    python bench/gemv.py --model qwen3-8b llama-3.1-8b --rows 1 8 16 --out runs/gemv-h200.md
    python bench/gemv.py --model qwen3-8b --rows 1 8 --sweep   # tile settings, best first
"""

from __future__ import annotations

import argparse
import itertools
import math
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.acceptance import write_atomic  # noqa: E402
from bench.kernels import calls_median_us, copy_bandwidth  # noqa: E402
from vegas_core.config import preset_config  # noqa: E402
from vegas_kernels.gemv import (gemv, gemv_silu_mul, reference_gemv,  # noqa: E402
                                reference_gemv_silu_mul)
from vegas_kernels.launch import GemvConfig, gemv_config  # noqa: E402
from vegas_kernels.layer_ops import silu_mul  # noqa: E402

# Weights cycled through per graph: at least this many bytes, several times the H200's
# 50 MB L2, so each product reads its weight from HBM.
ROTATION_BYTES = 400 << 20
MIN_CALLS_PER_GRAPH = 48
CHECK_TOLERANCE = 2e-2  # bf16 output rounding, relative to the output's scale
SWEEP = [GemvConfig(n, k, w, s) for n, k, w, s in itertools.product(
    (16, 32, 64), (64, 128, 256, 512), (4, 8), (3, 4, 5))]


def projections(model: str) -> dict[str, tuple[int, int, bool]]:
    """name -> (N, K, silu): the weight shapes of one layer and the LM head."""
    c = preset_config(model)
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return {"qkv": (q + 2 * kv, c.hidden_size, False), "o": (c.hidden_size, q, False),
            "gate_up + silu": (2 * c.intermediate_size, c.hidden_size, True),
            "down": (c.hidden_size, c.intermediate_size, False),
            "lm_head": (c.vocab_size, c.hidden_size, False)}


def check(n: int, k: int, silu: bool, rows: int, config: GemvConfig | None) -> float:
    """Largest error of the kernel against the float32 reference, over the output's scale."""
    g = torch.Generator(device="cuda").manual_seed(n + k + rows)
    x = torch.randn(rows, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / math.sqrt(k)).bfloat16()
    if silu:
        out, ref = gemv_silu_mul(x, w, config=config), reference_gemv_silu_mul(x.float(), w.float())
    else:
        out, ref = gemv(x, w, config=config), reference_gemv(x.float(), w.float())
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def time_projection(n: int, k: int, silu: bool, rows: int,
                    configs: list[GemvConfig | None]) -> tuple[float, list[float]]:
    """-> (cuBLAS us, [gemv us per config]) per product."""
    nbytes = n * k * 2
    copies = max(2, math.ceil(ROTATION_BYTES / nbytes))
    weights = [torch.randn(n, k, device="cuda").bfloat16() for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda").bfloat16()
    calls = max(copies, MIN_CALLS_PER_GRAPH)
    order = [weights[i % copies] for i in range(calls)]
    if silu:
        cublas = [lambda w=w: silu_mul(F.linear(x, w)) for w in order]
    else:
        cublas = [lambda w=w: F.linear(x, w) for w in order]
    base = calls_median_us(cublas)
    ours = []
    for c in configs:
        kernel = gemv_silu_mul if silu else gemv
        ours.append(calls_median_us([lambda w=w: kernel(x, w, config=c) for w in order]))
    del weights
    torch.cuda.empty_cache()
    return base, ours


def main() -> None:
    import triton
    from triton.runtime.errors import OutOfResources

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", nargs="+", default=["qwen3-8b"], help="dummy presets")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    p.add_argument("--sweep", action="store_true", help="time every tile setting in SWEEP")
    p.add_argument("--out", type=Path, help="write the markdown table here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: bench/gemv.py needs a CUDA GPU")
    bandwidth = copy_bandwidth()
    lines = ["# Linear layers of a few rows: gemv against cuBLAS (bf16)", "",
             f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; "
             f"triton {triton.__version__}",
             f"- Command: `python {shlex.join(sys.argv)}`",
             f"- Copy bandwidth measured in this run: {bandwidth / 1e12:.2f} TB/s (read + write).",
             "- Per product, microseconds: median of CUDA-graph replays of distinct weights "
             "back to back; 'of bw': weight bytes / time / copy bandwidth.", ""]
    for model in args.model:
        lines += [f"## {model}", "", "| projection | N x K | rows | cuBLAS us | of bw | gemv us "
                  "| of bw | cuBLAS / gemv | config |", "| --- | --- | --- | --- | --- | --- | "
                  "--- | --- | --- |"]
        for name, (n, k, silu) in projections(model).items():
            for rows in args.rows:
                configs = SWEEP if args.sweep else [gemv_config(n // 2 if silu else n, k)]
                fitting = []
                for c in configs:
                    try:
                        err = check(n, k, silu, rows, c)
                    except OutOfResources:  # a sweep's tile of too many stages
                        continue
                    if err > CHECK_TOLERANCE:
                        sys.exit(f"error: gemv {name} {n}x{k}, {rows} rows, {c}: error {err:.3g}")
                    fitting.append(c)
                configs = fitting
                base, ours = time_projection(n, k, silu, rows, configs)
                ranked = sorted(zip(ours, configs), key=lambda t: t[0])
                best_us, best = ranked[0]
                gbytes = n * k * 2 / bandwidth * 1e6  # us at copy bandwidth
                lines.append(f"| {name} | {n} x {k} | {rows} | {base:.1f} | {gbytes / base:.2f} | "
                             f"{best_us:.1f} | {gbytes / best_us:.2f} | {base / best_us:.2f}x | "
                             f"{best.block_n}/{best.block_k}/{best.num_warps}w/{best.num_stages}s |")
                print(lines[-1], flush=True)
                if args.sweep:
                    for us, c in ranked[1:6]:
                        print(f"    next: {us:.1f} us {c}", flush=True)
        lines.append("")
    if args.out:
        write_atomic(args.out, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
