#!/bin/bash
# Eleventh session, first GPU call (issue 9): the tenth session's code that never ran on a GPU
# (the w2 GEMV's counter argument on the default decode path, the one-launch experts), then the
# one-launch experts measured: step bench, the grouped GEMM's wall vs kernel time, and
# `kiln bench latency` on one artifact with KILN_MOE_ONE_LAUNCH off / on / off (read at capture).
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s11a.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
gpu_tests tests.log 240 tests/ops/test_moe_one_launch.py tests/ops/test_moe_gemm.py tests/ops/test_moe_pdl.py
stamp tests
(cd bench && timeout 120 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider \
  -k "a3b-1-default or a3b-1-one_launch" --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
bench_summary "$OUT/decode_step.json"
stamp step
timeout 90 python bench/gpu/moe_kernel_time.py --tokens 1,2,4 --json "$OUT/kt_default.json" 2>&1 | grep "^T="
KILN_MOE_ONE_LAUNCH=1 timeout 90 python bench/gpu/moe_kernel_time.py --tokens 1,2,4 --json "$OUT/kt_one_launch.json" 2>&1 | grep "^T=" | sed 's/^/one_launch /'
stamp kernel_time
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
moe_latency default ""
moe_latency one_launch "" KILN_MOE_ONE_LAUNCH=1
moe_latency default_again ""
moe_latency one_launch_again "" KILN_MOE_ONE_LAUNCH=1
stamp latency
