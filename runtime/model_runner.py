"""ModelRunner: turns one scheduled step into logits.

Decode steps run the decode graph of the smallest captured bucket that holds the batch, as a
CUDA-graph replay (``cuda_graph=False`` runs the graph module directly). Extend steps (chunked
prefill) run the extend graph, whose token and request dimensions are dynamic. Host work per step
is O(batch): the step's integers go to the device in one copy.

Greedy ids inside the decode graph (the ``graph_greedy`` setting: ``--graph-greedy``,
``EngineOptions.graph_greedy``, ``KILN_GRAPH_GREEDY``; read when the runner is built; default on;
+0.3% at batch 1 on the H200, ``bench/results/2026-12-03_h200_s14a_*``): the
decode graph also takes each row's argmax over the vocabulary and writes it into its own input-ids
row. A plain-greedy step (runtime/stepper.py) takes those ids instead of launching the sampler, and
the next step, when it decodes the same requests, finds its input ids in place: its input copy
skips that row and no ids copy runs. Between two replays that
leaves the input copy, the block-table update and the ids' copy back; without it the sampler's two
argmax kernels and the ids copy also run there, each waiting for the one before (about 35 us
between replays on the H200 at batch 1, ``bench/results/2026-12-02_h200_s13b_*``). Other steps pay
for one argmax they ignore.
"""

from __future__ import annotations

import bisect
import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from kiln import settings
from kiln.manifest import Manifest, VerifySpec
from kiln.ops.sampling.gumbel import argmax_rows
from kiln.runtime.kv_pool import BlockTable, KVPool
from kiln.runtime.loader import LoadedModel
from kiln.runtime.spec_tree import move_kv

if TYPE_CHECKING:
    from kiln.runtime.prefill_graphs import PrefillGraphs

Mode = Literal["decode", "extend", "verify"]  # verify: an extend step with logits at every new token


@dataclass
class StepInputs:
    """One step, as plain Python lists (built by the scheduler)."""

    mode: Mode
    input_ids: list[int]  # T
    positions: list[int]  # T
    out_slots: list[int]  # T
    req_rows: list[int]  # B
    seq_lens: list[int]  # B, KV length including this step's tokens
    extend_lens: list[int] | None = None  # B, extend and verify only
    # verify steps of token trees (runtime/spec_tree.py): T ancestor-or-self bitmasks, each token's
    # over its request's chunk (positions by depth, slots by node index); None: causal chunks
    tree_mask: list[int] | None = None

    @property
    def batch(self) -> int:
        return len(self.req_rows)


def with_drafts(step: StepInputs, draft_ids: torch.Tensor | None) -> StepInputs:
    """``step`` (a verify step whose draft tokens are placeholders) with request ``b``'s drafts
    ``draft_ids[b, :extend_lens[b] - 1]`` read to the host (waits for them): for the paths that take
    their inputs from the host (the eager verify, a tensor-parallel step's followers)."""
    if draft_ids is None:
        return step
    assert step.extend_lens is not None
    ids = list(step.input_ids)
    at = 0
    for row, e in zip(draft_ids.tolist(), step.extend_lens):
        ids[at + 1 : at + e] = row[: e - 1]
        at += e
    return replace(step, input_ids=ids)


