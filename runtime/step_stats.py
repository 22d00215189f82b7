"""Per-step figures of an engine: what its steps ran and where their time went, by step kind.

Every step the engine launches (one forward: ``Engine.status()["steps"]`` counts them) is
counted under its kind:

- ``prefill``: prompt (extend) tokens only: today's extend steps, chunked prefill and the
  recomputation of a resumed request's tokens alike;
- ``decode``: decode rows only, one token per request;
- ``mixed``: both in one forward (the coming mixed steps; no step is mixed today).

Per kind :class:`StepStats` keeps sums only (O(1) memory however many steps run):

- ``steps``: steps launched.
- ``requests``: the requests in each step (its batch), summed; ``requests / steps`` is the mean
  running batch, weighted by steps.
- ``prefill_tokens`` / ``decode_tokens``: tokens the steps fed the model (a prefill step's chunk
  lengths; one per decode row). Tokens the radix cache supplied are not fed, so not counted.
- ``wall_s``: wall time of the engine's ``step()`` calls, each given to the kind of the step the
  call waits for: with overlap a decode call launches step k+1 and then waits for step k, so its
  time is step k's; a call that waits for nothing (an extend chunk that samples no token, the first
  overlapped decode step) counts for the step it launched. Over a run ``wall_s`` is the time the
  engine spent in steps of that kind and ``wall_s / steps`` their mean step time; the split of time
  between two consecutive steps is not exact (a chunk that samples nothing does not wait for the
  device, and the next call that waits pays for it).
- ``calls``: the ``step()`` calls whose time went to the kind: one per step, but with overlap an
  unbroken run of n decode steps takes n + 1 calls (the first only launches; the last only
  finishes).
- ``host_s``: the part of ``wall_s`` the host worked (scheduling, building inputs, launching,
  sampling, stop checks, text): the call's time minus its wait on the CUDA event recorded after the
  sampled ids' copy to the host, the one place a step waits for the device (``Stepper.finish``;
  measured with ``time.perf_counter`` around that wait; no device sync is added). It includes any
  blocking inside a launch (a full launch queue, an op reading a device value). On CPU the forward
  runs inside the launch, so ``host_s`` is close to ``wall_s``.
- ``batch_hist``: steps per batch-size bucket (:data:`BATCH_BUCKETS`: 1, 2, 3-4, ..., 257-512,
  513+ requests).
- ``wall_hist``: ``step()`` calls per wall-time bucket (:data:`WALL_BUCKETS_MS`, upper bounds; the
  last open): the longest steps of a kind, which bound the inter-token gaps (a prefill step between
  two decode steps delays every stream by its length). In ``as_dict`` its keys are the bounds as
  strings, ``"5"`` .. ``"1000"`` and ``"inf"`` (``batch_hist``'s are its bucket names).

Beside the kinds, ``discarded_tokens``: tokens sampled for a request that had finished (or was
aborted) while the step was in flight, the cost of overlapped decoding; a run's decode tokens are
its generated tokens, less those sampled by prefill steps, plus these. They are counted when their
step is finished: a step still in flight (overlap leaves one after the last token) is counted in
``steps`` and its tokens, not yet in ``discarded_tokens``.

The engine's stepper counts each step at launch (:meth:`StepStats.count`) and times each
``step()`` call (:meth:`StepStats.time`); :meth:`StepStats.snapshot` gives the typed totals and
:meth:`StepStats.as_dict` plain numbers (e.g. for a metrics endpoint). :meth:`StepStats.reset`
zeroes everything (a benchmark resets before its measured run).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

KINDS = ("prefill", "decode", "mixed")
PREFILL, DECODE, MIXED = 0, 1, 2

# Batch-size buckets of ``batch_hist``: bucket i holds batches of 2**(i-1)+1 .. 2**i requests
# (bucket 0: one request); the last bucket is open.
_LAST_BUCKET = 10
BATCH_BUCKETS = (
    ("1", "2")
    + tuple(f"{2 ** (i - 1) + 1}-{2**i}" for i in range(2, _LAST_BUCKET))
    + (f"{2 ** (_LAST_BUCKET - 1) + 1}+",)
)


# Upper bounds (ms) of ``wall_hist``'s buckets; one more bucket holds the longer calls.
WALL_BUCKETS_MS = (5, 10, 15, 20, 30, 40, 60, 80, 100, 150, 200, 300, 500, 1000)


def step_kind(prefill_tokens: int, decode_tokens: int) -> int:
    """The kind (:data:`PREFILL`, :data:`DECODE` or :data:`MIXED`) of a step feeding these tokens."""
    if decode_tokens and prefill_tokens:
        return MIXED
    return DECODE if decode_tokens else PREFILL


def _per_step(total: float, steps: int, scale: float = 1.0) -> float | None:
    return scale * total / steps if steps else None


@dataclass(frozen=True)
class KindStats:
    """Totals of one step kind (module docstring); the means are None when no step ran."""

    kind: str  # "prefill", "decode", "mixed" or "all"
    steps: int
    requests: int
    prefill_tokens: int
    decode_tokens: int
    wall_s: float
    host_s: float
    calls: int
    batch_hist: tuple[int, ...]  # steps per BATCH_BUCKETS bucket
    wall_hist: tuple[int, ...]  # step() calls per WALL_BUCKETS_MS bucket (+ one open bucket)

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens

    @property
    def mean_batch(self) -> float | None:
        """Requests per step, weighted by steps (the mean running batch)."""
        return _per_step(self.requests, self.steps)

    @property
    def tokens_per_step(self) -> float | None:
        return _per_step(self.tokens, self.steps)

    @property
    def step_ms(self) -> float | None:
        """Mean wall time of a step, in milliseconds."""
        return _per_step(self.wall_s, self.steps, 1e3)

    @property
    def host_ms_per_step(self) -> float | None:
        return _per_step(self.host_s, self.steps, 1e3)

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "requests": self.requests,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "wall_s": self.wall_s,
            "host_s": self.host_s,
            "calls": self.calls,
            "batch_hist": dict(zip(BATCH_BUCKETS, self.batch_hist)),
            "wall_hist": dict(zip((*map(str, WALL_BUCKETS_MS), "inf"), self.wall_hist)),
            "mean_batch": self.mean_batch,
            "tokens_per_step": self.tokens_per_step,
            "step_ms": self.step_ms,
            "host_ms_per_step": self.host_ms_per_step,
        }


@dataclass(frozen=True)
class StepStatsSnapshot:
    """:class:`StepStats` at one moment: one :class:`KindStats` per kind, in :data:`KINDS` order."""

    kinds: tuple[KindStats, ...]
    discarded_tokens: int

    def kind(self, name: str) -> KindStats:
        return self.kinds[KINDS.index(name)]

    @property
    def total(self) -> KindStats:
        """Every kind together (``kind`` "all")."""
        ks = self.kinds
        return KindStats(
            "all",
            sum(k.steps for k in ks),
            sum(k.requests for k in ks),
            sum(k.prefill_tokens for k in ks),
            sum(k.decode_tokens for k in ks),
            sum(k.wall_s for k in ks),
            sum(k.host_s for k in ks),
            sum(k.calls for k in ks),
            tuple(map(sum, zip(*(k.batch_hist for k in ks)))),
            tuple(map(sum, zip(*(k.wall_hist for k in ks)))),
        )

    def as_dict(self) -> dict[str, Any]:
        """``{kind: KindStats.as_dict(), ..., "all": ..., "discarded_tokens": n}``: plain numbers."""
        out: dict[str, Any] = {k.kind: k.as_dict() for k in (*self.kinds, self.total)}
        out["discarded_tokens"] = self.discarded_tokens
        return out


class StepStats:
    """The running sums of an engine's steps (module docstring). Not thread-safe: the engine's
    thread updates it; read it there, or accept a snapshot a step out of date."""

    __slots__ = (
        "calls",
        "decode_tokens",
        "discarded_tokens",
        "hist",
        "host_s",
        "prefill_tokens",
        "requests",
        "steps",
        "wall_hist",
        "wall_s",
    )

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Zero every sum."""
        n = len(KINDS)
        self.steps = [0] * n
        self.requests = [0] * n
        self.prefill_tokens = [0] * n
        self.decode_tokens = [0] * n
        self.wall_s = [0.0] * n
        self.host_s = [0.0] * n
        self.calls = [0] * n
        self.hist = [[0] * len(BATCH_BUCKETS) for _ in KINDS]
        self.wall_hist = [[0] * (len(WALL_BUCKETS_MS) + 1) for _ in KINDS]
        self.discarded_tokens = 0

    def count(self, requests: int, prefill_tokens: int, decode_tokens: int) -> int:
        """Count a launched step of ``requests`` requests feeding these tokens; returns its kind."""
        k = step_kind(prefill_tokens, decode_tokens)
        self.steps[k] += 1
        self.requests[k] += requests
        self.prefill_tokens[k] += prefill_tokens
        self.decode_tokens[k] += decode_tokens
        self.hist[k][min((requests - 1).bit_length(), _LAST_BUCKET) if requests > 0 else 0] += 1
        return k

    def time(self, kind: int, wall_s: float, host_s: float) -> None:
        """Add one ``step()`` call's wall and host seconds to ``kind``."""
        self.wall_s[kind] += wall_s
        self.host_s[kind] += host_s
        self.calls[kind] += 1
        self.wall_hist[kind][bisect.bisect_left(WALL_BUCKETS_MS, wall_s * 1e3)] += 1

    def snapshot(self) -> StepStatsSnapshot:
        kinds = tuple(
            KindStats(
                name,
                self.steps[k],
                self.requests[k],
                self.prefill_tokens[k],
                self.decode_tokens[k],
                self.wall_s[k],
                self.host_s[k],
                self.calls[k],
                tuple(self.hist[k]),
                tuple(self.wall_hist[k]),
            )
            for k, name in enumerate(KINDS)
        )
        return StepStatsSnapshot(kinds, self.discarded_tokens)

    def as_dict(self) -> dict[str, Any]:
        """The totals as plain numbers (:meth:`StepStatsSnapshot.as_dict`)."""
        return self.snapshot().as_dict()
