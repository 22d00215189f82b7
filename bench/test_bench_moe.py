"""Fused MoE (routing, alignment, grouped GEMMs / decode GEMV, combine) at Qwen3-30B-A3B shapes:
E=128 experts, top-8, H=2048, I=768, for 1 to 4096 tokens.

Rows of ``test_fused_moe`` (``impl``):

* ``triton`` / ``triton_fp8``: ``kiln.fused_moe`` (bf16 / FP8 experts), captured in a CUDA graph,
  with the default launch table (ops/moe/gemm.py: ``DEFAULT_TABLE``) or the recorded table in
  ``KILN_MOE_TUNING`` (the JSON ``moe_tuning_table`` writes, or a path to it): how a retuned table
  is checked before it becomes the default;
* ``cutlass_sm90``: kiln's CUTLASS backend (ops/moe/cutlass.py: sort, gather, the sm90 grouped GEMM
  library for both GEMMs, SiLU-and-mul, weighted un-sort), captured in a CUDA graph; skipped without
  the library (``KILN_CUTLASS_LIB``, built by compiler/cutlass_build.py) or off sm90;
* ``cutlass``: the same MoE with both GEMMs in ``torch._grouped_mm``, PyTorch's CUTLASS grouped
  GEMM for sm90 (tokens sorted by expert with torch ops, our SiLU-and-mul, index_add combine):
  CUTLASS beside Triton without carrying the CuTe DSL wheels (92 MB, over the GPU machine's
  64 MiB transfer limit); on CPU (smoke) torch's reference grouped GEMM;
* ``eager``: the torch baseline Hugging Face's expert loop amounts to (per hit expert: gather,
  gate_up, SiLU-and-mul, down, weight, index_add; bf16, not capturable: it reads the routing on the
  host);
* ``routing`` / ``align``: ``kiln.moe_topk`` and ``kiln.moe_align`` alone (``align`` at the grouped
  GEMM's ``BLOCK_M``; decode sizes that run the GEMV do not align at all: ``used=False``).

``bytes`` counts the weights of the experts the batch actually hits plus the activations read and
written (``frac_bw`` is what bounds few tokens; target >= 0.7); ``flops`` counts ``2 * T * k * 3 * H * I``
(``frac_mm`` against the measured bf16 matmul rate; target >= 0.5 at 4096 tokens). Routing is
random (uniform over experts), as a trained router's load is close to balanced. Smoke mode (CPU):
tiny shapes through the interpreter, one round.

Sweeps (GPU only, ``-k sweep``), to pick ``DEFAULT_TABLE``'s entries in one run:

* ``test_moe_gemm_sweep[GEMM-Ntok-CFG]``: one GEMM alone (w13 with the fused SiLU-and-mul; w2 with
  the routing weight and the top-k sum: the combine kernel after the grouped GEMM, the GEMV's own
  with ``gemvsum``, or its last-arrival sum with one pair per program)
  for each candidate launch config at 1, 8 and 4096 tokens; the alignment is done outside the
  timing. Decode sizes report ``frac_bw``
  (bytes: the hit experts' weights of that GEMM and its activations), 4096 tokens ``frac_mm``.
  Every output is checked against the default config's.
* ``test_fused_moe_sweep[Ntok-PAIR]``: the whole op (alignment and combine included) for
  (w13, w2) config pairs at 1, 4, 8 and 16 tokens: where the decode GEMV stops beating the grouped
  GEMM (the last GEMV row of ``DEFAULT_TABLE``) and its best tiles.

Config ids: ``gemv_nBN_kBK_wWARPS_sSTAGES`` / ``gemvsum_...`` (``BLOCK_M`` 1; w2 ``GROUP_M`` 1 / 8)
and ``mBM_nBN_kBK_gGROUP_wWARPS_sSTAGES``;
``-k "sweep and 1tok"`` / ``8tok`` / ``4096tok`` select one size.
"""

import functools
import json
from pathlib import Path

import pytest
import torch
import triton
from conftest import SMOKE, graphed, pick

from kiln import settings
from kiln.ops.common.quant import quantize_fp8_per_channel
from kiln.ops.moe import cutlass as moe_cutlass
from kiln.ops.moe import fused as moe
from kiln.ops.moe import gemm as mg
from kiln.ops.moe.align import moe_align_run

pytestmark = pytest.mark.usefixtures("kernels_on_cpu")

