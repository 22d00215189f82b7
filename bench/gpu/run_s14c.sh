#!/bin/bash
# Fourteenth session, after s14b's one failure (a fresh FP8 artifact compiled the greedy argmax at
# load: the compile warmed only the seeded sampler's kernel): the runtime's GPU tests with the
# greedy argmax warmed at compile and the loading test on an artifact copy no test loaded; then
# the Llama-3.1-8B-shaped artifact end to end (start-up, decode batch 1 and 8 beside HF), first
# time since the folded norms, pre-wait loads and graph greedy became defaults.
# Usage: KILN_COMMIT=<hash> bash bench/gpu/run_s14c.sh OUTDIR
set -o pipefail
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
call_start s14c "$1"
rm -rf "$MCK" "$MART"  # a warm machine still holds them: room for the 8B checkpoint and artifact
gpu_tests tests.log 200 tests/runtime
stamp tests
BATCHES=1,8 OUTLEN=64 HF=1 LAT_TIMEOUT=200 bash bench/gpu/run_e2e_llama8b.sh "$OUT" 2>&1 | tail -14 \
  | tee "$OUT/llama_summary.txt"
stamp llama
call_end
