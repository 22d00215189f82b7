"""Speculative decoding's core (runtime/speculative.py): n-gram proposals, greedy acceptance, and
lossless sampled verification checked by chi-square tests on a small vocabulary.

The statistical tests run a speculative loop over a Markov "model" (the target's next-token logits
depend on the previous token only: a [V, V] table) for N independent requests until each has
emitted two tokens, and compare the first token's and the pair's frequencies with the target's own
distribution (the sampler's filters applied to the table). Fixed seeds make them deterministic; the
significance is ALPHA. A deliberately wrong acceptance rule must fail the same check.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from markov_oracle import PROMPT, V, chi2_pvalue, plain_seeded_tokens, tables, target_probs

from kiln.ops.sampling.gumbel import derive_seed, row_keys
from kiln.runtime.sampler import Sampler
from kiln.runtime.sampling_params import SamplingParams as SP
from kiln.runtime.speculative import (
    ACCEPT_STREAM,
    AcceptanceStats,
    DraftBatch,
    NgramConfig,
    NgramDrafter,
    SpecSampling,
    SpeculativeError,
    accept_matches,
    position_keys,
    propose_ngram,
    speculation_blocker,
    stream_seeds,
    verify,
)

K = 3  # drafts per verify step at most
N = 12000  # requests (samples) per statistical test
ALPHA = 1e-3  # significance: a correct rule passes with p-value > ALPHA, the wrong one fails


# ---- noise keys ------------------------------------------------------------------------------------


def test_position_keys_are_the_samplers_row_keys():
    seeds = [0, 1, 12345, (1 << 63) - 1, -7, 2**64 + 5, derive_seed(99, 3)]
    steps = [0, 5, 1000, 7, 3, 2**40, 0]
    keys = position_keys(seeds, steps, 4)
    assert keys.shape == (len(seeds), 4, 2) and keys.dtype == np.int64
    for b, (s, t) in enumerate(zip(seeds, steps)):
        for j in range(4):
            assert tuple(keys[b, j].tolist()) == row_keys(s, t + j)
    assert stream_seeds(seeds, ACCEPT_STREAM) == [derive_seed(s, ACCEPT_STREAM) for s in seeds]
    assert len(set(stream_seeds([5], ACCEPT_STREAM) + [derive_seed(5, i) for i in range(4)])) == 5


# ---- greedy acceptance -----------------------------------------------------------------------------

# (target's argmax at positions 0..K, drafts, draft length) -> emitted tokens
GREEDY_CASES = [
    ([5, 6, 7, 4], [5, 6, 7], 3, [5, 6, 7, 4]),  # every draft accepted, then the bonus token
    ([5, 6, 7, 4], [5, 6, 1], 3, [5, 6, 7]),  # mismatch at 2: the target's token there
    ([5, 6, 7, 4], [1, 6, 7], 3, [5]),  # mismatch at 0: one token, the target's
    ([5, 6, 7, 4], [5, 2, 7], 3, [5, 6]),  # a match after the first mismatch does not count
    ([5, 6, 7, 4], [5, 6, 7], 2, [5, 6, 7]),  # drafts past the length are ignored, even matching
    ([5, 6, 7, 4], [5, 6, 7], 0, [5]),  # no drafts: a plain decode step
]


def _greedy_logits(
    targets: list[list[int]], vocab: int, padded_vocab: int, margin: float = 50.0
) -> torch.Tensor:
    """Logits whose argmax at request b's position j is ``targets[b][j]``, ``margin`` above the rest."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(len(targets), K + 1, padded_vocab, generator=g)
    for b, row in enumerate(targets):
        for j, t in enumerate(row):
            logits[b, j, t] = logits[b, j, :vocab].max() + margin
    logits[:, :, vocab:] = 1e4  # vocabulary padding: never chosen
    return logits


