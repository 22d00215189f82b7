#!/bin/bash
# Eighth session, second GPU call (issue 9): the RMSNorm fused into the GEMV behind it
# (ops/norm_linear.py, the GEMV plan's "norm" role): its GPU tests, the chained launch sweep against
# the two launches it replaces, and Qwen3-30B-A3B-shaped (16 layers) decode compiled without and
# with it in the same run, with the fused artifact's batch-1 profile.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s8b.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
gpu_tests tests.log 150 tests/ops/test_norm_linear.py tests/ops/test_gemv.py -k "gpu and (norm or replay or matches)"
cd bench
timeout 120 python -m pytest -q test_bench_norm_linear.py -p no:cacheprovider --benchmark-json="$OUT/norm_linear_chain.json" > "$OUT/bench.log" 2>&1
bench_summary "$OUT/norm_linear_chain.json"
cd ..
moe_checkpoint
moe_compile
moe_latency default ""
MART_DEFAULT=$MART; MART=/tmp/art-qwen3moe-L16-norm
KILN_GEMV=attn:1,mlp:1,router:1,norm:1 moe_compile
moe_latency norm ""
moe_profile 12
