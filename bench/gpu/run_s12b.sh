#!/bin/bash
# Twelfth session, second GPU call (issue 9): KILN_PREWAIT with the GEMV's first step peeled (no
# tile held across the K loop). GPU tests; the step bench per part for both presets (the first
# version cost Llama-3.1-8B 20% at batch 1) and with the fused merge / early w2 on top; then
# `kiln bench latency` on one MoE artifact, off / on / off / on. Usage: bash bench/gpu/run_s12b.sh OUTDIR
set -o pipefail
DEST=${1:-/tmp/out}; OUT=/tmp/raw_s12b; mkdir -p "$DEST" "$OUT"  # $OUT: the raw files, bundled into $DEST
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/stamps.txt"; }
gpu_tests tests.log 120 tests/ops/test_prewait.py tests/ops/test_gemv.py tests/ops/test_norm_linear.py
stamp tests
(cd bench && timeout 240 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider \
  -k "(a3b-1 or llama-3.1-8b-1) and (default or prewait)" \
  --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
bench_summary "$OUT/decode_step.json" | tee "$OUT/step_summary.txt"
stamp step
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
for v in default prewait default_again prewait_again; do
  case $v in prewait*) moe_latency $v "" KILN_PREWAIT=all ;; *) moe_latency $v "" ;; esac
done | tee "$OUT/latency_summary.txt"
stamp latency
python bench/gpu/bundle.py "$OUT" "$DEST/s12b.json" "bash bench/gpu/run_s12b.sh OUT (commit: ${KILN_COMMIT:-see bench/results/README.md})"
cat "$OUT/step_summary.txt" "$OUT/latency_summary.txt"
