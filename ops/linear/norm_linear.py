"""RMSNorm fused into the GEMV that consumes it: one launch instead of a norm kernel then a GEMV.

``torch.ops.kiln.rmsnorm_linear(x, residual, norm_w, eps, w, bias, max_m, gate_up, normed)
-> (y, h, xn)``

* ``x [T, K]`` (the block's output, or the embeddings), ``residual [T, K]`` or None, ``norm_w [K]``,
  ``w [N, K]`` (``[2I, K]`` gate rows then up rows with ``gate_up``), ``bias [N]`` or None; one
  bf16/fp16/fp32 dtype.
* ``h = x + residual`` rounded (the next residual; ``[0, K]`` when ``residual`` is None, the caller
  keeps ``x``), ``xn = rmsnorm(h) * norm_w`` with ops/norm/rmsnorm.py's roundings, ``y = linear(xn, w, bias)``
  (``silu(gate) * up`` with ``gate_up``, as ``kiln::linear_silu_mul``). ``xn`` is returned only with
  ``normed`` (``[0, K]`` otherwise): the MoE router's GEMV hands it to the experts.

Unlike ``fused_add_rmsnorm`` nothing is updated in place: the GEMV's programs all read the residual
row while some of them write ``h``, so ``h`` is a new tensor.

Paths, picked at call time like ``kiln::linear``:

* ``T == 1`` where ``kiln::linear`` would take the GEMV (``1 <= T <= max_m``, the ``gemv`` setting
  on, a device that runs Triton): ops/linear/gemv.py's CUDA-core kernel with ``norm`` (``NormIn``). Its
  programs accumulate ``sum(h * h)`` beside ``W @ (norm_w * h)`` in the same K loop and scale by
  ``rstd`` at the end, so the norm costs extra loads of two ``K`` rows from L2 but no pass and no
  launch; each program then writes a ``cdiv(K, programs)`` chunk of ``h`` (and ``xn``). The
  product sees ``norm_w * h * rstd`` unrounded, so ``y`` differs from the two-launch path by
  rounding only (the same at float32).
* otherwise: ``fused_add_rmsnorm`` (on a copy of the residual) or ``rmsnorm``, then ``kiln::linear``
  / ``kiln::linear_silu_mul`` on ``xn``: what the layers ran before, plus the copy (a torch kernel,
  not PDL-launched) at every prefill chunk and decode batch above 1. On a device that does not run
  Triton (CPU): ``rmsnorm_linear_ref``, the same computation in torch.

In the MoE layer the router logits come from the unrounded normalized row while the experts get
the rounded one (as prefill's router does), so a near-tie in the top-k may pick differently from the
two-launch path.

The graphs of the residual-stream layout (``kiln compile --fold-norms``, compiler/models/base.py) call it,
with no residual (the projection before added it) and ``folded``: the norm weight is folded into
``w`` at load time, so the one-token GEMV loads only ``x`` and accumulates ``sum(x * x)`` beside
the product. (The unfolded layers' use, the GEMV plan's ``norm`` role, measured no faster on the
H200 and was removed: docs/decode_budget.md, "Removed variants"; the op still takes a residual
and an unfolded weight.)
"""

from __future__ import annotations

import torch

from kiln.ops.common.op import DIRECT, kiln_op
from kiln.ops.linear.gemv import NormIn, gemv, linear_ref, linear_silu_mul_ref, use_gemv
from kiln.ops.norm.rmsnorm import rmsnorm_ref

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # of x, w, norm_w (one of them)


def rmsnorm_linear_ref(
    x, residual, norm_w, eps, w, bias, max_m, gate_up, normed, folded=False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unfused computation in torch (the op on CPU): ``h = x + residual`` rounded (``[0, K]``
    without a residual), ``xn = rmsnorm_ref(h)`` (of ``x`` without a residual), ``y`` from
    ``linear_ref`` / ``linear_silu_mul_ref`` (``gate_up``) on ``xn``; ``xn`` is returned only with
    ``normed``. ``norm_w`` applies whatever ``folded`` says (module docstring)."""
    k = x.shape[1]
    h = x.new_empty((0, k)) if residual is None else (residual.float() + x.float()).to(residual.dtype)
    xn = rmsnorm_ref(x if residual is None else h, norm_w, eps)
    y = (linear_silu_mul_ref if gate_up else linear_ref)(xn, w, bias, max_m)
    return y, h, xn if normed else x.new_empty((0, k))


def _check(x: torch.Tensor, residual, norm_w, eps, w, bias, max_m, gate_up, *_) -> None:
    dt = x.dtype
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1] or dt not in DTYPES:
        raise ValueError(
            f"rmsnorm_linear: need x [T, K] and w [N, K] (bf16/fp16/fp32), got {tuple(x.shape)} {dt} "
            f"and {tuple(w.shape)}"
        )
    k = x.shape[1]
    if w.dtype != dt or norm_w.shape != (k,) or norm_w.dtype != dt:
        raise ValueError(f"rmsnorm_linear: w and norm_w [{k}] must share x's dtype {dt}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != dt):
        raise ValueError(
            f"rmsnorm_linear: residual must match x, got {tuple(residual.shape)} {residual.dtype}"
        )
    if bias is not None and bias.shape != (w.shape[0],):
        raise ValueError(f"rmsnorm_linear: bias must be [{w.shape[0]}], got {tuple(bias.shape)}")
    if gate_up and w.shape[0] % 2:
        raise ValueError(f"rmsnorm_linear: gate_up needs 2I weight rows, got {w.shape[0]}")


@kiln_op("rmsnorm_linear", ref=rmsnorm_linear_ref, check=_check)
def rmsnorm_linear_forward(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_w: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    max_m: int,
    gate_up: bool,
    normed: bool,
    folded: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(linear(rmsnorm(x + residual)), x + residual, rmsnorm(x + residual))`` (see the module docstring).
    ``folded``: ``norm_w`` is all ones, its values folded into ``w``'s columns (weights/fold.py);
    the one-token GEMV then never loads it, while the other paths still multiply by it (so the two
    agree only when it is ones, as the load-time fold makes it). Off the GEMV: the norm op then
    ``kiln::linear`` / ``kiln::linear_silu_mul`` (their bodies), as :func:`rmsnorm_linear_ref`."""
    t, k = x.shape
    if t == 1 and use_gemv(x, w, max_m):
        x = x if x.stride(1) == 1 else x.contiguous()
        res = None if residual is None else (residual if residual.stride(1) == 1 else residual.contiguous())
        h = x.new_empty((1 if res is not None else 0, k))
        xn = x.new_empty((1 if normed else 0, k))
        g = None if folded else norm_w.contiguous()
        spec = NormIn(g, eps, res, h if res is not None else None, xn if normed else None)
        y = gemv(x, w, bias, gate_up=gate_up, norm=spec)
        return y, h, xn
    if residual is None:
        h = x.new_empty((0, k))
        xn = DIRECT["rmsnorm"](x, norm_w, eps)
    else:
        h = residual.clone(memory_format=torch.contiguous_format)  # a copy launch: see the docstring
        xn = DIRECT["fused_add_rmsnorm"](x, h, norm_w, eps)  # h += x in place
    y = DIRECT["linear_silu_mul" if gate_up else "linear"](xn, w, bias, max_m)
    return y, h, xn if normed else x.new_empty((0, k))
