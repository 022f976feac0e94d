"""How every Triton kernel is launched: tiles, split counts, warps and stages, each rule
beside the measurement that chose it.

The kernel modules ask this one (``launch.tile_slots(d)``, ``launch.gemv_config(n, k)``,
...) rather than deciding themselves, so a reader finds every launch choice here and a
benchmark can override one by setting it on this module. ``CHOICES`` lists the rules with
the ``docs/results`` file behind each ("not measured" where a rule follows from a
constraint or a default, not from a timing); docs/architecture.md's table of launch
choices is ``choices_table()``, which a test keeps equal to it. Changing a rule is a
retune: re-run the benchmark its result file names.

Pure Python (torch for the SM count), so that the rules can be read and tested without
Triton.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for n <= 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# ---------------------------------------------------------------------------------------
# Attention split kernels (verify_attention, sparse_attention): one program per
# (sequence, KV head, split of the key range)
# ---------------------------------------------------------------------------------------

BLOCK_N = 64  # key slots per tile
# Heads this narrow (SmolLM2's 64) take tiles of NARROW_BLOCK_N slots: a tile of the same
# bytes as a 64-slot tile of head dim 128; at 64 slots the split kernel ran 1.1-1.3x the
# K+V floor at batch 64-256 (docs/results/kernel-launch.md#tiles-warps-and-stages-at-head-dim-64).
NARROW_HEAD_DIM = 64
NARROW_BLOCK_N = 128
MIN_BLOCK_M = 16  # tl.dot needs at least 16 rows
# Split-kernel programs one SM runs at once (by shared memory, at BLOCK_N 64, head dim
# 128): the split count fills whole waves of them (docs/results/kernel-launch.md#split-count-programs-per-sm).
RESIDENT_PER_SM = 2
# A last wave of programs filled below this share leaves SMs idle while it runs: the split
# count grows until the last wave is filled this well, within MAX_SPLIT_WAVES waves. At
# SmolLM2's 3 KV heads one split left it 73% full at batch 64 and 128; 4 and 2 splits
# fill 97%, and a 7-row verify with fused scores ran 16-21% faster (H200,
# docs/results/kernel-launch.md#split-count-a-full-last-wave).
MIN_LAST_WAVE_FILL = 0.9
MAX_SPLIT_WAVES = 4
# Launch options of the split kernels (Triton's defaults; at head dim 64, 4 warps and 3
# stages were the best of 4 / 8 warps and 2-4 stages at batch 64 and 128:
# docs/results/kernel-launch.md#tiles-warps-and-stages-at-head-dim-64).
SPLIT_WARPS = 4
SPLIT_STAGES = 3
# Head dims above this (Gemma3's 256) pipeline two K/V tiles, not three: three 64 x 256
# bf16 K and V tiles take 192 KiB of shared memory, near an H200 SM's 227 KiB.
WIDE_HEAD_DIM = 128
# Tiles this tall (the first that spreads its rows over warps) sum the verify kernel's
# fused scores by a dot with the weighted query sum rather than by a column sum of the
# tile: at SmolLM2's 33 rows (gamma 10) on the H200 a verify with scores cost 1.76-1.92x
# a plain one the column-sum way, 1.12-1.16x with the dot
# (docs/results/kernel-launch.md#fused-score-sums-a-dot-from-64-rows).
DOT_SUM_ROWS = 64


def tile_slots(d: int) -> int:
    """Key slots per tile of the verify/decode split kernel for head dim ``d``."""
    return NARROW_BLOCK_N if d <= NARROW_HEAD_DIM else BLOCK_N


def block_rows(rows: int) -> int:
    """Tile height for ``rows`` packed query rows."""
    return max(MIN_BLOCK_M, next_power_of_2(rows))


def split_stages(d: int) -> int:
    """Pipeline stages of the split kernels for head dim ``d``."""
    return SPLIT_STAGES if d <= WIDE_HEAD_DIM else SPLIT_STAGES - 1


def split_count(programs_per_split: int, tiles: int, sms: int) -> int:
    """Splits of the key range per (sequence, KV head), for ``programs_per_split`` (B x H_kv)
    programs per split, ``tiles`` key tiles under the static bound and ``sms`` SMs.

    At least as many as make one whole wave of RESIDENT_PER_SM programs per SM; more
    while the programs would fill their last wave less than MIN_LAST_WAVE_FILL and stay
    within MAX_SPLIT_WAVES waves (the best-filled count if none gets there). Never more
    than the tiles."""
    wave = RESIDENT_PER_SM * sms
    programs = max(programs_per_split, 1)
    one_wave = max(1, wave // programs)
    best, best_fill = one_wave, 0.0
    for splits in range(one_wave, max(one_wave, MAX_SPLIT_WAVES * wave // programs) + 1):
        launched = programs * splits
        fill = launched / (math.ceil(launched / wave) * wave)
        if fill > best_fill:
            best, best_fill = splits, fill
        if fill >= MIN_LAST_WAVE_FILL:
            break
    return max(1, min(best, tiles))


def sm_count(device: torch.device) -> int:
    """SMs of ``device`` (one for a CPU, where the interpreter runs the kernels)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits_for(device: torch.device, programs_per_split: int, bound: int,
               block_n: int = BLOCK_N) -> int:
    """``split_count`` on ``device``'s SMs (one on a CPU) for a key bound of ``bound``
    slots in ``block_n``-slot tiles."""
    return split_count(programs_per_split, math.ceil(bound / block_n), sm_count(device))


