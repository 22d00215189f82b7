"""Cross-compile kernel variants for sm_90 on a machine without a GPU (the local Triton; the H200
runs triton 3.6) and report their registers and spills, from the bundled ptxas run with ``-v`` on
the PTX (spills are made by ptxas, so the PTX itself never shows them). Pointer arguments are
declared 16-byte aligned, as the real launches specialize them. A check between GPU runs, not a
substitute for them: `python bench/gpu/xcompile_sm90.py`.
"""

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kiln.ops.linear import gemv as G
from kiln.ops.moe import fused as M
from kiln.ops.moe import gemm as MG

BF16, F32, I32 = "*bf16", "*fp32", "*i32"


def xc(fn, types: dict[str, str], consts: dict, warps: int = 4, div16: tuple[str, ...] = ()) -> None:
    """Compile ``fn`` for sm_90: ``types`` for its non-integer arguments (the rest i32), ``consts``
    for the constexprs without a default (and any default to override). ``div16``: integer
    arguments to declare multiples of 16, as Triton specializes them at a real launch (sizes and
    strides of 2048, 4096, ...). Without it the integer offsets look unaligned, the 16-byte loads
    become scalar ones and the register counts come out two to five times too high (twelfth
    session: 80 vs 42 for the o GEMV)."""
    signature, constexprs, attrs = {}, {}, {}
    for p in fn.params:
        if p.is_constexpr:
            signature[p.name] = "constexpr"
            constexprs[(p.num,)] = consts[p.name] if p.name in consts or not p.has_default else p.default
        else:
            signature[p.name] = types.get(p.name, "i32")
            if signature[p.name].startswith("*") or p.name in div16:
                attrs[(p.num,)] = [["tt.divisibility", 16]]
    k = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=warps),
    )
    print(fn.fn.__name__, consts, _ptxas_report(k.asm["ptx"]))


def _ptxas_report(ptx: str) -> str:
    """``registers N, spill stores B, spill loads B`` from the bundled ptxas (``-v``), sm_90a."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run(
            [str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(d) / "k.cubin")],
            capture_output=True,
            text=True,
        )
    log = run.stdout + run.stderr
    regs = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if run.returncode or not regs or not spills:
        return "ptxas failed: " + log.strip().splitlines()[-1] if log.strip() else "ptxas failed"
    return f"registers {regs[1]}, spill stores {spills[1]} B, spill loads {spills[2]} B"


gemv_types = dict.fromkeys(("X", "W", "B", "Y", "R", "G", "H", "XN", "Z"), BF16)
gemv_types |= {"P": F32, "XS": F32, "WS": F32, "eps": "fp32"}
fma = dict(BLOCK_M=1, BLOCK_N=2, BLOCK_K=512, VEC=8, SPLIT_K=1, GATE_UP=False, HAS_BIAS=False, EVEN_K=True,
           ROUND_IN_F32=False, PDL=True, SCALED=False)  # fmt: skip
# the sizes and strides of the Qwen3-30B-A3B / Llama-3.1-8B GEMVs are multiples of 16; M is not specialized
gemv_div = ("N_OUT", "K", "K_SPLIT", "stride_xm", "stride_wn", "stride_ym", "UP_OFF", "stride_zm")
qkv = fma | dict(NORM=True, HAS_G=False, WRITE_XN=True, CHUNK=32)  # 2 x 512, 2 warps: the qkv rung
o = fma | dict(BLOCK_K=2048, ADD_Z=True)  # 2 x 2048, 4 warps: the o rung
for extra in ({}, dict(PREWAIT=True)):  # KILN_PREWAIT's peeled first step
    xc(G._gemv_fma_kernel, gemv_types, qkv | extra, 2, gemv_div)
    xc(G._gemv_fma_kernel, gemv_types, o | extra, 4, gemv_div)
xc(G._gemv_fma_kernel, gemv_types, fma | dict(SPLIT_K=4), 4, gemv_div)
xc(G._gemv_fma_kernel, gemv_types, qkv | dict(BLOCK_K=2048, PREWAIT=True), 2, gemv_div)  # whole slab
xc(G._gemv_fma_kernel, gemv_types, o | dict(BLOCK_K=4096, PREWAIT=True), 4, gemv_div)
xc(G._splitk_reduce_kernel, gemv_types,
   dict(SPLIT_K=4, BLOCK=256, GATE_UP=False, HAS_BIAS=False, ROUND_IN_F32=False, PDL=True, ADD_Z=True),
   2)  # fmt: skip
xc(G._gemv_dot_kernel, gemv_types,
   dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, GATE_UP=False, HAS_BIAS=False, EVEN_K=True,
        ROUND_IN_F32=False, PDL=True, ADD_Z=True))  # fmt: skip

moe_types = dict.fromkeys(("A", "A_SCALE", "W", "W_SCALE", "C", "OUT", "LOGITS", "Z", "Y2"), BF16)
moe_types |= {"TOPK_W": F32, "IDS": I32, "MAP": I32, "CNT": I32, "route_scale": "fp32"}
w2 = dict(A_DIV=1, GROUP=1, P_PAD=1, HAS_MAP=False, FUSE_SILU=False, MUL_WEIGHT=True, FP8=False,
          ROUND_IN_F32=False, BLOCK_N=32, BLOCK_K=256, STAGES=1, PDL=True, SUM_K=8)  # fmt: skip
xc(MG._moe_gemv_kernel, moe_types, w2 | dict(ADD_Z=True))
xc(MG._moe_gemv_kernel, moe_types, w2)
xc(MG._moe_gemv_kernel, moe_types, w2 | dict(GROUP=8, P_PAD=8, SUM_K=0, BLOCK_N=8, ADD_Z=True))
xc(M._combine_kernel, moe_types, dict(HAS_MAP=False, BLOCK_H=1024, RF=False, PDL=True, ADD_Z=True))

from kiln.ops.attention import decode as DA  # noqa: E402

attn_types = dict.fromkeys(("q_ptr", "k_ptr", "v_ptr", "out_ptr", "qw_ptr", "kw_ptr"), BF16)
attn_types |= {"bt_ptr": I32, "rows_ptr": I32, "lens_ptr": I32, "cnt_ptr": I32, "mid_o_ptr": F32}
attn_types |= {"mid_lse_ptr": F32, "pos_ptr": "*i64", "slot_ptr": "*i64", "cs_ptr": F32}
attn_types |= {"sm_scale": "fp32", "logit_cap": "fp32", "eps": "fp32"}
split = dict(GROUP=8, GROUP_PAD=16, GROUP_M=8, D=128, BLOCK_D=128, DV=128, BLOCK_DV=128, PAGE=1, BLOCK_N=64,
             MERGE_TILE=4, HAS_CAP=False, HAS_WINDOW=False, DIRECT=False, FUSED=False, PREC="tf32",
             UPCAST=False, PDL=True)  # fmt: skip
xc(DA._decode_split_kernel, attn_types, split)
xc(DA._decode_split_kernel, attn_types, split | dict(PAGE=16, BLOCK_N=32, PREWAIT=True))  # KILN_PREWAIT
rope = dict(ROPE=True, HQ=32, HKV=4, ROT=128, HAS_QN=True, HAS_KN=True, ROUND_QN=True, ROUND_KN=True)
xc(DA._decode_split_kernel, attn_types, split | rope)
