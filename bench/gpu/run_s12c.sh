#!/bin/bash
# Twelfth session, third GPU call (issue 9): KILN_PREWAIT on by default (now with the merge
# kernel's length), checked and recorded: GPU tests, the step bench with it off and on for both
# presets, `kiln bench latency` on one MoE artifact (on / off / on / off), then beside Hugging Face
# transformers, then with the early w2 slabs (KILN_MOE_EARLY_W2) on top. Usage: bash bench/gpu/run_s12c.sh OUTDIR
set -o pipefail
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
call_start s12c "$1"
gpu_tests tests.log 150 tests/ops/test_prewait.py tests/ops/test_decode_attention.py tests/ops/test_qkv_rope.py \
  tests/ops/test_decode_rope.py tests/ops/test_moe_pdl.py tests/ops/test_moe_route.py
stamp tests
step_bench 120 "(a3b-1 or llama-3.1-8b-1) and (default or prewait_off)"
stamp step
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
{ moe_latency default ""; moe_latency prewait_off "" KILN_PREWAIT=none; moe_latency default_again "";
  moe_latency prewait_off_again "" KILN_PREWAIT=none; moe_latency default_hf "--compare-hf $MCK";
  moe_latency early_w2 "" KILN_MOE_EARLY_W2=1; } | tee "$OUT/latency_summary.txt"
stamp latency
call_end
