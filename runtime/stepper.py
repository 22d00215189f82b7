"""Launching a step on the device and finishing it on the host, with decode overlap.

A step is *launched* (inputs built, graph run, tokens sampled: all asynchronous) and later
*finished* (sampled ids read back, stop conditions, text). Launching appends a placeholder token
to every request that sampled, so the scheduler can form the next decode step before the ids are
known: its input ids are then taken on the device from the previous step's sampled ids.

With overlap on, a decode step is launched before the previous one is finished, so the host work
of finishing (detokenizing, stop checks) and of forming the next step runs while the GPU computes.
Overlap is used only between pure decode steps with enough free KV pages (no admission, no
retraction); anything else finishes the step in flight first. A request that finishes in the step
being finished was already included in the next launched step: that extra token is discarded.

Speculative decoding (``StepParts.spec``; docs/speculative.md): a scheduled decode step with drafts
runs as a *verify* step instead (:meth:`Stepper._verify_step`): each request's newest token and its
drafts (n-gram or the draft model's) through a verify graph or the extend graph, logits at every new
token; :func:`~kiln.runtime.speculative.verify` picks 1..k+1 tokens per request, and the step is
finished at once. Its pages come from ``Scheduler.reserve_drafts``; the engine applies the tokens
(``Launched.host["num_emitted"]``). Drafting needs the tokens on the host, so decode steps overlap
only where they cannot verify: batches above the artifact's verify graphs (:meth:`Stepper._overlaps`).
With n-gram drafts the measured policy (``SpecParts.policy``, runtime/spec_policy.py) decides which
of the others verify, from their wall times; with a draft model or head every one does.

Token trees (``SpecParts.trees``: ``draft_branches`` > 1 on an artifact with the tree graph; at
tp > 1 the accepted path's K/V moves run on every rank, ``BroadcastRunner.move_kv``):
the n-gram drafter proposes a tree per request (runtime/spec_tree.py ``ngram_tree``), an EAGLE-3 head
or MTP layer a tree it searched (``TreeSearch``, :meth:`Eagle3Drafter.propose_tree`); a step in
which some tree branches runs every request's tree (chains as chain-shaped trees) on the tree graph
(its (B, k) CUDA graph where one holds the step; positions ``kv_len + depth``, slots ``kv_len +
node``, ``tree_mask``), picks the tokens
with :func:`~kiln.runtime.spec_tree.verify_tree` and moves the accepted path's K/V to ``kv_len + d``
(:meth:`Stepper._move_accepted`) before the engine applies them as for chains (the head gets the
target's streams of the accepted path's rows); a step whose trees are all chains runs as a chain
step (the verify graphs; the same tokens).

The stepper sees its engine only through :class:`StepParts` (the scheduler, the model runner, the
sampler, the host stager, the EOS ids, the shared counters and the ``outputs`` callback that turns a
finished step's tokens into the step's ``RequestOutput`` list); the engine builds it.
It keeps the host-time accounting of the steps itself (:attr:`Stepper.host_breakdown`) and the
per-kind step figures (:attr:`Stepper.step_stats`, runtime/step_stats.py: each step counted when
launched, each ``step()`` call timed).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.runtime.grammar import mask_logits
from kiln.runtime.model_runner import ModelRunner
from kiln.runtime.request import Req, RequestOutput
from kiln.runtime.sampler import SampleOutput, Sampler, SamplingBatch
from kiln.runtime.scheduler import ScheduledBatch, Scheduler
from kiln.runtime.spec_draft import DraftModel
from kiln.runtime.spec_eagle import Eagle3Drafter
from kiln.runtime.spec_policy import SpecPolicy
from kiln.runtime.spec_tree import (
    TreeBatch,
    TreeDraft,
    TreeSampling,
    TreeVerifyOutput,
    branching,
    compact_moves,
    verify_tree,
)
from kiln.runtime.speculative import (
    AcceptanceStats,
    DraftBatch,
    NgramDrafter,
    SpecSampling,
    VerifyOutput,
    speculation_blocker,
    verify,
)
from kiln.runtime.staging import HostStager
from kiln.runtime.step_stats import StepStats

PLACEHOLDER = -1  # an output token sampled on the device, not read back yet


@dataclass
class Launched:
    """A step whose sampled tokens are (possibly) still on the device."""

    batch: ScheduledBatch
    reqs: list[Req]  # requests that sampled a token this step
    index: list[int]  # where each token goes in its request's output_ids (a placeholder now)
    ids: torch.Tensor  # [n] int64 on the device
    host: dict[str, torch.Tensor] = field(default_factory=dict)  # host copies (pinned on CUDA)
    event: Any = None  # CUDA event after the host copies, None on CPU
    host_s: float = 0.0  # host seconds spent launching
    greedy: SamplingBatch | None = None  # the step's batch when plain greedy (argmax only)
    kind: int = 0  # step_stats kind (PREFILL, DECODE, MIXED)

    def position(self) -> dict[str, int]:
        return {r.rid: j for j, r in enumerate(self.reqs)}


@dataclass(frozen=True)
class SpecParts:
    """Speculative decoding's parts (docs/speculative.md): the n-gram drafter (one history per
    request id; the engine forgets a request when it ends) and the acceptance sums."""

    drafter: NgramDrafter | DraftModel  # drafts from the request's tokens, or from the draft model
    stats: AcceptanceStats
    max_batch: int | None = None  # larger decode steps decode plainly (the artifact's verify buckets)
    trees: bool = False  # draft trees (n-gram, EAGLE-3 head; runtime/spec_tree.py) on the tree graph
    policy: SpecPolicy | None = None  # which decode steps speculate (None: every one with drafts)


@dataclass(frozen=True)
class StepParts:
    """What a :class:`Stepper` uses of its engine, handed over once when the engine is built.

    ``stats``: the engine's counters; the stepper adds ``steps`` and ``cached_tokens``.
    ``outputs(launched)``: called once the step's sampled tokens are on the host
    (``launched.host``); applies them to the requests (stop conditions, text) and returns the
    step's outputs."""

    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    stager: HostStager
    device: torch.device
    eos_token_ids: frozenset[int]
    stats: dict[str, int]
    outputs: Callable[[Launched], list[RequestOutput]]
    spec: SpecParts | None = None  # speculative decoding on: decode steps become verify steps


