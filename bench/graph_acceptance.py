"""Do captured draft steps accept what eager ones do? Acceptance by execution mode.

The tuner's measurement (``vegas_tune.measure.Measurer``: its prompts, steady window and
accepted-length count) of each configuration, at each batch size, in these modes:

- ``graphs``: the kernels on static buffers, captured in CUDA graphs (what the tuner and
  ``vegas generate`` run on a GPU);
- ``graphs-merge-launch``: the same, but no split kernel merges in its last program
  (``launch.merges_in_kernel`` answers no): the partials always go to a merge launch,
  and the split counters are never used;
- ``graphs-private-pools``: the same as ``graphs``, but each graph captured into a
  memory pool of its own rather than the workspace's shared one;
- ``graphs-poisoned``: the same as ``graphs``, but the sparse kernel's partials are NaN
  until written, so a merge that read one its launch did not write would show;
- ``eager``: the kernels launched eagerly, sized from the host's lengths
  (``VEGAS_CUDA_GRAPHS=0``);
- ``reference``: the PyTorch reference attention, eagerly (``VEGAS_ATTENTION=reference``).

All compute the same drafts up to the order of floating-point sums, so their mean
accepted lengths must agree within a few hundredths; a mode that accepts less drafts
from something else than the others do, and the variants of ``graphs`` say whether
the last-program merge or the shared pool is involved. Compare modes measured in one
process: processes can differ in their prompts (transformers 5.17.0 tokenized Gemma3's
prompts one way while converting its tokenizer, another from the copy it saved; the
loader now refuses both). A measurement that ``generate``
refuses (a kernel merge left out of phase), or that runs out of memory, is a row of its
own, with the error. Each (batch size, mode) starts from a released workspace: prompts
prefilled again, no graph kept from another mode.

    python bench/graph_acceptance.py --model gemma3-270m --ctx 32000 --batch-sizes 16,128 \\
        --configs streaming:gamma=4,min_tokens=2048,sparsity=0.06 \\
                  vegas:gamma=4,min_tokens=128,sparsity=0.004 --out runs/graph-acceptance
    python bench/graph_acceptance.py --model dummy:tiny --device cpu --dtype float32 \\
        --ctx 200 --batch-sizes 2 --modes eager,reference --configs vegas:gamma=3,min_tokens=16
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shlex
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vegas_core import VegasError, load_model  # noqa: E402
from vegas_core import graphs  # noqa: E402
from vegas_core.schedule import config_words  # noqa: E402
from vegas_kernels import launch, sparse_attention, split_merge  # noqa: E402
from vegas_tune.datasets import load_prompts  # noqa: E402
from vegas_tune.measure import Measurer, Workload, out_of_memory  # noqa: E402
from bench.acceptance import hardware, with_ext, write_atomic  # noqa: E402
from bench.bench_args import add_model_args, add_output_args  # noqa: E402
from bench.schedule_switch import parse_switch_config  # noqa: E402


class _PrivatePoolStepGraph(graphs.StepGraph):
    """A ``StepGraph`` that captures into a pool of its own, whatever pool it is given."""

    def __init__(self, body, device, pool=None):
        super().__init__(body, device, None)


def _poisoned_split_buffers(b, h_kv, splits, rows, d, device):
    """``split_buffers`` filled with NaN (a fill in the graph before every launch): a
    merge that reads a partial its launch did not write turns its rows into NaN."""
    acc, maxes, sums, live = split_merge.split_buffers(b, h_kv, splits, rows, d, device)
    return acc.fill_(float("nan")), maxes.fill_(float("nan")), sums.fill_(float("nan")), live


CAPTURED = {"VEGAS_CUDA_GRAPHS": "auto"}
EAGER = {"VEGAS_CUDA_GRAPHS": "0"}
# Each mode: the environment it sets (unset variables keep the engine's defaults) and the
# (object, attribute, value) it patches while it runs.
MODES = {
    "graphs": (CAPTURED, ()),
    "graphs-merge-launch": (CAPTURED, ((launch, "merges_in_kernel", lambda *a: False),)),
    "graphs-private-pools": (CAPTURED, ((graphs, "StepGraph", _PrivatePoolStepGraph),)),
    # The sparse kernel's partials NaN until written (a fill in the graph before every
    # launch): a merge that read one its launch did not write would turn rows into NaN.
    "graphs-poisoned": (CAPTURED, ((sparse_attention, "split_buffers",
                                    _poisoned_split_buffers),)),
    "eager": (EAGER, ()),
    "reference": ({**EAGER, "VEGAS_ATTENTION": "reference"}, ()),
}


@contextlib.contextmanager
def in_mode(name: str):
    """The engine set up as mode ``name`` runs, and given back as it was."""
    env, patches = MODES[name]
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, env))
        for target, attribute, value in patches:
            stack.enter_context(mock.patch.object(target, attribute, value))
        yield


def measure_modes(model, prompts, batch_sizes, configs, modes, max_new_tokens, seed) -> list[dict]:
    rows = []
    for batch in batch_sizes:
        for mode in modes:
            with in_mode(mode):
                measurer = Measurer(model, Workload(prompts[:batch], batch, max_new_tokens,
                                                    0.0, seed))
                for text, spec in configs:
                    row = {"batch_size": batch, "mode": mode, "config": text}
                    try:
                        m = measurer.measure(spec)
                    except (VegasError, RuntimeError, MemoryError) as e:
                        # A merge fault that generate caught, or a mode out of memory
                        # (private pools take more): a row of its own, and on.
                        if not isinstance(e, VegasError) and not out_of_memory(e):
                            raise
                        rows.append({**row, "error": str(e).split("\n")[0]})
                        print(f"batch {batch} {mode:20s} {config_words(spec)}: {e}", flush=True)
                        continue
                    rows.append({**row, "mean_accepted_length": m.mean_accepted_length,
                                 "acceptance_by_position": m.acceptance_by_position,
                                 "tokens_per_second": m.tokens_per_second})
                    by_position = " ".join(f"{a:.3f}" for a in m.acceptance_by_position)
                    print(f"batch {batch} {mode:20s} {config_words(spec)}: accepted "
                          f"{m.mean_accepted_length:.3f} ({by_position} by draft position), "
                          f"{m.tokens_per_second:.0f} tok/s", flush=True)
                measurer.release()
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Acceptance by execution mode ({meta['hardware']}, {meta['date']})", "",
             f"`{meta['command']}`", "",
             "| batch | configuration | mode | mean accepted length | by draft position "
             "| tokens/s |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        by_position = " ".join(f"{a:.3f}" for a in r.get("acceptance_by_position", []))
        figures = (f"failed: {r['error']} | | |" if "error" in r else
                   f"{r['mean_accepted_length']:.3f} | {by_position} | "
                   f"{r['tokens_per_second']:.0f} |")
        lines.append(f"| {r['batch_size']} | `{r['config']}` | {r['mode']} | {figures}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p, dtype="auto")
    p.add_argument("--ctx", type=int, default=8000)
    p.add_argument("--dataset", default="mixed")
    p.add_argument("--batch-sizes", default="16,128")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="graphs,eager,reference")
    p.add_argument("--configs", nargs="+", required=True,
                   help="DRAFTER:name=value,... (any SpecConfig field)")
    add_output_args(p, "runs/graph-acceptance", "rows of an earlier run to summarize")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        print(markdown(data["rows"], data["meta"]))
        return
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"--modes: unknown {', '.join(unknown)}; choose from {', '.join(MODES)}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    configs = [(text, parse_switch_config(text)) for text in args.configs]
    if any(spec is None for _, spec in configs):
        p.error("--configs: vanilla drafts nothing; give speculative configurations")
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    prompts = load_prompts(model.tokenizer, args.dataset, args.ctx, max(batch_sizes), args.seed)
    rows = measure_modes(model, prompts, batch_sizes, configs, modes, args.max_new_tokens,
                         args.seed)
    meta = {"hardware": hardware(), "date": datetime.date.today().isoformat(),
            "command": "python bench/graph_acceptance.py " + shlex.join(sys.argv[1:])}
    write_atomic(with_ext(out, ".json"), json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_atomic(with_ext(out, ".md"), markdown(rows, meta))
    print(f"wrote {with_ext(out, '.md')}")


if __name__ == "__main__":
    main()
