"""Markov targets over a small vocabulary, the oracles of the speculative-decoding tests
(tests/runtime/test_speculative.py, test_spec_tree.py): the target and draft tables, the plain
sampler's distribution and its seeded tokens."""

from __future__ import annotations

import itertools

import torch

from kiln.runtime.sampler import Sampler, SamplingBatch
from kiln.runtime.sampling_params import SamplingParams

V = 8  # vocabulary of the statistical tests
PROMPT = [3, 1, 4, 1, 5, 2, 6, 5, 3, 5, 7, 2, 1, 4, 3, 5, 0, 2, 6, 1]  # gives the n-gram drafter matches


def tables(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft next-token logits [V, V], row = the previous token. The target favours the
    continuations PROMPT shows (a model that copies), so n-gram drafts are often accepted."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, V, generator=g) * 0.8
    for a, b in itertools.pairwise(PROMPT):
        target[a, b] += 1.0
    return target, target + torch.randn(V, V, generator=g) * 0.8


def target_probs(target: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[V, V]: the plain sampler's distribution of the next token after each previous token."""
    sb = SamplingBatch.build([params] * V, [1] * V, "cpu", seeds=[0] * V, steps=[0] * V)
    return torch.softmax(Sampler(V, 2, "cpu").filter_logits(target, sb), -1)


def plain_seeded_tokens(
    target: torch.Tensor, params: SamplingParams, seeds: int, length: int, last: int, eos: int
) -> list[list[int]]:
    """``length`` tokens for each seed ``0 .. seeds - 1`` decoded plainly, one step at a time, from
    ``target`` (``[V, V]`` logits of the next token given the previous one) after a prompt ending in
    ``last``; ``eos`` is banned while ``min_tokens`` asks."""
    sampler = Sampler(target.shape[0], 2, "cpu")
    out = []
    for r in range(seeds):
        seq: list[int] = []
        for step in range(length):
            sb = SamplingBatch.build([params], [1], "cpu", seeds=[r], steps=[step], eos_token_ids=[eos])
            prev = seq[-1] if seq else last
            seq.append(int(sampler.sample(target[prev][None], sb).next_ids[0]))
        out.append(seq)
    return out


def chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square p-value of counts against probabilities (cells expecting fewer than 5
    pooled into one; cells of probability 0 must be empty)."""
    observed, probs = observed.double().flatten(), probs.double().flatten()
    assert observed[probs == 0].sum() == 0, "a token of probability 0 was emitted"
    total = observed.sum()
    expected = probs * total
    big = expected >= 5
    small = (~big) & (probs > 0)
    o = torch.cat([observed[big], observed[small].sum()[None]])
    e = torch.cat([expected[big], expected[small].sum()[None]])
    if e[-1] < 5:  # the pooled cell still too small: into the smallest big one
        o, e = o[:-1], e[:-1]
        o[e.argmin()] += observed[small].sum()
        e[e.argmin()] += expected[small].sum()
    stat = ((o - e) ** 2 / e).sum()
    df = o.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))
