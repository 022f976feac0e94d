"""Top-k prefix slots from selection scores, one launch for every layer and sequence.

For each (layer l, sequence b, group g) the kernel forms

    x[s] = sum over the group's heads h of scores[l, b, h, s],   s < prefix_len[b]

(one head per group, or all H_kv heads when they are summed: ``layer`` granularity), ranks
the reserved slots (a streaming window's sinks and most recent slots, ``reserved[b]`` of
them) above every score, and writes the ``budget[b]`` best slots in ascending order, then
zeros up to the list's capacity. This replaces a heads sum, a masked copy and
``torch.topk``: each row of scores is read once and never written back.

Exact top-k without sorting: a float's bits, read as an int32 and with the negative
ones' magnitude bits flipped, order as the floats do. The kernel searches that int32 key
for the largest threshold t with at least ``budget`` keys >= t, between the row's lowest
key and its highest one outside the window, by false position on the count (Illinois
variant; bisection after INTERPOLATED_PROBES), stopping early once exactly ``budget``
keys are >= the probe: 7-11 counts of the row on logit-, weight- and sink-like scores
where bisection took 12-18 (more with many ties). Ties at t go to the lowest slots; the
selected set then equals ``torch.topk``'s up to the order of equal scores. The whole row
stays in registers, so the search re-reads nothing: rows up to RESIDENT_SPAN slots
(longer prefixes use the PyTorch path, ``reference_topk_slots``).

The kernel is bound by latency, not bandwidth: how many programs an SM holds (set by
registers) and how many instructions a program issues decide its time. Three choices
keep both low (docs/results/kernel-launch.md#selection-kernel, 0cf468c): the row's loads are
masked on a length divisible by 16 (``_load_len``), so they vectorise and need a quarter
of the address registers of per-slot masked loads; the list's places come from a
running count in two levels (within rows of COUNT_ROW slots, then across them) rather
than one scan of the whole row; and the lengths are compared as 32-bit integers. A row a
little past 2048, 4096 or 8192 slots runs as that block plus one an eighth its size, not
as one block of twice the work (``launch.topk_launch``).

``reference_topk_slots`` is the PyTorch ground truth (and that fallback).
"""

from __future__ import annotations

import torch

from vegas_kernels import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path is used
    triton = None

# Longest row the kernel keeps in registers: launch.SCORES_PER_THREAD scores per thread at
# launch.TOPK_MAX_WARPS warps (at 32768 slots still 1.0-1.65x faster than PyTorch's top-k
# on the H200; longer rows use it).
RESIDENT_SPAN = launch.SCORES_PER_THREAD * 32 * launch.TOPK_MAX_WARPS
# Past this many probes the search bisects: a bound on its worst case (interpolated
# probes find the k-th largest score in about 7-11 of them on smooth scores).
INTERPOLATED_PROBES = 24
# Streaming window (MagicDec-Stream and Vegas's reserved share): sink slots at the start.
WINDOW_SINKS = 16
# Slots per row of the two-level running count: one warp's slots (32 lanes x 4), so the
# count along a row needs no shared memory.
COUNT_ROW = 128
# Row lengths the loads' mask is rounded up to: Triton vectorises a load whose mask is
# constant over 4 slots only when it can prove it, from a bound divisible by 16.
LOAD_ALIGN = 16

__all__ = ["RESIDENT_SPAN", "aligned_slots", "reference_topk_slots", "reserved_indices", "reserved_slots",
           "serves", "topk_slots"]


