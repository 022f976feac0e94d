"""Selection against brute-force references; budgets; the recent tail; rollback."""

from __future__ import annotations

import math

import pytest
import torch

from vegas_core import SpecConfig
from vegas_core.attention import AttentionMeta, attend
from vegas_core.cache import KVCache
from vegas_core.scores import ScoreCollector
from vegas_core.selection import (STREAMING_SINKS, OracleSelection, QuestSelection,
                                  SelectionInputs, draft_budget, make_drafter)
from vegas_core.spec_config import COLLECT, GRANULARITIES, SCORES, fork_budget
from tests.test_engine import tiny_model

L, B, HKV, T, S = 3, 2, 2, 5, 40


@pytest.fixture(params=["reference", "triton"])
def selection_path(request, monkeypatch):
    """Top-k by PyTorch, or by ``vegas_kernels.select_slots`` in Triton's interpreter. These
    tables live on the CPU: on a GPU machine the kernel's own tests (tests/test_kernels.py)
    run it natively instead."""
    if request.param == "triton" and torch.cuda.is_available():
        pytest.skip("CPU tables; the GPU runs tests/test_kernels.py's top-k tests")
    monkeypatch.setenv("VEGAS_ATTENTION", request.param)
    return request.param


def random_tables(seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-row scores of a verify window, [L, B, H_kv, T, S], of either mode."""
    g = torch.Generator().manual_seed(seed)
    return {"logit": torch.randn(L, B, HKV, T, S, generator=g),
            "weight": torch.rand(L, B, HKV, T, S, generator=g)}


def collector_of(tables, mode: str, layers=None) -> ScoreCollector:
    """A collector fed ``tables`` as the reference attention feeds it (one query head
    per KV head, every slot visible)."""
    c = ScoreCollector(mode, layers)
    mask = torch.ones(B, HKV, 1, T, S, dtype=torch.bool)
    for layer in range(L):
        per_row = tables[mode][layer][:, :, None]
        c.add(layer, per_row, per_row, mask)
    return c


def select(drafter, tables, prefix_len, budget, last_row):
    """What the loop does after a verify: finish the drafter's scores, then select."""
    last_row = torch.tensor(last_row)
    scores = None
    if drafter.score_mode is not None:
        c = collector_of(tables, drafter.score_mode, drafter.collect_layers)
        scores = c.finish(lambda: drafter.score_rows(T, last_row))
    return drafter.select(SelectionInputs(scores, T, last_row, torch.tensor(prefix_len),
                                          torch.tensor(budget), iteration=1, num_layers=L))


def brute_force_vegas(tables, collect, score, granularity, prefix_len, budget, last_row):
    """Python loops: sum the collected rows and heads, sort, take the top budget."""
    chosen = {}
    table = tables[score]
    for layer in range(L):
        for b in range(B):
            rows = {"two": [0, T - 1], "all": list(range(T)), "last": [last_row[b]]}[collect]
            groups = [[0, 1]] if granularity == "layer" else [[0], [1]]
            for g, heads in enumerate(groups):
                totals = [sum(float(table[layer][b, h, r, s]) for h in heads for r in rows)
                          for s in range(prefix_len[b])]
                order = sorted(range(prefix_len[b]), key=lambda s: -totals[s])
                chosen[layer, b, g] = set(order[: budget[b]])
    return chosen


@pytest.mark.parametrize("collect", COLLECT)
@pytest.mark.parametrize("score", SCORES)
@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_vegas_topk_matches_brute_force(collect, score, granularity, selection_path):
    tables = random_tables()
    prefix_len, budget, last_row = [33, 20], [7, 5], [2, 0]
    spec = SpecConfig(collect=collect, score=score, granularity=granularity)
    sel = select(make_drafter(spec, L), tables, prefix_len, budget, last_row)
    expected = brute_force_vegas(tables, collect, score, granularity, prefix_len, budget, last_row)
    for (layer, b, g), want in expected.items():
        got = set(sel.indices[layer, b, g, : sel.counts[layer, b]].tolist())
        assert got == want
    assert sel.tail_start.tolist() == prefix_len


def test_a_hybrid_model_collects_and_selects_in_its_global_layers_only():
    """Layers 0 and 2 slide (their drafts read their window): vegas asks for layer 1's
    scores alone and ranks layer 1 alone, the same slots as over all three layers."""
    spec = SpecConfig(collect="two", score="logit", granularity="layer")
    drafter = make_drafter(spec, L, [1])
    assert drafter.collect_layers == {1}
    tables = random_tables(3)
    prefix_len, budget, last_row = [33, 20], [7, 5], [2, 0]
    sel = select(drafter, tables, prefix_len, budget, last_row)
    every = select(make_drafter(spec, L), tables, prefix_len, budget, last_row)
    assert sel.layers == (1,) and sel.indices.shape[0] == 1 and sel.row(1) == 0
    for b in range(B):
        n = int(sel.counts[0, b])
        assert set(sel.indices[0, b, 0, :n].tolist()) == set(every.indices[1, b, 0, :n].tolist())
    mask = sel.prefix_mask(1, S)
    torch.testing.assert_close(mask, every.prefix_mask(1, S))


def test_collector_keeps_the_verify_pass_scores():
    g = torch.Generator().manual_seed(1)
    cache = KVCache(1, 1, 16, 2, 4, dtype=torch.float64, device="cpu")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g, dtype=torch.float64))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g, dtype=torch.float64))
    q = torch.randn(1, 3, 6, 4, generator=g, dtype=torch.float64)  # 3 rows, 6 heads, group 3
    positions = torch.tensor([[10, 11, 12]])
    collectors = {mode: ScoreCollector(mode) for mode in ("logit", "weight")}
    for collector in collectors.values():
        attend(q, cache, 0, AttentionMeta.verify(positions, 13, collector=collector))
    k = cache.k[0, 0, :, :13]  # [H_kv, S, D]
    row_weights = torch.tensor([[0.5, 0.0, 2.0]], dtype=torch.float64)
    logit = collectors["logit"].finish(lambda: row_weights)[0, 0]  # [H_kv, S]
    weight = collectors["weight"].finish(lambda: row_weights)[0, 0]
    for kv in range(2):
        heads = range(3 * kv, 3 * kv + 3)
        logits = torch.stack([q[0, :, h] @ k[kv].T / 2.0 for h in heads])  # [3, T, S]
        causal = torch.arange(13)[None] <= positions[0][:, None]
        weights = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
        rows = row_weights[0][None, :, None]
        torch.testing.assert_close(logit[kv], (logits.masked_fill(~causal, 0) * rows).sum((0, 1)))
        torch.testing.assert_close(weight[kv], (weights * rows).sum((0, 1)))


