#!/bin/bash
# Twelfth session, second GPU call (issue 9): KILN_PREWAIT with the GEMV's first step peeled (no
# tile held across the K loop). GPU tests; the step bench per part for both presets (the first
# version cost Llama-3.1-8B 20% at batch 1) and with the fused merge / early w2 on top; then
# `kiln bench latency` on one MoE artifact, off / on / off / on. Usage: bash bench/gpu/run_s12b.sh OUTDIR
# As recorded: KILN_PREWAIT was off by default then, and `all` had no `slab` part; rerun today,
# `default` is on and `all` adds the slab step (run_s12c.sh is the A/B against the current default).
set -o pipefail
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
call_start s12b "$1"
gpu_tests tests.log 120 tests/ops/test_prewait.py tests/ops/test_gemv.py tests/ops/test_norm_linear.py
stamp tests
step_bench 240 "(a3b-1 or llama-3.1-8b-1) and (default or prewait)"
stamp step
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
{ moe_latency default ""; moe_latency prewait "" KILN_PREWAIT=all; moe_latency default_again "";
  moe_latency prewait_again "" KILN_PREWAIT=all; } | tee "$OUT/latency_summary.txt"
stamp latency
call_end
