"""CUDA graphs of prefill and mixed steps (the ``prefill_graphs`` setting).

An extend step (a prefill chunk, a mixed step of decode rows and a chunk) runs the artifact's
extend graph, whose token and request counts are dynamic. Run eagerly, its ~300 kernel launches
took 25.6 ms of host time for a 512-token chunk of the Llama-3.1-8B shape while its kernels needed
11.2 ms of GPU time (H100, ``bench/gpu/profile_decode.py --engine-extend 512``, s32b): the step
waited on Python, and every stream decoding beside it waited with it. Here such a step replays a
CUDA graph of the same extend graph, captured at a padded shape ``(T, B)``:

- ``T``, tokens: the step's, rounded up to :data:`TOKEN_BUCKETS` (powers of two and 1.5 times
  them, 16 to 1024: at most a third of a step is padding). Steps of more tokens run eagerly: there
  the GPU, not the launches, sets the pace.
- ``B``, requests: the step's, one more when ``T`` pads, rounded up to a power of two, at most
  the block table's rows rounded up. ``T`` is always more than ``B``: at ``T == B`` paged
  attention takes its one-token-per-request decode kernel (ops/attention/paged.py), which a
  padded step of longer chunks must not reach.
- Padding: the padding tokens are one padding request's, on block-table row 0 at position 0,
  their K/V written to slot 0 (runtime/kv_pool.py: row 0 and page 0, the sink, are never handed
  out, so it only ever touches the sink page; ``T`` at most ``max_seq_len``, so its keys stay
  inside row 0); further padding requests bring no tokens; padding logits rows read token 0. The
  real requests come first, in the step's order, so the graph's first ``b`` logits rows are the
  step's: equal to the eager run's up to rounding (the padded counts may pick another attention
  kernel, ops/attention/paged.py, and other GEMM tiles).
- ``T`` stays within the artifact's chunk (what its compile warmed up) and ``max_seq_len``.

Not with tensor parallelism (the engine turns them off): a capture that failed on one rank would
leave the ranks running different collectives. Not on a draft model's runner (runtime/spec_draft.py
keeps several steps' logits rows at once, which one graph's output buffer cannot hold).

Each shape is captured the first time a step needs it: two warm-up runs and the capture, on the
runner's capture stream into its graph pool (runtime/model_runner.py), about three eager steps once
(a capturing step took 80-86 ms on the 8B shape: a stall of every stream the first time). So the
shapes of one to three prompts' chunks, every token bucket at :data:`IDLE_REQUESTS` requests
(``B = 1``: a chunk that fills its bucket exactly, as a long prompt's middle chunks do), are captured
ahead while the engine is idle (:meth:`capture_next`, from ``Engine.idle``: a server right after
start; ``Engine.finish_captures``: the benchmarks before timing). At most :data:`MAX_GRAPHS` shapes
are kept, whose logits rows (``B x V x 4`` bytes each) take at most :data:`LOGITS_BYTES` together;
a step of another shape then runs eagerly. A failed capture (out of memory, an op that cannot be
captured) is a warning: one captured ahead ends the captures ahead, one a step needed turns the
graphs off (every later extend step runs eagerly).

Static inputs: one device buffer, int64 ids / positions / slots / logits rows ``[4, T_max]`` and
int32 rows / lengths / ``qo_indptr`` ``[3, B_max + 1]`` (``B_max + 1`` rounded to 4: each row
16-byte aligned, as the artifact's kernels were specialized), written per step by one copy from a
pinned host buffer. Two host buffers alternate, and each waits for a CUDA event recorded after its
last copy before it is written again: an extend step that samples nothing (a prompt's middle
chunk) does not wait for the device, so the host can come back to a buffer whose copy is queued.

``capture=False`` (the tests, on CPU) runs the padded shape's graph eagerly instead of capturing
it: the padding is checked where no CUDA graph exists.
"""

from __future__ import annotations

import bisect
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kiln.runtime.model_runner import call_extend_graph

if TYPE_CHECKING:
    from kiln.runtime.model_runner import ModelRunner

