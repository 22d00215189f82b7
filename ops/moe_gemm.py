"""Grouped GEMM over stacked expert weights, fed by the sorted, block-padded pairs of ops/moe_align.py,
and the block-size table it runs with.

``moe_gemm_launch`` computes, for every local pair ``p`` (token ``t = p // a_div``, expert ``e``),
``C[p] = epilogue(A[p // a_div] @ W[e]^T)``:

* ``A``: ``[rows, K]`` bf16/fp16/fp32, or float8_e4m3fn with per-row scales ``a_scale [rows, 1]`` f32;
* ``W``: ``[E, N_w, K]`` (``w13 [E, 2I, H]`` gate rows then up rows, or ``w2 [E, H, I]``), the
  activation dtype or float8_e4m3fn with per-output-channel scales ``w_scale [E, N_w]`` f32;
* epilogues: ``fuse_silu`` (``w13`` only): ``C [P, I] = silu(gate) * up`` from the two halves of
  ``W[e]``; ``mul_weight``: ``C [P, N] = (A W^T) * topk_weights[p]``; neither: ``C [P, N_w] = A W^T``.

Rounding follows Hugging Face's expert MLP in the activation dtype: GEMM results are rounded to it,
``silu(gate)`` is rounded, the product with ``up`` is rounded, and the down projection is rounded
before the (float32) routing weight multiplies it. FP8 products accumulate in float32 and are
scaled by ``a_scale[row] * w_scale[e, n]`` before rounding.

Kernel: one program per (row block of one expert, ``BLOCK_N`` weight rows), grouped ``GROUP_M``
row blocks at a time for L2 reuse; row blocks past ``num_padded`` exit at once (the grid is sized
by the worst case, so shapes never depend on the routing). With ``fuse_silu`` a program holds the
gate and the up accumulator (``BLOCK_N / 2`` columns each).

``moe_config(E, N, K, tokens, top_k)`` picks the blocks from the rows each expert receives on
average; ``BLOCK_M`` depends on ``(E, tokens, top_k)`` only, so both GEMMs of a layer share the
alignment. A compiler can record its output (or a measured table, see ``parse_tuning``).
"""

from __future__ import annotations

import functools
import json

import torch
import triton
import triton.language as tl

from kiln.ops.common import FP8_DTYPE, interpreting, next_pow2
from kiln.ops.quant import tl_round

# (largest average rows per expert, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages): decode-sized
# batches read each hit expert once with many narrow programs; prefill-sized ones use big tiles.
_TABLE = (
    (0.25, 64, 64, 1, 4, 4),
    (2.0, 64, 128, 1, 4, 3),
    (8.0, 128, 128, 1, 4, 2),
    (16.0, 256, 128, 16, 4, 2),
    (32.0, 128, 64, 1, 4, 3),
    (float("inf"), 256, 64, 16, 8, 3),
)


def moe_block_m(num_experts: int, tokens: int, top_k: int) -> int:
    """Row block: the power of two above the average rows per expert, within 16..128."""
    rows = tokens * top_k / max(num_experts, 1)
    return min(128, max(16, next_pow2(int(rows) + 1)))


def moe_config(num_experts: int, n: int, k: int, tokens: int, top_k: int = 8) -> dict[str, int]:
    """Launch parameters of the grouped GEMM for ``W [E, N, K]`` at ``tokens`` tokens.

    Returns ``{"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}``; ``BLOCK_N``
    counts weight rows (a fused SiLU program computes ``BLOCK_N / 2`` gate and up columns each).
    """
    rows = tokens * top_k / max(num_experts, 1)
    _, bn, bk, gm, warps, stages = next(r for r in _TABLE if rows <= r[0])
    bn = max(32, min(bn, next_pow2(n)))
    bk = max(32, min(bk, next_pow2(k)))
    return dict(
        BLOCK_M=moe_block_m(num_experts, tokens, top_k),
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=gm,
        num_warps=warps,
        num_stages=stages,
    )


@functools.lru_cache(maxsize=64)
def parse_tuning(tuning: str) -> tuple[tuple[int, dict[str, dict[str, int]]], ...]:
    """A recorded table ``{"<max tokens>": {"w13": cfg, "w2": cfg}, ...}`` (JSON) as sorted pairs.

    Each ``cfg`` has the keys of ``moe_config``; the two GEMMs of one entry must share ``BLOCK_M``.
    """
    table = []
    for key, entry in json.loads(tuning).items():
        if set(entry) != {"w13", "w2"} or entry["w13"]["BLOCK_M"] != entry["w2"]["BLOCK_M"]:
            raise ValueError(f"moe tuning entry {key!r} needs 'w13' and 'w2' configs with one BLOCK_M")
        table.append((int(key), entry))
    return tuple(sorted(table, key=lambda kv: kv[0]))


def pick_configs(
    tuning: str, num_experts: int, inter: int, hidden: int, tokens: int, top_k: int
) -> tuple[dict[str, int], dict[str, int]]:
    """(w13 config, w2 config) for ``tokens``: the recorded table's first entry with ``max tokens >=
    tokens`` (else its last), or ``moe_config`` when ``tuning`` is empty."""
    if tuning:
        table = parse_tuning(tuning)
        entry = next((e for m, e in table if tokens <= m), table[-1][1])
        return entry["w13"], entry["w2"]
    return (
        moe_config(num_experts, 2 * inter, hidden, tokens, top_k),
        moe_config(num_experts, hidden, inter, tokens, top_k),
    )


