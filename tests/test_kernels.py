"""Triton kernels against their float64 PyTorch references, on fresh random inputs.

On a machine without a GPU they run in Triton's interpreter (small sizes); on a GPU the
same tests run natively, in float32 and bfloat16, and the one-launch test replays a
captured CUDA graph.

Ragged batches throughout: each sequence's window ends at a different slot, so each has
its own ``total`` (slots seen) below the static ``kv_len`` bound. Score slots at or past
a sequence's total are unwritten by contract, so only slots below it are compared.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is optional on CPU-only installs")

from vegas_kernels import launch  # noqa: E402
from vegas_kernels.collect_scores import (collect_scores, edge_weight_scores,  # noqa: E402
                                          reference_collect_scores)
import vegas_kernels.verify_attention as verify_module  # noqa: E402
import vegas_kernels.sparse_attention as sparse_module  # noqa: E402
from vegas_kernels.launch import BLOCK_N, COLLECT_TILES  # noqa: E402
import vegas_kernels.split_merge as split_merge  # noqa: E402
from vegas_kernels.split_merge import merge_partials, split_buffers  # noqa: E402
from vegas_kernels.select_slots import (reference_topk_slots, reserved_slots,  # noqa: E402
                                        topk_slots)
from vegas_kernels.sparse_attention import (reference_sparse_attention,  # noqa: E402
                                            sparse_attention)
from vegas_kernels.verify_attention import (reference_verify_attention,  # noqa: E402
                                            verify_attention)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
SCORE_TOLERANCE = 10  # scores sum G * T terms: their absolute error grows with that
SLACK = 40  # cache slots past kv_len: the kernels must not read them


def randn(*shape, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(*shape, generator=g, device=DEVICE, dtype=torch.float32).to(dtype)


def window_positions(ends, rows):
    """[B, rows]: sequence b's window covers slots ends[b] - rows .. ends[b] - 1."""
    return torch.stack([torch.arange(e - rows, e) for e in ends]).to(DEVICE)


def row_weights(kind: str, batch: int, rows: int) -> torch.Tensor:
    """[B, T]: the first and last rows, all rows, or one row per sequence (one-hot at
    the last accepted row, which differs between sequences)."""
    w = torch.zeros(batch, rows, device=DEVICE)
    if kind == "two":
        w[:, [0, -1]] = 1.0
    elif kind == "all":
        w[:] = 1.0
    else:
        w[torch.arange(batch), torch.arange(batch) * 3 % rows] = 1.0
    return w


def selected_slots(prefix, groups, width, generator):
    """[B, groups, width] distinct slots below prefix[b] (where the selection lives: the
    tail starts there), in random order, padded with 0 past prefix[b]."""
    indices = torch.zeros(len(prefix), groups, width, dtype=torch.long)
    for b, n in enumerate(prefix):
        for group in range(groups):
            indices[b, group, :min(n, width)] = torch.randperm(n, generator=generator)[:width]
    return indices.to(DEVICE)


def captured(launch):
    """On a GPU: ``launch`` captured once in a CUDA graph, as a function that replays it
    and returns its (static) outputs. On the CPU: ``launch`` itself."""
    if DEVICE != "cuda":
        return launch
    launch()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = launch()

    def replay():
        graph.replay()
        return static

    return replay


def assert_prefix_close(got, ref, ends, tol):
    """Compare [B, H_kv, S] scores at the slots below each sequence's end only."""
    for b, end in enumerate(ends):
        torch.testing.assert_close(got[b, :, :end].double(), ref[b, :, :end].double(),
                                   atol=tol * SCORE_TOLERANCE, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, rows, heads, kv_heads, dim, kv_len, splits", [
    (2, 9, 8, 2, 64, 257, None),  # gamma = 8 verify, GQA 4, the default split count
    (2, 9, 8, 2, 64, 257, 3),  # split boundaries that differ between sequences
    (1, 1, 4, 4, 32, 100, 8),  # a decode step, no GQA: more splits than tiles (empty ones)
    (3, 3, 6, 3, 64, 700, 5),  # many tiles per split
    (2, 7, 9, 3, 64, 129, 2),  # SmolLM2's heads: 21 packed rows
    (2, 7, 9, 3, 64, 300, 1),  # one split: the merge only normalises it
    (2, 11, 9, 3, 64, 700, 2),  # gamma 10: 33 rows, scores by the weighted query sum
])
def test_verify_attention_matches_reference(dtype, batch, rows, heads, kv_heads, dim, kv_len,
                                            splits):
    seed = batch * 100 + rows + (splits or 0)
    q = randn(batch, rows, heads, dim, dtype=dtype, seed=seed)
    k = randn(batch, kv_heads, kv_len + SLACK, dim, dtype=dtype, seed=seed + 1)
    v = randn(batch, kv_heads, kv_len + SLACK, dim, dtype=dtype, seed=seed + 2)
    ends = [kv_len - 37 * i for i in range(batch)]  # only the first reaches the bound
    positions = window_positions(ends, rows)
    weights = row_weights("two", batch, rows)
    out, lse, scores = verify_attention(q, k, v, positions, kv_len, weights, splits=splits)
    ref_out, ref_lse, ref_scores = reference_verify_attention(
        q.double(), k.double(), v.double(), positions, kv_len, weights.double())
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32 and scores.shape == ref_scores.shape
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)
    assert_prefix_close(scores, ref_scores, ends, tol)

    plain_out, plain_lse, none = verify_attention(q, k, v, positions, kv_len, splits=splits)
    assert none is None and torch.equal(plain_out, out) and torch.equal(plain_lse, lse)

    # Into a strided slice of a bigger buffer: only the slots below each end are written.
    big = torch.full((batch + 1, 2 * kv_heads, kv_len + SLACK), float("nan"), device=DEVICE)
    home = big[1:, ::2, 3:]
    _, _, into = verify_attention(q, k, v, positions, kv_len, weights, scores_out=home,
                                  splits=splits)
    assert into.data_ptr() == home.data_ptr()
    assert_prefix_close(home, ref_scores, ends, tol)
    written = torch.zeros_like(big, dtype=torch.bool)
    for b, end in enumerate(ends):
        written[1 + b, ::2, 3:3 + end] = True
    assert big[written].isfinite().all() and big[~written].isnan().all()


