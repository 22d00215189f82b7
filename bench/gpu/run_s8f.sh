#!/bin/bash
# Written at the end of the eighth session for the next one's first GPU call (issue 9): where a
# batch-1 decode step of Qwen3-30B-A3B-shaped (16 layers) really spends its time. The profile's
# per-kernel sums include each kernel's PDL wait (it starts before its predecessor ends), which is
# why the eighth session's fusions looked like wins in chains and were not end to end. So: the
# step's first 24 kernels (one layer and a half) in launch order with PDL on and off, both
# profiles, and decode with PDL on and off on one artifact.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s8f.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
moe_checkpoint
moe_compile
moe_latency pdl_on ""
moe_latency pdl_off "" KILN_PDL=0
for v in 1 0; do
  KILN_PDL=$v timeout 80 python bench/gpu/profile_decode.py $MART --batch-sizes 1 --sequence 24 \
    --json "$OUT/moe_profile_pdl$v.json" > "$OUT/moe_profile_pdl$v.txt" 2>&1
  echo "== KILN_PDL=$v"; tail -26 "$OUT/moe_profile_pdl$v.txt"
done