# ---- Triton kernel --------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PREC: tl.constexpr):
    if UPCAST:  # the interpreter's bf16 dot is wrong; float32 is exact for every input dtype
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _moe_gemm_kernel(
    A, A_SCALE, W, W_SCALE, C, TOPK_W, SORTED, BLOCK_EXPERT, NUM_PADDED,
    num_pairs, num_m_blocks, N, K,
    stride_am, stride_we, stride_wn, stride_se, stride_cm,
    A_DIV: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, ROUND_IN_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    # N: output columns (I when FUSE_SILU: the up rows of W start at row N)
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(num_m_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    if pid_m * BLOCK_M >= tl.load(NUM_PADDED):
        return
    e = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    pair = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BM] int32
    rmask = pair < num_pairs
    arow = (pair // A_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptr = A + arow[:, None] * stride_am + offs_k[None, :]  # [BM, BK]
    w_ptr = W + e * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]  # [BK, BN]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if FUSE_SILU:
        acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc += _dot(a, b, UPCAST, PREC)
        if FUSE_SILU:
            bu = tl.load(w_ptr + N * stride_wn, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc_up += _dot(a, bu, UPCAST, PREC)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    out_ty = C.dtype.element_ty
    if FP8:
        a_s = tl.load(A_SCALE + arow, mask=rmask, other=0.0)[:, None]  # [BM, 1]
        s_ptr = W_SCALE + e * stride_se + offs_n
        acc = acc * a_s * tl.load(s_ptr, mask=nmask, other=0.0)[None, :]
        if FUSE_SILU:
            acc_up = acc_up * a_s * tl.load(s_ptr + N, mask=nmask, other=0.0)[None, :]
    y = tl_round(acc, out_ty, ROUND_IN_F32)
    if FUSE_SILU:
        up = tl_round(acc_up, out_ty, ROUND_IN_F32)
        y = tl_round(y / (1.0 + tl.exp(-y)), out_ty, ROUND_IN_F32) * up
    if MUL_WEIGHT:
        y = y * tl.load(TOPK_W + pair, mask=rmask, other=0.0)[:, None]
    c_ptr = C + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptr, tl_round(y, out_ty, ROUND_IN_F32).to(out_ty), mask=rmask[:, None] & nmask[None, :])


def moe_gemm_launch(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    num_padded: torch.Tensor,
    cfg: dict[str, int],
    a_div: int,
    fuse_silu: bool = False,
) -> None:
    """Run the grouped GEMM into ``c`` (rows = pairs, see the module docstring).

    ``a_div``: pairs per row of ``a`` (``top_k`` when ``a`` is the token activations, 1 when it is
    the per-pair intermediate); ``topk_weights``: ``[T, k]`` f32 to apply in the epilogue, or None.
    ``cfg``: a ``moe_config`` dict whose ``BLOCK_M`` the alignment used.
    """
    num_pairs = c.shape[0]
    if num_pairs == 0:
        return
    if a.stride(1) != 1 or w.stride(2) != 1 or c.stride(1) != 1:
        raise ValueError("moe_gemm: a, w and c need a unit last stride")
    n_out = w.shape[1] // 2 if fuse_silu else w.shape[1]
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"] // (2 if fuse_silu else 1)
    num_m = sorted_ids.numel() // bm
    fp8 = w.dtype == FP8_DTYPE
    grid = (num_m * triton.cdiv(n_out, bn),)
    _moe_gemm_kernel[grid](
        a, a_scale if fp8 else a, w, w_scale if fp8 else w, c,
        topk_weights if topk_weights is not None else c,
        sorted_ids, block_expert, num_padded,
        num_pairs, num_m, n_out, w.shape[2],
        a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0) if fp8 else 0, c.stride(0),
        A_DIV=a_div, FUSE_SILU=fuse_silu, MUL_WEIGHT=topk_weights is not None, FP8=fp8,
        UPCAST=interpreting(), PREC="ieee" if a.dtype == torch.float32 else "tf32",
        ROUND_IN_F32=interpreting(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def moe_warmup_tokens(num_experts: int, inter: int, hidden: int, top_k: int, max_tokens: int) -> list[int]:
    """One token count per distinct kernel specialization of ``fused_moe`` up to ``max_tokens``
    (the block-size entry of each GEMM, and the one-program vs chunked alignment), so that a
    compile-time warm-up running these sizes leaves nothing for the runtime to compile."""
    from kiln.ops.moe_align import CHUNK

    seen: dict[tuple, int] = {}
    for t in range(1, max_tokens + 1):
        c1 = moe_config(num_experts, 2 * inter, hidden, t, top_k)
        c2 = moe_config(num_experts, hidden, inter, t, top_k)
        seen.setdefault((tuple(c1.values()), tuple(c2.values()), t * top_k <= CHUNK), t)
    return sorted(seen.values())
