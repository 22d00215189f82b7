"""Whether a decode step speculates: the measured policy (``--speculative-policy``).

A verify step of ``B`` requests costs more than a plain decode step of ``B``: ``k + 1`` tokens a
request go through the target and the draft source runs too. It pays only when enough drafts are
accepted. On an H200 a chain-4 step of an EAGLE-3-shaped head cost 2.15x / 1.91x / 2.29x a plain step
at batch 1 / 8 / 32 (bench/results/2026-12-06_h200_s31f_*): at 2 tokens a request per step it lost
5.7% at batch 1 and 8.4% at batch 32. Acceptance depends on the text, so no setting chosen ahead
fits every workload; the engine measures instead.

``measured`` keeps, per decode bucket (``ModelRunner.bucket_for``: steps of similar size cost about
the same), exponential moving averages (weight :data:`EMA`) of

* a plain decode step's wall time ``t_plain``,
* a verify step's wall time ``t_verify`` and the tokens it emits per request ``e`` (accepted
  drafts + 1, requests that rode along without drafts counted with their one token),

and speculates while ``e / t_verify >= 1 / t_plain`` (tokens per request per second). A bucket
starts speculating; it has :data:`MIN_SAMPLES` steps of each mode before it compares. Each decision
is probed: after ``interval`` steps of one mode, :data:`MIN_SAMPLES` steps run the other and replace
its stale estimate, so the choice follows the workload; a probe that confirms the mode doubles
``interval`` (from :data:`PROBE_FIRST` up to :data:`PROBE_MAX`: in the long run 3 steps in 256 run
the mode that loses), one that changes the mode resets it.

Protocol: the stepper asks :meth:`SpecPolicy.speculate` before drafting a decode step of ``n``
requests, and reports every decode step it could have asked about with :meth:`SpecPolicy.observe`
(wall seconds from scheduling to its outputs: such steps are finished before the next is launched,
never overlapped). A step asked to speculate that found no drafts runs plainly and is reported as
plain. ``always`` (the policy off) speculates whenever there are drafts. Speculation is lossless
either way: the policy changes the speed, never the tokens of a greedy request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

EMA = 0.25  # weight of the newest step in each moving average
MIN_SAMPLES = 3  # steps of each mode a bucket measures before it compares them
PROBE_FIRST = 16  # steps of one mode before the first probe of the other
PROBE_MAX = 256  # the longest run of one mode between probes
POLICIES = ("measured", "always")


@dataclass
class BucketCosts:
    """One decode bucket's estimates (seconds, tokens per request) and its probe schedule."""

    t_plain: float = 0.0
    n_plain: int = 0
    t_verify: float = 0.0
    emitted: float = 0.0
    n_verify: int = 0
    speculating: bool = True
    run: int = 0  # steps of the current mode since the last probe or switch
    interval: int = PROBE_FIRST
    probing: bool = False  # a probe of the other mode is measuring

    def speculate_rate(self) -> float:
        """Tokens per request per second of a verify step."""
        return self.emitted / self.t_verify

    def plain_rate(self) -> float:
        """Tokens per request per second of a plain step."""
        return 1.0 / self.t_plain


def _ema(old: float, new: float, n: int) -> float:
    return new if n == 0 else old + EMA * (new - old)


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
        if c.n_verify < MIN_SAMPLES:
            return True
        if c.n_plain < MIN_SAMPLES:
            return False
        if c.run >= c.interval:  # probe the other mode: its estimate is stale, measure it afresh
            c.probing, c.run = True, 0
            self.probes += 1
            if c.speculating:
                c.n_plain = 0
            else:
                c.n_verify = 0
            return not c.speculating
        return c.speculating

    def observe(self, n: int, speculated: bool, seconds: float, emitted_per_request: float = 1.0) -> None:
        """A finished decode step of ``n`` requests: verified (``speculated``) or plain, its wall
        ``seconds`` and, verified, the tokens it emitted per request."""
        if seconds <= 0.0:
            return
        c = self.costs(n)
        if speculated:
            c.t_verify = _ema(c.t_verify, seconds, c.n_verify)
            c.emitted = _ema(c.emitted, emitted_per_request, c.n_verify)
            c.n_verify += 1
        else:
            c.t_plain = _ema(c.t_plain, seconds, c.n_plain)
            c.n_plain += 1
        if c.n_verify < MIN_SAMPLES or c.n_plain < MIN_SAMPLES:
            return  # still measuring (at the start, or a probe)
        best = c.speculate_rate() >= c.plain_rate()
        if best != c.speculating:  # a switch: probe the old mode again soon
            c.speculating = best
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
                    "plain_tok_s": round(c.plain_rate(), 3) if c.n_plain else None,
                    "verify_tok_s": round(c.speculate_rate(), 3) if c.n_verify else None,
                    "mean_emitted": round(c.emitted, 3) if c.n_verify else None,
                }
                for b, c in sorted(self.buckets.items())
            },
        }