def test_budget_rule():
    prefix = torch.tensor([1000, 1001, 100, 10, 0])
    assert draft_budget(prefix, 0.05, 16).tolist() == [50, 51, 16, 10, 0]
    assert draft_budget(torch.tensor([8000]), 0.05, 256).tolist() == [400]


@pytest.mark.parametrize("sparsity, min_tokens", [(0.05, 16), (0.1023, 256), (0.3, 1), (1.0, 0)])
def test_budget_rule_is_the_same_on_the_host_and_on_tensors(sparsity, min_tokens):
    """Static sizes and the cost model use host ints, drafters tensors: one rule."""
    lengths = [0, 1, 7, 255, 256, 2500, 8000, 32137, 131072]
    on_device = draft_budget(torch.tensor(lengths), sparsity, min_tokens).tolist()
    assert on_device == [draft_budget(n, sparsity, min_tokens) for n in lengths]


def test_budget_covering_the_prefix_selects_all_of_it():
    sel = select(make_drafter(SpecConfig(), L), random_tables(2), [12, 9], [12, 9], [0, 0])
    for layer in range(L):
        assert set(sel.indices[layer, 0, 0, :12].tolist()) == set(range(12))
        assert set(sel.indices[layer, 1, 0, :9].tolist()) == set(range(9))


def test_streaming_keeps_sinks_and_the_most_recent_prefix():
    sel = select(make_drafter(SpecConfig(drafter="streaming"), L), None, [100, 30], [40, 30],
                 [0, 0])
    first = set(sel.indices[0, 0, 0, : sel.counts[0, 0]].tolist())
    assert first == set(range(STREAMING_SINKS)) | set(range(100 - 24, 100))
    assert set(sel.indices[2, 1, 0, : sel.counts[2, 1]].tolist()) == set(range(30))