def test_verify_attention_scattered_rows():
    """Rows whose positions are out of order, far apart or -1 (a row that sees nothing:
    out 0, lse -inf): tiles below some rows' positions but not others' are masked."""
    batch, rows, heads, kv_heads, dim, kv_len = 2, 5, 4, 2, 32, 300
    q = randn(batch, rows, heads, dim, dtype=torch.float32, seed=11)
    k = randn(batch, kv_heads, kv_len, dim, dtype=torch.float32, seed=12)
    v = randn(batch, kv_heads, kv_len, dim, dtype=torch.float32, seed=13)
    positions = torch.tensor([[250, 3, 140, 299, 70], [-1, 200, 64, 63, 128]], device=DEVICE)
    weights = torch.rand(batch, rows, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    out, lse, scores = verify_attention(q, k, v, positions, kv_len, weights, splits=3)
    ref_out, ref_lse, ref_scores = reference_verify_attention(
        q.double(), k.double(), v.double(), positions, kv_len, weights.double())
    seen = positions >= 0  # [B, T]
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out[seen].double(), ref_out[seen], atol=tol, rtol=tol)
    torch.testing.assert_close(lse[seen].double(), ref_lse[seen], atol=tol, rtol=tol)
    assert (out[~seen] == 0).all() and (lse[~seen] == float("-inf")).all()
    assert_prefix_close(scores, ref_scores, [300, 201], tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, window, sinks, splits", [
    (9, 100, False, None),  # a verify window over a local layer: tiles where windows start
    (1, 64, True, 4),  # a decode row, a tile-sized window, sinks, more splits than tiles
    (4, 37, True, 2),  # a window smaller than a tile, every tile masked
    (3, 1000, False, 3),  # a window longer than the cache: plain causal attention
    (5, None, True, None),  # sinks without a window (gpt-oss's full layers)
    (9, 100, True, 1),  # one split and sinks
])
def test_verify_attention_with_a_sliding_window_and_sinks(dtype, rows, window, sinks, splits):
    batch, heads, kv_heads, dim, kv_len = 2, 8, 2, 32, 300
    seed = rows * 10 + (window or 0)
    q = randn(batch, rows, heads, dim, dtype=dtype, seed=seed)
    k = randn(batch, kv_heads, kv_len + SLACK, dim, dtype=dtype, seed=seed + 1)
    v = randn(batch, kv_heads, kv_len + SLACK, dim, dtype=dtype, seed=seed + 2)
    sink = randn(heads, dtype=torch.float32, seed=seed + 3) + 2.0 if sinks else None
    ends = [kv_len, 170]
    positions = window_positions(ends, rows)
    weights = row_weights("two", batch, rows)
    out, lse, scores = verify_attention(q, k, v, positions, kv_len, weights, splits=splits,
                                        window=window, sinks=sink)
    ref_out, ref_lse, ref_scores = reference_verify_attention(
        q.double(), k.double(), v.double(), positions, kv_len, weights.double(), window,
        None if sink is None else sink.double())
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)
    first = [0 if window is None else max(e - rows - window + 1, 0) for e in ends]
    for b, (lo, end) in enumerate(zip(first, ends)):  # written where the rows see
        torch.testing.assert_close(scores[b, :, lo:end].double(), ref_scores[b, :, lo:end],
                                   atol=tol * SCORE_TOLERANCE, rtol=tol)


def test_reference_sinks_are_a_slot_with_no_value():
    """A sink is a key whose logit is the sink and whose value is 0: the reference with
    sinks equals plain attention over the cache with such a slot prepended."""
    q = randn(2, 3, 4, 16, dtype=torch.float64, seed=21)
    k = randn(2, 2, 40, 16, dtype=torch.float64, seed=22)
    v = randn(2, 2, 40, 16, dtype=torch.float64, seed=23)
    sinks = randn(4, dtype=torch.float64, seed=24)
    positions = window_positions([40, 25], 3)
    out, lse, _ = reference_verify_attention(q, k, v, positions, 40, sinks=sinks)
    # q.k_sink / sqrt(d) = sink for head h: a key along q's own direction, per head, is
    # not shared across a KV group; prepend one slot per query head instead.
    b, t, h, d = q.shape
    qh = q.permute(0, 2, 1, 3)  # [B, H, T, D]
    kh = k.repeat_interleave(2, dim=1)  # [B, H, S, D]
    vh = v.repeat_interleave(2, dim=1)
    logits = qh @ kh.transpose(-1, -2) / d ** 0.5  # [B, H, T, S]
    unseen = torch.arange(40, device=q.device) > positions[:, None, :, None]
    logits = logits.masked_fill(unseen, float("-inf"))
    logits = torch.cat([sinks.view(1, h, 1, 1).expand(b, h, t, 1), logits], dim=-1)
    probs = logits.softmax(-1)
    expected = (probs[..., 1:] @ vh).permute(0, 2, 1, 3)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, logits.logsumexp(-1).permute(0, 2, 1))