H, I, E, K = pick((2048, 768, 128, 8), (64, 32, 8, 2))
TOKENS = pick([1, 8, 64, 256, 1024, 4096], [3])
DEV = "cpu" if SMOKE else "cuda"
IMPLS = ["triton", "triton_fp8", "cutlass_sm90", "cutlass", "eager", "routing", "align"]


def _tuning() -> str:
    """``KILN_MOE_TUNING``: a recorded table (JSON, or a path to one), or "" for the default table."""
    v = settings.value("moe_tuning").strip()
    if v and not v.startswith("{"):
        v = Path(v).read_text()
    if v:
        mg.parse_tuning(v)  # fail here, not inside a capture
    return v


TUNING = _tuning()


def _cutlass_unavailable(x, w13, w2) -> str | None:
    """Why the ``cutlass_sm90`` row cannot run (None: it can); loads ``KILN_CUTLASS_LIB``."""
    path = settings.value("cutlass_lib")
    if moe_cutlass.library_path() is None and path:
        moe_cutlass.load_library(path)
    if moe_cutlass.library_path() is None:
        return "no CUTLASS library: set KILN_CUTLASS_LIB (compiler/cutlass_build.py builds one)"
    if not moe_cutlass.supports(x, w13, w2):
        return "the CUTLASS backend runs bf16 experts on an sm90 GPU only"
    return None


def eager_moe(x, w13, w2, weights, ids):
    """The torch baseline: one expert at a time, as Hugging Face's eager experts run."""
    out = torch.zeros_like(x)
    i = w2.shape[2]
    for e in torch.unique(ids).tolist():
        tok, j = torch.where(ids == e)
        gu = x[tok] @ w13[e].t()  # [n, 2I]
        h = torch.nn.functional.silu(gu[:, :i]) * gu[:, i:]
        y = (h @ w2[e].t()) * weights[tok, j, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out


def cutlass_moe(x, w13t, w2t, weights, ids):
    """Both expert GEMMs through ``torch._grouped_mm`` (CUTLASS); w13t [E, H, 2I], w2t [E, I, H]."""
    flat = ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(w13t.shape[0], dtype=torch.int32, device=x.device)
    counts.index_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0).to(torch.int32)  # [E] group ends
    tok = order // ids.shape[1]
    gu = torch._grouped_mm(x[tok], w13t, offs=offs)  # [T*k, 2I]
    y = torch._grouped_mm(torch.ops.kiln.silu_and_mul(gu), w2t, offs=offs)  # [T*k, H]
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, tok, y)


@functools.lru_cache(maxsize=1)
def _experts():
    return random_experts(torch.Generator(DEV).manual_seed(0))


def random_experts(g: torch.Generator):
    """One MoE layer's bf16 ``(w13 [E, 2I, H], w2 [E, H, I], router [E, H])`` drawn from ``g``."""
    w13 = (torch.randn(E, 2 * I, H, device=DEV, generator=g) / H**0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device=DEV, generator=g) / I**0.5).to(torch.bfloat16)
    router = (torch.randn(E, H, device=DEV, generator=g) / H**0.5).to(torch.bfloat16)
    return w13, w2, router