def test_streaming_index_lists_hold_the_window_mask():
    """The index lists built directly hold exactly the slots of the window's mask."""
    from vegas_kernels.select_slots import reserved_indices, reserved_slots

    prefix = torch.tensor([100, 30, 17, 5, 1])
    for reserved in (torch.tensor([40, 30, 16, 5, 1]), torch.tensor([16, 3, 0, 2, 1])):
        width = int(reserved.max())
        lists = reserved_indices(prefix, reserved, width)
        mask = reserved_slots(prefix, reserved, 100)
        for b in range(len(prefix)):
            chosen = lists[b, : reserved[b]].tolist()
            assert chosen == mask[b].nonzero().flatten().tolist()
            assert all(s == 0 for s in lists[b, reserved[b]:].tolist())


@pytest.mark.parametrize("kind", ["vegas", "streaming", "quest", "oracle"])
def test_recent_tail_is_always_attended(kind):
    torch.manual_seed(0)
    prefix_len, budget = torch.tensor([30, 21]), torch.tensor([4, 4])
    if kind == "quest":
        sel = QuestSelection(prefix_len, budget)
    elif kind == "oracle":
        sel = OracleSelection(prefix_len, budget, "logit", "layer")
    else:
        scores = torch.randn(1, B, HKV, S) if kind == "vegas" else None
        sel = make_drafter(SpecConfig(drafter=kind), 1).select(SelectionInputs(
            scores, T, torch.tensor([0, 0]), prefix_len, budget, 1, 1))
    positions = torch.tensor([[35], [27]])
    q, k = torch.randn(B, 1, 4, 8), torch.randn(B, HKV, S, 8)
    mask = AttentionMeta.draft(positions, S, sel).mask(0, q, k)  # [B, G, 1, 1, S]
    for b in range(B):
        row = mask[b, :, 0, 0]
        start, pos = int(prefix_len[b]), int(positions[b, 0])
        assert row[:, start : pos + 1].all()  # the tail up to the query itself
        assert not row[:, pos + 1 :].any()  # nothing after it
        assert (row[:, :start].sum(-1) <= 16).all()  # prefix within budget (Quest: pages)


def test_oracle_takes_the_exact_top_k_of_the_draft_query():
    torch.manual_seed(1)
    q, k = torch.randn(1, 1, 4, 8), torch.randn(1, 2, 24, 8)
    sel = OracleSelection(torch.tensor([20]), torch.tensor([5]), "logit", "layer")
    mask = sel.prefix_mask(0, 24, q, k, torch.tensor([[22]]))
    scores = torch.einsum("hd,hsd->hs", q[0, 0], k[0].repeat_interleave(2, 0)).sum(0)
    want = set(torch.topk(scores[:20], 5).indices.tolist())
    assert set(mask[0, 0].nonzero().flatten().tolist()) == want


def test_quest_scores_pages_by_key_bounds():
    torch.manual_seed(2)
    q, k = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 64, 4)  # one KV head, 4 pages of 16
    sel = QuestSelection(torch.tensor([64]), torch.tensor([32]))  # 2 pages
    mask = sel.prefix_mask(0, 64, q, k, torch.tensor([[70]]))
    kmax = k[0, 0].view(4, 16, 4).amax(1)
    kmin = k[0, 0].view(4, 16, 4).amin(1)
    score = sum(torch.maximum(q[0, 0, h] * kmax, q[0, 0, h] * kmin).sum(-1) for h in range(2))
    best_other = int(torch.argmax(score[:3]))  # the last page (3) is always kept
    want = set(range(48, 64)) | set(range(16 * best_other, 16 * best_other + 16))
    assert set(mask[0, 0].nonzero().flatten().tolist()) == want


