"""Speculative decoding's self-contained core: n-gram drafts and lossless verification.

The engine integration (docs/speculative.md) calls this module; nothing here knows the scheduler,
the KV pool or the graphs. The protocol of one speculative step for B requests:

1. Drafts. Each request gets up to ``K`` draft tokens: from :class:`NgramDrafter` (prompt lookup on
   the host, no weights) or from a draft model, which also keeps the distribution ``q`` each draft
   token was sampled from. They travel padded, as a :class:`DraftBatch` (``ids [B, K]``,
   ``lens [B]``, optional ``probs [B, K, V]``).
2. Verify. The target scores ``[newest token, drafts...]`` in one forward: ``logits [B, K + 1, V]``,
   where row ``j`` of request ``b`` is the target's next-token distribution after its sequence
   plus ``drafts[b, :j]`` (rows past ``lens[b]`` are padding and never read).
3. :func:`verify` returns the emitted tokens ``token_ids [B, K + 1]`` (``-1`` past each request's
   ``num_emitted``) and ``num_emitted [B]`` = accepted drafts + 1, all on the device: the only host
   sync a step needs is reading those back, as the stepper reads its sampled ids today.

Acceptance is lossless: the emitted tokens are distributed as the target's own samples.

* Greedy rows: the longest prefix of drafts equal to the target's argmax (lowest id on ties, as the
  sampler), then the argmax at the first mismatch, or the bonus token after all ``lens[b]``.
* Sampled rows, point-mass drafts (n-gram, a greedy draft model; ``probs`` None): the target samples
  each position with the noise the plain sampler would use for that token (``row_keys(seed, step +
  j)``, ops/sampling/gumbel.py) and a draft is accepted while it equals that sample. This is
  rejection sampling with ``q`` a point mass (accept ``x`` with probability ``p(x)``; on rejection
  the token is ``p`` without ``x``, renormalized), and it emits exactly the tokens the plain sampler
  emits for the same seed, logits and steps: speculation does not change a seeded output.
* Sampled rows, drafts with a distribution ``q``: standard speculative rejection sampling (Leviathan
  et al. 2023, Chen et al. 2023): accept ``x_j`` while ``u_j < p(x_j) / q(x_j)``; at the first
  rejection sample ``normalize(max(0, p - q))``; all accepted: the bonus token from ``p``. ``u_j``
  comes from its own counter-based stream (``ACCEPT_STREAM``), the residual and bonus draws from the
  target's keys, and a draft model must sample from a third stream (``DRAFT_STREAM``, see
  :func:`stream_seeds`) so that the three are independent.

``p`` is the target's logits through the sampler's own transforms: min_tokens bans (per position:
``step + j < min_tokens``), temperature, top-k, top-p and min-p (``Sampler.filter_logits``). Penalties
and structured outputs depend on the tokens before each position and are not applied here;
:func:`speculation_blocker` names them so the engine decodes such requests without speculation.
Logprobs (of the raw logits, as the sampler reports them) are returned per emitted position.

Nothing in :func:`verify`, :func:`accept_matches` or :func:`rejection_sample` reads a device value on
the host; which transforms run is decided on the host when :class:`SpecSampling` is built.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.ops.sampling.gumbel import argmax_rows, derive_seed, gumbel_argmax
from kiln.runtime.sampler import Sampler, SamplingBatch
from kiln.runtime.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kiln.runtime.spec_tree import TreeDraft

# Noise streams of a request, each a seed derived from the request's seed (``derive_seed(seed,
# stream)``; completions of ``n > 1`` use indices 1, 2, ... of the same derivation, far below these).
ACCEPT_STREAM = (1 << 40) + 1  # the acceptance uniforms u_j of rejection sampling
DRAFT_STREAM = (1 << 40) + 2  # a draft model's own sampling noise


class SpeculativeError(KilnError, ValueError):
    """A speculative-decoding input or option out of range (the message names it)."""


# ---- counter-based noise keys, vectorized (bit for bit ops/sampling/gumbel.py's row_keys) ----------

_M32 = np.uint64(0xFFFFFFFF)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64 of every element of a uint64 array (wrapping arithmetic, as gumbel.py's)."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def counter_keys(seeds: Sequence[int], counters: np.ndarray) -> np.ndarray:
    """``[B, P, 2]`` int64: ``row_keys(seeds[b], counters[b, p])``, the plain sampler's noise keys for
    request ``b``'s token number ``counters[b, p]`` (``counters`` ``[B, P]`` integers)."""
    mask = (1 << 64) - 1
    s = np.array([x & mask for x in seeds], dtype=np.uint64)[:, None]  # [B, 1]
    with np.errstate(over="ignore"):
        z = _splitmix64(s ^ _splitmix64(np.asarray(counters).astype(np.uint64)))
    return np.stack([z & _M32, z >> np.uint64(32)], axis=-1).astype(np.int64)


