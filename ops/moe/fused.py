"""Fused MoE experts: align -> grouped GEMM ``w13`` (+ SiLU-and-mul) -> grouped GEMM ``w2`` (x routing
weight) -> top-k combine, as one op.

Op ``torch.ops.kiln.fused_moe(x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale,
tuning, residual=None) -> y [T, H]`` (dtype of ``x``):

* ``x``: ``[T, H]`` bf16/fp16/fp32 (the normed activations);
* ``w13``: ``[E, 2I, H]`` gate rows then up rows per expert; ``w2``: ``[E, H, I]``; both in ``x``'s
  dtype, or float8_e4m3fn with ``w13_scale [E, 2I]`` / ``w2_scale [E, H]`` float32 per-output-channel
  scales (the activations are then quantized per token: ``x`` before ``w13``, the SiLU-and-mul
  output before ``w2``), or float8_e4m3fn with 128 x 128 block scales ``w13_scale [E, ceil(2I/128),
  ceil(H/128)]`` / ``w2_scale [E, ceil(H/128), ceil(I/128)]`` (``--quant fp8-block``, DeepSeek-V3's
  format: ``x`` and the SiLU-and-mul output are quantized per token and 128-column group by
  ops/linear/fp8_block.py's ``quantize_fp8_groups`` kernel; ``w13`` runs with the SiLU-and-mul fused,
  its output in the activation dtype; the reference is ``fp8_block_linear``'s per expert);
* ``topk_weights [T, k]`` f32, ``topk_ids [T, k]`` int32 (from ``kiln.moe_route`` / ``kiln.moe_topk``);
* ``expert_map``: ``[E_global]`` int32 global -> local slot (-1: another rank's expert, contributes
  nothing here), or None when ``topk_ids`` are local already;
* ``tuning``: "" to use ``moe_config``'s table, or a recorded table (``moe_gemm.parse_tuning``);
* ``residual``: ``[T, H]`` or None; given, the op returns ``residual + y`` (``y`` rounded, then the
  sum rounded, as a separate add would), added by the kernel that writes the top-k sum (the w2
  GEMV's last arrival, its token-group store, or the combine kernel): the residual stream of
  folded-norm graphs (``kiln compile --fold-norms``, compiler/models/base.py).

``y[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(w13[e][:I] @ x[t]) * (w13[e][I:] @ x[t]))`` over
the local experts ``e = topk_ids[t, j]``, rounded as Hugging Face's expert MLP rounds (see
ops/moe/gemm.py); the ``k`` terms are summed in float32 and rounded once.

Backend: a recorded table's entry for ``T`` may name ``"backend": "cutlass"`` (ops/moe/gemm.py
``pick_backend``): bf16 experts on an sm90 GPU then run ops/moe/cutlass.py's CUTLASS grouped GEMMs
(its library must be loaded); anything else (FP8, fp16/fp32, CPU, the interpreter) runs the Triton
kernels below with the entry's configs.

The block sizes are chosen here from the concrete ``T`` (the op is one opaque node of the exported
graph, so each decode bucket captured and each prefill chunk gets the table's entry for its size).
A config with ``BLOCK_M`` 1 (decode-sized ``T``, see ops/moe/gemm.py) runs the decode GEMV instead:
no alignment; the w2 GEMV also writes the top-k sum itself (no combine kernel): with a w2
``GROUP_M`` above 1 each program gathers a token's ``k`` experts, with ``GROUP_M`` 1 (one pair per
program) the last program of a token to finish a column block sums the ``k`` rows, in pair order,
from the per-pair output (the combine kernel does instead inside a CUDA-graph capture that
would have to allocate the arrival counters: ``COUNTERS`` below).
Intermediates: ``[T * k, I]`` (``[T * k, 2I]`` for per-channel FP8; block FP8 adds its e4m3 copy
and ``[T * k, ceil(I/128)]`` scales, and ``x``'s) and ``[T * k, H]`` (but with a w2
``GROUP_M`` above 1) in the activation dtype. The kernels here and in ops/moe/align.py and
ops/moe/gemm.py are launched with PDL (ops/common/launch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.ops.activation import silu_and_mul as activation
from kiln.ops.activation.quantize import quantize_fp8_rows_triton
from kiln.ops.common.launch import (
    ArrivalCounters,
    interpreting,
    next_pow2,
    pdl_args,
    pdl_trigger,
    pdl_wait,
)
from kiln.ops.common.op import kiln_op
from kiln.ops.common.quant import (
    FP8_DTYPE,
    QUANT_DYNAMIC,
    add_rounded,
    dequantize_fp8,
    quantize_fp8_per_token,
    tl_add_row,
    tl_round,
)
from kiln.ops.linear.fp8_block import BLOCK as FP8_BLOCK
from kiln.ops.linear.fp8_block import (
    block_grid,
    dequantize_fp8_block,
    quantize_fp8_groups,
    quantize_fp8_groups_triton,
)
from kiln.ops.moe import cutlass as moe_cutlass
from kiln.ops.moe.align import moe_align_run
from kiln.ops.moe.gemm import (
    check_config,
    moe_gemm_launch,
    moe_gemv_launch,
    pair_sum,
    pick_backend,
    pick_configs,
)

# ---- torch reference ------------------------------------------------------------------------------


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, one expert at a time (reads which experts were hit on the host)."""
    act = x.dtype
    fp8 = w13.dtype == FP8_DTYPE
    if fp8 and (w13_scale is None or w2_scale is None):
        raise ValueError("fused_moe_ref: FP8 weights need w13_scale and w2_scale")
    blocks = fp8 and w13_scale is not None and w13_scale.dim() == 3  # 128 x 128 block scales
    local = expert_map.long()[topk_ids.long()] if expert_map is not None else topk_ids.long()  # [T, k]
    if blocks:
        xin = _dequantize_groups(x)  # [T, H] f32, per token and 128-column group
    else:
        xin = dequantize_fp8(*quantize_fp8_per_token(x)) if fp8 else x.float()  # [T, H] f32
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(local[local >= 0]).tolist():
        tok, j = torch.where(local == e)
        if blocks and w13_scale is not None and w2_scale is not None:
            w13e, w2e = dequantize_fp8_block(w13[e], w13_scale[e]), dequantize_fp8_block(w2[e], w2_scale[e])
        elif fp8 and w13_scale is not None and w2_scale is not None:  # (both given: checked above)
            w13e, w2e = dequantize_fp8(w13[e], w13_scale[e]), dequantize_fp8(w2[e], w2_scale[e])
        else:
            w13e, w2e = w13[e].float(), w2[e].float()  # [2I, H], [H, I]
        gu = (xin[tok] @ w13e.t()).to(act)  # [n, 2I]
        if blocks:
            h = _dequantize_groups(activation.silu_and_mul_ref(gu))  # [n, I] f32
        elif fp8:
            h = dequantize_fp8(*activation.silu_and_mul_quant_ref(gu, None))  # [n, I] f32
        else:
            h = activation.silu_and_mul_ref(gu).float()
        y = (h @ w2e.t()).to(act).float() * topk_weights[tok, j].float()[:, None]  # [n, H]
        out.index_add_(0, tok, y.to(act).float())
    return out.to(act)


