#!/bin/bash
# GPU call 3 of the fifth 2026-11-29 session (issue 4): stream-K FP8 GEMM (ops/fp8_streamk.py).
# (1) the FP8 GEMM GPU tests; (2) the launch sweep at M = 256 / 512 (clean L2 flush, single launch
# and a >= 128 MB chain of distinct weights) over fp8_gemm.SWEEP_CONFIGS; (3) fp8_linear (cuBLAS,
# precise and fast accumulation) against bf16 at M = 1024 and 4096.
# Usage: bash bench/gpu/run_s5b.sh OUTDIR   (5 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
timeout 120 python -m pytest -q -m gpu tests/ops/test_fp8_gemm.py -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
KILN_FP8_SWEEP_CHAIN=128 KILN_SWEEP_M=256,512 timeout 300 python -m pytest -q bench/test_bench_fp8_linear.py \
  -k "fp8_gemm_sweep" -p no:cacheprovider --benchmark-json="$OUT/raw.json" > "$OUT/sweep.log" 2>&1
tail -1 "$OUT/sweep.log"
python bench/report.py "$OUT/raw.json" "$OUT/fp8_sweep_streamk.json" --command \
  "KILN_FP8_SWEEP_CHAIN=128 KILN_SWEEP_M=256,512 pytest bench/test_bench_fp8_linear.py -k fp8_gemm_sweep" > /dev/null 2>&1
rm -f "$OUT/raw.json"
timeout 150 python -m pytest -q bench/test_bench_fp8_linear.py -k "test_fp8_linear and (1024- or 4096-) and not ref_ and not triton" \
  -p no:cacheprovider --benchmark-json="$OUT/raw.json" > "$OUT/linear.log" 2>&1
tail -1 "$OUT/linear.log"
python bench/report.py "$OUT/raw.json" "$OUT/fp8_linear_large_m.json" --command \
  "pytest bench/test_bench_fp8_linear.py -k 'test_fp8_linear and (1024- or 4096-) and not ref_ and not triton'" > /dev/null 2>&1
rm -f "$OUT/raw.json"
python bench/gpu/fp8_best.py "$OUT/fp8_sweep_streamk.json"
python - "$OUT/fp8_linear_large_m.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    if "speedup_vs_bf16" in r:
        print(f"{r['m']:>5} {r['n']:>5} {r['k']:>5} {r['impl']:16} {r['ms']*1e3:7.1f} us  x{r['speedup_vs_bf16']:.2f} vs bf16")
PY
