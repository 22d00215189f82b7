"""MLA attention (DeepSeek-V2/V3, absorbed form: ops/attention/mla.py) at DeepSeek shapes:
``r = kv_lora_rank = 512``, ``dr = qk_rope_head_dim = 64``, bf16, page size 16, the latent cache as
the pool's layer view ``[S, 1, r + dr]``; ``H`` = 16 heads (V2-Lite, V3 at tp 8) and 128 (V3 at tp 1).

* decode (``kiln::mla_decode``) at batch 1/8/64/256 and contexts 1k/8k/32k: ``bytes`` = every
  cached latent row read once (``B L (r + dr) 2``) + ``q_latent``, ``q_pe`` and the output, as a
  fraction of the measured read bandwidth (issue 29: >= 80% where memory bound; at 16 heads the
  kernel does ~30 FLOP/byte, bandwidth bound; at 128 heads ~240, near the H200's ridge:
  docs/mla.md). ``num_splits``: ``mla_num_splits`` (what ``num_splits=0`` picks).
* extend (``kiln::mla_extend``, the flash kernel): one 4k prompt, 4k new tokens over a 4k prefix, 8
  chunks of 512 over 4k prefixes, 64 requests of 8 new tokens over 2k (speculative / short chunks,
  where the absorbed form wins: docs/mla.md): ``flops`` = ``2 H (2 r + dr)`` per visible (query,
  key) pair (the 576-wide QK and the 512-wide P @ c), as a fraction of the measured bf16 matmul rate.

Beside the kernels: ``eager`` (torch: gather the latents by slot, bf16 matmuls, softmax in
float32) for decode, and ``reference`` for extend (the host loop the CUDA path ran before the
kernel; not capturable, so timed eagerly). Sizes whose eager temporaries pass a few GB are skipped.
* per-head latent maps (``kiln::mla_head_matmul`` beside the graphs' batched matmuls) at 1..512
  tokens: ``bytes`` = weights, input and output once (docs/mla.md's batch-1 plan).

On a GPU the kernels and ``eager`` are timed as CUDA-graph replays. The ``*_sweep`` benchmarks
(GPU only, ``-k sweep``) time launch configurations at the target shapes, to tune
``MLADecodeConfig`` / ``MLAExtendConfig``. Smoke mode (CPU): tiny widths and sizes, the kernels
through the interpreter, one round each.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import pytest
import torch
from conftest import SMOKE, graphed, kernel_resources, pick

from kiln.ops.attention.decode import choose_num_splits
from kiln.ops.attention.mla import (
    MLADecodeConfig,
    MLAExtendConfig,
    _mla_decode_split_kernel,
    default_decode_config,
    mla_decode_triton,
    mla_extend_ref,
    mla_extend_triton,
    mla_num_splits,
)
from kiln.ops.attention.reference import random_block_table, request_slots

R, DR = pick(512, 32), pick(64, 16)
W = R + DR
PAGE = 16
DTYPE = torch.bfloat16
DEV = "cpu" if SMOKE else "cuda"
HEADS = pick([16, 128], [4, 20])  # smoke: one and two head blocks
EAGER_MAX_TOKENS = 2**21  # decode: B * L above this (2.4 GB of gathered latents) skips eager
REF_MAX_SCORES = 2**30  # extend: H * n * L above this (4 GB of float32 scores) skips the reference


@functools.lru_cache(maxsize=1)
def _layout(lens: tuple[int, ...]):
    """A paged layout for ``lens`` and a random latent cache ``[S, 1, W]`` (kept for the next case
    of the same lengths: the big ones take seconds to build)."""
    block_table, req_rows, num_slots = random_block_table(list(lens), PAGE, DEV)
    cache = torch.randn(num_slots, 1, W, dtype=DTYPE, device=DEV)
    return block_table, req_rows, torch.tensor(lens, dtype=torch.int32, device=DEV), cache


def _sm_scale() -> float:
    return (128 + DR) ** -0.5  # qk_nope_head_dim 128 + qk_rope_head_dim


# --------------------------------------------------------------------------- decode
def decode_bytes(batch: int, ctx: int, heads: int) -> int:
    """Bytes one decode call moves: each cached row ``[c_kv | k_pe]`` once, q_latent and q_pe in,
    the latent output out (bf16)."""
    return 2 * (batch * ctx * W + batch * heads * (W + R))


def _decode_case(batch: int, ctx: int, heads: int):
    block_table, req_rows, seq_lens, cache = _layout((ctx,) * batch)
    q_latent = torch.randn(batch, heads, R, dtype=DTYPE, device=DEV)
    q_pe = torch.randn(batch, heads, DR, dtype=DTYPE, device=DEV)
    return q_latent, q_pe, cache, block_table, req_rows, seq_lens


def _eager_decode(q_latent, q_pe, cache, slots, scale: float):
    """Decode in plain torch on uniform lengths: ``slots [B, L]``, returns ``[B, H, r]``."""
    rows = cache[slots, 0]  # [B, L, W]
    c, pe = rows[..., :R], rows[..., R:]
    s = torch.einsum("bhr,blr->bhl", q_latent, c).float() + torch.einsum("bhd,bld->bhl", q_pe, pe).float()
    p = torch.softmax(s * scale, dim=-1).to(c.dtype)
    return torch.einsum("bhl,blr->bhr", p, c)


def _decode_fn(
    impl: str, case, ctx: int, splits: int, config: MLADecodeConfig | None = None
) -> Callable[[], object]:
    q_latent, q_pe, cache, block_table, req_rows, seq_lens = case
    if impl == "triton":
        return lambda: mla_decode_triton(
            q_latent, q_pe, cache, block_table, req_rows, seq_lens, _sm_scale(), PAGE, splits, config=config
        )
    slots = torch.stack([request_slots(block_table, r, ctx, PAGE) for r in req_rows.tolist()])
    return lambda: _eager_decode(q_latent, q_pe, cache, slots, _sm_scale())


DECODE_CASES = pick([(b, c) for b in (1, 8, 64, 256) for c in (1024, 8192, 32768)], [(1, 40), (3, 40)])


@pytest.mark.parametrize("impl", ["triton", "eager"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("batch, ctx", DECODE_CASES)
def test_mla_decode(measure, batch, ctx, heads, impl):
    if impl == "eager" and batch * ctx > EAGER_MAX_TOKENS:
        pytest.skip(f"eager gathers B * L = {batch * ctx} latent rows; the bound is {EAGER_MAX_TOKENS}")
    case = _decode_case(batch, ctx, heads)
    splits = mla_num_splits(batch, ctx, heads)
    fn = _decode_fn(impl, case, ctx, splits)
    out = fn()
    assert out.shape == (batch, heads, R) and not out.isnan().any()
    nbytes = decode_bytes(batch, ctx, heads)
    measure(graphed(fn), bytes=nbytes, impl=impl, batch=batch, ctx=ctx, heads=heads, num_splits=splits)


# the launches swept (MLADecodeConfig.label names them); the first is the default
DECODE_SWEEP = [MLADecodeConfig(h, n, w, s) for h, n, w, s in (
    (16, 32, 4, 2), (16, 64, 4, 2), (16, 16, 4, 2), (16, 32, 4, 3), (16, 32, 8, 2), (16, 64, 8, 2),
    (16, 64, 4, 3), (16, 32, 8, 4), (32, 32, 8, 2), (64, 32, 8, 2), (64, 16, 8, 2), (16, 16, 4, 4),
    (16, 16, 8, 3),
)]  # fmt: skip


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize("resident", [1, 2, 3, 4], ids=lambda r: f"res{r}")
@pytest.mark.parametrize("config", DECODE_SWEEP, ids=lambda c: c.label)
@pytest.mark.parametrize(
    "batch, ctx, heads", [(64, 8192, 16), (64, 8192, 128), (8, 32768, 16), (256, 32768, 16), (64, 1024, 16)]
)
def test_mla_decode_sweep(measure, batch, ctx, heads, config, resident):
    """``resident``: the programs an SM holds that the split plan fills in one wave
    (``mla_num_splits``); the registers and spills recorded say what the launch really allows.
    Each split past the first writes a ``[B, H, 512]`` float32 partial the merge reads back."""
    config = dataclasses.replace(config, resident=resident)
    splits = mla_num_splits(batch, ctx, heads, config)
    fn = _decode_fn("triton", _decode_case(batch, ctx, heads), ctx, splits, config)
    _measure_launch(measure, fn, batch, ctx, heads, num_splits=splits, config=str(config))


@pytest.mark.skipif(SMOKE, reason="split plan comparison: GPU only")
@pytest.mark.parametrize("plan", ["waves", "pps8"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("batch, ctx", DECODE_CASES)
def test_mla_decode_plan_sweep(measure, batch, ctx, heads, plan):
    """The default launch under two split plans: ``waves``, the op's (``mla_num_splits``: by the
    waves of resident programs), and ``pps8``, eight programs an SM (``choose_num_splits``, GQA's
    rule, which MLA used for 16-head blocks until session 34; 64-head blocks used two an SM in
    session 33, 0.978 ms at 64 x 8k, against 1.080 at eight here)."""
    if plan == "waves":
        splits = mla_num_splits(batch, ctx, heads)
    else:
        splits = choose_num_splits(batch, ctx, -(-heads // default_decode_config(heads).block_h))
    fn = _decode_fn("triton", _decode_case(batch, ctx, heads), ctx, splits)
    _measure_launch(measure, fn, batch, ctx, heads, num_splits=splits)


def _measure_launch(
    measure, fn: Callable[[], object], batch: int, ctx: int, heads: int, **info: object
) -> None:
    """A sweep point: ``fn`` graphed and timed, with the registers and spills of the split kernel
    variant it compiled (the others forgotten first)."""
    getattr(_mla_decode_split_kernel, "device_caches", {}).clear()  # (the interpreter keeps none)
    replay = graphed(fn)
    measure(
        replay, bytes=decode_bytes(batch, ctx, heads), batch=batch, ctx=ctx, heads=heads,
        **info, **kernel_resources(_mla_decode_split_kernel),
    )  # fmt: skip


SPLIT_COUNTS = [4, 5, 6, 8, 11, 12, 16, 17, 18, 24, 34]
# (batch, ctx, splits): the waves at 64 and 32 requests, and batches that fill one wave of the
# default launch's 264 programs by half or more, where one split leaves each SM one or two programs
SPLIT_COUNT_CASES = [(b, c, n) for b, c in ((64, 8192), (64, 4096), (32, 8192)) for n in SPLIT_COUNTS] + [
    (b, 8192, n) for b in (160, 192) for n in (1, 2, 3, 4, 5, 6, 8)
]


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize("batch, ctx, splits", SPLIT_COUNT_CASES)
def test_mla_decode_split_count_sweep(measure, batch, ctx, splits):
    """16 heads, the default launch, explicit split counts: whether the time follows the waves
    (``ceil(batch * splits / resident programs)`` times the keys a split walks). It does (H100,
    session 34): at 64 x 8k 4 splits (one wave of two programs an SM) read at 74.5% of bandwidth,
    5 at 53.4%, 8 (two waves) at 72.7%, 17 at 71.7%. ``mla_num_splits`` picks by that model."""
    fn = _decode_fn("triton", _decode_case(batch, ctx, 16), ctx, splits)
    _measure_launch(measure, fn, batch, ctx, 16, num_splits=splits, plan=mla_num_splits(batch, ctx, 16))


# --------------------------------------------------------------------------- extend
def extend_flops(reqs: list[tuple[int, int]], heads: int) -> int:
    """FLOPs of an extend over ``reqs`` of (cached prefix, new tokens): ``2 H (2 r + dr)`` per
    visible (query, key) pair; query ``j`` of a request sees its prefix and new tokens ``0..j``."""
    visible = sum(n * p + n * (n + 1) // 2 for p, n in reqs)
    return 2 * heads * (2 * R + DR) * visible


def _extend_case(reqs: tuple[tuple[int, int], ...], heads: int):
    block_table, req_rows, seq_lens, cache = _layout(tuple(p + n for p, n in reqs))
    counts = torch.tensor([0] + [n for _, n in reqs])
    indptr = counts.cumsum(0).to(torch.int32).to(DEV)
    t = int(counts.sum())
    q_latent = torch.randn(t, heads, R, dtype=DTYPE, device=DEV)
    q_pe = torch.randn(t, heads, DR, dtype=DTYPE, device=DEV)
    return q_latent, q_pe, cache, block_table, req_rows, seq_lens, indptr, _sm_scale(), PAGE


# name -> requests of (cached prefix, new tokens)
EXTEND_CASES = pick(
    {
        "prompt-4k": ((0, 4096),),
        "4k-over-4k": ((4096, 4096),),
        "8x512-over-4k": ((4096, 512),) * 8,
        "64x8-over-2k": ((2048, 8),) * 64,
    },
    {"prompt": ((0, 12),), "chunks": ((20, 8), (5, 3))},
)


@pytest.mark.parametrize("impl", ["triton", "reference"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", list(EXTEND_CASES))
def test_mla_extend(measure, case, heads, impl):
    reqs = EXTEND_CASES[case]
    scores = heads * max(n for _, n in reqs) * max(p + n for p, n in reqs)
    if impl == "reference" and scores > REF_MAX_SCORES:
        pytest.skip(f"the reference holds H x n x L = {scores} float32 scores; the bound is {REF_MAX_SCORES}")
    args = _extend_case(reqs, heads)
    fn = (lambda: mla_extend_triton(*args)) if impl == "triton" else (lambda: mla_extend_ref(*args))
    out = fn()
    assert out.shape == args[0].shape and not out.isnan().any()
    timed = graphed(fn) if impl == "triton" else fn  # the reference reads lengths on the host
    measure(
        timed, flops=extend_flops(list(reqs), heads), impl=impl, case=case, heads=heads, requests=len(reqs),
        new_tokens=args[0].shape[0],
    )  # fmt: skip


# (block_m, block_n, block_v, pack, num_warps, num_stages); the first is the default. Each fits the
# H200's 227 KB of shared memory (cross-compiled for sm_90 with triton 3.9: 64 rows use wgmma, 32
# mma v2; block_v 0 (all 512 columns) spills a few hundred bytes at 255 registers, 256 and 128 none)
EXTEND_SWEEP = [(64, 32, 0, 0, 8, 2), (64, 32, 0, 0, 8, 1), (64, 16, 0, 0, 8, 2), (64, 64, 0, 0, 8, 1),
                (64, 32, 0, 16, 8, 2), (64, 32, 256, 0, 8, 2), (64, 16, 256, 0, 8, 2), (64, 32, 128, 0, 8, 2),
                (128, 16, 256, 0, 8, 1), (128, 32, 128, 0, 8, 1), (32, 32, 0, 0, 8, 2)]  # fmt: skip


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize("cfg", EXTEND_SWEEP, ids=lambda c: "m{}-n{}-v{}-p{}-w{}-s{}".format(*c))
@pytest.mark.parametrize("case, heads", [("4k-over-4k", 16), ("4k-over-4k", 128), ("64x8-over-2k", 128)])
def test_mla_extend_sweep(measure, case, heads, cfg):
    config = MLAExtendConfig(
        block_m=cfg[0], block_n=cfg[1], block_v=cfg[2], pack=cfg[3], num_warps=cfg[4], num_stages=cfg[5]
    )
    reqs = EXTEND_CASES[case]
    args = _extend_case(reqs, heads)
    fn = lambda: mla_extend_triton(*args, config=config)
    measure(graphed(fn), flops=extend_flops(list(reqs), heads), case=case, heads=heads, config=str(config))


def test_bench_bytes_and_flops_formulas():
    # the figures the fractions rest on, counted by hand on small cases
    assert decode_bytes(2, 48, 4) == 2 * (2 * 48 * (R + DR) + 2 * 4 * (R + DR) + 2 * 4 * R)
    assert extend_flops([(5, 3)], 4) == 4 * (2 * (R + DR) + 2 * R) * (6 + 7 + 8)
    assert extend_flops([(0, 2), (1, 0)], 1) == (2 * (R + DR) + 2 * R) * (1 + 2)


# --------------------------------------------------------------------------- per-head latent maps
DN, DV = pick(128, 24), pick(128, 20)  # qk_nope_head_dim, v_head_dim
HEAD_TOKENS = pick([1, 8, 64, 512], [1, 5])


@pytest.mark.parametrize("impl", ["triton", "bmm"])
@pytest.mark.parametrize("use", ["absorb_q", "apply_uv"])
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("tokens", HEAD_TOKENS)
def test_mla_head_matmul(measure, tokens, heads, use, impl):
    """``absorb_q`` / ``apply_uv`` as the graphs run them today (``bmm``: cuBLAS batched matmuls of
    the ``[H, T, .]`` transposes, and for ``apply_uv`` the copy into the o projection's ``[T, H dv]``
    input) beside ``kiln::mla_head_matmul`` (ops/attention/mla_heads.py); ``bytes`` = the weights,
    ``x`` and the output once (docs/mla.md's batch-1 plan: 12.5 us a layer on cuBLAS at batch 1)."""
    from kiln.ops.attention.mla import absorb_q, apply_uv
    from kiln.ops.attention.mla_heads import mla_head_matmul_triton

    k, n = (DN, R) if use == "absorb_q" else (R, DV)
    if use == "absorb_q":  # the q projection's output, its nope part a strided slice
        x = torch.randn(tokens, heads, DN + DR, dtype=DTYPE, device=DEV)[..., :DN]
    else:
        x = torch.randn(tokens, heads, R, dtype=DTYPE, device=DEV)
    w = torch.randn(heads, k, n, dtype=DTYPE, device=DEV) * k**-0.5
    if impl == "triton":
        fn = lambda: mla_head_matmul_triton(x, w)
    elif use == "absorb_q":
        fn = lambda: absorb_q(x, w)
    else:
        fn = lambda: apply_uv(x, w).reshape(tokens, heads * n)
    out = fn()
    torch.testing.assert_close(out.reshape(tokens, heads, n).float(), absorb_q(x, w).float() if use == "absorb_q"
                               else apply_uv(x, w).float(), rtol=2e-2, atol=2e-2)  # fmt: skip
    nbytes = 2 * (heads * k * n + tokens * heads * (k + n))
    measure(graphed(fn), bytes=nbytes, impl=impl, tokens=tokens, heads=heads, use=use)