TOKEN_BUCKETS: tuple[int, ...] = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
MAX_GRAPHS = 80  # shapes captured at most (each about three eager steps' time, once)
LOGITS_BYTES = 1 << 29  # and the float32 logits rows all their graphs keep, together
IDLE_REQUESTS = (1, 2, 4)  # padded request counts captured ahead while idle (1-3 prompts a step)


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class PrefillGraphs:
    """The extend steps of one :class:`ModelRunner` on CUDA graphs (module docstring): :meth:`run`
    a step, or None when it must run eagerly."""

    def __init__(self, runner: ModelRunner, max_tokens: int, max_requests: int, capture: bool = True):
        self.runner = runner
        self.capture = capture
        self.tokens = tuple(t for t in TOKEN_BUCKETS if t <= max_tokens)
        self.max_requests = _pow2(max_requests)
        self.graphs: dict[tuple[int, int], Any] = {}  # (T, B) -> torch.cuda.CUDAGraph
        self.out: dict[tuple[int, int], torch.Tensor] = {}
        self.failed = False
        self.ahead_failed = False  # a capture ahead failed: no more of them
        self.steps = {"graph": 0, "eager": 0}  # extend steps by how they ran (eager: too big, cap, failure)
        tmax = self.tokens[-1] if self.tokens else 0
        bmax = self.max_requests + 1
        self._rows = (tmax, bmax + -bmax % 4)  # the int64 and int32 rows' lengths
        dev = runner.device
        self._buf = torch.zeros(self._nbytes, dtype=torch.uint8, device=dev)
        self._i64, self._i32 = self._views(self._buf)
        pin = dev.type == "cuda"
        self._host = [torch.zeros(self._nbytes, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        # each host buffer's copy, recorded: an extend step that samples nothing (a prompt's middle
        # chunk) does not wait for the device, so the host may come back to a buffer whose copy is
        # still queued
        self._copied = [torch.cuda.Event() for _ in range(2)] if pin else None
        self._hviews = [self._views(h.numpy()) for h in self._host]
        self._flip = 0

    @property
    def _nbytes(self) -> int:
        tmax, bmax = self._rows
        return 4 * tmax * 8 + 3 * bmax * 4

    def _views(self, buf: Any) -> tuple[Any, Any]:
        """The int64 ``[4, T_max]`` and int32 ``[3, B_max + 1]`` views of a uint8 buffer (a device
        tensor, or a host buffer's numpy array)."""
        (tmax, bmax), n64 = self._rows, 4 * self._rows[0] * 8
        if isinstance(buf, np.ndarray):
            return buf[:n64].view(np.int64).reshape(4, tmax), buf[n64:].view(np.int32).reshape(3, bmax)
        return buf[:n64].view(torch.int64).view(4, tmax), buf[n64:].view(torch.int32).view(3, bmax)

    @property
    def enabled(self) -> bool:
        return bool(self.tokens) and not self.failed

    def shape(self, t: int, b: int) -> tuple[int, int] | None:
        """The padded ``(T, B)`` of a step of ``t`` tokens over ``b`` requests, or None (eager)."""
        i = bisect.bisect_left(self.tokens, t)
        if i == len(self.tokens):
            return None
        T = self.tokens[i]
        B = _pow2(b + (t < T))
        while T <= B:  # T == B would take the decode kernel; pad the tokens further
            i += 1
            if i == len(self.tokens):
                return None
            T = self.tokens[i]
            B = _pow2(b + 1)
        return (T, B) if self.max_requests >= B else None

    def run(
        self,
        ids: Sequence[int],
        pos: Sequence[int],
        slots: Sequence[int],
        rows: Sequence[int],
        lens: Sequence[int],
        ext: Sequence[int],
    ) -> torch.Tensor | None:
        """float32 logits ``[b, V]`` at each request's last new token (as ``run_extend_graph``), by
        a replay of the step's padded shape; None when the step must run eagerly."""
        t, b = len(ids), len(rows)
        shape = self.shape(t, b) if self.enabled else None
        if shape is not None and shape not in self.graphs and not self._room(shape[1]):
            shape = None
        if shape is None:
            self.steps["eager"] += 1
            return None
        T, B = shape
        self._flip ^= 1
        if self._copied is not None:
            self._copied[self._flip].synchronize()  # its last copy has read it (usually long done)
        h64, h32 = self._hviews[self._flip]
        ends = np.cumsum(np.asarray(ext, dtype=np.int64))
        h64[0, :t] = ids
        h64[1, :t] = pos
        h64[2, :t] = slots
        h64[3, :b] = ends - 1  # each request's last new token
        h32[0, :b] = rows
        h32[1, :b] = lens
        h32[2, 0] = 0
        h32[2, 1 : b + 1] = ends
        self._pad(h64, h32, t, b, T, B)
        if shape not in self.graphs and not self._capture(shape):
            self.steps["eager"] += 1
            return None
        self._buf.copy_(self._host[self._flip], non_blocking=True)  # one copy (a few KiB)
        if self._copied is not None:
            self._copied[self._flip].record(torch.cuda.current_stream(self.runner.device))
        self.runner.bt.flush()
        self.steps["graph"] += 1
        if self.capture:
            self.graphs[shape].replay()
            return self.out[shape][:b]
        return self._forward(T, B)[:b]

    def pending(self) -> list[tuple[int, int]]:
        """The shapes :meth:`capture_next` would still capture ahead, smallest first."""
        if not self.enabled or self.ahead_failed:
            return []
        want = [(t, b) for t in self.tokens for b in IDLE_REQUESTS if t > b and b <= self.max_requests]
        return [s for s in want if s not in self.graphs]

    def _ahead(self) -> list[tuple[int, int]]:
        """:meth:`pending`, or none once the caps leave no room for the next shape."""
        todo = self.pending()
        return todo if todo and self._room(todo[0][1]) else []

    def ahead_left(self) -> int:
        """The shapes still to capture ahead (:meth:`pending`); 0 once the caps leave no room for
        the next one, when :meth:`capture_next` stops (so a count, at most, of those it makes)."""
        return len(self._ahead())

    def capture_next(self) -> bool:
        """Capture the next pending shape (:meth:`pending`) if the caps leave room: between steps,
        with no step in flight (its warm-ups write the static inputs). True if one was captured."""
        todo = self._ahead()
        return bool(todo) and self._capture(todo[0], ahead=True)

    def _room(self, rows: int) -> bool:
        """Whether one more graph, of ``rows`` logits rows, stays within the caps."""
        vocab = self.runner.vocab_size
        held = sum(B for _, B in self.graphs) * vocab * 4
        return len(self.graphs) < MAX_GRAPHS and held + rows * vocab * 4 <= LOGITS_BYTES

    @staticmethod
    def _pad(h64: np.ndarray, h32: np.ndarray, t: int, b: int, T: int, B: int) -> None:
        """Padding of a ``(T, B)`` shape past ``t`` real tokens of ``b`` requests (module docstring)."""
        h64[0, t:T] = 0
        h64[1, t:T] = 0  # rope's row 0: any position would do, and 0 is always in the table
        h64[2, t:T] = 0
        h64[3, b:B] = 0
        h32[0, b:B] = 0
        h32[1, b:B] = 0
        if t < T:
            h32[1, b] = T - t
        h32[2, b + 1 : B + 1] = T

    def _forward(self, T: int, B: int) -> torch.Tensor:
        """One run of the extend graph on the static inputs of shape ``(T, B)``."""
        r = self.runner
        i64, i32 = self._i64, self._i32
        return call_extend_graph(r.m, r.pool, r.bt, i64[:, :T], i32[:2, :B], i32[2, : B + 1], i64[3, :B])

    def _capture(self, shape: tuple[int, int], ahead: bool = False) -> bool:
        """Capture ``shape``'s graph (its warm-ups and capture run on padding alone); False after
        a failure, which ends the captures ahead (``ahead``) or turns the graphs off."""
        if not self.capture:
            self.graphs[shape] = None
            return True
        T, B = shape
        # padding alone, from a host array of its own (both pinned buffers may be in use: this
        # step's inputs, and the previous step's copy, which may still be queued)
        host = np.zeros(self._nbytes, dtype=np.uint8)
        self._pad(*self._views(host), 0, 0, T, B)
        self._buf.copy_(torch.from_numpy(host))  # on the step's stream: after any replay reading it
        try:
            with self.runner.capturing() as capture:
                self.graphs[shape], self.out[shape] = capture(lambda: self._forward(T, B))
        except Exception as e:
            warnings.warn(
                f"kiln: capturing the prefill graph of {T} tokens x {B} requests failed "
                f"({type(e).__name__}: {e}); "
                + ("no more shapes are captured ahead" if ahead else "extend steps run eagerly"),
                stacklevel=4,
            )
            if ahead:
                self.ahead_failed = True
            else:
                self.failed = True
            return False
        return True

    def release(self) -> None:
        """Free every captured graph (later steps run eagerly)."""
        for g in self.graphs.values():
            if g is not None:
                g.reset()
        self.graphs.clear()
        self.out.clear()
        self.failed = True
