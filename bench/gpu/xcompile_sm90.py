"""Cross-compile the residual-epilogue / folded-norm kernel variants for sm_90 on a machine without
a GPU (the local Triton; the H200 runs triton 3.6), and report whether any spills to local memory.
A check between GPU runs, not a substitute for them: `python bench/gpu/xcompile_sm90.py`.
"""

import inspect

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kiln.ops import gemv as G
from kiln.ops import moe as M
from kiln.ops import moe_gemm as MG


def xc(fn, sig, consts, warps=4):
    names = list(inspect.signature(fn.fn).parameters)
    signature = {n: sig.get(n, "i32") for n in names if n not in consts}
    for n in consts:
        signature[n] = "constexpr"
    cx = {(names.index(n),): v for n, v in consts.items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=cx)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
    ptx = k.asm["ptx"]
    print(
        fn.fn.__name__,
        "ok",
        "local" if ".local" in ptx else "no-local",
        k.n_regs if hasattr(k, "n_regs") else "",
    )


P = "*bf16"
# FMA GEMV: M=1, residual, split 1
fma_ptrs = {n: P for n in ("X", "W", "B", "Y", "R", "G", "H", "XN", "Z")} | {
    "P": "*fp32",
    "XS": "*fp32",
    "WS": "*fp32",
    "eps": "fp32",
}
base = dict(
    BLOCK_M=1,
    BLOCK_N=2,
    BLOCK_K=512,
    VEC=8,
    SPLIT_K=1,
    GATE_UP=False,
    HAS_BIAS=False,
    EVEN_K=True,
    ROUND_IN_F32=False,
    PDL=True,
    SCALED=False,
    NORM=False,
    HAS_RES=False,
    WRITE_H=False,
    WRITE_XN=False,
    CHUNK=1,
    HAS_G=True,
)
xc(G._gemv_fma_kernel, fma_ptrs, base | dict(ADD_Z=True))
xc(G._gemv_fma_kernel, fma_ptrs, base | dict(NORM=True, HAS_G=False, WRITE_XN=True, CHUNK=32))
xc(G._gemv_fma_kernel, fma_ptrs, base | dict(SPLIT_K=4, ADD_Z=False))
xc(
    G._splitk_reduce_kernel,
    {"P": "*fp32", "B": P, "Y": P, "Z": P},
    dict(SPLIT_K=4, BLOCK=256, GATE_UP=False, HAS_BIAS=False, ROUND_IN_F32=False, PDL=True, ADD_Z=True),
    2,
)
xc(
    G._gemv_dot_kernel,
    {n: P for n in ("X", "W", "B", "Y", "Z")} | {"P": "*fp32"},
    dict(
        BLOCK_M=16,
        BLOCK_N=16,
        BLOCK_K=256,
        SPLIT_K=1,
        GATE_UP=False,
        HAS_BIAS=False,
        EVEN_K=True,
        ROUND_IN_F32=False,
        PDL=True,
        ADD_Z=True,
    ),
)
moe_ptrs = {
    "A": P,
    "A_SCALE": P,
    "W": P,
    "W_SCALE": P,
    "C": P,
    "TOPK_W": "*fp32",
    "IDS": "*i32",
    "MAP": "*i32",
    "OUT": P,
    "CNT": "*i32",
    "LOGITS": P,
    "Z": P,
    "route_scale": "fp32",
}
mb = dict(
    A_DIV=1,
    GROUP=1,
    P_PAD=1,
    HAS_MAP=False,
    FUSE_SILU=False,
    MUL_WEIGHT=True,
    FP8=False,
    ROUND_IN_F32=False,
    BLOCK_N=32,
    BLOCK_K=256,
    STAGES=1,
    PDL=True,
    SUM_K=8,
    EARLY=False,
    KP=1,
    LATE_TRIGGER=False,
    ROUTE_K=0,
    E_PAD=1,
    RENORM=False,
    ROUND_W=0,
)
xc(MG._moe_gemv_kernel, moe_ptrs, mb | dict(ADD_Z=True))
xc(MG._moe_gemv_kernel, moe_ptrs, mb | dict(ADD_Z=False))
xc(MG._moe_gemv_kernel, moe_ptrs, mb | dict(GROUP=8, P_PAD=8, SUM_K=0, BLOCK_N=8, ADD_Z=True))
xc(
    M._combine_kernel,
    {"Y2": P, "IDS": "*i32", "MAP": "*i32", "OUT": P, "Z": P},
    dict(HAS_MAP=False, BLOCK_H=1024, RF=False, PDL=True, ADD_Z=True),
)
