"""MLA's per-head maps between the heads' space and the latent space, as one Triton kernel.

The absorbed form (ops/attention/mla.py) runs two per-head matmuls around attention: ``absorb_q``
(``q_nope [T, H, dn] @ w_kc [H, dn, r]``) before and ``apply_uv`` (``o_latent [T, H, r] @ w_vc [H,
r, dv]``) after. In the graphs they are cuBLAS batched matmuls over ``[H, T, .]`` transposes, each
with a layout copy: on an H100 at batch 1 (DeepSeek-V2-Lite shape) 12.5 us a layer for 2 MB of
weights, plus 6 us of copies (docs/mla.md, the batch-1 profile).

Op (``torch.ops.kiln.*``):

* ``mla_head_matmul(x [T, H, K], w [H, K, N], max_t) -> [T, H, N]``: ``out[t, h] = x[t, h] @ w[h]``
  (the kernel up to ``max_t`` tokens, decided at run time as ``kiln::linear`` does; the batched
  matmul above),
  float32 accumulation, in ``x``'s dtype, contiguous ``[T, H, N]`` (so ``apply_uv``'s result is the
  o projection's ``[T, H * dv]`` input without a copy). ``x`` may be a strided view with a unit last
  stride (``absorb_q`` passes the slice ``q[..., :dn]`` of the q projection's output as it is); ``w``
  contiguous in its last dim.

Kernel: grid ``(H, cdiv(T, BLOCK_T), cdiv(N, BLOCK_N))``; a program walks ``K`` in ``BLOCK_K``
steps, loading ``x``'s ``[BLOCK_T, BLOCK_K]`` and ``w[h]``'s ``[BLOCK_K, BLOCK_N]`` tiles into one
``tl.dot`` each (rows past ``T`` masked). At decode sizes (a few tokens) the bytes are the weights',
read once; narrow ``BLOCK_N`` columns then spread them over enough programs to keep the SMs busy.
The graphs trace it where the GEMV plan has the ``latent`` role (``kiln compile --gemv-plan
attn:1,mlp:1,router:1,latent:16``; not in the default plan until measured faster than the batched
matmul on the GPU: bench/test_bench_mla.py ``test_mla_head_matmul``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.ops.attention.decode import tl_dot
from kiln.ops.common.launch import interpreting, pdl_args, pdl_trigger, pdl_wait
from kiln.ops.common.op import kiln_op


def mla_head_matmul_ref(x: torch.Tensor, w: torch.Tensor, max_t: int = 1 << 30) -> torch.Tensor:
    """``x [T, H, K] @ w [H, K, N]`` per head, ``[T, H, N]`` contiguous (the graphs' batched matmul)."""
    return torch.bmm(x.transpose(0, 1), w).transpose(0, 1).contiguous()


def check_mla_head_matmul(x: torch.Tensor, w: torch.Tensor, *_: object) -> None:
    if x.dim() != 3 or w.dim() != 3:
        raise ValueError(
            f"mla_head_matmul: x must be [T, H, K] and w [H, K, N]; got {tuple(x.shape)} and {tuple(w.shape)}."
        )
    if x.shape[1] != w.shape[0] or x.shape[2] != w.shape[1]:
        raise ValueError(
            f"mla_head_matmul: x {tuple(x.shape)} and w {tuple(w.shape)} disagree: x's heads and width "
            "must be w's first two dims."
        )
    if x.dtype != w.dtype:
        raise ValueError(f"mla_head_matmul: x is {x.dtype} but w is {w.dtype}; pass one dtype.")
    if x.stride(2) != 1 or w.stride(2) != 1:
        raise ValueError("mla_head_matmul: x and w need a unit stride in their last dim (.contiguous()).")


@dataclass(frozen=True)
class HeadMatmulConfig:
    block_t: int
    block_k: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2


def default_head_matmul_config(tokens: int) -> HeadMatmulConfig:
    """Narrow column blocks for a few tokens (the weights spread over many programs), wider tiles
    for prefill chunks; untuned on a GPU yet."""
    if interpreting():
        return HeadMatmulConfig(block_t=16, block_k=16, block_n=16, num_warps=1, num_stages=1)
    if tokens <= 16:
        return HeadMatmulConfig(block_t=16, block_k=128, block_n=32)
    return HeadMatmulConfig(block_t=64, block_k=64, block_n=128, num_stages=3)


@triton.jit
def _head_matmul_kernel(
    X, W, O, T, K, N, stride_xt, stride_xh, stride_wh, stride_wk, stride_ot, stride_oh,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr,
    UPCAST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl_trigger(PDL)
    pdl_wait(PDL)
    h = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    rmask = rows < T
    cmask = cols < N
    x_rows = X + h * stride_xh + rows.to(tl.int64)[:, None] * stride_xt  # [BLOCK_T, 1]
    w_cols = W + h * stride_wh + cols[None, :]  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_T, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + ks
        kmask = kk < K
        x = tl.load(x_rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_cols + kk[:, None] * stride_wk, mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc += tl_dot(x, w, PREC, UPCAST)
    o = O + rows.to(tl.int64)[:, None] * stride_ot + h * stride_oh + cols[None, :]
    tl.store(o, acc.to(O.dtype.element_ty), mask=rmask[:, None] & cmask[None, :])


@kiln_op("mla_head_matmul", ref=mla_head_matmul_ref, check=check_mla_head_matmul)
def mla_head_matmul_triton(
    x: torch.Tensor, w: torch.Tensor, max_t: int = 1 << 30, *, config: HeadMatmulConfig | None = None
) -> torch.Tensor:
    """``x [T, H, K] @ w [H, K, N]`` per head (module docstring): the kernel up to ``max_t`` tokens
    (the GEMV plan's ``latent`` role), the batched matmul above; ``config`` overrides the launch
    (benchmarks sweep it)."""
    t, heads, k = x.shape
    n = w.shape[2]
    if t > max_t:
        return mla_head_matmul_ref(x, w)
    out = torch.empty(t, heads, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    cfg = config or default_head_matmul_config(t)
    grid = (heads, triton.cdiv(t, cfg.block_t), triton.cdiv(n, cfg.block_n))
    _head_matmul_kernel[grid](
        x, w, out, t, k, n, x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        BLOCK_T=cfg.block_t, BLOCK_K=cfg.block_k, BLOCK_N=cfg.block_n,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", UPCAST=interpreting(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_args(x),
    )  # fmt: skip
    return out
