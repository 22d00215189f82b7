"""The CUTLASS FP8 GEMM (ops/cutlass/sm90_fp8_gemm.cu, every instantiation) against ops/fp8_gemm.py's
Triton kernel (its TABLE config, fast accumulation), cuBLAS ``_scaled_mm`` and bf16 ``F.linear`` at
Llama-3.1-8B's (N, K), M = 128..1024, on the GPU. Two timings per variant, clean L2 flush (bench/conftest):
``single`` (one graph replay per timed call) and ``chain`` (per launch over distinct weight copies,
at least CHAIN_MB of FP8 weights, back to back in one graph, as a prefill step runs its linears).
Each CUTLASS result is checked against the float32 reference first.

    python bench/gpu/fp8_cutlass_bench.py LIB.so OUT.json

LIB.so: the library ``kiln compile --quant fp8`` builds (``compiler/cutlass_build.py``), or with every
instantiation of the sweep (how ``bench/results/2026-11-29_h200_fp8_cutlass_sweep.json`` was made),
on any machine with nvcc 12.4+ and the nvidia-cutlass wheel's headers (``C=.../cutlass_library/source``):

    nvcc -std=c++17 --expt-relaxed-constexpr -arch=sm_90a -O3 -DNDEBUG -Xcompiler=-fPIC -shared \
      --split-compile=4 -DKF_SWEEP -I$C/include -I$C/tools/util/include ops/cutlass/sm90_fp8_gemm.cu -o LIB.so
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/conftest, not tests/conftest
from conftest import _median_ms, graphed

from kiln.ops import fp8_cutlass as fc
from kiln.ops import fp8_gemm as fg
from kiln.ops import fp8_linear as fl
from kiln.ops.quant import quantize_fp8_per_channel, quantize_fp8_per_token

CHAIN_MB = 256
MS = (128, 256, 512, 1024)
SHAPES = ((4096, 4096), (6144, 4096), (14336, 4096), (4096, 14336))


def key(r: dict) -> tuple[int, int, int]:
    return r["m"], r["n"], r["k"]


def per_launch_ms(fns) -> float:
    return _median_ms(graphed(lambda: [f() for f in fns])) / len(fns)


def variants(m: int, n: int, k: int, names: list[str]) -> tuple[dict, torch.Tensor, int]:
    """Per implementation, one launch per weight copy; the float32 reference; the copy count."""
    copies = max(1, -(-CHAIN_MB * 10**6 // (n * k)))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    xq, xs = quantize_fp8_per_token(x)
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(copies)]
    qs = [quantize_fp8_per_channel(w) for w in ws]
    bf = torch.bfloat16
    out = {
        "bf16": [lambda w=w: F.linear(x, w) for w in ws],
        "cublas_fast": [lambda q=q: fl.scaled_mm_rowwise(xq, xs, *q, None, bf, fast_accum=True) for q in qs],
        "triton": [lambda q=q: fg.fp8_gemm(xq, xs, *q, None, bf, fast_accum=True) for q in qs],
    }
    for name in names:
        out[name] = [lambda q=q, c=name: fc.fp8_gemm_cutlass(xq, xs, *q, None, bf, c) for q in qs]
    return out, fg.fp8_gemm_ref(xq, xs, *qs[0], None, torch.float32), copies


def main(lib: str, out_json: str) -> None:
    fc.load_library(lib)
    names = fc.config_names()
    rows = []
    for m in MS:
        for n, k in SHAPES:
            fns_by_impl, ref, copies = variants(m, n, k, names)
            for name, fns in fns_by_impl.items():
                row = {"m": m, "n": n, "k": k, "impl": name, "copies": copies}
                try:
                    y = fns[0]()
                    torch.cuda.synchronize()
                    if name != "bf16":
                        row["rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
                    row["single_ms"] = _median_ms(graphed(fns[0]))
                    row["chain_ms"] = per_launch_ms(fns)
                except Exception as e:  # a config that fails is recorded, not fatal
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                if name == "triton":
                    row["config"] = str(fg.fp8_gemm_config(m, n, k, fg.num_sms(ref.device)))
                rows.append(row)
                print(json.dumps(row), flush=True)
            del fns_by_impl
    env = {"date": __import__("datetime").date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": __import__("triton").__version__, "cuda": torch.version.cuda,
           "command": "python bench/gpu/fp8_cutlass_bench.py LIB OUT (bench/gpu/run_s6b.sh)", "configs": names}  # fmt: skip
    with open(out_json, "w") as f:
        json.dump({"env": env, "results": rows}, f, indent=1)
    # summary: per (m, n, k) bf16, triton, cublas, best CUTLASS (chain and single), speedups over bf16
    print(f"\n{'m':>5} {'n':>6} {'k':>6} | {'bf16':>6} {'triton':>6} {'cublas':>6} {'best cutlass':>24} {'us':>6} | "
          f"x(bf16) chain: tri {'cut':>5} | single: tri {'cut':>5}")  # fmt: skip
    for mnk in sorted({key(r) for r in rows}):
        rs = {r["impl"]: r for r in rows if key(r) == mnk and "chain_ms" in r}
        cut = [r for name, r in rs.items() if name in names and r.get("rel_err", 1) < 1e-2]
        if not cut or "bf16" not in rs:
            print(mnk, "no result")
            continue
        best = min(cut, key=lambda r: r["chain_ms"])
        best_s = min(cut, key=lambda r: r["single_ms"])
        b, t = rs["bf16"], rs["triton"]
        print(f"{mnk[0]:>5} {mnk[1]:>6} {mnk[2]:>6} | {b['chain_ms']*1e3:6.1f} {t['chain_ms']*1e3:6.1f} "
              f"{rs['cublas_fast']['chain_ms']*1e3:6.1f} {best['impl']:>24} {best['chain_ms']*1e3:6.1f} | "
              f"{b['chain_ms']/t['chain_ms']:5.2f} {b['chain_ms']/best['chain_ms']:5.2f} | "
              f"{b['single_ms']/t['single_ms']:5.2f} {b['single_ms']/best_s['single_ms']:5.2f} {best_s['impl']}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
