#!/bin/bash
# GPU run: every GPU test, then the kernel microbenchmarks (no sweeps, no torch.compile rows).
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_tests_and_kernels.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$OUT/nvidia_smi.txt"
timeout ${TEST_TIMEOUT:-300} python -m pytest -q -m gpu tests -p no:cacheprovider -rf --timeout 280 \
  2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -25
timeout ${BENCH_TIMEOUT:-240} python -m pytest -q bench -k "not sweep and not compile" -p no:cacheprovider \
  --benchmark-json="$OUT/kernels_raw.json" 2>&1 | tee "$OUT/bench.log" | tail -3
python bench/report.py "$OUT/kernels_raw.json" "$OUT/kernels.json" \
  --command "pytest bench -k 'not sweep and not compile'" > "$OUT/kernels_table.txt"
grep -E "ceilings|\[4096|bs32|32768|8192|fp8" "$OUT/kernels_table.txt" | head -60
