"""Acceptance: which drafted tokens a verify pass keeps, and the token that follows them.

A verify pass scores the pending token and the G drafts in one forward: its logits
[B, G + 1, V] give the target's next-token distribution after each prefix of the drafts.
A sequence keeps its first ``accepted`` drafts (0 to G) and one more token from the
target, the bonus, which becomes its pending token:

- greedy: the drafts kept are the longest prefix equal to the target's argmax, and the
  bonus is the target's argmax right after them. The output is exactly greedy decoding's.
- sampling: speculative sampling (Leviathan et al., Chen et al., 2023). Draft i is kept
  with probability min(1, p(d_i) / q(d_i)), p the target's and q the draft's distribution
  after the same processing (``sampling.probabilities``); at the first rejection the
  bonus is drawn from norm(max(0, p - q)) at that position, and after G kept drafts from
  p at position G. Each emitted token is then distributed as p: the output distribution
  is plain sampling's.

``advance`` moves each sequence past what it accepted; finished sequences stay put.
"""

from __future__ import annotations

import torch

from vegas_core.sampling import SamplingParams, probabilities


def accept_greedy(target_logits: torch.Tensor, drafts: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (accepted [B], bonus [B]): the longest prefix of ``drafts`` that equals the
    target's argmax, and the argmax after it.

    target_logits: [B, G + 1, V], row i the target after the pending token and d_1..d_i;
    drafts: [B, G]."""
    b, gamma = drafts.shape
    target = target_logits.argmax(-1)  # [B, G + 1]
    match = (drafts == target[:, :gamma]).long()  # [B, G]
    accepted = match.cumprod(dim=1).sum(dim=1)  # [B]: matches before the first miss
    rows = torch.arange(b, device=drafts.device)
    return accepted, target[rows, accepted]


def accept_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor,
                   drafts: torch.Tensor, generator: torch.Generator | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (accepted [B], bonus [B]) by speculative sampling.

    target_probs: [B, G + 1, V], p after each prefix of the drafts; draft_probs: [B, G, V],
    q that drew each draft; drafts: [B, G]. Draws B x G uniforms, then one bonus token
    per sequence, from ``generator``."""
    b, gamma = drafts.shape
    rows = torch.arange(b, device=drafts.device)
    p_d = target_probs[:, :gamma].gather(-1, drafts[..., None]).squeeze(-1)  # [B, G]
    q_d = draft_probs.gather(-1, drafts[..., None]).squeeze(-1)  # [B, G]
    u = torch.rand(b, gamma, generator=generator, device=drafts.device)
    ok = (u * q_d < p_d).long()  # u < p/q without dividing
    accepted = ok.cumprod(dim=1).sum(dim=1)  # [B]
    # On a rejection at position j: sample from norm(max(0, p_j - q_j)); if all
    # gamma drafts pass, q_gamma is 0 and the bonus comes from p_gamma.
    p_j = target_probs[rows, accepted]  # [B, V]
    q_j = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, accepted]
    residual = torch.clamp(p_j - q_j, min=0.0)
    mass = residual.sum(-1, keepdim=True)
    # p == q exactly leaves no residual mass; rejection then has probability 0.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_j)
    bonus = torch.multinomial(residual, 1, generator=generator).squeeze(-1)
    return accepted, bonus


def accept(target_logits: torch.Tensor, drafts: torch.Tensor,
           draft_probs: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (accepted [B], bonus [B]) as ``params`` decodes: greedy, or speculative sampling
    of the target's processed distribution against ``draft_probs`` [B, G, V] (None when
    greedy). target_logits: [B, G + 1, V]; drafts: [B, G]."""
    if params.greedy:
        return accept_greedy(target_logits, drafts)
    return accept_sampled(probabilities(target_logits, params), draft_probs, drafts,
                          generator)


def advance(lengths: torch.Tensor, pending: torch.Tensor, accepted: torch.Tensor,
            bonus: torch.Tensor, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (lengths [B], pending [B]) after an iteration: an active sequence commits its
    pending token and accepted drafts to the cache (``accepted + 1`` slots) and takes the
    bonus as its pending token; a finished one (``active`` False) keeps both.

    lengths: [B] committed tokens before the iteration; pending, accepted, bonus: [B];
    active: [B] bool."""
    return (torch.where(active, lengths + accepted + 1, lengths),
            torch.where(active, bonus, pending))
