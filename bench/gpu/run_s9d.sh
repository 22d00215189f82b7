#!/bin/bash
# Ninth session, fourth GPU call (issue 9), with folded norms now the compile default:
# 1. the decode-step bench, folded (default) vs unfolded, Qwen3-30B-A3B- and Llama-3.1-8B-shaped
#    (16 layers), batch 1 and 8: the dense family's first measurement of the fold;
# 2. the bf16 end-to-end GPU tests against HF (tests/runtime/test_gpu_e2e.py: logits, CUDA-graph
#    replay equals eager, loading compiles no Triton kernel, overlapped decoding), now folded;
# 3. the routing kernels' GPU tests (the eighth session's shared _softmax/_scale_round).
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s9d.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
(cd bench && timeout 150 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider \
  -k "default or unfolded" --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
tail -1 "$OUT/decode_step.log"
bench_summary "$OUT/decode_step.json"
gpu_tests e2e.log 180 tests/runtime/test_gpu_e2e.py -v
gpu_tests routing.log 90 tests/ops/test_moe_routing.py -v
for f in e2e routing; do echo "== $f"; grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/$f.log" | tail -12; done
