#!/bin/bash
# GPU call 2 of the seventh session (2026-11-30), issue 9 (MoE decode):
# (1) GPU tests: the fused router (one warp, L2 prefetch of its rows before the PDL wait), the GEMV's
#     L2 prefetch (PDL chain with and without it), the last-arrival top-k sum;
# (2) bench/test_bench_moe_decode.py: the router variants and the MoE op chained over 8 layers;
# (3) Qwen3-30B-A3B-shaped (16 of 48 layers) decode at batch 1 / 8: defaults, KILN_PREFETCH=0,
#     KILN_MOE_ROUTE=separate; the batch-1 kernel profile with the defaults.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s7b.sh OUTDIR   (8 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
moe_checkpoint &
P=$!
gpu_tests tests.log 120 tests/ops/test_moe_route.py tests/ops/test_gemv.py tests/ops/test_moe_gemm.py \
  -k "route or pdl or sum_last or gemv_variants"
(cd bench && timeout 200 python -m pytest -q test_bench_moe_decode.py -p no:cacheprovider \
  --benchmark-json="$OUT/moe_decode_chain.json" > "$OUT/moe_decode_chain.log" 2>&1) || tail -5 "$OUT/moe_decode_chain.log"
bench_summary "$OUT/moe_decode_chain.json"
wait $P
moe_compile
moe_latency default ""
moe_latency noprefetch "" KILN_PREFETCH=0
moe_latency route_separate "" KILN_MOE_ROUTE=separate
moe_profile
