#!/bin/bash
# Sixth session, GPU call 5: Llama-3.1-8B-shaped --quant fp8 with this session's FP8 paths (the FP8
# GEMV with its measured table at M <= 2, the CUTLASS FP8 GEMM at M 65..1024) against cuBLAS for
# every FP8 product (KILN_FP8_GEMM=cublas), same artifact; after the FP8 GEMV's GPU tests.
# Usage (repo root, carry bench/cutlass_probe/out): bash bench/gpu/run_s6e.sh OUT   (3 files)
source bench/gpu/s6_env.sh "$1"
timeout 90 python -m pytest -q -m gpu tests/ops/test_gemv_fp8.py -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -4
fp8_compile 120
for be in auto cublas; do
  KILN_FP8_GEMM=$be timeout 90 python -m kiln bench latency $ART --batch-sizes 1,2,8,128,256 --input-len 512 \
    --output-len 48 --kv-memory 40 --json "$OUT/fp8_latency_$be.json" 2>&1 | grep -v "it/s\]" | tail -5
done