class Stepper:
    """Owns the launch/finish cycle of an engine's steps (module docstring)."""

    def __init__(self, parts: StepParts, overlap: bool):
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.sampler = parts.sampler
        self.stager = parts.stager
        self.device = parts.device
        self.eos_token_ids = tuple(sorted(parts.eos_token_ids))  # as SamplingBatch.build takes them
        self.stats = parts.stats
        self.outputs = parts.outputs
        self.spec = parts.spec
        self.overlap = overlap  # with speculation, only above the verify batches (_overlaps)
        self.inflight: Launched | None = None
        self.overlapped = 0  # decode steps launched while the previous one was in flight
        self.last_step_mode = ""
        # Cumulative seconds per part of a step. Host work: "schedule" (the scheduler, step inputs,
        # bookkeeping), "launch" (ModelRunner.forward), "sample", "outputs" (stop checks, text,
        # RequestOutputs); "wait" is the sync on the device. All but "wait" add up to the step's
        # host time (last_step_host_s).
        self.host_breakdown = dict.fromkeys(("schedule", "launch", "sample", "wait", "outputs"), 0.0)
        self.last_step_host_s = 0.0
        self.step_stats = StepStats()
        self.launched_kind = 0  # the step_stats kind of the step launched last
        # token-tree verify steps: steps, those with a branching tree, draft nodes verified, and
        # requests whose accepted nodes were not the first ones (their K/V moved)
        self.tree_stats = {"steps": 0, "branching": 0, "nodes": 0, "moved": 0}

    # ------------------------------------------------------------------ launching
    def launch(
        self, batch: ScheduledBatch, prev: Launched | None = None, sched_s: float = 0.0
    ) -> Launched | None:
        """Launch ``batch``; ``sched_s``: host seconds the scheduler spent forming it (counted
        in the step's host time and its "schedule" part)."""
        t0 = time.perf_counter()
        stats = self.stats
        stats["steps"] += 1
        self.last_step_mode = batch.mode
        n, k = len(batch.reqs), batch.decode_rows  # a mixed batch counts its decode rows apart
        if batch.mode == "decode":
            kind = self.step_stats.count(n, 0, n)
        else:
            kind = self.step_stats.count(n, sum(batch.extend_lens) - k, k)
        self.launched_kind = kind
        # Newly admitted (or resumed) requests get a fresh sampler row. Admission happens only in
        # extend steps, so a decode step's requests all went through here already.
        for req in batch.reqs if batch.mode != "decode" else ():
            if req.sampler_row != req.row:
                self.sampler.reset_row(req.row, req.prompt_ids, req.output_ids)
                req.sampler_row = req.row
                if req.kv_len == req.cached_len and not req.num_preemptions:
                    stats["cached_tokens"] += req.cached_len
        step = self.scheduler.step_inputs(batch)
        subst = None
        reqs = batch.reqs
        if (  # the steady state: the same requests in the same order, all waiting for their ids
            prev is not None
            and len(reqs) == len(prev.reqs)
            and all(map(operator.is_, reqs, prev.reqs))
            and all(r.output_ids[-1] == PLACEHOLDER for r in reqs)
        ):
            subst = (None, prev.ids)  # one device copy, no index lists
        elif prev is not None:  # input ids still on the device: take them from the previous step
            pos = prev.position()
            dst = [i for i, r in enumerate(batch.reqs) if r.output_ids and r.output_ids[-1] == PLACEHOLDER]
            src = [pos[batch.reqs[i].rid] for i in dst]
            if dst:  # a pageable torch.tensor(..., device=) here would wait for the step in flight
                idx = self.stager.to_device([dst, src], torch.int64)  # [2, k]
                subst = (idx[0], prev.ids.index_select(0, idx[1]))
        t1 = time.perf_counter()
        logits = self.runner.forward(step, subst)  # [B, V]
        drafter = self.spec.drafter if self.spec is not None else None
        if batch.mode != "decode" and isinstance(drafter, DraftModel):
            drafter.mirror(step, batch.reqs)  # the draft model's K/V of the same tokens
        elif isinstance(drafter, Eagle3Drafter):  # a decode step's hidden states, for the head
            n = len(batch.reqs)
            drafter.harvest(batch.reqs, step.positions, [[i] for i in range(n)])
        t2 = time.perf_counter()
        hb = self.host_breakdown
        hb["launch"] += t2 - t1
        # A decode step completes every request; an extend step those whose chunk reaches the end.
        done = None if batch.mode == "decode" else [i for i in range(len(batch.reqs)) if batch.completes(i)]
        self.scheduler.after_step(batch)
        t3 = time.perf_counter()
        hb["schedule"] += sched_s + (t1 - t0) + (t3 - t2)
        if done is not None and not done:
            self.last_step_host_s = sched_s + t3 - t0
            return None
        t2 = t3
        every = done is None or len(done) == len(batch.reqs)
        if every:
            reqs, rows = batch.reqs, step.req_rows
        else:
            assert done is not None  # an extend step, some requests finished their prompt
            reqs = [batch.reqs[i] for i in done]
            rows = [r.row for r in reqs]
            logits = logits[self.stager.to_device(done, torch.int64)]
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if constrained:  # structured outputs: the grammar's mask on the logits (runtime/grammar.py)
            stats["masked_rows"] += len(constrained)
            mask_logits(
                logits,
                [(i, reqs[i].grammar, self._known_ids(reqs[i], prev)) for i in constrained],
                self.stager,
            )
        sampler = self.sampler
        need_rows = sampler.counts is not None
        greedy = prev.greedy if prev is not None and subst is not None and subst[0] is None else None
        if greedy is not None and greedy.row_list == rows and (greedy.rows.numel() > 0) == need_rows:
            # The steady state: the previous step's requests (so params) and rows, all plain
            # greedy: its argmax-only batch again (nothing in it depends on the step).
            sb = greedy
        elif SamplingBatch.plain_greedy(params := [r.params for r in reqs]):  # argmax only
            sb = greedy = SamplingBatch.greedy_batch(rows, self.device, self.stager, need_rows=need_rows)
        else:
            greedy = None
            sb = SamplingBatch.build(
                params,
                rows,
                self.device,
                seeds=[r.seed for r in reqs],
                steps=[len(r.output_ids) for r in reqs],
                eos_token_ids=self.eos_token_ids,
            )
        if sb is greedy and every and self.runner.last_ids is not None:
            # the decode graph's argmax (KILN_GRAPH_GREEDY), one per row of the step: not for an
            # extend step (run as decode: one token each) that leaves some prompts unfinished
            out = SampleOutput(next_ids=self.runner.last_ids)
        else:
            out = sampler.sample(logits, sb)
        sampler.observe(sb.rows, out.next_ids)
        index = []  # each request's new token goes where its placeholder is appended now
        for r in reqs:
            ids = r.output_ids
            index.append(len(ids))
            ids.append(PLACEHOLDER)
        launched = Launched(batch, reqs, index, out.next_ids, kind=kind)
        launched.greedy = greedy  # a plain greedy batch: the next step may reuse it
        launched.host["ids"] = self.stager.to_host(out.next_ids)
        if out.logprobs is not None:
            for k in ("logprobs", "top_ids", "top_logprobs"):
                launched.host[k] = self.stager.to_host(getattr(out, k))
        if out.next_ids.device.type == "cuda":
            launched.event = torch.cuda.Event()
            launched.event.record()
        t4 = time.perf_counter()
        hb["sample"] += t4 - t2
        launched.host_s = sched_s + t4 - t0
        return launched

    @staticmethod
    def _known_ids(req: Req, prev: Launched | None) -> list[int]:
        """``req``'s output tokens, its token of the step in flight (``prev``) read back: the host
        waits for that step here, while this step's forward runs on the device."""
        ids = req.output_ids
        if not ids or ids[-1] != PLACEHOLDER:
            return ids
        assert prev is not None, "a placeholder token without a step in flight"
        if prev.event is not None:
            prev.event.synchronize()
        return [*ids[:-1], int(prev.host["ids"][prev.position()[req.rid]])]

    # ------------------------------------------------------------------ finishing
    def finish(self, launched: Launched, launch_host_s: float) -> list[RequestOutput]:
        """Wait for ``launched``'s tokens, then hand them to ``outputs``. ``launch_host_s``: host
        seconds this ``step()`` call spent launching (for the step's host time)."""
        t0 = time.perf_counter()
        if launched.event is not None:
            launched.event.synchronize()
        t_synced = time.perf_counter()
        hb = self.host_breakdown
        hb["wait"] += t_synced - t0
        outs = self.outputs(launched)
        t_end = time.perf_counter()
        self.step_stats.discarded_tokens += len(launched.reqs) - len(outs)  # one output per token kept
        hb["outputs"] += t_end - t_synced
        # Host time of this step() call: launching plus finishing, not waiting for the device.
        self.last_step_host_s = launch_host_s + (t_end - t_synced)
        return outs

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Launch and/or finish steps (module docstring); the call's wall and host time go to
        the kind of the step it waited for, else of the step it launched (runtime/step_stats.py)."""
        t0 = time.perf_counter()
        outs, kind = self._step()
        if kind >= 0:
            self.step_stats.time(kind, time.perf_counter() - t0, self.last_step_host_s)
        return outs

    def _step(self) -> tuple[list[RequestOutput], int]:
        """One ``step()`` call: its outputs and the kind its time goes to (-1: no step ran)."""
        if self.inflight is not None:
            prev, self.inflight = self.inflight, None
            nxt = None
            t0 = time.perf_counter()
            # a decode-all step (every running request), unless its graph is still to capture
            # (startup_graphs smallest): the step in flight finishes first, the capture then runs
            n = len(self.scheduler.running)
            if self._overlaps(n) and not self.runner.bucket_pending(n):
                batch = self.scheduler.schedule_decode_all()
                nxt = self.launch(batch, prev, time.perf_counter() - t0) if batch is not None else None
                self.overlapped += nxt is not None
            outs = self.finish(prev, nxt.host_s if nxt else 0.0)
            self.inflight = nxt
            return outs, prev.kind
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch is None:
            return [], -1
        # Nothing in flight: a decode graph still pending for this batch is captured now (its
        # warm-ups write the static inputs; a later overlapped step replays the smallest captured
        # bucket that holds it). A one-token-each extend step runs as a decode step.
        n = len(batch.reqs)
        self.runner.capture_bucket_for(n)
        may_verify = self._may_verify(batch)
        # the measured policy (runtime/spec_policy.py) times the decode steps that could speculate
        policy = self.spec.policy if may_verify and self.spec is not None else None
        if may_verify and (policy is None or policy.speculate(n)):
            verified = self._verify_step(batch, t0)
            if verified is not None:
                return verified, self.launched_kind
        launched = self.launch(batch, sched_s=time.perf_counter() - t0)
        if launched is None:
            return [], self.launched_kind
        if batch.mode == "decode" and self._overlaps(n):
            self.inflight = launched
            self.last_step_host_s = launched.host_s
            return [], launched.kind
        outs = self.finish(launched, launched.host_s)
        if policy is not None:
            policy.observe(n, False, time.perf_counter() - t0)
        return outs, launched.kind

    def _may_verify(self, batch: ScheduledBatch) -> bool:
        """Whether a scheduled step could run as a verify step: a decode step within the verify
        graphs' batches (larger ones decode plainly, overlapped)."""
        spec = self.spec
        return (
            spec is not None
            and batch.mode == "decode"
            and (spec.max_batch is None or len(batch.reqs) <= spec.max_batch)
        )

    def _overlaps(self, n: int) -> bool:
        """Whether a decode step of ``n`` requests may stay in flight while the next is launched:
        with overlap on, always without speculation; with it, only for batches above the verify
        graphs' (such steps decode plainly, and nothing drafts from their placeholder tokens)."""
        if not self.overlap:
            return False
        spec = self.spec
        return spec is None or (spec.max_batch is not None and n > spec.max_batch)

    # ------------------------------------------------------------------ speculative decoding
    def _verify_rows(
        self,
        rows3: torch.Tensor,
        reqs: list[Req],
        drafts: list[list[int]],
        blocked: list[int],
        trees: list[TreeDraft] | None = None,
        draft_ids: torch.Tensor | None = None,
    ) -> dict[str, torch.Tensor]:
        """The emitted tokens of a verify step, on the host: ``ids [B, P]`` (-1 past each
        request's), ``num_emitted [B]`` and, when a request asked, ``logprobs [B, P]``, ``top_ids``
        and ``top_logprobs [B, P, N]``. :func:`verify` for the speculating requests, one plain
        sample at position 0 for those in ``blocked``. With ``trees`` (a token-tree step; ``drafts``
        their node tokens) :func:`verify_tree` instead, and the accepted nodes' K/V moved into place
        (:meth:`_move_accepted`). ``draft_ids``: a draft model's chains on the device (``drafts``
        then hold placeholders of the right lengths)."""
        B, P = len(reqs), rows3.shape[1]
        assert self.spec is not None
        drafter = self.spec.drafter
        probs = drafter.probs if isinstance(drafter, DraftModel) else None  # sampled drafts' q
        no = set(blocked)
        spec_i = [i for i in range(B) if i not in no]
        if blocked:
            idx = self.stager.to_device(spec_i, torch.int64)
            rows3_s, probs = rows3[idx], probs[idx] if probs is not None else None
        else:
            rows3_s = rows3
        sreqs = [reqs[i] for i in spec_i]
        out: VerifyOutput | TreeVerifyOutput
        if trees is not None:
            out = self._verify_trees(rows3_s, sreqs, [trees[i] for i in spec_i], P)
        else:
            if draft_ids is not None:  # on the device: the lengths from the host
                assert draft_ids.shape[1] == P - 1
                lens = self.stager.to_device([[len(drafts[i]) for i in spec_i]], torch.int64)[0]
                ids = draft_ids[self.stager.to_device(spec_i, torch.int64)] if blocked else draft_ids
                db = DraftBatch(ids, lens)
            else:
                db = DraftBatch.from_lists(
                    [drafts[i] for i in spec_i], self.device, max_len=P - 1, stager=self.stager
                )
            if probs is not None:
                db = DraftBatch(db.ids, db.lens, probs[:, : P - 1])
            spec = SpecSampling.build(
                [r.params for r in sreqs],
                [r.row for r in sreqs],
                [r.seed for r in sreqs],
                [len(r.output_ids) for r in sreqs],
                P,
                self.device,
                eos_token_ids=self.eos_token_ids,
                with_uniforms=db.probs is not None,
                stager=self.stager,
            )
            out = verify(rows3_s, db, spec, self.sampler)
        if not blocked:
            host = {"ids": out.token_ids.cpu(), "num_emitted": out.num_emitted.cpu()}  # -1 past num_emitted
            if isinstance(out, TreeVerifyOutput):
                host["path"] = out.path.cpu()  # the accepted node at each depth
            if out.logprobs is not None:
                for k in ("logprobs", "top_ids", "top_logprobs"):
                    host[k] = getattr(out, k).cpu()
            return host
        plain = self._sample_rows(
            [reqs[i] for i in blocked], rows3[self.stager.to_device(blocked, torch.int64), 0]
        )
        ids = torch.full((B, P), -1, dtype=torch.int64)
        ids[spec_i] = out.token_ids.cpu()
        ids[blocked, 0] = plain.next_ids.cpu()
        num = torch.ones(B, dtype=torch.int64)
        num[spec_i] = out.num_emitted.cpu()
        host = {"ids": ids, "num_emitted": num}
        if isinstance(out, TreeVerifyOutput):  # the accepted node at each depth; node 0 alone if blocked
            host["path"] = torch.full((B, P), -1, dtype=torch.int64)
            host["path"][:, 0] = 0
            host["path"][spec_i] = out.path.cpu()
        tops = [t for t in (out.top_ids, plain.top_ids) if t is not None]
        if tops:  # logprobs: both parts' in one layout
            n = max(t.shape[-1] for t in tops)
            host["logprobs"] = torch.zeros(B, P)
            host["top_ids"] = torch.zeros(B, P, n, dtype=torch.int64)
            host["top_logprobs"] = torch.full((B, P, n), float("-inf"))
            for rows, pos, o in ((spec_i, slice(None), out), (blocked, 0, plain)):
                if o.logprobs is not None and o.top_ids is not None and o.top_logprobs is not None:
                    k = o.top_ids.shape[-1]
                    host["logprobs"][rows, pos] = o.logprobs.cpu()
                    host["top_ids"][rows, pos, :k] = o.top_ids.cpu()
                    host["top_logprobs"][rows, pos, :k] = o.top_logprobs.cpu()
        return host

    def _verify_trees(
        self, rows3: torch.Tensor, reqs: list[Req], trees: list[TreeDraft], P: int
    ) -> TreeVerifyOutput:
        """:func:`verify_tree` over ``reqs``' trees (``rows3 [B, P, V]``: row ``j`` node ``j``'s
        logits), then :meth:`_move_accepted`: the emitted tokens, the accepted path's K/V in place."""
        tb = TreeBatch.from_trees(trees, self.device, max_len=P - 1, stager=self.stager)
        ts = TreeSampling.build(
            [r.params for r in reqs],
            [r.row for r in reqs],
            [r.seed for r in reqs],
            [len(r.output_ids) for r in reqs],
            tb,
            self.device,
            eos_token_ids=self.eos_token_ids,
            stager=self.stager,
        )
        out = verify_tree(rows3, tb, ts, self.sampler)
        self._move_accepted(reqs, out)
        d = torch.arange(P, device=out.path.device)
        self.tree_stats["moved"] += int(((out.path >= 0) & (out.path != d)).any(dim=1).sum())
        return out

    def _move_accepted(self, reqs: list[Req], out: TreeVerifyOutput) -> None:
        """After a tree verify step: node ``path[d]``'s K/V (written at position ``kv_len +
        path[d]``) moved to position ``kv_len + d`` in every pool tensor of the target (K, V and an
        FP8 pool's scales), so the accepted tokens' K/V are the positions ``kv_len ..`` as after a
        chain step (runtime/spec_tree.py ``compact_moves``, ``move_kv``; on the device, no sync)."""
        idx = self.stager.to_device([[r.row for r in reqs], [r.kv_len for r in reqs]], torch.int64)
        src, dst = compact_moves(
            self.runner.bt.table, idx[0], idx[1], out.path, out.num_emitted, self.scheduler.page_size
        )
        self.runner.move_kv(src, dst)  # on every rank of a tensor-parallel run

    def _sample_rows(self, reqs: list[Req], logits: torch.Tensor) -> SampleOutput:
        """One token for each of ``reqs`` from its ``logits [n, V]`` (a copy), as a decode step samples
        it: the grammar's mask on structured requests, penalties, logprobs."""
        constrained = [(i, r.grammar, r.output_ids) for i, r in enumerate(reqs) if r.grammar is not None]
        if constrained:
            self.stats["masked_rows"] += len(constrained)
            mask_logits(logits, constrained, self.stager)
        sb = SamplingBatch.build(
            [r.params for r in reqs],
            [r.row for r in reqs],
            self.device,
            seeds=[r.seed for r in reqs],
            steps=[len(r.output_ids) for r in reqs],
            eos_token_ids=self.eos_token_ids,
        )
        out = self.sampler.sample(logits, sb)
        self.sampler.observe(sb.rows, out.next_ids)
        return out

    def _verify_step(self, batch: ScheduledBatch, t0: float) -> list[RequestOutput] | None:
        """A scheduled decode step run as a verify step (docs/speculative.md sections 2-3): each
        request's newest token and its n-gram drafts through the extend graph with logits at every
        new token, :func:`verify` picks the emitted tokens, ``outputs`` applies them. Finished
        before returning (no overlap). A request that cannot speculate (:func:`speculation_blocker`:
        penalties, structured outputs) or asked not to rides along with no drafts; the first kind is
        sampled as a decode step samples it (:meth:`_sample_rows`). None, with nothing changed, when
        the step should decode plainly: no request has drafts (the caller sends only steps within the
        verify graphs' batches, :meth:`_may_verify`). ``t0``: when this ``step()`` call started scheduling. Reported to the measured
        policy, when there is one (the caller asked it)."""
        assert self.spec is not None
        reqs = batch.reqs
        blocked = [i for i, r in enumerate(reqs) if speculation_blocker(r.params) is not None]
        if len(blocked) == len(reqs):
            return None
        sched = self.scheduler
        # at most the tokens a request may still reach, less one for the bonus token; none for a
        # request that asked for no speculation or cannot have it
        no = set(blocked)
        limits = [
            0 if i in no or r.params.speculative is False else sched.max_len(r) - r.seq_len - 1
            for i, r in enumerate(reqs)
        ]
        drafter = self.spec.drafter
        trees: list[TreeDraft] | None = None
        draft_ids: torch.Tensor | None = None  # a draft model's chains, on the device
        if isinstance(drafter, Eagle3Drafter) and self.spec.trees:  # the head's top tokens as trees
            trees = drafter.propose_tree(reqs, limits, sched)  # it reserves the pages it drafts into
            drafts = [list(t.tokens) for t in trees]
            if not any(drafts):
                return None
        elif isinstance(drafter, DraftModel):  # the draft model reserves the pages it drafts into
            chain = drafter.propose(reqs, limits, sched)  # left on the device
            if not any(chain.counts):
                return None
            drafts = chain.placeholders()
            draft_ids = chain.ids
        elif self.spec.trees:  # n-gram trees: every request's drafts as a tree (chains included)
            proposed = drafter.propose_tree_batch([r.rid for r in reqs], [r.token_view for r in reqs], limits)
            if not any(t.tokens for t in proposed):
                return None
            # pages for kv_len + 1 + nodes; a request short of pages keeps its first nodes (a tree)
            kept = sched.reserve_drafts(reqs, [list(t.tokens) for t in proposed])
            trees = [TreeDraft(t.tokens[: len(d)], t.parents[: len(d)]) for t, d in zip(proposed, kept)]
            drafts = [list(t.tokens) for t in trees]
        else:
            drafts = drafter.propose_batch([r.rid for r in reqs], [r.token_view for r in reqs], limits)
            if not any(drafts):
                return None
            drafts = sched.reserve_drafts(reqs, drafts)  # pages for kv_len + 1 + drafts
        if trees is not None and not any(branching(t) for t in trees):  # chains: a chain step, same tokens
            trees = None
        t1 = time.perf_counter()
        n_tok = len(reqs) + sum(len(d) for d in drafts)
        self.stats["steps"] += 1
        self.last_step_mode = "decode"
        kind = self.launched_kind = self.step_stats.count(len(reqs), 0, n_tok)
        if trees is not None:
            step = sched.tree_verify_inputs(reqs, trees)
            ts = self.tree_stats
            ts["steps"] += 1
            ts["branching"] += 1  # trees is None when no tree branches
            ts["nodes"] += n_tok - len(reqs)
        else:
            step = sched.verify_inputs(reqs, drafts)
        rows3 = self.runner.verify(step, draft_ids)  # [B, P, V]: request b's logits after each new token
        t2 = time.perf_counter()
        host = self._verify_rows(rows3, reqs, drafts, blocked, trees, draft_ids)
        launched = Launched(batch, reqs, [], host["ids"], kind=kind)
        launched.host = host
        t3 = time.perf_counter()
        emitted = launched.host["num_emitted"].tolist()
        self.spec.stats.record([len(d) for d in drafts], emitted)
        if isinstance(drafter, DraftModel):
            drafter.accepted(reqs, drafts, emitted)
        if isinstance(drafter, Eagle3Drafter):  # the head's input for the accepted tokens
            first = [s - e for s, e in zip(step.seq_lens, step.extend_lens or [])]
            rows = self.runner.verify_rows()  # each request's node 0; its nodes follow in index order
            path = host["path"].tolist() if trees is not None else [range(e) for e in emitted]
            drafter.harvest(reqs, first, [[r + j for j in p[:e]] for r, p, e in zip(rows, path, emitted)])
        outs = self.outputs(launched)
        t4 = time.perf_counter()
        hb = self.host_breakdown
        hb["schedule"] += t1 - t0
        hb["launch"] += t2 - t1
        hb["sample"] += t3 - t2
        hb["outputs"] += t4 - t3
        self.last_step_host_s = t4 - t0
        if self.spec.policy is not None:
            self.spec.policy.observe(len(reqs), True, t4 - t0, sum(emitted) / len(emitted))
        return outs
