"""One self-speculative iteration: draft, verify, accept, roll back, select.

State per sequence b: ``cache.lengths[b]`` = n_b committed tokens in the cache, and one
pending token (accepted, not yet in the cache). An iteration

1. drafts gamma tokens: forwards of [pending, d1, .., d(gamma-1)] at n_b, n_b+1, ..
   with draft metadata (the drafter's prefix slots + the tail since its selection);
2. verifies [pending, d1, .., d_gamma] at n_b .. n_b+gamma in one full-attention
   forward, which overwrites the draft's K/V and collects selection scores;
3. accepts j_b drafts (greedy: longest match; sampling: speculative sampling) and one
   bonus token, which becomes the new pending token;
4. rolls back by setting n_b += j_b + 1: slots beyond hold stale K/V that the next
   writes overwrite;
5. selects the next draft's KV from the verify scores over the prefix [0, n_b_old);
   slots from n_b_old on are the tail, attended by every draft.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from vegas_core.attention import AttentionMeta, ScoreCollector
from vegas_core.generation import (GenerationResult, GenerationStats, PrefixCache, ProgressFn,
                                   _sync, check_lengths, encode_prompts, prefill)
from vegas_core.loading import LoadedModel
from vegas_core.sampling import SamplingParams, choose_tokens, probabilities
from vegas_core.selection import SelectionInputs, draft_budget, make_drafter
from vegas_core.spec_config import SpecConfig


@dataclass
class SpeculativeStats(GenerationStats):
    gamma: int = 0
    iterations: int = 0
    # 1 + accepted drafts per (sequence, iteration), bonus token included.
    mean_accepted_length: float = 0.0
    # acceptance_by_position[i-1]: rate at which draft position i was accepted.
    acceptance_by_position: list[float] = field(default_factory=list)
    # (sequence, iteration) pairs in which a sequence was still generating.
    sequence_rounds: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    selection_seconds: float = 0.0

    @property
    def selection_overhead(self) -> float:
        """Selection time / decode time."""
        return self.selection_seconds / self.decode_seconds if self.decode_seconds > 0 else 0.0


class SpeculativeSession:
    """A batch being decoded speculatively; ``step`` runs one iteration."""

    def __init__(self, model: LoadedModel, prompt_ids: list[list[int]], spec: SpecConfig,
                 params: SamplingParams, max_new_tokens: int, *, prefill_chunk: int,
                 progress: ProgressFn | None = None,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.model, self.spec, self.params = model, spec, params
        self.net = model.net
        self.dev = model.device
        self.window = model.config.sliding_window
        self.drafter = make_drafter(spec, model.config.num_layers)
        self.batch = len(prompt_ids)
        self.generator = torch.Generator(device=self.dev).manual_seed(params.seed)
        longest = max(len(p) for p in prompt_ids)
        # Room for a full iteration past the last token, and for one more: a sequence that
        # finished keeps its length but its slots are still written by the batch's steps.
        self.cache = self.net.new_cache(self.batch, longest + max_new_tokens + 2 * (spec.gamma + 1))
        self.iteration = 0
        self.timers = {"draft": 0.0, "verify": 0.0, "selection": 0.0}
        self._prefill(prompt_ids, prefill_chunk, progress, prefix_cache)

    def _collector(self, window_rows: int) -> ScoreCollector | None:
        modes = self.drafter.collect_modes
        if not modes:
            return None
        weights = self.drafter.fused_row_weights(window_rows, self.batch, self.dev)
        return ScoreCollector(modes, self.drafter.collect_layers, weights)

    def _select(self, collector, window_rows: int, last_row: torch.Tensor,
                prefix_len: torch.Tensor) -> None:
        self.last_collector = collector
        _sync(self.dev)
        t = time.perf_counter()
        budget = draft_budget(prefix_len, self.spec.sparsity, self.spec.min_tokens)
        self.selection = self.drafter.select(SelectionInputs(
            collector, window_rows, last_row, prefix_len, budget, self.iteration,
            self.model.config.num_layers))
        _sync(self.dev)
        self.timers["selection"] += time.perf_counter() - t

    @torch.inference_mode()
    def _prefill(self, prompt_ids: list[list[int]], chunk: int, progress, prefix_cache) -> None:
        """Prefill all but the last W prompt tokens in chunks, then the last W as a
        verify-style window, whose scores make the first selection."""
        lengths = torch.tensor([len(p) for p in prompt_ids], device=self.dev)
        w = min(max(self.spec.gamma + 1, self.drafter.prefill_rows), int(lengths.min()))
        head = [p[: len(p) - w] for p in prompt_ids]
        if max(len(h) for h in head) > 0:
            prefill(self.model, head, self.cache, chunk=chunk, progress=progress,
                    reuse=prefix_cache, need_last_hidden=False)
        start = lengths - w
        positions = start[:, None] + torch.arange(w, device=self.dev)  # [B, W]
        tokens = torch.tensor([p[len(p) - w:] for p in prompt_ids], device=self.dev)
        collector = self._collector(w)
        hidden = self.net(tokens, positions, self.cache,
                          AttentionMeta.verify(positions, int(lengths.max()), self.window,
                                               collector))
        self.cache.lengths.copy_(lengths)
        self.pending = choose_tokens(self.net.logits(hidden[:, -1]), self.params, self.generator)
        self._select(collector, w, torch.full_like(lengths, w - 1), start)

    def _meta_draft(self, positions: torch.Tensor, kv_len: int) -> AttentionMeta:
        if self.selection is None:
            return AttentionMeta.full(positions, kv_len, self.window)
        return AttentionMeta.draft(positions, kv_len, self.selection, self.window)

    @torch.inference_mode()
    def step(self, active: torch.Tensor) -> list[list[int]]:
        """One iteration. ``active`` [B] bool: finished sequences are computed but keep
        their length. Returns the accepted tokens (drafts + bonus) per sequence."""
        gamma, net, params = self.spec.gamma, self.net, self.params
        n = self.cache.lengths.clone()
        longest = int(n.max())
        self.iteration += 1

        _sync(self.dev)
        t0 = time.perf_counter()
        drafts, draft_probs = [], []
        current = self.pending
        for i in range(gamma):
            positions = (n + i)[:, None]
            hidden = net(current[:, None], positions, self.cache,
                         self._meta_draft(positions, longest + i + 1))
            logits = net.logits(hidden[:, -1])
            if params.greedy:
                current = logits.argmax(-1)
            else:
                q = probabilities(logits, params)
                current = torch.multinomial(q, 1, generator=self.generator).squeeze(-1)
                draft_probs.append(q)
            drafts.append(current)
        drafts_t = torch.stack(drafts, dim=1)  # [B, gamma]
        _sync(self.dev)
        t1 = time.perf_counter()

        tokens = torch.cat([self.pending[:, None], drafts_t], dim=1)  # [B, gamma + 1]
        positions = n[:, None] + torch.arange(gamma + 1, device=self.dev)
        collector = self._collector(gamma + 1)
        hidden = net(tokens, positions, self.cache,
                     AttentionMeta.verify(positions, longest + gamma + 1, self.window, collector))
        logits = net.logits(hidden)  # [B, gamma + 1, V]
        accepted, bonus = self._accept(logits, drafts_t, draft_probs)
        _sync(self.dev)
        t2 = time.perf_counter()
        self.timers["draft"] += t1 - t0
        self.timers["verify"] += t2 - t1

        self.cache.lengths.copy_(torch.where(active, n + accepted + 1, n))
        self.pending = torch.where(active, bonus, self.pending)
        self._select(collector, gamma + 1, accepted, n)
        self.last_accepted = accepted
        out = []
        for b, (j, extra) in enumerate(zip(accepted.tolist(), bonus.tolist())):
            out.append(drafts_t[b, :j].tolist() + [extra])
        return out

    def _accept(self, logits: torch.Tensor, drafts: torch.Tensor,
                draft_probs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (accepted drafts [B], bonus token [B])."""
        b, gamma = drafts.shape
        rows = torch.arange(b, device=self.dev)
        if self.params.greedy:
            target = logits.argmax(-1)  # [B, gamma + 1]
            match = (drafts == target[:, :gamma]).long()
            accepted = match.cumprod(dim=1).sum(dim=1)
            return accepted, target[rows, accepted]
        p = probabilities(logits, self.params)  # [B, gamma + 1, V]
        q = torch.stack(draft_probs, dim=1)  # [B, gamma, V]
        p_d = p[:, :gamma].gather(-1, drafts[..., None]).squeeze(-1)
        q_d = q.gather(-1, drafts[..., None]).squeeze(-1)
        u = torch.rand(b, gamma, generator=self.generator, device=self.dev)
        ok = (u * q_d < p_d).long()  # u < p/q without dividing
        accepted = ok.cumprod(dim=1).sum(dim=1)
        # On a rejection at position j: sample from norm(max(0, p_j - q_j)); if all
        # gamma drafts pass, the bonus comes from p_gamma.
        p_j = p[rows, accepted]
        q_j = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)[rows, accepted]
        residual = torch.clamp(p_j - q_j, min=0.0)
        mass = residual.sum(-1, keepdim=True)
        # p == q exactly leaves no residual mass; rejection then has probability 0.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_j)
        bonus = torch.multinomial(residual, 1, generator=self.generator).squeeze(-1)
        return accepted, bonus