def run_extend_graph(
    m: LoadedModel,
    pool: KVPool,
    bt: BlockTable,
    ids: list[int],
    pos: list[int],
    slots: list[int],
    rows: list[int],
    lens: list[int],
    indptr: list[int],
    every_token: bool = False,
    aux: tuple[torch.Tensor, ...] = (),
    tree_mask: list[int] | None = None,
) -> torch.Tensor:
    """One run of the shared (extend) graph over ``len(rows)`` requests' new tokens (``ids``,
    their ``pos``itions and KV ``slots``, request ``i``'s at ``indptr[i]:indptr[i + 1]``; ``lens``:
    each request's length after them): float32 logits ``[B, V]`` at each request's last new token,
    or with ``every_token`` ``[T, V]`` at every token (teacher-forced figures, runtime/accuracy.py).
    ``aux``: the artifact's aux hidden-state buffer (:func:`aux_buffer`), which the graph fills.
    ``tree_mask``: each token's ancestor bitmask in its request's chunk (token trees): the run is
    the artifact's tree graph (``Manifest.TREE_GRAPH``) instead.

    One host->device copy per dtype. Every segment starts 16-byte aligned: Triton specializes
    kernels on pointer alignment, and the artifact's kernels were built for aligned inputs."""
    dev = m.device
    t, b = len(ids), len(rows)
    n = t if every_token else b
    tp, bp = -(-max(t, n) // 2) * 2, -(-(b + 1) // 4) * 4
    h64 = torch.zeros(5 if tree_mask is not None else 4, tp, dtype=torch.int64)
    h64[:3, :t] = torch.tensor([ids, pos, slots], dtype=torch.int64)
    if tree_mask is not None:
        h64[4, :t] = torch.tensor(tree_mask, dtype=torch.int64)
    if every_token:
        h64[3, :t] = torch.arange(t)
    else:  # each request's last new token
        h64[3, :b] = torch.tensor([max(i - 1, 0) for i in indptr[1:]], dtype=torch.int64)
    h32 = torch.zeros(3, bp, dtype=torch.int32)
    h32[0, :b] = torch.tensor(rows, dtype=torch.int32)
    h32[1, :b] = torch.tensor(lens, dtype=torch.int32)
    h32[2, : b + 1] = torch.tensor(indptr, dtype=torch.int32)
    i64, i32 = h64.to(dev, non_blocking=True), h32.to(dev, non_blocking=True)
    bt.flush()
    tree = i64[4, :t] if tree_mask is not None else None
    logits = call_extend_graph(m, pool, bt, i64[:, :t], i32[:2, :b], i32[2, : b + 1], i64[3, :n], tree, aux)
    return logits[:n]


def call_extend_graph(
    m: LoadedModel,
    pool: KVPool,
    bt: BlockTable,
    i64: torch.Tensor,
    i32: torch.Tensor,
    indptr: torch.Tensor,
    out_rows: torch.Tensor,
    tree: torch.Tensor | None = None,
    aux: tuple[torch.Tensor, ...] = (),
) -> torch.Tensor:
    """One run of the artifact's extend graph on device inputs (the tree graph with ``tree``, each
    token's ancestor bitmask): ``i64`` rows ids / positions / slots ``[>= 3, T]``, ``i32`` rows
    request rows / lengths ``[2, B]``, ``indptr`` ``[B + 1]``, ``out_rows`` the tokens whose logits
    it returns. Every caller's one argument list: the eager extend, the verify graphs and the
    prefill graphs (runtime/prefill_graphs.py)."""
    graph = m.graphs[Manifest.TREE_GRAPH if tree is not None else Manifest.SHARED_GRAPH]
    return graph(
        m.weights,
        m.cos_sin,
        pool.k_cache,
        pool.v_cache,
        i64[0],
        i64[1],
        i64[2],
        bt.table,
        i32[0],
        i32[1],
        indptr,
        out_rows,
        *pool.scale_args,  # an FP8 pool's scales (compiler/context.py KV_SCALE_INPUTS)
        *(() if tree is None else (tree,)),  # compiler/context.py TREE_INPUTS, before the aux buffer
        *aux,
    )


def aux_buffer(m: LoadedModel, rows: int) -> tuple[torch.Tensor, ...]:
    """The hidden-state buffer an artifact's graphs take last (``[rows, manifest.aux_width]``
    float32), or () for an artifact without one. A target's graphs write the residual streams of
    ``manifest.aux_layers`` into it (row t's block j: token t's stream at layer ``aux_layers[j]``);
    an EAGLE-3 head's graphs read their input from it and write their output into it
    (runtime/spec_eagle.py)."""
    width = m.artifact.manifest.aux_width
    if not width:
        return ()
    return (torch.zeros(rows, width, dtype=torch.float32, device=m.device),)


def _capture_graph(run: Callable[[], torch.Tensor], pool: Any) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """``run``'s CUDA graph in ``pool`` and its output, after two warm-up runs (allocator and any
    lazy init outside the capture); on the current stream, which must not be the default one."""
    for _ in range(2):
        run()
    g = torch.cuda.CUDAGraph()
    g.capture_begin(pool=pool, capture_error_mode="thread_local")
    try:
        out = run()
    except BaseException:
        with contextlib.suppress(Exception):  # run()'s error is the one to report
            g.capture_end()
        raise
    g.capture_end()
    return g, out


class ModelRunner:
    CAPTURE_DEVICES: tuple[str, ...] = ("cuda",)  # device types whose decode steps replay CUDA graphs

    def __init__(
        self,
        model: LoadedModel,
        pool: KVPool,
        block_table: BlockTable,
        cuda_graph: bool = True,
        graph_greedy: bool | None = None,
        num_draft_tokens: int = 0,
        aux_rows: int = 0,
        tree_graphs: bool = False,
        startup_graphs: str = "all",
        prefill_graphs: bool | None = None,
    ):
        """``graph_greedy``: the module docstring's switch (None: the ``graph_greedy`` setting).
        ``num_draft_tokens``: speculative decoding is on with at most this many drafts per request:
        capture the artifact's verify graphs too (:meth:`verify`; the manifest's ``verify``), those
        of the lengths up to the first that holds that many (a step never needs a longer one).
        ``aux_rows``: the least rows of the aux buffer (:func:`aux_buffer`; else a step's most tokens).
        ``tree_graphs``: token-tree steps run on the artifact's tree graph per ``(B, k)`` verify
        shape as chains do (captured on a GPU; :meth:`verify`), where it has one.
        ``startup_graphs``: ``all`` decode buckets captured here, or only the ``smallest``: the rest
        wait in :attr:`pending_graphs` for :meth:`capture_bucket_for` / :meth:`capture_pending`
        (the engine calls them when no step is in flight), and a decode step meanwhile replays the
        smallest captured bucket that holds it, or runs its graph eagerly.
        ``prefill_graphs``: extend steps of up to 1024 tokens replay CUDA graphs of padded shapes
        (runtime/prefill_graphs.py; None: the ``prefill_graphs`` setting), on a GPU and for an
        artifact without an aux buffer; False for tensor-parallel ranks and draft models."""
        self.m = model
        self.pool = pool
        self.bt = block_table
        self.device = model.device
        m = model.artifact.manifest
        self.decode_buckets = m.decode_buckets  # ascending (checked at load)
        self.max_batch_size = m.max_batch_size  # the largest bucket
        self.use_cuda_graph = cuda_graph and self.device.type in self.CAPTURE_DEVICES
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        bmax = self.max_batch_size
        # Static decode inputs, sliced per bucket: ids/positions/slots int64, rows/lens int32, and
        # the constant request layout of a decode step (one token each): qo_indptr and logits rows.
        # Both live in one device buffer so that a step's inputs go up in one copy (bmax a multiple
        # of 4: every row starts 16-byte aligned, as the kernels were specialized for).
        bmax += -bmax % 4
        self._n64 = 3 * bmax * 8  # bytes of the int64 rows
        self._ids_bytes = bmax * 8  # the first of them: the input ids
        self._dbuf = torch.zeros(self._n64 + 2 * bmax * 4, dtype=torch.uint8, device=self.device)
        self._i64 = self._dbuf[: self._n64].view(torch.int64).view(3, bmax)
        self._i32 = self._dbuf[self._n64 :].view(torch.int32).view(2, bmax)
        self._indptr = torch.arange(bmax + 1, dtype=torch.int32, device=self.device)
        self._rows_out = torch.arange(bmax, dtype=torch.int64, device=self.device)
        self._out: dict[int, torch.Tensor] = {}
        pin = self.device.type == "cuda"
        # Pinned staging for the decode inputs, double-buffered: with overlapped decoding the next
        # step's inputs are written while the previous step's copy may still be queued.
        self._hbuf = [torch.zeros(self._dbuf.numel(), dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        # numpy views of the same memory: filling them from Python lists is several times faster
        # than torch.tensor(list) plus a copy (the per-step host cost that grows with the batch).
        self._h64np = [h[: self._n64].numpy().view(np.int64).reshape(3, bmax) for h in self._hbuf]
        self._h32np = [h[self._n64 :].numpy().view(np.int32).reshape(2, bmax) for h in self._hbuf]
        self._flip = 0
        self.graph_greedy = settings.value("graph_greedy") if graph_greedy is None else graph_greedy
        self.vocab_size = m.vocab_size
        self.last_ids: torch.Tensor | None = None  # [n] int64: the last decode step's argmax ids
        self.ids_in_place = 0  # decode steps whose input ids the previous graph left in place
        # capturing() blocks run (each stalls the step stream once; one may hold several graphs)
        self.captures = 0
        self.capture_seconds = 0.0  # and their wall seconds, warm-ups included
        # token trees: the artifact's tree graph (:meth:`verify` of a tree step)
        self.has_tree_graph = Manifest.TREE_GRAPH in model.graphs
        self._init_verify(m.verify if num_draft_tokens else None, num_draft_tokens, tree_graphs)
        vrows = self._v64.shape[1] if self._vshapes else 0
        # the aux hidden states of the last step (runtime/model_runner.py aux_buffer), or ()
        self.aux_args = aux_buffer(model, max(m.chunk_size, self.max_batch_size, vrows, aux_rows))
        if startup_graphs not in ("all", "smallest"):
            raise ValueError(f"startup_graphs is {startup_graphs!r}; it takes all or smallest")
        # decode buckets not captured yet, smallest first; their graphs' shared memory pool
        self.pending_graphs: list[int] = list(self.decode_buckets) if self.use_cuda_graph else []
        self._graph_pool: Any = None
        self._capture_stream: Any = None
        if prefill_graphs is None:
            prefill_graphs = settings.value("prefill_graphs")
        self.prefill: PrefillGraphs | None = None
        if self.use_cuda_graph and self.device.type == "cuda" and prefill_graphs and not self.aux_args:
            from kiln.runtime.prefill_graphs import PrefillGraphs  # it calls call_extend_graph

            tokens = min(m.chunk_size, m.max_seq_len, m.max_blocks * pool.page_size)
            self.prefill = PrefillGraphs(self, tokens, block_table.num_rows)
        if self.use_cuda_graph:
            first = self.decode_buckets[:1] if startup_graphs == "smallest" else self.decode_buckets
            self._capture(first, verify=True)

    # ------------------------------------------------------------------ decode
    def bucket_for(self, batch: int) -> int:
        i = bisect.bisect_left(self.decode_buckets, batch)
        if i == len(self.decode_buckets):
            raise ValueError(f"decode batch {batch} exceeds the largest bucket {self.max_batch_size}")
        return self.decode_buckets[i]

    def _decode_args(self, b: int) -> tuple:
        m = self.m
        return (
            m.weights,
            m.cos_sin,
            self.pool.k_cache,
            self.pool.v_cache,
            self._i64[0, :b],
            self._i64[1, :b],
            self._i64[2, :b],
            self.bt.table,
            self._i32[0, :b],
            self._i32[1, :b],
            self._indptr[: b + 1],
            self._rows_out[:b],
            *self.pool.scale_args,
            *self.aux_args,
        )

    def _run_decode_graph(self, b: int) -> torch.Tensor:
        graph = self.m.graphs.get(f"decode_b{b}") or self.m.graphs["model"]
        logits = graph(*self._decode_args(b))  # [b, >= V]
        if self.graph_greedy:  # into the input-ids row the graph has read already
            argmax_rows(logits[:, : self.vocab_size], out=self._i64[0, :b])
        return logits

    def bucket_pending(self, batch: int) -> bool:
        """Whether the decode graph of ``batch``'s bucket is still to be captured."""
        return (
            bool(self.pending_graphs)
            and batch <= self.max_batch_size
            and self.bucket_for(batch) in self.pending_graphs
        )

    def capture_bucket_for(self, batch: int) -> None:
        """Capture the decode graph of ``batch``'s bucket if it is still pending. Only between steps:
        the warm-ups write the static inputs, which a step in flight (or the argmax ids it left for
        the next) may still need."""
        if self.bucket_pending(batch):
            self._capture_later([self.bucket_for(batch)])

    def capture_pending(self) -> None:
        """Capture the largest pending decode graph (so smaller ones reuse its memory; between
        steps, as :meth:`capture_bucket_for`)."""
        if self.pending_graphs:
            self._capture_later(self.pending_graphs[-1:])

    def _capture_later(self, buckets: list[int]) -> None:
        """:meth:`_capture` while serving: a failure (out of memory, say) is a warning, and the
        pending graphs are given up (their steps replay a larger bucket or run eagerly)."""
        try:
            self._capture(buckets)
        except Exception as e:
            warnings.warn(
                f"kiln: capturing the decode graph of batch {buckets} failed ({type(e).__name__}: {e}); "
                "those batches run on larger captured graphs or eagerly",
                stacklevel=3,
            )
            self.pending_graphs.clear()

    def _capture(self, buckets: Sequence[int], verify: bool = False) -> None:
        """Capture the decode graphs of ``buckets`` (largest first, so that smaller graphs reuse its
        memory), then with ``verify`` every verify graph, into one pool shared by all the runner's
        graphs. Safe beside the weight stream (runtime/loader.py ``weights_placed``): each capture is
        ``thread_local`` (the readers' copies on their own threads do not break it) and nothing here
        waits for the whole device. ``CUDAGraph``'s ``capture_begin``/``capture_end`` directly:
        ``torch.cuda.graph`` synchronizes the device and empties the device and pinned-host caches
        before every capture."""
        # Padding inputs: row 0 (all-zero block table row), slot 0, seq_len 1: valid and harmless.
        self._i64.zero_()
        self._i32[0].zero_()
        self._i32[1].fill_(1)
        with self.capturing() as capture:
            for b in sorted(buckets, reverse=True):
                self.graphs[b], self._out[b] = capture(partial(self._run_decode_graph, b))
                self.pending_graphs.remove(b)
            for tree in ((False, True) if self._vtree else (False,)) if verify else ():
                graphs, outs = (self.tgraphs, self._tout) if tree else (self.vgraphs, self._vout)
                for key in sorted(self._vshapes, reverse=True):
                    self._pad_verify(*key)
                    graphs[key], outs[key] = capture(partial(self._run_verify_graph, *key, tree))

    @contextlib.contextmanager
    def capturing(
        self,
    ) -> Iterator[Callable[[Callable[[], torch.Tensor]], tuple[torch.cuda.CUDAGraph, torch.Tensor]]]:
        """Yields ``capture(run)`` (:func:`_capture_graph`): graphs into the runner's one pool, on
        its one capture stream (the allocator reuses a freed block only on the stream that freed
        it), after the work queued so far; the main stream waits for the warm-ups after, even when
        a capture failed. :meth:`_capture` and runtime/prefill_graphs.py capture through it."""
        t0 = time.perf_counter()
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
            self._capture_stream = torch.cuda.Stream(self.device)
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        try:
            with torch.cuda.stream(stream):
                yield partial(_capture_graph, pool=self._graph_pool)
        finally:
            torch.cuda.current_stream(self.device).wait_stream(stream)
            stream.synchronize()
            self.captures += 1
            self.capture_seconds += time.perf_counter() - t0

    def decode(
        self, step: StepInputs, subst: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """logits [B, V] f32 for a decode step of B requests (one token each). ``subst``
        ``(rows [k], ids [k])``: input ids still on the device (sampled by the previous step)."""
        n = step.batch
        b = self.bucket_for(n)
        if self.pending_graphs and b not in self.graphs:  # startup_graphs smallest: a larger captured one
            b = next((c for c in self.decode_buckets if c > b and c in self.graphs), b)
        self._flip ^= 1
        n64, n32 = self._h64np[self._flip], self._h32np[self._flip]
        if n < b:  # padding rows: token 0 at position 0 into the sink slot, block-table row 0, length 1
            n64[:, n:b] = 0
            n32[0, n:b] = 0
            n32[1, n:b] = 1
        n64[0, :n] = step.input_ids
        n64[1, :n] = step.positions
        n64[2, :n] = step.out_slots
        n32[0, :n] = step.req_rows
        n32[1, :n] = step.seq_lens
        in_place = self.uses_argmax_ids(subst, n)
        self.ids_in_place += in_place
        skip = self._ids_bytes if in_place else 0
        self._dbuf[skip:].copy_(self._hbuf[self._flip][skip:], non_blocking=True)  # one copy (a few KiB)
        if subst is not None and not in_place:
            if subst[0] is None:  # every row's id: the previous step's ids in order
                self._i64[0, :n].copy_(subst[1])
            else:
                self._i64[0].index_copy_(0, subst[0], subst[1])
        self.bt.flush()
        if b in self.graphs:
            self.graphs[b].replay()
            logits = self._out[b]
        else:
            logits = self._run_decode_graph(b)
        self.last_ids = self._i64[0, :n] if self.graph_greedy else None
        return logits[:n]

    # ------------------------------------------------------------------ extend
    def extend(self, step: StepInputs) -> torch.Tensor:
        """logits [B, V] f32 at the last new token of each request of an extend step.

        One new token per request (prompts the prefix cache holds but for their last token, or
        one-token prompts) is a decode step: it runs as one, on the decode graphs (a replay, and
        kernels the compile built for those buckets) instead of the extend graph at ``T == B``."""
        assert step.extend_lens is not None
        ids, pos, slots = step.input_ids, step.positions, step.out_slots
        rows, lens, ext = step.req_rows, step.seq_lens, step.extend_lens
        if len(rows) <= self.max_batch_size and all(e == 1 for e in ext):
            return self.decode(StepInputs("decode", ids, pos, slots, rows, lens))
        if self.prefill is not None:
            logits = self.prefill.run(ids, pos, slots, rows, lens, ext)
            if logits is not None:
                return logits
        indptr = [0]
        for e in ext:
            indptr.append(indptr[-1] + e)
        return run_extend_graph(
            self.m, self.pool, self.bt, ids, pos, slots, rows, lens, indptr, aux=self.aux_args
        )

    # ------------------------------------------------------------------ verify
    def _init_verify(self, spec: VerifySpec | None, num_draft_tokens: int = 0, trees: bool = False) -> None:
        """Static inputs of the verify graphs (docs/speculative.md section 2), one set for every
        ``(B, k)``: ids / positions / slots / tree masks int64 ``[4, B_max * (k_max + 1)]``, rows /
        lengths int32 ``[2, B_max]``, and the constant layout: ``qo_indptr`` steps of ``k + 1``, every
        token's logits. ``trees``: the tree graph runs token-tree steps on the same inputs."""
        self._vshapes: tuple[tuple[int, int], ...] = ()
        self.vgraphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._vout: dict[tuple[int, int], torch.Tensor] = {}
        self.tgraphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # the tree graph's, likewise
        self._tout: dict[tuple[int, int], torch.Tensor] = {}
        self._vtree = trees and spec is not None and self.has_tree_graph
        self.verify_steps = {"graph": 0, "eager": 0}  # verify steps by how they ran
        self._vfirst: list[int] = []  # the last verify step's first row of each request (verify_rows)
        self.tree_verify_steps = 0  # token-tree verify steps (on the tree graph)
        if spec is None:
            return
        i = bisect.bisect_left(spec.lengths, num_draft_tokens)
        spec = replace(spec, lengths=spec.lengths[: i + 1])  # what steps of <= num_draft_tokens drafts use
        self._vspec = spec
        self._vshapes = tuple((b, k) for b in spec.buckets for k in spec.lengths)
        bmax, kmax = spec.buckets[-1], spec.lengths[-1]
        bmax += -bmax % 4
        tmax = bmax * (kmax + 1)
        n64 = 4 * tmax * 8
        self._vbuf = torch.zeros(n64 + 2 * bmax * 4, dtype=torch.uint8, device=self.device)
        self._vhost = torch.zeros(
            self._vbuf.numel(), dtype=torch.uint8, pin_memory=self.device.type == "cuda"
        )
        self._v64 = self._vbuf[:n64].view(torch.int64).view(4, tmax)
        self._v32 = self._vbuf[n64:].view(torch.int32).view(2, bmax)
        self._vh64 = self._vhost[:n64].numpy().view(np.int64).reshape(4, tmax)
        self._vh32 = self._vhost[n64:].numpy().view(np.int32).reshape(2, bmax)
        steps = torch.arange(bmax + 1, dtype=torch.int32, device=self.device)
        self._vindptr = {k: steps * (k + 1) for k in spec.lengths}
        self._vrows = torch.arange(tmax, dtype=torch.int64, device=self.device)
        self._max_len = self.m.artifact.manifest.max_blocks * self.pool.page_size  # a block-table row's slots

    @property
    def verify_lengths(self) -> tuple[int, ...]:
        """The draft counts k this runner has verify graphs for (empty: speculation off, or an
        artifact without verify graphs)."""
        return self._vspec.lengths if self._vshapes else ()

    def verify_shape(self, step: StepInputs) -> tuple[int, int] | None:
        """The ``(B, k)`` verify graph that holds ``step`` (the smallest batch bucket, then the
        shortest length), or None: not a verify artifact, too many requests or drafts, or a
        request whose padded chunk would pass the block table's width."""
        if not self._vshapes:
            return None
        assert step.extend_lens is not None
        n, need = step.batch, max(step.extend_lens) - 1
        spec = self._vspec
        i, j = bisect.bisect_left(spec.buckets, n), bisect.bisect_left(spec.lengths, need)
        if i == len(spec.buckets) or j == len(spec.lengths):
            return None
        k = spec.lengths[j]
        ends = (s - e + k + 1 for s, e in zip(step.seq_lens, step.extend_lens))
        return (spec.buckets[i], k) if max(ends) <= self._max_len else None

    def _pad_verify(self, b: int, k: int) -> None:
        """Every row of the ``(b, k)`` shape a padding request: block-table row 0, slot 0, its
        ``k + 1`` tokens at positions 0.., each a tree node that sees itself (valid and harmless;
        before a capture)."""
        t = b * (k + 1)
        self._v64[:, :t].zero_()
        self._v64[3, :t] = 1 << (self._vrows[:t] % (k + 1))
        self._v32[0, :b].zero_()
        self._v32[1, :b].fill_(k + 1)

    def _run_verify_graph(self, b: int, k: int, tree: bool = False) -> torch.Tensor:
        t = b * (k + 1)
        mask = self._v64[3, :t] if tree else None
        return call_extend_graph(
            self.m, self.pool, self.bt, self._v64[:, :t], self._v32[:, :b], self._vindptr[k][: b + 1],
            self._vrows[:t], mask, self.aux_args,
        )  # fmt: skip

    def verify(self, step: StepInputs, draft_ids: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits ``[B, P, V]`` of a verify step (an extend step in which request ``b``
        brings its newest token and ``extend_lens[b] - 1`` drafts; ``P = max(extend_lens)``):
        ``[b, j]`` follows the request's ``j``-th new token; past its own tokens a request's rows
        are padding (its last token repeated, or a chain's unverified picks; never read by
        ``verify``). ``draft_ids`` (``[B, >= P - 1]`` on the device; ``step.input_ids`` hold
        placeholders for the drafts): a draft chain's drafts, copied into the graph's inputs on the
        device (:func:`with_drafts` on the eager path).

        On the ``(B, k)`` verify graph that holds the step (:meth:`verify_shape`; a CUDA-graph replay
        on a GPU): each request's chunk padded to ``k + 1`` tokens whose K/V go to slot 0 (the sink)
        at its last real position, padding requests on block-table row 0. Else the extend graph,
        eagerly, with logits at every new token. A step of token trees (``step.tree_mask``: the
        new tokens are each request's tree nodes in index order) runs the tree graph, row ``[b, j]``
        then node ``j``'s: on its ``(B, k)`` graph when the runner has them (``tree_graphs``; a
        padding node sees only itself), else eagerly."""
        assert step.extend_lens is not None
        self.last_ids = None
        ext = step.extend_lens
        n, p = step.batch, max(ext)
        tree = step.tree_mask is not None
        if tree and not self.has_tree_graph:
            raise ValueError(f"a token-tree verify step, but the artifact has no {Manifest.TREE_GRAPH} graph")
        shape = self.verify_shape(step) if self._vtree or not tree else None
        self.tree_verify_steps += tree
        if shape is None:
            self.verify_steps["eager"] += 1
            step = with_drafts(step, draft_ids)
            indptr = np.concatenate([[0], np.cumsum(ext)])
            logits = run_extend_graph(
                self.m,
                self.pool,
                self.bt,
                step.input_ids,
                step.positions,
                step.out_slots,
                step.req_rows,
                step.seq_lens,
                indptr.tolist(),
                every_token=True,
                aux=self.aux_args,
                tree_mask=step.tree_mask,
            )
            self._vfirst = indptr[:-1].tolist()
            # request b's rows: its j-th new token's, the last one repeated past its own tokens
            idx = indptr[:-1, None] + np.minimum(np.arange(p)[None, :], np.asarray(ext)[:, None] - 1)
            return logits[torch.from_numpy(idx.reshape(-1)).to(self.device)].view(n, p, -1)
        self.verify_steps["graph"] += 1
        b, k = shape
        self._vfirst = list(range(0, n * (k + 1), k + 1))
        t = b * (k + 1)
        h64, h32 = self._vh64, self._vh32
        e = np.asarray(ext)
        src = np.concatenate([[0], np.cumsum(e)[:-1]])[:, None] + np.minimum(np.arange(k + 1), e[:, None] - 1)
        src = src.reshape(-1)
        for row, vals in enumerate((step.input_ids, step.positions, step.out_slots)):
            h64[row, : n * (k + 1)] = np.asarray(vals, dtype=np.int64)[src]
        pad = (np.arange(k + 1)[None, :] >= e[:, None]).reshape(-1)
        h64[2, : n * (k + 1)][pad] = 0  # padding tokens' K/V into the sink slot
        h64[:3, n * (k + 1) : t] = 0
        if step.tree_mask is not None:
            # real nodes their masks, padding nodes (and padding requests) themselves alone
            h64[3, :t] = 1 << (np.arange(t) % (k + 1))
            h64[3, : n * (k + 1)][~pad] = step.tree_mask
        h32[0, :n] = step.req_rows
        h32[1, :n] = np.asarray(step.seq_lens) - e + k + 1
        h32[0, n:b] = 0
        h32[1, n:b] = k + 1
        self._vbuf.copy_(self._vhost, non_blocking=True)
        if draft_ids is not None:  # the chain's drafts after each request's newest token
            d = min(draft_ids.shape[1], k)
            self._v64[0, : n * (k + 1)].view(n, k + 1)[:, 1 : 1 + d].copy_(draft_ids[:n, :d])
        self.bt.flush()
        graphs, outs = (self.tgraphs, self._tout) if tree else (self.vgraphs, self._vout)
        if shape in graphs:
            graphs[shape].replay()
            logits = outs[shape]
        else:
            logits = self._run_verify_graph(b, k, tree)
        return logits[:t].view(b, k + 1, -1)[:n, :p]

    def verify_rows(self) -> list[int]:
        """Each request's first row in the last verify step's per-token outputs (the aux buffer's
        rows, :attr:`aux_args`); its other tokens' rows follow it."""
        return self._vfirst

    def argmax_ids(self, n: int) -> torch.Tensor:
        """The decode input row's first ``n`` ids: where the last decode graph's argmax is
        (KILN_GRAPH_GREEDY); as ``subst`` ``(None, argmax_ids(n))`` they are used in place."""
        return self._i64[0, :n]

    def uses_argmax_ids(self, subst: tuple[torch.Tensor | None, torch.Tensor] | None, n: int) -> bool:
        """Whether a decode step of ``n`` rows with ``subst`` takes the previous graph's argmax
        ids where they already are (:meth:`argmax_ids`): no copy."""
        return (
            subst is not None
            and subst[0] is None
            and subst[1].data_ptr() == self._i64.data_ptr()
            and subst[1].numel() == n
        )

    def release_graphs(self) -> None:
        """Free the captured decode graphs (their replays fall back to eager runs). A tensor-parallel
        rank calls it before leaving its NCCL group: a communicator whose collectives a live CUDA
        graph holds never finishes ``ncclCommDestroy`` (the process hung at exit on the H200 pair)."""
        if self.graphs or self.vgraphs or self.tgraphs:
            torch.cuda.synchronize(self.device)
            for g in [*self.graphs.values(), *self.vgraphs.values(), *self.tgraphs.values()]:
                g.reset()
            self.graphs.clear()
            self.vgraphs.clear()
            self.tgraphs.clear()
        if self.prefill is not None:
            self.prefill.release()
        self.pending_graphs.clear()
        self.use_cuda_graph = False

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slot ``src[i]``'s K/V to slot ``dst[i]`` in every pool tensor (K, V and an FP8 pool's
        scales), after a token-tree step (runtime/spec_tree.py ``compact_moves``, ``move_kv``)."""
        pool = self.pool
        move_kv([pool.k_cache, pool.v_cache, *pool.scale_args], src.to(self.device), dst.to(self.device))

    def forward(
        self, step: StepInputs, subst: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        self.last_ids = None
        if step.mode == "decode":
            return self.decode(step, subst)
        if step.mode == "verify":
            return self.verify(step)
        assert subst is None, "extend steps take their input ids from the host"
        return self.extend(step)
