"""Print the fastest config per (M, N, K, accumulation) of an FP8 GEMM sweep JSON (bench/report.py
output of ``test_fp8_gemm_sweep`` run with ``KILN_FP8_SWEEP_CHAIN``): chain and single timings and
their speedups over bf16 and cuBLAS.

    python bench/gpu/fp8_best.py SWEEP.json
"""

import json
import sys

with open(sys.argv[1]) as f:
    rows = [r for r in json.load(f)["results"] if "chain_ms" in r]
best: dict[tuple, dict] = {}
for r in rows:
    key = (r["m"], r["n"], r["k"], r["accum"])
    if key not in best or r["chain_ms"] < best[key]["chain_ms"]:
        best[key] = r
print(f"{'m':>4} {'n':>5} {'k':>5} {'accum':7} {'best (chain)':24} {'us':>6} {'xbf16':>6} {'xcublas':>7} | single: {'us':>6} {'xbf16':>6}")  # fmt: skip
for key, r in sorted(best.items()):
    print(
        f"{key[0]:>4} {key[1]:>5} {key[2]:>5} {key[3]:7} {r['config']:24} {r['chain_ms'] * 1e3:6.1f} "
        f"{r['chain_speedup_vs_bf16']:6.2f} {r['chain_speedup_vs_cublas']:7.2f} | {r['ms'] * 1e3:6.1f} "
        f"{r['speedup_vs_bf16']:6.2f}"
    )