# Pipeline stages of the sparse draft kernel at head dims up to NARROW_HEAD_DIM
# (SmolLM2's 64): with the list entries prefetched, three stages ran 3-5% slower than two
# there, while at head dim 128 three beat two by 3-6% (H200, the section of ed7e2a3 in
# docs/results/kernel-launch.md).
SPARSE_NARROW_STAGES = 2
# A sparse launch whose programs fit in one wave and whose splits hold at most this many
# tiles (a batch of one or two at 5% of the prefix) runs tiles of half the slots and
# twice the splits: twice the programs in flight over lists too short to fill each one's
# pipeline (Qwen3-8B shape, batch 1, 64k / 128k: 11.88 -> 10.96 / 16.07 -> 14.58 us a layer,
# there; docs/results/kernel-launch.md, the section of ed7e2a3).
SHORT_SPLIT_TILES = 4


def sparse_stages(d: int) -> int:
    """Pipeline stages of the sparse draft kernel for head dim ``d``."""
    return SPARSE_NARROW_STAGES if d <= NARROW_HEAD_DIM else split_stages(d)


def sparse_tiling(device: torch.device, programs_per_split: int, max_keys: int
                  ) -> tuple[int, int]:
    """-> (splits, slots per tile) of a sparse launch of ``programs_per_split`` (B x H_kv)
    programs per split over at most ``max_keys`` keys."""
    splits = splits_for(device, programs_per_split, max_keys)
    one_wave = programs_per_split * splits <= RESIDENT_PER_SM * sm_count(device)
    short = math.ceil(math.ceil(max_keys / BLOCK_N) / splits) <= SHORT_SPLIT_TILES
    if one_wave and short and max_keys > BLOCK_N:  # (a list of one tile stays whole)
        return 2 * splits, BLOCK_N // 2
    return splits, BLOCK_N


# ---------------------------------------------------------------------------------------
# Merging the splits (split_merge)
# ---------------------------------------------------------------------------------------

# Splits a merge program reads at once (independent loads in flight): with 16 lanes the
# merge looped, 7 us at 66 splits, against 2.6 with a lane per split (0d77492); 3.3 us at
# 33 splits in docs/results/kernel-launch.md#split-count-programs-per-sm.
MERGE_MAX_LANES = 128
MERGE_TILE = 4096  # elements of a merge program's [lanes, rows, dims] running sums
MERGE_MIN_DIMS = 16  # narrowest slice of the head dim one merge program takes