def test_accept_matches_cases():
    target = torch.tensor([c[0] for c in GREEDY_CASES])
    drafts = torch.tensor([c[1] for c in GREEDY_CASES])
    lens = torch.tensor([c[2] for c in GREEDY_CASES])
    ids, n = accept_matches(target, drafts, lens)
    for b, (_, _, _, want) in enumerate(GREEDY_CASES):
        assert n[b].item() == len(want)
        assert ids[b].tolist() == want + [-1] * (K + 1 - len(want)), b


def test_greedy_verify_through_the_sampling_batch():
    cases = GREEDY_CASES + [([5, 3, 7, 4], [5, 3, 7], 3, [5, 3, 7, 4])]
    logits = _greedy_logits([c[0] for c in cases], vocab=12, padded_vocab=16)
    logits[6, 1, 3] = logits[6, 1, 9] = 60.0  # a tie at position 1: the lowest id wins
    for b, (_, _, n, _) in enumerate(cases):  # rows past each request's drafts + 1 are never read
        logits[b, n + 1 :] = float("nan")
    B = len(cases)
    drafts = DraftBatch.from_lists([c[1][: c[2]] for c in cases], "cpu", max_len=K)
    spec = SpecSampling.build([SP(temperature=0)] * B, list(range(1, B + 1)), [0] * B, [0] * B, K + 1, "cpu")
    assert spec.batch.all_greedy
    out = verify(logits, drafts, spec, Sampler(12, B + 1, "cpu"))
    for b, (_, _, _, want) in enumerate(cases):
        assert out.token_ids[b, : len(want)].tolist() == want, b
        assert out.num_emitted[b].item() == len(want) and (out.token_ids[b, len(want) :] == -1).all()
    assert out.num_accepted.tolist() == [len(c[3]) - 1 for c in cases]


def test_mixed_batch_greedy_rows_match_exactly_and_logprobs_are_the_raw_ones():
    # a small margin: sampling at temperature 1 would often pick another token than the argmax
    logits = _greedy_logits([c[0] for c in GREEDY_CASES], vocab=16, padded_vocab=16, margin=0.5)
    B = len(GREEDY_CASES)
    params = [SP(temperature=0, logprobs=2) if b % 2 == 0 else SP(temperature=0.9, seed=b) for b in range(B)]
    drafts = [c[1][: c[2]] for c in GREEDY_CASES]
    q = torch.softmax(torch.randn(B, K, 16, generator=torch.Generator().manual_seed(3)), -1)
    for probs in (None, q):
        db = DraftBatch.from_lists(drafts, "cpu", max_len=K)
        db.probs = probs
        spec = SpecSampling.build(
            params, list(range(1, B + 1)), list(range(B)), [0] * B, K + 1, "cpu", with_uniforms=True
        )
        out = verify(logits, db, spec, Sampler(16, B + 1, "cpu"))
        for b in range(0, B, 2):  # the greedy rows
            want = GREEDY_CASES[b][3]
            assert out.token_ids[b, : len(want)].tolist() == want and out.num_emitted[b] == len(want)
        assert out.logprobs is not None and out.top_ids is not None
        lp = torch.log_softmax(logits, -1)
        for b in range(B):
            for j in range(int(out.num_emitted[b])):
                t = int(out.token_ids[b, j])
                assert torch.isclose(out.logprobs[b, j], lp[b, j, t])
                assert out.top_ids[b, j].tolist() == lp[b, j].topk(2).indices.tolist()


def test_identical_draft_and_target_distributions_accept_every_draft():
    g = torch.Generator().manual_seed(11)
    B, Vb = 64, 32
    logits = torch.randn(B, K + 1, Vb, generator=g)
    params = [SP(temperature=1.0, seed=b) for b in range(B)]
    spec = SpecSampling.build(params, [1] * B, list(range(B)), [0] * B, K + 1, "cpu", with_uniforms=True)
    sampler = Sampler(Vb, 2, "cpu")
    p = torch.softmax(sampler.filter_logits(logits.view(-1, Vb), spec.batch), -1).view(B, K + 1, Vb)
    lens = torch.randint(0, K + 1, (B,), generator=g)
    ids = torch.stack([torch.multinomial(p[:, j], 1, generator=g).squeeze(1) for j in range(K)], 1)
    out = verify(logits, DraftBatch(ids, lens, p[:, :K].clone()), spec, sampler)
    assert torch.equal(out.num_emitted, lens + 1)
    for b in range(B):
        assert out.token_ids[b, : lens[b]].tolist() == ids[b, : lens[b]].tolist()


