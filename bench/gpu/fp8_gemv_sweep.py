"""The GEMV with FP8 operands (ops/gemv.py) at Llama-3.1-8B decode shapes, M = 1, 2, 4: a small
launch sweep beside the heuristic's pick, cuBLAS ``_scaled_mm`` (precise, what ``auto`` ran before)
and the bf16 GEMV / ``F.linear`` on the same weights; fraction of the measured read bandwidth.
One graph replay per timed call, clean L2 flush (bench/conftest).

    python bench/gpu/fp8_gemv_sweep.py OUT.json
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/conftest, not tests/conftest
from conftest import _median_ms, graphed, measure_ceilings

from kiln.ops import fp8_linear as fl
from kiln.ops import gemv as G
from kiln.ops.fp8_gemm import fp8_gemm_ref
from kiln.ops.quant import quantize_fp8_per_channel, quantize_fp8_per_token

SHAPES = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))
SWEEP = [
    dict(block_n=bn, block_k=bk, split_k=s)
    for bn in (2, 4, 8, 16)
    for bk in (512, 1024, 2048)
    for s in (1, 2)
]


def candidates(m: int, n: int, k: int) -> tuple[dict, torch.Tensor]:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    xq, xs = quantize_fp8_per_token(x)
    wq, ws = quantize_fp8_per_channel(w)
    cands = {
        "cublas": lambda: fl.scaled_mm_rowwise(xq, xs, wq, ws, None, torch.bfloat16),
        "bf16_gemv": lambda: G.gemv(x, w),
        "bf16_linear": lambda: F.linear(x, w),
        "fp8_gemv": lambda: G.gemv(xq, wq, x_scale=xs, w_scale=ws),
    }
    for cfg in SWEEP:
        name = f"n{cfg['block_n']}k{cfg['block_k']}s{cfg['split_k']}"
        cands[name] = lambda cfg=cfg: G.gemv(xq, wq, x_scale=xs, w_scale=ws, **cfg)
    return cands, fp8_gemm_ref(xq, xs, wq, ws, None, torch.float32)


def main(out_json: str) -> None:
    bw = measure_ceilings().read_gbps
    rows = []
    for m in (1, 2, 4):
        for n, k in SHAPES:
            cands, ref = candidates(m, n, k)
            for name, fn in cands.items():
                row = {"m": m, "n": n, "k": k, "impl": name}
                try:
                    y = fn()
                    if not name.startswith("bf16"):
                        row["rel_err"] = ((y.float() - ref).norm() / ref.norm()).item()
                    row["us"] = _median_ms(graphed(fn)) * 1e3
                    nbytes = n * k * (2 if name.startswith("bf16") else 1)
                    row["frac_bw"] = nbytes / (row["us"] * 1e-6) / (bw * 1e9)
                except Exception as e:  # a config that cannot run is recorded
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                rows.append(row)
    env = {"date": __import__("datetime").date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
           "torch": torch.__version__, "triton": __import__("triton").__version__, "read_gbps": bw,
           "command": "python bench/gpu/fp8_gemv_sweep.py OUT (bench/gpu/run_s6d.sh)"}  # fmt: skip
    Path(out_json).write_text(json.dumps({"env": env, "results": rows}, indent=1))
    print(
        f"{'m':>2} {'n':>6} {'k':>6} | {'cublas':>7} {'bf16gemv':>8} {'fp8gemv':>8} {'best':>14} {'us':>6} {'bw':>5}"
    )
    for key in sorted({(r["m"], r["n"], r["k"]) for r in rows}):
        rs = {r["impl"]: r for r in rows if (r["m"], r["n"], r["k"]) == key and "us" in r}
        ok = [r for name, r in rs.items() if name[0] == "n" and r["rel_err"] < 1e-2]
        best = min(ok, key=lambda r: r["us"])
        print(f"{key[0]:>2} {key[1]:>6} {key[2]:>6} | {rs['cublas']['us']:7.1f} {rs['bf16_gemv']['us']:8.1f} "
              f"{rs['fp8_gemv']['us']:8.1f} {best['impl']:>14} {best['us']:6.1f} {best['frac_bw']:5.1%}")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
