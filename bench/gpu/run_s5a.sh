#!/bin/bash
# GPU call 2 of the fifth 2026-11-29 session (issue 4): the Triton FP8 GEMM with TMA loads and the
# fused split-K reduction. (1) its GPU tests (and decode attention's fused-merge tests, whose counter
# buffer moved to ops/common.py); (2) the launch sweep at M = 256 / 512, clean L2 flush, single
# launch and a chain of distinct weights (>= 128 MB), against bf16 F.linear and cuBLAS _scaled_mm.
# Usage: bash bench/gpu/run_s5a.sh OUTDIR   (3 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
timeout 150 python -m pytest -q -m gpu tests/ops/test_fp8_gemm.py tests/ops/test_decode_attention.py \
  -k "test_fp8_gemm or graph_replay or capture_falls_back" -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
tail -3 "$OUT/tests.log"
KILN_FP8_SWEEP_CHAIN=128 KILN_SWEEP_M=256,512 timeout 380 python -m pytest -q bench/test_bench_fp8_linear.py \
  -k "fp8_gemm_sweep" -p no:cacheprovider --benchmark-json="$OUT/raw.json" > "$OUT/sweep.log" 2>&1
tail -2 "$OUT/sweep.log"
python bench/report.py "$OUT/raw.json" "$OUT/fp8_sweep_tma.json" --command \
  "KILN_FP8_SWEEP_CHAIN=128 KILN_SWEEP_M=256,512 pytest bench/test_bench_fp8_linear.py -k fp8_gemm_sweep" > /dev/null 2>&1
rm -f "$OUT/raw.json"
python bench/gpu/fp8_best.py "$OUT/fp8_sweep_tma.json"