def test_spec_sampling_refuses_what_it_cannot_honour():
    assert speculation_blocker(SP(repetition_penalty=1.2)) is not None
    assert speculation_blocker(SP(temperature=0.7, top_k=5, min_tokens=3, logprobs=1)) is None
    with pytest.raises(SpeculativeError, match="penalties"):
        SpecSampling.build([SP(presence_penalty=0.5)], [1], [0], [0], K + 1, "cpu")
    spec = SpecSampling.build([SP(temperature=0)] * 2, [1, 2], [0, 0], [0, 0], K + 1, "cpu")
    with pytest.raises(SpeculativeError, match="drafts are"):  # one draft each, the batch built for K
        verify(torch.zeros(2, K + 1, V), DraftBatch.from_lists([[1], [2]], "cpu"), spec, Sampler(V, 3, "cpu"))


# ---- n-gram proposals ------------------------------------------------------------------------------

# (sequence, num_draft_tokens, ngram_max, ngram_min) -> drafts
NGRAM_CASES = [
    ([1, 2, 3, 4, 2, 3], 4, 3, 2, [4, 2, 3, 4]),  # suffix [2, 3] at 1..2: copy 4, 2, 3, then loop
    ([1, 2, 3, 9, 7, 3, 5, 1, 2, 3], 2, 3, 1, [9, 7]),  # [1, 2, 3] beats the later [3]
    ([5, 1, 7, 5, 1, 8, 0, 5, 1], 3, 2, 1, [8, 0, 5]),  # of two [5, 1], the latest
    ([1, 2, 3, 4], 3, 3, 1, []),  # the last token never occurred before
    ([4, 9, 4], 3, 3, 2, []),  # only a 1-gram matches, ngram_min is 2
    ([4, 9, 4], 3, 3, 1, [9, 4, 9]),  # period 2 continued
    ([7, 7, 7, 7], 5, 3, 1, [7, 7, 7, 7, 7]),
    ([6], 3, 3, 1, []),  # too short
    ([1, 2, 1, 2, 1], 0, 3, 1, []),  # no drafts asked
    ([1, 2, 1], 8, 10, 1, [2, 1, 2, 1, 2, 1, 2, 1]),  # ngram_max longer than the sequence
]


@pytest.mark.parametrize("seq,k,nmax,nmin,want", NGRAM_CASES)
def test_ngram_cases(seq, k, nmax, nmin, want):
    for dtype in (np.int32, np.int64):
        got = propose_ngram(np.array(seq, dtype=dtype), k, nmax, nmin)
        assert got.dtype == np.int64 and got.tolist() == want


def _ngram_reference(seq: list[int], k: int, nmax: int, nmin: int) -> list[int]:
    """The rule, written plainly: longest suffix n-gram, latest earlier occurrence, LZ77 copy."""
    size = len(seq)
    for n in range(min(nmax, size - 1), nmin - 1, -1):
        suffix = seq[size - n :]
        starts = [s for s in range(size - n) if seq[s : s + n] == suffix]
        if starts:
            out: list[int] = []
            src = starts[-1] + n
            for j in range(k):
                out.append(seq[src + j] if src + j < size else out[src + j - size])
            return out
    return []


def test_ngram_matches_the_plain_rule_on_random_sequences():
    rng = np.random.default_rng(0)
    for trial in range(400):
        vocab = int(rng.integers(2, 6))
        seq = rng.integers(0, vocab, int(rng.integers(1, 40))).tolist()
        nmin = int(rng.integers(1, 4))
        nmax = nmin + int(rng.integers(0, 4))
        k = int(rng.integers(1, 7))
        want = _ngram_reference(seq, k, nmax, nmin)
        assert propose_ngram(np.array(seq), k, nmax, nmin).tolist() == want, (trial, seq, k, nmax, nmin)


