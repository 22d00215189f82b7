"""Whether a decode step speculates: the measured policy (``--speculative-policy``).

A verify step of ``B`` requests costs more than a plain decode step of ``B``: ``k + 1`` tokens a
request go through the target (on an H200, Llama-3.1-8B shape: 1.31-1.36x a plain step at batch 1,
bench/results/2026-12-05_h200_s24a_*; a chain-4 step with an EAGLE-3-shaped head 1.9-2.3x at batch
1 to 32, ..._s31f_*). It pays only when enough drafts are accepted, and how many are depends on
the text: n-gram drafts match code, quotes and edits, and almost never free prose. No setting chosen
ahead fits every workload; the engine measures instead.

``measured`` keeps, per decode bucket (``ModelRunner.bucket_for``: steps of similar size cost about
the same), the last :data:`WINDOW` steps of each mode:

* a plain decode step's wall time, their median ``t_plain``;
* a verify step's wall time, their median ``t_verify``, and the tokens it emitted per request,
  their mean ``e`` (accepted drafts + 1; requests that rode along without drafts count their one
  token);

and speculates while ``e / t_verify`` (tokens per request per second) beats ``1 / t_plain``.
Medians, so that one step stalled by the host (a garbage collection, another thread) moves nothing;
and a mode changes only when the other wins by :data:`MARGIN`, so that two near-equal modes do not
alternate. A bucket starts speculating; it has :data:`MIN_SAMPLES` steps of each mode before it
compares. Each decision is probed: after ``interval`` steps of one mode, :data:`MIN_SAMPLES` steps
run the other and replace its stale samples, so the choice follows the workload; a probe that
confirms the mode doubles ``interval`` (from :data:`PROBE_FIRST` up to :data:`PROBE_MAX`: in the long
run 3 steps in 256 run the mode that loses), one that changes the mode resets it.

It decides for n-gram drafts only (the engine, runtime/engine.py): they hold no state, so a plain
step costs what it costs without speculation and a probe what any verify step costs. A draft model,
EAGLE-3 head or MTP layer must see every token (a draft model's K/V is caught up at its next verify
step, an EAGLE-3 head's ring keeps only ``k + 1`` positions: docs/speculative.md), so with one the
engine verifies every step it can, as under ``always``.

Protocol: the stepper asks :meth:`SpecPolicy.speculate` before drafting a decode step of ``n``
requests, and reports every decode step it could have asked about with :meth:`SpecPolicy.observe`
(wall seconds from scheduling to its outputs: such steps are finished before the next is launched,
never overlapped). A step asked to speculate that found no drafts runs plainly and is reported as
plain. ``always`` (the policy off) speculates whenever there are drafts. Greedy tokens do not
depend on the policy where a verify step's logits equal a decode step's (float32); in bf16 the
graphs round differently (the batch-1 decode graph folds the norms into its linears), so a near-tie
may break differently from run to run as the steps that verify follow the timing (``always`` keeps
runs repeatable). n-gram drafts are point masses, so a seeded request's tokens are the plain
sampler's wherever the logits are equal.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

WINDOW = 8  # the steps of each mode an estimate reads (the newest)
MARGIN = 1.05  # a mode changes when the other emits this much faster
MIN_SAMPLES = 3  # steps of each mode a bucket measures before it compares them
PROBE_FIRST = 16  # steps of one mode before the first probe of the other
PROBE_MAX = 256  # the longest run of one mode between probes


def _window() -> deque[float]:
    return deque(maxlen=WINDOW)


@dataclass
class BucketCosts:
    """One decode bucket's samples (seconds, tokens per request) and its probe schedule."""

    plain_s: deque[float] = field(default_factory=_window)
    verify_s: deque[float] = field(default_factory=_window)
    emitted: deque[float] = field(default_factory=_window)  # per request, of the verify steps
    speculating: bool = True
    run: int = 0  # steps of the current mode since the last probe or switch
    interval: int = PROBE_FIRST
    probing: bool = False  # a probe of the other mode is measuring

    def verify_rate(self) -> float:
        """Tokens per request per second of a verify step."""
        return statistics.fmean(self.emitted) / statistics.median(self.verify_s)

    def plain_rate(self) -> float:
        """Tokens per request per second of a plain step."""
        return 1.0 / statistics.median(self.plain_s)

    def measured(self) -> bool:
        return len(self.verify_s) >= MIN_SAMPLES and len(self.plain_s) >= MIN_SAMPLES


@dataclass
class SpecPolicy:
    """The measured policy (module docstring); ``bucket`` maps a decode batch to its bucket."""

    bucket: Callable[[int], int]
    buckets: dict[int, BucketCosts] = field(default_factory=dict)
    switches: int = 0  # mode changes of any bucket (for /metrics and tests)
    probes: int = 0

    def costs(self, n: int) -> BucketCosts:
        return self.buckets.setdefault(self.bucket(n), BucketCosts())

    def speculate(self, n: int) -> bool:
        """Whether the decode step of ``n`` requests about to be drafted should speculate."""
        c = self.costs(n)
        if len(c.verify_s) < MIN_SAMPLES:
            return True
        if len(c.plain_s) < MIN_SAMPLES:
            return False
        if c.run >= c.interval:  # probe the other mode: its samples are stale, measure it afresh
            c.probing, c.run = True, 0
            self.probes += 1
            if c.speculating:
                c.plain_s.clear()
            else:
                c.verify_s.clear()
                c.emitted.clear()
            return not c.speculating
        return c.speculating

    def observe(self, n: int, speculated: bool, seconds: float, emitted_per_request: float = 1.0) -> None:
        """A finished decode step of ``n`` requests: verified (``speculated``) or plain, its wall
        ``seconds`` and, verified, the tokens it emitted per request."""
        if seconds <= 0.0:
            return
        c = self.costs(n)
        if speculated:
            c.verify_s.append(seconds)
            c.emitted.append(emitted_per_request)
        else:
            c.plain_s.append(seconds)
        if not c.measured():
            return  # still measuring (at the start, or a probe)
        spec, plain = c.verify_rate(), c.plain_rate()
        if (plain > MARGIN * spec) if c.speculating else (spec > MARGIN * plain):
            c.speculating = not c.speculating  # a switch: probe the old mode again soon
            c.run, c.interval = 0, PROBE_FIRST
            self.switches += 1
        elif c.probing:  # the probe confirmed the mode: probe less often
            c.run, c.interval = 0, min(2 * c.interval, PROBE_MAX)
        else:
            c.run += 1
        c.probing = False

    def as_dict(self) -> dict[str, object]:
        """Per bucket: the mode and its estimates (tokens per request per second), and the sums."""
        return {
            "switches": self.switches,
            "probes": self.probes,
            "buckets": {
                b: {
                    "speculating": c.speculating,
                    "plain_tok_s": round(c.plain_rate(), 3) if c.plain_s else None,
                    "verify_tok_s": round(c.verify_rate(), 3) if c.verify_s else None,
                    "mean_emitted": round(statistics.fmean(c.emitted), 3) if c.emitted else None,
                }
                for b, c in sorted(self.buckets.items())
            },
        }
