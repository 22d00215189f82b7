"""Grouped GEMM over stacked expert weights, in two variants, and the launch table they run with.

Both compute, for every local pair ``p = t * k + j`` (token ``t``'s ``j``-th expert ``e``),
``C[p] = epilogue(A[p // a_div] @ W[e]^T)``:

* ``A``: ``[rows, K]`` bf16/fp16/fp32, or float8_e4m3fn with per-row scales ``a_scale [rows, 1]`` f32
  (per-channel weights) or per-row 128-column-group scales ``a_scale [rows, ceil(K/128)]`` f32 (block
  weights: ops/linear/fp8_block.py ``quantize_fp8_groups``);
* ``W``: ``[E, N_w, K]`` (``w13 [E, 2I, H]`` gate rows then up rows, or ``w2 [E, H, I]``), the
  activation dtype or float8_e4m3fn with per-output-channel scales ``w_scale [E, N_w]`` f32, or
  128 x 128 block scales ``w_scale [E, ceil(N_w/128), ceil(K/128)]`` f32 (``--quant fp8-block``);
* epilogues: ``fuse_silu`` (``w13`` only): ``C [P, I] = silu(gate) * up`` from the two halves of
  ``W[e]``; ``mul_weight``: ``C [P, N] = (A W^T) * topk_weights[p]``; neither: ``C [P, N_w] = A W^T``.

Rounding follows Hugging Face's expert MLP in the activation dtype: GEMM results are rounded to it,
``silu(gate)`` is rounded, the product with ``up`` is rounded, and the down projection is rounded
before the (float32) routing weight multiplies it. FP8 products accumulate in float32 and are
scaled by ``a_scale[row] * w_scale[e, n]`` before rounding. Block scales (``BLOCK_SCALE``, picked by
a 3-D ``w_scale``): the K loop runs in steps of one 128-column group whatever the config's
``BLOCK_K``, and each step's FP8 product is promoted into the float32 accumulator times
``a_scale[row, k // 128] * w_scale[e, n // 128, k // 128]`` (as ops/linear/fp8_block.py does; the
up half of ``w13`` reads the scale rows of its own rows ``I + n``, so any ``I`` works here, the pack
needing ``I`` a multiple of 128 only to keep a checkpoint's blocks); the epilogue then rounds as
above.

Variants (``BLOCK_M`` of the launch config picks one):

* grouped GEMM (``BLOCK_M`` 16..256, ``moe_gemm_launch``): fed by the sorted, block-padded pairs of
  ops/moe/align.py; one program per (row block of one expert, ``BLOCK_N`` weight rows), grouped
  ``GROUP_M`` row blocks at a time for L2 reuse; row blocks past ``num_padded`` exit at once (the
  grid is sized by the worst case, so shapes never depend on the routing). With ``fuse_silu`` a
  program holds the gate and the up accumulator (``BLOCK_N / 2`` columns each).
* decode GEMV (``BLOCK_M == 1``, ``moe_gemv_launch``): for a few tokens, where every hit expert
  gets about one row and the op is a read of the hit experts' weights. No alignment: a program
  reads its pair's expert straight from ``topk_ids`` and computes ``BLOCK_N`` weight rows of it with
  vector loads along K and float32 multiply-adds (no padded MMA rows), its K loop software-pipelined
  ``num_stages`` deep; the grid is (pairs, N / BLOCK_N), so even one token has hundreds of
  programs. With ``combine`` a program takes all ``k`` pairs of one token (``BLOCK_N`` output
  columns of each: one gathered ``[k * BLOCK_N, BLOCK_K]`` weight tile per step, and as many
  activation rows) and writes the top-k sum straight to ``out [T, H]`` (the w2 GEMM and
  ops/moe/fused.py's combine in one kernel). ``GROUP_M`` picks that for the w2 GEMV: 1 = one pair per
  program, the last to finish of a token's ``k`` programs on a column block summing their rows
  (``sum_out``; the combine kernel after it where the arrival counters cannot be had, ops/moe/fused.py);
  above 1 = ``combine`` (w13 ignores it).

The launch table (``DEFAULT_TABLE``) is a tuple of ``TableRow``: by the average rows each expert
receives (``tokens * top_k / E``), the ``BLOCK_M`` of both GEMMs and one tile per GEMM.
``moe_config`` / ``pick_configs`` resolve it for a shape and a token count; ``moe_tuning_table``
writes the resolved table for one model as the JSON a compiler can record (and ``fused_moe``'s
``tuning`` argument reads back, ``parse_tuning``): ``{"<max tokens>": {"w13": cfg, "w2": cfg}}``,
``cfg`` the keys ``CONFIG_KEYS``. An entry may also name its ``"backend"``: ``"triton"`` (the
default, these kernels) or ``"cutlass"`` (ops/moe/cutlass.py, for bf16 experts on sm90; elsewhere
the entry's Triton configs run), read with ``pick_backend``.

Both kernels are launched with PDL (ops/common/launch.py) and wait at their top: which expert's weights a
program reads comes from the routing (``topk_ids``, or the alignment), so no weight tile can be
streamed before the wait.
"""