def test_rollback_leaves_the_cache_as_vanilla_decoding_would():
    from vegas_core.sampling import SamplingParams
    from vegas_core.speculative import SpeculativeSession

    model = tiny_model()
    prompts = [list(range(3, 43)), list(range(10, 31))]
    session = SpeculativeSession(model, prompts, SpecConfig(gamma=4, sparsity=0.1, min_tokens=3),
                                 SamplingParams(), 30, prefill_chunk=16)
    committed = [list(p) for p in prompts]
    pending = session.pending.tolist()
    rejected = False
    for _ in range(5):
        new = session.step(torch.tensor([True, True]))
        rejected |= any(len(tokens) < 4 + 1 for tokens in new)
        for b in range(2):
            committed[b].append(pending[b])
            committed[b].extend(new[b][:-1])
        pending = [new[b][-1] for b in range(2)]
    assert rejected  # some drafts were rejected
    net = model.net
    for b in range(2):
        n = len(committed[b])
        assert int(session.cache.lengths[b]) == n
        fresh = net.new_cache(1, n)
        positions = torch.arange(n)[None]
        with torch.inference_mode():
            net(torch.tensor([committed[b]]), positions, fresh, AttentionMeta.full(positions, n))
        torch.testing.assert_close(session.cache.k[:, b, :, :n], fresh.k[:, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(session.cache.v[:, b, :, :n], fresh.v[:, 0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0.25, 0.5, 0.75])
def test_window_reserves_sinks_and_recent_then_fills_by_score(window, selection_path):
    tables = random_tables(3)
    prefix_len, budget = [36, 30], [12, 8]
    spec = SpecConfig(window=window, granularity="kv_head")
    sel = select(make_drafter(spec, L), tables, prefix_len, budget, [0, 0])
    for b in range(B):
        reserved = math.floor(budget[b] * window)
        sinks = min(reserved, STREAMING_SINKS)
        must = set(range(sinks)) | set(range(prefix_len[b] - (reserved - sinks), prefix_len[b]))
        for layer in range(L):
            for g in range(HKV):
                got = set(sel.indices[layer, b, g, : sel.counts[layer, b]].tolist())
                assert must <= got and len(got) == budget[b]
                # The rest are the best-scoring other prefix slots.
                totals = sum(tables["logit"][layer][b, g, r] for r in (0, T - 1))
                others = sorted((s for s in range(prefix_len[b]) if s not in must),
                                key=lambda s: -float(totals[s]))
                assert got - must == set(others[: budget[b] - len(must)])


def test_window_out_of_range_is_refused():
    from vegas_core.errors import VegasError

    with pytest.raises(VegasError, match="window"):
        SpecConfig(window=0.9)


# ---- the vLLM fork's rule (rule: fork) ----------------------------------------------

def draft_keys(selection, position: int, b: int) -> set[int]:
    """The slots a draft query of sequence ``b`` at ``position`` attends to under
    ``selection`` (through the reference attention's mask)."""
    span = position + 8
    positions = torch.full((B, 1), position)
    q, k = torch.zeros(B, 1, 2, 8), torch.zeros(B, 1, span, 8)
    mask = AttentionMeta.draft(positions, span, selection).mask(0, q, k)  # [B, G, 1, 1, S]
    return set(mask[b, 0, 0, 0].nonzero().flatten().tolist())


def test_the_forks_vegas_budget_clamps_between_min_tokens_and_the_served_length():
    # clamp(ceil(seq_len * ratio), min_tokens, max(ceil(max_model_len * ratio), min_tokens)),
    # at most the slots ranked.
    cases = [  # seq_len, ratio, min_tokens, max_model_len, valid_len -> budget
        (1000, 0.05, 256, 40960, 994, 256),  # min_tokens
        (8000, 0.05, 256, 40960, 7994, 400),  # the ratio
        (200, 0.05, 256, 40960, 194, 194),  # every ranked slot
        (40960, 0.05, 256, 40960, 40954, 2048),  # the largest a served sequence reaches
        (50000, 0.05, 256, 40960, 49994, 2048),  # past max_model_len: the upper clamp
        (1000, 0.05, 256, 1000, 994, 256),  # max_model_len * ratio under min_tokens
        (3000, 0.07, 16, 40960, 2994, 210),  # float32, as the fork: 211 in float64
        (50000, 0.05, 256, None, 49994, 2500),  # no upper clamp
    ]
    for seq_len, ratio, min_tokens, max_len, valid, want in cases:
        assert fork_budget(seq_len, ratio, min_tokens, max_len, valid) == want
        on_tensors = fork_budget(torch.tensor([seq_len]), ratio, min_tokens, max_len,
                                 torch.tensor([valid]))
        assert on_tensors.tolist() == [want]


def test_the_forks_vegas_ranks_the_verified_windows_first_slot_and_attends_what_followed():
    """After a verify of 4 rows at slots start..start+3, the fork ranks [0, start + 1)
    (the window's first slot, accepted before, competes with the prefix) and attends
    every slot from start + 1 to the draft itself; the budget counts start + 4 keys."""
    spec = SpecConfig(gamma=3, sparsity=0.1, min_tokens=3, score="weight", rule="fork")
    drafter = make_drafter(spec, 1, max_model_len=100)
    start, window = torch.tensor([10, 6]), 4
    prefix_len, budget = drafter.bounds(start, window)
    assert prefix_len.tolist() == [11, 7] and budget.tolist() == [3, 3]
    scores = torch.zeros(1, B, 1, 20)  # [L, B, H_kv, S]: one KV head
    scores[0, 0, 0, [10, 2, 5]] = torch.tensor([3.0, 2.0, 1.0])  # the window's first slot wins
    scores[0, 1, 0, [0, 6, 3]] = 1.0
    scores[0, :, 0, 15:] = 9.0  # past the candidates: never chosen
    accepted = torch.tensor([1, 3])
    sel = drafter.select(SelectionInputs(scores, window, accepted, prefix_len, budget, 1, 1))
    first = (start + accepted + 1).tolist()  # where the bonus token drafts: 12, 10
    assert draft_keys(sel, first[0], 0) == {2, 5, 10} | set(range(11, first[0] + 1))
    assert draft_keys(sel, first[1] + 2, 1) == {0, 3, 6} | set(range(7, first[1] + 3))
    # This engine's own rule ranks [0, start) and always attends slot start.
    engine = make_drafter(SpecConfig(gamma=3, sparsity=0.1, min_tokens=3, score="weight"), 1)
    assert [t.tolist() for t in engine.bounds(start, window)] == [[10, 6], [3, 3]]


def test_the_forks_vegas_selects_first_from_the_prompts_last_row_over_the_whole_prompt():
    spec = SpecConfig(gamma=6, sparsity=0.05, min_tokens=4, rule="fork")
    drafter = make_drafter(spec, 1, max_model_len=5000)
    assert drafter.prefill_window(spec.gamma) == 1
    assert make_drafter(SpecConfig(gamma=6), 1).prefill_window(6) == 7
    # A one-row window at the prompt's last slot L - 1: every prompt slot is a candidate.
    prefix_len, budget = drafter.bounds(torch.tensor([999, 40]), 1)
    assert prefix_len.tolist() == [1000, 41] and budget.tolist() == [50, 4]
    rows = drafter.score_rows(1, torch.tensor([0, 0]))
    assert rows.tolist() == [[1.0], [1.0]]


def test_the_forks_streaming_window_is_whole_blocks_up_to_each_draft_query():
    """ratio 0.05, min_tokens 64, max_model_len 4096: the window is
    ceil(max(seq_len * ratio, 64) / 16) = 4 blocks up to the query's own block, besides
    the sink block [0, 16); it moves when a draft step crosses a block boundary."""
    spec = SpecConfig(drafter="streaming", gamma=3, sparsity=0.05, min_tokens=64, rule="fork")
    drafter = make_drafter(spec, 2, max_model_len=4096)
    # Verified at 500..503 with 2 drafts accepted (row 2): the drafts go to 503, 504, 505;
    # the second sequence's at 510, 511, 512 (its window moves at 512).
    start, accepted = torch.tensor([500, 506]), torch.tensor([2, 3])
    prefix_len, budget = drafter.bounds(start, 4)
    steps = drafter.select(SelectionInputs(None, 4, accepted, prefix_len, budget, 1, 2)).steps
    assert len(steps) == 3
    sinks = set(range(16))
    for step, sel in enumerate(steps):
        assert draft_keys(sel, 503 + step, 0) == sinks | set(range(448, 503 + step + 1))
    assert draft_keys(steps[1], 511, 1) == sinks | set(range(448, 512))
    assert draft_keys(steps[2], 512, 1) == sinks | set(range(464, 513))


@pytest.mark.parametrize("position, max_model_len, window_start", [
    (500, 1000, 464),  # max(ceil(1000 * 0.05), 64) = 64 slots: at most 4 - 1 = 3 blocks
    (500, None, 448),  # no clamp: 4 blocks
    (40, 4096, 16),  # the window reaches block 1: the whole sequence
    (10, 4096, 0),  # inside the sink block: the whole sequence
    (4999, 8192, 4752),  # 250 slots by the ratio: 16 blocks
])
def test_the_forks_streaming_clamp(position, max_model_len, window_start):
    spec = SpecConfig(drafter="streaming", gamma=1, sparsity=0.05, min_tokens=64, rule="fork")
    drafter = make_drafter(spec, 1, max_model_len=max_model_len)
    start = torch.tensor([position, position])
    (sel,) = drafter.select(SelectionInputs(None, 1, torch.tensor([-1, -1]), start,
                                            start, 1, 1)).steps
    want = set(range(min(16, window_start))) | set(range(window_start, position + 1))
    assert draft_keys(sel, position, 0) == want


def test_the_fork_rule_is_only_for_vegas_and_streaming():
    from vegas_core.errors import VegasError

    with pytest.raises(VegasError, match="rule 'fork'"):
        SpecConfig(drafter="quest", rule="fork")


# ---- issue 41's key options: accumulate, pages ---------------------------------------

def test_accumulated_scores_decay_the_earlier_ones_and_start_new_slots_fresh():
    from vegas_core.score_history import ScoreHistory

    history = ScoreHistory(0.5)
    first = torch.tensor([[[[4.0, 2.0, 9.0]]]])  # [L', B, H_kv, S]: slots 0, 1 ranked
    history.update(first, torch.tensor([2]))
    second = torch.tensor([[[[0.0, 6.0, 1.0, 3.0]]]])  # slots 0..2 ranked now
    got = history.update(second, torch.tensor([3]))
    # Slots 0 and 1 blend half and half; slot 2 was tail last time: its new score alone.
    assert got[0, 0, 0, :3].tolist() == [2.0, 4.0, 1.0]


def test_accumulate_changes_the_top_k_toward_slots_that_scored_before():
    spec = SpecConfig(accumulate=0.9, min_tokens=1)
    drafter = make_drafter(spec, 1)
    prefix, budget = torch.tensor([4]), torch.tensor([1])

    def pick(values):
        scores = torch.tensor(values)[None, None, None]  # [1, 1, 1, S]
        sel = drafter.select(SelectionInputs(scores, T, torch.tensor([0]), prefix, budget, 1, 1))
        return int(sel.indices[0, 0, 0, 0])

    assert pick([5.0, 0.0, 0.0, 0.0]) == 0
    # Slot 1 now leads the new pass alone, but slot 0's history keeps it first.
    assert pick([0.0, 1.0, 0.0, 0.0]) == 0
    assert make_drafter(SpecConfig(min_tokens=1), 1).select(SelectionInputs(
        torch.tensor([0.0, 1.0, 0.0, 0.0])[None, None, None], T, torch.tensor([0]), prefix,
        budget, 1, 1)).indices[0, 0, 0, 0] == 1


def test_pages_add_whole_quest_pages_to_the_verification_top_k():
    torch.manual_seed(4)
    prefix, budget = torch.tensor([64]), torch.tensor([24])
    spec = SpecConfig(pages=0.75, min_tokens=1, granularity="kv_head")
    scores = torch.randn(1, 1, 1, 64)
    sel = make_drafter(spec, 1).select(SelectionInputs(scores, T, torch.tensor([0]), prefix,
                                                       budget, 1, 1))
    q, k = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 64, 4)
    got = set(sel.prefix_mask(0, 64, q, k, torch.tensor([[70]]))[0, 0].nonzero()
              .flatten().tolist())
    # 24 * 0.75 = 18 slots: one page of 16 (the last prefix page), 8 slots by score.
    top = set(torch.topk(scores[0, 0, 0], 8).indices.tolist())
    assert got == top | set(range(48, 64))


@pytest.mark.parametrize("options", [dict(accumulate=0.5, drafter="streaming"),
                                     dict(pages=0.25, drafter="quest"), dict(accumulate=1.0),
                                     dict(pages=0.9), dict(spread=65),
                                     dict(spread=2, drafter="oracle")])
def test_key_options_out_of_range_or_on_other_drafters_are_refused(options):
    from vegas_core.errors import VegasError

    with pytest.raises(VegasError, match="accumulate|pages|spread"):
        SpecConfig(**options)


def test_spread_ranks_the_slots_after_a_strongly_attended_one_with_it():
    spec = SpecConfig(spread=2, min_tokens=1)
    scores = torch.tensor([0.0, 9.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0])[None, None, None]
    sel = make_drafter(spec, 1).select(SelectionInputs(
        scores, T, torch.tensor([0]), torch.tensor([8]), torch.tensor([3]), 1, 1))
    # Slots 1, 2 and 3 share slot 1's 9; slot 5's 1 reaches 6 and 7 only.
    assert sorted(sel.indices[0, 0, 0].tolist()) == [1, 2, 3]


def test_a_configuration_without_the_key_options_keeps_its_earlier_dict():
    """The tuner keys its trials by ``to_dict``: studies made before the options resume."""
    assert set(SpecConfig().to_dict()) == {"drafter", "gamma", "sparsity", "min_tokens",
                                           "collect", "score", "granularity", "window", "rule"}
    with_spread = SpecConfig(spread=4)
    assert with_spread.to_dict()["spread"] == 4
    assert SpecConfig(**with_spread.to_dict()) == with_spread
