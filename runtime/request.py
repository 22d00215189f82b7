"""Request state (``Req``) and what a step reports back (``RequestOutput``)."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from kiln.runtime.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued; its KV (if any) was released or never computed
    RUNNING = "running"  # holds a block-table row and KV pages; prefilling or decoding
    FINISHED = "finished"


@dataclass
class Req:
    """One sequence being generated. Bookkeeping only: plain Python ints and lists."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    row: int = -1  # block-table row while running
    sampler_row: int = -1  # the row the sampler was last reset for this request (runtime/stepper.py)
    pages: list[int] = field(default_factory=list)  # KV pages, in order
    kv_len: int = 0  # tokens of fill_ids whose K/V are in the pool
    cached_len: int = 0  # leading tokens whose pages belong to the radix cache (locked)
    prefix_hit: int = 0  # tokens matched in the radix cache at (first) admission
    last_node: Any = None  # radix node locked for this request
    finish_reason: str | None = None
    stop_text: str | None = None  # the stop string that ended it, if any
    text: str = ""  # text emitted so far (after stop-string hold-back)
    detok: Any = None
    stop_matcher: Any = None
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    overtaken: int = 0  # later arrivals admitted while this one waited (the scheduler's aging)
    seed: int = 0
    grammar: Any = None  # structured outputs: the request's runtime/grammar.py Matcher

    @property
    def fill_ids(self) -> list[int]:
        """Every token of the sequence: the prompt, then what was generated."""
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """``fill_ids[start:end]`` without building ``fill_ids`` (O(end - start))."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def token_view(self) -> TokenView:
        """``fill_ids`` read in place, not built (for readers that look only at what is new)."""
        return TokenView(self)

    @property
    def prefilling(self) -> bool:
        """True while tokens other than the newest one lack K/V (an extend step is needed).

        Invariant between steps: ``kv_len <= seq_len - 1`` (the newest token's K/V is written by
        the step that consumes it). A request with exactly one token left goes to decode.
        """
        return self.seq_len - self.kv_len > 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class RequestOutput:
    """A request's state after a step: new text and tokens since the last report, and totals."""

    rid: str
    new_text: str
    new_token_ids: list[int]
    token_ids: list[int]  # every generated token: filled when finished (empty while running)
    text: str
    finished: bool
    finish_reason: str | None
    num_output_tokens: int
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: list[dict[str, Any]]
    ttft: float | None = None
    latency: float | None = None


class TokenView(Sequence[int]):
    """A request's ``fill_ids`` without the copy: its length, an item, a slice (``Req.tokens``).
    The n-gram drafter syncs its history from it each step, reading only the new tokens."""

    __slots__ = ("req",)

    def __init__(self, req: Req) -> None:
        self.req = req

    def __len__(self) -> int:
        return self.req.seq_len

    @overload
    def __getitem__(self, i: int) -> int: ...
    @overload
    def __getitem__(self, i: slice) -> list[int]: ...
    def __getitem__(self, i: int | slice) -> int | list[int]:
        if isinstance(i, slice):
            start, stop, step = i.indices(len(self))
            if step != 1:
                raise ValueError("TokenView: slices with a step are not supported")
            return self.req.tokens(start, max(start, stop))
        j = i + len(self) if i < 0 else i
        if not 0 <= j < len(self):
            raise IndexError(i)
        return self.req.tokens(j, j + 1)[0]