def merge_tile(splits: int, rows: int, d: int) -> tuple[int, int, int]:
    """-> (lanes, dims, rows) of a merge block: a lane per split (up to the cap), then as
    much of the head dim and as many rows as keep the lanes x rows x dims tile within
    budget."""
    lanes = min(next_power_of_2(splits), MERGE_MAX_LANES)
    dims = min(d, max(MERGE_MIN_DIMS, MERGE_TILE // lanes))
    block = max(1, min(next_power_of_2(rows), MERGE_TILE // (lanes * dims)))
    return lanes, dims, block


def merges_in_kernel(splits: int, rows: int, d: int) -> bool:
    """Whether a split kernel's last programs merge its partials: when one merge block
    (``merge_tile``) holds all of a (sequence, KV head)'s splits, rows and head dims, so
    that the last program merges in one memory round trip (SmolLM2's draft step at batch
    64: 1.182 -> 1.162 ms, ed7e2a3). Larger merges (many splits at a small batch, or many
    rows) keep a merge launch of their own, whose programs share the work: merged block
    by block in the last program, a Qwen3-8B draft step at batch 1 / 64k (33 splits)
    took 5.19 ms against 4.70 (H200)."""
    lanes, dims, block = merge_tile(splits, rows, d)
    return lanes >= splits and dims == d and block >= rows


# ---------------------------------------------------------------------------------------
# Selection scores after the verify pass (collect_scores)
# ---------------------------------------------------------------------------------------

# BLOCK_N tiles per program of collect_scores: q is loaded once for them, and the loop
# lets the next K tile load while this one is reduced.
COLLECT_TILES = 8
EDGE_BLOCK = 1024  # slots per program of edge_weight_scores


# ---------------------------------------------------------------------------------------
# Top-k of the prefix slots (select_slots): one program per score row
# ---------------------------------------------------------------------------------------

# The row stays in registers, SCORES_PER_THREAD slots a thread. At least 8 warps: with 4,
# a program needed 255 registers (spilling) and an SM held two; at 8 warps 127, two
# programs of twice the warps; 16 warps ran 1.7x slower
# (docs/results/kernel-launch.md#selection-kernel).
SCORES_PER_THREAD = 64
TOPK_MIN_WARPS = 8
TOPK_MAX_WARPS = 16
# Rows a little past one of these powers of two run as two blocks, the second
# 1 / TOPK_TAIL_SHARE of the first (see topk_launch).
TOPK_SPLIT_BLOCKS = (2048, 4096, 8192)
TOPK_TAIL_SHARE = 8


def topk_launch(span: int) -> tuple[int, int, int]:
    """-> (block, tail, warps): a row of ``span`` slots as one power-of-two block, or, a
    little past a power of two P in TOPK_SPLIT_BLOCKS (by at most P / TOPK_TAIL_SHARE),
    as P plus a block of P / TOPK_TAIL_SHARE: one block would do twice the work there
    (8192 + 8 slots took 1088 us at SmolLM2's batch 256 as 16384, 863 as 8192 + 1024;
    further past P the single block ran faster: 810 against 874 us at 12000). Past 8192
    both shapes spill registers, and the split one was not timed: the single block
    stays."""
    block, tail = max(next_power_of_2(span), 16), 0
    half = block // 2
    if half in TOPK_SPLIT_BLOCKS and span - half <= half // TOPK_TAIL_SHARE:
        block, tail = half, half // TOPK_TAIL_SHARE
    return block, tail, max(TOPK_MIN_WARPS,
                            min(TOPK_MAX_WARPS, block // (32 * SCORES_PER_THREAD)))


# ---------------------------------------------------------------------------------------
# Linear layers of 1-16 rows (gemv)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GemvConfig:
    """Tile and launch settings: weight rows per program, K per step, warps, stages."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Chosen by bench/gemv.py --sweep on the H200 (docs/results/kernel-launch.md#gemv-tiles), 1 and 8
# rows. At the 8B shapes, wide weights (N >= 6144: 96 or more programs) take 64-row tiles
# and narrower ones 32-row tiles, so that a 4096-row weight still spreads over 128
# programs, one per SM, with a deeper pipeline to keep each SM's loads in flight. A short
# K (SmolLM2's 576) is a few steps per program and the products take 3-16 us, mostly
# launch and ramp: 16-row tiles (more programs) there, and short K steps for the LM head.
WIDE_WEIGHT_ROWS = 6144
SHORT_K = 1024
WIDE_CONFIG = GemvConfig(block_n=64, block_k=128, num_warps=4, num_stages=4)
NARROW_CONFIG = GemvConfig(block_n=32, block_k=256, num_warps=4, num_stages=5)
SHORT_WIDE_CONFIG = GemvConfig(block_n=64, block_k=64, num_warps=4, num_stages=3)
SHORT_NARROW_CONFIG = GemvConfig(block_n=16, block_k=128, num_warps=4, num_stages=5)


def gemv_config(n: int, k: int) -> GemvConfig:
    """Tile settings for a product with N output columns over K."""
    if k < SHORT_K:
        return SHORT_WIDE_CONFIG if n >= WIDE_WEIGHT_ROWS else SHORT_NARROW_CONFIG
    return WIDE_CONFIG if n >= WIDE_WEIGHT_ROWS else NARROW_CONFIG


# ---------------------------------------------------------------------------------------
# Per-layer elementwise ops (layer_ops)
# ---------------------------------------------------------------------------------------

# rms_norm: a program covers whole rows and, for short rows (head dims), several rows so
# that each program still has about this many elements to work on.
NORM_TILE_ELEMENTS = 2048
# Elements per warp a program aims for when choosing num_warps (32 lanes x 8 values).
ELEMENTS_PER_WARP = 256
ELEMENTWISE_MAX_WARPS = 8
# silu_mul: output columns per program (F is ~14-19k for 8B models, so a row is a
# dozen or more programs, enough to spread a batch-1 decode step over the GPU).
SILU_BLOCK = 1024
SILU_WARPS = 4


def elementwise_warps(elements: int) -> int:
    """Warps of a program over ``elements`` values: one per ELEMENTS_PER_WARP, 1 to
    ELEMENTWISE_MAX_WARPS."""
    return max(1, min(ELEMENTWISE_MAX_WARPS, elements // ELEMENTS_PER_WARP))


def norm_tile(n: int) -> tuple[int, int, int]:
    """-> (rows per program, columns per row tile, warps) of rms_norm over rows of ``n``."""
    block_n = next_power_of_2(n)
    rows = max(1, NORM_TILE_ELEMENTS // block_n)
    return rows, block_n, elementwise_warps(rows * block_n)


# ---------------------------------------------------------------------------------------
# Grouped mixture of experts (moe)
# ---------------------------------------------------------------------------------------

# Pairs per tile: tl.dot needs at least 16 rows, and at decode sizes an expert rarely
# gets more than a few pairs, so a taller tile would mostly multiply padding.
MOE_BLOCK_M = 16
# Hidden columns per gate/up program. Narrow, so that a batch-1 step (K experts) still
# spreads over the GPU: gpt-oss (F = 2880) gives 90 programs per expert, Qwen3-30B-A3B
# (F = 768) 24, i.e. 360 and 192 busy programs at one token, more than the 132 SMs.
MOE_BLOCK_F = 32
# Output columns per down program, for the same reason (D = 2880 and 2048: 90 and 64
# programs per expert).
MOE_BLOCK_D = 32
# The reduction step (over D for gate/up, over F for down): 128 elements of a weight row
# is 256 contiguous bytes in bf16, and the two weight tiles of a gate/up step stay at
# 16 KiB per pipeline stage.
MOE_BLOCK_K = 128
MOE_WARPS = 4  # launch options of both kernels (Triton's defaults)
MOE_STAGES = 3


# ---------------------------------------------------------------------------------------
# The registry: every rule above, what it decides and what justified it
# ---------------------------------------------------------------------------------------

NOT_MEASURED = "not measured"


@dataclass(frozen=True)
class LaunchChoice:
    """One launch rule: the kernel module it serves, the names in this module that make
    it (the first is the one to read), the rule in words, and the docs/results file
    whose timings chose it (NOT_MEASURED where a constraint or a default decided)."""

    kernel: str
    names: tuple[str, ...]
    rule: str
    evidence: str


CHOICES: tuple[LaunchChoice, ...] = (
    LaunchChoice("verify_attention", ("tile_slots", "BLOCK_N", "NARROW_BLOCK_N"),
                 "64-slot key tiles; 128 at head dims up to 64",
                 "kernel-launch.md"),
    LaunchChoice("verify_attention, sparse_attention",
                 ("split_count", "RESIDENT_PER_SM", "MIN_LAST_WAVE_FILL", "MAX_SPLIT_WAVES"),
                 "splits fill whole waves of 2 programs per SM, more until the last wave "
                 "is 90% full (within 4 waves), never more than the tiles",
                 "kernel-launch.md"),
    LaunchChoice("verify_attention, sparse_attention",
                 ("split_stages", "SPLIT_WARPS", "SPLIT_STAGES"),
                 "4 warps, 3 stages", "kernel-launch.md"),
    LaunchChoice("verify_attention, sparse_attention", ("WIDE_HEAD_DIM",),
                 "2 stages above head dim 128 (three K/V tiles would not fit shared memory)",
                 NOT_MEASURED),
    LaunchChoice("verify_attention, sparse_attention, collect_scores",
                 ("block_rows", "MIN_BLOCK_M"),
                 "query tile of the packed rows rounded up to a power of two, at least 16 "
                 "(tl.dot's minimum)", NOT_MEASURED),
    LaunchChoice("verify_attention", ("DOT_SUM_ROWS",),
                 "fused scores summed by a dot with the weighted query sum from 64 rows",
                 "kernel-launch.md"),
    LaunchChoice("sparse_attention", ("sparse_tiling", "SHORT_SPLIT_TILES"),
                 "split_count's splits over 64-slot tiles; in one wave with at most 4 tiles "
                 "a split, 32-slot tiles and twice the splits", "kernel-launch.md"),
    LaunchChoice("sparse_attention", ("sparse_stages", "SPARSE_NARROW_STAGES"),
                 "2 stages at head dims up to 64, else as the verify kernel",
                 "kernel-launch.md"),
    LaunchChoice("split_merge",
                 ("merge_tile", "MERGE_MAX_LANES", "MERGE_TILE", "MERGE_MIN_DIMS"),
                 "a lane per split up to 128, then head dims and rows within 4096 elements",
                 "kernel-launch.md"),
    LaunchChoice("split_merge", ("merges_in_kernel",),
                 "the split kernel's last program merges when one merge block holds every "
                 "split, row and dim; else a merge launch", "kernel-launch.md"),
    LaunchChoice("collect_scores", ("COLLECT_TILES", "EDGE_BLOCK"),
                 "8 tiles of 64 slots per collect program; 1024 slots per edge-weight "
                 "program", NOT_MEASURED),
    LaunchChoice("select_slots", ("topk_launch", "SCORES_PER_THREAD", "TOPK_MIN_WARPS",
                                  "TOPK_SPLIT_BLOCKS"),
                 "one power-of-two block per row, 64 scores a thread, 8-16 warps; just past "
                 "2048, 4096 or 8192 slots that block plus an eighth",
                 "kernel-launch.md"),
    LaunchChoice("gemv", ("gemv_config", "WIDE_WEIGHT_ROWS", "SHORT_K"),
                 "four tiles by N >= 6144 and K < 1024", "kernel-launch.md"),
    LaunchChoice("layer_ops", ("norm_tile", "elementwise_warps", "SILU_BLOCK"),
                 "about 2048 elements a norm program, a warp per 256 (up to 8); 1024 "
                 "columns a SiLU-mul program", NOT_MEASURED),
    LaunchChoice("moe", ("MOE_BLOCK_F", "MOE_BLOCK_M", "MOE_BLOCK_D", "MOE_BLOCK_K"),
                 "16 pairs x 32 columns a program, 128-element reduction steps, 4 warps, "
                 "3 stages", NOT_MEASURED),
)


def evidence_files(choice: LaunchChoice) -> list[str]:
    """The docs/results files named by ``choice`` (none when not measured)."""
    return [] if choice.evidence == NOT_MEASURED else choice.evidence.split(", ")


TABLE_HEADER = ("| kernel | rule | made by | justified by |\n"
                "| --- | --- | --- | --- |")


def choices_table() -> str:
    """``CHOICES`` as the Markdown table docs/architecture.md carries."""
    rows = []
    for c in CHOICES:
        evidence = c.evidence if c.evidence == NOT_MEASURED else ", ".join(
            f"[{name}](results/{name})" for name in evidence_files(c))
        made_by = ", ".join(f"`{name}`" for name in c.names)
        rows.append(f"| `{c.kernel}` | {c.rule} | {made_by} | {evidence} |")
    return "\n".join([TABLE_HEADER, *rows])


if __name__ == "__main__":
    print(choices_table())