def position_keys(seeds: Sequence[int], steps: Sequence[int], positions: int) -> np.ndarray:
    """``[B, positions, 2]`` int64: ``row_keys(seeds[b], steps[b] + j)`` for ``j < positions``, the
    noise keys the plain sampler uses for request ``b``'s token number ``steps[b] + j``."""
    t = np.array(steps, dtype=np.uint64)[:, None] + np.arange(positions, dtype=np.uint64)  # [B, P]
    return counter_keys(seeds, t)


def stream_seeds(seeds: Sequence[int], stream: int) -> list[int]:
    """Each request's seed for noise ``stream`` (``ACCEPT_STREAM``, ``DRAFT_STREAM``)."""
    return [derive_seed(s, stream) for s in seeds]


def uniforms_from_keys(keys: np.ndarray) -> np.ndarray:
    """Uniforms in (0, 1), 24 bits, from keys ``[..., 2]`` (the high key word's top 24 bits)."""
    return (((keys[..., 1] >> 8).astype(np.float64) + 0.5) / 16777216.0).astype(np.float32)


def h2d(host: torch.Tensor, device: torch.device, stager: Any) -> torch.Tensor:
    """A host tensor on ``device`` without a host sync (through ``stager`` when given)."""
    if stager is not None:
        return stager.to_device(host, host.dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


# ---- inputs ----------------------------------------------------------------------------------------


def speculation_blocker(params: SamplingParams) -> str | None:
    """Why a request cannot be verified speculatively, or None when it can: what :func:`verify`
    cannot honour (penalties and grammars depend on the tokens before each position)."""
    if params.uses_penalties:
        return "repetition/frequency/presence penalties"
    if params.structured is not None:
        return "structured outputs"
    return None


@dataclass
class DraftBatch:
    """Drafts of B requests, padded to ``K`` (``max_len``).

    ids: [B, K] int64 (past ``lens``: padding, 0 or a chain's unverified picks, never read). lens:
    [B] int64 in [0, K]. probs: [B, K, >= V] float32, the distribution each draft token was sampled
    from (rows past ``lens`` ignored), or None for point-mass drafts (n-gram, greedy draft models)."""

    ids: torch.Tensor
    lens: torch.Tensor
    probs: torch.Tensor | None = None

    @property
    def max_len(self) -> int:
        return self.ids.shape[1]

    @classmethod
    def from_lists(
        cls,
        drafts: Sequence[Sequence[int]],
        device: torch.device | str,
        max_len: int | None = None,
        stager: Any = None,
    ) -> DraftBatch:
        """Point-mass drafts from host lists (one copy); ``max_len`` pads further (a graph bucket)."""
        k = max((len(d) for d in drafts), default=0) if max_len is None else max_len
        host = torch.zeros(len(drafts), k + 1, dtype=torch.int64)  # column k: the lengths
        for b, d in enumerate(drafts):
            if len(d) > k:
                raise SpeculativeError(f"drafts: request {b} has {len(d)} drafts, more than max_len {k}")
            host[b, : len(d)] = torch.tensor(list(d), dtype=torch.int64)
            host[b, k] = len(d)
        dev = h2d(host, torch.device(device), stager)
        return cls(ids=dev[:, :k], lens=dev[:, k])


@dataclass
class SpecSampling:
    """The sampling tensors of a verify step over B requests and ``positions`` = K + 1 rows each.

    ``batch`` is a :class:`SamplingBatch` of ``B * positions`` rows (request ``b``'s position ``j``
    is row ``b * positions + j``): the request's parameters repeated, its noise keys those of token
    number ``step + j`` and its min_tokens bans per position. ``uniforms`` [B, K] float32: the
    acceptance uniforms of rejection sampling (None when built without them)."""

    batch: SamplingBatch
    uniforms: torch.Tensor | None
    size: int
    positions: int

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        rows: Sequence[int],
        seeds: Sequence[int],
        steps: Sequence[int],
        positions: int,
        device: torch.device | str,
        *,
        eos_token_ids: Sequence[int] = (),
        with_uniforms: bool = False,
        stager: Any = None,
    ) -> SpecSampling:
        """Host work of one verify step: ``params_list[i]``, ``rows[i]`` (block-table row),
        ``seeds[i]`` (``Req.seed``) and ``steps[i]`` (tokens generated so far) describe request
        ``i``; ``positions`` is ``K + 1``; ``with_uniforms`` for drafts with a distribution."""
        B, P = len(params_list), positions
        if not (len(rows) == len(seeds) == len(steps) == B):
            raise SpeculativeError(
                f"SpecSampling.build: {B} params, {len(rows)} rows, {len(seeds)} seeds, {len(steps)} steps"
            )
        if P < 1:
            raise SpeculativeError(f"SpecSampling.build: positions must be >= 1 (K + 1), got {P}")
        for p in params_list:
            if (why := speculation_blocker(p)) is not None:
                raise SpeculativeError(f"a request with {why} cannot be verified speculatively")
        dev = torch.device(device)
        rows_p = [r for r in rows for _ in range(P)]
        uniforms = None
        if with_uniforms:
            u = uniforms_from_keys(position_keys(stream_seeds(seeds, ACCEPT_STREAM), steps, P - 1))
            uniforms = h2d(torch.from_numpy(u), dev, stager)  # [B, K]
        if SamplingBatch.plain_greedy(params_list):
            return cls(SamplingBatch.greedy_batch(rows_p, dev, stager), uniforms, B, P)
        base = SamplingBatch.build(
            params_list, rows, dev, seeds=seeds, steps=steps, eos_token_ids=eos_token_ids, stager=stager
        )
        keys = h2d(torch.from_numpy(position_keys(seeds, steps, P).reshape(B * P, 2)), dev, stager)
        ban_b, ban_t = [], []
        for i, (p, step) in enumerate(zip(params_list, steps)):
            if step >= p.min_tokens:
                continue
            banned = list(p.stop_token_ids or ()) + ([] if p.ignore_eos else list(eos_token_ids))
            for j in range(min(P, p.min_tokens - step)):
                ban_b += [i * P + j] * len(banned)
                ban_t += banned
        ban = None
        if ban_b:
            idx = h2d(torch.tensor([ban_b, ban_t], dtype=torch.int64), dev, stager)
            ban = (idx[0], idx[1])

        def rep(t: torch.Tensor) -> torch.Tensor:
            return t.repeat_interleave(P, dim=0)

        batch = dataclasses.replace(
            base,
            size=B * P,
            row_list=rows_p,
            rows=rep(base.rows),
            keys=keys,
            greedy=rep(base.greedy),
            temperature=rep(base.temperature),
            top_p=rep(base.top_p),
            min_p=rep(base.min_p),
            rep=rep(base.rep),
            freq=rep(base.freq),
            pres=rep(base.pres),
            top_k=rep(base.top_k),
            ban=ban,
        )
        return cls(batch, uniforms, B, P)