def _dequantize_groups(x: torch.Tensor) -> torch.Tensor:
    """``x [n, K]`` quantized per token and 128-column group (ops/linear/fp8_block.py), as float32."""
    xq, xs = quantize_fp8_groups(x)
    return xq.float() * xs.repeat_interleave(FP8_BLOCK, dim=-1)[:, : x.shape[1]]


def fused_moe_op_ref(
    x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale, tuning, residual=None
) -> torch.Tensor:
    """The op's reference (its parameters, typed on ``fused_moe_forward``): ``fused_moe_ref``, plus
    ``residual`` as a separate add rounds it."""
    y = fused_moe_ref(x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale)
    return y if residual is None else add_rounded(y, residual)


# ---- Triton kernels: per-token FP8 quantization of x, top-k combine ---------------------------------


@triton.jit
def _combine_kernel(
    Y2,
    IDS,
    MAP,
    OUT,
    H,
    K,
    stride_y,
    stride_o,
    HAS_MAP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RF: tl.constexpr,
    PDL: tl.constexpr,
    Z=None,  # ADD_Z: [T, H] the residual, added to the rounded sum
    stride_zm=0,
    ADD_Z: tl.constexpr = False,
):  # Y2: [T * K, H] weighted expert outputs; OUT: [T, H]
    pdl_trigger(PDL)
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    acc = pair_sum(Y2, IDS, MAP, t, K, offs, hmask, stride_y, HAS_MAP, "")
    out_ty = OUT.dtype.element_ty
    y = tl_add_row(tl_round(acc, out_ty, RF), Z, t, stride_zm, offs, hmask, ADD_Z, out_ty, RF)
    tl.store(OUT + t * stride_o + offs, y.to(out_ty), mask=hmask)


