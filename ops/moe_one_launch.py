"""The decode MoE experts in one launch: w13 GEMV + SiLU, then w2 GEMV + top-k sum, ticket-ordered.

At one token the two expert GEMVs of ``fused_moe`` (ops/moe.py ``_fused_moe_gemv``) run their own
kernels 23.6 us per layer, while the op chained in a CUDA graph takes 28.5 us
(``bench/results/2026-11-30_h200_s10f_*``): the difference is the boundary between the two
launches and w2's ramp. Here one launch does both:

* every program takes a ticket (an atomic counter, after its PDL wait) and the ticket picks its
  tile, in the order w13(0), w13(1), w2(0), w13(2), w2(1), ..., w2(P-1): pair ``g``'s w2 tiles
  come after pair ``g + 1``'s w13 tiles, so w2 streams while w13 is still running;
* a w13 tile (``BLOCK_N1`` columns of pair ``g``'s SiLU-and-mul output, as ``moe_gemv`` rounds
  it) stores its columns, then bumps the pair's arrival count;
* a w2 tile loads its ``[BLOCK_N2, I]`` weight slab first, then waits until all of its pair's
  w13 tiles have arrived, then reads the pair's activation row, applies the routing weight, and
  the last of the token's ``k`` pairs to arrive on these columns sums them and adds the residual
  (ops/moe_gemm.py ``sum_last``, as the two-launch path does; the w2 dot sums the whole row at
  once, so its rounding can differ from that path's in the last bit).

A waiting program only waits on tiles with lower tickets, and those tickets were taken by programs
that are running and never wait on a higher ticket, so the launch finishes however the GPU
schedules its programs. The last program to finish resets the counters (ticket, finish count,
per-pair arrivals) to zero for the next call; the per-column sum counters reset themselves.

Scope: bf16/fp16/fp32 experts, no expert map, a token count up to ``MAX_TOKENS``, an intermediate
size up to ``EARLY_MAX_K`` (the w2 slab stays in registers), unit last strides. With the switch on
it also takes precedence over ``KILN_MOE_COMBINE`` and a ``configs`` override. The counters are one
buffer per device: two streams must not run it at the same time. Switch: ``KILN_MOE_ONE_LAUNCH=1``
(read at call time, so at capture for decode graphs); off by default, and not yet measured on the
GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kiln.ops.common import ArrivalCounters, interpreting, next_pow2, pdl_args, pdl_trigger, pdl_wait
from kiln.ops.moe_gemm import EARLY_MAX_K, _epilogue, sum_last

MAX_TOKENS = 4
BLOCK_N1 = 8  # w13 tile: activation columns (16 weight rows, gate and up: the 1-token rung's w13)
BLOCK_N2 = 16  # w2 tile: output columns; the slab [BLOCK_N2, I] sits in registers through the wait
LINE = 32  # int32 counters per 128-byte line: each pair's arrival count on a line of its own
BLOCK_K1 = 256
COUNTERS = ArrivalCounters(1 << 12, "fused_moe's one-launch experts", "the two-launch path")


def one_launch_requested() -> bool:
    """``KILN_MOE_ONE_LAUNCH`` (read at call time): ``1`` on, ``0`` off (default)."""
    value = os.environ.get("KILN_MOE_ONE_LAUNCH", "0")
    if value not in ("0", "1"):
        raise ValueError(f"KILN_MOE_ONE_LAUNCH must be 0 or 1, got {value!r}")
    return value == "1"


@triton.jit
def tile_of(tk, P, NB13, NB2):
    """Ticket ``tk`` -> (is a w2 tile, pair, column block). Round 0 is pair 0's w13 tiles; round
    ``r`` in 1..P-1 is pair r's w13 tiles, then pair r-1's w2 tiles; round P is pair P-1's w2 tiles."""
    first = tk < NB13
    u = tk - NB13
    r = tl.where(first, 0, u // (NB13 + NB2) + 1)
    pos = tl.where(first, tk, u % (NB13 + NB2))
    last = r >= P
    is_w2 = (tk >= NB13) & (last | (pos >= NB13))
    pair = tl.where(is_w2, r - 1, r)
    col = tl.where(is_w2 & (r < P), pos - NB13, pos)
    return is_w2, pair, col


@triton.jit(do_not_specialize=["P", "NB13", "NB2"])
def _moe_one_launch_kernel(
    X, W13, W2, ACT, Y2, TOPK_W, IDS, OUT, CNT, SUMCNT, Z,
    I, H, stride_x, stride_w13e, stride_w13n, stride_w2e, stride_w2n, stride_o, stride_zm, P, NB13, NB2,
    K: tl.constexpr, BLOCK_N1: tl.constexpr, BLOCK_N2: tl.constexpr, BLOCK_K1: tl.constexpr,
    IP: tl.constexpr, P_PAD: tl.constexpr, LINE: tl.constexpr, ADD_Z: tl.constexpr,
    ROUND_IN_F32: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    # X [T, H]; W13 [E, 2I, H]; W2 [E, H, I]; ACT [P, I], Y2 [P, H] scratch (x's dtype);
    # TOPK_W [P] f32, IDS [P] int32 (P = T * K pairs); OUT [T, H]; CNT: int32, [0] the ticket,
    # [1] the finish count, [LINE * (1 + g)] pair g's w13 arrivals; SUMCNT: [T * NB2] int32 (the
    # top-k sums' last arrivals). P, NB13, NB2 are runtime values: one compiled kernel per shape.
    pdl_trigger(PDL)
    pdl_wait(PDL)  # the routing (IDS, TOPK_W) and x come from earlier kernels; the counters too
    tk = tl.atomic_add(CNT, 1, sem="relaxed", scope="gpu")
    is_w2, g, col = tile_of(tk, P, NB13, NB2)
    e = tl.load(IDS + g).to(tl.int64)
    out_ty = ACT.dtype.element_ty
    if is_w2:  # w2: the slab first, then the pair's activation row once all its w13 tiles arrived
        offs_n = col * BLOCK_N2 + tl.arange(0, BLOCK_N2)
        nmask = offs_n < H
        offs_i = tl.arange(0, IP)
        imask = offs_i < I
        slab = W2 + e * stride_w2e + offs_n[:, None].to(tl.int64) * stride_w2n + offs_i[None, :]
        w = tl.load(slab, mask=nmask[:, None] & imask[None, :], other=0.0)  # [BLOCK_N2, IP]
        arrived = tl.atomic_add(CNT + LINE * (1 + g), 0, sem="acquire", scope="gpu")
        while arrived < NB13:
            arrived = tl.atomic_add(CNT + LINE * (1 + g), 0, sem="acquire", scope="gpu")
        a = tl.load(ACT + g * I + offs_i, mask=imask, other=0.0, cache_modifier=".cg").to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
        tw = tl.load(TOPK_W + g)
        y = _epilogue(acc, acc, acc, acc, acc, tw, out_ty, False, True, False, ROUND_IN_F32)
        tl.store(Y2 + g * H + offs_n, y.to(out_ty), mask=nmask)
        tok = g // K
        sum_last(Y2, IDS, IDS, OUT, SUMCNT + tok * NB2 + col, tok, offs_n, nmask, H, stride_o, K, False,
                 ROUND_IN_F32, Z, stride_zm, ADD_Z)  # fmt: skip
    else:  # w13: act[g, cols] = silu(x W_gate^T) * (x W_up^T), rounded as moe_gemv rounds
        offs_n1 = col * BLOCK_N1 + tl.arange(0, BLOCK_N1)
        nmask1 = offs_n1 < I
        offs_k1 = tl.arange(0, BLOCK_K1)
        w_ptr1 = W13 + e * stride_w13e + offs_n1[:, None].to(tl.int64) * stride_w13n + offs_k1[None, :]
        a_ptr1 = X + (g // K) * stride_x + offs_k1
        acc1 = tl.zeros([BLOCK_N1], dtype=tl.float32)
        acc_up1 = tl.zeros([BLOCK_N1], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K1):
            kmask1 = offs_k1 < H - k0
            a1 = tl.load(a_ptr1 + k0, mask=kmask1, other=0.0).to(tl.float32)
            m1 = nmask1[:, None] & kmask1[None, :]
            acc1 += tl.sum(tl.load(w_ptr1 + k0, mask=m1, other=0.0).to(tl.float32) * a1[None, :], axis=1)
            wu1 = tl.load(w_ptr1 + I * stride_w13n + k0, mask=m1, other=0.0).to(tl.float32)
            acc_up1 += tl.sum(wu1 * a1[None, :], axis=1)
        y1 = _epilogue(acc1, acc_up1, acc1, acc1, acc1, acc1, out_ty, True, False, False, ROUND_IN_F32)
        tl.store(ACT + g * I + offs_n1, y1.to(out_ty), mask=nmask1)
        # release: the barrier puts every thread's stores before the scalar atomic (cumulative)
        tl.debug_barrier()
        tl.atomic_add(CNT + LINE * (1 + g), 1, sem="release", scope="gpu")
    # the last program to finish zeroes the ticket, the finish count and the pair arrivals
    tl.debug_barrier()
    done = tl.atomic_add(CNT + 1, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(0) - 1:
        offs_p = tl.arange(0, P_PAD)
        tl.store(CNT + LINE * (1 + offs_p), tl.zeros_like(offs_p), mask=offs_p < P)
        tl.store(CNT + 1, 0)
        tl.store(CNT, 0)


def moe_one_launch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
) -> bool:
    """Run the experts of ``x [T, H]`` into ``out [T, H]`` (plus ``residual``) in one launch; False
    (nothing run) where the path does not apply: see the module docstring, or no counters inside a
    capture that would allocate them."""
    t, h = x.shape
    k = topk_ids.shape[1]
    i = w2.shape[2]
    if (
        not 1 <= t <= MAX_TOKENS
        or i > EARLY_MAX_K  # the w2 slab [BLOCK_N2, next_pow2(I)] must fit in registers
        or w13.dtype != x.dtype
        or w2.dtype != x.dtype
        or any(a.stride(-1) != 1 for a in (x, w13, w2, out) + ((residual,) if residual is not None else ()))
    ):
        return False
    p = t * k
    nb13, nb2 = triton.cdiv(i, BLOCK_N1), triton.cdiv(h, BLOCK_N2)
    sums_at = LINE * (1 + MAX_TOKENS * k)  # after the ticket, finish count and per-pair lines
    cnt = COUNTERS.get(x.device, sums_at + MAX_TOKENS * nb2)
    if cnt is None:
        return False
    act = x.new_empty((p, i))
    y2 = x.new_empty((p, h))
    ids = topk_ids.reshape(-1)
    tw = topk_weights.reshape(-1)
    z = residual if residual is not None else out
    _moe_one_launch_kernel[(p * (nb13 + nb2),)](
        x, w13, w2, act, y2, tw, ids, out, cnt, cnt[sums_at:], z,
        i, h, x.stride(0), w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1), out.stride(0),
        z.stride(0), p, nb13, nb2, K=k, BLOCK_N1=BLOCK_N1, BLOCK_N2=BLOCK_N2,
        BLOCK_K1=min(BLOCK_K1, next_pow2(h)), IP=next_pow2(i), P_PAD=next_pow2(MAX_TOKENS * k), LINE=LINE,
        ADD_Z=residual is not None, ROUND_IN_F32=interpreting(), num_warps=4, **pdl_args(x),
    )  # fmt: skip
    return True


__all__ = ["MAX_TOKENS", "moe_one_launch", "one_launch_requested"]