def test_ngram_drafter_follows_growing_and_rewritten_sequences():
    rng = np.random.default_rng(1)
    cfg = NgramConfig(num_draft_tokens=5, ngram_max=3, ngram_min=1)
    drafter = NgramDrafter(cfg)
    seqs = {f"r{i}": rng.integers(0, 4, 30).tolist() for i in range(3)}
    for step in range(300):  # 300 > the history's first capacity (256): it grows
        for key, seq in seqs.items():
            seq.append(int(rng.integers(0, 4)))
            got = drafter.propose(key, seq, limit=step % 7)
            assert got.tolist() == _ngram_reference(seq, min(5, step % 7), 3, 1)
    seq = seqs["r0"]
    seq[-1] = (seq[-1] + 1) % 4  # a different last token: the history is rebuilt
    assert drafter.propose("r0", seq).tolist() == _ngram_reference(seq, 5, 3, 1)
    short = seq[:50]  # a shorter sequence under the same key: rebuilt too
    assert drafter.propose("r0", short).tolist() == _ngram_reference(short, 5, 3, 1)
    keys = list(seqs)
    assert drafter.propose_batch(keys, [seqs[k] for k in keys]) == [
        _ngram_reference(seqs[k], 5, 3, 1) for k in keys
    ]
    drafter.forget("r1")
    assert "r1" not in drafter._hist


def test_ngram_config_errors_name_the_field():
    with pytest.raises(SpeculativeError, match="num_draft_tokens"):
        NgramConfig(num_draft_tokens=0)
    with pytest.raises(SpeculativeError, match="ngram_min"):
        NgramConfig(ngram_min=0)
    with pytest.raises(SpeculativeError, match="ngram_max"):
        NgramConfig(ngram_max=1, ngram_min=2)


def test_acceptance_stats():
    stats = AcceptanceStats()
    stats.record([3, 3, 0], [4, 1, 1])
    stats.record([2], [2])
    d = stats.as_dict()
    assert (d["verified"], d["proposed"], d["accepted"], d["emitted"]) == (4, 8, 4, 8)
    assert d["acceptance_rate"] == 0.5 and d["mean_emitted"] == 2.0
    assert d["accepted_hist"] == {0: 2, 1: 1, 3: 1}


# ---- lossless sampling: chi-square on a small vocabulary -------------------------------------------


