"""Batched sampling on the device: one ``Sampler.sample`` call per step.

Per step the engine builds a ``SamplingBatch`` from the running requests' ``SamplingParams``
(``SamplingBatch.build``: a few small host->device copies), then calls ``sample(logits, batch)``
and, once the tokens are accepted, ``observe(batch.rows, next_ids)``. Nothing on this path reads
a device value back to the host; which transforms run is decided on the host at build time.

Order of transforms (Hugging Face's, which vLLM shares): penalties on the raw logits (repetition:
HF semantics over prompt + generated tokens; frequency/presence: OpenAI semantics over generated
tokens), min_tokens masking of EOS/stop ids, then greedy rows take ``argmax`` (ties: lowest id);
sampled rows divide by temperature, keep top-k, then top-p (on the top-k renormalized
distribution), then min-p (``p >= min_p * p_max``), and draw by Gumbel-max with noise hashed from
(seed, step, token id) (``ops/sampling/gumbel.py``): the same seed gives the same tokens whatever
else is in the batch. Unseeded requests should get a seed at admission (``resolve_seed``).

Logprobs are ``log_softmax`` of the raw logits (before penalties and temperature), as vLLM and
OpenAI report them: the chosen token's and the top N (N = the largest ``logprobs`` in the batch).

Penalties need per-request token counts: ``[R, V]`` device buffers indexed by block-table row
(generated-token counts int32, prompt-token mask bool), allocated on the first batch that uses a
penalty, filled lazily from the ids given to ``reset_row``, updated by one scatter per ``observe``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kiln.ops.sampling.gumbel import argmax_rows, derive_seed, gumbel_argmax, row_keys
from kiln.runtime.sampling_params import SamplingParams

_rng = random.SystemRandom()


def _h2d(data: list, dtype: torch.dtype, device: torch.device | str, stager: Any = None) -> torch.Tensor:
    """A host list as a device tensor without a host sync (pinned, non-blocking on CUDA); through
    ``stager`` (a :class:`~kiln.runtime.staging.HostStager`) when given: no pinned allocation."""
    if stager is not None:
        return stager.to_device(data, dtype)
    t = torch.tensor(data, dtype=dtype)
    if torch.device(device).type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


_EMPTY: dict[str, torch.Tensor] = {}


def _empty_i64(device: torch.device | str) -> torch.Tensor:
    key = str(device)
    if key not in _EMPTY:
        _EMPTY[key] = torch.empty(0, dtype=torch.int64, device=device)
    return _EMPTY[key]


def resolve_seed(params: SamplingParams, index: int = 0) -> int:
    """The seed a request samples with: ``params.seed`` (completion ``index`` of ``n`` derives its
    own), or a fresh random 63-bit seed when unseeded. Call once at admission; keep it."""
    if params.seed is None:
        return _rng.getrandbits(63)
    return derive_seed(params.seed, index)


@dataclass
class SampleOutput:
    """next_ids: [B] int64. logprobs: [B] f32 (chosen token) or None when no row asked.
    top_ids: [B, N] int64 and top_logprobs: [B, N] f32, or None (N may be 0)."""

    next_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    top_logprobs: torch.Tensor | None = None


@dataclass
class SamplingBatch:
    """Per-step sampling tensors for B requests (build with ``SamplingBatch.build``).

    rows: [B] int64 block-table rows. keys: [B, 2] int64 noise keys. greedy: [B] bool.
    temperature, top_p, min_p, rep, freq, pres: [B, 1] f32. top_k: [B, 1] int64 (V when off).
    ban: (batch idx [K] int64, token id [K] int64) masked to -inf (min_tokens), or None.
    Host flags select which transforms run.
    """

    size: int
    row_list: list[int]
    rows: torch.Tensor
    keys: torch.Tensor
    greedy: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    rep: torch.Tensor
    freq: torch.Tensor
    pres: torch.Tensor
    top_k: torch.Tensor
    ban: tuple[torch.Tensor, torch.Tensor] | None
    all_greedy: bool
    any_greedy: bool
    use_top_k: bool
    max_top_k: int
    use_top_p: bool
    use_min_p: bool
    use_penalties: bool
    num_logprobs: int | None  # None: no row wants logprobs

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        rows: Sequence[int],
        device: torch.device | str,
        *,
        seeds: Sequence[int] | None = None,
        steps: Sequence[int] | None = None,
        eos_token_ids: Sequence[int] = (),
        stager: Any = None,
    ) -> SamplingBatch:
        """Tensors for one step (copied through ``stager`` when given, see ``_h2d``).

        params_list[i] and rows[i] (block-table row) describe batch entry i. ``seeds[i]``: the
        request's seed from ``resolve_seed`` (default: ``params.seed``, or a fresh random draw for
        unseeded requests). ``steps[i]``: tokens the request has generated so far; required when
        any entry is seeded or has ``min_tokens`` (the noise and the masking depend on it).
        ``eos_token_ids``: masked with ``stop_token_ids`` while ``steps[i] < min_tokens`` (not
        with ``ignore_eos``).
        """
        B = len(params_list)
        if len(rows) != B:
            raise ValueError(f"SamplingBatch.build: {B} params but {len(rows)} rows")
        if cls.plain_greedy(params_list):
            return cls.greedy_batch(list(rows), device, stager)
        seeded = seeds is not None or any(p.seed is not None for p in params_list)
        if steps is None and (seeded or any(p.min_tokens > 0 for p in params_list)):
            raise ValueError(
                "SamplingBatch.build: steps (tokens generated per request) is required for seeded requests and min_tokens"
            )
        if seeds is None:
            seeds = [p.seed if p.seed is not None else _rng.getrandbits(63) for p in params_list]
        if steps is None:
            steps = [0] * B
        off_k = 1 << 62  # top-k off: larger than any vocabulary
        floats, ints, ban_b, ban_t = [], [], [], []
        greedy_list = []
        for i, (p, row, seed, step) in enumerate(zip(params_list, rows, seeds, steps)):
            g = p.is_greedy
            greedy_list.append(g)
            floats.append(
                (
                    1.0 if g else p.temperature,
                    p.top_p if p.top_p < 1.0 else float("inf"),
                    p.min_p,
                    p.repetition_penalty,
                    p.frequency_penalty,
                    p.presence_penalty,
                )
            )
            keys = (0, 0) if g else row_keys(seed, step)  # greedy rows draw no noise
            ints.append((row, p.top_k if p.top_k > 0 else off_k, *keys, int(g)))
            if step < p.min_tokens:
                banned = list(p.stop_token_ids or ()) + ([] if p.ignore_eos else list(eos_token_ids))
                ban_b += [i] * len(banned)
                ban_t += banned
        sampled = [p for p, g in zip(params_list, greedy_list) if not g]
        f = _h2d([list(c) for c in zip(*floats)], torch.float32, device, stager).reshape(6, B, 1)  # [6, B, 1]
        n = _h2d([list(c) for c in zip(*ints)], torch.int64, device, stager).reshape(5, B)  # [5, B]
        ban = None
        if ban_b:
            idx = _h2d([ban_b, ban_t], torch.int64, device, stager)  # [2, K]
            ban = (idx[0], idx[1])
        want = [p.logprobs for p in params_list if p.logprobs is not None]
        return cls(
            size=B,
            row_list=list(rows),
            rows=n[0],
            keys=n[2:4].t().contiguous(),
            greedy=n[4].bool(),
            temperature=f[0],
            top_p=f[1],
            min_p=f[2],
            rep=f[3],
            freq=f[4],
            pres=f[5],
            top_k=n[1].unsqueeze(-1),
            ban=ban,
            all_greedy=not sampled,
            any_greedy=len(sampled) < B,
            use_top_k=any(p.top_k > 0 for p in sampled),
            max_top_k=max((p.top_k for p in sampled if p.top_k > 0), default=0),
            use_top_p=any(p.top_p < 1.0 for p in sampled),
            use_min_p=any(p.min_p > 0.0 for p in sampled),
            use_penalties=any(p.uses_penalties for p in params_list),
            num_logprobs=max(want) if want else None,
        )

    @staticmethod
    def plain_greedy(params_list: Sequence[SamplingParams]) -> bool:
        """Whether every entry is greedy without penalties, logprobs, min_tokens or a structure
        (argmax only: a structure's mask applies to the logits before it).
        Requests usually share a few ``SamplingParams`` objects: each distinct one is checked once."""
        return all(
            p.is_greedy
            and not p.uses_penalties
            and p.logprobs is None
            and p.min_tokens == 0
            and p.structured is None
            for p in {id(p): p for p in params_list}.values()
        )

    @classmethod
    def greedy_batch(
        cls, rows: list[int], device: torch.device | str, stager: Any = None, need_rows: bool = True
    ) -> SamplingBatch:
        """The common all-greedy batch (``plain_greedy``): argmax only, so nothing but the rows
        is built, and not even those with ``need_rows=False`` (``observe`` has no counts to
        update: no request has used penalties yet). ``rows`` is kept as ``row_list``, not copied."""
        B = len(rows)
        r = _h2d(rows, torch.int64, device, stager) if need_rows else _empty_i64(device)
        none = r[:0]
        return cls(
            size=B,
            row_list=rows,
            rows=r,
            keys=none,
            greedy=none,
            temperature=none,
            top_p=none,
            min_p=none,
            rep=none,
            freq=none,
            pres=none,
            top_k=none,
            ban=None,
            all_greedy=True,
            any_greedy=True,
            use_top_k=False,
            max_top_k=0,
            use_top_p=False,
            use_min_p=False,
            use_penalties=False,
            num_logprobs=None,
        )


# Greedy picks of up to this many rows take the Triton argmax (ops/sampling/gumbel.py: 7 us against
# torch.argmax's 41 us at batch 1 on the H200), larger batches torch.argmax: its two launches cost
# ~0.13 ms more host time per step through Triton's launcher (measured at batch 64, where the host
# path is the budget), while a small batch's step waits on the GPU anyway.
TRITON_ARGMAX_MAX_ROWS = 4


def _greedy(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for x [B, V]: lowest index among equal maxima either way."""
    return argmax_rows(x) if x.shape[0] <= TRITON_ARGMAX_MAX_ROWS else x.argmax(dim=-1)


def filter_logits(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p; masked logits are -inf. x: [B, V] -> [B, V] f32."""
    x = x / batch.temperature
    neg_inf = float("-inf")
    if batch.use_top_p:
        s, _ = x.sort(dim=-1, descending=True)  # s: [B, V]
        if batch.use_top_k:
            kth = s.gather(1, (batch.top_k.clamp(max=x.shape[1]) - 1))  # [B, 1]
            s = s.masked_fill(s < kth, neg_inf)
        p = torch.softmax(s, dim=-1)
        before = torch.cumsum(p, dim=-1) - p  # mass of the higher-ranked tokens
        keep = (before < batch.top_p) & (s > neg_inf)  # [B, V], the first token always kept
        cutoff = s.gather(1, keep.sum(dim=-1, keepdim=True) - 1)  # [B, 1] lowest kept logit
        x = x.masked_fill(x < cutoff, neg_inf)
    elif batch.use_top_k:
        k = min(batch.max_top_k, x.shape[1])
        top = x.topk(k, dim=-1).values  # [B, k]
        kth = top.gather(1, batch.top_k.clamp(max=k) - 1)  # [B, 1]
        kth = kth.masked_fill(batch.top_k > k, neg_inf)  # rows with top-k off keep all
        x = x.masked_fill(x < kth, neg_inf)
    if batch.use_min_p:
        floor = x.max(dim=-1, keepdim=True).values + torch.log(batch.min_p)  # [B, 1]
        x = x.masked_fill(x < floor, neg_inf)
    return x.contiguous()


class Sampler:
    """Samples the next token of every request of a batch on ``device``.

    Args: vocab_size: V (logits columns past V, vocab padding, are ignored). max_rows: R, rows of
    the block table (indexes the penalty buffers). device: where logits live.
    """

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device | str) -> None:
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.device = torch.device(device)
        self.counts: torch.Tensor | None = None  # [R, V] int32 generated-token counts
        self.prompt_mask: torch.Tensor | None = None  # [R, V] bool prompt tokens
        self._pending: dict[int, tuple[list[int], list[int]]] = {}  # row -> (prompt, output) ids
        self._ready: set[int] = set()  # rows whose device counts are current

    # ------------------------------------------------------------------------ row state
    def reset_row(self, row: int, prompt_ids: Sequence[int], output_ids: Sequence[int] = ()) -> None:
        """Start ``row`` for a request with ``prompt_ids`` (and, when resuming a preempted request,
        the ``output_ids`` it generated). Host-only; the device rows are written if and when the
        request first samples with a penalty."""
        if not 0 <= row < self.max_rows:
            raise ValueError(f"reset_row: row {row} outside 0..{self.max_rows - 1}")
        self._pending[row] = (list(prompt_ids), list(output_ids))
        self._ready.discard(row)

    def observe(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Count the sampled tokens: rows [B] int64 (``batch.rows``), token_ids [B] int64. One
        scatter on the device, nothing when no request has used penalties yet."""
        if self.counts is None:
            return
        if rows.numel() != token_ids.numel():
            raise ValueError("Sampler.observe: the batch was built without its rows (need_rows=False)")
        ones = torch.ones(token_ids.shape, dtype=torch.int32, device=self.device)
        self.counts.index_put_((rows, token_ids), ones, accumulate=True)

    def _materialize(self, rows: Sequence[int]) -> None:
        todo = [r for r in rows if r not in self._ready]
        if not todo:
            return
        if self.counts is None:
            self.counts = torch.zeros(self.max_rows, self.vocab_size, dtype=torch.int32, device=self.device)
            self.prompt_mask = torch.zeros(
                self.max_rows, self.vocab_size, dtype=torch.bool, device=self.device
            )
        pr, pt, orow, ot = [], [], [], []
        for r in todo:
            if r not in self._pending:
                raise RuntimeError(
                    f"Sampler: row {r} samples with penalties but reset_row({r}, ...) was never called"
                )
            prompt, output = self._pending.pop(r)
            pr += [r] * len(prompt)
            pt += prompt
            orow += [r] * len(output)
            ot += output
            self._ready.add(r)
        counts, mask = self.counts, self.prompt_mask
        assert counts is not None and mask is not None
        idx = _h2d(todo, torch.int64, self.device)
        counts[idx] = 0
        mask[idx] = False
        if pt:
            t = _h2d([pr, pt], torch.int64, self.device)
            mask[t[0], t[1]] = True
        if ot:
            t = _h2d([orow, ot], torch.int64, self.device)
            counts.index_put_((t[0], t[1]), torch.ones_like(t[0], dtype=torch.int32), accumulate=True)

    # --------------------------------------------------------------------------- sample
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
        """logits: [>= B, >= V] (float32, or cast to it); rows past B and columns past V are ignored."""
        B, V = batch.size, self.vocab_size
        raw = logits if logits.shape == (B, V) else logits[:B, :V]  # raw: [B, V]
        if raw.dtype != torch.float32:
            raw = raw.float()
        top = None
        if batch.num_logprobs is not None:
            lp = torch.log_softmax(raw, dim=-1)  # [B, V]
            top = lp.topk(min(batch.num_logprobs, V), dim=-1)  # [B, N]
        x = raw
        if batch.use_penalties:
            x = self.penalize(x, batch)
        if batch.ban is not None:
            x = x.index_put(batch.ban, x.new_full((1,), float("-inf")))
        if batch.all_greedy:
            next_ids = _greedy(x)
        else:
            sampled = gumbel_argmax(self.filter_logits(x, batch), batch.keys)
            next_ids = torch.where(batch.greedy, _greedy(x), sampled) if batch.any_greedy else sampled
        out = SampleOutput(next_ids=next_ids)
        if top is not None:
            out.top_logprobs, out.top_ids = top
            out.logprobs = lp.gather(1, next_ids[:, None]).squeeze(1)
        return out

    def penalize(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Repetition (prompt + generated), frequency and presence (generated) penalties.
        x: [B, V] f32 -> new [B, V] f32. Rows without penalties come back unchanged."""
        self._materialize(batch.row_list)
        assert self.counts is not None and self.prompt_mask is not None  # made by _materialize
        counts = self.counts[batch.rows]  # [B, V] int32
        seen = self.prompt_mask[batch.rows] | (counts > 0)  # [B, V] bool
        x = torch.where(seen, torch.where(x > 0, x / batch.rep, x * batch.rep), x)
        c = counts.float()
        return x - batch.freq * c - batch.pres * (c > 0).float()

    filter_logits = staticmethod(filter_logits)  # (a pure function: runtime/speculative.py calls it too)
