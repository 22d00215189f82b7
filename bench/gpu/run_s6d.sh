#!/bin/bash
# Sixth session, GPU call 4: the GEMV with FP8 operands (fp8_linear's auto backend at M <= 4).
#   (1) GPU tests: tests/ops/test_gemv_fp8.py, test_fp8_linear.py, test_gemv.py (regressions);
#   (2) bench/gpu/fp8_gemv_sweep.py: M = 1, 2, 4 at 8B decode shapes vs cuBLAS FP8 and the bf16 GEMV;
#   (3) Llama-3.1-8B-shaped --quant fp8 (CUTLASS library carried): decode b1/2/4/8 with the FP8 GEMV
#       (auto) and without (KILN_GEMV=0: cuBLAS), same artifact.
# Usage (repo root, carry bench/cutlass_probe/out): bash bench/gpu/run_s6d.sh OUT   (5 files)
source bench/gpu/s6_env.sh "$1"
timeout 150 python -m pytest -q -m gpu tests/ops/test_gemv_fp8.py tests/ops/test_fp8_linear.py tests/ops/test_gemv.py \
  -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -6
timeout 200 python bench/gpu/fp8_gemv_sweep.py "$OUT/fp8_gemv_sweep.json" > "$OUT/sweep.log" 2>&1
fp8_compile 150
for g in 1 0; do
  KILN_GEMV=$g timeout 90 python -m kiln bench latency $ART --batch-sizes 1,2,4,8 --input-len 512 \
    --output-len 64 --kv-memory 40 --json "$OUT/fp8_latency_gemv$g.json" 2>&1 | grep -v "it/s\]" | tail -5
done
tail -14 "$OUT/sweep.log"
