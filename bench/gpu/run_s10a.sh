#!/bin/bash
# A record: it ran at commit 66d45df; check that commit out to rerun it
# (the L2 prefetch code it measures was removed after this run).
# Tenth session, first GPU call (issue 9):
# 1. bench/gpu/l2_prefetch_probe.py: does the sm_90 bulk L2 prefetch (ops/l2_prefetch.py) make a
#    later GEMV read from L2, how many programs it needs, and whether the lines survive a stream;
# 2. the step bench at batch 1, both presets: default vs the rope kernel prefetching the o (and
#    router) weights during the attention (KILN_L2_PREFETCH=1, 4 / 16 / 64 programs);
# 3. GPU tests of the code changed after the ninth session's last GPU run (the shared tl_add_row,
#    strided residuals, the load-time fold on CUDA, the bf16 end-to-end tests of a folded artifact)
#    and of the prefetch.
# Usage on the GPU machine, from the repo root: bash bench/gpu/run_s10a.sh OUTDIR
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
source bench/gpu/moe_l16.sh
timeout 100 python bench/gpu/l2_prefetch_probe.py --json "$OUT/l2_prefetch_probe.json" > "$OUT/probe.log" 2>&1
tail -40 "$OUT/probe.log" | grep -E "^(case|cold|warm|pf|evict)" | tr '\n' ';'; echo
(cd bench && timeout 150 python -m pytest -q test_bench_decode_step.py -p no:cacheprovider \
  -k "1-default or 1-prefetch" --benchmark-json="$OUT/decode_step.json" > "$OUT/decode_step.log" 2>&1)
tail -1 "$OUT/decode_step.log"
bench_summary "$OUT/decode_step.json"
gpu_tests tests.log 270 -v tests/ops/test_l2_prefetch.py tests/ops/test_qkv_rope.py tests/ops/test_gemv.py \
  tests/ops/test_norm_linear.py tests/ops/test_moe_gemm.py tests/compiler/test_fold_norms.py \
  tests/runtime/test_gpu_e2e.py -k "prefetch or residual or folded or fold or e2e or logits or replay"
grep -cE "PASSED" "$OUT/tests.log"; grep -E "FAILED|ERROR" "$OUT/tests.log" | head -5