def _batch(t: int):
    """Activations and routing for ``t`` tokens: ``(x, weights, ids, experts hit)``."""
    g = torch.Generator(DEV).manual_seed(t)
    x = torch.randn(t, H, device=DEV, generator=g).to(torch.bfloat16)
    logits = x @ _experts()[2].t()  # [T, E]
    weights, ids = torch.ops.kiln.moe_topk(logits, None, K, True, "softmax", 1, 1, 1.0)
    return x, weights, ids, int(torch.unique(ids).numel())


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t", TOKENS)
def test_fused_moe(measure, t, impl):
    w13, w2, _ = _experts()
    x, weights, ids, hit = _batch(t)
    wbytes = 1 if impl == "triton_fp8" else 2
    act = 2 * t * H * 2  # x in, y out (bf16)
    moved = hit * 3 * H * I * wbytes + act
    flops = 2.0 * t * K * 3 * H * I
    c1, c2 = mg.pick_configs(TUNING, E, I, H, t, K)
    bm = c1["BLOCK_M"]
    info = dict(t=t, impl=impl, experts_hit=hit, E=E, top_k=K, H=H, I=I, block_m=bm, w13=c1, w2=c2)
    info |= dict(variant="gemv" if bm == 1 else "grouped", tuning="KILN_MOE_TUNING" if TUNING else "default")
    if impl == "routing":
        logits = x @ _experts()[2].t()
        fn = graphed(lambda: torch.ops.kiln.moe_topk(logits, None, K, True, "softmax", 1, 1, 1.0))
        measure(fn, bytes=t * E * 2 + t * K * 8, **info)
        return
    if impl == "align":
        block = bm if bm > 1 else mg.auto_block_m(t * K / E)
        fn = graphed(lambda: torch.ops.kiln.moe_align(ids, None, E, block))
        measure(fn, bytes=t * K * 4, **(info | dict(block_m=block, used=bm > 1)))
        return
    if impl == "eager":
        fn = lambda: eager_moe(x, w13, w2, weights, ids)
    elif impl == "cutlass_sm90":
        why = _cutlass_unavailable(x, w13, w2)
        if why:
            pytest.skip(why)
        out = moe_cutlass.fused_moe_cutlass(x, w13, w2, weights, ids, None)  # also sets up outside the graph
        ref = eager_moe(x.float(), w13.float(), w2.float(), weights, ids)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, f"CUTLASS MoE vs eager float32: relative error {err:.2e}"
        info |= dict(backend="cutlass", variant="cutlass_sm90")
        fn = graphed(lambda: moe_cutlass.fused_moe_cutlass(x, w13, w2, weights, ids, None))
    elif impl == "cutlass":
        if not hasattr(torch, "_grouped_mm"):
            pytest.skip(f"torch {torch.__version__} has no _grouped_mm")
        w13t, w2t = w13.transpose(1, 2), w2.transpose(1, 2)
        out = cutlass_moe(x, w13t, w2t, weights, ids)
        ref = eager_moe(x.float(), w13.float(), w2.float(), weights, ids)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, f"grouped_mm MoE vs eager float32: relative error {err:.2e}"
        fn = graphed(lambda: cutlass_moe(x, w13t, w2t, weights, ids))
    else:
        if impl == "triton_fp8":
            w13, s13 = quantize_fp8_per_channel(w13)
            w2, s2 = quantize_fp8_per_channel(w2)
        else:
            s13 = s2 = None
        fn = graphed(lambda: torch.ops.kiln.fused_moe(x, w13, w2, weights, ids, None, s13, s2, TUNING))
    measure(fn, bytes=moved, flops=flops, **info)
    if impl == "triton":  # the benchmark also checks what it measured
        out = torch.ops.kiln.fused_moe(x, w13, w2, weights, ids, None, None, None, TUNING)
        ref = eager_moe(x.float(), w13.float(), w2.float(), weights, ids)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, f"fused_moe vs eager float32: relative error {err:.2e}"


# ---- launch-config sweeps (GPU only) ----------------------------------------------------------------


def _cfg(bm, bn, bk, gm, warps, stages):
    return dict(zip(mg.CONFIG_KEYS, (bm, bn, bk, gm, warps, stages), strict=True))


def _gemv(bn, bk, warps, stages, group=1):
    return _cfg(1, bn, bk, group, warps, stages)


def cfg_id(c: dict[str, int]) -> str:
    tail = f"k{c['BLOCK_K']}_w{c['num_warps']}_s{c['num_stages']}"
    if c["BLOCK_M"] == 1:
        return f"gemv{'sum' if c['GROUP_M'] > 1 else ''}_n{c['BLOCK_N']}_{tail}"
    return f"m{c['BLOCK_M']}_n{c['BLOCK_N']}_k{c['BLOCK_K']}_g{c['GROUP_M']}_w{c['num_warps']}_s{c['num_stages']}"