def _window(prefix_len: torch.Tensor, reserved: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (sinks, recent_start), [B, 1] each: the window is [0, sinks) and
    [recent_start, prefix_len), ``reserved`` slots in all."""
    sinks = torch.clamp(reserved, max=WINDOW_SINKS)[:, None]
    return sinks, (prefix_len - reserved)[:, None] + sinks


def reserved_slots(prefix_len: torch.Tensor, reserved: torch.Tensor, span: int) -> torch.Tensor:
    """Boolean [B, span]: up to WINDOW_SINKS sink slots, then the most recent prefix
    slots, ``reserved[b]`` in all (all of the prefix if it is shorter)."""
    slots = torch.arange(max(span, 1), device=prefix_len.device)[None]
    sinks, recent_start = _window(prefix_len, reserved)
    return ((slots < sinks) | (slots >= recent_start)) & (slots < prefix_len[:, None])


def reserved_indices(prefix_len: torch.Tensor, reserved: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] int64: the slots ``reserved_slots`` marks, ascending, then zeros
    (``width`` >= max(reserved)). Built directly: no scores, no top-k."""
    j = torch.arange(max(width, 1), device=prefix_len.device)[None]
    sinks, recent_start = _window(prefix_len, reserved)
    slots = torch.where(j < sinks, j, recent_start + j - sinks)
    return torch.where(j < reserved[:, None], slots, torch.zeros_like(slots))


def reference_topk_slots(scores: torch.Tensor, prefix_len: torch.Tensor, budget: torch.Tensor,
                         k_cap: int, sum_heads: bool = False,
                         reserved: torch.Tensor | None = None) -> torch.Tensor:
    """scores [L, B, H, S] -> indices [L, B, G, min(k_cap, S)] (G = 1 if ``sum_heads``
    else H): per row the top ``budget[b]`` slots below ``prefix_len[b]``, by score, the
    ``reserved[b]`` window slots first. Entries past the budget are unspecified."""
    if sum_heads:
        scores = scores.sum(dim=2, keepdim=True)
    s = scores.shape[-1]
    slots = torch.arange(s, device=scores.device)
    if reserved is not None:
        keep = reserved_slots(prefix_len, reserved, s)  # [B, S]
        scores = scores.masked_fill(keep[None, :, None, :], float("inf"))
    scores = scores.masked_fill(slots >= prefix_len[None, :, None, None], float("-inf"))
    return torch.topk(scores, min(max(k_cap, 1), s), dim=-1).indices


def serves(scores: torch.Tensor) -> bool:
    """Whether ``topk_slots`` takes scores of this span (the rows fit in registers)."""
    return triton is not None and scores.shape[-1] <= RESIDENT_SPAN


def aligned_slots(slots: int) -> int:
    """A score row of ``slots`` slots rounded up to a multiple of LOAD_ALIGN: the row
    length of a score buffer whose rows all start aligned (vectorised loads)."""
    return -(-slots // LOAD_ALIGN) * LOAD_ALIGN


def _load_len(scores: torch.Tensor) -> int:
    """The slots each row's loads cover: its length rounded up to LOAD_ALIGN where the
    storage holds that many more (the padding is read, never selected), else the length."""
    s = scores.shape[-1]
    padded = aligned_slots(s)
    last_row = scores.storage_offset() + sum((n - 1) * st for n, st in
                                             zip(scores.shape[:-1], scores.stride()[:-1]))
    fits = last_row + padded <= scores.untyped_storage().nbytes() // scores.element_size()
    return padded if fits else s


def topk_slots(scores: torch.Tensor, prefix_len: torch.Tensor, budget: torch.Tensor,
               k_cap: int, sum_heads: bool = False,
               reserved: torch.Tensor | None = None) -> torch.Tensor:
    """The kernel version of ``reference_topk_slots``: indices [L, B, G, min(k_cap, S)],
    int64, each row's ``budget[b]`` slots ascending, then zeros. ``budget[b] <=
    min(prefix_len[b], k_cap)``, ``prefix_len[b] <= S <= RESIDENT_SPAN``. Nothing is
    read back to the host: a CUDA graph can capture it."""
    l, b, h, s = scores.shape
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        scores = scores.float().contiguous()
    groups, heads = (1, h) if sum_heads else (h, 1)
    k_cap = min(max(k_cap, 1), s)
    prefix_len, budget = prefix_len.contiguous(), budget.contiguous()
    has_reserved = reserved is not None
    reserved = reserved.contiguous() if has_reserved else prefix_len  # unused placeholder
    out = torch.empty(l, b, groups, k_cap, dtype=torch.long, device=scores.device)
    block, tail, warps = launch.topk_launch(s)
    _topk_slots_kernel[(l * b * groups,)](
        scores, prefix_len, budget, reserved, out,
        scores.stride(0), scores.stride(1), scores.stride(2), b, groups, heads, k_cap,
        _load_len(scores), HAS_RESERVED=has_reserved, SINKS=WINDOW_SINKS,
        INTERPOLATED_PROBES=INTERPOLATED_PROBES, BLOCK=block, TAIL=tail,
        COUNT_ROW=min(block, COUNT_ROW), TAIL_COUNT_ROW=max(min(tail, COUNT_ROW), 1),
        num_warps=warps)
    return out


if triton is not None:

    @triton.jit
    def _running_count(flags, BLOCK: tl.constexpr, ROW: tl.constexpr):
        """Inclusive running count of flags [BLOCK] (int32): along rows of ROW slots,
        plus the totals of the rows before."""
        rows = tl.reshape(flags, [BLOCK // ROW, ROW])
        totals = tl.sum(rows, axis=1)
        before = tl.cumsum(totals, axis=0) - totals
        return tl.reshape(tl.cumsum(rows, axis=1) + before[:, None], [BLOCK])

    @triton.jit
    def _row_keys(base, s_h, heads, slots, load_len, prefix, sinks, recent_start,
                  HAS_RESERVED: tl.constexpr):
        """The keys of a block of a row's ``slots`` -> (keys, the lowest candidate key, the
        highest key outside the window). A key is the heads' summed score read as an
        int32 that orders as the floats do; slots past the prefix take the lowest key
        (which no probe above the search's low end counts), the window's the highest."""
        # Masked on load_len, not the prefix, so that the loads vectorise.
        loadable = slots < load_len
        x = tl.zeros(slots.shape, dtype=tl.float32)
        for h in range(heads):
            x += tl.load(base + h * s_h + slots, mask=loadable, other=0.0)
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        candidate = slots < prefix
        key = tl.where(candidate, key, -2147483648)
        if HAS_RESERVED:
            window = candidate & ((slots < sinks) | (slots >= recent_start))
        else:
            window = slots < 0
        lowest = tl.min(tl.where(candidate, key, 2147483647), axis=0)
        highest = tl.max(tl.where(window, -2147483648, key), axis=0)
        return tl.where(window, 2147483647, key), lowest, highest

    @triton.jit
    def _count_at_least(key, t):
        return tl.sum((key >= t).to(tl.int32), axis=0)

    @triton.jit
    def _write_slots(out_row, slots, key, t, rank_ties, ties_wanted, ties_before, placed,
                     k, k_cap, BLOCK: tl.constexpr, ROW: tl.constexpr):
        """Store a block's chosen slots at their places in the list (``placed`` chosen
        before it): keys above t, and keys at t whose rank among the row's ties (from
        ``ties_before``) is at most ``ties_wanted`` (all of them unless ``rank_ties``);
        zeros from the budget to the list's capacity. -> (placed, ties) after it."""
        tied = key == t
        take = key >= t
        if rank_ties:
            tie_rank = ties_before + _running_count(tied.to(tl.int32), BLOCK, ROW)
            take = (key > t) | (tied & (tie_rank <= ties_wanted))
        place = placed + _running_count(take.to(tl.int32), BLOCK, ROW) - 1
        tl.store(out_row + place, slots.to(tl.int64), mask=take)
        tl.store(out_row + slots, tl.zeros(slots.shape, dtype=tl.int64),
                 mask=(slots >= k) & (slots < k_cap))
        return (placed + tl.sum(take.to(tl.int32), axis=0),
                ties_before + tl.sum(tied.to(tl.int32), axis=0))

    # The list capacity follows the longest prefix, so it changes between iterations:
    # specialised (divisible by 16, or 1), it would compile new variants mid-decode.
    @triton.jit(do_not_specialize=["k_cap"])
    def _topk_slots_kernel(SCORES, PREFIX, BUDGET, RESERVED, OUT,
                           s_l, s_b, s_h, batch, groups, heads, k_cap, load_len,
                           HAS_RESERVED: tl.constexpr, SINKS: tl.constexpr,
                           INTERPOLATED_PROBES: tl.constexpr, BLOCK: tl.constexpr,
                           TAIL: tl.constexpr, COUNT_ROW: tl.constexpr,
                           TAIL_COUNT_ROW: tl.constexpr):
        # A row is slots [0, BLOCK) and, when TAIL > 0, [BLOCK, BLOCK + TAIL): two
        # power-of-two blocks rather than one of twice BLOCK for a span just past it.
        row = tl.program_id(0)  # (layer, sequence, group), group fastest
        g = row % groups
        b = (row // groups) % batch
        layer = row // (groups * batch)
        prefix = tl.load(PREFIX + b).to(tl.int32)
        k = tl.load(BUDGET + b).to(tl.int32)
        if HAS_RESERVED:
            reserved = tl.load(RESERVED + b).to(tl.int32)
            sinks = tl.minimum(reserved, SINKS)
            recent_start = prefix - reserved + sinks
            in_window = tl.minimum(reserved, prefix)
        else:
            sinks = tl.zeros([], dtype=tl.int32)
            recent_start = sinks
            in_window = sinks
        base = SCORES + layer.to(tl.int64) * s_l + b.to(tl.int64) * s_b + (g * heads) * s_h
        slots = tl.arange(0, BLOCK)
        key, lo, hi = _row_keys(base, s_h, heads, slots, load_len, prefix, sinks,
                                recent_start, HAS_RESERVED)
        if TAIL > 0:
            tail_slots = BLOCK + tl.arange(0, TAIL)
            tail_key, tail_lo, tail_hi = _row_keys(base, s_h, heads, tail_slots, load_len,
                                                   prefix, sinks, recent_start, HAS_RESERVED)
            lo = tl.minimum(lo, tail_lo)
            hi = tl.maximum(hi, tail_hi)
        # The search runs between the lowest candidate key and the highest one outside
        # the window (whose slots hold the highest key): count(key >= lo) = c_lo =
        # prefix >= k, count(key > hi) = c_up = in_window < k.
        lo = lo.to(tl.int64)
        hi = hi.to(tl.int64)
        c_lo = prefix
        c_up = in_window
        # The window alone fills the budget (or the prefix is empty): t = its key.
        window_only = in_window >= k
        lo = tl.where(window_only, 2147483647, lo)
        hi = tl.where(window_only | (c_lo == k), lo, hi)
        c_lo = tl.where(window_only, in_window, c_lo)
        c_up = tl.where(window_only, 0, c_up)

        # Largest t with count(key >= t) >= k: Illinois false position on the count, whose
        # root (count = k + 1/2) lies between two consecutive keys; stop at a probe with
        # exactly k keys at or above it. Past INTERPOLATED_PROBES, plain bisection.
        f_lo = (c_lo - k).to(tl.float32) - 0.5
        f_hi = (c_up - k).to(tl.float32) - 0.5
        last_side = tl.zeros([], dtype=tl.int32)
        probes = tl.zeros([], dtype=tl.int32)
        while lo < hi:
            span = hi + 1 - lo
            step = (f_lo / (f_lo - f_hi)).to(tl.float64) * span.to(tl.float64)
            guess = tl.minimum(tl.maximum(lo + step.to(tl.int64), lo + 1), hi)
            mid = tl.where(probes < INTERPOLATED_PROBES, guess, lo + (hi - lo + 1) // 2)
            above = _count_at_least(key, mid.to(tl.int32))
            if TAIL > 0:
                above += _count_at_least(tail_key, mid.to(tl.int32))
            more = above > k
            fewer = above < k
            # Illinois: an end kept twice in a row has its count's weight halved.
            f_hi = tl.where(more & (last_side == 1), f_hi * 0.5, f_hi)
            f_lo = tl.where(fewer & (last_side == -1), f_lo * 0.5, f_lo)
            f_lo = tl.where(more, (above - k).to(tl.float32) - 0.5, f_lo)
            f_hi = tl.where(fewer, (above - k).to(tl.float32) - 0.5, f_hi)
            last_side = tl.where(more, 1, tl.where(fewer, -1, 0))
            lo = tl.where(fewer, lo, mid)
            hi = tl.where(more, hi, tl.where(fewer, mid - 1, mid))
            c_lo = tl.where(fewer, c_lo, above)
            c_up = tl.where(fewer, above, c_up)
            probes += 1
        t = lo.to(tl.int32)

        # More than k keys >= t: c_up of them are > t, then the lowest-slot ties.
        rank_ties = c_lo != k
        out_row = OUT + row.to(tl.int64) * k_cap
        placed, ties = _write_slots(out_row, slots, key, t, rank_ties, k - c_up, 0, 0, k,
                                    k_cap, BLOCK, COUNT_ROW)
        if TAIL > 0:
            _write_slots(out_row, tail_slots, tail_key, t, rank_ties, k - c_up, ties, placed,
                         k, k_cap, TAIL, TAIL_COUNT_ROW)
