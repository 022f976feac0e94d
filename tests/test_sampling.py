"""Logits processing and sampling."""

from __future__ import annotations

import pytest
import torch

from vegas_core.errors import VegasError
from vegas_core.sampling import SamplingParams, choose_tokens, probabilities


def test_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    assert choose_tokens(logits, SamplingParams(), None).tolist() == [1, 0]


def test_temperature_top_k_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probabilities(logits, SamplingParams(temperature=1.0))
    torch.testing.assert_close(p, torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probabilities(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # top_p 0.8: 0.5 + 0.3 reaches it, so the tail is dropped.
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.8))
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # top_p below the top token's mass keeps the top token alone.
    p = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.1))
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    sharp = probabilities(logits, SamplingParams(temperature=0.5))
    assert sharp[0, 0] > 0.5


def test_sampling_follows_the_distribution_and_the_seed():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05])).expand(20000, 4)
    params = SamplingParams(temperature=1.0)
    draws = choose_tokens(logits, params, torch.Generator().manual_seed(7))
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    # 5 standard errors of a frequency near 0.5 over 20000 draws is 0.018.
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.018, rtol=0)
    again = choose_tokens(logits, params, torch.Generator().manual_seed(7))
    assert torch.equal(draws, again)


@pytest.mark.parametrize("bad", [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5),
                                 dict(top_k=-2)])
def test_bad_parameters_are_user_errors(bad):
    with pytest.raises(VegasError):
        SamplingParams(**bad)