# Candidates. GEMV: BLOCK_N weight rows per program (w13: gate + up halves), BLOCK_K, warps, stages;
# w2 ``gemvsum`` (GROUP_M 8): a program takes a token's k pairs (a [k * BLOCK_N, BLOCK_K] tile per
# step) and writes their sum, else one pair per program and the combine kernel.
GEMV_W13 = [
    _gemv(16, 256, 4, 3), _gemv(32, 256, 4, 3), _gemv(32, 256, 4, 4), _gemv(32, 512, 4, 3),
    _gemv(32, 512, 8, 3), _gemv(64, 256, 8, 3), _gemv(64, 128, 4, 4), _gemv(32, 256, 4, 1),
    _gemv(16, 512, 4, 3),
]  # fmt: skip
GEMV_W2 = [
    _gemv(32, 256, 4, 3), _gemv(16, 256, 4, 3), _gemv(32, 256, 4, 4), _gemv(64, 256, 8, 3),
    _gemv(32, 128, 4, 4), _gemv(32, 256, 4, 1),
    _gemv(4, 256, 4, 3, 8), _gemv(8, 256, 8, 2, 8), _gemv(4, 128, 4, 4, 8), _gemv(8, 128, 8, 3, 8),
]  # fmt: skip
GROUPED_DECODE = [  # BLOCK_M 16: one expert's few rows per program (the first two: the old defaults)
    _cfg(16, 64, 64, 1, 4, 4), _cfg(16, 64, 128, 1, 4, 3), _cfg(16, 128, 128, 1, 4, 3),
    _cfg(16, 64, 256, 1, 4, 3), _cfg(16, 128, 64, 1, 4, 4), _cfg(16, 32, 128, 1, 4, 4),
]  # fmt: skip
GROUPED_PREFILL = [  # the first: the current default at 4096 tokens
    _cfg(bm, *tile)
    for bm in (128, 64)
    for tile in (
        (256, 64, 16, 8, 3), (256, 64, 16, 8, 4), (128, 64, 16, 8, 3), (128, 64, 16, 8, 4),
        (128, 64, 8, 4, 4), (128, 128, 16, 8, 3), (256, 64, 1, 8, 3), (64, 64, 16, 4, 4),
        (256, 128, 16, 8, 2),
    )
]  # fmt: skip
GEMM_SWEEP = (
    [("w13", t, c) for t in (1, 8) for c in GEMV_W13 + GROUPED_DECODE]
    + [("w2", t, c) for t in (1, 8) for c in GEMV_W2 + GROUPED_DECODE]
    + [(g, 4096, c) for g in ("w13", "w2") for c in GROUPED_PREFILL]
)
_GEMV0 = tuple(_gemv(*tile[:2], *tile[3:], tile[2]) for tile in mg.DEFAULT_TABLE[0][2:])
FUSED_SWEEP = {  # (w13, w2) pairs for the whole op
    "grouped_old_small": (GROUPED_DECODE[0], GROUPED_DECODE[0]),  # the T <= 4 default before the GEMV
    "grouped_old_mid": (GROUPED_DECODE[1], GROUPED_DECODE[1]),  # the T = 5..32 default
    "gemv_default": _GEMV0,
    "gemv_a": (_gemv(32, 512, 4, 3), _gemv(32, 256, 4, 3)),
    "gemv_b": (_gemv(16, 256, 4, 3), _gemv(16, 256, 4, 3)),
    "gemv_c": (_gemv(64, 256, 8, 3), _gemv(64, 256, 8, 3)),
    "gemvsum_a": (_gemv(32, 256, 4, 3), _gemv(4, 256, 4, 3, 8)),
    "gemvsum_b": (_gemv(32, 256, 4, 3), _gemv(8, 256, 8, 2, 8)),
}


def _compiled(fn, what: str):
    """Run ``fn`` once (compiling it); a config the GPU cannot hold is skipped, not failed."""
    try:
        return fn()
    except triton.runtime.errors.OutOfResources as err:
        pytest.skip(f"{what}: {err}")


