#!/bin/bash
# Thirteenth session, last GPU call (issue 9): KILN_PREWAIT's default is now every part (the slab
# parts on, the plain one only for grids of at most 8 programs a SM). GPU tests under it, the step
# bench against the old default (gemv,attn,rope) for both presets, `kiln bench latency` on one MoE
# artifact (new / old / new / old), then the new default beside Hugging Face.
# Usage: bash bench/gpu/run_s13d.sh OUTDIR
set -o pipefail
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
call_start s13d "$1"
gpu_tests tests.log 130 tests/ops/test_prewait.py tests/ops/test_gemv.py tests/ops/test_norm_linear.py \
  tests/runtime/test_gpu_e2e.py
stamp tests
step_bench 90 "(a3b-1 or llama-3.1-8b-1) and (default or prewait_noslab)"
stamp step
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
OLD=gemv,attn,rope
{ moe_latency default ""; moe_latency noslab "" KILN_PREWAIT=$OLD; moe_latency default_again "";
  moe_latency noslab_again "" KILN_PREWAIT=$OLD; moe_latency default_hf "--compare-hf $MCK"; } | tee "$OUT/latency_summary.txt"
stamp latency
call_end