def _speculate(
    params: SP, source: str, rule: str, seed: int = 0, n: int = N, length: int = 2
) -> tuple[torch.Tensor, AcceptanceStats]:
    """[n, length] tokens emitted by n requests (seeds 1000 + i) decoding speculatively from the
    Markov target after PROMPT. source: "draft" (a draft model: drafts sampled from the draft table
    with their q), "ngram" (NgramDrafter, point masses). rule: "gumbel" (verify, point masses),
    "reject" (verify with q; the n-gram's q is one-hot), "accept_any" (rejection with u = 0: a
    draft is accepted whenever p(x) > 0, the deliberately wrong rule). Also returns the acceptance
    statistics."""
    target, draft = tables(seed)
    g = torch.Generator().manual_seed(seed + 1)
    sampler = Sampler(V, 2, "cpu")
    drafter = NgramDrafter(NgramConfig(num_draft_tokens=K, ngram_max=3, ngram_min=1))
    out = torch.full((n, length), -1, dtype=torch.int64)
    count = torch.zeros(n, dtype=torch.int64)
    stats = AcceptanceStats()
    while (count < length).any():
        act = torch.nonzero(count < length).squeeze(1)
        m = act.numel()
        prev = out[act, (count[act] - 1).clamp_min(0)]
        prev = torch.where(count[act] == 0, PROMPT[-1], prev)  # [m] the token before the step
        limit = torch.randint(0, K + 1, (m,), generator=g)  # varying draft lengths
        if source == "draft":
            ids = torch.zeros(m, K, dtype=torch.int64)
            q = torch.zeros(m, K, V)
            ctx = prev
            for j in range(K):
                q[:, j] = torch.softmax(draft[ctx], -1)
                ids[:, j] = ctx = torch.multinomial(q[:, j], 1, generator=g).squeeze(1)
            lens = limit
        else:
            lists = [
                drafter.propose(str(i), PROMPT + out[i, : count[i]].tolist(), int(lim))
                for i, lim in zip(act.tolist(), limit.tolist())
            ]
            db = DraftBatch.from_lists(lists, "cpu", max_len=K)
            ids, lens = db.ids, db.lens
            q = torch.zeros(m, K, V).scatter_(2, ids[:, :, None], 1.0)  # point masses
        ctx = torch.cat([prev[:, None], ids], dim=1)  # [m, K + 1]: the token before each position
        logits = target[ctx]  # [m, K + 1, V]
        spec = SpecSampling.build(
            [params] * m,
            [1] * m,
            (act + 1000).tolist(),
            count[act].tolist(),
            K + 1,
            "cpu",
            with_uniforms=rule != "gumbel",
        )
        if rule == "accept_any":
            assert spec.uniforms is not None
            spec.uniforms.zero_()
        res = verify(logits, DraftBatch(ids, lens, None if rule == "gumbel" else q), spec, sampler)
        stats.record(lens.tolist(), res.num_emitted.tolist())
        for r, i in enumerate(act.tolist()):
            c = int(count[i])
            take = min(int(res.num_emitted[r]), length - c)
            out[i, c : c + take] = res.token_ids[r, :take]
            count[i] = c + take
    return out, stats


def _pvalues(tokens: torch.Tensor, params: SP, seed: int = 0) -> tuple[float, float]:
    """p-values of the first token and of the (first, second) pair against the target's law."""
    p = target_probs(tables(seed)[0], params)  # [V, V]
    first = p[PROMPT[-1]]  # [V]
    pair = first[:, None] * p  # [V, V]: P(t0) * P(t1 | t0)
    c1 = torch.bincount(tokens[:, 0], minlength=V)
    c2 = torch.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)
    return chi2_pvalue(c1, first), chi2_pvalue(c2, pair)


PARAMS = {
    "t0.8": SP(temperature=0.8),
    "t1.3_topk5_topp0.9": SP(temperature=1.3, top_k=5, top_p=0.9),
}


@pytest.mark.parametrize("params", list(PARAMS.values()), ids=list(PARAMS))
@pytest.mark.parametrize(
    "source,rule",
    [("draft", "reject"), ("ngram", "gumbel"), ("ngram", "reject")],
    ids=["draft", "ngram", "ngram_q"],
)
def test_speculative_sampling_keeps_the_target_distribution(params, source, rule):
    """N = 12000 requests, 2 emitted tokens each; significance ALPHA = 0.001 (V = 8 cells for the
    first token, up to 64 for the pair; cells expecting < 5 pooled)."""
    tokens, stats = _speculate(params, source, rule)
    p_first, p_pair = _pvalues(tokens, params)
    assert p_first > ALPHA and p_pair > ALPHA, (p_first, p_pair)
    assert stats.as_dict()["acceptance_rate"] > 0.15  # drafts were accepted, not only rejected


@pytest.mark.parametrize("source", ["draft", "ngram"])
def test_a_wrong_acceptance_rule_fails_the_same_check(source):
    params = PARAMS["t0.8"]
    tokens, _ = _speculate(params, source, "accept_any")
    p_first, p_pair = _pvalues(tokens, params)
    assert p_first < ALPHA and p_pair < ALPHA, (p_first, p_pair)


