"""One self-speculative iteration: draft, verify, accept, roll back, select.

State per sequence b: ``cache.lengths[b]`` = n_b committed tokens in the cache, and one
pending token (accepted, not yet in the cache). An iteration

1. drafts gamma tokens: forwards of [pending, d1, .., d(gamma-1)] at n_b, n_b+1, ..
   with draft metadata (the drafter's prefix slots + the tail since its selection);
2. verifies [pending, d1, .., d_gamma] at n_b .. n_b+gamma in one full-attention
   forward, which overwrites the draft's K/V and collects selection scores;
3. accepts j_b drafts (greedy: longest match; sampling: speculative sampling) and one
   bonus token, which becomes the new pending token (``vegas_core.acceptance``);
4. rolls back by setting n_b += j_b + 1: slots beyond hold stale K/V that the next
   writes overwrite;
5. selects the next draft's KV from the verify scores over the prefix [0, n_b_old);
   slots from n_b_old on are the tail, attended by every draft.
"""

from __future__ import annotations

import time

import torch

from vegas_core.acceptance import accept, advance
from vegas_core.attention import AttentionMeta, kernels_serve_model
from vegas_core.decode_state import DecodeState, decode_capacity
from vegas_core.graphs import SpeculativeForwards
from vegas_core.loading import LoadedModel
from vegas_core.prefill import PrefixCache, ProgressFn, prefill, sync
from vegas_core.sampling import SamplingParams, choose_tokens, probabilities
from vegas_core.scores import ScoreCollector
from vegas_core.selection import SelectionInputs, draft_budget, for_draft_step, make_drafter
from vegas_core.spec_config import SpecConfig


class _PhaseClock:
    """Per-phase decode times without host synchronisation: CUDA events recorded
    between phases, read after the iteration's one sync; wall-clock time on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, object]] = []

    def mark(self, phase: str) -> None:
        """Start ``phase`` (the previous one ends here); "" ends the last."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((phase, event))
        else:
            self.marks.append((phase, time.perf_counter()))

    def collect(self, totals: dict[str, float]) -> None:
        """Add each finished phase's seconds to ``totals`` (after a sync on CUDA)."""
        for (phase, start), (_, end) in zip(self.marks, self.marks[1:]):
            if phase:
                totals[phase] += (start.elapsed_time(end) / 1000 if self.cuda else end - start)
        self.marks.clear()


