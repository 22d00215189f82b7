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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.runtime.request import Req
from kiln.runtime.sampler import SamplingBatch
from kiln.runtime.scheduler import ScheduledBatch

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

    def position(self) -> dict[str, int]:
        return {r.rid: j for j, r in enumerate(self.reqs)}


class Stepper:
    """Owns the launch/finish cycle for an :class:`~kiln.runtime.engine.Engine`."""

    def __init__(self, engine: Any, overlap: bool):
        self.e = engine
        self.overlap = overlap
        self.inflight: Launched | None = None
        self.overlapped = 0  # decode steps launched while the previous one was in flight

    # ------------------------------------------------------------------ launching
    def launch(self, batch: ScheduledBatch, prev: Launched | None = None) -> Launched | None:
        e = self.e
        t0 = time.perf_counter()
        e.stats["steps"] += 1
        e.last_step_mode = batch.mode
        for req in batch.reqs:  # newly admitted (or resumed): fresh sampler row
            if e._sampler_rows.get(req.rid) != req.row:
                e.sampler.reset_row(req.row, req.prompt_ids, req.output_ids)
                e._sampler_rows[req.rid] = req.row
                if req.kv_len == req.cached_len and not req.num_preemptions:
                    e.stats["cached_tokens"] += req.cached_len
        step = e.scheduler.step_inputs(batch)
        subst = None
        if prev is not None:  # input ids still on the device: take them from the previous step
            pos = prev.position()
            dst = [i for i, r in enumerate(batch.reqs) if r.output_ids and r.output_ids[-1] == PLACEHOLDER]
            src = [pos[batch.reqs[i].rid] for i in dst]
            if dst:  # a pageable torch.tensor(..., device=) here would wait for the step in flight
                idx = e.stager.to_device([dst, src], torch.int64)  # [2, k]
                subst = (idx[0], prev.ids.index_select(0, idx[1]))
        t1 = time.perf_counter()
        logits = e.runner.forward(step, subst)  # [B, V]
        e.host_breakdown["schedule"] += t1 - t0
        e.host_breakdown["launch"] += time.perf_counter() - t1
        done = [i for i in range(len(batch.reqs)) if batch.completes(i)]
        e.scheduler.after_step(batch)
        if not done:
            e.last_step_host_s = time.perf_counter() - t0
            return None
        t2 = time.perf_counter()
        reqs = [batch.reqs[i] for i in done]
        if len(done) < len(batch.reqs):
            logits = logits[e.stager.to_device(done, torch.int64)]
        sb = SamplingBatch.build(
            [r.params for r in reqs],
            [r.row for r in reqs],
            e.device,
            seeds=[r.seed for r in reqs],
            steps=[len(r.output_ids) for r in reqs],
            eos_token_ids=sorted(e.eos_ids),
        )
        out = e.sampler.sample(logits, sb)
        e.sampler.observe(sb.rows, out.next_ids)
        launched = Launched(batch, reqs, [len(r.output_ids) for r in reqs], out.next_ids)
        for r in reqs:
            r.output_ids.append(PLACEHOLDER)
        launched.host["ids"] = e.stager.to_host(out.next_ids)
        if out.logprobs is not None:
            for k in ("logprobs", "top_ids", "top_logprobs"):
                launched.host[k] = e.stager.to_host(getattr(out, k))
        if out.next_ids.device.type == "cuda":
            launched.event = torch.cuda.Event()
            launched.event.record()
        e.host_breakdown["sample"] += time.perf_counter() - t2
        launched.host_s = time.perf_counter() - t0
        return launched

    # ------------------------------------------------------------------ the loop
    def can_overlap(self) -> bool:
        s = self.e.scheduler
        if not self.overlap or s.waiting or not s.running or any(r.prefilling for r in s.running):
            return False
        need = sum(s._pages_needed(r, r.kv_len + 1) > 0 for r in s.running)
        return need <= self.e.pool.num_free_pages

    def step(self) -> list[Any]:
        e = self.e
        if self.inflight is not None:
            prev, self.inflight = self.inflight, None
            nxt = None
            if self.can_overlap():
                batch = e.scheduler.schedule_decode()
                nxt = self.launch(batch, prev) if batch is not None else None
                self.overlapped += nxt is not None
            outs = e._finish(prev, launch_host_s=nxt.host_s if nxt else 0.0)
            self.inflight = nxt
            return outs
        batch = e.scheduler.schedule()
        if batch is None:
            return []
        launched = self.launch(batch)
        if launched is None:
            return []
        if self.overlap and batch.mode == "decode":
            self.inflight = launched
            e.last_step_host_s = launched.host_s
            return []
        return e._finish(launched, launch_host_s=launched.host_s)
