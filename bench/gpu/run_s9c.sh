#!/bin/bash
# Ninth session, third GPU call (issue 9): the MoE replay / routing GPU tests the last call's time
# limit cut, then KILN_FOLD_NORMS end to end: L16 compiled without and with it, `kiln bench latency`
# on each (batch 1 and 8, same machine), and the folded artifact's batch-1 kernel sequence.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s9c.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
gpu_tests tests.log 120 tests/ops/test_moe_gemm.py tests/ops/test_moe_routed.py tests/ops/test_moe_routing.py \
  -k "replay or routing"
tail -c 300 "$OUT/tests.log"; echo
moe_checkpoint
moe_compile
moe_latency default ""
MART_DEFAULT=$MART
MART=/tmp/art-qwen3moe-L16-fold
KILN_FOLD_NORMS=1 timeout 150 python -m kiln compile $MCK -o $MART --force > "$OUT/compile_fold.log" 2>&1
tail -1 "$OUT/compile_fold.log"
moe_latency fold ""
timeout 80 python bench/gpu/profile_decode.py /tmp/art-qwen3moe-L16-fold --batch-sizes 1 --sequence 24 \
  --json "$OUT/profile_fold.json" > "$OUT/profile_fold.txt" 2>&1
tail -40 "$OUT/profile_fold.txt"