@dataclass
class VerifyOutput:
    """token_ids: [B, K + 1] int64, each request's emitted tokens then -1. num_emitted: [B] int64,
    accepted drafts + 1. With logprobs asked: logprobs [B, K + 1] f32 (the emitted tokens'),
    top_ids [B, K + 1, N] int64, top_logprobs [B, K + 1, N] f32; rows past num_emitted are junk."""

    token_ids: torch.Tensor
    num_emitted: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None

    @property
    def num_accepted(self) -> torch.Tensor:
        return self.num_emitted - 1


# ---- acceptance ------------------------------------------------------------------------------------


def _accepted(accept: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """[B] int64: how many leading entries of ``accept`` [B, K] hold, among the first ``lens``."""
    K = accept.shape[1]
    valid = torch.arange(K, device=accept.device)[None, :] < lens[:, None]  # [B, K]
    return (accept & valid).long().cumprod(dim=1).sum(dim=1)


def accept_matches(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, draft_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact-match acceptance (greedy rows; point-mass drafts against the target's own samples).

    target_ids: [B, K + 1] int64, the target's token at each position. draft_ids: [B, K] int64.
    draft_lens: [B] int64. Returns (token_ids [B, K + 1]: ``target_ids`` up to and including the
    first position whose draft differs or is past ``lens``, then -1; num_emitted [B])."""
    K1 = target_ids.shape[1]
    a = _accepted(draft_ids == target_ids[:, : K1 - 1], draft_lens)  # [B]
    j = torch.arange(K1, device=target_ids.device)[None, :]
    return target_ids.masked_fill(j > a[:, None], -1), a + 1


def rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor,
    draft_ids: torch.Tensor,
    draft_lens: torch.Tensor,
    uniforms: torch.Tensor,
    keys: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative rejection sampling for drafts sampled from ``q``.

    p: [B, K + 1, V] f32 target probabilities (position K: the bonus token's). q: [B, K, V] f32.
    draft_ids: [B, K] int64, ``draft_ids[b, j] ~ q[b, j]``. draft_lens: [B]. uniforms: [B, K] in
    (0, 1). keys: [B, K + 1, 2] int64 Gumbel keys of each position's draw. Accept ``x_j`` while
    ``u_j * q(x_j) < p(x_j)``; at the first rejection ``a`` draw from ``max(0, p_a - q_a)`` (from
    ``p_a`` when that is all zero: p <= q everywhere, a rounding corner), after all ``lens`` drafts
    from ``p``. Returns (token_ids [B, K + 1], num_emitted [B]) as :func:`accept_matches`."""
    B, K1, V = p.shape
    K = K1 - 1
    dev = p.device
    x = draft_ids[:, :, None]
    px = p[:, :K].gather(2, x).squeeze(2)  # [B, K]
    qx = q.gather(2, x).squeeze(2)
    a = _accepted(uniforms * qx < px, draft_lens)  # [B]
    pa = p.gather(1, a[:, None, None].expand(B, 1, V)).squeeze(1)  # [B, V]
    if K > 0:  # q at the rejected position; zero after all drafts (the bonus draw is from p)
        qa = q.gather(1, a.clamp(max=K - 1)[:, None, None].expand(B, 1, V)).squeeze(1)
        qa = qa * (a < draft_lens).to(qa.dtype)[:, None]
        res = (pa - qa).clamp_min(0.0)
        res = torch.where(res.sum(dim=1, keepdim=True) > 0, res, pa)
    else:
        res = pa
    ka = keys.gather(1, a[:, None, None].expand(B, 1, 2)).squeeze(1)  # [B, 2]
    tok = gumbel_argmax(torch.log(res).contiguous(), ka)  # [B]
    j = torch.arange(K1, device=dev)[None, :]
    drafts = torch.cat([draft_ids, draft_ids.new_zeros(B, 1)], dim=1)  # [B, K + 1]
    out = torch.where(j < a[:, None], drafts, tok[:, None])
    return out.masked_fill(j > a[:, None], -1), a + 1


def verify(logits: torch.Tensor, drafts: DraftBatch, spec: SpecSampling, sampler: Sampler) -> VerifyOutput:
    """The emitted tokens of a verify step (module docstring).

    logits: [>= B, >= K + 1, >= V] target logits (float32 or cast to it; columns past the
    sampler's vocabulary ignored). drafts: the step's :class:`DraftBatch` (K = ``spec.positions - 1``).
    spec: built for the same requests. sampler: the engine's (its ``filter_logits``; the
    penalty buffers are not used)."""
    B, P, V = spec.size, spec.positions, sampler.vocab_size
    K = P - 1
    if tuple(drafts.ids.shape) != (B, K):
        raise SpeculativeError(f"verify: drafts are {tuple(drafts.ids.shape)}, the sampling batch ({B}, {K})")
    sb = spec.batch
    raw = logits[:B, :P, :V].reshape(B * P, V)  # [B*P, V]
    if raw.dtype != torch.float32:
        raw = raw.float()
    x = raw
    if sb.ban is not None:
        x = x.index_put(sb.ban, x.new_full((1,), float("-inf")))
    greedy_ids = argmax_rows(x.contiguous()) if sb.any_greedy else None  # [B*P]
    if sb.all_greedy:
        assert greedy_ids is not None
        token_ids, n = accept_matches(greedy_ids.view(B, P), drafts.ids, drafts.lens)
    elif drafts.probs is None:
        filt = sampler.filter_logits(x, sb)
        sampled = gumbel_argmax(filt, sb.keys)
        if greedy_ids is not None:
            sampled = torch.where(sb.greedy, greedy_ids, sampled)
        token_ids, n = accept_matches(sampled.view(B, P), drafts.ids, drafts.lens)
    else:
        if spec.uniforms is None:
            raise SpeculativeError("verify: drafts with probabilities need SpecSampling built with_uniforms")
        probs = torch.softmax(sampler.filter_logits(x, sb), dim=-1)  # [B*P, V]
        if greedy_ids is not None:  # a greedy row's p is a point mass: exact match, argmax after
            hot = torch.zeros_like(probs).scatter_(1, greedy_ids[:, None], 1.0)
            probs = torch.where(sb.greedy[:, None], hot, probs)
        token_ids, n = rejection_sample(
            probs.view(B, P, V),
            drafts.probs[:, :, :V].float(),
            drafts.ids,
            drafts.lens,
            spec.uniforms,
            sb.keys.view(B, P, 2),
        )
    out = VerifyOutput(token_ids=token_ids, num_emitted=n)
    if sb.num_logprobs is not None:  # of the raw logits, as the sampler reports them
        lp = torch.log_softmax(raw, dim=-1)  # [B*P, V]
        top = lp.topk(min(sb.num_logprobs, V), dim=-1)
        out.logprobs = lp.gather(1, token_ids.view(B * P, 1).clamp_min(0)).view(B, P)
        out.top_logprobs = top.values.view(B, P, -1)
        out.top_ids = top.indices.view(B, P, -1)
    return out


# ---- acceptance statistics -------------------------------------------------------------------------


@dataclass
class AcceptanceStats:
    """Sums over verify steps (for /metrics and ``kiln bench``): verify steps, requests verified,
    draft tokens proposed and accepted, tokens emitted, and a histogram of accepted drafts per
    request-step."""

    steps: int = 0
    verified: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    hist: dict[int, int] = dataclasses.field(default_factory=dict)

    def record(self, draft_lens: Sequence[int], num_emitted: Sequence[int]) -> None:
        """One verify step's host copies of ``DraftBatch.lens`` and ``VerifyOutput.num_emitted``."""
        self.steps += 1
        for k, n in zip(draft_lens, num_emitted):
            self.verified += 1
            self.proposed += k
            self.accepted += n - 1
            self.emitted += n
            self.hist[n - 1] = self.hist.get(n - 1, 0) + 1

    def as_dict(self) -> dict[str, Any]:
        """The sums plus ``acceptance_rate`` (accepted / proposed) and ``mean_emitted`` (tokens
        per request per verify step, the speed-up's upper bound)."""
        return {
            "steps": self.steps,
            "verified": self.verified,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "emitted": self.emitted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
            "mean_emitted": self.emitted / self.verified if self.verified else 0.0,
            "accepted_hist": dict(sorted(self.hist.items())),
        }


# ---- n-gram prompt lookup --------------------------------------------------------------------------


@dataclass(frozen=True)
class NgramConfig:
    """num_draft_tokens: drafts per request and step (K; a tree's draft nodes). ngram_max, ngram_min:
    the lengths of the sequence's suffix looked up earlier in it, longest first. branches: the most
    distinct continuations a draft tree merges (runtime/spec_tree.py ``ngram_tree``; 1: chains)."""

    num_draft_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 1
    branches: int = 1

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise SpeculativeError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.branches < 1:
            raise SpeculativeError(f"draft_branches must be >= 1, got {self.branches}")
        if self.ngram_min < 1:
            raise SpeculativeError(f"ngram_min must be >= 1, got {self.ngram_min}")
        if self.ngram_max < self.ngram_min:
            raise SpeculativeError(f"ngram_max ({self.ngram_max}) must be >= ngram_min ({self.ngram_min})")


_NO_DRAFTS = np.zeros(0, dtype=np.int64)


def propose_ngram(tokens: np.ndarray, num_draft_tokens: int, ngram_max: int, ngram_min: int) -> np.ndarray:
    """Up to ``num_draft_tokens`` drafts for the sequence ``tokens`` (1-D integer array: prompt and
    output so far), int64, empty when nothing matches.

    The suffix of length n, for n from ``ngram_max`` down to ``ngram_min``, is looked up earlier in
    the sequence (an occurrence followed by at least one token); the longest n that occurs wins,
    and among its occurrences the latest (the most recent context). The drafts copy what followed
    it; a copy that reaches the end of the sequence continues from its own start, LZ77-style (the
    occurrence at distance d repeats with period d: a loop of d tokens is drafted in full).

    Vectorized: one comparison of the last token against the sequence, then the candidates only."""
    seq = np.asarray(tokens)
    if num_draft_tokens <= 0:
        return _NO_DRAFTS
    ends = ngram_occurrences(seq, ngram_max, ngram_min)
    if ends.size == 0:
        return _NO_DRAFTS
    return ngram_continuation(seq, int(ends[-1]), num_draft_tokens)  # the latest occurrence's


def ngram_occurrences(tokens: np.ndarray, ngram_max: int, ngram_min: int) -> np.ndarray:
    """The occurrences (each its last index, ascending) earlier in ``tokens`` of the sequence's
    longest suffix of length ``ngram_min..ngram_max`` that occurs there (:func:`propose_ngram`'s
    lookup); empty when none does."""
    seq = np.asarray(tokens)
    size = seq.shape[0]
    if size <= ngram_min:
        return _NO_DRAFTS
    last = size - 1
    ends = np.flatnonzero(seq[:last] == seq[last])  # occurrences (their last index) of the last token
    n = 1  # every candidate in ``ends`` matches the suffix of length n
    while ends.size and n < ngram_max:
        cand = ends[ends >= n]
        cand = cand[seq[cand - n] == seq[last - n]]
        if cand.size == 0:
            break
        ends, n = cand, n + 1
    if ends.size == 0 or n < ngram_min:
        return _NO_DRAFTS
    return ends


def ngram_continuation(tokens: np.ndarray, end: int, num_draft_tokens: int) -> np.ndarray:
    """The ``num_draft_tokens`` tokens that follow the occurrence ending at ``end`` (int64), continued
    LZ77-style past the sequence's end (period: the occurrence's distance from it)."""
    start = end + 1
    period = tokens.shape[0] - start
    return np.asarray(tokens)[start + np.arange(num_draft_tokens) % period].astype(np.int64)


class _History:
    """An append-only token sequence in a growing int32 array."""

    def __init__(self) -> None:
        self.buf = np.zeros(256, dtype=np.int32)
        self.n = 0

    def sync(self, tokens: Sequence[int]) -> np.ndarray:
        """Bring the history up to ``tokens`` (appending what is new; rebuilt if ``tokens`` is not an
        extension of it: a shorter list, or a different token at its end) and return it."""
        m = len(tokens)
        if m < self.n or (self.n and self.buf[self.n - 1] != tokens[self.n - 1]):
            self.n = 0
        if m > self.buf.shape[0]:
            grown = np.zeros(max(m, 2 * self.buf.shape[0]), dtype=np.int32)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        if m > self.n:
            self.buf[self.n : m] = tokens[self.n :]
            self.n = m
        return self.buf[:m]


class NgramDrafter:
    """Prompt-lookup drafts for many requests, each keeping its tokens in an array that grows with
    it (converting an 8k-token list per step would cost more than the lookup).

    ``propose(key, tokens)``: ``tokens`` is the request's prompt and output so far, known tokens only
    (no placeholders); between calls it only grows. ``forget(key)`` when the request ends."""

    def __init__(self, cfg: NgramConfig) -> None:
        self.cfg = cfg
        self._hist: dict[str, _History] = {}

    def propose(self, key: str, tokens: Sequence[int], limit: int | None = None) -> np.ndarray:
        """Drafts (int64, possibly empty) for ``key``; at most ``limit`` (e.g. the tokens the request
        may still generate, less one for the bonus token) when given."""
        hist = self._hist.get(key)
        if hist is None:
            hist = self._hist[key] = _History()
        k = self.cfg.num_draft_tokens if limit is None else min(limit, self.cfg.num_draft_tokens)
        return propose_ngram(hist.sync(tokens), k, self.cfg.ngram_max, self.cfg.ngram_min)

    def propose_batch(
        self, keys: Sequence[str], token_lists: Sequence[Sequence[int]], limits: Sequence[int] | None = None
    ) -> list[list[int]]:
        """:meth:`propose` for each request (lists, for :meth:`DraftBatch.from_lists`)."""
        lim = limits if limits is not None else [None] * len(keys)
        return [self.propose(k, t, m).tolist() for k, t, m in zip(keys, token_lists, lim)]

    def propose_tree(self, key: str, tokens: Sequence[int], limit: int | None = None) -> TreeDraft:
        """A draft tree for ``key`` (runtime/spec_tree.py ``ngram_tree``: up to ``cfg.branches``
        distinct continuations of the suffix's occurrences, at most ``limit`` and
        ``num_draft_tokens`` draft nodes); with ``branches`` 1 the chain of :meth:`propose`."""
        from kiln.runtime.spec_tree import ngram_tree

        hist = self._hist.get(key)
        if hist is None:
            hist = self._hist[key] = _History()
        cfg = self.cfg
        k = cfg.num_draft_tokens if limit is None else min(limit, cfg.num_draft_tokens)
        return ngram_tree(hist.sync(tokens), k, cfg.ngram_max, cfg.ngram_min, cfg.branches)

    def propose_tree_batch(
        self, keys: Sequence[str], token_lists: Sequence[Sequence[int]], limits: Sequence[int] | None = None
    ) -> list[TreeDraft]:
        """:meth:`propose_tree` for each request."""
        lim = limits if limits is not None else [None] * len(keys)
        return [self.propose_tree(k, t, m) for k, t, m in zip(keys, token_lists, lim)]

    def forget(self, key: str) -> None:
        self._hist.pop(key, None)
