#!/bin/bash
# Twelfth session, first GPU call (issue 9): KILN_PREWAIT (graph-constant loads before the PDL
# wait: the GEMV's first weight step, the decode split kernel's cached K/V, the RoPE kernel's
# tables). GPU tests, the step bench per part, then `kiln bench latency` on one artifact with the
# switch off / on / off / on (read at capture). Usage: bash bench/gpu/run_s12a.sh OUTDIR
set -o pipefail
DEST=${1:-/tmp/out}; OUT=/tmp/raw_s12a; mkdir -p "$DEST" "$OUT"  # $OUT: the raw files, bundled into $DEST
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/stamps.txt"; }
gpu_tests tests.log 100 tests/ops/test_prewait.py tests/ops/test_decode_attention.py -k "gpu or prewait"
stamp tests
(cd bench && timeout 170 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider \
  -k "a3b-1-default or a3b-1-prewait or llama-3.1-8b-1-default or (llama-3.1-8b-1-prewait and not prewait_)" \
  --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
bench_summary "$OUT/decode_step.json" | tee "$OUT/step_summary.txt"
stamp step
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
for v in default prewait default_again prewait_again; do
  case $v in prewait*) moe_latency $v "" KILN_PREWAIT=all ;; *) moe_latency $v "" ;; esac
done | tee "$OUT/latency_summary.txt"
stamp latency
python bench/gpu/bundle.py "$OUT" "$DEST/s12a.json" "bash bench/gpu/run_s12a.sh OUT (commit: ${KILN_COMMIT:-see bench/results/README.md})"
cat "$OUT/step_summary.txt" "$OUT/latency_summary.txt"
