"""Drafts from an EAGLE-3 head compiled into the artifact (``kiln compile TARGET --eagle3 HEAD``;
docs/speculative.md section 4): the draft source of ``--speculative draft`` (``auto``) on an artifact
whose ``manifest.draft.kind`` is ``"eagle3"``, and likewise of one whose draft is a DeepSeek-V3 MTP
layer (``kiln compile TARGET --mtp``, kind ``"mtp"``): its graphs keep the same protocol over one
stream, the target's last decoder layer output (``manifest.aux_layers == (L,)``, ``3 H`` below
reads ``H``), which its graph puts through the target's final norm where an EAGLE-3 head fuses
its three through ``fc``.

The head is one decoder layer with its own one-layer KV pool (as many slots as the target's,
addressed through the target's block table, as a draft model's). Its position ``p`` reads token
``x[p + 1]`` and a hidden state for position ``p``: the target's residual streams at three layers
(``manifest.aux_layers``, ``[3 H]`` per token, which every target graph writes into the target
runner's aux buffer; the head's ``model`` graph fuses them through ``fc``), or in a chain of drafts
the head's own output at ``p - 1`` (its ``decode_b{b}`` graphs). Its logits at ``p`` are over the
target's ids (``-inf`` outside the draft vocabulary) and predict ``x[p + 2]``. The head's graphs read
and write one buffer, :attr:`Eagle3Drafter.hidden` (``[rows, W]`` float32: its first ``3 H_target``
columns the fused input, its first ``H`` columns the head's output, written after every read).

Protocol, per request (``rid``), with ``done[rid]`` the head positions below which its K/V are
right, and a ring of the target's streams at the request's newest positions that the head has not
consumed yet (:attr:`store`, ``[rows, depth, 3 H]``, ``depth = k + 1``):

* every target step hands its streams over (:meth:`harvest`, right after the step's launch, in
  stream order before the next step can overwrite the target's buffer); an extend step (prefill
  chunks, mixed steps) is also run on the head at once (:meth:`mirror`): the chunk's positions
  ``lo .. hi - 2``, after the ring's from ``done`` up to ``lo - 1``, leaving position ``hi - 1`` in
  the ring: its token ``x[hi]`` is not known yet;
* a verify step (:meth:`propose`) catches the head up on the positions the ring holds from ``done``
  to ``s - 2`` (``s``: the request's length; one head extend, from the ring, on the head's ``(B,
  k)`` verify graph where one holds it), whose last logits give draft 1 and whose last output starts
  the chain; draft ``i + 1`` is the head's decode step at position ``s - 2 + i`` on draft ``i`` and
  its own previous output (CUDA graphs, chained on the device; the drafts stay there for the verify
  step);
* with draft trees (:meth:`propose_tree`, ``--draft-branches`` > 1) the same catch-up gives the
  root's candidates, and each further depth is one run of the head's tree graph over the request's
  expanded nodes (node ``j`` of depth ``d`` at position ``s - 2 + d``, its K/V in the slot of
  position ``s - 1 + j``, seeing the head's K/V below ``s - 1`` and its ancestors) on its parent's
  output; the slots lie inside the pages reserved for the target's tree;
* after the verify step (:meth:`accepted`), ``done = s - 1``: the drafts' positions were computed
  from the head's own outputs, so the next catch-up redoes them from the target's streams of the
  accepted tokens, which :meth:`harvest` puts in the ring (a tree step's from its accepted path's
  rows).

Positions that fell out of the ring before the head consumed them (plain decode steps above the
verify batches, more than ``depth`` of them in a row) keep stale head K/V: fewer drafts accepted,
never a wrong token (the target verifies every draft).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kiln.runtime.kv_pool import BlockTable, KVPool
from kiln.runtime.loader import LoadedModel
from kiln.runtime.model_runner import StepInputs, run_extend_graph
from kiln.runtime.spec_draft import DraftModel
from kiln.runtime.spec_tree import TreeDraft, TreeSearch
from kiln.runtime.staging import HostStager

if TYPE_CHECKING:
    from kiln.runtime.request import Req
    from kiln.runtime.scheduler import Scheduler


class Eagle3Drafter(DraftModel):
    """The EAGLE-3 (or MTP) draft source (module docstring) over the head's runner and the target's
    aux buffer ``target_hidden`` (``ModelRunner.aux_args[0]``: ``[rows, 3 H]``, MTP ``[rows, H]``)."""

    SHIFT = 1  # a chain step feeds draft i at position start - 2 + i

    def __init__(
        self,
        model: LoadedModel,
        pool: KVPool,
        block_table: BlockTable,
        num_draft_tokens: int,
        target_vocab: int,
        cuda_graph: bool,
        target_hidden: torch.Tensor,
        stager: HostStager,
        eos_token_ids: tuple[int, ...] = (),
        branches: int = 1,
    ):
        # the head's buffer holds an eager catch-up of up to k + 1 positions per request (the runner
        # sizes it for its verify graphs' padded catch-ups too)
        rows = max(model.artifact.manifest.decode_buckets) * (num_draft_tokens + 1)
        super().__init__(
            model, pool, block_table, num_draft_tokens, target_vocab, cuda_graph, eos_token_ids, aux_rows=rows
        )
        (self.hidden,) = self.runner.aux_args  # the head graphs' input and output
        self.width = target_hidden.shape[1]  # 3 H of the target (MTP: H): the fused input
        if self.hidden.shape[1] < self.width:
            raise ValueError(
                f"the draft head reads {self.hidden.shape[1]} hidden columns, the target hands out "
                f"{self.width}; recompile the artifact with --eagle3 or --mtp"
            )
        self.target_hidden = target_hidden
        self.hidden_size = int(model.artifact.manifest.model["hidden_size"])  # the head's output columns
        self.stager = stager
        self.depth = num_draft_tokens + 1  # a verify step's accepted positions
        rows = block_table.num_rows
        self.store = torch.zeros(rows * self.depth, self.width, dtype=torch.float32, device=self.device)
        # rid -> (block-table row, lo, hi): the ring holds the target's streams at positions [lo, hi)
        self.held: dict[str, tuple[int, int, int]] = {}
        self.branches = branches  # a draft tree's width (:meth:`propose_tree`; 1: chains)
        self.tree_rows = 0  # tokens the head's tree steps ran

    def forget(self, rid: str) -> None:
        super().forget(rid)
        self.held.pop(rid, None)

    # ------------------------------------------------------------------ the ring
    def _ring(self, row: int, pos: int) -> int:
        return row * self.depth + pos % self.depth

    def _held(self, req: Req) -> tuple[int, int]:
        """The positions ``[lo, hi)`` whose target streams the ring holds for ``req``."""
        row, lo, hi = self.held.get(req.rid, (req.row, 0, 0))
        return (lo, hi) if row == req.row else (0, 0)

    def _keep(self, req: Req, lo: int, rows: Sequence[int], src: list[int], dst: list[int]) -> None:
        """Plan the ring's copies of positions ``lo, lo + 1, ..`` of ``req``, whose streams are at
        target rows ``rows``: the ring's range grows (or restarts after a gap)."""
        hi = lo + len(rows)
        if hi <= lo:
            return
        held_lo, held_hi = self._held(req)
        if held_hi != lo:
            held_lo = lo
        keep = max(lo, hi - self.depth)
        src += rows[keep - lo :]
        dst += (self._ring(req.row, p) for p in range(keep, hi))
        self.held[req.rid] = (req.row, max(held_lo, hi - self.depth), hi)

    def _copy(self, out: torch.Tensor, dst: list[int], src_t: torch.Tensor, src: list[int]) -> None:
        """``out[dst] = src_t[src]`` (rows), its index lists staged to the device in one copy."""
        if dst:
            idx = self.stager.to_device([dst, src], torch.int64)
            out.index_copy_(0, idx[0], src_t.index_select(0, idx[1]))

    def harvest(self, reqs: list[Req], positions: list[int], rows: list[Sequence[int]]) -> None:
        """Put the target's streams of request ``b``'s positions ``positions[b] ..`` (at the target
        buffer's rows ``rows[b]``, one per position) into the ring: a plain decode step's (one
        each), a verify step's accepted ones (a tree step's: the rows of its accepted path)."""
        src: list[int] = []
        dst: list[int] = []
        for req, p, r in zip(reqs, positions, rows):
            self._keep(req, p, r, src, dst)
        self._copy(self.store, dst, self.target_hidden, src)

    # ------------------------------------------------------------------ prefill
    def mirror(self, step: StepInputs, reqs: list[Req]) -> None:
        """Run the target's extend ``step`` (of ``reqs``) on the head: each chunk's positions
        ``lo .. hi - 2``, after those the ring holds from ``done`` up to ``lo - 1``; then position
        ``hi - 1`` into the ring (module docstring)."""
        assert step.extend_lens is not None
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        rows, lens, indptr = [], [], [0]
        from_ring: list[int] = []
        ring_rows: list[int] = []
        from_target: list[int] = []
        target_rows: list[int] = []
        keep_src: list[int] = []
        keep_dst: list[int] = []
        first = 0  # the chunk's first target row
        for req, hi, n in zip(reqs, step.seq_lens, step.extend_lens):
            lo = hi - n
            held_lo, held_hi = self._held(req)
            # the ring's positions the head has not run, when they lead up to the chunk (a first
            # chunk of one token leaves its position in the ring and nothing done)
            start = min(max(self.done.get(req.rid, held_lo), held_lo), lo) if held_hi == lo else lo
            if hi - 1 > start:
                t = len(ids)
                ids += req.token_view[start + 1 : hi]
                pos += range(start, hi - 1)
                slots += self.bt.slots(req.row, start, hi - 1)
                from_ring += range(t, t + lo - start)
                ring_rows += (self._ring(req.row, p) for p in range(start, lo))
                t += lo - start
                from_target += range(t, t + hi - 1 - lo)
                target_rows += range(first, first + hi - 1 - lo)
                rows.append(req.row)
                lens.append(hi - 1)
                indptr.append(len(ids))
                self.done[req.rid] = hi - 1
            self._keep(req, hi - 1, [first + n - 1], keep_src, keep_dst)
            first += n
        if ids:
            self._copy(self.hidden[:, : self.width], from_ring, self.store, ring_rows)
            self._copy(self.hidden[:, : self.width], from_target, self.target_hidden, target_rows)
            run_extend_graph(
                self.runner.m, self.runner.pool, self.bt, ids, pos, slots, rows, lens, indptr,
                aux=self.runner.aux_args,
            )  # fmt: skip
        self._copy(self.store, keep_dst, self.target_hidden, keep_src)

    # ------------------------------------------------------------------ drafting
    def _catch_up(self, reqs: list[Req]) -> torch.Tensor:
        """One head extend over each request's positions from ``done`` to ``s - 2`` that the ring
        holds (the fused input from the ring); its logits ``[B, vocab]`` at each request's last
        position (zeros for a request with none), and its outputs there in the head's decode input
        rows ``0 .. B - 1`` (the chain's first hidden states). On the head's ``(B, k)`` verify graph
        where one holds the step (a replay on a GPU; request ``j``'s positions at buffer rows ``j (k
        + 1) ..``), else on its extend graph."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        ring_rows: list[int] = []
        rows, lens, ext, which = [], [], [], []
        for i, (req, s) in enumerate(zip(reqs, self._starts)):
            held_lo, held_hi = self._held(req)
            lo, hi = max(self.done.get(req.rid, 0), held_lo), min(s - 1, held_hi)
            if hi > lo:
                ids += req.token_view[lo + 1 : hi + 1]
                pos += range(lo, hi)
                slots += self.bt.slots(req.row, lo, hi)
                ring_rows += (self._ring(req.row, p) for p in range(lo, hi))
                rows.append(req.row)
                lens.append(hi)
                ext.append(hi - lo)
                which.append(i)
            self.done[req.rid] = s - 1
        logits = torch.zeros(len(reqs), self.vocab, device=self.device)
        if not ids:
            self.hidden[: len(reqs), : self.hidden_size].zero_()  # no last outputs: zeros, as for one
            return logits
        step = StepInputs("verify", ids, pos, slots, rows, lens, ext)
        shape = self.runner.verify_shape(step)
        fused = self.hidden[:, : self.width]
        if shape is not None:  # each request's positions padded to k + 1 rows
            k1 = shape[1] + 1
            self._copy(
                fused, [j * k1 + t for j, e in enumerate(ext) for t in range(e)], self.store, ring_rows
            )
            out = self.runner.verify(step)  # [n, P, V]
            first = self.runner.verify_rows()
            idx = self.stager.to_device(
                [which, [f + e - 1 for f, e in zip(first, ext)], range(len(ext)), [e - 1 for e in ext]],
                torch.int64,
            )
            last_logits = out[idx[2], idx[3]]
        else:
            self._copy(fused, list(range(len(ids))), self.store, ring_rows)
            indptr = [0, *itertools.accumulate(ext)]
            out = run_extend_graph(
                self.runner.m, self.runner.pool, self.bt, ids, pos, slots, rows, lens, indptr,
                aux=self.runner.aux_args,
            )  # fmt: skip
            idx = self.stager.to_device([which, [e - 1 for e in indptr[1:]]], torch.int64)
            last_logits = out
        self.caught_up += len(ids)
        logits.index_copy_(0, idx[0], last_logits[:, : self.vocab].float())
        h = self.hidden[:, : self.hidden_size]
        last = h.index_select(0, idx[1])  # a copy: the chain's rows may overlap the catch-up's
        h[: len(reqs)].zero_()
        h.index_copy_(0, idx[0], last)
        return logits

    def propose_tree(self, reqs: list[Req], limits: list[int], sched: Scheduler) -> list[TreeDraft]:
        """A draft tree per request of ``min(k, limits[i])`` nodes (fewer where its pages cannot grow,
        :meth:`Scheduler.reserve_drafts`), searched as EAGLE-2 does
        (:class:`~kiln.runtime.spec_tree.TreeSearch`, ``width`` = :attr:`branches`): the catch-up's
        top tokens, then per depth one run of the head's tree graph over each request's expanded
        nodes (:meth:`_tree_step`) whose newest ones offer their top tokens. Every node is a point
        mass, a sampling request's too (lossless by the tree's point-mass rule; the ``q`` rule of
        :meth:`propose`'s sampled chains is not used). One host sync per depth (the search runs on
        the host)."""
        want = [[0] * max(0, min(self.k, lim)) for lim in limits]
        counts = [len(d) for d in sched.reserve_drafts(reqs, want)]
        self._starts = [r.seq_len for r in reqs]
        self.probs = None
        searches = [TreeSearch(c, self.branches) for c in counts]
        live = [i for i, c in enumerate(counts) if c > 0]
        if not live:
            return [TreeDraft((), ()) for _ in reqs]
        logits = self._catch_up(reqs)
        # each request's head output at s - 2 (the catch-up's last): its depth-1 nodes' input
        roots = self.hidden[: len(reqs), : self.hidden_size].clone()
        prev = (roots, [0] * len(reqs))  # the inputs' source rows, each request's first there
        rows = live
        while rows:
            top = logits.index_select(0, self.stager.to_device(rows, torch.int64))[:, : self.vocab]
            lp, ids = torch.log_softmax(top.float(), -1).topk(self.branches, -1)
            lp_h, ids_h = lp.tolist(), ids.tolist()
            at = 0
            for i in live:  # the rows of its frontier (of the root at first), in order
                n = len(searches[i].frontier) or 1
                searches[i].offer(ids_h[at : at + n], lp_h[at : at + n])
                at += n
            live = [i for i in live if searches[i].frontier]
            if not live:
                break
            logits, prev, rows = self._tree_step(reqs, searches, live, roots, prev)
        return [s.tree() for s in searches]

    def _tree_step(
        self,
        reqs: list[Req],
        searches: list[TreeSearch],
        live: list[int],
        roots: torch.Tensor,
        prev: tuple[torch.Tensor, list[int]],
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, list[int]], list[int]]:
        """One run of the head's tree graph over the expanded nodes of the requests ``live``: node
        ``j`` of request ``i`` (token, parent, depth from :meth:`TreeSearch.chunk`) at position
        ``s - 2 + depth``, its K/V in the slot of position ``s - 1 + j``, seeing the head's K/V
        below ``s - 1`` and its ancestors (``tree_mask``), on its parent's output (``roots[i]`` at
        depth 1, else the previous run's row ``prev[1][i] + parent``). Returns the logits, the run's
        outputs with each request's first row there, and the logits rows of the frontier nodes."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        masks: list[int] = []
        src: list[int] = []
        rows, lens, indptr, first = [], [], [0], [0] * len(reqs)
        frontier: list[int] = []
        for i in live:
            req, s = reqs[i], self._starts[i]
            toks, parents, depths = searches[i].chunk()
            first[i] = t = len(ids)
            ids += toks
            pos += (s - 2 + d for d in depths)
            slots += self.bt.slots(req.row, s - 1, s - 1 + len(toks))
            for j, p in enumerate(parents):
                masks.append((1 << j) | (masks[t + p] if p >= 0 else 0))
                src.append(i if p < 0 else len(roots) + prev[1][i] + p)
            frontier += (t + f for f in searches[i].frontier)
            rows.append(req.row)
            lens.append(s - 1 + len(toks))
            indptr.append(len(ids))
        h = self.hidden[:, : self.hidden_size]
        self._copy(h, list(range(len(ids))), torch.cat([roots, prev[0]]), src)
        logits = run_extend_graph(
            self.runner.m, self.runner.pool, self.bt, ids, pos, slots, rows, lens, indptr,
            every_token=True, aux=self.runner.aux_args, tree_mask=masks,
        )  # fmt: skip
        self.tree_rows += len(ids)
        return logits, (h[: len(ids)].clone(), first), frontier

    def accepted(self, reqs: list[Req], drafts: list[list[int]], num_emitted: list[int]) -> None:
        """After the verify step of :meth:`propose`'s (or :meth:`propose_tree`'s) drafts: the head's
        K/V are right below ``s - 1`` (the drafts' positions are redone from the target's streams);
        the target's streams of each request's newest token and accepted drafts go into the ring,
        from the rows the verify step wrote (:attr:`ModelRunner.verify_rows`), by :meth:`harvest`."""
        for req, s in zip(reqs, self._starts):
            self.done[req.rid] = s - 1