class SpeculativeSession:
    """A batch being decoded speculatively; ``step`` runs one iteration.

    Lengths are tracked on the host too (each iteration ends with one device-to-host
    copy of its tokens), so nothing inside an iteration reads the device. Where the
    kernels serve every forward, the draft and verify forwards run on static buffers,
    captured in CUDA graphs on a GPU (see ``vegas_core.graphs``).
    """

    def __init__(self, model: LoadedModel, prompt_ids: list[list[int]], spec: SpecConfig,
                 params: SamplingParams, max_new_tokens: int, *, prefill_chunk: int | None = None,
                 progress: ProgressFn | None = None,
                 prefix_cache: PrefixCache | None = None,
                 state: DecodeState | None = None) -> None:
        """Prefill ``prompt_ids`` into a cache of the session's own, or into ``state``'s
        (a batch shared with other decoders) unless that is prefilled already: the
        session then joins the batch, and selects when ``enter`` hands it over."""
        self.model, self.spec, self.params = model, spec, params
        self.net, self.dev, self.window = model.net, model.device, model.config.window
        # The longest sequence this call can make: what the vLLM export serves as
        # max-model-len (the prompt plus the new tokens), which bounds the fork's budgets.
        self.max_model_len = max(len(p) for p in prompt_ids) + max_new_tokens
        self.drafter = self._new_drafter()
        self.batch = len(prompt_ids)
        self.iteration = 0
        self.timers = {"draft": 0.0, "verify": 0.0, "selection": 0.0}
        self._clock = _PhaseClock(self.dev)

        if state is None:
            state = DecodeState.for_batch(
                model, prompt_ids, decode_capacity(prompt_ids, max_new_tokens, spec.gamma),
                spec.gamma + 1, params.seed)
        self.state = state
        # The cache, the generator and the lengths list are the state's own objects.
        self.cache, self.generator = state.cache, state.generator
        self.host_lengths = state.host_lengths
        # An index list as long as the budget at full capacity: longer ones (SpecExtend's
        # whole chunks under small budgets) run eagerly.
        list_capacity = draft_budget(self.cache.max_len, spec.sparsity, spec.min_tokens)
        self.forwards = SpeculativeForwards(self.net, self.cache, self.window, state.space,
                                            list_capacity, self.dev)
        self._scores_out = None
        c = model.config
        if self.drafter.kernel_scores and kernels_serve_model(c, self.dev, 1):
            # The kernels write each selecting layer's row-summed scores here: no stack,
            # no copy.
            layers = self.drafter.collect_layers
            self._scores_out = self.forwards.score_buffer(
                (c.num_layers if layers is None else len(layers), self.batch,
                 c.num_kv_heads, self.cache.max_len))
        if not state.prefilled:
            self._prefill(prompt_ids, prefill_chunk, progress, prefix_cache)

    # Every iteration drafts: its accepted tokens count for the acceptance statistics.
    drafts = True

    @property
    def pending(self) -> torch.Tensor:
        """[B] each sequence's next token: accepted, not yet in the cache."""
        return self.state.pending

    @pending.setter
    def pending(self, tokens: torch.Tensor) -> None:
        self.state.pending = tokens

    def _new_drafter(self):
        return make_drafter(self.spec, self.model.config.num_layers,
                            self.model.config.selection_layers, self.max_model_len)

    @torch.inference_mode()
    def enter(self, histories: list[list[int]]) -> None:
        """Take the batch over from another decoder of its state: select as after the
        prefill, from a verify-style window over the last tokens each sequence committed
        (``histories[b]``: its tokens, prompt first, of which the cache holds the first
        ``host_lengths[b]``). The pending tokens stay: they are already output."""
        # A fresh drafter: what one keeps (a fixed or refreshed selection, accumulated
        # scores) was made at an earlier context of the batch.
        self.drafter = self._new_drafter()
        self.iteration = 0
        # Another decoder's drafts may have staged their selection where this one's read.
        self.forwards.forget_staged()
        w = min(self.drafter.prefill_window(self.spec.gamma), min(self.host_lengths))
        tokens = torch.tensor([h[n - w:n] for h, n in zip(histories, self.host_lengths)],
                              device=self.dev)  # [B, W]
        start = torch.tensor([n - w for n in self.host_lengths], device=self.dev)
        self._open_window(tokens, start, choose_pending=False)

    def _collector(self, window_rows: int, iteration: int) -> ScoreCollector | None:
        d = self.drafter
        if not d.needs_scores(iteration):
            return None
        return ScoreCollector(d.score_mode, d.collect_layers,
                              d.fused_row_weights(window_rows, self.batch, self.dev),
                              deferrable=d.kernel_scores, scores_out=self._scores_out)

    def _select(self, collector: ScoreCollector | None, window_rows: int,
                last_row: torch.Tensor, start: torch.Tensor, start_max: int) -> None:
        """Select after the window of ``window_rows`` rows verified from slot ``start``
        [B] (``start_max``: its largest value, on the host)."""
        scores = None
        if collector is not None:
            scores = collector.finish(lambda: self.drafter.score_rows(window_rows, last_row))
        prefix_len, budget = self.drafter.bounds(start, window_rows)
        prefix_max, budget_max = self.drafter.bounds(start_max, window_rows)
        self.selection = self.drafter.select(SelectionInputs(
            scores, window_rows, last_row, prefix_len, budget, self.iteration,
            self.model.config.num_layers, prefix_max, budget_max))

    @torch.inference_mode()
    def _prefill(self, prompt_ids: list[list[int]], chunk: int | None, progress,
                 prefix_cache) -> None:
        """Prefill all but the last W prompt tokens in chunks, then the last W as a
        verify-style window, whose scores make the first selection."""
        w = min(self.drafter.prefill_window(self.spec.gamma), min(self.host_lengths))
        head = [p[: len(p) - w] for p in prompt_ids]
        if max(len(h) for h in head) > 0:
            prefill(self.model, head, self.cache, chunk=chunk, progress=progress,
                    reuse=prefix_cache, need_last_hidden=False)
        tokens = torch.tensor([p[len(p) - w:] for p in prompt_ids], device=self.dev)
        start = torch.tensor([n - w for n in self.host_lengths], device=self.dev)
        self._open_window(tokens, start, choose_pending=True)

    def _open_window(self, tokens: torch.Tensor, start: torch.Tensor,
                     choose_pending: bool) -> None:
        """tokens [B, W] at positions start[b] .. start[b] + W - 1, the last W of each
        sequence: one verify-style forward gives the first selection and, with
        ``choose_pending``, the pending token."""
        w = tokens.shape[1]
        for b, n in enumerate(self.host_lengths):
            self.cache.forget_from(b, n - w)  # the window rewrites these prompt slots
        positions = start[:, None] + torch.arange(w, device=self.dev)  # [B, W]
        collector = self._collector(w, 0)
        hidden = self.net(tokens, positions, self.cache,
                          AttentionMeta.verify(positions, max(self.host_lengths), self.window,
                                               collector))
        self.cache.lengths.copy_(start + w)
        if choose_pending:
            self.pending = choose_tokens(self.net.logits(hidden[:, -1]), self.params,
                                         self.generator)
        self._clock.mark("selection")
        self._select(collector, w, torch.full_like(start, w - 1), start,
                     max(self.host_lengths) - w)
        self._clock.mark("")
        sync(self.dev)
        self._clock.collect(self.timers)

    def first_tokens(self) -> list[int]:
        """The pending token of each sequence after the prefill: its first new token."""
        return self.pending.tolist()

    @torch.inference_mode()
    def step(self, active) -> list[list[int]]:
        """One iteration. ``active`` [B] bools (a list, or a tensor): finished sequences
        are computed but keep their length. Returns the accepted tokens (drafts + bonus)
        per sequence."""
        gamma, params = self.spec.gamma, self.params
        active, active_host = self.state.active_mask(active)
        n = self.cache.lengths.clone()
        longest = max(self.host_lengths)
        self.iteration += 1

        self._clock.mark("draft")
        drafts, draft_probs = [], []
        current = self.pending
        for i in range(gamma):
            logits = self.forwards.draft(for_draft_step(self.selection, i), current[:, None],
                                         (n + i)[:, None], longest + i + 1)
            if params.greedy:
                current = logits.argmax(-1)
            else:
                q = probabilities(logits, params)
                current = torch.multinomial(q, 1, generator=self.generator).squeeze(-1)
                draft_probs.append(q)
            drafts.append(current)
        drafts_t = torch.stack(drafts, dim=1)  # [B, gamma]

        self._clock.mark("verify")
        tokens = torch.cat([self.pending[:, None], drafts_t], dim=1)  # [B, gamma + 1]
        positions = n[:, None] + torch.arange(gamma + 1, device=self.dev)
        collect = self.drafter.needs_scores(self.iteration)
        # What the collector would be, as far as a captured graph is concerned: the kind
        # of drafter and the vegas options decide its mode, rows and layers.
        kind = (collect, type(self.drafter).__name__, self.spec.collect, self.spec.score)
        logits, collector = self.forwards.verify(
            tokens, positions, longest + gamma + 1, kind,
            lambda: self._collector(gamma + 1, self.iteration) if collect else None)
        q_all = torch.stack(draft_probs, dim=1) if draft_probs else None  # [B, gamma, V]
        accepted, bonus = accept(logits, drafts_t, q_all, params, self.generator)

        self._clock.mark("selection")
        lengths, self.pending = advance(n, self.pending, accepted, bonus, active)
        self.cache.lengths.copy_(lengths)
        self._select(collector, gamma + 1, accepted, n, longest)
        self._clock.mark("")
        # The iteration's one device-to-host copy: accepted counts, bonus and drafts.
        host = torch.cat([accepted[:, None], bonus[:, None], drafts_t], dim=1).tolist()
        self._clock.collect(self.timers)
        out = []
        for b, (j, extra, *drafted) in enumerate(host):
            out.append(drafted[:j] + [extra])
            if active_host[b]:
                self.host_lengths[b] += j + 1
        return out
