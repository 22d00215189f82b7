#!/bin/bash
# A record: it ran at commit c82bdd0; check that commit out to rerun it
# (the packed-key top-k was reverted after it, and its variants renamed).
# Tenth session, second GPU call (issue 9): the top-k by packed keys (default now; topk_3red is the
# old selection) and the rope inside decode attention (KILN_ROPE_IN_ATTN=1, rope_attn) in the step
# bench, then their GPU tests and the bf16 end-to-end tests.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s10b.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
(cd bench && timeout 200 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider \
  -k "1-default or 1-topk_3red or 1-rope_attn or 8-default or 8-topk_3red" \
  --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
tail -1 "$OUT/decode_step.log"
bench_summary "$OUT/decode_step.json"
gpu_tests tests.log 300 tests/ops/test_decode_rope.py tests/ops/test_moe_routing.py tests/ops/test_moe_route.py \
  tests/ops/test_decode_attention.py tests/compiler/test_fold_norms.py tests/runtime/test_gpu_e2e.py
