"""Prefill throughput and memory on the fused prefill path, against a bf16 matmul.

Random weights of a real model's shape (bf16), random prompt ids. Measured in one run:

- the rate of a bf16 ``n x n x n`` matmul (median of timed products after warm-up), before
  and after the batch prefill: the faster is the ceiling the model FLOPs utilisation
  (MFU) is taken against;
- the prefill of ``--batch`` prompts of ``--ctx`` tokens into a fresh KV cache (one timed
  run after an untimed short prefill of the same batch, which compiles the kernels):
  model FLOPs = 2 x linear parameters per token (q/k/v, o, gate/up, down) + causal
  attention 4 x heads x head_dim x (visible keys) per query and layer (QK^T and PV; a
  causal block counts the keys each row sees, not the full square); MFU = (model FLOPs
  / seconds) / matmul rate;
- memory of one sequence's prefill at several contexts: the peak allocated beyond the
  weights and the KV cache. Growth with the square of the context would show as a ratio
  of 4 per doubling; a linear one as 2;
- the same single-sequence prefill in chunks with a prefix (``--chunk`` rows per
  forward), and on the PyTorch reference attention (``--reference-ctx``) for a same-run
  ratio.

    python bench/prefill.py --out runs/prefill-h200
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.acceptance import hardware, with_ext, write_atomic  # noqa: E402
from bench.end_to_end import versions  # noqa: E402
from vegas_core import load_model  # noqa: E402
from vegas_core.attention import ATTENTION_ENV  # noqa: E402
from vegas_core.prefill import prefill, prefill_budget  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def matmul_rate(n: int, dtype: torch.dtype, repeats: int = 10) -> float:
    a = torch.randn(n, n, device="cuda", dtype=dtype)
    b = torch.randn(n, n, device="cuda", dtype=dtype)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * n**3 / statistics.median(times)


def model_flops(config, batch: int, ctx: int) -> dict:
    """FLOPs of prefilling ``batch`` prompts of ``ctx`` tokens (the LM head of the last
    row excluded: it is one row per sequence)."""
    c = config
    d, hd = c.hidden_size, c.head_dim
    linear_params = c.num_layers * (d * (c.num_heads + 2 * c.num_kv_heads) * hd
                                    + c.num_heads * hd * d + 3 * d * c.intermediate_size)
    linear = 2 * linear_params * batch * ctx
    visible_keys = ctx * (ctx + 1) / 2  # query at position p sees p + 1 keys
    attention = 4 * c.num_heads * hd * visible_keys * c.num_layers * batch
    return dict(linear=linear, attention=attention, total=linear + attention)


def random_prompts(vocab: int, batch: int, ctx: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, ctx), generator=g).tolist()


def timed_prefill(model, prompts, capacity: int, chunk: int | None = None) -> dict:
    """One prefill into a fresh cache: seconds, the peak memory beyond the cache, and
    the tokens per forward the schedule chose beside that cache."""
    cache = model.net.new_cache(len(prompts), capacity)
    tokens_per_forward = prefill_budget(model)[1]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    prefill(model, prompts, cache, chunk=chunk)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base
    del cache
    gc.collect()
    torch.cuda.empty_cache()
    return dict(seconds=seconds, peak_extra_bytes=peak, tokens_per_forward=tokens_per_forward)


def run(args) -> dict:
    if not torch.cuda.is_available():
        raise SystemExit("error: bench/prefill.py needs a CUDA GPU")
    log("matmul rate")
    rate = matmul_rate(args.matmul_n, torch.bfloat16)
    log(f"bf16 matmul {args.matmul_n}^3: {rate / 1e12:.0f} TFLOP/s")
    rates = [rate]
    model = load_model(f"dummy:{args.model}", device="cuda", dtype="bfloat16")
    c = model.config
    data = dict(meta=dict(hardware=hardware(), versions=versions(), model=args.model,
                          date=time.strftime("%Y-%m-%d"), args=vars(args),
                          command="python " + " ".join(shlex.quote(a) for a in sys.argv)),
                matmul_tflops=rate / 1e12)

    # The headline: batch x ctx in one call, after a short untimed prefill that compiles.
    prefill(model, random_prompts(c.vocab_size, args.batch, 1024, 1),
            model.net.new_cache(args.batch, 1024))
    gc.collect()
    torch.cuda.empty_cache()
    prompts = random_prompts(c.vocab_size, args.batch, args.ctx, 0)
    log(f"prefill {args.batch} x {args.ctx}")
    timed = timed_prefill(model, prompts, args.ctx + 256)
    flops = model_flops(c, args.batch, args.ctx)
    achieved = flops["total"] / timed["seconds"]
    data["batch_prefill"] = dict(batch=args.batch, ctx=args.ctx, **timed, flops=flops,
                                 tflops=achieved / 1e12, mfu=achieved / rate,
                                 tokens_per_second=args.batch * args.ctx / timed["seconds"])
    # Again with the clocks where a long run leaves them: MFU against the faster of the two.
    rates.append(matmul_rate(args.matmul_n, torch.bfloat16))
    rate = max(rates)
    data["matmul_tflops"] = rate / 1e12
    data["matmul_tflops_before_after"] = [r / 1e12 for r in rates]
    data["batch_prefill"]["mfu"] = achieved / rate
    log(f"  {timed['seconds']:.1f}s, {achieved / 1e12:.0f} TFLOP/s = {achieved / rate:.1%} of "
        f"the matmul ({', '.join(f'{r / 1e12:.0f}' for r in rates)} TFLOP/s before and "
        f"after); peak beyond the cache {timed['peak_extra_bytes'] / 2**30:.2f} GiB")

    data["memory"] = []
    for ctx in args.memory_ctx:
        one = random_prompts(c.vocab_size, 1, ctx, 2)
        row = dict(ctx=ctx, **timed_prefill(model, one, ctx + 256))
        row["tflops"] = model_flops(c, 1, ctx)["total"] / row["seconds"] / 1e12
        data["memory"].append(row)
        log(f"  one sequence of {ctx}: {row['seconds']:.2f}s, peak beyond the cache "
            f"{row['peak_extra_bytes'] / 2**30:.2f} GiB")
    ctx = max(args.memory_ctx)
    one = random_prompts(c.vocab_size, 1, ctx, 2)
    chunked = timed_prefill(model, one, ctx + 256, chunk=args.chunk)
    chunked["tflops"] = model_flops(c, 1, ctx)["total"] / chunked["seconds"] / 1e12
    data["chunked"] = dict(ctx=ctx, chunk=args.chunk, **chunked)
    log(f"  one sequence of {ctx} in chunks of {args.chunk}: {chunked['seconds']:.2f}s")

    if args.reference_ctx:
        ref_prompt = random_prompts(c.vocab_size, 1, args.reference_ctx, 3)
        fused = timed_prefill(model, ref_prompt, args.reference_ctx + 256)
        os.environ[ATTENTION_ENV] = "reference"
        try:
            reference = timed_prefill(model, ref_prompt, args.reference_ctx + 256)
        finally:
            os.environ.pop(ATTENTION_ENV)
        data["reference"] = dict(ctx=args.reference_ctx, fused=fused, reference=reference)
        log(f"  reference attention at {args.reference_ctx}: {reference['seconds']:.2f}s "
            f"against {fused['seconds']:.2f}s fused")
    return data


def summarize(data: dict) -> str:
    m, b = data["meta"], data["batch_prefill"]
    gib = 2**30
    lines = [
        f"# Prefill on the fused path: dummy {m['model']}",
        "",
        f"- Hardware: {m['hardware']}; torch {m['versions']['torch']}, triton "
        f"{m['versions']['triton']}; date {m['date']}.",
        f"- Command: `{m['command']}`",
        "- Model FLOPs: 2 x linear parameters per token + causal attention 4 x heads x "
        "head_dim x visible keys per query and layer (LM head excluded). MFU: achieved "
        f"FLOP/s / the rate of a bf16 {m['args']['matmul_n']}^3 matmul measured in the same "
        f"run, before and after the batch prefill, the faster of the two "
        f"({' and '.join(f'{r:.0f}' for r in data['matmul_tflops_before_after'])} TFLOP/s).",
        "",
        "## Batch prefill",
        "",
        "| prompts x tokens | tokens per forward | seconds | tokens/s | linear PFLOP | "
        "attention PFLOP | TFLOP/s | MFU | peak beyond cache |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {b['batch']} x {b['ctx']} | {b['tokens_per_forward']} | {b['seconds']:.1f} | "
        f"{b['tokens_per_second']:,.0f} | {b['flops']['linear'] / 1e15:.1f} | "
        f"{b['flops']['attention'] / 1e15:.1f} | {b['tflops']:.0f} | {b['mfu']:.1%} | "
        f"{b['peak_extra_bytes'] / gib:.2f} GiB |",
        "",
        "## Memory of one sequence's prefill",
        "",
        "| ctx | seconds | TFLOP/s | peak beyond cache | ratio to the previous ctx |",
        "| --- | --- | --- | --- | --- |",
    ]
    prev = None
    for r in data["memory"]:
        ratio = f"{r['peak_extra_bytes'] / prev:.2f}" if prev else "-"
        lines.append(f"| {r['ctx']} | {r['seconds']:.2f} | {r['tflops']:.0f} | "
                     f"{r['peak_extra_bytes'] / gib:.2f} GiB | {ratio} |")
        prev = r["peak_extra_bytes"]
    ch = data["chunked"]
    lines += ["", f"In chunks of {ch['chunk']} rows with the prefix in the cache (FlashAttention "
              f"with the lower-right causal mask): {ch['ctx']} tokens in {ch['seconds']:.2f}s, "
              f"{ch['tflops']:.0f} TFLOP/s, peak beyond the cache "
              f"{ch['peak_extra_bytes'] / gib:.2f} GiB."]
    if "reference" in data:
        r = data["reference"]
        lines += ["", f"Reference attention (masked PyTorch, 512-row chunks) at {r['ctx']} "
                  f"tokens: {r['reference']['seconds']:.2f}s against {r['fused']['seconds']:.2f}s "
                  f"fused ({r['reference']['seconds'] / r['fused']['seconds']:.1f}x)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=65536)
    p.add_argument("--memory-ctx", type=int, nargs="+", default=[16384, 32768, 65536])
    p.add_argument("--chunk", type=int, default=8192)
    p.add_argument("--reference-ctx", type=int, default=16384,
                   help="also prefill one sequence this long on the reference (0: skip)")
    p.add_argument("--matmul-n", type=int, default=8192)
    p.add_argument("--out", default="runs/prefill")
    args = p.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = run(args)
    write_atomic(with_ext(out, ".json"), json.dumps(data, indent=1))
    write_atomic(with_ext(out, ".md"), summarize(data))
    print(with_ext(out, ".md").read_text())


if __name__ == "__main__":
    main()
