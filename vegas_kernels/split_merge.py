"""Split-KV attention's shared machinery: cutting the key range into splits, the
online softmax over tiles, storing each split's partial rows, and merging the splits by
log-sum-exp into the final rows.

Used by the verify/decode kernel (``vegas_kernels.verify_attention``), the sparse draft
kernel (``vegas_kernels.sparse_attention``) and, for ``scaled_scores``, the score
collection (``vegas_kernels.collect_scores``). How many splits, tiles and merge lanes a
launch uses is ``vegas_kernels.launch``'s business.

A split kernel runs one program per (sequence, KV head, split). Each program cuts its
slice of the keys from lengths on the device (``split_range``), runs ``softmax_step``
over its tiles and stores its partial rows ([B * H_kv, splits, rows, D] plus row maxima
and sums, float32; ``split_buffers``) with ``store_partials``; an empty split stores
nothing. The partials are then merged into out [B, T, H, D] (q's dtype) and lse
[B, T, H] (float32) in their final layout, either

- by the kernel's own last program of each (sequence, KV head) (``merge_if_last``, with
  a counter per (sequence, KV head) from ``split_counters``) where one merge block holds
  all its splits, rows and head dims (``launch.merges_in_kernel``), or
- by a merge launch of its own (``merge_partials``), whose programs share a large merge.

Packed row r of a (sequence, KV head) is query head ``kv_head * G + r // T`` at window
row ``r % T`` (T = 1 for drafts). Attention ``sinks`` ([H], gpt-oss) join each row's
softmax as one more slot with no value, once, when the rows are finished
(``store_rows``). A row that sees no slot gets out 0 and lse -inf.
"""

from __future__ import annotations

import torch

from vegas_kernels import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the references are used
    triton = None

__all__ = ["counters_device", "counters_out_of_phase", "merge_args", "merge_block",
           "merge_if_last", "merge_partials", "scaled_scores", "softmax_step", "split_buffers",
           "split_counters", "split_range", "store_partials", "store_rows"]


