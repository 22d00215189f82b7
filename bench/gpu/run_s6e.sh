#!/bin/bash
# Sixth session, GPU call 5: Llama-3.1-8B-shaped --quant fp8 with this session's FP8 paths (the FP8
# GEMV with its measured table at M <= 2, the CUTLASS FP8 GEMM at M 65..1024) against cuBLAS for
# every FP8 product (KILN_FP8_GEMM=cublas), same artifact; after the FP8 GEMV's GPU tests.
# Usage (repo root, carry bench/cutlass_probe/out): bash bench/gpu/run_s6e.sh OUT   (3 files)
set -o pipefail
OUT=${1:-/tmp/out}; mkdir -p "$OUT"
source bench/gpu/env.sh
export KILN_CUTLASS_FP8_LIB=$PWD/bench/cutlass_probe/out/kiln/cutlass_fp8_sm90.so
CK=/tmp/ckpt-llama8b; ART=/tmp/art-llama8b-fp8
python bench/make_checkpoint.py --preset llama-3.1-8b -o $CK > /dev/null 2>&1 &
PCK=$!
timeout 90 python -m pytest -q -m gpu tests/ops/test_gemv_fp8.py -p no:cacheprovider -rf > "$OUT/tests.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tests.log" | tail -4
wait $PCK
timeout 120 python -m kiln compile $CK -o $ART --quant fp8 --force 2>&1 | tail -1
for be in auto cublas; do
  KILN_FP8_GEMM=$be timeout 90 python -m kiln bench latency $ART --batch-sizes 1,2,8,128,256 --input-len 512 \
    --output-len 48 --kv-memory 40 --json "$OUT/fp8_latency_$be.json" 2>&1 | grep -v "it/s\]" | tail -5
done
