#!/bin/bash
# Written at the end of the eighth session for the next one's first GPU call (issue 9).
# 1. Without a checkpoint: bench/test_bench_decode_step.py, the model definition's decode step on
#    random weights in one CUDA graph (Qwen3-30B-A3B-shaped, 16 layers, batch 1 and 8), default
#    against the opt-in switches (norm role, early w2, top-k in the w13 GEMV) and PDL / GEMV off. It should agree with
#    `kiln bench latency` (ITL 1.04 ms at batch 1) before it replaces it for A/B runs.
# 2. On a compiled artifact: decode with PDL on and off, and the batch-1 step's first 24 kernels in
#    launch order (profile_decode.py --sequence; the eighth session's copy of this profile is
#    bench/results/2026-11-30_h200_s8g_profile_sequence.json).
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s8f.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
gpu_tests tests.log 150 tests/ops/test_moe_routed.py tests/ops/test_moe_routing.py tests/ops/test_moe_gemm.py -k "routing or replay or gpu"
(cd bench && timeout 240 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider \
  --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
bench_summary "$OUT/decode_step.json"
moe_checkpoint
moe_compile
moe_latency pdl_on ""
moe_latency pdl_off "" KILN_PDL=0
for v in 1 0; do
  KILN_PDL=$v timeout 80 python bench/gpu/profile_decode.py $MART --batch-sizes 1 --sequence 24 \
    --json "$OUT/moe_profile_pdl$v.json" > "$OUT/moe_profile_pdl$v.txt" 2>&1
  echo "== KILN_PDL=$v"; tail -26 "$OUT/moe_profile_pdl$v.txt"
done
