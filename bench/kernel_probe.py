"""Compile a Triton kernel for a GPU target on any machine (no GPU needed) and report what bounds
it before it runs: registers per thread and spills (``ptxas -v``), shared memory, and whether its
loads became asynchronous copies (``cp.async``) and its dots warpgroup MMAs (``wgmma``). Registers
set how many programs fit an SM (65,536 a SM: 255 x 128 threads leave room for two).

Usage (repo root):
  python bench/kernel_probe.py kiln.ops.attention.mla:_mla_decode_split_kernel \\
      --const '{"R": 512, "BLOCK_R": 512, "DR": 64, "BLOCK_DR": 64, "PAGE": 1, "BLOCK_H": 16,
                "BLOCK_N": 32, "DIRECT": false, "PREC": "tf32", "UPCAST": false, "PDL": true}' \\
      --ptr-types '{"mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "bt_ptr": "*i32",
                    "rows_ptr": "*i32", "lens_ptr": "*i32"}' --launch 4x2 --launch 8x2

Arguments the kernel takes that are neither in --const nor --ptr-types are typed by their name:
``*_ptr`` as ``*bf16``, ``sm_scale``/``logit_cap`` as ``fp32``, the rest ``i32``. The compiler is
this machine's Triton (the GPU machine's may allocate differently: read the sweeps'
``kernel_resources`` there for the figures that ran).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

FLOAT_ARGS = {"sm_scale", "logit_cap"}


def arg_type(name: str, ptr_types: dict[str, str]) -> str:
    if name in ptr_types:
        return ptr_types[name]
    if name.endswith("_ptr"):
        return "*bf16"
    return "fp32" if name in FLOAT_ARGS else "i32"


def probe(kernel, const: dict, ptr_types: dict[str, str], warps: int, stages: int, arch: int) -> dict:
    """Compile ``kernel`` for ``sm_<arch>`` and report its resources (module docstring). Under the
    interpreter (``TRITON_INTERPRET=1``, which wraps every ``@triton.jit``) its Python function is
    compiled."""
    if not hasattr(kernel, "cache_key"):  # an InterpretedFunction
        kernel = JITFunction(kernel.fn)
    sig = {n: "constexpr" if n in const else arg_type(n, ptr_types) for n in kernel.arg_names}
    consts = {(kernel.arg_names.index(n),): v for n, v in const.items()}
    ck = triton.compile(
        ASTSource(fn=kernel, signature=sig, constexprs=consts),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    ptx = ck.asm["ptx"]
    out = {
        "warps": warps,
        "stages": stages,
        "shared_bytes": ck.metadata.shared,
        "cp_async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma_sync": ptx.count("mma.sync"),
    }
    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        for name in ("ptxas-blackwell", "ptxas"):  # the newer one reads the newer PTX versions
            exe = os.path.join(bindir, name)
            if not os.path.exists(exe):
                continue
            gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
            p = subprocess.run([exe, "-v", "--gpu-name", gpu, src, "-o", os.path.join(tmp, "k.cubin")],
                               capture_output=True, text=True)  # fmt: skip
            regs = re.search(r"Used (\d+) registers", p.stderr)
            if regs:
                spills = re.search(r"(\d+) bytes spill stores", p.stderr)
                out["registers"] = int(regs.group(1))
                out["spill_store_bytes"] = int(spills.group(1)) if spills else 0
                out["programs_per_sm_by_registers"] = 65536 // (max(out["registers"], 1) * 32 * warps)
                break
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("kernel", help="module:attribute of a @triton.jit function")
    ap.add_argument("--const", default="{}", help="JSON: its constexpr arguments")
    ap.add_argument(
        "--ptr-types", default="{}", help="JSON: argument -> Triton type, where the name's default is wrong"
    )
    ap.add_argument("--launch", action="append", default=None, help="WARPSxSTAGES (repeatable; default 4x2)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper)")
    args = ap.parse_args(argv)
    module, _, attr = args.kernel.partition(":")
    kernel = getattr(importlib.import_module(module), attr)
    rows = []
    for launch in args.launch or ["4x2"]:
        warps, stages = (int(x) for x in launch.split("x"))
        row = probe(kernel, json.loads(args.const), json.loads(args.ptr_types), warps, stages, args.arch)
        print(json.dumps(row))
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
