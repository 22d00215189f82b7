#!/bin/bash
# Written at the end of the ninth session for the next one's first GPU call (issue 9).
# 1. GPU tests of the code changed after the ninth session's last GPU run: the residual epilogues
#    and the folded norm (the shared tl_add_row, strided residuals), the load-time fold on CUDA,
#    then the bf16 end-to-end tests of a folded artifact (tests/runtime/test_gpu_e2e.py);
# 2. the batch-1 kernels cross-checked by the step bench (both presets, default);
# Then, in a call of its own, `bash bench/gpu/run_s8e.sh OUT`: the defaults beside Hugging Face (L16
# decode at batch 1 / 8 / 64, 200-prompt throughput), which README's MoE figures should then quote.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s10a.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
gpu_tests tests.log 240 tests/ops/test_gemv.py tests/ops/test_norm_linear.py tests/ops/test_moe_gemm.py \
  tests/compiler/test_fold_norms.py tests/runtime/test_gpu_e2e.py -k "residual or folded or fold or e2e or logits or replay"
tail -c 400 "$OUT/tests.log"; echo
(cd bench && timeout 90 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider -k default \
  --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
bench_summary "$OUT/decode_step.json"
