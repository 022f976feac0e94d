"""Attention kernels against the memory-bandwidth floor, one layer of a real shape.

For each (ctx, batch): the device-to-device copy bandwidth measured in the same run;
single-row decode attention (ours, PyTorch SDPA); a 9-row verify (ours, ours with fused
Collect-2-Query scores, SDPA); the deferred Collect-2-Query weight scores after a verify
(``collect_scores``, as a ratio to the 9-row verify); the 9-row verify keeping the edge
rows' logits plus ``edge_weight_scores`` (the same weight scores without reading K again);
a 5% sparse draft (ours; PyTorch gather + SDPA). Every figure is a median over CUDA-event
timings after warm-up, reported as microseconds and as a ratio. Kernels are first checked
against the float32 reference on fresh inputs.

    python bench/kernels.py --out runs/kernels-h200.md
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vegas_kernels.collect_scores import (collect_scores, edge_weight_scores,  # noqa: E402
                                          reference_collect_scores)
from vegas_kernels.sparse_attention import (reference_sparse_attention,  # noqa: E402
                                            sparse_attention)
from vegas_kernels.verify_attention import (reference_verify_attention,  # noqa: E402
                                            verify_attention)

SHAPES = {"qwen3-8b": (32, 8, 128), "llama-3.1-8b": (32, 8, 128),  # heads, kv heads, dim
          "smollm2-135m": (9, 3, 64)}
WARMUP, REPEATS = 5, 30
CALLS_PER_GRAPH = 20


def median_us(fn) -> float:
    """Median GPU time of one call of ``fn``: CALLS_PER_GRAPH calls captured back to back
    in one CUDA graph, each replay timed with CUDA events and divided by the count. Timing
    a single call per replay would add the graph launch's host latency (about 10 us, and
    jittery) to every figure; in a decode step the kernels run back to back like this."""
    return calls_median_us([fn] * CALLS_PER_GRAPH)


def calls_median_us(calls: list) -> float:
    """Median GPU time per call of ``calls`` (e.g. one product per layer's weight),
    captured back to back in one CUDA graph as ``median_us`` does."""
    for fn in calls[:WARMUP]:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()  # the first replay uploads the graph
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    # Timed directly, not from a graph: a captured copy runs as a slower kernel, and one
    # 2 GB copy has no launch overhead worth removing.
    for _ in range(WARMUP):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPEATS):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * REPEATS / (start.elapsed_time(end) * 1e-3)


def check(heads, kv_heads, dim) -> str:
    g = torch.Generator(device="cuda").manual_seed(0)
    b, ctx, rows = 2, 4096, 9
    q = torch.randn(b, rows, heads, dim, device="cuda", generator=g).bfloat16()
    k = torch.randn(b, kv_heads, ctx, dim, device="cuda", generator=g).bfloat16()
    v = torch.randn(b, kv_heads, ctx, dim, device="cuda", generator=g).bfloat16()
    pos = torch.arange(ctx - rows, ctx, device="cuda").expand(b, -1)
    w = torch.zeros(b, rows, device="cuda")
    w[:, [0, -1]] = 1
    out, lse, scores = verify_attention(q, k, v, pos, ctx, w)
    ref, ref_lse, ref_scores = reference_verify_attention(q.float(), k.float(), v.float(), pos,
                                                          ctx, w)
    e1 = (out.float() - ref).abs().max().item()
    e2 = ((scores - ref_scores).abs().max() / ref_scores.abs().max()).item()
    weights = collect_scores(q, k, pos, w, ctx, lse)
    ref_weights = reference_collect_scores(q.float(), k.float(), pos, w, ctx, ref_lse)
    e4 = ((weights - ref_weights).abs().max() / ref_weights.abs().max()).item()
    _, _, edges = verify_attention(q, k, v, pos, ctx, edge_logits=True)
    from_edges = edge_weight_scores(edges, lse, pos, w, ctx)
    e5 = ((from_edges - ref_weights).abs().max() / ref_weights.abs().max()).item()
    budget = ctx // 20
    idx = torch.stack([torch.randperm(ctx - rows, device="cuda")[:budget] for _ in range(b)])[:, None]
    counts = torch.full((b,), budget, device="cuda")
    tail = torch.full((b,), ctx - rows, device="cuda")
    sp = sparse_attention(q[:, -1:], k, v, pos[:, -1:], idx, counts, tail, budget + rows)
    sref = reference_sparse_attention(q[:, -1:].float(), k.float(), v.float(), pos[:, -1:], idx,
                                      counts, tail)
    e3 = (sp.float() - sref).abs().max().item()
    return (f"bf16 vs float32 reference at ctx 4096, batch 2: verify out max abs error {e1:.2e}, "
            f"fused scores max relative error {e2:.2e}, deferred weight scores max relative "
            f"error {e4:.2e}, edge weight scores max relative error {e5:.2e}, sparse out max "
            f"abs error {e3:.2e}")


def bench(heads, kv_heads, dim, ctx, batch, bandwidth, rows: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    k = torch.randn(batch, kv_heads, ctx, dim, device=dev, dtype=dt)
    v = torch.randn_like(k)
    kv_bytes = 2 * k.numel() * k.element_size()
    floor_us = kv_bytes / bandwidth * 1e6
    r = {"ctx": ctx, "batch": batch, "floor_us": floor_us}
    q9 = torch.randn(batch, rows, heads, dim, device=dev, dtype=dt)
    q1 = q9[:, -1:].contiguous()
    pos9 = torch.arange(ctx - rows, ctx, device=dev).expand(batch, -1).contiguous()
    pos1 = pos9[:, -1:].contiguous()
    w = torch.zeros(batch, rows, device=dev)
    w[:, [0, -1]] = 1
    r["decode_ours"] = median_us(lambda: verify_attention(q1, k, v, pos1, ctx))
    sq1 = q1.transpose(1, 2)
    r["decode_sdpa"] = median_us(lambda: F.scaled_dot_product_attention(sq1, k, v, enable_gqa=True))
    r["verify_ours"] = median_us(lambda: verify_attention(q9, k, v, pos9, ctx))
    r["verify_collect"] = median_us(lambda: verify_attention(q9, k, v, pos9, ctx, w))
    _, lse9, _ = verify_attention(q9, k, v, pos9, ctx)
    r["collect_weights"] = median_us(lambda: collect_scores(q9, k, pos9, w, ctx, lse9))

    def verify_edge_weights():
        _, lse, edges = verify_attention(q9, k, v, pos9, ctx, edge_logits=True)
        return edge_weight_scores(edges, lse, pos9, w, ctx)

    r["verify_edge_weights"] = median_us(verify_edge_weights)
    mask = torch.arange(ctx, device=dev) <= pos9[:, None, :, None]
    sq9 = q9.transpose(1, 2)
    r["verify_sdpa"] = median_us(lambda: F.scaled_dot_product_attention(
        sq9, k, v, attn_mask=mask, enable_gqa=True))
    budget = math.ceil(0.05 * ctx)
    idx = torch.stack([torch.randperm(ctx - rows, device=dev)[:budget].sort().values
                       for _ in range(batch)])[:, None].contiguous()
    counts = torch.full((batch,), budget, device=dev)
    tail = torch.full((batch,), ctx - rows, device=dev)
    r["sparse_ours"] = median_us(lambda: sparse_attention(q1, k, v, pos1, idx, counts, tail,
                                                          budget + rows))
    gather_idx = torch.cat([idx[:, 0], torch.arange(ctx - rows, ctx, device=dev).expand(batch, -1)], 1)

    def gather_sdpa():
        gi = gather_idx[:, None, :, None].expand(-1, kv_heads, -1, dim)
        return F.scaled_dot_product_attention(sq1, k.gather(2, gi), v.gather(2, gi), enable_gqa=True)

    r["sparse_gather_sdpa"] = median_us(gather_sdpa)
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3-8b", choices=sorted(SHAPES))
    p.add_argument("--ctx", nargs="+", type=int, default=[32768, 65536, 131072])
    p.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    p.add_argument("--verify-rows", type=int, default=9,
                   help="rows of the verify window (gamma + 1)")
    p.add_argument("--out", default="runs/kernels.md")
    args = p.parse_args()
    heads, kv_heads, dim = SHAPES[args.shape]
    import triton

    bandwidth = copy_bandwidth()
    lines = [
        f"# Attention kernels vs the bandwidth floor ({args.shape}: {heads} heads, {kv_heads} KV "
        f"heads, dim {dim}; one layer, bf16)",
        "",
        f"- GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; triton {triton.__version__}",
        f"- Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- Copy bandwidth measured in this run: {bandwidth / 1e12:.2f} TB/s (read + write).",
        f"- Floor = K+V bytes of the layer / that bandwidth. Per-call microseconds: median of "
        f"{REPEATS} CUDA-event timings of a CUDA graph holding {CALLS_PER_GRAPH} calls back to "
        f"back, divided by {CALLS_PER_GRAPH} (no host launch latency), after {WARMUP} warm-ups.",
        f"- Correctness: {check(heads, kv_heads, dim)}",
        "",
        f"| ctx | batch | floor | decode ours | decode SDPA | verify-{args.verify_rows} ours | "
        f"+fused scores | verify-{args.verify_rows} SDPA | verify/decode | deferred weight "
        f"scores / verify-{args.verify_rows} | +edge weight scores | sparse 5% ours | "
        "gather+SDPA | sparse/decode |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for ctx in args.ctx:
        for batch in args.batch:
            r = bench(heads, kv_heads, dim, ctx, batch, bandwidth, args.verify_rows)
            lines.append(
                f"| {ctx} | {batch} | {r['floor_us']:.0f} | {r['decode_ours']:.0f} "
                f"({r['decode_ours'] / r['floor_us']:.2f}x floor) | {r['decode_sdpa']:.0f} | "
                f"{r['verify_ours']:.0f} | {r['verify_collect']:.0f} "
                f"(+{100 * (r['verify_collect'] / r['verify_ours'] - 1):.0f}%) | "
                f"{r['verify_sdpa']:.0f} | {r['verify_ours'] / r['decode_ours']:.2f} | "
                f"{r['collect_weights']:.0f} ({r['collect_weights'] / r['verify_ours']:.2f}) | "
                f"{r['verify_edge_weights']:.0f} "
                f"(+{100 * (r['verify_edge_weights'] / r['verify_ours'] - 1):.0f}%) | "
                f"{r['sparse_ours']:.0f} | {r['sparse_gather_sdpa']:.0f} | "
                f"{r['sparse_ours'] / r['decode_ours']:.2f} |")
            print(lines[-1], flush=True)
            torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(out)
    print(text)


if __name__ == "__main__":
    main()