def test_point_mass_speculation_emits_the_plain_samplers_seeded_tokens():
    """n-gram speculation, verified by matching the target's own seeded samples, emits exactly what
    plain decoding emits for the same seeds (min_tokens bans per position included)."""
    target, _ = tables(5)
    eos = 2
    target[:, eos] += 2.0  # EOS likely: the per-position min_tokens ban matters
    params = SP(temperature=1.1, top_k=6, top_p=0.95, min_tokens=4)
    R, length = 24, 16
    sampler = Sampler(V, 2, "cpu")
    plain = plain_seeded_tokens(target, params, R, length, PROMPT[-1], eos)
    drafter = NgramDrafter(NgramConfig(num_draft_tokens=K, ngram_max=3))
    spec_out: list[list[int]] = [[] for _ in range(R)]
    accepted = 0
    while any(len(s) < length for s in spec_out):
        act = [r for r in range(R) if len(spec_out[r]) < length]
        lists = [drafter.propose(str(r), PROMPT + spec_out[r], length - len(spec_out[r]) - 1) for r in act]
        db = DraftBatch.from_lists(lists, "cpu", max_len=K)
        prev = torch.tensor([spec_out[r][-1] if spec_out[r] else PROMPT[-1] for r in act])
        logits = target[torch.cat([prev[:, None], db.ids], 1)]
        steps = [len(spec_out[r]) for r in act]
        spec = SpecSampling.build(
            [params] * len(act), [1] * len(act), act, steps, K + 1, "cpu", eos_token_ids=[eos]
        )
        res = verify(logits, db, spec, sampler)
        accepted += int(res.num_accepted.sum())
        for i, r in enumerate(act):
            spec_out[r] += res.token_ids[i, : int(res.num_emitted[i])].tolist()
    assert [s[:length] for s in spec_out] == plain
    assert accepted > 0  # the drafts did take part
    assert all(eos not in s[:4] for s in plain) and any(eos in s for s in plain)


@pytest.mark.gpu
def test_verify_runs_on_cuda_without_host_syncs():
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    B, Vb = 8, 1000
    logits = torch.randn(B, K + 1, Vb, generator=g).to(dev)
    params = [SP(temperature=0.8, top_k=50, top_p=0.9, min_tokens=2, seed=b) for b in range(B)]
    q = torch.softmax(torch.randn(B, K, Vb, generator=g), -1).to(dev)
    ids = torch.multinomial(q.view(-1, Vb).cpu(), 1, generator=g).view(B, K).to(dev)
    lens = torch.randint(0, K + 1, (B,), generator=g).to(dev)
    sampler = Sampler(Vb, B + 1, dev)
    for probs in (None, q):
        spec = SpecSampling.build(
            params,
            list(range(1, B + 1)),
            list(range(B)),
            [0] * B,
            K + 1,
            dev,
            eos_token_ids=[0],
            with_uniforms=True,
        )
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = verify(logits, DraftBatch(ids, lens, probs), spec, sampler)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert ((out.num_emitted >= 1) & (out.num_emitted <= lens + 1)).all()


def test_token_view_reads_a_request_in_place():
    """What the engine hands the drafter each step: the request's tokens without building
    ``fill_ids`` (runtime/request.py ``TokenView``), equal to it by length, item and slice."""
    from kiln.runtime.request import Req

    req = Req("r", [5, 6, 7], SP(max_tokens=8))
    req.output_ids += [8, 9]
    view, full = req.token_view, req.fill_ids
    assert len(view) == len(full) == 5
    assert [view[i] for i in range(-5, 5)] == [full[i] for i in range(-5, 5)]
    for a, b in ((0, 5), (1, 4), (2, 3), (3, 5), (4, 2), (0, 99)):
        assert view[a:b] == full[a:b]
    assert view[2:] == full[2:] and list(view) == full
    with pytest.raises(IndexError):
        view[5]
    drafter = NgramDrafter(NgramConfig(num_draft_tokens=3, ngram_max=2, ngram_min=1))
    assert drafter.propose("r", view).tolist() == propose_ngram(np.array(full), 3, 2, 1).tolist()