from __future__ import annotations

import functools
import json
import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kiln.ops.activation.silu_and_mul import NARROW_ROWS
from kiln.ops.common.launch import grouped_tile, interpreting, next_pow2, pdl_args, pdl_trigger, pdl_wait
from kiln.ops.common.quant import FP8_DTYPE, tl_add_row, tl_round
from kiln.ops.linear.fp8_block import BLOCK as FP8_BLOCK

CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
BACKENDS = ("triton", "cutlass")  # a tuning entry's optional "backend"


class Tile(NamedTuple):
    """One GEMM's launch parameters besides ``BLOCK_M`` (``BLOCK_N`` counts weight rows)."""

    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


class TableRow(NamedTuple):
    """Launch parameters for batches whose average rows per expert are at most ``max_rows``.

    ``block_m``: 1 for the decode GEMV, 0 for the power of two above the average rows within
    16..128 (``auto_block_m``), else that row block."""

    max_rows: float
    block_m: int
    w13: Tile
    w2: Tile


# Decode-sized batches (at most a quarter row per expert: 1..4 tokens at E=128, top-8; 1 token at
# E=8, top-2) run the GEMV (w2: one pair per program, the top-k sum by the last arrival); then the
# grouped GEMM, narrow programs while each expert gets a few rows, big tiles (GROUP_M swizzle,
# 8 warps) for prefill. Retune from the sweeps in bench/test_bench_moe.py (``-k sweep``) and check
# a decode rung in bench/test_bench_moe_decode.py's chain: at 1 token of Qwen3-30B-A3B (1/16 row
# per expert) 16-row w13 programs and an unpipelined w2 (K = 768 is 3 steps) took 28.5 us per layer
# there against 32.6 us with the 2..4-token tiles, which stay ahead at 2 tokens (43.9 vs 46.5 us).
# Measured at that shape only: other models with 1/16 row per expert or less (DeepSeek-V3, E=256,
# top-8: 1..2 tokens) take the same tiles, but their w2 pipelines again when its K loop is longer
# than the measured one (``UNPIPELINED_MAX_STEPS``; DeepSeek-V3's I = 2048 is 8 steps).
UNPIPELINED_MAX_STEPS = 3  # K steps of the longest loop an unpipelined (num_stages 1) GEMV was measured on
DEFAULT_TABLE: tuple[TableRow, ...] = (
    TableRow(1 / 16, 1, Tile(16, 256, 1, 4, 3), Tile(32, 256, 1, 4, 1)),
    TableRow(0.25, 1, Tile(32, 256, 1, 4, 3), Tile(32, 256, 1, 4, 3)),
    TableRow(2.0, 0, Tile(64, 128, 1, 4, 3), Tile(64, 128, 1, 4, 3)),
    TableRow(8.0, 0, Tile(128, 128, 1, 4, 2), Tile(128, 128, 1, 4, 2)),
    TableRow(16.0, 0, Tile(256, 128, 16, 4, 2), Tile(256, 128, 16, 4, 2)),
    TableRow(32.0, 0, Tile(128, 64, 1, 4, 3), Tile(128, 64, 1, 4, 3)),
    TableRow(math.inf, 0, Tile(256, 64, 16, 8, 3), Tile(256, 64, 16, 8, 3)),
)


def _rows(num_experts: int, tokens: int, top_k: int) -> float:
    return tokens * top_k / max(num_experts, 1)


def auto_block_m(rows: float) -> int:
    """The power of two above ``rows`` (average rows per expert), within 16..128."""
    return min(128, max(16, next_pow2(int(rows) + 1)))


def table_row(num_experts: int, tokens: int, top_k: int, table: tuple[TableRow, ...] = DEFAULT_TABLE):
    rows = _rows(num_experts, tokens, top_k)
    return next((r for r in table if rows <= r.max_rows), table[-1])


def moe_block_m(
    num_experts: int, tokens: int, top_k: int, table: tuple[TableRow, ...] = DEFAULT_TABLE
) -> int:
    """``BLOCK_M`` of both GEMMs at ``tokens`` tokens (1: the decode GEMV, no alignment)."""
    row = table_row(num_experts, tokens, top_k, table)
    return row.block_m or auto_block_m(_rows(num_experts, tokens, top_k))


