#!/bin/bash
# Eighth session, fourth GPU call (issue 9): KILN_MOE_EARLY_W2=1 with its own 16-row w2 programs
# (ops/moe.py EARLY_BLOCK_N) end to end: Qwen3-30B-A3B-shaped (16 layers) decode without and with
# it on one artifact compiled with it set (so its kernels are warmed), the chain at 1 / 2 / 4 tokens
# beside the default, and the batch-1 profile with it.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s8d.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
gpu_tests tests.log 100 tests/ops/test_moe_gemm.py -k "early"
cd bench
for v in 0 1; do
  KILN_MOE_EARLY_W2=$v timeout 60 python -m pytest -q test_bench_moe_decode.py -k "decode_chain and fused" \
    -p no:cacheprovider --benchmark-json="$OUT/moe_early$v.json" > /dev/null 2>&1
  bench_summary "$OUT/moe_early$v.json" early$v
done
cd ..
moe_checkpoint
KILN_MOE_EARLY_W2=1 moe_compile
moe_latency early0 "" KILN_MOE_EARLY_W2=0
moe_latency early1 "" KILN_MOE_EARLY_W2=1
moe_latency early0_again "" KILN_MOE_EARLY_W2=0
KILN_MOE_EARLY_W2=1 moe_profile 8
