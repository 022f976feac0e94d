"""Drafters: which prefix slots each draft forward attends to.

All drafters share one interface. After the prefill window and after every verify pass
the loop asks ``Drafter.bounds`` which prefix slots are candidates and how many to keep
(``draft_budget``; the vLLM fork's own rule under ``rule: fork``), then calls
``Drafter.select`` with a ``SelectionInputs``; the drafter returns a ``DraftSelection``
(or None for dense drafts), or ``StepSelections`` where the slots move from one draft
step to the next. Every selection attends, besides its prefix slots, to every slot
written since it was made (the tail).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vegas_kernels import select_slots
from vegas_core.attention import SparseSelection, kernels_enabled
from vegas_core.score_history import ScoreHistory
from vegas_core.spec_config import (FORK_BLOCK, SpecConfig, draft_budget, fork_budget,
                                    fork_stream_window_start)

# MagicDec-Stream: attention-sink tokens kept at the start of the prefix.
STREAMING_SINKS = select_slots.WINDOW_SINKS
# MagicDec-Quest: page size and the scoring of pages by their key bounds.
QUEST_PAGE = 16
# SnapKV: observation window (last prompt rows) and pooling kernel.
SNAPKV_WINDOW = 32
SNAPKV_POOL = 5
# SpecExtend-style retrieval: chunk size and refresh period (iterations).
SPECEXTEND_CHUNK = 32
SPECEXTEND_REFRESH = 8


@dataclass
class SelectionInputs:
    """What the loop knows when it selects.

    scores: [L', B, H_kv, S] selection scores of the window just verified (or of the
        prefill's last rows), summed over the rows the drafter's ``score_rows`` weight,
        one row per collected layer (``vegas_core.scores``); None for drafters that
        collect none. S may run past the prefix.
    window_rows: T, the rows of that window. last_row: [B] row of the last accepted
        token in it. prefix_len: [B] the candidates, slots [0, prefix_len): the slots
        before the window (``Drafter.bounds``; the fork's vegas rule adds the window's
        first slot); later slots form the tail. budget: [B]. iteration: 0 after
        prefill, then 1, 2, ...
    """

    scores: torch.Tensor | None
    window_rows: int
    last_row: torch.Tensor
    prefix_len: torch.Tensor
    budget: torch.Tensor
    iteration: int
    num_layers: int
    # max(prefix_len) and max(budget) known on the host (the loop tracks lengths
    # there), so that sizes need no read from the device; None reads them.
    prefix_max: int | None = None
    budget_max: int | None = None

    def longest_prefix(self) -> int:
        return int(self.prefix_len.max()) if self.prefix_max is None else self.prefix_max

    def largest_budget(self) -> int:
        return int(self.budget.max()) if self.budget_max is None else self.budget_max


def _topk_selection(scores: torch.Tensor, prefix_len: torch.Tensor, budget: torch.Tensor,
                    k_max: int | None = None, *, sum_heads: bool = False,
                    reserved: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [L, B, H, S] -> (indices [L, B, G, K], counts [L, B]) of the top budget[b]
    prefix slots (slots >= prefix_len[b] never chosen), G = 1 when ``sum_heads`` sums
    the heads' scores, else H; ``reserved[b]`` window slots (``select_slots.
    reserved_slots``) come first. ``k_max`` >= max(budget), known on the host, avoids
    reading the budget back from the device. One Triton launch where the kernels serve
    (``vegas_kernels.select_slots``)."""
    l, b = scores.shape[:2]
    k = max(int(budget.max()) if k_max is None else k_max, 1)
    if kernels_enabled(scores) and select_slots.serves(scores):
        indices = select_slots.topk_slots(scores, prefix_len, budget, k, sum_heads, reserved)
    else:
        indices = select_slots.reference_topk_slots(scores, prefix_len, budget, k, sum_heads,
                                                    reserved)
    return indices, budget[None].expand(l, b).clone()


def collected_rows(collect: str, window_rows: int, last_row: torch.Tensor) -> torch.Tensor:
    """[B, T] float weights of the window rows whose scores count (0 or 1)."""
    b = last_row.shape[0]
    rows = torch.zeros(b, window_rows, device=last_row.device)
    if collect == "two":
        rows[:, 0] = 1.0
        rows[:, -1] = 1.0
    elif collect == "all":
        rows[:] = 1.0
    else:  # "last": the last accepted token's row
        rows[torch.arange(b, device=last_row.device), last_row] = 1.0
    return rows


@dataclass
class StepSelections:
    """One selection per draft step of an iteration, for rules whose slots move with the
    draft's own position (the fork's streamingllm): ``steps[i]`` serves draft step i."""

    steps: list[SparseSelection]


def for_draft_step(selection, step: int):
    """The selection that draft step ``step`` (0-based) attends to."""
    return selection.steps[step] if isinstance(selection, StepSelections) else selection


class Drafter:
    """Base: no selection scores needed, prefill window of gamma + 1 rows.

    ``layers``: the layers whose drafts attend to a selection (``ModelConfig.
    selection_layers``; None: all); selections for the others are never read.
    ``max_model_len``: the longest sequence served, which bounds the fork's budgets
    (``rule: fork``; None: unbounded)."""

    score_mode: str | None = None  # "logit" or "weight" scores of the verify pass, or none
    collect_layers: set[int] | None = None  # the layers whose scores count (None: all)
    prefill_rows = 0  # rows of the prefill window this drafter needs beyond gamma + 1
    # Whether the verify kernels may sum the scores (fused, or deferred to a pass after
    # acceptance); the peers keep PyTorch's per-row path, as their own implementations do.
    kernel_scores = False

    def __init__(self, spec: SpecConfig, num_layers: int, layers: list[int] | None = None,
                 max_model_len: int | None = None) -> None:
        self.spec = spec
        self.num_layers = num_layers
        self.layers = list(range(num_layers)) if layers is None else list(layers)
        self.max_model_len = max_model_len
        self.fork = spec.rule == "fork"

    def prefill_window(self, gamma: int) -> int:
        """Rows of the verify-style window that ends the prefill (at most the shortest
        prompt): its scores make the first selection."""
        return max(gamma + 1, self.prefill_rows)

    def bounds(self, start, window_rows: int):
        """(candidates, budget) after a window of ``window_rows`` rows verified at slots
        ``start`` onwards (a [B] tensor, or a host int for static sizes): the drafter
        chooses ``budget`` of the prefix slots [0, candidates); later slots are the
        tail. Both grow with ``start``."""
        return start, draft_budget(start, self.spec.sparsity, self.spec.min_tokens)

    def select(self, inputs: SelectionInputs) -> object | None:
        raise NotImplementedError

    def fused_row_weights(self, window_rows: int, batch: int, device) -> torch.Tensor | None:
        """[B, T] weights of the verify rows whose scores count, when they are known
        before the pass (the verify kernel then sums them, see ``vegas_core.scores``);
        None otherwise."""
        return None

    def score_rows(self, window_rows: int, last_row: torch.Tensor) -> torch.Tensor:
        """[B, T] weights of the window rows whose scores count, once acceptance is known
        (``last_row`` [B]: the last accepted row)."""
        raise NotImplementedError

    def needs_scores(self, iteration: int) -> bool:
        """Whether the verify pass of ``iteration`` (0: the prefill window) must collect
        scores: drafters that keep a selection skip the work in between."""
        return self.score_mode is not None


class DenseDrafter(Drafter):
    """Full attention in the draft: every greedy draft is accepted."""

    def select(self, inputs: SelectionInputs) -> None:
        return None


class VegasDrafter(Drafter):
    """Top-k of the verify pass's own scores (Collect-2-Query by default), in the layers
    that select only: a hybrid model's sliding layers are neither collected nor ranked."""

    kernel_scores = True

    def __init__(self, spec: SpecConfig, num_layers: int, layers: list[int] | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(spec, num_layers, layers, max_model_len)
        self.score_mode = spec.score
        self.every_layer = len(self.layers) == num_layers
        self.collect_layers = None if self.every_layer else set(self.layers)
        self.history = ScoreHistory(spec.accumulate) if spec.accumulate > 0 else None

    def prefill_window(self, gamma: int) -> int:
        # The fork selects first from its prefill pass, by the prompt's last row alone:
        # a one-row window, whose first and last rows are that row.
        return 1 if self.fork else super().prefill_window(gamma)

    def bounds(self, start, window_rows: int):
        if not self.fork:
            return super().bounds(start, window_rows)
        # The fork ranks the window's first slot too (the token accepted before it; the
        # verify pass rewrote its K/V) and sizes the budget by the keys the pass saw.
        candidates = start + 1
        return candidates, fork_budget(start + window_rows, self.spec.sparsity,
                                       self.spec.min_tokens, self.max_model_len, candidates)

    def score_rows(self, window_rows: int, last_row: torch.Tensor) -> torch.Tensor:
        return collected_rows(self.spec.collect, window_rows, last_row)

    def fused_row_weights(self, window_rows: int, batch: int, device) -> torch.Tensor | None:
        # Known before the pass: logit scores of the first/last or all rows, and the
        # first/last rows' probabilities (the verify kernel keeps those rows' logits).
        collect, score = self.spec.collect, self.spec.score
        if collect == "last" or (score == "weight" and collect != "two"):
            return None
        return collected_rows(self.spec.collect, window_rows,
                              torch.zeros(batch, dtype=torch.long, device=device))

    def select(self, inputs: SelectionInputs) -> SparseSelection | PagedSelection:
        # Only prefix slots are candidates: the kernels' score rows may run longer.
        span = max(inputs.longest_prefix(), 1)
        scores = inputs.scores[..., :span]  # [L', B, H_kv, S]
        if self.history is not None:
            scores = self.history.update(scores, inputs.prefix_len)
        if self.spec.spread > 0:
            scores = spread_forward(scores, self.spec.spread)
        budget, page_slots = inputs.budget, None
        if self.spec.pages > 0:
            # Whole pages for the query-guided share, the rest for the verify's top-k.
            page_slots = _page_share(budget, self.spec.pages)
            budget = torch.clamp(budget - page_slots, min=0)
        reserved = None
        if self.spec.window > 0:
            # The window's sinks and recent slots first; the rest of the budget by score.
            reserved = torch.floor(budget.double() * self.spec.window).long()
        k_max = inputs.largest_budget()
        indices, counts = _topk_selection(scores, inputs.prefix_len, budget, k_max,
                                          sum_heads=self.spec.granularity == "layer",
                                          reserved=reserved)
        top = SparseSelection(indices, counts, inputs.prefix_len.clone(),
                              layers=None if self.every_layer else tuple(self.layers))
        if page_slots is None:
            return top
        return PagedSelection(top, QuestSelection(inputs.prefix_len, page_slots))


def spread_forward(scores: torch.Tensor, spread: int) -> torch.Tensor:
    """scores [L', B, H_kv, S] -> the same shape, each slot's score the highest of its
    own and the ``spread`` slots before it (a causal max-pool), so that the slots after
    a strongly attended one rank with it."""
    l, b, h, s = scores.shape
    flat = scores.float().reshape(l * b * h, 1, s)
    padded = F.pad(flat, (spread, 0), value=float("-inf"))
    return F.max_pool1d(padded, spread + 1, stride=1).reshape(l, b, h, s)


def _page_share(budget: torch.Tensor, share: float) -> torch.Tensor:
    """[B] slots of ``budget`` [B] that whole Quest pages take at ``share``: rounded down
    to pages, at least one page."""
    pages = torch.floor(budget.double() * share / QUEST_PAGE).long()
    return torch.clamp(pages, min=1) * QUEST_PAGE


class StreamingDrafter(Drafter):
    """MagicDec-Stream, sliding: 16 sink tokens + the most recent prefix tokens,
    rebuilt at every iteration. ``rule: fork``: the fork's streamingllm instead, a sink
    block and the most recent whole blocks up to each draft query, moved at every draft
    step (``StepSelections``)."""

    def select(self, inputs: SelectionInputs) -> SparseSelection | StepSelections:
        if self.fork:
            return self._fork_windows(inputs)
        # The slots follow from the budget alone: built directly, once for every layer.
        k_max = inputs.largest_budget()
        indices = select_slots.reserved_indices(inputs.prefix_len, inputs.budget, k_max)
        l, b = self.num_layers, indices.shape[0]
        return SparseSelection(indices[None, :, None, :].expand(l, -1, -1, -1),
                               inputs.budget[None].expand(l, b).clone(),
                               inputs.prefix_len.clone())

    def _fork_windows(self, inputs: SelectionInputs) -> StepSelections:
        """Per draft step: the sink block as an index list and the window as the tail,
        which runs from the window's first block to the query itself (the tokens since
        the last verification included, within the budget)."""
        # The first draft goes where the bonus token goes: after the accepted rows
        # (``bounds`` is the engine's here, so prefix_len is the window's first slot).
        first = inputs.prefix_len + inputs.last_row + 1  # [B]
        l, b, gamma = self.num_layers, first.shape[0], self.spec.gamma
        # Every step's window at once (a few launches, not a few per step).
        positions = first[:, None] + torch.arange(gamma, device=first.device)  # [B, gamma]
        start = fork_stream_window_start(positions, self.spec.sparsity, self.spec.min_tokens,
                                         self.max_model_len)  # [B, gamma]
        # A query inside block 0 sees all of it: its whole sequence is the tail.
        start = torch.where(start > positions, torch.zeros_like(start), start)
        counts = torch.clamp(start, max=FORK_BLOCK).T  # [gamma, B]
        sinks = torch.arange(FORK_BLOCK, device=first.device)
        indices = sinks[None, None, None, :].expand(l, b, 1, -1)  # [L, B, 1, FORK_BLOCK]
        return StepSelections([SparseSelection(indices, counts[i][None].expand(l, b),
                                               start[:, i]) for i in range(gamma)])


class SnapKVDrafter(Drafter):
    """SnapKV at prefill (MagicDec's drafter): the last 32 prompt rows' softmax weights,
    summed, avg-pooled (kernel 5), summed over each GQA group; top (budget - 32) per
    layer and KV head, plus the 32 window tokens; never re-selected."""

    score_mode = "weight"
    prefill_rows = SNAPKV_WINDOW

    def __init__(self, spec: SpecConfig, num_layers: int, layers: list[int] | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(spec, num_layers, layers, max_model_len)
        self.fixed: SparseSelection | None = None

    def needs_scores(self, iteration: int) -> bool:
        return iteration == 0

    def score_rows(self, window_rows: int, last_row: torch.Tensor) -> torch.Tensor:
        return torch.ones(last_row.shape[0], window_rows, device=last_row.device)

    def select(self, inputs: SelectionInputs) -> SparseSelection:
        if self.fixed is None:
            s = inputs.scores  # [L, B, H_kv, S], the window's rows summed
            l, b, h, n = s.shape
            pooled = F.avg_pool1d(s.reshape(l * b * h, 1, n), SNAPKV_POOL, stride=1,
                                  padding=SNAPKV_POOL // 2, count_include_pad=False)
            budget = torch.clamp(inputs.budget - inputs.window_rows, min=0)
            indices, counts = _topk_selection(pooled.reshape(l, b, h, n), inputs.prefix_len,
                                              budget)
            self.fixed = SparseSelection(indices, counts, inputs.prefix_len.clone())
        return self.fixed


class SpecExtendDrafter(Drafter):
    """SpecExtend-style retrieval adapted to self-speculation: the last layer's weights
    of the last accepted token, averaged over heads, score 32-token chunks by their
    mean; the top chunks are shared by all layers and refreshed every 8 iterations."""

    score_mode = "weight"

    def __init__(self, spec: SpecConfig, num_layers: int, layers: list[int] | None = None,
                 max_model_len: int | None = None) -> None:
        super().__init__(spec, num_layers, layers, max_model_len)
        self.collect_layers = {num_layers - 1}
        self.current: SparseSelection | None = None

    def needs_scores(self, iteration: int) -> bool:
        return iteration % SPECEXTEND_REFRESH == 0

    def score_rows(self, window_rows: int, last_row: torch.Tensor) -> torch.Tensor:
        return F.one_hot(last_row, window_rows).float()

    def select(self, inputs: SelectionInputs) -> SparseSelection:
        if self.current is not None and inputs.iteration % SPECEXTEND_REFRESH:
            return self.current
        w = inputs.scores[0].sum(dim=1)  # [B, S]: the last accepted row, heads summed
        b = w.shape[0]
        n = w.shape[-1]
        slots = torch.arange(n, device=w.device)
        w = w.masked_fill(slots >= inputs.prefix_len[:, None], 0.0)
        chunks = math.ceil(n / SPECEXTEND_CHUNK)
        padded = F.pad(w, (0, chunks * SPECEXTEND_CHUNK - n)).view(b, chunks, SPECEXTEND_CHUNK)
        valid = F.pad((slots[None] < inputs.prefix_len[:, None]).float(),
                      (0, chunks * SPECEXTEND_CHUNK - n)).view(b, chunks, SPECEXTEND_CHUNK)
        chunk_score = padded.sum(-1) / valid.sum(-1).clamp(min=1)
        n_chunks = torch.div(inputs.prefix_len + SPECEXTEND_CHUNK - 1, SPECEXTEND_CHUNK,
                             rounding_mode="floor")
        chunk_score = chunk_score.masked_fill(
            torch.arange(chunks, device=w.device)[None] >= n_chunks[:, None], float("-inf"))
        want = torch.clamp(inputs.budget // SPECEXTEND_CHUNK, min=1)
        want = torch.minimum(want, n_chunks)
        top = torch.topk(chunk_score, max(int(want.max()), 1), dim=-1).indices  # [B, C]
        take = torch.arange(top.shape[1], device=w.device)[None] < want[:, None]
        # Expand chunks to slots; slots of unchosen chunks and past the prefix are dropped.
        slot_ids = top[:, :, None] * SPECEXTEND_CHUNK + torch.arange(SPECEXTEND_CHUNK,
                                                                    device=w.device)
        keep = take[:, :, None] & (slot_ids < inputs.prefix_len[:, None, None])
        slot_ids, keep = slot_ids.flatten(1), keep.flatten(1)
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)
        indices = torch.gather(slot_ids, 1, order)
        counts = keep.sum(1)
        l = self.num_layers
        self.current = SparseSelection(
            indices[None, :, None, :].expand(l, -1, 1, -1).contiguous(),
            counts[None].expand(l, -1).clone(), inputs.prefix_len.clone())
        return self.current


class QuestSelection:
    """MagicDec-Quest: per draft step and layer, pages of 16 prefix tokens scored by
    sum_d max(q_d * kmax_d, q_d * kmin_d) with the current draft query, summed over
    each KV head's query heads; the top budget/16 pages per KV head, last page kept."""

    def __init__(self, prefix_len: torch.Tensor, budget: torch.Tensor) -> None:
        self.tail_start = prefix_len.clone()
        self.prefix_len = prefix_len
        self.pages = torch.clamp(torch.div(budget, QUEST_PAGE, rounding_mode="floor"), min=1)
        self._bounds: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _page_bounds(self, layer: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Prefix keys do not change during the drafts of one iteration: bound them once.
        if layer not in self._bounds:
            b, h, s, d = k.shape
            n_pages = math.ceil(s / QUEST_PAGE)
            inside = (torch.arange(s, device=k.device)[None] < self.prefix_len[:, None])
            inside = inside[:, None, :, None]
            pad = n_pages * QUEST_PAGE - s
            big = torch.finfo(k.dtype).max
            kmax = F.pad(k.masked_fill(~inside, -big), (0, 0, 0, pad), value=-big)
            kmin = F.pad(k.masked_fill(~inside, big), (0, 0, 0, pad), value=big)
            kmax = kmax.view(b, h, n_pages, QUEST_PAGE, d).amax(3)
            kmin = kmin.view(b, h, n_pages, QUEST_PAGE, d).amin(3)
            self._bounds[layer] = (kmax, kmin)
        return self._bounds[layer]

    def prefix_mask(self, layer: int, kv_len: int, q: torch.Tensor, k: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
        kmax, kmin = self._page_bounds(layer, k)  # [B, H_kv, P, D]
        b, t, h, d = q.shape
        h_kv, n_pages = kmax.shape[1], kmax.shape[2]
        qg = q[:, -1].reshape(b, h_kv, h // h_kv, 1, d).float()  # [B, H_kv, group, 1, D]
        per_dim = torch.maximum(qg * kmax[:, :, None].float(), qg * kmin[:, :, None].float())
        score = per_dim.sum(-1).sum(2)  # [B, H_kv, P]
        n_prefix_pages = torch.div(self.prefix_len + QUEST_PAGE - 1, QUEST_PAGE,
                                   rounding_mode="floor")
        page_ids = torch.arange(n_pages, device=q.device)[None, None]
        score = score.masked_fill(page_ids >= n_prefix_pages[:, None, None], float("-inf"))
        last_page = (n_prefix_pages - 1).clamp(min=0)
        score = score.masked_fill(page_ids == last_page[:, None, None], float("inf"))
        want = torch.minimum(self.pages, n_prefix_pages)
        top = torch.topk(score, max(int(want.max()), 1), dim=-1).indices  # [B, H_kv, W]
        take = (torch.arange(top.shape[-1], device=q.device)[None, None]
                < want[:, None, None]).expand_as(top)
        chosen = torch.zeros(b, h_kv, n_pages, dtype=torch.bool, device=q.device)
        chosen.scatter_(-1, top, take)
        # Bounds were taken at the first draft step; later steps only add tail slots.
        slot_pages = (torch.arange(kv_len, device=q.device) // QUEST_PAGE).clamp(max=n_pages - 1)
        mask = chosen[:, :, slot_pages]  # [B, H_kv, S]
        return mask & (torch.arange(kv_len, device=q.device) < self.prefix_len[:, None, None])


class PagedSelection:
    """Vegas with ``pages``: the verification top-k (an index list, fixed for the
    iteration) and, at every draft step and layer, whole pages chosen by Quest's key
    bounds with the draft's own query; a draft attends to the union."""

    def __init__(self, top: SparseSelection, pages: QuestSelection) -> None:
        self.top, self.pages = top, pages
        self.tail_start = top.tail_start

    def prefix_mask(self, layer: int, kv_len: int, q: torch.Tensor, k: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
        # [B, G, S] | [B, H_kv, S] -> [B, H_kv, S]
        return (self.top.prefix_mask(layer, kv_len)
                | self.pages.prefix_mask(layer, kv_len, q, k, positions))


class OracleSelection:
    """Upper bound, not a method: the exact top-k prefix slots by the current draft
    query's own scores, recomputed at every draft step and layer."""

    def __init__(self, prefix_len: torch.Tensor, budget: torch.Tensor, score: str,
                 granularity: str) -> None:
        self.tail_start = prefix_len.clone()
        self.prefix_len, self.budget = prefix_len, budget
        self.score, self.granularity = score, granularity

    def prefix_mask(self, layer: int, kv_len: int, q: torch.Tensor, k: torch.Tensor,
                    positions: torch.Tensor) -> torch.Tensor:
        b, t, h, d = q.shape
        h_kv = k.shape[1]
        qg = q[:, -1].reshape(b, h_kv, h // h_kv, d).float()
        logits = torch.einsum("bkgd,bksd->bkgs", qg, k.float()) / math.sqrt(d)
        slots = torch.arange(kv_len, device=q.device)
        if self.score == "weight":
            # Normalised over everything the query could see with full attention.
            visible = slots <= positions[:, -1, None, None, None]
            logits = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
        s = logits.sum(2)  # [B, H_kv, S]
        if self.granularity == "layer":
            s = s.sum(1, keepdim=True)
        # Not a method, timed at no point: PyTorch's top-k (lengths change every step).
        indices = select_slots.reference_topk_slots(s[None], self.prefix_len, self.budget,
                                                    int(self.budget.max()))
        counts = self.budget[None].clone()
        return SparseSelection(indices, counts, self.tail_start).prefix_mask(0, kv_len)


class QuestDrafter(Drafter):
    def select(self, inputs: SelectionInputs) -> QuestSelection:
        return QuestSelection(inputs.prefix_len, inputs.budget)


class OracleDrafter(Drafter):
    def select(self, inputs: SelectionInputs) -> OracleSelection:
        return OracleSelection(inputs.prefix_len, inputs.budget, self.spec.score,
                               self.spec.granularity)


_DRAFTERS = {
    "vegas": VegasDrafter, "streaming": StreamingDrafter, "quest": QuestDrafter,
    "snapkv": SnapKVDrafter, "specextend": SpecExtendDrafter, "oracle": OracleDrafter,
    "dense": DenseDrafter,
}


def make_drafter(spec: SpecConfig, num_layers: int, layers: list[int] | None = None,
                 max_model_len: int | None = None) -> Drafter:
    """The drafter ``spec`` names, for a model of ``num_layers`` whose drafts select in
    ``layers`` (None: all), serving sequences of up to ``max_model_len`` positions."""
    return _DRAFTERS[spec.drafter](spec, num_layers, layers, max_model_len)
