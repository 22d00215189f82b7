"""MoE token alignment: sort the (token, expert) pairs by expert and pad each expert's rows to the
grouped GEMM's ``BLOCK_M``, so that every ``BLOCK_M`` rows of the sorted list belong to one expert.

Op ``torch.ops.kiln.moe_align(topk_ids, expert_map, num_experts, block_m) -> (sorted_ids,
block_expert, num_padded)``:

* ``topk_ids``: ``[T, k]`` int32 global expert ids; pair ``p = t * k + j`` is token ``t``'s
  ``j``-th choice.
* ``expert_map``: ``[E_global]`` int32 global -> local expert slot, ``-1`` for experts this rank
  does not hold (expert parallelism), or None (ids are already local, ``0..num_experts-1``).
* ``num_experts``: local experts ``E``; ``block_m``: the GEMM's row block.
* ``sorted_ids``: ``[M]`` int32, ``M = align_rows(T * k, E, block_m)``: local pairs grouped by
  expert (expert 0 first), each group in pair order and padded to a multiple of ``block_m`` with
  the sentinel ``T * k``; every entry past ``num_padded`` is the sentinel too.
* ``block_expert``: ``[M / block_m]`` int32, the local expert of each row block; ``-1`` past
  ``num_padded``. ``num_padded``: ``[1]`` int32, rows in use (a multiple of ``block_m``).

Shapes depend on ``T``, ``k``, ``E`` and ``block_m`` only (worst case: every expert that can be
hit wastes ``block_m - 1`` rows), so the op is CUDA-graph safe; pairs routed to non-local experts
are left out (the combine skips them).

Kernels (no host sync): (1) per chunk of pairs, a per-expert count (one-hot [CHUNK, E] summed);
(2) one program: exclusive scan of the counts over chunks (up to ``SCAN_ROWS`` chunks per step),
padded expert starts, ``num_padded``, ``block_expert`` and the sentinel fill; (3) per chunk, each
pair's rank inside its expert (a cumulative sum of the one-hot) placed at ``start[e] + chunk offset
+ rank``. When every pair fits one chunk (decode: ``T * k <= 128``) a single program does all three
(one launch instead of three). Every kernel is launched with PDL (ops/common/launch.py) and waits at its
top: all it reads comes from the previous kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.common.launch import next_pow2, pdl_args, pdl_trigger, pdl_wait
from kiln.ops.common.op import DIRECT, kiln_op

CHUNK = 128  # pairs per program in the count and scatter kernels
FILL = 1024  # entries per step of the sentinel fill
SCAN_ROWS = 64  # most chunks per step of the scan over chunks (a [rows, E] tile: at most 4096 counts)


def align_rows(num_pairs, num_experts: int, block_m: int):
    """Length of ``sorted_ids``: ``num_pairs + min(E, num_pairs) * (block_m - 1)`` rounded up to
    ``block_m`` (works on SymInts: the fake implementation uses it under torch.export)."""
    hit = (
        torch.sym_min(num_pairs, num_experts)
        if isinstance(num_pairs, torch.SymInt)
        else min(num_pairs, num_experts)
    )
    rows = num_pairs + hit * (block_m - 1)
    return (rows + block_m - 1) // block_m * block_m


# ---- torch reference ------------------------------------------------------------------------------


def moe_align_ref(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch (stable sort by local expert); same outputs as the op."""
    dev = topk_ids.device
    flat = topk_ids.reshape(-1).long()  # [P]
    p = flat.numel()
    local = expert_map.long()[flat] if expert_map is not None else flat  # [P], -1: not on this rank
    key = torch.where(local >= 0, local, num_experts)
    order = torch.sort(key, stable=True).indices  # pairs grouped by expert, pair order inside
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]  # [E]
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded  # [E]
    first = torch.cumsum(counts, 0) - counts  # index in `order` of each expert's first pair
    m = align_rows(p, num_experts, block_m)
    sorted_ids = torch.full((m,), p, dtype=torch.int32, device=dev)
    n_local = int(counts.sum())
    e_of = key[order[:n_local]]  # [n_local]
    rank = torch.arange(n_local, device=dev) - first[e_of]
    sorted_ids[starts[e_of] + rank] = order[:n_local].to(torch.int32)
    total = padded.sum()
    ends = torch.cumsum(padded, 0)
    block_start = torch.arange(m // block_m, device=dev) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True).to(torch.int32)
    block_expert[block_start >= total] = -1
    return sorted_ids, block_expert, total.reshape(1).to(torch.int32)


# ---- Triton kernels -------------------------------------------------------------------------------


@triton.jit
def _local_ids(IDS, MAP, chunk, num_pairs, E, HAS_MAP: tl.constexpr, CHUNK_: tl.constexpr):
    """Pairs of one chunk: (pair index, local expert, in-use mask)."""
    pair = chunk * CHUNK_ + tl.arange(0, CHUNK_)
    inb = pair < num_pairs
    e = tl.load(IDS + pair, mask=inb, other=-1)
    if HAS_MAP:
        e = tl.load(MAP + e, mask=inb & (e >= 0), other=-1)
    return pair, e, inb & (e >= 0) & (e < E)


@triton.jit
def _onehot(e, ok, E_PAD: tl.constexpr):
    experts = tl.arange(0, E_PAD)
    return ((e[:, None] == experts[None, :]) & ok[:, None]).to(tl.int32)  # [CHUNK, E_PAD]


@triton.jit
def _layout(
    counts, SORTED, BLOCK_EXPERT, NUM_PADDED, num_pairs, E, M,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, FILL_: tl.constexpr, BLOCKS: tl.constexpr,
):  # fmt: skip
    """From the per-expert counts [E_PAD]: num_padded, block_expert and the sentinel fill of
    sorted_ids; returns each expert's padded start row."""
    emask = tl.arange(0, E_PAD) < E
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [E_PAD] inclusive
    total = tl.sum(padded, axis=0)
    tl.store(NUM_PADDED, total)
    for i in range(0, M, FILL_):
        offs = i + tl.arange(0, FILL_)
        tl.store(SORTED + offs, tl.zeros([FILL_], dtype=tl.int32) + num_pairs, mask=offs < M)
    nb = M // BLOCK_M
    for i in range(0, nb, BLOCKS):
        b = i + tl.arange(0, BLOCKS)
        row = b * BLOCK_M
        e = tl.sum(((ends[None, :] <= row[:, None]) & emask[None, :]).to(tl.int32), axis=1)  # [BLOCKS]
        tl.store(BLOCK_EXPERT + b, tl.where(row < total, e, -1), mask=b < nb)
    return ends - padded


@triton.jit
def _rank(onehot):
    """Rank of each pair among the pairs of its expert inside the chunk (pair order)."""
    return tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1  # [CHUNK]


@triton.jit
def scan_counts(COUNTS, num_chunks, E, E_PAD: tl.constexpr, ROWS: tl.constexpr):
    """``COUNTS [C, E]`` per-chunk counts -> their exclusive prefix over chunks, in place; returns
    ``(totals, experts, emask)``: the per-expert totals ``[E_PAD]`` (0 past ``E``), with the
    expert offsets ``0 .. E_PAD - 1`` and their ``< E`` mask for the caller's stores."""
    experts = tl.arange(0, E_PAD)
    emask = experts < E
    run = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(0, num_chunks, ROWS):  # ROWS chunks per step: a scan down the tile
        rows = c0 + tl.arange(0, ROWS)
        m = (rows < num_chunks)[:, None] & emask[None, :]
        ptr = COUNTS + rows[:, None] * E + experts[None, :]  # [ROWS, E_PAD]
        cnt = tl.load(ptr, mask=m, other=0)
        tl.store(ptr, run[None, :] + tl.cumsum(cnt, axis=0) - cnt, mask=m)
        run += tl.sum(cnt, axis=0)
    return run, experts, emask


@triton.jit
def sorted_rows(
    IDS, MAP, COUNTS, STARTS, chunk, num_pairs, E,
    HAS_MAP: tl.constexpr, CHUNK_: tl.constexpr, E_PAD: tl.constexpr,
):  # fmt: skip
    """One chunk's pairs and their rows in expert order: ``STARTS[e]`` + the chunk's offset in
    ``COUNTS`` (scanned) + the pair's rank in the chunk. Returns (pair, in-use mask, row)."""
    pair, e, ok = _local_ids(IDS, MAP, chunk, num_pairs, E, HAS_MAP, CHUNK_)
    es = tl.where(ok, e, 0)
    base = tl.load(STARTS + es, mask=ok, other=0) + tl.load(COUNTS + chunk * E + es, mask=ok, other=0)
    return pair, ok, base + _rank(_onehot(e, ok, E_PAD))


@triton.jit(do_not_specialize=["num_pairs", "M"])
def _align_one_program_kernel(
    IDS, MAP, SORTED, BLOCK_EXPERT, NUM_PADDED, num_pairs, E, M,
    HAS_MAP: tl.constexpr, CHUNK_: tl.constexpr, E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, FILL_: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Everything in one program when all pairs fit one chunk (decode-sized batches: one launch)."""
    pdl_trigger(PDL)
    pdl_wait(PDL)
    pair, e, ok = _local_ids(IDS, MAP, 0, num_pairs, E, HAS_MAP, CHUNK_)
    onehot = _onehot(e, ok, E_PAD)
    starts = _layout(
        tl.sum(onehot, axis=0),
        SORTED,
        BLOCK_EXPERT,
        NUM_PADDED,
        num_pairs,
        E,
        M,
        BLOCK_M,
        E_PAD,
        FILL_,
        BLOCKS,
    )
    base = tl.sum(onehot * starts[None, :], axis=1)  # [CHUNK] start row of each pair's expert
    tl.debug_barrier()  # the sentinel fill above must land before the pairs overwrite it
    tl.store(SORTED + base + _rank(onehot), pair.to(tl.int32), mask=ok)


@triton.jit(do_not_specialize=["num_pairs"])
def count_kernel(
    IDS, MAP, COUNTS, num_pairs, E,
    HAS_MAP: tl.constexpr, CHUNK_: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_trigger(PDL)
    pdl_wait(PDL)
    chunk = tl.program_id(0)
    _, e, ok = _local_ids(IDS, MAP, chunk, num_pairs, E, HAS_MAP, CHUNK_)
    experts = tl.arange(0, E_PAD)
    tl.store(COUNTS + chunk * E + experts, tl.sum(_onehot(e, ok, E_PAD), axis=0), mask=experts < E)


@triton.jit(do_not_specialize=["num_chunks", "num_pairs", "M"])
def _offsets_kernel(
    COUNTS,  # in: [C, E] per-chunk counts; out: exclusive prefix over chunks
    STARTS,  # out: [E] padded start row of each expert
    SORTED, BLOCK_EXPERT, NUM_PADDED,
    num_chunks, num_pairs, E, M,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, FILL_: tl.constexpr, BLOCKS: tl.constexpr,
    ROWS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_trigger(PDL)
    pdl_wait(PDL)
    run, experts, emask = scan_counts(COUNTS, num_chunks, E, E_PAD, ROWS)
    starts = _layout(run, SORTED, BLOCK_EXPERT, NUM_PADDED, num_pairs, E, M, BLOCK_M, E_PAD, FILL_, BLOCKS)
    tl.store(STARTS + experts, starts, mask=emask)


@triton.jit(do_not_specialize=["num_pairs"])
def scatter_kernel(
    IDS, MAP, COUNTS, STARTS, OUT, num_pairs, E,
    HAS_MAP: tl.constexpr, CHUNK_: tl.constexpr, E_PAD: tl.constexpr, PDL: tl.constexpr,
    TO_DST: tl.constexpr = False,
):  # fmt: skip
    """Each pair's row in expert order (``sorted_rows``), written as ``OUT [M] sorted_ids``:
    ``OUT[row] = pair`` (this file), or with ``TO_DST`` as ``OUT [P] dst``: ``OUT[pair] = row``, -1
    for another rank's pair (ops/moe/permute.py)."""
    pdl_trigger(PDL)
    pdl_wait(PDL)
    pair, ok, row = sorted_rows(IDS, MAP, COUNTS, STARTS, tl.program_id(0), num_pairs, E, HAS_MAP, CHUNK_, E_PAD)  # fmt: skip
    if TO_DST:
        tl.store(OUT + pair, tl.where(ok, row, -1), mask=pair < num_pairs)
    else:
        tl.store(OUT + row, pair.to(tl.int32), mask=ok)


def moe_align_launch(
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    num_experts: int,
    block_m: int,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
) -> None:
    """Run the kernels into preallocated outputs (shapes as the op's): one program when the pairs
    fit one chunk, else count / offsets / scatter."""
    p = topk_ids.numel()
    chunks = triton.cdiv(p, CHUNK)
    e_pad = next_pow2(num_experts)
    ids = topk_ids.reshape(-1)
    emap = expert_map if expert_map is not None else ids
    has_map = expert_map is not None
    m = sorted_ids.numel()
    warps = 8 if e_pad >= 128 else 4  # the [CHUNK, E_PAD] one-hot lives in registers
    layout = dict(BLOCK_M=block_m, E_PAD=e_pad, FILL_=FILL, BLOCKS=max(16, min(256, 8192 // e_pad)))
    pdl = pdl_args(topk_ids)
    if chunks <= 1:
        _align_one_program_kernel[(1,)](
            ids, emap, sorted_ids, block_expert, num_padded, p, num_experts, m,
            HAS_MAP=has_map, CHUNK_=CHUNK, **layout, num_warps=warps, **pdl,
        )  # fmt: skip
        return
    counts = topk_ids.new_empty((chunks, num_experts), dtype=torch.int32)
    starts = topk_ids.new_empty((num_experts,), dtype=torch.int32)
    count_kernel[(chunks,)](
        ids, emap, counts, p, num_experts,
        HAS_MAP=has_map, CHUNK_=CHUNK, E_PAD=e_pad, **pdl,
    )  # fmt: skip
    _offsets_kernel[(1,)](
        counts, starts, sorted_ids, block_expert, num_padded, chunks, p, num_experts, m, **layout,
        ROWS=min(SCAN_ROWS, max(1, 4096 // e_pad)),  # not from `chunks`: no specialization per T
        **pdl,
    )  # fmt: skip
    scatter_kernel[(chunks,)](
        ids, emap, counts, starts, sorted_ids, p, num_experts,
        HAS_MAP=has_map, CHUNK_=CHUNK, E_PAD=e_pad, **pdl,
    )  # fmt: skip


# ---- custom op ------------------------------------------------------------------------------------


def _check(topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, block_m: int) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype != torch.int32:
        raise ValueError(
            f"moe_align: topk_ids must be [T, k] int32, got {tuple(topk_ids.shape)} {topk_ids.dtype}"
        )
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype != torch.int32):
        raise ValueError(
            f"moe_align: expert_map must be [E_global] int32, got {tuple(expert_map.shape)} {expert_map.dtype}"
        )
    if num_experts < 1 or block_m < 1 or block_m & (block_m - 1):
        raise ValueError(
            f"moe_align: num_experts must be >= 1 and block_m a power of two, got {num_experts}, {block_m}"
        )


def align_outputs(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's outputs, uninitialized (its shape rule: the reference reads the counts on the host)."""
    m = align_rows(topk_ids.numel(), num_experts, block_m)
    return (
        topk_ids.new_empty((m,), dtype=torch.int32),
        topk_ids.new_empty((m // block_m,), dtype=torch.int32),
        topk_ids.new_empty((1,), dtype=torch.int32),
    )


@kiln_op("moe_align", ref=moe_align_ref, check=_check, fake=align_outputs)
def moe_align_triton(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``topk_ids [T, k]`` -> ``(sorted_ids [M], block_expert [M / block_m], num_padded [1])`` int32."""
    out = align_outputs(topk_ids, expert_map, num_experts, block_m)
    moe_align_launch(topk_ids.contiguous(), expert_map, num_experts, block_m, *out)
    return out


moe_align_run = DIRECT["moe_align"]  # the op's body without the dispatcher (ops/moe/fused.py calls it)
