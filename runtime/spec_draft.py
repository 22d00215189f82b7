"""Drafts from a draft model compiled into the artifact (``kiln compile --draft-model``;
docs/speculative.md section 4): the draft source of ``--speculative draft`` (``auto`` on an artifact
that has one).

The draft is a second :class:`~kiln.runtime.loader.LoadedModel` with its own KV pool of as many
slots as the target's, addressed through the target's block table: a request's page holds its
target K/V in one pool and its draft K/V in the other, so allocation, the prefix cache and
retraction need nothing new. Protocol, per request (``rid``), with ``done[rid]`` the positions below
which the draft's K/V are the request's tokens:

* every extend step of the target (prefill chunks, mixed steps) runs on the draft too, on the same
  :class:`~kiln.runtime.model_runner.StepInputs` (:meth:`DraftModel.mirror`): the chunk's draft K/V;
  a request new to the draft takes what its prefix-cache hit left in the draft pool as its own;
* a verify step first reserves the target's pages for ``k`` drafts, then
  (:meth:`DraftModel.propose`) runs one draft extend over the tokens the draft has not seen (after
  the last verify step: the bonus token, or the last draft and the bonus token; after plain decode
  steps: those tokens) whose last logits give draft 1, then ``k - 1`` draft decode steps feeding
  each draft back; the ids stay on the device (:class:`DeviceDrafts`), where the verify step's
  inputs take them. Over the ids both vocabularies have, a greedy request's drafts are the draft's
  argmax; a sampling request's are sampled from the draft's distribution ``q`` under the request's
  own temperature / top-k / top-p / min-p (and min_tokens bans), with noise from its
  ``DRAFT_STREAM`` keys, and ``q`` is kept (:attr:`DraftModel.probs`) for the rejection rule
  (:func:`~kiln.runtime.speculative.rejection_sample`): lossless, and a draft close to the target is
  accepted about as often as it agrees in distribution, not only where its sample hits the target's;
* after the verify step (:meth:`DraftModel.accepted`), with ``a`` of a request's ``n`` drafts accepted,
  its draft K/V are right up to position ``s - 1 + min(a, n - 1)`` (``s``: its length before the
  step): the drafts the draft itself fed were the accepted tokens.

Whatever the draft's K/V hold, the output is the target's: a stale draft page (a prefix-cache page
whose last tokens no draft step saw) costs acceptance, never correctness.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kiln import artifact_format as fmt
from kiln.artifact_format import RECOPY, ArtifactError
from kiln.kernel_cache import use_kernel_cache, user_cache_dir
from kiln.manifest import Manifest
from kiln.ops.sampling.gumbel import gumbel_argmax
from kiln.runtime.kv_pool import BlockTable, KVPool
from kiln.runtime.loader import LoadedModel, load_model
from kiln.runtime.model_runner import ModelRunner, StepInputs
from kiln.runtime.sampler import SamplingBatch, filter_logits
from kiln.runtime.speculative import DRAFT_STREAM, h2d, position_keys, stream_seeds

if TYPE_CHECKING:
    from kiln.runtime.request import Req
    from kiln.runtime.scheduler import Scheduler


@dataclasses.dataclass(frozen=True)
class DeviceDrafts:
    """A draft chain per request, on the device: request ``b``'s drafts are ``ids[b, :counts[b]]``
    (``ids [B, max(counts)]`` int64; columns past a request's count hold whatever its chain step
    picked there, never verified). The counts are on the host (the scheduler reserved their pages)."""

    ids: torch.Tensor
    counts: list[int]

    def placeholders(self) -> list[list[int]]:
        """Host lists of the right lengths whose token values are not known (0): the verify step's
        layout, its draft ids taken from :attr:`ids` on the device."""
        return [[0] * c for c in self.counts]

    def lists(self) -> list[list[int]]:
        """The drafts on the host (waits for the chain)."""
        host = self.ids.tolist()
        return [row[:c] for row, c in zip(host, self.counts)]


def load_draft(
    target: LoadedModel,
    device: torch.device,
    verify: bool,
    graph_format: str | None,
    kernel_cache_dir: str | Path | None = None,
) -> LoadedModel:
    """The target artifact's draft model, loaded (its files checked by its own manifest); refuses
    one that is not the draft the target was compiled with, or whose page size differs."""
    spec = target.artifact.manifest.draft
    assert spec is not None
    root = target.artifact.root / spec.path
    m = Manifest.load(root)  # its own self-hash first
    recorded = m.document()[fmt.MANIFEST_HASH_KEY]
    if recorded != spec.manifest_xxh3_128:
        raise ArtifactError(
            f"the draft model under {root} is not the one this artifact was compiled with (manifest hash "
            f"{recorded}, 'draft.manifest_xxh3_128' is {spec.manifest_xxh3_128}); {RECOPY}."
        )
    if m.kv.page_size != target.artifact.manifest.kv.page_size:
        raise ArtifactError(f"the draft model under {root} has another KV page size; {RECOPY}.")
    draft = load_model(
        str(root), device, verify=verify, graph_format=graph_format, kernel_cache_dir=kernel_cache_dir
    )
    # both artifacts' kernels: the draft's load pointed the cache at its own only
    kernels = (target.artifact.root / "kernels", root / "kernels")
    use_kernel_cache(write=Path(kernel_cache_dir or user_cache_dir()), read=kernels)
    return draft


class DraftModel:
    """The draft source (module docstring): the draft's runner over its own pool and the target's
    block table, and each request's drafted-up-to position."""

    def __init__(
        self,
        model: LoadedModel,
        pool: KVPool,
        block_table: BlockTable,
        num_draft_tokens: int,
        target_vocab: int,
        cuda_graph: bool,
        eos_token_ids: tuple[int, ...] = (),
        aux_rows: int = 0,
    ):
        # with the artifact's verify graphs, where its compile gave it some: the catch-up runs there
        self.runner = ModelRunner(
            model, pool, block_table, cuda_graph=cuda_graph, graph_greedy=False, aux_rows=aux_rows,
            num_draft_tokens=num_draft_tokens,
            prefill_graphs=False,  # _catch_up keeps rows of several extend steps' logits at once
        )  # fmt: skip
        self.bt = block_table
        self.k = num_draft_tokens
        self.vocab = min(target_vocab, model.artifact.manifest.vocab_size)  # ids both heads have
        self.chunk = model.artifact.manifest.chunk_size
        self.done: dict[str, int] = {}
        self._starts: list[int] = []  # each request's length when its drafts were made
        self.caught_up = 0  # tokens the draft's catch-up extends ran (1-2 per request and verify step)
        self.target_vocab = target_vocab
        self.eos_token_ids = eos_token_ids
        # [B, n, target_vocab] float32: q of each draft of the last propose (None: all greedy)
        self.probs: torch.Tensor | None = None
        self.device = model.device

    def forget(self, rid: str) -> None:
        self.done.pop(rid, None)

    # ------------------------------------------------------------------ prefill
    def mirror(self, step: StepInputs, reqs: list[Req]) -> None:
        """Run the target's extend ``step`` (of ``reqs``) on the draft: their chunks' draft K/V."""
        assert step.extend_lens is not None
        self.runner.extend(step)
        for req, end, n in zip(reqs, step.seq_lens, step.extend_lens):
            if self.done.get(req.rid, end - n) >= end - n:  # contiguous (or new: trust the cache)
                self.done[req.rid] = end

    # ------------------------------------------------------------------ drafting
    # A draft decode step feeds draft i at position ``start - SHIFT + i`` (``start``: the request's
    # length when its drafts are made): 0 for a draft model, whose catch-up ends at the newest
    # token; 1 for an EAGLE-3 head, whose position p reads token p + 1 (runtime/spec_eagle.py).
    SHIFT = 0

    def propose(self, reqs: list[Req], limits: list[int], sched: Scheduler) -> DeviceDrafts:
        """Up to ``min(k, limits[i])`` drafts per request, with the target's pages reserved for them
        (:meth:`Scheduler.reserve_drafts`: a request whose pages cannot grow drafts less), left on
        the device: the verify step takes them from there (no host read between the draft chain
        and the verify step)."""
        want = [[0] * max(0, min(self.k, lim)) for lim in limits]
        counts = [len(d) for d in sched.reserve_drafts(reqs, want)]
        self._starts = [r.seq_len for r in reqs]
        self.probs = None
        n = max(counts, default=0)
        if n == 0:
            return DeviceDrafts(torch.zeros(len(reqs), 0, dtype=torch.int64, device=self.device), counts)
        ids = torch.empty(len(reqs), n, dtype=torch.int64, device=self.device)
        pick = self._picker(reqs, n)
        ids[:, 0] = pick(0, self._catch_up(reqs))
        for i in range(1, n):  # draft i + 1 from draft i
            ids[:, i] = pick(
                i, self.runner.decode(self._chain_step(reqs, counts, i), subst=(None, ids[:, i - 1]))
            )
        return DeviceDrafts(ids, counts)

    def _chain_step(self, reqs: list[Req], counts: list[int], i: int) -> StepInputs:
        """The draft decode step that feeds each request's draft ``i`` (its ids substituted on the
        device) for draft ``i + 1``: request ``j`` at position ``start - SHIFT + i`` while ``i <
        counts[j]`` (its K/V in a reserved slot), else a row that writes the sink slot."""
        pos, slots, lens = [], [], []
        for req, s, c in zip(reqs, self._starts, counts):
            live = i < c  # its K/V lands in a reserved slot and its next draft is wanted
            p = s - 1 - self.SHIFT + (i if live else 0)
            pos.append(p)
            slots.append(self.bt.slots(req.row, p, p + 1)[0] if live else 0)
            lens.append(p + 1)
        return StepInputs("decode", [0] * len(reqs), pos, slots, [r.row for r in reqs], lens)

    def _picker(self, reqs: list[Req], n: int) -> Callable[[int, torch.Tensor], torch.Tensor]:
        """``pick(i, logits [B, >= vocab])``: draft ``i + 1`` of each request (module docstring:
        argmax for greedy requests, else a sample from the filtered ``q``, kept in :attr:`probs`)."""
        params = [r.params for r in reqs]
        if SamplingBatch.plain_greedy(params):
            return lambda i, logits: logits[:, : self.vocab].float().argmax(-1)
        self.probs = probs = torch.zeros(len(reqs), n, self.target_vocab, device=self.device)
        seeds = stream_seeds([r.seed for r in reqs], DRAFT_STREAM)
        steps = [len(r.output_ids) for r in reqs]
        rows = [r.row for r in reqs]
        eos = self.eos_token_ids
        base = SamplingBatch.build(params, rows, self.device, seeds=seeds, steps=steps, eos_token_ids=eos)
        # every draft position's noise keys in one copy; only min_tokens bans change with the
        # position (then the batch is built per position)
        pk = np.ascontiguousarray(position_keys(seeds, steps, n).transpose(1, 0, 2))
        keys = h2d(torch.from_numpy(pk), self.device, None)  # [n, B, 2]: position i's keys contiguous
        banning = any(p.min_tokens > t for p, t in zip(params, steps))

        def pick(i: int, logits: torch.Tensor) -> torch.Tensor:
            x = logits[:, : self.vocab].float()
            if banning:
                steps_i = [t + i for t in steps]
                sb = SamplingBatch.build(
                    params, rows, self.device, seeds=seeds, steps=steps_i, eos_token_ids=eos
                )
            else:
                sb = dataclasses.replace(base, keys=keys[i])
            if sb.ban is not None:
                x = x.index_put(sb.ban, x.new_full((1,), float("-inf")))
            filt = filter_logits(x, sb)
            tok = torch.where(sb.greedy, x.argmax(-1), gumbel_argmax(filt, sb.keys))
            probs[:, i, : self.vocab] = torch.softmax(filt, dim=-1)
            return tok

        return pick

    def _catch_up(self, reqs: list[Req]) -> torch.Tensor:
        """One draft extend (more when the backlog exceeds a chunk) over each request's tokens the
        draft has not seen, up to and including its newest; the draft's logits ``[B, vocab]`` there.
        One token each runs on the decode graphs (``ModelRunner.extend``); a few each (after a
        verify step that accepted every draft: the last draft and the bonus token) on the draft's
        verify graph where one holds them (a replay on a GPU); else the extend graph."""
        todo = [
            (i, min(self.done.get(r.rid, 0), s - 1), s) for i, (r, s) in enumerate(zip(reqs, self._starts))
        ]
        lengths = self.runner.verify_lengths
        if lengths and 1 < max(s - lo for _, lo, s in todo) <= lengths[-1] + 1:
            logits = self._catch_up_verify(reqs, todo)
            if logits is not None:
                return logits
        last: list[torch.Tensor | None] = [None] * len(reqs)
        per = max(1, self.chunk // len(reqs))
        while todo:
            ids: list[int] = []
            pos: list[int] = []
            slots: list[int] = []
            rows, lens, ext, which = [], [], [], []
            left = []
            for i, lo, s in todo:
                hi = min(s, lo + per)
                req = reqs[i]
                ids += req.token_view[lo:hi]
                pos += range(lo, hi)
                slots += self.bt.slots(req.row, lo, hi)
                rows.append(req.row)
                lens.append(hi)
                ext.append(hi - lo)
                which.append(i)
                if hi < s:
                    left.append((i, hi, s))
            logits = self.runner.extend(StepInputs("extend", ids, pos, slots, rows, lens, ext))
            self.caught_up += len(ids)
            for j, i in enumerate(which):
                last[i] = logits[j, : self.vocab]
            todo = left
        for r, s in zip(reqs, self._starts):
            self.done[r.rid] = s
        return torch.stack([x for x in last if x is not None])

    def _catch_up_verify(self, reqs: list[Req], todo: list[tuple[int, int, int]]) -> torch.Tensor | None:
        """:meth:`_catch_up` on the draft's ``(B, k)`` verify graph (request ``i``'s tokens ``lo ..
        s - 1`` padded to ``k + 1``), or None (nothing changed) when none holds the step."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for i, lo, s in todo:
            ids += reqs[i].token_view[lo:s]
            pos += range(lo, s)
            slots += self.bt.slots(reqs[i].row, lo, s)
        lens = [s for _, _, s in todo]
        ext = [s - lo for _, lo, s in todo]
        step = StepInputs("verify", ids, pos, slots, [r.row for r in reqs], lens, ext)
        if self.runner.verify_shape(step) is None:
            return None
        out = self.runner.verify(step)  # [B, P, V]
        self.caught_up += len(ids)
        for r, s in zip(reqs, self._starts):
            self.done[r.rid] = s
        idx = h2d(torch.tensor([list(range(len(ext))), [e - 1 for e in ext]]), self.device, None)
        return out[idx[0], idx[1], : self.vocab]

    def accepted(self, reqs: list[Req], drafts: list[list[int]], num_emitted: list[int]) -> None:
        """After the verify step of :meth:`propose`'s drafts: each request's draft K/V are right up
        to the drafts it fed that were accepted (module docstring)."""
        for req, s, d, e in zip(reqs, self._starts, drafts, num_emitted):
            self.done[req.rid] = s + min(e - 1, max(len(d) - 1, 0))