if triton is not None:

    @triton.jit
    def scaled_scores(a, b, sm_scale, IEEE: tl.constexpr):
        """a [M, D] . b [N, D]^T * scale; exact float32 products for float32 inputs."""
        if IEEE:
            return tl.dot(a, tl.trans(b), input_precision="ieee") * sm_scale
        return tl.dot(a, tl.trans(b)) * sm_scale

    @triton.jit
    def softmax_step(s, vt, m_i, l_i, acc, IEEE: tl.constexpr):
        """One online-softmax step over a tile of masked scores s [M, N] and values
        vt [N, D]; rows with nothing visible yet keep max -inf and add nothing."""
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
        return m_new, l_i, acc

    @triton.jit
    def split_range(low, total, split, splits, BLOCK_N: tl.constexpr):
        """This split's slice [start, end) of the keys [low, total) cut into ``splits``
        slices of whole tiles (end == start when empty), and how many slices are
        non-empty. Never a zero-sized slice, so an empty key range gives no live split
        rather than a division by zero."""
        n = total - low
        tiles = tl.maximum(tl.cdiv(tl.cdiv(n, splits), BLOCK_N), 1)
        split_size = tiles * BLOCK_N
        start = low + split * split_size
        end = tl.maximum(tl.minimum(start + split_size, total), start)
        return start, end, tl.cdiv(n, split_size)

    @triton.jit
    def store_partials(ACC, MAX, SUM, LIVE, bh, split, acc_base, stat_base, sa_m,
                       acc, m_i, l_i, live, start, end,
                       ROWS: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr):
        """Store a split's ROWS valid rows; an empty split stores nothing, since the
        merge reads only the ``live`` splits (written per (sequence, KV head) by split 0)."""
        rows = tl.arange(0, BLOCK_M)
        # One comparison, not row_ok & scalar: the interpreter mistypes that mask.
        keep = rows < tl.where(start < end, ROWS, 0)
        tl.store(ACC + acc_base + rows[:, None] * sa_m + tl.arange(0, D)[None, :], acc,
                 mask=keep[:, None])
        tl.store(MAX + stat_base + rows, m_i, mask=keep)
        tl.store(SUM + stat_base + rows, l_i, mask=keep)
        if split == 0:
            tl.store(LIVE + bh, live.to(tl.int32))

    @triton.jit
    def store_rows(OUT, LSE, SINKS, b, head, trow, row_ok, dims, acc, top, total,
                   so_b, so_t, so_h, sl_b, sl_t, sl_h, lse_rows,
                   STORE_LSE: tl.constexpr, HAS_SINKS: tl.constexpr):
        """Finish rows of an online softmax (running max ``top``, sum ``total``,
        unnormalised ``acc`` [ROWS, DIMS]): add the sink, normalise, store out, and with
        STORE_LSE the lse of the rows ``lse_rows``. A row that saw nothing gets out 0
        (not NaN) and lse -inf."""
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        if HAS_SINKS:
            # The sink: one more slot of the softmax, logit sinks[head], value 0.
            sink = tl.load(SINKS + head, mask=row_ok, other=0.0)
            with_sink = tl.maximum(top, sink)
            rescale = tl.exp(top - with_sink)  # 0 for a row that saw no slot
            total = total * rescale + tl.exp(sink - with_sink)
            acc = acc * rescale[:, None]
            top_safe = with_sink
        seen = total > 0.0
        out = acc / tl.where(seen, total, 1.0)[:, None]
        tl.store(OUT + b * so_b + trow[:, None] * so_t + head[:, None] * so_h + dims[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
        if STORE_LSE:
            lse = tl.where(seen, top_safe + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
            tl.store(LSE + b * sl_b + trow * sl_t + head * sl_h, lse, mask=lse_rows)

    @triton.jit
    def merge_block(ACC, MAX, SUM, SINKS, OUT, LSE, bh, rows, dims, live, lse_rows,
                    sa_bh, sa_sp, sa_m, sm_bh, sm_sp, so_b, so_t, so_h, sl_b, sl_t, sl_h,
                    H_KV: tl.constexpr, G: tl.constexpr, T: tl.constexpr,
                    LANES: tl.constexpr, ROWS: tl.constexpr, DIMS: tl.constexpr,
                    STORE_LSE: tl.constexpr, HAS_SINKS: tl.constexpr):
        """Merge the ``live`` splits' partials of packed rows ``rows`` [ROWS] and head dims
        ``dims`` [DIMS] of one (sequence, KV head) and store them (the lse of
        ``lse_rows``). Lane j merges splits j, j + LANES, ... with an element-wise online
        log-sum-exp, then the lanes are merged once. LANES covers every split up to
        MERGE_MAX_LANES, so the loop usually runs once: all loads are in flight together
        and the merge costs one memory round trip, not one per split. The loads bypass
        L1: in a split kernel's last program (``merge_if_last``) L1 may hold lines that
        other SMs have written since."""
        row_ok = rows < G * T
        b = bh // H_KV
        kvh = bh % H_KV
        lanes = tl.arange(0, LANES)
        m_lane = tl.full([LANES, ROWS], float("-inf"), tl.float32)
        l_lane = tl.zeros([LANES, ROWS], tl.float32)
        acc_lane = tl.zeros([LANES, ROWS, DIMS], tl.float32)
        for s0 in range(0, live, LANES):
            split = s0 + lanes
            ok = (split[:, None] < live) & row_ok[None, :]  # [LANES, ROWS]
            stat = bh * sm_bh + split[:, None] * sm_sp + rows[None, :]
            m = tl.load(MAX + stat, mask=ok, other=float("-inf"), cache_modifier=".cg")
            l = tl.load(SUM + stat, mask=ok, other=0.0, cache_modifier=".cg")
            a = tl.load(ACC + bh * sa_bh + split[:, None, None] * sa_sp
                        + rows[None, :, None] * sa_m + dims[None, None, :],
                        mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_lane, m)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_lane - m_safe)  # both factors are 0 for a -inf max
            beta = tl.exp(m - m_safe)
            l_lane = l_lane * alpha + l * beta
            acc_lane = acc_lane * alpha[:, :, None] + a * beta[:, :, None]
            m_lane = m_new
        top = tl.max(m_lane, axis=0)  # [ROWS]
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        scale = tl.exp(m_lane - top_safe[None, :])
        total = tl.sum(l_lane * scale, axis=0)
        acc = tl.sum(acc_lane * scale[:, :, None], axis=0)  # [ROWS, DIMS]
        store_rows(OUT, LSE, SINKS, b, kvh * G + rows // T, rows % T, row_ok, dims, acc, top,
                   total, so_b, so_t, so_h, sl_b, sl_t, sl_h, lse_rows, STORE_LSE, HAS_SINKS)

    @triton.jit
    def _merge_kernel(
        ACC, MAX, SUM, LIVE, SINKS, OUT, LSE,
        sa_bh, sa_sp, sa_m, sm_bh, sm_sp, so_b, so_t, so_h, sl_b, sl_t, sl_h,
        H_KV: tl.constexpr, G: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
        LANES: tl.constexpr, ROWS: tl.constexpr, DIMS: tl.constexpr,
        STORE_LSE: tl.constexpr, HAS_SINKS: tl.constexpr,
    ):
        """One program per (sequence * KV head, block of ROWS packed rows, block of DIMS
        head dims): ``merge_block``."""
        bh = tl.program_id(0)
        rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
        dims = tl.program_id(2) * DIMS + tl.arange(0, DIMS)
        # The lse once per row (by the programs of the first dims block); one comparison,
        # not row_ok & scalar, which the interpreter mistypes.
        lse_rows = rows < tl.where(tl.program_id(2) == 0, G * T, 0)
        merge_block(ACC, MAX, SUM, SINKS, OUT, LSE, bh, rows, dims, tl.load(LIVE + bh),
                    lse_rows, sa_bh, sa_sp, sa_m, sm_bh, sm_sp, so_b, so_t, so_h, sl_b, sl_t,
                    sl_h, H_KV, G, T, LANES, ROWS, DIMS, STORE_LSE, HAS_SINKS)

    @triton.jit
    def merge_if_last(COUNT, ACC, MAX, SUM, SINKS, OUT, LSE, bh, splits, live,
                      sa_bh, sa_sp, sa_m, sm_bh, sm_sp, so_b, so_t, so_h, sl_b, sl_t, sl_h,
                      H_KV: tl.constexpr, G: tl.constexpr, T: tl.constexpr,
                      LANES: tl.constexpr, ROWS: tl.constexpr, DIMS: tl.constexpr,
                      STORE_LSE: tl.constexpr, HAS_SINKS: tl.constexpr):
        """Run by every program of a split kernel once its partials are stored: the last
        of a (sequence, KV head)'s ``splits`` programs to arrive merges them all in one
        block (``merge_block``; ``merges_in_kernel`` says when one block holds them) and
        sets its counter back to 0 for the next launch."""
        # A CTA barrier, then the ticket with release semantics at GPU scope: every
        # thread's partials are visible before the counter moves. The last program's
        # acquire orders its loads after all the others' stores.
        tl.debug_barrier()
        ticket = tl.atomic_add(COUNT + bh, 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:
            tl.atomic_xchg(COUNT + bh, 0, sem="relaxed", scope="gpu")
            rows = tl.arange(0, ROWS)
            merge_block(ACC, MAX, SUM, SINKS, OUT, LSE, bh, rows, tl.arange(0, DIMS), live,
                        rows < G * T, sa_bh, sa_sp, sa_m, sm_bh, sm_sp, so_b, so_t, so_h,
                        sl_b, sl_t, sl_h, H_KV, G, T, LANES, ROWS, DIMS, STORE_LSE,
                        HAS_SINKS)


def split_buffers(b: int, h_kv: int, splits: int, rows: int, d: int, device):
    """Per-split partials: acc [B * H_kv, splits, rows, D], row maxima and sums
    [B * H_kv, splits, rows] (float32), and the live split count [B * H_kv] (int32).
    Nothing is initialised: the split kernel writes what the merge reads."""
    acc = torch.empty(b * h_kv, splits, rows, d, device=device, dtype=torch.float32)
    maxes = torch.empty(b * h_kv, splits, rows, device=device, dtype=torch.float32)
    live = torch.empty(b * h_kv, device=device, dtype=torch.int32)
    return acc, maxes, torch.empty_like(maxes), live


def merge_partials(partials, out: torch.Tensor, lse: torch.Tensor | None, h_kv: int,
                   g: int, t: int, sinks: torch.Tensor | None = None) -> None:
    """Merge ``split_buffers`` into out [B, T, H, D] and, when given, lse [B, T, H];
    ``sinks`` [H] join each row's softmax (see the module docstring). A launch of its
    own: more, smaller programs than a split kernel's last program has."""
    acc, maxes, sums, live = partials
    bh, splits, rows, d = acc.shape
    lanes, dims, block = launch.merge_tile(splits, rows, d)
    lse_arg = lse if lse is not None else out  # unused placeholder pointer
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    sinks_arg = sinks.float().contiguous() if sinks is not None else maxes  # placeholder
    _merge_kernel[(bh, triton.cdiv(rows, block), d // dims)](
        acc, maxes, sums, live, sinks_arg, out, lse_arg,
        acc.stride(0), acc.stride(1), acc.stride(2), maxes.stride(0), maxes.stride(1),
        out.stride(0), out.stride(1), out.stride(2), *lse_strides,
        H_KV=h_kv, G=g, T=t, D=d, LANES=lanes, ROWS=block, DIMS=dims,
        STORE_LSE=lse is not None, HAS_SINKS=sinks is not None,
    )


_counters: dict[torch.device, torch.Tensor] = {}
# Buffers replaced by larger ones stay allocated: a CUDA graph captured with one keeps
# its address, and memory handed back to the allocator could be another tensor's (whose
# values would break the counts) by the time that graph replays.
_retired_counters: list[torch.Tensor] = []


def counters_device(device) -> torch.device:
    """The device ``split_counters`` keeps a buffer for: a CUDA device with its index."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def split_counters(device, n: int) -> torch.Tensor | None:
    """Zeroed int32 counters [>= n] for the split kernels' last-program merge, one per
    (sequence, KV head): every program of a launch adds 1 and the last one sets its
    counter back to 0, so the buffer is reused, zeroed, by every launch on ``device``
    (launches on one stream at a time, as the engine's are). None while a CUDA graph is
    captured with no buffer of that size yet: allocating one then would record it in the
    graph's private pool, so that launch merges in a kernel of its own (the engine's
    eager warm-up runs allocate it before any capture)."""
    device = counters_device(device)
    have = _counters.get(device)
    if have is None or have.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if have is not None:
            _retired_counters.append(have)
        have = torch.zeros(max(n, 2 * (0 if have is None else have.numel())),
                           device=device, dtype=torch.int32)
        _counters[device] = have
    return have


def counters_out_of_phase(device) -> int:
    """How many of ``device``'s split counters are not at rest, which it then resets.

    Every launch that merges in its last programs leaves its counters at 0, so once the
    device has finished its work a counter above 0 means some launch merged before all
    its splits had stored their partials (or never merged), and every later launch on
    that counter would do the same: their outputs are wrong. Read once per call by
    ``vegas_core.generate``; cheap (a few hundred bytes)."""
    device = counters_device(device)
    stuck = 0
    for counters in (_counters.get(device), *_retired_counters):
        if counters is None or counters.device != device:
            continue
        count = int(counters.ne(0).sum())
        if count:
            with torch.inference_mode():  # the kernels' callers made it in that mode
                counters.zero_()
            stuck += count
    return stuck


def merge_args(partials, out: torch.Tensor, lse: torch.Tensor | None, counters,
               sinks: torch.Tensor | None) -> tuple[list, dict]:
    """The split kernels' merge arguments (pointers, strides, constexprs) for a launch
    that merges in its last programs (``counters`` given) or leaves the partials to
    ``merge_partials`` (``counters`` None: MERGE off); ``partials`` None for a launch
    with no partials."""
    if partials is None:  # a launch that finishes its rows itself: placeholders
        lanes = dims = block = 1
        live = out
    else:
        live = partials[3]
        _, splits, rows, d = partials[0].shape
        lanes, dims, block = launch.merge_tile(splits, rows, d)
    lse_arg = lse if lse is not None else out  # placeholder pointer
    lse_strides = lse.stride() if lse is not None else (0, 0, 0)
    sinks_arg = sinks.float().contiguous() if sinks is not None else out  # placeholder
    args = [counters if counters is not None else live, sinks_arg, out, lse_arg,
            out.stride(0), out.stride(1), out.stride(2), *lse_strides]
    flags = dict(MERGE=counters is not None, LANES=lanes, MERGE_ROWS=block, MERGE_DIMS=dims,
                 STORE_LSE=lse is not None, HAS_SINKS=sinks is not None)
    return args, flags
