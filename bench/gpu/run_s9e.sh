#!/bin/bash
# Ninth session, last GPU call (issue 9): the compile's final choice (folded weights everywhere, the
# residual-stream layout in the batch-1 decode graph only): bf16 end-to-end GPU tests against HF,
# then the step bench's default (batch 1 folded, batch 8 add+norm) for both presets.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s9e.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
gpu_tests e2e.log 140 tests/runtime/test_gpu_e2e.py -v
grep -E "PASSED|FAILED|ERROR" "$OUT/e2e.log" | tail -8
(cd bench && timeout 75 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider \
  -k "default" --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
tail -1 "$OUT/decode_step.log"
bench_summary "$OUT/decode_step.json"
