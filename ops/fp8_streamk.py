"""Stream-K FP8 GEMM: the product of ops/fp8_gemm.py spread evenly over the GPU's SMs.

Why: at prefill-sized M (256..512 tokens) an output tile grid rarely matches the SM count. At
M = 256, N = K = 4096, 128 x 128 tiles give 64 programs for 132 SMs, and 64 x 128 tiles 128, yet
6144 columns give 192 (1.45 waves). Stream-K instead cuts the whole iteration space
(``tiles x K steps``, tile-major) into one contiguous range per program, with ``programs = min(SMs,
iterations)``, so every SM does the same work to within one ``BLOCK_K`` step.

Kernel: program ``p`` runs iterations ``[p * W // G, (p + 1) * W // G)`` (``W`` iterations, ``G``
programs), one tile segment at a time, operands through TMA descriptors. A segment that covers a
whole tile runs the epilogue itself. A partial one writes its float32 accumulator to the workspace
``P [2 * G, BLOCK_M, BLOCK_N]``: slot ``2p`` if the segment starts where ``p``'s range starts, else
``2p + 1`` (a program has at most two partial segments: its first and its last). It then bumps the
tile's arrival counter. The tile's programs are ``q_first..q_last``, computed from the partition
alone. The last to arrive sums their segments in K order, which makes the result deterministic. It
resets the counter and runs the epilogue. The memory-ordering argument is the one of
ops/decode_attention.py's fused merge. No program waits for another, so nothing depends on
co-residency.

``fp8_gemm(..., config)`` with ``config.streamk`` (``p`` in the config string) launches this when
TMA can describe both operands; otherwise the tiled kernel runs with the same blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kiln.ops.fp8_gemm import COUNTERS, Fp8GemmConfig, _epilogue, _mma


@triton.jit
def _owner(x, G, W):
    """The program whose range holds iteration ``x``: the largest ``q`` with ``q * W // G <= x``."""
    return ((x + 1) * G - 1) // W


@triton.jit(do_not_specialize=["M"])
def _fp8_streamk_kernel(
    A_DESC,  # TMA descriptor of A [M, K] fp8, block [BLOCK_M, BLOCK_K]
    B_DESC,  # TMA descriptor of B [N, K] fp8, block [BLOCK_N, BLOCK_K]
    C,  # [M, N] out
    A_SCALE,  # [M] f32 (stride_as 1) or [1] (stride_as 0)
    B_SCALE,  # [N] f32
    BIAS,  # [N] or a dummy
    P,  # [2 * G, BLOCK_M, BLOCK_N] f32 partial segments
    CNT,  # [>= tiles] int32 arrival counters, all zero
    M,
    N,
    K,
    stride_cm,
    stride_as,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FAST_ACCUM: tl.constexpr,
    UPCAST: tl.constexpr,
    ROUND_IN_F32: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)
    G = tl.num_programs(0).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    steps = tl.cdiv(K, BLOCK_K)  # iterations per tile
    W = (num_m * num_n).to(tl.int64) * steps
    start = p * W // G
    end = (p + 1) * W // G
    blk = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [BM, BN]
    per_group = GROUP_M * num_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # One flat loop over the range (a nested tile / K-step loop is not software-pipelined across
    # tiles): the segment ends at the tile's last K step or at the range's end.
    for i in range(start, end):
        tile = i // steps
        tile_lo = tile * steps
        ki = (i - tile_lo).to(tl.int32)
        first_m = (tile // per_group) * GROUP_M
        group_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = (first_m + (tile % per_group) % group_m).to(tl.int32)
        pid_n = ((tile % per_group) // group_m).to(tl.int32)
        a = A_DESC.load([pid_m * BLOCK_M, ki * BLOCK_K])  # [BM, BK]
        b = B_DESC.load([pid_n * BLOCK_N, ki * BLOCK_K])  # [BN, BK]
        acc = _mma(a, b.T, acc, FAST_ACCUM, UPCAST, BLOCK_K)
        if ki == steps - 1 or i == end - 1:
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            if ki == steps - 1 and start <= tile_lo:  # the whole tile
                _epilogue(acc, offs_m, offs_n, M, N, C, A_SCALE, B_SCALE, BIAS, stride_cm, stride_as, HAS_BIAS, ROUND_IN_F32)  # fmt: skip
            else:
                slot = 2 * p + tl.where(start >= tile_lo, 0, 1)  # the segment starts the range?
                tl.store(P + slot * (BLOCK_M * BLOCK_N) + blk, acc)
                q_first = _owner(tile_lo, G, W)
                q_last = _owner(tile_lo + steps - 1, G, W)
                tl.debug_barrier()
                old = tl.atomic_add(CNT + tile, 1, sem="acq_rel", scope="gpu")
                if old == q_last - q_first:  # the tile's last segment to arrive
                    tl.atomic_xchg(CNT + tile, 0, sem="relaxed", scope="gpu")
                    tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                    for q in range(q_first, q_last + 1):  # K order
                        q_slot = 2 * q + tl.where(q * W // G >= tile_lo, 0, 1)
                        tot += tl.load(P + q_slot * (BLOCK_M * BLOCK_N) + blk, cache_modifier=".cg")
                    _epilogue(tot, offs_m, offs_n, M, N, C, A_SCALE, B_SCALE, BIAS, stride_cm, stride_as, HAS_BIAS, ROUND_IN_F32)  # fmt: skip
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


def streamk_programs(m: int, n: int, k: int, cfg: Fp8GemmConfig, sms: int) -> int:
    """``G``: one program per SM, fewer when there are fewer iterations (every range non-empty)."""
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    return max(1, min(sms, tiles * triton.cdiv(k, cfg.block_k)))


def fp8_streamk_launch(
    x: torch.Tensor,  # [M, K] fp8, TMA-describable (ops/fp8_gemm.tma_ok)
    xs: torch.Tensor,  # [M] or [1] f32
    stride_as: int,
    w: torch.Tensor,  # [N, K] fp8
    ws: torch.Tensor,  # [N] f32
    bias: torch.Tensor | None,
    y: torch.Tensor,  # [M, N] out
    cfg: Fp8GemmConfig,
    sms: int,
    fast_accum: bool,
    interp: bool,
) -> bool:
    """Launch the stream-K kernel into ``y``; False (nothing launched) when the tile counters cannot
    be had (first call inside a CUDA-graph capture), for the caller's tiled fallback."""
    m, k = x.shape
    n = w.shape[0]
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    counters = COUNTERS.get(x.device, tiles)
    if counters is None:
        return False
    g = streamk_programs(m, n, k, cfg, sms)
    part = torch.empty((2 * g, cfg.block_m, cfg.block_n), dtype=torch.float32, device=x.device)
    a_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [cfg.block_m, cfg.block_k])
    b_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [cfg.block_n, cfg.block_k])
    _fp8_streamk_kernel[(g,)](
        a_desc, b_desc, y, xs, ws, bias if bias is not None else ws, part, counters,
        m, n, k, y.stride(0), stride_as,
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m, FAST_ACCUM=fast_accum, UPCAST=interp, ROUND_IN_F32=interp,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return True
