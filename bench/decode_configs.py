"""Which launch configuration brings single-row decode attention nearest its floor?

Sweeps the split kernel's launch knobs (RESIDENT_PER_SM, the programs per SM of a wave,
which the split count fills; tile width BLOCK_N; warps; pipeline stages; ``--splits``) for
one layer of a real shape, timing decode (1 row) and verify (``--verify-rows``) attention,
plain and with Collect-2-Query fused logit scores, against the K+V bytes /
copy-bandwidth floor of the same run, and the split-merge kernel alone. Each configuration is first
checked against the float32 reference. The rules of ``vegas_kernels/launch.py`` are
patched for the sweep only; the winner is what that module should ship.

    python bench/decode_configs.py --out runs/decode-configs-h200.md
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import shlex
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vegas_kernels.launch as launch  # noqa: E402
import vegas_kernels.split_merge as split_merge  # noqa: E402
import vegas_kernels.verify_attention as va  # noqa: E402
from bench.kernels import SHAPES, copy_bandwidth, median_us  # noqa: E402


@contextlib.contextmanager
def launch_constants(**constants):
    """``vegas_kernels.launch``'s rules (constants or functions) set for the block, then
    restored (also when the block fails)."""
    saved = {name: getattr(launch, name) for name in constants}
    for name, value in constants.items():
        setattr(launch, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(launch, name, value)


def checked(q, k, v, pos, ctx) -> float:
    out, _, _ = va.verify_attention(q, k, v, pos, ctx)
    ref, _, _ = va.reference_verify_attention(q.float(), k.float(), v.float(), pos, ctx)
    return (out.float() - ref).abs().max().item()


def merge_only_us(batch, kv_heads, heads, dim, rows, splits, max_lanes=None) -> float:
    """The merge kernel on partials of the split count a decode launch would use."""
    g = heads // kv_heads
    acc, maxes, sums, live = split_merge.split_buffers(batch, kv_heads, splits, g * rows, dim,
                                                       "cuda")
    acc.normal_()
    maxes.normal_()
    sums.uniform_(1, 2)
    live.fill_(splits)
    out = torch.empty(batch, rows, heads, dim, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(batch, rows, heads, device="cuda")
    with launch_constants(MERGE_MAX_LANES=max_lanes or launch.MERGE_MAX_LANES):
        return median_us(lambda: split_merge.merge_partials((acc, maxes, sums, live), out,
                                                            lse, kv_heads, g, rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--ctx", nargs="+", type=int, default=[32768, 65536])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--verify-rows", type=int, default=7)
    p.add_argument("--resident-per-sm", nargs="+", type=int, default=[1, 2, 3, 4])
    p.add_argument("--block-n", nargs="+", type=int, default=[32, 64, 128])
    p.add_argument("--warps", nargs="+", type=int, default=[4, 8])
    p.add_argument("--stages", nargs="+", type=int, default=[2, 3, 4])
    p.add_argument("--splits", nargs="+", type=int, default=[0],
                   help="split counts to time (0: the shipped rule, splits_for)")
    p.add_argument("--merge-lanes", nargs="+", type=int, default=[16, 32, 64, 128],
                   help="merge-alone timings for these MERGE_MAX_LANES caps")
    p.add_argument("--out", default="runs/decode-configs.md")
    args = p.parse_args()
    import triton

    heads, kv_heads, dim = SHAPES[args.shape]
    bandwidth = copy_bandwidth()
    shipped = (launch.RESIDENT_PER_SM, launch.tile_slots(dim), launch.SPLIT_WARPS,
               launch.split_stages(dim))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        f"# Decode/verify launch configurations ({args.shape}: {heads} heads, {kv_heads} KV "
        f"heads, dim {dim}; one layer, bf16)",
        "",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}",
        f"- Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- Copy bandwidth measured in this run: {bandwidth / 1e12:.2f} TB/s (read + write).",
        f"- Shipped configuration (resident/SM, BLOCK_N, warps, stages): {shipped}; "
        "best rows add the split count.",
        "- Per-call microseconds (bench/kernels.py's median_us: many calls per graph "
        "replay); ratios to the K+V floor of the same run.",
        "",
        f"| ctx | batch | resident/SM | BLOCK_N | warps | stages | splits | decode | "
        f"/floor | verify-{args.verify_rows} | +fused scores | verify/decode | merge alone | "
        "max abs err |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]

    def flush() -> None:
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        tmp.replace(out)

    gen = torch.Generator(device="cuda").manual_seed(0)
    for ctx, batch in itertools.product(args.ctx, args.batch):
        k = torch.randn(batch, kv_heads, ctx, dim, device="cuda", generator=gen).bfloat16()
        v = torch.randn(batch, kv_heads, ctx, dim, device="cuda", generator=gen).bfloat16()
        rows = args.verify_rows
        qv = torch.randn(batch, rows, heads, dim, device="cuda", generator=gen).bfloat16()
        q1 = qv[:, -1:].contiguous()
        posv = torch.arange(ctx - rows, ctx, device="cuda").expand(batch, -1).contiguous()
        pos1 = posv[:, -1:].contiguous()
        # Collect-2-Query: the first and last window rows' fused logit scores.
        weights = torch.zeros(batch, rows, device="cuda")
        weights[:, [0, -1]] = 1.0
        floor_us = 2 * k.numel() * k.element_size() / bandwidth * 1e6
        best = None
        for resident, bn, warps, stages, fixed in itertools.product(
                args.resident_per_sm, args.block_n, args.warps, args.stages, args.splits):
            row = f"| {ctx} | {batch} | {resident} | {bn} | {warps} | {stages} |"
            with launch_constants(RESIDENT_PER_SM=resident, SPLIT_WARPS=warps,
                                  SPLIT_STAGES=stages, tile_slots=lambda d, bn=bn: bn):
                splits = fixed or launch.splits_for(torch.device("cuda"), batch * kv_heads,
                                                    ctx, bn)
                try:
                    err = checked(q1[:2], k[:2, :, :4096], v[:2, :, :4096],
                                  pos1[:2] - ctx + 4096, 4096)
                    decode = median_us(lambda: va.verify_attention(q1, k, v, pos1, ctx,
                                                                   splits=splits))
                    verify = median_us(lambda: va.verify_attention(qv, k, v, posv, ctx,
                                                                   splits=splits))
                    fused = median_us(lambda: va.verify_attention(qv, k, v, posv, ctx, weights,
                                                                  splits=splits))
                    merge = merge_only_us(batch, kv_heads, heads, dim, 1, splits)
                except Exception as exc:  # e.g. out of shared memory for a wide tile
                    lines.append(f"{row} {splits} | failed: {type(exc).__name__} | | | | | | |")
                    print(lines[-1], flush=True)
                    continue
            lines.append(f"{row} {splits} | {decode:.1f} | {decode / floor_us:.2f} | "
                         f"{verify:.1f} | {fused:.1f} ({fused / verify - 1:+.0%}) | "
                         f"{verify / decode:.2f} | {merge:.1f} | {err:.1e} |")
            print(lines[-1], flush=True)
            flush()
            if best is None or decode < best[0]:
                best = (decode, resident, bn, warps, stages, splits)
        if best is not None:
            lines.append(f"| {ctx} | {batch} | **best** {best[1:]} | | | | | "
                         f"**{best[0]:.1f}** | **{best[0] / floor_us:.2f}** | | | | | |")
        splits = launch.splits_for(torch.device("cuda"), batch * kv_heads, ctx,
                                   launch.tile_slots(dim))  # shipped
        merges = ", ".join(
            f"{lanes} lanes {merge_only_us(batch, kv_heads, heads, dim, 1, splits, lanes):.1f}"
            for lanes in args.merge_lanes)
        lines.append(f"| {ctx} | {batch} | merge alone at {splits} splits, by lane cap: {merges} "
                     "| | | | | | | | | | | |")
        flush()
        k = v = qv = q1 = None  # free the cache before the next shape
        torch.cuda.empty_cache()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
