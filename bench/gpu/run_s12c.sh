#!/bin/bash
# Twelfth session, third GPU call (issue 9): KILN_PREWAIT on by default (now with the merge
# kernel's length), checked and recorded: GPU tests, the step bench with it off and on for both
# presets, `kiln bench latency` on one MoE artifact (on / off / on / off), then beside Hugging Face
# transformers, then with the early w2 slabs (KILN_MOE_EARLY_W2) on top. Usage: bash bench/gpu/run_s12c.sh OUTDIR
set -o pipefail
DEST=${1:-/tmp/out}; OUT=/tmp/raw_s12c; mkdir -p "$DEST" "$OUT"  # $OUT: the raw files, bundled into $DEST
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/stamps.txt"; }
gpu_tests tests.log 150 tests/ops/test_prewait.py tests/ops/test_decode_attention.py tests/ops/test_qkv_rope.py \
  tests/ops/test_decode_rope.py tests/ops/test_moe_pdl.py tests/ops/test_moe_route.py
stamp tests
(cd bench && timeout 120 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider \
  -k "(a3b-1 or llama-3.1-8b-1) and (default or prewait_off)" \
  --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
bench_summary "$OUT/decode_step.json" | tee "$OUT/step_summary.txt"
stamp step
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
{ moe_latency default ""; moe_latency prewait_off "" KILN_PREWAIT=none; moe_latency default_again "";
  moe_latency prewait_off_again "" KILN_PREWAIT=none; moe_latency default_hf "--compare-hf $MCK";
  moe_latency early_w2 "" KILN_MOE_EARLY_W2=1; } | tee "$OUT/latency_summary.txt"
stamp latency
python bench/gpu/bundle.py "$OUT" "$DEST/s12c.json" "bash bench/gpu/run_s12c.sh OUT (commit: ${KILN_COMMIT:-see bench/results/README.md})"
cat "$OUT/step_summary.txt" "$OUT/latency_summary.txt"