@pytest.mark.parametrize("max_lanes, tile", [
    (128, 4096),  # the shipped budget: one lane per split, whole head dim, all rows
    (4, 64),  # three lane steps, the head dim in slices of 16, one row per program
])
def test_merge_partials_is_logsumexp_of_live_splits(monkeypatch, max_lanes, tile):
    monkeypatch.setattr(launch, "MERGE_MAX_LANES", max_lanes)
    monkeypatch.setattr(launch, "MERGE_TILE", tile)
    b, h_kv, g, t, d, splits = 2, 2, 3, 2, 32, 11
    acc, maxes, sums, live = split_buffers(b, h_kv, splits, g * t, d, DEVICE)
    acc.copy_(randn(*acc.shape, dtype=torch.float32, seed=1))
    maxes.copy_(4 * randn(*maxes.shape, dtype=torch.float32, seed=2))
    sums.copy_(randn(*sums.shape, dtype=torch.float32, seed=3).abs() + 0.1)
    live.copy_(torch.tensor([11, 5, 1, 0], dtype=torch.int32))  # no live split: nothing seen
    out = torch.empty(b, t, g * h_kv, d, device=DEVICE)
    lse = torch.empty(b, t, g * h_kv, device=DEVICE)
    merge_partials((acc, maxes, sums, live), out, lse, h_kv, g, t)

    ref_out = torch.zeros(b * h_kv, g * t, d, dtype=torch.float64)
    ref_lse = torch.full((b * h_kv, g * t), float("-inf"), dtype=torch.float64)
    for bh, n in enumerate(live.tolist()):
        if n:
            m, l, a = maxes[bh, :n].double(), sums[bh, :n].double(), acc[bh, :n].double()
            top = m.max(dim=0).values  # [rows]
            scale = torch.exp(m - top)  # [splits, rows]
            total = (l * scale).sum(dim=0)
            ref_out[bh] = (a * scale[..., None]).sum(dim=0) / total[:, None]
            ref_lse[bh] = top + total.log()
    # packed row r of (sequence, KV head) is head kvh * G + r // T, window row r % T
    ref_out = ref_out.view(b, h_kv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, g * h_kv, d)
    ref_lse = ref_lse.view(b, h_kv, g, t).permute(0, 3, 1, 2).reshape(b, t, g * h_kv)
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernel", ["verify", "sparse"])
def test_split_kernels_merge_in_their_last_program(monkeypatch, kernel):
    """Where one merge block holds the splits, the last program of each (sequence, KV
    head) merges them as the merge launch would (which runs instead while a CUDA graph is
    captured before the counters exist), and leaves the counters at 0."""
    batch, heads, kv_heads, dim, slots, splits = 2, 8, 2, 32, 300, 5
    q = randn(batch, 3 if kernel == "verify" else 1, heads, dim, dtype=torch.float32, seed=1)
    k = randn(batch, kv_heads, slots, dim, dtype=torch.float32, seed=2)
    v = randn(batch, kv_heads, slots, dim, dtype=torch.float32, seed=3)
    sinks = randn(heads, dtype=torch.float32, seed=4)
    if kernel == "verify":
        positions = window_positions([slots, slots - 90], 3)
        run = lambda: verify_attention(q, k, v, positions, slots, splits=splits,  # noqa: E731
                                       sinks=sinks)[:2]
        ref = reference_verify_attention(q.double(), k.double(), v.double(), positions, slots,
                                         sinks=sinks.double())[:2]
    else:
        positions = torch.tensor([[slots - 1], [slots - 60]], device=DEVICE)
        tail_start = positions[:, 0] - 4
        indices = selected_slots(tail_start.tolist(), 1, 200, torch.Generator().manual_seed(5))
        counts = torch.tensor([200, 150], device=DEVICE)
        run = lambda: (sparse_attention(q, k, v, positions, indices, counts,  # noqa: E731
                                        tail_start, 205, splits=splits, sinks=sinks),)
        ref = (reference_sparse_attention(q.double(), k.double(), v.double(), positions,
                                          indices, counts, tail_start, sinks.double()),)
    assert launch.merges_in_kernel(splits, q.shape[1] * heads // kv_heads, dim)
    in_kernel = run()
    counters = split_merge._counters[split_merge.counters_device(DEVICE)]
    assert counters.eq(0).all()
    monkeypatch.setattr(verify_module, "split_counters", lambda *a: None)
    if kernel == "sparse":
        monkeypatch.setattr(sparse_module, "split_counters", lambda *a: None)
    own_launch = run()
    for got, launched, want in zip(in_kernel, own_launch, ref):
        torch.testing.assert_close(got, launched, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(got.double(), want, atol=TOLERANCE[torch.float32],
                                   rtol=TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("budget, tails, splits, block_n", [
    ([70, 33], [5, 9], 3, None),  # ragged budgets and tails
    ([0, 1], [0, 3], 16, None),  # edges: no selected slot (tail only), one; mostly empty splits
    ("all", [2, 2], None, None),  # the whole prefix selected: dense, the default split count
    ([70, 33], [5, 9], 1, None),  # one split: no merge launch
    ([70, 33], [5, 9], 6, BLOCK_N // 2),  # the short-list tiles of a small batch
    ("all", [2, 2], 1, BLOCK_N // 2),  # ... several of them in one split
])
def test_sparse_attention_matches_reference(dtype, per_head, budget, tails, splits, block_n):
    batch, heads, kv_heads, dim, slots = 2, 8, 2, 64, 160
    seed = len(str(budget)) + sum(tails) + (splits or 0) + (block_n or 0)
    q = randn(batch, 1, heads, dim, dtype=dtype, seed=seed)
    k = randn(batch, kv_heads, slots, dim, dtype=dtype, seed=seed + 1)
    v = randn(batch, kv_heads, slots, dim, dtype=dtype, seed=seed + 2)
    positions = torch.tensor([[slots - 1], [slots - 11]], device=DEVICE)
    tail_start = positions[:, 0] - torch.tensor(tails, device=DEVICE)
    prefix = tail_start.tolist()  # the test's own bookkeeping, not the kernel's
    counts = prefix if budget == "all" else budget
    groups = kv_heads if per_head else 1
    indices = selected_slots(prefix, groups, max(prefix), torch.Generator().manual_seed(seed))
    counts_t = torch.tensor(counts, device=DEVICE)
    max_keys = max(c + t + 1 for c, t in zip(counts, tails))
    out = sparse_attention(q, k, v, positions, indices, counts_t, tail_start, max_keys,
                           splits=splits, block_n=block_n)
    ref = reference_sparse_attention(q.double(), k.double(), v.double(), positions, indices,
                                     counts_t, tail_start)
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    # With sinks (gpt-oss): the merge adds them once, whatever the split count.
    sinks = randn(heads, dtype=torch.float32, seed=seed + 3)
    out = sparse_attention(q, k, v, positions, indices, counts_t, tail_start, max_keys,
                           splits=splits, block_n=block_n, sinks=sinks)
    ref = reference_sparse_attention(q.double(), k.double(), v.double(), positions, indices,
                                     counts_t, tail_start, sinks.double())
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["logit", "weight"])
@pytest.mark.parametrize("rows_kind", ["two", "all", "last"])
def test_collect_scores_matches_reference(dtype, mode, rows_kind):
    # Two blocks of slots per KV head (a program's share); the second sequence ends
    # inside the first, so its second block is skipped.
    block = COLLECT_TILES * BLOCK_N
    batch, rows, heads, kv_heads, dim, kv_len = 2, 9, 8, 2, 32, block + 88
    seed = len(mode) * 10 + len(rows_kind)
    q = randn(batch, rows, heads, dim, dtype=dtype, seed=seed)
    k = randn(batch, kv_heads, kv_len + SLACK, dim, dtype=dtype, seed=seed + 1)
    v = randn(batch, kv_heads, kv_len + SLACK, dim, dtype=dtype, seed=seed + 2)
    ends = [kv_len, block - 29]
    positions = window_positions(ends, rows)
    weights = row_weights(rows_kind, batch, rows)
    _, lse, _ = verify_attention(q, k, v, positions, kv_len, splits=2)
    _, ref_lse, _ = reference_verify_attention(q.double(), k.double(), v.double(), positions,
                                               kv_len)
    weight_mode = mode == "weight"
    got = collect_scores(q, k, positions, weights, kv_len, lse if weight_mode else None)
    ref = reference_collect_scores(q.double(), k.double(), positions, weights.double(), kv_len,
                                   ref_lse if weight_mode else None)
    assert got.dtype == torch.float32 and got.shape == (batch, kv_heads, kv_len)
    assert_prefix_close(got, ref, ends, TOLERANCE[dtype])
    if not weight_mode:  # the same sums as the scores fused into the verify pass
        _, _, fused = verify_attention(q, k, v, positions, kv_len, weights, splits=2)
        assert_prefix_close(got, fused, ends, TOLERANCE[dtype])

    home = torch.full((batch, 2 * kv_heads, kv_len + 5), float("nan"), device=DEVICE)[:, 1::2]
    into = collect_scores(q, k, positions, weights, kv_len, lse if weight_mode else None,
                          out=home)
    assert into.data_ptr() == home.data_ptr()
    assert_prefix_close(home, ref, ends, TOLERANCE[dtype])
    assert home[1, :, ends[1]:].isnan().all()  # past the end: unwritten


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, heads, kv_heads, dim, splits, sinks", [
    (7, 9, 3, 64, 3, False),  # SmolLM2's heads, a gamma-6 window
    (1, 4, 2, 32, 2, False),  # one row: it is both edges
    (4, 8, 2, 16, 5, True),  # attention sinks join each row's lse
    (7, 9, 3, 64, 1, True),  # one split, sinks in the lse
])
def test_edge_weight_scores_match_the_reference(dtype, rows, heads, kv_heads, dim, splits,
                                                sinks):
    """The verify pass keeps the first and last rows' logits (float16); with its lse they
    give the Collect-2-Query probabilities, as the deferred pass computes them from K."""
    batch, kv_len = 2, 300
    seed = rows * 10 + dim
    q = randn(batch, rows, heads, dim, dtype=dtype, seed=seed)
    k = randn(batch, kv_heads, kv_len + SLACK, dim, dtype=dtype, seed=seed + 1)
    v = randn(batch, kv_heads, kv_len + SLACK, dim, dtype=dtype, seed=seed + 2)
    sink = randn(heads, dtype=torch.float32, seed=seed + 3) if sinks else None
    ends = [kv_len, kv_len - 77]
    positions = window_positions(ends, rows)
    weights = row_weights("two", batch, rows)
    out, lse, edges = verify_attention(q, k, v, positions, kv_len, edge_logits=True,
                                       splits=splits, sinks=sink)
    plain_out, plain_lse, _ = verify_attention(q, k, v, positions, kv_len, splits=splits,
                                               sinks=sink)
    assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)
    assert edges.dtype == torch.float16 and edges.shape == (
        batch, kv_heads, (2 if rows > 1 else 1) * heads // kv_heads, kv_len)
    _, ref_lse, _ = reference_verify_attention(q.double(), k.double(), v.double(), positions,
                                               kv_len, sinks=sink)
    ref = reference_collect_scores(q.double(), k.double(), positions, weights.double(), kv_len,
                                   ref_lse)
    home = torch.full((batch, kv_heads, kv_len + 5), float("nan"), device=DEVICE)
    got = edge_weight_scores(edges, lse, positions, weights, kv_len, out=home)
    assert got.data_ptr() == home.data_ptr()
    # float16 logits: each weight to within |logit| * 2**-11 relative (logits here < 8).
    tol = max(TOLERANCE[dtype], 8 * 2.0 ** -11)
    assert_prefix_close(got, ref, ends, tol)
    assert home[1, :, ends[1]:].isnan().all()  # past the end: unwritten
    with pytest.raises(ValueError, match="edge_logits"):
        verify_attention(q, k, v, positions, kv_len, weights, edge_logits=True)


def test_reference_scores_agree():
    """The two references' logit sums agree (the fused and the deferred path)."""
    q = randn(2, 4, 4, 16, dtype=torch.float64, seed=7)
    k = randn(2, 2, 30, 16, dtype=torch.float64, seed=8)
    v = randn(2, 2, 30, 16, dtype=torch.float64, seed=9)
    positions = window_positions([30, 21], 4)
    w = row_weights("two", 2, 4).double()
    _, _, fused = reference_verify_attention(q, k, v, positions, 30, w)
    torch.testing.assert_close(reference_collect_scores(q, k, positions, w, 30), fused)


def test_one_launch_serves_two_lengths():
    """One launch configuration (fixed grid and arguments: split count, kv_len bound,
    key bound, buffers) is right for a short and a long state of the same buffers, as a
    CUDA graph captured once and replayed while the sequences grow needs. On a GPU the
    launches are captured in a graph and replayed; on the CPU they are called again."""
    batch, rows, heads, kv_heads, dim, bound, splits, width = 2, 4, 4, 2, 32, 256, 3, 64
    q = randn(batch, rows, heads, dim, dtype=torch.float32, seed=1)
    k = randn(batch, kv_heads, bound, dim, dtype=torch.float32, seed=2)
    v = randn(batch, kv_heads, bound, dim, dtype=torch.float32, seed=3)
    weights = row_weights("two", batch, rows)
    # The buffers the launches read: refilled in place for each state.
    positions = torch.zeros(batch, rows, dtype=torch.long, device=DEVICE)
    indices = torch.zeros(batch, 1, width, dtype=torch.long, device=DEVICE)
    counts = torch.zeros(batch, dtype=torch.long, device=DEVICE)
    tail_start = torch.zeros(batch, dtype=torch.long, device=DEVICE)
    fused = torch.empty(batch, kv_heads, bound, device=DEVICE)
    deferred = torch.empty(batch, kv_heads, bound, device=DEVICE)
    from_edges = torch.empty(batch, kv_heads, bound, device=DEVICE)
    max_keys = width + bound

    def launch():
        out, lse, _ = verify_attention(q, k, v, positions, bound, weights, scores_out=fused,
                                       splits=splits)
        collect_scores(q, k, positions, weights, bound, lse, out=deferred)
        _, _, edges = verify_attention(q, k, v, positions, bound, edge_logits=True,
                                       splits=splits)
        edge_weight_scores(edges, lse, positions, weights, bound, out=from_edges)
        draft = sparse_attention(q[:, -1:], k, v, positions[:, -1:], indices, counts,
                                 tail_start, max_keys, splits=splits)
        return out, lse, draft

    replay = captured(launch)
    g = torch.Generator().manual_seed(4)
    for ends, budgets, tails in (([60, 33], [10, 0], [3, 0]), ([bound, 190], [64, 40], [20, 5])):
        positions.copy_(window_positions(ends, rows))
        tail_start.copy_(torch.tensor([e - 1 - t for e, t in zip(ends, tails)]))
        counts.copy_(torch.tensor(budgets))
        indices.copy_(selected_slots([e - 1 - t for e, t in zip(ends, tails)], 1, width, g))
        out, lse, draft = replay()
        ref_out, ref_lse, ref_scores = reference_verify_attention(
            q.double(), k.double(), v.double(), positions, bound, weights.double())
        tol = TOLERANCE[torch.float32]
        torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)
        assert_prefix_close(fused, ref_scores, ends, tol)
        ref_weights = reference_collect_scores(q.double(), k.double(), positions,
                                               weights.double(), bound, ref_lse)
        assert_prefix_close(deferred, ref_weights, ends, tol)
        assert_prefix_close(from_edges, ref_weights, ends, 8 * 2.0 ** -11)
        ref_draft = reference_sparse_attention(q[:, -1:].double(), k.double(), v.double(),
                                               positions[:, -1:], indices, counts, tail_start)
        torch.testing.assert_close(draft.double(), ref_draft, atol=tol, rtol=tol)


def test_a_full_batch_draft_step_replayed_many_times_matches_the_reference(monkeypatch):
    """The draft step's attention where a batch fills the GPU: as many sequences as SMs
    (Gemma3-270M's shape: 4 query heads on one KV head of 256 dims), so that the sparse
    kernel over the static key bound of a captured step (list capacity + cache) runs two
    splits of BLOCK_N-slot tiles, and a sliding layer's 512-slot window two splits too,
    both merged by their last programs through the shared counters. Replayed as decode
    steps are, with positions, lists and tails moving and the two launches taking turns
    on the counters, every replay equals the reference and leaves the counters at 0. On
    the CPU the same launch shape comes from a batch of 2 on a pretended 2-SM device."""
    if DEVICE != "cuda":
        monkeypatch.setattr(launch, "sm_count", lambda device: 2)
    device = torch.device(DEVICE)
    heads, kv_heads, dim, slots, window, width = 4, 1, 256, 1024, 512, 640
    batch = launch.sm_count(device)
    max_keys = width + slots  # the bound a captured draft step passes
    splits, block_n = launch.sparse_tiling(device, batch * kv_heads, max_keys)
    assert (splits, block_n) == (2, BLOCK_N)
    assert launch.splits_for(device, batch * kv_heads, window, launch.tile_slots(dim)) == 2
    assert launch.merges_in_kernel(splits, heads // kv_heads, dim)
    q = randn(batch, 1, heads, dim, dtype=torch.float32, seed=11)
    k = randn(batch, kv_heads, slots, dim, dtype=torch.float32, seed=12)
    v = randn(batch, kv_heads, slots, dim, dtype=torch.float32, seed=13)
    positions = torch.zeros(batch, 1, dtype=torch.long, device=DEVICE)
    indices = torch.zeros(batch, 1, width, dtype=torch.long, device=DEVICE)
    counts = torch.zeros(batch, dtype=torch.long, device=DEVICE)
    tail_start = torch.zeros(batch, dtype=torch.long, device=DEVICE)

    def step():
        draft = sparse_attention(q, k, v, positions, indices, counts, tail_start, max_keys)
        local, _, _ = verify_attention(q, k, v, positions, slots, window=window)
        return draft, local

    replay = captured(step)
    g = torch.Generator().manual_seed(14)
    rows = torch.arange(batch)
    # (budget, tail): a small budget whose tail is a split of its own, one that ends a
    # split exactly, and a large one; each sequence at its own position.
    for budget, tail in ((128, 5), (128, 0), (600, 6), (37, 3)):
        ends = (slots - 1 - (rows * 7 + budget) % 200).tolist()
        positions.copy_(torch.tensor(ends)[:, None])
        tail_start.copy_(torch.tensor([e - tail for e in ends]))
        counts.copy_(torch.full((batch,), budget))
        indices.copy_(selected_slots([e - tail for e in ends], 1, width, g))
        draft, local = replay()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        want = reference_sparse_attention(q.double(), k.double(), v.double(), positions,
                                          indices, counts, tail_start)
        tol = TOLERANCE[torch.float32]
        torch.testing.assert_close(draft.double(), want, atol=tol, rtol=tol)
        want_local, _, _ = reference_verify_attention(q.double(), k.double(), v.double(),
                                                      positions, slots, window=window)
        torch.testing.assert_close(local.double(), want_local, atol=tol, rtol=tol)
        assert split_merge._counters[split_merge.counters_device(device)].eq(0).all()


def assert_same_top_slots(got, scores, prefix, budget, k_cap, sum_heads, reserved):
    """Each row of ``got`` holds budget[b] distinct prefix slots, ascending, then zeros;
    the reserved window's slots among them, and scores that equal the reference top-k's
    (sets may differ only between equal scores)."""
    ref = reference_topk_slots(scores, prefix, budget, k_cap, sum_heads, reserved)
    summed = scores.sum(2, keepdim=True) if sum_heads else scores
    assert got.shape == ref.shape
    for layer in range(got.shape[0]):
        for b in range(got.shape[1]):
            n = int(budget[b])
            must = set()
            if reserved is not None:
                must = set(reserved_slots(prefix, reserved, scores.shape[-1])[b]
                           .nonzero().flatten().tolist())
            for g in range(got.shape[2]):
                row = got[layer, b, g].tolist()
                chosen = row[:n]
                assert chosen == sorted(set(chosen)) and all(s < prefix[b] for s in chosen)
                assert all(s == 0 for s in row[n:])
                assert must <= set(chosen)
                picked = sorted(summed[layer, b, g, s].item() for s in set(chosen) - must)
                best = sorted(summed[layer, b, g, s].item() for s in ref[layer, b, g, :n].tolist()
                              if s not in must)
                assert picked == best


@pytest.mark.parametrize("span, scores_like", [(40, "logits"), (300, "weights"), (1000, "ties"),
                                                (2049, "ties"), (2500, "sink"), (4096, "logits"),
                                                (4600, "weights")])
@pytest.mark.parametrize("sum_heads", [False, True])
@pytest.mark.parametrize("window", [False, True])
def test_topk_slots_takes_the_reference_top_k(span, scores_like, sum_heads, window):
    """Ragged prefixes and budgets (zero, the whole prefix, between); scores like logits,
    like softmax weights (positive, spanning many binades), with ties (rounded to
    integers) or with one huge sink and a heavy tail (the search's hard cases); heads
    summed or ranked one by one; a reserved window of sinks and recent slots or none.
    Scores are a slice of a longer buffer, as the engine's score home is."""
    g = torch.Generator().manual_seed(span)
    layers, batch, heads = 2, 4, 3
    home = torch.randn(layers, batch, heads, span + 24, generator=g)
    if scores_like == "weights":
        home = torch.softmax(3 * home, dim=-1)
    elif scores_like == "ties":
        home = home.mul(2).round()
    elif scores_like == "sink":
        home = home / torch.rand(home.shape, generator=g).clamp_min(1e-3)  # heavy tails
        home[..., 0] = 1e4
    scores = home.to(DEVICE)[..., :span]
    prefix = torch.tensor([span, span // 2, 7, 1], device=DEVICE)
    budget = torch.stack([prefix[0] // 20, prefix[1], torch.tensor(0, device=DEVICE),
                          prefix[3]])
    k_cap = span // 2
    reserved = torch.floor(budget.double() * 0.5).long() if window else None
    got = topk_slots(scores, prefix, budget, k_cap, sum_heads, reserved)
    assert_same_top_slots(got, scores, prefix, budget, k_cap, sum_heads, reserved)


def test_topk_slots_ranks_ties_across_both_blocks_of_a_split_row():
    """Ties at the threshold in both blocks of a split row (2048 + a tail): the lowest
    slots win, counted through the first block into the second."""
    span = 2100
    scores = torch.full((1, 2, 1, span), -1.0)
    scores[..., :10] = 5.0  # above the threshold
    scores[..., 100:120] = 0.0  # 20 ties in the first block
    scores[..., 2050:2090] = 0.0  # 40 in the second
    scores = scores.to(DEVICE)
    prefix = torch.tensor([span, span], device=DEVICE)
    budget = torch.tensor([40, 10 + 20 + 40], device=DEVICE)
    got = topk_slots(scores, prefix, budget, 80)
    assert got[0, 0, 0, :40].tolist() == list(range(10)) + list(range(100, 120)) + list(
        range(2050, 2060))
    assert got[0, 1, 0, :70].tolist() == list(range(10)) + list(range(100, 120)) + list(
        range(2050, 2090))
    assert_same_top_slots(got, scores, prefix, budget, 80, False, None)


def test_topk_slots_one_launch_serves_new_lengths_and_budgets():
    """The launch reads prefix lengths and budgets from the device: replayed (a captured
    CUDA graph on a GPU) after they change in place, it selects for the new ones."""
    layers, batch, heads, span = 2, 3, 2, 512
    scores = torch.empty(layers, batch, heads, span, device=DEVICE)
    prefix = torch.zeros(batch, dtype=torch.long, device=DEVICE)
    budget = torch.zeros(batch, dtype=torch.long, device=DEVICE)
    replay = captured(lambda: topk_slots(scores, prefix, budget, span // 4, sum_heads=True))
    g = torch.Generator().manual_seed(11)
    for lengths, budgets in (([100, 20, 512], [10, 20, 30]), ([500, 3, 256], [128, 0, 13])):
        scores.copy_(torch.randn(scores.shape, generator=g))
        prefix.copy_(torch.tensor(lengths))
        budget.copy_(torch.tensor(budgets))
        assert_same_top_slots(replay(), scores, prefix, budget, span // 4, True, None)


def test_topk_slots_reads_rows_rounded_up_only_inside_their_storage():
    """Rows are loaded up to their length rounded to LOAD_ALIGN slots (so the loads
    vectorise) where the storage holds that much, else exactly: scores that end where
    their storage ends are never read past, and still select right."""
    from vegas_kernels.select_slots import LOAD_ALIGN, _load_len

    home = torch.randn(2, 3, 2, 100, generator=torch.Generator().manual_seed(5))
    assert LOAD_ALIGN == 16
    assert _load_len(home[..., :90]) == 96
    assert _load_len(home[..., :96]) == 96
    assert _load_len(home) == 100  # the last row ends the storage: 112 would run past it
    scores = home.to(DEVICE)
    prefix = torch.tensor([100, 61, 33], device=DEVICE)
    budget = torch.tensor([9, 20, 33], device=DEVICE)
    reserved = torch.tensor([4, 0, 3], device=DEVICE)
    for sum_heads in (False, True):
        got = topk_slots(scores, prefix, budget, 40, sum_heads, reserved)
        assert_same_top_slots(got, scores, prefix, budget, 40, sum_heads, reserved)


@pytest.mark.parametrize("drafter", ["vegas", "streaming", "snapkv"])
def test_engine_on_the_kernel_path_matches_the_reference_path(drafter, monkeypatch):
    """Vanilla decode steps and index-list drafts through the kernels give the same
    greedy tokens as the reference path (float32)."""
    from vegas_core import SpecConfig, generate
    from tests.test_engine import tiny_model

    model = tiny_model(head_dim=16)  # the kernels need a head dim of 16 or more
    if DEVICE == "cuda":
        model.net.to(DEVICE)
    prompts = [list(range(1, 70)), list(range(5, 40))]
    spec = SpecConfig(drafter=drafter, gamma=3, sparsity=0.1, min_tokens=4)
    monkeypatch.setenv("VEGAS_ATTENTION", "reference")
    ref_vanilla = generate(model, prompts, max_new_tokens=10, ignore_eos=True).tokens
    ref_spec = generate(model, prompts, max_new_tokens=10, ignore_eos=True, spec=spec).tokens
    monkeypatch.setenv("VEGAS_ATTENTION", "triton")
    assert generate(model, prompts, max_new_tokens=10, ignore_eos=True).tokens == ref_vanilla
    assert generate(model, prompts, max_new_tokens=10, ignore_eos=True, spec=spec).tokens == ref_spec
    assert ref_spec == ref_vanilla


@pytest.mark.parametrize("collect, granularity", [("two", "layer"), ("all", "kv_head")])
def test_fused_verify_scores_select_what_the_reference_selects(collect, granularity,
                                                                monkeypatch):
    """With the kernels on, a vegas verify hands over row-summed logit scores (no per-row
    tensor), and the selection they give equals the reference path's."""
    from vegas_core import SpecConfig
    from vegas_core.sampling import SamplingParams
    from vegas_core.speculative import SpeculativeSession
    from tests.test_engine import tiny_model
    from tests.test_gpu_path import finished_collectors

    model = tiny_model(head_dim=16)
    if DEVICE == "cuda":
        model.net.to(DEVICE)
    spec = SpecConfig(gamma=3, sparsity=0.1, min_tokens=4, collect=collect,
                      granularity=granularity)
    prompts = [list(range(1, 80)), list(range(3, 50))]
    sessions, collectors = {}, {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("VEGAS_ATTENTION", backend)
        session = SpeculativeSession(model, prompts, spec, SamplingParams(), 8, prefill_chunk=32)
        seen = finished_collectors(monkeypatch)
        session.step(torch.tensor([True, True], device=DEVICE))
        sessions[backend], collectors[backend] = session, seen[-1]
    layers = model.config.num_layers
    assert len(collectors["triton"]._summed) == layers  # the kernel summed them
    assert not collectors["triton"]._per_row and not collectors["triton"]._deferred
    assert len(collectors["reference"]._per_row) == layers
    ref, got = sessions["reference"].selection, sessions["triton"].selection
    assert torch.equal(ref.counts, got.counts)
    for layer in range(ref.indices.shape[0]):
        for b in range(2):
            for g in range(ref.indices.shape[2]):
                n = int(ref.counts[layer, b])
                assert set(ref.indices[layer, b, g, :n].tolist()) == set(
                    got.indices[layer, b, g, :n].tolist())


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_hybrid_and_moe_models_on_the_static_kernel_path_match_the_reference(
        family, tiny_hf, monkeypatch):
    """Sliding layers (their windows in the verify kernel, drafts over the whole window),
    attention sinks in the merge, the grouped mixture kernel (gpt-oss's; Qwen3-MoE's
    SiLU experts are the kernel tests' other case) and the selection of the global
    layers only, on the static buffers a GPU captures: the same greedy tokens as the
    reference path (float32)."""
    from vegas_core import SpecConfig, generate, load_model

    path, _ = tiny_hf(family)
    model = load_model(str(path), device=DEVICE, dtype="float32")
    g = torch.Generator().manual_seed(5)
    # Longer than the 8-token windows; few tokens: the interpreter runs every program.
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (40, 21)]
    spec = SpecConfig(drafter="vegas", gamma=2, sparsity=0.1, min_tokens=4)
    run = lambda **kw: generate(model, prompts, max_new_tokens=5, ignore_eos=True,  # noqa: E731
                                **kw).tokens
    monkeypatch.setenv("VEGAS_ATTENTION", "reference")
    ref_vanilla, ref_spec = run(), run(spec=spec)
    monkeypatch.setenv("VEGAS_ATTENTION", "triton")
    monkeypatch.setenv("VEGAS_CUDA_GRAPHS", "static")
    assert run() == ref_vanilla
    assert run(spec=spec) == ref_spec == ref_vanilla
    # Weight scores: the global layers' edge logits, lse with the sinks.
    assert run(spec=SpecConfig(drafter="vegas", gamma=2, sparsity=0.1, min_tokens=4,
                               score="weight")) == ref_vanilla


def test_counters_out_of_phase_counts_and_resets_retired_buffers_too(monkeypatch):
    """A graph captured before the counters grew keeps the old buffer: the check after a
    call reads and resets it as well as the current one."""
    monkeypatch.setattr(split_merge, "_counters", {})
    monkeypatch.setattr(split_merge, "_retired_counters", [])
    small = split_merge.split_counters("cpu", 4)
    large = split_merge.split_counters("cpu", 16)
    assert large is not small and split_merge._retired_counters == [small]
    assert split_merge.counters_out_of_phase("cpu") == 0
    small[1], large[3], large[5] = 1, 2, 1
    assert split_merge.counters_out_of_phase("cpu") == 3
    assert small.eq(0).all() and large.eq(0).all()
