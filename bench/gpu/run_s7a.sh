#!/bin/bash
# GPU call 1 of the seventh session (2026-11-30), issue 9 (MoE decode):
# (1) GPU tests of the fused decode router (ops/moe_route.py), the w2 GEMV's last-arrival top-k sum
#     and the rest of the MoE kernels; (2) the fused MoE op at 1 / 8 / 4096 tokens with the combine
#     kernel vs the last-arrival sum; (3) Qwen3-30B-A3B-shaped (16 of 48 layers) decode at batch 1 / 8
#     with both fusions on (default) and off (KILN_MOE_ROUTE=separate KILN_MOE_COMBINE=separate), and
#     the batch-1 kernel profile with the defaults.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s7a.sh OUTDIR   (7 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
moe_checkpoint &
P=$!
gpu_tests tests.log 150 tests/ops/test_moe_route.py tests/ops/test_moe_gemm.py tests/ops/test_moe_routing.py \
  tests/ops/test_moe_pdl.py
for mode in separate fused; do
  KILN_MOE_COMBINE=$mode timeout 120 python -m pytest -q bench/test_bench_moe.py \
    -k "test_fused_moe and (1-triton or 8-triton or 4096-triton) and not fp8" -p no:cacheprovider \
    --benchmark-json="$OUT/moe_op_$mode.json" > "$OUT/moe_op_$mode.log" 2>&1 || tail -5 "$OUT/moe_op_$mode.log"
  bench_summary "$OUT/moe_op_$mode.json" "$mode"
done
wait $P
moe_compile
moe_latency fused ""
moe_latency separate "" KILN_MOE_ROUTE=separate KILN_MOE_COMBINE=separate
moe_profile 16
