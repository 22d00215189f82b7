#!/bin/bash
# Ninth session, second GPU call (issue 9): the residual-stream layout with folded norms
# (KILN_FOLD_NORMS). GPU tests of the new epilogues (GEMV residual, MoE residual, folded norm) and of
# the eighth session's unverified MoE changes, then the decode-step bench (default vs fold, b1 / b8).
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s9b.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
gpu_tests tests.log 300 tests/ops/test_gemv.py tests/ops/test_norm_linear.py tests/ops/test_moe_gemm.py \
  tests/ops/test_moe_routed.py tests/ops/test_moe_routing.py --maxfail=6 \
  -k "residual or folded or replay or routing or gpu_gemv_variants or gpu_fused_moe or gpu_matches_reference"
tail -3 "$OUT/tests.log"
(cd bench && timeout 200 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider \
  -k "default or fold or norm" --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
tail -2 "$OUT/decode_step.log"
bench_summary "$OUT/decode_step.json"
