#!/bin/bash
# Sixth session, GPU call 6: CUTLASS FP8 GEMM above 1024 tokens (BUCKET_DEFAULTS[inf]) end to end:
# tests/ops/test_fp8_cutlass.py on the GPU, then Llama-3.1-8B-shaped --quant fp8 prefill-heavy
# throughput (200 prompts x 1024 tokens, 16 out: 4096-token chunks) with KILN_FP8_GEMM=auto vs cublas.
# Usage (repo root, carry bench/cutlass_probe/out): bash bench/gpu/run_s6f.sh OUT   (3 files)
source bench/gpu/s6_env.sh "$1"
timeout 40 python -m pytest -q -m gpu tests/ops/test_fp8_cutlass.py -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -4
fp8_compile 100
for be in auto cublas; do
  KILN_FP8_GEMM=$be timeout 40 python -m kiln bench throughput $ART --num-prompts 200 --input-len 1024 \
    --output-len 16 --json "$OUT/fp8_throughput_$be.json" 2>&1 | tail -1
done
