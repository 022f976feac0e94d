"""Registers, spills and shared memory of the verify/decode split kernel, compiled for an
NVIDIA GPU on a machine without one.

Why: the fused scores' cost moved by 10% and more between commits whose kernel code
differs little (docs/results/verify-scores-h200.md as of commit 8cc220d, in git
history). Registers, spills and shared memory (which sets how many programs an SM
holds) are the first suspects, and they can be read here, before device time is spent
timing a variant. Nothing is launched or timed.

How: ``verify_attention`` of the chosen module is called on CPU tensors of the model's
shape, with Triton's active driver replaced by one that names the target GPU. Triton's
own launcher then specialises every argument as it would on that GPU (integer values of
1, divisibility by 16), and a pre-compile hook hands the result to ``triton.compile``
instead of launching. ``cuobjdump`` (shipped with Triton) reads the cubin's resource
usage.

    python bench/kernel_resources.py --shapes smollm2-135m --rows 1 7 9 11
    git show f08609b:kernels/verify_attention.py > /tmp/old.py
    python bench/kernel_resources.py --module /tmp/old.py --rows 7

The figures depend on the installed Triton (its compiler and bundled ptxas): install the
GPU machine's version (``pip install --target DIR triton==X``, then PYTHONPATH=DIR) to see
what it compiles.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import os
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from bench.acceptance import with_ext, write_atomic  # noqa: E402
from bench.kernels import SHAPES  # noqa: E402  (heads, KV heads, head dim)
from vegas_kernels import launch as launch_rules  # noqa: E402

# The H200's streaming multiprocessors: the split count (one wave of programs) depends on
# it, and a split count of 1 is specialised into the kernel.
H200_SMS = 132
H200_ARCH = 90
# Prefix slots of the compiled launch: the kernel reads only strides and a runtime
# length, so this sets the split count, not the code.
DEFAULT_CTX = 8192
RESOURCE_FIELDS = ("REG", "STACK", "SHARED", "LOCAL")
# What Triton's pre-compile hook reports of the launch options.
LAUNCH_OPTIONS = ("num_warps", "num_ctas", "num_stages", "enable_fp_fusion",
                  "launch_cooperative_grid")


class _TargetDriver:
    """Stands in for Triton's CUDA driver: names the target and a device, launches nothing."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


def parse_resource_usage(text: str) -> dict[str, int]:
    """The first function's REG / STACK / SHARED / LOCAL from ``cuobjdump
    --dump-resource-usage`` output."""
    found = {}
    for field in RESOURCE_FIELDS:
        match = re.search(rf"\b{field}:(\d+)", text)
        if match is None:
            raise ValueError(f"no {field} in cuobjdump's resource usage: {text[:200]!r}")
        found[field] = int(match.group(1))
    return found


def resource_usage(cubin: bytes) -> dict[str, int]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(tool), "--dump-resource-usage", str(path)],
                             capture_output=True, text=True, check=True).stdout
    return parse_resource_usage(out)