def moe_combine(
    y2: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    out: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[t] = sum_j y2[t * k + j]`` over the local pairs (Triton), float32 sum, ``y2``'s dtype out;
    ``residual [T, H]``: plus ``residual[t]``, rounded again."""
    t, k = topk_ids.shape
    h = y2.shape[1]
    if residual is not None and (residual.shape != (t, h) or residual.stride(1) != 1):
        raise ValueError(f"moe_combine: residual must be [{t}, {h}] with a unit last stride")
    out = y2.new_empty((t, h)) if out is None else out
    if t:
        block = min(next_pow2(h), 1024)
        pdl = pdl_args(y2)
        z = dict(Z=y2) if residual is None else dict(Z=residual, stride_zm=residual.stride(0), ADD_Z=True)
        _combine_kernel[(t, triton.cdiv(h, block))](
            y2, topk_ids, expert_map if expert_map is not None else topk_ids, out,
            h, k, y2.stride(0), out.stride(0), HAS_MAP=expert_map is not None, BLOCK_H=block, RF=interpreting(),
            num_warps=max(1, min(4, block // 256)), **z, **pdl,
        )  # fmt: skip
    return out


def _fused_moe_gemv(
    x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale, c1, c2, out, residual=None
):  # fmt: skip
    """The decode variant (``BLOCK_M`` 1): w13 GEMV per pair, then w2 GEMV per pair whose
    last-arriving program per token sums the top-k (the combine kernel after it inside a capture
    that would have to allocate the counters), or (w2 ``GROUP_M`` > 1) w2 GEMV + top-k sum per
    token."""
    t, h = x.shape
    i, k = w2.shape[2], topk_ids.shape[1]
    ids, emap = topk_ids, expert_map
    if w13_scale is not None and w13_scale.dim() == 3:  # block FP8: x and h quantized per 128-group
        xq, xs = quantize_fp8_groups_triton(x)
        hid = x.new_empty((t * k, i))
        moe_gemv_launch(xq, xs, w13, w13_scale, hid, None, ids, emap, c1, a_div=k, fuse_silu=True)
        a, a_scale = quantize_fp8_groups_triton(hid)
    elif w13.dtype == FP8_DTYPE:
        xq, xs = quantize_fp8_rows_triton(x)
        gu = x.new_empty((t * k, 2 * i))
        moe_gemv_launch(xq, xs, w13, w13_scale, gu, None, ids, emap, c1, a_div=k)
        a = gu.new_empty((t * k, i), dtype=FP8_DTYPE)
        a_scale = gu.new_empty((t * k, 1), dtype=torch.float32)
        activation.silu_and_mul_launch(gu, None, QUANT_DYNAMIC, a, a_scale)
    else:
        a, a_scale = x.new_empty((t * k, i)), None
        moe_gemv_launch(x, None, w13, None, a, None, ids, emap, c1, a_div=k, fuse_silu=True)
    if c2["GROUP_M"] > 1:  # the top-k sum in the w2 GEMV
        out = x.new_empty((t, h)) if out is None else out
        moe_gemv_launch(
            a, a_scale, w2, w2_scale, out, topk_weights, ids, emap, c2, a_div=1, combine=True,
            residual=residual,
        )  # fmt: skip
        return out
    y2 = x.new_empty((t * k, h))
    # None inside a capture that would have to allocate them: the combine kernel sums instead
    counters = COUNTERS.get(x.device, t * triton.cdiv(h, c2["BLOCK_N"]))
    if counters is not None:  # the last-arriving pair of each token sums its k rows
        out = x.new_empty((t, h)) if out is None else out
        moe_gemv_launch(
            a, a_scale, w2, w2_scale, y2, topk_weights, ids, emap, c2, a_div=1, sum_out=out,
            counters=counters, residual=residual,
        )  # fmt: skip
        return out
    moe_gemv_launch(a, a_scale, w2, w2_scale, y2, topk_weights, ids, emap, c2, a_div=1)
    return moe_combine(y2, topk_ids, expert_map, out, residual)


# one per (token, w2 column block) of a decode GEMV
COUNTERS = ArrivalCounters(1 << 12, "fused_moe's last-arrival top-k sum", "the combine kernel")


# ---- custom op ------------------------------------------------------------------------------------


def _check(
    x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale, tuning, residual=None
) -> None:
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"fused_moe: x must be [T, H] bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    t, h = x.shape
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[2] != h or w2.shape[1] != h:
        raise ValueError(
            f"fused_moe: need w13 [E, 2I, H={h}] and w2 [E, H={h}, I], got {tuple(w13.shape)}, {tuple(w2.shape)}"
        )
    e, i = w13.shape[0], w2.shape[2]
    if w13.shape[1] != 2 * i or w2.shape[0] != e:
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} disagree on E or I")
    fp8 = w13.dtype == FP8_DTYPE
    if w2.dtype != w13.dtype or not (fp8 or w13.dtype == x.dtype):
        raise ValueError(
            f"fused_moe: w13/w2 must both be {x.dtype} or float8_e4m3fn, got {w13.dtype}, {w2.dtype}"
        )
    blocks = (e, *block_grid(2 * i, h)), (e, *block_grid(h, i))
    if fp8 and (
        w13_scale is None
        or w2_scale is None
        or (w13_scale.shape, w2_scale.shape) not in (((e, 2 * i), (e, h)), blocks)
        or w13_scale.dtype != torch.float32
        or w2_scale.dtype != torch.float32
    ):
        raise ValueError(
            f"fused_moe: FP8 weights need float32 w13_scale [E, 2I]={(e, 2 * i)} and w2_scale [E, H]={(e, h)} "
            f"(per channel), or [E, ceil(2I/128), ceil(H/128)]={blocks[0]} and [E, ceil(H/128), "
            f"ceil(I/128)]={blocks[1]} (128 x 128 blocks)"
        )
    if topk_ids.dtype != torch.int32 or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(
            f"fused_moe: topk_ids must be [T={t}, k] int32, got {tuple(topk_ids.shape)} {topk_ids.dtype}"
        )
    if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"fused_moe: topk_weights must be float32 shaped like topk_ids, got {tuple(topk_weights.shape)}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(
            f"fused_moe: residual must be {tuple(x.shape)} {x.dtype}, "
            f"got {tuple(residual.shape)} {residual.dtype}"
        )


def _fake(x: torch.Tensor, *_) -> torch.Tensor:
    """The shape rule (``fused_moe_ref`` reads which experts were hit on the host)."""
    return torch.empty_like(x)


@kiln_op("fused_moe", ref=fused_moe_op_ref, check=_check, fake=_fake)
def fused_moe_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    tuning: str,
    residual: torch.Tensor | None = None,
    *,
    configs: tuple[dict[str, int], dict[str, int]] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed experts of a MoE layer, ``x [T, H] -> [T, H]`` (see the module docstring);
    ``residual [T, H]``: ``residual + experts(x)``, the add done by the kernel that writes the sum.
    The backend: CUTLASS where the tuning table names it and ``moe_cutlass.supports`` the call,
    else the Triton kernels in sequence (``tuning=""``: the default table's configs). Extras for
    direct callers (tests, benchmarks, the tuner): ``configs`` (w13, w2) overrides the table;
    ``out [T, H]`` receives the result (allocated when None)."""
    if pick_backend(tuning, x.shape[0]) == "cutlass" and moe_cutlass.supports(x, w13, w2):
        y = moe_cutlass.fused_moe_cutlass(x, w13, w2, topk_weights, topk_ids, expert_map)
        return y if residual is None else add_rounded(y, residual)
    residual = residual if residual is None or residual.stride(1) == 1 else residual.contiguous()
    t, h = x.shape
    e, i, k = w13.shape[0], w2.shape[2], topk_ids.shape[1]
    c1, c2 = configs or pick_configs(tuning, e, i, h, t, k)
    if c1["BLOCK_M"] != c2["BLOCK_M"]:
        raise ValueError(f"fused_moe: the two GEMM configs must share BLOCK_M, got {c1} and {c2}")
    if configs:
        check_config(c1, "fused_moe w13 config")
        check_config(c2, "fused_moe w2 config")
    x = x if x.stride(1) == 1 else x.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    if c1["BLOCK_M"] == 1:
        return _fused_moe_gemv(
            x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale, c1, c2, out,
            residual=residual,
        )  # fmt: skip
    sorted_ids, block_expert, num_padded = moe_align_run(topk_ids, expert_map, e, c1["BLOCK_M"])
    align = (sorted_ids, block_expert, num_padded)
    p = t * k
    if w13_scale is not None and w13_scale.dim() == 3:  # block FP8: x and h quantized per 128-group
        xq, xs = quantize_fp8_groups_triton(x)
        hid = x.new_empty((p, i))
        moe_gemm_launch(xq, xs, w13, w13_scale, hid, None, *align, c1, a_div=k, fuse_silu=True)
        hq, hs = quantize_fp8_groups_triton(hid)
        y2 = x.new_empty((p, h))
        moe_gemm_launch(hq, hs, w2, w2_scale, y2, topk_weights, *align, c2, a_div=1)
    elif w13.dtype == FP8_DTYPE:
        xq, xs = quantize_fp8_rows_triton(x)
        gu = x.new_empty((p, 2 * i))
        moe_gemm_launch(xq, xs, w13, w13_scale, gu, None, *align, c1, a_div=k)
        hq = gu.new_empty((p, i), dtype=FP8_DTYPE)
        hs = gu.new_empty((p, 1), dtype=torch.float32)
        activation.silu_and_mul_launch(gu, None, QUANT_DYNAMIC, hq, hs)
        y2 = x.new_empty((p, h))
        moe_gemm_launch(hq, hs, w2, w2_scale, y2, topk_weights, *align, c2, a_div=1)
    else:
        hid = x.new_empty((p, i))
        moe_gemm_launch(x, None, w13, None, hid, None, *align, c1, a_div=k, fuse_silu=True)
        y2 = x.new_empty((p, h))
        moe_gemm_launch(hid, None, w2, None, y2, topk_weights, *align, c2, a_div=1)
    return moe_combine(y2, topk_ids, expert_map, out, residual)
