#!/bin/bash
# Ninth session, fourth GPU call (issue 9): with folded norms now the compile default, the bf16
# end-to-end GPU tests against HF (tests/runtime/test_gpu_e2e.py: logits, CUDA-graph replay equals
# eager, loading compiles no Triton kernel, overlapped decoding); the routing kernels' GPU tests
# (the eighth session's shared _softmax/_scale_round); last, the routing-in-w13 replay test, whose
# earlier runs hit the calls' time limits.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s9d.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
gpu_tests e2e.log 200 tests/runtime/test_gpu_e2e.py -v
gpu_tests routing.log 110 tests/ops/test_moe_routing.py -v
gpu_tests routed.log 70 tests/ops/test_moe_routed.py -v --durations=5
for f in e2e routing routed; do echo "== $f"; grep -E "PASSED|FAILED|ERROR|passed|failed|slowest|s call" "$OUT/$f.log" | tail -14; done
