#!/bin/bash
# Written in the twelfth session for the next one (not yet run): KILN_PREWAIT's opt-in `slab` part
# (the one-row qkv and o GEMVs load their whole weight slab before the PDL wait). GPU tests, the
# step bench default vs prewait_slab for both presets, then `kiln bench latency` on one MoE
# artifact, default / slab / default / slab. Usage: bash bench/gpu/run_s13a.sh OUTDIR
set -o pipefail
DEST=${1:-/tmp/out}; OUT=/tmp/raw_s13a; mkdir -p "$DEST" "$OUT"  # $OUT: the raw files, bundled into $DEST
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
T0=$(date +%s); stamp() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/stamps.txt"; }
KILN_PREWAIT=all gpu_tests tests.log 150 tests/ops/test_prewait.py tests/ops/test_gemv.py tests/ops/test_norm_linear.py
stamp tests
(cd bench && timeout 150 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider \
  -k "(a3b-1 or llama-3.1-8b-1) and (default or prewait_slab or prewait_off)" \
  --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
bench_summary "$OUT/decode_step.json" | tee "$OUT/step_summary.txt"
stamp step
moe_checkpoint; stamp checkpoint
moe_compile; stamp compile
{ moe_latency default ""; moe_latency slab "" KILN_PREWAIT=all; moe_latency default_again "";
  moe_latency slab_again "" KILN_PREWAIT=all; } | tee "$OUT/latency_summary.txt"
stamp latency
python bench/gpu/bundle.py "$OUT" "$DEST/s13a.json" "bash bench/gpu/run_s13a.sh OUT (commit: ${KILN_COMMIT:-see bench/results/README.md})"
cat "$OUT/step_summary.txt" "$OUT/latency_summary.txt"
