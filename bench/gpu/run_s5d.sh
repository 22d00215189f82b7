#!/bin/bash
# GPU call 5 (last) of the fifth 2026-11-29 session.
# (A) issue 4: FP8 GPU tests after the accumulation switch (KILN_FP8_FAST_ACCUM=auto) and the
#     persistent-norm GPU tests without pipelining; the one-wave sweep at M = 256 / 512 (fast).
# (B) issue 9: the CUTLASS MoE backend (bench/gpu/run_cutlass_moe.sh) in what is left.
# Carry: bench/cutlass_probe/whl, bench/cutlass_probe/out. Usage: bash bench/gpu/run_s5d.sh (7 files)
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
START=$SECONDS
(
  source bench/gpu/env.sh
  timeout 90 python -m pytest -q -m gpu tests/ops/test_fp8_gemm.py tests/ops/test_fp8_linear.py \
    -p no:cacheprovider -rf > "$OUT/fp8_norm_tests.log" 2>&1
  timeout 40 python -m pytest -q -m gpu tests/ops/test_norm.py -k persistent -p no:cacheprovider -rf >> "$OUT/fp8_norm_tests.log" 2>&1
  grep -E "^FAILED|passed|failed" "$OUT/fp8_norm_tests.log" | tail -6
  KILN_SWEEP_ACCUM=fast KILN_FP8_SWEEP_CHAIN=128 KILN_SWEEP_M=256,512 timeout 120 python -m pytest -q \
    bench/test_bench_fp8_linear.py -k "fp8_gemm_sweep" -p no:cacheprovider --benchmark-json="$OUT/raw.json" > /dev/null 2>&1
  python bench/report.py "$OUT/raw.json" "$OUT/fp8_sweep_occupancy.json" --command \
    "KILN_SWEEP_ACCUM=fast KILN_FP8_SWEEP_CHAIN=128 KILN_SWEEP_M=256,512 pytest bench/test_bench_fp8_linear.py -k fp8_gemm_sweep" > /dev/null 2>&1
  rm -f "$OUT/raw.json"
  python bench/gpu/fp8_best.py "$OUT/fp8_sweep_occupancy.json"
)
LEFT=$((540 - (SECONDS - START) - 70))
echo "== CUTLASS MoE, budget ${LEFT}s"
BUDGET=$LEFT bash bench/gpu/run_cutlass_moe.sh 2>&1 | tail -30