def generate_speculative(model: LoadedModel, prompts, max_new_tokens: int, spec: SpecConfig,
                         params: SamplingParams, *, ignore_eos: bool, prefill_chunk: int,
                         progress: ProgressFn | None,
                         prefix_cache: PrefixCache | None = None) -> GenerationResult:
    prompt_ids = encode_prompts(model, prompts)
    check_lengths(model, prompt_ids, max_new_tokens)
    dev = model.device
    eos = set() if ignore_eos or model.tokenizer is None else set(model.tokenizer.eos_token_ids)

    _sync(dev)
    t0 = time.perf_counter()
    session = SpeculativeSession(model, prompt_ids, spec, params, max_new_tokens,
                                 prefill_chunk=prefill_chunk, progress=progress,
                                 prefix_cache=prefix_cache)
    _sync(dev)
    t1 = time.perf_counter()
    prefill_selection = session.timers["selection"]

    b = len(prompt_ids)
    out: list[list[int]] = [[] for _ in range(b)]
    done = [False] * b

    def take(i: int, new: list[int]) -> None:
        for tok in new:
            out[i].append(tok)
            if tok in eos or len(out[i]) >= max_new_tokens:
                done[i] = True
                return

    for i, tok in enumerate(session.pending.tolist()):
        take(i, [tok])
    accepted_per_position = torch.zeros(spec.gamma)
    rounds = 0
    while not all(done):
        active = torch.tensor([not d for d in done], device=dev)
        new = session.step(active)
        accepted = session.last_accepted.cpu()
        for i in range(b):
            if done[i]:
                continue
            rounds += 1
            accepted_per_position += (torch.arange(spec.gamma) < accepted[i]).float()
            take(i, new[i])
        if progress:
            progress("decode", min(len(o) for o in out), max_new_tokens)
    _sync(dev)
    t2 = time.perf_counter()

    texts = [model.tokenizer.decode(ids) for ids in out] if model.tokenizer else None
    by_position = (accepted_per_position / max(rounds, 1)).tolist()
    stats = SpeculativeStats(
        prompt_tokens=[len(p) for p in prompt_ids],
        new_tokens=[len(o) for o in out],
        prefill_seconds=t1 - t0,
        decode_seconds=t2 - t1,
        decode_tokens=sum(len(o) - 1 for o in out),
        gamma=spec.gamma,
        iterations=session.iteration,
        mean_accepted_length=1.0 + sum(by_position),
        acceptance_by_position=by_position,
        sequence_rounds=rounds,
        draft_seconds=session.timers["draft"],
        verify_seconds=session.timers["verify"],
        selection_seconds=session.timers["selection"] - prefill_selection,
    )
    return GenerationResult(out, texts, stats)