def clip_config(cfg: dict[str, int], n: int, k: int) -> dict[str, int]:
    """``cfg`` with ``BLOCK_N`` / ``BLOCK_K`` no wider than the (padded) ``N`` / ``K`` of ``W [E, N, K]``
    (and at least what the variant needs: 32 for the grouped GEMM's MMA, 2 / 16 for the GEMV)."""
    lo_n, lo_k = (2, 16) if cfg["BLOCK_M"] == 1 else (32, 32)
    return dict(
        cfg,
        BLOCK_N=max(lo_n, min(cfg["BLOCK_N"], next_pow2(n))),
        BLOCK_K=max(lo_k, min(cfg["BLOCK_K"], next_pow2(k))),
    )


def moe_config(
    num_experts: int,
    n: int,
    k: int,
    tokens: int,
    top_k: int = 8,
    gemm: str = "w13",
    table: tuple[TableRow, ...] = DEFAULT_TABLE,
) -> dict[str, int]:
    """Launch parameters of one GEMM (``gemm``: "w13" or "w2") for ``W [E, N, K]`` at ``tokens``.

    Returns ``{"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}``; ``BLOCK_N``
    counts weight rows (a fused SiLU program computes ``BLOCK_N / 2`` gate and up columns each).
    """
    if gemm not in ("w13", "w2"):
        raise ValueError(f"moe_config: gemm must be 'w13' or 'w2', got {gemm!r}")
    row = table_row(num_experts, tokens, top_k, table)
    tile = row.w13 if gemm == "w13" else row.w2
    cfg = clip_config(
        dict(zip(CONFIG_KEYS, (moe_block_m(num_experts, tokens, top_k, table), *tile), strict=True)), n, k
    )
    if cfg["BLOCK_M"] == 1 and cfg["num_stages"] == 1 and -(-k // cfg["BLOCK_K"]) > UNPIPELINED_MAX_STEPS:
        cfg["num_stages"] = 3  # an unpipelined GEMV was measured ahead only on a short K loop
    return cfg


def check_config(cfg: dict[str, int], what: str = "moe config") -> None:
    """A launch config has exactly ``CONFIG_KEYS``, positive ints, power-of-two blocks, and a
    ``BLOCK_M`` of 1 (GEMV) or 16..256 (grouped GEMM)."""
    if set(cfg) != set(CONFIG_KEYS) or not all(isinstance(v, int) and v > 0 for v in cfg.values()):
        raise ValueError(f"{what}: need positive ints {CONFIG_KEYS}, got {cfg}")
    blocks = (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"])
    if any(b & (b - 1) for b in blocks) or not (cfg["BLOCK_M"] == 1 or 16 <= cfg["BLOCK_M"] <= 256):
        raise ValueError(f"{what}: blocks must be powers of two and BLOCK_M 1 or 16..256, got {cfg}")


@functools.lru_cache(maxsize=64)
def parse_tuning(tuning: str) -> tuple[tuple[int, dict[str, dict[str, int]]], ...]:
    """A recorded table ``{"<max tokens>": {"w13": cfg, "w2": cfg[, "backend": b]}, ...}`` (JSON) as
    sorted pairs.

    Each ``cfg`` has the keys of ``moe_config``; the two GEMMs of one entry must share ``BLOCK_M``;
    ``b`` is one of ``BACKENDS`` (absent: "triton").
    """
    table = []
    for key, entry in json.loads(tuning).items():
        if set(entry) - {"backend"} != {"w13", "w2"} or entry["w13"]["BLOCK_M"] != entry["w2"]["BLOCK_M"]:
            raise ValueError(f"moe tuning entry {key!r} needs 'w13' and 'w2' configs with one BLOCK_M")
        if entry.get("backend", "triton") not in BACKENDS:
            raise ValueError(
                f"moe tuning entry {key!r}: 'backend' must be one of {BACKENDS}, got {entry['backend']!r}"
            )
        for gemm in ("w13", "w2"):
            check_config(entry[gemm], f"moe tuning entry {key!r} {gemm}")
        table.append((int(key), entry))
    return tuple(sorted(table, key=lambda kv: kv[0]))


def pick_configs(
    tuning: str, num_experts: int, inter: int, hidden: int, tokens: int, top_k: int
) -> tuple[dict[str, int], dict[str, int]]:
    """(w13 config, w2 config) for ``tokens``: the recorded table's first entry with ``max tokens >=
    tokens`` (else its last), or ``DEFAULT_TABLE`` through ``moe_config`` when ``tuning`` is empty."""
    if tuning:
        entry = _entry(tuning, tokens)
        return entry["w13"], entry["w2"]
    return (
        moe_config(num_experts, 2 * inter, hidden, tokens, top_k, "w13"),
        moe_config(num_experts, hidden, inter, tokens, top_k, "w2"),
    )


def _entry(tuning: str, tokens: int) -> dict:
    table = parse_tuning(tuning)
    return next((e for m, e in table if tokens <= m), table[-1][1])


def pick_backend(tuning: str, tokens: int) -> str:
    """The backend the recorded table names for ``tokens`` ("triton" without a table or a name)."""
    return _entry(tuning, tokens).get("backend", "triton") if tuning else "triton"


def moe_tuning_table(num_experts: int, inter: int, hidden: int, top_k: int, max_tokens: int) -> str:
    """``DEFAULT_TABLE`` resolved for one model's shapes up to ``max_tokens``, as the JSON
    ``parse_tuning`` reads (one entry per run of token counts with the same configs), so that
    ``pick_configs(<it>, ...) == pick_configs("", ...)`` for every ``tokens <= max_tokens``: what a
    compiler records in the manifest (and what a per-GPU retune replaces)."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    prev = None
    for t in range(1, max_tokens + 1):
        c1, c2 = pick_configs("", num_experts, inter, hidden, t, top_k)
        if prev is not None and (c1, c2) != prev[1]:
            out[str(prev[0])] = {"w13": prev[1][0], "w2": prev[1][1]}
        prev = (t, (c1, c2))
    if prev is not None:
        out[str(prev[0])] = {"w13": prev[1][0], "w2": prev[1][1]}
    return json.dumps(out)


# ---- Triton kernels -------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr, PREC: tl.constexpr):
    if UPCAST:  # the interpreter's bf16 dot is wrong; float32 is exact for every input dtype
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _epilogue(
    acc, acc_up, a_s, s_gate, s_up, tw, out_ty: tl.constexpr,
    FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr, RF: tl.constexpr,
):  # fmt: skip
    """float32 products -> the rounded output (as float32): FP8 scales (``a_s`` per row, ``s_gate`` /
    ``s_up`` per column), SiLU-and-mul, routing weight ``tw``; unused arguments are ignored."""
    if FP8:
        acc = acc * a_s * s_gate
        if FUSE_SILU:
            acc_up = acc_up * a_s * s_up
    y = tl_round(acc, out_ty, RF)
    if FUSE_SILU:
        up = tl_round(acc_up, out_ty, RF)
        y = tl_round(y / (1.0 + tl.exp(-y)), out_ty, RF) * up
    if MUL_WEIGHT:
        y = y * tw
    return tl_round(y, out_ty, RF)


@triton.jit(do_not_specialize=["num_pairs", "num_m_blocks"])
def _moe_gemm_kernel(
    A, A_SCALE, W, W_SCALE, C, TOPK_W, SORTED, BLOCK_EXPERT, NUM_PADDED,
    num_pairs, num_m_blocks, N, K,
    stride_am, stride_we, stride_wn, stride_se, stride_cm,
    A_DIV: tl.constexpr, FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr,
    UPCAST: tl.constexpr, PREC: tl.constexpr, ROUND_IN_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr,
    BLOCK_SCALE: tl.constexpr = False,  # FP8 with block scales (BLOCK_K is the 128 group); FP8 False
    stride_asm=0,  # BLOCK_SCALE: A_SCALE [rows, KB], W_SCALE [E, NB, KB] (stride_se, stride_sn, 1)
    stride_sn=0,
):  # fmt: skip
    # N: output columns (I when FUSE_SILU: the up rows of W start at row N)
    pdl_trigger(PDL)
    pdl_wait(PDL)  # the expert of a row block comes from the alignment: no weight is known before
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = grouped_tile(pid, num_m_blocks, num_n, GROUP_M)
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
    acc_up = acc
    as_ptr = A_SCALE + arow * stride_asm  # [BM] BLOCK_SCALE: each row's group scales
    ws_ptr = W_SCALE + e * stride_se + (offs_n // BLOCK_K) * stride_sn  # [BN] and each column's block row
    wsu_ptr = W_SCALE + e * stride_se + ((N + offs_n) // BLOCK_K) * stride_sn  # the up rows'
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k < K - k0
        a = tl.load(a_ptr, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(w_ptr, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if BLOCK_SCALE:  # one 128-group per step: its FP8 product promoted into float32, scaled
            a_s = tl.load(as_ptr + k0 // BLOCK_K, mask=rmask, other=0.0)[:, None]  # [BM, 1]
            w_s = tl.load(ws_ptr + k0 // BLOCK_K, mask=nmask, other=0.0)[None, :]  # [1, BN]
            acc += _dot(a, b, UPCAST, PREC) * a_s * w_s
        else:
            acc += _dot(a, b, UPCAST, PREC)
        if FUSE_SILU:
            bu = tl.load(w_ptr + N * stride_wn, mask=kmask[:, None] & nmask[None, :], other=0.0)
            if BLOCK_SCALE:
                w_s = tl.load(wsu_ptr + k0 // BLOCK_K, mask=nmask, other=0.0)[None, :]
                acc_up += _dot(a, bu, UPCAST, PREC) * a_s * w_s
            else:
                acc_up += _dot(a, bu, UPCAST, PREC)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    out_ty = C.dtype.element_ty
    a_s, s_gate, s_up, tw = acc, acc, acc, acc  # placeholders when unused
    if FP8:
        a_s = tl.load(A_SCALE + arow, mask=rmask, other=0.0)[:, None]  # [BM, 1]
        s_ptr = W_SCALE + e * stride_se + offs_n
        s_gate = tl.load(s_ptr, mask=nmask, other=0.0)[None, :]
        if FUSE_SILU:
            s_up = tl.load(s_ptr + N, mask=nmask, other=0.0)[None, :]
    if MUL_WEIGHT:
        tw = tl.load(TOPK_W + pair, mask=rmask, other=0.0)[:, None]
    y = _epilogue(acc, acc_up, a_s, s_gate, s_up, tw, out_ty, FUSE_SILU, MUL_WEIGHT, FP8, ROUND_IN_F32)
    c_ptr = C + pair[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptr, y.to(out_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def pair_sum(Y, IDS, MAP, tok, K, offs, mask, stride_y, HAS_MAP: tl.constexpr, CACHE: tl.constexpr):
    """float32 sum over token ``tok``'s ``K`` pairs (rows ``tok * K + j`` of ``Y``, in pair order) at
    columns ``offs`` (``mask``); pairs of other ranks' experts (``MAP[IDS[p]] < 0``) left out.
    ``CACHE``: the loads' cache modifier (``.cg`` for rows other programs just wrote)."""
    total = tl.zeros(offs.shape, dtype=tl.float32)
    for j in range(K):
        p = tok * K + j
        use = mask
        if HAS_MAP:
            slot = tl.load(MAP + tl.load(IDS + p))
            use = use & (tl.zeros(offs.shape, dtype=tl.int32) + slot >= 0)  # broadcast the scalar
        total += tl.load(Y + p * stride_y + offs, mask=use, other=0.0, cache_modifier=CACHE).to(tl.float32)
    return total


@triton.jit
def sum_last(
    C, IDS, MAP, OUT, cnt, tok, offs_n, nmask, stride_cm, stride_o,
    SUM_K: tl.constexpr, HAS_MAP: tl.constexpr, ROUND_IN_F32: tl.constexpr,
    Z, stride_zm, ADD_Z: tl.constexpr,
):  # fmt: skip
    """Last arrival of token ``tok``'s ``SUM_K`` pairs on these columns (``cnt``: their arrival
    counter): sum their rows of ``C`` in pair order in float32 (other ranks' pairs left out), round
    once into ``OUT[tok]``.

    Memory ordering as ops/common/launch.py ``ArrivalCounters`` argues it: the barrier puts every thread's
    stores of ``C`` before the scalar acq_rel atomic (cumulative release at gpu scope); the
    program that reads ``SUM_K - 1`` acquires all of them and loads with ``.cg`` (L1 is not
    coherent across SMs); it resets the counter, which no other arrival of this launch touches."""
    tl.debug_barrier()
    old = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    if old == SUM_K - 1:
        tl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
        total = pair_sum(C, IDS, MAP, tok, SUM_K, offs_n, nmask, stride_cm, HAS_MAP, ".cg")
        out_ty = OUT.dtype.element_ty
        y = tl_add_row(tl_round(total, out_ty, ROUND_IN_F32), Z, tok, stride_zm, offs_n, nmask, ADD_Z, out_ty,
                  ROUND_IN_F32)  # fmt: skip
        tl.store(OUT + tok * stride_o + offs_n, y.to(out_ty), mask=nmask)


@triton.jit
def _moe_gemv_kernel(
    A, A_SCALE, W, W_SCALE, C, TOPK_W, IDS, MAP,
    N, K,
    stride_am, stride_we, stride_wn, stride_se, stride_cm,
    OUT, CNT, stride_o,
    A_DIV: tl.constexpr, GROUP: tl.constexpr, P_PAD: tl.constexpr, HAS_MAP: tl.constexpr,
    FUSE_SILU: tl.constexpr, MUL_WEIGHT: tl.constexpr, FP8: tl.constexpr, ROUND_IN_F32: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, PDL: tl.constexpr,
    SUM_K: tl.constexpr = 0,
    Z=None,  # ADD_Z: [T, N] residual added to each token's top-k sum (SUM_K, or GROUP k); else any pointer
    stride_zm=0,
    ADD_Z: tl.constexpr = False,
    BLOCK_SCALE: tl.constexpr = False,  # as _moe_gemm_kernel's
    stride_asm=0,
    stride_sn=0,
):  # fmt: skip
    # The expert comes from topk_ids (the router's output): no weight is known before the wait.
    pdl_trigger(PDL)
    pdl_wait(PDL)
    # Program (g, n): pairs g * GROUP .. + GROUP (GROUP 1: one pair; GROUP k: a token's k pairs,
    # summed into C[g]) x BLOCK_N output columns (N: I when FUSE_SILU, the up rows start at row N).
    # Its tile rows r = j * BLOCK_N + c: pair slot j, column c (2-D tiles only).
    g = tl.program_id(0).to(tl.int64)
    r = tl.arange(0, P_PAD * BLOCK_N)
    slot = r // BLOCK_N
    pair = g * GROUP + slot  # [R] int64
    offs_n = tl.program_id(1) * BLOCK_N + r % BLOCK_N
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    if GROUP == 1:
        e0 = tl.load(IDS + g)
        if HAS_MAP:
            e0 = tl.load(MAP + e0)
        if SUM_K == 0 and e0 < 0:
            return  # another rank's expert: the combine skips this pair (SUM_K: it still arrives)
        e = tl.zeros([P_PAD * BLOCK_N], dtype=tl.int32) + e0
        a_ptr = A + (g // A_DIV) * stride_am + offs_k[None, :]  # [1, BK]: one row for the tile
    else:
        e = tl.load(IDS + pair, mask=slot < GROUP, other=-1)
        if HAS_MAP:
            e = tl.load(MAP + e, mask=e >= 0, other=-1)
        a_ptr = A + (pair // A_DIV)[:, None] * stride_am + offs_k[None, :]  # [R, BK]
    use = e >= 0  # rows of a local expert
    rmask = use & nmask
    e64 = tl.where(use, e, 0).to(tl.int64)
    w_ptr = W + e64[:, None] * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([P_PAD * BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([P_PAD * BLOCK_N], dtype=tl.float32)
    as_ptr = A_SCALE + (pair // A_DIV) * stride_asm  # [R] BLOCK_SCALE: each row's group scales
    ws_ptr = W_SCALE + e64 * stride_se + (offs_n // BLOCK_K) * stride_sn  # [R] and its weight rows'
    wsu_ptr = W_SCALE + e64 * stride_se + ((N + offs_n) // BLOCK_K) * stride_sn
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        kmask = offs_k[None, :] < K - k0
        if GROUP == 1:
            a = tl.load(a_ptr, mask=kmask, other=0.0).to(tl.float32)
        else:
            a = tl.load(a_ptr, mask=use[:, None] & kmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr, mask=rmask[:, None] & kmask, other=0.0).to(tl.float32)
        if BLOCK_SCALE:  # one 128-group per step, promoted with the row's and the block's scales
            a_s = tl.load(as_ptr + k0 // BLOCK_K, mask=use, other=0.0)  # [R]
            w_s = tl.load(ws_ptr + k0 // BLOCK_K, mask=rmask, other=0.0)
            acc += tl.sum(w * a, axis=1) * a_s * w_s
        else:
            acc += tl.sum(w * a, axis=1)
        if FUSE_SILU:
            wu = tl.load(w_ptr + N * stride_wn, mask=rmask[:, None] & kmask, other=0.0).to(tl.float32)
            if BLOCK_SCALE:
                w_s = tl.load(wsu_ptr + k0 // BLOCK_K, mask=rmask, other=0.0)
                acc_up += tl.sum(wu * a, axis=1) * a_s * w_s
            else:
                acc_up += tl.sum(wu * a, axis=1)
        a_ptr += BLOCK_K
        w_ptr += BLOCK_K
    out_ty = C.dtype.element_ty
    a_s, s_gate, s_up, tw = acc, acc, acc, acc  # placeholders when unused
    if FP8:
        a_s = tl.load(A_SCALE + pair // A_DIV, mask=use, other=0.0)
        s_ptr = W_SCALE + e64 * stride_se + offs_n
        s_gate = tl.load(s_ptr, mask=rmask, other=0.0)
        if FUSE_SILU:
            s_up = tl.load(s_ptr + N, mask=rmask, other=0.0)
    if MUL_WEIGHT:
        tw = tl.load(TOPK_W + pair, mask=use, other=0.0)
    y = _epilogue(acc, acc_up, a_s, s_gate, s_up, tw, out_ty, FUSE_SILU, MUL_WEIGHT, FP8, ROUND_IN_F32)
    if GROUP == 1:
        tl.store(C + g * stride_cm + offs_n, y.to(out_ty), mask=rmask)
        if SUM_K > 0:
            sum_last(
                C,
                IDS,
                MAP,
                OUT,
                CNT + (g // SUM_K) * tl.num_programs(1) + tl.program_id(1),
                g // SUM_K,
                offs_n,
                nmask,
                stride_cm,
                stride_o,
                SUM_K,
                HAS_MAP,
                ROUND_IN_F32,
                Z,
                stride_zm,
                ADD_Z,
            )
    else:  # the top-k sum in float32 (other ranks' experts left out), rounded once
        cols = tl.arange(0, BLOCK_N)
        pick = rmask[:, None] & ((r % BLOCK_N)[:, None] == cols[None, :])  # [R, BN]
        total = tl.sum(tl.where(pick, y[:, None], 0.0), axis=0)  # [BN]
        offs_c = tl.program_id(1) * BLOCK_N + cols
        y = tl_round(total, out_ty, ROUND_IN_F32)
        y = tl_add_row(y, Z, g, stride_zm, offs_c, offs_c < N, ADD_Z, out_ty, ROUND_IN_F32)
        tl.store(C + g * stride_cm + offs_c, y.to(out_ty), mask=offs_c < N)


# ---- launchers ------------------------------------------------------------------------------------


def _block_scales(
    a: torch.Tensor, a_scale: torch.Tensor | None, w: torch.Tensor, w_scale: torch.Tensor | None, what: str
) -> bool:
    """Whether the launch is block-scaled FP8 (``w_scale [E, ceil(N_w/128), ceil(K/128)]``), checking
    that ``a`` is FP8 with ``a_scale [rows, ceil(K/128)]`` then; per-channel FP8 and plain: False."""
    if w.dtype != FP8_DTYPE or w_scale is None or w_scale.dim() != 3:
        return False
    e, n, k = w.shape
    kb = -(-k // FP8_BLOCK)
    if (
        w_scale.shape != (e, -(-n // FP8_BLOCK), kb)
        or w_scale.stride(2) != 1
        or w_scale.dtype != torch.float32
    ):
        raise ValueError(
            f"{what}: block scales of w {tuple(w.shape)} must be [E, ceil(N/128), ceil(K/128)] = "
            f"{(e, -(-n // FP8_BLOCK), kb)} float32 with a unit last stride, got {tuple(w_scale.shape)}"
        )
    if a.dtype != FP8_DTYPE or a_scale is None or a_scale.shape != (a.shape[0], kb) or a_scale.stride(1) != 1:
        raise ValueError(
            f"{what}: block-scaled weights need a float8_e4m3fn with group scales a_scale "
            f"[{a.shape[0]}, {kb}] (ops/linear/fp8_block.py quantize_fp8_groups)"
        )
    return True


def _block_args(blocks: bool, a_scale: torch.Tensor | None, w_scale: torch.Tensor | None) -> dict:
    if not blocks or a_scale is None or w_scale is None:
        return {}
    return dict(BLOCK_SCALE=True, stride_asm=a_scale.stride(0), stride_sn=w_scale.stride(1))


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
    blocks = _block_scales(a, a_scale, w, w_scale, "moe_gemm")
    grid = (num_m * triton.cdiv(n_out, bn),)
    pdl = pdl_args(a)
    _moe_gemm_kernel[grid](
        a, a_scale if fp8 else a, w, w_scale if fp8 else w, c,
        topk_weights if topk_weights is not None else c,
        sorted_ids, block_expert, num_padded,
        num_pairs, num_m, n_out, w.shape[2],
        a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0) if w_scale is not None and fp8 else 0, c.stride(0),
        A_DIV=a_div, FUSE_SILU=fuse_silu, MUL_WEIGHT=topk_weights is not None, FP8=fp8 and not blocks,
        UPCAST=interpreting(), PREC="ieee" if a.dtype == torch.float32 else "tf32",
        ROUND_IN_F32=interpreting(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=FP8_BLOCK if blocks else cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        **_block_args(blocks, a_scale, w_scale), **pdl,
    )  # fmt: skip


def moe_gemv_launch(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    c: torch.Tensor,
    topk_weights: torch.Tensor | None,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    cfg: dict[str, int],
    a_div: int,
    fuse_silu: bool = False,
    combine: bool = False,
    sum_out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> None:
    """Run the decode GEMV (no alignment; see the module docstring) into ``c``.

    ``topk_ids [T, k]`` int32 (contiguous) and ``expert_map`` as ``fused_moe`` takes them; ``c``:
    ``[T * k, N]`` one row per pair (pairs of other ranks' experts are left unwritten), or with
    ``combine`` ``[T, N]``: row ``t`` = the sum over its local pairs (zeros when it has none).
    ``sum_out [T, N]`` (one pair per program, ``c`` per pair): the last-arriving program of each
    token's ``k`` pairs also writes their sum there, as the combine kernel would; ``counters``:
    zeroed int32, at least ``T * cdiv(N, BLOCK_N)`` (ops/common/launch.py ``ArrivalCounters``).
    ``a_div`` and ``topk_weights`` as for ``moe_gemm_launch``; ``cfg["BLOCK_M"]`` must be 1.

    ``residual`` ``[T, N]`` (with ``combine`` or ``sum_out``): added to each token's rounded sum,
    rounded again (the residual stream's add after the MoE block).
    """
    t, k = topk_ids.shape
    if t == 0:
        return
    if cfg["BLOCK_M"] != 1:
        raise ValueError(f"moe_gemv: the decode GEMV runs with BLOCK_M 1, got {cfg}")
    if a.stride(1) != 1 or w.stride(2) != 1 or c.stride(1) != 1 or not topk_ids.is_contiguous():
        raise ValueError("moe_gemv: a, w and c need a unit last stride, topk_ids a contiguous layout")
    n_out = w.shape[1] // 2 if fuse_silu else w.shape[1]
    bn = cfg["BLOCK_N"] // (2 if fuse_silu else 1)
    fp8 = w.dtype == FP8_DTYPE
    group = k if combine else 1
    grid = (t if combine else t * k, triton.cdiv(n_out, bn))
    if sum_out is not None and (
        combine
        or fuse_silu
        or sum_out.shape != (t, n_out)
        or sum_out.stride(1) != 1
        or counters is None
        or counters.dtype != torch.int32
        or counters.numel() < t * grid[1]
    ):
        raise ValueError(
            f"moe_gemv: sum_out must be [T={t}, N={n_out}] with a unit last stride, for one pair per "
            f"program without fuse_silu, with at least {t * grid[1]} int32 counters"
        )
    if residual is not None and (
        not (combine or sum_out is not None) or residual.shape != (t, n_out) or residual.stride(1) != 1
        or residual.dtype != c.dtype
    ):  # fmt: skip
        raise ValueError(
            f"moe_gemv: residual must be [T={t}, N={n_out}] {c.dtype} with a unit last stride, with "
            "combine or sum_out"
        )
    z = dict(Z=a) if residual is None else dict(Z=residual, stride_zm=residual.stride(0), ADD_Z=True)
    blocks = _block_scales(a, a_scale, w, w_scale, "moe_gemv")
    pdl = pdl_args(a)
    _moe_gemv_kernel[grid](
        a, a_scale if fp8 else a, w, w_scale if fp8 else w, c,
        topk_weights if topk_weights is not None else c,
        topk_ids, expert_map if expert_map is not None else topk_ids,
        n_out, w.shape[2],
        a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0) if w_scale is not None and fp8 else 0, c.stride(0),
        sum_out if sum_out is not None else c, counters if sum_out is not None else topk_ids,
        sum_out.stride(0) if sum_out is not None else 0,
        A_DIV=a_div, GROUP=group, P_PAD=next_pow2(group), HAS_MAP=expert_map is not None,
        FUSE_SILU=fuse_silu, MUL_WEIGHT=topk_weights is not None, FP8=fp8 and not blocks, ROUND_IN_F32=interpreting(),
        BLOCK_N=bn, BLOCK_K=FP8_BLOCK if blocks else cfg["BLOCK_K"], STAGES=cfg["num_stages"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        SUM_K=k if sum_out is not None else 0, **z, **_block_args(blocks, a_scale, w_scale), **pdl,
    )  # fmt: skip


def specialization(
    c1: dict[str, int], c2: dict[str, int], tokens: int, top_k: int, backend: str = "triton"
) -> tuple:
    """What selects ``fused_moe``'s kernel specializations at ``tokens``: both configs, and for the
    grouped GEMM the one-program vs chunked alignment (the decode GEMV has no alignment); for the
    CUTLASS backend only the SiLU-and-mul's block (ops/activation/silu_and_mul.py: ``NARROW_ROWS`` or more)."""
    from kiln.ops.moe.align import CHUNK

    if backend == "cutlass":
        return ("cutlass", tokens * top_k <= NARROW_ROWS)
    align = None if c1["BLOCK_M"] == 1 else tokens * top_k <= CHUNK
    return tuple(c1[n] for n in CONFIG_KEYS), tuple(c2[n] for n in CONFIG_KEYS), align


def moe_warmup_tokens(
    num_experts: int, inter: int, hidden: int, top_k: int, max_tokens: int, tuning: str = ""
) -> list[int]:
    """One token count per distinct kernel specialization of ``fused_moe`` up to ``max_tokens``
    (``specialization``; ``tuning`` as ``fused_moe`` gets it), so that a compile-time warm-up
    running these sizes leaves nothing for the runtime to compile."""
    seen: dict[tuple, int] = {}
    for t in range(1, max_tokens + 1):
        c1, c2 = pick_configs(tuning, num_experts, inter, hidden, t, top_k)
        seen.setdefault(specialization(c1, c2, t, top_k, pick_backend(tuning, t)), t)
    return sorted(seen.values())