def load_module(path: str | None = None):
    """A fresh copy of ``verify_attention`` (this checkout's, or the file at ``path``),
    its kernels compiled ones even where TRITON_INTERPRET is set: an interpreted kernel
    would run on the CPU instead of compiling. Triton's own library functions (tl.zeros)
    follow the setting of the moment Triton was imported, so compile in a process that
    imported it without TRITON_INTERPRET (the tests do, in a subprocess)."""
    path = path or str(ROOT / "vegas_kernels" / "verify_attention.py")
    previous = triton.knobs.runtime.interpret
    triton.knobs.runtime.interpret = False
    try:
        spec = importlib.util.spec_from_file_location("verify_attention_compiled", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        triton.knobs.runtime.interpret = previous
    return module


def compile_split_kernel(module, shape, batch: int, rows: int, ctx: int, fused: bool,
                         target: GPUTarget, sms: int):
    """The split kernel ``module.verify_attention`` launches for this shape, compiled for
    ``target``: (compiled kernel, its constexprs, the split count)."""
    h, h_kv, d = shape
    q = torch.zeros(batch, rows, h, d, dtype=torch.bfloat16)
    k = torch.zeros(batch, h_kv, ctx, d, dtype=torch.bfloat16)
    positions = (ctx - rows + torch.arange(rows)).expand(batch, rows).contiguous()
    weights = torch.zeros(batch, rows) if fused else None
    # A module from before vegas_kernels.launch holds its own rules.
    rules = module if hasattr(module, "tile_slots") else launch_rules
    block_n = rules.tile_slots(d)
    # splits_for's rule, with the target's SM count rather than a CUDA device's (a module
    # from before split_count: its one-wave rule).
    tiles = -(-ctx // block_n)
    if hasattr(rules, "split_count"):
        splits = rules.split_count(batch * h_kv, tiles, sms)
    else:
        splits = max(1, min(rules.RESIDENT_PER_SM * sms // (batch * h_kv), tiles))
    captured = []

    def keep(*, fn, compile, **_):
        if fn.name == "_verify_split_kernel" and not captured:
            captured.append(compile)
        return True  # skip Triton's own compile and the launch: compiled below

    # The private slot, not ``.active``: reading that creates the real driver, which fails
    # on a machine without a GPU.
    previous_driver = triton.runtime.driver._active
    previous_hook = triton.knobs.runtime.jit_cache_hook
    triton.runtime.driver.set_active(_TargetDriver(target))
    triton.knobs.runtime.jit_cache_hook = keep
    try:
        module.verify_attention(q, k, k, positions, ctx, weights, splits=splits)
    except Exception:
        # What runs after the split kernel (the merge, on outputs never written) may fail
        # on CPU tensors; only a failure before it matters.
        if not captured:
            raise
    finally:
        triton.runtime.driver._active = previous_driver
        triton.knobs.runtime.jit_cache_hook = previous_hook
    (launch,) = captured
    fn = module._verify_split_kernel
    source = triton.compiler.ASTSource(fn, launch["signature"], launch["constants"],
                                       launch["configs"][0])
    options = {name: launch[name] for name in LAUNCH_OPTIONS}
    kernel = triton.compile(source, target=target, options=options)
    names = {p.name for p in fn.params if p.is_constexpr}
    constexprs = {fn.arg_names[i[0]]: v for i, v in launch["constants"].items()
                  if fn.arg_names[i[0]] in names}
    if constexprs["COLLECT"] != fused:
        raise RuntimeError(f"captured a launch with COLLECT={constexprs['COLLECT']}")
    return kernel, constexprs, splits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), nargs="+", default=["smollm2-135m"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 7, 9, 11],
                        help="verify window rows (gamma + 1); 1 is a decode step")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--ctx", type=int, default=DEFAULT_CTX)
    parser.add_argument("--module", help="another verify_attention.py (default: this checkout's)")
    parser.add_argument("--arch", type=int, default=H200_ARCH, help="compute capability, e.g. 90")
    parser.add_argument("--sms", type=int, default=H200_SMS, help="the GPU's SM count")
    parser.add_argument("--out", type=Path, help="path without suffix: writes OUT.md")
    args = parser.parse_args(argv)
    if args.module and not Path(args.module).is_file():
        parser.error(f"--module {args.module}: no such file (give a verify_attention.py, e.g. "
                     "one written by `git show <commit>:vegas_kernels/verify_attention.py`)")

    module = load_module(args.module)
    target = GPUTarget("cuda", args.arch, 32)
    lines = [f"# Split-kernel resources: sm_{args.arch}, {args.ctx} slots, compiled without a GPU",
             "",
             f"- Module: {args.module or 'vegas_kernels/verify_attention.py'}; "
             f"triton {triton.__version__}; torch {torch.__version__}",
             f"- Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
             "- REG: registers per thread; STACK: bytes of stack per thread (spills); "
             "dynamic shared: the shared memory (bytes) Triton allocates per program.",
             "",
             "| shape | batch | rows | scores | splits | tile (M x N) | warps / stages | REG "
             "| STACK | dynamic shared |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    print("\n".join(lines), flush=True)
    for name, batch, rows in itertools.product(args.shapes, args.batch, args.rows):
        for fused in ([False, True] if rows > 1 else [False]):
            kernel, constexprs, splits = compile_split_kernel(
                module, SHAPES[name], batch, rows, args.ctx, fused, target, args.sms)
            usage = resource_usage(kernel.asm["cubin"])
            meta = kernel.metadata
            row = (f"| {name} | {batch} | {rows} | {'fused' if fused else 'none'} | {splits} | "
                   f"{constexprs['BLOCK_M']} x {constexprs['BLOCK_N']} | "
                   f"{meta.num_warps} / {meta.num_stages} | {usage['REG']} | "
                   f"{usage['STACK']} | {meta.shared} |")
            lines.append(row)
            print(row, flush=True)
    if args.out:
        write_atomic(with_ext(args.out, ".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.exit(main())
