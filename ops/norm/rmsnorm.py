"""RMSNorm, fused residual-add + RMSNorm, and their FP8 (e4m3fn) quantizing variants.

Ops (``torch.ops.kiln.*``), ``x: [T, H]`` bf16/fp16/fp32, ``w: [H]``, ``eps: float``:

* ``rmsnorm(x, w, eps) -> y [T, H]`` (dtype of ``x``)
* ``fused_add_rmsnorm(x, residual, w, eps) -> y``: ``residual += x`` in place, ``y = rmsnorm(residual)``
* ``rmsnorm_quant(x, w, eps, scale) -> (y fp8 [T, H], s)``
* ``fused_add_rmsnorm_quant(x, residual, w, eps, scale) -> (y fp8, s)``

Quantization: ``scale`` ``[1]`` float32 is static (``s`` is a copy of it); ``scale=None`` is dynamic
per token, ``s: [T, 1]`` float32 ``= max(row amax / 448, FP8_MIN_SCALE)``, the amax taken over the
normalized, weighted row. ``y_fp8 = clamp(y / s, +-448)`` (see ops/common/quant.py).

Rounding follows Hugging Face's LlamaRMSNorm exactly: the residual sum is rounded to the activation
dtype, the statistics are float32, ``normalized`` is rounded to the activation dtype before the
weight multiply, and the product is rounded again (to the activation dtype, also before quantizing).

Kernel: the rows are cut into blocks of ``ROWS`` (``LAUNCH_DEFAULTS``, overridable per launch). A row
of ``H <= MAX_BLOCK`` stays in registers: one read of x and residual, one write of the residual and
of ``y`` (and of the row's scale), whatever the quantization; a longer row is walked in chunks (sum
of squares, [amax,] then normalize and store). Quantizing costs no division per element: one IEEE
reciprocal per scale, then a multiply and one FMA refinement per element, which returns exactly the
IEEE quotient ``y / s`` (``ops/common/quant.py: tl_quantize_fp8_rcp``).

Two launches of the same kernel (``Launch`` / ``launch_config``):

* one program per block (the default, measured: bench/results/2026-11-29_h200_norm_sweep.json);
* persistent: ``min(blocks, programs_per_sm * SMs)`` programs, program ``p`` doing blocks ``p,
  p + grid, ...``; the weight is loaded once per program, and the next block's loads are put in
  flight while the current block is reduced and stored, either by Triton's software pipeliner
  (``stages`` > 1: ``tl.range(num_stages=stages)``, ``stages - 1`` blocks buffered in shared memory;
  ``stages`` 2 overlaps nothing, see ``PERSISTENT_SWEEP``) or by hand (``prefetch``: the next block's
  x/residual into registers). Meant for large T, where 4096 one-row programs pay launch ramp-up
  and tail; measured on the H200 (bench/results/2026-11-29_h200_norm_sweep_persistent_argmax.json)
  no faster than one row per program at 4096 tokens, hence opt-in. At most ``MAX_STAGES`` (3).
  Chunked rows loop plainly (no pipelining, no prefetch).

Both run the same per-row code (``_row_block`` / ``_finish_rows``) and agree bit for bit in the
interpreter (tests/ops/test_norm.py); compiled on the H200 they agree bit for bit except the FP8
dynamic output of the persistent loop, which is held to one e4m3 code (see ``MAX_STAGES``). ``T`` is not specialized: one compiled kernel per mode and launch serves every T (the
persistent loop bounds and the grid come from T at launch; CUDA-graph buckets capture their grid).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from kiln.ops.common.launch import (
    interpreting,
    next_pow2,
    pdl_args,
    pdl_trigger,
    pdl_wait,
    sm_count,
)
from kiln.ops.common.op import kiln_op
from kiln.ops.common.quant import (
    FP8_DTYPE,
    FP8_MIN_SCALE,
    QUANT_DYNAMIC,
    QUANT_NONE,
    QUANT_STATIC,
    quantize_fp8,
    tl_dynamic_scale,
    tl_quantize_fp8_rcp,
    tl_round,
)

MAX_BLOCK = 16384  # widest row kept in registers (16 warps, 32 floats per thread per operand)
CHUNK = 4096  # piece width for wider rows

# ---- torch references -----------------------------------------------------------------------------


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: ``(w * (x.f32 * rsqrt(mean(x.f32**2) + eps)).to(x.dtype))`` in ``x.dtype``."""
    xf = x.float()  # [T, H]
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (w.float() * n.to(x.dtype).float()).to(x.dtype)


