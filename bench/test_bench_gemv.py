"""Decode GEMV (ops/linear/gemv.py) against cuBLAS (``F.linear``) at Llama-3.1-8B shapes, bf16.

Shapes ``[N, K]`` per layer: qkv [6144, 4096], o [4096, 4096], gate_up [28672, 4096] (gate rows, then
up rows), down [4096, 14336]; lm_head [128256, 4096]. ``frac_bw`` counts weight + activation + output
bytes over the read bandwidth measured in the session (a GEMV at M <= 8 is a pass over W). On a GPU
every variant is captured in a CUDA graph and replayed; ``do_bench`` flushes L2 between runs, so W
comes from HBM as it does in a decode step (every layer's weights evict the previous ones').

* ``test_gemv[SHAPE-mM-IMPL]``: ``gemv`` (the default config: ``TUNED`` or the heuristic) and
  ``cublas``; gemv rows also carry ``cublas_ms`` and ``speedup_vs_cublas``. gate_up here is the plain
  [28672, 4096] product.
* ``test_gate_up[mM-IMPL]``: the fused gate_up GEMV writing ``silu(gate) * up`` (``fused``) against
  ``cublas+silu_and_mul`` (what the MLP ran before) and ``gemv+silu_and_mul`` (the fusion alone).
* ``test_gemv_sweep[SHAPE-mM-CONFIG]`` (GPU only, ``-k sweep``): every candidate launch config of
  ``SWEEP`` for the 5 shapes (gate_up in its fused form, as the MLP calls it) at M = 1 and 8
  (``KILN_GEMV_SWEEP_M=1,2,4,8`` for more); the candidates are compiled first in parallel
  processes (``KILN_GEMV_SWEEP_PRECOMPILE=0``: one by one inside the tests instead). Each row is checked against cuBLAS and records ``ms``, ``frac_bw``, ``cublas_ms`` (the
  speedup is ``cublas_ms / ms``; for gate_up cuBLAS + ``silu_and_mul``) and ``tuned_entry``, the line
  to paste into ``ops/linear/gemv.py: TUNED`` for the winner of its (shape, M);
  ``python bench/test_bench_gemv.py RAW.json`` prints the best configs and the ``TUNED`` block.
  Config ids: ``fma_nBN_kBK_wWARPS_splitS`` / ``dot_nBN_kBK_wWARPS_sSTAGES_splitS``; ``heuristic``
  is the current default.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
import torch.nn.functional as F
import triton
from conftest import SMOKE, _median_ms, graphed, pick

from kiln import settings
from kiln.ops.activation.silu_and_mul import silu_and_mul_ref
from kiln.ops.common.launch import next_pow2
from kiln.ops.linear import gemv as G

pytestmark = pytest.mark.usefixtures("kernels_on_cpu")

DEV = "cpu" if SMOKE else "cuda"
DTYPE = torch.bfloat16
SHAPES = pick(
    {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
     "lm_head": (128256, 4096)},
    {"tiny": (48, 64)},
)  # fmt: skip
MS = pick([1, 8], [1, 3])
GATE_UP_NK = pick((28672, 4096), (48, 64))


@functools.cache
def _weight(n: int, k: int) -> torch.Tensor:
    g = torch.Generator(DEV).manual_seed(n * 7 + k)
    return (torch.randn(n, k, device=DEV, generator=g) / k**0.5).to(DTYPE)


def _x(m: int, k: int) -> torch.Tensor:
    g = torch.Generator(DEV).manual_seed(m)
    return torch.randn(m, k, device=DEV, generator=g).to(DTYPE)


def _bytes(m: int, n_w: int, k: int, n_out: int) -> float:
    return 2.0 * (n_w * k + m * k + m * n_out)


@functools.cache
def _cublas_ms(m: int, n: int, k: int, gate_up: bool) -> float:
    w, x = _weight(n, k), _x(m, k)
    if gate_up:
        return _median_ms(graphed(lambda: torch.ops.kiln.silu_and_mul(F.linear(x, w))))
    return _median_ms(graphed(lambda: F.linear(x, w)))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("impl", ["gemv", "cublas"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("name", list(SHAPES))
def test_gemv(measure, name, m, impl):
    n, k = SHAPES[name]
    w, x = _weight(n, k), _x(m, k)
    fn = (lambda: G.gemv(x, w)) if impl == "gemv" else (lambda: F.linear(x, w))
    assert _rel(fn(), F.linear(x, w)) < 1e-2
    info = dict(shape=name, m=m, n=n, k=k, impl=impl)
    if impl == "gemv":
        cfg = G.gemv_config(m, n, k, False, 2, G.sm_count(x.device))
        info["config"] = dataclasses.asdict(cfg)
        if not SMOKE:
            ms, ref_ms = _median_ms(graphed(fn)), _cublas_ms(m, n, k, False)
            info |= dict(cublas_ms=ref_ms, speedup_vs_cublas=ref_ms / ms)
    measure(graphed(fn), bytes=_bytes(m, n, k, n), flops=2.0 * m * n * k, **info)


@pytest.mark.parametrize("impl", ["fused", "cublas+silu_and_mul", "gemv+silu_and_mul"])
@pytest.mark.parametrize("m", MS)
def test_gate_up(measure, m, impl):
    n, k = GATE_UP_NK
    w, x = _weight(n, k), _x(m, k)
    fns = {
        "fused": lambda: G.gemv(x, w, gate_up=True),
        "cublas+silu_and_mul": lambda: torch.ops.kiln.silu_and_mul(F.linear(x, w)),
        "gemv+silu_and_mul": lambda: torch.ops.kiln.silu_and_mul(G.gemv(x, w)),
    }
    fn = fns[impl]
    assert _rel(fn(), silu_and_mul_ref(F.linear(x, w))) < 1e-2
    info = dict(shape="gate_up", m=m, n=n, k=k, impl=impl)
    if impl == "fused" and not SMOKE:
        ms, ref_ms = _median_ms(graphed(fn)), _cublas_ms(m, n, k, True)
        info |= dict(cublas_ms=ref_ms, speedup_vs_cublas=ref_ms / ms)
    measure(graphed(fn), bytes=_bytes(m, n, k, n // 2), flops=2.0 * m * n * k, **info)


# ---- launch-config sweep (GPU only) ---------------------------------------------------------------


def _fma(bn, bk, warps, split):
    return G.GemvConfig(bn, bk, warps, 1, split, False)


def _dot(bn, bk, warps, stages, split):
    return G.GemvConfig(bn, bk, warps, stages, split, True)


def cfg_id(c: G.GemvConfig) -> str:
    if c.use_dot:
        return f"dot_n{c.block_n}_k{c.block_k}_w{c.num_warps}_s{c.num_stages}_split{c.split_k}"
    return f"fma_n{c.block_n}_k{c.block_k}_w{c.num_warps}_split{c.split_k}"


# CUDA-core candidates (M <= 4): rows per program, K per step, warps, split-K. Each thread has
# BN * BK / (32 * warps) W elements (x2 for gate_up) in flight per step. Cross-compiled for sm_90 at
# these shapes: no spills and no layout conversion in the loop at M <= 2 (<= 128 registers but
# n16_k512_w4_split4 with gate_up, ~150); at M = 4 with gate_up most use ~170 registers.
FMA_CANDIDATES = [
    _fma(2, 1024, 4, 1), _fma(2, 2048, 4, 1), _fma(2, 512, 2, 1), _fma(4, 512, 4, 1), _fma(4, 1024, 4, 1),
    _fma(4, 2048, 8, 1), _fma(4, 1024, 8, 1), _fma(8, 256, 4, 1), _fma(8, 512, 4, 1), _fma(8, 1024, 8, 1),
    _fma(16, 256, 4, 1), _fma(16, 512, 8, 1), _fma(4, 1024, 4, 2), _fma(8, 512, 4, 2), _fma(16, 256, 4, 2),
    _fma(8, 512, 4, 4), _fma(16, 512, 4, 4),
]  # fmt: skip
# Tensor-core candidates (any M <= 16): W rows per program, K per step, warps, stages, split-K.
DOT_CANDIDATES = [
    _dot(16, 256, 4, 4, 1), _dot(16, 256, 4, 4, 2), _dot(16, 256, 4, 4, 4), _dot(16, 512, 4, 3, 1),
    _dot(16, 128, 4, 6, 1), _dot(16, 256, 2, 4, 1), _dot(32, 256, 4, 4, 1), _dot(32, 256, 4, 3, 2),
    _dot(32, 128, 4, 5, 2), _dot(64, 128, 4, 4, 1), _dot(64, 128, 4, 4, 2), _dot(64, 128, 4, 4, 4),
    _dot(64, 256, 8, 3, 2), _dot(128, 64, 4, 5, 4),
]  # fmt: skip
SWEEP_SHAPES = {  # name: (N_out, K, gate_up); moe_*: Qwen3-30B-A3B's attention projections
    "qkv": (6144, 4096, False), "o": (4096, 4096, False), "gate_up": (14336, 4096, True),
    "down": (4096, 14336, False), "lm_head": (128256, 4096, False),
    "moe_qkv": (5120, 2048, False), "moe_o": (2048, 4096, False),
}  # fmt: skip
SWEEP_MS = list(settings.value("gemv_sweep_m"))  # KILN_GEMV_SWEEP_M
# KILN_GEMV_SWEEP_CHAIN=MB: each timed graph launches the GEMV over distinct weight copies of at
# least MB megabytes in all, back to back, as a decode step does layer after layer (the single-launch
# timing adds a graph launch's fixed cost to every row); ``ms`` is per launch.
CHAIN_MB = settings.value("gemv_sweep_chain")


def _copies(n_w: int, k: int) -> int:
    return max(1, -(-CHAIN_MB * 10**6 // (2 * n_w * k))) if CHAIN_MB else 1


@functools.cache
def _weights(n: int, k: int, copies: int) -> tuple[torch.Tensor, ...]:
    if copies == 1:
        return (_weight(n, k),)
    return tuple(_weight(n, k).roll(i, 0).contiguous() for i in range(copies))


@functools.cache
def _cublas_chain_ms(m: int, n: int, k: int, gate_up: bool, copies: int) -> float:
    """cuBLAS over the same chain, for the whole chain (as the row's ``ms``)."""
    ws, x = _weights(n, k, copies), _x(m, k)
    if gate_up:
        return _median_ms(graphed(lambda: [torch.ops.kiln.silu_and_mul(F.linear(x, w)) for w in ws]))
    return _median_ms(graphed(lambda: [F.linear(x, w) for w in ws]))


def _candidates(m: int) -> list[G.GemvConfig | None]:
    fma = FMA_CANDIDATES if next_pow2(m) <= G.FMA_MAX_M else []
    return [None, *fma, *DOT_CANDIDATES]  # None: the current default


SWEEP = [(name, m, c) for name in SWEEP_SHAPES for m in SWEEP_MS for c in _candidates(m)]


def _resolve(name: str, m: int, cfg: G.GemvConfig | None) -> G.GemvConfig:
    n, k, gate_up = SWEEP_SHAPES[name]
    if cfg is None:
        return G.gemv_config(m, n, k, gate_up, 2, G.sm_count(torch.device(DEV)))
    return cfg


@pytest.fixture(scope="module")
def _precompiled(request):
    """Compile every selected sweep candidate in parallel processes first (Triton's on-disk cache
    then serves the tests), instead of one at a time inside the timed loop."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = []
    for item in request.session.items:
        p = getattr(getattr(item, "callspec", None), "params", {})
        if item.originalname == "test_gemv_sweep" and "cfg" in p:
            n, k, gate_up = SWEEP_SHAPES[p["name"]]
            jobs.append((p["m"], n, k, gate_up, _resolve(p["name"], p["m"], p["cfg"])))
    jobs = list(dict.fromkeys(jobs))
    if not jobs or not settings.value("gemv_sweep_precompile"):  # KILN_GEMV_SWEEP_PRECOMPILE
        return {}
    workers = max(1, min(16, (os.cpu_count() or 2) - 1, len(jobs)))
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as ex:
        errors = list(ex.map(G.compile_for, *zip(*jobs, strict=True)))
    return {job: err for job, err in zip(jobs, errors, strict=True) if err}


@pytest.mark.skipif(SMOKE, reason="configuration sweep: GPU only")
@pytest.mark.parametrize(
    "name, m, cfg", SWEEP, ids=[f"{n}-m{m}-{cfg_id(c) if c else 'heuristic'}" for n, m, c in SWEEP]
)
def test_gemv_sweep(measure, _precompiled, name, m, cfg):
    n_out, k, gate_up = SWEEP_SHAPES[name]
    heuristic = cfg is None
    cfg = _resolve(name, m, cfg)
    n_w = 2 * n_out if gate_up else n_out
    copies = _copies(n_w, k)
    ws, x = _weights(n_w, k, copies), _x(m, k)
    w = ws[0]
    over = dataclasses.asdict(cfg)
    fn = lambda: G.gemv(x, w, gate_up=gate_up, **over)
    try:
        out = fn()
    except triton.runtime.errors.OutOfResources as err:
        pytest.skip(f"{cfg_id(cfg)}: {err}")
    ref = F.linear(x, w)
    assert _rel(out, silu_and_mul_ref(ref) if gate_up else ref) < 1e-2, cfg_id(cfg)
    key = (next_pow2(m), n_out, k, gate_up, 2)
    info = dict(
        shape=name, m=m, n=n_w, k=k, config=cfg_id(cfg), cfg=over, heuristic=heuristic,
        tuned_entry=f"{key}: GemvConfig(**{over}),", chain_copies=copies,
    )  # fmt: skip
    nbytes, flops = _bytes(m, n_w, k, n_out), 2.0 * m * n_w * k
    if copies == 1:
        info["cublas_ms"] = _cublas_ms(m, n_w, k, gate_up)
        measure(graphed(fn), bytes=nbytes, flops=flops, **info)
        return
    # chain: one timed graph runs all copies (ms and cublas_ms are for the whole chain)
    chain = lambda: [G.gemv(x, wi, gate_up=gate_up, **over) for wi in ws]
    info["cublas_ms"] = _cublas_chain_ms(m, n_w, k, gate_up, copies)
    measure(graphed(chain), bytes=nbytes * copies, flops=flops * copies, **info)


def test_sweep_candidates_are_valid():
    """Every candidate passes the launcher's checks (runs in smoke mode too, on a tiny shape)."""
    ids = [f"{n}-m{m}-{cfg_id(c) if c else 'heuristic'}" for n, m, c in SWEEP]
    assert len(set(ids)) == len(ids)
    for c in FMA_CANDIDATES + DOT_CANDIDATES:
        for v in (c.block_n, c.block_k, c.num_warps, c.split_k):
            assert v & (v - 1) == 0, c
        assert not c.use_dot or (c.block_n >= 16 and c.block_k >= 16)
        smem = c.num_stages * (c.block_n * 2 + G.DOT_M) * c.block_k * 2 if c.use_dot else 0
        assert smem <= 227 * 1024, c  # with gate_up's two W tiles: within an H100/H200 block's limit


def summarize(raw_json: str, top: int = 3) -> None:
    """Print the sweep's best configs per (shape, M) and the ``TUNED`` lines of the winners."""
    import json

    with open(raw_json) as f:
        rows = [b["extra_info"] for b in json.load(f)["benchmarks"] if "tuned_entry" in b["extra_info"]]
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["m"]), []).append(r)
    winners = []
    for (shape, m), rs in sorted(groups.items()):
        rs.sort(key=lambda r: r["ms"])
        heur = next((r for r in rs if r.get("heuristic")), None)
        per = rs[0].get("chain_copies", 1)  # chain rows: ms per launch
        print(f"{shape} M={m}: cuBLAS {rs[0]['cublas_ms'] * 1e3 / per:.1f} us", end="")
        print(f", heuristic {heur['ms'] * 1e3 / per:.1f} us" if heur else "")
        for r in rs[:top]:
            print(
                f"  {r['config']:<36} {r['ms'] * 1e3 / per:7.1f} us  frac_bw {r['frac_bw']:.3f}  "
                f"x{r['cublas_ms'] / r['ms']:.2f} vs cuBLAS"
            )
        winners.append(rs[0]["tuned_entry"])
    print("TUNED = {\n" + "\n".join(f"    {w}" for w in winners) + "\n}")


if __name__ == "__main__":  # python bench/test_bench_gemv.py SWEEP_RAW.json
    import sys

    summarize(sys.argv[1])