def _rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize(
    "gemm, t, cfg", GEMM_SWEEP, ids=[f"{g}-{t}tok-{cfg_id(c)}" for g, t, c in GEMM_SWEEP]
)
def test_moe_gemm_sweep(measure, gemm, t, cfg):
    w13, w2, _ = _experts()
    x, weights, ids, hit = _batch(t)
    p = t * K
    g = torch.Generator(DEV).manual_seed(p)
    hid = torch.randn(p, I, device=DEV, generator=g).to(torch.bfloat16)  # the w2 GEMM's input
    ids = ids.contiguous()
    if gemm == "w13":
        w, a, a_div, n, kk, cols, tw = w13, x, K, 2 * I, H, I, None
    else:
        w, a, a_div, n, kk, cols, tw = w2, hid, 1, H, I, H, weights
    fuse = gemm == "w13"
    cfg = mg.clip_config(cfg, n, kk)
    gemv = cfg["BLOCK_M"] == 1
    fused_sum = gemv and gemm == "w2" and cfg["GROUP_M"] > 1  # the w2 GEMV writes the top-k sum
    y = torch.empty(p, cols, device=DEV, dtype=torch.bfloat16)  # per-pair rows
    out = torch.empty(t, cols, device=DEV, dtype=torch.bfloat16)  # w2: the top-k sum
    last_sum = gemv and gemm == "w2" and not fused_sum
    counters = moe.COUNTERS.get(a.device, t * triton.cdiv(cols, cfg["BLOCK_N"])) if last_sum else None
    if gemv:  # w2, one pair per program: the last arrival's top-k sum as the op runs it (default)
        run = lambda: mg.moe_gemv_launch(
            a, None, w, None, out if fused_sum else y, tw, ids, None, cfg, a_div, fuse, fused_sum,
            sum_out=out if last_sum else None, counters=counters,
        )  # fmt: skip
    else:
        align = moe_align_run(ids, None, E, cfg["BLOCK_M"])
        run = lambda: mg.moe_gemm_launch(a, None, w, None, y, tw, *align, cfg, a_div, fuse)
    if gemm == "w2" and not fused_sum and not last_sum:  # every w2 row includes the top-k sum
        fn = lambda: (run(), moe.moe_combine(y, ids, None, out))
    else:
        fn = run
    _compiled(fn, cfg_id(cfg))
    # checked against a grouped-GEMM default (a wrong fast config must not win)
    ref_cfg = mg.moe_config(E, n, kk, max(t, 64), K, gemm)
    ref = torch.empty(p, cols, device=DEV, dtype=torch.bfloat16)
    ref_align = moe_align_run(ids, None, E, ref_cfg["BLOCK_M"])
    mg.moe_gemm_launch(a, None, w, None, ref, tw, *ref_align, ref_cfg, a_div, fuse)
    got = y if gemm == "w13" else out
    if gemm == "w2":
        ref = moe.moe_combine(ref, ids, None)
    assert _rel(got, ref) < 1e-2, f"{cfg_id(cfg)} disagrees with {cfg_id(ref_cfg)}"
    wbytes = hit * n * kk * 2
    act = (t if gemm == "w13" else p) * kk * 2 + got.numel() * 2
    flops = 2.0 * p * n * kk
    info = dict(gemm=gemm, t=t, config=cfg_id(cfg), cfg=cfg, experts_hit=hit)
    info["variant"] = "gemv" if gemv else "grouped"
    if t >= 1024:  # compute-bound: the table shows frac_mm
        measure(graphed(fn), flops=flops, **info)
    else:
        measure(graphed(fn), bytes=wbytes + act, flops=flops, **info)


FUSED_CASES = [(t, name) for t in (1, 4, 8, 16) for name in FUSED_SWEEP]


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize("t, name", FUSED_CASES, ids=[f"{t}tok-{n}" for t, n in FUSED_CASES])
def test_fused_moe_sweep(measure, t, name):
    w13, w2, _ = _experts()
    x, weights, ids, hit = _batch(t)
    c1, c2 = (mg.clip_config(c, n, k) for c, n, k in zip(FUSED_SWEEP[name], (2 * I, H), (H, I), strict=True))
    fn = lambda: moe.fused_moe_forward(x, w13, w2, weights, ids, None, None, None, "", configs=(c1, c2))
    out = _compiled(fn, name)
    ref = eager_moe(x.float(), w13.float(), w2.float(), weights, ids)
    assert _rel(out, ref) < 2e-2, name
    info = dict(t=t, pair=name, w13=cfg_id(c1), w2=cfg_id(c2), config=f"{cfg_id(c1)}+{cfg_id(c2)}")
    measure(graphed(fn), bytes=hit * 3 * H * I * 2 + 2 * t * H * 2, flops=2.0 * t * K * 3 * H * I, **info)


def test_sweep_candidates_are_valid():
    # every candidate passes the op's checks once clipped to the real shapes (also in smoke mode)
    for gemm, _, c in GEMM_SWEEP:
        n, k = (2 * 768, 2048) if gemm == "w13" else (2048, 768)
        mg.check_config(mg.clip_config(c, n, k))
    for c1, c2 in FUSED_SWEEP.values():
        assert c1["BLOCK_M"] == c2["BLOCK_M"]
    ids = [cfg_id(c) for *_, c in GEMM_SWEEP]
    assert len(set(zip([g for g, *_ in GEMM_SWEEP], [t for _, t, _ in GEMM_SWEEP], ids))) == len(ids)
    assert json.loads(mg.moe_tuning_table(128, 768, 2048, 8, 64))  # the recordable form of the table