def fused_add_rmsnorm_ref(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` (rounded to its dtype, in place), then ``rmsnorm_ref(residual)``."""
    residual.copy_((residual.float() + x.float()).to(residual.dtype))
    return rmsnorm_ref(residual, w, eps)


def rmsnorm_quant_ref(
    x: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rmsnorm_ref`` then FP8 (ops/common/quant.py ``quantize_fp8``)."""
    return quantize_fp8(rmsnorm_ref(x, w, eps), scale)


def fused_add_rmsnorm_quant_ref(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fused_add_rmsnorm_ref`` (``residual`` updated in place) then FP8 (``quantize_fp8``)."""
    return quantize_fp8(fused_add_rmsnorm_ref(x, residual, w, eps), scale)


# ---- Triton kernel --------------------------------------------------------------------------------


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    if MASKED:
        v = tl.load(ptrs, mask=mask, other=0.0)
    else:
        v = tl.load(ptrs)
    return v


@triton.jit
def _store(ptrs, v, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, v, mask=mask)
    else:
        tl.store(ptrs, v)


@triton.jit
def _add_res(
    x,
    r,
    r_ptrs,
    mask,
    act: tl.constexpr,
    HAS_RES: tl.constexpr,
    STORE_RES: tl.constexpr,
    MASKED: tl.constexpr,
    RF: tl.constexpr,
):
    """Loaded x (+ loaded residual r) rounded to the activation dtype, as float32; optionally stored
    to the residual."""
    v = x.to(tl.float32)
    if HAS_RES:
        v = tl_round(v + r.to(tl.float32), act, RF)
        if STORE_RES:
            _store(r_ptrs, v.to(r_ptrs.dtype.element_ty), mask, MASKED)
    return v


@triton.jit
def _load_sum(
    x_ptrs,
    r_ptrs,
    mask,
    HAS_RES: tl.constexpr,
    STORE_RES: tl.constexpr,
    MASKED: tl.constexpr,
    RF: tl.constexpr,
):
    """v = x (+ residual) rounded to the activation dtype, as float32; optionally stored to residual."""
    x = _load(x_ptrs, mask, MASKED)
    r = x
    if HAS_RES:
        r = _load(r_ptrs, mask, MASKED)
    return _add_res(x, r, r_ptrs, mask, x_ptrs.dtype.element_ty, HAS_RES, STORE_RES, MASKED, RF)


@triton.jit
def _round_mul(v, act: tl.constexpr, w, rstd, RF: tl.constexpr):
    """HF rounding: normalized -> activation dtype, times the (float32) weight -> activation dtype."""
    n = tl_round(v * rstd, act, RF)
    return tl_round(w * n, act, RF)


@triton.jit
def _normalize(v, act: tl.constexpr, w_ptrs, cmask, rstd, MASK_COLS: tl.constexpr, RF: tl.constexpr):
    """:func:`_round_mul` with the weight loaded here. ``v [ROWS, BLOCK]``, ``w_ptrs``/``cmask
    [1, BLOCK]``, ``rstd [ROWS, 1]``."""
    w = _load(w_ptrs, cmask, MASK_COLS).to(tl.float32)
    return _round_mul(v, act, w, rstd, RF)


@triton.jit
def _finish_rows(
    v,  # [ROWS, BLOCK] float32: x (+ residual), rounded
    w,  # [1, BLOCK]: the weight's pointers (W_IS_PTRS) or the weight loaded as float32
    cmask,  # [1, BLOCK] column mask
    y_ptrs,  # [ROWS, BLOCK]
    s_ptrs,  # [ROWS, 1] dynamic scales out
    rmask,  # [ROWS, 1]
    mask,  # [ROWS, BLOCK]
    H,
    eps,
    s,  # static: the scale
    inv,  # static: 1 / s
    act: tl.constexpr,
    W_IS_PTRS: tl.constexpr,
    QUANT: tl.constexpr,
    ROWS: tl.constexpr,
    MASK_COLS: tl.constexpr,
    MASKED: tl.constexpr,
    RF: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    """Rows held in registers, residual already added: rstd, normalize, [scale,] [quantize,] store."""
    rstd = 1.0 / tl.math.sqrt_rn(tl.sum(v * v, axis=1) / H + eps)  # [ROWS]
    if W_IS_PTRS:  # loaded after the reduction (the one-row-per-program kernel's order)
        y = _normalize(v, act, w, cmask, rstd[:, None], MASK_COLS, RF)  # [ROWS, BLOCK]
    else:
        y = _round_mul(v, act, w, rstd[:, None], RF)
    if QUANT == 0:
        _store(y_ptrs, y.to(y_ptrs.dtype.element_ty), mask, MASKED)
    else:
        if QUANT == 2:
            s = tl_dynamic_scale(tl.max(tl.abs(y), axis=1), MIN_SCALE)[:, None]  # [ROWS, 1]
            _store(s_ptrs, s, rmask, ROWS > 1)
            inv = tl.math.div_rn(tl.full([ROWS, 1], 1.0, tl.float32), s)
        _store(y_ptrs, tl_quantize_fp8_rcp(y, s, inv, RF), mask, MASKED)


@triton.jit
def _row_block(
    blk,  # index of the block of ROWS rows to normalize
    X, R, Y, S, W,
    w,  # [1, BLOCK]: the weight's pointers (W_IS_PTRS) or, loaded once per program, its float32 values
    cmask, cols0, T, H, stride_x, stride_r, stride_y, eps,
    s,  # static: the scale (dynamic: computed per row here)
    inv,  # static: 1 / s
    act: tl.constexpr,
    W_IS_PTRS: tl.constexpr,
    HAS_RES: tl.constexpr,
    QUANT: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,
    MASK_COLS: tl.constexpr,
    MASKED: tl.constexpr,
    RF: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):  # fmt: skip
    """The rows ``blk * ROWS + [0, ROWS)``: load, add, normalize, [quantize,] store. A row of one
    register block goes through :func:`_finish_rows`; a wider one is walked in NUM_CHUNKS pieces of
    BLOCK: sum of squares, [amax,] then residual, normalize and store (the residual is written only
    in the last pass)."""
    rows = blk * ROWS + tl.arange(0, ROWS).to(tl.int64)  # [ROWS]
    rmask = rows[:, None] < T  # [ROWS, 1]
    x_base = X + rows[:, None] * stride_x  # [ROWS, 1] row pointers
    r_base = R + rows[:, None] * stride_r
    y_base = Y + rows[:, None] * stride_y
    if NUM_CHUNKS == 1:
        mask = rmask & cmask
        v = _load_sum(x_base + cols0, r_base + cols0, mask, HAS_RES, True, MASKED, RF)
        _finish_rows(
            v, w, cmask, y_base + cols0, S + rows[:, None], rmask, mask, H, eps, s, inv,
            act, W_IS_PTRS, QUANT, ROWS, MASK_COLS, MASKED, RF, MIN_SCALE,
        )  # fmt: skip
    else:
        s_ptrs = S + rows[:, None]  # [ROWS, 1] dynamic scales out
        # pass 1: sum of squares
        acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK + cols0
            v = _load_sum(x_base + cols, r_base + cols, rmask & (cols < H), HAS_RES, False, MASKED, RF)
            acc += v * v
        rstd = (1.0 / tl.math.sqrt_rn(tl.sum(acc, axis=1) / H + eps))[:, None]  # [ROWS, 1]
        if QUANT == 2:  # pass 2: amax of the normalized row
            amax = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
            for c in range(NUM_CHUNKS):
                cols = c * BLOCK + cols0
                cmask = cols < H
                v = _load_sum(x_base + cols, r_base + cols, rmask & cmask, HAS_RES, False, MASKED, RF)
                y = _normalize(v, act, W + cols, cmask, rstd, MASK_COLS, RF)
                amax = tl.maximum(amax, tl.abs(y))
            s = tl_dynamic_scale(tl.max(amax, axis=1), MIN_SCALE)[:, None]  # [ROWS, 1]
            _store(s_ptrs, s, rmask, ROWS > 1)
            inv = tl.math.div_rn(tl.full([ROWS, 1], 1.0, tl.float32), s)
        for c in range(NUM_CHUNKS):  # last pass: residual, normalize, store
            cols = c * BLOCK + cols0
            cmask = cols < H
            mask = rmask & cmask
            v = _load_sum(x_base + cols, r_base + cols, mask, HAS_RES, True, MASKED, RF)
            y = _normalize(v, act, W + cols, cmask, rstd, MASK_COLS, RF)
            if QUANT == 0:
                _store(y_base + cols, y.to(y_base.dtype.element_ty), mask, MASKED)
            else:
                _store(y_base + cols, tl_quantize_fp8_rcp(y, s, inv, RF), mask, MASKED)


@triton.jit
def _prefetch(
    X, R, blk, cols0, cmask, T, stride_x, stride_r,
    HAS_RES: tl.constexpr,
    MASK_COLS: tl.constexpr,
    ROWS: tl.constexpr,
):  # fmt: skip
    """The raw x (and residual) of row block ``blk``; rows at or past T are masked off (not read)."""
    rows = blk * ROWS + tl.arange(0, ROWS).to(tl.int64)  # [ROWS]
    mask = rows[:, None] < T  # [ROWS, 1]
    if MASK_COLS:
        mask = mask & cmask
    x = tl.load(X + rows[:, None] * stride_x + cols0, mask=mask, other=0.0)
    r = x
    if HAS_RES:
        r = tl.load(R + rows[:, None] * stride_r + cols0, mask=mask, other=0.0)
    return x, r


@triton.jit(do_not_specialize=["T"])
def _rmsnorm_kernel(
    X,  # [T, H] input
    R,  # [T, H] residual (updated in place) or a dummy
    W,  # [H] weight
    Y,  # [T, H] output: activation dtype, or fp8 when quantizing
    S,  # dynamic: [T, 1] f32 scales out; static: [1] f32 copy of the scale out
    SCALE_IN,  # static: [1] f32 scale in
    T,
    H,
    stride_x,
    stride_r,
    stride_y,
    eps,
    HAS_RES: tl.constexpr,
    QUANT: tl.constexpr,  # 0 none, 1 static, 2 dynamic
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    ROWS: tl.constexpr,  # rows per block (a power of two)
    MASK_COLS: tl.constexpr,  # H != BLOCK * NUM_CHUNKS
    MASKED: tl.constexpr,  # MASK_COLS or ROWS > 1 (the last block may run past T)
    PERSISTENT: tl.constexpr,  # False: program i does block i; True: blocks i, i + grid, ...
    STAGES: tl.constexpr,  # persistent: > 1 pipelines the row loop (tl.range num_stages)
    PREFETCH: tl.constexpr,  # persistent, NUM_CHUNKS == 1, STAGES == 1: next block's x/r in registers
    ROUND_IN_F32: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch (ops/common/launch.py)
):
    pdl_trigger(PDL)
    pdl_wait(PDL)
    pid = tl.program_id(0)
    act = X.dtype.element_ty
    cols0 = tl.arange(0, BLOCK)[None, :]  # [1, BLOCK]
    cmask = cols0 < H
    s = 0.0  # the static scale and its reciprocal (dynamic: per row, set where computed)
    inv = 0.0
    if QUANT == 1:
        s = tl.load(SCALE_IN)
        inv = tl.math.div_rn(1.0, s)  # one IEEE reciprocal; elements multiply (tl_quantize_fp8_rcp)
        if pid == 0:
            tl.store(S, s)
    if not PERSISTENT:
        _row_block(
            pid, X, R, Y, S, W, W + cols0, cmask, cols0, T, H, stride_x, stride_r, stride_y, eps, s, inv,
            act, True, HAS_RES, QUANT, BLOCK, NUM_CHUNKS, ROWS, MASK_COLS, MASKED, ROUND_IN_F32, MIN_SCALE,
        )  # fmt: skip
    else:
        nprog = tl.num_programs(0)
        n_blk = tl.cdiv(T, ROWS)
        w = W + cols0  # chunked rows load the weight per chunk
        if NUM_CHUNKS == 1:  # once per program, not per row
            w = _load(W + cols0, cmask, MASK_COLS).to(tl.float32)
        if PREFETCH:
            tl.static_assert(NUM_CHUNKS == 1 and STAGES == 1, "rmsnorm: prefetch needs one block, 1 stage")
            xn, rn = _prefetch(X, R, pid, cols0, cmask, T, stride_x, stride_r, HAS_RES, MASK_COLS, ROWS)
            for blk in range(pid, n_blk, nprog):
                x = xn
                r = rn
                # the next block's loads go out before this one's reductions and stores
                xn, rn = _prefetch(
                    X, R, blk + nprog, cols0, cmask, T, stride_x, stride_r, HAS_RES, MASK_COLS, ROWS
                )
                rows = blk * ROWS + tl.arange(0, ROWS).to(tl.int64)  # [ROWS]
                rmask = rows[:, None] < T  # [ROWS, 1]
                mask = rmask & cmask
                r_ptrs = R + rows[:, None] * stride_r + cols0
                v = _add_res(x, r, r_ptrs, mask, act, HAS_RES, True, MASKED, ROUND_IN_F32)
                _finish_rows(
                    v, w, cmask, Y + rows[:, None] * stride_y + cols0, S + rows[:, None], rmask, mask,
                    H, eps, s, inv, act, False, QUANT, ROWS, MASK_COLS, MASKED, ROUND_IN_F32, MIN_SCALE,
                )  # fmt: skip
        elif STAGES > 1:
            for blk in tl.range(pid, n_blk, nprog, num_stages=STAGES):
                _row_block(
                    blk, X, R, Y, S, W, w, cmask, cols0, T, H, stride_x, stride_r, stride_y, eps, s, inv,
                    act, NUM_CHUNKS > 1, HAS_RES, QUANT, BLOCK, NUM_CHUNKS, ROWS, MASK_COLS, MASKED,
                    ROUND_IN_F32, MIN_SCALE,
                )  # fmt: skip
        else:
            for blk in range(pid, n_blk, nprog):
                _row_block(
                    blk, X, R, Y, S, W, w, cmask, cols0, T, H, stride_x, stride_r, stride_y, eps, s, inv,
                    act, NUM_CHUNKS > 1, HAS_RES, QUANT, BLOCK, NUM_CHUNKS, ROWS, MASK_COLS, MASKED,
                    ROUND_IN_F32, MIN_SCALE,
                )  # fmt: skip


@dataclass(frozen=True)
class Launch:
    """A launch shape. ``num_warps`` None: ~16 elements per thread. ``persistent``: ``min(blocks,
    programs_per_sm * SMs)`` programs loop over the blocks of ``rows`` rows (block ``pid``, ``pid +
    grid``, ...), with ``stages`` > 1 pipelining the loop's loads (``tl.range(num_stages=stages)``,
    ``stages - 1`` blocks of x/residual buffered in shared memory; see PERSISTENT_SWEEP on which
    stage counts overlap loads with work) or, with ``prefetch`` (``stages`` 1), the next block's
    x/residual loaded into registers before the current block is reduced and stored."""

    rows: int = 1
    num_warps: int | None = None
    persistent: bool = False
    programs_per_sm: int = 4
    stages: int = 3
    prefetch: bool = False

    def overrides(self) -> dict[str, object]:
        """This launch as ``rmsnorm_launch`` / ``launch_config`` keyword overrides."""
        kw: dict[str, object] = dict(rows_per_program=self.rows, num_warps=self.num_warps)
        if self.persistent:
            kw.update(persistent=True, programs_per_sm=self.programs_per_sm, stages=self.stages)
            kw.update(prefetch=self.prefetch)
        return kw

    @property
    def label(self) -> str:
        """``{rows}-{warps}`` or ``persistent-p{programs_per_sm}-{s{stages}|prefetch}-{warps}``."""
        if not self.persistent:
            return f"{self.rows}-{self.num_warps}"
        how = "prefetch" if self.prefetch else f"s{self.stages}"
        rows = f"-r{self.rows}" if self.rows > 1 else ""
        return f"persistent-p{self.programs_per_sm}-{how}{rows}-{self.num_warps}"


# Launch shape per quantization mode. Pick these from ``bench/test_bench_norm.py::
# test_fused_add_rmsnorm_sweep`` on the target GPU. One row per program is the measured default
# (bench/results/2026-11-29_h200_norm_sweep.json); the persistent fields (4 programs per SM, 3 stages)
# are placeholders that no GPU has measured yet, used only when a launch asks for ``persistent``.
LAUNCH_DEFAULTS: dict[int, Launch] = {
    QUANT_NONE: Launch(),
    QUANT_STATIC: Launch(),
    QUANT_DYNAMIC: Launch(),
}

# The persistent launches the sweep times at 4096 tokens (and the GPU tests check bit for bit against
# one row per program): not the full product of programs per SM x stages x warps (GPU time). Compiled
# here for sm_90 with Triton 3.9 (the H200 runs had 3.6), a pipelined loop issues its copies for
# block i + S - 1 at the end of iteration i and waits for block i + 1 at the top of the next: stages 2
# (one buffer) overlaps no load with any block's work (kept at two points to see that on the GPU);
# stages 3 keeps 1 block in flight while one is reduced (16 KiB of shared memory per
# buffered 4096-wide bf16 block of x and residual). One program per SM without pipelining or prefetch
# (one row in flight per SM) is left out. ptxas put the 8-warp loops at 48-60 registers (prefetch up
# to 77), i.e. 4-5 resident programs per SM; programs beyond what fits run as a second wave.
PERSISTENT_SWEEP: tuple[Launch, ...] = tuple(
    Launch(num_warps=w, persistent=True, programs_per_sm=p, stages=s or 1, prefetch=not s)
    for w, p, s in (
        (8, 1, 3),
        (8, 2, 1), (8, 2, 2), (8, 2, 3),
        (8, 4, 1), (8, 4, 2), (8, 4, 3),
        (4, 4, 1), (4, 4, 3),
        (4, 8, 1),
        (8, 2, 0), (8, 4, 0), (4, 4, 0),  # 0: register prefetch
    )
)  # fmt: skip
INTERPRETER_SMS = 3  # the "SM count" persistent grids use off the GPU (the interpreter tests)
# Persistent launches pipeline at most 3 deep. At 4 stages the H200 (Triton 3.6) gave FP8-dynamic
# outputs that differ from one row per program on masked (non-power-of-two) rows
# (bench/results/2026-11-29_h200_gpu_tests_s4a.log). Later runs showed the same at 3 stages and at
# 1 (no pipelining; 2026-11-29_h200_gpu_tests_s5.log), so the cause is the compiled persistent loop
# itself, not the pipeliner: the GPU test holds that output to one e4m3 code. No persistent launch
# beat one row per program in the sweep; the mode stays opt-in.
MAX_STAGES = 3


class LaunchConfig(NamedTuple):
    block: int
    chunks: int
    num_warps: int
    rows: int
    persistent: bool = False
    programs_per_sm: int = 0  # 0 unless persistent
    stages: int = 1
    prefetch: bool = False


def launch_config(
    h: int,
    max_block: int = MAX_BLOCK,
    quant: int = QUANT_NONE,
    rows_per_program: int | None = None,
    num_warps: int | None = None,
    *,
    persistent: bool | None = None,
    programs_per_sm: int | None = None,
    stages: int | None = None,
    prefetch: bool | None = None,
) -> LaunchConfig:
    """The launch for rows of ``h`` elements: ``LAUNCH_DEFAULTS[quant]``, any argument not None
    overriding its field.

    A row of ``h <= max_block`` is one register block; wider rows go in CHUNK-wide pieces (wider
    chunks spill registers), and their persistent loop is neither pipelined nor prefetched (its
    body is three loops over the chunks). The persistent fields are normalized away otherwise
    (``programs_per_sm`` 0, ``stages`` 1, no prefetch), so equal launches compile one kernel.
    """
    block = next_pow2(h)
    if block > max_block:
        block = min(CHUNK, next_pow2(max_block))
    chunks = triton.cdiv(h, block)
    d = LAUNCH_DEFAULTS[quant]
    rows = rows_per_program or d.rows
    if rows & (rows - 1):
        raise ValueError(f"rmsnorm: rows_per_program must be a power of two, got {rows}")
    warps = num_warps or d.num_warps or min(16, max(1, block // 512))
    if not (d.persistent if persistent is None else persistent):
        return LaunchConfig(block, chunks, warps, rows)
    pps = d.programs_per_sm if programs_per_sm is None else programs_per_sm
    prefetch = d.prefetch if prefetch is None else prefetch
    if stages is None:
        stages = 1 if prefetch else d.stages
    if pps < 1 or not 1 <= stages <= MAX_STAGES:
        raise ValueError(
            f"rmsnorm: programs_per_sm must be >= 1 and stages 1..{MAX_STAGES}, got {pps} and {stages}"
        )
    if prefetch and stages > 1:
        raise ValueError(
            "rmsnorm: prefetch (into registers) and stages > 1 (pipelined loads) exclude each other"
        )
    if chunks > 1:
        stages, prefetch = 1, False
    return LaunchConfig(block, chunks, warps, rows, True, pps, stages, bool(prefetch))


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; INTERPRETER_SMS off the GPU."""
    return sm_count(device, INTERPRETER_SMS)


def launch_grid(t: int, cfg: LaunchConfig, device: torch.device) -> int:
    """Programs for ``t`` rows: one per block of ``cfg.rows`` rows, or (persistent) at most
    ``programs_per_sm`` per SM, each looping over blocks ``pid, pid + grid, ...``."""
    blocks = triton.cdiv(t, cfg.rows)
    return min(blocks, cfg.programs_per_sm * num_sms(device)) if cfg.persistent else blocks


def rmsnorm_launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    w: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None,
    quant: int,
    y: torch.Tensor | None = None,
    s: torch.Tensor | None = None,
    max_block: int = MAX_BLOCK,
    **launch: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run the Triton kernel into the outputs ``y`` (and ``s`` when quantizing), allocated here when
    None; returns ``(y, s)``.

    ``x``: [T, H], any row stride; ``residual`` like ``x`` (updated in place) or None; ``quant`` one
    of QUANT_NONE / QUANT_STATIC (``scale`` [1] f32, ``s`` [1]) / QUANT_DYNAMIC (``s`` [T, 1] f32).
    ``launch``: ``launch_config``'s overrides (``rows_per_program``, ``num_warps``, ``persistent``,
    ``programs_per_sm``, ``stages``, ``prefetch``).
    """
    x = x if x.stride(-1) == 1 else x.contiguous()  # [T, H]; any row stride
    w = w.contiguous()  # [H]
    scale = scale.reshape(1) if scale is not None else None
    t, h = x.shape
    if y is None:
        y = x.new_empty((t, h), dtype=FP8_DTYPE if quant != QUANT_NONE else x.dtype)
    if s is None and quant == QUANT_DYNAMIC:
        s = x.new_empty((t, 1), dtype=torch.float32)
    elif s is None and quant == QUANT_STATIC and scale is not None:
        s = scale.clone() if t == 0 else torch.empty_like(scale)  # else the kernel copies it
    if t == 0:
        return y, s
    cfg = launch_config(h, max_block, quant, **launch)
    r = residual if residual is not None else x
    mask_cols = h != cfg.block * cfg.chunks
    pdl = pdl_args(x)
    _rmsnorm_kernel[(launch_grid(t, cfg, x.device),)](
        x, r, w, y,
        s if s is not None else y,
        scale if scale is not None else w,
        t, h, x.stride(0), r.stride(0), y.stride(0), eps,
        HAS_RES=residual is not None, QUANT=quant, BLOCK=cfg.block, NUM_CHUNKS=cfg.chunks, ROWS=cfg.rows,
        MASK_COLS=mask_cols, MASKED=mask_cols or cfg.rows > 1,
        PERSISTENT=cfg.persistent, STAGES=cfg.stages, PREFETCH=cfg.prefetch,
        ROUND_IN_F32=interpreting(), MIN_SCALE=FP8_MIN_SCALE, num_warps=cfg.num_warps,
        **pdl,
    )  # fmt: skip
    return y, s


# ---- ops -----------------------------------------------------------------------------------------


def _check(x: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor | None = None) -> None:
    """The checks of ``rmsnorm`` and ``rmsnorm_quant`` (the op's arguments)."""
    if x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"rmsnorm: x must be [T, H] bf16/fp16/fp32, got {tuple(x.shape)} {x.dtype}")
    if w.shape != (x.shape[1],):
        raise ValueError(f"rmsnorm: w must be [H={x.shape[1]}], got {tuple(w.shape)}")
    if scale is not None and (scale.numel() != 1 or scale.dtype != torch.float32):
        raise ValueError(f"rmsnorm_quant: scale must be [1] float32, got {tuple(scale.shape)} {scale.dtype}")


def _check_add(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor | None = None
) -> None:
    """The checks of ``fused_add_rmsnorm`` and ``fused_add_rmsnorm_quant``: :func:`_check`, and the
    residual, updated in place, like ``x`` with a unit last stride."""
    _check(x, w, eps, scale)
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(
            f"fused_add_rmsnorm: residual must match x ({tuple(x.shape)} {x.dtype}), "
            f"got {tuple(residual.shape)} {residual.dtype} on {residual.device}"
        )
    if residual.shape[0] > 0 and residual.stride(-1) != 1:
        raise ValueError("fused_add_rmsnorm: residual is updated in place and needs a unit last stride")


def _fp8_mode(scale: torch.Tensor | None) -> int:
    return QUANT_DYNAMIC if scale is None else QUANT_STATIC


@kiln_op("rmsnorm", ref=rmsnorm_ref, check=_check)
def rmsnorm_triton(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [T, H] -> [T, H]`` RMSNorm (see the module docstring)."""
    return rmsnorm_launch(x, None, w, eps, None, QUANT_NONE)[0]


@kiln_op("fused_add_rmsnorm", ref=fused_add_rmsnorm_ref, check=_check_add, mutates_args=("residual",))
def fused_add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place; returns ``rmsnorm(residual)`` ``[T, H]``."""
    return rmsnorm_launch(x, residual, w, eps, None, QUANT_NONE)[0]


@kiln_op("rmsnorm_quant", ref=rmsnorm_quant_ref, check=_check)
def rmsnorm_quant_triton(
    x: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm then FP8: ``(y fp8 [T, H], s)``; ``s`` is ``[T, 1]`` (dynamic) or ``[1]`` (static)."""
    return rmsnorm_launch(x, None, w, eps, scale, _fp8_mode(scale))  # type: ignore[return-value]


@kiln_op(
    "fused_add_rmsnorm_quant", ref=fused_add_rmsnorm_quant_ref, check=_check_add, mutates_args=("residual",)
)
def fused_add_rmsnorm_quant_triton(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` in place, then ``rmsnorm_quant(residual)``: ``(y fp8 [T, H], s)``."""
    return rmsnorm_launch(x, residual, w, eps, scale, _fp8_mode(scale))  # type: ignore[return-value]
