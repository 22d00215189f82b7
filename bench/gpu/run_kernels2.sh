#!/bin/bash
# One GPU call for the second round of kernels: GPU tests of the new ops and of the server/runtime,
# then benches and launch sweeps: fused add+RMSNorm(+FP8 quant), Triton FP8 GEMM (M=256), small-M
# GEMV, MoE (decode GEMV at 1 token, grouped GEMM at 4096, cutlass = torch._grouped_mm row).

# Usage on the GPU machine, from the repo root: bash bench/gpu/run_kernels2.sh OUT
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
rep() {  # NAME: bench report table from $OUT/NAME_raw.json
  python bench/report.py "$OUT/$1_raw.json" "$OUT/$1.json" --command "$2" > "$OUT/$1.txt" 2>&1
}
pyb() {  # NAME TIMEOUT FILES -k EXPR
  timeout $2 python -m pytest -q $3 -k "$4" -p no:cacheprovider --benchmark-json="$OUT/$1_raw.json" \
    > "$OUT/$1.log" 2>&1; tail -1 "$OUT/$1.log"; rep $1 "pytest $3 -k '$4'"
}
timeout 240 python -m pytest -q -m gpu tests/ops/test_norm.py tests/ops/test_quant.py tests/ops/test_fp8_gemm.py \
  tests/ops/test_fp8_linear.py tests/ops/test_gemv.py tests/ops/test_moe_gemm.py tests/ops/test_moe_align.py \
  tests/server/test_gpu_serve.py tests/runtime/test_staging.py tests/runtime/test_gpu_e2e.py \
  -p no:cacheprovider -rf --timeout 200 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|rror" | tail -12
pyb norm 60 bench/test_bench_norm.py "not compile"
pyb gemv 90 bench/test_bench_gemv.py "not sweep and not compile"
pyb gemv_sweep 150 bench/test_bench_gemv.py "sweep and m1"
pyb fp8 150 bench/test_bench_fp8_linear.py "(test_fp8_linear and not compile and not 1-) or (fp8_gemm_sweep and precise)"
pyb moe 200 bench/test_bench_moe.py "(test_fused_moe and not sweep) or (sweep and (1tok or 4096tok))"
echo "== tables"
grep -E "ceilings|\[4096-" "$OUT/norm.txt" | head -8
grep -E "ceilings|gemv\[|gate_up\[" "$OUT/gemv.txt" | grep -v sweep | head -24
grep -E "fp8_linear\[256-" "$OUT/fp8.txt" | head -24
grep -E "test_fused_moe\[(1|4096)-" "$OUT/moe.txt" | head -12
python - "$OUT" <<'PY'
import collections, json, sys
for name in ("norm", "gemv_sweep", "fp8", "moe"):
    try:
        rows = json.load(open(f"{sys.argv[1]}/{name}.json"))["results"]
    except Exception as e:
        print(name, "no results", e); continue
    best = collections.defaultdict(list)
    skip = {"ms", "bytes", "flops", "gbps", "frac_bw", "tflops", "frac_mm", "config", "cfg", "rows",
            "num_warps", "num_stages", "block_n", "block_k", "split_k", "bf16_ms", "cublas_ms",
            "speedup_vs_bf16", "speedup_vs_cublas", "name", "file", "w13", "w2"}
    for r in rows:
        if "ms" in r and "sweep" in r["name"]:
            key = tuple(sorted((k, v) for k, v in r.items() if k not in skip and not isinstance(v, (dict, list))))
            f = r.get("speedup_vs_bf16") or r.get("frac_bw") or r.get("frac_mm") or 0
            best[(name, key)].append((round(f, 3), round(r["ms"] * 1e3, 1), r["name"].split("[", 1)[1]))
    for k, v in sorted(best.items(), key=str):
        print(k, sorted(v, key=lambda t: -t[0])[:2])
PY
